"""`brigade export`: an adapter version out of the bucket, as a folder `peft` and vLLM load as they are.

    brigade export --bucket URL --version N|best --to DIR [--merge]

The version's files are checked against their commit marker, then written
as a PEFT adapter folder (adapter_model.safetensors + adapter_config.json,
whose base_model_name_or_path names the run's base model folder). With
`--merge` the adapter is folded into the base weights instead and DIR is a
plain model folder (weights, config and tokenizer), servable without LoRA.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from bucket import adapters, events
from bucket.config import ConfigError, open_bucket
from bucket.store import BucketError
from infra.best_version import resolve_version
from infra.config import add_flags, load
from infra.summary import accuracy_curve
from jobkit.entry import setup_logging
from jobkit.settings import default_model_dir

DESCRIPTION = "Write an adapter version as a PEFT folder (peft and vLLM load it as is), or merged into the base."


def export(bucket_url: str, version: str | int | None, out: str, base_model: str, merge: bool) -> int:
    from bucket.config import BucketConfig

    store = open_bucket(BucketConfig(url=bucket_url))
    committed = adapters.committed_versions(store)
    if not committed:
        raise ConfigError(f"{bucket_url} holds no committed adapter version")
    if version == "best":
        curve = accuracy_curve([e for e in events.read_all(store) if e["kind"] == events.EVAL], 0.0)
        try:
            version = resolve_version(version, curve)
        except ValueError as exc:
            raise ConfigError(f"{bucket_url}: {exc}") from None
        print(f"the best held-out version is {version}", flush=True)
    else:
        try:
            version = resolve_version(version, [])
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    version = committed[-1] if version is None else version
    if version not in committed:
        raise ConfigError(f"adapter version {version} is not committed in {bucket_url} (committed: {committed})")
    files = adapters.read_verified(store, version)
    config = json.loads(files["adapter_config.json"])
    config["base_model_name_or_path"] = base_model
    if os.path.exists(out) and os.listdir(out):
        raise ConfigError(f"--to {out} exists and is not empty")
    adapter_dir = out if not merge else os.path.join(out, ".adapter")
    os.makedirs(adapter_dir, exist_ok=True)
    with open(os.path.join(adapter_dir, "adapter_model.safetensors"), "wb") as f:
        f.write(files["adapter_model.safetensors"])
    with open(os.path.join(adapter_dir, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=1)
    if merge:
        import shutil

        import torch
        from peft import PeftModel
        from transformers import AutoModelForCausalLM, AutoTokenizer

        base = AutoModelForCausalLM.from_pretrained(base_model, dtype=torch.float32)
        merged = PeftModel.from_pretrained(base, adapter_dir).merge_and_unload()
        merged.save_pretrained(out, safe_serialization=True)
        AutoTokenizer.from_pretrained(base_model).save_pretrained(out)
        shutil.rmtree(adapter_dir)
    print(f"adapter version {version} written to {out}" + (" (merged into the base model)" if merge else ""))
    return 0


def build_parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=DESCRIPTION)
    parser.add_argument("--log-level", default="INFO", help="Python logging level.")
    parser.add_argument(
        "--version",
        default=None,
        help="Adapter version: a number, or best (the best held-out accuracy of the run's evaluations); default: "
        "the newest committed.",
    )
    parser.add_argument("--to", required=True, metavar="DIR", help="Folder to write (must be new or empty).")
    parser.add_argument("--merge", action="store_true", help="Fold the adapter into the base model's weights.")
    add_flags(parser, {"bucket": ["url"], "trainer": ["model_path"]})  # what an export reads
    return parser


def main(argv: list[str] | None = None, prog: str = "brigade export") -> int:
    args = build_parser(prog).parse_args(argv)
    setup_logging(args.log_level or "INFO")
    try:
        config = load(args)
        base = config.trainer.model_path or default_model_dir()
        return export(config.bucket.url, args.version, args.to, base, args.merge)
    except (ConfigError, BucketError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
