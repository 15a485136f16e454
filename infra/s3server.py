"""A loopback S3 server for trying the object-store path on one machine (`brigade local --local.s3-server true`).

It is moto's standalone server (the same one the tests and s3fs's own test
suite use), so every job goes through s3fs and botocore exactly as against a
cloud bucket. Its objects live in the server's memory: they are gone when
the run ends, which is why `brigade local` writes its summary before
stopping it.
"""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from bucket.config import ConfigError
from bucket.store import Store
from jobkit.processes import stop_process

# moto accepts any credentials; the jobs need some, or botocore's chain stops at "no credentials".
LOOPBACK_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "brigade-local",
    "AWS_SECRET_ACCESS_KEY": "brigade-local",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def listen_ports(n: int) -> int:
    """The first of `n` consecutive ports free now, below the kernel's ephemeral range: an ephemeral port
    can be taken by any outgoing connection (S3 traffic is plenty) before a replica binds it."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low = int(f.read().split()[0])
    for _ in range(200):
        base = random.randrange(max(1024, low - 12000), low - 1100)  # a sidecar's /metrics is port + 1000
        socks: list[socket.socket] = []
        try:
            for port in range(base, base + n):
                socks.append(socket.socket())
                socks[-1].bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    return free_port()


@dataclass
class LoopbackS3:
    """A running moto server; `env` is what every job of the run needs to reach it."""

    proc: subprocess.Popen
    endpoint: str
    log_path: str

    @property
    def env(self) -> dict[str, str]:
        return {**LOOPBACK_CREDENTIALS, "BRIGADE_S3_ENDPOINT_URL": self.endpoint}

    def stop(self, timeout_s: float = 10) -> None:
        stop_process(self.proc, timeout_s)


def start_loopback_s3(log_path: str, port: int = 0, timeout_s: float = 30) -> LoopbackS3:
    """Start moto's S3 server on 127.0.0.1 (a free port unless `port`) and wait until it answers."""
    try:
        import moto.server  # noqa: F401 - only checks that it is installed
    except ImportError:
        raise ConfigError(
            "--local.s3-server needs moto's server: install brigade with the test extra "
            "(`bash infra/install.sh`, or pip install 'moto[server]')"
        ) from None
    port = port or free_port()
    endpoint = f"http://127.0.0.1:{port}"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # a Ctrl-C reaches brigade local, which stops it last
        )
    server = LoopbackS3(proc, endpoint, log_path)
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise ConfigError(f"the loopback S3 server exited with code {proc.returncode}; see {log_path}")
        try:
            with urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=2):
                return server
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            server.stop()
            raise ConfigError(f"the loopback S3 server did not answer on {endpoint} within {timeout_s:.0f}s")
        time.sleep(0.2)


def use_loopback_s3(server: LoopbackS3) -> None:
    """Point this process (and so every job it starts) at the server; real credentials are not replaced."""
    for key, value in server.env.items():
        if key == "BRIGADE_S3_ENDPOINT_URL" or not os.environ.get(key):
            os.environ[key] = value
    # AWS_ENDPOINT_URL would not be consulted while ours is set, but would confuse anyone reading the env.
    os.environ.pop("AWS_ENDPOINT_URL", None)


@contextmanager
def environment(values: dict[str, str], unset: tuple[str, ...] = ()) -> Iterator[None]:
    """This process's environment with `values` set and `unset` removed, as it was again after the block."""
    saved = {k: os.environ.get(k) for k in (*values, *unset)}
    os.environ.update(values)
    for k in unset:
        os.environ.pop(k, None)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def create_bucket(url: str) -> None:
    """Create the S3 bucket named in `url` (s3://name/prefix) if it does not exist."""
    if not url.startswith("s3://"):
        raise ConfigError(f"--local.s3-server needs an s3:// bucket (or none), not {url!r}")
    name = url[len("s3://") :].split("/", 1)[0]
    store = Store(f"s3://{name}")
    if not store.fs.exists(name):
        store.fs.mkdir(name)
