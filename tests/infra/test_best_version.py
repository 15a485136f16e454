"""The best held-out version beside the final one (infra/best_version.py): a run whose accuracy falls is called out
in its summary, and `brigade export --version best` writes that version.

The runs are recorded as a rollout worker records them: `eval` events through the bucket's EventLog (the
accuracies of issue 34's 100-step run, 200 sums each), read back the way `brigade summary` reads them.
"""

from __future__ import annotations

import os

from bucket import Store, adapters, events
from bucket.events import EventLog
from infra.best_version import best_line
from infra.cli import main
from infra.summary import learning_figures

# issue 34's run: peaks at v64, then falls for five evaluations in a row
FALLING = {0: 0.25, 8: 0.31, 16: 0.46, 24: 0.595, 32: 0.655, 40: 0.72, 48: 0.685, 56: 0.715, 64: 0.725, 72: 0.68}
FALLING |= {80: 0.675, 88: 0.67, 96: 0.655, 101: 0.635}


def _recorded(tmp_path, accuracies: dict[int, float], total: int = 200) -> Store:
    store = Store(str(tmp_path / "bucket"))
    store.check_reachable(create=True)
    log = EventLog(store, "rollout_worker")
    for version, accuracy in accuracies.items():
        log.emit(events.EVAL, version=version, accuracy=accuracy, total=total, correct=round(accuracy * total))
    return store


def _figures(store: Store) -> dict:
    evals = [e for e in events.read_all(store) if e["kind"] == events.EVAL]
    return learning_figures(evals, [], 0, t0=min(e["ts"] for e in evals))


def test_a_run_that_lost_accuracy_names_its_best_version_and_warns(tmp_path):
    summary = _figures(_recorded(tmp_path, FALLING))
    assert (summary["best_version"], summary["best_accuracy"]) == (64, 0.725)
    assert summary["final_accuracy"] == 0.635 and summary["final_accuracy_version"] == 101
    # 9 points below the best: 2.8 standard errors of a 200-sum evaluation at 0.725
    assert summary["final_below_best"] and 2.7 < summary["final_below_best_se"] < 2.9, summary
    (line,) = best_line(summary)
    assert "v64 0.725" in line and "WARNING" in line and "brigade export --version best" in line


def test_a_run_within_noise_of_its_best_is_not_warned_about(tmp_path):
    summary = _figures(_recorded(tmp_path, {0: 0.25, 8: 0.6, 16: 0.72, 24: 0.70}))
    assert summary["best_version"] == 16 and not summary["final_below_best"]  # 2 points: 0.6 standard errors
    assert best_line(summary) == ["best held-out         v16 0.720"]


def test_export_of_the_best_version_writes_that_versions_files(tmp_path, model_dir):
    store = _recorded(tmp_path, {0: 0.25, 1: 0.4, 2: 0.6, 3: 0.5})
    files = {v: adapters_files(model_dir, tmp_path, v) for v in (1, 2, 3)}
    for v, made in files.items():
        adapters.publish(store, v, made)
    out = tmp_path / "best"
    assert main(["export", "--bucket", store.url, "--version", "best", "--to", str(out)]) == 0
    weights = (out / "adapter_model.safetensors").read_bytes()  # the config is rewritten for the base model
    assert weights == files[2]["adapter_model.safetensors"] != files[3]["adapter_model.safetensors"]
    # a run with no evaluated version says what to do instead
    empty = Store(str(tmp_path / "other"))
    empty.check_reachable(create=True)
    adapters.publish(empty, 1, files[1])
    assert main(["export", "--bucket", empty.url, "--version", "best", "--to", str(tmp_path / "x")]) == 2
    assert main(["export", "--bucket", empty.url, "--version", "newest", "--to", str(tmp_path / "y")]) == 2


def adapters_files(model_dir: str, tmp_path, seed: int) -> dict[str, bytes]:
    from tests.helpers import make_adapter_files

    return make_adapter_files(model_dir, os.path.join(str(tmp_path), f"made-{seed}"), seed=seed)
