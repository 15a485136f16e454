"""Stopping a child process: SIGTERM, a grace period for it to leave cleanly, then SIGKILL.

Every launcher, benchmark and test that starts a job stops it this way (a replica's sidecar drains and
deregisters on SIGTERM, a rollout worker detaches from its pool); one place for it, so none forgets the wait.
"""

from __future__ import annotations

import subprocess


def stop_process(proc: subprocess.Popen | None, timeout_s: float = 30.0) -> int | None:
    """SIGTERM `proc` and wait `timeout_s` for it to end, SIGKILL after that; its exit status (None: no process).

    A process that already ended is left as it is."""
    if proc is None:
        return None
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def stop_processes(procs: list[subprocess.Popen], timeout_s: float = 60.0) -> None:
    """SIGTERM every process at once (replicas drain in parallel), then wait for each, SIGKILL after
    `timeout_s` of that wait."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        stop_process(proc, timeout_s)
