"""`brigade pool`: make a bucket a replica pool shared by several runs, give runs their tokens, look at it.

    brigade pool init   --pool URL --base-model NAME [--pool-id ID]   write pool.json (or check the one there)
    brigade pool token  --pool URL --run RUN_ID                        a new token for a run (printed once)
    brigade pool status --pool URL [--json]                            runs, replicas, adapter slots

The pool's bucket layout and who writes what: bucket/pool.py. A token is printed once, on standard output as
`export BRIGADE_POOL_TOKEN=...` (so `eval "$(brigade pool token ...)"` sets it), and never written anywhere
else: the pool stores only its SHA-256, and the proxy checks a run's token against that.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
import uuid
from typing import Any

from bucket import adapters, pool, replicas
from bucket.config import BucketConfig, ConfigError, open_bucket
from bucket.pool import BadRunId
from bucket.store import BucketError, Store
from jobkit.entry import setup_logging

DESCRIPTION = "A replica pool shared by several runs: init its bucket, give a run its token, show who uses it."
TOKEN_ENV = "BRIGADE_POOL_TOKEN"


def default_pool_id(url: str) -> str:
    """The pool's name from its URL's last folder (s3://b/pools/main -> main), else a random one."""
    name = re.sub(r"[^A-Za-z0-9_.-]", "-", url.rstrip("/").rsplit("/", 1)[-1].split(":")[-1]).strip("-.")
    return name[:64] or uuid.uuid4().hex[:8]


def open_pool(url: str, create: bool = False) -> Store:
    try:
        return open_bucket(BucketConfig(url=url), create=create)
    except BucketError as exc:
        raise BucketError(f"the pool's bucket (--pool {url}): {exc}") from None


def init(url: str, base_model: str, pool_id: str = "") -> int:
    store = open_pool(url, create=True)
    existed = store.exists(pool.POOL_MANIFEST)
    manifest = pool.init_pool(store, pool_id or default_pool_id(store.url), base_model)
    where = f"{store.url}/{pool.POOL_MANIFEST}"
    if existed:
        print(f"{where} is already there, for the same base model: nothing written")
    else:
        print(f"wrote {where}")
    print(json.dumps(manifest.model_dump(), indent=1))
    print(
        f"next: `brigade pool token --pool {store.url} --run RUN_ID` for each run; start the replicas with "
        f"--bucket {store.url} --run.base-model {manifest.base_model} (and --replica.max-loras: the admitted runs' "
        "live windows, max_staleness + 2 each, must fit)"
    )
    return 0


def token(url: str, run_id: str) -> int:
    store = open_pool(url)
    pool.read_pool(store)  # a token for a bucket that is no pool is a mistake: say so
    value = pool.new_token(store, run_id)
    print(
        f"a new token for run {run_id} in the pool {store.url} (only its SHA-256 is stored, in "
        f"{pool.token_key(run_id)}; an earlier token of {run_id} stops working). It is shown once: give it to the "
        f"run's jobs as {TOKEN_ENV}:",
        file=sys.stderr,
    )
    print(f"export {TOKEN_ENV}={value}", flush=True)
    return 0


def _left(seconds: float) -> str:
    return f"{seconds:.0f}s" if seconds >= 0 else f"lapsed {-seconds:.0f}s ago"


def status(store: Store, now: float | None = None) -> dict[str, Any]:
    """What `brigade pool status` shows, as one JSON-able object."""
    now = time.time() if now is None else now
    manifest = pool.read_pool(store)
    runs = pool.read_runs(store)
    infos = sorted(replicas.list_replicas(store), key=lambda r: r.replica_id)
    tokens = sorted(n[: -len(".json")] for n in store.list(pool.TOKENS) if n.endswith(".json"))
    used = sum(run.live_window for run in runs.values())
    slots = min((r.max_loras for r in infos), default=None)
    return {
        "pool": manifest.model_dump(),
        "url": store.url,
        "runs": {
            run_id: {
                "weight": run.weight,
                "max_staleness": run.max_staleness,
                "window": run.live_window,
                "lease_left_s": round(run.lease_until - now, 1),
                "newest": adapters.latest_version(store, pool.adapters_folder(run_id)),
                "admitted_at": run.admitted_at,
            }
            for run_id, run in sorted(runs.items())
        },
        "replicas": {
            r.replica_id: {
                "url": r.url,
                "max_loras": r.max_loras,
                "heartbeat_age_s": round(now - r.heartbeat_at, 1),
                "draining": r.draining,
                "mirrored_runs": None if r.mirrored_runs is None else {k: len(v) for k, v in r.mirrored_runs.items()},
            }
            for r in infos
        },
        "slots": {"total": slots, "used": used, "free": None if slots is None else slots - used},
        "tokens": tokens,
    }


def format_status(s: dict[str, Any]) -> str:
    p = s["pool"]
    lines = [f"pool {p['pool_id']} at {s['url']}: base model {p['base_model']}"]
    runs = s["runs"]
    lines.append(f"runs admitted: {len(runs)}" + (":" if runs else ""))
    for run_id, r in runs.items():
        newest = "none yet" if r["newest"] is None else f"v{r['newest']:06d}"
        lines.append(
            f"  {run_id}: weight {r['weight']:g}, window {r['window']} (max_staleness {r['max_staleness']}), "
            f"lease {_left(r['lease_left_s'])}, newest adapter {newest}"
        )
    reps = s["replicas"]
    lines.append(f"replicas registered: {len(reps)}" + (":" if reps else ""))
    for rid, r in reps.items():
        mirror = "" if r["mirrored_runs"] is None else f", mirrors {len(r['mirrored_runs'])} run(s)"
        lines.append(
            f"  {rid} ({r['url']}): max_loras {r['max_loras']}, heartbeat {r['heartbeat_age_s']:.0f}s ago"
            + (", draining" if r["draining"] else "")
            + mirror
        )
    slots = s["slots"]
    if slots["total"] is None:
        lines.append(f"adapter slots: {slots['used']} held by the runs; no replica registered yet")
    else:
        lines.append(
            f"adapter slots: {slots['used']} used of {slots['total']} (the smallest max_loras), {slots['free']} free"
        )
    idle = [t for t in s["tokens"] if t not in runs]
    lines.append(f"tokens issued: {len(s['tokens'])}" + (f" (not admitted now: {', '.join(idle)})" if idle else ""))
    return "\n".join(lines)


def build_parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=DESCRIPTION)
    parser.add_argument("--log-level", default="INFO", help="Python logging level.")
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    url_help = "The pool's own bucket: a local folder or s3://bucket/prefix."
    p = sub.add_parser("init", help="Write pool.json (or check the one there).")
    p.add_argument("--pool", required=True, metavar="URL", help=url_help)
    p.add_argument("--base-model", required=True, help="The name the replicas serve the base model under.")
    p.add_argument("--pool-id", default="", help="The pool's name (default: the URL's last folder).")
    p = sub.add_parser("token", help="A new token for a run, printed once (only its hash is stored).")
    p.add_argument("--pool", required=True, metavar="URL", help=url_help)
    p.add_argument("--run", required=True, metavar="RUN_ID", help="The run's id (its run.json's run_id).")
    p = sub.add_parser("status", help="Admitted runs, replicas and adapter slots.")
    p.add_argument("--pool", required=True, metavar="URL", help=url_help)
    p.add_argument("--json", action="store_true", help="One JSON object instead of text.")
    return parser


def main(argv: list[str] | None = None, prog: str = "brigade pool") -> int:
    args = build_parser(prog).parse_args(argv)
    setup_logging(args.log_level or "INFO")
    try:
        if args.action == "init":
            return init(args.pool, args.base_model, args.pool_id)
        if args.action == "token":
            return token(args.pool, args.run)
        s = status(open_pool(args.pool))
        print(json.dumps(s) if args.json else format_status(s))
        return 0
    except (ConfigError, BucketError, BadRunId) as exc:
        print(f"{prog} {args.action}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
