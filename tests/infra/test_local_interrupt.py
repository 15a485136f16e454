"""Ctrl-C on `brigade local` on a terminal, and its wall limit: nothing the run started survives, and the summary
of what the bucket holds is still written, saying what cut the run.

`brigade local` runs in a pseudo-terminal of its own (so stdout is a TTY and it draws its rich live view)
and in a process group of its own, which gets SIGINT as a terminal's Ctrl-C sends it, once the trainer has
published its first version. Every process that descended from it while it ran (the replica sidecar,
vLLM and its engine, the proxy, the rollout worker and its reward pool, the trainer) must be gone.
"""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import signal
import struct
import subprocess
import termios
import threading
import time

from bucket import adapters
from bucket.store import Store
from infra.s3server import listen_ports
from tests.helpers import REPO_ROOT, brigade_local, free_port, host_timeout
from tests.procs import ProcessTree, left_behind


class _Terminal:
    """A pseudo-terminal whose output is drained by a thread (a full pty would block the writer)."""

    def __init__(self) -> None:
        self.master, self.slave = pty.openpty()
        fcntl.ioctl(self.slave, termios.TIOCSWINSZ, struct.pack("HHHH", 60, 160, 0, 0))
        self.chunks: list[bytes] = []
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        while True:
            try:
                data = os.read(self.master, 65536)
            except OSError:
                return
            if not data:
                return
            self.chunks.append(data)

    def close(self) -> None:
        os.close(self.slave)
        os.close(self.master)  # ends the draining thread's read

    def text(self) -> str:
        return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", b"".join(self.chunks).decode(errors="replace"))


def test_ctrl_c_leaves_no_process_behind(tmp_path, model_dir):
    bucket = tmp_path / "bucket"
    proxy_port = free_port()
    cmd = brigade_local(
        str(bucket),
        model_dir,
        "--local.num-replicas",
        "1",
        "--run.num-generations",
        "4",
        "--trainer.max-steps",
        "100",  # still training when interrupted
        "--trainer.groups-per-step",
        "2",
        "--rollout.max-completion-length",
        "8",
        # The base's evaluation is cut by its bound (200 prompts cannot all be answered in 3 s): recorded as
        # partial, which the summary names and never reports as the base's accuracy.
        "--rollout.eval-size",
        "200",
        "--rollout.eval-timeout-s",
        "3",
        "--rollout.eval-every-versions",
        "0",
        "--proxy.port",
        str(proxy_port),
        "--rollout.proxy-url",
        f"http://127.0.0.1:{proxy_port}",
        "--local.base-port",
        str(listen_ports(2)),
        "--trainer.metrics-port",
        str(free_port()),
        "--rollout.metrics-port",
        str(free_port()),
        "--local.max-wall-s",
        str(host_timeout(600)),
    )
    term = _Terminal()
    # Started with SIGINT ignored, as a non-interactive shell starts a background job (a script's `&`, a CI
    # runner): Python keeps an inherited SIG_IGN, so unless brigade local sets its own handler, Ctrl-C does
    # nothing and the run trains on to its end. Set here so the test does not depend on how pytest was started.
    ignoring = ["/bin/sh", "-c", 'trap "" INT; exec "$@"', "sh", *cmd]
    proc = subprocess.Popen(
        ignoring, cwd=REPO_ROOT, stdin=term.slave, stdout=term.slave, stderr=term.slave, start_new_session=True
    )
    tree = ProcessTree(proc.pid)
    store = Store(str(bucket))
    try:
        deadline = time.monotonic() + host_timeout(480)
        published_at = None
        # until v1 is out and the live view has drawn it (the loop redraws every 2 s)
        while published_at is None or time.monotonic() < published_at + 6:
            assert proc.poll() is None, term.text()[-4000:]
            late = f"no adapter version published within {host_timeout(480):.0f} s:\n"
            assert time.monotonic() < deadline, late + term.text()[-4000:]
            tree.sample()
            if published_at is None and store.exists("run.json") and (adapters.latest_version(store) or 0) >= 1:
                published_at = time.monotonic()
            time.sleep(0.5)
        tree.sample()
        # vLLM runs under its sidecar, unknown to brigade local's record: seen in the tree (it runs for minutes)
        assert tree.kinds_seen({"vllm.entrypoints"}), tree.seen

        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C does: the terminal's foreground process group
        assert proc.wait(240) == 130, term.text()[-4000:]
    finally:
        if proc.poll() is None:  # the test failed: leave nothing running either way
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(240)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        term.close()
    summary = json.loads((tmp_path / "summary.json").read_text())
    # what brigade local itself records of the jobs it started: every job ran, and each was stopped
    jobs = {p["job"]: p for p in summary["processes"]}
    assert set(jobs) == {"replica-0", "proxy", "rollout", "trainer"}, summary["processes"]
    assert all(p["exit_code"] is not None for p in jobs.values()), summary["processes"]
    # none of them, nothing seen under them, nothing naming the run's folder outlived the run
    left = left_behind(tree, str(tmp_path), [p["pid"] for p in jobs.values()])
    assert not left, left

    shown = term.text()
    # the live view: the dashboard's panels, redrawn while the run went on
    assert "in a browser: brigade dashboard --bucket" in shown
    for text in ("versions", "last sync", "reward", "replica-0"):
        assert text in shown, (text, shown[-4000:])

    # the summary, written after every job stopped, from what the bucket holds; it says the run was interrupted
    assert summary["cut"] == "interrupted" and summary["adapter_versions"] >= 1, summary
    assert summary["cut_note"].startswith("interrupted (Ctrl-C or SIGTERM) after "), summary["cut_note"]
    assert "summary written to" in shown and summary["cut_note"] in shown.replace("\r\n", "\n"), shown[-4000:]
    cut = [c for c in summary["evaluations_cut"] if c["version"] == 0]
    assert cut and cut[0]["cut"] == "timeout" and cut[0]["planned"] == 200 and cut[0]["judged"] < 200, summary
    assert summary["base_accuracy"] is None  # a partial evaluation is not the base's accuracy


def test_the_wall_limit_stops_everything_and_still_writes_the_summary(tmp_path, model_dir):
    """Cut while its replica is still starting (or, on a machine fast enough, training): whenever the wall limit
    falls, every job is stopped and the summary is written with the cut named, exit code 1."""
    bucket = tmp_path / "bucket"
    proxy_port = free_port()
    max_wall_s = 40  # the jobs are stopped at 20 s (the shutdown grace is at most half of the limit)
    cmd = brigade_local(
        str(bucket),
        model_dir,
        *("--local.num-replicas", "1", "--trainer.max-steps", "100", "--local.max-wall-s", str(max_wall_s)),
        *("--proxy.port", str(proxy_port), "--rollout.proxy-url", f"http://127.0.0.1:{proxy_port}"),
        *("--local.base-port", str(listen_ports(2)), "--trainer.metrics-port", str(free_port())),
        *("--rollout.metrics-port", str(free_port())),
    )
    out = tmp_path / "out.txt"
    with open(out, "wb") as f:
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    tree = ProcessTree(proc.pid)
    try:
        deadline = time.monotonic() + max_wall_s + 300  # stopping a replica may take its 60 s grace
        while proc.poll() is None:
            assert time.monotonic() < deadline, out.read_text()[-4000:]
            tree.sample()
            time.sleep(0.5)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            proc.wait(240)
    text = out.read_text()
    assert proc.returncode == 1, text[-4000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    # it got as far as starting the jobs (its own record, whenever the limit fell), and stopped each
    jobs = {p["job"]: p for p in summary["processes"]}
    assert "replica-0" in jobs and all(p["exit_code"] is not None for p in jobs.values()), summary["processes"]
    left = left_behind(tree, str(tmp_path), [p["pid"] for p in jobs.values()])
    assert not left, left

    assert summary["cut"] == "wall_limit", summary
    assert summary["cut_note"].startswith(f"cut at the wall limit of {max_wall_s} s after "), summary["cut_note"]
    assert summary["wall_s"] < max_wall_s + 90  # stopped in time: the grace before the limit, then the stop
    assert set(summary["cpu"]["cpu_flags"]) >= {"avx2", "avx512f", "avx512_bf16", "amx_bf16"}
    # printed: the CPU line first, the error, then the summary naming the cut
    assert any(line.startswith("CPU ") for line in text.splitlines()[:5]), text[:500]
    assert "--local.max-wall-s 40s" in text and summary["cut_note"] in text and "summary written to" in text, text
