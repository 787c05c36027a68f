"""The trainer's configuration: one frozen dataclass, validated on construction."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from ..core.errors import ConfigError
from .schedule import LR_SCHEDULES

ALGORITHMS = ("grpo", "dr_grpo", "rloo", "pcar", "dcpo", "rft")
AGGREGATION_NAMES = ("token_mean", "sequence_mean", "constant_normalizer")
# PCAR and DCPO rescale or spread a group advantage; this is the estimator they start from.
PARALLELISM = ("ddp", "fsdp")
OLD_LOGPROBS = ("rollout", "recompute")
BASE_ESTIMATOR = {"grpo": "grpo", "dr_grpo": "dr_grpo", "rloo": "rloo", "pcar": "grpo", "dcpo": "grpo", "rft": None}


@dataclass(frozen=True)
class TrainConfig:
    env_id: str = "rftgym/VerifiableQA-v0"
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    algo: str = "grpo"
    model: str | None = None  # None: the default SmolLM2-135M-Instruct; else a local HF directory
    output_dir: str = "runs/train"

    # sampling
    steps: int = 20
    tasks_per_step: int = 4
    group_size: int = 8
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    rollout_batch_size: int = 32

    # optimisation
    learning_rate: float = 1e-5
    # The rate of each step (rftgym/train/schedule.py): linear warm-up over warmup_steps steps,
    # then constant, or a linear or cosine decay to learning_rate * min_lr_ratio.
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0
    weight_decay: float = 0.0
    epochs_per_step: int = 1
    minibatch_size: int = 16  # sequences (segments) per optimizer step
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
    aggregation: str = "token_mean"
    kl_coef: float = 0.0  # > 0 adds k3 KL to a frozen reference (the base model when LoRA is on)
    logprob_chunk_size: int = 1024
    # The PPO ratio's old log-probs: "rollout" (recorded while sampling) or "recompute" (the
    # training forward pass before the update, as verl does; removes the decode/training kernel
    # gap from the ratio, at one extra forward pass per step).
    old_logprobs: str = "rollout"
    filter_zero_variance: bool = True  # DAPO dynamic sampling: groups with equal rewards are skipped
    filter_overlong: bool = False  # DAPO overlong filtering: replies cut by max_new_tokens are masked

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
    # Update-phase speed (rftgym/train/speed.py): compile each decoder layer, and recompute each
    # MLP in the backward pass (None = on CUDA, off on CPU). Measured on an H200 at 64 x 384
    # tokens: compiled 14.7% MFU / 15.4 GB peak, compiled + MLP recompute 15.5% / 8.0 GB.
    compile: bool | None = None
    checkpoint_mlp: bool | None = None
    device: str | None = None  # default: cuda if available, else cpu
    # None: on CUDA float32 weights with bfloat16 autocast, on CPU float32. "bfloat16" holds the
    # model in bf16, with float32 master copies in the optimizer.
    dtype: str | None = None
    seed: int = 0
    save_every: int = 10
    # Evaluation during training: every eval_every steps (0 = never) and after the last, the
    # policy plays eval_episodes episodes greedily, with seeds eval_seed, eval_seed + 1, ... (the
    # episodes of `rftgym eval --seed eval_seed --episodes eval_episodes`), so that the curve
    # follows the same tasks from step to step.
    eval_every: int = 0
    eval_episodes: int = 32
    eval_seed: int = 0
    log_every: int = 1  # metrics.jsonl / TensorBoard get every log_every-th step (and the last)

    def __post_init__(self) -> None:
        if self.algo not in ALGORITHMS:
            raise ConfigError(f"algo must be one of {', '.join(ALGORITHMS)}; got {self.algo!r}")
        if self.aggregation not in AGGREGATION_NAMES:
            raise ConfigError(f"aggregation must be one of {', '.join(AGGREGATION_NAMES)}; got {self.aggregation!r}")
        positive = ("steps", "tasks_per_step", "group_size", "max_new_tokens", "rollout_batch_size",
                    "epochs_per_step", "minibatch_size", "logprob_chunk_size", "save_every", "log_every")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(self.eval_every, int) or isinstance(self.eval_every, bool) or self.eval_every < 0:
            raise ConfigError(f"eval_every must be an int >= 0 (0 = no evaluation), got {self.eval_every!r}")
        if not isinstance(self.eval_episodes, int) or isinstance(self.eval_episodes, bool) or self.eval_episodes < 1:
            raise ConfigError(f"eval_episodes must be a positive integer, got {self.eval_episodes!r}")
        for name in ("seed", "eval_seed"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**63:
                raise ConfigError(f"{name} must be an int in [0, 2**63), got {value!r}")
        if self.eval_seed + self.eval_episodes > 2**63:
            raise ConfigError(f"eval seeds run from eval_seed={self.eval_seed} for {self.eval_episodes} episodes, "
                              "past 2**63 - 1; lower eval_seed")
        if self.group_size < 2 and self.algo != "rft":
            raise ConfigError(f"group_size must be at least 2 for {self.algo} (advantages compare samples of a task)")
        numbers = ("learning_rate", "min_lr_ratio", "weight_decay", "temperature", "top_p", "max_grad_norm", "clip_low",
                   "clip_high", "kl_coef", "pcar_lambda", "pcar_delta", "lora_alpha")
        for name in numbers:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ConfigError(f"{name} must be a finite number, got {value!r}")
        if self.learning_rate <= 0:
            raise ConfigError(f"learning_rate must be positive, got {self.learning_rate}")
        if self.weight_decay < 0:
            raise ConfigError(f"weight_decay must be >= 0, got {self.weight_decay}")
        if self.lora_alpha <= 0:
            raise ConfigError(f"lora_alpha must be positive, got {self.lora_alpha}")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ConfigError(f"lr_schedule must be one of {', '.join(LR_SCHEDULES)}; got {self.lr_schedule!r}")
        if not isinstance(self.warmup_steps, int) or isinstance(self.warmup_steps, bool) \
                or not 0 <= self.warmup_steps <= self.steps:
            raise ConfigError(f"warmup_steps must be an int in [0, steps] = [0, {self.steps}], got {self.warmup_steps!r}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"min_lr_ratio must be in [0, 1] (the final rate as a share of learning_rate), "
                              f"got {self.min_lr_ratio}")
        if self.temperature <= 0:
            raise ConfigError(f"temperature must be positive for RL sampling, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.clip_low < 1 or self.clip_high < 0:
            raise ConfigError(f"clip_low must be in [0, 1) and clip_high >= 0; got {self.clip_low}, {self.clip_high}")
        if self.kl_coef < 0:
            raise ConfigError(f"kl_coef must be >= 0, got {self.kl_coef}")
        if self.pcar_lambda < 0 or self.pcar_delta < 0:
            raise ConfigError(f"pcar_lambda and pcar_delta must be >= 0; got {self.pcar_lambda}, {self.pcar_delta}")
        if self.dcpo_segment_budget < 0:
            raise ConfigError(f"dcpo_segment_budget must be >= 0 (0 = all segments), got {self.dcpo_segment_budget}")
        if self.lora_rank < 0:
            raise ConfigError(f"lora_rank must be >= 0 (0 = full fine-tuning), got {self.lora_rank}")
        if self.max_grad_norm <= 0:
            raise ConfigError(f"max_grad_norm must be positive, got {self.max_grad_norm}")
        if self.parallelism not in PARALLELISM:
            raise ConfigError(f"parallelism must be 'ddp' (every rank holds the whole model; the default, also for one "
                              f"process) or 'fsdp' (parameters, gradients and optimizer state sharded across ranks; "
                              f"needs a distributed launch: torchrun or accelerate launch); got {self.parallelism!r}")
        if not isinstance(self.microbatch_size, int) or isinstance(self.microbatch_size, bool) \
                or self.microbatch_size < 0:
            raise ConfigError(f"microbatch_size must be an int >= 0 (0 = the whole minibatch at once), "
                              f"got {self.microbatch_size!r}")
        if not isinstance(self.microbatch_tokens, int) or isinstance(self.microbatch_tokens, bool) \
                or self.microbatch_tokens < 0:
            raise ConfigError(f"microbatch_tokens must be an int >= 0 (0 = off), got {self.microbatch_tokens!r}")
        if self.microbatch_size and self.microbatch_tokens:
            raise ConfigError(f"microbatch_size={self.microbatch_size} and microbatch_tokens={self.microbatch_tokens} "
                              "are two ways to size a forward/backward pass; set one of them")
        if self.compile not in (None, True, False) or self.checkpoint_mlp not in (None, True, False):
            raise ConfigError(f"compile and checkpoint_mlp must be True, False or None (auto: on CUDA); "
                              f"got compile={self.compile!r}, checkpoint_mlp={self.checkpoint_mlp!r}")
        if self.old_logprobs not in OLD_LOGPROBS:
            raise ConfigError(f"old_logprobs must be one of {', '.join(OLD_LOGPROBS)}; got {self.old_logprobs!r}")
        if self.dtype not in (None, "float32", "bfloat16"):
            raise ConfigError(f"dtype must be None (auto), 'float32' or 'bfloat16', got {self.dtype!r} (float16 "
                              "would need loss scaling, which rftgym does not do)")
        if self.parallelism == "fsdp" and self.dtype == "bfloat16":
            raise ConfigError(f"dtype={self.dtype!r} with parallelism='fsdp' would step the optimizer on 16-bit "
                              "weights; leave dtype unset (on CUDA FSDP then computes in bfloat16 over float32 "
                              "master weights)")
        if self.parallelism == "fsdp" and self.compile:
            raise ConfigError("compile is not supported with parallelism='fsdp' yet; leave it unset "
                              "(auto skips it under FSDP) or set it to False")
        if not isinstance(self.env_kwargs, dict):
            raise ConfigError("env_kwargs must be a dict of environment options")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TrainConfig":
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown TrainConfig fields {unknown}; valid fields: {', '.join(sorted(known))}")
        return cls(**data)
