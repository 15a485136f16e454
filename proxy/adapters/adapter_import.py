"""Adapter folders a client wrote inside the bucket under its own names (TRL's `trl-policy-vN`), made versions.

TRL's AsyncGRPOTrainer saves each policy as `<output_dir>/.vllm_lora/trl-policy-v{N}` and asks the server to
load that path under the name `trl-policy-v{N}`. With `output_dir` inside the bucket (a local folder or a
mount of it), the proxy imports such a folder as the next committed version (bucket/adapters.py: claim,
files, commit marker) and fans that version out like any other. Confinement is unchanged: only a folder
inside the bucket is read, and the replicas load the committed copy from their own adapter root.

Names. Within a run a name is loaded once (vLLM keys its prefix cache by adapter name, so a name served
with new weights would reuse KV computed under the old ones): the same name with the same files again is
the same version (a retried request); with other files it is refused, except for a run's first name
(`...-v1`): that is a new run reusing the old run's names, whose adapters are then unloaded first.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

from bucket import adapters, layout
from bucket.store import NotFound, Store
from bucket.version import Version

# The client's names (TRL's `trl-policy-v{N}`, unpadded), not brigade's versions (bucket/version.py).
FIRST_OF_A_RUN = re.compile(r"^(?P<prefix>.+)-v0*1$")
MARKER_FIELD = "imported"  # in the commit marker: where the files came from and under which name


class ImportRefused(ValueError):
    """The folder cannot be imported (HTTP 400 or 409: `status`)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Imported:
    lora_name: str
    version: Version
    digest: str  # sha256 over the adapter files, in ADAPTER_FILES order


def read_folder(store: Store, folder: str) -> tuple[dict[str, bytes], str]:
    """The adapter files of a bucket folder and their digest; ImportRefused when it holds no adapter."""
    files: dict[str, bytes] = {}
    for name in adapters.ADAPTER_FILES:
        try:
            files[name] = store.get_bytes(f"{folder}/{name}")
        except NotFound:
            raise ImportRefused(
                400,
                f"{folder} is neither an adapter version folder ({layout.ADAPTERS}/vNNNNNN, as the trainer "
                f"publishes them) nor an adapter folder to import: it has no {name} (expected "
                f"{', '.join(adapters.ADAPTER_FILES)}, as peft's save_pretrained writes them)",
            ) from None
    digest = hashlib.sha256(b"".join(hashlib.sha256(files[n]).digest() for n in adapters.ADAPTER_FILES)).hexdigest()
    return files, digest


def new_run_prefix(lora_name: str) -> str | None:
    """The name prefix of a run's first version (`trl-policy` for `trl-policy-v1`), else None."""
    m = FIRST_OF_A_RUN.match(lora_name)
    return m.group("prefix") if m else None


def of_run(lora_name: str, prefix: str) -> bool:
    """Whether a client's name is one of the run whose names start `<prefix>-v` (a new run unloads those)."""
    return re.fullmatch(rf"{re.escape(prefix)}-v\d+", lora_name) is not None


def publish_import(store: Store, folder: str, lora_name: str, files: dict[str, bytes], digest: str) -> Imported:
    """Commit the folder's files as the next version, recording their origin in the marker."""
    version = adapters.claim_version(store, owner=f"proxy import of {lora_name}")
    meta = {MARKER_FIELD: {"from": folder, "lora_name": lora_name, "sha256": digest}}
    adapters.publish(store, version, files, meta=meta)
    return Imported(lora_name, version, digest)
