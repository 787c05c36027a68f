"""Models whose logits are more than ``hidden @ lm_head.weight`` (a soft cap, a scale) train on
the probabilities they sample from; a model whose logits rftgym cannot reproduce is refused."""

from __future__ import annotations

import pytest
import torch
from support import SayAEnv, make_char_policy

from rftgym.core.errors import ConfigError
from rftgym.train import TrainConfig
from rftgym.train.batching import TrainSample, collate
from rftgym.train.loop import train
from rftgym.train.model_setup import check_training_logprobs, prepare_model
from rftgym.train.update import decoder_logprobs


def model_logprobs(model, batch):
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    logp = torch.log_softmax(logits.double(), dim=-1)
    return logp.gather(-1, batch["targets"].unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize("family", ["gemma2", "cohere", "granite"])
def test_training_logprobs_equal_the_models_own(family):
    from transformers import (
        CohereConfig,
        CohereForCausalLM,
        Gemma2Config,
        Gemma2ForCausalLM,
        GraniteConfig,
        GraniteForCausalLM,
    )

    # Caps and scales small enough to change every probability noticeably.
    policy = {
        "gemma2": lambda: make_char_policy(0, Gemma2ForCausalLM, Gemma2Config, final_logit_softcapping=0.05),
        "cohere": lambda: make_char_policy(0, CohereForCausalLM, CohereConfig, logit_scale=3.0),
        "granite": lambda: make_char_policy(0, GraniteForCausalLM, GraniteConfig, logits_scaling=0.25),
    }[family]()
    config = TrainConfig(temperature=1.0)
    model = prepare_model(policy, config)  # runs check_training_logprobs
    model.eval()
    samples = [TrainSample([5, 9, 11, 4, 7], [0, 1, 1, 1, 1], [0.0] * 5, [0.0] * 5, 0, 0),
               TrainSample([6, 8, 3], [0, 1, 1], [0.0] * 3, [0.0] * 3, 0, 1)]
    batch = collate(samples, policy.pad_id)
    with torch.no_grad():
        ours, _ = decoder_logprobs(model, batch, config)
        theirs = model_logprobs(model, batch)
        identity = torch.log_softmax((model.get_decoder()(input_ids=batch["input_ids"]).last_hidden_state[:, :-1]
                                      @ model.get_output_embeddings().weight.t()).double(), -1)
    mask = batch["attention_mask"][:, 1:].bool()
    assert torch.allclose(ours.double()[mask], theirs[mask], atol=1e-5)
    # and the transform matters: without it the numbers would differ
    plain = identity.gather(-1, batch["targets"].unsqueeze(-1)).squeeze(-1)
    assert (plain[mask] - theirs[mask]).abs().max() > 1e-2


class TellsRepliesApartEnv(SayAEnv):
    """SayAEnv with a reward that two different replies almost surely differ in, so that a group's
    advantages are not all zero whatever the draws (an update then runs)."""

    def step(self, action):
        context, _, terminated, truncated, info = super().step(action)
        return context, sum(map(ord, action)) % 97 / 97, terminated, truncated, info


def test_a_soft_capped_model_trains(tmp_path):
    from transformers import Gemma2Config, Gemma2ForCausalLM

    policy = make_char_policy(0, Gemma2ForCausalLM, Gemma2Config, final_logit_softcapping=5.0)
    config = TrainConfig(steps=1, tasks_per_step=1, group_size=4, max_new_tokens=4, learning_rate=1e-3,
                         minibatch_size=4, output_dir=str(tmp_path), seed=0, device="cpu")
    history = train(config, policy=policy, make_env=TellsRepliesApartEnv)
    assert len(history) == 1 and history[0]["updates"] > 0 and history[0]["loss"] is not None


def test_unknown_logit_transform_is_refused():
    policy = make_char_policy()
    # A Llama ignores logit_scale, so reading it would train on probabilities it never samples from.
    policy.model.config.logit_scale = 2.0
    with pytest.raises(ConfigError, match="differ from rftgym's training log-probs.*logit scale and a soft cap"):
        check_training_logprobs(policy.model)


def test_output_bias_is_refused():
    policy = make_char_policy()
    head = policy.model.get_output_embeddings()
    head.bias = torch.nn.Parameter(torch.zeros(head.weight.shape[0]))
    with pytest.raises(ConfigError, match="bias"):
        check_training_logprobs(policy.model)


def test_the_update_runs_without_the_attention_dropout_a_model_config_asks():
    policy = make_char_policy(0, attention_dropout=0.5)
    model = prepare_model(policy, TrainConfig())
    model.train()  # as the update runs: Llama's attention applies its dropout itself in train mode
    ids = torch.tensor([[5, 9, 11, 4, 7, 3, 8]])
    with torch.no_grad():
        first, second = model(input_ids=ids).logits, model(input_ids=ids).logits
        model.eval()
        evaluated = model(input_ids=ids).logits
    assert torch.equal(first, second) and torch.allclose(first, evaluated, atol=1e-6)
