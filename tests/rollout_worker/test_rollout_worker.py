"""The rollout worker against the real proxy and the session's real vLLM replicas.

Each job runs as its own process through its own entry point (`python -m proxy`, `python -m rollout_worker`),
as in a deployment.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

from bucket import adapters, appendlog, events, layout
from bucket.datacursor import read_data_cursor
from bucket.rollouts import RolloutShard, read_shards
from rollout_worker.prompts import load_data
from rollout_worker.sampler import PromptSampler
from tests.helpers import REPO_ROOT, free_port, host_timeout, make_adapter_files, stop, wait_http
from tests.promql import missing, scrape


def worker_shards(store, worker: str = "w-sigterm") -> list[RolloutShard]:
    reads = [r for r in read_shards(store, {}) if r.record.writer == worker]
    assert all(r.shard is not None for r in reads), [r.error for r in reads]
    return [r.shard for r in reads]


def worker_argv(store_url: str, port: int, *flags: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "rollout_worker",
        "--bucket",
        store_url,
        "--bucket.manifest-wait-s",
        "5",
        "--rollout.proxy-url",
        f"http://127.0.0.1:{port}",
        "--rollout.worker-id",
        "w-sigterm",
        "--rollout.max-unconsumed-groups",
        "0",
        "--rollout.max-inflight-groups",
        "2",
        "--rollout.max-completion-length",
        "6",
        "--rollout.eval-size",
        "0",
        *flags,
    ]


def _check_metrics(metrics_url: str, store, num_generations: int) -> None:
    """The worker's /metrics while it runs: every name monitoring queries, counts that match its shards (read
    before the scrape: the worker keeps writing, so a shard listed after it could hold groups it did not count)."""
    shards = worker_shards(store)
    m = scrape(metrics_url)
    assert not missing("brigade_rollout_", m), missing("brigade_rollout_", m)
    written = sum(len(s.groups) for s in shards)
    assert m["brigade_rollout_groups_scored_total"] >= written >= 3
    assert m["brigade_rollout_shards_written_total"] >= len(shards)
    assert m["brigade_rollout_sample_reward_count"] == num_generations * m["brigade_rollout_groups_scored_total"]
    assert 0 <= m["brigade_rollout_sample_reward_sum"] <= m["brigade_rollout_sample_reward_count"]
    assert m["brigade_rollout_generated_tokens_total"] >= m["brigade_rollout_sample_reward_count"]  # >= 1 per sample
    assert 0 <= m["brigade_rollout_completions_clipped_total"] <= m["brigade_rollout_sample_reward_count"]
    assert 0 <= m["brigade_rollout_inflight_groups"] <= 2  # max_inflight_groups
    assert m["brigade_rollout_waiting_for_trainer"] == 0  # max_unconsumed_groups 0: never held back
    assert m["brigade_rollout_adapter_version"] == max(g.adapter_version for s in shards for g in s.groups)


def _check_first_rollouts(store) -> None:
    """One adapter_first_rollout per (version, replica) the worker generated with, naming the replica."""
    records = appendlog.read_after(store, layout.EVENTS, {})
    firsts = [r.body for r in records if r.writer == "w-sigterm-events" and r.body["kind"] == events.FIRST_ROLLOUT]
    pairs = [(e["version"], e["replica"]) for e in firsts]
    groups_at: dict[tuple[int, str], set[float]] = {}
    for shard in worker_shards(store):
        for g in shard.groups:
            for s in g.samples:
                groups_at.setdefault((g.adapter_version, s.replica), set()).add(g.generated_at)
    assert len(pairs) == len(set(pairs)) and set(pairs) == set(groups_at), (pairs, sorted(groups_at))
    assert all(r.startswith("test-replica-") and e["host"] == socket.gethostname() for e, (_, r) in zip(firsts, pairs))
    for e in firsts:  # the event carries the generated_at of one of that pair's groups (the timeline takes the min)
        assert e["generated_at"] in groups_at[(e["version"], e["replica"])]


def test_scored_shards_and_nothing_lost_on_sigterm_and_a_restart_continues_the_data(vllm_replicas, model_dir, tmp_path):
    store, _, manifest = vllm_replicas
    # A committed version for the worker to load, through a proxy whose admin endpoints need a token.
    version = adapters.next_version(store)
    adapters.publish(store, version, make_adapter_files(model_dir, str(tmp_path / "adapter"), seed=7))
    env = {**os.environ, "BRIGADE_PROXY_ADMIN_TOKEN": "test-admin-token"}
    port = free_port()
    common = ["--bucket", store.url, "--bucket.manifest-wait-s", "5"]
    proxy = subprocess.Popen(
        [sys.executable, "-m", "proxy", *common, "--proxy.port", str(port), "--proxy.refresh-s", "0.5"],
        env=env,
        cwd=REPO_ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    worker_log = tmp_path / "rollout.log"
    worker = None
    metrics_port = free_port()
    try:
        wait_http(f"http://127.0.0.1:{port}/health", 60, proxy)
        with open(worker_log, "wb") as out:
            worker = subprocess.Popen(
                worker_argv(
                    store.url, port, "--rollout.groups-per-shard", "3", "--rollout.metrics-port", f"{metrics_port}"
                ),
                env=env,
                cwd=REPO_ROOT,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        first_shard_s = host_timeout(240)  # three groups generated on real replicas: slower on an AVX2 CPU
        deadline = time.monotonic() + first_shard_s
        while not worker_shards(store):
            assert worker.poll() is None, worker_log.read_text()[-3000:]
            assert time.monotonic() < deadline, f"no shard within {first_shard_s:.0f} s"
            time.sleep(0.5)
        time.sleep(2)  # let more groups finish, so some are scored but not yet in a full shard
        _check_metrics(f"http://127.0.0.1:{metrics_port}/metrics", store, manifest.num_generations)
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(60) == 0, worker_log.read_text()[-3000:]
        _check_first_rollouts(store)
        # The data cursor says how far the worker got; restarted under the same id, it goes on from there.
        cursor = read_data_cursor(store, "w-sigterm")
        assert cursor is not None
        # The cursor is the first prompt whose group is not in the bucket: every one before it is written, that
        # one is not (it was in flight at the SIGTERM). Groups after it that finished sooner are written too (a
        # group can wait behind a version's load and probe on its replica while the other in flight finish).
        assert all(p == 0 for k, p in cursor.positions.items() if k != "0"), cursor.positions  # still level 0
        at = cursor.positions["0"]
        from_start = PromptSampler(load_data("arithmetic", "", 0), "w-sigterm", 0)
        order = [from_start.next()[1]["prompt_id"] for _ in range(at + 1)]
        done = {g.prompt_id for s in worker_shards(store) for g in s.groups}
        assert all(order[i] in done for i in range(at)) and order[at] not in done, (at, len(done))
        expected = PromptSampler(load_data("arithmetic", "", 0), "w-sigterm", 0, cursor=cursor)
        upcoming = {expected.next()[1]["prompt_id"] for _ in range(2)}
        # restarted with each group as num_generations requests of n = 1 (the other generation_shape)
        restart = subprocess.run(
            worker_argv(
                store.url,
                port,
                *("--rollout.max-groups", "2", "--rollout.groups-per-shard", "2"),
                *("--rollout.generation-shape", "n_1"),
            ),
            env=env,
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=host_timeout(300),
        )
        assert restart.returncode == 0, restart.stderr[-3000:]
        after = worker_shards(store)
        assert {g.prompt_id for g in after[-1].groups} == upcoming
        for g in after[-1].groups:  # G answers of one sample each: still one group, on one replica
            assert len(g.samples) == manifest.num_generations
            assert all(len(x.logprobs) == len(x.completion_ids) > 0 for x in g.samples)
            assert len({x.replica for x in g.samples}) == 1
    finally:
        if worker is not None:
            stop(worker)
        stop(proxy)

    text = worker_log.read_text()
    m = re.search(r"stopped: (\d+) groups in (\d+) shards", text)
    assert m, text[-3000:]
    shards = worker_shards(store)[:-1]  # the restarted worker's one shard is last
    # every group the worker scored is in the bucket, the last partial shard included
    assert sum(len(s.groups) for s in shards) == int(m.group(1))
    assert len(shards) == int(m.group(2))
    # the proxy loaded the committed version by itself, and the worker generated with it
    assert version in {g.adapter_version for s in shards for g in s.groups}, text[-3000:]
    for shard in shards:
        for g in shard.groups:
            assert len(g.samples) == manifest.num_generations
            assert g.prompt.startswith("What is ") and g.extra["answer"].isdigit()
            assert g.prompt_ids[-4:] == [1, 520, 9531, 198], "chat template's assistant turn"  # <|im_start|>assistant\n
            for s in g.samples:
                assert len(s.logprobs) == len(s.completion_ids) > 0 and all(lp <= 0 for lp in s.logprobs)
                assert s.replica.startswith("test-replica-")
                assert s.reward in (0.0, 1.0)
