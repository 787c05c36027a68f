"""The trainer's configuration: one frozen dataclass, validated on construction."""

from __future__ import annotations

import os
from dataclasses import MISSING, asdict, dataclass, field
from typing import Any

from ..core.errors import ConfigError
from ..agents.hf_policy import MIN_TEMPERATURE
from ..agents.stop_strings import checked_stop_strings
from ..core.values import checked_megabytes, is_finite_real, is_int
from ..envs.common import short_env_name
from .schedule import LR_SCHEDULES


class UnreadSetting(ConfigError):
    """A setting the run would never read (it belongs to another mode): refused for a new run, so
    that a run is the one asked for; a saved run's is set back to its default
    (:meth:`TrainConfig.from_saved`)."""


ALGORITHMS = ("grpo", "dr_grpo", "rloo", "pcar", "dcpo", "rft")
COMPILE_SCOPES = ("layers", "decoder")  # what one compiled graph of the update covers (train/speed.py)
AGGREGATION_NAMES = ("token_mean", "sequence_mean", "constant_normalizer")
PARALLELISM = ("ddp", "fsdp")
OLD_LOGPROBS = ("rollout", "recompute")
RATIO_LEVELS = ("token", "sequence")  # per-token PPO ratios, or GSPO's one per sequence
# PCAR and DCPO rescale or spread a group advantage; this is the estimator they start from.
BASE_ESTIMATOR = {"grpo": "grpo", "dr_grpo": "dr_grpo", "rloo": "rloo", "pcar": "grpo", "dcpo": "grpo", "rft": None}
# What a resume may not change (another env, algorithm or adapter shape or scale would be another
# run: alpha / rank scales what the adapters add), and what it may change without a note; any other
# change is noted as the run resumes.
RESUME_FIXED = ("env_id", "algo", "lora_rank", "lora_alpha")
RESUME_FREE = ("steps", "save_every", "keep_checkpoints", "log_every", "log_episodes", "output_dir", "eval_every",
               "eval_episodes", "eval_seed", "eval_before_training", "dist_timeout_s")


def _default(name: str) -> Any:
    """TrainConfig's default of the field ``name`` (a fresh one where a factory makes it)."""
    spec = TrainConfig.__dataclass_fields__[name]
    return spec.default_factory() if spec.default_factory is not MISSING else spec.default


def default_output_dir(env_id: str, algo: str) -> str:
    """Where a run of ``algo`` on ``env_id`` writes unless told: ``runs/train/<env>-<algo>``, the
    env's name without its namespace or module (``VerifiableQA-v0`` for ``rftgym/VerifiableQA-v0``)."""
    return os.path.join("runs", "train", f"{short_env_name(env_id)}-{algo}")


def _absolute_if_a_file(key: str, value: Any) -> Any:
    """An env's file option (``dataset_path``, ``corpus_path``: any ``*_path``) given relative to
    where the run starts and naming a file there, made absolute: the checkpoint keeps it, and a
    resume from another directory reads the same file. Anything else is kept as given (a missing
    file is the env's to refuse, naming it)."""
    if key.endswith("_path") and isinstance(value, str) and value \
            and not os.path.isabs(value) and os.path.exists(value):
        return os.path.abspath(value)
    return value


@dataclass(frozen=True)
class TrainConfig:
    env_id: str = "rftgym/VerifiableQA-v0"
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    algo: str = "grpo"
    model: str | None = None  # None: the default SmolLM2-135M-Instruct; else a local HF directory
    # None: runs/train/<env>-<algo>, as `rftgym train` names it (decided when the run starts, so that
    # dataclasses.replace(config, algo=...) writes elsewhere)
    output_dir: str | None = None

    # sampling
    steps: int = 20
    tasks_per_step: int = 4
    group_size: int = 8
    max_new_tokens: int = 128
    # The longest prompt answered; a longer one ends its episode as truncated (info context_full).
    # 0 = whatever leaves room for max_new_tokens in the model's context. It bounds the samples the
    # update sees, as verl's max_prompt_length does.
    max_prompt_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    # Strings that end a reply (with the token that completes one; e.g. "</search>", so that the
    # env's results follow a search rather than the model's guess at them), as verl's and vLLM's stop.
    stop: tuple[str, ...] = ()
    rollout_batch_size: int = 32
    # Memory (MB) for prefix reuse in rollouts on the generic decode loop (CPU; see
    # rftgym/agents/prefix_cache.py): a turn's prompt is prefilled from where what the model already
    # ran ends. None = the policy's own (1024 for the model the run loads); 0 = off.
    prefix_cache_mb: float | None = None

    # optimisation
    learning_rate: float = 1e-5
    # The rate of each step (rftgym/train/schedule.py): linear warm-up over warmup_steps steps,
    # then constant, or a linear or cosine decay to learning_rate * min_lr_ratio.
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0
    weight_decay: float = 0.0
    epochs_per_step: int = 1
    # Sequences (segments) per optimizer step on each process (as TRL's per-device batch): under a
    # launch of N processes a step takes N x minibatch_size of them.
    minibatch_size: int = 16
    # Gradient accumulation inside a minibatch: forward/backward this many samples at a time
    # (0 = the whole minibatch at once). Same gradient, less activation memory.
    microbatch_size: int = 0
    # Or by tokens (verl's dynamic batch size): a pass takes as many samples as fit this many
    # tokens, padding included (0 = off). A sample longer than that gets a pass of its own.
    microbatch_tokens: int = 0
    # Pack several samples into each row (rftgym/train/packing.py), so the update computes no
    # padding; the same loss and gradient. Checked once per run against the model's attention.
    pack_sequences: bool = False
    max_grad_norm: float = 1.0
    clip_low: float = 0.2
    clip_high: float = 0.28  # > clip_low is DAPO's clip-higher
    # Dual-clip PPO (verl's clip_ratio_c, e.g. 3): with a negative advantage the loss stops growing
    # past this ratio (0 = off; else above 1).
    clip_ratio_c: float = 0.0
    # "sequence": GSPO, every token of a sequence takes the sequence's ratio (the geometric mean of
    # its token ratios); its clip range is narrow (the paper's clip_low=3e-4, clip_high=4e-4).
    ratio_level: str = "token"
    aggregation: str = "token_mean"
    kl_coef: float = 0.0  # > 0 adds k3 KL to a frozen reference (the base model when LoRA is on)
    logprob_chunk_size: int = 1024
    # The PPO ratio's old log-probs: "rollout" (recorded while sampling) or "recompute" (the
    # training forward pass before the update, as verl does; removes the decode/training kernel
    # gap from the ratio, at one extra forward pass per step).
    old_logprobs: str = "rollout"
    # Truncated importance sampling (TIS) over the rollout/training mismatch, with
    # old_logprobs="recompute": each trained token's loss is weighted by
    # min(pi_train(token) / pi_rollout(token), rollout_is_cap), the sampler's tokens reweighted
    # toward the policy the update computes (0 = off; 2.0 is verl's and TRL's usual cap). Both are
    # untruncated log-probs (as in verl): with top_p < 1 the sampler drew from the nucleus,
    # renormalised, so the weight is off from pi_train / q by the nucleus's mass (at most 1/top_p).
    rollout_is_cap: float = 0.0
    filter_zero_variance: bool = True  # DAPO dynamic sampling's filter: groups with equal rewards are skipped
    # DAPO dynamic sampling's refill (verl's max_num_gen_batches): while fewer than tasks_per_step
    # groups have rewards that vary, roll out tasks_per_step more tasks, up to this many rollouts
    # per step, and train on the first tasks_per_step such groups (1 = no refill: the step trains
    # on the groups the one rollout kept).
    max_rollout_batches: int = 1
    # DAPO overlong filtering: episodes whose last reply was cut by max_new_tokens, or that ran out
    # of context, are masked
    filter_overlong: bool = False

    # algorithm-specific
    pcar_lambda: float = 0.5
    pcar_delta: float = 0.1
    dcpo_segment_budget: int = 0  # segments trained per group; 0 = all

    # model and runtime
    lora_rank: int = 0  # 0 = full fine-tuning
    lora_alpha: float = 16.0
    gradient_checkpointing: bool = False
    # Across processes (torchrun / accelerate launch): "ddp" replicates the model on every rank;
    # "fsdp" shards parameters, gradients and optimizer state (FSDP2) for models whose training
    # state does not fit one GPU. One process without a launcher is "ddp".
    parallelism: str = "ddp"
    # How long a rank waits in a collective for the others (seconds) before the run stops with an
    # error: one hung rank (a stuck env or server) otherwise holds every rank for the process
    # group's default (30 minutes on gloo, 10 on NCCL). Set it above a step's slowest rollout.
    # None: that default.
    dist_timeout_s: float | None = None
    # Update-phase speed (rftgym/train/speed.py): compile each decoder layer, and recompute each
    # MLP in the backward pass (None = on CUDA, off on CPU). Measured on an H200 at 64 x 384
    # tokens: compiled 14.7% MFU / 15.4 GB peak, compiled + MLP recompute 15.5% / 8.0 GB.
    compile: bool | None = None
    # What one compiled graph covers: "layers" (each decoder layer: compiles in seconds) or
    # "decoder" (every layer at once: one compiled call per forward; minutes to compile, again for
    # a pass without gradients or with LoRA adapters off).
    compile_scope: str = "layers"
    checkpoint_mlp: bool | None = None
    device: str | None = None  # default: cuda if available, else cpu
    # None: on CUDA float32 weights with bfloat16 autocast, on CPU float32. "bfloat16" holds the
    # model in bf16, with float32 master copies in the optimizer.
    dtype: str | None = None
    seed: int = 0
    save_every: int = 10
    # Checkpoints the run keeps, its latest included (0 = every one): each save then leaves the
    # one before as checkpoint-<step>/, which rftgym eval --model and rftgym export read as the run
    # at that step (TRL's save_total_limit, verl's max_ckpt_to_keep).
    keep_checkpoints: int = 1
    # Evaluation during training: every eval_every steps (0 = never) and after the last, the
    # policy plays eval_episodes episodes greedily, with seeds eval_seed, eval_seed + 1, ... (the
    # episodes of `rftgym eval --seed eval_seed --episodes eval_episodes`), so that the curve
    # follows the same tasks from step to step.
    eval_every: int = 0
    eval_episodes: int = 32
    eval_seed: int = 0
    # Env options of the evaluation's episodes, over env_kwargs: e.g. a held-out dataset_path, so
    # that the curve is measured on tasks training never draws.
    eval_env_kwargs: dict[str, Any] = field(default_factory=dict)
    # Also evaluate before the first step (a new run's, not a resume's), logged as step 0: the
    # baseline the curve starts from (verl's val_before_train).
    eval_before_training: bool = False
    # metrics.jsonl / TensorBoard get a row every log_every-th step (and the last), the mean of the
    # steps since the last row (their least *_min and greatest *_max; the learning rate and epoch as
    # they are at the row's step), as TRL's logging_steps averages.
    log_every: int = 1
    # On each logged step, its first log_episodes episodes (rank 0's share) go to
    # episodes/step-<step>.jsonl in rftgym eval's format: what the policy wrote, turn by turn, with its
    # rewards (TRL's log_completions); 0 = none.
    log_episodes: int = 0

    def __post_init__(self) -> None:
        self._check_kinds()
        self._check_ranges()
        self._check_combinations()

    def _check_kinds(self) -> None:
        if self.algo not in ALGORITHMS:
            raise ConfigError(f"algo must be one of {', '.join(ALGORITHMS)}; got {self.algo!r}", field="algo")
        if self.aggregation not in AGGREGATION_NAMES:
            raise ConfigError(f"aggregation must be one of {', '.join(AGGREGATION_NAMES)}; got {self.aggregation!r}",
                              field="aggregation")
        for name in ("output_dir", "model"):  # a pathlib.Path is a path too; kept as a string (saved as JSON)
            if isinstance(getattr(self, name), os.PathLike):
                object.__setattr__(self, name, os.fspath(getattr(self, name)))
        for name in ("env_id", "output_dir"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                if name == "output_dir" and self.output_dir is None:
                    continue
                raise ConfigError(f"{name} must be a non-empty string, got {getattr(self, name)!r}"
                                  + (" (or None: runs/train/<env>-<algo>)" if name == "output_dir" else ""), field=name)
        if self.model is not None and not isinstance(self.model, str):
            raise ConfigError(f"model must be a local model directory (a string) or None, got {self.model!r}",
                              field="model")
        for name in ("env_kwargs", "eval_env_kwargs"):
            options = getattr(self, name)
            if not isinstance(options, dict) or not all(isinstance(key, str) for key in options):
                raise ConfigError(f"{name} must be a dict of environment options (by name: string keys), got "
                                  f"{options!r}", field=name)
            # (a pathlib path is taken as its text, as output_dir's)
            object.__setattr__(self, name, {
                key: _absolute_if_a_file(key, os.fspath(value) if isinstance(value, os.PathLike) else value)
                for key, value in options.items()})
        object.__setattr__(self, "stop", checked_stop_strings(self.stop))  # (a saved list: a tuple)
        for name in ("filter_zero_variance", "filter_overlong", "pack_sequences", "gradient_checkpointing",
                     "eval_before_training"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be True or False, got {getattr(self, name)!r}", field=name)
        if self.compile_scope not in COMPILE_SCOPES:
            raise ConfigError(f"compile_scope must be one of {', '.join(COMPILE_SCOPES)}; got {self.compile_scope!r}",
                              field="compile_scope")
        for name in ("compile", "checkpoint_mlp"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
                raise ConfigError(f"compile and checkpoint_mlp must be True, False or None (auto: on CUDA); "
                                  f"got compile={self.compile!r}, checkpoint_mlp={self.checkpoint_mlp!r}", field=name)
        # Integers and numbers of any kind (numpy's too) are stored as Python ints and floats, so the
        # config compares, prints and saves as JSON alike.
        for name, spec in self.__dataclass_fields__.items():
            value = getattr(self, name)
            if spec.type in ("int", int):
                if not is_int(value):
                    raise ConfigError(f"{name} must be an integer, got {value!r}", field=name)
                object.__setattr__(self, name, int(value))
        for name in ("learning_rate", "min_lr_ratio", "weight_decay", "temperature", "top_p", "max_grad_norm",
                     "clip_low", "clip_high", "clip_ratio_c", "kl_coef", "pcar_lambda", "pcar_delta", "lora_alpha",
                     "rollout_is_cap"):
            value = getattr(self, name)
            if not is_finite_real(value):
                raise ConfigError(f"{name} must be a finite number, got {value!r}", field=name)
            object.__setattr__(self, name, float(value))
        if self.old_logprobs not in OLD_LOGPROBS:
            raise ConfigError(f"old_logprobs must be one of {', '.join(OLD_LOGPROBS)}; got {self.old_logprobs!r}",
                              field="old_logprobs")
        if self.ratio_level not in RATIO_LEVELS:
            raise ConfigError(f"ratio_level must be one of {', '.join(RATIO_LEVELS)} (per-token PPO ratios, or "
                              f"GSPO's one per sequence); got {self.ratio_level!r}", field="ratio_level")
        if self.rollout_is_cap != 0 and self.rollout_is_cap < 1:
            raise ConfigError(f"rollout_is_cap must be 0 (off) or at least 1 (a cap below 1 would shrink every "
                              f"token's weight, not only the ones the sampler over-drew; 2.0 is usual), got "
                              f"{self.rollout_is_cap}", field="rollout_is_cap")
        if self.dtype not in (None, "float32", "bfloat16"):
            raise ConfigError(f"dtype must be None (auto), 'float32' or 'bfloat16', got {self.dtype!r} (float16 "
                              "would need loss scaling, which rftgym does not do)", field="dtype")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ConfigError(f"lr_schedule must be one of {', '.join(LR_SCHEDULES)}; got {self.lr_schedule!r}",
                              field="lr_schedule")
        if self.prefix_cache_mb is not None:
            object.__setattr__(self, "prefix_cache_mb", checked_megabytes(
                self.prefix_cache_mb, "prefix_cache_mb", "turns prefix reuse off; None keeps the policy's own"))
        if self.dist_timeout_s is not None:
            if not is_finite_real(self.dist_timeout_s) or not 0 < self.dist_timeout_s <= 1e7:
                raise ConfigError(f"dist_timeout_s must be a number of seconds in (0, 1e7] (or None: the process "
                                  f"group's default), got {self.dist_timeout_s!r}", field="dist_timeout_s")
            object.__setattr__(self, "dist_timeout_s", float(self.dist_timeout_s))
        if self.parallelism not in PARALLELISM:
            raise ConfigError(f"parallelism must be 'ddp' (every rank holds the whole model; the default, also for one "
                              f"process) or 'fsdp' (parameters, gradients and optimizer state sharded across ranks; "
                              f"needs a distributed launch: torchrun or accelerate launch); got {self.parallelism!r}",
                              field="parallelism")

    def _check_ranges(self) -> None:
        for name in ("steps", "tasks_per_step", "group_size", "max_new_tokens", "rollout_batch_size",
                     "epochs_per_step", "minibatch_size", "logprob_chunk_size", "save_every", "log_every",
                     "eval_episodes", "max_rollout_batches"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be a positive integer, got {getattr(self, name)!r}", field=name)
        for name, zero_means in (("eval_every", "no evaluation"), ("microbatch_size", "the whole minibatch at once"),
                                 ("microbatch_tokens", "off"), ("dcpo_segment_budget", "all segments"),
                                 ("keep_checkpoints", "every one"), ("log_episodes", "none"),
                                 ("max_prompt_tokens", "room for a reply in the model's context"),
                                 ("lora_rank", "full fine-tuning")):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be an int >= 0 (0 = {zero_means}), got {getattr(self, name)!r}",
                                  field=name)
        for name in ("seed", "eval_seed"):
            if not 0 <= getattr(self, name) < 2**63:
                raise ConfigError(f"{name} must be an int in [0, 2**63), got {getattr(self, name)!r}", field=name)
        if self.eval_seed + self.eval_episodes > 2**63:
            raise ConfigError(f"eval seeds run from eval_seed={self.eval_seed} for {self.eval_episodes} episodes, "
                              "past 2**63 - 1; lower eval_seed", field=("eval_seed", "eval_episodes"))
        if not 0 <= self.warmup_steps <= self.steps:
            raise ConfigError(f"warmup_steps must be an int in [0, steps] = [0, {self.steps}], got {self.warmup_steps!r}",
                              field="warmup_steps")
        # Bounds past which a run fails or wrecks the weights at its first update: an AdamW rate
        # above 1, lr x weight decay above 1 (each step would zero or flip every weight), numbers
        # beyond float32's range in the sampler and the ratio clip.
        if not 0 < self.learning_rate <= 1:
            raise ConfigError(f"learning_rate must be positive and at most 1 (AdamW rates are ~1e-7..1e-3), "
                              f"got {self.learning_rate}", field="learning_rate")
        if self.weight_decay < 0 or self.weight_decay * self.learning_rate > 1:
            raise ConfigError(f"weight_decay must be >= 0, with learning_rate x weight_decay at most 1 (AdamW "
                              f"shrinks every weight by that share per step), got {self.weight_decay}",
                              field="weight_decay")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"min_lr_ratio must be in [0, 1] (the final rate as a share of learning_rate), "
                              f"got {self.min_lr_ratio}", field="min_lr_ratio")
        if not MIN_TEMPERATURE <= self.temperature <= 1e6:
            raise ConfigError(f"temperature must be in [{MIN_TEMPERATURE:g}, 1e6] for RL sampling (greedy decoding "
                              f"has no log-probs to train on), got {self.temperature}", field="temperature")
        if not 1e-30 <= self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1] and at least 1e-30 (float32's range), got {self.top_p}",
                              field="top_p")
        if not 0 <= self.clip_low < 1:
            raise ConfigError(f"clip_low must be in [0, 1), got {self.clip_low}", field="clip_low")
        if not 0 <= self.clip_high <= 1e6:
            raise ConfigError(f"clip_high must be in [0, 1e6] (1e6: no upper clip), got {self.clip_high}",
                              field="clip_high")
        if not (self.clip_ratio_c == 0 or 1 < self.clip_ratio_c <= 1e6):
            raise ConfigError(f"clip_ratio_c must be 0 (off) or in (1, 1e6] (dual clip: the ratio past which a "
                              f"negative advantage's loss stops growing; verl uses 3), got {self.clip_ratio_c}",
                              field="clip_ratio_c")
        if not 0 <= self.kl_coef <= 1e3:
            raise ConfigError(f"kl_coef must be in [0, 1e3] (KL weights are ~1e-3..1e-1; a huge one overflows the "
                              f"loss), got {self.kl_coef}", field="kl_coef")
        if not 0 <= self.pcar_lambda <= 1e3:
            raise ConfigError(f"pcar_lambda must be in [0, 1e3] (the weight of a segment's standardized score in "
                              f"its advantage scale 1 + lambda * z), got {self.pcar_lambda}", field="pcar_lambda")
        if not 0 <= self.pcar_delta <= 1:
            raise ConfigError(f"pcar_delta must be in [0, 1] (the floor of a segment's advantage scale, which is 1 "
                              f"for an average score), got {self.pcar_delta}", field="pcar_delta")
        if self.max_grad_norm <= 0:
            raise ConfigError(f"max_grad_norm must be positive, got {self.max_grad_norm}", field="max_grad_norm")
        if not 0 < self.lora_alpha <= 1e5:
            raise ConfigError(f"lora_alpha must be positive and at most 1e5 (the adapters' output is scaled by "
                              f"lora_alpha / lora_rank; common values are 8..128), got {self.lora_alpha}",
                              field="lora_alpha")

    def _check_combinations(self) -> None:
        if self.group_size < 2 and self.algo != "rft":
            raise ConfigError(f"group_size must be at least 2 for {self.algo} (advantages compare samples of a task)",
                              field=("group_size", "algo"))
        if self.algo == "rft":
            # Rejection-sampling fine-tuning is supervised learning on the successful episodes:
            # settings of the policy-gradient loss would be silently ignored.
            defaults = {name: spec.default for name, spec in self.__dataclass_fields__.items()}
            ignored = [(text, name) for text, name, on in (
                (f"kl_coef={self.kl_coef}", "kl_coef", self.kl_coef > 0),
                ("filter_overlong=True", "filter_overlong", self.filter_overlong),
                ("old_logprobs='recompute'", "old_logprobs", self.old_logprobs == "recompute"),
                (f"ratio_level={self.ratio_level!r}", "ratio_level", self.ratio_level != "token"),
                (f"rollout_is_cap={self.rollout_is_cap}", "rollout_is_cap", self.rollout_is_cap != 0),
                (f"clip_low={self.clip_low}", "clip_low", self.clip_low != defaults["clip_low"]),
                (f"clip_high={self.clip_high}", "clip_high", self.clip_high != defaults["clip_high"]),
                (f"clip_ratio_c={self.clip_ratio_c}", "clip_ratio_c", self.clip_ratio_c != 0),
                ("filter_zero_variance=False", "filter_zero_variance", not self.filter_zero_variance)) if on]
            if ignored:
                raise ConfigError(f"algo='rft' maximises the successful episodes' log-likelihood, with no reference, "
                                  f"ratio or advantage; it has no use for {', '.join(t for t, _ in ignored)}: drop "
                                  "those settings, or choose a policy-gradient algo",
                                  field=("algo", *(name for _, name in ignored)))
        # A setting that only one mode reads, set away from its default in another mode, would be
        # silently ignored: the run would not be the one asked for.
        algo = f"algo={self.algo!r}"
        for name, used, where, this_run in (
                ("pcar_lambda", self.algo == "pcar", "algo='pcar'", algo),
                ("pcar_delta", self.algo == "pcar", "algo='pcar'", algo),
                ("dcpo_segment_budget", self.algo == "dcpo", "algo='dcpo'", algo),
                ("max_rollout_batches", self.filter_zero_variance and self.algo != "rft",
                 "filter_zero_variance=True and a policy-gradient algo (it refills the groups that filter drops)",
                 "algo='rft'" if self.algo == "rft" else "filter_zero_variance=False"),
                ("rollout_is_cap", self.old_logprobs == "recompute", "old_logprobs='recompute' (the training "
                 "forward's log-probs are what the sampler's are weighed against)", f"old_logprobs={self.old_logprobs!r}"),
                ("lora_alpha", self.lora_rank > 0, "LoRA (lora_rank > 0)", "lora_rank=0 (full fine-tuning)"),
                ("compile_scope", self.compile is not False, "compile on (or auto)", "compile=False"),
                ("eval_episodes", self.eval_every > 0, "eval_every > 0", "eval_every=0 (no evaluation)"),
                ("eval_seed", self.eval_every > 0, "eval_every > 0", "eval_every=0 (no evaluation)"),
                ("eval_env_kwargs", self.eval_every > 0, "eval_every > 0", "eval_every=0 (no evaluation)"),
                ("eval_before_training", self.eval_every > 0, "eval_every > 0", "eval_every=0 (no evaluation)"),
                ("min_lr_ratio", self.lr_schedule != "constant", "a linear or cosine lr_schedule",
                 "lr_schedule='constant'")):
            if not used and getattr(self, name) != _default(name):
                raise UnreadSetting(f"{name}={getattr(self, name)!r} is only read with {where}, and this run has "
                                    f"{this_run}; drop {name}, or set what it belongs to", field=name)
        if self.microbatch_size > self.minibatch_size:
            raise UnreadSetting(f"microbatch_size={self.microbatch_size} is larger than minibatch_size="
                                f"{self.minibatch_size}: a pass never holds more than one minibatch; set it at most "
                                "minibatch_size (or 0: the whole minibatch at once)", field="microbatch_size")
        if self.microbatch_size and self.microbatch_tokens:
            raise ConfigError(f"microbatch_size={self.microbatch_size} and microbatch_tokens={self.microbatch_tokens} "
                              "are two ways to size a forward/backward pass; set one of them",
                              field=("microbatch_size", "microbatch_tokens"))
        if self.parallelism == "fsdp" and self.dtype == "bfloat16":
            raise ConfigError(f"dtype={self.dtype!r} with parallelism='fsdp' would step the optimizer on 16-bit "
                              "weights; leave dtype unset (on CUDA FSDP then computes in bfloat16 over float32 "
                              "master weights)", field=("dtype", "parallelism"))
        if self.parallelism == "fsdp" and self.compile:
            raise ConfigError("compile is not supported with parallelism='fsdp' yet; leave it unset "
                              "(auto skips it under FSDP) or set it to False", field=("compile", "parallelism"))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TrainConfig":
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown TrainConfig fields {unknown}; valid fields: {', '.join(sorted(known))}",
                              field=tuple(unknown))
        return cls(**data)

    @classmethod
    def from_saved(cls, data: dict[str, Any]) -> "TrainConfig":
        """A saved run's config (``state.json``): fields this version does not know are dropped, and
        a setting the run never read, which a later version refuses (:class:`UnreadSetting`), is set
        back to its default, so that a run saved before stays loadable (to export or evaluate it)."""
        data = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        for _ in range(len(cls.__dataclass_fields__)):
            try:
                return cls(**data)
            except UnreadSetting as exc:
                for name in exc.fields:
                    data[name] = _default(name)
        return cls(**data)
