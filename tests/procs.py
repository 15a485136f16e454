"""What a test can see of the processes a command started: a watcher of its process tree, and a wait for them all
to be gone once it ended.

The jobs `brigade local` starts are named in its summary (`processes`: job, pid, exit code), which is what the
tests assert on first. Their descendants that `brigade local` does not know (vLLM's engine under a replica's
sidecar, a rollout worker's reward pool) are visible only in /proc, so a watcher samples the tree while the
command runs. A process is known by its pid *and* its start time (a reused pid is another process), and keeps the
first non-empty command line read for it: /proc/<pid>/cmdline reads empty while a process exits, which must not
erase what it was (a rehearsal read a replica sidecar's as '' on its last sample and missed it).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Proc:
    ppid: int
    state: str
    start: int  # clock ticks after boot: with the pid, one process
    cmd: str


def processes() -> dict[int, Proc]:
    """Every process on the machine by pid."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # the command name in (...) may hold spaces
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        # after ')': state is field 3 of stat(5), ppid 4, starttime 22
        out[int(name)] = Proc(int(fields[1]), fields[0], int(fields[19]), cmd)
    return out


def descendants(root: int, procs: dict[int, Proc] | None = None) -> dict[int, Proc]:
    procs = processes() if procs is None else procs
    found: dict[int, Proc] = {}
    frontier = [root]
    while frontier:
        parent = frontier.pop()
        for pid, p in procs.items():
            if p.ppid == parent and pid not in found:
                found[pid] = p
                frontier.append(pid)
    return found


class ProcessTree:
    """The processes seen under `root` while it runs, sampled by `sample()`."""

    def __init__(self, root: int) -> None:
        self.root = root
        self.seen: dict[int, Proc] = {}

    def sample(self) -> None:
        for pid, p in descendants(self.root).items():
            before = self.seen.get(pid)
            if before is None or before.start != p.start or (not before.cmd and p.cmd):
                self.seen[pid] = p

    def commands(self) -> list[str]:
        return [p.cmd for p in self.seen.values()]

    def kinds_seen(self, kinds: set[str]) -> set[str]:
        return {k for k in kinds if any(k in c for c in self.commands())}

    def alive(self) -> dict[int, str]:
        """Those seen that still run (the same pid and start time, not a zombie)."""
        now = processes()
        return {
            pid: p.cmd
            for pid, p in self.seen.items()
            if pid in now and now[pid].start == p.start and now[pid].state != "Z"
        }


def alive_with(text: str) -> dict[int, str]:
    """Live processes whose command line holds `text` (a run's folder: found even if reparented before a sample)."""
    return {pid: p.cmd for pid, p in processes().items() if text in p.cmd and p.state != "Z"}


def left_behind(tree: ProcessTree, marker: str, pids: list[int] = (), timeout_s: float = 30) -> dict[int, str]:
    """What still runs of a command that has ended: its sampled tree, processes naming `marker`, and `pids` (the
    process groups it recorded). Waits up to `timeout_s` for processes killed last to finish exiting (the
    command's exit may precede the kernel's teardown of a SIGKILLed grandchild); what is left then leaked."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = processes()
        groups = {pid: p.cmd for pid, p in now.items() if p.state != "Z" and _pgid(pid) in set(pids)}
        left = tree.alive() | alive_with(marker) | groups
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None
