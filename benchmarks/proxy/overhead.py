"""What the proxy costs per forwarded request: loopback upstreams that answer at once, direct and through a proxy.

    python -m benchmarks.proxy.overhead --json                       # direct, then brigade's proxy
    python -m benchmarks.proxy.overhead --json --candidates brigade,aiohttp,uvicorn_aiohttp,fastapi_httpx
    python -m benchmarks.proxy.overhead --json --src /tmp/old-tree   # brigade's proxy from another source tree

Every part is its own process: the upstreams (one process serving `--upstreams`
ports with a raw asyncio protocol that answers a vLLM-shaped completion at
once), the load generator (raw asyncio protocol, `--concurrency` keep-alive
connections, each sending its next request when the previous answer is
complete; GRPO-shaped bodies: groups of 8 identical prompts of 64-200 token ids
after a 23-token template), and the proxy. With `--pin` (2+ cores) the proxy
is pinned to core 0 and the load generator and upstreams share core 1, in the
direct run too: `rps` close to `direct_rps` then means the proxy keeps up with
a whole core's worth of client and server work (on a machine shared with other
work, pinning can starve the proxy instead; the default lets the scheduler
place them). The load generator's own CPU share is reported
(`loadgen_cpu_util`), with the upstreams' (`upstream_cpu_util_direct`) and the
proxy's (`proxy_cpu_util`), so one can see which side is saturated.

`cpu_ms_per_request`: CPU time (user + system) of the proxy's process and all
its children over the load generator's run (warm-up included), divided by the
requests sent in it.
The last line of `--json` output is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

import psutil

from jobkit.processes import stop_process

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO_ROOT)  # run as a file too, like the other benchmarks: its parts are sibling modules

from benchmarks.proxy.candidates import serve_candidate  # noqa: E402
from benchmarks.proxy.loopback_peers import run_loadgen, serve_upstreams  # noqa: E402
from benchmarks.report import tree_cpu_seconds, with_cpu  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- orchestration -------------------------------------------------------------------------------
def _pin(pid: int, cores: set[int] | None) -> None:
    if cores:
        for p in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]:
            try:
                p.cpu_affinity(sorted(cores))
            except (psutil.Error, OSError):
                pass


def _wait_http(port: int, proc: subprocess.Popen, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    req = b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server on port {port} exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
                s.sendall(req)
                if s.recv(64).startswith(b"HTTP/1.1 200"):
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"nothing healthy on port {port} after {timeout_s}s")


def _loadgen_proc(targets: list[int], args: argparse.Namespace, cores: set[int] | None) -> dict[str, Any]:
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.proxy.overhead",
        "--loadgen",
        ",".join(map(str, targets)),
        "--requests",
        str(args.requests),
        "--concurrency",
        str(args.concurrency),
        "--warmup",
        str(args.warmup),
    ]
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
    _pin(proc.pid, cores)
    out, _ = proc.communicate(timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"load generator failed ({proc.returncode})")
    return json.loads(out.strip().splitlines()[-1])


def _start_proxy(kind: str, port: int, upstream_urls: list[str], args: argparse.Namespace, bucket: str):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if kind.startswith("brigade"):
        src = args.src or REPO_ROOT
        env["PYTHONPATH"] = src
        cmd = [
            sys.executable,
            "-m",
            "proxy",
            "--bucket.url",
            bucket,
            "--proxy.replica-urls",
            ",".join(upstream_urls),
            "--proxy.port",
            str(port),
            "--proxy.adapter-root",
            "/tmp",
            "--log-level",
            "WARNING",
        ]
        return subprocess.Popen(cmd, cwd=src, env=env, stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    cmd = [sys.executable, "-m", "benchmarks.proxy.overhead", "--serve-candidate", kind, "--port", str(port)]
    cmd += ["--upstream-urls", ",".join(upstream_urls)]
    return subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL)


def measure(kind: str, upstream_ports: list[int], args: argparse.Namespace, cores: dict[str, set[int] | None]):
    urls = [f"http://127.0.0.1:{p}" for p in upstream_ports]
    port = free_port()
    with tempfile.TemporaryDirectory() as bucket:
        if kind.startswith("brigade"):
            sys.path.insert(0, REPO_ROOT)
            from bucket import Store
            from bucket.manifest import RunSpec, init_or_check

            store = Store(bucket)
            store.check_reachable(create=True)
            init_or_check(store, RunSpec(), "bench")
        proc = _start_proxy(kind, port, urls, args, bucket)
        try:
            _wait_http(port, proc)
            time.sleep(1.0)  # replicas join (static list: first health probes)
            _pin(proc.pid, cores["proxy"])
            cpu0 = tree_cpu_seconds(proc.pid)
            t0 = time.perf_counter()
            res = _loadgen_proc([port], args, cores["client"])
            cpu = tree_cpu_seconds(proc.pid) - cpu0
            wall = time.perf_counter() - t0
        finally:
            stop_process(proc, 15)
    # The proxy's CPU over the whole load-generator run (warm-up included), per request sent in it.
    sent = args.requests + args.warmup
    return {**res, "cpu_ms_per_request": 1000 * cpu / sent, "proxy_cpu_util": cpu / wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    ap.add_argument("--requests", type=int, default=20_000)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=2_000)
    ap.add_argument("--upstreams", type=int, default=2)
    ap.add_argument(
        "--upstream-stack",
        default="raw",
        choices=["raw", "fastapi"],
        help="raw: an asyncio protocol (the cheapest possible upstream); fastapi: uvicorn + FastAPI, vLLM's own stack",
    )
    ap.add_argument("--candidates", default="brigade", help="comma-separated: brigade, aiohttp, uvicorn_aiohttp, ...")
    ap.add_argument("--src", default="", help="run brigade's proxy from this source tree instead (a before/after)")
    ap.add_argument(
        "--pin", action="store_true", help="pin the proxy to core 0, load generator and upstreams to core 1"
    )
    # internal: the processes the benchmark starts
    ap.add_argument("--loadgen", default="", help=argparse.SUPPRESS)
    ap.add_argument("--serve-upstreams", default="", help=argparse.SUPPRESS)
    ap.add_argument("--serve-candidate", default="", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--upstream-urls", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.loadgen:
        targets = [("127.0.0.1", int(p)) for p in args.loadgen.split(",")]
        print(json.dumps(run_loadgen(targets, args.requests, args.concurrency, args.warmup)))
        return
    if args.serve_upstreams:
        serve_upstreams([int(p) for p in args.serve_upstreams.split(",")], args.upstream_stack)
        return
    if args.serve_candidate:
        serve_candidate(args.serve_candidate, args.port, args.upstream_urls.split(","))
        return

    ncores = len(os.sched_getaffinity(0))
    pin = args.pin and ncores >= 2
    cores = {"proxy": {0}, "client": {1}} if pin else {"proxy": None, "client": None}
    ports = [free_port() for _ in range(args.upstreams)]
    up = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "benchmarks.proxy.overhead",
            "--serve-upstreams",
            ",".join(map(str, ports)),
            "--upstream-stack",
            args.upstream_stack,
        ],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        up.stdout.readline()
        _pin(up.pid, cores["client"])
        cpu0 = tree_cpu_seconds(up.pid)
        t0 = time.perf_counter()
        direct = _loadgen_proc(ports, args, cores["client"])
        up_util = (tree_cpu_seconds(up.pid) - cpu0) / (time.perf_counter() - t0)
        runs = {}
        for kind in [c.strip() for c in args.candidates.split(",") if c.strip()]:
            runs[kind] = measure(kind, ports, args, cores)
            print(f"# {kind}: {json.dumps(runs[kind])}", file=sys.stderr, flush=True)
    finally:
        stop_process(up, 15)
    main_kind = "brigade" if "brigade" in runs else next(iter(runs))
    m = runs[main_kind]
    result = {
        "proxy": main_kind + (f" (from {args.src})" if args.src else ""),
        "upstream_stack": args.upstream_stack,
        "requests": args.requests,
        "concurrency": args.concurrency,
        "rps": round(m["rps"], 1),
        "direct_rps": round(direct["rps"], 1),
        "rps_vs_direct": round(m["rps"] / direct["rps"], 3),
        "cpu_ms_per_request": round(m["cpu_ms_per_request"], 4),
        "added_ms_p50": round(m["p50_ms"] - direct["p50_ms"], 3),
        "added_ms_p99": round(m["p99_ms"] - direct["p99_ms"], 3),
        "errors": m["errors"],
        "loadgen_cpu_util": round(m["cpu_util"], 3),
        "direct_loadgen_cpu_util": round(direct["cpu_util"], 3),
        "upstream_cpu_util_direct": round(up_util, 3),
        "proxy_cpu_util": round(m["proxy_cpu_util"], 3),
        "pinned": pin,
        "candidates": {
            k: {
                "rps": round(v["rps"], 1),
                "cpu_ms_per_request": round(v["cpu_ms_per_request"], 4),
                "added_ms_p50": round(v["p50_ms"] - direct["p50_ms"], 3),
                "added_ms_p99": round(v["p99_ms"] - direct["p99_ms"], 3),
                "errors": v["errors"],
            }
            for k, v in runs.items()
        },
    }
    result = with_cpu(result)
    if args.json:
        print(json.dumps(result))
    else:
        print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
