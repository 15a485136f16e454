"""One bucket root, reached through fsspec: a local folder, s3://, gs://, hf://, or a mount.

Every object the jobs exchange goes through `Store`. Two rules hold for every
backend:

* A write is atomic: readers see the whole object or nothing. On object stores
  a single PUT already is; on a local folder (or a mount) we write a hidden
  temporary file in the same directory and rename it into place.
* Reads are never served from a listing cache: the jobs poll for objects that
  other machines create, so a cached "not there" would stall them.
"""

from __future__ import annotations

import json
import os
import posixpath
import uuid
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

TEMP_PREFIX = ".tmp-"


class BucketError(RuntimeError):
    """The bucket could not be used; the message says what to check."""


class NotFound(BucketError, FileNotFoundError):
    """The object does not exist (yet)."""


def _s3_options(url: str) -> dict[str, Any]:
    # A custom endpoint (MinIO, R2, a loopback test server) comes from the
    # environment so that no job needs a flag for it and no secret lands in a
    # config file. Credentials stay with botocore's usual chain.
    if not url.startswith("s3://"):
        return {}
    opts: dict[str, Any] = {"use_listings_cache": False, "skip_instance_cache": True}
    endpoint = os.environ.get("BRIGADE_S3_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        opts["client_kwargs"] = {"endpoint_url": endpoint}
    return opts


class Store:
    """A bucket root. Keys are '/'-separated paths relative to that root."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None):
        self.url = url.rstrip("/") or url
        options = {**_s3_options(url), **(storage_options or {})}
        try:
            self.fs, root = fsspec.core.url_to_fs(url, **options)
        except (ImportError, ValueError) as exc:
            raise BucketError(
                f"cannot open bucket {url!r}: {exc}. Local folders and s3:// work out of the box; "
                "other schemes need their fsspec package installed (gcsfs for gs://, huggingface_hub for hf://)."
            ) from exc
        self.is_local = isinstance(self.fs, LocalFileSystem)
        self.root = os.path.abspath(root) if self.is_local else root.rstrip("/")

    def __repr__(self) -> str:
        return f"Store({self.url!r})"

    # -- paths -------------------------------------------------------------
    def path(self, key: str) -> str:
        key = key.strip("/")
        return posixpath.join(self.root, key) if key else self.root

    def local_path(self, key: str) -> str | None:
        """The path of `key` on this machine's filesystem, if the bucket is a local folder or mount."""
        return self.path(key) if self.is_local else None

    # -- checks ------------------------------------------------------------
    def check_reachable(self, create: bool = False) -> None:
        """Fail early, with an actionable message, if the bucket cannot be read."""
        try:
            if self.is_local:
                if not os.path.isdir(self.root):
                    if not create:
                        raise BucketError(
                            f"bucket folder {self.root} does not exist: create it, "
                            "or point --bucket at the run's bucket"
                        )
                    os.makedirs(self.root, exist_ok=True)
                return
            self.fs.ls(self.root, detail=False)
        except BucketError:
            raise
        except FileNotFoundError as exc:
            if create:
                return  # object stores have no folders: the first write creates the prefix
            raise BucketError(f"bucket {self.url} not found: {exc}") from exc
        except Exception as exc:  # network, credentials, DNS: all mean the same to the user
            raise BucketError(
                f"bucket {self.url} is unreachable ({type(exc).__name__}: {exc}). Check the URL, the endpoint "
                "(BRIGADE_S3_ENDPOINT_URL / AWS_ENDPOINT_URL) and the credentials."
            ) from exc

    # -- reads -------------------------------------------------------------
    def get_bytes(self, key: str) -> bytes:
        try:
            return self.fs.cat_file(self.path(key))
        except FileNotFoundError as exc:
            raise NotFound(f"{self.url}/{key} does not exist") from exc

    def get_json(self, key: str) -> Any:
        data = self.get_bytes(key)
        try:
            return json.loads(data)
        except json.JSONDecodeError as exc:
            raise BucketError(f"{self.url}/{key} is not valid JSON: {exc}") from exc

    def _fresh(self, path: str) -> None:
        # fsspec backends other than s3 (gcsfs, hf) may keep a listings cache; we poll for objects
        # other machines create, so never trust it.
        if not self.is_local:
            self.fs.invalidate_cache(path)

    def exists(self, key: str) -> bool:
        self._fresh(self.path(key))
        return bool(self.fs.exists(self.path(key)))

    def list(self, prefix: str) -> list[str]:
        """Sorted names directly below `prefix` (files and folders), without temporaries."""
        self._fresh(self.path(prefix))
        try:
            entries = self.fs.ls(self.path(prefix), detail=False)
        except FileNotFoundError:
            return []
        names = {posixpath.basename(str(e).rstrip("/")) for e in entries}
        return sorted(n for n in names if n and not n.startswith(TEMP_PREFIX))

    # -- writes ------------------------------------------------------------
    def put_bytes(self, key: str, data: bytes) -> None:
        target = self.path(key)
        if not self.is_local:
            self.fs.pipe_file(target, data)  # one PUT: atomic on every object store
            return
        directory = os.path.dirname(target)
        os.makedirs(directory, exist_ok=True)
        tmp = os.path.join(directory, f"{TEMP_PREFIX}{uuid.uuid4().hex}-{os.path.basename(target)}")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)

    def put_json(self, key: str, obj: Any) -> None:
        self.put_bytes(key, json.dumps(obj, indent=1, sort_keys=True).encode())

    def put_if_absent(self, key: str, data: bytes) -> bool:
        """Create `key` only if it does not exist; True if this call created it.

        Local folders get a real exclusive create (link() fails on an existing
        name). On object stores this is check-then-put, which only guards
        against mistakes (two writers with one id), not a true race; callers
        rely on it only where one writer is expected.
        """
        target = self.path(key)
        if not self.is_local:
            if self.fs.exists(target):
                return False
            self.fs.pipe_file(target, data)
            return True
        directory = os.path.dirname(target)
        os.makedirs(directory, exist_ok=True)
        tmp = os.path.join(directory, f"{TEMP_PREFIX}{uuid.uuid4().hex}")
        with open(tmp, "wb") as f:
            f.write(data)
        try:
            os.link(tmp, target)
            return True
        except FileExistsError:
            return False
        finally:
            os.unlink(tmp)

    def delete(self, key: str) -> None:
        try:
            self.fs.rm(self.path(key), recursive=True)
        except FileNotFoundError:
            pass
