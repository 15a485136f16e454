"""Proxy settings (the `[proxy]` table). Imports neither torch nor vLLM."""

from __future__ import annotations

from pydantic import BaseModel, Field, model_validator


class ProxyConfig(BaseModel):
    model_config = {"extra": "forbid"}

    host: str = Field("127.0.0.1", description="Address to listen on.")
    port: int = Field(8100, ge=1, le=65535, description="Port to listen on.")
    replica_urls: list[str] = Field(
        default_factory=list, description="Static replica URLs; empty = learn them from the bucket's replica registry."
    )
    block_size: int = Field(
        16, ge=1, description="Tokens per routing block (hash chain granularity; replicas' KV block sizes may differ)."
    )
    spill_threshold: int = Field(
        8,
        ge=1,
        description="A group moves to the least-loaded replica when its replica, not counting the group itself, is "
        "this many requests' worth of outstanding tokens ahead of it, beyond the siblings the group still expects "
        "(n=1 requests: a new group reserves room for them; n=G requests: exactly this many).",
    )
    max_inflight: int = Field(1024, ge=1, description="Requests in flight across all replicas; more wait.")
    replica_max_inflight: int = Field(
        512, ge=1, description="Requests in flight on one replica; more wait in that replica's queue."
    )
    connect_timeout_s: float = Field(
        2.0, gt=0, description="Opening a connection to a replica; a replica that does not accept is ejected."
    )
    probe_interval_s: float = Field(
        0.25, gt=0, description="How often each replica's /health is probed (the active half of ejection)."
    )
    probe_timeout_s: float = Field(
        0.75,
        gt=0,
        description="The least time a replica's /health is given; the timeout follows the replica's observed /health "
        "latency (4x, up to probe_timeout_max_s), and a replica that answered a generation within busy_grace_s "
        "is busy, not dead: its /health running out of time does not eject it. A refused or broken connection "
        "ejects at once.",
    )
    probe_timeout_max_s: float = Field(
        10.0, gt=0, description="The most time a replica's /health is given, however slow it has been."
    )
    busy_grace_s: float = Field(
        5.0,
        ge=0,
        description="A replica that answered a generation this recently is alive: a /health that runs out of time "
        "then stretches its timeout instead of ejecting it (0 = judge /health alone).",
    )
    load_retry_s: float = Field(
        60.0, ge=0, description="How long to retry 'No adapter found' on a replica (a mount or mirror catching up)."
    )
    replica_timeout_s: float = Field(
        15.0, gt=0, description="A registered replica whose heartbeat has not changed for this long is dropped."
    )
    refresh_s: float = Field(1.0, gt=0, description="How often to re-read the replica registry.")
    watch_adapters: bool = Field(
        True,
        description="Load each version the trainer commits on every replica, keep the newest max_staleness + 1 "
        "loaded and unload older ones once unused (rollout workers only read GET /live_adapters). Off: clients "
        "load and unload through /v1/load_lora_adapter themselves (TRL's trainer always may).",
    )
    watch_s: float = Field(
        0.05, gt=0, description="How often adapters/LATEST.json is read (one small GET): how soon a commit is seen."
    )
    unload_idle_s: float = Field(
        5.0,
        ge=0,
        description="A version outside the live window is unloaded once no request has named it for this long "
        "(a group or an evaluation between two requests still holds it).",
    )
    session_idle_s: float = Field(
        30.0,
        ge=0,
        description="An episode's version (a request with an X-Session-ID header) stays loaded while one of its "
        "turns ended less than this long ago: the episode's next turn uses the version its first turn used.",
    )
    mirror_wait_s: float = Field(
        60.0,
        ge=0,
        description="How long a load waits for a replica's mirror to list the version as on its disk (the "
        "replica's registry entry) before that replica fails the load.",
    )
    request_timeout_s: float = Field(
        600.0, gt=0, description="A forwarded request whose replica sends nothing for this long is given up."
    )
    adapter_root: str = Field(
        "",
        description="With static replica_urls: where the replicas find adapter version folders "
        "on their disks; empty = the bucket's adapters/ folder (bucket must be local). "
        "Registered replicas announce their own.",
    )
    max_routing_blocks: int = Field(
        1_000_000, ge=1, description="Prompt blocks the router remembers (least recently used are forgotten first)."
    )
    api_key_env: str = Field(
        "BRIGADE_REPLICA_API_KEY",
        description="Environment variable holding a bearer token for the replicas (never logged).",
    )
    admin_token_env: str = Field(
        "BRIGADE_PROXY_ADMIN_TOKEN",
        description="Environment variable holding the bearer token clients must send to load, unload, pause and "
        "resume (never logged). Without one, the proxy refuses to listen beyond loopback.",
    )
    pause_lease_s: float = Field(
        300.0,
        gt=0,
        description="A /pause without /resume ends after this long (a client that died must not leave generation "
        "paused); a failed adapter load also ends a pause.",
    )
    # A shared pool (docs/pool.md): several runs attach over HTTP, each with its own token and adapters.
    pool: bool = Field(
        False,
        description="Serve a shared replica pool: the bucket is the pool's (pool.json, written by `brigade pool "
        "init`), runs attach over HTTP with their own tokens and push their adapters (docs/pool.md); there is no "
        "run.json and no adapter watching. Off: serve the one run of the bucket's run.json.",
    )
    pool_run_timeout_s: float = Field(
        60.0,
        gt=0,
        description="Pool mode: a run whose lease (PUT /pool/runs/RUN/lease) is not renewed for this long is "
        "detached: its adapters unloaded everywhere, its adapter slots freed.",
    )
    pool_max_loras: int = Field(
        0,
        ge=0,
        description="Pool mode: adapter slots per replica for replicas that do not say (static replica_urls); "
        "registered replicas announce their --max-loras. 0 = admit no run until a replica says.",
    )
    pool_token_refresh_s: float = Field(
        1.0,
        gt=0,
        description="Pool mode: a bearer token the proxy does not know makes it re-read the run tokens "
        "(tokens/*.json) at most this often (a run given its token after the proxy started).",
    )
    # The Tinker API (proxy/tinker/, docs/tinker.md), served on a run whose run.json says api = "tinker".
    tinker_session_timeout_s: float = Field(
        120.0,
        gt=0,
        description="A Tinker client session that sent no heartbeat for this long (the SDK sends one every 10 s) is "
        "finished: its models are let go by the trainer and its sampling sessions unpin their adapter versions.",
    )
    tinker_tokenizer: str = Field(
        "",
        description="What the Tinker API tells clients to load the tokenizer from (get_info's tokenizer_id): a "
        "local model folder or a hub id; empty = the base model's name.",
    )
    snapshot_s: float = Field(
        5.0, gt=0, description="How often a routing snapshot event goes to the bucket while there is traffic."
    )
    # The desired replica count (proxy/scaling/, docs/autoscaling.md): advice for whatever starts and stops
    # replicas, exported as brigade_proxy_desired_replicas and as desired_replicas events.
    min_replicas: int = Field(1, ge=1, description="Fewest replicas the desired count ever asks for.")
    max_replicas: int = Field(
        0, ge=0, description="Most replicas the desired count ever asks for (0 = no bound: advice only)."
    )
    scale_interval_s: float = Field(
        5.0,
        ge=0,
        description="How often the desired replica count is reconsidered (reads the trainer's steps, the shards' "
        "events and trainer/progress.json from the bucket); 0 = off: no gauge, no event, no reads.",
    )
    scale_window_s: float = Field(
        60.0,
        gt=0,
        description="A signal must hold this long, at every look, before the desired count moves (hysteresis); also "
        "the span of trainer steps its waiting share is measured over.",
    )
    scale_cooldown_s: float = Field(
        180.0,
        ge=0,
        description="After the desired count moves, it stays put this long (a new vLLM replica takes minutes to "
        "start and serve, and the signals show its effect only then).",
    )
    scale_up_wait: float = Field(
        0.2,
        gt=0,
        lt=1,
        description="More replicas when the trainer spent at least this share of its time waiting for rollouts, "
        "with generations in flight, for all of scale_window_s: in proportion, N / (1 - share), at most doubling.",
    )
    scale_down_wait: float = Field(
        0.05,
        ge=0,
        lt=1,
        description="One replica fewer only while the trainer waits at most this share of its time (below "
        "scale_up_wait: the gap between them is the hysteresis band) and the backlog and idleness below hold.",
    )
    scale_down_backlog_steps: float = Field(
        1.0,
        ge=0,
        description="One replica fewer only while the rollout groups written and not yet read by the trainer are at "
        "least this many optimizer steps' worth (generation is ahead; the workers' max_unconsumed_groups holds them).",
    )
    scale_down_busy: float = Field(
        0.6,
        gt=0,
        le=1,
        description="One replica fewer only while one fewer would be busy at most this share of the time: the "
        "replicas with requests in flight averaged at most this times (replicas - 1) over scale_window_s, and "
        "none waited in the proxy for a slot.",
    )
    canary_positions: int = Field(
        8,
        ge=1,
        description="Served-policy probe: canary positions asked first, those that tell the version from the base "
        "best per prefill token (each is one prompt's prefill on the replica; 8 cost ~280 prompt tokens per "
        "replica and version, 16 cost ~600: every version pays it on every replica, several runs' versions on a "
        "shared pool).",
    )
    canary_max_positions: int = Field(
        64,
        ge=1,
        description="Served-policy probe: while the verdict is inconclusive, the positions asked double up to this "
        "many (or the canary's length); a replica still undecided then is inconclusive, and the version refused.",
    )
    canary_min_gap: float = Field(
        0.01,
        ge=0,
        description="Served-policy probe: a version whose canary logprobs are closer than this to the base (mean per "
        "probed token; the initial version is 0) is admitted as near_base without a verdict: serving the base "
        "instead would change its policy by less than this. Farther versions must be shown served (pass) or are "
        "refused. A float32 CPU replica decides from ~0.002, a bf16 one erred below 0.01 "
        "(benchmarks/proxy/probe_margin.py; its kernel noise is systematic, not Gaussian).",
    )
    canary_min_shift: float = Field(
        0.25,
        ge=0,
        le=1,
        description="Served-policy probe: the share of the version's shift from the base that separates serving "
        "the version from serving the base. A float32 replica shows 1.000 or 0.000; not 0.5, because a bf16 "
        "replica adds the small rank-1 delta in bf16 and loses part of it (0.49-0.80 served correctly).",
    )
    canary_confidence_z: float = Field(
        2.33,
        ge=0,
        description="Served-policy probe: standard errors (from the noise of the replica's own answer) the shift "
        "must clear canary_min_shift by, either way, for a verdict: 2.33 errs about once in a hundred probes each "
        "way where the noise is Gaussian; closer than that is inconclusive (more positions, then refused).",
    )
    canary_tolerance: float = Field(
        0.25,
        ge=0,
        description="Served-policy probe: largest mean |logprob| difference per canary token between a replica "
        "and the trainer's adapter before the replica is refused that version.",
    )

    @model_validator(mode="after")
    def _scaling_bounds(self) -> ProxyConfig:
        if self.max_replicas and self.max_replicas < self.min_replicas:
            raise ValueError(f"max_replicas ({self.max_replicas}) is below min_replicas ({self.min_replicas})")
        if self.scale_down_wait >= self.scale_up_wait:
            raise ValueError(
                f"scale_down_wait ({self.scale_down_wait}) must be below scale_up_wait ({self.scale_up_wait}): "
                "the gap is what keeps the desired count from flapping"
            )
        return self
