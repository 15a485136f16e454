"""Weights with NaN or infinite values are never published: the trainer stops before it claims a version, says why
in an event and its error, and the bucket holds nothing of them. (The proxy's side: tests/proxy.)"""

from __future__ import annotations

import pytest
import torch

from bucket import adapters, checkpoints, events
from bucket.manifest import RunSpec, init_or_check
from bucket.store import Store
from infra.config import load
from trainer.distributed import DataParallel
from trainer.model import NonFiniteAdapter
from trainer.trainer import Trainer


def test_a_nan_adapter_is_never_published(tmp_path, model_dir):
    store = Store(str(tmp_path / "bucket"))
    store.check_reachable(create=True)
    manifest = init_or_check(store, RunSpec(), "test")
    c = load(overrides={"bucket.url": store.url, "trainer.model_path": model_dir, "trainer.torch_threads": 1})
    trainer = Trainer(c.trainer, store, manifest, DataParallel(cpu=True))
    trainer.publish()  # the untrained adapter: finite, published as v1
    assert adapters.committed_versions(store) == [1]

    name, param = next((n, p) for n, p in trainer.model.named_parameters() if "lora_B" in n and "mlp" in n)
    with torch.no_grad():
        param[0, 0] = float("nan")
    with pytest.raises(NonFiniteAdapter, match="NaN or infinite") as err:
        trainer.publish()
    module = name.split(".lora_B")[0]  # the tensor as saved drops peft's adapter name ("default")
    assert err.value.tensors == [f"{module}.lora_B.weight"], err.value
    assert adapters.committed_versions(store) == [1]
    assert adapters.latest_version(store) == 1
    assert not store.list("adapters/v000002/")  # not even claimed
    assert checkpoints.load_latest(store).version == 1  # a restart resumes from the last good version
    refused = [e for e in events.read_all(store) if e["kind"] == events.ADAPTER_REFUSED]
    assert len(refused) == 1 and refused[0]["tensors"] == err.value.tensors
