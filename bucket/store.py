"""One bucket root, reached through fsspec: a local folder, s3://, gs://, hf://, or a mount.

Every object the jobs exchange goes through `Store`. Two rules hold for every
backend:

* A write is atomic: readers see the whole object or nothing. On object stores
  a single PUT already is; on a local folder (or a mount) we write a hidden
  temporary file in the same directory and rename it into place.
* Reads are never served from a listing cache: the jobs poll for objects that
  other machines create, so a cached "not there" would stall them.

Transient errors of an object store (5xx, throttling, timeouts, dropped
connections) are retried with exponential backoff and jitter by botocore's
own "standard" retry mode (on top of s3fs's retries of unparsable answers),
so a bucket hiccup costs a job a few hundred milliseconds, not its life.

Exclusive creates (`put_if_absent`) are atomic where the store can make them
so: a hard link on a local folder, a conditional PUT (`If-None-Match: *`) on
S3 and the S3-compatible stores that implement it. A FUSE mount of an object
store has no hard links: there it is check-then-rename. A store that ignores or
rejects the condition is detected once per process by a probe and falls
back to check-then-put, which only guards against mistakes, not races
(docs/architecture.md, "Exclusive creates").
"""

from __future__ import annotations

import errno
import json
import logging
import os
import posixpath
import threading
import uuid
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

TEMP_PREFIX = ".tmp-"
PROBE_ATTEMPTS = 4  # botocore attempts of the start-up check on S3 (Store._probe_fs)
# botocore's standard mode retries 5xx, throttling and connection errors with exponential backoff
# (base 0.5 s, capped at 20 s) and jitter; 10 attempts ride out several seconds of a flaky endpoint.
S3_RETRY_ATTEMPTS = 10

log = logging.getLogger("brigade.bucket")
# link() on a FUSE mount of an object store (s3fs, gcsfuse, mountpoint-s3): "Operation not supported".
NO_LINK_ERRNOS = (errno.EOPNOTSUPP, errno.ENOTSUP, errno.EPERM, errno.ENOSYS)


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
    opts: dict[str, Any] = {
        "use_listings_cache": False,
        "skip_instance_cache": True,
        "config_kwargs": {
            # AWS_RETRY_MODE / AWS_MAX_ATTEMPTS still win, as botocore users expect.
            "retries": {
                "mode": os.environ.get("AWS_RETRY_MODE") or "standard",
                "max_attempts": int(os.environ.get("AWS_MAX_ATTEMPTS") or S3_RETRY_ATTEMPTS),
            },
            # A hung connection is a transient error too: time it out so that it is retried.
            # BRIGADE_S3_READ_TIMEOUT_S shortens it where requests are small and the endpoint is near
            # (the chaos benchmark: a held request costs seconds, not half a minute).
            "connect_timeout": 5,
            "read_timeout": float(os.environ.get("BRIGADE_S3_READ_TIMEOUT_S") or 30),
        },
    }
    endpoint = os.environ.get("BRIGADE_S3_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        opts["client_kwargs"] = {"endpoint_url": endpoint}
    return opts


class Store:
    """A bucket root. Keys are '/'-separated paths relative to that root."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None):
        self.url = url.rstrip("/") or url
        options = self._options = {**_s3_options(url), **(storage_options or {})}
        try:
            self.fs, root = fsspec.core.url_to_fs(url, **options)
        except (ImportError, ValueError) as exc:
            raise BucketError(
                f"cannot open bucket {url!r}: {exc}. Local folders and s3:// work out of the box; "
                "other schemes need their fsspec package installed (gcsfs for gs://, huggingface_hub for hf://)."
            ) from exc
        self.is_local = isinstance(self.fs, LocalFileSystem)
        self.root = os.path.abspath(root) if self.is_local else root.rstrip("/")
        self._conditional: bool | None = None  # does the object store honour If-None-Match? (probed once)
        self.hard_links = True  # a local folder supports link(), until a FUSE mount says otherwise
        self._probe_lock = threading.Lock()

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
            self._probe_fs().ls(self.root, detail=False)
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

    def _probe_fs(self) -> Any:
        """The filesystem for the start-up check: on S3 four attempts, not the ten (times s3fs's own five) that
        ride out a flaky endpoint during the run, so a wrong endpoint is reported in seconds, not minutes. Two
        were too few: a job restarted while ~10 % of requests failed (the chaos run) met two failures in a row
        about once in a hundred starts and exited as if the bucket were unreachable."""
        if not self.url.startswith("s3://") or os.environ.get("AWS_MAX_ATTEMPTS"):
            return self.fs
        options = dict(self._options)
        config = dict(options.get("config_kwargs") or {})
        retries = dict(config.get("retries") or {})
        retries["max_attempts"] = min(PROBE_ATTEMPTS, int(retries.get("max_attempts", PROBE_ATTEMPTS)))
        options["config_kwargs"] = {**config, "retries": retries}
        fs, _ = fsspec.core.url_to_fs(self.url, **options)
        fs.retries = 1  # s3fs retries connection errors itself too
        return fs

    # -- reads -------------------------------------------------------------
    def get_bytes(self, key: str) -> bytes:
        try:
            return self.fs.cat_file(self.path(key))
        except FileNotFoundError as exc:
            raise NotFound(f"{self.url}/{key} does not exist") from exc

    def get_many(self, keys: list[str]) -> dict[str, bytes]:
        """The objects at `keys` that exist (key -> bytes), fetched concurrently where the store can (s3fs)."""
        if not keys:
            return {}
        paths = {self.path(k): k for k in keys}
        out: dict[str, bytes] = {}
        for path, value in self.fs.cat(list(paths), on_error="return").items():
            key = paths[str(path)]
            if isinstance(value, FileNotFoundError):
                continue
            if isinstance(value, BaseException):
                raise BucketError(f"cannot read {self.url}/{key}: {value}") from value
            out[key] = value
        return out

    def get_json(self, key: str) -> Any:
        data = self.get_bytes(key)
        try:
            return json.loads(data)
        # ValueError: not JSON, or not UTF-8 (UnicodeDecodeError); RecursionError: nested deeper than Python's stack
        except (ValueError, RecursionError) as exc:
            raise BucketError(f"{self.url}/{key} is not valid JSON: {str(exc)[:200]}") from exc

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
        # A FUSE mount (s3fs) writes an empty "<folder>/" marker object per folder, which an object store
        # lists as an entry of the folder itself: not a child.
        own = self.path(prefix).rstrip("/")
        names = {posixpath.basename(str(e).rstrip("/")) for e in entries if str(e).rstrip("/") != own}
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

        Atomic on a local folder (link() fails on an existing name) and on object stores that honour
        `If-None-Match: *` (AWS S3, moto, MinIO, R2, ...): of two racing writers exactly one wins.
        Elsewhere it is check-then-put, which only guards against mistakes (two writers given one id).
        """
        if self.is_local:
            return self._link_if_absent(self.path(key), data)
        if not self.conditional_writes():
            if self.exists(key):
                return False
            self.fs.pipe_file(self.path(key), data)
            return True
        return self._conditional_put(self.path(key), data)

    def _conditional_put(self, target: str, data: bytes) -> bool:
        try:
            self.fs.pipe_file(target, data, mode="create")
            return True
        except FileExistsError:
            # A retried PUT whose first attempt did land (its answer was lost) also fails the condition:
            # the object then holds exactly our bytes, and it is ours.
            try:
                return bool(self.fs.cat_file(target) == data)
            except FileNotFoundError:
                return False

    def conditional_writes(self) -> bool:
        """Whether this object store honours `If-None-Match: *`; probed once with a throwaway object.

        Some S3-compatible stores ignore the header (the second create would then silently overwrite)
        and some reject it: both fall back to check-then-put.
        """
        with self._probe_lock:
            if self._conditional is None:
                probe = self.path(f"{TEMP_PREFIX}conditional-write-probe-{uuid.uuid4().hex}")
                try:
                    # The first create of a fresh name succeeds, or meets itself after a retry (its answer lost)
                    if not self._conditional_put(probe, b"1"):
                        self._conditional = False  # someone else's object under a fresh name: nonsense
                    else:
                        try:
                            self.fs.pipe_file(probe, b"2", mode="create")
                            self._conditional = False  # the condition was ignored
                        except FileExistsError:
                            self._conditional = True
                except (OSError, NotImplementedError, TypeError, ValueError) as exc:
                    log.warning("%s rejects conditional writes (%s); exclusive creates are check-then-put", self, exc)
                    self._conditional = False
                finally:
                    try:
                        self.fs.rm(probe)
                    except (OSError, NotImplementedError):
                        pass
                if not self._conditional:
                    log.warning("%s does not honour If-None-Match: exclusive creates fall back to check-then-put", self)
            return self._conditional

    def _link_if_absent(self, target: str, data: bytes) -> bool:
        directory = os.path.dirname(target)
        os.makedirs(directory, exist_ok=True)
        tmp = os.path.join(directory, f"{TEMP_PREFIX}{uuid.uuid4().hex}")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        try:
            if self.hard_links:
                try:
                    os.link(tmp, target)
                    return True
                except FileExistsError:
                    return False
                except OSError as exc:
                    if exc.errno not in NO_LINK_ERRNOS:
                        raise
                    self._no_hard_links(exc)
            # A FUSE mount of an object store: no link(), and rename() is a server-side copy that makes the
            # target appear whole (readers never see a partial object) but may replace an existing one, so
            # this is check-then-rename: exclusive against mistakes, not against a race (see the docs).
            if os.path.lexists(target):
                return False
            os.replace(tmp, target)
            return True
        finally:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass  # renamed into place

    def _no_hard_links(self, exc: OSError) -> None:
        self.hard_links = False
        log.warning(
            "%s has no hard links (%s): a FUSE mount of an object store? Exclusive creates fall back to "
            "check-then-rename, which guards against mistakes but not races; every writer here has its own "
            "names, so this holds while one trainer runs and writer ids are unique. For atomic exclusive "
            "creates give the jobs the s3:// URL instead (docs/architecture.md, 'Mounted buckets').",
            self.url,
            exc.strerror,
        )

    def delete_many(self, keys: list[str]) -> None:
        """Delete objects (absent ones are fine): on S3 one DeleteObjects request per 1000 keys."""
        if not keys:
            return
        if self.is_local:
            for key in keys:
                try:
                    os.remove(self.path(key))
                except FileNotFoundError:
                    pass
            return
        try:
            self.fs.rm([self.path(k) for k in keys])
        except FileNotFoundError:
            pass

    def delete(self, key: str) -> None:
        try:
            self.fs.rm(self.path(key), recursive=True)
        except FileNotFoundError:
            pass
