"""Reading one bucket object into its pydantic model, with one error type for every way it can be bad.

A bucket object is written by another job, maybe another brigade version, maybe by hand: it may be missing,
not JSON, JSON of the wrong shape (a list, a string, null), or a dict whose fields fail validation. Every
reader here turns each of those into `BucketError` naming the object and what was wrong, so a job catches one
type (records and skips the object, or refuses the run with the message) and never dies on a TypeError or a
KeyError from deep inside. `NotFound` (a BucketError too) still says "absent", which many readers answer with None.
"""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from bucket.store import BucketError, NotFound, Store
from bucket.version import BadVersion, Version

M = TypeVar("M", bound=BaseModel)


class InvalidObject(BucketError, ValueError):
    """An object that is there but is not what its key holds. A ValueError too: callers written for pydantic's
    ValidationError (a ValueError) keep catching it."""


def parse_model(store: Store, key: str, data: Any, cls: type[M]) -> M:
    """`data` (read from `key`) as a `cls`; BucketError when it is not one."""
    if not isinstance(data, dict):
        raise InvalidObject(f"{store.url}/{key} holds a JSON {type(data).__name__}, not the object a {cls.__name__} is")
    try:
        return cls(**data)
    except (ValidationError, TypeError, ValueError) as exc:
        raise InvalidObject(f"{store.url}/{key} is not a valid {cls.__name__}: {str(exc)[:500]}") from exc


def read_model(store: Store, key: str, cls: type[M]) -> M:
    """The object at `key` as a `cls`: NotFound when absent, BucketError when unreadable or invalid."""
    return parse_model(store, key, store.get_json(key), cls)


def read_model_or_none(store: Store, key: str, cls: type[M]) -> M | None:
    """As `read_model`, None when the object is absent."""
    try:
        data = store.get_json(key)
    except NotFound:
        return None
    return parse_model(store, key, data, cls)


def read_pointer(store: Store, key: str) -> Version | None:
    """A `{"version": n}` pointer (LATEST.json): None when absent, BucketError when it names no version."""
    try:
        data = store.get_json(key)
    except NotFound:
        return None
    try:
        return Version(data["version"])
    except (TypeError, KeyError, BadVersion) as exc:
        raise InvalidObject(f'{store.url}/{key} is not a version pointer ({{"version": n}}): {exc}') from exc
