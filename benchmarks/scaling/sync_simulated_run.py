"""The measurement of benchmarks/scaling/sync_simulated.py: each replica count's syncs, and who had the CPU meanwhile.

    python -m benchmarks.scaling.sync_latency --simulated-replicas 2,16,64 --json [--versions 20] [--pin-proxy]

Besides the latencies, each count says how the cores were shared while it was measured: the proxy's CPU
(per version, per forwarded request), this process's (`bench_cpu_util`: the simulated replicas and the load),
everyone else's on the machine (`others_cpu_util`: this machine is shared, and `flock` holds off only those
who take the lock), and where the proxy ran (`proxy_cpus`: its own core with --pin-proxy, else anywhere).

This process does not collect cyclic garbage while a count is measured (`gc.freeze` after the set-up, then
`gc.disable`; what it would have collected is collected after, `bench_cyclic_garbage` objects, a few MB at
most). Its collector's full passes took 35-80 ms every ~5 s, stalling all N simulated replicas and the load
at once, which no real fleet does; the proxy's own collector is left as it is, being part of what is measured.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import tempfile
import time
from typing import Any

import uvloop

from benchmarks.report import percentile
from benchmarks.scaling.sync_simulated import CONTROL_SEQS, GAP_S, Bench
from bucket import events


def proxy_cpu_s(pid: int) -> float:
    """utime + stime of one process (the proxy is one process: no children to add)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_cpu_s() -> float:
    """CPU seconds every process on this machine has used (/proc/stat: all but idle and iowait): less the proxy's
    and this process's, what others took from the same cores meanwhile (this machine is shared)."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:9]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


async def _loop_lag(lags: list[float]) -> None:
    """How late this process's loop wakes up: if it is late, the simulated replicas answer late too."""
    while True:
        t0 = time.monotonic()
        await asyncio.sleep(0.02)
        lags.append(time.monotonic() - t0 - 0.02)


async def measure(bench: Bench, versions: int) -> dict[str, Any]:
    servers: list[Any] = []  # the simulated replicas' listening sockets and their heartbeat
    clients: list[asyncio.Task] = []
    try:
        await bench.start(servers)
        lags: list[float] = []
        clients += [asyncio.create_task(c) for c in [bench.watch_live(), _loop_lag(lags)]]
        # every sequence running and as many waiting in the proxy
        clients += [asyncio.create_task(bench.generate(k)) for k in range(2 * bench.max_num_seqs * bench.n)]
        await bench.publish_and_wait(seed=10_000)  # a first version, unmeasured: the load moves onto it
        await asyncio.sleep(3)
        pid = bench.proc.pid  # type: ignore[union-attr]
        gc.collect()  # this process's collector stays off while measuring (the module's docstring says why)
        gc.freeze()
        gc.disable()
        cpu0, ok0 = proxy_cpu_s(pid), bench.counts["ok"]
        await asyncio.sleep(4)  # the proxy's CPU per forwarded request, without syncs
        per_request = (proxy_cpu_s(pid) - cpu0) / max(1, bench.counts["ok"] - ok0)
        lags.clear()
        cpu0, t0, ok0 = proxy_cpu_s(pid), time.monotonic(), bench.counts["ok"]
        own0, all0 = time.process_time(), machine_cpu_s()
        done = []
        for i in range(versions):
            done.append(await bench.publish_and_wait(seed=i))
            await asyncio.sleep(GAP_S)
        wall, cpu = time.monotonic() - t0, proxy_cpu_s(pid) - cpu0
        own = time.process_time() - own0
        others = machine_cpu_s() - all0 - cpu - own
        ok, end, errors = bench.counts["ok"] - ok0, time.time(), bench.counts["errors"]
        cyclic = gc.collect()  # what its collector would have freed meanwhile
    finally:
        gc.enable()
        gc.unfreeze()
        # The clients, the proxy (off this loop: the replicas answer it as it drains), then the replicas.
        for task in clients:
            task.cancel()
        await asyncio.gather(*clients, return_exceptions=True)
        await asyncio.to_thread(bench.stop)
        for item in servers:
            item.cancel() if isinstance(item, asyncio.Task) else item.close()
    evs = events.read_all(bench.store)
    loads: dict[int, list[dict[str, Any]]] = {int(d["loaded_all"]["version"]): [] for d in done}
    for e in evs:
        if e["kind"] == events.LOADED and e.get("version") in loads and "load_s" in e:
            loads[e["version"]].append(e)
    alls = [d["loaded_all"] for d in done]
    synced = [a["started_at"] + a["seconds"] - d["committed"] for a, d in zip(alls, done)]
    p95 = lambda xs: round(percentile(xs, 95), 4) if xs else None  # noqa: E731
    return {
        "versions": len(done),
        # loaded on every replica: when the fan-out finished (its probes passed; /live_adapters names it then),
        # on the proxy's clock; the events that say so land `events_p95_s` later (event_written_p95_s)
        "p50_s": round(percentile(synced, 50), 4),
        "p95_s": p95(synced),
        "max_s": round(max(synced), 4),
        "event_written_p95_s": p95([a["ts"] - d["committed"] for a, d in zip(alls, done)]),
        "live_p95_s": p95([d["live"] - d["committed"] for d in done]),
        "detect_p95_s": p95([a["started_at"] - d["committed"] for a, d in zip(alls, done)]),
        "fanout_p95_s": p95([a["seconds"] for a in alls]),
        "replica_load_p95_s": p95([max(e["load_s"] for e in es) for es in loads.values() if es]),
        "replica_probe_p95_s": p95([max(e["seconds"] - e["load_s"] for e in es) for es in loads.values() if es]),
        "events_p95_s": p95([a["ts"] - a["started_at"] - a["seconds"] for a in alls]),
        "proxy_cpu_s_per_version": round(cpu / len(done), 3),
        "proxy_cpu_sync_s_per_version": round((cpu - per_request * ok) / len(done), 3),
        "proxy_cpu_util": round(cpu / wall, 3),
        "proxy_cpu_ms_per_request_without_syncs": round(1000 * per_request, 3),
        "false_ejections": sum(e["kind"] == events.REPLICA_EJECTED and e["ts"] <= end for e in evs),
        "adapter_load_failures": sum(e["kind"] == events.LOAD_FAILED and e["ts"] <= end for e in evs),
        "load_errors": errors,
        "generated_requests_per_s": round(ok / wall, 1),
        "saturated_requests_per_s": round(bench.n * bench.max_num_seqs / (bench.tokens * bench.step_s), 1),
        "bench_loop_lag_p95_ms": round(1000 * percentile(lags, 95), 1) if lags else None,
        # Who else used the cores meanwhile, in cores: this process (the simulated replicas and the load), and
        # everything else on the machine (other engineers' work: `flock` holds off only those who take the lock)
        "bench_cpu_util": round(own / wall, 3),
        "others_cpu_util": round(others / wall, 3),
        "proxy_cpus": sorted(bench.proxy_cpus) if bench.proxy_cpus else None,
        "bench_cyclic_garbage": cyclic,
        "sim_bad_requests": sum(len(sim.bad_requests) for sim in bench.sims),
    }


def run_simulated(
    counts: list[int], versions: int, max_num_seqs: int, tokens: int, step_s: float, pin: bool = False
) -> dict[str, Any]:
    """Every replica count in turn, each with its own proxy and bucket; `p95_64_vs_2` the goal's ratio. `pin`:
    the proxy on a core of its own (the last this process may use), this process on the others."""
    tmp = tempfile.mkdtemp(prefix="brigade-sync-simulated-")
    by_replicas: dict[str, Any] = {}
    cores = os.sched_getaffinity(0)
    proxy_cpus = {max(cores)} if pin and len(cores) > 1 else None
    if proxy_cpus:  # before any thread starts: threads keep the affinity of the thread that started them
        os.sched_setaffinity(0, cores - proxy_cpus)
    try:
        for n in counts:
            folder = tempfile.mkdtemp(prefix=f"replicas-{n}-", dir=tmp)
            bench = Bench(folder, n, max_num_seqs, tokens, step_s, proxy_cpus)
            try:  # the load and N replicas share this process's one loop: uvloop's costs less per request
                by_replicas[str(n)] = uvloop.run(measure(bench, versions))
            except Exception as exc:  # noqa: BLE001 - the other counts still run; the error says where to look
                by_replicas[str(n)] = {"error": f"{type(exc).__name__}: {exc}"}
            print(f"sync_simulated {n}: {json.dumps(by_replicas[str(n)])}", flush=True)  # kept should a later fail
    finally:
        os.sched_setaffinity(0, cores)
    first, last = by_replicas[str(counts[0])], by_replicas[str(counts[-1])]
    ratio = last["p95_s"] / first["p95_s"] if first.get("p95_s") and last.get("p95_s") else None
    return {
        **{"mode": "simulated", "max_num_seqs": max_num_seqs, "control_seqs": CONTROL_SEQS},
        **{"completion_tokens": tokens, "step_s": step_s, "by_replicas": by_replicas},
        f"p95_{counts[-1]}_vs_{counts[0]}": round(ratio, 3) if ratio else None,
        **{f"p95_{n}": by_replicas[str(n)].get("p95_s") for n in counts},  # flat, for a record's figure
        "logs": tmp,
    }
