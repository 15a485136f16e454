"""jobkit/processes.py: a child that leaves on SIGTERM is waited for, one that ignores it is killed."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from jobkit.processes import stop_process, stop_processes

# Prints once its SIGTERM handler is set, so the test never signals it before that.
IGNORES_TERM = (
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(60)"
)


def test_a_process_that_leaves_on_sigterm_is_waited_for_and_its_status_returned():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    assert stop_process(proc, timeout_s=10) == -signal.SIGTERM
    assert stop_process(proc) == -signal.SIGTERM  # already ended: left as it is
    assert stop_process(None) is None


def test_one_that_ignores_sigterm_is_killed_after_the_grace_period():
    procs = [
        subprocess.Popen([sys.executable, "-c", IGNORES_TERM], stdout=subprocess.PIPE, text=True) for _ in range(2)
    ]
    for proc in procs:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    t0 = time.monotonic()
    stop_processes(procs, timeout_s=0.5)
    assert [p.returncode for p in procs] == [-signal.SIGKILL, -signal.SIGKILL]
    assert time.monotonic() - t0 < 10
