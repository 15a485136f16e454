"""The command: `brigade dashboard --bucket URL [--port P]`."""

from __future__ import annotations

import argparse
import sys

from bucket.config import BucketConfig, ConfigError, open_bucket
from bucket.store import BucketError
from jobkit.entry import setup_logging
from jobkit.settings import add_flags, config_model, load

DESCRIPTION = (
    "Serve a web page of a run, live from its bucket (read access only): sync latency per version, stage and "
    "replica, reward, ratio, clip fractions, staleness, tokens/s, replicas, recent completions, a health banner."
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
    add_flags(parser, _Tables, only={"bucket": ["url"]})
    return parser


def main(argv: list[str] | None = None, prog: str = "brigade dashboard") -> int:
    args = build_parser(prog).parse_args(argv)
    setup_logging(args.log_level or "INFO")
    from infra.dashboard import page, server

    try:
        store = open_bucket(load(_Tables, args).bucket)
        dashboard = server.Dashboard(store, args.refresh_s, args.completions, args.replica_timeout_s)
        if args.terminal:
            from infra.dashboard.terminal import watch

            watch(dashboard.data, args.refresh_s)
            return 0
        if args.out:
            with open(args.out, "w") as f:
                f.write(page.page(dashboard.data, 0))
            print(f"brigade dashboard: wrote {args.out}")
            return 0
        server.serve(dashboard, args.host, args.port)
    except (ConfigError, BucketError, OSError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0
