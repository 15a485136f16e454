"""run.json: the settings every job of one run must agree on.

The first trainer (or `brigade init`) writes it; every job compares its own
settings against it at start and refuses to run on a mismatch, because a
rollout worker sampling 4 generations per prompt for a trainer that expects 8,
or a replica capped at rank 1 serving rank-8 adapters, fails late and
confusingly otherwise.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Literal

from pydantic import BaseModel, Field, model_validator

from bucket import layout
from bucket.store import BucketError, NotFound, Store
from bucket.version import Version

# The format of everything in the bucket (shards, progress, checkpoints, events). Raised whenever a
# reader of an older brigade would misread what a newer one writes.
#   1: first release
#   2: shards carry typed sampling parameters; typed trainer progress and done marker
#   3: run.json records the tokenizer's fingerprint (bucket/tokenizer_id.py)
#   4: a sample is an episode's token stream: per-token loss_mask and per-request turns (bucket/rollouts.py);
#      a format-3 trainer would train the environment's and template's tokens as if the model had sampled them
#   5: a sample has no `env_error` (never set: an episode its environment ended is not written as a sample, it
#      is an env_failed event; `finish_reason` says how a written episode ended); a format-4 shard could carry
#      the field, which this reader's strict models refuse
#   6: a single-turn sample may carry `turns`: a completion continued under a newer version by the in-flight
#      switch (rollout.switch_after, rollout_worker/switch.py) records one span per version, and an episode's
#      turns may have different versions; a format-5 reader takes every sample with turns for an episode of
#      one version (its summary would count switched completions as episodes, its audit flag them as broken)
#   7: a group's sampling parameters carry `max_tokens` (the most tokens a sample could train), which the trainer's
#      dr_grpo divides by; a format-6 reader refuses the field mid-run instead of at start
FORMAT_VERSION = 7


class RunSpec(BaseModel):
    """The shared settings (the `[run]` table of a run config)."""

    model_config = {"extra": "forbid"}

    base_model: str = Field(
        "SmolLM2-135M-Instruct", description="Name the replicas serve the base model under; every job must agree."
    )
    lora_rank: int = Field(
        1, ge=1, le=512, description="LoRA rank of every adapter (vLLM needs --max-lora-rank >= this)."
    )
    lora_alpha: float = Field(2.0, gt=0, description="LoRA alpha (scale = alpha / rank).")
    lora_target_modules: list[str] = Field(
        default_factory=lambda: ["all-linear"],
        description="Linear layers that get a LoRA, by the model's own module names (q_proj, ...); all-linear (the "
        "default): every linear layer of the decoder blocks, as peft's all-linear finds them (Phi-3's qkv_proj and "
        "gate_up_proj included), never the LM head.",
    )
    num_generations: int = Field(8, ge=2, description="Completions per prompt (the GRPO group size).")
    max_staleness: int = Field(
        4, ge=0, description="Rollouts generated more than this many adapter versions ago are dropped."
    )
    api: Literal["grpo", "tinker"] = Field(
        "grpo",
        description="Who owns the training loop: grpo (brigade's: rollout workers score groups, the trainer trains "
        "them) or tinker (a Tinker API client's: the proxy serves /api/v1, the trainer executes the client's "
        "operations from the bucket; docs/tinker.md).",
    )
    # Retention is in [run], not [trainer]: the trainer alone deletes (trainer/retention.py), but what may vanish
    # is every job's business. Readers of the bucket (mirrors, the proxy, audits, summaries) must know which
    # objects a run keeps; a restarted trainer must not quietly turn an audited run (keep_rollouts) into one that
    # deletes; and keep_adapters is checked against max_staleness, which lives here.
    keep_adapters: int = Field(
        8,
        ge=0,
        description="Adapter versions kept in the bucket: the newest this many, plus every version the proxy holds "
        "live (proxy/live.json) and every kept checkpoint's; older ones are deleted by the trainer after each "
        "publish. At least max_staleness + 2 (the proxy's window and the version being loaded; unset, it is raised to "
        "that); 0 = keep every version. 8 with the default max_staleness 4: two versions of margin for a proxy "
        "that lags.",
    )
    keep_checkpoints: int = Field(
        2,
        ge=1,
        description="Checkpoints a restart can resume from (their optimizer state): the newest this many; older "
        "ones keep only their ledger (state.json, a few KB: what they consumed), which audits read. 2: the newest, "
        "and the one before should the newest's adapter be unreadable.",
    )
    keep_rollouts: bool = Field(
        False,
        description="Keep every rollout shard. Off (the default): a shard is deleted once the oldest kept checkpoint "
        "has consumed it (shards carry every token id and logprob: the bulk of a long run's bucket). On: audits "
        "(infra/audit.py) and anything else that reads every shard after the run.",
    )

    @model_validator(mode="after")
    def _keep_covers_window(self) -> RunSpec:
        window = self.max_staleness + 2
        if "keep_adapters" not in self.model_fields_set and 0 < self.keep_adapters < window:
            self.keep_adapters = window  # the default follows a wide window instead of refusing it
        elif 0 < self.keep_adapters < window:
            raise ValueError(
                f"keep_adapters ({self.keep_adapters}) must be at least max_staleness + 2 = {window}: the proxy serves "
                "the newest max_staleness + 1 versions and loads one more, whose files must not vanish under it. "
                f"Set --run.keep-adapters {window} or more, or 0 to keep every version."
            )
        return self


class RunManifest(RunSpec):
    run_id: str
    created_at: float
    format_version: int = FORMAT_VERSION
    # The creator's tokenizer files, hashed (bucket/tokenizer_id.py); {} when it was created without a model.
    tokenizer: dict[str, str] = Field(default_factory=dict)

    def lora_name(self, version: Version) -> str:
        """Name an adapter version is loaded under in vLLM.

        vLLM keys its prefix cache by this name, so it carries the run id: a
        replica shared by two runs (or reused after a bucket was wiped) never
        serves KV computed under other weights.
        """
        return Version(version).lora_name(self.run_id)

    def spec(self) -> RunSpec:
        return RunSpec(**self.model_dump(include=set(RunSpec.model_fields)))


class ManifestMismatch(BucketError):
    pass


class UnknownFormat(BucketError):
    pass


def read_manifest(store: Store) -> RunManifest:
    try:
        data = store.get_json(layout.RUN_MANIFEST)
    except NotFound as exc:
        raise NotFound(
            f"{store.url}/{layout.RUN_MANIFEST} is missing: this bucket holds no run yet. Start the trainer "
            "(it writes run.json) or run `brigade init --bucket ...` first, or check --bucket."
        ) from exc
    found = data.get("format_version") if isinstance(data, dict) else None
    if found != FORMAT_VERSION:
        # Checked before anything else: a format we do not know may hold fields we would misread.
        raise UnknownFormat(
            f"{store.url}/{layout.RUN_MANIFEST} says the bucket's format is {found!r}; this brigade reads and writes "
            f"format {FORMAT_VERSION} only. Run the brigade version that wrote this run, or start a new run in a "
            "new bucket."
        )
    try:
        return RunManifest(**data)
    except Exception as exc:
        raise BucketError(f"{store.url}/{layout.RUN_MANIFEST} is not a valid run manifest: {exc}") from exc


def check_manifest(manifest: RunManifest, spec: RunSpec, job: str) -> None:
    diffs = []
    for field in RunSpec.model_fields:
        want, have = getattr(manifest, field), getattr(spec, field)
        if want != have:
            diffs.append(f"  run.{field}: run.json has {json.dumps(want)}, this {job} has {json.dumps(have)}")
    if diffs:
        raise ManifestMismatch(
            f"{job} settings disagree with run.json of this run (run {manifest.run_id}):\n"
            + "\n".join(diffs)
            + "\nUse the run's settings (drop the overrides or fix the config), or start a new run in a new bucket."
        )


def init_or_check(store: Store, spec: RunSpec, job: str, tokenizer: dict[str, str] | None = None) -> RunManifest:
    """Create run.json if the bucket has none, else check it. Returns the manifest in force.

    `tokenizer`: the creating job's tokenizer fingerprint (tokenizer_id.fingerprint), recorded on creation.
    """
    manifest = RunManifest(
        **spec.model_dump(), run_id=uuid.uuid4().hex[:8], created_at=time.time(), tokenizer=tokenizer or {}
    )
    created = store.put_if_absent(layout.RUN_MANIFEST, json.dumps(manifest.model_dump(), indent=1).encode())
    if created:
        return manifest
    existing = read_manifest(store)
    check_manifest(existing, spec, job)
    return existing


def wait_and_check(store: Store, spec: RunSpec, job: str, timeout_s: float) -> RunManifest:
    """For jobs that never create a run: wait up to `timeout_s` for run.json, then check it."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            manifest = read_manifest(store)
            break
        except NotFound:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.5)
    check_manifest(manifest, spec, job)
    return manifest
