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

from bucket import Store


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
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    saved = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION", "BRIGADE_S3_ENDPOINT_URL")}
    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1",
                      BRIGADE_S3_ENDPOINT_URL=endpoint)
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
