"""The command: `brigade dashboard --bucket URL [--port P]`, or `--pool URL [--proxy-url URL]` for a shared pool."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from bucket import layout, pool
from bucket.config import BucketConfig, ConfigError, open_bucket
from bucket.store import BucketError
from jobkit.entry import setup_logging
from jobkit.settings import add_flags, config_model, load

if TYPE_CHECKING:
    from infra.dashboard import server

DESCRIPTION = (
    "Serve a web page of a run, live from its bucket (read access only): sync latency per version, stage and "
    "replica, reward, ratio, clip fractions, staleness, tokens/s, replicas, recent completions, a health banner. "
    "With --pool: a shared pool's runs side by side (share of tokens served vs weight, queue, sync latency, "
    "versions live)."
)
_Tables = config_model("DashboardConfig", {"bucket": BucketConfig})


def build_parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=DESCRIPTION)
    parser.add_argument("--log-level", default="INFO", help="Python logging level.")
    g = parser.add_argument_group("dashboard")
    g.add_argument("--host", default="127.0.0.1", help="Address to listen on (0.0.0.0: every interface).")
    g.add_argument("--port", type=int, default=8300, help="Port to listen on (0: any free port).")
    g.add_argument("--refresh-s", type=float, default=2.0, help="Seconds between reads of the bucket while live.")
    g.add_argument("--completions", type=int, default=30, help="Recent completions shown.")
    g.add_argument(
        "--replica-timeout-s",
        type=float,
        default=15.0,
        help="A registered replica whose heartbeat has not moved for this long (on this machine's clock) is down.",
    )
    g.add_argument("--out", metavar="FILE", help="Write the page once to FILE (a snapshot, no server) and exit.")
    g.add_argument("--terminal", action="store_true", help="Show the dashboard in this terminal instead of serving it.")
    g.add_argument(
        "--pool",
        metavar="URL",
        help="A shared pool's bucket (`brigade pool init`) instead of a run's: its runs side by side (docs/pool.md).",
    )
    g.add_argument(
        "--proxy-url",
        metavar="URL",
        default="",
        help="With --pool: the pool proxy's address (http://host:8100), whose /metrics (no token) give each run's "
        "tokens served and requests waiting.",
    )
    g.add_argument(
        "--share-window-s",
        type=float,
        default=60.0,
        help="With --proxy-url: the shares of tokens served are over this many seconds of the dashboard's scrapes.",
    )
    add_flags(parser, _Tables, only={"bucket": ["url"]})
    return parser


def main(argv: list[str] | None = None, prog: str = "brigade dashboard") -> int:
    args = build_parser(prog).parse_args(argv)
    setup_logging(args.log_level or "INFO")
    if args.pool:
        return _show(args, prog, _pool_page, _pool_usage_error(args))
    if args.proxy_url:
        return _show(args, prog, _run_page, "--proxy-url goes with --pool (a run's page reads its bucket only)")
    return _show(args, prog, _run_page)


Page = tuple[Callable[[], str], "server.Served"]  # a snapshot's renderer, and what serves the page live


def _show(
    args: argparse.Namespace, prog: str, open_page: Callable[[argparse.Namespace], Page | None], usage: str = ""
) -> int:
    """Open the page (None: it was shown in the terminal), then write it once with --out or serve it; a usage
    error, a bucket that cannot be read or a port that cannot be bound is exit status 2 with what was wrong."""
    from infra.dashboard import server

    if usage:
        print(f"{prog}: error: {usage}", file=sys.stderr)
        return 2
    try:
        opened = open_page(args)
        if opened is None:
            return 0
        snapshot, live = opened
        if args.out:
            with open(args.out, "w") as f:
                f.write(snapshot())
            print(f"brigade dashboard: wrote {args.out}")
            return 0
        server.serve(live, args.host, args.port)
    except (ConfigError, BucketError, OSError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


def _run_page(args: argparse.Namespace) -> Page | None:
    from infra.dashboard import page, server

    store = open_bucket(load(_Tables, args).bucket)
    if store.exists(pool.POOL_MANIFEST) and not store.exists(layout.RUN_MANIFEST):
        # a run's page of a pool's bucket would be empty: say which flag reads it
        raise BucketError(f"{store.url} is a shared pool's bucket, not a run's: use --pool {store.url}")
    dashboard = server.Dashboard(store, args.refresh_s, args.completions, args.replica_timeout_s)
    if args.terminal:
        from infra.dashboard.terminal import watch

        watch(dashboard.data, args.refresh_s)
        return None
    return lambda: page.page(dashboard.data, 0), dashboard


def _pool_usage_error(args: argparse.Namespace) -> str:
    if args.bucket or getattr(args, "bucket.url", None):
        return "give --bucket (a run) or --pool (a pool), not both"
    if args.terminal:
        return "--terminal shows a run; for a pool, serve the page or use `brigade pool status`"
    if args.proxy_url and not args.proxy_url.startswith(("http://", "https://")):
        return f"--proxy-url {args.proxy_url!r} needs its scheme, e.g. http://host:8100"
    return ""


def _pool_page(args: argparse.Namespace) -> Page:
    from infra.dashboard import pool_page, server
    from infra.dashboard.pool_data import PoolData

    store = open_bucket(BucketConfig(url=args.pool))
    if store.exists(layout.RUN_MANIFEST) and not store.exists(pool.POOL_MANIFEST):
        raise BucketError(f"{store.url} is a run's bucket, not a shared pool's: use --bucket {store.url}")
    pool.read_pool(store)  # a bucket that is no pool: say how to make one, and serve nothing
    data = PoolData(store, args.proxy_url, args.replica_timeout_s, args.share_window_s)
    return lambda: pool_page.page(data, 0), server.PoolDashboard(data, args.refresh_s)
