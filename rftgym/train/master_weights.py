"""Float32 master weights for a model held in 16-bit floats.

AdamW steps on bfloat16 weights lose every update smaller than about 0.4% of the weight (bf16
keeps 8 significant bits): at a learning rate of 1e-6 nearly all of them, so training would run
and change nothing. :class:`MasterWeights` keeps a float32 copy of every trainable 16-bit
parameter, steps the wrapped optimizer on the copies (with the model's gradients upcast), and
writes the rounded result back into the model, as mixed-precision trainers do (FSDP's
``MixedPrecisionPolicy`` plays this part under ``parallelism="fsdp"``).

Gradients are summed in float32 too: a hook on each 16-bit parameter moves its gradient into the
master's ``grad`` as soon as autograd has accumulated it, so the microbatches of a minibatch add
up in float32, not in bf16 (where each addition would round to 8 significant bits). Between the
backward passes and ``step``, the gradients are therefore on :attr:`MasterWeights.masters` (see
:func:`gradient_tensors`), and the model's ``grad`` is None; clear them with the optimizer's
``zero_grad`` (the model's own ``zero_grad`` does not reach the masters).

It is an ``Optimizer`` whose ``param_groups`` are the inner optimizer's (the float32 copies, laid
out like the model's trainable parameters), so a checkpoint maps states to parameters as for any
optimizer; ``state_dict`` adds each copy as a per-parameter state ``"master"``, so a resumed run
continues from the float32 values, not from their bf16 rounding.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

SIXTEEN_BIT = (torch.bfloat16, torch.float16)


# The gradient hook each parameter has, by id(parameter): a parameter has one master at a time, so
# a new MasterWeights for the same model removes the hooks of an earlier one. (Kept here, not on the
# parameter, so that a model stays picklable.)
_HOOKS: dict[int, torch.utils.hooks.RemovableHandle] = {}


def _move_grad_into(master: torch.Tensor) -> Callable[[torch.Tensor], None]:
    """A post-accumulate-grad hook: add the parameter's gradient to ``master.grad`` in float32,
    and free the 16-bit one. It holds the master weakly: once its MasterWeights is gone, the
    hook does nothing and the gradient stays on the parameter, for whichever optimizer is next."""
    master_ref = weakref.ref(master)

    @torch.no_grad()
    def move(param: torch.Tensor) -> None:
        master = master_ref()
        if master is None or param.grad is None:
            return
        if master.grad is None:
            master.grad = param.grad.to(torch.float32)
        else:
            master.grad.add_(param.grad)
        param.grad = None
    return move


def gradient_tensors(optimizer: torch.optim.Optimizer, parameters: list[torch.Tensor]) -> list[torch.Tensor]:
    """Where the gradients of ``parameters`` are after the backward passes, for clipping and
    averaging: the float32 masters of a :class:`MasterWeights`, else the parameters themselves."""
    if not isinstance(optimizer, MasterWeights):
        return parameters
    master_of = {id(param): master for param, master in zip(optimizer.params, optimizer.masters)}
    return [master_of.get(id(p), p) for p in parameters]


def needs_master_weights(parameters) -> bool:
    """Whether any trainable parameter is a 16-bit float."""
    return any(p.requires_grad and p.dtype in SIXTEEN_BIT for p in parameters)


class MasterWeights(torch.optim.Optimizer):
    """``make_inner(float32 copies)`` stepped on float32 copies of ``parameters``."""

    def __init__(self, parameters, make_inner: Callable[[list[torch.Tensor]], torch.optim.Optimizer]):
        self.params = [p for p in parameters if p.requires_grad]
        if not self.params:
            raise ValueError("MasterWeights got no trainable parameters")
        self.masters = [p.detach().to(torch.float32).clone().requires_grad_(True) for p in self.params]
        self.inner = make_inner(self.masters)
        for param, master in zip(self.params, self.masters):
            previous = _HOOKS.pop(id(param), None)
            if previous is not None:
                previous.remove()
            _HOOKS[id(param)] = param.register_post_accumulate_grad_hook(_move_grad_into(master))
        # Deliberately not Optimizer.__init__: the inner optimizer owns the groups and the state.
        # Optimizer hooks, add_param_group and pickling are not supported.
        self.defaults = self.inner.defaults

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise NotImplementedError("MasterWeights keeps the parameters it was made with; make a new one")

    # The inner optimizer's groups and state are this optimizer's (checkpoints, LR schedules).
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.inner.param_groups

    @property
    def state(self):
        return self.inner.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()
        self.inner.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("MasterWeights.step takes no closure")
        for param, master in zip(self.params, self.masters):
            _move_grad_into(master)(param)  # a gradient set on the parameter by hand
        self.inner.step()
        # One multi-tensor copy (rounding to the model's dtype), not a kernel launch per parameter.
        torch._foreach_copy_(self.params, self.masters)
        for master in self.masters:
            master.grad = None  # a float32 copy of every gradient need not outlive the step

    def state_dict(self) -> dict[str, Any]:
        state = self.inner.state_dict()
        index_of = {id(m): i for i, m in enumerate(p for g in self.inner.param_groups for p in g["params"])}
        entries = {index: dict(entry) for index, entry in state["state"].items()}
        for master in self.masters:
            entries.setdefault(index_of[id(master)], {})["master"] = master.detach()
        return {**state, "state": entries}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the inner optimizer, then the masters: from the model's (just loaded) weights,
        overlaid by the saved float32 masters where the checkpoint has them (a checkpoint of a
        float32 run has none)."""
        saved_masters = {}
        entries = {}
        for index, entry in state_dict["state"].items():
            entry = dict(entry)
            if "master" in entry:
                saved_masters[index] = entry.pop("master")
            if entry:  # an entry with only a master (no step taken yet) is no optimizer state
                entries[index] = entry
        self.inner.load_state_dict({**state_dict, "state": entries})  # checks the groups match
        ordered = [p for g in self.inner.param_groups for p in g["params"]]
        indices = [i for g in state_dict["param_groups"] for i in g["params"]]
        with torch.no_grad():
            for param, master in zip(self.params, self.masters):
                master.copy_(param)
            for index, master in zip(indices, ordered):
                saved = saved_masters.get(index)
                if saved is not None:
                    if saved.shape != master.shape:
                        raise ValueError(f"the saved master weight {index} has shape {tuple(saved.shape)}, the "
                                         f"parameter {tuple(master.shape)}; resume with the same model")
                    master.copy_(saved)
            for param, master in zip(self.params, self.masters):
                param.copy_(master)
