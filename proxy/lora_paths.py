"""Which adapter folder a load request may name, and the vLLM answers a load fan-out must understand.

The proxy loads adapters only from inside the bucket's adapters/ folder: a
load request names a version folder there, and each replica is told the path
of that version under its OWN adapter root (its mount or mirror). The path the
client sent is never passed on, so neither '..' nor a symlink can make a
replica read outside the adapters it was meant to serve.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from bucket import layout
from bucket.canary import Canary
from bucket.store import Store
from bucket.version import BadVersion, Version

# vLLM's answers (see vllm/entrypoints/openai/models/serving.py and vllm/exceptions.py).
ALREADY_LOADED = "has already been loaded"
NOT_FOUND_ON_DISK = "No adapter found"


class BadAdapterPath(ValueError):
    """lora_path does not name an adapter version folder inside the bucket (HTTP 400)."""


class NotAVersionFolder(BadAdapterPath):
    """lora_path names a folder inside the bucket that is not a version folder (a client's own adapter folder)."""

    def __init__(self, message: str, folder: str) -> None:
        super().__init__(message)
        self.folder = folder  # bucket key of the folder


@dataclass(frozen=True)
class AdapterRef:
    lora_name: str
    version: Version  # its folder has the same name in the bucket and under every replica's adapter root
    canary: Canary | None = field(default=None, compare=False, repr=False)  # from the commit marker, if any
    # The run whose folder below the adapters root holds it, in a pool's bucket (adapters/<run_id>/v000007,
    # bucket/pool.py); "" for a run's own bucket (adapters/v000007).
    pool_run: str = ""

    def path_under(self, root: str) -> str:
        """Its folder below a replica's adapter root (the replica's mount or mirror of the adapters folder)."""
        return self.version.path_under(os.path.join(root, self.pool_run) if self.pool_run else root)


def _bucket_relative(store: Store, lora_path: str) -> str:
    path = lora_path.strip()
    if path.startswith("file://"):
        path = path[len("file://") :]
    if "://" in path:
        prefix = store.url.rstrip("/") + "/"
        if not path.startswith(prefix):
            raise BadAdapterPath(f"lora_path {lora_path!r} is outside this proxy's bucket {store.url}")
        return path[len(prefix) :]
    if path.startswith("/"):
        root = store.local_path("")
        if root is None:
            raise BadAdapterPath(
                f"lora_path {lora_path!r} is a local path, but the bucket {store.url} is not a local folder: "
                f"name the version as {layout.ADAPTERS}/vNNNNNN"
            )
        for base, candidate in ((root, path), (os.path.realpath(root), os.path.realpath(path))):
            base = base.rstrip("/") + "/"
            if candidate.startswith(base):
                return candidate[len(base) :]
        raise BadAdapterPath(f"lora_path {lora_path!r} is outside this proxy's bucket {store.url}")
    return path


def version_of(store: Store, lora_path: object) -> Version:
    """The version whose folder `lora_path` names inside the bucket's adapters/, or BadAdapterPath.

    Accepted: a bucket key `adapters/v000003`, the same under the bucket URL
    (`s3://b/run/adapters/v000003`), or under the bucket's local folder. Another folder inside the bucket
    (outside adapters/) raises NotAVersionFolder, which the proxy may import (adapters/adapter_import.py).
    """
    if not isinstance(lora_path, str) or not lora_path.strip():
        raise BadAdapterPath(f"lora_path must be a non-empty string naming an adapter version, e.g. {Version(3).key}")
    if ".." in lora_path.replace("\\", "/").split("/") or "\0" in lora_path:
        raise BadAdapterPath(f"lora_path {lora_path!r} contains '..': adapters are loaded only from inside the bucket")
    key = "/".join(p for p in _bucket_relative(store, lora_path).split("/") if p not in ("", "."))
    try:
        return Version.parse(key, only="key")
    except BadVersion:
        message = (
            f"lora_path {lora_path!r} does not name an adapter version folder: use "
            f"{layout.ADAPTERS}/vNNNNNN (a folder the trainer published in the bucket)"
        )
        if key and key.split("/")[0] != layout.ADAPTERS:
            raise NotAVersionFolder(message, key) from None
        raise BadAdapterPath(message) from None


def error_message(body: str) -> str:
    """The human part of an upstream error body (vLLM's JSON error, FastAPI's detail, or plain text)."""
    try:
        data = json.loads(body)
    except ValueError:
        return body.strip()[:500]
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])[:500]
        for field in ("message", "detail", "error"):
            if field in data:
                return str(data[field])[:500]
    return body.strip()[:500]
