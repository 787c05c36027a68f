"""Prefix KV reuse: the key/value states of token sequences the model already ran, kept for
prompts that begin with them.

A multi-turn episode's next prompt is its last prompt, the sampled reply (its exact tokens,
DESIGN.md section 2) and the env's observation, so all but the newest turn's tokens were already
run through the model. Prefilling them again is most of the work on a CPU (a 600-token prompt
costs the 135M default model as much as ~150 decode steps at batch 16). :class:`PrefixKVCache`
keeps, per reply, the keys and values of its prompt and sampled tokens; a later prompt that
shares a prefix with one of them is prefilled from the end of that prefix only. Episodes that open
with the same system prompt share that part too (the longest common prefix counts, not only a
whole entry). A reply that went on from reused states holds those states' blocks rather than a
copy, so memory grows with the tokens computed, not with the replies that begin with them.

The states are valid only for the weights that computed them: every generation passes the
model's :func:`weights_fingerprint`, and a change (an optimizer step, new weights loaded, the model
moved, peft adapters disabled or merged) empties the cache. What the fingerprint cannot see calls
for :meth:`PrefixKVCache.clear` (``HFPolicy.clear_prefix_cache``): writes through ``.data`` (they
bypass the version counter), peft's ``set_adapter``, weights that FSDP gathers into the same
buffers each time (the trainer clears the cache after each rollout for that reason).

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


@dataclass(frozen=True, eq=False)
class StateBlock:
    """The keys and values of consecutive tokens: per layer ``[kv_heads, tokens, head_dim]``."""

    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]

    @property
    def tokens(self) -> int:
        return self.keys[0].shape[1]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    def copy_of_first(self, tokens: int) -> "StateBlock":
        """A block of its own holding this block's first ``tokens`` tokens."""
        return StateBlock(tuple(k[:, :tokens].clone() for k in self.keys),
                          tuple(v[:, :tokens].clone() for v in self.values))


@dataclass(frozen=True, eq=False)
class PrefixEntry:
    """The states of ``ids`` run through the model, as a chain of blocks: each block and how many
    of its first tokens belong here, in order, ``len(ids)`` tokens in all.

    A reply that went on from a reused prefix keeps that prefix's blocks and adds one block of
    its own, so a GRPO group's prompt, or an episode's earlier turns, are held once however many
    replies begin with them."""

    ids: torch.Tensor  # int64, on the CPU
    blocks: tuple[tuple[StateBlock, int], ...]

    @classmethod
    def of_states(cls, ids: torch.Tensor, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> "PrefixEntry":
        """An entry of one block: ``keys``/``values`` per layer ``[kv_heads, len(ids), head_dim]``,
        tensors of their own (the budget counts their elements; a view would keep more alive)."""
        block = StateBlock(tuple(keys), tuple(values))
        return cls(ids, ((block, block.tokens),))

    def extended(self, reused: int, ids: torch.Tensor, block: StateBlock) -> "PrefixEntry":
        """The entry of ``ids``: this entry's first ``reused`` tokens (sharing their blocks), then
        ``block``'s tokens. A last shared block used for less than half its tokens is copied
        instead: held whole, the rest of it would stay in memory, beyond reach of any lookup,
        once this entry's other holders are gone."""
        kept = list(self._first(reused))
        if kept and kept[-1][1] * 2 < kept[-1][0].tokens:
            part, used = kept[-1]
            kept[-1] = (part.copy_of_first(used), used)
        return PrefixEntry(ids, (*kept, (block, block.tokens)))

    def pieces(self, which: str, layer: int, tokens: int) -> list[torch.Tensor]:
        """One layer's ``"keys"`` or ``"values"`` of the first ``tokens`` tokens, block by block."""
        return [getattr(block, which)[layer][:, :used] for block, used in self._first(tokens)]

    @property
    def layers(self) -> int:
        return len(self.blocks[0][0].keys)

    @property
    def nbytes(self) -> int:
        """The bytes its blocks hold (whole, though it may use only the last one's beginning)."""
        return sum(block.nbytes for block, _ in self.blocks)

    def _first(self, tokens: int) -> tuple[tuple[StateBlock, int], ...]:
        if tokens > len(self.ids):
            raise ValueError(f"the entry holds {len(self.ids)} tokens' states, {tokens} were asked for")
        kept = []
        for block, used in self.blocks:
            if tokens <= 0:
                break
            kept.append((block, min(used, tokens)))
            tokens -= used
        return tuple(kept)


@dataclass
class PrefixCacheStats:
    """Since creation: the prompt tokens replies were asked for, the tokens the model ran to
    prefill them (shared prefixes run once included), and the bytes of states dropped to stay
    within the budget (a later prompt prefills again what no kept entry covers: a budget too
    small for a rollout's episodes shows here)."""

    prompt_tokens: int = 0
    prefilled_tokens: int = 0
    evicted_bytes: int = 0

    @property
    def saved_share(self) -> float:
        """The share of prompt tokens whose states were not computed again."""
        return 1.0 - self.prefilled_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class PrefixKVCache:
    """Least-recently-used entries within ``budget_bytes``, for one set of weights; thread-safe.

    Entries are filed by their first ``min_reuse`` ids: a prompt can only reuse an entry that
    begins as it does, so a lookup compares it with those alone. The budget counts each block
    once, however many entries share it; dropping an entry frees the blocks no other kept entry
    holds."""

    def __init__(self, budget_bytes: int, min_reuse: int = MIN_REUSE_TOKENS):
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be 0 (no cache) or more, got {budget_bytes}")
        self.budget_bytes = int(budget_bytes)
        self.min_reuse = max(1, int(min_reuse))
        self.stats = PrefixCacheStats()
        self._entries: OrderedDict[int, PrefixEntry] = OrderedDict()  # by key, least recently used first
        self._by_start: dict[tuple[int, ...], dict[int, PrefixEntry]] = {}
        self._blocks: dict[int, list] = {}  # id(block): [block, how many kept entries hold it]
        self._bytes = 0
        self._next_key = 0
        self._fingerprint: object = None
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        """The bytes the kept entries' blocks hold, each block once."""
        return self._bytes

    def entries(self) -> list[PrefixEntry]:
        """The kept entries, least recently used first."""
        with self._lock:
            return list(self._entries.values())

    def clear(self) -> None:
        with self._lock:
            self._clear()

    def _clear(self) -> None:
        self._entries.clear()
        self._by_start.clear()
        self._blocks.clear()
        self._bytes = 0

    def check_weights(self, fingerprint: object) -> None:
        """Empty the cache when the weights it was computed with changed; :meth:`store` keeps
        only states computed with ``fingerprint``'s weights from now on."""
        with self._lock:
            if fingerprint != self._fingerprint:
                self._clear()
                self._fingerprint = fingerprint

    def count(self, prompt_tokens: int = 0, prefilled_tokens: int = 0) -> None:
        with self._lock:
            self.stats.prompt_tokens += prompt_tokens
            self.stats.prefilled_tokens += prefilled_tokens

    def lookup(self, prompt: Sequence[int]) -> tuple[PrefixEntry | None, int]:
        """The entry sharing the longest prefix with ``prompt`` and that prefix's length, at most
        ``len(prompt) - 1`` (the model must run the last token to give the next one's logits);
        ``(None, 0)`` when no entry shares ``min_reuse`` tokens."""
        limit = len(prompt) - 1
        if limit < self.min_reuse:
            return None, 0
        start = tuple(prompt[:self.min_reuse])
        with self._lock:
            candidates = self._by_start.get(start)
            if not candidates:
                return None, 0
            key, length = _longest_match(candidates.items(), prompt[:limit])
            self._entries.move_to_end(key)
            return candidates[key], length

    def store(self, entry: PrefixEntry, fingerprint: object) -> None:
        """Keep ``entry``, computed with the weights of ``fingerprint`` (not kept if those are no
        longer the cache's), dropping entries that are prefixes of it (it holds their states too),
        then the least recently used ones past the budget. An entry that is itself the prefix of a
        kept one, or whose blocks alone are larger than the whole budget, is not kept."""
        size = entry.nbytes
        if size > self.budget_bytes or len(entry.ids) < self.min_reuse:
            return
        start = tuple(entry.ids[:self.min_reuse].tolist())
        with self._lock:
            if fingerprint != self._fingerprint:
                return
            bucket = self._by_start.setdefault(start, {})
            for key, kept in list(bucket.items()):
                shorter = min(len(kept.ids), len(entry.ids))
                if _common_prefix(kept.ids, entry.ids) < shorter:
                    continue
                if len(kept.ids) >= len(entry.ids):
                    self._entries.move_to_end(key)
                    return
                self._drop(key)
            key = self._next_key
            self._next_key += 1
            self._entries[key] = entry
            self._by_start.setdefault(start, {})[key] = entry
            for block, _ in entry.blocks:  # distinct: each entry adds a block of its own to its parent's
                held = self._blocks.setdefault(id(block), [block, 0])
                if held[1] == 0:
                    self._bytes += block.nbytes
                held[1] += 1
            while self._bytes > self.budget_bytes:
                self.stats.evicted_bytes += self._drop(next(iter(self._entries)))

    def _drop(self, key: int) -> int:
        """Forget the entry of ``key``; return the bytes that freed (its blocks no other entry holds)."""
        entry = self._entries.pop(key)
        freed = 0
        start = tuple(entry.ids[:self.min_reuse].tolist())
        bucket = self._by_start[start]
        del bucket[key]
        if not bucket:
            del self._by_start[start]
        for block, _ in entry.blocks:
            held = self._blocks[id(block)]
            held[1] -= 1
            if held[1] == 0:
                del self._blocks[id(block)]
                freed += block.nbytes
        self._bytes -= freed
        return freed

    def __getstate__(self):  # copied or pickled, a cache starts empty: its states belong to weights in memory
        return {"budget_bytes": self.budget_bytes, "min_reuse": self.min_reuse}

    def __setstate__(self, state):
        self.__init__(state["budget_bytes"], state["min_reuse"])


def shared_prefixes(prompts: Sequence[Sequence[int]], covered: Sequence[int], min_reuse: int) -> list[list[int]]:
    """The prefixes worth running once for a batch of ``prompts`` before the batch itself: for
    each prompt, the longest prefix it shares with another prompt of the batch (at most all but
    its last token), where that is ``min_reuse`` tokens more than the cache already ``covered``
    for it. A prefix that begins another one kept is dropped: running the longer one gives both.
    (A GRPO group's samples share their whole prompt; a benchmark's tasks, the env's system
    prompt.)"""
    # In sorted order, the prompt sharing the longest prefix with a prompt is next to it.
    order = sorted(range(len(prompts)), key=lambda i: list(prompts[i]))
    ids = [torch.as_tensor(list(prompts[i]), dtype=torch.long) for i in order]
    beside = [_common_prefix(a, b) for a, b in zip(ids, ids[1:])]
    wanted: set[tuple[int, ...]] = set()
    for place, i in enumerate(order):
        longest = max(beside[place - 1] if place else 0, beside[place] if place < len(beside) else 0)
        longest = min(longest, len(prompts[i]) - 1)
        if longest - covered[i] >= min_reuse:
            wanted.add(tuple(prompts[i][:longest]))
    kept = sorted(wanted, key=len, reverse=True)
    return [list(p) for n, p in enumerate(kept) if not any(q[:len(p)] == p for q in kept[:n])]


def best_of(batch_entries: Sequence[PrefixEntry], prompt: Sequence[int], cached: tuple[PrefixEntry | None, int],
            min_reuse: int) -> tuple[PrefixEntry | None, int]:
    """``cached`` (a :meth:`PrefixKVCache.lookup`), or the entry of ``batch_entries`` (states
    computed for this batch alone) sharing a longer prefix with ``prompt``, at most all but its
    last token and at least ``min_reuse``."""
    if not batch_entries or len(prompt) - 1 < min_reuse:
        return cached
    index, length = _longest_match(enumerate(batch_entries), prompt[:len(prompt) - 1])
    return (batch_entries[index], length) if length >= min_reuse and length > cached[1] else cached


def _longest_match(keyed_entries, wanted: Sequence[int]) -> tuple[object, int]:
    """The key of the entry sharing the longest prefix with ``wanted`` (the last of equals: the
    newest, as keys are given in the order entries were made) and its length."""
    wanted = torch.as_tensor(list(wanted), dtype=torch.long)
    best_key, best_length = None, -1
    for key, entry in keyed_entries:
        length = _common_prefix(entry.ids, wanted)
        if length >= best_length:
            best_key, best_length = key, length
    return best_key, best_length


def _common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many leading ids ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    differ = torch.nonzero(a[:n] != b[:n])
    return int(differ[0, 0]) if len(differ) else n


def weights_fingerprint(model) -> tuple:
    """What changes when the states the model computes do: each parameter's storage, version
    counter (every in-place update bumps it: optimizer steps, ``load_state_dict``), dtype and
    device, the adapter switches peft keeps on its layers, and autocast on the model's device (on
    or off, and its dtype: states cached under bfloat16 autocast, reused in a float32 pass, moved
    its log-probs by some 2e-2)."""
    params = tuple((p.data_ptr(), p._version, p.dtype, p.device) for p in model.parameters())
    switches = tuple((getattr(m, "disable_adapters", None), getattr(m, "merged", None))
                     for m in model.modules() if hasattr(m, "disable_adapters"))
    device = params[0][3].type if params else "cpu"
    autocast = (torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)) \
        if device in ("cpu", "cuda") else None
    return params, switches, autocast


def unsupported_reason(model) -> str | None:
    """Why prefix reuse cannot serve ``model`` (None if it can): reuse prefills behind a padded
    cached part, which needs full attention in every layer, a kernel that takes any padding mask,
    and rotary frequencies that do not depend on the sequence's length."""
    from .fast_decode import STATIC_ROPE_TYPES

    try:
        weights_fingerprint(model)
    except RuntimeError:  # inference tensors have no version counter
        return "its parameters were made under torch.inference_mode (no version counter tells when they change)"
    for module in model.modules():
        rope_type = getattr(module, "rope_type", None)
        if isinstance(rope_type, str) and rope_type not in STATIC_ROPE_TYPES:
            return f"its RoPE type {rope_type!r} depends on the sequence's length"
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
