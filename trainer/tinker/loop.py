"""`brigade trainer` on a run with api = tinker: watch the bucket's models, hold one, execute its ops in order.

One model at a time: the trainer's LoRA is one adapter. A second live model while one is held gets an error
status naming the held one. A model is let go when the proxy marks it finished (the client's session ended).

Exactly once across restarts: results are written after what an op changed is durable (state.py), so on start,
for the model it held (status ready, not finished), the trainer loads the durable state named by applied.json,
writes the result of that op if the previous trainer died just before writing it, runs again the
forward_backward ops after it whose results exist (their gradients died with the process; their results are
not rewritten) and goes on with the first op without a result.
"""

from __future__ import annotations

import json
import logging
import time
from typing import get_args

from bucket import tinker
from bucket.events import EventLog
from bucket.manifest import RunManifest
from bucket.reading import InvalidObject
from bucket.store import Store
from bucket.tinker import OpKind, TinkerModelStatus, TinkerResult
from trainer.config import TrainerConfig
from trainer.model import build_model, default_token_budget
from trainer.rows import FLEX_BLOCK
from trainer.stopping import StopRequest
from trainer.tinker import hold, state
from trainer.tinker.data import TinkerUserError
from trainer.tinker.session import Session

log = logging.getLogger("brigade.trainer")
SCAN_S = 1.0  # how often a busy trainer lists the models (new ones to refuse, its own finished)
IDLE_SCAN_S = 0.25  # how often a free one does: a create_model waits for it (an object store bills each listing)


class TinkerLoop:
    def __init__(self, settings: TrainerConfig, store: Store, manifest: RunManifest, model=None):
        self.settings, self.store, self.manifest = settings, store, manifest
        self.events = EventLog(store, "trainer")
        self.model = (
            model if model is not None else build_model(settings.model_path, settings.dtype, manifest, settings.device)
        )
        device = next(self.model.parameters()).device
        self.token_budget = settings.token_budget or default_token_budget(self.model, device)
        self.pad_to = FLEX_BLOCK if device.type == "cuda" else 1
        self.session: Session | None = None
        # The next op's seq_id; None until a model's first op arrives: the SDK numbers a model's ops from its own
        # counter (its first training call is seq_id 1, not 0), so the first op present is where the model starts.
        self.next_seq: int | None = None
        self.scanned = 0.0
        self.settled: set[str] = set()  # models refused or finished: a scan reads nothing more of them

    # -- which model -----------------------------------------------------------------------------------------
    def scan(self) -> None:
        """Let go of a finished model, take a new one when free, refuse the others while one is held."""
        self.scanned = time.monotonic()
        if self.session is not None and tinker.read_finished(self.store, self.session.model_id) is not None:
            log.info("tinker model %s finished; the trainer is free", self.session.model_id)
            self.settled.add(self.session.model_id)
            self.session = None
        for model_id in tinker.list_models(self.store):
            if model_id in self.settled or (self.session is not None and model_id == self.session.model_id):
                continue
            try:
                self._scan_one(model_id)
            # one model's invalid objects never stop the trainer: it is refused (a bucket that cannot be reached,
            # a BucketError but no InvalidObject, still stops it: that is not the model's fault)
            except InvalidObject as exc:
                log.error("tinker model %s is refused: %s", model_id, exc)
                self.settled.add(model_id)
                error = f"the model's objects in the bucket are invalid: {exc}"
                tinker.write_status(self.store, TinkerModelStatus(model_id=model_id, ready=False, error=error))

    def _scan_one(self, model_id: str) -> None:
        """One model of the scan: settle it (refused or finished), take it, or refuse it while one is held."""
        status = tinker.read_status(self.store, model_id)
        if (status is not None and not status.ready) or tinker.read_finished(self.store, model_id) is not None:
            self.settled.add(model_id)  # refused or finished: never looked at again
            return
        if self.session is None:
            self.take(model_id, resumed=status is not None)
        elif status is None:
            held = self.session.model_id
            tinker.write_status(
                self.store,
                TinkerModelStatus(
                    model_id=model_id,
                    ready=False,
                    error=f"this trainer holds one LoRA adapter at a time (model {held}); finish its session first",
                ),
            )

    def take(self, model_id: str, resumed: bool) -> None:
        spec = tinker.read_model(self.store, model_id)
        if spec is None:
            return
        try:
            if spec.from_state:
                # a model made from a saved state trains what the state's model trained (the proxy, which
                # creates it from a path only, cannot know)
                saved_by, _ = state.source(self.store, spec.from_state)
                spec = spec.model_copy(update={k: getattr(saved_by, k) for k in hold.TRAINED_PARTS})
            warning = hold.check(spec, self.manifest, self.settings.model_path, self.settings.tinker_unembed)
            params = hold.fresh_lora(self.model, spec)
            session = Session(
                self.store, self.manifest, self.events, self.model, spec, params, self.token_budget, self.pad_to
            )
            if resumed:
                self.resume(session)
            else:
                if spec.from_state:
                    prefix = state.resolve_state(self.store, spec.from_state)
                    opt = session.optimizer if spec.load_optimizer else None
                    state.read_files(self.store, prefix, self.model, opt, f"from_state {spec.from_state!r}")
                # the start is durable too: a restart before the first optim_step begins from these weights
                state.persist(self.store, model_id, -1, 0, self.model, session.optimizer)
                self.next_seq = None
        except TinkerUserError as exc:
            log.info("tinker model %s refused: %s", model_id, exc)
            tinker.write_status(self.store, TinkerModelStatus(model_id=model_id, ready=False, error=str(exc)))
            return
        self.session = session
        if not resumed:
            tinker.write_status(self.store, TinkerModelStatus(model_id=model_id, ready=True, warning=warning))
        log.info("tinker model %s held (rank %d)%s", model_id, spec.rank, " (resumed)" if resumed else "")

    def resume(self, session: Session) -> None:
        """Back to where the previous trainer was with this model (the module docstring says how)."""
        model_id = session.model_id
        applied = tinker.read_applied(self.store, model_id)
        if applied is None:  # held, but died before its first state was written: as a new model
            state.persist(self.store, model_id, -1, 0, self.model, session.optimizer)
            self.next_seq = None
            return
        state.read_files(
            self.store, state.state_prefix(model_id, applied.seq_id), self.model, session.optimizer, "durable state"
        )
        session.steps = applied.optimizer_steps
        seq = applied.seq_id + 1
        if applied.seq_id >= 0 and tinker.read_result(self.store, model_id, applied.seq_id) is None:
            op = tinker.read_op(self.store, model_id, applied.seq_id)
            kind = op.kind if op is not None else "optim_step"
            tinker.write_result(self.store, TinkerResult(model_id=model_id, seq_id=applied.seq_id, kind=kind, ok=True))
        replayed = 0
        while (result := tinker.read_result(self.store, model_id, seq)) is not None:
            if result.kind == "forward_backward" and result.ok:
                op = tinker.read_op(self.store, model_id, seq)
                if op is not None:
                    session.execute(op, write=False)
                    replayed += 1
            seq += 1
        self.next_seq = seq
        log.info(
            "tinker model %s resumed after op %d (%d optimizer steps), %d forward_backward replayed",
            model_id,
            applied.seq_id,
            applied.optimizer_steps,
            replayed,
        )

    # -- the ops ---------------------------------------------------------------------------------------------
    def tick(self) -> bool:
        """One move: an op executed (True), or a look at the models when it is time for one."""
        if time.monotonic() - self.scanned >= (SCAN_S if self.session is not None else IDLE_SCAN_S):
            self.scan()
        if self.session is None:
            return False
        model_id = self.session.model_id
        if self.next_seq is None:
            self.next_seq = self._first_seq(model_id)
            if self.next_seq is None:
                return False
        try:
            op = tinker.read_op(self.store, model_id, self.next_seq)
        except ValueError as exc:  # the op's object fails validation: a user error for that seq, then go on
            error = f"invalid operation {tinker.op_key(model_id, self.next_seq)}: {exc}"
            tinker.write_result(
                self.store,
                TinkerResult(model_id=model_id, seq_id=self.next_seq, kind=self._kind(), ok=False, error=error),
            )
            self.next_seq += 1
            return True
        if op is None:
            return False
        if tinker.read_result(self.store, model_id, op.seq_id) is None:
            self.session.execute(op)
        self.next_seq += 1
        return True

    def _first_seq(self, model_id: str) -> int | None:
        """The smallest seq_id among the model's ops, None while it has none."""
        seqs = [int(n.split(".")[0]) for n in self.store.list(tinker.model_key(model_id, "ops/")) if n[:1].isdigit()]
        return min(seqs, default=None)

    def _kind(self) -> OpKind:
        """The kind an invalid op object says it is, where it says a known one (the proxy matches it)."""
        try:
            kind = json.loads(self.store.get_bytes(tinker.op_key(self.session.model_id, self.next_seq)))["kind"]
        except Exception:
            return "forward"
        return kind if kind in get_args(OpKind) else "forward"


def run_tinker(settings: TrainerConfig, store: Store, manifest: RunManifest, stop: StopRequest) -> int:
    """Execute Tinker clients' operations until asked to stop (SIGTERM / SIGINT: the op in flight finishes)."""
    loop = TinkerLoop(settings, store, manifest)
    log.info("tinker trainer ready: rank %d, base model %s", manifest.lora_rank, manifest.base_model)
    while not stop.requested:
        stop.doing = "executing a tinker op" if loop.session is not None else "waiting for a tinker model"
        if not loop.tick():
            stop.wait(settings.tinker_poll_s)
    log.info("tinker trainer stopped by %s", stop.signal)
    return 0
