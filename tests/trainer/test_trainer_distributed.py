"""Data parallelism: two processes (gloo, launched with torch's launcher) give the single-process step's gradients.

Each rank trains its share of the packed micro-batches of the same step; the summed LoRA gradients must
equal those of one process that trains all of them. Rank 0's batch reaches rank 1 intact. Run as a script,
this file is the worker.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys

import torch

# Run as a script (the worker), this file needs the repository root on its path for `tests` and the code.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bucket.rollouts import GroupId  # noqa: E402
from tests.helpers import REPO_ROOT, free_port, host_timeout  # noqa: E402
from tests.trainer.test_grpo_packing import _groups, _model  # noqa: E402
from trainer.grpo import LossConfig, accumulate, advantages, completions  # noqa: E402
from trainer.rows import pack  # noqa: E402

BUDGET = 24  # several micro-batches, so that each rank gets some


def _gradients(dp=None) -> tuple[dict[str, torch.Tensor], int]:
    """The LoRA gradients of one step, and how many micro-batches this process trained."""
    torch.set_num_threads(1)
    model = _model()
    groups = _groups(random.Random(5), n=4)
    cfg = LossConfig(loss_type="grpo")
    advs, _ = advantages(groups, cfg.scale_rewards)
    micro = pack(completions(groups, advs, cfg), BUDGET)
    params = [p for p in model.parameters() if p.requires_grad]
    mine = dp.share(micro) if dp else micro
    accumulate(model, mine, cfg)
    if dp:
        dp.sum_gradients(params)
    return {k: p.grad for k, p in model.named_parameters() if p.requires_grad}, len(mine)


def test_two_ranks_sum_to_the_single_process_gradient(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(free_port()),
        __file__,
    ]
    proc = subprocess.run([*cmd, str(tmp_path)], env=env, capture_output=True, text=True, timeout=host_timeout(240))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    from safetensors.torch import load_file

    shares = [load_file(str(tmp_path / f"rank{r}.safetensors")) for r in range(2)]
    assert all(s["micro_batches"].item() >= 1 for s in shares)  # both ranks trained something
    single, n = _gradients()
    assert n > 2
    for rank in shares:  # every rank ends with the same, summed gradient
        for k, g in single.items():
            torch.testing.assert_close(rank[k], g, rtol=1e-5, atol=1e-8)


def test_torchrun_launches_the_training_loop(tmp_path, model_dir):
    """`python -m trainer` under torch's launcher, 2 gloo ranks on the real model: rank 0 reads the bucket and
    publishes, both ranks train, and the ledger counts every group once."""
    from bucket import adapters, checkpoints, events
    from bucket.manifest import RunSpec, init_or_check
    from bucket.rollouts import Sample, SamplingParams, ScoredGroup, ShardWriter
    from bucket.store import Store

    store = Store(str(tmp_path / "bucket"))
    store.check_reachable(create=True)
    init_or_check(store, RunSpec(num_generations=4, max_staleness=2), "test")
    rng = random.Random(7)
    writer = ShardWriter(store, "w0")
    for shard in range(2):
        groups = []
        for k in range(2):
            lengths = [rng.randint(2, 9) for _ in range(4)]
            samples = [
                Sample(
                    completion_ids=[rng.randrange(100, 4000) for _ in range(n)],
                    logprobs=[-3.0] * n,
                    text="",
                    reward=float(j % 2),
                )
                for j, n in enumerate(lengths)
            ]
            groups.append(
                ScoredGroup(
                    prompt_id=f"p{shard}{k}",
                    prompt="x",
                    prompt_ids=[rng.randrange(100, 4000) for _ in range(rng.randint(4, 12))],
                    adapter_version=0,
                    sampling=SamplingParams(temperature=1.0),
                    samples=samples,
                )
            )
        writer.write(groups)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port())]
    cmd += ["-m", "trainer", "--bucket", store.url, "--trainer.model-path", model_dir, "--trainer.device", "cpu"]
    cmd += ["--run.num-generations", "4", "--run.max-staleness", "2", "--trainer.max-steps", "2"]
    cmd += ["--trainer.groups-per-step", "2", "--trainer.token-budget", "32", "--trainer.torch-threads", "1"]
    cmd += ["--trainer.metrics", "false", "--trainer.rollout-wait-s", "30"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=host_timeout(300), cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert adapters.committed_versions(store) == [1, 2, 3]  # the untrained adapter, then one per step
    steps = [e for e in events.read_all(store) if e["kind"] == events.TRAIN_STEP]
    assert [e["step"] for e in steps] == [1, 2]  # rank 0 alone writes events
    assert all(e["perf/micro_batches"] >= 2 for e in steps)  # rows for both ranks
    trained = [g for s in checkpoints.lineage(store) for g in s.trained]
    assert len(trained) == len(set(trained)) == 4


if __name__ == "__main__":
    from safetensors.torch import save_file

    from trainer.distributed import DataParallel
    from trainer.main import decode_batch, encode_batch

    dp = DataParallel(cpu=True)
    assert dp.world == 2
    # rank 0 reads the bucket and sends the batch to the others as JSON
    groups = [g.model_copy(update={"generated_at": 0.0}) for g in _groups(random.Random(6), n=2)]
    batch = [(GroupId(f"rollouts/w/000000/{i:012d}.json", 0), g) for i, g in enumerate(groups)]
    assert decode_batch(dp.broadcast_text(encode_batch(batch) if dp.is_main else None)) == batch
    grads, n = _gradients(dp)
    out = {k: g.contiguous() for k, g in grads.items()} | {"micro_batches": torch.tensor(n)}
    save_file(out, os.path.join(sys.argv[1], f"rank{dp.rank}.safetensors"))
