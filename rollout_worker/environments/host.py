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
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

from rollout_worker.environments import contract
from rollout_worker.environments.contract import EnvError
from rollout_worker.environments.env_vars import environment_of
from rollout_worker.environments.schema import EnvSpecError

log = logging.getLogger("brigade.rollout")

START_TIMEOUT_S = 60.0  # a new process imports the environment's module before its first answer


# -- the environment's process --------------------------------------------------------------------------


async def _awaited(aw: Any) -> Any:
    return await aw


class _Served:
    """The process's side: one instance at a time, made by `create`, called by name.

    Async methods (TRL allows async tools and get_reward; OpenEnv's client is async throughout) run on ONE event
    loop that lives as long as the process: a client that opened a connection (a WebSocket) in `reset` finds its
    loop still running in `step`. A fresh loop per call (asyncio.run) would close the connection's loop after
    the first call and break every later one."""

    def __init__(self) -> None:
        self.factories: dict[str, Any] = {}
        self.env: Any = None
        self.kind = ""
        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)

    def _maybe_await(self, value: Any) -> Any:
        return self.loop.run_until_complete(_awaited(value)) if inspect.isawaitable(value) else value

    def create(self, spec: str) -> dict[str, Any]:
        if spec not in self.factories:
            self.factories[spec] = contract.import_factory(spec)
        self.env = self._maybe_await(self.factories[spec]())
        d = contract.describe(self.env)
        self.kind = d.kind
        return {"kind": d.kind, "tools": d.tools, "has_reward": d.has_reward}

    def check(self, spec: str) -> None:
        """A library's environment named at start (`textarena:GAME`, ...): its id exists, it is single-player;
        raises with what is wrong. Run here, not in the worker: it imports the library and makes one instance."""
        from rollout_worker.environments.libraries import check_spec

        self._maybe_await(check_spec(spec))

    def reset(self, row: dict[str, Any]) -> Any:
        return self._maybe_await(self.env.reset(**row))

    def step(self, action: str) -> Any:
        return self._maybe_await(self.env.step(action))

    def tool(self, name: str, arguments: dict[str, Any]) -> str:
        """A tool's result as the tool message's text; an error (as TRL does) when it raises or is no tool."""
        fn = contract.tool_methods(self.env).get(name)
        if fn is None:
            return str({"error": f"Tool {name} not found."})
        try:
            result = self._maybe_await(fn(**arguments))
        except Exception as exc:  # noqa: BLE001 - the model's call was wrong, or the tool broke: the model is told
            return str({"error": f"{type(exc).__name__}: {exc}"})
        return str(result)

    def get_reward(self) -> Any:
        return self._maybe_await(self.env.get_reward())

    def snapshot(self) -> bytes | None:
        """The instance pickled, for reward functions' `environments=`; None when it cannot be pickled."""
        try:
            return pickle.dumps(self.env)
        except Exception:  # noqa: BLE001 - sockets, locks, ...: the reward function gets None for it
            return None

    def close(self) -> None:
        """The episode is over. A text-step instance's own `close()` (gymnasium's, skyrl-gym's, a library
        adapter's: it ends a connection) is called; TRL's contract has none (a public `close` is a tool there)."""
        env, self.env = self.env, None
        closer = getattr(env, "close", None) if self.kind == contract.STEP else None
        if callable(closer):
            try:
                self._maybe_await(closer())
            except Exception as exc:  # noqa: BLE001 - the episode is written already; the next one gets a new instance
                log.warning("the environment's close() raised %s: %s", type(exc).__name__, exc)


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
        except EnvSpecError as exc:  # a setting brigade refuses (check, create): its message says what to do
            answer = ("error", str(exc))
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

    def __init__(self, passed_env: Sequence[str] = ()) -> None:
        parent, child = socket.socketpair()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rollout_worker.environments.host", str(child.fileno())],
            pass_fds=[child.fileno()],
            stdin=subprocess.DEVNULL,
            # only the allowlist (env_vars.py): never the bucket's credentials or the pool token
            env=environment_of(passed_env, os.pathsep.join(p for p in sys.path if p)),
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


def check_in_process(spec: str, passed_env: Sequence[str] = (), timeout_s: float = START_TIMEOUT_S) -> None:
    """`_Served.check` in a process of its own, waited for here (the worker's start, before any episode): EnvError
    with the library's reason when the named environment cannot run."""
    proc = EnvProcess(passed_env)
    try:
        proc.conn.send(("check", (spec,)))
        if not proc.conn.poll(timeout_s):
            raise EnvError(f"checking --rollout.environment {spec!r} took over {timeout_s:g} s")
        status, value = proc.conn.recv()
    except (EOFError, OSError) as exc:
        raise EnvError(f"the process checking {spec!r} died (exit code {proc.proc.poll()}: {exc!r})") from None
    finally:
        proc.kill()
    if status != "ok":
        raise EnvError(str(value))


class EnvHosts:
    """Processes for episodes: one per episode in flight, idle ones kept for the next (start-up is not free)."""

    def __init__(self, max_idle: int, passed_env: Sequence[str] = ()):
        self.max_idle = max_idle
        self.passed_env = tuple(passed_env)  # --rollout.environment-env: names added to the allowlist
        self.idle: list[EnvProcess] = []
        self.busy: set[EnvProcess] = set()
        self.started = 0  # processes started (metrics, tests)
        self.killed = 0  # killed after a hang or a death

    def acquire(self) -> EnvProcess:
        proc = self.idle.pop() if self.idle else None
        if proc is None or proc.proc.poll() is not None:
            proc = EnvProcess(self.passed_env)
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
