"""Shared fixtures: a real S3 API server on loopback, buckets of both kinds.

Slow real parts (the model folder, vLLM replicas) are session-scoped: they
start once per test session, and every process a fixture starts is stopped
when the session ends.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid

import httpx
import pytest

from bucket import Store, adapters
from bucket.manifest import RunSpec
from jobkit.cpu import cpu_class

# Machines of this kind come with an AVX-512 CPU or an AVX2-only one about 4x slower for vLLM and the trainer
# (issue 17); ATEN_CPU_CAPABILITY=avx2 / ONEDNN_MAX_CPU_ISA=AVX2 make jobkit.cpu report the slow kind here too.
SLOW = 4.0 if cpu_class() == "avx2" else 1.0


def host_timeout(seconds: float) -> float:
    """A bound on real work (vLLM start-up, generation, training) tuned on the fast CPU, stretched by SLOW.

    For bounds close to what the work takes on the fast CPU; a bound that only catches a hang stays as it is.
    """
    return seconds * SLOW


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout_s: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process serving {url} exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=2).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} not up after {timeout_s}s")


def stop(proc: subprocess.Popen, timeout_s: float = 20) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


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


def new_s3_bucket(endpoint: str) -> str:
    name = f"brigade-test-{uuid.uuid4().hex[:10]}"
    Store(f"s3://{name}").fs.mkdir(name)
    return f"s3://{name}/run"


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path) -> Store:
    """The same contract tests run against a local folder and a real S3 API."""
    if request.param == "local":
        s = Store(str(tmp_path / "bucket"))
        s.check_reachable(create=True)
        return s
    endpoint = request.getfixturevalue("s3_endpoint")
    s = Store(new_s3_bucket(endpoint))
    s.check_reachable(create=True)
    return s


# -- the real model and real vLLM replicas ----------------------------------------------------------

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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


def start_replica(
    bucket_url: str,
    model_dir: str,
    port: int,
    replica_id: str,
    cpu_threads: str,
    log_dir: str,
    *extra: str,
    env: dict[str, str] | None = None,
) -> tuple[subprocess.Popen, str]:
    """`brigade replica` as its own process (the code path a deployment uses); returns it and its log path."""
    os.makedirs(log_dir, exist_ok=True)
    log_path = os.path.join(log_dir, f"sidecar-{replica_id}.log")
    cmd = [
        sys.executable,
        "-m",
        "infra.cli",
        "replica",
        "--bucket",
        bucket_url,
        "--replica.model-path",
        model_dir,
        "--replica.port",
        str(port),
        "--replica.replica-id",
        replica_id,
        "--replica.cpu-threads",
        cpu_threads,
        "--replica.log-dir",
        log_dir,
        "--replica.heartbeat-s",
        "1",
        "--replica.kv-cache-gib",
        "1",
        *extra,
    ]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            cmd, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
    return proc, log_path


@pytest.fixture(scope="session")
def vllm_replicas(tmp_path_factory, model_dir):
    """Two real vLLM replicas behind `brigade replica` sidecars, registered in a local-folder bucket.

    Started once per session (about a minute on CPU), each pinned to its own
    core; yields (store, [ReplicaInfo, ReplicaInfo], manifest). The sidecars
    are stopped with SIGTERM at the end, which deregisters them and stops
    their vLLM process trees.
    """
    from bucket import replicas
    from bucket.manifest import init_or_check

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
                )
            )
        deadline = time.monotonic() + 420
        while True:
            infos = sorted(replicas.list_replicas(store), key=lambda r: r.replica_id)
            if len(infos) == 2:
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

LOCAL_RUN_STEPS, LOCAL_RUN_SYNC, LOCAL_RUN_STALENESS = 6, 2, 2


def brigade_local(bucket: str, model_dir: str, *flags: str) -> list[str]:
    """The command line of `brigade local` on `bucket`, every job on the test model, then `flags`."""
    head = [sys.executable, "-m", "infra.cli", "local", "--bucket", str(bucket)]
    return [*head, "--trainer.model-path", model_dir, "--replica.model-path", model_dir, *flags]


@pytest.fixture(scope="session")
def local_run(tmp_path_factory, model_dir):
    """One real `brigade local` run per test session, shared by every test that reads a finished run's
    bucket (tests/test_e2e_local.py, tests/test_dashboard.py); yields (the CompletedProcess, its Store)."""
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
        str(free_port()),
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


def make_adapter_files(model_dir: str, out_dir: str, seed: int = 0) -> dict[str, bytes]:
    """A real rank-1 peft adapter on the model, with B non-zero so that it changes what the model says."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    torch.manual_seed(seed)
    spec = RunSpec()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft_model = get_peft_model(
        model,
        LoraConfig(
            r=spec.lora_rank, lora_alpha=spec.lora_alpha, target_modules=spec.lora_target_modules, lora_dropout=0.0
        ),
    )
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    peft_model.save_pretrained(out_dir)
    return {name: open(os.path.join(out_dir, name), "rb").read() for name in adapters.ADAPTER_FILES}
