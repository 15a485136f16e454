"""`brigade local` end to end, for real: 2 vLLM replicas, the proxy, a rollout worker and the trainer,
each its own process, coordinating through a local-folder bucket. Every check reads the bucket.

The run is the session-wide `local_run` fixture (tests/conftest.py), shared with
tests/infra/test_dashboard.py. It runs before the tests that share the session-wide replicas
(tests/conftest.py orders those last): only one set of vLLM servers is up at a time on a 2-core machine.
"""

from __future__ import annotations

import collections
import json
import re
import statistics

from bucket import checkpoints, events
from bucket.manifest import read_manifest
from bucket.rollouts import read_shards
from infra.summary import summarize
from tests.helpers import LOCAL_RUN_STEPS as STEPS
from tests.helpers import LOCAL_RUN_SYNC as SYNC


def test_run_succeeds_and_prints_summary(local_run):
    proc, _ = local_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "trained samples/s" in proc.stdout
    assert "adapter versions" in proc.stdout
    # each step's line says the share of its completions cut at their token limit (the trainer's event field)
    assert any(re.search(r"^  step +\d+ .* cut \d+%  ", line) for line in proc.stdout.splitlines()), proc.stdout[-3000:]
    assert any(line.startswith("CPU ") for line in proc.stdout.splitlines()[:5])  # what the CPU has, first


def test_a_finished_run_is_not_cut_and_names_its_cpu(local_run):
    _, store = local_run
    run_dir = store.root.rsplit("/", 1)[0]
    with open(f"{run_dir}/summary.json") as f:
        s = json.load(f)
    assert s["cut"] is None and s["cut_note"] == "" and s["done"]
    assert s["final_evaluation"] == "complete" and s["evaluations_cut"] == []
    assert s["cpu"]["cpu_cores"] >= 1 and "avx2" in s["cpu"]["cpu_flags"]


def test_adapters_published_and_loaded_on_both_replicas(local_run):
    _, store = local_run
    s = summarize(store)
    assert s["steps"] == STEPS
    assert s["adapter_versions"] >= 1 + STEPS // SYNC
    on_both = [v for v in s["versions"] if len(v["replicas_loaded"]) == 2]
    assert len(on_both) >= 3, s["versions"]
    assert all(v["commit_to_all_loaded_s"] is not None and v["commit_to_all_loaded_s"] >= 0 for v in on_both)


def test_every_rollout_consumed_exactly_once_within_staleness(local_run):
    _, store = local_run
    lineage = checkpoints.lineage(store)
    trained = [g for st in lineage for g in st.trained]
    dropped = [g for st in lineage for g in st.dropped_stale]
    skipped = [g for st in lineage for g in st.skipped_zero_variance]  # equal rewards: no signal, never trained
    pending = lineage[-1].pending
    consumed = trained + dropped + skipped + pending
    assert len(consumed) == len(set(consumed)), "a group was consumed twice"
    assert len(trained) + len(skipped) == STEPS * 2
    # every group of every shard up to the trainer's cursors is accounted for; the rest came after the last step
    cursors = lineage[-1].cursors
    shards = read_shards(store, {})
    assert not [s.error for s in shards if s.shard is None]
    read = {str(gid) for s in shards if s.record.seq <= cursors.get(s.record.writer, -1) for gid, _ in s.groups()}
    assert read == set(consumed)
    # staleness: groups trained between checkpoint k-1 and k were trained at the version of checkpoint k-1
    groups = {str(gid): g for s in shards for gid, g in s.groups()}
    manifest = read_manifest(store)
    for parent, child in zip(lineage, lineage[1:]):
        for gid in child.trained:
            assert parent.version - groups[gid].adapter_version <= manifest.max_staleness
        for gid in child.dropped_stale:
            assert parent.version - groups[gid].adapter_version > manifest.max_staleness


def test_replicas_served_more_than_one_adapter_version(local_run):
    _, store = local_run
    served: dict[str, set[int]] = collections.defaultdict(set)
    for s in read_shards(store, {}):
        for _, g in s.groups():
            for sample in g.samples:
                served[sample.replica].add(g.adapter_version)
    assert set(served) >= {"replica-0", "replica-1"}, dict(served)
    assert all(len(v) > 1 for k, v in served.items() if k.startswith("replica-")), dict(served)


def test_sync_latency_events_present(local_run):
    _, store = local_run
    kinds = collections.Counter(e["kind"] for e in events.read_all(store))
    for kind in (events.PUBLISHED, events.DETECTED, events.LOADED, events.LOADED_ALL, events.FIRST_ROLLOUT):
        assert kinds[kind] >= 3, (kind, kinds)
    assert json.dumps(summarize(store))  # the summary is plain JSON


def test_held_out_accuracy_of_the_base_and_the_final_version(local_run):
    proc, store = local_run
    s = summarize(store)
    evals = [e for e in events.read_all(store) if e["kind"] == events.EVAL]
    assert {e["total"] for e in evals} == {16} and len({e["eval_set"] for e in evals}) == 1
    versions = [e["version"] for e in evals]
    final = max(v["version"] for v in s["versions"])
    assert versions[0] == 0 and final in versions  # the base first, the trainer's final version last
    assert s["base_accuracy"] is not None and s["final_accuracy"] is not None
    assert s["final_accuracy_version"] == final
    assert "held-out accuracy" in proc.stdout
    # the run's plot of accuracy over time, next to its summary
    run_dir = store.root.rsplit("/", 1)[0]
    with open(f"{run_dir}/accuracy.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_the_summary_cuts_the_run_into_phases_from_its_own_records(local_run):
    _, store = local_run
    s = summarize(store)
    steps = [e for e in events.read_all(store) if e["kind"] == events.TRAIN_STEP]
    phases = s["phases"]
    assert 1 <= len(phases) <= 4
    # consecutive and together every step, first to last
    assert phases[0]["steps"][0] == min(e["step"] for e in steps)
    assert phases[-1]["steps"][1] == max(e["step"] for e in steps)
    assert all(a["steps"][1] + 1 == b["steps"][0] for a, b in zip(phases, phases[1:]))
    for p in phases:
        part = [e for e in steps if p["steps"][0] <= e["step"] <= p["steps"][1]]
        assert p["reward"] == round(sum(e["reward"] for e in part) / len(part), 4)
        # the default cosine schedule: a phase's mean rate (falling from the base rate 1e-3, below)
        assert p["learning_rate"] == float(f"{statistics.fmean(e['learning_rate'] for e in part):.4g}")
        assert 0.0 <= p["frac_reward_zero_std"] <= 1.0
        # the token means are of the steps that trained tokens (none when every group had equal rewards)
        trained = [e for e in part if e["tokens"]]
        assert p["steps_trained"] == len(trained)
        assert (p["entropy"] is None) == (not trained) and (p["entropy"] is None or p["entropy"] > 0)
        # the trained completions are at most the run's 8 tokens
        assert p["completion_tokens_mean"] is None or 0 < p["completion_tokens_mean"] <= 8
    rates = [e["learning_rate"] for e in sorted(steps, key=lambda e: e["step"])]
    assert rates[0] == 1e-3 and all(a > b for a, b in zip(rates, rates[1:])), rates
    # the base model's evaluation opens the first phase, the final version's closes the last
    assert phases[0]["held_out"][0][0] == 0
    assert phases[-1]["held_out"][-1][0] == s["final_accuracy_version"]
