"""Session-wide fixtures: a real S3 API server on loopback, buckets of both kinds, the model, vLLM replicas, a run.

tests/ mirrors the code (bucket/, proxy/, replica/, rollout_worker/, trainer/, infra/) plus e2e/ for whole
runs. Fixtures that tests of several folders use live here; one that only one folder's tests share belongs in
that folder's conftest.py (none does yet); plain helpers are in tests/helpers.py. Slow real parts (the model
folder, vLLM replicas, the shared `brigade local` run) are session-scoped: they start once per test session,
and every process a fixture starts is stopped when the session ends.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from bucket import Store
from bucket.manifest import RunSpec, init_or_check
from infra.s3server import listen_ports
from tests.helpers import (
    LOCAL_RUN_STALENESS,
    LOCAL_RUN_STEPS,
    LOCAL_RUN_SYNC,
    SESSION_SIDECARS,
    brigade_local,
    free_port,
    new_s3_bucket,
    start_replica,
    stop,
    wait_http,
)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test of the session-wide replicas (`vllm_replicas`) runs after all the others, in their own order.

    Only one set of vLLM servers at a time on a 2-core machine: the tests that start their own (the chaos run,
    the end-to-end runs, `brigade local` cut short, the replica sidecar's) run before the shared two come up,
    and those stay up until the session ends (the drain test, last of all, stops one of them: starting a third
    replica for it cost a minute). The sort is stable: the other tests keep the order of the tree.
    """

    def order(item: pytest.Item) -> tuple[bool, bool]:
        # the drain test stops one of the shared two for good: after every other test that uses them
        shared = "vllm_replicas" in getattr(item, "fixturenames", ())
        return shared, item.get_closest_marker("drains_a_session_replica") is not None

    items.sort(key=order)


# -- buckets ------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def s3_endpoint():
    """moto's standalone S3 server on loopback, driven through s3fs like a cloud bucket."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    saved = {
        k: os.environ.get(k)
        for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION", "BRIGADE_S3_ENDPOINT_URL")
    }
    os.environ.update(
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_DEFAULT_REGION="us-east-1",
        BRIGADE_S3_ENDPOINT_URL=endpoint,
    )
    try:
        wait_http(f"{endpoint}/moto-api/", 30, proc)
        yield endpoint
    finally:
        stop(proc)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture
def local_store(tmp_path) -> Store:
    """A fresh, empty local-folder bucket: tmp_path / "bucket"."""
    s = Store(str(tmp_path / "bucket"))
    s.check_reachable(create=True)
    return s


@pytest.fixture
def s3_store(s3_endpoint) -> Store:
    """A fresh, empty bucket on the loopback S3 server."""
    s = Store(new_s3_bucket(s3_endpoint))
    s.check_reachable(create=True)
    return s


@pytest.fixture(params=["local", "s3"])
def store(request) -> Store:
    """The same contract tests run against a local folder and a real S3 API."""
    return request.getfixturevalue(f"{request.param}_store")


@pytest.fixture
def run_store(local_store):
    """A local-folder bucket holding a run (the default RunSpec, made by "test"): (its Store, its manifest)."""
    return local_store, init_or_check(local_store, RunSpec(), "test")


# -- the real model and real vLLM replicas ----------------------------------------------------------


@pytest.fixture(scope="session")
def model_dir() -> str:
    """SmolLM2-135M-Instruct as a safetensors folder, built once and cached across sessions.

    BRIGADE_HOME (or ~/.cache/brigade) holds it; the first build takes about 40 s.
    """
    from infra.prepare_model import prepare_model
    from jobkit.settings import default_model_dir

    return prepare_model(default_model_dir())


def _log_tail(path: str, lines: int = 40) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


@pytest.fixture(scope="session")
def vllm_replicas(tmp_path_factory, model_dir):
    """Two real vLLM replicas behind `brigade replica` sidecars, registered in a local-folder bucket.

    Started once per session (about a minute on CPU), each pinned to its own
    core; yields (store, [ReplicaInfo, ReplicaInfo], manifest). The sidecars
    are stopped with SIGTERM at the end, which deregisters them and stops
    their vLLM process trees. The tests that use it run last (see
    pytest_collection_modifyitems above).
    """
    from bucket import replicas

    root = tmp_path_factory.mktemp("replicas")
    store = Store(str(root / "bucket"))
    store.check_reachable(create=True)
    manifest = init_or_check(store, RunSpec(), "test")
    ncores = os.cpu_count() or 1
    procs = []
    try:
        for i in range(2):
            procs.append(
                start_replica(
                    store.url,
                    model_dir,
                    free_port(),
                    f"test-replica-{i}",
                    str(i % ncores),
                    str(root / "logs"),
                    "--replica.metrics-port",
                    str(free_port()),
                    # generation's sequences (vLLM runs control_seqs, 16, more for the probe): what
                    # tests/proxy/test_under_load.py saturates
                    "--replica.max-num-seqs",
                    "16",
                )
            )
        deadline = time.monotonic() + 420
        while True:
            infos = sorted(replicas.list_replicas(store), key=lambda r: r.replica_id)
            if len(infos) == 2:
                SESSION_SIDECARS.update({f"test-replica-{i}": proc for i, (proc, _) in enumerate(procs)})
                break
            for proc, log_path in procs:
                if proc.poll() is not None:
                    pytest.fail(f"replica sidecar exited with {proc.returncode}:\n{_log_tail(log_path)}")
            if time.monotonic() > deadline:
                pytest.fail("replicas did not register within 420 s:\n" + "\n".join(_log_tail(p) for _, p in procs))
            time.sleep(1)
        yield store, infos, manifest
    finally:
        for proc, _ in procs:
            if proc.poll() is None:
                proc.terminate()  # SIGTERM: the sidecar deregisters and stops vLLM
        for proc, _ in procs:
            stop(proc, timeout_s=60)


# -- the shared end-to-end run ----------------------------------------------------------------------


@pytest.fixture(scope="session")
def local_run(tmp_path_factory, model_dir):
    """One real `brigade local` run per test session, shared by every test that reads a finished run's
    bucket (tests/e2e/test_e2e_local.py, tests/infra/test_dashboard.py); yields (the CompletedProcess, its Store)."""
    run_dir = tmp_path_factory.mktemp("local")
    bucket = run_dir / "bucket"
    proxy_port = free_port()
    cmd = brigade_local(
        str(bucket),
        model_dir,
        "--run.num-generations",
        "4",
        "--run.max-staleness",
        str(LOCAL_RUN_STALENESS),
        "--trainer.max-steps",
        str(LOCAL_RUN_STEPS),
        "--trainer.weight-sync-steps",
        str(LOCAL_RUN_SYNC),
        "--trainer.groups-per-step",
        "2",
        "--rollout.max-completion-length",
        "8",
        "--rollout.groups-per-shard",
        "1",
        "--rollout.max-inflight-groups",
        "2",
        "--proxy.port",
        str(proxy_port),
        "--rollout.proxy-url",
        f"http://127.0.0.1:{proxy_port}",
        "--local.base-port",
        str(listen_ports(2)),  # both replicas' ports free (free_port() + 1 may be taken by another process)
        "--rollout.eval-size",  # a small held-out set: the base, every 2 versions and the final one
        "16",
        "--rollout.eval-every-versions",
        "2",
        "--rollout.eval-max-tokens",
        "16",
        "--local.max-wall-s",
        "900",
    )
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    return proc, Store(str(bucket))
