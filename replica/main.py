"""`brigade replica`: stock vLLM plus a small sidecar that makes it findable through the bucket.

The sidecar (this process):
  1. checks run.json (or a pool's pool.json: pool_mode.py) and the model
     folder, so a wrong setup fails in seconds, not after vLLM's minute-long
     start;
  2. starts vLLM as a child process with runtime LoRA loading on and waits
     for /health;
  3. registers the replica in the bucket (replicas/<id>.json) and heartbeats
     while vLLM is healthy; the proxy learns the replica set from there;
  4. when the bucket is not a local folder, mirrors committed adapters into a
     local cache, since vLLM loads adapters from local paths only (in a pool,
     every admitted run's, each in a folder of its own: pool_mirror.py);
  5. on SIGTERM/SIGINT drains: registers as draining (the proxy sends no new
     groups here, only the siblings of groups already here), waits until the
     proxy says it has nothing more here (drain.py; at most
     `drain_timeout_s`), then deregisters and stops its whole process tree; a
     second signal stops at once. When vLLM dies, it deregisters and stops at
     once.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import time

import httpx

from bucket import events, layout, replicas, tokenizer_id
from bucket.config import BucketConfig, open_bucket
from bucket.events import EventLog
from bucket.manifest import RunManifest, RunSpec
from bucket.pool import PoolManifest
from bucket.replicas import ReplicaInfo
from bucket.store import Store
from bucket.version import Version
from replica import pool_mode, vllm_version, warmup
from replica.config import ReplicaConfig
from replica.drain import wait_drained
from replica.metrics import ReplicaMetrics
from replica.mirror import AdapterMirror
from replica.pool_mirror import PoolMirror, versions_by_run
from replica.startup import advertise_url, check_model_dir, check_port_free, metrics_port, replica_id
from replica.vllm_server import ReplicaError, VllmServer, is_cpu_build, lora_roots, plan_server, scheduling_policy

log = logging.getLogger("brigade.replica")

MIRROR_POLL_S = 0.05  # one small GET of adapters/LATEST.json: a new version is copied ~50 ms after its commit


class Replica:
    def __init__(self, settings: ReplicaConfig, spec: RunSpec, bucket: BucketConfig):
        self.spec, self.bucket = spec, bucket
        self.rc = settings
        self.stop = threading.Event()
        self.draining = threading.Event()  # the first SIGTERM/SIGINT once registered: finish the work here, then stop
        self.hurry = threading.Event()  # a second one: stop now, no more waiting
        self.released = False  # the proxy said it has nothing more here (drain.py)
        self.rid = replica_id(self.rc)
        self.registered = False
        self.server: VllmServer | None = None
        self.mirror: AdapterMirror | PoolMirror | None = None
        self.pool: PoolManifest | None = None  # set when the bucket is a pool's (pool_mode.py)
        self.info: ReplicaInfo | None = None  # set once registered
        self._registry_lock = threading.Lock()
        self._own_cache_dir: str | None = None
        self._threads: list[threading.Thread] = []
        self.metrics = ReplicaMetrics(self.rid)

    # -- setup --------------------------------------------------------------
    def _adapter_root(self, store: Store, manifest: RunManifest, event_log: EventLog) -> str:
        local = store.local_path(layout.ADAPTERS)
        if local is not None:
            return local  # vLLM reads the bucket's own folder (local path or mount)
        cache_dir = self.rc.adapter_cache_dir
        if not cache_dir:
            cache_dir = self._own_cache_dir = tempfile.mkdtemp(prefix=f"brigade-adapters-{self.rid}-")
        if self.pool is not None:
            self.mirror = PoolMirror(
                store,
                cache_dir,
                on_mirrored=lambda run, v, committed_at: self._mirrored(event_log, v, committed_at, run),
                in_use=self._registered_by_run,
                on_error=self._pool_mirror_failed,
            )
            self.mirror.sync_once()  # fail now if the bucket cannot be read, not in a thread later
            return self.mirror.cache_dir
        self.mirror = AdapterMirror(
            store,
            cache_dir,
            window=manifest.max_staleness + 1,
            on_mirrored=lambda v, committed_at: self._mirrored(event_log, v, committed_at),
            in_use=self._registered_versions,
        )
        self.mirror.sync_once()  # fail now if the bucket cannot be read, not in a thread later
        return self.mirror.cache_dir

    def _vllm_headers(self) -> dict[str, str]:
        """What the sidecar's own calls to vLLM carry when vLLM was started with an API key."""
        key = os.environ.get(self.rc.api_key_env, "") if self.rc.api_key_env else ""
        return {"Authorization": f"Bearer {key}"} if key else {}

    def _registered_versions(self) -> set[Version] | None:
        """Versions vLLM has registered (it reloads an evicted one from its folder on use, and a missing folder
        kills its engine), None while that cannot be known."""
        if self.server is None or not self.server.alive():
            return None
        roots = lora_roots(self.server.plan.base_url, self._vllm_headers())
        if roots is None:
            return None
        return set(Version.among(roots, only="path"))

    def _registered_by_run(self) -> dict[str, set[Version]] | None:
        """A pool's versions vLLM has registered, by run (see `_registered_versions`)."""
        if self.server is None or not self.server.alive() or self.mirror is None:
            return None
        roots = lora_roots(self.server.plan.base_url, self._vllm_headers())
        return None if roots is None else versions_by_run(roots, self.mirror.cache_dir)

    def _mirrored(self, event_log: EventLog, version: Version, committed_at: float, run: str = "") -> None:
        path = self.mirror.path(run, version) if run else self.mirror.path(version)
        log.info("mirrored adapter %s into %s", f"{run}/{version.folder}" if run else version.folder, path)
        if run:
            self.metrics.mirrored.inc()  # the newest-version gauge is one run's: versions of runs do not compare
        else:
            self.metrics.adapter_mirrored(version)
        fields = {"run": run} if run else {}
        event_log.emit(events.ADAPTER_MIRRORED, version=version, committed_at=committed_at, path=path, **fields)

    def _pool_mirror_failed(self, run: str, exc: Exception) -> None:
        log.warning("adapter mirror of pool run %s: %s", run, exc)
        self.metrics.mirror_failures.inc()

    def _mirror_fields(self) -> dict[str, object]:
        """What the registry entry says the mirror holds (none without a mirror: vLLM reads the bucket)."""
        if isinstance(self.mirror, PoolMirror):
            return {"mirrored_runs": self.mirror.mirrored()}
        return {"mirrored": self.mirror.mirrored()} if self.mirror is not None else {}

    def _log_path(self) -> str:
        log_dir = self.rc.log_dir or tempfile.mkdtemp(prefix="brigade-replica-")
        return os.path.join(os.path.abspath(log_dir), f"vllm-{self.rid}.log")

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signals can only be handled there; whoever runs us in a thread stops us via .stop
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, frame: self._asked_to_stop())

    def _asked_to_stop(self) -> None:
        """SIGTERM/SIGINT: the first one drains a registered replica, a second one (or one while starting) stops."""
        if self.registered and self.rc.drain_timeout_s > 0 and not self.draining.is_set():
            self.draining.set()
            return
        if self.draining.is_set():
            self.hurry.set()
        self.stop.set()

    # -- background loops -----------------------------------------------------
    def _heartbeat_loop(self, store: Store, info: ReplicaInfo) -> None:
        # Beat only while vLLM answers /health: a hung server stops beating and
        # the proxy drops it, while its process is still there to be looked at.
        while not self.stop.wait(self.rc.heartbeat_s):
            if not self.server.alive():
                return
            healthy = self.server.healthy(timeout_s=max(5.0, 2 * self.rc.heartbeat_s))
            self.metrics.healthy.set(int(healthy))
            if not healthy:
                log.warning("vLLM /health failed; skipping this heartbeat")
                self.metrics.heartbeat_failures.labels("vllm_unhealthy").inc()
                continue
            if self.stop.is_set():
                return  # shutting down: do not re-register
            try:
                with self._registry_lock:  # the mirror loop rewrites the same entry when a version lands
                    for name, value in self._mirror_fields().items():
                        setattr(info, name, value)
                    replicas.heartbeat(store, info)
                self.metrics.heartbeat()
            except Exception as exc:  # a bucket hiccup must not kill a serving replica
                log.warning("heartbeat failed: %s", exc)
                self.metrics.heartbeat_failures.labels("bucket").inc()

    def _mirror_loop(self, store: Store) -> None:
        while not self.stop.wait(MIRROR_POLL_S):
            try:
                self.mirror.sync_once()  # each version copied is logged by `_mirrored`
                self._publish_mirrored(store)
            except Exception as exc:
                log.warning("adapter mirror: %s", exc)
                self.metrics.mirror_failures.inc()

    def _publish_mirrored(self, store: Store) -> None:
        """Rewrite the registry entry as soon as the mirror's contents change, not at the next heartbeat: the
        proxy sends a load here only once the version is listed (so vLLM never looks for a missing folder)."""
        info = self.info
        if info is None or self.mirror is None:
            return  # not registered yet: the registration will carry the list
        now = self._mirror_fields()
        if all(getattr(info, name) == value for name, value in now.items()):
            return
        with self._registry_lock:
            if self.stop.is_set():
                return  # shutting down: a write now would re-register us after the deregistration
            for name, value in now.items():
                setattr(info, name, value)
            replicas.register(store, info)

    def _warm_up(self, manifest: RunManifest) -> float | None:
        """The first LoRA load and use, paid before registering (replica/warmup.py); None if it failed."""
        assert self.server is not None
        with tempfile.TemporaryDirectory(prefix="brigade-warmup-") as tmp:
            try:
                warmup.zero_adapter(self.rc.model_path, manifest.lora_rank, manifest.lora_alpha, tmp)
                seconds = warmup.warm_up(self.server.plan.base_url, tmp, self._vllm_headers())
            except (OSError, KeyError, TypeError, RuntimeError, httpx.HTTPError) as exc:
                log.warning("LoRA warm-up skipped (%s: %s): the first version loads slower", type(exc).__name__, exc)
                return None
        log.info("LoRA warm-up done in %.1fs", seconds)
        return seconds

    def _start_thread(self, target, *args) -> None:
        t = threading.Thread(target=target, args=args, daemon=True, name=f"replica-{target.__name__}")
        t.start()
        self._threads.append(t)

    # -- main -------------------------------------------------------------------
    def serve(self) -> int:
        logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per health check otherwise
        store = open_bucket(self.bucket)
        serving = pool_mode.resolve(store, self.spec, self.bucket.manifest_wait_s)
        manifest, self.pool = serving.manifest, serving.pool
        check_model_dir(self.rc.model_path)
        tokenizer_id.check(manifest, self.rc.model_path, "replica")
        plan = plan_server(self.rc, manifest, cpu=is_cpu_build())
        if self.rc.check_vllm_version:
            vllm_version.check_installed()  # seconds, before vLLM's minute-long start
        check_port_free(self.rc.host, self.rc.port)
        event_log = EventLog(store, "replica", replica=self.rid)
        self._install_signal_handlers()
        if self.rc.metrics:  # up before vLLM: a scrape during the minute-long start shows it unregistered
            advertise_host = advertise_url(self.rc).split("://", 1)[1].rsplit(":", 1)[0]
            self.metrics.serve(self.rc.host, metrics_port(self.rc), advertise_host)
        try:
            adapter_root = self._adapter_root(store, manifest, event_log)
            if self.mirror is not None:
                # Mirroring goes on while vLLM starts (a minute on CPU): a replica joining a running run
                # then holds every version the proxy will give it when it registers, instead of making
                # the join wait on "No adapter found" while it catches up.
                self._start_thread(self._mirror_loop, store)
            self.server = VllmServer(plan, self._log_path())
            print(
                f"brigade replica {self.rid}: starting vLLM on {plan.base_url} "
                f"({'CPU' if plan.cpu else 'GPU'}); log: {self.server.log_path}",
                file=sys.stderr,
                flush=True,
            )
            self.server.start()
            startup_s = self.server.wait_healthy(self.rc.startup_timeout_s, should_stop=self.stop.is_set)
            if startup_s is None:
                return 0  # SIGTERM/SIGINT while starting: a requested stop, not an error
            # What really serves (extra_args, a wrapper script, a patched build), before anything relies on it.
            served = vllm_version.check_server(plan.base_url, self._vllm_headers(), refuse=self.rc.check_vllm_version)
            warmup_s = self._warm_up(manifest)
            info = ReplicaInfo(
                replica_id=self.rid,
                url=advertise_url(self.rc),
                adapter_root=adapter_root,
                base_model=manifest.base_model,
                block_size=plan.block_size,
                max_loras=plan.max_loras,
                started_at=time.time(),
                kv_blocks=self.server.kv_blocks(),
                **self._mirror_fields(),
                priority_scheduling=scheduling_policy(plan.argv) == "priority",
                max_num_seqs=self.rc.max_num_seqs,
                control_seqs=self.rc.control_seqs if self.rc.max_num_seqs else 0,
            )
            # The started event goes first: once registered, the proxy may load adapters here at once (a
            # registration write that S3 applied and answered 500 to is seen during its retry), and a started
            # event stamped after those loads reads as a restart that lost them (a 20-minute chaos run's audit
            # counted such a join as admitted without its live versions).
            event_log.emit(
                events.REPLICA_STARTED,
                url=info.url,
                startup_s=round(startup_s, 1),
                warmup_s=None if warmup_s is None else round(warmup_s, 2),
                adapter_root=adapter_root,
                metrics_url=self.metrics.url,
                vllm_version=served,
            )
            with self._registry_lock:
                replicas.register(store, info)
                self.info = info
            self.registered = True
            self.metrics.started(info.url, startup_s)
            print(
                f"brigade replica {self.rid}: healthy after {startup_s:.0f}s, registered as {info.url} "
                f"(adapters from {adapter_root})",
                file=sys.stderr,
                flush=True,
            )
            if self.pool is not None:
                print(pool_mode.describe(self.pool, plan.max_loras, manifest.lora_rank), file=sys.stderr, flush=True)
            self._start_thread(self._heartbeat_loop, store, info)
            drained: dict[str, object] = {}
            while not self.stop.wait(0.5):
                self._check_vllm()
                if self.draining.is_set():
                    drained = self._drain(store, info)
                    self._check_vllm()
                    break
            event_log.emit(events.REPLICA_STOPPED, reason="signal", **drained)
            return 0
        finally:
            self._shutdown(store)

    def _check_vllm(self) -> None:
        if not self.server.alive():
            raise ReplicaError(
                f"vLLM exited with code {self.server.proc.returncode}. "
                f"Last lines of {self.server.log_path}:\n{self.server.log_tail()}"
            )

    def _drain(self, store: Store, info: ReplicaInfo) -> dict[str, object]:
        """Finish the work here before leaving (drain.py): registered as draining, the proxy sends no new groups,
        only the siblings of groups already here, and says when it has nothing more here."""
        print(
            f"brigade replica {self.rid}: draining (no new groups; at most {self.rc.drain_timeout_s:.0f}s, "
            "a second signal stops at once)",
            file=sys.stderr,
            flush=True,
        )
        with self._registry_lock:
            info.draining = True  # every later write (heartbeat, mirror) carries it too
            try:
                replicas.register(store, info)
            except Exception as exc:  # the next heartbeat writes it again
                log.warning("could not register as draining: %s", exc)
        self.metrics.draining.set(1)
        result = wait_drained(
            self.server,
            store,
            info,
            drain_s=self.rc.drain_s,
            drain_timeout_s=self.rc.drain_timeout_s,
            stop=self.stop,
        )
        self.released = result.outcome == "released"
        return result.fields()

    def _shutdown(self, store: Store) -> None:
        self.stop.set()
        # Threads first: a heartbeat landing after the deregistration would re-register us.
        for t in self._threads:
            t.join(timeout=15)
        # Then deregister, so the proxy stops routing here before vLLM goes away.
        if self.registered:
            try:
                replicas.deregister(store, self.rid)
                self.metrics.registered.set(0)
            except Exception as exc:
                log.warning("could not deregister %s: %s", self.rid, exc)
            # A clean leave: requests the proxy sends before it notices are still answered (none once the
            # proxy released this replica: it routes nothing here since).
            waits = self.rc.drain_s > 0 and not self.hurry.is_set() and not self.released
            if self.server is not None and self.server.alive() and waits:
                log.info("deregistered; serving %.1fs more before stopping vLLM", self.rc.drain_s)
                self.hurry.wait(self.rc.drain_s)
        if self.server is not None:
            self.server.stop()
        self.metrics.close()
        if self._own_cache_dir:
            shutil.rmtree(self._own_cache_dir, ignore_errors=True)


def run(settings: ReplicaConfig, spec: RunSpec, bucket: BucketConfig) -> int:
    try:
        return Replica(settings, spec, bucket).serve()
    except ReplicaError as exc:
        # Reported like the CLI's ConfigError/BucketError: one clean message, no traceback.
        print(f"brigade replica: error: {exc}", file=sys.stderr)
        return 2
