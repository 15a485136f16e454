"""Whether a committed version may be loaded at all: its files match their commit marker and its weights are finite.

The trainer never publishes NaN or infinite weights (trainer/model.py), but the proxy is the one owner of what the
replicas hold, and a bucket has other writers (a second trainer, a hand-made version, a tampered or truncated file):
a version that fails here is never sent to any replica. vLLM would load NaN weights without complaint and every
sample drawn from them would be garbage. The adapter is read once more (the mirrors read it too); for a rank-1
adapter that is a few hundred kilobytes, and the check itself runs at about 150 M values a second.
"""

from __future__ import annotations

from bucket import adapters
from bucket.finite import BadSafetensors, nonfinite_tensors
from bucket.store import NotFound, Store
from bucket.version import Version


def refusal(store: Store, version: Version) -> str | None:
    """Why `version` must not be loaded, or None. A version not (yet) committed is not refused here: the lifecycle
    loads only committed versions, and reads again."""
    try:
        files = adapters.read_verified(store, version)
        weights = files[adapters.ADAPTER_WEIGHTS]
    except NotFound:
        return None
    except (adapters.AdapterCorrupt, KeyError) as exc:
        return f"{version.folder}: {exc}"
    unusable = unusable_weights(weights)
    return f"{version.folder}/{adapters.ADAPTER_WEIGHTS} {unusable}" if unusable else None


def unusable_weights(data: bytes) -> str | None:
    """What is wrong with an adapter's weights file (unreadable, NaN or infinite values), or None."""
    try:
        bad = nonfinite_tensors(data)
    except BadSafetensors as exc:
        return f"cannot be read as safetensors: {exc}"
    if bad:
        more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
        return f"holds NaN or infinite values ({', '.join(bad[:3])}{more})"
    return None
