"""Immutable, versioned adapters.

Publish order: a claim of the version name (CLAIM.json, created exclusively),
the adapter files, then COMMITTED.json (sizes + sha256 of each file), then
adapters/LATEST.json. A reader trusts a version only once its commit marker
exists, so a trainer that dies mid-upload leaves a folder that nobody loads;
the next trainer skips that number instead of reusing it. The claim makes the
name exclusive even between two trainers racing for it, wherever the store
has atomic exclusive creates (bucket/store.py).
"""

from __future__ import annotations

import hashlib
import json
import time
from typing import Any

from bucket import layout
from bucket.store import BucketError, NotFound, Store
from bucket.version import Version

ADAPTER_FILES = ("adapter_model.safetensors", "adapter_config.json")
CLAIM = "CLAIM.json"


class AdapterCorrupt(BucketError):
    pass


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def next_version(store: Store) -> Version:
    """One past every version folder ever started, committed or not: names are never reused."""
    return Version(max(Version.among(store.list(layout.ADAPTERS)), default=0) + 1)


def claim_version(store: Store, owner: str = "") -> Version:
    """A new version name that no other writer has or will get: one past every folder, created exclusively."""
    while True:
        version = next_version(store)
        claim = json.dumps({"version": version, "owner": owner, "claimed_at": time.time()}).encode()
        if store.put_if_absent(f"{version.key}/{CLAIM}", claim):
            return version
        # another writer took this number between our listing and our create: list again


def publish(
    store: Store, version: Version, files: dict[str, bytes], meta: dict[str, Any] | None = None
) -> dict[str, Any]:
    version = Version(version)
    key = version.key
    if store.exists(f"{key}/{layout.COMMIT_MARKER}"):
        raise BucketError(f"adapter {key} is already committed; versions are immutable")
    for name, data in files.items():
        store.put_bytes(f"{key}/{name}", data)
    marker = {
        "version": version,
        "committed_at": time.time(),
        "files": {name: {"size": len(data), "sha256": sha256(data)} for name, data in files.items()},
        **(meta or {}),
    }
    store.put_json(f"{key}/{layout.COMMIT_MARKER}", marker)
    store.put_json(layout.ADAPTERS_LATEST, {"version": version, "committed_at": marker["committed_at"]})
    return marker


def commit_marker(store: Store, version: Version) -> dict[str, Any] | None:
    try:
        return store.get_json(f"{Version(version).key}/{layout.COMMIT_MARKER}")
    except NotFound:
        return None


def latest_version(store: Store) -> Version | None:
    """Newest committed version, from the LATEST pointer (one small read)."""
    try:
        return Version(store.get_json(layout.ADAPTERS_LATEST)["version"])
    except NotFound:
        return None


def committed_versions(store: Store) -> list[Version]:
    return [v for v in Version.among(store.list(layout.ADAPTERS)) if store.exists(f"{v.key}/{layout.COMMIT_MARKER}")]


def read_verified(store: Store, version: Version) -> dict[str, bytes]:
    """The files of a committed version, checked against their checksums."""
    version = Version(version)
    marker = commit_marker(store, version)
    if marker is None:
        raise NotFound(f"adapter {version.key} is not committed")
    files = {}
    for name, info in marker["files"].items():
        data = store.get_bytes(f"{version.key}/{name}")
        if len(data) != info["size"] or sha256(data) != info["sha256"]:
            raise AdapterCorrupt(
                f"{store.url}/{version.key}/{name} does not match its commit marker "
                f"(size {len(data)} vs {info['size']}): the bucket was modified after commit"
            )
        files[name] = data
    return files
