"""HFPolicy: a local Hugging Face causal LM as an agent and as the trainable policy.

It renders contexts through the tokenizer's chat template with an exact-token cache
(:mod:`rftgym.agents.chat_tokens`), generates for many contexts at once (left padding, one
KV-cached decode loop, temperature / top-k / top-p sampling, stop at end of turn or at a stop string), and returns
for each reply the exact prompt tokens, sampled tokens and their log-probabilities.

On CUDA, Llama-family models decode through :mod:`rftgym.agents.fast_decode` (static KV cache,
one CUDA graph per decode step) with the same reply contract; ``HFPolicy(..., fast_decode=False)``
keeps the generic loop, which any causal LM can use.

With a seed, the replies the rollout engine asks for are keyed (:mod:`rftgym.agents.sampling_keys`):
each draws from a stream of its own, so an episode samples the same tokens whatever else shares
its batch (up to the last bits of the logits, which a batch's padding may change: see that
module). Direct calls without keys draw from the policy's one seeded generator, unless the call is
given a ``SamplingConfig`` with a seed of its own (not the policy's), which makes that call
reproducible.

Top-k and top-p filter as Hugging Face's ``TopKLogitsWarper`` then ``TopPLogitsWarper`` do (the
nucleus is taken over the top-k survivors, renormalised). The recorded log-probabilities are
those of the untruncated distribution, ``log_softmax(logits / temperature)``, not of the
renormalised one sampled from; greedy decoding records ``log_softmax(logits)`` (temperature 1).
The trainer recomputes them at the same temperature, so that importance ratios compare like with
like.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from ..core.errors import AgentError, ConfigError, require, warn_caller
from ..core.messages import Context, Message
from ..core.values import checked_megabytes, is_finite_real, is_int
from .base import CONTEXT_FULL, Agent, AgentReply, check_decoding_bounds, refuse_empty_prompts
from .chat_tokens import ChatTokenizer
from .sampling_keys import SampleKey, call_uniforms, keyed_uniforms
from .stop_strings import StopStrings, checked_stop_strings


# Enough for 16 episodes of ~1,400 tokens of the default model (46 KB of keys and values a token).
DEFAULT_PREFIX_CACHE_MB = 1024
MIN_TEMPERATURE = 1e-6  # logits divided by much less overflow float32 (1e-40 gives NaN probabilities)


@dataclass(frozen=True)
class SamplingConfig:
    """How :class:`HFPolicy` samples. Top-p is applied after top-k, over its survivors renormalised.
    Whatever the filters, a reply's ``logprobs`` are those of the untruncated
    ``log_softmax(logits / temperature)`` (of ``log_softmax(logits)`` when greedy)."""

    max_new_tokens: int = 256
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no top-k truncation
    # With a seed, sampling is reproducible; replies the rollout engine keys (each episode's turns)
    # then sample the same whatever else shares their batch. None: fresh randomness each run.
    # A config handed to one generate() call with a seed other than the policy's makes that call
    # reproducible on its own.
    seed: int | None = None
    max_batch_size: int = 32
    # The longest prompt the policy answers; None = whatever leaves room for a whole reply in the
    # model's context. A longer prompt gets a CONTEXT_FULL reply, which ends its episode.
    max_prompt_tokens: int | None = None
    # Strings that end a reply, besides the end of a turn: it keeps its tokens through the one that
    # completes the string (e.g. ("</search>",), so that the env's results follow a search, not the
    # model's guess at them). See rftgym.agents.stop_strings.
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", checked_stop_strings(self.stop))
        for name in ("max_batch_size", "max_prompt_tokens"):
            value = getattr(self, name)
            if not (value is None and name == "max_prompt_tokens") and not (is_int(value) and value >= 1):
                raise ConfigError(f"{name} must be an integer of at least 1, got {value!r}", field=name)
        check_decoding_bounds(self, MIN_TEMPERATURE)
        if self.greedy and (self.top_p != 1 or self.top_k != 0):  # as the CLI refuses --top-p with --temperature 0
            raise ConfigError(f"top_p={self.top_p!r} and top_k={self.top_k!r} are not read with temperature=0 (greedy "
                              "decoding takes the most likely token): leave them at 1.0 and 0, or sample with a "
                              "temperature above 0", field=("top_p", "top_k"))
        if self.seed is not None and not (is_int(self.seed) and 0 <= self.seed < 2**63):
            raise ConfigError(f"seed must be None or an integer in [0, 2^63), got {self.seed!r}", field="seed")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class HFPolicy(Agent):
    """A transformers causal LM that acts on batches of contexts and records exact tokens."""

    def __init__(self, model, tokenizer, sampling: SamplingConfig | None = None, name: str = "hf",
                 fast_decode: bool | None = None, prefix_cache_mb: float = DEFAULT_PREFIX_CACHE_MB):
        """``fast_decode``: None (default) uses :mod:`rftgym.agents.fast_decode` (static KV cache,
        one CUDA graph per decode step) on CUDA when the model qualifies; True also uses it,
        eagerly, on CPU; False always uses the generic transformers loop.

        ``prefix_cache_mb``: memory for the generic loop's prefix reuse
        (:mod:`rftgym.agents.prefix_cache`): a prompt that begins with tokens an earlier reply
        already ran (its episode's last turn, a shared system prompt) is prefilled from where they
        end. 0 turns it off."""
        self.torch = require("torch", "hf", "The Hugging Face policy")
        self._prefix_support: tuple | None = None  # (model it was checked for, reason it cannot serve it or None)
        self.set_prefix_cache_mb(prefix_cache_mb)
        self.fast_decode = fast_decode
        self._fast: tuple | None = None  # (model it was built for, FastDecoder or None, reason)
        # Threads whose first generations meet must build one decoder, not one each (each would
        # hold its own static caches and CUDA graphs, and all but the last would be dropped mid-use).
        self._fast_lock = threading.Lock()
        # The generations under way (threads may share the policy) and whether the first of them
        # found the model in train mode, which the last one gives back (_evaluating).
        self._mode_lock = threading.Lock()
        self._generating = 0
        self._was_training = False
        self.model = model
        self.tokenizer = tokenizer
        # The model's own generation config may name more end-of-turn tokens (as generate() reads it).
        generation_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        self.chat = ChatTokenizer(tokenizer, extra_stop_ids=generation_eos if isinstance(generation_eos, list)
                                  else [generation_eos] if generation_eos is not None else [])
        embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        rows = getattr(embeddings, "num_embeddings", None)
        if isinstance(rows, int) and len(tokenizer) > rows:
            raise ConfigError(f"the tokenizer has {len(tokenizer)} tokens and the model's embeddings {rows} rows, so "
                              "some token ids have no embedding (tokens added without model.resize_token_embeddings"
                              "?); resize the embeddings and train them, or use the tokenizer the model was made with")
        self.sampling = sampling or SamplingConfig()
        self.name = name
        # The model directory it was loaded from (from_pretrained), while its weights are that
        # directory's (training in place clears it).
        self.source_dir: str | None = None
        self.trained_in: str | None = None  # the output directory of the run that last trained it in place
        self.default_model = False  # loaded as the default model (from_pretrained(None)), untrained since
        self._warned_context_full = False
        self._warned_prompt_cap = False
        pad = tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else self.chat.stop_ids[0]
        self._cache_kwarg = _cache_kwarg(model)
        self._generator = self.torch.Generator(device=self.device)
        if self.sampling.seed is not None:
            self._generator.manual_seed(self.sampling.seed)
        else:  # a new Generator starts from one fixed seed: "no seed" must not mean the same samples each run
            self._generator.seed()

    def _sampling_generator(self):
        # The model may have moved (e.g. to a GPU) since construction; keep the seed stream.
        if not _same_device(self._generator.device, self.device):
            state_seed = int(self.torch.randint(0, 2**62, (1,), generator=self._generator,
                                                device=self._generator.device))
            self._generator = self.torch.Generator(device=self.device).manual_seed(state_seed)
        return self._generator

    @classmethod
    def from_pretrained(cls, model: str | None = None, *, sampling: SamplingConfig | None = None,
                        device: str | None = None, dtype: str | None = None,
                        prefix_cache_mb: float = DEFAULT_PREFIX_CACHE_MB) -> "HFPolicy":
        """Load ``model`` (a local HF directory, or None/"default" for SmolLM2-135M-Instruct) on
        ``device`` (None: cuda if available, else cpu) in ``dtype`` (a name, "bfloat16", or a
        torch dtype; None: bfloat16 on CUDA, else float32)."""
        from .model_loading import DEFAULT_MODEL_NAME, load_model_and_tokenizer

        lm, tokenizer = load_model_and_tokenizer(model, device=device, dtype=dtype)
        name = DEFAULT_MODEL_NAME if model in (None, "default") else str(model)
        policy = cls(lm, tokenizer, sampling=sampling, name=name, prefix_cache_mb=prefix_cache_mb)
        if model not in (None, "default") and Path(model).expanduser().is_dir():
            policy.source_dir = str(Path(model).expanduser().resolve())
        policy.default_model = model in (None, "default")  # (a run of it names its base: the default model)
        return policy

    @property
    def device(self):
        return next(self.model.parameters()).device

    # ------------------------------------------------------------------ Agent API

    token_level = True
    keyed_sampling = True

    def act(self, contexts: Sequence[Context], *, sample_keys: Sequence[SampleKey] | None = None) -> list[AgentReply]:
        if isinstance(contexts, Context):  # iterating it would give its messages
            raise TypeError("act takes a list of contexts; wrap one in a list: act([context])")
        # (the policy's own tokenizer made these ids: __init__ checked that each has an embedding)
        return self._generate([self.chat.prompt_ids(c) for c in contexts], None, sample_keys)

    def __reduce__(self):
        # A model on a device, its caches and CUDA graphs: not a thing to pickle or deepcopy.
        raise TypeError("an HFPolicy cannot be pickled or copied (it holds a model on a device and its decode caches); "
                        "save the model with policy.model.save_pretrained(DIR) and policy.tokenizer.save_pretrained(DIR), "
                        "and make another with HFPolicy.from_pretrained(DIR)" + (
                            f" (it was LoRA-trained by the run in {self.trained_in}: rftgym export "
                            f"{self.trained_in} DIR saves its merged model)"
                            if self.trained_in and getattr(self.model, "peft_config", None) else ""))

    def act_tokens(self, contexts: Sequence[Context], sampled_spans: Sequence[Mapping[str, Sequence[int]]], *,
                   sample_keys: Sequence[SampleKey] | None = None) -> list[AgentReply]:
        return self.generate([self.chat.prompt_ids(c, spans) for c, spans in zip(contexts, sampled_spans, strict=True)],
                             sample_keys=sample_keys)

    def assistant_span(self, message: Message, reply: AgentReply) -> tuple[int, ...] | None:
        if reply.sampled_ids is None:
            return None
        if self.chat.decode_reply(reply.sampled_ids) != message.content:
            # Another agent (a wrapper) changed the text and kept these tokens: they are not what
            # the message says, so the next prompt renders the text as it stands (the rollout
            # engine warns of tokens left unbound).
            return None
        return self.chat.assistant_span(message, reply.sampled_ids)

    # ------------------------------------------------------------------ generation

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig | None = None, *,
                 sample_keys: Sequence[SampleKey] | None = None) -> list[AgentReply]:
        """Generate one reply per prompt (token ids), batching up to ``max_batch_size``.

        Prompts are grouped by length so that a batch wastes little on padding; replies come
        back in the order of ``prompts``.

        ``sample_keys`` (one per prompt): with a seed, each reply samples from the stream of
        ``(seed, key)`` alone, the same in any batch. Without keys: given ``sampling`` with a seed
        other than the policy's, reply i draws from the stream of ``(seed, i)``, so the call gives
        the same tokens each time it is made with that seed; otherwise (the policy's seed, or none) every reply
        draws from the policy's one generator, in the order of ``prompts`` (seeded by the policy's
        seed: a run replays as a whole, and successive calls sample afresh).

        An empty prompt is refused with a ValueError (nothing to condition the first token on; a
        context's prompt ends with the template's generation prompt); no prompts give no replies.

        A prompt longer than :meth:`prompt_limit` is not generated for: its reply is empty with
        finish reason ``CONTEXT_FULL`` (the episode cannot go on, which is the episode's fate, not
        an error of the run).
        """
        refuse_empty_prompts(prompts)
        self._refuse_unknown_ids(prompts)
        return self._generate(prompts, sampling, sample_keys)

    def _generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig | None,
                  sample_keys: Sequence[SampleKey] | None) -> list[AgentReply]:
        """:meth:`generate` of prompts known to be non-empty and to hold only ids with embeddings."""
        # A seed of the call's own makes the call reproducible. The policy's seed is not one: a
        # config made from the policy's settings (dataclasses.replace(policy.sampling, ...)) in a
        # loop of calls must sample afresh each time, as without a config.
        own_seed = sampling is not None and sampling.seed is not None and sampling.seed != self.sampling.seed
        sampling = sampling or self.sampling
        limit = self.prompt_limit(sampling)
        replies: list[AgentReply | None] = [None] * len(prompts)
        for i, prompt in enumerate(prompts):
            if len(prompt) > limit:
                replies[i] = AgentReply(text="", finish_reason=CONTEXT_FULL)
        if any(r is not None for r in replies) and not self._warned_context_full:
            self._warned_context_full = True
            # At the user's line: a direct generate()/act(), or the run_episodes (or train) driving it.
            warn_caller(f"a prompt is longer than the policy answers ({limit} tokens: {self._limit_reason(sampling)}); "
                        "its episode ends there as truncated, with info context_full. Raise max_prompt_tokens if "
                        "set, give the env a context budget, fewer turns or shorter tool outputs, or ask for fewer "
                        "new tokens")
        uniforms = self._uniforms(sampling, len(prompts), sample_keys, own_seed)
        order = sorted((i for i in range(len(prompts)) if replies[i] is None), key=lambda i: len(prompts[i]))
        for start in range(0, len(order), sampling.max_batch_size):
            chunk = order[start:start + sampling.max_batch_size]
            rows = None if uniforms is None else uniforms[chunk]
            for index, reply in zip(chunk, self._generate_batch([list(prompts[i]) for i in chunk], sampling, rows)):
                replies[index] = reply
        return replies  # type: ignore[return-value]

    def _refuse_unknown_ids(self, prompts: Sequence[Sequence[int]]) -> None:
        """A ValueError naming the first token id the model has no embedding for (an IndexError deep
        in the model otherwise, or a device-side assert on a GPU)."""
        rows = getattr(self.model.get_input_embeddings(), "num_embeddings", None) or 2**63
        for i, prompt in enumerate(prompts):
            if min(prompt) >= 0 and max(prompt) < rows:  # (min and max run in C: a long prompt costs little)
                continue
            bad = next(t for t in prompt if not 0 <= t < rows)
            raise ValueError(f"prompt {i} of {len(prompts)} holds the token id {bad!r}, which the model has no "
                             f"embedding for (ids are ints in [0, {rows})); give ids from the policy's tokenizer "
                             "(policy.chat.prompt_ids(context))")

    def _uniforms(self, sampling: SamplingConfig, rows: int, keys: Sequence[SampleKey] | None,
                  call_seeded: bool = False):
        """Every reply's draws, ``[rows, max_new_tokens]`` float64 in [0, 1) (None when greedy):
        keyed streams (keys and a seed), the call's own streams (``call_seeded``: the call was
        given a seed), else the policy's generator.

        Drawn for every prompt, also one that gets no reply (CONTEXT_FULL), so that the generator's
        stream does not depend on which prompts fit."""
        if sampling.greedy:
            return None
        n = sampling.max_new_tokens
        if keys is not None:
            keys = list(keys)  # each checked where its stream is made
            if len(keys) != rows:
                raise ValueError(f"{len(keys)} sample keys for {rows} prompts; give one per prompt")
            if sampling.seed is not None:
                return self.torch.from_numpy(keyed_uniforms(sampling.seed, keys, n))
        if call_seeded:
            return self.torch.from_numpy(call_uniforms(sampling.seed, rows, n))
        generator = self._sampling_generator()
        return self.torch.rand((rows, n), dtype=self.torch.float64, generator=generator, device=generator.device)

    def prompt_limit(self, sampling: SamplingConfig | None = None) -> int:
        """The longest prompt the policy answers: room for ``max_new_tokens`` more in the model's
        context (``max_position_embeddings``), and at most ``max_prompt_tokens`` when that is set."""
        sampling = sampling or self.sampling
        context = self.context_length
        if context is not None and sampling.max_new_tokens >= context:
            raise ConfigError(f"max_new_tokens={sampling.max_new_tokens} does not fit the model's context of "
                              f"{context} tokens (max_position_embeddings); ask for fewer new tokens",
                              field="max_new_tokens")
        limits = [context - sampling.max_new_tokens] if context is not None else []
        if sampling.max_prompt_tokens is not None:
            limits.append(sampling.max_prompt_tokens)
            if limits[0] < sampling.max_prompt_tokens and not self._warned_prompt_cap:
                self._warned_prompt_cap = True
                warn_caller(f"max_prompt_tokens={sampling.max_prompt_tokens} is more than the model's context "
                            f"leaves ({context} - max_new_tokens {sampling.max_new_tokens} = {limits[0]}); prompts "
                            f"are capped at {limits[0]} tokens")
        return min(limits) if limits else sys.maxsize

    @property
    def context_length(self) -> int | None:
        """The model's context window in tokens, when its config states one."""
        context = getattr(self.model.config, "max_position_embeddings", None)
        return context if isinstance(context, int) and not isinstance(context, bool) else None

    def _limit_reason(self, sampling: SamplingConfig) -> str:
        reasons = []
        if self.context_length is not None:
            reasons.append(f"the model's context of {self.context_length} less max_new_tokens={sampling.max_new_tokens}")
        if sampling.max_prompt_tokens is not None:
            reasons.append(f"max_prompt_tokens={sampling.max_prompt_tokens}")
        return " and ".join(reasons)

    def _fast_decoder(self, length: int):
        """The fast decoder for the current model, or None when it is off or does not apply."""
        if self.fast_decode is False or (self.fast_decode is None and self.device.type != "cuda"):
            return None
        with self._fast_lock:
            if self._fast is None or self._fast[0] is not self.model:  # e.g. prepare_model wrapped it in LoRA
                from .fast_decode import FastDecoder, unsupported_reason

                reason = unsupported_reason(self.model)
                self._fast = (self.model, None if reason else FastDecoder(self.model), reason)
                if reason and self.fast_decode:
                    warn_caller(f"fast_decode=True but {reason}; using the generic decode loop")
            fast = self._fast[1]
        return fast if fast is not None and fast.supports_length(length) else None

    @property
    def prefix_cache_unused(self) -> str | None:
        """Why ``prefix_cache_mb`` changes nothing for this policy's model however it is set (None
        if it counts): the fast decoder takes the model (on CUDA, by default) and reuses no prefixes."""
        if self._fast_decoder(0) is None:
            return None
        return (f"the fast decoder serves {self.name} on {self.device.type} and reuses no prefixes (only the generic "
                "decode loop does: the default on CPU)")

    @property
    def fast_decode_reason(self) -> str | None:
        """Why the last generation did not use the fast path (None if it did or was not asked)."""
        return None if self._fast is None else self._fast[2]

    @contextlib.contextmanager
    def _evaluating(self):
        """The model in eval mode meanwhile: a model built in train mode (from_config, or handed
        over from a training loop) would sample and score with dropout, so that the recorded
        log-probs would not be the policy's and the samples would draw on torch's global RNG.
        Threads generating at once share it: the last to finish gives train mode back."""
        with self._mode_lock:
            if self._generating == 0:
                self._was_training = bool(getattr(self.model, "training", False))
                if self._was_training:
                    self.model.eval()
            self._generating += 1
        try:
            yield
        finally:
            with self._mode_lock:
                self._generating -= 1
                if self._generating == 0 and self._was_training:
                    self.model.train()

    def _generate_batch(self, prompts: list[list[int]], sampling: SamplingConfig, uniforms) -> list[AgentReply]:
        with self._evaluating():
            return self._generate_evaluating(prompts, sampling, uniforms)

    def _generate_evaluating(self, prompts: list[list[int]], sampling: SamplingConfig, uniforms) -> list[AgentReply]:
        width = max(len(p) for p in prompts)
        fast = self._fast_decoder(width + sampling.max_new_tokens)
        if fast is not None:
            from .fast_decode import DecodeSettings

            settings = DecodeSettings(sampling.max_new_tokens, sampling.temperature, sampling.top_k, sampling.top_p)
            sampled, logprobs, lengths, stopped = fast.generate(  # in inference mode itself
                prompts, settings, stop_ids=self.chat.stop_ids, pad_id=self.pad_id, uniforms=uniforms)
            if sampling.stop:  # cut afterwards: the tokens before a stop string are the same either way
                self._cut_at_stop_strings(StopStrings(sampling.stop, self.chat.decode_reply), sampled, lengths, stopped)
        else:
            sampled, logprobs, lengths, stopped = self._generic_decode(prompts, sampling, uniforms)
        return self._replies(prompts, sampled, logprobs, lengths, stopped)

    @staticmethod
    def _cut_at_stop_strings(stops: StopStrings, sampled, lengths, stopped) -> None:
        """End each row (``lengths``, ``stopped``; in place) at its first stop string."""
        for row in range(len(lengths)):
            keep = stops.cut(sampled[row, :int(lengths[row])].tolist())
            if keep is not None:
                lengths[row] = keep
                stopped[row] = True

    def _generic_decode(self, prompts: list[list[int]], sampling: SamplingConfig, uniforms=None):
        """The plain transformers loop (dynamic cache), for any causal LM; ``uniforms`` as for
        :meth:`_sample`, one column per step. Prompts that begin with tokens of an earlier reply
        are prefilled from where those end (:mod:`rftgym.agents.prefix_cache`)."""
        torch = self.torch
        device = self.device
        batch = len(prompts)
        stop_ids = torch.tensor(self.chat.stop_ids, device=device)
        uniforms = None if uniforms is None else uniforms.to(device)

        sampled = torch.zeros((batch, sampling.max_new_tokens), dtype=torch.long, device=device)
        logprobs = torch.zeros((batch, sampling.max_new_tokens), dtype=torch.float32, device=device)
        lengths = torch.zeros(batch, dtype=torch.long, device=device)
        finished = torch.zeros(batch, dtype=torch.bool, device=device)
        stopped = torch.zeros(batch, dtype=torch.bool, device=device)
        stops = StopStrings(sampling.stop, self.chat.decode_reply) if sampling.stop else None
        readers = [stops.reader() for _ in range(batch)] if stops else []  # each row's text so far
        replies = [[] for _ in range(batch)]  # each row's tokens so far, for its reader

        with torch.inference_mode():
            plan = self._prefix_lookup(prompts)
            out, prompt_mask, positions = self._prefill(prompts, None if plan is None else plan[1])
            attention = prompt_mask
            cache = _output_cache(out)
            logits = out.logits[:, -1, :]
            position = positions[:, -1:]
            for step in range(sampling.max_new_tokens):
                token, token_logprob = self._sample(logits.float(), sampling,
                                                    None if uniforms is None else uniforms[:, step])
                active = ~finished
                sampled[:, step] = torch.where(active, token, self.pad_id)
                logprobs[:, step] = torch.where(active, token_logprob, 0.0)
                lengths += active.long()
                hit_stop = active & torch.isin(token, stop_ids)
                if stops is not None:
                    hit_stop |= self._completes_stop_string(readers, replies, token, active)
                stopped |= hit_stop
                finished |= hit_stop
                if bool(finished.all()) or step == sampling.max_new_tokens - 1:
                    break
                attention = torch.cat([attention, torch.ones((batch, 1), dtype=attention.dtype, device=device)], dim=1)
                position = position + 1
                out = self.model(input_ids=sampled[:, step:step + 1], attention_mask=attention,
                                 position_ids=position, use_cache=True, **{self._cache_kwarg: cache})
                cache = _output_cache(out)
                logits = out.logits[:, -1, :]
            if plan is not None:
                self._prefix_store(prompts, plan[1], cache, prompt_mask, sampled, lengths, fingerprint=plan[0])

        return sampled.cpu(), logprobs.cpu(), lengths.cpu(), stopped.cpu()

    def _completes_stop_string(self, readers: list, replies: list[list[int]], token, active):
        """Which active rows' new ``token`` completes a stop string (``replies``: each row's tokens
        before it, extended here; ``readers``: each row's :class:`StopReader`)."""
        hits = []
        for row, (new, going) in enumerate(zip(token.tolist(), active.tolist())):
            if going:
                replies[row].append(new)
            hits.append(going and readers[row].completes_stop(replies[row]))
        return self.torch.tensor(hits, device=token.device)

    def _prefill(self, prompts: list[list[int]], reuse: list[tuple] | None):
        """Run the prompts' tokens that no cached prefix covers, left padded, behind the reused
        states (left padded to the longest reused prefix: row ``[pad, reused, pad, new]``). Return
        the model's output, the attention mask over the prompts' columns and the new tokens'
        positions."""
        torch = self.torch
        device = self.device
        batch = len(prompts)
        reused = [n for _, n in reuse] if reuse is not None else [0] * batch
        cached = max(reused)
        width = max(len(p) - n for p, n in zip(prompts, reused))
        input_ids = torch.full((batch, width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((batch, cached + width), dtype=torch.long)
        for row, (prompt, n) in enumerate(zip(prompts, reused)):  # every row ends at the same column
            new = prompt[n:]
            input_ids[row, width - len(new):] = torch.tensor(new, dtype=torch.long)
            attention[row, cached + width - len(new):] = 1
            attention[row, cached - n:cached] = 1
        input_ids, attention = input_ids.to(device), attention.to(device)
        positions = (attention.cumsum(-1) - 1).clamp(min=0)[:, cached:]
        past = {}
        if cached:
            from .prefix_cache import cache_from_states

            layers = next(entry for entry, _ in reuse if entry is not None).layers
            keys = [self._stacked_prefixes(reuse, "keys", layer, cached) for layer in range(layers)]
            values = [self._stacked_prefixes(reuse, "values", layer, cached) for layer in range(layers)]
            past[self._cache_kwarg] = cache_from_states(keys, values)
        if reuse is not None:
            self.prefix_cache.count(prefilled_tokens=sum(len(p) - n for p, n in zip(prompts, reused)))
        out = self.model(input_ids=input_ids, attention_mask=attention, position_ids=positions, use_cache=True,
                         logits_to_keep=1, **past)
        return out, attention, positions

    def _stacked_prefixes(self, reuse: list[tuple], which: str, layer: int, cached: int):
        """One layer's reused keys or values of every row, ``[batch, heads, cached, head_dim]``,
        each row's right-aligned (zeros before it, masked out)."""
        rows = [(row, entry.pieces(which, layer, n), n) for row, (entry, n) in enumerate(reuse) if n]
        heads, _, dim = rows[0][1][0].shape
        stacked = self.torch.zeros((len(reuse), heads, cached, dim), dtype=rows[0][1][0].dtype, device=self.device)
        for row, pieces, n in rows:  # one concatenation (one kernel on a GPU) rather than a copy per block
            stacked[row, :, cached - n:] = pieces[0] if len(pieces) == 1 else self.torch.cat(pieces, dim=1)
        return stacked

    def _prefix_lookup(self, prompts: list[list[int]]) -> tuple[object, list[tuple]] | None:
        """The weights' fingerprint, and each prompt's cached entry and how many of its tokens it
        covers (``(None, 0)`` where none does); None when prefix reuse is off or cannot serve the
        model. Prefixes that several of the prompts share and the cache lacks are run first, once
        each."""
        if self.prefix_cache.budget_bytes == 0 or self.prefix_cache_reason is not None:
            return None
        from .prefix_cache import best_of, shared_prefixes, weights_fingerprint

        cache = self.prefix_cache
        fingerprint = weights_fingerprint(self.model)
        cache.check_weights(fingerprint)
        cache.count(prompt_tokens=sum(len(p) for p in prompts))
        cached = [cache.lookup(prompt) for prompt in prompts]
        shared = shared_prefixes(prompts, [n for _, n in cached], cache.min_reuse) if len(prompts) > 1 else []
        batch_entries = []
        if shared:
            # Run for this batch and handed to it directly, not kept: the batch's replies keep
            # longer entries that begin with them, and a tight budget could not evict them first.
            shared_reuse = [cache.lookup(prefix) for prefix in shared]
            out, prompt_mask, _ = self._prefill(shared, shared_reuse)
            nothing_sampled = self.torch.zeros((len(shared), 0), dtype=self.torch.long, device=self.device)
            batch_entries = self._row_entries(shared, shared_reuse, _output_cache(out), prompt_mask, nothing_sampled,
                                              lengths=self.torch.zeros(len(shared), dtype=self.torch.long))
        return fingerprint, [best_of(batch_entries, prompt, found, cache.min_reuse)
                             for prompt, found in zip(prompts, cached)]

    def _prefix_store(self, prompts, reuse, cache, prompt_mask, sampled, lengths, fingerprint) -> None:
        """Keep each row's states of its prompt and the sampled tokens the model ran."""
        for entry in self._row_entries(prompts, reuse, cache, prompt_mask, sampled, lengths):
            self.prefix_cache.store(entry, fingerprint)

    def _row_entries(self, prompts, reuse, cache, prompt_mask, sampled, lengths) -> list:
        """Each row's states of its prompt and of the sampled tokens the model ran (all but the
        last: it was sampled, never fed); none for a model whose cache cannot be read so. A row
        that reused ``(entry, n)`` of ``reuse`` shares that entry's blocks for its first ``n``
        tokens and copies out only the states computed after them."""
        from .prefix_cache import PrefixEntry, StateBlock, layer_states

        torch = self.torch
        states = layer_states(cache, len(prompts))
        if states is None:  # a model whose cache is not plain full attention: found at the first generation
            self._prefix_support = (self.model, "its generation cache is not a DynamicCache of full-attention layers")
            self.prefix_cache.clear()
            return []
        columns = prompt_mask.shape[1]
        entries = []
        for row, prompt in enumerate(prompts):
            fed = max(int(lengths[row]) - 1, 0)
            if columns + fed > states[0][0].shape[2]:
                continue
            parent, reused = reuse[row]
            where = torch.cat([torch.nonzero(prompt_mask[row]).flatten()[reused:],
                               torch.arange(columns, columns + fed, device=prompt_mask.device)])
            ids = torch.tensor(list(prompt) + sampled[row, :fed].tolist(), dtype=torch.long)
            keys = tuple(k[row].index_select(1, where) for k, _ in states)
            values = tuple(v[row].index_select(1, where) for _, v in states)
            entries.append(parent.extended(reused, ids, StateBlock(keys, values)) if reused
                           else PrefixEntry.of_states(ids, keys, values))
        return entries

    @property
    def prefix_cache_reason(self) -> str | None:
        """Why the generic decode loop would not reuse prefixes for the current model (None if it
        would; the CUDA fast path, where it serves the model, reuses none)."""
        if self.prefix_cache.budget_bytes == 0:
            return "prefix_cache_mb is 0"
        if self._prefix_support is None or self._prefix_support[0] is not self.model:
            from .prefix_cache import unsupported_reason

            self._prefix_support = (self.model, unsupported_reason(self.model))
        return self._prefix_support[1]

    def set_prefix_cache_mb(self, prefix_cache_mb: float) -> None:
        """A new, empty prefix cache of ``prefix_cache_mb`` megabytes (0: no prefix reuse)."""
        from .prefix_cache import PrefixKVCache

        budget = checked_megabytes(prefix_cache_mb, "prefix_cache_mb", "turns prefix reuse off")
        self.prefix_cache = PrefixKVCache(int(budget * 2**20))

    def clear_prefix_cache(self) -> None:
        """Forget every cached prefix. Most weight changes do so themselves (each generation checks
        the weights' fingerprint: :mod:`rftgym.agents.prefix_cache`); call this after one it
        cannot see: a write through ``.data``, peft's ``set_adapter``, FSDP gathering new weights
        into the same buffers."""
        self.prefix_cache.clear()

    def close(self) -> None:
        """Free what generation holds beyond the model: the fast decoder's captured graphs and their
        KV caches (up to ``max_graphs`` of them: gigabytes at large batches) and the cached
        prefixes. The policy still works; its next generation builds what it needs again."""
        with self._fast_lock:
            self._fast = None
        self.prefix_cache.clear()
        if self.device.type == "cuda":
            self.torch.cuda.empty_cache()  # (their memory, given back by the allocator)

    def _replies(self, prompts, sampled, logprobs, lengths, stopped) -> list[AgentReply]:
        # A sampled token's log-prob is finite unless the model's logits were not (NaN or inf):
        # such replies would hand training NaN weights, and their tokens mean nothing.
        taken = self.torch.arange(logprobs.shape[1])[None, :] < lengths[:, None]
        if not bool(self.torch.isfinite(logprobs[taken]).all()):
            raise AgentError(f"model {self.name!r} gave NaN or infinite logits while sampling; its weights or "
                             "activations overflowed or are broken (float16 overflow, a diverged training run, "
                             "a bad checkpoint): try bfloat16 or float32, or check the weights")
        replies = []
        for row, prompt in enumerate(prompts):
            n = int(lengths[row])
            ids = sampled[row, :n].tolist()
            replies.append(AgentReply(
                text=self.chat.decode_reply(ids),
                prompt_ids=list(prompt),
                sampled_ids=ids,
                logprobs=logprobs[row, :n].tolist(),
                finish_reason="stop" if bool(stopped[row]) else "length",
            ))
        return replies

    def _sample(self, logits, sampling: SamplingConfig, uniforms):
        """Draw one token per row at its uniform draw (``uniforms``, ``[rows]``; None when greedy);
        return it and its log-prob under the untruncated ``logits / temperature`` (temperature 1
        when greedy). The fast path samples with the same function."""
        from .fast_decode import DecodeSettings, sample_tokens

        settings = DecodeSettings(sampling.max_new_tokens, sampling.temperature, sampling.top_k, sampling.top_p)
        return sample_tokens(logits, settings, uniforms)

    # ------------------------------------------------------------------ scoring

    def score(self, prompt_ids: Sequence[int], completion_ids: Sequence[int], temperature: float = 1.0) -> list[float]:
        """Log-probs of ``completion_ids`` after ``prompt_ids`` by one teacher-forced forward pass.

        Only the completion positions' logits are materialized (``logits_to_keep``).
        """
        torch = self.torch
        prompt_ids = _token_list(prompt_ids, "prompt_ids")
        completion_ids = _token_list(completion_ids, "completion_ids")
        if not (is_finite_real(temperature) and temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0 (0 or 1: the plain log-probs), got "
                             f"{temperature!r}")
        if not completion_ids:
            return []
        if not prompt_ids:
            raise ValueError("score() needs at least one prompt token: the first completion token is scored given "
                             "what comes before it; give the prompt the reply was sampled after (its prompt_ids)")
        self._refuse_unknown_ids([prompt_ids + completion_ids])
        ids = torch.tensor([list(prompt_ids) + list(completion_ids)], device=self.device)
        n = len(completion_ids)
        with torch.inference_mode(), self._evaluating():
            logits = self.model(input_ids=ids, logits_to_keep=n + 1).logits[0, :-1].float()
        logp = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
        target = torch.tensor(list(completion_ids), device=self.device)
        return logp.gather(-1, target[:, None]).squeeze(-1).tolist()


def _token_list(ids, name: str) -> list[int]:
    """``ids`` (a sequence, a 1-d tensor or array of ints) as a list of ints, or a TypeError naming
    ``name``."""
    ids = ids.tolist() if hasattr(ids, "tolist") else ids
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
        raise TypeError(f"{name} is a sequence of token ids (ints), got {type(ids).__name__}")
    ids = list(ids)
    if not all(is_int(t) for t in ids):
        bad = next(t for t in ids if not is_int(t))
        raise TypeError(f"{name} is a sequence of token ids (ints), got {bad!r} among them")
    return [int(t) for t in ids]


def _cache_kwarg(model) -> str:
    """transformers 5.24 renamed ``past_key_values`` to ``cache``; 5.17 knows only the old name."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    parameters = inspect.signature(base.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def _output_cache(output):
    cache = getattr(output, "cache", None)
    return cache if cache is not None else getattr(output, "past_key_values", None)


def _same_device(a, b) -> bool:
    """"cuda" and "cuda:0" are one device (a generator made for "cuda" reports no index)."""
    if a.type != b.type:
        return False
    return a.index is None or b.index is None or a.index == b.index
