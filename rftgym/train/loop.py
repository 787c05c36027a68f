"""The training loop: sample tasks -> roll out G episodes each -> advantages -> update -> log.

Read top to bottom: :func:`train` is the whole algorithm; the helpers below it are the model
plumbing (LoRA, reference policy, log-probs of a batch) and one optimisation pass.
"""

from __future__ import annotations

import copy
import math
import os
import sys
import time
import warnings
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path

import gymnasium as gym
import numpy as np
import torch

from ..agents.hf_policy import HFPolicy, SamplingConfig
from ..agents.sampling_keys import training_keys
from ..core.errors import ConfigError, EnvContractError, TrainingError, require, warn_caller
from ..core.values import is_int
from ..envs.common import env_metadata, with_policy_options, with_training_defaults
from ..rollout import RolloutConfig, run_episodes
from .batching import (
    PROCESS_SCORE_KEY,
    PROCESS_SPLIT_KEY,
    TrainSample,
    build_samples,
    collate,
    group_episodes,
    tokens_covering,
)
from .base_model import base_fingerprint, files_fingerprint, load_dtype
from .checkpoint import (
    OutputLock,
    RunFootprint,
    check_base_model,
    check_base_model_early,
    check_checkpoint_files,
    check_output_dir,
    check_world_size,
    checkpoint_state,
    load_checkpoint,
    resume_notes,
    save_checkpoint,
    saved_rng_states,
    saved_state,
)
from .config import TrainConfig
from .distributed import (
    Distributed,
    ShardedModel,
    full_parameters,
    full_tensor,
    shard_model,
)
from .evaluation import evaluate_policy
from .failed_rollouts import keeping_episodes_of_failed_samples, keeping_finished_episodes
from .losses import aggregate, policy_loss, token_mean
from .master_weights import gradient_tensors, needs_master_weights
from .metrics_log import MetricsLog, plot_learning_curve
from .microbatches import plan_passes
from .packing import collate_packed
from .schedule import learning_rate_at
from .speed import (
    SpeedConfig,
    apply_training_speedups,
    is_right_padded,
    make_optimizer,
    tag_right_padding,
)
from .stopping import LaunchStops, finishing_the_step, keeping_finished_steps, say
from .token_logprobs import chunked_token_logprobs, logit_transform


def segment_seed(seed: int, rank: int) -> int:
    """The seed of a rank's generator for DCPO segment picks and minibatch shuffles: drawn from
    (seed, rank) apart from the sampler's ``seed + rank``, since two CPU generators seeded alike
    give the same numbers, so picks and sampled tokens would be correlated."""
    return int(np.random.SeedSequence([seed, rank, 1]).generate_state(1, np.uint64)[0] >> 1)


def train(config: TrainConfig, *, policy: HFPolicy | None = None, resume: bool = False,
          make_env: Callable[[], gym.Env] | None = None,
          on_step: Callable[[dict], None] | None = None) -> list[dict]:
    """Run ``config.steps`` steps of ``config.algo``; return the per-step metrics, each row's
    ``"step"`` the step's number as the user sees it (1 for the first step; a resumed run's first
    row is the checkpoint's step + 1). ``on_step``: called on the writing rank with each step's
    metrics (the returned list's entry) as soon as the step is done, e.g. to show progress."""
    out = Path(config.output_dir)
    fsdp = config.parallelism == "fsdp"
    if fsdp and "RANK" not in os.environ:
        raise ConfigError("parallelism='fsdp' needs a distributed launch, e.g. torchrun --nproc_per_node=2 "
                          "-m rftgym.cli train ... (or accelerate launch); one plain process uses 'ddp'")
    # One process unless started by torchrun / accelerate launch.
    ranks = Distributed.from_env(config.device, process_group_for_one=fsdp, timeout_s=config.dist_timeout_s)
    if config.tasks_per_step % ranks.world_size:
        raise ConfigError(f"tasks_per_step ({config.tasks_per_step}) must be a multiple of the number of "
                          f"processes ({ranks.world_size}) so that every rank rolls out the same number of tasks",
                          field="tasks_per_step")
    # The writing rank checks the output directory and locks it; every rank then stops alike if
    # it may not be used (a rank that went on alone would wait forever at its first collective).
    # What it adds there is noted first: a run that stops before any result leaves nothing behind.
    lock, refusal, footprint = None, None, None
    if ranks.is_main:
        footprint = RunFootprint(out)
        try:
            check_output_dir(out, resume)
            try:
                out.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise ConfigError(f"cannot create the output directory {out}: {exc.strerror or exc}") from None
            try:
                lock = OutputLock(out)
            except OSError as exc:  # every rank must hear of it, not wait at the gather below
                raise TrainingError(f"cannot lock the output directory {out}: {exc.strerror or exc}") from None
        except (ConfigError, TrainingError) as exc:  # bad input, or a lock file that cannot be written
            refusal = (type(exc) is TrainingError, str(exc))
            footprint.remove_unless_results(held_lock=False)
    refusal = ranks.gather_objects(refusal)[0]
    if refusal is not None:
        unwritable, message = refusal
        raise ranks.every_rank((TrainingError if unwritable else ConfigError)(message))
    try:
        saved = saved_state(out) if resume else None
        saved_rng = None
        if saved is not None:
            check_checkpoint_files(out)  # each file there
        # Before any model loads, and what cannot be mended first: a run told to add steps would
        # only then learn that it may not resume this checkpoint at all, or not with this launch.
        notes = resume_notes(saved, config) if resume else []
        if saved is not None:
            saved_rng = saved_rng_states(out, saved)  # given to the load, like saved: not read again
            check_world_size(len(saved_rng["ranks"]), ranks, out)
        # The base model's fingerprint as its files give it, before it loads (None for a policy passed in).
        from_files = files_fingerprint(config.model, load_dtype(config)) if policy is None else None
        if saved is not None:
            check_base_model_early(saved, from_files, config)
        if saved is not None and saved["step"] >= config.steps:
            raise ConfigError(f"the checkpoint in {out} is already at step {saved['step']} and this run has "
                              f"{config.steps} steps; pass more steps (e.g. --steps {saved['step'] + config.steps}) "
                              "to continue it")
        if saved is not None:  # the files its save wrote (read whole: after the quick refusals above)
            check_checkpoint_files(out, saved, already=("rng.pt",))  # (saved_rng_states verified that one)
        if ranks.is_main:
            for note in notes:
                print(note, file=sys.stderr)
        return _train(config, policy, saved, saved_rng, make_env, ranks, footprint, on_step, from_files)
    except BaseException:
        if footprint is not None:  # while the lock is held, so that no other run starts in between
            footprint.remove_unless_results()
        raise
    finally:
        if lock is not None:
            lock.release()


def _train(config: TrainConfig, policy: HFPolicy | None, saved: dict | None, saved_rng: dict | None, make_env,
           ranks: Distributed, footprint: RunFootprint | None = None,
           on_step: Callable[[dict], None] | None = None, from_files: str | None = None) -> list[dict]:
    """The run itself; ``saved`` and ``saved_rng``: the state and the random states (checked) of
    the checkpoint it resumes (None for a new run); ``footprint`` (the writing rank's) learns when
    the run has written a result; ``from_files``: the base model's fingerprint as its files gave
    it (base_model.files_fingerprint)."""
    out = Path(config.output_dir)
    fsdp = config.parallelism == "fsdp"
    torch.manual_seed(config.seed)
    device = ranks.device(config.device) or ("cuda" if torch.cuda.is_available() else "cpu")
    # On a GPU the default is mixed precision: float32 master weights (AdamW steps of ~1e-5 vanish
    # in bfloat16) with bfloat16 autocast for rollouts and updates alike, so old and new log-probs
    # are computed the same way.
    mixed = device.startswith("cuda") and config.dtype is None
    policy = policy or HFPolicy.from_pretrained(config.model, device=device, dtype=load_dtype(config))
    mixed = mixed and policy.device.type == "cuda"
    # Seeded and keyed: an episode's samples depend on the seed, the step, its task and its turn,
    # not on the rollout batch size or the number of ranks (rftgym.agents.sampling_keys).
    sampling = SamplingConfig(max_new_tokens=config.max_new_tokens, temperature=config.temperature,
                              top_p=config.top_p, max_batch_size=config.rollout_batch_size,
                              max_prompt_tokens=config.max_prompt_tokens or None, seed=config.seed)
    policy.prompt_limit(sampling)  # a reply longer than the model's context: refused before any work
    if make_env is None:
        # An env's token budget counts with the policy's tokenizer, as in `rftgym eval`; options an env asks
        # of training (CodeTCG: a sandbox that isolates) are set unless given.
        metadata = env_metadata(config.env_id)
        env_kwargs = with_training_defaults(metadata, with_policy_options(metadata, config.env_kwargs, policy))
        make_env = lambda: gym.make(config.env_id, **env_kwargs)  # noqa: E731
    base_model = base_fingerprint(policy.model)
    base_model_path = str(Path(config.model).expanduser().resolve()) if config.model not in (None, "default") \
        and Path(config.model).expanduser().is_dir() else None
    if saved is not None:  # before anything is built on the weights
        check_base_model(saved, base_model, config)
    # Its checkpoints say whether the files told the fingerprint: their resumes are then checked at once.
    base_model_from_files = from_files == base_model
    weights_dtype = next(policy.model.parameters()).dtype
    if config.dtype is not None and weights_dtype != getattr(torch, config.dtype):
        raise ConfigError(f"dtype={config.dtype!r}, but the policy passed in holds {weights_dtype} weights; convert "
                          f"it first (policy.model.to(torch.{config.dtype})) or leave dtype unset")
    if fsdp and needs_master_weights(policy.model.parameters()):
        raise ConfigError("the policy's weights are 16-bit, and FSDP would step the optimizer on them; pass a "
                          "float32 policy (on CUDA FSDP then computes in bfloat16 over float32 weights)")
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if mixed else nullcontext
    model = prepare_model(policy, config, autocast)
    reference = make_reference(model, config)  # copied before sharding: FSDP modules cannot be deep-copied
    # After make_reference: compiled or patched layers must not be deep-copied into the reference.
    on_cuda = policy.device.type == "cuda"
    speedups = apply_training_speedups(model, SpeedConfig(
        compile_layers=(on_cuda if config.compile is None else config.compile) and not fsdp,
        compile_scope=config.compile_scope,
        checkpoint_mlp=on_cuda if config.checkpoint_mlp is None else config.checkpoint_mlp))
    if isinstance(reference, torch.nn.Module):  # the update's attention kernel, for a KL of 0 at the start
        apply_training_speedups(reference, SpeedConfig(compile_layers=False))
    if config.compile_scope == "decoder" and "compile_decoder" not in speedups:
        speedups["compile_decoder"] = ("skipped: compile is off (--compile auto compiles on CUDA only, and never "
                                       "under FSDP; --compile on to compile here)")
    if ranks.is_main and any(v != "on" for v in speedups.values()):
        print(f"update speed-ups: {speedups}")
    if fsdp:
        # From here on ``model`` is FSDP's root (forward = the chunked log-probs) and the policy's
        # own model, inside it, holds parameter shards; rollouts gather them (full_parameters).
        model = shard_model(model, _logprobs, mixed_precision=mixed)
        if isinstance(reference, torch.nn.Module):
            reference = shard_model(reference, _logprobs, mixed_precision=mixed)
            reference.set_reshard_after_forward(True)  # used only in forward: free everything after it
        # FSDP's root is the first module to run forward; rollouts call inner modules directly,
        # so run one (tiny, gradient-free) forward through the root before the first rollout.
        with torch.no_grad(), autocast():
            batch_logprobs(model, to_device(padding_batch(policy.pad_id), policy.device), config)
        model.reshard()
    # 16-bit weights get float32 master copies in the optimizer (FSDP has its own mixed precision).
    optimizer = make_optimizer(model.parameters(), lr=config.learning_rate, weight_decay=config.weight_decay,
                               fused=not fsdp, master_weights=not fsdp)
    policy.sampling = sampling
    task_rng = np.random.default_rng(config.seed)  # the same on every rank: all draw the same tasks
    policy._generator.manual_seed(config.seed + ranks.rank)
    segment_rng = torch.Generator().manual_seed(segment_seed(config.seed, ranks.rank))
    start = 0
    if saved is not None:  # check_output_dir made sure there is a complete checkpoint
        start, rng, _ = load_checkpoint(out, model=model, optimizer=optimizer, state=saved, rng_states=saved_rng,
                                        verified=True)  # train() checked every file (and holds the lock)
        task_rng.bit_generator.state = rng["tasks"]
        policy._generator.set_state(rng["ranks"][ranks.rank]["sampling"])
        segment_rng.set_state(rng["ranks"][ranks.rank]["segments"])
        torch.set_rng_state(rng["torch"])
    # Rank 0 opens the metrics (and rewrites them on resume); the others stop with it if it cannot.
    log = ranks.together(lambda: MetricsLog(out, resume_step=start) if ranks.is_main else None)
    if footprint is not None and log is not None:
        footprint.close_before_removing(log)
    history = []
    logged = start  # the number of the last step metrics.jsonl has (it keeps the checkpoint's rows)
    checkpointed = start  # the steps the checkpoint in out holds (0: none)

    def random_states(per_rank: list[dict]) -> dict:
        return {"tasks": task_rng.bit_generator.state, "torch": torch.get_rng_state(), "ranks": per_rank}

    def this_ranks_random_states() -> dict:
        return {"sampling": policy._generator.get_state(), "segments": segment_rng.get_state()}

    def save(done: int, rng_states: dict) -> None:
        """Checkpoint the weights and the optimizer after ``done`` steps (every rank takes part)."""
        nonlocal checkpointed
        state = checkpoint_state(model, optimizer, keep=ranks.is_main)  # FSDP: every rank gathers
        # The others wait for the writing rank, and stop with it if it cannot write.
        ranks.together(lambda: ranks.is_main and save_checkpoint(
            out, state=state, step=done, config=config.to_dict(), base_model=base_model,
            base_model_path=base_model_path, base_model_from_files=base_model_from_files, rng_states=rng_states))
        checkpointed = done
        if footprint is not None:
            footprint.results_written = True

    def keep_finished_steps(done: int, rng_states: Callable[[], dict]) -> None:
        """A stopped run keeps what it finished: the checkpoint after ``done`` steps (with the
        random states ``rng_states()`` gives: on every rank of a launch, which all save it), the
        last finished step's metrics row (logged as a run's last step always is), and the
        learning curve."""
        if not history:  # stopped in its first step: nothing to keep (and nothing is left behind)
            return
        if log is not None and history[-1]["step"] > logged:
            log.write(history[-1]["step"], {k: v for k, v in history[-1].items() if k != "step"})
        if done > checkpointed:
            if ranks.is_main:
                say(f"rftgym train: stopping; saving the checkpoint after step {done} first")
            save(done, rng_states())
        if log is not None:
            _close_outputs(log, out)

    # One process stops where it is (stopping.keeping_finished_steps, finishing_the_step); the
    # ranks of a launch, which would each stop elsewhere in a step, stop together (LaunchStops).
    stops_save = ranks.world_size == 1 and log is not None
    launch_stops = LaunchStops(ranks, enabled=ranks.world_size > 1)
    for step in range(start, config.steps):
        # ``step``, 0-based, is also the count of steps done before this one; what the user sees (the
        # metrics rows, metrics.jsonl, TensorBoard, messages) is the step's number, 1-based.
        number = step_number(step)
        # What a checkpoint saved now would hold: a stop before this step's update saves it.
        step_start = random_states([this_ranks_random_states()])

        def at_step_start() -> dict:  # (every rank's own states, gathered under a launch)
            return {**step_start, "ranks": ranks.gather_objects(step_start["ranks"][0])}

        def at_step_end() -> dict:
            return random_states(ranks.gather_objects(this_ranks_random_states()))

        with launch_stops.noting():
            with keeping_finished_steps(lambda: keep_finished_steps(step, at_step_start), stops_save):
                started = time.perf_counter()
                # 1. Sample tasks: each task seed is repeated group_size times, so a group shares its task.
                task_seeds = task_rng.integers(0, 2**31 - 1, size=config.tasks_per_step).tolist()
                tasks = ranks.shard(list(enumerate(task_seeds)))
                seeds = [seed for _, seed in tasks for _ in range(config.group_size)]
                # Each episode's sampling stream: (step, task index over all ranks, member of the group).
                sample_keys = training_keys(step, [task for task, _ in tasks], config.group_size)

                # 2. Roll out with the current policy (its sampled tokens and log-probs are recorded).
                # 3. Advantages -> per-token training samples.
                # Both run on each rank alone; an error in either (an env breaking its contract, a policy
                # without log-probs) stops every rank, not just this one. A rollout that fails keeps the
                # episodes it finished in the output directory (failed_rollouts), for a look at them; a
                # failure to build samples keeps all of them.
                def rollout_and_samples():
                    model.eval()
                    with autocast(), full_parameters(model), keeping_finished_episodes(out, number, len(seeds), ranks):
                        episodes = run_episodes(make_env, policy, seeds, sample_keys=sample_keys,
                                                config=RolloutConfig(num_envs=config.rollout_batch_size))
                    rollout_seconds = time.perf_counter() - started
                    with keeping_episodes_of_failed_samples(out, number, episodes, ranks):
                        samples, batch_stats = build_samples(group_episodes(episodes, config.group_size), config,
                                                             segment_rng, split_tokens=evaluation_split(policy))
                    return episodes, rollout_seconds, samples, batch_stats

                episodes, rollout_seconds, samples, batch_stats = ranks.together(rollout_and_samples)
                unused = unused_signal(config.algo, episodes) if step == start and ranks.is_main else None
                if unused:
                    warn_caller(unused)
            launch_stops.stop_if_asked(lambda: keep_finished_steps(step, at_step_start))

            # From the update on the weights change: a stop waits until the step is done and saved.
            with finishing_the_step(lambda: keep_finished_steps(number, at_step_end), stops_save):
                # 4. Update: epochs of minibatches over the samples, at this step's learning rate.
                model.train()
                recomputed = {}
                if config.old_logprobs == "recompute":
                    samples, recomputed = recompute_old_logprobs(model, samples, config, policy.pad_id, ranks, autocast)
                learning_rate = learning_rate_at(step, base=config.learning_rate, total_steps=config.steps,
                                                 schedule=config.lr_schedule, warmup_steps=config.warmup_steps,
                                                 min_ratio=config.min_lr_ratio)
                for group in optimizer.param_groups:
                    group["lr"] = learning_rate
                update = optimise(model, reference, optimizer, samples, config, policy.pad_id, segment_rng, ranks,
                                  autocast)
                ranks.together(lambda: check_finite_update(update, number, out, episodes, config))

                # Episode statistics over all ranks (optimise's loss statistics are already).
                rewards = [e.total_reward for e in episodes]
                n, r_sum, r_sq, wins, full, tokens, kept, n_samples, n_tokens, *pcar_sums = ranks.sum_floats([
                    len(episodes), sum(rewards), sum(r * r for r in rewards), sum(e.success for e in episodes),
                    sum(e.context_full for e in episodes), sum(e.num_sampled_tokens for e in episodes),
                    batch_stats.groups_kept, batch_stats.samples, batch_stats.trained_tokens,
                    batch_stats.pcar_spans, batch_stats.pcar_factor_sum, batch_stats.pcar_factor_sq_sum])
                metrics = {
                    "reward_mean": r_sum / n,
                    "reward_std": float(np.sqrt(max(0.0, r_sq / n - (r_sum / n) ** 2))),
                    "success_rate": wins / n,
                    "context_full_rate": full / n,  # episodes ended because the context had no room for a reply
                    "sampled_tokens_mean": tokens / n,
                    "groups_kept": int(kept),
                    "samples": int(n_samples),
                    "trained_tokens": int(n_tokens),
                    "rollout_seconds": rollout_seconds,
                    "step_seconds": time.perf_counter() - started,
                    "learning_rate": learning_rate,
                    **recomputed,
                    **update,
                }
                if config.algo == "pcar":
                    metrics.update(pcar_metrics(pcar_sums, int(kept) * config.group_size))
                if config.eval_every and (number % config.eval_every == 0 or number == config.steps):
                    # (this rank's share of the evaluation seeds, as evaluate_policy deals them out)
                    eval_share = len(ranks.shard(list(range(config.eval_episodes))))
                    with keeping_finished_episodes(out, number, eval_share, ranks, phase="evaluation"):
                        metrics.update(evaluate_policy(make_env, policy, model, config, ranks, autocast))
                history.append({"step": number, **metrics})
                if number % config.log_every == 0 or number == config.steps or "eval_reward_mean" in metrics:
                    # An evaluation is always logged. Only rank 0 writes; the others stop with it if it cannot.
                    ranks.together(lambda: log is not None and log.write(number, metrics))
                    logged = number
                    if footprint is not None:
                        footprint.results_written = True
                if on_step is not None and ranks.is_main:
                    on_step(history[-1])

                # 5. Checkpoint (weights, optimizer, every random state) for an exact resume.
                if number % config.save_every == 0 or number == config.steps:
                    save(number, at_step_end())
            launch_stops.stop_if_asked(lambda: keep_finished_steps(number, at_step_end))

    # Rank 0 writes the curve; every rank waits for it, so that no rank leaves the process group
    # (and the launcher) while another still works.
    ranks.together(lambda: log is not None and _close_outputs(log, out))
    idle = untrained_run(history, config)
    if idle and ranks.is_main:
        warn_caller(idle)
    return history


def step_number(index: int) -> int:
    """The number a step shows in its metrics row, metrics.jsonl, TensorBoard and messages (1 for
    the first) from the loop's 0-based index: step N is the one after which a checkpoint is at
    step N (state.json's count of steps done)."""
    return index + 1


def _close_outputs(log: MetricsLog, out: Path) -> None:
    log.close()
    plot_learning_curve(out / "metrics.jsonl", out / "learning_curve.png")


def untrained_run(history: list[dict], config: TrainConfig) -> str | None:
    """Why no step of the run updated the model (no rank had a sample to train on), or None when
    one did. ``samples`` is summed over ranks; a rank's own ``loss`` is None whenever it alone had
    none."""
    if not history or any(h.get("samples", 0) > 0 for h in history):
        return None
    if config.algo == "rft":
        why = ("no episode succeeded (info['success']), and rft trains on successful episodes only; the env must "
               "set info['success'], and the policy must reach it sometimes")
    elif all(h.get("context_full_rate") == 1.0 for h in history):
        why = "every episode ran out of context before a reply (see --max-prompt-tokens and --max-new-tokens)"
    elif config.filter_zero_variance and all(h.get("groups_kept") == 0 for h in history):
        why = ("in every group all episodes had the same reward, so no sample had an advantage "
               "(filter_zero_variance skips such groups)")
    else:
        why = ("no episode gave a sample to train on" + (" (filter_overlong masked the episodes cut short)"
                                                        if config.filter_overlong else ""))
    # The rows' own numbers (a resumed run's start past step 1).
    first, last = history[0].get("step", 1), history[-1].get("step", len(history))
    steps = f"step {first}" if first == last else f"steps {first} to {last}"
    return f"no step of this run updated the model ({steps}): {why}"


# ---------------------------------------------------------------- model plumbing

def prepare_model(policy: HFPolicy, config: TrainConfig, autocast=nullcontext):
    """Apply LoRA and gradient checkpointing as configured; return the model to train.
    ``autocast``: the precision context the rollouts and updates will run under."""
    model = policy.model
    # Rollouts run in eval mode; dropout during the update would make first-epoch ratios noisy.
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
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


def check_finite_update(update: dict, step: int, out: Path, episodes, config: TrainConfig) -> None:
    """Stop the run when the loss or gradient norm of step ``step`` (its number, 1-based) is not
    finite: the optimizer has then written NaN or infinity into the weights, and every later step
    (and its checkpoint) would carry them. Nothing of this step is saved; the last checkpoint stays
    the last good state."""
    bad = {key: update[key] for key in ("loss", "grad_norm") if update.get(key) is not None
           and not math.isfinite(update[key])}
    if not bad:
        return
    rewards = [e.total_reward for e in episodes]
    used = {"pcar_lambda": config.algo == "pcar", "lora_alpha": config.lora_rank > 0}
    suspects = [f"{name}={getattr(config, name):g}" for name in ("kl_coef", "learning_rate", "pcar_lambda", "lora_alpha")
                if used.get(name, True)]
    raise TrainingError(
        f"step {step}: the update's {' and '.join(f'{k} is {v}' for k, v in bad.items())}, so the weights are no "
        f"longer finite; the run stops without saving them (the checkpoint in {out}, if any, is the last good "
        f"state). Rewards this step ranged over [{min(rewards, default=0):g}, {max(rewards, default=0):g}]. Lower "
        f"what scales the loss ({', '.join(suspects)}) or the env's rewards, then resume or start again")


def pcar_metrics(sums: list[float], episodes: int) -> dict[str, float]:
    """PCAR's step metrics from ``[scored spans, factor sum, factor sum of squares]`` over the kept
    groups' ``episodes``: scored spans per episode, and the rescaling factors' mean and spread
    (1 and 0 when no group's scores varied, i.e. PCAR trained as GRPO)."""
    spans, total, squares = sums
    mean = total / spans if spans else 1.0
    return {"pcar_scores_per_episode": spans / episodes if episodes else 0.0,
            "pcar_factor_mean": mean,
            "pcar_factor_std": float(np.sqrt(max(0.0, squares / spans - mean * mean))) if spans else 0.0}


def unused_signal(algo: str, episodes) -> str | None:
    """Why PCAR or DCPO trained as plain GRPO on ``episodes``, or None: PCAR scales advantages by the
    env's per-search evaluation scores, DCPO trains the segments between context edits; without
    either there is nothing for them to do (most likely an env that has no such signal)."""
    env_ids = {e.env_id for e in episodes}
    if algo == "pcar" and not any(t.info.get(PROCESS_SCORE_KEY) is not None for e in episodes for t in e.turns):
        why = ("the policy evaluated none of its searches (<evaluate>score: N</evaluate> right after a search)"
               if env_ids == {"rftgym/SearchEvalQA-v0"} else "PCAR needs an env that scores each search "
               "(rftgym/SearchEvalQA-v0) and a policy that evaluates its searches")
        return f"--algo pcar: no turn had info['evaluation_score'], so PCAR trained as GRPO; {why}"
    if algo == "dcpo" and all(len(e.segments) <= 1 for e in episodes):
        why = ("the policy made no <prune> edit" if env_ids == {"rftgym/MemoryQA-v0"} else "DCPO needs an env whose "
               "context the agent edits (rftgym/MemoryQA-v0) and a policy that edits it")
        return f"--algo dcpo: no episode edited its context (one segment each), so DCPO trained as GRPO; {why}"
    return None


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


def evaluation_split(policy: HFPolicy) -> Callable:
    """PCAR's ``split_tokens``: how many of a turn's sampled tokens its evaluation spans (the
    env's ``evaluation_end`` character offset, mapped through the policy's tokenizer), or None."""
    def split_tokens(turn) -> int | None:
        end = turn.info.get(PROCESS_SPLIT_KEY)
        if end is None or not turn.sampled_ids:
            return None
        if not is_int(end) or not 0 <= end <= len(turn.action):
            raise EnvContractError(f"info[{PROCESS_SPLIT_KEY!r}] is {end!r}; it is a character "
                                   f"offset into the turn's action, an int in [0, {len(turn.action)}]")
        if not turn.action[end:].strip():
            # Nothing but white space after the evaluation: the whole turn is its span. Mapped to
            # tokens, the offset would fall before the sampled stop token, which would then go to
            # the next span.
            return None
        return tokens_covering(policy.chat.decode_reply, list(turn.sampled_ids), int(end))
    return split_tokens


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


def batch_logprobs(model, batch: dict[str, torch.Tensor], config: TrainConfig, with_entropy: bool = False):
    """Log-probs of each next token, computed from the final hidden states in vocabulary chunks."""
    if isinstance(model, ShardedModel):  # FSDP: through the root's forward, whose hooks gather parameters
        return model(batch, config, with_entropy)
    return _logprobs(model, batch, config, with_entropy)


def _logprobs(model, batch: dict[str, torch.Tensor], config: TrainConfig, with_entropy: bool = False):
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    # Packed rows (rftgym.train.packing) carry position ids that restart at each sample, and no
    # padding mask; the decoder then attends within each sample only.
    hidden = base.get_decoder()(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"),
                                position_ids=batch.get("position_ids"), use_cache=False).last_hidden_state
    weight = base.get_output_embeddings().weight
    options = dict(temperature=config.temperature, chunk_size=config.logprob_chunk_size, with_entropy=with_entropy,
                   transform=logit_transform(base.config))
    targets, index = batch["targets"], batch.get("trained_index")
    if index is None or index.numel() == 0:  # every position (e.g. a padding pass that trains nothing)
        return chunked_token_logprobs(hidden[:, :-1], weight, targets, **options)
    # The loss, the KL term and the reported entropy are all taken over the loss mask, so only
    # trained positions need the vocabulary projection: prompts, tool output and padding skip it.
    # Position t of row b is index b * (T - 1) + t of the targets and b * T + t of the hidden states.
    width = targets.shape[1]
    rows = hidden.reshape(-1, hidden.shape[-1]).index_select(0, index + index // width)
    logp, entropy = chunked_token_logprobs(rows.unsqueeze(0), weight, targets.reshape(-1)[index].unsqueeze(0),
                                           **options)
    return _spread(logp, index, targets.shape), (None if entropy is None else _spread(entropy, index, targets.shape))


def _spread(values: torch.Tensor, index: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """``values`` ``[1, K]`` placed at the flat positions ``index`` of a zero tensor of ``shape``."""
    return values.new_zeros(shape.numel()).index_copy(0, index, values[0]).view(shape)


def _batch_loss(model, reference, batch, config: TrainConfig, autocast):
    """The minibatch's loss (aggregated over its own tokens), its stats (0-dim tensors, still on
    the device), and the log-probs."""
    with autocast():
        logp, entropy = batch_logprobs(model, batch, config, with_entropy=True)
        ref_logp = reference_logprobs(model, reference, batch, config)
    mask = batch["loss_mask"]
    normalizer = config.minibatch_size * config.max_new_tokens if config.aggregation == "constant_normalizer" else None
    if config.algo == "rft":  # supervised: the negative log-likelihood of the sampled tokens
        loss = aggregate(config.aggregation, -logp, mask, normalizer=normalizer, sequence_ids=batch.get("sequence_ids"))
        return loss, {"pg_loss": loss.detach(), "entropy": token_mean(entropy.detach(), mask)}, logp
    loss, stats = policy_loss(
        logp, batch["old_logprobs"], batch["advantages"], mask,
        clip_low=config.clip_low, clip_high=config.clip_high, aggregation=config.aggregation,
        normalizer=normalizer, ref_logp=ref_logp, kl_coef=config.kl_coef, entropy=entropy.detach(),
        sequence_ids=batch.get("sequence_ids"),
    )
    return loss, stats, logp


def normalizer_count(samples: list[TrainSample], aggregation: str) -> int:
    """What ``aggregation``'s mean divides by over ``samples``: trained tokens (token_mean), sequences
    with a trained token (sequence_mean), or the sample count (constant_normalizer). A sample's
    first token is never predicted, so its mask counts from the second token."""
    if aggregation == "token_mean":
        return sum(sum(s.loss_mask[1:]) for s in samples)
    if aggregation == "sequence_mean":
        return sum(1 for s in samples if any(s.loss_mask[1:]))
    return len(samples)


def microbatch_weights(parts: list[list[TrainSample]], aggregation: str) -> list[float]:
    """How much each microbatch's own aggregated loss weighs in the minibatch's: its share of the
    trained tokens (token_mean), of the sequences with trained tokens (sequence_mean), or 1
    (constant_normalizer, a plain sum over a fixed normalizer)."""
    if aggregation == "constant_normalizer":
        return [1.0] * len(parts)
    counts = [normalizer_count(part, aggregation) for part in parts]
    total = sum(counts)
    return [c / total if total else 0.0 for c in counts]


def microbatches(samples: list[TrainSample], config: TrainConfig) -> list[list[TrainSample]]:
    """``samples`` split into forward/backward passes by ``microbatch_size`` or ``microbatch_tokens``
    (:func:`~rftgym.train.microbatches.plan_passes`)."""
    return [[samples[i] for i in indices] for indices in _pass_plan(samples, config)]


def _pass_plan(samples: list[TrainSample], config: TrainConfig, *, no_grad: bool = False) -> list[list[int]]:
    # Without gradients (old_logprobs="recompute") and without a limit, a pass takes a minibatch.
    per_pass = config.microbatch_size or (config.minibatch_size if no_grad and not config.microbatch_tokens else 0)
    return plan_passes([len(s.token_ids) for s in samples], samples_per_pass=per_pass,
                       tokens_per_pass=config.microbatch_tokens, packed=config.pack_sequences)


def _accumulate(model, reference, parts: list[list[TrainSample]], config: TrainConfig, pad_id: int, device,
                autocast, *, passes: int = 0, scale: float = 1.0):
    """Backward over a minibatch split into forward/backward passes (``parts``, from
    :func:`microbatches`: gradient accumulation, the same gradient as one pass with one part's
    activations at a time), each loss times ``scale``; then zero-weighted padding passes up to
    ``passes`` in all (FSDP: every rank must run as many forward/backward passes, since those hold
    the collectives). Returns the minibatch's loss and stats (stats weighted like the loss; 0-dim
    tensors, nothing is read back from the device), or ``(None, {})`` for no parts."""
    # The loss (and pg_loss) combine as the aggregation does; the other stats are token means.
    loss_weights = microbatch_weights(parts, config.aggregation)
    token_weights = microbatch_weights(parts, "token_mean")
    total_loss, stats = 0.0, {}
    for part, weight, token_weight in zip(parts, loss_weights, token_weights):
        batch = to_device(collate_packed(part, pad_id) if config.pack_sequences else collate(part, pad_id), device)
        loss, part_stats, _ = _batch_loss(model, reference, batch, config, autocast)
        (loss * (weight * scale)).backward()
        total_loss = total_loss + loss.detach() * weight
        for key, value in part_stats.items():
            share = weight if key == "pg_loss" else token_weight
            stats[key] = stats.get(key, 0.0) + value * share
    for _ in range(len(parts), passes):
        batch = to_device(padding_batch(pad_id), device)
        _, _, logp = _batch_loss(model, reference, batch, config, autocast)
        # logp times zero, not the loss: the loss of a fully masked batch need not be finite.
        (logp * 0.0).sum().backward()
    return (total_loss, stats) if parts else (None, {})


def to_device(batch: dict[str, torch.Tensor], device) -> dict[str, torch.Tensor]:
    """A collated (host) batch on ``device``, copied without waiting for the device.

    A plain copy from pageable memory to a GPU waits until the device has finished all work
    queued before it (the previous microbatch's backward pass), and then the host has nothing
    queued while it prepares the next pass. From pinned memory the copy is queued like a kernel.
    The attention mask is checked for right padding here, on the host, and tagged
    (:func:`~rftgym.train.speed.tag_right_padding`), so the decoder's mask hook need not read
    the mask back from the device.
    """
    device = torch.device(device)
    pin = device.type == "cuda"
    # Only a contiguous pinned tensor is copied asynchronously: for a strided view (e.g. a slice)
    # PyTorch first makes a pageable contiguous copy, and the transfer from it waits for the device.
    moved = {key: (value.contiguous().pin_memory() if pin else value).to(device, non_blocking=pin)
             for key, value in batch.items()}
    if "attention_mask" in moved:
        tag_right_padding(moved["attention_mask"], is_right_padded(batch["attention_mask"]))
    return moved


def padding_batch(pad_id: int) -> dict[str, torch.Tensor]:
    """A two-token batch that trains nothing (its loss mask is zero): FSDP's stand-in minibatch."""
    return collate([TrainSample(token_ids=[pad_id, pad_id], loss_mask=[0, 0], old_logprobs=[0.0, 0.0],
                                advantages=[0.0, 0.0], group=-1, episode=-1)], pad_id)


def reference_logprobs(model, reference, batch, config: TrainConfig):
    if reference is None:
        return None
    context = model.disable_adapter() if reference == "adapters-off" else nullcontext()
    with torch.no_grad(), context:
        logp, _ = batch_logprobs(model if reference == "adapters-off" else reference, batch, config)
    return logp


# ---------------------------------------------------------------- one optimisation pass

def optimise(model, reference, optimizer, samples: list[TrainSample], config: TrainConfig, pad_id: int,
             generator: torch.Generator, ranks: Distributed | None = None, autocast=nullcontext) -> dict[str, float]:
    """``epochs_per_step`` passes of minibatch updates over ``samples``; mean stats.

    With several ranks, every rank runs the largest rank's number of minibatches (a rank that
    has run out contributes zero gradients), and each minibatch's loss is the aggregation over
    all ranks' samples together (a token mean weighs every token of every rank alike), as one
    process would compute it over the union; gradients are averaged before each step. Under FSDP
    (``model`` a :class:`ShardedModel`) the forward and backward passes hold the collectives, so
    every rank runs the largest rank's number of passes
    (zero-weighted padding passes where it has fewer microbatches, or none), and FSDP's
    reduce-scatter does the averaging.

    Nothing is read back from the device until every minibatch has been queued (the stats stay
    0-dim device tensors until then), so on a GPU the host prepares the next kernels while the
    device runs the previous ones; the stats are read back at once at the end.
    """
    ranks = ranks or Distributed()
    sharded = isinstance(model, ShardedModel)
    device = next(model.parameters()).device
    # The gradients to average and clip (float32 masters hold them for a 16-bit model).
    trainable = gradient_tensors(optimizer, [p for p in model.parameters() if p.requires_grad])
    size, aggregation = config.minibatch_size, config.aggregation
    orders = [torch.randperm(len(samples), generator=generator).tolist() for _ in range(config.epochs_per_step)]
    # Each epoch's minibatches, each split into its forward/backward passes.
    planned = [[microbatches([samples[i] for i in order[k:k + size]], config) for k in range(0, len(samples), size)]
               for order in orders]
    # Every rank's sample count and, per minibatch, what its loss is a mean over (trained tokens or
    # sequences) and its number of passes: a minibatch's loss is one mean over all ranks' samples,
    # as in one process, so each rank weighs its share by its own count over the total; under FSDP
    # every rank runs the most passes any rank has.
    own = (len(samples), [[(normalizer_count(flat := [s for part in parts for s in part], aggregation), len(parts),
                            normalizer_count(flat, "token_mean")) for parts in epoch] for epoch in planned])
    per_rank = ranks.gather_objects(own)
    minibatches = max(-(-n // size) for n, _ in per_rank)
    if minibatches == 0:
        return {"loss": None, "grad_norm": None, "updates": 0}
    totals: dict[str, torch.Tensor] = {}
    grad_norms: torch.Tensor | float = 0.0
    updates = 0
    for epoch in range(len(orders)):
        for index in range(minibatches):
            parts = planned[epoch][index] if index < len(planned[epoch]) else []
            optimizer.zero_grad(set_to_none=True)
            chunk_sizes = [min(size, max(0, n - index * size)) for n, _ in per_rank]
            contributors = sum(n > 0 for n in chunk_sizes)
            if aggregation == "constant_normalizer":  # a sum over a fixed normalizer of world x minibatch
                share = 1.0 / ranks.world_size
            else:
                counts = [c[epoch][index][0] if index < len(c[epoch]) else 0 for _, c in per_rank]
                share = counts[ranks.rank] / sum(counts) if sum(counts) else 0.0
            # The token-mean statistics (entropy, clip fraction, ...) combine by trained tokens.
            tokens = [c[epoch][index][2] if index < len(c[epoch]) else 0 for _, c in per_rank]
            token_share = tokens[ranks.rank] / sum(tokens) if sum(tokens) else 0.0
            # The gradients are then divided by the contributing ranks (DDP) or by all of them
            # (FSDP's reduce-scatter); scaled by that divisor, this rank's loss enters as its share.
            scale = share * (ranks.world_size if sharded else contributors)
            if sharded:
                passes = max(c[epoch][index][1] if index < len(c[epoch]) else 0 for _, c in per_rank)
                loss, stats = _accumulate(model, reference, parts, config, pad_id, device, autocast,
                                          passes=passes, scale=scale)
            else:
                loss, stats = _accumulate(model, reference, parts, config, pad_id, device, autocast, scale=scale)
                # A rank that has run out still joins the average (with zero gradients).
                ranks.average_gradients(trainable, contributed=bool(parts))
            # Sharded gradients: the norm is a DTensor over all shards, so every rank clips alike.
            grad_norm = full_tensor(torch.nn.utils.clip_grad_norm_(trainable, config.max_grad_norm))
            optimizer.step()
            updates += 1
            # The gradient (and its norm) is every rank's. The loss and its stats are this rank's
            # own, weighed by its share as in the gradient: summed over the ranks below, they make
            # the minibatch's loss as one process would compute it.
            grad_norms = grad_norms + grad_norm.detach()
            if loss is None:
                continue
            for key, value in {"loss": loss, **stats}.items():
                totals[key] = totals.get(key, 0.0) + value * (share if key in ("loss", "pg_loss") else token_share)
    if not updates:
        return {"loss": None, "grad_norm": None, "updates": 0}
    sums = read_back({**totals, "grad_norm": grad_norms})  # one wait for the device, at the end
    grad_norm = sums.pop("grad_norm") / updates
    merged: dict[str, float] = {}
    for rank_sums in ranks.gather_objects(sums):  # every rank reports every rank's loss, not its own
        for key, value in rank_sums.items():
            merged[key] = merged.get(key, 0.0) + value
    if not merged:
        return {"loss": None, "grad_norm": grad_norm, "updates": updates}
    return {**{key: value / updates for key, value in merged.items()}, "grad_norm": grad_norm, "updates": updates}


def recompute_old_logprobs(model, samples: list[TrainSample], config: TrainConfig, pad_id: int,
                           ranks: Distributed | None = None, autocast=nullcontext) -> tuple[list[TrainSample], dict]:
    """``samples`` with the PPO ratio's old log-probs recomputed by the model as the update computes
    them (``old_logprobs="recompute"``, as verl does), and how far the rollout's were from them.

    The rollout's log-probs come from the decode kernels (a KV cache, CUDA graphs, bf16 in another
    order); the update's from the training forward pass. Their gap makes the first ratio differ
    from 1 by noise alone, which the clip then treats as a policy change. The recomputed ones are
    the update's own numbers before its first step. Reported: ``old_logprob_gap`` (mean absolute
    difference over trained tokens) and ``old_logprob_gap_max``.
    """
    ranks = ranks or Distributed()
    device = next(model.parameters()).device
    sharded = isinstance(model, ShardedModel)
    plan = _pass_plan(samples, config, no_grad=True)
    # FSDP's forward holds collectives: every rank runs the largest rank's number of passes.
    passes = max(ranks.gather_objects(len(plan))) if sharded else len(plan)
    values, owners = [], []
    with torch.no_grad():
        for index in range(passes):
            part = [samples[i] for i in plan[index]] if index < len(plan) else None
            host = (collate_packed(part, pad_id) if config.pack_sequences else collate(part, pad_id)) if part \
                else padding_batch(pad_id)
            with autocast():
                logp, _ = batch_logprobs(model, to_device(host, device), config)
            if part:
                values.append(logp.float())
                owners.append((host.get("sequence_ids"), len(part)))
    if sharded:
        # A forward without gradients leaves the root's parameters gathered (no backward pass
        # reshards them), and the update's backward would then reduce the wrong tensors.
        model.reshard()
    # The first .cpu() waits for the device, once.
    predicted = [lp for part, owner in zip(values, owners) for lp in _per_sample(part.cpu(), *owner)]
    row_of = dict(zip((i for indices in plan for i in indices), predicted))
    out, gaps = [], []
    for index, sample in enumerate(samples):
        row = row_of[index]
        # row[t - 1] is the log-prob of token t (position p predicts token p + 1).
        old = list(sample.old_logprobs)
        for t in range(1, len(sample.token_ids)):
            if sample.loss_mask[t]:
                gaps.append(abs(row[t - 1] - old[t]))
                old[t] = row[t - 1]
        out.append(replace(sample, old_logprobs=old))
    if not gaps:
        return out, {}
    return out, {"old_logprob_gap": sum(gaps) / len(gaps), "old_logprob_gap_max": max(gaps)}


def _per_sample(logp: torch.Tensor, sequence_ids: torch.Tensor | None, count: int) -> list[list[float]]:
    """Each sample's log-probs, in order, from a padded batch (one sample per row) or a packed one
    (``sequence_ids`` names the sample of each position; a sample's positions come in order)."""
    if sequence_ids is None:
        return logp.tolist()
    owner = sequence_ids.reshape(-1)
    order = torch.argsort(owner, stable=True)  # by sample, each sample's positions in order
    lengths = torch.bincount(owner + 1, minlength=count + 1).tolist()  # padding (-1) first
    return [part.tolist() for part in torch.split(logp.reshape(-1)[order], lengths)[1:]]


def read_back(values: dict[str, torch.Tensor | float], divisor: int = 1) -> dict[str, float]:
    """``values / divisor`` as Python floats, read from the device in one transfer (one wait)."""
    keys = list(values)
    tensors = [torch.as_tensor(values[key]).detach() for key in keys]
    device = next((t.device for t in tensors if t.device.type != "cpu"), torch.device("cpu"))
    # float64 where the device has it, so that float64 runs report their full precision.
    dtype = torch.float32 if device.type == "mps" else torch.float64
    stacked = torch.stack([t.reshape(()).to(device=device, dtype=dtype) for t in tensors])
    return dict(zip(keys, (stacked / divisor).tolist()))
