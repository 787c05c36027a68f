"""Prefix KV reuse: the key/value states of token sequences the model already ran, kept for
prompts that begin with them.

A multi-turn episode's next prompt is its last prompt, the sampled reply (its exact tokens,
DESIGN.md section 2) and the env's observation, so all but the newest turn's tokens were already
run through the model. Prefilling them again is most of the work on a CPU (a 600-token prompt
costs the 135M default model as much as ~150 decode steps at batch 16). :class:`PrefixKVCache`
keeps, per reply, the keys and values of its prompt and sampled tokens; a later prompt that
shares a prefix with one of them is prefilled from the end of that prefix only. Episodes that open
with the same system prompt share that part too (the longest common prefix counts, not only a
whole entry).

The states are valid only for the weights that computed them: every lookup passes the model's
:func:`weights_fingerprint`, and a change (an optimizer step, new weights loaded, the model moved)
empties the cache. What the fingerprint cannot see (LoRA adapters switched off by a flag) calls
for :meth:`PrefixKVCache.clear`.

Reused states are the same numbers a full prefill computes, up to the last bits that a batch's
composition can change (as with any batched decoding); the trainer recomputes log-probs anyway.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

import torch

# A shorter shared prefix is not worth gathering: padding the batch's cached part to the longest
# reused prefix costs about as much as prefilling a few tokens.
MIN_REUSE_TOKENS = 16


@dataclass
class PrefixEntry:
    """The states of ``ids`` run through the model: per layer ``[kv_heads, len(ids), head_dim]``."""

    ids: torch.Tensor  # int64, on the CPU
    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))


@dataclass
class PrefixCacheStats:
    """Prompt tokens whose states were reused, and prompt tokens the model ran, since creation."""

    reused_tokens: int = 0
    prefilled_tokens: int = 0

    @property
    def reuse_rate(self) -> float:
        total = self.reused_tokens + self.prefilled_tokens
        return self.reused_tokens / total if total else 0.0


class PrefixKVCache:
    """Least-recently-used entries within ``budget_bytes``; thread-safe."""

    def __init__(self, budget_bytes: int, min_reuse: int = MIN_REUSE_TOKENS):
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be 0 (no cache) or more, got {budget_bytes}")
        self.budget_bytes = int(budget_bytes)
        self.min_reuse = max(1, int(min_reuse))
        self.stats = PrefixCacheStats()
        self._entries: OrderedDict[int, PrefixEntry] = OrderedDict()
        self._bytes = 0
        self._next_key = 0
        self._fingerprint: object = None
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0

    def check_weights(self, fingerprint: object) -> None:
        """Empty the cache when the weights it was computed with changed."""
        with self._lock:
            if fingerprint != self._fingerprint:
                self._entries.clear()
                self._bytes = 0
                self._fingerprint = fingerprint

    def lookup(self, prompt: Sequence[int]) -> tuple[PrefixEntry | None, int]:
        """The entry sharing the longest prefix with ``prompt`` and that prefix's length, at most
        ``len(prompt) - 1`` (the model must run the last token to give the next one's logits);
        ``(None, 0)`` when no entry shares ``min_reuse`` tokens."""
        limit = len(prompt) - 1
        if limit < self.min_reuse or not self._entries:
            return None, 0
        wanted = torch.as_tensor(list(prompt[:limit]), dtype=torch.long)
        best, best_length = None, 0
        with self._lock:
            for entry in reversed(self._entries.values()):  # the newest first: ties go to it
                length = _common_prefix(entry.ids, wanted)
                if length > best_length:
                    best, best_length = entry, length
            if best is None or best_length < self.min_reuse:
                return None, 0
            self._touch(best)
        return best, best_length

    def store(self, entry: PrefixEntry) -> None:
        """Keep ``entry``, dropping entries that are prefixes of it (it holds their states too),
        then the least recently used ones past the budget. An entry that is itself the prefix of
        a kept one, or larger than the whole budget, is not kept."""
        size = entry.nbytes
        if size > self.budget_bytes or len(entry.ids) < self.min_reuse:
            return
        with self._lock:
            for key, kept in list(self._entries.items()):
                shorter = min(len(kept.ids), len(entry.ids))
                if _common_prefix(kept.ids, entry.ids[:shorter]) < shorter:
                    continue
                if len(kept.ids) >= len(entry.ids):
                    self._entries.move_to_end(key)
                    return
                self._bytes -= kept.nbytes
                del self._entries[key]
            self._entries[self._next_key] = entry
            self._next_key += 1
            self._bytes += size
            while self._bytes > self.budget_bytes:
                _, dropped = self._entries.popitem(last=False)
                self._bytes -= dropped.nbytes

    def _touch(self, entry: PrefixEntry) -> None:
        for key, kept in self._entries.items():
            if kept is entry:
                self._entries.move_to_end(key)
                return

    def __getstate__(self):  # a pickled policy (a worker's copy) starts with an empty cache
        return {"budget_bytes": self.budget_bytes, "min_reuse": self.min_reuse}

    def __setstate__(self, state):
        self.__init__(state["budget_bytes"], state["min_reuse"])


def _common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many leading ids ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    differ = torch.nonzero(a[:n] != b[:n])
    return int(differ[0, 0]) if len(differ) else n


def weights_fingerprint(model) -> tuple:
    """What changes when the model's weights do: each parameter's storage, version counter (every
    in-place update bumps it: optimizer steps, ``load_state_dict``), dtype and device, and the
    adapter switches peft keeps on its layers."""
    params = tuple((p.data_ptr(), p._version, p.dtype, p.device) for p in model.parameters())
    switches = tuple((getattr(m, "disable_adapters", None), getattr(m, "merged", None))
                     for m in model.modules() if hasattr(m, "disable_adapters"))
    return params, switches


def unsupported_reason(model) -> str | None:
    """Why prefix reuse cannot serve ``model`` (None if it can): reuse prefills behind a padded
    cached part, which needs full attention in every layer and a kernel that takes any padding
    mask."""
    config = getattr(model, "config", None)
    implementation = getattr(config, "_attn_implementation", None)
    if implementation not in (None, "sdpa", "eager"):
        return f"its attention implementation is {implementation!r} (prefix reuse needs 'sdpa' or 'eager')"
    layer_types = getattr(config, "layer_types", None)
    if layer_types and any(kind != "full_attention" for kind in layer_types):
        return "some of its layers are not full attention (sliding windows or recurrent layers)"
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return "it attends over a sliding window"
    return None


def cache_from_states(keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]):
    """A transformers ``DynamicCache`` holding ``keys``/``values`` (per layer ``[batch, heads,
    length, head_dim]``), to be passed to the model's forward as its past."""
    from transformers import DynamicCache

    return DynamicCache(ddp_cache_data=list(zip(keys, values)))


def layer_states(cache, batch: int) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """Each layer's keys and values in a model's output cache, or None when the cache is not a
    dynamic cache of ``batch`` rows whose every layer holds its whole past (what reuse needs)."""
    layers = getattr(cache, "layers", None)
    if layers is None or type(cache).__name__ != "DynamicCache":
        return None
    states = []
    for layer in layers:
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if type(layer).__name__ != "DynamicLayer" or not isinstance(keys, torch.Tensor) \
                or not isinstance(values, torch.Tensor) or keys.dim() != 4 or keys.shape[0] != batch:
            return None
        states.append((keys, values))
    return states or None
