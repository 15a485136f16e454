"""The real `tinker` SDK (0.38) against the proxy's Tinker API: sessions, models, training calls and futures.

The proxy runs in this process on a real port. No replica is involved: these calls go to the bucket. The
trainer's side is `OpAnswerer` (tests/proxy/tinker_helpers.py), which writes a status per model and a result
per op with values the test computes: the point here is what the proxy hands the trainer (ops in seq order,
exact tokens and loss inputs) and what it hands back to the SDK (protobuf outputs, metrics, errors). The real
trainer executing these ops is tests/trainer's and the end-to-end tests'.
"""

from __future__ import annotations

import threading

import httpx
import numpy as np
import pytest

from bucket import tinker as bt
from bucket.manifest import RunSpec, init_or_check
from proxy.app import Proxy
from proxy.config import ProxyConfig
from tests.helpers import wait_for
from tests.proxy.tinker_helpers import OpAnswerer, serve_proxy

tinker = pytest.importorskip("tinker")


def tinker_run(store):
    return init_or_check(store, RunSpec(api="tinker"), "test")


def answer(op: bt.TinkerOp) -> bt.TinkerResult:
    """Per datum logprobs = -(position + 1) * 0.5, the loss the sum of -weights * logprobs (cross_entropy)."""
    common = dict(model_id=op.model_id, seq_id=op.seq_id, kind=op.kind)
    if op.kind in ("forward", "forward_backward"):
        rows = [[-(i + 1) * 0.5 for i in range(len(d.tokens))] for d in op.data]
        loss = sum(-w * lp for d, row in zip(op.data, rows) for w, lp in zip(d.inputs.get("weights", []), row))
        return bt.TinkerResult(**common, ok=True, logprobs=rows, metrics={"loss:sum": loss})
    if op.kind == "optim_step":
        return bt.TinkerResult(**common, ok=True, metrics={"optimizer_step:sum": 1.0})
    if op.kind == "save_weights":
        return bt.TinkerResult(**common, ok=True, path=bt.state_path(op.model_id, op.name or ""))
    return bt.TinkerResult(**common, ok=False, error=f"{op.kind} is not answered by this test")


def datum(tokens: list[int], weights: list[float]):
    return tinker.Datum(
        model_input=tinker.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights},
    )


def test_training_calls_reach_the_bucket_in_order_and_results_reach_the_sdk(local_store):
    manifest = tinker_run(local_store)
    proxy = Proxy(ProxyConfig(), local_store, manifest)
    with serve_proxy(proxy) as url, OpAnswerer(local_store, answer) as trainer:
        client = tinker.ServiceClient(base_url=url, api_key="tml-anything")
        tc = client.create_lora_training_client(base_model=manifest.base_model, rank=manifest.lora_rank).result()
        assert tc.get_info().lora_rank == manifest.lora_rank
        data = [datum([1, 5, 9, 13, 2], [0.0, 1.0, 1.0, 0.5]), datum([1, 7, 2], [1.0, 1.0])]
        out = tc.forward_backward(data, "cross_entropy").result()
        assert [o["logprobs"].tolist() for o in out.loss_fn_outputs] == [[-0.5, -1.0, -1.5, -2.0], [-0.5, -1.0]]
        assert out.metrics["loss:sum"] == pytest.approx(0.0 + 1.0 + 1.5 + 1.0 + 0.5 + 1.0)
        step = tc.optim_step(tinker.AdamParams(learning_rate=3e-4, beta2=0.99, grad_clip_norm=1.0)).result()
        assert step.metrics == {"optimizer_step:sum": 1.0}
        saved = tc.save_state("ckpt").result()
        assert saved.path == bt.state_path(tc.model_id, "ckpt")
        fwd = tc.forward([datum([3, 4, 5], [1.0, 1.0])], "cross_entropy").result()
        assert fwd.loss_fn_outputs[0]["logprobs"].tolist() == [-0.5, -1.0]
        model_id = tc.model_id
        client.close("success").result()

    ops = trainer.ops
    assert [(op.seq_id, op.kind) for op in ops] == [
        (1, "forward_backward"),
        (2, "optim_step"),
        (3, "save_weights"),
        (4, "forward"),
    ]
    fb = ops[0]
    assert fb.loss_fn == "cross_entropy"
    assert [d.tokens for d in fb.data] == [[1, 5, 9, 13], [1, 7]]
    assert [d.target_tokens for d in fb.data] == [[5, 9, 13, 2], [7, 2]]
    assert [d.inputs["weights"] for d in fb.data] == [[0.0, 1.0, 1.0, 0.5], [1.0, 1.0]]
    assert ops[1].adam == bt.AdamSettings(learning_rate=3e-4, beta2=0.99, grad_clip_norm=1.0)
    assert ops[2].name == "ckpt"
    model = bt.read_model(local_store, model_id)
    assert model is not None and model.rank == manifest.lora_rank
    assert bt.read_finished(local_store, model_id) is not None  # the session's end lets the trainer drop it


def test_a_failed_op_and_a_refused_model_reach_the_sdk_as_user_errors(local_store):
    manifest = tinker_run(local_store)

    def refuse(op: bt.TinkerOp) -> bt.TinkerResult:
        return bt.TinkerResult(
            model_id=op.model_id, seq_id=op.seq_id, kind=op.kind, ok=False, error="loss_fn 'dro' is not supported"
        )

    proxy = Proxy(ProxyConfig(), local_store, manifest)
    with serve_proxy(proxy) as url, OpAnswerer(local_store, refuse):
        client = tinker.ServiceClient(base_url=url, api_key="tml-anything")
        with pytest.raises(tinker.RequestFailedError, match="--run.lora-rank 32") as wrong_rank:
            client.create_lora_training_client(base_model=manifest.base_model, rank=32).result()
        assert wrong_rank.value.category == "user"
        tc = client.create_lora_training_client(base_model=manifest.base_model, rank=manifest.lora_rank).result()
        with pytest.raises(tinker.RequestFailedError, match="'dro' is not supported") as failed:
            tc.forward_backward([datum([1, 2, 3], [1.0, 1.0])], "cross_entropy").result()
        assert failed.value.category == "user"
        # an optimizer the trainer does not run is refused by the proxy, and its seq_id is not left a gap
        with pytest.raises(tinker.RequestFailedError, match="Adam only"):
            tc.optim_step(tinker.DimuonParams(learning_rate=0.1)).result()
        refused = bt.read_result(local_store, tc.model_id, 2)
        assert refused is not None and not refused.ok and refused.kind == "optim_step"
        client.close("errored").result()


def test_the_http_face_refuses_clearly(local_store, tmp_path, monkeypatch):
    from bucket.store import Store

    grpo_store = Store(str(tmp_path / "grpo"))
    grpo_store.check_reachable(create=True)
    grpo = Proxy(ProxyConfig(), grpo_store, init_or_check(grpo_store, RunSpec(), "test"))
    with serve_proxy(grpo) as url:
        r = httpx.post(f"{url}/api/v1/create_session", json={})
        assert r.status_code == 404 and "--run.api tinker" in r.json()["error"]

    monkeypatch.setenv("BRIGADE_PROXY_ADMIN_TOKEN", "s3cret")
    proxy = Proxy(ProxyConfig(), local_store, tinker_run(local_store))
    with serve_proxy(proxy) as url:
        assert httpx.get(f"{url}/api/v1/healthz", headers={"X-API-Key": "tml-wrong"}).status_code == 401
        ok = {"X-API-Key": "tml-s3cret"}
        assert httpx.get(f"{url}/api/v1/healthz", headers=ok).json() == {"status": "ok"}
        r = httpx.post(f"{url}/api/v1/no_such_call", json={}, headers=ok)
        assert r.status_code == 404 and "no_such_call" in r.json()["error"]
        r = httpx.post(f"{url}/api/v1/forward_backward", json={"model_id": "m", "seq_id": 1}, headers=ok)
        assert r.status_code == 400 and "protobuf" in r.json()["error"]
        caps = httpx.get(f"{url}/api/v1/get_server_capabilities", headers=ok).json()
        assert caps["supported_models"][0]["model_name"] == RunSpec().base_model
        # the SDK's own check of the service: its capabilities call through RestClient
        rest = tinker.RestClient(base_url=url, api_key="tml-s3cret")
        names = [m.model_name for m in rest.get_server_capabilities().result().supported_models]
        assert names == [RunSpec().base_model]


def test_the_proxys_protobuf_reads_and_writes_what_the_sdk_does():
    """The proxy's own declaration of the wire format (proxy/tinker/schema.py) against the SDK's encoder and
    decoder: a request with a sparse tensor and string and number loss settings; outputs with an empty row."""
    from tinker.proto.request_conv import forward_backward_request_to_proto

    from proxy.tinker.wire import WireError, decode_forward_backward

    weights = tinker.TensorData(
        data=np.asarray([2.0, 0.5], dtype=np.float32),
        dtype="float32",
        shape=[2, 2],
        sparse_crow_indices=[0, 1, 2],
        sparse_col_indices=[1, 1],
    )
    data = [
        tinker.Datum(
            model_input=tinker.ModelInput.from_ints([4, 5]),
            loss_fn_inputs={"target_tokens": [5, 6], "weights": weights},
        )
    ]
    fb = tinker.types.ForwardBackwardInput(
        data=data, loss_fn="ppo", loss_fn_config={"clip_low_threshold": 0.7, "mode": "x"}
    )
    request = tinker.types.ForwardBackwardRequest(forward_backward_input=fb, model_id="s:train:0", seq_id=7)
    model_id, seq, loss_fn, config, forward_only, got = decode_forward_backward(
        forward_backward_request_to_proto(request).SerializeToString()
    )
    assert (model_id, seq, loss_fn, forward_only) == ("s:train:0", 7, "ppo", False)
    assert config == {"clip_low_threshold": pytest.approx(0.7), "mode": "x"}
    assert got[0].tokens == [4, 5] and got[0].target_tokens == [5, 6]
    assert got[0].inputs["weights"] == [0.0, 2.0, 0.0, 0.5]
    image = tinker.Datum(
        model_input=tinker.ModelInput(chunks=[tinker.types.ImageChunk(data=b"x", format="png")]), loss_fn_inputs={}
    )
    fb = tinker.types.ForwardBackwardInput(data=[image], loss_fn="cross_entropy")
    with pytest.raises(WireError, match="not text"):
        decode_forward_backward(
            forward_backward_request_to_proto(
                tinker.types.ForwardBackwardRequest(forward_backward_input=fb, model_id="m", seq_id=1)
            ).SerializeToString()
        )

    from tinker.proto.response_conv import deserialize_forward_backward_output, deserialize_sample_response

    from proxy.tinker.wire import encode_forward_backward_output, encode_sample_response

    result = bt.TinkerResult(
        model_id="m", seq_id=1, kind="forward", ok=True, logprobs=[[-1.5, -0.25], [], [-3.0]], metrics={"loss:sum": 2}
    )
    out = deserialize_forward_backward_output(encode_forward_backward_output(result))
    assert [o["logprobs"].tolist() for o in out.loss_fn_outputs] == [[-1.5, -0.25], [], [-3.0]]
    assert out.metrics == {"loss:sum": 2.0}
    sample = deserialize_sample_response(
        encode_sample_response([([5, 6, 2], [-0.5, -1.0, -0.125], "stop"), ([7], [-2.0], "length")], [None, -1.0])
    )
    assert [s.tokens for s in sample.sequences] == [[5, 6, 2], [7]]
    assert [s.stop_reason for s in sample.sequences] == ["stop", "length"]
    assert np.allclose(sample.sequences[0].logprobs, [-0.5, -1.0, -0.125])
    assert sample.prompt_logprobs == [None, -1.0]


def test_a_silent_session_is_finished_and_a_restarted_proxy_still_answers_a_future(local_store):
    """The SDK heartbeats every 10 s; a session that stops is finished after the timeout (its models let go in the
    bucket). A request id names its op in the bucket, so a new proxy answers a future an old one handed out."""
    manifest = tinker_run(local_store)
    with OpAnswerer(local_store, answer):
        first = Proxy(ProxyConfig(tinker_session_timeout_s=2.0), local_store, manifest)
        with serve_proxy(first) as url:
            session = httpx.post(f"{url}/api/v1/create_session", json={}).json()["session_id"]
            # heartbeats while the client works (on a busy host a call can take longer than the timeout), then none
            silent = threading.Event()

            def heartbeats() -> None:
                while not silent.wait(0.1):
                    httpx.post(f"{url}/api/v1/session_heartbeat", json={"session_id": session})

            beating = threading.Thread(target=heartbeats, daemon=True)
            beating.start()
            body = {"session_id": session, "model_seq_id": 0, "base_model": manifest.base_model}
            created = httpx.post(f"{url}/api/v1/create_model", json=body | {"lora_config": {"rank": 1}}).json()
            model_id = created["model_id"]
            done = httpx.post(f"{url}/api/v1/retrieve_future", json={"request_id": created["request_id"]}).json()
            assert done["model_id"] == model_id
            step = {"model_id": model_id, "seq_id": 1, "adam_params": {"learning_rate": 0.01}}
            future = httpx.post(f"{url}/api/v1/optim_step", json=step).json()
            assert future["request_id"] == bt.request_id(model_id, 1)
            assert bt.read_finished(local_store, model_id) is None  # alive while it heartbeats
            silent.set()
            beating.join()
            wait_for(lambda: bt.read_finished(local_store, model_id), 20, "the silent session to be finished")
            assert httpx.post(f"{url}/api/v1/session_heartbeat", json={"session_id": session}).status_code == 410
        second = Proxy(ProxyConfig(), local_store, manifest)
        with serve_proxy(second) as url:
            again = httpx.post(f"{url}/api/v1/retrieve_future", json={"request_id": future["request_id"]})
            assert again.json() == {"metrics": {"optimizer_step:sum": 1.0}}
