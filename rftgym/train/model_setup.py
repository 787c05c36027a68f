"""The model a run trains, made ready: LoRA adapters, gradient checkpointing, the frozen
reference for the KL term, and the checks that refuse a model the trainer would train on other
numbers than it samples from (log-probs, packed attention) before any step runs."""

from __future__ import annotations

import copy
import warnings
from contextlib import nullcontext

import torch

from ..agents.hf_policy import HFPolicy
from ..core.errors import ConfigError, require
from .config import TrainConfig
from .token_logprobs import chunked_token_logprobs, logit_transform


def prepare_model(policy: HFPolicy, config: TrainConfig, autocast=nullcontext):
    """Apply LoRA and gradient checkpointing as configured; return the model to train.
    ``autocast``: the precision context the rollouts and updates will run under."""
    model = policy.model
    turn_off_dropout(model)
    check_training_logprobs(model, autocast)
    if config.pack_sequences:
        check_packed_attention(model, autocast)
    if config.lora_rank:
        check_lora_rank(model, config.lora_rank)
        model = with_lora(model, config)
        policy.model = model
    if config.gradient_checkpointing:
        # transformers 5.24 renamed the method and its argument; 5.17 has only the old names.
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if config.lora_rank:
            model.enable_input_require_grads()
    return model


# Dropout probabilities that models keep as numbers and apply themselves in train mode, on their
# modules (Llama, Qwen2, Mistral: attention_dropout, read from the config as the module is built)
# or read from their config in the forward pass (Falcon's hidden_dropout; OPT's layerdrop).
DROPOUT_PROBABILITIES = ("attention_dropout", "attn_dropout", "dropout", "hidden_dropout", "layerdrop")


def turn_off_dropout(model) -> None:
    """Rollouts run in eval mode, without dropout; the update runs in train mode, where dropout
    would make the first epoch's ratios noisy (and recomputed old log-probs with it). So every
    dropout rftgym knows of is set to 0: ``nn.Dropout`` modules, and the probabilities of
    :data:`DROPOUT_PROBABILITIES` on the modules and the config."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        for name in DROPOUT_PROBABILITIES:
            if isinstance(getattr(module, name, None), float):
                setattr(module, name, 0.0)
    for name in DROPOUT_PROBABILITIES:
        if isinstance(getattr(model.config, name, None), float):
            setattr(model.config, name, 0.0)


def check_lora_rank(model, rank: int) -> None:
    """Refuse a LoRA rank above the full rank of every layer it would adapt (each linear layer but
    the output head): the adapters would be larger than the layers (an absurd rank runs out of
    memory), and full fine-tuning already reaches any update of them."""
    head = model.get_output_embeddings()
    ranks = [min(m.in_features, m.out_features) for m in model.modules()
             if isinstance(m, torch.nn.Linear) and m is not head]
    if ranks and rank > max(ranks):
        raise ConfigError(f"lora_rank {rank} is above the full rank of every layer LoRA would adapt (at most "
                          f"{max(ranks)} in this model); use a rank of at most {max(ranks)} (typically 8 to 64), "
                          "or lora_rank 0 for full fine-tuning")


def with_lora(model, config: TrainConfig):
    """``model`` with LoRA adapters as ``config`` sets them (base weights frozen): how a run
    trains them, and how :mod:`rftgym.train.export` rebuilds a run's model."""
    peft = require("peft", "train", "LoRA training")
    with warnings.catch_warnings():
        # peft reads the model's is_gradient_checkpointing, which transformers 5.2x deprecates with
        # a FutureWarning on every LoRA run and every rebuilt run: not the user's to act on.
        warnings.filterwarnings("ignore", message=r".*is_gradient_checkpointing.*deprecated", category=FutureWarning)
        return peft.get_peft_model(model, peft.LoraConfig(r=config.lora_rank, lora_alpha=config.lora_alpha,
                                                          target_modules="all-linear", lora_dropout=0.0,
                                                          task_type="CAUSAL_LM"))


def check_training_logprobs(model, autocast=nullcontext) -> None:
    """Refuse a model whose own next-token log-probs differ from the ones training computes.

    Training computes log-probs from the final hidden states (``hidden @ lm_head.weight`` through
    the config's :class:`~rftgym.train.token_logprobs.LogitTransform`), while rollouts sample from
    the model's own logits; a model that does more to its logits (an output bias, a transform
    rftgym does not know) would be trained on other probabilities than it sampled from. One
    forward pass over a few tokens, under the training precision (``autocast``), compares the two.
    """
    head = model.get_output_embeddings()
    if getattr(head, "bias", None) is not None:
        raise ConfigError("the model's output layer has a bias, which rftgym's chunked log-probs do not apply yet")
    weight = head.weight
    ids = (torch.arange(6, device=weight.device) * 7 + 3).remainder(weight.shape[0]).unsqueeze(0)
    with torch.no_grad(), autocast():
        # As the samplers do: the model's logits upcast to float32, then log_softmax.
        theirs = torch.log_softmax(model(input_ids=ids, use_cache=False).logits[:, :-1].float(), dim=-1)
        theirs = theirs.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1).double()
        hidden = model.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state[:, :-1]
        ours, _ = chunked_token_logprobs(hidden, weight, ids[:, 1:], transform=logit_transform(model.config))
    # The same operations in the same precision give (nearly) the same numbers; 16-bit rounding
    # of a differently fused reduction stays far below a wrong transform's gap.
    tolerance = 1e-3 if ours.dtype == torch.float64 or weight.dtype == torch.float32 else 2e-2
    gap = float((ours.double() - theirs).abs().max())
    if not gap <= tolerance:
        raise ConfigError(
            f"the model's own log-probs differ from rftgym's training log-probs by up to {gap:.3g} (tolerance "
            f"{tolerance}): its logits are more than hidden @ lm_head.weight with the transform its config names "
            f"({logit_transform(model.config)}). Training it would use other probabilities than it samples from; "
            "rftgym supports a logit scale and a soft cap (final_logit_softcapping, logit_scale, logits_scaling)")


def check_packed_attention(model, autocast=nullcontext) -> None:
    """Refuse packing (``pack_sequences``) for a model that does not keep packed samples apart.

    Packed rows (:mod:`rftgym.train.packing`) rely on the decoder reading position ids that
    restart at 0 as the start of a new sample and masking attention across samples, as
    Hugging Face's shared mask code does; a model with attention code of its own may attend across
    samples instead, silently. Two short samples packed in one row must give the log-probs they
    give alone."""
    weight = model.get_output_embeddings().weight
    vocab = weight.shape[0]
    first = (torch.arange(5, device=weight.device) * 5 + 2).remainder(vocab)
    second = (torch.arange(4, device=weight.device) * 3 + 1).remainder(vocab)
    decoder = model.get_decoder()
    with torch.no_grad(), autocast():
        alone = [decoder(input_ids=ids.unsqueeze(0), use_cache=False).last_hidden_state[0] for ids in (first, second)]
        packed = decoder(input_ids=torch.cat([first, second]).unsqueeze(0),
                         position_ids=torch.cat([torch.arange(5), torch.arange(4)]).to(weight.device).unsqueeze(0),
                         use_cache=False).last_hidden_state[0]
    gap = float((packed - torch.cat(alone)).abs().max())
    scale = float(torch.cat(alone).abs().max())
    if not gap <= 2e-2 * max(scale, 1.0):
        raise ConfigError(f"this model attends across packed samples (hidden states differ by {gap:.3g} from the "
                          "samples run alone): its attention ignores restarting position ids. Train it without "
                          "pack_sequences (--no-pack-sequences)")


def make_reference(model, config: TrainConfig):
    """The frozen reference for the KL term: None when unused; with LoRA, the same model with
    its adapters switched off (no second copy); otherwise a frozen copy of the initial model."""
    if config.kl_coef == 0:
        return None
    if config.lora_rank:
        return "adapters-off"
    reference = copy.deepcopy(model).eval()
    for p in reference.parameters():
        p.requires_grad_(False)
    return reference
