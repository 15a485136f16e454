"""Which tokenizer a run's token ids belong to: recorded in run.json, checked by every job holding a model.

Token ids cross every boundary of the system: the replicas generate them, the rollout worker stores them
in shards, the trainer scores them. A trainer whose model folder has another tokenizer than the replicas'
(another model revision, a re-exported folder with different added tokens) trains on ids that mean other
text, and nothing fails: the loss just stops making sense. So the job that creates run.json (the trainer,
or `brigade init` given a model folder) records its tokenizer's fingerprint there, and every job that
loads a model folder (trainer, replica) compares its own and refuses to start on a mismatch.

The fingerprint is a sha256 per tokenizer file a model folder holds, and one over them all, so it needs
neither transformers nor torch.
"""

from __future__ import annotations

import hashlib
import json
import os

from bucket.manifest import RunManifest
from bucket.store import BucketError

# Every file a Hugging Face tokenizer may be loaded from (fast or slow); the chat template is included
# because it decides the prompt's token ids as much as the vocabulary does.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)


class TokenizerMismatch(BucketError):
    pass


def fingerprint(model_dir: str) -> dict[str, str]:
    """sha256 of each tokenizer file in `model_dir`, and of them all under "sha256" ({} when it has none)."""
    files: dict[str, str] = {}
    if not model_dir or not os.path.isdir(model_dir):
        return files
    for name in TOKENIZER_FILES:
        path = os.path.join(model_dir, name)
        if os.path.isfile(path):
            with open(path, "rb") as f:
                files[name] = hashlib.sha256(f.read()).hexdigest()
    if not files:
        return {}
    overall = hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()
    return {"sha256": overall, **files}


def check(manifest: RunManifest, model_dir: str, job: str) -> str:
    """This model folder's tokenizer against run.json's; returns its sha256 ("" when either side has none).

    A run created without a model records no tokenizer and cannot be checked; a mismatch raises
    TokenizerMismatch, naming the files that differ.
    """
    mine, want = fingerprint(model_dir), manifest.tokenizer
    if not mine or not want or want.get("sha256") == mine["sha256"]:
        return mine.get("sha256", "")
    differ = sorted(n for n in set(want) | set(mine) if n != "sha256" and want.get(n) != mine.get(n))
    raise TokenizerMismatch(
        f"the {job}'s tokenizer ({model_dir}) is not the one this run's token ids are made with: "
        f"{', '.join(differ)} differ from those recorded in run.json (run {manifest.run_id}). Every job must load "
        "the same model folder (same revision, e.g. one `brigade prepare-model` output copied to every machine), "
        "or start a new run in a new bucket."
    )
