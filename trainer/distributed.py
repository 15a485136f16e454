"""Data parallelism across processes, launched with `accelerate launch` (or torchrun): one GPU per rank.

Every rank holds the whole model and trains a share of the step's micro-batches; the gradients of the
LoRA (rank 1: a few MB even on a 1.5B model) are then summed in one all-reduce, which is what DDP does
without overlapping it with the backward: for an adapter this small the overlap is worth less than the
bucketing. Token weights are computed over the whole step, so the summed gradient is the single-process
gradient exactly, whatever the split. Rank 0 alone reads the bucket and writes to it; the batch it takes
goes to the other ranks as JSON (nothing is unpickled).

One process (no launcher) is world size 1 and every call here is a no-op.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


class DataParallel:
    def __init__(self, cpu: bool = False):
        from accelerate import PartialState

        state = PartialState(cpu=cpu)  # initialises the process group from the launcher's environment
        self.rank, self.world = state.process_index, state.num_processes
        self.device = state.device
        self.is_main = self.rank == 0

    def share(self, micro: list[T], size: Callable[[T], int] = lambda mb: mb.tokens) -> list[T]:
        """This rank's micro-batches (or planned rows): largest first, each to the rank with the fewest tokens
        so far. Every rank computes the same split from the same list, so nothing is exchanged."""
        if self.world == 1:
            return micro
        load = [0] * self.world
        mine = []
        for mb in sorted(micro, key=size, reverse=True):
            r = min(range(self.world), key=lambda i: (load[i], i))
            load[r] += size(mb)
            if r == self.rank:
                mine.append(mb)
        return mine

    def sum_gradients(self, params: list[torch.nn.Parameter]) -> None:
        """Sum every parameter's gradient over the ranks (a rank that trained nothing contributes zeros)."""
        if self.world == 1:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        for p, g in zip(params, flat.split([g.numel() for g in grads])):
            p.grad = g.view_as(p)

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            dist.all_reduce(tensor)
        return tensor

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def broadcast_text(self, text: str | None) -> str:
        """Rank 0's string on every rank, as UTF-8 bytes in a tensor."""
        if self.world == 1:
            return text or ""
        data = (text or "").encode() if self.is_main else b""
        n = torch.tensor([len(data)], dtype=torch.long, device=self.device)
        dist.broadcast(n, 0)
        buf = torch.empty(int(n.item()), dtype=torch.uint8, device=self.device)
        if self.is_main:
            buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        dist.broadcast(buf, 0)
        return buf.cpu().numpy().tobytes().decode()
