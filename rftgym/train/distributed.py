"""Data-parallel training across processes started by ``torchrun`` or ``accelerate launch``.

The launcher sets ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``; :meth:`Distributed.from_env` joins
the process group (NCCL on GPUs, gloo on CPU). Every rank draws the same task seeds and rolls
out its own share of the tasks; after each backward pass the gradients are averaged across ranks
with ``all_reduce``, so every rank applies the same update and the weights stay identical.
Ranks may hold different numbers of samples (groups are filtered locally), so each epoch runs
the largest rank's minibatch count; a rank that has run out contributes nothing, and the average
is over the ranks that did contribute (so an empty rank does not halve the step).

With ``parallelism="fsdp"`` the model is sharded by PyTorch's FSDP2 (``fully_shard``, one unit
per decoder layer, then a root): each rank holds 1/N of the parameters, gradients and optimizer
state. Gradients are averaged by FSDP's reduce-scatter, so :func:`shard_model` replaces
``average_gradients``; the root is a :class:`ShardedModel` whose forward computes the chunked
log-probs, so that the root's hooks gather the embeddings, final norm and head read outside any
layer. Rollouts run with the parameters gathered (:func:`full_parameters`).
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, TypeVar

import torch
import torch.distributed as dist

from ..core.errors import RftgymError

T = TypeVar("T")
E = TypeVar("E", bound=BaseException)


class PeerRankError(RftgymError, RuntimeError):
    """Another rank of a distributed run stopped with an error, so this one stops too: the message
    names the rank and its error, and the error's :class:`RankFailures` make that rank the one that
    prints it in full. One raised after waiting past the process group's timeout has no record (no
    rank is known to have failed), so this rank reports it itself."""


@dataclass(frozen=True)
class RankFailures:
    """Which ranks of a distributed run failed at one point of it, and with what: ``reports[r]`` is
    rank r's error as ``"Type: message"``, or None where rank r did not fail. Each rank's error from
    that point (its own, or a :class:`PeerRankError`) carries the same record, so that every rank
    tells from it alone who prints the error (:func:`who_reports`)."""
    reports: tuple[str | None, ...]

    @property
    def failed_ranks(self) -> list[int]:
        return [rank for rank, report in enumerate(self.reports) if report is not None]

    def attach(self, error: E) -> E:
        """``error``, carrying this record."""
        try:
            error.rank_failures = self
        except AttributeError:  # an exception type that takes no attributes: reported by its rank
            pass
        return error

    @staticmethod
    def of(error: BaseException) -> RankFailures | None:
        """The record ``error`` carries, or the nearest one along its causes: a front end may raise
        its own error from it (``raise UsageError("--flag: ...") from exc``)."""
        seen = set()
        while error is not None and id(error) not in seen:  # (causes can form a cycle: stop there too)
            failures = getattr(error, "rank_failures", None)
            if isinstance(failures, RankFailures):
                return failures
            seen.add(id(error))
            error = error.__cause__
        return None


@dataclass(frozen=True)
class ErrorReport:
    """Who prints an error of a launched run: ``reporter`` prints it in full, the other ranks one
    line that names it; ``every_rank``: all ranks stopped with this same error, so it is printed
    as one process would print it (else with the reporter's rank)."""
    reporter: int
    every_rank: bool


def who_reports(error: BaseException, rank: int, world_size: int, same_on_every_rank: bool) -> ErrorReport:
    """The :class:`ErrorReport` of ``error``, this rank's, so that the user reads each error once
    rather than once per rank. An error that carries the ranks' :class:`RankFailures` (from
    :meth:`Distributed.together` or :meth:`Distributed.every_rank`) is reported by the first rank
    that had this rank's error, or, where this rank did not fail (a :class:`PeerRankError`), by the
    first rank that failed. Any other error: ``same_on_every_rank`` (an error of input that every
    rank reads alike: a flag, a config, a data file) by rank 0, and anything else by this rank
    itself (it may be its own alone: a crash, a device)."""
    failures = RankFailures.of(error)
    if failures is not None and len(failures.reports) == world_size:  # (another size: not this launch's)
        own = failures.reports[rank]
        if own is None:
            return ErrorReport(failures.failed_ranks[0], False)
        return ErrorReport(failures.reports.index(own), all(report == own for report in failures.reports))
    return ErrorReport(0, True) if same_on_every_rank else ErrorReport(rank, False)


def leave_after_report(wait_s: float = 30.0) -> None:
    """Under a launcher, once this rank has printed its part of an error report: wait for every
    rank to have printed its own, then leave the process group. The launcher ends all ranks as
    soon as one exits, and the rank that prints the error in full must not be ended before it has.
    A rank without a process group (the error came before the run joined one) joins one on CPU
    for this; every rank then has the same error (it came from input they all read), so all join."""
    from datetime import timedelta

    if not dist.is_initialized():
        try:
            dist.init_process_group("gloo", timeout=timedelta(seconds=wait_s))
        except Exception:  # noqa: BLE001 (no launcher's rendezvous, or a rank that never came: leave)
            return
    leave_process_group(wait_s)


def leave_process_group(wait_s: float = 30.0) -> None:
    """End this process's part in a torchrun/accelerate process group, if it joined one. Left to the
    interpreter's exit, the collective backend's threads can abort a process (SIGABRT) after its
    run ended well, and the launcher then reports the run as failed. First a barrier, bounded by
    ``wait_s`` (a peer that died is not waited for longer): no rank closes its connections while
    another's last collective is still in flight. The run's cyclic garbage (FSDP state) is collected
    while the group still exists, and the group's own objects right after it is destroyed."""
    import gc
    from datetime import timedelta

    if not (dist.is_available() and dist.is_initialized()):
        return
    try:
        dist.barrier(async_op=True).wait(timeout=timedelta(seconds=wait_s))
    except Exception:  # noqa: BLE001 (a peer gone or failed: leave anyway)
        pass
    gc.collect()
    dist.destroy_process_group()
    gc.collect()


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
    def from_env(cls, device: str | None = None, process_group_for_one: bool = False,
                 timeout_s: float | None = None) -> "Distributed":
        """Join the launcher's process group. One process needs none, except FSDP (which shards
        over a process group even of one, e.g. ``torchrun --nproc_per_node=1``). ``timeout_s``
        bounds each collective's wait for the other ranks (None: PyTorch's default)."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world <= 1 and not (process_group_for_one and "RANK" in os.environ):
            return cls()
        rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
        if not dist.is_initialized():
            use_cuda = torch.cuda.is_available() and not (device or "").startswith("cpu")
            if use_cuda:
                torch.cuda.set_device(local_rank)
            from datetime import timedelta

            dist.init_process_group(backend="nccl" if use_cuda else "gloo",
                                    **({} if timeout_s is None else {"timeout": timedelta(seconds=timeout_s)}))
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
        """Each parameter's gradient becomes the mean over the ranks that contributed (ran samples
        this minibatch); a rank without a gradient for a parameter adds zeros.

        A parameter that has a gradient on no rank keeps ``grad = None``, as in one process, so
        the optimizer skips it (AdamW would otherwise still move it, by weight decay and by its
        moments). That takes knowing on the host whether any rank had one, which is read back
        only when this rank lacks a gradient (an unused parameter, or no samples): in the usual
        minibatch every rank has them all, and nothing is read back.
        """
        if not self.enabled:
            return
        present = [p.grad is not None and contributed for p in parameters]
        grads = [p.grad if has else torch.zeros_like(p) for p, has in zip(parameters, present)]
        device = parameters[0].device
        # Summed in the same collective: how many ranks had each parameter's gradient, then how
        # many ranks contributed.
        flags = torch.tensor(present + [contributed], dtype=torch.float32)
        if device.type == "cuda":  # from pinned memory the copy is queued, not waited for
            flags = flags.pin_memory().to(device, non_blocking=True)
        flat = torch.cat([g.reshape(-1).float() for g in grads] + [flags.to(device)])
        dist.all_reduce(flat)
        counts = flat[-len(parameters) - 1:-1]
        # Divided on the device (no read-back, so the host need not wait for the all-reduce).
        averaged = flat[:-len(parameters) - 1] / flat[-1:].clamp(min=1.0)
        unused = set()
        if not all(present):
            unused = {i for i, n in enumerate(counts.tolist()) if n == 0}
        offset = 0
        for i, (p, g) in enumerate(zip(parameters, grads)):
            n = g.numel()
            p.grad = None if i in unused else averaged[offset:offset + n].view_as(p).to(p.dtype)
            offset += n

    def gather_objects(self, obj) -> list:
        if not self.enabled:
            return [obj]
        out = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def together(self, work: Callable[[], T]) -> T:
        """``work()``'s result, where ``work`` may fail on one rank alone (a collective inside it
        must come before anything that can fail): if it raises on any rank, every rank raises.
        The rank that failed raises its own error; the others a :class:`PeerRankError` naming it;
        each carries the ranks' :class:`RankFailures`, from which every rank knows who reports it.
        Without this a rank whose rollout or samples failed (an env breaking its contract, a
        policy without log-probs) would stop while the others waited in their next collective
        until the process group's timeout."""
        if not self.enabled:
            return work()
        try:
            result, failure = work(), None
        except Exception as exc:  # reported to every rank, then raised here as it was
            result, failure = None, exc
        try:
            reports = self.gather_objects(None if failure is None else f"{type(failure).__name__}: {failure}")
        except Exception as gather_error:  # e.g. a broken device: the work's own error still comes first
            if failure is not None:
                raise failure from gather_error
            if "timed out" in str(gather_error).lower() or "timeout" in str(gather_error).lower():
                raise PeerRankError(f"this rank waited for the other ranks past the process group's timeout "
                                    f"({gather_error}); one of them is stuck (its env, a server, the model) or slower "
                                    "than that. Raise --dist-timeout (dist_timeout_s) if its steps take that "
                                    "long") from gather_error
            raise
        if all(report is None for report in reports):
            return result
        failures = RankFailures(tuple(reports))
        raise failures.attach(failure if failure is not None else self._peer_error(failures))

    def _peer_error(self, failures: RankFailures) -> PeerRankError:
        """What this rank, which did not fail, stops with: the first rank that failed, and its error."""
        first, *others = failures.failed_ranks
        more = f" (and {len(others)} more ranks)" if others else ""
        return PeerRankError(f"rank {first}{more} stopped the run with {failures.reports[first]}; rank {self.rank} "
                             f"stops too. Rank {first}'s own output has the full error.")

    def every_rank(self, error: E) -> E:
        """``error``, noted as the one every rank raises alike (e.g. the writing rank's refusal of
        the output directory, sent to all), so that a launched run prints it once."""
        return RankFailures((f"{type(error).__name__}: {error}",) * self.world_size).attach(error)

    def _comm_device(self):
        return torch.device("cuda", self.local_rank) if dist.get_backend() == "nccl" else torch.device("cpu")


# ---------------------------------------------------------------- FSDP (parallelism="fsdp")

class ShardedModel(torch.nn.Module):
    """FSDP's root module: ``forward`` is ``logprobs(model, *args)``, so that the root's hooks
    gather (and, in backward, reduce-scatter) the parameters that the log-prob computation reads
    outside the decoder layers: embeddings, final norm and the (possibly tied) output head."""

    def __init__(self, model: torch.nn.Module, logprobs: Callable):
        super().__init__()
        self.model = model
        self._logprobs = logprobs

    def forward(self, *args, **kwargs):
        # FSDP attaches its backward hook to the outputs, and warns that an in-place op on a view
        # would drop it; the log-probs are small (batch x tokens), so hand back copies.
        return tuple(t.clone() if isinstance(t, torch.Tensor) and t._is_view() else t
                     for t in self._logprobs(self.model, *args, **kwargs))

    def disable_adapter(self):
        # The LoRA reference ("adapters-off") switches the wrapped peft model's adapters off.
        return self.model.disable_adapter()


def inner_model(model: torch.nn.Module) -> torch.nn.Module:
    """The model itself under FSDP's root, whose parameter names (in checkpoints and fingerprints)
    are the model's own."""
    return model.model if isinstance(model, ShardedModel) else model


def shard_model(model: torch.nn.Module, logprobs: Callable, mixed_precision: bool) -> ShardedModel:
    """Shard ``model`` in place with FSDP2 and return its root (a :class:`ShardedModel`).

    One FSDP unit per decoder layer (the classes named by the model's ``_no_split_modules``, as
    accelerate does), so that only one layer's full parameters exist at a time in forward and
    backward; with LoRA the peft-wrapped model is sharded, and its frozen base weights simply get
    no gradients. ``mixed_precision`` (CUDA): layers compute in bfloat16 while the sharded master
    weights, and the gradient reduce-scatter, stay in float32.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    device = next(model.parameters()).device
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if mixed_precision else MixedPrecisionPolicy())
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    layer_classes = set(getattr(base, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in layer_classes]
    if not layers:
        from ..core.errors import ConfigError

        raise ConfigError(f"{type(base).__name__} names no decoder-layer classes (_no_split_modules), so FSDP "
                          "cannot shard it layer by layer; use parallelism='ddp' for this model")
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    root = ShardedModel(model, logprobs)
    fully_shard(root, mesh=mesh, mp_policy=policy)
    return root


@contextmanager
def full_parameters(model):
    """Gather every FSDP unit's full parameters for a rollout, and free them afterwards.

    A rollout calls the inner model token by token, and ranks generate different numbers of
    tokens, so per-forward all-gathers could not be matched across ranks; instead each unit is
    gathered once (one all-gather per unit per step), generation then runs collective-free, and
    the cost is the full model's parameters (in the compute dtype) held for the rollout's
    duration. Not sharded: nothing to do.
    """
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(model, FSDPModule):
        yield
        return
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for unit in units:
        unit.set_reshard_after_forward(False, recurse=False)  # the layers' forward hooks must not free them
        unit.unshard()
    try:
        yield
    finally:
        for unit in units:
            unit.reshard()
            # Layers free their parameters after forward in training; the root keeps its own
            # (FSDP's default: backward needs them at once).
            unit.set_reshard_after_forward(unit is not model, recurse=False)


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole of a (possibly sharded) tensor; a collective for a sharded one."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def shard_like(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``full`` laid out as ``like`` is: this rank's shard if ``like`` is sharded, else as is."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(like, DTensor):
        return full
    # Every rank read the same checkpoint, so each cuts its own shard without communication.
    return distribute_tensor(full.to(like.device, like.dtype), like.device_mesh, like.placements, src_data_rank=None)
