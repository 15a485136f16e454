"""`brigade eval`: held-out accuracy of the base model and adapter versions of a run, through its proxy.

The evaluation set, the answer check and the greedy settings are the rollout
worker's (`[rollout]` table: dataset, eval_dataset, eval_size, eval_max_tokens,
eval_judge), so a number here is comparable with the ones the worker records
during the run. A run with an environment is evaluated as its worker does it:
give the run's `environment`, its episode bounds (max_turns, max_tool_calls,
max_episode_tokens, max_completion_length, environment_timeout_s), its
reward_funcs and eval_success_threshold, as flags or in the run's --config
file. Each version is loaded on the replicas through the proxy (and unloaded
again if this command loaded it); each result is appended to
the bucket as an `eval` event, which `brigade summary` and the dashboard read.

Each evaluation is bounded by `eval_timeout_s` as in the worker: one past it is cut, recorded as partial
(`partial: true`, `cut`, `planned`) and printed as such, never as the version's accuracy.

`--pool URL` (or `rollout.pool_url`): the run trains on a shared pool, and the versions are evaluated there,
with the run's token (`$BRIGADE_POOL_TOKEN`, `rollout.pool_token_env`, or `--pool-token-file`); eval_pool.py
says how the run is held and its versions made live on the pool.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

import httpx

from bucket import adapters
from bucket.config import ConfigError, open_bucket
from bucket.events import EventLog
from bucket.manifest import RunManifest, read_manifest
from bucket.rollouts import SamplingParams
from bucket.store import BucketError, Store
from bucket.version import Version
from infra.config import Config, Flags, add_flags, load
from infra.eval_pool import open_pool, read_token
from jobkit.entry import setup_logging

DESCRIPTION = (
    "Greedy held-out accuracy of the base model and adapter versions, through the proxy; results to the bucket."
)
# The settings an evaluation reads: the bucket, and the rollout worker's evaluation set, judge and proxy.
FLAGS: Flags = {
    "bucket": ["url"],
    "rollout": [
        "proxy_url",
        "dataset",
        "dataset_split",
        "eval_dataset",
        "eval_dataset_split",
        "eval_size",
        "eval_max_tokens",
        "eval_timeout_s",
        "eval_judge",
        "eval_success_threshold",
        # an environment run is evaluated through its environment, with training's bounds and reward
        "environment",
        "max_turns",
        "max_tool_calls",
        "max_episode_tokens",
        "max_completion_length",
        "environment_timeout_s",
        "reward_funcs",
        "reward_weights",
        "reward_timeout_s",
        "request_timeout_s",
        "pool_url",
        "pool_token_env",
        "pool_weight",
    ],
}


def parse_versions(text: str, store: Store) -> list[Version]:
    """'0,3,latest' / 'all': 0 is the base model; every adapter version named must be committed."""
    committed = adapters.committed_versions(store)
    out: list[Version] = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        if part == "all":
            out += [Version(0), *committed]
        elif part == "latest":
            if not committed:
                raise ConfigError("--versions latest: the bucket holds no committed adapter version yet")
            out.append(committed[-1])
        elif part.isdigit():
            v = int(part)
            if v and v not in committed:
                raise ConfigError(f"--versions: adapter version {v} is not committed in the bucket ({committed})")
            out.append(Version(v))
        else:
            raise ConfigError(f"--versions: {part!r} is not a version number, 'latest' or 'all'")
    return list(dict.fromkeys(out))


async def _load(client: httpx.AsyncClient, manifest: RunManifest, version: Version) -> bool:
    """Have the proxy load a version on every replica; True when this call loaded it (so it unloads it after)."""
    resp = await client.post(
        "/v1/load_lora_adapter",
        json={"lora_name": manifest.lora_name(version), "lora_path": version.key},
    )
    if resp.status_code == 200:
        return True
    if "already" in resp.text:
        return False
    raise ConfigError(f"the proxy could not load version {version} (HTTP {resp.status_code}): {resp.text[:300]}")


async def evaluate_versions(config: Config, versions_text: str, token_file: str | None = None) -> list[dict[str, Any]]:
    from rollout_worker.environments.held_out import HeldOutEpisodes
    from rollout_worker.evaluation import EVAL_CONCURRENCY, Evaluator, episode_note
    from rollout_worker.generation import Generator
    from rollout_worker.main import wait_for_proxy
    from rollout_worker.pool_client import auth_headers
    from rollout_worker.prompts import load_data

    rc = config.rollout
    url = rc.pool_url or rc.proxy_url
    token, source = read_token(rc.pool_token_env, url, token_file) if rc.pool_url else ("", "")
    store = open_bucket(config.bucket)
    manifest = read_manifest(store)
    versions = parse_versions(versions_text, store)
    data = load_data(rc.dataset, rc.eval_dataset, rc.eval_size or 200, rc.dataset_split, rc.eval_dataset_split)
    ev = EventLog(store, "eval")
    results = []
    on_pool = None
    async with httpx.AsyncClient(base_url=url, timeout=rc.request_timeout_s, headers=auth_headers(token)) as client:
        await wait_for_proxy(client, url, 30, "the pool's proxy or fix --pool" if rc.pool_url else "`brigade proxy`")
        if rc.pool_url:
            on_pool = open_pool(url, token, source, rc.pool_token_env, store, manifest, rc.pool_weight)
            await on_pool.hold()
        generator = Generator(client, manifest.base_model, SamplingParams(temperature=0.0), rc.eval_max_tokens)
        episodes = HeldOutEpisodes.for_settings(rc, client, manifest.base_model, EVAL_CONCURRENCY)
        evaluator = Evaluator(client, generator, data, rc.eval_judge, rc.eval_max_tokens, episodes=episodes)
        try:
            for v in versions:
                model = manifest.base_model if v == 0 else manifest.lora_name(v)
                if on_pool is not None:
                    loaded = v != 0 and await on_pool.prepare(v)
                else:
                    loaded = v != 0 and await _load(client, manifest, v)
                try:
                    result = await evaluator.evaluate(v, model, rc.eval_timeout_s or None)  # 0: no bound
                finally:
                    if loaded and on_pool is not None:
                        await on_pool.release(v)
                    elif loaded:
                        await client.post("/v1/unload_lora_adapter", json={"lora_name": model})
                evaluator.emit(ev, result, model)
                row: dict[str, Any] = {
                    "version": v,
                    "accuracy": result.accuracy,
                    "correct": result.correct,
                    "total": result.total,
                }
                if episodes is not None:  # what the episodes scored, beside the fraction that succeeded
                    row.update(mean_reward=result.mean_reward, env_errors=len(result.env_errors))
                counts = f"{result.correct}/{result.total}, {result.seconds:.1f}s{episode_note(result)}"
                if result.partial:
                    row.update(partial=True, cut=result.cut, planned=result.planned)
                    acc = "-" if result.accuracy is None else f"{result.accuracy:.3f}"
                    print(
                        f"  v{v:<6} CUT ({result.cut}) after {result.total} of {result.planned} prompts: "
                        f"partial accuracy {acc}  ({counts})"
                    )
                else:
                    print(f"  v{v:<6} accuracy {result.accuracy:.3f}  ({counts})")
                results.append(row)
        finally:
            evaluator.close()
            if on_pool is not None:
                await on_pool.close()
    print(f"evaluation set: {data.eval_name} (id {data.eval_id})")
    return results


def build_parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=DESCRIPTION)
    parser.add_argument("--log-level", default="INFO", help="Python logging level.")
    parser.add_argument(
        "--versions", default="0,latest", help="Comma-separated: 0 = the base model, N, 'latest', or 'all'."
    )
    parser.add_argument(
        "--pool",
        metavar="URL",
        help="Evaluate on a shared pool's proxy (rollout.pool_url), with the run's token from "
        "$BRIGADE_POOL_TOKEN (rollout.pool_token_env) or --pool-token-file.",
    )
    parser.add_argument(
        "--pool-token-file", metavar="PATH", help="A file holding the run's pool token (instead of the environment)."
    )
    add_flags(parser, FLAGS)
    return parser


def main(argv: list[str] | None = None, prog: str = "brigade eval") -> int:
    args = build_parser(prog).parse_args(argv)
    setup_logging(args.log_level or "INFO")
    try:
        config = load(args, overrides={"rollout.pool_url": args.pool} if args.pool else None)
        if args.pool_token_file and not config.rollout.pool_url:
            raise ConfigError("--pool-token-file is for a pool: give --pool URL too")
        results = asyncio.run(evaluate_versions(config, args.versions, args.pool_token_file))
    except (ConfigError, BucketError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
