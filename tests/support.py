"""Test support shared by fixtures and by scripts that tests start in subprocesses
(e.g. the two-process distributed run): a character tokenizer, a tiny model, a learnable env."""

from __future__ import annotations

import string

import gymnasium as gym

from rftgym.core.messages import Context, MessageIds
from rftgym.core.spaces import AssistantText, ContextSpace

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def char_tokenizer():
    """A 32-token character-level ChatML tokenizer, so that a tiny random model can learn fast."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {t: i for i, t in enumerate(specials + list(string.ascii_lowercase + " .\n"))}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens(specials)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<|endoftext|>", bos_token="<|im_start|>",
                                   eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=CHATML)


def make_char_policy(seed: int = 0, model_class=None, config_class=None, **config_options):
    """A 2-layer random model (a Llama unless ``model_class``/``config_class`` name another
    family, with ``config_options`` added to its config) over the character tokenizer; the same
    seed gives the same weights."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from rftgym.agents.hf_policy import HFPolicy

    model_class, config_class = model_class or LlamaForCausalLM, config_class or LlamaConfig
    tokenizer = char_tokenizer()
    torch.manual_seed(seed)
    config = config_class(**{**dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                    max_position_embeddings=512, tie_word_embeddings=True,
                                    pad_token_id=tokenizer.pad_token_id), **config_options})
    name = "char-tiny" if model_class is LlamaForCausalLM else f"char-{config.model_type}"
    return HFPolicy(model_class(config), tokenizer, name=name)


class SayAEnv(gym.Env):
    """One turn; reward = share of an 8-token budget spent on the letter 'a'."""

    metadata = {"render_modes": []}

    def __init__(self):
        self.observation_space = ContextSpace()
        self.action_space = AssistantText()

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.ids = MessageIds.from_rng(self.np_random)
        return Context((self.ids.message("user", "say a"),)), {}

    def step(self, action):
        share = action.count("a") / 8
        done = Context((self.ids.message("user", "done"),))
        return done, float(share), True, False, {"success": share >= 0.5}


def tiny_llama(seed: int = 0):
    """A 2-layer random Llama over a 40-token vocabulary (pad id 0) for update-math tests."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, pad_token_id=0)
    return LlamaForCausalLM(config)


def train_config(tmp_path, name: str = "run", **overrides):
    """A TrainConfig for the tiny model on SayAEnv, writing to ``tmp_path / name``: 24 steps of 2
    tasks x 8 samples of up to 8 tokens, which the tiny model learns from."""
    from rftgym.train import TrainConfig

    settings = dict(steps=24, tasks_per_step=2, group_size=8, max_new_tokens=8, learning_rate=1e-2,
                    minibatch_size=16, output_dir=str(tmp_path / name), seed=0, save_every=100)
    settings.update(overrides)
    return TrainConfig(**settings)


# A module that registers an env of its own with Gymnasium (``module:EnvId`` in the CLI and train).
ECHO_MODULE = '''
import gymnasium as gym
from rftgym.core.messages import Context, MessageIds
from rftgym.core.spaces import AssistantText, ContextSpace


class EchoEnv(gym.Env):
    metadata = {"render_modes": [], "eval_metrics": (("said", "said", "final_mean"),)}

    def __init__(self, word="hi"):
        self.word, self.observation_space, self.action_space = word, ContextSpace(), AssistantText()

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.ids = MessageIds.from_rng(self.np_random)
        return Context((self.ids.message("user", f"say {self.word}"),)), {}

    def step(self, action):
        said = float(self.word in action)
        return Context((self.ids.message("user", "done"),)), said, True, False, {"said": said}


gym.register("mine/Echo-v0", entry_point=EchoEnv)
'''
