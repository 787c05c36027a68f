"""Training-speed switches for the update phase, applied to the model in place.

The update runs through :func:`rftgym.train.update.batch_logprobs` (the HF decoder, then chunked
log-probs) whatever is switched on here; these switches only change how fast and how lean it is:

* ``compile_layers``: ``torch.compile`` each decoder layer, for calls without a KV cache (decoding
  with one stays eager). Identical layers share one compiled graph (a short first compile), and
  the compiler fuses norms, RoPE, SiLU and residual adds, recomputing those cheap elementwise
  results in the backward pass instead of saving them.
* ``compile_scope="decoder"``: compile the whole decoder (every layer, the embedding and the
  final norm) as one graph instead, again only for cache-free calls. Each compiled call costs the
  host a guard check, an autograd node and its wrapper code, per layer with ``"layers"``; for a
  small model (30 layers of width 576) that host work, not the device, can bound the update. One
  graph has it once per forward, at the price of a first compile that grows with the depth.
* ``causal_without_mask``: training batches are right-padded (:func:`~rftgym.train.batching.collate`),
  so under a causal mask no real token ever sees padding: the padding mask changes nothing for
  real tokens. Dropping it lets SDPA use its flash kernel (``is_causal``) instead of the masked
  memory-efficient one, and running SDPA under a name transformers has no mask function for
  (:data:`CAUSAL_SDPA`) spares the host a wait for the device in every forward. A decoder call
  with any other mask (e.g. left padding) keeps its mask and the model's attention.
* ``checkpoint_mlp``: recompute each layer's MLP in the backward pass (its 3 x intermediate-size
  activations dominate memory) at the cost of one extra MLP forward.
* ``memory_budget``: the compiler's activation-memory budget (0..1) for choosing what to recompute.
* ``compile_mode``: ``torch.compile``'s mode for those graphs. ``"default"`` is what training uses;
  ``"reduce-overhead"`` (CUDA graphs: the host launches each graph's kernels at once) and
  ``"max-autotune-no-cudagraphs"`` (GEMM kernels tuned for the model's narrow matrices) are there
  for ``benchmarks/trainer_gpu.py`` to measure against it on a GPU; they are not yet chosen by
  ``rftgym train``.

:func:`make_optimizer` gives a fused AdamW on CUDA (one kernel for all parameters).

Wiring (for :mod:`rftgym.train.loop`): call ``apply_training_speedups(model, SpeedConfig(...))`` at
the end of ``prepare_model`` and build the optimizer with :func:`make_optimizer`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from ..agents.fast_decode import active_window
from ..core.errors import ConfigError
from .config import COMPILE_SCOPES
from .master_weights import MasterWeights, needs_master_weights


COMPILE_MODES = ("default", "reduce-overhead", "max-autotune-no-cudagraphs", "max-autotune")


@dataclass(frozen=True)
class SpeedConfig:
    compile_layers: bool = True
    compile_scope: str = "layers"  # "layers": each decoder layer alone; "decoder": the decoder as one graph
    causal_without_mask: bool = True
    checkpoint_mlp: bool = False
    fused_optimizer: bool = True
    memory_budget: float | None = None  # None: the compiler's default (save what is not cheap to recompute)
    compile_mode: str = "default"  # torch.compile's mode (see the module docstring)

    def __post_init__(self) -> None:
        if self.compile_scope not in COMPILE_SCOPES:
            raise ConfigError(f"compile_scope must be one of {', '.join(COMPILE_SCOPES)}; got {self.compile_scope!r}")
        if self.compile_mode not in COMPILE_MODES:
            raise ConfigError(f"compile_mode must be one of {', '.join(COMPILE_MODES)}; got {self.compile_mode!r}")
        if self.memory_budget is not None and not 0 < self.memory_budget <= 1:
            raise ConfigError(f"memory_budget must be in (0, 1] (share of activations kept), got {self.memory_budget}")


def _base(model):
    return model.get_base_model() if hasattr(model, "get_base_model") else model


@functools.lru_cache(maxsize=None)
def compile_works(device_type: str) -> str | None:
    """None if ``torch.compile`` can build and run a kernel on ``device_type``; else why not
    (e.g. no C compiler for Triton's launcher). Checked once per process."""
    try:
        def probe(x):
            return torch.nn.functional.silu(x) * 2 + 1

        x = torch.randn(8, device=device_type)
        torch.testing.assert_close(torch.compile(probe)(x), probe(x))
        return None
    except Exception as exc:  # the compiler raises many types; any means "do not compile"
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def is_right_padded(mask: torch.Tensor) -> bool:
    """Whether every row of a ``[B, T]`` mask is nonzeros followed by zeros. A mask in host memory
    is checked there; one on an accelerator is read back once, which waits for the device."""
    if mask.dim() != 2:
        return False
    nonzero = mask.detach().ne(0)
    if nonzero.device.type == "cpu":
        return bool(_ones_then_zeros(nonzero.numpy()))
    return bool(_ones_then_zeros(nonzero))


def _ones_then_zeros(values):
    """For a ``[B, T]`` boolean numpy array or tensor: every row is True up to some point, then False."""
    return values[:, 0].all() & (values[:, 1:] <= values[:, :-1]).all()


def tag_right_padding(mask: torch.Tensor, right_padded: bool) -> torch.Tensor:
    """Record on ``mask`` whether it is right-padded, as checked on the host before it moved to
    the device; the mask hook then trusts the tag instead of reading the mask back (which would
    make the host wait for the device). Returns ``mask``."""
    mask._rftgym_right_padded = bool(right_padded)
    return mask


# SDPA under a name that has no mask function in transformers: the decoder then builds no mask and
# checks nothing. Its mask code would otherwise read the position ids back from the device once per
# forward (looking for packed sequences), which makes the host wait for the device; with no mask,
# SDPA runs causal (``is_causal``: the flash kernel).
CAUSAL_SDPA = "rftgym_causal_sdpa"
CACHE_KWARGS = ("past_key_values", "past_key_value", "cache")  # transformers 5.17, older, 5.24


@functools.lru_cache(maxsize=None)
def _causal_sdpa_registered() -> bool:
    try:
        from transformers import AttentionInterface
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
    except ImportError:
        return False
    AttentionInterface.register(CAUSAL_SDPA, sdpa_attention_forward)
    return True


def _drops_mask(mask: torch.Tensor) -> bool:
    """Whether the padding mask can go: a batch from :func:`~rftgym.train.update.to_device` carries
    its host-checked tag (trusted in any grad mode, so that the no-grad forwards of the reference
    and of recomputed log-probs run the same kernels as the update); an untagged mask is checked
    under grad only (rollouts and scoring keep theirs)."""
    right_padded = getattr(mask, "_rftgym_right_padded", None)
    if right_padded is not None:
        return right_padded
    return torch.is_grad_enabled() and is_right_padded(mask)


def full_causal_attention(config) -> bool:
    """Whether every layer attends to every earlier token: no sliding window (Mistral, Qwen2 with
    ``use_sliding_window``, Gemma 2/3's sliding layers) and no chunked attention, which only the
    masks transformers builds would add."""
    if active_window(config) is not None:
        return False
    layer_types = getattr(config, "layer_types", None) or ()
    if any(kind != "full_attention" for kind in layer_types):
        return False
    return getattr(config, "attention_chunk_size", None) is None


def _drop_right_padding_mask(module, args, kwargs):
    """Before each decoder forward: drop a right-padding mask, and pick the attention: SDPA under
    :data:`CAUSAL_SDPA` for a mask-free, cache-free, unpacked call (no position ids given) of a
    fully causal model, the model's own otherwise. The choice is made afresh at every call."""
    mask = kwargs.get("attention_mask")
    if mask is not None and _drops_mask(mask):
        kwargs = {**kwargs, "attention_mask": None}
    config = module.config
    if config._attn_implementation != CAUSAL_SDPA:  # the model's own (it may have been changed since)
        module._rftgym_attention = config._attn_implementation
    own = module._rftgym_attention
    causal = (own == "sdpa" and module._rftgym_full_causal and kwargs.get("attention_mask") is None
              and kwargs.get("position_ids") is None and kwargs.get("use_cache") is False
              and all(kwargs.get(k) is None for k in CACHE_KWARGS) and _causal_sdpa_registered())
    _set_attention(config, CAUSAL_SDPA if causal else own)
    return args, kwargs


def _restore_attention(module, args, kwargs, output):
    """After each decoder forward, also one that raised: the model's own attention again."""
    _set_attention(module.config, module._rftgym_attention)


def _set_attention(config, name: str) -> None:
    if config._attn_implementation != name:
        config._attn_implementation = name


def _checkpoint_mlp_class(mlp_class) -> None:
    """Give an MLP class a forward that is recomputed in the backward pass for the instances
    flagged ``_rftgym_checkpointed`` (others run as before). A class-level switch, rather than a
    per-instance forward: the flag pickles and deep-copies with its module, and the compiler sees
    one function for every layer, so identical layers still share one graph."""
    if "_rftgym_plain_forward" in mlp_class.__dict__:
        return
    plain = mlp_class.forward

    @functools.wraps(plain)
    def forward(self, *args, **kwargs):
        if getattr(self, "_rftgym_checkpointed", False) and torch.is_grad_enabled() \
                and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            return checkpoint(plain, self, *args, use_reentrant=False, preserve_rng_state=False, **kwargs)
        return plain(self, *args, **kwargs)

    mlp_class._rftgym_plain_forward = plain
    mlp_class.forward = forward


@functools.lru_cache(maxsize=None)
def _compiled_forward(module_class, mode: str = "default"):
    """One compiled ``forward`` per decoder-layer (or decoder) class and mode, shared by its
    instances (the module is an input of the graph, so identical layers reuse it), for any
    sequence length."""
    return torch.compile(module_class.forward, dynamic=True, mode=mode)


def _compiled_unless_cached(self, *args, **kwargs):
    """A decoder layer's forward: compiled for the update's cache-free calls; eager when decoding
    with a KV cache, whose per-layer state the compiler would guard on (one graph per layer and
    cache state, past its cache of graphs), and which the update never runs."""
    if _cache_free(kwargs):
        return _compiled_forward(type(self), self._rftgym_compile_mode)(self, *args, **kwargs)
    return type(self).forward(self, *args, **kwargs)


def _cache_free(kwargs) -> bool:
    return all(kwargs.get(k) is None for k in CACHE_KWARGS)


def _compiled_decoder_unless_cached(self, *args, **kwargs):
    """A decoder's forward: compiled as one graph for the update's calls (keyword arguments only,
    no KV cache, ``use_cache=False``); eager for everything else, e.g. decoding, whose cache the
    compiler would guard on, and a call that leaves ``use_cache`` to the config, which would build
    a cache inside the graph."""
    if not args and _cache_free(kwargs) and kwargs.get("use_cache") is False:
        return _compiled_forward(type(self), self._rftgym_compile_mode)(self, **kwargs)
    return type(self).forward(self, *args, **kwargs)


def _compile(decoder, layers, scope: str | None, mode: str = "default") -> str | None:
    """Route ``decoder``'s (or each layer's) cache-free calls through a compiled forward; the
    reason it cannot, or None. Switching scope undoes the other one; ``scope=None`` (or a compile
    that cannot work) undoes both, so a model set up again without compiling runs eagerly."""
    problem = None
    if scope is not None:
        problem = compile_works(next(decoder.parameters()).device.type)
        if problem is None and scope == "layers" and layers is None:
            problem = "the decoder has no .layers"
    if problem:
        scope = None
    if scope is not None:  # identical layers share one compiled graph; leave room in the guard cache anyway
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    for module, dispatch, wanted in [(decoder, _compiled_decoder_unless_cached, scope == "decoder"),
                                     *((layer, _compiled_unless_cached, scope == "layers") for layer in layers or [])]:
        routed = getattr(module.__dict__.get("forward"), "func", None) is dispatch
        if wanted and not routed:
            module.forward = functools.partial(dispatch, module)
        if wanted:
            module._rftgym_compile_mode = mode
        elif routed and not wanted:
            del module.forward
    return problem


def apply_training_speedups(model, speed: SpeedConfig | None = None) -> dict[str, str]:
    """Apply ``speed`` to ``model`` in place; return what was applied or skipped, and why."""
    speed = speed or SpeedConfig()
    base = _base(model)
    decoder = base.get_decoder()
    layers = getattr(decoder, "layers", None)
    report: dict[str, str] = {}
    if speed.causal_without_mask:
        if getattr(decoder, "_rftgym_mask_hook", None) is None:
            decoder._rftgym_attention = decoder.config._attn_implementation
            decoder._rftgym_full_causal = full_causal_attention(decoder.config)
            decoder._rftgym_mask_hook = decoder.register_forward_pre_hook(_drop_right_padding_mask, with_kwargs=True)
            decoder.register_forward_hook(_restore_attention, with_kwargs=True, always_call=True)
        report["causal_without_mask"] = "on"
    if speed.checkpoint_mlp:
        if layers is None or not all(hasattr(layer, "mlp") for layer in layers):
            report["checkpoint_mlp"] = "skipped: the decoder has no layers[i].mlp"
        else:
            for layer in layers:
                _checkpoint_mlp_class(type(layer.mlp))
                layer.mlp._rftgym_checkpointed = True
            report["checkpoint_mlp"] = "on"
    if speed.compile_layers:
        if speed.memory_budget is not None:
            torch._functorch.config.activation_memory_budget = speed.memory_budget
        problem = _compile(decoder, layers, speed.compile_scope, speed.compile_mode)
        name = "compile_decoder" if speed.compile_scope == "decoder" else "compile_layers"
        report[name] = f"skipped: {problem}" if problem else "on"
        if speed.compile_mode != "default" and not problem:
            report["compile_mode"] = speed.compile_mode
    else:
        _compile(decoder, layers, None)
    return report


def make_optimizer(parameters, *, lr: float, weight_decay: float = 0.0, fused: bool = True,
                   master_weights: bool = True) -> torch.optim.Optimizer:
    """AdamW over the trainable ``parameters``, fused into one kernel when they are all on CUDA;
    stepped on float32 master copies (:class:`~rftgym.train.master_weights.MasterWeights`) when
    some are 16-bit floats and ``master_weights`` is on."""
    parameters = [p for p in parameters if p.requires_grad]
    on_cuda = bool(parameters) and all(p.is_cuda for p in parameters)

    def adamw(params):
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=fused and on_cuda)

    if master_weights and needs_master_weights(parameters):
        return MasterWeights(parameters, adamw)
    return adamw(parameters)


# ---------------------------------------------------------------- accounting

def parameter_count(model) -> int:
    """Parameters of the model, tied weights counted once."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def update_flops(parameters: int, sequence_lengths: list[int], layers: int, attention_width: int, *,
                 head_parameters: int = 0, head_positions: int | None = None, lookup_parameters: int = 0) -> float:
    """Model FLOPs of one forward+backward over sequences of the given lengths::

        6 * (N - N_head - N_lookup) * sum(s)  +  6 * N_head * head_positions
            +  12 * layers * attention_width * sum(s^2)

    (dense matmuls, then QK^T and AV at full, non-causal cost as in PaLM's MFU; recomputation
    is not counted: MFU measures useful work). The update runs the output layer (``N_head =
    vocab x hidden`` parameters) only at trained positions (``head_positions``); by default it is
    counted at every token, as a plain forward pass would run it. ``N_lookup``: an input
    embedding that is not the output layer (an untied one), a table lookup that multiplies
    nothing; a tied one is the output layer, counted once in N (see :func:`flop_parameters`)."""
    tokens = sum(sequence_lengths)
    head_positions = tokens if head_positions is None else head_positions
    return (6.0 * (parameters - head_parameters - lookup_parameters) * tokens + 6.0 * head_parameters * head_positions
            + 12.0 * layers * attention_width * sum(s * s for s in sequence_lengths))


def flop_parameters(model) -> dict[str, int]:
    """:func:`update_flops`' parameter counts for a Hugging Face causal LM: ``parameters`` (tied
    weights once), ``head_parameters`` (the output layer) and ``lookup_parameters`` (the input
    embedding where it is not the output layer's weight, else 0)."""
    head = model.get_output_embeddings().weight
    embedding = model.get_input_embeddings().weight
    return {"parameters": parameter_count(model), "head_parameters": head.numel(),
            "lookup_parameters": 0 if embedding is head else embedding.numel()}
