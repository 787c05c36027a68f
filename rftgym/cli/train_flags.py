"""``rftgym train``'s flags: one for each TrainConfig field, with its defaults and help."""

from __future__ import annotations

import argparse


AUTO_SWITCH = {"auto": None, "on": True, "off": False}


def _train_flags() -> list[tuple[str, str, dict]]:
    """``(flag, TrainConfig field, argparse options)`` for ``rftgym train``; defaults are TrainConfig's.
    The env id, ``--env-arg``, ``--seed`` and ``--output-dir``'s default are set apart."""
    from ..train.config import (AGGREGATION_NAMES, ALGORITHMS, COMPILE_SCOPES, OLD_LOGPROBS, PARALLELISM, RATIO_LEVELS,
                                TrainConfig)
    from ..train.schedule import LR_SCHEDULES

    d = TrainConfig  # the dataclass's defaults
    run, sampling, optim, algo, model = ("run", "sampling", "optimisation", "algorithm-specific", "model and runtime")

    def opt(group, default, help_text, **options):
        kind = {"type": type(default)} if isinstance(default, (int, float)) and not isinstance(default, bool) else {}
        shown = "" if default is None else " (default: %(default)s)"
        return {"group": group, "default": default, "help": help_text + shown, **kind, **options}

    return [
        ("--algo", "algo", opt(run, d.algo, "algorithm", choices=ALGORITHMS)),
        ("--model", "model", opt(run, d.model, "local Hugging Face model directory (default model: SmolLM2-135M-Instruct)")),
        ("--output-dir", "output_dir", opt(run, None, "where metrics, the PNG and checkpoints go "
                                                      "(runs/train/<env>-<algo> when unset; with --resume and "
                                                      "no --algo, the env's one run there)")),
        ("--steps", "steps", opt(run, d.steps, "training steps")),
        ("--save-every", "save_every", opt(run, d.save_every, "checkpoint every N steps (and after the last)")),
        ("--keep-checkpoints", "keep_checkpoints", opt(run, d.keep_checkpoints, "checkpoints kept, the latest "
                                                                                "included (0 = every one); earlier "
                                                                                "ones stay as checkpoint-<step>/")),
        ("--log-every", "log_every", opt(run, d.log_every, "write metrics every N steps (and the last): "
                                                             "each row the mean of the steps since the last "
                                                             "(*_min, *_max their least and greatest)")),
        ("--log-episodes", "log_episodes", opt(run, d.log_episodes, "on each logged step, write its first N episodes "
                                                                   "(what the policy wrote, turn by turn, and the "
                                                                   "rewards) to episodes/step-<step>.jsonl")),
        ("--eval-every", "eval_every", opt(run, d.eval_every, "every N steps (and after the last) play --eval-episodes "
                                                             "greedy episodes and log eval_reward_mean (0 = never)")),
        ("--eval-episodes", "eval_episodes", opt(run, d.eval_episodes, "episodes per evaluation")),
        ("--eval-seed", "eval_seed", opt(run, d.eval_seed, "seed of the first evaluation episode (the same "
                                                           "episodes as rftgym eval --seed N)")),
        ("--eval-env-arg", "eval_env_kwargs", opt(run, None, "env option of the evaluation's episodes, over "
                                                             "--env-arg's (e.g. a held-out dataset_path=FILE); "
                                                             "repeatable", action="append", metavar="KEY=VALUE")),
        ("--eval-before-training", "eval_before_training", opt(
            run, d.eval_before_training, "also evaluate before the first step (a new run's), logged as step 0: the "
            "baseline the curve starts from", action=argparse.BooleanOptionalAction)),
        ("--tasks-per-step", "tasks_per_step", opt(sampling, d.tasks_per_step, "tasks sampled per step")),
        ("--group-size", "group_size", opt(sampling, d.group_size, "samples per task (G)")),
        ("--max-new-tokens", "max_new_tokens", opt(sampling, d.max_new_tokens, "token limit of one assistant turn")),
        ("--max-prompt-tokens", "max_prompt_tokens", opt(sampling, d.max_prompt_tokens, "the longest prompt answered; "
                                                         "a longer one ends its episode as truncated (0 = room for "
                                                         "a reply in the model's context)")),
        ("--temperature", "temperature", opt(sampling, d.temperature, "sampling temperature")),
        ("--top-p", "top_p", opt(sampling, d.top_p, "nucleus sampling threshold")),
        ("--stop", "stop", opt(sampling, None, "a string that ends a reply, kept with the token that completes it "
                                               "(e.g. '</search>', so that the env's results follow a search); "
                                               "repeatable", action="append", metavar="STRING")),
        ("--rollout-batch-size", "rollout_batch_size", opt(sampling, d.rollout_batch_size,
                                                           "episodes run side by side")),
        ("--prefix-cache-mb", "prefix_cache_mb", opt(sampling, d.prefix_cache_mb, "memory for reusing the states "
                                                     "of prompt tokens the model already ran, on the generic "
                                                     "decode loop (CPU); 0 = off (default: the policy's, 1024)",
                                                     type=float)),
        ("--lr", "learning_rate", opt(optim, d.learning_rate, "peak learning rate")),
        ("--lr-schedule", "lr_schedule", opt(optim, d.lr_schedule, "after the warm-up", choices=LR_SCHEDULES)),
        ("--warmup-steps", "warmup_steps", opt(optim, d.warmup_steps, "linear warm-up steps")),
        ("--min-lr-ratio", "min_lr_ratio", opt(optim, d.min_lr_ratio, "a decaying schedule's final rate, as a "
                                                                     "share of --lr")),
        ("--weight-decay", "weight_decay", opt(optim, d.weight_decay, "AdamW weight decay")),
        ("--epochs", "epochs_per_step", opt(optim, d.epochs_per_step, "passes over each step's samples")),
        ("--minibatch-size", "minibatch_size", opt(optim, d.minibatch_size, "samples per optimizer step on each "
                                                                           "process (N processes: N x this many)")),
        ("--microbatch-size", "microbatch_size", opt(optim, d.microbatch_size, "gradient accumulation: forward/"
                                                     "backward this many samples at a time (0 = the whole minibatch)")),
        ("--microbatch-tokens", "microbatch_tokens", opt(
            optim, d.microbatch_tokens, "gradient accumulation by tokens: a forward/backward pass computes at most "
                                        "this many tokens, padding included (0 = off; instead of --microbatch-size)")),
        ("--pack-sequences", "pack_sequences", opt(
            optim, d.pack_sequences, "several samples per row, so the update computes no padding (the same "
                                     "gradient)", action=argparse.BooleanOptionalAction)),
        ("--max-grad-norm", "max_grad_norm", opt(optim, d.max_grad_norm, "gradient clipping norm")),
        ("--clip-low", "clip_low", opt(optim, d.clip_low, "PPO ratio clipped below at 1 - clip_low")),
        ("--clip-high", "clip_high", opt(optim, d.clip_high, "PPO ratio clipped above at 1 + clip_high "
                                                             "(set above --clip-low, it is DAPO's clip-higher)")),
        ("--clip-ratio-c", "clip_ratio_c", opt(optim, d.clip_ratio_c, "dual clip: with a negative advantage the "
                                               "loss stops growing past this ratio (0: off; verl uses 3)")),
        ("--ratio-level", "ratio_level", opt(optim, d.ratio_level, "PPO ratio per token, or one per sequence (GSPO: "
                                             "the geometric mean of its token ratios; use a narrow clip, e.g. "
                                             "--clip-low 3e-4 --clip-high 4e-4)", choices=RATIO_LEVELS)),
        ("--aggregation", "aggregation", opt(optim, d.aggregation, "how token losses reduce to one",
                                             choices=AGGREGATION_NAMES)),
        ("--kl-coef", "kl_coef", opt(optim, d.kl_coef, "k3 KL to the initial model (0: no reference)")),
        ("--filter-zero-variance", "filter_zero_variance", opt(
            optim, d.filter_zero_variance, "skip groups whose rewards are all equal (DAPO dynamic sampling's "
            "filter; see --max-rollout-batches for sampling more in their place)",
            action=argparse.BooleanOptionalAction)),
        ("--max-rollout-batches", "max_rollout_batches", opt(
            optim, d.max_rollout_batches, "DAPO dynamic sampling: while fewer than --tasks-per-step groups have "
            "rewards that vary, roll out that many more tasks, up to this many rollouts a step, and train on the "
            "first --tasks-per-step that vary (1: no refill)")),
        ("--filter-overlong", "filter_overlong", opt(
            optim, d.filter_overlong, "mask episodes whose last reply was cut by --max-new-tokens or "
                                                  "that ran out of context (DAPO overlong filtering)",
            action=argparse.BooleanOptionalAction)),
        ("--old-logprobs", "old_logprobs", opt(optim, d.old_logprobs, "the PPO ratio's old log-probs: as sampled, or "
                                               "recomputed by the training forward pass", choices=OLD_LOGPROBS)),
        ("--rollout-is-cap", "rollout_is_cap", opt(optim, d.rollout_is_cap, "with --old-logprobs recompute: weight "
                                                   "each token's loss by min(pi_train / pi_rollout, this) (truncated "
                                                   "importance sampling; 0 = off, 2 is usual)")),
        ("--logprob-chunk-size", "logprob_chunk_size", opt(optim, d.logprob_chunk_size,
                                                           "tokens per chunk of the vocabulary projection")),
        ("--pcar-lambda", "pcar_lambda", opt(algo, d.pcar_lambda, "PCAR: weight of the segment's evaluation score")),
        ("--pcar-delta", "pcar_delta", opt(algo, d.pcar_delta, "PCAR: floor of a segment's advantage scale")),
        ("--dcpo-segment-budget", "dcpo_segment_budget", opt(algo, d.dcpo_segment_budget,
                                                             "DCPO: segments trained per group (0 = all)")),
        ("--lora-rank", "lora_rank", opt(model, d.lora_rank, "LoRA rank (0 = full fine-tuning)")),
        ("--lora-alpha", "lora_alpha", opt(model, d.lora_alpha, "LoRA alpha")),
        ("--gradient-checkpointing", "gradient_checkpointing", opt(
            model, d.gradient_checkpointing, "recompute each decoder layer in the backward pass",
            action=argparse.BooleanOptionalAction)),
        ("--compile", "compile", opt(model, "auto", "torch.compile each decoder layer for the update "
                                                    "(auto: on CUDA only)", choices=tuple(AUTO_SWITCH))),
        ("--compile-scope", "compile_scope", opt(model, d.compile_scope, "what one compiled graph covers: each "
                                                 "decoder layer, or the whole decoder (less host work per forward, "
                                                 "a longer first compile)", choices=COMPILE_SCOPES)),
        ("--checkpoint-mlp", "checkpoint_mlp", opt(model, "auto", "recompute each MLP in the backward pass: about "
                                                   "half the activation memory (auto: on CUDA only)",
                                                   choices=tuple(AUTO_SWITCH))),
        ("--dtype", "dtype", opt(model, "auto", "the model's weights (auto: float32, with bfloat16 autocast on CUDA; "
                                                "bfloat16 keeps float32 master weights in the optimizer)",
                                 choices=("auto", "float32", "bfloat16"))),
        ("--device", "device", opt(model, d.device, "torch device (unset: cuda if available, else cpu)")),
        ("--parallelism", "parallelism", opt(model, d.parallelism, "under torchrun / accelerate launch: ddp "
                                             "replicates the model on every process, fsdp shards parameters, "
                                             "gradients and optimizer state", choices=PARALLELISM)),
        ("--dist-timeout", "dist_timeout_s", opt(model, d.dist_timeout_s, "under a launcher: seconds a process "
                                                 "waits for the others in a collective before the run stops with an "
                                                 "error (unset: PyTorch's default, 30 minutes on CPU, 10 on CUDA); set it "
                                                 "above a step's "
                                                 "slowest rollout", type=float, metavar="SECONDS")),
    ]


TRAIN_FLAGS = _train_flags()
