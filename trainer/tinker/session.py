"""One held model's operations, executed on the trainer's model: each op in, one TinkerResult out.

forward / forward_backward run the op's data as packed rows through trainer/losses.py's `accumulate` (the GRPO
step's code path) with the op's loss; the result carries every datum's per-position logprobs and `loss:sum`, the
sum of the per-token losses (Tinker's semantics: summed, never averaged). Gradients of forward_backward accumulate
until optim_step, which steps Adam once with the client's parameters and clears them. What the client got wrong
is a result with ok=False and category "user"; the job goes on.
"""

from __future__ import annotations

import logging
import time

import torch
from peft import PeftModel

from bucket import tinker
from bucket.events import EventLog
from bucket.manifest import RunManifest
from bucket.store import Store
from bucket.tinker import TinkerModel, TinkerOp, TinkerResult
from trainer.losses import accumulate
from trainer.packing import causal_lm
from trainer.rows import build, rows
from trainer.tinker import state
from trainer.tinker.data import TinkerUserError, completion, loss_for
from trainer.tinker.hold import adam

log = logging.getLogger("brigade.trainer")


class Session:
    """The trainer's model while it holds one client's model: its LoRA, its optimizer, its step count."""

    def __init__(
        self,
        store: Store,
        manifest: RunManifest,
        events: EventLog,
        model: PeftModel,
        spec: TinkerModel,
        params: list[torch.nn.Parameter],
        token_budget: int,
        pad_to: int = 1,
    ):
        self.store, self.manifest, self.events, self.model, self.spec = store, manifest, events, model, spec
        self.params = params
        self.optimizer = adam(params)
        self.steps = 0
        self.token_budget, self.pad_to = token_budget, pad_to
        self.device = next(model.parameters()).device
        self.vocab = causal_lm(model).config.vocab_size

    @property
    def model_id(self) -> str:
        return self.spec.model_id

    def execute(self, op: TinkerOp, write: bool = True) -> TinkerResult:
        """Run `op`; with `write`, persist what it changed and write its result. A user's mistake (or any failure
        of the op) becomes an error result, never an exception out of here."""
        started = time.time()
        try:
            result = self._run(op)
        except TinkerUserError as exc:
            result = self._error(op, str(exc), "user")
        except Exception as exc:  # a server-side failure of this op: the client learns it, the job goes on
            log.exception("tinker op %s#%d (%s) failed", op.model_id, op.seq_id, op.kind)
            result = self._error(op, f"the trainer failed on {op.kind}: {type(exc).__name__}: {exc}", "server")
        result.started = started
        if write:
            tinker.write_result(self.store, result)
        return result

    def _error(self, op: TinkerOp, message: str, category: str) -> TinkerResult:
        return TinkerResult(
            model_id=op.model_id, seq_id=op.seq_id, kind=op.kind, ok=False, error=message, category=category
        )

    def _ok(self, op: TinkerOp, **fields) -> TinkerResult:
        return TinkerResult(model_id=op.model_id, seq_id=op.seq_id, kind=op.kind, ok=True, **fields)

    def _run(self, op: TinkerOp) -> TinkerResult:
        if op.kind in ("forward", "forward_backward"):
            logprobs, loss = self.forward(op, backward=op.kind == "forward_backward")
            return self._ok(op, logprobs=logprobs, metrics={"loss:sum": loss})
        if op.kind == "optim_step":
            self.optim_step(op)
            state.persist(self.store, self.model_id, op.seq_id, self.steps, self.model, self.optimizer)
            return self._ok(op)
        if op.kind == "save_weights_for_sampler":
            version = state.publish(self.store, self.manifest, self.events, self.model, self.model_id, self.steps)
            path = tinker.sampler_path(self.model_id, op.name or version.folder)
            return self._ok(op, version=int(version), path=path)
        if op.kind == "save_weights":
            name = op.name or f"seq{op.seq_id:06d}"
            state.write_files(self.store, tinker.weights_prefix(self.model_id, name), self.model, self.optimizer)
            return self._ok(op, path=tinker.state_path(self.model_id, name))
        if op.kind == "load_weights":
            self.load(op.path or "", op.optimizer)
            state.persist(self.store, self.model_id, op.seq_id, self.steps, self.model, self.optimizer)
            return self._ok(op, path=op.path)
        raise TinkerUserError(f"operation {op.kind!r} is not one the trainer executes")

    def forward(self, op: TinkerOp, backward: bool) -> tuple[list[list[float]], float]:
        """Per-datum logprobs (every position) and the summed loss; gradients accumulate with `backward`."""
        loss = loss_for(op.loss_fn, op.loss_fn_config)
        if not op.data:
            raise TinkerUserError(f"{op.kind} got no data")
        comps = [completion(i, d, loss, self.vocab) for i, d in enumerate(op.data)]
        index = {id(c): i for i, c in enumerate(comps)}
        planned = rows([([d.tokens[0]], [c]) for d, c in zip(op.data, comps)], self.token_budget, pad_to=self.pad_to)
        out: list[list[float]] = [[] for _ in comps]
        current: list[int] = []  # the datum of each completion of the row being run, in row order

        def micro():
            for units in planned:
                current[:] = [index[id(c)] for u in units for c in u.completions]
                yield build(units, self.pad_to).to(self.device)

        def on_row(mb, logp, weighted) -> None:
            # every position of a datum is a trained token: the row's tokens are its completions' in order
            values = logp.float().cpu().tolist()
            at = 0
            for i in current:
                n = len(comps[i].ids)
                out[i] = values[at : at + n]
                at += n

        # A failed op leaves nothing behind: the gradients of part of a batch would be applied by the next
        # optim_step. Every datum is checked above, before any backward; this covers a failure on the way.
        before = [p.grad.clone() if p.grad is not None else None for p in self.params] if backward else []
        try:
            sums = accumulate(self.model, micro(), loss, backward=backward, on_row=on_row)
        except BaseException:
            for p, g in zip(self.params, before):
                p.grad = g
            raise
        return out, float(sums[1])

    def optim_step(self, op: TinkerOp) -> None:
        a = op.adam or tinker.AdamSettings()
        if a.learning_rate < 0 or not 0 <= a.beta1 < 1 or not 0 <= a.beta2 < 1 or a.eps < 0 or a.weight_decay < 0:
            raise TinkerUserError(
                f"AdamParams out of range ({a.model_dump()}): learning_rate, eps and weight_decay >= 0, betas in [0, 1)"
            )
        for group in self.optimizer.param_groups:
            group.update(lr=a.learning_rate, betas=(a.beta1, a.beta2), eps=a.eps, weight_decay=a.weight_decay)
        if a.grad_clip_norm > 0:
            torch.nn.utils.clip_grad_norm_(self.params, a.grad_clip_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1

    def load(self, path: str, with_optimizer: bool) -> None:
        """The weights (and the optimizer's state, or a fresh one) of a saved state of this bucket."""
        prefix = state.resolve_state(self.store, path)
        fresh = adam(self.params)
        weights = [p.detach().clone() for p in self.params]
        try:
            state.read_files(self.store, prefix, self.model, fresh if with_optimizer else None, f"{path!r}")
        except BaseException:  # the adapter loaded and the optimizer did not: the weights go back as they were
            with torch.no_grad():
                for p, w in zip(self.params, weights):
                    p.copy_(w)
            raise
        self.optimizer = fresh
        self.optimizer.zero_grad(set_to_none=True)
        for p in self.params:
            p.grad = None
