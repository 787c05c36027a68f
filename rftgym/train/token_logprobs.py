"""Log-probabilities of sampled tokens straight from the final hidden states, chunk by chunk.

The training update needs, for every position, ``log softmax(hidden @ W.T / T)[target]`` (and the
entropy, for reporting). Done naively this materialises a ``[tokens, vocab]`` float32 tensor
(24576 x 49152 x 4 bytes = 4.8 GB for SmolLM2 at 64 x 384 tokens) and autograd keeps several of
them. :func:`chunked_token_logprobs` instead runs ``chunk_size`` tokens at a time through a fused
linear + log-softmax autograd function:

* forward, per chunk: ``logits = h @ W.T`` in the compute dtype (bfloat16 under autocast), then
  one fused reduction pass in float32 gives the target's log-prob, the log-sum-exp and the
  entropy. Only ``[tokens]``-sized results are saved: the log-sum-exp and the entropy.
* backward, per chunk: the chunk's logits are recomputed (one matmul) and the gradient with
  respect to them is written in one fused elementwise pass::

      s  = logits / T,   p = softmax(s) = exp(s - lse),   log p = s - lse
      dL/ds = g_logp * (onehot(target) - p)  -  g_entropy * p * (log p + H)
      dL/dlogits = dL/ds / T

  (``dH/ds_j = -p_j (log p_j + H)`` follows from ``H = lse(s) - sum_i p_i s_i``), then two
  matmuls give the gradients of ``h`` and of ``W``.

Models whose logits are more than ``h @ W.T`` are covered by a :class:`LogitTransform` (read from
the model's config by :func:`logit_transform`): a scale (Cohere's ``logit_scale``), a divisor
(Granite's ``logits_scaling``) and a soft cap (Gemma 2/3's ``cap * tanh(logits / cap)``), applied
to each chunk's logits op for op as the model does (in bfloat16 under autocast, so the numbers
round alike), with the chain rule through it in the backward pass.

Compared with checkpointing the chunk's autograd graph (what this replaced), the backward pass
no longer re-runs the forward's float32 elementwise chain, and on CUDA the two elementwise
passes are compiled into fused kernels, so each chunk's vocabulary-wide work is a few reads and
writes of its logits instead of a dozen float32 passes.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

from ..core.errors import ConfigError, warn_caller

# ---------------------------------------------------------------- the two elementwise passes

@dataclass(frozen=True)
class LogitTransform:
    """What a model does to ``l = hidden @ W.T`` before its softmax, in this order and, as the
    model does it, in the logits' own dtype: ``l * scale``, ``/ divisor``, then with a ``softcap``
    ``softcap * tanh(z / softcap)``."""

    scale: float = 1.0
    divisor: float = 1.0
    softcap: float | None = None

    def __post_init__(self) -> None:
        if not self.scale > 0 or not self.divisor > 0:
            raise ConfigError(f"a logit scale and divisor must be > 0, got {self.scale} and {self.divisor}")
        if self.softcap is not None and not self.softcap > 0:
            raise ConfigError(f"a logit soft cap must be > 0 (or None), got {self.softcap}")

    @property
    def is_identity(self) -> bool:
        return self.scale == 1.0 and self.divisor == 1.0 and self.softcap is None

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """The transformed logits, op for op as the model computes them (so in bfloat16 they round
        the same way, and training sees the probabilities the rollout sampled from)."""
        z = logits
        if self.scale != 1.0:
            z = z * self.scale
        if self.divisor != 1.0:
            z = z / self.divisor
        if self.softcap is not None:
            z = torch.tanh(z / self.softcap) * self.softcap
        return z

    def derivative(self, transformed: torch.Tensor) -> torch.Tensor | float:
        """``dz/dl`` (float32, float64 for float64), from the transformed logits ``z``; a number
        when it is constant."""
        factor = self.scale / self.divisor
        if self.softcap is None:
            return factor
        tanh = transformed.to(torch.promote_types(transformed.dtype, torch.float32)) / self.softcap
        return (1.0 - tanh * tanh) * factor


IDENTITY = LogitTransform()


def logit_transform(model_config) -> LogitTransform:
    """The :class:`LogitTransform` a Hugging Face model config asks for (identity for most models).

    Read from ``final_logit_softcapping`` (Gemma 2/3 and others: ``cap * tanh(l / cap)``),
    ``logit_scale`` (Cohere: ``l * logit_scale``) and ``logits_scaling`` (Granite: ``l /
    logits_scaling``; HyperCLOVA X multiplies by it instead). Training checks the result against
    the model's own logits once (:func:`rftgym.train.model_setup.check_training_logprobs`), so a family
    that reads these names differently is refused rather than trained on the wrong probabilities.
    """
    def number(name):
        value = getattr(model_config, name, None)
        return None if value is None or isinstance(value, bool) else float(value)

    softcap = number("final_logit_softcapping") or None  # 0 means off in some configs
    scale = number("logit_scale") or 1.0
    divisor = number("logits_scaling") or 1.0
    if getattr(model_config, "model_type", "") == "hyperclovax":
        scale, divisor = scale * divisor, 1.0
    return LogitTransform(scale=scale, divisor=divisor, softcap=softcap)


# Far below any log-probability whose probability is not 0 in float32 (or float64: exp(-1e4) is 0).
LOGP_FLOOR = -1e4


def _scores(logits: torch.Tensor, inv_temperature: float) -> torch.Tensor:
    scores = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return scores if inv_temperature == 1.0 else scores * inv_temperature


def logit_statistics(logits: torch.Tensor, targets: torch.Tensor, inv_temperature: float,
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(log p[target], log-sum-exp, entropy)`` of ``softmax(logits * inv_temperature)``, per
    row, in float32 (float64 stays float64)."""
    scores = _scores(logits, inv_temperature)
    logp = torch.log_softmax(scores, dim=-1)
    target_logp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    # log p_v = s_v - lse in every column; the most likely one has log p near 0, so nothing cancels.
    lse = scores.amax(dim=-1) - logp.amax(dim=-1)
    # A -inf logit (a masked token) has p = 0 and log p = -inf, and 0 * -inf is nan; raised to the
    # floor its term is 0 * floor = 0, as for any log p below ~-104, where exp underflows to 0.
    logp.clamp_(min=LOGP_FLOOR)
    # H = -sum_v p_v log p_v, as a batched dot product (no third [rows, V] temporary)
    entropy = -torch.bmm(torch.exp(logp).unsqueeze(1), logp.unsqueeze(2)).view(-1)
    return target_logp, lse, entropy


def logit_gradient(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, entropy: torch.Tensor,
                   grad_logp: torch.Tensor, grad_entropy: torch.Tensor | None, inv_temperature: float,
                   ) -> torch.Tensor:
    """``dL/dlogits`` (in the logits' dtype) from the upstream gradients of the target log-probs
    and of the entropies (``None``: the entropies are not in the loss). See the module docstring."""
    logp = (_scores(logits, inv_temperature) - lse.unsqueeze(-1)).clamp_(min=LOGP_FLOOR)  # see logit_statistics
    if grad_entropy is None:
        weight = grad_logp.unsqueeze(-1)  # dL/ds = g * (onehot - p)
    else:
        # g_logp + g_entropy * (log p + H), per element
        weight = torch.addcmul((grad_logp + grad_entropy * entropy).unsqueeze(-1), grad_entropy.unsqueeze(-1), logp)
    grad = logp.exp_().mul_(weight).neg_()  # logp's storage becomes -p * weight
    grad.scatter_add_(-1, targets.unsqueeze(-1), grad_logp.unsqueeze(-1).to(grad.dtype))
    if inv_temperature != 1.0:
        grad.mul_(inv_temperature)
    return grad.to(logits.dtype)


@functools.cache
def _compiled(function):
    return torch.compile(function, dynamic=True)


_compile_failed: set = set()
# The passes run inside torch's frames (autograd's Function.apply, a module's forward): a warning
# from one names the line past those too.
_TORCH_DIR = (os.path.dirname(torch.__file__) + os.sep,)


def _pass(function, device: torch.device, *args):
    """Run one elementwise pass, compiled on CUDA (fused kernels) and eager elsewhere (also inside
    an outer compiled region, whose compiler then traces it). A compile failure is reported once
    and that pass then runs eagerly: same numbers, more memory traffic."""
    if device.type != "cuda" or function in _compile_failed or torch.compiler.is_compiling():
        return function(*args)
    try:
        return _compiled(function)(*args)
    except Exception as exc:  # the compiler raises many types; any means "run it eagerly"
        _compile_failed.add(function)
        warn_caller(f"could not compile the fused log-prob pass {function.__name__} ({type(exc).__name__}: "
                    f"{str(exc).splitlines()[0] if str(exc) else ''}); running it eagerly", also_skipping=_TORCH_DIR)
        return function(*args)


# ---------------------------------------------------------------- the autograd function

def _compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    # Under autocast the matmul runs in the autocast dtype, as nn.Linear would; otherwise in the
    # weight's dtype (a chunk of hidden in another dtype is cast, never the [V, H] weight).
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type) and weight.dtype == torch.float32:
        return torch.get_autocast_dtype(device_type)
    return weight.dtype


class _FusedTokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, transform: LogitTransform, inv_temperature: float, chunk_size: int):
        compute_dtype = _compute_dtype(hidden, weight)
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(compute_dtype)
            results = [
                _pass(logit_statistics, hidden.device, transform.apply(h.to(compute_dtype) @ w.t()), t, inv_temperature)
                for h, t in zip(torch.split(hidden, chunk_size), torch.split(targets, chunk_size))
            ]
        logp, lse, entropy = (torch.cat(parts) for parts in zip(*results))
        ctx.save_for_backward(hidden, weight, targets, lse, entropy)
        # An unused entropy then arrives as None, and its gradient term is skipped.
        ctx.set_materialize_grads(False)
        ctx.transform, ctx.inv_temperature = transform, inv_temperature
        ctx.chunk_size, ctx.compute_dtype = chunk_size, compute_dtype
        return logp, entropy

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, targets, lse, entropy = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if grad_logp is None:
            grad_logp = torch.zeros_like(lse)
        size, dtype = ctx.chunk_size, ctx.compute_dtype
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        # Accumulate the weight's gradient in float32 at least, whatever the compute dtype.
        grad_weight = torch.zeros(weight.shape, dtype=torch.promote_types(weight.dtype, torch.float32),
                                  device=weight.device) if need_weight else None
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(dtype)
            for start in range(0, hidden.shape[0], size):
                rows = slice(start, start + size)
                h = hidden[rows].to(dtype)
                transformed = ctx.transform.apply(h @ w.t())
                grad_logits = _pass(logit_gradient, hidden.device, transformed, targets[rows], lse[rows], entropy[rows],
                                    grad_logp[rows], None if grad_entropy is None else grad_entropy[rows],
                                    ctx.inv_temperature)
                if not ctx.transform.is_identity:  # the chain rule through the model's transform
                    wide = grad_logits.to(torch.promote_types(dtype, torch.float32))
                    grad_logits = (wide * ctx.transform.derivative(transformed)).to(dtype)
                if need_hidden:
                    grad_hidden[rows] = grad_logits @ w
                if need_weight:
                    if grad_weight.dtype == dtype:
                        grad_weight.addmm_(grad_logits.t(), h)
                    else:  # e.g. bf16 products summed into a float32 gradient
                        grad_weight += grad_logits.t() @ h
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None


def chunked_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    with_entropy: bool = False,
    transform: LogitTransform = IDENTITY,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probabilities of ``targets`` (and optionally the entropy) without a full-vocab tensor.

    ::

        logits_bt  = transform(hidden_bt @ weight.T) / temperature
        logprob_bt = log_softmax(logits_bt)[targets_bt]
        entropy_bt = -sum_v softmax(logits_bt)_v * log_softmax(logits_bt)_v

    ``hidden`` is ``[B, T, H]`` (final, already normed hidden states), ``weight`` the ``[V, H]``
    lm_head weight, ``targets`` ``[B, T]`` valid token ids (masked positions may hold any valid id,
    e.g. the pad id). The B*T tokens are processed ``chunk_size`` at a time. The matmul runs in
    the autocast dtype under autocast, else in the weight's dtype; the softmax statistics in
    float32 (float64 for float64 inputs). Both outputs are differentiable (with respect to
    ``hidden`` and ``weight``); no ``[chunk, V]`` tensor is kept between forward and backward,
    and none ever has more than ``chunk_size`` rows.

    Returns ``(logprobs [B, T], entropy [B, T] or None)`` in float32 (float64 for float64 inputs).
    """
    if not temperature > 0:
        raise ConfigError(f"temperature must be > 0, got {temperature}")
    if chunk_size < 1:
        raise ConfigError(f"chunk_size must be >= 1, got {chunk_size}")
    if hidden.dim() != 3 or targets.shape != hidden.shape[:2] or weight.dim() != 2 or weight.shape[1] != hidden.shape[2]:
        raise ValueError(
            f"expected hidden [B, T, H], weight [V, H], targets [B, T]; got {tuple(hidden.shape)}, "
            f"{tuple(weight.shape)}, {tuple(targets.shape)}"
        )
    batch, seq, _ = hidden.shape
    if batch * seq == 0:
        empty = hidden.new_zeros((batch, seq), dtype=torch.promote_types(weight.dtype, torch.float32))
        return empty, (empty.clone() if with_entropy else None)
    flat_hidden = hidden.reshape(batch * seq, -1)
    flat_targets = targets.reshape(-1).long()
    logp, entropy = _FusedTokenLogprobs.apply(flat_hidden, weight, flat_targets, transform, 1.0 / temperature,
                                              chunk_size)
    return logp.view(batch, seq), (entropy.view(batch, seq) if with_entropy else None)
