"""What `brigade local` prints while its run goes on, read back from the bucket's events."""

from __future__ import annotations

import json
import sys

from bucket import appendlog, events, layout
from bucket.store import Store
from infra.dashboard.terminal import LiveView


def progress_display(store: Store) -> Progress | LiveView:
    """A live view when stdout is a terminal; else one plain line per event (a log file, CI, a pipe)."""
    return LiveView(store) if sys.stdout.isatty() else Progress(store)


class Progress:
    """Prints what the jobs report to the bucket, reading only new events; each line after `prefix` (the run's
    name when several runs print at once)."""

    def __init__(self, store: Store, prefix: str = ""):
        self.store, self.cursors, self.prefix = store, {}, prefix

    def close(self) -> None:
        pass  # every line is printed already

    def poll(self) -> None:
        new = appendlog.read_after(self.store, layout.EVENTS, self.cursors)
        for rec in new:
            self.cursors[rec.writer] = rec.seq
        for e in sorted((r.body for r in new), key=lambda e: e["ts"]):
            if e["kind"] == events.TRAIN_STEP:
                cut = e.get("completions/clipped_ratio")  # absent from a trainer older than the field
                self.say(
                    f"  step {e['step']:>4}  reward {e['reward']:.3f}  ratio {e['ratio']:.4f}  "
                    f"staleness {e['sample/staleness_mean']:.2f}  "
                    + ("" if cut is None else f"cut {cut:.0%}  ")
                    + f"{e['perf/step_s']:.1f}s"
                )
            elif e["kind"] == events.PUBLISHED:
                self.say(f"  adapter v{e['version']} published at step {e['step']}")
            elif e["kind"] == events.LOADED_ALL:
                self.say(f"  adapter v{e['version']} loaded on every replica ({e.get('seconds', 0):.2f}s fan-out)")
            elif e["kind"] == events.EVAL:
                self.say(_eval_line(e))
            elif e["kind"] == events.CURRICULUM:
                self.say(f"  curriculum: training prompts now at level {e['level']}")
            elif e["kind"] == events.LOAD_FAILED:
                self.say(f"  adapter v{e.get('version')} load FAILED: {json.dumps(e.get('failed', ''))[:300]}")

    def say(self, line: str) -> None:
        print(self.prefix + line, flush=True)


def _eval_line(e: dict) -> str:
    """An `eval` event in words; a cut one's accuracy is said to be partial, never the version's."""
    if e.get("partial"):
        acc = "-" if e.get("accuracy") is None else f"{e['accuracy']:.3f}"
        return (
            f"  evaluation of v{e['version']} {e.get('cut', 'cut')}: partial accuracy {acc} on "
            f"{e['total']} of {e.get('planned', '?')} prompts ({e['seconds']:.0f}s), not the version's"
        )
    line = (
        f"  held-out accuracy of v{e['version']}: {e['accuracy']:.3f} ({e['correct']}/{e['total']}, "
        f"{e['seconds']:.0f}s)"
    )
    if "environment" in e:  # an environment run's episodes (rollout_worker/environments/held_out.py)
        mean = "-" if e.get("mean_reward") is None else f"{e['mean_reward']:.3f}"
        line += f"; episodes: mean reward {mean}, {e.get('env_errors', 0)} ended by an environment error"
    return line
