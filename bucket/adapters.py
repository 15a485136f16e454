"""Immutable, versioned adapters.

Publish order: a claim of the version name (CLAIM.json, created exclusively),
the adapter files, then COMMITTED.json (sizes + sha256 of each file), then
adapters/LATEST.json. A reader trusts a version only once its commit marker
exists, so a trainer that dies mid-upload leaves a folder that nobody loads;
the next trainer skips that number instead of reusing it. The claim makes the
name exclusive even between two trainers racing for it, wherever the store
has atomic exclusive creates (bucket/store.py). A trainer stopped between
COMMITTED.json and LATEST.json leaves a version committed but unannounced;
the next trainer announces it before anything else (bucket/checkpoints.py,
`finish_publish`).

`root` is the folder the versions live in: a run's bucket has them in
adapters/ (the default); a pool's bucket has each run's in adapters/<run_id>/
(bucket/pool.py), written by the same functions.
"""

from __future__ import annotations

import hashlib
import json
import time
from typing import Any

from bucket import layout
from bucket.reading import read_pointer
from bucket.store import BucketError, NotFound, Store
from bucket.version import Version

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_FILES = (ADAPTER_WEIGHTS, "adapter_config.json")
CLAIM = "CLAIM.json"


class AdapterCorrupt(BucketError):
    pass


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def version_key(version: Version, root: str = layout.ADAPTERS) -> str:
    """The version's folder in the bucket (`version.key` under the default root)."""
    return f"{root}/{Version(version).folder}"


def next_version(store: Store, root: str = layout.ADAPTERS) -> Version:
    """One past every version folder ever started, committed or not: names are never reused."""
    return Version(max(Version.among(store.list(root)), default=0) + 1)


def claim(store: Store, version: Version, owner: str = "", root: str = layout.ADAPTERS) -> bool:
    """Take the name `version` (its CLAIM.json, created exclusively); False when another writer has it."""
    body = json.dumps({"version": Version(version), "owner": owner, "claimed_at": time.time()}).encode()
    return store.put_if_absent(f"{version_key(version, root)}/{CLAIM}", body)


def claim_version(store: Store, owner: str = "", root: str = layout.ADAPTERS) -> Version:
    """A new version name that no other writer has or will get: one past every folder, created exclusively."""
    while True:
        version = next_version(store, root)
        if claim(store, version, owner, root):
            return version
        # another writer took this number between our listing and our create: list again


def marker_for(version: Version, files: dict[str, bytes], meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """The commit marker of `files` as `version`: their sizes and checksums, plus `meta` (the canary...)."""
    return {
        "version": Version(version),
        "committed_at": time.time(),
        "files": {name: {"size": len(data), "sha256": sha256(data)} for name, data in files.items()},
        **(meta or {}),
    }


def commit(
    store: Store,
    version: Version,
    files: dict[str, bytes],
    meta: dict[str, Any] | None = None,
    root: str = layout.ADAPTERS,
) -> dict[str, Any]:
    """Write `files` as `version`, then its COMMITTED.json; the commit marker. Not yet announced (`announce`)."""
    version = Version(version)
    key = version_key(version, root)
    if store.exists(f"{key}/{layout.COMMIT_MARKER}"):
        raise BucketError(f"adapter {key} is already committed; versions are immutable")
    for name, data in files.items():
        store.put_bytes(f"{key}/{name}", data)
    marker = marker_for(version, files, meta)
    store.put_json(f"{key}/{layout.COMMIT_MARKER}", marker)
    return marker


def announce(store: Store, version: Version, committed_at: float, root: str = layout.ADAPTERS) -> None:
    """Point LATEST.json at a committed `version`: what the proxy and the mirrors follow."""
    store.put_json(f"{root}/LATEST.json", {"version": Version(version), "committed_at": committed_at})


def publish(
    store: Store,
    version: Version,
    files: dict[str, bytes],
    meta: dict[str, Any] | None = None,
    root: str = layout.ADAPTERS,
) -> dict[str, Any]:
    """`commit`, then `announce`: the whole publish of one version."""
    marker = commit(store, version, files, meta, root)
    announce(store, version, marker["committed_at"], root)
    return marker


def commit_marker(store: Store, version: Version, root: str = layout.ADAPTERS) -> dict[str, Any] | None:
    """The version's COMMITTED.json (None: not committed); AdapterCorrupt when it is not a marker."""
    key = f"{version_key(version, root)}/{layout.COMMIT_MARKER}"
    try:
        marker = store.get_json(key)
    except NotFound:
        return None
    if not isinstance(marker, dict):
        raise AdapterCorrupt(f"{store.url}/{key} holds a JSON {type(marker).__name__}, not a commit marker")
    return marker


def marker_files(store: Store, version: Version, marker: dict[str, Any], root: str = layout.ADAPTERS) -> dict[str, Any]:
    """The marker's {file name: {"size", "sha256"}}, checked: AdapterCorrupt when a name is not a plain file name
    of the version's folder (a "../" or "/" in it would read, mirror or load a file outside the version) or an
    entry is not a size and a checksum."""
    files = marker.get("files")
    where = f"{store.url}/{version_key(version, root)}/{layout.COMMIT_MARKER}"
    if not isinstance(files, dict) or not files:
        raise AdapterCorrupt(f"{where} lists no files (its 'files' is {type(files).__name__}): not a commit marker")
    for name, info in files.items():
        if not name or "/" in name or "\\" in name or name in (".", "..") or "\x00" in name:
            raise AdapterCorrupt(f"{where} names the file {name!r}: a marker lists only files of its own folder")
        size = info.get("size") if isinstance(info, dict) else None
        digest = info.get("sha256") if isinstance(info, dict) else None
        if not isinstance(size, int) or isinstance(size, bool) or size < 0 or not isinstance(digest, str):
            raise AdapterCorrupt(f"{where}: the entry of {name!r} is {info!r}, not a size and a sha256")
    return files


def latest_version(store: Store, root: str = layout.ADAPTERS) -> Version | None:
    """Newest committed version, from the LATEST pointer (one small read); BucketError when it names none."""
    return read_pointer(store, f"{root}/LATEST.json")


def newest_committed(store: Store, above: int = 0, root: str = layout.ADAPTERS) -> Version | None:
    """The newest committed version above `above` (None if none): one listing, then a marker check per folder
    from the newest down, so the usual answer (nothing above the announced one) costs one or two reads."""
    for version in sorted(Version.among(store.list(root)), reverse=True):
        if version <= above:
            return None
        if store.exists(f"{version_key(version, root)}/{layout.COMMIT_MARKER}"):
            return version
    return None


def committed_versions(store: Store, root: str = layout.ADAPTERS) -> list[Version]:
    return [
        v for v in Version.among(store.list(root)) if store.exists(f"{version_key(v, root)}/{layout.COMMIT_MARKER}")
    ]


def read_verified(store: Store, version: Version, root: str = layout.ADAPTERS) -> dict[str, bytes]:
    """The files of a committed version, checked against their checksums."""
    version = Version(version)
    key = version_key(version, root)
    marker = commit_marker(store, version, root)
    if marker is None:
        raise NotFound(f"adapter {key} is not committed")
    files = {}
    for name, info in marker_files(store, version, marker, root).items():
        data = store.get_bytes(f"{key}/{name}")
        if len(data) != info["size"] or sha256(data) != info["sha256"]:
            raise AdapterCorrupt(
                f"{store.url}/{key}/{name} does not match its commit marker "
                f"(size {len(data)} vs {info['size']}): the bucket was modified after commit"
            )
        files[name] = data
    return files
