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
import json
import os
from typing import Any

from bucket.config import ConfigError
from infra.config import Config
from rollout_worker.length_check import LengthCheck, check_lengths, round_up
from rollout_worker.length_preflight import tools_or_warn
from rollout_worker.lengths import fit_episodes


class LocalTokens:
    """The model folder's tokenizer and chat template, rendered as transformers renders them.

    Read with `tokenizers` and transformers' template renderer rather than AutoTokenizer: importing the latter
    costs seconds of CPU on every local run (about 4 s of a 2-core AVX2 host's CPU, 1 s this way), and the two
    give the same ids (tests/infra/test_local_lengths.py). A folder without tokenizer.json gets AutoTokenizer."""

    def __init__(self, model_path: str):
        self.auto: Any = None
        path = os.path.join(model_path, "tokenizer.json")
        if not os.path.isfile(path):
            from transformers import AutoTokenizer

            self.auto = AutoTokenizer.from_pretrained(model_path)
            return
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(path)
        config = _read_json(os.path.join(model_path, "tokenizer_config.json"))
        template_file = os.path.join(model_path, "chat_template.jinja")
        if os.path.isfile(template_file):
            with open(template_file) as f:
                self.template = f.read()
        else:
            self.template = config.get("chat_template") or ""
        # the special tokens a template names (bos_token, eos_token, ...), as transformers passes them
        self.special = {
            k: (v.get("content") if isinstance(v, dict) else v)
            for k, v in config.items()
            if k.endswith("_token") and isinstance(v, (str, dict))
        }

    def encode(self, text: str) -> list[int]:
        if self.auto is not None:
            return list(self.auto.encode(text, add_special_tokens=False))
        return list(self.tok.encode(text, add_special_tokens=False).ids)

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
        if self.auto is not None:
            out = self.auto.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True)
            return list(out["input_ids"] if hasattr(out, "keys") else out)
        from transformers.utils.chat_template_utils import render_jinja_template

        if not self.template:
            raise ConfigError("the model folder has no chat template: episodes and chat prompts need one")
        rendered, _ = render_jinja_template(
            [messages], tools=tools, chat_template=self.template, add_generation_prompt=True, **self.special
        )
        return self.encode(rendered[0])


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def check_local_lengths(config: Config, train: Any, eval_rows: Any) -> tuple[Config, LengthCheck]:
    """(the config with replica.max_model_len sized when not given, the check). Raises ConfigError on a refusal."""
    rc, replica = config.rollout, config.replica
    given_len = "max_model_len" in replica.model_fields_set
    tools = asyncio.run(tools_or_warn(rc))
    limit = replica.max_model_len if given_len else None  # not given: sized below instead of refused
    fitted = fit_episodes(rc, limit)  # an episode bound not given yields to a max_model_len given
    if fitted:
        print(fitted, flush=True)
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
