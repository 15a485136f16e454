"""An adapter version: the one place that spells it and reads it back.

A version is a number (1, 2, ...; 0 stands for the base model where a job needs a "no adapter yet"). It is
written in five ways, all built here:

    Version(7).folder           v000007                    a folder name, in the bucket and on every disk
    Version(7).key              adapters/v000007           the adapter's bucket key (also what a load names)
    Version(7).checkpoint_key   trainer/checkpoints/v000007
    Version(7).lora_name(run)   <run>-v000007              the name vLLM serves it under (bucket/manifest.py)
    Version(7).path_under(root) <root>/v000007             where a replica's mount or mirror holds it

and in JSON (adapters/LATEST.json, proxy/live.json, events) as the plain number 7. The digits are
zero-padded to six so that a listing sorts by version; that is the bucket's format, not a choice to revisit
per module. `Version.parse` (with `from_folder`, `from_lora_name` and `among` on top of it) reads these
spellings back and refuses anything else with `BadVersion`, which names the text and the forms it takes.

`Version` is an int: arithmetic, comparisons, sets and JSON treat it as its number, and a plain int is
accepted wherever a Version is expected by wrapping it (`Version(n)` checks it).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from typing import Any, Literal

from bucket import layout

DIGITS = 6
MAX = 10**DIGITS - 1  # one more digit would sort v1000000 before v999999 and the trainer would not see it
Spelling = Literal["folder", "key", "checkpoint_key", "lora_name", "path"]

_DIGITS = f"(?P<n>[0-9]{{{DIGITS}}})"  # ASCII digits only: str.isdigit() would take '٣'
_FORMS: dict[Spelling, str] = {
    "folder": rf"v{_DIGITS}",
    "key": rf"{re.escape(layout.ADAPTERS)}/v{_DIGITS}",
    "checkpoint_key": rf"{re.escape(layout.CHECKPOINTS)}/v{_DIGITS}",
    "lora_name": rf"(?P<run>[^/]+)-v{_DIGITS}",
    "path": rf"(?P<root>.*)/v{_DIGITS}/*",  # any root, and the trailing '/' a directory may carry
}
_PATTERNS = {form: re.compile(pattern) for form, pattern in _FORMS.items()}
_EXAMPLES: dict[Spelling, str] = {
    "folder": "v000007 (a version folder)",
    "key": f"{layout.ADAPTERS}/v000007 (a bucket key)",
    "checkpoint_key": f"{layout.CHECKPOINTS}/v000007 (a checkpoint's bucket key)",
    "lora_name": "<run>-v000007 (a LoRA name)",
    "path": "<root>/v000007 (a folder under an adapter root)",
}


class BadVersion(ValueError):
    """Not an adapter version: a number out of range, or text in none of the version's spellings."""


class Version(int):
    """An adapter version number, ordered and hashed as that number; see the module's docstring."""

    __slots__ = ()

    def __new__(cls, number: int) -> Version:
        if type(number) is cls:
            return number
        # bool is an int, and "7" or 7.0 would be taken by int(): a version is only ever an integer
        if not isinstance(number, int) or isinstance(number, bool):
            raise BadVersion(
                f"an adapter version is an integer from 0 to {MAX}, not {number!r} ({type(number).__name__}); "
                f"to read text such as 'v000007' use Version.parse"
            )
        if not 0 <= number <= MAX:
            raise BadVersion(
                f"an adapter version is an integer from 0 to {MAX} (its folder name has {DIGITS} digits), not {number}"
            )
        return super().__new__(cls, number)

    # repr(), str() and f-strings stay the int's: "7" in logs, metric labels and messages listing versions.

    @property
    def folder(self) -> str:
        return f"v{int(self):0{DIGITS}d}"

    @property
    def key(self) -> str:
        """The adapter's folder in the bucket (its files are `<key>/<name>`)."""
        return f"{layout.ADAPTERS}/{self.folder}"

    @property
    def checkpoint_key(self) -> str:
        """The trainer's checkpoint taken with this adapter (bucket/checkpoints.py)."""
        return f"{layout.CHECKPOINTS}/{self.folder}"

    def lora_name(self, run_id: str) -> str:
        """The name vLLM serves the version under; it carries the run because vLLM keys its prefix cache by
        name, so a replica shared by two runs never serves KV computed under the other run's weights."""
        if not run_id or "/" in run_id:
            raise BadVersion(f"a LoRA name needs a run id without '/', not {run_id!r}")
        return f"{run_id}-{self.folder}"

    def path_under(self, root: str) -> str:
        """The version's folder below a local adapter root (a replica's mount or mirror)."""
        return os.path.join(root, self.folder)

    @classmethod
    def parse(cls, text: object, *, run_id: str | None = None, only: Spelling | None = None) -> Version:
        """The version that `text` spells, in any of the module's spellings (or `only` that one); with
        `run_id`, a LoRA name must be that run's. BadVersion for anything else."""
        if not isinstance(text, str):
            raise BadVersion(f"{text!r} ({type(text).__name__}) is not text; a version number is read by Version(n)")
        forms: tuple[Spelling, ...] = (only,) if only is not None else tuple(_PATTERNS)
        for form in forms:
            m = _PATTERNS[form].fullmatch(text)
            if m is not None and (form != "lora_name" or run_id is None or m.group("run") == run_id):
                return cls(int(m.group("n")))
        expected = [_EXAMPLES[f] for f in forms]
        if run_id is not None and "lora_name" in forms:
            expected[forms.index("lora_name")] = f"{run_id}-v000007 (a LoRA name of run {run_id})"
        raise BadVersion(f"{text!r} is not an adapter version: expected " + " or ".join(expected))

    @classmethod
    def from_folder(cls, name: object) -> Version:
        return cls.parse(name, only="folder")

    @classmethod
    def from_lora_name(cls, name: object, run_id: str) -> Version:
        return cls.parse(name, run_id=run_id, only="lora_name")

    @classmethod
    def among(cls, texts: Iterable[str], *, only: Spelling = "folder", run_id: str | None = None) -> list[Version]:
        """The versions that some of `texts` spell (one listing's folder names, say), sorted; other texts
        (LATEST.json, a client's own adapter) are skipped."""
        found: set[Version] = set()
        for text in texts:
            try:
                found.add(cls.parse(text, run_id=run_id, only=only))
            except BadVersion:
                continue
        return sorted(found)

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: Any) -> Any:
        """In a pydantic model: read from a JSON integer and checked, written back as that integer."""
        from pydantic_core import core_schema

        return core_schema.no_info_after_validator_function(
            cls,
            core_schema.int_schema(),
            serialization=core_schema.plain_serializer_function_ser_schema(int),
        )
