"""The runs a pool admitted: admission against the replicas' adapter slots, leases, detach, live windows.

Every replica of the pool must hold every admitted run's live window at once (a version is loaded on all
of them or none: adapters/fanout.py), so the slots a pool has are the smallest `--max-loras` among its
replicas, and a run needs `max_staleness + 2` of them (bucket.pool.live_window). A run is admitted only
while the windows of all admitted runs fit; it keeps its slots while it renews its lease, and frees them
when it detaches or its lease lapses (its adapters are unloaded everywhere). A run with several rollout
workers is held by each of them (they name themselves: `worker`): one worker leaving detaches nothing while
another still holds a lease, so its generations keep their adapters; the last one leaving detaches the run.

Each renewal may carry the run's pace (bucket.pool.RunPace: its trainer's waiting share and unread backlog,
read by its rollout worker from the run's own bucket); the latest per run is kept until the run detaches,
for the pool's autoscaler (`reports`, proxy/scaling/pool_signals.py).

Admitted runs are written to runs/<run_id>.json in the pool's bucket. A restarted proxy reads them back,
gives each a fresh lease (nobody could renew while it was down) and adopts the versions its replicas still
serve for them (`adopt`); the window and the lease then apply as before.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from pydantic import BaseModel, Field, ValidationError

from bucket import adapters, events, pool
from bucket.canary import read_canary
from bucket.pool import AttachedRun, PoolManifest, RunPace
from bucket.replicas import ReplicaInfo
from bucket.version import BadVersion, Version
from proxy.adapters.fanout import AdapterFanout
from proxy.adapters.lifecycle import live_answer, oldest_kept, unload_stale, versions_of
from proxy.event_writer import EventWriter
from proxy.lora_paths import AdapterRef
from proxy.pool.access import Denied
from proxy.replicas.upstream import Upstream
from proxy.scaling.pool_signals import RunReport
from proxy.serving.slots import run_of_model
from proxy.state import ProxyState

log = logging.getLogger("brigade.proxy")


class Attach(BaseModel):
    """The body of POST /pool/runs/{run_id}."""

    base_model: str
    max_staleness: int = Field(ge=0)
    weight: float = Field(1.0, gt=0, allow_inf_nan=False)
    worker: str = Field("", max_length=200)  # which of the run's rollout workers asks ("": it does not say)


class PoolRuns:
    """The admitted runs, their leases and the versions live for each."""

    def __init__(
        self, state: ProxyState, fanout: AdapterFanout, events: EventWriter, manifest: PoolManifest, upstream: Upstream
    ) -> None:
        self.state, self.fanout, self.events, self.upstream = state, fanout, events, upstream
        self.base_model = manifest.base_model
        self.runs: dict[str, AttachedRun] = {}
        self.latest: dict[str, Version] = {}  # each run's newest version committed in the pool's bucket
        self.loading: dict[str, Version] = {}  # a push being loaded, per run
        # run -> its workers that named themselves -> when each one's lease ends (kept in memory: after a proxy
        # restart the workers' next renewals name them again)
        self.holders: dict[str, dict[str, float]] = {}
        self.paces: dict[str, tuple[RunPace, float]] = {}  # run -> its latest reported pace, when (monotonic)
        self._writes = asyncio.Lock()  # runs/ writes, one at a time: a late lease write never outlives a detach

    @property
    def timeout_s(self) -> float:
        return self.state.config.pool_run_timeout_s

    # -- capacity -----------------------------------------------------------------------------------
    def slots(self) -> tuple[int, int] | Denied:
        """(adapter slots every replica has, replicas counted), or why the pool cannot tell yet."""
        infos = list(self.state.routable.values())
        known = [n for n in map(self._slots_of, infos) if n]
        if known:
            return min(known), len(known)
        if not infos:
            return Denied(
                503,
                "no replica serves this pool yet, so its adapter slots (the smallest --max-loras among its "
                "replicas) are unknown: attach again once a replica has joined (GET /health says when)",
            )
        return Denied(
            503,
            f"the pool's {len(infos)} replicas do not say their --max-loras (static replica_urls): set "
            "proxy.pool_max_loras to the --max-loras they were started with",
        )

    def _slots_of(self, info: ReplicaInfo) -> int:
        """A replica's --max-loras as it registered it, else proxy.pool_max_loras (0: unknown)."""
        return info.max_loras or self.state.config.pool_max_loras

    def too_small(self, info: ReplicaInfo) -> str | None:
        """Why a replica may not join: fewer adapter slots than the admitted runs' live windows (None: it fits).

        Admission counts the replicas serving when a run attaches; one that joins later with a smaller
        --max-loras would have vLLM evict adapters still in use (reloaded from disk on every switch)."""
        slots = self._slots_of(info)
        used = sum(a.live_window for a in self.runs.values())
        if not slots or used <= slots:
            return None
        return (
            f"it holds {slots} adapters (--max-loras {slots}) and the pool's runs {', '.join(sorted(self.runs))} "
            f"hold {used} adapter slots: restart it with --max-loras {used} or more, or wait for a run to leave"
        )

    def _no_room(self, run_id: str, want: Attach, slots: int, replicas: int) -> str | None:
        others = {r: a for r, a in self.runs.items() if r != run_id}
        used = sum(a.live_window for a in others.values())
        need = pool.live_window(want.max_staleness)
        if used + need <= slots:
            return None
        where = f"(the smallest --max-loras among {replicas} replica{'s' if replicas != 1 else ''})"
        if others:
            names = ", ".join(sorted(others))
            held = f"run{'s' if len(others) > 1 else ''} {names} hold{'' if len(others) > 1 else 's'} {used} of "
            held += f"{slots} adapter slots {where}"
        else:
            held = f"no run holds any of the {slots} adapter slots {where}"
        message = (
            f"{held}; run {run_id} needs {need} (max_staleness {want.max_staleness} + {need - want.max_staleness}): "
            f"raise --max-loras on the replicas, lower {run_id}'s max_staleness"
            + (", or wait for a run to leave" if others else "")
        )
        known = self.runs.get(run_id)
        if known is not None:
            message += f"; {run_id} stays attached as it was (max_staleness {known.max_staleness})"
        return message

    # -- admission, leases, detach ------------------------------------------------------------------
    async def admit(self, run_id: str, body: Any) -> tuple[int, dict[str, Any]] | Denied:
        """Admit `run_id` (201), or update it when already admitted (200), or say why not."""
        try:
            want = Attach(**body) if isinstance(body, dict) else None
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
            return Denied(400, f"the body of POST /pool/runs/{run_id} is not valid: {problems}")
        if want is None:
            return Denied(400, 'the body must be a JSON object {"base_model": ..., "max_staleness": ..., "weight": 1}')
        if want.base_model != self.base_model:
            return await self._refuse(
                run_id,
                "base_model",
                409,
                f"run {run_id} uses {want.base_model!r}; this pool serves {self.base_model!r}: train the run on "
                f"{self.base_model!r}, or attach it to a pool that serves {want.base_model!r}",
            )
        capacity = self.slots()
        if isinstance(capacity, Denied):
            return await self._refuse(run_id, "capacity_unknown", capacity.status, capacity.message)
        slots, replicas = capacity
        message = self._no_room(run_id, want, slots, replicas)
        if message is not None:
            return await self._refuse(run_id, "capacity", 409, message)
        known = self.runs.get(run_id)
        now = time.time()
        run = AttachedRun(
            run_id=run_id,
            base_model=want.base_model,
            max_staleness=want.max_staleness,
            weight=want.weight,
            admitted_at=known.admitted_at if known else now,
            lease_until=now + self.timeout_s,
        )
        self.runs[run_id] = run
        self._hold(run_id, want.worker, run.lease_until)
        if run_id not in self.latest:
            latest = await asyncio.to_thread(adapters.latest_version, self.state.store, pool.adapters_folder(run_id))
            if latest is not None:
                self.latest[run_id] = latest
        await self._write(run)
        used = sum(a.live_window for a in self.runs.values())
        await self.events.emit(
            events.RUN_ADMITTED,
            run=run_id,
            weight=run.weight,
            max_staleness=run.max_staleness,
            live_window=run.live_window,
            slots_used=used,
            slots=slots,
            replicas=replicas,
            reattached=known is not None,
        )
        verb = "re-attached" if known else "admitted"
        log.info("run %s %s: %d of %d adapter slots now held", run_id, verb, used, slots)
        return (200 if known else 201), {
            "run": run.model_dump(),
            "lease_s": self.timeout_s,
            "pace_window_s": self.pace_window_s,
        }

    @property
    def pace_window_s(self) -> float:
        """The window a run's pace is measured over for the pool's autoscaler (0: it is off, send none)."""
        config = self.state.config
        return config.scale_window_s if config.scale_interval_s > 0 else 0.0

    async def _refuse(self, run_id: str, reason: str, status: int, message: str) -> Denied:
        log.warning("run %s refused: %s", run_id, message)
        await self.events.emit(events.RUN_REFUSED, run=run_id, reason=reason, message=message)
        return Denied(status, message)

    async def renew(self, run_id: str, worker: str = "", pace: RunPace | None = None) -> float | None:
        """Extend the run's lease (and `worker`'s hold on it), keeping the pace it reported (None: it sent none,
        the last one stands); None when it is not admitted (attach again)."""
        run = self.runs.get(run_id)
        if run is None:
            return None
        run.lease_until = time.time() + self.timeout_s
        self._hold(run_id, worker, run.lease_until)
        if pace is not None:
            self.paces[run_id] = (pace, time.monotonic())
        await self._write(run)
        return run.lease_until

    def reports(self) -> dict[str, RunReport]:
        """Every admitted run, its weight and its latest pace: what the pool's autoscaler sums (app.py wires it)."""
        now = time.monotonic()
        out = {}
        for run_id, run in self.runs.items():
            pace, at = self.paces.get(run_id, (None, None))
            out[run_id] = RunReport(run.weight, pace, None if at is None else now - at)
        return out

    def _hold(self, run_id: str, worker: str, until: float) -> None:
        if worker:
            self.holders.setdefault(run_id, {})[worker] = until

    def _release(self, run_id: str, worker: str) -> list[str]:
        """Drop `worker`'s hold on the run; the other workers whose leases still run."""
        held = self.holders.get(run_id, {})
        held.pop(worker, None)
        now = time.time()
        return sorted(w for w, until in held.items() if until >= now)

    async def leave(self, run_id: str, worker: str = "") -> dict[str, Any]:
        """A worker of the run leaves: the run detaches unless another of its workers still holds it."""
        others = self._release(run_id, worker) if worker else []
        if others and run_id in self.runs:
            log.info("worker %s of run %s left; the run stays attached for %s", worker, run_id, ", ".join(others))
            return {"run": run_id, "was_attached": True, "unloaded": [], "failed": {}, "held_by": others}
        return await self.detach(run_id, "left")

    async def detach(self, run_id: str, reason: str) -> dict[str, Any]:
        """Forget the run and unload its adapters from every replica (reason: left | lease_lapsed)."""
        run = self.runs.pop(run_id, None)
        self.holders.pop(run_id, None)
        self.paces.pop(run_id, None)  # its pace expires with it: a run that left says nothing about the pool's
        self.latest.pop(run_id, None)
        names = sorted(ad.lora_name for ad in self.state.loaded.values() if ad.pool_run == run_id)
        failed: dict[str, str] = {}
        for name in names:
            resp = await self.fanout.unload(name)
            if resp.status_code != 200:
                failed[name] = resp.body.decode(errors="replace")[:300]
        async with self._writes:
            try:
                await asyncio.to_thread(pool.remove_run, self.state.store, run_id)
            except Exception as exc:  # noqa: BLE001 - the run is gone here; a restart would re-admit it briefly
                log.warning("could not remove %s: %s", pool.run_key(run_id), exc)
        if run is not None:
            await self.events.emit(events.RUN_DETACHED, run=run_id, reason=reason, unloaded=names, failed=failed)
            log.info("run %s detached (%s); unloaded %s", run_id, reason, names or "nothing")
        return {"run": run_id, "was_attached": run is not None, "unloaded": names, "failed": failed}

    async def _write(self, run: AttachedRun) -> None:
        """runs/<run_id>.json, unless the run left meanwhile (a lease write never brings a detached run back)."""
        async with self._writes:
            if self.runs.get(run.run_id) is not run:
                return
            try:
                await asyncio.to_thread(pool.write_run, self.state.store, run)
            except Exception as exc:  # noqa: BLE001 - the admission holds in this proxy; the next renewal rewrites
                log.warning("could not write %s: %s", pool.run_key(run.run_id), exc)

    # -- live versions ------------------------------------------------------------------------------
    def versions(self, run_id: str) -> dict[Version, AdapterRef]:
        return versions_of(self.state.loaded, run_id, pool_run=True)

    def retired(self, model: str) -> str | None:
        """Why a generation naming `model` is not sent to a replica any more (None: it may be): a version of
        an admitted run older than that run's newest live one - max_staleness.

        Its samples would be dropped by the run's trainer (older than max_staleness), and sending it would
        keep the version in use on the replicas: a run whose requests wait long behind other runs' would
        hold a dozen versions there (the shared_pool benchmark: up to 29 on one replica with --max-loras 10,
        each version's LoRA evicted and read again by vLLM, a third of the pool's throughput lost). The
        rollout worker generates the group again with a live version."""
        run_id = run_of_model(model)
        run = self.runs.get(run_id) if run_id else None
        if run is None:
            return None
        live = self.versions(run_id)
        if not live:
            return None
        low = oldest_kept(live, run.max_staleness)
        version = Version.parse(model, only="lora_name")
        if version >= low:
            return None
        keep = ", ".join(ad.lora_name for v, ad in sorted(live.items()) if v >= low)
        return (
            f"{model} is past run {run_id}'s staleness window (max_staleness {run.max_staleness}; live: {keep}): "
            "its samples would not be trained on, so it was not generated; generate with a live version"
        )

    def live(self, run_id: str) -> dict[str, Any]:
        """One run's `GET /live_adapters` (the single-run answer's shape)."""
        return live_answer(run_id, self.versions(run_id), self.latest.get(run_id), self.loading.get(run_id), True)

    async def tick(self) -> None:
        """Detach runs whose lease lapsed, keep each run's window, unload what runs that left still hold."""
        now = time.time()
        for run_id, run in list(self.runs.items()):
            if run.lease_until < now:
                await self.detach(run_id, "lease_lapsed")
        for run_id, run in list(self.runs.items()):
            await unload_stale(self.state, self.fanout, self.versions(run_id), run.max_staleness)
        # A push whose load ended after its run left, or a version a restarted proxy adopted for a run gone since.
        for name in [ad.lora_name for ad in self.state.loaded.values() if ad.pool_run and ad.pool_run not in self.runs]:
            await self.fanout.unload(name)

    # -- a restarted proxy ----------------------------------------------------------------------------
    async def restore(self) -> None:
        """The runs admitted before a restart, each with a fresh lease."""
        store = self.state.store
        found = await asyncio.to_thread(pool.read_runs, store)
        for run_id, run in found.items():
            run.lease_until = time.time() + self.timeout_s
            self.runs[run_id] = run
            latest = await asyncio.to_thread(adapters.latest_version, store, pool.adapters_folder(run_id))
            if latest is not None:
                self.latest[run_id] = latest
        if found:
            log.info("runs admitted before this proxy started: %s", ", ".join(sorted(found)))

    async def adopt(self, replicas: list[ReplicaInfo]) -> None:
        """Remember the committed pool versions the replicas already serve (before they join: each joiner is
        then given all of them, as after a single-run proxy's restart). Those of runs gone since are unloaded
        by the next `tick`."""
        loaded = self.state.loaded
        for info in replicas:
            try:
                resp = await self.upstream.probe(info, "/v1/models")
                cards = resp.json().get("data", []) if resp.status_code == 200 else []
            except Exception:  # noqa: BLE001 - a replica that does not answer now joins later like any other
                continue
            for card in cards if isinstance(cards, list) else []:
                name, root = card.get("id"), card.get("root")
                if not card.get("parent") or not isinstance(name, str) or not isinstance(root, str) or name in loaded:
                    continue
                try:
                    version = Version.parse(root, only="path")
                    run_id = pool.check_run_id(root.rstrip("/").rsplit("/", 2)[-2])
                except (BadVersion, pool.BadRunId, IndexError):
                    continue
                if name != version.lora_name(run_id):
                    continue  # not a pool version under its own name
                root_key = pool.adapters_folder(run_id)
                marker = await asyncio.to_thread(adapters.commit_marker, self.state.store, version, root_key)
                if marker is None:
                    continue
                loaded[name] = AdapterRef(name, version, read_canary(marker), pool_run=run_id)
                log.info("adopted %s (%s/%s) already served by %s", name, run_id, version.folder, info.replica_id)
