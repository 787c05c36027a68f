"""Data-parallel training across processes started by ``torchrun`` or ``accelerate launch``.

The launcher sets ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``; :meth:`Distributed.from_env` joins
the process group (NCCL on GPUs, gloo on CPU). Every rank draws the same task seeds and rolls
out its own share of the tasks; after each backward pass the gradients are averaged across ranks
with ``all_reduce``, so every rank applies the same update and the weights stay identical.
Ranks may hold different numbers of samples (groups are filtered locally), so each epoch runs
the largest rank's minibatch count; a rank that has run out contributes nothing, and the average
is over the ranks that did contribute (so an empty rank does not halve the step).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class Distributed:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_env(cls, device: str | None = None) -> "Distributed":
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world <= 1:
            return cls()
        rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
        if not dist.is_initialized():
            use_cuda = torch.cuda.is_available() and not (device or "").startswith("cpu")
            if use_cuda:
                torch.cuda.set_device(local_rank)
            dist.init_process_group(backend="nccl" if use_cuda else "gloo")
        return cls(rank=rank, world_size=world, local_rank=local_rank)

    def device(self, requested: str | None) -> str | None:
        if requested is None and self.enabled and torch.cuda.is_available():
            return f"cuda:{self.local_rank}"
        return requested

    def shard(self, items: list) -> list:
        return items[self.rank::self.world_size]

    def max_int(self, value: int) -> int:
        if not self.enabled:
            return value
        tensor = torch.tensor([value], dtype=torch.long, device=self._comm_device())
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return int(tensor.item())

    def sum_floats(self, values: list[float]) -> list[float]:
        if not self.enabled:
            return values
        tensor = torch.tensor(values, dtype=torch.float64, device=self._comm_device())
        dist.all_reduce(tensor)
        return tensor.tolist()

    def average_gradients(self, parameters: list[torch.nn.Parameter], contributed: bool = True) -> None:
        if not self.enabled:
            return
        grads = [p.grad if p.grad is not None and contributed else torch.zeros_like(p) for p in parameters]
        # The last element counts the contributing ranks, summed in the same collective.
        flat = torch.cat([g.reshape(-1).float() for g in grads]
                         + [torch.ones(1, device=parameters[0].device) * float(contributed)])
        dist.all_reduce(flat)
        contributors = max(1.0, float(flat[-1]))
        flat = flat[:-1] / contributors
        offset = 0
        for p, g in zip(parameters, grads):
            n = g.numel()
            p.grad = flat[offset:offset + n].view_as(p).to(p.dtype)
            offset += n

    def gather_objects(self, obj) -> list:
        if not self.enabled:
            return [obj]
        out = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()

    def _comm_device(self):
        return torch.device("cuda", self.local_rank) if dist.get_backend() == "nccl" else torch.device("cpu")
