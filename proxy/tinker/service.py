"""The Tinker API's state in the proxy: sessions, models, sampling, and the futures the SDK polls.

Training calls go to the bucket (training.py); sampling runs here, through the proxy's forwarder; the futures of
both are polled by `retrieve_future`, which holds the request open for up to `LONG_POLL_S` (the SDK asks again
at once after a `try_again`, so a short answer would spin it) and then says `try_again`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi.responses import JSONResponse, Response

from bucket import tinker as bt
from bucket.store import Store
from bucket.version import Version
from proxy.adapters.lifecycle import AdapterLifecycle
from proxy.serving.forwarding import Forwarder
from proxy.state import ProxyState
from proxy.tinker import training
from proxy.tinker.sampling import KEEP_DONE_S, SampleRuns, completion_body
from proxy.tinker.sessions import Sampler, Sessions, session_of_model
from proxy.tinker.training import PROTOBUF, Refused, failed, try_again
from proxy.tinker.wire import encode_forward_backward_output

log = logging.getLogger("brigade.proxy.tinker")

LONG_POLL_S = 20.0  # the SDK gives retrieve_future 45 s
POLL_S = 0.05  # how often a held retrieve_future looks again (one small bucket read)
LOAD_ATTEMPTS = 3  # a version the replicas refused this many times fails its save_weights_for_sampler


class TinkerService:
    def __init__(
        self, state: ProxyState, forwarder: Forwarder, lifecycle: AdapterLifecycle, session_timeout_s: float
    ) -> None:
        self.state, self.forwarder, self.lifecycle = state, forwarder, lifecycle
        self.store: Store = state.store
        self.sessions = Sessions(session_timeout_s)
        self.models: dict[str, bt.TinkerModel] = {}
        self.finished_models: set[str] = set()
        self.failures: dict[str, tuple[str, str]] = {}  # request id -> (error, category): refused at submit
        self.runs = SampleRuns()
        self.loads: dict[Version, asyncio.Task[bool]] = {}  # versions being loaded for a sampler
        self.load_failures: dict[Version, int] = {}
        self.sampler_paths: dict[str, Version] = {}
        self._expiry: asyncio.Task[None] | None = None

    @property
    def manifest(self) -> Any:
        assert self.state.manifest is not None
        return self.state.manifest

    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()  # the proxy's loop: where its lifecycle and forwarder run
        self._expiry = asyncio.create_task(self._expire_forever(), name="tinker-sessions")

    async def close(self) -> None:
        await self.runs.close()
        tasks = [t for t in [self._expiry, *self.loads.values()] if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _expire_forever(self) -> None:
        while True:
            await asyncio.sleep(min(5.0, max(self.sessions.timeout_s / 4, 0.05)))
            for session_id in self.sessions.expired():
                log.warning(
                    "tinker session %s sent no heartbeat for %.0fs: finished", session_id, self.sessions.timeout_s
                )
                await self.finish(session_id, "the session's heartbeats stopped")

    # -- sessions -------------------------------------------------------------------------------------------
    def create_session(self) -> dict[str, Any]:
        m = self.manifest
        session = self.sessions.create()
        info = f"brigade run {m.run_id}: base model {m.base_model}, LoRA rank {m.lora_rank}"
        # Said at the session's start, where the SDK logs it: its create_model answer has no field a client shows,
        # and train_unembed=True is the SDK's default (docs/tinker.md).
        warning = (
            "brigade trains no LoRA on the LM head (vLLM cannot serve one): a model asking for train_unembed=True "
            "is refused, or trained without the head where the trainer runs with --trainer.tinker-unembed skip"
        )
        return {
            "type": "create_session",
            "session_id": session.session_id,
            "info_message": info,
            "warning_message": warning,
        }

    def heartbeat(self, session_id: str) -> Response:
        known = self.sessions.sessions.get(session_id)
        if known is not None and known.finished:
            return JSONResponse({"error": f"session {session_id} has finished"}, status_code=410)
        self.sessions.touch(session_id)
        return JSONResponse({"type": "session_heartbeat"})

    async def finish(self, session_id: str, reason: str = "session finished") -> None:
        """End a session: its models are marked finished in the bucket (the trainer lets them go), its samplers
        unpin their versions."""
        models, samplers = self.sessions.end(session_id)
        on_bucket = await asyncio.to_thread(bt.list_models, self.store)
        models |= {m for m in on_bucket if session_of_model(m) == session_id}
        for model_id in sorted(models):
            self.finished_models.add(model_id)
            await asyncio.to_thread(bt.mark_finished, self.store, bt.TinkerFinished(model_id=model_id, reason=reason))
        for sampler in samplers:
            if sampler.version is not None:
                self.lifecycle.unpin(sampler.served_name)

    # -- models ---------------------------------------------------------------------------------------------
    async def model(self, model_id: str) -> bt.TinkerModel | None:
        found = self.models.get(model_id)
        if found is None:
            found = await asyncio.to_thread(bt.read_model, self.store, model_id)
            if found is not None:
                self.models[model_id] = found
        return found

    def fail(self, error: str, category: str = "user", model_id: str | None = None) -> dict[str, Any]:
        """A future that fails at once (the SDK raises RequestFailedError with `error`)."""
        request_id = f"failed:{uuid.uuid4().hex}"
        self.failures[request_id] = (error, category)
        return {"request_id": request_id, "model_id": model_id}

    async def create_model(self, body: dict[str, Any], from_state: bool = False) -> dict[str, Any]:
        """create_model, or load_weights without a model (a new model starting from a saved training state)."""
        try:
            model = training.model_of(body, self.manifest, from_state)
        except training.Unsupported as exc:
            return self.fail(str(exc))
        return await self._create(model)

    async def _create(self, model: bt.TinkerModel) -> dict[str, Any]:
        await asyncio.to_thread(bt.write_model, self.store, model)  # False on a retry: the model is there already
        self.models.setdefault(model.model_id, model)
        self.sessions.touch(model.session_id).models.add(model.model_id)
        return {"request_id": f"create:{model.model_id}", "model_id": model.model_id}

    async def get_info(self, model_id: str) -> Response:
        model = await self.model(model_id)
        if model is None:
            return JSONResponse({"error": f"no training model {model_id!r} in this run"}, status_code=404)
        return JSONResponse(
            {
                "type": "get_info",
                "model_id": model_id,
                "model_name": model.base_model,
                "is_lora": True,
                "lora_rank": model.rank,
                "model_data": {
                    "model_name": model.base_model,
                    "tokenizer_id": self.state.config.tinker_tokenizer or None,
                },
            }
        )

    # -- training ops ---------------------------------------------------------------------------------------
    async def submit(self, op: bt.TinkerOp, refused: str | None = None) -> dict[str, Any]:
        """Write the op (exclusively: a retried call finds it); a refused one gets its failed result with it."""
        model = await self.model(op.model_id)
        if model is None:
            return self.fail(
                f"no training model {op.model_id!r} in this run: create it with create_lora_training_client"
            )
        if op.model_id in self.finished_models:
            return self.fail(f"model {op.model_id} belongs to a finished session", model_id=op.model_id)
        if refused is not None and await asyncio.to_thread(bt.read_op, self.store, op.model_id, op.seq_id) is None:
            # The failed result before the op: a trainer that sees the op sees it answered, and moves past it.
            result = bt.TinkerResult(model_id=op.model_id, seq_id=op.seq_id, kind=op.kind, ok=False, error=refused)
            await asyncio.to_thread(bt.write_result, self.store, result)
        await asyncio.to_thread(bt.submit_op, self.store, op)
        return {"request_id": bt.request_id(op.model_id, op.seq_id), "model_id": op.model_id}

    # -- futures --------------------------------------------------------------------------------------------
    async def retrieve(self, request_id: str) -> Response:
        """One retrieve_future: the answer, or try_again after holding the request up to LONG_POLL_S."""
        if request_id in self.failures:
            return failed(*self.failures[request_id])
        look: Callable[[], Awaitable[Response | None]]
        if request_id.startswith("create:"):
            model_id = request_id.removeprefix("create:")
            if await self.model(model_id) is None:
                return failed(f"no training model {model_id!r} in this run's bucket")
            look = lambda: self._created(model_id)  # noqa: E731
        elif request_id.startswith("sample:"):
            if not self.runs.known(request_id):
                return failed(f"no sample request {request_id} (finished more than {KEEP_DONE_S:.0f}s ago?)")
            look = lambda: self._sampled(request_id)  # noqa: E731
        elif (parsed := bt.parse_request_id(request_id)) is not None:
            op = await asyncio.to_thread(bt.read_op, self.store, *parsed)
            if op is None:
                return failed(f"no operation {request_id} in this run's bucket")
            look = lambda: self._trained(op)  # noqa: E731
        else:
            return failed(f"unknown request id {request_id!r}")
        deadline = time.monotonic() + LONG_POLL_S
        while True:
            answer = await look()
            if answer is not None:
                return answer
            if time.monotonic() >= deadline:
                return try_again(request_id)
            await asyncio.sleep(POLL_S)

    async def _sampled(self, request_id: str) -> Response | None:
        answer, failure = self.runs.answer(request_id)
        if failure is not None:
            return failed(str(failure), "user" if failure.user else "server")
        return Response(answer, media_type=PROTOBUF) if answer is not None else None

    async def _created(self, model_id: str) -> Response | None:
        status = await asyncio.to_thread(bt.read_status, self.store, model_id)
        if status is None:
            return None
        if not status.ready:
            return failed(status.error or f"the trainer could not hold model {model_id}")
        if status.warning:
            log.warning("tinker model %s: %s", model_id, status.warning)
        model = await self.model(model_id)
        return JSONResponse({"model_id": model_id, "path": model.from_state if model else None})

    async def _trained(self, op: bt.TinkerOp) -> Response | None:
        result = await asyncio.to_thread(bt.read_result, self.store, op.model_id, op.seq_id)
        if result is None:
            return None
        if op.kind != "save_weights_for_sampler" or not result.ok:
            return training.answer(op, result, encode_forward_backward_output)
        if result.version is None:
            return failed(f"{op.kind} {op.seq_id}: the trainer's result names no adapter version", "server")
        version = Version(result.version)
        if not await self._serving(version):
            if self.load_failures.get(version, 0) >= LOAD_ATTEMPTS:
                return failed(
                    f"adapter version {version} could not be loaded on every replica (the proxy's log says why)",
                    "server",
                )
            return None
        if result.path:
            self.sampler_paths[result.path] = version
        sampler_id = None
        if op.name is None:  # save_weights_and_get_sampling_client: a sampling session of this snapshot
            sampler_id = f"{op.model_id}:sampler:{op.seq_id}"
            self._add_sampler(
                Sampler(
                    sampler_id,
                    session_of_model(op.model_id) or "",
                    await self._base_of(bt.sampler_path(op.model_id, "")),
                    version.lora_name(self.manifest.run_id),
                    version,
                    result.path,
                )
            )
        return training.sampler_answer(op, result, sampler_id)

    async def _serving(self, version: Version) -> bool:
        """Whether `version` is loaded on every replica; starts (once) loading it when it is not."""
        if version in self.lifecycle.run_versions():
            return True
        task = self.loads.get(version)
        if task is None:
            task = self.loads[version] = asyncio.create_task(self.lifecycle.ensure(version))
        if not task.done():
            return False
        del self.loads[version]
        ok = not task.cancelled() and task.exception() is None and task.result()
        if not ok:
            self.load_failures[version] = self.load_failures.get(version, 0) + 1
        return ok

    # -- sampling -------------------------------------------------------------------------------------------
    def _add_sampler(self, sampler: Sampler) -> None:
        if self.sessions.add_sampler(sampler) and sampler.version is not None:
            self.lifecycle.pin(sampler.served_name)

    async def resolve_path(self, path: str) -> Version:
        """The adapter version a sampler path (what save_weights_for_sampler answered) names."""
        if path not in self.sampler_paths:
            self.sampler_paths.update(await asyncio.to_thread(training.sampler_versions, self.store, path))
        if path not in self.sampler_paths:
            raise Refused(f"no saved sampler weights at {path} in this run")
        return self.sampler_paths[path]
        parts = path[len("tinker://") :].split("/") if path.startswith("tinker://") else []
        if len(parts) != 3 or parts[1] != "sampler_weights":
            raise Refused(
                f"model_path {path!r}: a sampling client samples a sampler path, "
                "tinker://<model_id>/sampler_weights/<name> (what save_weights_for_sampler returned)"
            )
        prefix = bt.model_key(parts[0], "results/")
        for key in await asyncio.to_thread(self.store.list, prefix):
            seq = key.rsplit("/", 1)[-1].removesuffix(".json")
            result = await asyncio.to_thread(bt.read_result, self.store, parts[0], int(seq)) if seq.isdigit() else None
            if (
                result is not None
                and result.ok
                and result.version is not None
                and result.kind == "save_weights_for_sampler"
            ):
                self.sampler_paths[result.path or bt.sampler_path(parts[0], "")] = Version(result.version)
        if path not in self.sampler_paths:
            raise Refused(f"no saved sampler weights at {path} in this run")
        return self.sampler_paths[path]

    async def create_sampler(self, body: dict[str, Any]) -> dict[str, Any]:
        m = self.manifest
        session_id, seq = body.get("session_id"), body.get("sampling_session_seq_id")
        if not isinstance(session_id, str) or type(seq) is not int:
            raise Refused("create_sampling_session needs session_id and sampling_session_seq_id")
        sampler_id = f"{session_id}:sample:{seq}"
        path = body.get("model_path")
        if path:
            version = await self.resolve_path(path)
            if not await self.lifecycle.ensure(version):
                raise Refused(f"adapter version {version} ({path}) could not be loaded on every replica")
            base = await self._base_of(path)
            sampler = Sampler(sampler_id, session_id, base, version.lora_name(m.run_id), version, path)
        else:
            base = str(body.get("base_model"))
            if not self._is_base(base):
                raise Refused(f"base_model {base!r}: this run serves {m.base_model!r} (or its model folder)")
            sampler = Sampler(sampler_id, session_id, base, m.base_model)
        self._add_sampler(sampler)
        return {"type": "create_sampling_session", "sampling_session_id": sampler_id}

    def _is_base(self, name: str) -> bool:
        """The run's base model by its served name, or by the folder it was loaded from (the cookbook names the
        model by its folder, so that its tokenizer loads offline)."""
        name, folder = name.rstrip("/"), self.state.config.tinker_tokenizer.rstrip("/")
        return name == self.manifest.base_model or os.path.basename(name) == self.manifest.base_model or name == folder

    async def _base_of(self, path: str) -> str:
        """The base model a sampler path's training model named (what the SDK loads the tokenizer by)."""
        model = await self.model(path[len("tinker://") :].split("/")[0])
        return model.base_model if model is not None else self.manifest.base_model

    def sampler_info(self, sampler_id: str) -> Response:
        s = self.sessions.samplers.get(sampler_id)
        if s is None:
            return JSONResponse({"error": f"no sampling session {sampler_id!r} on this proxy"}, status_code=404)
        return JSONResponse({"sampler_id": sampler_id, "base_model": s.base_model, "model_path": s.model_path})

    async def asample(self, body: dict[str, Any]) -> dict[str, Any]:
        sampler_id = body.get("sampling_session_id")
        if sampler_id is not None:
            sampler = self.sessions.samplers.get(sampler_id)
            if sampler is None:
                raise Refused(f"no sampling session {sampler_id!r} on this proxy (it finished, or the proxy restarted)")
            served = sampler.served_name
        elif body.get("model_path"):
            served = (await self.resolve_path(body["model_path"])).lora_name(self.manifest.run_id)
        else:
            served = self.manifest.base_model
        for key in ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k"):
            if body.get(key):
                raise Refused(f"{key}: brigade returns the sampled tokens' logprobs only, not top-k alternatives")
        if body.get("target_prompt_logprobs") is not None:
            raise Refused("target_prompt_logprobs is not supported by brigade")
        tokens: list[int] = []
        for chunk in (body.get("prompt") or {}).get("chunks") or []:
            if chunk.get("type", "encoded_text") != "encoded_text":
                raise Refused(f"prompt chunk of type {chunk.get('type')!r}: brigade samples text token prompts only")
            tokens.extend(int(t) for t in chunk["tokens"])
        n = body.get("num_samples", 1)
        with_prompt = bool(body.get("prompt_logprobs"))
        try:
            request = completion_body(served, tokens, n, body.get("sampling_params") or {}, with_prompt)
        except ValueError as exc:
            raise Refused(str(exc)) from exc
        last_n = body.get("prompt_logprobs_last_n")
        request_id = self.runs.start(self.forwarder, request, tokens, with_prompt, last_n)
        return {"request_id": request_id, "sample_sequence_ids": [f"{request_id}:{i}" for i in range(n)]}

    def cancel(self, request_ids: list[str]) -> None:
        self.runs.cancel(request_ids)
