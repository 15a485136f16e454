"""`brigade plan`: published figures from architecture facts alone, parameter counts checked against
transformers on the meta device, replica flags checked against the installed vLLM's own parser."""

from __future__ import annotations

import functools
import http.server
import json
import math
import os
import subprocess
import sys
import threading
from dataclasses import replace

import pytest

from bucket.manifest import RunManifest
from infra import cli
from infra.config import Config, load
from infra.plan import Hardware, PlanError, PlanOptions, RunShape, arch_from_config, load_arch, make_plan, split
from infra.plan.sizing import (
    GB,
    rollout_kv_bytes,
    sync_bytes,
    sync_seconds_per_step,
    training_state_bytes,
    weight_bytes,
)
from replica.vllm_server import plan_server

KiB = 1024
ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# Architecture facts of each model's published config.json (the fields that size it).
LLAMA_3_1_8B = {
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "tie_word_embeddings": False,
    "max_position_embeddings": 131072,
}
LLAMA_3_3_70B = {
    **LLAMA_3_1_8B,
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
}
QWEN3_32B = {  # head_dim is not hidden / heads, and q and k are normalised per head
    "model_type": "qwen3",
    "hidden_size": 5120,
    "intermediate_size": 25600,
    "num_hidden_layers": 64,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "tie_word_embeddings": False,
    "max_position_embeddings": 40960,
}
QWEN2_5_1_5B = {  # q/k/v biases, tied embeddings
    "model_type": "qwen2",
    "hidden_size": 1536,
    "intermediate_size": 8960,
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
    "max_position_embeddings": 32768,
}


def shape(**changes: object) -> RunShape:
    """The published figures' run: rank-1 LoRA on every linear layer, 512 + 4,096-token rollouts."""
    base = RunShape(
        prompts_per_step=4,
        num_generations=8,
        prompt_tokens=512,
        completion_tokens=4096,
        lora_rank=1,
        lora_targets=ALL_LINEAR,
        weight_sync_steps=1,
    )
    return replace(base, **changes)


def gpus(n: int, gb: float, **changes: object) -> Hardware:
    return Hardware(gpus=n, gpu_memory=gb * GB, **changes)


def model_folder(root: str, name: str, config: dict) -> str:
    path = os.path.join(root, name)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path


# -- the published figures ----------------------------------------------------------------------------------


def test_kv_cache_per_token_matches_the_published_figures():
    assert arch_from_config(LLAMA_3_1_8B).kv_bytes_per_token() == 128 * KiB
    assert arch_from_config(QWEN3_32B).kv_bytes_per_token() == 256 * KiB
    assert arch_from_config(LLAMA_3_3_70B).kv_bytes_per_token() == 320 * KiB


def test_llama_8b_colocated_on_a_96_gb_card_holds_21_rollouts_of_512_plus_4096_tokens():
    arch = arch_from_config(LLAMA_3_1_8B)
    assert round(weight_bytes(arch) / GB, 1) == 16.1
    assert rollout_kv_bytes(arch, shape(), block_size=16) == 128 * KiB * 4608
    plan = split(arch, shape(), gpus(1, 96))
    assert (plan.mode, plan.share) == ("colocate", 0.3)  # one card: TRL's colocate share, 28.8 GB
    assert plan.rollouts_per_replica == 21
    # 32 rollouts per step, 21 at once: two passes; the replica never admits more than fit
    assert plan.max_num_seqs <= 21 and math.ceil(shape().rollouts_per_step / plan.concurrent_rollouts) == 2


def test_full_parameter_8b_needs_128_5_gb_of_state_and_64_2_gb_per_card_over_two_with_fsdp():
    arch, full = arch_from_config(LLAMA_3_1_8B), shape(full_finetune=True)
    assert round(training_state_bytes(arch, full) / GB, 1) == 128.5
    plan = split(arch, full, gpus(4, 96))  # 128.5 GB do not fit one 96 GB card: the trainer takes two
    assert (plan.trainer_gpus, plan.trainer_parallelism) == (2, "FSDP")
    assert round(plan.trainer_bytes_per_gpu / GB, 1) == 64.2
    # a KL term adds a BF16 reference copy for full fine-tuning, and nothing for LoRA (adapter disabled)
    assert training_state_bytes(arch, replace(full, beta=0.04)) - training_state_bytes(arch, full) == weight_bytes(arch)
    assert training_state_bytes(arch, shape(beta=0.04)) == training_state_bytes(arch, shape())


def test_full_70b_weights_synced_every_step_over_pcie_gen5_take_at_least_2_2_s():
    arch, full = arch_from_config(LLAMA_3_3_70B), shape(full_finetune=True, weight_sync_steps=1)
    assert sync_bytes(arch, full) == weight_bytes(arch)
    assert round(sync_seconds_per_step(sync_bytes(arch, full), full, 64 * GB), 1) == 2.2
    lora = sync_bytes(arch, shape())  # the rank-1 adapter: four orders of magnitude less
    assert lora < weight_bytes(arch) / 1000 and sync_seconds_per_step(lora, shape(), 64 * GB) < 0.001


def test_tensor_parallelism_shards_the_weights_and_the_kv_cache_in_the_concurrent_rollouts_figure():
    arch = arch_from_config(LLAMA_3_3_70B)
    for tp in (2, 4, 8):
        # LoRA on 70B needs two trainer cards of 80 GB; the rest is one replica of tensor-parallel size tp
        plan = split(arch, shape(), gpus(tp + 2, 80, tensor_parallel=tp))
        room = 80 * GB * 0.92 - weight_bytes(arch) / tp
        assert plan.rollouts_per_replica == math.floor(room / (320 * KiB / tp * 4608)), tp
    # beyond the 8 KV heads vLLM replicates them: a GPU still holds one head per layer
    assert arch.kv_bytes_per_token(16) == arch.kv_bytes_per_token(8) == 2 * 80 * 1 * 128 * 2
    # left to choose, the plan takes the smallest size whose replica holds a whole group, and gives the
    # GPUs that size leaves over to the trainer rather than idling them
    auto = split(arch, shape(), gpus(8, 80))
    assert (auto.tensor_parallel, auto.replicas, auto.trainer_gpus, auto.idle_gpus) == (4, 1, 4, 0)


@pytest.mark.parametrize(
    "config",
    [LLAMA_3_1_8B, QWEN3_32B, LLAMA_3_3_70B, QWEN2_5_1_5B],
    ids=["llama8b", "qwen3-32b", "llama70b", "qwen2.5"],
)
def test_parameter_counts_match_transformers_models_on_the_meta_device(config):
    torch = pytest.importorskip("torch")
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {k: v for k, v in config.items() if k != "model_type"}
    with torch.device("meta"):  # shapes only: no memory, no weights
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(config["model_type"], **fields))
    assert arch_from_config(config).parameters() == sum(p.numel() for p in model.parameters())


def test_lora_trainable_counts_match_peft_on_the_meta_device():
    torch = pytest.importorskip("torch")
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    for config, targets in ((QWEN3_32B, ALL_LINEAR), (QWEN2_5_1_5B, ("q_proj", "v_proj"))):
        fields = {k: v for k, v in config.items() if k != "model_type"}
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.for_model(config["model_type"], **fields))
            model = get_peft_model(model, LoraConfig(r=4, target_modules=list(targets)))
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        assert arch_from_config(config).lora_parameters(4, targets) == trainable


def test_the_prepared_smollm2_folder_counts_like_transformers(model_dir):
    torch = pytest.importorskip("torch")
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    arch = load_arch(model_dir)
    assert (arch.name, arch.parameters()) == ("SmolLM2-135M-Instruct", sum(p.numel() for p in model.parameters()))


# -- invalid inputs: a clear message and the nearest plan that fits ---------------------------------------------


def test_a_config_without_head_counts_is_refused_naming_the_missing_field():
    headless = {k: v for k, v in LLAMA_3_1_8B.items() if not k.startswith("num_")}
    with pytest.raises(PlanError, match="num_hidden_layers, num_attention_heads"):
        arch_from_config(headless, "mystery")
    # no num_key_value_heads is plain multi-head attention, as transformers reads it
    assert arch_from_config({k: v for k, v in LLAMA_3_1_8B.items() if k != "num_key_value_heads"}).kv_heads == 32


def test_a_share_above_1_names_the_nearest_valid_share():
    with pytest.raises(PlanError, match=r"share 1.2 is not a fraction .* nearest valid is 1.0"):
        split(arch_from_config(LLAMA_3_1_8B), shape(), gpus(2, 96, share=1.2))


def test_a_model_that_does_not_fit_says_how_many_more_gpus_it_needs():
    arch = arch_from_config(LLAMA_3_3_70B)
    with pytest.raises(PlanError, match=r"more GPUs: 4, 3 more \(--gpus 4\)") as exc:
        split(arch, shape(), gpus(1, 80))
    assert "141.3 GB" in str(exc.value)  # and says what did not fit
    split(arch, shape(), gpus(4, 80))  # the suggestion does fit


def test_too_many_concurrent_rollouts_name_fewer_rollouts_a_shorter_completion_or_more_gpus():
    arch, one_card = arch_from_config(LLAMA_3_1_8B), gpus(1, 96)
    with pytest.raises(PlanError) as exc:
        split(arch, shape(concurrent_rollouts=40), one_card)
    message = str(exc.value)
    assert "40 concurrent rollouts do not fit" in message
    assert "fewer concurrent rollouts: 21, 19 fewer (--concurrent-rollouts 21)" in message
    assert "more GPUs: 2, 1 more (--gpus 2)" in message
    shorter = int(message.split("a shorter completion: ")[1].split(" tokens")[0])
    # each suggestion is the nearest that fits: one step further does not
    split(arch, shape(concurrent_rollouts=40, completion_tokens=shorter), one_card)
    with pytest.raises(PlanError):
        split(arch, shape(concurrent_rollouts=40, completion_tokens=shorter + 16), one_card)
    with pytest.raises(PlanError):
        split(arch, shape(concurrent_rollouts=22), one_card)


def test_rollouts_longer_than_the_model_positions_suggest_the_longest_completion_that_fits():
    with pytest.raises(PlanError, match=r"exceed the 32768 positions.*a shorter completion: 32256 tokens"):
        split(arch_from_config(QWEN2_5_1_5B), shape(completion_tokens=40000), gpus(2, 80))


def test_hub_ids_are_read_over_http_and_no_network_gives_a_clear_error(tmp_path, monkeypatch):
    model_folder(str(tmp_path), "org/tiny/resolve/main", QWEN2_5_1_5B)
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    try:
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.server_address[1]}")
        assert load_arch("org/tiny").parameters() == arch_from_config(QWEN2_5_1_5B).parameters()
        with pytest.raises(PlanError, match="has no model org/missing"):
            load_arch("org/missing")
    finally:
        server.shutdown()
        server.server_close()
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens: as good as no network
    with pytest.raises(PlanError, match="without network, pass a local model folder or its config.json"):
        load_arch("org/tiny")
    with pytest.raises(PlanError, match="neither a model folder"):
        load_arch(str(tmp_path / "nowhere"))


# -- the command and the files it writes ------------------------------------------------------------------------


def test_brigade_plan_for_smollm2_on_cpu_writes_a_run_config_brigade_local_runs_with(model_dir, tmp_path, capsys):
    out = tmp_path / "plan.toml"
    assert cli.main(["plan", "--model", model_dir, "--out", str(out)]) == 0
    table = capsys.readouterr().out
    assert "22.5 KiB" in table and "--max-num-seqs 32 --max-model-len 528" in table  # 16 + 16 for the probe
    config = load(path=str(out))  # exactly how `brigade local --config plan.toml` reads it
    assert (config.local.num_replicas, config.rollout.max_inflight_groups) == (2, 4)
    assert (config.replica.max_num_seqs, config.replica.max_model_len, config.replica.kv_cache_gib) == (16, 528, 1.0)
    assert config.replica.model_path == config.trainer.model_path == os.path.abspath(model_dir)
    # everything the plan does not decide stays as brigade local's defaults
    assert (config.trainer, config.run) == (Config().trainer.model_copy(update={"model_path": model_dir}), Config().run)


def test_plan_json_carries_figures_split_flags_and_the_run_config(tmp_path, capsys):
    folder = model_folder(str(tmp_path), "Qwen2.5-1.5B-Instruct", QWEN2_5_1_5B)
    argv = ["plan", "--model", folder, "--gpus", "1", "--gpu", "h200", "--rollout.max-completion-length", "4096"]
    assert cli.main([*argv, "--json", "--link", "pcie5"]) == 0
    plan = json.loads(capsys.readouterr().out)
    per_rollout = 28 * KiB * 4608
    assert plan["figures"]["rollouts_per_replica_by_mode"] == {
        "colocate": math.floor((141 * GB * 0.3 - 2 * 1_543_714_304) / per_rollout),
        "server": math.floor((141 * GB * 0.92 - 2 * 1_543_714_304) / per_rollout),
    }
    assert plan["split"]["mode"] == "colocate" and plan["config"]["replica"]["gpu_memory_utilization"] == 0.3
    assert plan["config"]["run"]["base_model"] == "Qwen2.5-1.5B-Instruct"
    assert "--gpu-memory-utilization" in plan["replica_flags"]
    assert cli.main([*argv, "--out", str(tmp_path / "plan.json")]) == 0
    assert json.loads((tmp_path / "plan.json").read_text())["split"] == plan["split"]


def test_the_plan_gives_the_autoscaler_a_starting_count_and_its_bounds(tmp_path, capsys):
    folder = model_folder(str(tmp_path), "Llama-3.1-8B", LLAMA_3_1_8B)
    argv = ["plan", "--model", folder, "--gpus", "8", "--gpu", "h100", "--rollout.max-completion-length", "4096"]
    argv += ["--trainer.groups-per-step", "64"]
    assert cli.main([*argv, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    sp = plan["split"]
    # start with the fewest replicas whose KV caches hold the groups in flight; up to every replica there is room for
    start = math.ceil(sp["inflight_groups"] * 8 / sp["rollouts_per_replica"])
    assert plan["autoscaler"] == {"start_replicas": start, "min_replicas": 1, "max_replicas": sp["replicas"]}
    assert 1 < start < sp["replicas"] == plan["config"]["proxy"]["max_replicas"] == 7
    assert cli.main(argv) == 0
    assert f"autoscaler        start {start} replicas" in capsys.readouterr().out
    # a bound the run config sets is kept, and the start stays within it
    assert cli.main([*argv, "--proxy.max-replicas", "3", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["autoscaler"] == {
        "start_replicas": 3,
        "min_replicas": 1,
        "max_replicas": 3,
    }


def test_invalid_plans_exit_2_with_one_line(capsys):
    assert cli.main(["plan", "--gpus", "2", "--gpu", "h100", "--share", "1.2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("brigade plan: error: share 1.2") and "Traceback" not in err


def test_planning_imports_neither_torch_nor_vllm(tmp_path):
    """A run is planned on a laptop: the planner needs neither torch, transformers nor vLLM."""
    folder = model_folder(str(tmp_path), "Qwen2.5-1.5B-Instruct", QWEN2_5_1_5B)
    code = (
        "import sys; from infra.plan import main; main(['--model', sys.argv[1], '--gpus', '2', '--gpu', 'h100']); "
        "print([m for m in ('torch', 'transformers', 'peft', 'vllm') if m in sys.modules])"
    )
    done = subprocess.run([sys.executable, "-c", code, folder], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.splitlines()[-1] == "[]", done.stdout[-2000:] + done.stderr[-2000:]


def _plans(model_dir: str, root: str) -> list:
    qwen = model_folder(root, "Qwen2.5-1.5B-Instruct", QWEN2_5_1_5B)
    llama = model_folder(root, "Llama-3.3-70B-Instruct", LLAMA_3_3_70B)
    long = Config(rollout={"max_completion_length": 4096})
    return [
        make_plan(Config(), PlanOptions(model=model_dir)),
        make_plan(long, PlanOptions(model=qwen, gpus=1, gpu="h200")),
        make_plan(long, PlanOptions(model=llama, gpus=8, gpu="h100")),
    ]


# Parses each command line with vLLM's own server parser and checks, as `vllm serve` does before loading;
# for the CPU plan it also builds vLLM's engine config from the real model folder (scheduler, LoRA, lengths).
VLLM_CHECK = """
import json, sys
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
from vllm.utils.argparse_utils import FlexibleArgumentParser
out = []
for i, argv in enumerate(json.loads(sys.argv[1])):
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
    validate_parsed_serve_args(args)
    if i == 0:
        engine = AsyncEngineArgs.from_cli_args(args).create_engine_config()
        assert engine.scheduler_config.max_num_seqs == args.max_num_seqs, engine.scheduler_config
        assert engine.lora_config.max_loras == args.max_loras, engine.lora_config
    keys = ("tensor_parallel_size", "gpu_memory_utilization", "max_num_seqs", "max_model_len")
    out.append({k: getattr(args, k) for k in keys + ("max_lora_rank", "max_loras")})
print("RESULT" + json.dumps(out))
"""


def test_the_replica_flags_a_plan_emits_are_accepted_by_the_installed_vllm(model_dir, tmp_path):
    pytest.importorskip("vllm")
    plans = _plans(model_dir, str(tmp_path))
    argvs = []
    for plan in plans:
        manifest = RunManifest(**plan.config.run.model_dump(), run_id="plan", created_at=0.0)
        server = plan_server(plan.config.replica, manifest, cpu=plan.hardware.cpu)  # what `brigade replica` runs
        assert server.argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
        for name, value in zip(plan.replica_flags[::2], plan.replica_flags[1::2]):
            assert server.argv[server.argv.index(name) + 1] == value
        argvs.append(server.argv[3:])
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_LOGGING_LEVEL": "ERROR"}
    done = subprocess.run(
        [sys.executable, "-c", VLLM_CHECK, json.dumps(argvs)], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    parsed = json.loads(done.stdout.split("RESULT", 1)[1])
    for plan, args in zip(plans, parsed):
        flags = dict(zip(plan.replica_flags[::2], plan.replica_flags[1::2]))
        control = plan.config.replica.control_seqs  # vLLM runs these beyond generation's, for the probe
        assert args["max_num_seqs"] == plan.split.max_num_seqs + control == int(flags["--max-num-seqs"])
        assert args["max_model_len"] == plan.shape.sequence_tokens
        assert args["max_loras"] == plan.shape.max_staleness + 2 and args["max_lora_rank"] == 1
        if not plan.hardware.cpu:
            assert args["tensor_parallel_size"] == plan.split.tensor_parallel
            assert args["gpu_memory_utilization"] == plan.split.share
    assert [p.split.tensor_parallel for p in plans] == [1, 1, 4]
