"""bucket/version.py: every spelling of an adapter version, read back; everything else refused by name."""

from __future__ import annotations

import json
import pickle

import pytest
from pydantic import BaseModel

from bucket import layout
from bucket.version import BadVersion, Version


def test_every_spelling_of_a_version():
    v = Version(7)
    assert v.folder == "v000007"
    assert v.key == f"{layout.ADAPTERS}/v000007" == "adapters/v000007"
    assert v.checkpoint_key == f"{layout.CHECKPOINTS}/v000007" == "trainer/checkpoints/v000007"
    assert v.lora_name("3f2a9c1d") == "3f2a9c1d-v000007"
    assert v.path_under("/mnt/bucket/adapters") == "/mnt/bucket/adapters/v000007"
    assert v.path_under("/mirror/") == "/mirror/v000007"
    assert Version(123456).folder == "v123456" and Version(0).folder == "v000000"


@pytest.mark.parametrize("number", [0, 1, 7, 42, 999, 123456, 999999])
def test_every_spelling_reads_back(number):
    v = Version(number)
    for text in (
        v.folder,
        v.key,
        v.checkpoint_key,
        v.lora_name("run"),
        v.path_under("/a/b"),
        v.path_under("/a/b") + "/",
    ):
        assert Version.parse(text) == v and type(Version.parse(text)) is Version, text
    assert Version.from_folder(v.folder) == v
    assert Version.from_lora_name(v.lora_name("3f2a9c1d"), "3f2a9c1d") == v
    assert Version.parse(v.lora_name("trl-policy"), run_id="trl-policy") == v  # a run id with '-' in it
    for only, text in (
        ("folder", v.folder),
        ("key", v.key),
        ("path", v.path_under("/r")),
        ("lora_name", "r-" + v.folder),
    ):
        assert Version.parse(text, only=only) == v


@pytest.mark.parametrize(
    "text",
    [
        "",
        "7",
        "v7",  # unpadded: the spelling is six digits
        "v0000007",  # seven digits
        "V000007",
        "v00000x",
        "v٠٠٠٠٠٧",  # digits, but not ASCII ones
        " v000007",
        "v000007 ",
        "v000007.json",
        "adapters/LATEST.json",
        "adapters/v000007/adapter_model.safetensors",
        "-v000007",  # a LoRA name needs its run
        "run_v000007",
        "trl-policy-v7",  # a client's own name, not a brigade version
    ],
)
def test_anything_else_is_refused_naming_the_text_and_the_forms(text):
    with pytest.raises(BadVersion) as exc:
        Version.parse(text)
    message = str(exc.value)
    assert repr(text) in message
    for form in ("v000007", "adapters/v000007", "<run>-v000007", "<root>/v000007"):
        assert form in message, message


def test_a_spelling_asked_for_alone_refuses_the_others():
    with pytest.raises(BadVersion, match=r"'adapters/v000007' is not an adapter version: expected v000007 \(a version"):
        Version.from_folder("adapters/v000007")
    with pytest.raises(BadVersion, match="expected adapters/v000007"):
        Version.parse("trainer/checkpoints/v000007", only="key")
    with pytest.raises(BadVersion, match="<run>-v000007"):
        Version.parse("other/v000007", only="lora_name")
    with pytest.raises(BadVersion, match=r"expected abc-v000007 \(a LoRA name of run abc\)"):
        Version.from_lora_name("abd-v000007", "abc")  # another run's name
    with pytest.raises(BadVersion, match="<root>/v000007"):
        Version.parse("v000007", only="path")
    with pytest.raises(BadVersion, match=r"7 \(int\) is not text; a version number is read by Version\(n\)"):
        Version.parse(7)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [-1, 1_000_000, 7.0, "7", "v000007", True, None])
def test_only_an_integer_in_range_is_a_version(bad):
    with pytest.raises(BadVersion) as exc:
        Version(bad)
    assert repr(bad) in str(exc.value) or str(bad) in str(exc.value)
    assert "from 0 to 999999" in str(exc.value)
    assert isinstance(exc.value, ValueError)  # callers that caught ValueError still do


def test_among_keeps_the_versions_and_skips_the_rest():
    listing = ["LATEST.json", "v000010", "v000002", "v2", ".tmp-ab12-v000003", "v000002", "x-v000004"]
    assert Version.among(listing) == [2, 10]
    names = ["base", "run1-v000003", "run2-v000004", "run1-v000001", "trl-policy-v1"]
    assert Version.among(names, only="lora_name", run_id="run1") == [1, 3]
    roots = ["/m/adapters/v000005/", "/tmp/client-adapter", "/m/adapters/v000004"]
    assert Version.among(roots, only="path") == [4, 5]


def test_ordered_hashed_and_written_as_its_number():
    vs = [Version(10), Version(2), Version(9)]
    assert sorted(vs) == [2, 9, 10] and max(vs) == Version(10) and Version(2) < 3 < Version(9)
    assert sorted(v.folder for v in vs) == [v.folder for v in sorted(vs)]  # the padding keeps listings in order
    assert {Version(3), 3} == {3} and {3: "a"}[Version(3)] == "a"
    assert Version(Version(4)) == 4 and Version(5) + 1 == 6
    assert str(Version(7)) == f"{Version(7)}" == repr(Version(7)) == "7"  # logs, metric labels, messages
    assert json.dumps({"versions": [Version(7)], "version": Version(1)}) == '{"versions": [7], "version": 1}'
    assert pickle.loads(pickle.dumps(Version(8))) == 8 and type(pickle.loads(pickle.dumps(Version(8)))) is Version


def test_in_a_pydantic_model_it_is_read_checked_and_written_as_an_int():
    class M(BaseModel):
        version: Version
        parent: Version | None = None

    m = M(**json.loads('{"version": 7, "parent": 6}'))
    assert type(m.version) is Version and m.version.folder == "v000007"
    assert m.model_dump() == {"version": 7, "parent": 6} and type(m.model_dump()["version"]) is int
    assert m.model_dump_json() == '{"version":7,"parent":6}'
    with pytest.raises(ValueError, match="from 0 to 999999"):
        M(version=-1)


def test_lora_name_needs_a_run():
    with pytest.raises(BadVersion):
        Version(1).lora_name("")
    with pytest.raises(BadVersion):
        Version(1).lora_name("a/b")
