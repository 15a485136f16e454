"""The trainer's model and what it saves: the LoRA-wrapped base model, adapter files, optimizer state.

Adapters are written as peft's two files (what vLLM loads); the optimizer
state goes to a checkpoint as safetensors with the parameter groups in its
metadata, since nothing read from the bucket is ever unpickled.
"""

from __future__ import annotations

import collections
import json
import os
import tempfile
import types

import torch
import torch.nn.functional as F
from peft import LoraConfig, PeftModel, get_peft_model, set_peft_model_state_dict
from peft.tuners.lora import Linear as LoraLinear
from peft.tuners.lora import LoraLayer
from safetensors.torch import load, save
from transformers import AutoModelForCausalLM

from bucket import adapters
from bucket.config import ConfigError
from bucket.finite import nonfinite_tensors
from bucket.manifest import RunManifest, RunSpec
from jobkit.cpu import native_bf16
from trainer.families import FUSED_QKV_FAMILIES, peft_targets
from trainer.kernels.projections import CONCAT_ATTR, CONCAT_BIAS_ATTR, concat_weights, fuse_qkv
from trainer.kernels.swiglu_lora import swiglu_lora, swiglu_lora_packed
from trainer.packing import PACKED_ATTENTION, causal_lm, set_matmul_dtype

OPTIMIZER_FILE = "optimizer.safetensors"


def check_model_dir(path: str) -> None:
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(
            f"model folder {path} does not exist or has no config.json: build it with `brigade prepare-model` "
            "or point --trainer.model-path at a Hugging Face-format model folder"
        )


def resolve_device(device: str) -> torch.device:
    return torch.device(("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """The base weights' dtype."""
    return (torch.bfloat16 if device.type == "cuda" else torch.float32) if dtype == "auto" else getattr(torch, dtype)


def resolve_matmul_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """The dtype the step's matmuls run in: the weights' own, except `auto` on a CPU with native bf16, where fp32
    weights are multiplied in bf16 under autocast (normalisation and the log-softmax stay fp32): the
    long-tail CPU step 16.3-18.6 s -> 12.6-13.4 s (benchmarks/trainer/step.py, 1 group of 8)."""
    if dtype == "auto" and device.type == "cpu" and native_bf16():
        return torch.bfloat16
    return resolve_dtype(dtype, device)


def build_model(model_path: str, dtype: str, manifest: RunManifest, device: str = "cpu") -> PeftModel:
    """The base model with the run's LoRA, on `device`, running packed rows (trainer/packing.py)."""
    dev = resolve_device(device)
    base = AutoModelForCausalLM.from_pretrained(
        model_path, dtype=resolve_dtype(dtype, dev), attn_implementation=PACKED_ATTENTION
    )
    model = wrap_lora(base, manifest).to(dev)
    set_matmul_dtype(model, resolve_matmul_dtype(dtype, dev))
    return model


def wrap_lora(base: torch.nn.Module, spec: RunSpec) -> PeftModel:
    """The run's LoRA (rank, alpha, target modules from the run spec) on a base model."""
    lora = LoraConfig(
        r=spec.lora_rank,
        lora_alpha=spec.lora_alpha,
        target_modules=peft_targets(spec.lora_target_modules),
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(base, lora)
    # Trainable (LoRA) parameters in float32 even when the base runs in bf16: rank-1 updates are tiny.
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    if base.dtype != torch.float32:
        # The forward then runs under autocast (packed_logprobs): peft's cast of every LoRA input to float32
        # would only be cast back, a copy of the activations per linear layer.
        for m in model.modules():
            if isinstance(m, LoraLayer):
                m.cast_input_dtype_enabled = False
    use_rank1_lora(model)
    return model


# Token budget on a GPU: the largest power of two whose activations fit in this share of the memory free once the
# model is loaded, between these bounds. Measured peaks for Qwen2.5-1.5B on an H200 (bf16, 28 layers, hidden 1536,
# intermediate 8960) at 32768 tokens: 48 GB compiled, 87 GB eager (about 2.5 MB a token);
# `activation_bytes_per_token` estimates 2.7 MB from the shape, a little over the eager figure.
GPU_MEMORY_SHARE = 0.85
GPU_TOKEN_BUDGETS = (4096, 65536)
# On a CPU, SmolLM2-135M, 4 long-tail groups of 8 (benchmarks/trainer/step.py): 1024 tokens 66.7 s/step, 3.3 GB;
# 2048 57.9 s, 5.4 GB (fewer groups split, so fewer prompts repeated); 4096 53.8 s, 7.7 GB.
CPU_TOKEN_BUDGET = 2048


def activation_bytes_per_token(config) -> int:
    """Bytes the backward keeps per token of a row: per layer about 5 x intermediate + 2 x hidden values, in bf16."""
    return 2 * config.num_hidden_layers * (5 * config.intermediate_size + 2 * config.hidden_size)


def default_token_budget(model: torch.nn.Module, device: torch.device) -> int:
    """The token budget `token_budget = 0` stands for: on a GPU, from its free memory and the model's shape (32768
    for Qwen2.5-1.5B on an H200, 16384 on an 80 GB GPU); on a CPU, CPU_TOKEN_BUDGET."""
    if device.type != "cuda":
        return CPU_TOKEN_BUDGET
    free, _ = torch.cuda.mem_get_info(device)
    per_token = activation_bytes_per_token(causal_lm(model).config)
    low, high = GPU_TOKEN_BUDGETS
    budget = low
    while budget < high and 2 * budget * per_token <= GPU_MEMORY_SHARE * free:
        budget *= 2
    return budget


class Rank1LoraLinear(LoraLinear):
    """peft's LoRA linear layer, with the rank-1 update y = W x + s (a . x) b computed without its [N, 1] x [1, d]
    matrix product and the full-size `* scaling` and `+` that follow it:

    - eager: one addmm adds s (a . x) b into the base layer's output (forward: one pass over the output instead
      of three; backward: two matrix-vector products, no full-size multiply);
    - compiled (torch.compile): element-wise work and reductions, which inductor fuses with the layer's
      neighbours, where the matrix form calls cuBLAS for its [N, d] x [d, 1] products (slow, memory-bound
      kernels) forward and backward.

    The parameters, their names and what is saved are peft's (the class only replaces `forward`); anything else
    (rank > 1, adapter disabled, merged, dropout, variants, extra arguments) runs peft's own forward."""

    def rank1(self) -> tuple[torch.Tensor, torch.Tensor, float] | None:
        """(a [in], b [out], scaling) of the one active rank-1 adapter, or None where peft's forward must run."""
        if self.disable_adapters or self.merged or getattr(self, "lora_variant", None):
            return None
        active = [n for n in self.active_adapters if n in self.lora_A]
        if len(active) != 1 or not isinstance(self.lora_dropout[active[0]], torch.nn.Identity):
            return None
        a, b = self.lora_A[active[0]].weight, self.lora_B[active[0]].weight  # [1, in], [out, 1]
        return (a[0], b[:, 0], self.scaling[active[0]]) if a.shape[0] == 1 else None

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        factors = None if args or kwargs else self.rank1()
        if factors is None:
            return super().forward(x, *args, **kwargs)
        a, b, scaling = factors
        result = self.base_layer(x)
        if torch.compiler.is_compiling():
            # products in x's dtype (bf16 on a GPU, as peft's matmuls under autocast), sums accumulated in fp32;
            # only x is kept for the backward, not an fp32 copy of it
            m = (x * a.to(x.dtype)).sum(-1, keepdim=True, dtype=torch.float32)  # [..., 1]
            return result + (m * scaling).to(result.dtype) * b.to(result.dtype)
        m = F.linear(x, a[None]).reshape(-1, 1)  # [N, 1]
        out = torch.addmm(result.reshape(-1, result.shape[-1]), m, b[None], alpha=scaling)
        return out.view(result.shape)


def use_rank1_lora(model: torch.nn.Module, on: bool = True) -> None:
    """Run rank-1 LoRA linear layers as Rank1LoraLinear (on) or as peft's own class (off); nothing else changes."""
    for m in model.modules():
        if type(m) is (LoraLinear if on else Rank1LoraLinear):
            m.__class__ = Rank1LoraLinear if on else LoraLinear


# q/k/v and gate/up each as one product of concatenated frozen weights (trainer/kernels/projections.py), with the
# fused MLP: off, no measurable win on an H100 (0.992 against 0.997 s, docs/trainer-gpu.md; equal within bf16).
CONCAT_PROJECTIONS = False


def fuse_lora_mlps(model: torch.nn.Module, concat: bool | None = None) -> int:
    """Run each SwiGLU MLP whose gate, up and down projections are rank-1 LoRA layers as one op
    (trainer/kernels/swiglu_lora.py: its backward one pass over the [N, intermediate] tensors instead of inductor's
    many). With `concat` (default CONCAT_PROJECTIONS), gate and up also run as one product, and so do each attention
    module's q, k and v (trainer/kernels/projections.py). Returns how many MLPs were fused. The parameters and what
    is saved do not change."""
    concat = CONCAT_PROJECTIONS if concat is None else concat
    fused = 0
    for mod in model.modules():
        family = getattr(getattr(mod, "config", None), "model_type", None)
        if concat and hasattr(mod, "q_proj") and family in FUSED_QKV_FAMILIES:
            fuse_qkv(mod)
        parts = [getattr(mod, name, None) for name in ("gate_proj", "up_proj", "down_proj")]
        silu = getattr(getattr(mod, "config", None), "hidden_act", None) == "silu"
        if silu and all(type(p) is Rank1LoraLinear for p in parts):
            if concat:
                concat_weights(mod, parts[:2])
            mod.forward = types.MethodType(_fused_mlp_forward, mod)
            fused += 1
    return fused


def _fused_mlp_forward(mlp: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    gate, up, down = mlp.gate_proj, mlp.up_proj, mlp.down_proj
    factors = gate.rank1(), up.rank1(), down.rank1()
    if any(f is None for f in factors):  # adapter disabled or merged: the MLP as transformers writes it
        return down(mlp.act_fn(gate(x)) * up(x))
    (ag, bg, sg), (au, bu, su), (ad, bd, sd) = factors
    x2 = x.reshape(-1, x.shape[-1])
    mg = (x2 * ag.to(x2.dtype)).sum(-1, dtype=torch.float32) * sg  # [N]: the scaled LoRA inputs, fp32 sums
    mu = (x2 * au.to(x2.dtype)).sum(-1, dtype=torch.float32) * su
    concat = getattr(mlp, CONCAT_ATTR, None)
    if concat is not None:  # [gate | up] as one product
        h, hd = swiglu_lora_packed(F.linear(x2, concat, getattr(mlp, CONCAT_BIAS_ATTR)), mg, mu, bg, bu, ad)
    else:
        h, hd = swiglu_lora(gate.base_layer(x2), up.base_layer(x2), mg, mu, bg, bu, ad)
    out = down.base_layer(h)
    out = out + (hd * sd).to(out.dtype)[:, None] * bd.to(out.dtype)
    return out.view(*x.shape[:-1], out.shape[-1])


def compile_layers(model: PeftModel, backend: str = "inductor") -> None:
    """torch.compile each decoder layer (fuses the LoRA and normalisation element-wise work). Rows are then padded
    to a multiple of packing's `row_quantum`, and each row length compiles once (dynamic=False: a graph with a
    symbolic length would be slower, and flex attention's kernels are tuned per length). `backend`: torch.compile's
    (tests on a CPU may capture the graphs without inductor's code generation)."""
    # 16 row lengths at most (row_quantum), forward and backward
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    for layer in model.get_base_model().base_model.layers:
        layer.compile(dynamic=False, backend=backend)


class NonFiniteAdapter(RuntimeError):
    """The adapter's weights hold NaN or infinite values: publishing them would make every served logprob NaN."""

    def __init__(self, tensors: list[str]):
        self.tensors = tensors
        shown = ", ".join(tensors[:3]) + (f" and {len(tensors) - 3} more" if len(tensors) > 3 else "")
        super().__init__(
            f"the adapter's weights hold NaN or infinite values ({shown}): it is not published. The training "
            "diverged: lower trainer.learning_rate or trainer.max_grad_norm, check the rewards for NaN or huge "
            "values; a restarted trainer resumes from the last published version's checkpoint."
        )


def adapter_files(model: PeftModel) -> dict[str, bytes]:
    """The adapter's files as published; raises NonFiniteAdapter for weights with NaN or infinite values, so that
    no publish path (GRPO's, the Tinker API's) can commit them."""
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        out = {}
        for name in adapters.ADAPTER_FILES:
            with open(os.path.join(tmp, name), "rb") as f:
                out[name] = f.read()
    bad = nonfinite_tensors(out[adapters.ADAPTER_WEIGHTS])
    if bad:
        raise NonFiniteAdapter(bad)
    return out


def load_adapter_weights(model: PeftModel, files: dict[str, bytes]) -> None:
    set_peft_model_state_dict(model, load(files["adapter_model.safetensors"]))


def optimizer_bytes(optimizer: torch.optim.Optimizer) -> bytes:
    sd = optimizer.state_dict()
    tensors = {f"{idx}.{k}": v.contiguous() for idx, st in sd["state"].items() for k, v in st.items()}
    return save(tensors, metadata={"param_groups": json.dumps(sd["param_groups"])})


def load_optimizer(optimizer: torch.optim.Optimizer, data: bytes) -> None:
    # safetensors = 8-byte little-endian header length, then a JSON header holding our metadata
    header = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
    groups = json.loads(header["__metadata__"]["param_groups"])
    state: dict[int, dict] = collections.defaultdict(dict)
    for key, value in load(data).items():
        idx, name = key.split(".", 1)
        state[int(idx)][name] = value
    optimizer.load_state_dict({"state": dict(state), "param_groups": groups})
