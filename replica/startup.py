"""The replica's name, its URLs, and the checks made before vLLM starts (so a wrong setup fails in seconds)."""

from __future__ import annotations

import os
import re
import socket

from replica.config import ReplicaConfig
from replica.vllm_server import ReplicaError


def replica_id(rc: ReplicaConfig) -> str:
    """Registry name; object-name safe because it becomes replicas/<id>.json."""
    raw = rc.replica_id or f"{socket.gethostname()}-{rc.port}"
    return re.sub(r"[^A-Za-z0-9_.-]", "-", raw)[:100]


def advertise_url(rc: ReplicaConfig) -> str:
    if rc.advertise_url:
        return rc.advertise_url.rstrip("/")
    host = socket.gethostname() if rc.host in ("0.0.0.0", "::") else rc.host
    return f"http://{host}:{rc.port}"


def metrics_port(rc: ReplicaConfig) -> int:
    return rc.metrics_port or rc.port + 1000


def check_model_dir(path: str) -> None:
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ReplicaError(
            f"no model at {path} (replica.model_path): build it with "
            f"`brigade prepare-model --trainer.model-path {path}`, "
            "or point --replica.model-path at a Hugging Face model folder"
        )


def check_port_free(host: str, port: int) -> None:
    """Fail clearly if something already listens there.

    Otherwise that other server could answer our /health checks and we would
    register a replica that is not ours.
    """
    bind_host = "" if host in ("0.0.0.0", "::") else host
    with socket.socket() as s:
        # SO_REUSEADDR as uvicorn sets it: a port in TIME_WAIT is free, one with a listener is not.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((bind_host, port))
        except OSError as exc:
            raise ReplicaError(
                f"cannot listen on {host}:{port} ({exc.strerror}): choose another --replica.port"
            ) from None
