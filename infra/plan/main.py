"""`brigade plan`: from a model's config.json, the run's shape and the hardware, to a plan and a run config.

The run's shape comes from the same tables and flags every command reads (`--config run.toml`,
`--trainer.groups-per-step`, `--rollout.max-completion-length`, ...); what only the plan needs
(the model, prompt length, GPUs, link) are flags of its own. `--out plan.toml` writes the run
config with the plan's settings, which every job and `brigade local` take as `--config plan.toml`.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, fields

from bucket.config import ConfigError
from bucket.manifest import RunManifest
from infra.config import Config, Flags, add_flags, load
from infra.plan.arch import ModelArch, PlanError, load_arch, model_name
from infra.plan.report import Link, Plan, render, to_json
from infra.plan.sizing import GB, GiB, RunShape, training_state_bytes, weight_bytes
from infra.plan.split import MODES, Hardware, Split, split
from jobkit.entry import setup_logging
from jobkit.settings import to_toml
from replica.vllm_server import CPU_BLOCK_SIZE, GPU_BLOCK_SIZE, plan_server

DESCRIPTION = (
    "Plan a run's GPUs, KV cache and replica flags from the model's config.json; --out writes a run config "
    "every command accepts."
)
# The run-config settings a plan reads (its inputs, and what decides the replica flags it shows); every other
# setting of a --config file passes into --out unchanged.
FLAGS: Flags = {
    "run": ["base_model", "lora_rank", "lora_target_modules", "num_generations", "max_staleness"],
    "trainer": ["groups_per_step", "weight_sync_steps", "beta"],
    "rollout": ["max_completion_length", "max_unconsumed_groups"],
    "replica": ["model_path", "block_size", "kv_cache_gib", "max_loras"],
    "proxy": ["min_replicas", "max_replicas"],
    "local": ["num_replicas", "replicas"],
}
# Memory per card as sold (GB = 10^9 bytes), for --gpu NAME.
GPU_MEMORY_GB: dict[str, float] = {
    "l4": 24,
    "a10g": 24,
    "rtx4090": 24,
    "a100-40gb": 40,
    "l40s": 48,
    "a100-80gb": 80,
    "h100": 80,
    "h100-nvl": 94,
    "gh200": 96,
    "h200": 141,
    "b200": 180,
    "mi300x": 192,
}
# One direction of each link, GB/s, for --link NAME: what a weight sync can cross at best.
LINK_GB_S: dict[str, float] = {
    "ethernet-25g": 3.125,
    "ethernet-100g": 12.5,
    "ethernet-400g": 50,
    "pcie4": 32,
    "pcie5": 64,
    "nvlink4": 450,
    "nvlink5": 900,
}
# The replica flags a plan decides, in the order they are shown.
PLAN_FLAGS = (
    "--tensor-parallel-size",
    "--gpu-memory-utilization",
    "--max-num-seqs",
    "--max-model-len",
    "--max-lora-rank",
    "--max-loras",
)
MIN_MODEL_LEN = 64  # replica.max_model_len's floor; a larger limit than the rollouts need costs nothing


@dataclass(frozen=True)
class PlanOptions:
    """What only the plan needs; the run's shape comes from the run config."""

    model: str = ""  # folder, config.json or hub id; "" = --replica.model-path
    prompt_length: int = 512
    full_finetune: bool = False
    beta: float | None = None  # None = the trainer's own --trainer.beta, where it has one
    gpus: int = 0  # 0 = this machine's CPU, as `brigade local` runs
    gpu: str = ""
    gpu_memory_gb: float = 0.0
    mode: str = "auto"
    share: float = 0.0
    tensor_parallel_size: int = 0
    trainer_gpus: int = 0
    concurrent_rollouts: int = 0
    link: str = "pcie5"


def _link(name: str) -> Link:
    if name in LINK_GB_S:
        return Link(name, LINK_GB_S[name] * GB)
    try:
        value = float(name)
    except ValueError:
        raise PlanError(f"link {name!r}: give GB/s (e.g. --link 25) or one of {sorted(LINK_GB_S)}") from None
    if value <= 0:
        raise PlanError(f"link {name!r}: bandwidth must be positive (GB/s)")
    return Link(f"{value:g} GB/s", value * GB)


def _gpu_memory(opts: PlanOptions) -> float:
    if opts.gpu_memory_gb:
        return opts.gpu_memory_gb * GB
    if not opts.gpu:
        return 0.0
    if opts.gpu.lower() not in GPU_MEMORY_GB:
        raise PlanError(f"GPU {opts.gpu!r} is not one the planner knows ({sorted(GPU_MEMORY_GB)}): use --gpu-memory-gb")
    return GPU_MEMORY_GB[opts.gpu.lower()] * GB


def run_shape(config: Config, opts: PlanOptions) -> RunShape:
    return RunShape(
        prompts_per_step=config.trainer.groups_per_step,
        num_generations=config.run.num_generations,
        prompt_tokens=opts.prompt_length,
        completion_tokens=config.rollout.max_completion_length,
        lora_rank=config.run.lora_rank,
        lora_targets=tuple(config.run.lora_target_modules),
        full_finetune=opts.full_finetune,
        # the trainer's own KL coefficient where its settings have one
        beta=opts.beta if opts.beta is not None else getattr(config.trainer, "beta", 0.0),
        max_staleness=config.run.max_staleness,
        weight_sync_steps=config.trainer.weight_sync_steps,
        concurrent_rollouts=opts.concurrent_rollouts,
    )


def hardware(config: Config, opts: PlanOptions) -> Hardware:
    return Hardware(
        gpus=opts.gpus,
        gpu_memory=_gpu_memory(opts),
        mode=opts.mode,
        share=opts.share,
        tensor_parallel=opts.tensor_parallel_size,
        trainer_gpus=opts.trainer_gpus,
        block_size=config.replica.block_size or (GPU_BLOCK_SIZE if opts.gpus else CPU_BLOCK_SIZE),
        cpu_replicas=config.local.num_replicas if config.local.replicas in (0, "auto") else config.local.replicas,
        cpu_kv_gib=config.replica.kv_cache_gib,
    )


def model_folder(source: str) -> str | None:
    """The local folder a model source names (the folder itself, or the one holding its config.json)."""
    if os.path.isdir(source):
        return os.path.abspath(source)
    if os.path.isfile(source) and os.path.basename(source) == "config.json":
        return os.path.dirname(os.path.abspath(source))
    return None


def planned_config(config: Config, opts: PlanOptions, shape: RunShape, sp: Split) -> Config:
    """The run config with the plan's settings: what every job reads from `--config plan.toml`."""
    c = config.model_copy(deep=True)
    folder = model_folder(opts.model) if opts.model else None
    if folder:
        c.trainer.model_path = c.replica.model_path = folder
    if opts.model and "base_model" not in config.run.model_fields_set:
        c.run.base_model = model_name(opts.model)
    c.rollout.max_inflight_groups = sp.inflight_groups
    if 0 < c.rollout.max_unconsumed_groups < sp.inflight_groups:
        c.rollout.max_unconsumed_groups = sp.inflight_groups  # else backpressure would cap what is in flight
    c.replica.max_model_len = max(shape.sequence_tokens, MIN_MODEL_LEN)
    c.replica.max_num_seqs = sp.max_num_seqs
    c.replica.tensor_parallel_size = sp.tensor_parallel
    if sp.mode == "cpu":
        c.replica.kv_cache_gib = float(sp.kv_cache_gib)
    else:
        c.replica.gpu_memory_utilization = sp.share
    c.local.num_replicas = sp.replicas
    if c.local.replicas != "auto":
        c.local.replicas = 0  # num_replicas, as planned
    if "max_replicas" not in config.proxy.model_fields_set:  # the autoscaler's bound: every replica there is room for
        c.proxy.max_replicas = max(sp.replicas, c.proxy.min_replicas)
    return Config.model_validate(c.model_dump())


def replica_flags(config: Config, cpu: bool) -> tuple[tuple[str, ...], dict[str, str]]:
    """The plan's vLLM flags (and env), taken from the command line `brigade replica` builds from this config."""
    manifest = RunManifest(**config.run.model_dump(), run_id="plan", created_at=0.0)
    server = plan_server(config.replica, manifest, cpu=cpu)
    flags: list[str] = []
    for name in PLAN_FLAGS:
        if name in server.argv:
            flags += [name, server.argv[server.argv.index(name) + 1]]
    env = {"VLLM_CPU_KVCACHE_SPACE": server.env["VLLM_CPU_KVCACHE_SPACE"]} if cpu else {}
    return tuple(flags), env


def _cpu_memory_note(arch: ModelArch, shape: RunShape, sp: Split) -> list[str]:
    """A warning when the replicas and the trainer would not fit this machine's memory."""
    need = sp.replicas * (weight_bytes(arch) + sp.kv_cache_gib * GiB) + training_state_bytes(arch, shape)
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # not a POSIX system: nothing to compare with
        return []
    if need <= ram:
        return []
    return [f"replicas and trainer need at least {need / GB:.1f} GB; this machine has {ram / GB:.1f} GB"]


def _weights_note(source: str) -> list[str]:
    """The run config points the jobs at the model's folder: say so when they would find no weights there."""
    folder = model_folder(source)
    if not folder:
        return ["not a local folder: download the model and set --trainer.model-path and --replica.model-path"]
    if not glob.glob(os.path.join(folder, "*.safetensors")):
        return [f"{folder} has no *.safetensors weights yet: put the model there before starting the jobs"]
    return []


def _notes(arch: ModelArch, opts: PlanOptions, shape: RunShape, sp: Split) -> list[str]:
    notes = _cpu_memory_note(arch, shape, sp) if sp.mode == "cpu" else []
    if not arch.known_family:
        notes.append(
            f"model_type {arch.model_type!r} is counted as a Llama-style decoder (known: llama, mistral, qwen2/3)"
        )
    if opts.model:
        notes += _weights_note(opts.model)
    if opts.full_finetune:
        notes.append("brigade trains LoRA adapters: full fine-tuning figures are for comparison (no run config)")
    if sp.trainer_gpus > 1:
        notes.append(f"brigade's trainer is one process: {sp.trainer_gpus} trainer GPUs need a data-parallel launcher")
    if sp.idle_gpus:
        notes.append(
            f"{sp.idle_gpus} GPU(s) idle: give them to the trainer (--trainer-gpus) or pick a tensor-parallel size"
        )
    return notes


def make_plan(config: Config, opts: PlanOptions) -> Plan:
    """Read the model, size everything, and return the plan with the run config that carries it."""
    source = opts.model or config.replica.model_path
    arch = load_arch(source)
    shape, hw = run_shape(config, opts), hardware(config, opts)
    link = _link(opts.link)
    sp = split(arch, shape, hw)
    planned = planned_config(config, opts, shape, sp)
    flags, env = replica_flags(planned, cpu=hw.cpu)
    notes = tuple(_notes(arch, opts, shape, sp))
    return Plan(source, arch, shape, hw, link, sp, planned, flags, env, notes)


def write_plan(plan: Plan, path: str) -> None:
    """`.json`: the whole plan; anything else: the run config as TOML, headed by the plan's table as comments."""
    if path.endswith(".json"):
        text = json.dumps(to_json(plan), indent=1) + "\n"
    elif plan.shape.full_finetune:
        raise PlanError(
            "brigade's jobs train LoRA adapters: a full fine-tuning plan has no run config (use --out x.json)"
        )
    else:
        table = "\n".join(f"# {line}".rstrip() for line in render(plan).splitlines())
        text = f"{table}\n#\n# A run config: `brigade local --config {path}`, or give it to every job.\n\n" + to_toml(
            plan.config
        )
    with open(path, "w") as f:
        f.write(text)


def _int_at_least(low: int) -> Callable[[str], int]:
    def parse(value: str) -> int:
        n = int(value)
        if n < low:
            raise argparse.ArgumentTypeError(f"must be {low} or more, got {n}")
        return n

    return parse


def build_parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description=DESCRIPTION,
        epilog="The table flags are the settings a plan reads; --out carries every other setting of --config.",
    )
    parser.add_argument("--log-level", default="INFO", help="Python logging level.")
    g = parser.add_argument_group("plan (flags of `brigade plan` only; the run's shape comes from the tables below)")
    g.add_argument(
        "--model",
        default="",
        help="Model folder, its config.json, or a hub id (org/name, needs network); default: --replica.model-path.",
    )
    g.add_argument(
        "--prompt-length", type=_int_at_least(1), default=512, help="Longest prompt in tokens, chat template included."
    )
    g.add_argument("--full-finetune", action="store_true", help="Size full-parameter training instead of LoRA.")
    g.add_argument(
        "--beta",
        type=float,
        default=None,
        help="KL coefficient (default: --trainer.beta); > 0 adds a "
        "BF16 reference copy to full fine-tuning, nothing to LoRA (the base is the reference).",
    )
    g.add_argument(
        "--gpus", type=_int_at_least(0), default=0, help="GPUs in all; 0 = this machine's CPU (`brigade local`)."
    )
    g.add_argument("--gpu", default="", help=f"GPU model, for its memory: {', '.join(GPU_MEMORY_GB)}.")
    g.add_argument("--gpu-memory-gb", type=float, default=0.0, help="Memory per GPU in GB (10^9 bytes).")
    g.add_argument(
        "--mode",
        choices=MODES,
        default="auto",
        help="server: replicas and trainer on separate GPUs; "
        "colocate: they share each GPU; auto: colocate on 1 GPU, else server.",
    )
    g.add_argument(
        "--share",
        type=float,
        default=0.0,
        help="vLLM's fraction of each replica GPU; 0 = 0.92 (server) or 0.3 (colocate).",
    )
    g.add_argument(
        "--tensor-parallel-size", type=_int_at_least(0), default=0, help="GPUs per replica; 0 = chosen by the plan."
    )
    g.add_argument(
        "--trainer-gpus", type=_int_at_least(0), default=0, help="Trainer GPUs; 0 = as few as its state needs."
    )
    g.add_argument(
        "--concurrent-rollouts",
        type=_int_at_least(0),
        default=0,
        help="Rollouts to generate at once; 0 = one optimizer step's worth, if it fits.",
    )
    g.add_argument("--link", default="pcie5", help=f"Link a weight sync crosses: GB/s, or {', '.join(LINK_GB_S)}.")
    g.add_argument("--json", action="store_true", help="Print the plan as JSON instead of a table.")
    g.add_argument("--out", metavar="FILE", help="Write the plan: FILE.toml = a run config for --config; FILE.json.")
    add_flags(parser, FLAGS)
    return parser


def main(argv: list[str] | None = None, prog: str = "brigade plan") -> int:
    args = build_parser(prog).parse_args(argv)
    setup_logging(args.log_level or "INFO")
    opts = PlanOptions(**{f.name: getattr(args, f.name) for f in fields(PlanOptions)})
    try:
        plan = make_plan(load(args), opts)
        if args.out:
            write_plan(plan, args.out)
    except ConfigError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(to_json(plan), indent=1) if args.json else render(plan))
    if args.out and not args.json:
        print(f"\nplan written to {args.out}: `brigade local --config {args.out}`, or give it to every job")
    return 0
