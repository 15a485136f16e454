"""Which tokenizer a run's token ids belong to: recorded once, checked by every job that holds a model.

Token ids cross every boundary of the system: the replicas generate them, the rollout worker stores them
in shards, the trainer scores them. A trainer whose model folder has another tokenizer than the replicas'
(another model revision, a re-exported folder with different added tokens) trains on ids that mean other
text, and nothing fails: the loss just stops making sense. So the first job to start with a model folder
(the trainer or a replica) records the tokenizer's fingerprint in the bucket, and every later one compares
its own and refuses to start on a mismatch.

The fingerprint is a sha256 over the tokenizer files a model folder holds (name and content), so it needs
neither transformers nor torch. One writer and reader: `check_or_record`.
"""

from __future__ import annotations

import hashlib
import json
import os
import time

from bucket import layout
from bucket.store import BucketError, Store

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
    files = {}
    for name in TOKENIZER_FILES:
        path = os.path.join(model_dir, name)
        if os.path.isfile(path):
            with open(path, "rb") as f:
                files[name] = hashlib.sha256(f.read()).hexdigest()
    if not files:
        return {}
    overall = hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()
    return {"sha256": overall, **files}


def check_or_record(store: Store, model_dir: str, job: str) -> str:
    """Record this model folder's tokenizer as the run's, or check it against the one recorded; returns its sha256.

    A folder without tokenizer files is not checked (it cannot disagree); a mismatch raises TokenizerMismatch.
    """
    mine = fingerprint(model_dir)
    if not mine:
        return ""
    record = {"fingerprint": mine, "recorded_by": job, "model_path": os.path.abspath(model_dir), "at": time.time()}
    if store.put_if_absent(layout.RUN_TOKENIZER, json.dumps(record, indent=1).encode()):
        return mine["sha256"]
    theirs = store.get_json(layout.RUN_TOKENIZER)
    want = theirs.get("fingerprint", {}) if isinstance(theirs, dict) else {}
    if want.get("sha256") == mine["sha256"]:
        return mine["sha256"]
    differ = sorted(n for n in set(want) | set(mine) if n != "sha256" and want.get(n) != mine.get(n))
    raise TokenizerMismatch(
        f"the {job}'s tokenizer ({model_dir}) is not the one this run's token ids are made with: "
        f"{', '.join(differ)} differ from those the {theirs.get('recorded_by', '?')} recorded from "
        f"{theirs.get('model_path', '?')} in {store.url}/{layout.RUN_TOKENIZER}. Every job must load the same model "
        "folder (same revision, e.g. one `brigade prepare-model` output copied to every machine), or start a new "
        "run in a new bucket."
    )
