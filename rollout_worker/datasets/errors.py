"""The error of a dataset brigade cannot use (here, so that every data module can raise it without a cycle)."""

from __future__ import annotations

from bucket.config import ConfigError


class DataError(ConfigError):
    """A dataset that cannot be used; the message names the dataset (the file and, for a bad row, the row) and
    what to do."""
