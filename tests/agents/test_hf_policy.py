"""HFPolicy: exact tokens, batched generation, log-probs, sampling options, default model cache."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from rftgym.agents.hf_policy import HFPolicy, SamplingConfig
from rftgym.core.errors import ConfigError, ModelLoadError
from rftgym.core.messages import Context, Message


def ctx(*pairs):
    return Context(tuple(Message(role, text, f"m{i}") for i, (role, text) in enumerate(pairs)))


QUESTIONS = [
    ctx(("user", "What is 2+3?")),
    ctx(("system", "Be brief."), ("user", "Name a colour. A much longer question to force left padding here.")),
    ctx(("user", "Say hi"), ("assistant", "Hi!"), ("user", "Again, please.")),
]


def test_default_model_is_cached_as_plain_hf_directory():
    from rftgym.agents.model_loading import default_model_dir

    path = default_model_dir()
    config = json.loads((path / "config.json").read_text())
    assert "quantization_config" not in config  # a reload must not go through GGUF again
    assert (path / "model.safetensors").is_file() and (path / "tokenizer.json").is_file()


def test_a_directory_named_like_the_default_model_is_that_directory(tmp_path, monkeypatch):
    from rftgym.agents.model_loading import DEFAULT_MODEL_NAME, names_default_model, resolve_model_dir

    monkeypatch.chdir(tmp_path)
    assert names_default_model(DEFAULT_MODEL_NAME) and names_default_model(None) and names_default_model("default")
    (tmp_path / DEFAULT_MODEL_NAME).mkdir()
    (tmp_path / DEFAULT_MODEL_NAME / "config.json").write_text("{}")
    assert not names_default_model(DEFAULT_MODEL_NAME)  # a fine-tuned copy saved under the upstream name
    with pytest.raises(ModelLoadError, match="no weights"):
        resolve_model_dir(DEFAULT_MODEL_NAME)


def test_an_unwritable_model_cache_is_named(tmp_path, monkeypatch):
    from rftgym.agents.model_loading import default_model_dir

    blocker = tmp_path / "a_file"
    blocker.write_text("")
    monkeypatch.setenv("RFTGYM_CACHE", str(blocker / "cache"))  # under a file: no directory can be made
    with pytest.raises(ModelLoadError, match=r"cannot be written .*; set RFTGYM_CACHE to a writable directory"):
        default_model_dir()


def test_unknown_model_path_says_what_to_pass(tmp_path):
    with pytest.raises(ModelLoadError, match="missing': no such directory .*pass a local model directory"):
        HFPolicy.from_pretrained(str(tmp_path / "missing"))
    with pytest.raises(ModelLoadError, match="local Hugging Face model directory"):
        HFPolicy.from_pretrained(str(tmp_path))   # a folder that holds no model
    # config.json alone: say that weights and a tokenizer are missing (transformers' own message
    # speaks of sentencepiece), before anything is loaded.
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelLoadError, match="has config.json but no weights .* and no tokenizer"):
        HFPolicy.from_pretrained(str(tmp_path))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="has config.json but no tokenizer"):
        HFPolicy.from_pretrained(str(tmp_path))
    (tmp_path / "tokenizer_config.json").write_text("{}")  # a tokenizer's settings, not its vocabulary
    with pytest.raises(ModelLoadError, match="has config.json but no tokenizer"):
        HFPolicy.from_pretrained(str(tmp_path))
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    for name in ("adapter_config.json", "config.json"):
        (adapter / name).write_text("{}")
    (adapter / "adapter_model.safetensors").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="holds a PEFT adapter .* merge it into its base model"):
        HFPolicy.from_pretrained(str(adapter))


def test_the_device_is_checked_before_the_model_loads_and_a_torch_dtype_is_taken(tmp_path, make_char_policy):
    made = make_char_policy()
    made.model.save_pretrained(tmp_path / "m")
    made.tokenizer.save_pretrained(tmp_path / "m")
    with pytest.raises(ConfigError, match="device='tpu': not a torch device; use cpu, cuda or cuda:N"):
        HFPolicy.from_pretrained(str(tmp_path / "m"), device="tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="device='cuda': this torch build or machine has no CUDA; use cpu"):
            HFPolicy.from_pretrained(str(tmp_path / "m"), device="cuda")
    policy = HFPolicy.from_pretrained(str(tmp_path / "m"), device="cpu", dtype=torch.bfloat16)
    assert next(policy.model.parameters()).dtype == torch.bfloat16


def test_a_tokenizer_with_ids_past_the_models_embeddings_is_refused():
    from support import char_tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = char_tokenizer()
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer) - 2, hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))
    with pytest.raises(ConfigError, match=r"the tokenizer has \d+ tokens and the model's embeddings \d+ rows"):
        HFPolicy(model, tokenizer)


def test_default_model_answers_simple_question(default_policy):
    reply = default_policy.act([ctx(("user", "What is 2+3? Reply with just the number."))])[0]
    assert "5" in reply.text
    assert reply.finish_reason == "stop"
    assert reply.sampled_ids[-1] in default_policy.chat.stop_ids
    assert len(reply.logprobs) == len(reply.sampled_ids)


def test_prompt_ids_equal_chat_template_rendering(default_policy):
    chat = default_policy.chat
    for context in QUESTIONS:
        rendered = default_policy.tokenizer(chat.render_text(context), add_special_tokens=False)["input_ids"]
        assert chat.prompt_ids(context) == list(rendered)


def test_logprobs_match_teacher_forced_scoring(default_policy):
    replies = default_policy.act(QUESTIONS)
    for reply in replies:
        scored = default_policy.score(reply.prompt_ids, reply.sampled_ids)
        assert scored == pytest.approx(reply.logprobs, abs=1e-4)


def test_batched_greedy_generation_equals_one_at_a_time(tiny_policy):
    batched = tiny_policy.act(QUESTIONS)
    for context, reply in zip(QUESTIONS, batched):
        alone = tiny_policy.act([context])[0]
        assert alone.sampled_ids == reply.sampled_ids
        assert alone.logprobs == pytest.approx(reply.logprobs, abs=1e-4)


def test_batches_larger_than_max_batch_size_keep_order(tiny_policy):
    sampling = SamplingConfig(max_new_tokens=4, temperature=0.0, max_batch_size=2)
    prompts = [tiny_policy.chat.prompt_ids(c) for c in QUESTIONS * 2]
    split = tiny_policy.generate(prompts, sampling)
    whole = tiny_policy.generate(prompts, SamplingConfig(max_new_tokens=4, temperature=0.0, max_batch_size=8))
    assert [r.prompt_ids for r in split] == prompts
    assert [r.sampled_ids for r in split] == [r.sampled_ids for r in whole]


def test_length_finish_and_budget(tiny_policy):
    reply = tiny_policy.generate([tiny_policy.chat.prompt_ids(QUESTIONS[0])], SamplingConfig(max_new_tokens=3, temperature=0.0))[0]
    if reply.finish_reason == "length":
        assert len(reply.sampled_ids) == 3
    else:
        assert reply.sampled_ids[-1] in tiny_policy.chat.stop_ids


def test_seeded_sampling_is_reproducible_and_top_k_1_is_greedy(tiny_policy):
    prompt = [tiny_policy.chat.prompt_ids(QUESTIONS[1])]
    hot = SamplingConfig(max_new_tokens=8, temperature=1.5, seed=7)
    tiny_policy._generator.manual_seed(7)
    first = tiny_policy.generate(prompt, hot)[0].sampled_ids
    tiny_policy._generator.manual_seed(7)
    second = tiny_policy.generate(prompt, hot)[0].sampled_ids
    assert first == second
    greedy = tiny_policy.generate(prompt, SamplingConfig(max_new_tokens=8, temperature=0.0))[0]
    top1 = tiny_policy.generate(prompt, SamplingConfig(max_new_tokens=8, temperature=1.0, top_k=1))[0]
    assert top1.sampled_ids == greedy.sampled_ids


def test_top_p_keeps_only_the_nucleus(tiny_policy):
    logits = torch.tensor([[4.0, 3.0, 0.0, -1.0]])
    cfg = SamplingConfig(temperature=1.0, top_p=0.5)
    probs = torch.softmax(logits, -1)[0]
    assert probs[0] > 0.5  # so the nucleus is the first token alone
    tokens = {int(tiny_policy._sample(logits, cfg, torch.rand(1, dtype=torch.float64))[0]) for _ in range(50)}
    assert tokens == {0}


def test_sampling_config_errors_say_what_is_allowed():
    for temperature in (-1, float("nan"), float("inf"), True, 1e-40, "1"):  # 1e-40: NaN probabilities
        with pytest.raises(ConfigError, match=r"temperature must be 0 \(greedy\) or a finite number >= 1e-06"):
            SamplingConfig(temperature=temperature)
    for top_p in (0, 1.5, "1", float("nan")):
        with pytest.raises(ConfigError, match="top_p must be a number in"):
            SamplingConfig(top_p=top_p)
    for name in ("max_new_tokens", "max_batch_size", "max_prompt_tokens"):
        for bad in (0, 4.5, True, "8"):
            with pytest.raises(ConfigError, match=f"{name} must be an integer of at least 1"):
                SamplingConfig(**{name: bad})
    with pytest.raises(ConfigError, match="top_k must be an integer >= 0"):
        SamplingConfig(top_k=2.5)
    assert SamplingConfig(temperature=0).greedy and SamplingConfig(max_prompt_tokens=None, temperature=1e-6)
    for filters in ({"top_p": 0.5}, {"top_k": 5}):  # greedy reads neither: refused, as the CLI refuses the flags
        with pytest.raises(ConfigError, match="are not read with temperature=0 .* leave them at 1.0 and 0"):
            SamplingConfig(temperature=0, **filters)


def test_no_seed_means_other_samples_each_run(make_char_policy):
    # A new torch Generator starts from one fixed seed: without seeding it, "no seed" gave the same
    # samples in every run.
    first, second = (make_char_policy()._generator.initial_seed() for _ in range(2))  # SamplingConfig(seed=None)
    assert first != second


def test_prompt_limit_leaves_room_for_a_whole_reply(tiny_policy):
    context = tiny_policy.context_length
    assert context == 2048
    assert tiny_policy.prompt_limit(SamplingConfig(max_new_tokens=48)) == context - 48
    assert tiny_policy.prompt_limit(SamplingConfig(max_new_tokens=48, max_prompt_tokens=100)) == 100
    with pytest.warns(UserWarning, match=rf"max_prompt_tokens=4000 is more than the model's context leaves "
                                         rf"\({context} - max_new_tokens 48 = {context - 48}\); prompts are capped"):
        assert tiny_policy.prompt_limit(SamplingConfig(max_new_tokens=48, max_prompt_tokens=4000)) == context - 48
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        assert tiny_policy.prompt_limit(SamplingConfig(max_new_tokens=48, max_prompt_tokens=4000)) == context - 48
    with pytest.raises(ConfigError, match="max_prompt_tokens must be an integer of at least 1"):
        SamplingConfig(max_prompt_tokens=0)


def test_prompt_that_does_not_fit_gets_a_context_full_reply_and_the_others_are_unchanged(tiny_policy):
    from rftgym.agents.base import CONTEXT_FULL

    policy = HFPolicy(tiny_policy.model, tiny_policy.tokenizer)  # its own once-per-policy warning
    sampling = SamplingConfig(max_new_tokens=5, temperature=0.0, max_prompt_tokens=10)
    fits_a, too_long, fits_b = [5, 6, 7], [1] * 11, [8, 9, 10, 11, 12, 13, 14, 15, 16, 17]
    with pytest.warns(UserWarning, match=r"longer than the policy answers \(10 tokens: .*max_prompt_tokens=10\)"):
        replies = policy.generate([fits_a, too_long, fits_b], sampling)
    assert replies[1].finish_reason == CONTEXT_FULL and replies[1].text == ""
    assert replies[1].sampled_ids is None and replies[1].prompt_ids is None  # nothing to train on
    alone = policy.generate([fits_a, fits_b], sampling)
    for got, want in zip([replies[0], replies[2]], alone):
        assert got.sampled_ids == want.sampled_ids and got.finish_reason in ("stop", "length")
    # Room for a whole reply counts too: 2048 - 2040 leaves prompts of at most 8 tokens. The
    # warning came once for this policy; a fresh one words the model's limit.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert policy.generate([[1] * 9], SamplingConfig(max_new_tokens=2040))[0].finish_reason == CONTEXT_FULL
    fresh = HFPolicy(tiny_policy.model, tiny_policy.tokenizer)
    with pytest.warns(UserWarning, match="the model's context of 2048 less max_new_tokens=2040"):
        replies = fresh.generate([[1] * 9], SamplingConfig(max_new_tokens=2040, temperature=0.0))
    assert replies[0].finish_reason == CONTEXT_FULL
    assert fresh.prompt_limit(SamplingConfig(max_new_tokens=2040)) == 8


def test_a_model_in_train_mode_samples_and_scores_without_dropout(make_char_policy):
    """A model built from its config is in train mode: sampled with dropout, its recorded log-probs
    would not be the ones scoring (or the trainer) computes, and each call would draw on torch's
    global RNG. The policy samples and scores in eval mode, and gives the model back as it was."""
    from transformers import GPT2Config, GPT2LMHeadModel

    policy = make_char_policy(model_class=GPT2LMHeadModel, config_class=GPT2Config, resid_pdrop=0.5, embd_pdrop=0.5,
                              attn_pdrop=0.5)
    assert policy.model.training
    sampling = SamplingConfig(max_new_tokens=8, temperature=1.0, seed=3)
    torch.manual_seed(0)
    first = policy.generate([[5, 6, 7]], sampling)[0]
    torch.manual_seed(1)  # another global RNG state: no effect on what the policy samples
    again = policy.generate([[5, 6, 7]], sampling)[0]
    assert again.sampled_ids == first.sampled_ids
    assert policy.model.training  # as it was
    scored = policy.score([5, 6, 7], first.sampled_ids)
    assert scored == pytest.approx(list(first.logprobs), abs=1e-5)
    assert policy.model.training


def _context_full_policy(make_char_policy):
    char = make_char_policy()
    return HFPolicy(char.model, char.tokenizer, SamplingConfig(max_new_tokens=2, temperature=0.0, max_prompt_tokens=3))


def _prompt_cap_policy(make_char_policy):  # 512 positions less 2 new tokens leave 510
    char = make_char_policy()
    sampling = SamplingConfig(max_new_tokens=2, temperature=0.0, max_prompt_tokens=511)
    return HFPolicy(char.model, char.tokenizer, sampling)


def _no_fast_decode_policy(make_char_policy):
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = make_char_policy(model_class=GPT2LMHeadModel, config_class=GPT2Config)
    return HFPolicy(gpt2.model, gpt2.tokenizer, SamplingConfig(max_new_tokens=2, temperature=0.0), fast_decode=True)


@pytest.mark.parametrize("warning, make_policy", [
    ("a prompt is longer than the policy answers", _context_full_policy),
    ("max_prompt_tokens=511 is more than the model's context leaves", _prompt_cap_policy),
    ("fast_decode=True but model_type 'gpt2'", _no_fast_decode_policy),
], ids=["context full", "prompt cap", "no fast decode"])
@pytest.mark.parametrize("way_in", ["generate", "act", "run_episodes"])
def test_the_policys_warnings_name_the_line_that_called_into_rftgym(make_char_policy, warning, make_policy, way_in):
    """However deep in rftgym a warning is found (the engine calls act_tokens, which calls generate,
    which asks prompt_limit ...), it names the user's line: a direct call, or the run_episodes call."""
    from support import SayAEnv

    from rftgym.rollout import run_episodes

    policy = make_policy(make_char_policy)
    call = {"generate": lambda: policy.generate([[5, 6, 7, 8]]),
            "act": lambda: policy.act([ctx(("user", "say a"))]),
            "run_episodes": lambda: run_episodes(SayAEnv, policy, [0])}[way_in]
    with pytest.warns(UserWarning, match=warning) as caught:
        call()
    said = [(w.filename, w.lineno) for w in caught if warning in str(w.message)]
    assert said == [(__file__, call.__code__.co_firstlineno)]  # the line of the call itself
