"""Each episode's environment in a process of its own, off the worker's event loop.

An instance holds state across an episode's turns, so one episode lives in one process from `reset` to its
end: `EnvHosts.acquire()` hands an episode a process of its own (an idle one, else a new one), the episode calls
into it, and `release()` returns it for another episode. A call gets `timeout_s`: one that outlives it, or a
process that dies, ends that episode (EnvError) and the process is killed, never reused; every other episode has
a process of its own and goes on. The worker itself never runs environment code.

The process is `python -m rollout_worker.environments.host FD`, which imports this module and the user's
environment module and nothing of the worker (a spawned multiprocessing child would import the worker's main
module too). Calls and answers are pickled over a socket pair (multiprocessing's Connection): the worker waits
for an answer with the event loop's reader on the socket, so a thousand waiting episodes cost no threads.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

from rollout_worker.environments import contract
from rollout_worker.environments.contract import EnvError

log = logging.getLogger("brigade.rollout")

START_TIMEOUT_S = 60.0  # a new process imports the environment's module before its first answer


# -- the environment's process --------------------------------------------------------------------------


def _maybe_await(value: Any) -> Any:
    """TRL allows async tools and an async get_reward: run them to completion here."""
    return asyncio.run(_awaited(value)) if inspect.isawaitable(value) else value


async def _awaited(aw: Any) -> Any:
    return await aw


class _Served:
    """The process's side: one instance at a time, made by `create`, called by name."""

    def __init__(self) -> None:
        self.factories: dict[str, Any] = {}
        self.env: Any = None

    def create(self, spec: str) -> dict[str, Any]:
        if spec not in self.factories:
            self.factories[spec] = contract.import_factory(spec)
        self.env = self.factories[spec]()
        d = contract.describe(self.env)
        return {"kind": d.kind, "tools": d.tools, "has_reward": d.has_reward}

    def reset(self, row: dict[str, Any]) -> Any:
        return _maybe_await(self.env.reset(**row))

    def step(self, action: str) -> Any:
        return _maybe_await(self.env.step(action))

    def tool(self, name: str, arguments: dict[str, Any]) -> str:
        """A tool's result as the tool message's text; an error (as TRL does) when it raises or is no tool."""
        fn = contract.tool_methods(self.env).get(name)
        if fn is None:
            return str({"error": f"Tool {name} not found."})
        try:
            result = _maybe_await(fn(**arguments))
        except Exception as exc:  # noqa: BLE001 - the model's call was wrong, or the tool broke: the model is told
            return str({"error": f"{type(exc).__name__}: {exc}"})
        return str(result)

    def get_reward(self) -> Any:
        return _maybe_await(self.env.get_reward())

    def snapshot(self) -> bytes | None:
        """The instance pickled, for reward functions' `environments=`; None when it cannot be pickled."""
        try:
            return pickle.dumps(self.env)
        except Exception:  # noqa: BLE001 - sockets, locks, ...: the reward function gets None for it
            return None

    def close(self) -> None:
        self.env = None


def serve(conn: Connection) -> None:
    """Answer calls until the worker closes the socket: ("ok", value) or ("error", text)."""
    served = _Served()
    while True:
        try:
            op, args = conn.recv()
        except (EOFError, OSError):
            return
        if op == "close":  # the episode is over: no answer, so releasing a process never waits on it
            served.close()
            continue
        try:
            answer: tuple[str, Any] = ("ok", getattr(served, op)(*args))
        except Exception as exc:  # noqa: BLE001 - any failure of the user's code is the episode's error
            last = traceback.extract_tb(exc.__traceback__)[-1:]
            where = f" ({last[0].filename}:{last[0].lineno})" if last else ""
            answer = ("error", f"{type(exc).__name__}: {exc}{where}")
        try:
            conn.send(answer)
        except (pickle.PicklingError, TypeError, AttributeError) as exc:
            conn.send(("error", f"{op} returned something that cannot be sent back ({type(exc).__name__}: {exc})"))
        except (BrokenPipeError, OSError):
            return


# -- the worker's side -------------------------------------------------------------------------------------


class EnvProcess:
    """One environment process, held by one episode at a time."""

    def __init__(self) -> None:
        parent, child = socket.socketpair()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rollout_worker.environments.host", str(child.fileno())],
            pass_fds=[child.fileno()],
            stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)},
        )
        child.close()
        self.conn = Connection(parent.detach())
        self.started = False  # the first answer also waits for the process's start-up
        self.dead = False

    async def call(self, op: str, *args: Any, timeout_s: float) -> Any:
        """One call; EnvError when the environment raised, outlived `timeout_s` or died (then it is killed)."""
        if self.dead:
            raise EnvError("the environment's process was killed")
        loop = asyncio.get_running_loop()
        ready = loop.create_future()
        fd = self.conn.fileno()
        try:
            self.conn.send((op, args))
            loop.add_reader(fd, lambda: ready.done() or ready.set_result(None))
            try:
                wait = timeout_s + (0.0 if self.started else START_TIMEOUT_S)
                await asyncio.wait_for(ready, wait)
            finally:
                loop.remove_reader(fd)
            status, value = self.conn.recv()
        except TimeoutError:
            self.kill()
            raise EnvError(
                f"{op} did not answer within {timeout_s:g} s (environment_timeout_s); its process was killed"
            ) from None
        except (EOFError, OSError) as exc:
            self.kill()
            raise EnvError(
                f"the environment's process died during {op} (exit code {self.proc.poll()}: {exc!r})"
            ) from None
        except BaseException:
            self.kill()  # cancelled mid-call: the answer would be read by the next episode
            raise
        self.started = True
        if status != "ok":
            raise EnvError(f"{op} raised {value}")
        return value

    def kill(self) -> None:
        if not self.dead:
            self.dead = True
            self.proc.kill()
            self.proc.wait()
            self.conn.close()

    def close(self) -> None:
        """Ends the process gently: it exits when its socket closes."""
        if not self.dead:
            self.dead = True
            self.conn.close()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class EnvHosts:
    """Processes for episodes: one per episode in flight, idle ones kept for the next (start-up is not free)."""

    def __init__(self, max_idle: int):
        self.max_idle = max_idle
        self.idle: list[EnvProcess] = []
        self.busy: set[EnvProcess] = set()
        self.started = 0  # processes started (metrics, tests)
        self.killed = 0  # killed after a hang or a death

    def acquire(self) -> EnvProcess:
        proc = self.idle.pop() if self.idle else None
        if proc is None or proc.proc.poll() is not None:
            proc = EnvProcess()
            self.started += 1
        self.busy.add(proc)
        return proc

    def release(self, proc: EnvProcess) -> None:
        """Back to the idle set, its instance dropped; a dead or surplus process is ended."""
        self.busy.discard(proc)
        if proc.dead:
            self.killed += 1
            return
        try:
            proc.conn.send(("close", ()))
        except OSError:
            proc.kill()
            self.killed += 1
            return
        if len(self.idle) < self.max_idle:
            self.idle.append(proc)
        else:
            proc.close()

    def close(self) -> None:
        for proc in [*self.idle, *self.busy]:
            proc.kill() if proc in self.busy else proc.close()
        self.idle.clear()
        self.busy.clear()


def _exit_with_parent(parent: int) -> None:
    """A worker killed outright (SIGKILL) cannot kill its environments: one stuck in a call would live on, so
    each process ends itself once its parent is gone (an idle one ends anyway, when its socket closes)."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(1)


if __name__ == "__main__":
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    serve(Connection(int(sys.argv[1])))
