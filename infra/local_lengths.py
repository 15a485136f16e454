"""`brigade local`: the run's lengths checked against its data and tools, and the replicas' max_model_len sized,
before any replica starts (rollout_worker/length_check.py says what is checked and why).

The model folder's own tokenizer and chat template stand in for the replicas' (the replicas load the same
folder; run.json's tokenizer fingerprint holds every job to it). A refusal is a ConfigError naming the setting;
warnings are printed. replica.max_model_len, when not given, becomes what the run's longest request needs (never
below its default): vLLM refuses a request longer than it, and an environment's episode grows to
max_episode_tokens.
"""

from __future__ import annotations

import asyncio
from typing import Any

from bucket.config import ConfigError
from infra.config import Config
from rollout_worker.length_check import LengthCheck, check_lengths, round_up
from rollout_worker.length_preflight import tools_or_warn


class LocalTokens:
    """The model folder's tokenizer and chat template, as transformers renders them (the trainer's too)."""

    def __init__(self, model_path: str):
        from transformers import AutoTokenizer  # here: a few seconds of import, paid once per local run

        self.tok = AutoTokenizer.from_pretrained(model_path)

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
        out = self.tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True)
        return list(out["input_ids"] if hasattr(out, "keys") else out)


def check_local_lengths(config: Config, train: Any, eval_rows: Any) -> tuple[Config, LengthCheck]:
    """(the config with replica.max_model_len sized when not given, the check). Raises ConfigError on a refusal."""
    rc, replica = config.rollout, config.replica
    given_len = "max_model_len" in replica.model_fields_set
    tools = asyncio.run(tools_or_warn(rc))
    limit = replica.max_model_len if given_len else None  # not given: sized below instead of refused
    check = check_lengths(rc, train, eval_rows, LocalTokens(config.trainer.model_path), tools, limit)
    if check.refusals:
        raise ConfigError("the lengths set cannot serve this run:\n  " + "\n  ".join(check.refusals))
    if not given_len and check.need_model_len > replica.max_model_len:
        sized = replica.model_copy(update={"max_model_len": round_up(check.need_model_len, 256)})
        config = config.model_copy(update={"replica": sized})
    return config, check


def describe_lengths(config: Config, check: LengthCheck) -> str:
    """One line for a person: the lengths the run uses and where they came from."""
    rc = config.rollout
    given = rc.model_fields_set
    parts = [
        f"{name} {getattr(rc, name)}{'' if name in given else ' (sized to the task)'}"
        for name in ("max_completion_length", "eval_max_tokens", *(("max_episode_tokens",) if rc.environment else ()))
    ]
    return (
        f"lengths: {', '.join(parts)}; longest prompt {check.longest_prompt} tokens; "
        f"replica max_model_len {config.replica.max_model_len}"
    )
