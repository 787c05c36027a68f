"""A static-cache decode path for Llama-family models, replayed as one CUDA graph per step.

Plain ``transformers`` decoding of a small model is bound by kernel launches and Python (about
45 steps/s for SmolLM2-135M on an H200 whatever the batch size). This module runs prefill and
decode itself over the Hugging Face modules (their weights are used in place, never copied):

* one static KV cache per layer, ``[batch, kv_heads, max_len, head_dim]``, written at a slot index
  held in a device tensor, with an explicit boolean mask over cache slots (left padding, causal);
* per-row positions (left-padded rows start at 0), RoPE from the model's own rotary module
  (its ``inv_freq`` and ``attention_scaling``), so ``rope_theta`` and static scalings (linear,
  llama3, yarn) are honoured; length-dependent scalings (dynamic, longrope) are refused;
* one decode step = forward + temperature / top-k / top-p sampling + log-prob + stop bookkeeping,
  all on device with static shapes. On CUDA the step is captured once per (batch bucket, length
  bucket, sampling settings) as a CUDA graph and replayed; the host syncs only every
  ``sync_every`` steps to ask "all rows finished?". On CPU the same step function runs eagerly,
  which is what the tests check against the Hugging Face forward.

Sampling inverts the cumulative distribution of the (top-k / top-p filtered) probabilities at
one uniform draw per row and step; top-p's nucleus is taken over the top-k survivors renormalised,
as Hugging Face's ``TopKLogitsWarper`` then ``TopPLogitsWarper`` and vLLM do. The policy hands
every row's draws for the whole generation in before the loop (from its seeded generator, or
from each row's own keyed stream, :mod:`rftgym.agents.sampling_keys`), so seeded sampling is
reproducible, a row's tokens do not depend on the other rows, and the graph itself holds no
random-number state. Recorded log-probs are those of the untruncated
``log_softmax(logits / temperature)`` (not of the top-k / top-p renormalised distribution
sampled from), and of ``log_softmax(logits)`` when greedy, as in :mod:`rftgym.agents.hf_policy`.

A decoder runs one generation at a time: a generation's state (KV cache, buffers) and captured
graph are shared by every call of its shape, so concurrent calls from several threads take turns
on a lock (a GPU runs them one after another anyway).

Linear layers, norms and MLPs are called as modules, so a peft LoRA-wrapped model decodes
merge-free with its adapters. Captured graphs are keyed by the parameters' storage addresses
and the adapters' on/off state: moving or replacing weights recaptures; in-place optimizer
updates are seen by the graph as they are.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from ..core.errors import ConfigError
from .base import check_decoding_bounds, refuse_empty_prompts

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
# One CUDA graph capture at a time in the process: every capture runs on torch's one capture
# stream, so two decoders (two policies, or a policy and its copy) capturing on two threads would
# record into each other's graphs. A decoder's own lock covers only its own calls.
_CAPTURE_LOCK = threading.Lock()
# RoPE types whose frequencies do not depend on the sequence length: cos/sin follow from
# ``inv_freq`` and ``attention_scaling`` alone.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
_LAYER_PARTS = ("input_layernorm", "post_attention_layernorm", "self_attn", "mlp")
_ATTENTION_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj")
_EXTRA_ATTENTION_PARTS = ("q_norm", "k_norm")  # Qwen3/OLMo-style QK norms: another architecture


@dataclass(frozen=True)
class FastDecodeOptions:
    """How the fast path runs. ``graphs=None`` captures CUDA graphs on CUDA and runs eagerly elsewhere."""

    graphs: bool | None = None
    bucket: bool | None = None  # round batch and cache length up to buckets; None: when capturing graphs
    sync_every: int = 8  # decode steps between "all rows finished?" host checks
    length_bucket: int = 128  # cache lengths are rounded up to a multiple of this (graph reuse)
    max_graphs: int = 4  # captured (batch, length, sampling) variants kept; each holds its KV cache

    def __post_init__(self) -> None:
        if self.sync_every < 1:
            raise ConfigError(f"sync_every must be at least 1, got {self.sync_every}")
        if self.length_bucket < 1:
            raise ConfigError(f"length_bucket must be at least 1, got {self.length_bucket}")
        if self.max_graphs < 1:
            raise ConfigError(f"max_graphs must be at least 1, got {self.max_graphs}")


@dataclass(frozen=True)
class DecodeSettings:
    """The sampling settings a captured step bakes in (the subset of SamplingConfig it needs)."""

    max_new_tokens: int
    temperature: float
    top_k: int
    top_p: float

    def __post_init__(self) -> None:
        # The same bounds as SamplingConfig's, for callers of FastDecoder who make these directly.
        check_decoding_bounds(self)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _base_model(model):
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def unsupported_reason(model) -> str | None:
    """Why ``model`` cannot use the fast path, or None if it can."""
    base = _base_model(model)
    config = getattr(base, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        return f"model_type {model_type!r} is not one of {SUPPORTED_MODEL_TYPES}"
    decoder = getattr(base, "model", None)
    if decoder is None or not hasattr(decoder, "layers") or not hasattr(decoder, "embed_tokens"):
        return "the model has no .model.layers / .model.embed_tokens (not a standard *ForCausalLM)"
    if getattr(base, "lm_head", None) is None:
        return "the model has no lm_head"
    for name in ("final_logit_softcapping", "logits_scaling", "logit_scale"):
        if getattr(config, name, None) not in (None, 0, 1, 1.0):
            return f"the config sets {name}, which the fast path does not apply"
    rotary = getattr(decoder, "rotary_emb", None)
    if rotary is None or not hasattr(rotary, "inv_freq"):
        return "the model has no shared rotary embedding module with inv_freq"
    rope_type = getattr(rotary, "rope_type", "default")
    if rope_type not in STATIC_ROPE_TYPES:
        return f"RoPE type {rope_type!r} depends on the sequence length; only {STATIC_ROPE_TYPES} are supported"
    for index, layer in enumerate(decoder.layers):
        missing = [p for p in _LAYER_PARTS if not hasattr(layer, p)]
        missing += [p for p in _ATTENTION_PARTS if not hasattr(getattr(layer, "self_attn", None), p)]
        if missing:
            return f"decoder layer {index} lacks {missing}"
        extra = [p for p in _EXTRA_ATTENTION_PARTS if getattr(layer.self_attn, p, None) is not None]
        if extra:
            return f"decoder layer {index} has {extra}, which the fast path does not apply"
    return None


def active_window(config) -> int | None:
    """The sliding attention window a model config turns on (Mistral; Qwen2 and others only with
    ``use_sliding_window``), else None. The update's attention check uses the same rule
    (:func:`rftgym.train.speed.full_causal_attention`)."""
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return None
    return int(window)


def sliding_window(model) -> int | None:
    """The attention window of ``model`` when one is active, else None."""
    return active_window(_base_model(model).config)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def batch_bucket(batch: int) -> int:
    """Captured batch sizes: powers of two up to 64, then multiples of 64."""
    if batch <= 64:
        return 1 << (batch - 1).bit_length()
    return _round_up(batch, 64)


# ---------------------------------------------------------------- state


class DecodeState:
    """The static tensors one generation (and its captured graph) reads and writes in place."""

    def __init__(self, decoder: "FastDecoder", batch: int, max_len: int, settings: DecodeSettings,
                 stop_ids: Sequence[int], pad_id: int, cache_dtype: torch.dtype):
        device = decoder.device
        shape = (batch, decoder.kv_heads, max_len, decoder.head_dim)
        self.batch, self.max_len, self.settings, self.pad_id = batch, max_len, settings, pad_id
        self.keys = [torch.zeros(shape, dtype=cache_dtype, device=device) for _ in decoder.layers]
        self.values = [torch.zeros(shape, dtype=cache_dtype, device=device) for _ in decoder.layers]
        self.key_valid = torch.zeros((batch, max_len), dtype=torch.bool, device=device)
        self.slot_range = torch.arange(max_len, device=device)
        self.token = torch.full((batch,), pad_id, dtype=torch.long, device=device)
        self.position = torch.zeros(batch, dtype=torch.long, device=device)
        self.slot = torch.zeros(1, dtype=torch.long, device=device)  # cache slot of `token`
        self.step = torch.zeros(1, dtype=torch.long, device=device)  # column of the next sample
        n = settings.max_new_tokens
        self.sampled = torch.full((batch, n), pad_id, dtype=torch.long, device=device)
        self.logprobs = torch.zeros((batch, n), dtype=torch.float32, device=device)
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)
        self.finished = torch.zeros(batch, dtype=torch.bool, device=device)
        self.stopped = torch.zeros(batch, dtype=torch.bool, device=device)
        self.stop_ids = torch.tensor(list(stop_ids) or [-1], dtype=torch.long, device=device)
        # One uniform draw per row and step, loaded before each generation (greedy needs none).
        self.uniforms = None if settings.greedy else torch.zeros((batch, n), dtype=torch.float64, device=device)

    def reset(self, finished_rows: torch.Tensor) -> None:
        """Make the state ready for a new generation (in place: a captured graph keeps its pointers)."""
        for tensor in (*self.keys, *self.values):
            tensor.zero_()
        self.key_valid.zero_()
        self.token.fill_(self.pad_id)
        self.position.zero_()
        self.slot.zero_()
        self.step.zero_()
        self.sampled.fill_(self.pad_id)
        self.logprobs.zero_()
        self.lengths.zero_()
        self.finished.copy_(finished_rows)
        self.stopped.zero_()

    def load_uniforms(self, uniforms: torch.Tensor | None) -> None:
        """Take this generation's draws, ``[rows, max_new_tokens]`` (bucket filler rows keep theirs)."""
        if self.uniforms is None:
            return
        if uniforms is None or uniforms.shape[1] != self.uniforms.shape[1] or uniforms.shape[0] > self.batch:
            raise ValueError(f"sampling needs uniforms of shape [rows <= {self.batch}, {self.uniforms.shape[1]}], "
                             f"got {None if uniforms is None else tuple(uniforms.shape)}")
        self.uniforms[:uniforms.shape[0]].copy_(uniforms, non_blocking=True)

    def step_uniforms(self) -> torch.Tensor | None:
        """Each row's draw for the sample at ``step`` (a gather on device: no host sync)."""
        if self.uniforms is None:
            return None
        return self.uniforms.gather(1, self.step.expand(self.batch)[:, None]).squeeze(1)


# ---------------------------------------------------------------- sampling


def sample_tokens(logits: torch.Tensor, settings: DecodeSettings, uniforms: torch.Tensor | None):
    """One token per row and its log-prob under ``logits / temperature``, with static shapes.

    The log-prob is that of the untruncated ``log_softmax(logits / temperature)`` whatever top-k /
    top-p keep (``log_softmax(logits)`` when greedy), which is what the trainer recomputes.

    Sampling inverts the cumulative distribution: row i takes the first token whose cumulative
    probability exceeds ``uniforms[i] * total``, which draws exactly from
    ``softmax(filtered_logp)`` with one uniform per row, and needs no host-side ``multinomial``.
    Both decode paths sample here, so they agree token for token on the same draws.
    """
    temperature = settings.temperature if settings.temperature > 0 else 1.0
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    if settings.greedy:
        token = logp.argmax(dim=-1)
    else:
        token = inverse_cdf_sample(filter_logprobs(logp, settings.top_k, settings.top_p), uniforms)
    return token, logp.gather(-1, token[:, None]).squeeze(-1)


def inverse_cdf_sample(filtered_logp: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """The token of each row at its uniform draw ``u`` in [0, 1): the first index whose cumulative
    probability exceeds ``u * total``. Tokens filtered out (-inf) have probability 0 and so can
    never be that first index."""
    if uniforms is None or tuple(uniforms.shape) != tuple(filtered_logp.shape[:1]):
        raise ValueError(f"sampling {tuple(filtered_logp.shape)} log-probs needs one uniform per row, shape "
                         f"[{filtered_logp.shape[0]}], got {None if uniforms is None else tuple(uniforms.shape)}")
    # float64: a float32 running sum over a 50k vocabulary drifts by about 1e-5, which would
    # shift the odds of every token by as much. (Its cost is small next to the step's forward,
    # even on GPUs with slow float64.)
    probs = torch.softmax(filtered_logp.double(), dim=-1)
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:]
    # Strictly below the total, so that some index always qualifies.
    target = torch.minimum(uniforms.to(cdf.dtype)[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    token = torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp(max=cdf.shape[-1] - 1)
    # A parallel scan (CUDA) may round two equal prefixes apart by an ulp; never return a token of
    # probability 0 because of it.
    return torch.where(probs.gather(-1, token[:, None]).squeeze(-1) > 0, token, probs.argmax(dim=-1))


def filter_logprobs(logp: torch.Tensor, top_k: int | None, top_p: float) -> torch.Tensor:
    """``logp`` with the tokens outside top-k and outside the top-p nucleus set to -inf (static
    shapes, no host sync: usable inside a CUDA graph). Both decode paths sample from this.

    Top-k first (ties with the k-th value stay), then top-p over what top-k left, renormalised:
    the order and arithmetic of Hugging Face's ``TopKLogitsWarper`` + ``TopPLogitsWarper`` and of
    vLLM. The result is not renormalised (sampling is: :func:`inverse_cdf_sample`)."""
    filtered = logp
    if top_k:
        kth = torch.topk(filtered, min(top_k, filtered.shape[-1]), dim=-1).values[:, -1:]
        filtered = filtered.masked_fill(filtered < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logp, sorted_index = torch.sort(filtered, descending=True, dim=-1)
        # softmax, not exp: the nucleus holds top_p of the mass top-k left, not of the whole vocabulary.
        probs = torch.softmax(sorted_logp, dim=-1)
        # Drop a token when the mass before it already reaches top_p (keeps at least one).
        drop_sorted = (probs.cumsum(dim=-1) - probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, sorted_index, drop_sorted)
        filtered = filtered.masked_fill(drop, float("-inf"))
    return filtered


def record_sample(state: DecodeState, token: torch.Tensor, token_logprob: torch.Tensor) -> None:
    """Write step ``state.step``'s sample and advance, exactly as the generic loop's bookkeeping."""
    active = ~state.finished
    fed = torch.where(active, token, torch.full_like(token, state.pad_id))
    column = state.step.expand(state.batch)[:, None]
    state.sampled.scatter_(1, column, fed[:, None])
    state.logprobs.scatter_(1, column, torch.where(active, token_logprob, torch.zeros_like(token_logprob))[:, None])
    state.lengths.add_(active.long())
    # Not torch.isin: its sorting path calls unique(), which syncs with the host (no graph).
    hit_stop = active & (token[:, None] == state.stop_ids[None, :]).any(dim=-1)
    state.stopped.logical_or_(hit_stop)
    state.finished.logical_or_(hit_stop)
    state.token.copy_(fed)  # finished rows are fed padding, like the generic loop
    state.step.add_(1)
    state.position.add_(1)
    state.slot.add_(1)


# ---------------------------------------------------------------- the model


class FastDecoder:
    """Prefill and decode for one Llama-family model, reading its modules in place.

    Thread-safe: :meth:`generate` holds a lock for the whole call, because every call of one
    shape writes the same cached state and replays the same graph; concurrent calls take turns."""

    def __init__(self, model, options: FastDecodeOptions | None = None):
        reason = unsupported_reason(model)
        if reason is not None:
            raise ConfigError(f"the fast decode path does not support this model: {reason}; "
                              "use HFPolicy(..., fast_decode=False) for the generic loop")
        self.model = model
        self.options = options or FastDecodeOptions()
        base = _base_model(model)
        self.base = base
        self.embed = base.model.embed_tokens
        self.layers = list(base.model.layers)
        self.norm = base.model.norm
        self.lm_head = base.lm_head
        self.rotary = base.model.rotary_emb
        attention = self.layers[0].self_attn
        config = base.config
        self.head_dim = getattr(attention, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.vocab_size = self.lm_head.weight.shape[0]
        self.window = sliding_window(model)
        self._graphs: OrderedDict = OrderedDict()
        self._pool = None
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:
        # A lock cannot be copied or pickled, nor can captured graphs: a copy captures its own.
        state = self.__dict__.copy()
        state.update(_graphs=OrderedDict(), _pool=None, _lock=None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    def supports_length(self, length: int) -> bool:
        """Whether ``length`` tokens fit without a sliding window (which the fast path does not apply)."""
        return self.window is None or length <= self.window

    # .............................................................. forward

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype):
        # As the HF rotary module: float32 frequencies, scaled, then cast to the hidden dtype.
        inv_freq = self.rotary.inv_freq.to(device=positions.device, dtype=torch.float32)
        freqs = positions.float()[..., None] * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        scaling = getattr(self.rotary, "attention_scaling", 1.0)
        cos, sin = emb.cos() * scaling, emb.sin() * scaling
        return cos.to(dtype)[:, None], sin.to(dtype)[:, None]  # [B, 1, T, head_dim]

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    def _grouped_bias(self, mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The ``[B, 1, T, L]`` boolean mask as an additive bias for grouped queries, ``[B, 1, G*T, L]``,
        built once per forward rather than once per layer."""
        batch, _, length, slots = mask.shape
        groups = self.heads // self.kv_heads
        grouped = mask[:, :, None].expand(batch, 1, groups, length, slots).reshape(batch, 1, groups * length, slots)
        return torch.zeros(grouped.shape, dtype=dtype, device=mask.device).masked_fill_(~grouped, float("-inf"))

    def _attend(self, query, keys, values, bias):
        """Grouped-query attention without repeating K/V: the ``groups`` query heads that share a
        KV head become extra query rows of that head."""
        batch, heads, length, dim = query.shape
        groups = heads // self.kv_heads
        # The query takes the cache's dtype (casting the small query, never the whole cache).
        q = query.reshape(batch, self.kv_heads, groups * length, dim).to(keys.dtype)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=bias)
        return out.reshape(batch, heads, length, dim)

    def forward(self, state: DecodeState, ids: torch.Tensor, positions: torch.Tensor,
                slots: torch.Tensor) -> torch.Tensor:
        """Final hidden states of ``ids`` ``[B, T]`` at ``positions`` ``[B, T]``, whose K/V go to cache
        ``slots`` ``[T]``; each query attends to the valid slots up to its own (and always itself,
        so that padding queries never see an empty row, whose softmax would be NaN)."""
        batch, length = ids.shape
        hidden = self.embed(ids)
        cos, sin = self._rope(positions, hidden.dtype)
        earlier = state.slot_range[None, :] <= slots[:, None]  # [T, L]
        itself = state.slot_range[None, :] == slots[:, None]
        mask = (state.key_valid[:, None, :] & earlier[None]) | itself[None]  # [B, T, L]
        bias = self._grouped_bias(mask[:, None], state.keys[0].dtype)
        for index, layer in enumerate(self.layers):
            attention = layer.self_attn
            x = layer.input_layernorm(hidden)
            q = attention.q_proj(x).view(batch, length, -1, self.head_dim).transpose(1, 2)
            k = attention.k_proj(x).view(batch, length, -1, self.head_dim).transpose(1, 2)
            v = attention.v_proj(x).view(batch, length, -1, self.head_dim).transpose(1, 2)
            q, k = self._rotate(q, cos, sin), self._rotate(k, cos, sin)
            keys, values = state.keys[index], state.values[index]
            keys.index_copy_(2, slots, k.to(keys.dtype))
            values.index_copy_(2, slots, v.to(values.dtype))
            out = self._attend(q, keys, values, bias)
            out = out.transpose(1, 2).reshape(batch, length, -1)
            hidden = hidden + attention.o_proj(out)
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        return self.norm(hidden)

    def prefill(self, state: DecodeState, input_ids: torch.Tensor, attention: torch.Tensor,
                all_logits: bool = False) -> torch.Tensor:
        """Run left-padded prompts ``[B, W]`` into cache slots ``0..W-1``; return the last
        position's logits ``[B, V]`` (or every position's, ``[B, W, V]``)."""
        width = input_ids.shape[1]
        positions = (attention.long().cumsum(-1) - 1).clamp(min=0)
        state.key_valid[:, :width] = attention.bool()
        hidden = self.forward(state, input_ids, positions, state.slot_range[:width])
        state.position.copy_(positions[:, -1])
        state.slot.fill_(width - 1)
        return self.lm_head(hidden if all_logits else hidden[:, -1])

    def decode_logits(self, state: DecodeState) -> torch.Tensor:
        """Feed ``state.token`` at the next slot/position; return its logits ``[B, V]``."""
        state.key_valid.index_fill_(1, state.slot, True)
        hidden = self.forward(state, state.token[:, None], state.position[:, None], state.slot)
        return self.lm_head(hidden[:, -1])

    def decode_step(self, state: DecodeState) -> None:
        """One whole decode step on device: forward, sample, log-prob, stop bookkeeping."""
        logits = self.decode_logits(state)
        token, token_logprob = sample_tokens(logits, state.settings, state.step_uniforms())
        record_sample(state, token, token_logprob)

    # .............................................................. generation

    def generate(self, prompts: Sequence[Sequence[int]], settings: DecodeSettings, *, stop_ids: Sequence[int],
                 pad_id: int, uniforms: torch.Tensor | None = None):
        """Sample for left-padded ``prompts``; return CPU tensors ``(sampled [B, N], logprobs [B, N],
        lengths [B], stopped [B])`` with the generic loop's contract. ``uniforms`` (``[B, N]`` in
        [0, 1), not needed when greedy) are each row's draws, one per new token. No prompts give
        empty results; an empty prompt is refused (there is nothing to condition the first token on).
        One call at a time runs (a lock): concurrent calls from threads wait their turn."""
        refuse_empty_prompts(prompts)
        if not prompts:
            n = settings.max_new_tokens
            return (torch.zeros((0, n), dtype=torch.long), torch.zeros((0, n), dtype=torch.float32),
                    torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.bool))
        if not settings.greedy and (uniforms is None or tuple(uniforms.shape) != (len(prompts),
                                                                                   settings.max_new_tokens)):
            raise ValueError(f"sampling {len(prompts)} prompts for {settings.max_new_tokens} new tokens needs "
                             f"uniforms of shape [{len(prompts)}, {settings.max_new_tokens}], got "
                             f"{None if uniforms is None else tuple(uniforms.shape)}")
        device = self.device
        graphs = self.options.graphs if self.options.graphs is not None else device.type == "cuda"
        real = len(prompts)
        width = max(len(p) for p in prompts)
        need = width + settings.max_new_tokens
        bucket = self.options.bucket if self.options.bucket is not None else graphs
        batch = batch_bucket(real) if bucket else real
        max_len = _round_up(need, self.options.length_bucket) if bucket else need
        input_ids = torch.full((batch, width), pad_id, dtype=torch.long)
        attention = torch.zeros((batch, width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            input_ids[row, width - len(prompt):] = torch.tensor(list(prompt), dtype=torch.long)
            attention[row, width - len(prompt):] = 1
        attention[real:, -1] = 1  # bucket filler rows: one pad token, finished from the start
        finished_rows = (torch.arange(batch) >= real).to(device)
        # Streams and graph capture use the current CUDA device: make it the model's (a single
        # process may run on cuda:1 without ever setting the current device).
        # inference_mode here too: the cached state is made of inference tensors, which a call
        # outside that mode could not update in place.
        on_device = torch.cuda.device(device) if device.type == "cuda" else nullcontext()
        with self._lock:
            with torch.inference_mode(), on_device:
                results = self._decode(input_ids, attention, finished_rows, real, max_len, settings, stop_ids,
                                       pad_id, graphs, uniforms)
            # Copies, under the lock (the next call of this shape overwrites the state in place; on
            # a CPU .cpu() would return views) and outside inference mode, so that they are plain
            # tensors a caller may change in place, like the generic loop's.
            return tuple(t.to("cpu", copy=True) for t in results)

    def _decode(self, input_ids, attention, finished_rows, real, max_len, settings, stop_ids, pad_id, graphs,
                uniforms):
        """:meth:`generate` once its batch is laid out (on the model's current CUDA device)."""
        device, batch = self.device, len(finished_rows)
        entry = self._entry(batch, max_len, settings, stop_ids, pad_id, graphs)
        state, graph = entry["state"], entry["graph"]
        state.reset(finished_rows)
        state.load_uniforms(None if uniforms is None else uniforms.to(device))
        with self._autocast_for_capture():
            logits = self.prefill(state, input_ids.to(device), attention.to(device))
            record_sample(state, *sample_tokens(logits, settings, state.step_uniforms()))
            for step in range(1, settings.max_new_tokens):
                if step % self.options.sync_every == 0 and bool(state.finished.all()):
                    break
                if graph is not None:
                    graph.replay()
                else:
                    self.decode_step(state)
        return tuple(t[:real] for t in (state.sampled, state.logprobs, state.lengths, state.stopped))

    # .............................................................. graph cache

    def _compute_dtype(self) -> torch.dtype:
        device_type = self.device.type
        if torch.is_autocast_enabled(device_type):
            return torch.get_autocast_dtype(device_type)
        return self.lm_head.weight.dtype

    def _autocast_for_capture(self):
        """Re-enter the caller's autocast (if any) with its weight cache off: a graph must not
        capture casts into a cache that is freed when the autocast region ends."""
        device_type = self.device.type
        if not torch.is_autocast_enabled(device_type):
            return nullcontext()
        return torch.autocast(device_type, dtype=torch.get_autocast_dtype(device_type), cache_enabled=False)

    def _weights_key(self) -> tuple:
        # Storage addresses (a move or a new tensor recaptures) and LoRA on/off states.
        pointers = tuple(p.data_ptr() for p in self.model.parameters())
        adapters = tuple((getattr(m, "disable_adapters", None), getattr(m, "merged", None),
                          tuple(getattr(m, "active_adapters", ()) or ()))
                         for m in self.model.modules() if hasattr(m, "active_adapters") and hasattr(m, "merged"))
        return pointers, adapters

    def _entry(self, batch, max_len, settings, stop_ids, pad_id, graphs) -> dict:
        dtype = self._compute_dtype()
        key = (batch, max_len, settings, tuple(stop_ids), pad_id, dtype, graphs)
        weights = self._weights_key() if graphs else None
        entry = self._graphs.get(key)
        if entry is not None and entry["weights"] == weights:
            self._graphs.move_to_end(key)
            return entry
        if entry is not None:
            del self._graphs[key]
        while len(self._graphs) >= self.options.max_graphs:
            self._graphs.popitem(last=False)
        state = DecodeState(self, batch, max_len, settings, stop_ids, pad_id, dtype)
        # With one new token there is no decode step to replay.
        graph = self._capture(state) if graphs and settings.max_new_tokens > 1 else None
        entry = {"state": state, "graph": graph, "weights": weights}
        self._graphs[key] = entry
        return entry

    def _capture(self, state: DecodeState):
        """Capture one decode step. Warm-up runs first on a side stream (cuBLAS and lazy inits
        must not happen during capture); the state is reset before real use."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        state.reset(torch.zeros(state.batch, dtype=torch.bool, device=self.device))
        state.key_valid[:, 0] = True
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), self._autocast_for_capture():
            for _ in range(2):
                self.decode_step(state)
                state.step.zero_()  # stay inside the sampled buffer however short it is
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # "thread_local": only this thread's calls may not break the capture. Under the default
        # ("global") another thread's CUDA work at that moment, e.g. a retriever embedding its
        # queries on the same device or a second policy's generation (replaying its graphs),
        # would fail the capture.
        with _CAPTURE_LOCK, self._autocast_for_capture(), \
                torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            self.decode_step(state)
        return graph
