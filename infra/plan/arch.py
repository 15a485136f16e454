"""A decoder model's architecture facts, read from its config.json: parameter counts, LoRA shapes, KV per token.

Everything here is arithmetic on the config: no torch, no weights, so a run can be planned on a
laptop before any model is downloaded.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Any

import httpx

from bucket.config import ConfigError
from trainer.families import ALL_LINEAR, PACKED_LINEARS

BF16_BYTES = 2

# What config.json does not say but the modelling code does: Qwen2 always has q/k/v biases, Qwen3
# normalises queries and keys per head. Families not listed are counted as Llama-style decoders.
FAMILY_QUIRKS: dict[str, dict[str, bool]] = {
    "llama": {},
    "mistral": {},
    "qwen2": {"qkv_bias": True},
    "qwen3": {"qk_norm": True},
    "smollm3": {},
    "phi3": {},
    # Gemma normalises before and after both the attention and the MLP (four norms a block)
    "gemma2": {"sandwich_norms": True},
    "gemma3_text": {"sandwich_norms": True, "qk_norm": True},
    # every linear layer has a bias, and the norms are LayerNorms (a weight and a bias)
    "gpt_neox": {"linear_biases": True, "layer_norm_bias": True},
}
# Keys of mixture-of-experts configs: their expert weights follow other rules than a dense MLP.
MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


class PlanError(ConfigError):
    """The plan cannot be made as asked; the message says why and what would fit instead."""


@dataclass(frozen=True)
class ModelArch:
    """The shape of a dense decoder-only transformer, as far as memory is concerned."""

    name: str
    model_type: str
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied_embeddings: bool
    max_positions: int
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sandwich_norms: bool = False
    linear_biases: bool = False
    layer_norm_bias: bool = False

    @property
    def known_family(self) -> bool:
        return self.model_type in FAMILY_QUIRKS

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each linear layer of one block, by the module name peft targets."""
        q_out, kv_out = self.heads * self.head_dim, self.kv_heads * self.head_dim
        if self.model_type == "gpt_neox":  # q/k/v as one projection, an MLP without a gate
            return {
                "query_key_value": (self.hidden, q_out + 2 * kv_out),
                "dense": (q_out, self.hidden),
                "dense_h_to_4h": (self.hidden, self.intermediate),
                "dense_4h_to_h": (self.intermediate, self.hidden),
            }
        if self.model_type in PACKED_LINEARS:  # Phi-3: q/k/v as one projection, gate/up as one
            return {
                "qkv_proj": (self.hidden, q_out + 2 * kv_out),
                "o_proj": (q_out, self.hidden),
                "gate_up_proj": (self.hidden, 2 * self.intermediate),
                "down_proj": (self.intermediate, self.hidden),
            }
        return {
            "q_proj": (self.hidden, q_out),
            "k_proj": (self.hidden, kv_out),
            "v_proj": (self.hidden, kv_out),
            "o_proj": (q_out, self.hidden),
            "gate_proj": (self.hidden, self.intermediate),
            "up_proj": (self.hidden, self.intermediate),
            "down_proj": (self.intermediate, self.hidden),
        }

    def block_parameters(self) -> int:
        linears = sum(i * o for i, o in self.linear_shapes().values())
        biases = 0
        if self.linear_biases:
            biases = sum(o for _, o in self.linear_shapes().values())
        else:
            if self.qkv_bias:
                biases += (self.heads + 2 * self.kv_heads) * self.head_dim
            if self.o_bias:
                biases += self.hidden
            if self.mlp_bias:
                biases += 2 * self.intermediate + self.hidden
        norms = (4 if self.sandwich_norms else 2) * self.hidden + (2 * self.head_dim if self.qk_norm else 0)
        return linears + biases + norms * self.norm_factor

    @property
    def norm_factor(self) -> int:
        return 2 if self.layer_norm_bias else 1

    def parameters(self) -> int:
        """Every parameter: embeddings, blocks, final norm, and the LM head unless it is the embedding matrix."""
        embeddings = self.vocab * self.hidden
        head = 0 if self.tied_embeddings else self.vocab * self.hidden
        return embeddings + self.layers * self.block_parameters() + self.hidden * self.norm_factor + head

    def lora_parameters(self, rank: int, targets: list[str] | tuple[str, ...]) -> int:
        """Trainable parameters of a LoRA: rank x (in + out) per targeted linear layer (A is r x in, B out x r);
        `all-linear` targets every linear layer of the block, as peft's all-linear and the trainer do."""
        shapes = self.linear_shapes()
        if [t.lower() for t in targets] == [ALL_LINEAR]:
            targets = list(shapes)
        unknown = sorted(set(targets) - set(shapes))
        if unknown:
            raise PlanError(
                f"LoRA target modules {unknown} are not linear layers of a {self.model_type} block; "
                f"choose among {list(shapes)} or {ALL_LINEAR} (--run.lora-target-modules)"
            )
        return self.layers * sum(rank * (shapes[t][0] + shapes[t][1]) for t in set(targets))

    def kv_bytes_per_token(self, tensor_parallel: int = 1) -> int:
        """KV cache of one token on one GPU: 2 (K and V) x layers x KV heads x head dim x BF16 bytes.

        Tensor parallelism splits the KV heads across GPUs; with more GPUs than KV heads vLLM
        replicates them, so a GPU never holds less than one head.
        """
        heads_per_gpu = max(1, -(-self.kv_heads // tensor_parallel))
        return 2 * self.layers * heads_per_gpu * self.head_dim * BF16_BYTES

    def valid_tensor_parallel(self, tp: int) -> bool:
        """vLLM splits attention heads evenly; KV heads are split evenly or replicated evenly."""
        kv_ok = self.kv_heads % tp == 0 or tp % self.kv_heads == 0
        return self.heads % tp == 0 and kv_ok


def _require(config: dict[str, Any], source: str, *keys: str) -> None:
    missing = [k for k in keys if not isinstance(config.get(k), int) or config[k] <= 0]
    if missing:
        raise PlanError(
            f"config.json of {source} has no {', '.join(missing)}: the planner needs the layer, width and "
            "attention head counts of a decoder language model (for a multimodal model, pass its text model's "
            "config.json)"
        )


def arch_from_config(config: dict[str, Any], source: str = "the model") -> ModelArch:
    """A ModelArch from a Hugging Face config.json (a multimodal config's `text_config` is used when present)."""
    if "num_hidden_layers" not in config and isinstance(config.get("text_config"), dict):
        config = config["text_config"]
    if any(config.get(k) for k in MOE_KEYS):
        raise PlanError(
            f"{source} is a mixture-of-experts model: the planner counts dense models only (its expert weights "
            "would be miscounted)"
        )
    _require(
        config, source, "num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "vocab_size"
    )
    heads = config["num_attention_heads"]
    # Absent num_key_value_heads means plain multi-head attention; absent head_dim means hidden / heads.
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    model_type = str(config.get("model_type", "unknown"))
    attention_bias = bool(config.get("attention_bias", False))
    quirks = FAMILY_QUIRKS.get(model_type, {})
    return ModelArch(
        name=source,
        model_type=model_type,
        layers=config["num_hidden_layers"],
        hidden=config["hidden_size"],
        intermediate=config["intermediate_size"],
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        vocab=config["vocab_size"],
        tied_embeddings=bool(config.get("tie_word_embeddings", False)),
        max_positions=int(config.get("max_position_embeddings") or 0),
        qkv_bias=attention_bias or quirks.get("qkv_bias", False),
        o_bias=attention_bias,
        mlp_bias=bool(config.get("mlp_bias", False)),
        qk_norm=quirks.get("qk_norm", False),
        sandwich_norms=quirks.get("sandwich_norms", False),
        linear_biases=quirks.get("linear_biases", False),
        layer_norm_bias=quirks.get("layer_norm_bias", False),
    )


def _fetch_hub_config(repo: str) -> dict[str, Any]:
    """config.json of a hub model, over HTTP (HF_ENDPOINT and HF_TOKEN honoured as the hub's own client does)."""
    hint = f"pass a local model folder or its config.json instead (e.g. `hf download {repo} config.json`)"
    if os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0"):
        raise PlanError(f"{repo} looks like a hub id, but HF_HUB_OFFLINE is set: {hint}")
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
    token = os.environ.get("HF_TOKEN")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    url = f"{endpoint}/{repo}/resolve/main/config.json"
    try:
        response = httpx.get(url, headers=headers, timeout=15, follow_redirects=True)
    except httpx.HTTPError as exc:
        raise PlanError(f"cannot read {url} ({type(exc).__name__}: {exc}); without network, {hint}") from None
    if response.status_code in (401, 403):
        raise PlanError(f"{repo} is gated or private on {endpoint}: set HF_TOKEN, or {hint}")
    if response.status_code == 404:
        raise PlanError(f"{endpoint} has no model {repo} (404): check the id, or {hint}")
    if response.status_code != 200:
        raise PlanError(f"{url} answered HTTP {response.status_code}: {hint}")
    try:
        return response.json()
    except ValueError:
        raise PlanError(f"{url} did not return JSON: {hint}") from None


def read_model_config(source: str) -> dict[str, Any]:
    """config.json from a local model folder, a config.json file, or a hub id (org/name, needs network)."""
    path = os.path.join(source, "config.json") if os.path.isdir(source) else source
    if os.path.isfile(path):
        try:
            with open(path) as f:
                return json.load(f)
        except (OSError, ValueError) as exc:
            raise PlanError(f"cannot read {path} as JSON: {exc}") from None
    if os.path.isdir(source):
        raise PlanError(f"{source} has no config.json: is it a Hugging Face model folder?")
    if HUB_ID.fullmatch(source) and not source.startswith((".", "/")):
        return _fetch_hub_config(source)
    raise PlanError(
        f"{source} is neither a model folder, a config.json file nor a hub id (org/name); "
        "build the default model with `brigade prepare-model`"
    )


def model_name(source: str) -> str:
    """A short name for a model source: the folder's name, or the last part of a hub id."""
    path = os.path.abspath(source) if os.path.exists(source) else source.rstrip("/")
    if os.path.isfile(path):
        folder, file = os.path.split(path)
        return os.path.basename(folder) if file == "config.json" else os.path.splitext(file)[0]
    return os.path.basename(path) or source


def load_arch(source: str) -> ModelArch:
    return arch_from_config(read_model_config(source), model_name(source))
