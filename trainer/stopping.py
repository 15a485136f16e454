"""Stopping the trainer on SIGTERM or SIGINT without leaving the bucket half-written.

The first signal only sets a flag (`StopRequest`); the training loop reads it between its moves: a step in
flight is finished, a publish in flight completes through adapters/LATEST.json and trainer/LATEST.json, the
steps trained since the last version are published, and the job exits 0 with a `trainer_stopped` event. A
wait for rollouts is abandoned at once (nothing of a step has been written then). A second signal raises
KeyboardInterrupt wherever the trainer is (exit 130): the bucket may then hold a version committed but not
announced, which the next start announces and resumes from (`bucket.checkpoints.finish_publish`).

Only the main rank's flag decides, in data parallelism: the other ranks stop when it sends them no batch
(trainer/main.py), so no rank is left waiting in a collective for one that already left.

Test hook, never set in a real run: BRIGADE_TEST_HOLD_PUBLISH=<version> makes the publish of that version
wait, after its COMMITTED.json and before adapters/LATEST.json, until the trainer is asked to stop. It exists
because that window is a few milliseconds of bucket writes: a test can only place a signal inside it if the
trainer holds there (tests/trainer/test_trainer_stop.py).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

log = logging.getLogger("brigade.trainer")

HOLD_PUBLISH_ENV = "BRIGADE_TEST_HOLD_PUBLISH"
SIGNALS = (signal.SIGTERM, signal.SIGINT)
_TICK_S = 0.05  # how often a wait looks at the flag: the handler only sets attributes (no lock taken in it)


class StopRequest:
    """Whether the job was asked to stop, by which signal, and what the trainer was doing then.

    `doing` is set by the training loop ("starting", "waiting for rollouts", "step 7", "publishing");
    the first signal copies it into `interrupted`, which the `trainer_stopped` event reports.
    """

    def __init__(self) -> None:
        self.signal: str | None = None
        self.at: float | None = None  # time.monotonic() of the first signal
        self.doing = "starting"
        self.interrupted: str | None = None

    @property
    def requested(self) -> bool:
        return self.signal is not None

    def request(self, name: str) -> None:
        # Plain attribute writes only: this runs in a signal handler, which may interrupt any code (a lock
        # held by the very code it interrupted would deadlock it).
        if self.signal is None:
            self.interrupted, self.at, self.signal = self.doing, time.monotonic(), name

    def wait(self, timeout_s: float) -> bool:
        """Sleep up to `timeout_s`, returning early (True) once a stop is requested."""
        deadline = time.monotonic() + timeout_s
        while not self.requested:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(_TICK_S, left))
        return True


@contextmanager
def stop_on_signals(stop: StopRequest | None = None) -> Iterator[StopRequest]:
    """SIGTERM and SIGINT set `stop` (the first) or abort at once (the second) while the block runs.

    The handlers are installed only in the main thread (Python allows no other); the previous ones are put
    back on leaving, so an in-process caller (a test) gets its own Ctrl-C back.
    """
    stop = stop or StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return

    def handle(signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if stop.requested:
            raise KeyboardInterrupt(f"second stop signal ({name})")
        stop.request(name)
        # os.write, not logging: a handler that interrupted a write to stderr must not write through it again
        now = time.strftime("%Y-%m-%d %H:%M:%S")
        line = f"{now} INFO {log.name}: {name} while {stop.doing}: finishing it, then stopping (again: abort now)\n"
        os.write(2, line.encode())

    previous = {sig: signal.signal(sig, handle) for sig in SIGNALS}
    try:
        yield stop
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def hold_publish(version: int, stop: StopRequest) -> None:
    """The test hook (module docstring): hold between the commit and the announcement of `version`."""
    if os.environ.get(HOLD_PUBLISH_ENV, "") != str(int(version)):
        return
    log.warning("%s=%s: holding the publish after its commit until a stop is requested", HOLD_PUBLISH_ENV, version)
    while not stop.wait(3600):
        pass
