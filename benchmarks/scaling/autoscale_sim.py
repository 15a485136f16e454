"""A simulated vLLM replica of fixed throughput, for benchmarks/scaling/autoscale.py.

It extends benchmarks/scaling/sync_simulated.py's `SimReplica` (loads, unloads, /v1/models and the canary probe as
vLLM 0.32 answers them) with what a rollout worker needs from a replica and what an autoscaling benchmark
measures:

* **generation at a fixed rate**: the replica decodes `tokens_per_s` tokens a second in all, shared equally by
  the sequences running (processor sharing), so its throughput is the same whatever its batch and the best
  fixed replica count can be computed from the rate alone (autoscale_figures.py);
* `/tokenize`: the worker tokenises prompts through the proxy; a deterministic made-up tokenisation (one id per
  character, a chat template around chat prompts) is enough, as nothing here reads the ids back as text;
* answers with `token_ids` and per-token logprobs, as the worker asks (`return_token_ids`, `logprobs`);
* a ledger of which replica served which prompt, and which requests a stopping replica cut, from which the
  benchmark counts split and lost groups;
* `alive()` and `requests()`, what replica/drain.py's `wait_drained` reads of a vLLM server, so a simulated
  replica drains with the sidecar's own code.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections import defaultdict
from typing import Any

import orjson

from benchmarks.scaling.sync_simulated import SimReplica, _error, _ServerConn

CHAT_HEAD = [1, 9690, 198]  # <|im_start|>user\n as SmolLM2's template starts a user turn
CHAT_TAIL = [2, 198, 1, 520, 9531, 198]  # <|im_end|>\n<|im_start|>assistant\n
PROBE_STEP_S = 0.005  # a canary probe's one step: control requests run beside generation (vLLM's control_seqs)


def fake_tokens(body: dict[str, Any]) -> list[int]:
    """Token ids for a /tokenize body: one per character (a prompt keeps its ids however often it is asked)."""
    if "messages" in body:
        text = "\n".join(str(m.get("content", "")) for m in body["messages"])
        return CHAT_HEAD + [300 + ord(c) % 30000 for c in text] + CHAT_TAIL
    return [300 + ord(c) % 30000 for c in str(body.get("prompt", ""))]


class Ledger:
    """What every simulated replica served, by prompt: a group is the requests that share its prompt."""

    def __init__(self) -> None:
        # prompt -> (replica, wall time) of each answer, and of each request a stopping replica cut
        self.served: dict[tuple[int, ...], list[tuple[str, float]]] = defaultdict(list)
        self.cut: dict[tuple[int, ...], list[tuple[str, float]]] = defaultdict(list)


class FixedRate:
    """One replica's decoding: `tokens_per_s` shared equally by the sequences running (processor sharing).

    Every sequence running gets rate / S tokens a second while S run, so a virtual clock (`progress`: tokens
    each sequence running all along would have by now) advances by rate / S per second, and a request of
    `tokens` tokens per sequence ends when the clock has moved `tokens` past where it stood at its arrival.
    The proxy holds the sequences beyond the replica's max_num_seqs in its own queue, so all sent here run.
    """

    def __init__(self, tokens_per_s: float) -> None:
        self.rate = tokens_per_s
        self.progress = 0.0
        self.at = 0.0  # loop time at which `progress` was last brought up to date
        self.sequences = 0
        self.pending: list[tuple[float, int, asyncio.Future[None], int]] = []  # (progress at its end, order, done, n)
        self.order = itertools.count()
        self.timer: asyncio.TimerHandle | None = None

    def _advance(self, now: float) -> None:
        if self.sequences:
            self.progress += (now - self.at) * self.rate / self.sequences
        self.at = now

    async def decode(self, n: int, tokens: int) -> None:
        """Return once `n` sequences of `tokens` tokens each, started now, are decoded."""
        loop = asyncio.get_running_loop()
        self._advance(loop.time())
        done: asyncio.Future[None] = loop.create_future()
        heapq.heappush(self.pending, (self.progress + tokens, next(self.order), done, n))
        self.sequences += n
        self._schedule(loop)
        await done

    def _schedule(self, loop: asyncio.AbstractEventLoop) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.pending:
            left = max(0.0, self.pending[0][0] - self.progress)
            self.timer = loop.call_at(self.at + left * self.sequences / self.rate, self._finish, loop)

    def _finish(self, loop: asyncio.AbstractEventLoop) -> None:
        self.timer = None
        self._advance(loop.time())
        while self.pending and self.pending[0][0] <= self.progress + 1e-6:
            _, _, done, n = heapq.heappop(self.pending)
            self.sequences -= n
            if not done.done():
                done.set_result(None)
        self._schedule(loop)

    def cut(self) -> int:
        """The replica stops: every request still decoding fails; returns how many did."""
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        cut = 0
        for _, _, done, _ in self.pending:
            if not done.done():
                done.set_exception(ConnectionResetError("the replica stopped"))
                cut += 1
        self.pending.clear()
        self.sequences = 0
        return cut


class FixedRateReplica(SimReplica):
    """A simulated vLLM server whose generation runs at a fixed rate (above), recording what it served."""

    def __init__(self, rid: str, base_model: str, tokens_per_s: float, ledger: Ledger) -> None:
        # The parent's slots serve only the canary probe here: one short step each, never waiting behind generation.
        super().__init__(rid, base_model, max_num_seqs=64, step_s=PROBE_STEP_S)
        self.engine = FixedRate(tokens_per_s)
        self.ledger = ledger
        self.connections: set[Any] = set()  # open transports: a stopped replica closes them (the proxy sees it go)
        self.stopped = False
        self.generated_tokens = 0

    # -- what replica/drain.py reads of a vLLM server ---------------------------------------------------------
    def alive(self) -> bool:
        return not self.stopped

    def requests(self, timeout_s: float = 2.0) -> int:
        """Requests running or waiting here (vLLM's num_requests_running + num_requests_waiting)."""
        return len(self.engine.pending)

    # -- HTTP ------------------------------------------------------------------------------------------------
    async def handle(self, path: bytes, body: bytes) -> tuple[int, bytes]:
        if self.stopped:
            return _error(503, "the replica stopped")
        if path == b"/tokenize":
            tokens = fake_tokens(orjson.loads(body) if body else {})
            return 200, orjson.dumps({"tokens": tokens, "count": len(tokens), "max_model_len": 4096})
        return await super().handle(path, body)

    async def complete(self, req: dict[str, Any]) -> tuple[int, bytes]:
        if "return_token_ids" not in req:  # the canary probe (or another client's plain request): the parent's
            return await super().complete(req)
        model, prompt, tokens = req.get("model"), req["prompt"], int(req.get("max_tokens", 16))
        if model != self.base_model and model not in self.loras:
            return _error(404, f"The model `{model}` does not exist.")
        if not isinstance(prompt, list) or not all(isinstance(t, int) for t in prompt):
            return _error(400, "the simulated replica takes a prompt of token ids")
        n = int(req.get("n") or 1)
        key = tuple(prompt)
        try:
            await self.engine.decode(n, tokens)
        except ConnectionResetError:
            self.ledger.cut[key].append((self.rid, time.time()))
            raise
        self.ledger.served[key].append((self.rid, time.time()))
        self.generated_tokens += n * tokens
        ids = [1000 + (len(prompt) * 31 + j) % 20000 for j in range(tokens)]
        choices = [
            {
                "index": i,
                "text": "x" * tokens,
                "token_ids": ids,
                "logprobs": {"tokens": ["x"] * tokens, "token_logprobs": [-0.5] * tokens},
                "finish_reason": "length",
            }
            for i in range(n)
        ]
        usage = {"prompt_tokens": len(prompt), "completion_tokens": n * tokens}
        return 200, orjson.dumps({"object": "text_completion", "model": model, "choices": choices, "usage": usage})

    def stop(self) -> int:
        """Stop serving at once (vLLM killed): requests still decoding are cut; returns how many."""
        self.stopped = True
        cut = self.engine.cut()
        for transport in list(self.connections):
            transport.close()
        return cut


class SimConn(_ServerConn):
    """The parent's keep-alive HTTP connection, remembered by its replica so that stopping closes it."""

    sim: FixedRateReplica

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        self.sim.connections.add(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.sim.connections.discard(self.transport)
