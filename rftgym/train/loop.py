"""The training loop: sample tasks -> roll out G episodes each -> advantages -> update -> log.

Read top to bottom: :func:`train` is the whole algorithm. The model plumbing (LoRA, the KL
reference, the checks of a model's log-probs) is :mod:`rftgym.train.model_setup`; one optimisation
pass over a step's samples (minibatches, gradient accumulation, the loss) is
:mod:`rftgym.train.update`.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

import gymnasium as gym
import numpy as np
import torch

from ..agents.hf_policy import HFPolicy, SamplingConfig
from ..agents.sampling_keys import training_keys
from ..core.devices import device_problem
from ..core.errors import ConfigError, TrainingError, warn_caller
from ..core.values import is_int
from ..envs.common import env_metadata, with_policy_options, with_training_defaults
from ..rollout import RolloutConfig, run_episodes
from ..rollout.engine import check_env_factory
from .batching import build_samples, evaluation_split, first_varied_tasks, group_episodes, varied_groups
from .base_model import base_fingerprint, files_fingerprint, load_dtype
from .checkpoint import (
    check_base_model,
    check_base_model_early,
    check_checkpoint_files,
    check_world_size,
    checkpoint_state,
    kept_as_text,
    load_checkpoint,
    resume_notes,
    save_checkpoint,
    saved_rng_states,
)
from .config import TrainConfig, default_output_dir
from .distributed import (
    Distributed,
    RankFailures,
    full_parameters,
    shard_model,
)
from .evaluation import columns_of_made_env, declared_columns, evaluate_policy
from .failed_rollouts import keeping_episodes_of_failed_samples, keeping_finished_episodes
from .master_weights import needs_master_weights
from .metrics_log import MetricsLog, plot_learning_curve, window_row, write_step_episodes
from .model_setup import make_reference, prepare_model
from .run_dir import (
    LEARNING_CURVE,
    METRICS_FILE,
    OutputLock,
    RunFootprint,
    check_output_dir,
    is_run_dir,
    resumed_model,
    saved_state,
)
from .schedule import learning_rate_at
from .signals import refuse_idle_algorithm, unused_signal
from .speed import (
    SpeedConfig,
    apply_training_speedups,
    make_optimizer,
)
from .step_metrics import rollout_metrics
from .stopping import LaunchStops, finishing_the_step, keeping_finished_steps, say
from .task_order import epoch_task_seeds, served_dataset_size
from .update import batch_logprobs, decoder_logprobs, optimise, padding_batch, recompute_old_logprobs, to_device


def check_train_arguments(config: TrainConfig, policy, make_env, on_step=None) -> None:
    """What :func:`train` cannot use, refused before any work: another type than it takes, a model
    setting that names another directory than the policy passed in came from, a device torch
    cannot run on here, env options beside an env the caller makes, an FSDP run without a launch,
    and PCAR or DCPO on an env that declares it gives them nothing to work on."""
    if not isinstance(config, TrainConfig):
        raise TypeError(f"train takes a TrainConfig, got {type(config).__name__} (a dict of settings: "
                        "TrainConfig.from_dict(settings))")
    if make_env is not None:
        check_env_factory(make_env)
    if on_step is not None and not callable(on_step):
        raise TypeError(f"on_step is a function called with each step's metrics row (a dict), e.g. print; got "
                        f"{type(on_step).__name__} {on_step!r:.60}")
    if policy is not None and not isinstance(policy, HFPolicy):
        raise TypeError(f"policy must be an HFPolicy (a local Hugging Face model whose tokens and log-probs are "
                        f"recorded), got {type(policy).__name__}; or None to load config.model")
    if policy is not None and getattr(policy.model, "peft_config", None):
        trained = (f" (LoRA-trained in place by the run in {policy.trained_in}: resume that run with a fresh policy, or "
                   "load_trained() its model)") if policy.trained_in else ""
        raise ConfigError(f"policy.model carries peft adapters{trained}; train() adds its own with lora_rank > 0 and "
                          "keeps the base weights' fingerprint without them, so the run could be neither exported nor "
                          "resumed. Pass the base model (a PeftModel's get_base_model(), or merge_and_unload() to train "
                          "the adapted weights whole) and set lora_rank / lora_alpha")
    if policy is not None and policy.source_dir and isinstance(config.model, str) and config.model != "default" \
            and os.path.realpath(os.path.expanduser(config.model)) != os.path.realpath(policy.source_dir):
        raise ConfigError(f"model={config.model!r} names another directory than the policy passed in was loaded from "
                          f"({policy.source_dir}); the run trains the policy, and its checkpoint would name the wrong "
                          "model: leave model None, or name that directory", field="model")
    problem = device_problem(config.device) if config.device is not None else None
    if problem is not None:  # (as the CLI checks --device)
        raise ConfigError(f"device={config.device!r}: {problem} (or None: cuda if available, else cpu)", field="device")
    if make_env is not None and config.env_kwargs:
        raise ConfigError(f"env_kwargs {sorted(config.env_kwargs)} are read only when train makes the env from "
                          "env_id; with make_env=, give the options to the env it makes (and leave env_kwargs empty, "
                          "so that the checkpoint does not name options the run never used)", field="env_kwargs")
    if make_env is not None and config.eval_env_kwargs:
        raise ConfigError(f"eval_env_kwargs {sorted(config.eval_env_kwargs)} are read only when train makes the env "
                          "from env_id; with make_env=, the evaluation plays make_env's env: leave eval_env_kwargs "
                          "empty", field="eval_env_kwargs")
    if config.parallelism == "fsdp" and "RANK" not in os.environ:
        raise ConfigError("parallelism='fsdp' needs a distributed launch, e.g. torchrun --nproc_per_node=2 "
                          "-m rftgym.cli train ... (or accelerate launch); one plain process uses 'ddp'")
    if make_env is None:  # (an env made by the caller declares nothing here)
        refuse_idle_algorithm(config.algo, config.env_id)


def made_env_id(make_env: Callable[[], gym.Env]) -> str | None:
    """The registered id of the env ``make_env`` makes (``gymnasium.make``'s spec), or None: from
    one env made and closed for it."""
    env = make_env()
    try:
        spec = getattr(env, "spec", None)
        return spec.id if spec is not None and isinstance(getattr(spec, "id", None), str) else None
    finally:
        env.close()


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
    metrics (the returned list's entry) as soon as the step is done (and saved, on a save_every
    step), e.g. to show progress; to stop early, raise an Exception from it: the run then saves
    that step first, so that ``resume=True`` continues from it, and raises it (under a launch of
    several processes, every rank saves and stops together, the others raising a
    :class:`.distributed.PeerRankError` that names it).

    ``policy``: an :class:`HFPolicy` to train instead of loading ``config.model`` (it is trained in
    place: its sampling settings become the run's, with LoRA its model is wrapped in adapters, and
    its dropout is turned off; it is handed back in eval mode, as a loaded model comes).
    ``make_env``: a function that makes an env instead of ``gymnasium.make(config.env_id,
    **config.env_kwargs)``; with ``config.env_id`` left at its default, the run takes the made
    env's registered id (``env.spec.id``) where it has one, for its output directory and records."""
    check_train_arguments(config, policy, make_env, on_step)
    if make_env is not None and config.env_id == TrainConfig.__dataclass_fields__["env_id"].default:
        # env_id left at its default beside an env of the caller's: the run (its directory, its
        # records) is named after the env make_env makes, where that env has a registered id.
        made_id = made_env_id(make_env)
        if made_id is not None:
            config = dataclasses.replace(config, env_id=made_id)
    if config.output_dir is None:
        config = dataclasses.replace(config, output_dir=default_output_dir(config.env_id, config.algo))
    out = Path(config.output_dir)
    fsdp = config.parallelism == "fsdp"
    # One process unless started by torchrun / accelerate launch.
    ranks = Distributed.from_env(config.device, process_group_for_one=fsdp, timeout_s=config.dist_timeout_s)
    if config.dist_timeout_s is not None and ranks.world_size == 1 and ranks.is_main:
        warn_caller(f"dist_timeout_s={config.dist_timeout_s:g} (--dist-timeout) changes nothing in a run of one "
                    "process: it bounds how long the processes of a launch (torchrun, accelerate launch) wait for "
                    "each other; leave it out")
    unsaved = [key for options in (config.env_kwargs, config.eval_env_kwargs) for key, value in options.items()
               if kept_as_text(value)]
    if unsaved and ranks.is_main:
        warn_caller(f"env options {unsaved} are not JSON values (e.g. objects); the checkpoint keeps only their text, "
                    "so a resume must give them again (train(config, resume=True) with this config does; `rftgym train "
                    "--resume` cannot)")
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
        if saved is not None and policy is None and config.model in (None, saved["config"].get("model")):
            # A resume that names no other model loads its checkpoint's (as the CLI's resume does).
            config = dataclasses.replace(config, model=resumed_model(saved, config.model))
        if saved is not None:
            check_checkpoint_files(out)  # each file there
        # Before any model loads, and what cannot be mended first: a run told to add steps would
        # only then learn that it may not resume this checkpoint at all, or not with this launch.
        notes = resume_notes(saved, config) if resume else []
        if saved is not None and saved.get("env_from_caller") is True and make_env is None:
            raise ConfigError(f"the run in {out} made its env with train(..., make_env=...), which its checkpoint "
                              f"cannot hold: resume it with the same make_env= (gymnasium.make({config.env_id!r}) "
                              "with env_kwargs would be another env, with other tasks)")
        if saved is not None:
            saved_rng = saved_rng_states(out, saved)  # given to the load, like saved: not read again
            check_world_size(len(saved_rng["ranks"]), ranks, out)
        # The base model's fingerprint as its files give it, before it loads (None for a policy passed in).
        from_files = files_fingerprint(config.model, load_dtype(config)) if policy is None else None
        if saved is not None:
            check_base_model_early(saved, from_files, config)
        if saved is not None and saved["step"] >= config.steps:
            steps = f"{config.steps} step{'s' if config.steps != 1 else ''}"
            raise ConfigError(f"the checkpoint in {out} is already at step {saved['step']} and this run has {steps}; "
                              f"pass more steps (e.g. --steps {saved['step'] + config.steps}) to continue it")
        if saved is not None:  # the files its save wrote (read whole: after the quick refusals above)
            check_checkpoint_files(out, saved, already=("rng.pt",))  # (saved_rng_states verified that one)
        if ranks.is_main:
            if saved is not None:
                print(f"resuming the run in {out} from its checkpoint at step {saved['step']}: steps "
                      f"{saved['step'] + 1} to {config.steps}", file=sys.stderr)
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
        if policy is not None:  # handed back as a loaded model comes: in eval mode (its dropout stays 0)
            policy.model.eval()


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
    # A policy passed in that no directory holds and no model names: no later load can find its base.
    base_in_memory = policy is not None and policy.source_dir is None and not policy.default_model \
        and config.model is None
    policy = policy or HFPolicy.from_pretrained(config.model, device=device, dtype=load_dtype(config))
    mixed = mixed and policy.device.type == "cuda"
    # Seeded and keyed: an episode's samples depend on the seed, the step, its task and its turn,
    # not on the rollout batch size or the number of ranks (rftgym.agents.sampling_keys).
    sampling = SamplingConfig(max_new_tokens=config.max_new_tokens, temperature=config.temperature,
                              top_p=config.top_p, stop=config.stop, max_batch_size=config.rollout_batch_size,
                              max_prompt_tokens=config.max_prompt_tokens or None, seed=config.seed)
    policy.prompt_limit(sampling)  # a reply longer than the model's context: refused before any work
    if config.prefix_cache_mb is not None:
        policy.set_prefix_cache_mb(config.prefix_cache_mb)
        idle_budget = policy.prefix_cache_unused if config.prefix_cache_mb and ranks.is_main else None
        if idle_budget:
            warn_caller(f"prefix_cache_mb={config.prefix_cache_mb:g} (--prefix-cache-mb) changes nothing in this run: "
                        f"{idle_budget}; leave it out (from Python, train(config, policy=...) takes a policy made with "
                        "fast_decode=False)")
    if policy.trained_in not in (None, str(out.resolve())) and ranks.is_main:
        warn_caller(f"the policy passed in was trained in place by the run in {policy.trained_in}: no model directory "
                    "holds its weights, so this run's checkpoint could not be resumed, exported or loaded without one "
                    f"(as --model / --base-model). Save them first (rftgym export {policy.trained_in} DIR) and train "
                    "HFPolicy.from_pretrained(DIR)")
    env_from_caller = make_env is not None  # (a resume must be given it again: the checkpoint says so)
    env_module = config.env_id.rpartition(":")[0] if not env_from_caller else ""  # a module:EnvId env's module
    eval_columns = None  # the env's own evaluation columns (the caller's env's: read at the first evaluation)
    make_eval_env = make_env  # (the caller's; else made below)
    if make_env is None:
        # An env's token budget counts with the policy's tokenizer, as in `rftgym eval`; options an env asks
        # of training (CodeTCG: a sandbox that isolates) are set unless given.
        metadata = env_metadata(config.env_id)
        eval_columns = declared_columns(metadata, config.env_id) if config.eval_every else ()

        def env_maker(options: dict) -> Callable[[], gym.Env]:
            kwargs = with_training_defaults(metadata, with_policy_options(metadata, options, policy))
            return lambda: gym.make(config.env_id, **kwargs)

        make_env = env_maker(config.env_kwargs)
        make_eval_env = env_maker({**config.env_kwargs, **config.eval_env_kwargs}) if config.eval_env_kwargs \
            else make_env
        if config.eval_env_kwargs:  # its options refused now, not at the first evaluation, steps later
            ranks.together(lambda: make_eval_env().close())
    base_model = base_fingerprint(policy.model)
    # Where the base weights came from, for a later export or resume, absolute: the directory the
    # policy was loaded from, else config.model's (a policy passed in, said to be that model's).
    source = policy.source_dir or config.model
    base_model_path = str(Path(source).expanduser().resolve()) \
        if source not in (None, "default") and Path(source).expanduser().is_dir() else None
    if saved is not None:  # before anything is built on the weights
        check_base_model(saved, base_model, config)
    elif base_model_path is not None and is_run_dir(base_model_path) and ranks.is_main:
        warn_caller(f"the base model is the training run in {base_model_path}, at the step its checkpoint holds now; "
                    "this run's export, evaluation and resume read it from there, so once that run trains on (or "
                    f"drops that checkpoint) they are refused. To keep it, export it first (rftgym export "
                    f"{base_model_path} DIR) and train from DIR")
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
        model = shard_model(model, decoder_logprobs, mixed_precision=mixed)
        if isinstance(reference, torch.nn.Module):
            reference = shard_model(reference, decoder_logprobs, mixed_precision=mixed)
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
    tasks_drawn = 0  # the tasks drawn so far (of a dataset: its epochs' order, task_order)
    if saved is not None:  # check_output_dir made sure there is a complete checkpoint
        start, rng, _ = load_checkpoint(out, model=model, optimizer=optimizer, state=saved, rng_states=saved_rng,
                                        verified=True)  # train() checked every file (and holds the lock)
        task_rng.bit_generator.state = rng["tasks"]
        # (a checkpoint from before the refill drew tasks_per_step a step)
        tasks_drawn = rng.get("tasks_drawn", start * config.tasks_per_step)
        policy._generator.set_state(rng["ranks"][ranks.rank]["sampling"])
        segment_rng.set_state(rng["ranks"][ranks.rank]["segments"])
        torch.set_rng_state(rng["torch"])
    # Rank 0 opens the metrics (on resume, the rows of steps run again go with its first result); the
    # others stop with it if it cannot.
    log = ranks.together(lambda: MetricsLog(out, resume_step=start) if ranks.is_main else None)
    if footprint is not None and log is not None:
        footprint.close_before_removing(log)
    history = []
    # The rows of the checkpoint's steps that no row of metrics.jsonl stands for yet (--log-every),
    # which this run's first row stands for too, as the uninterrupted run's would; not those a kept
    # row stands for (a stop right after a checkpoint writes its step's row and saves nothing new).
    kept_rows = log.last_kept_step if log is not None else 0
    carried = [row for row in ((saved or {}).get("unlogged_metrics") or [])
               if isinstance(row, dict) and is_int(row.get("step")) and kept_rows < row["step"] <= start]
    # The number of the last step a row of metrics.jsonl stands for (it keeps the checkpoint's rows).
    logged = carried[0]["step"] - 1 if carried else start

    def unlogged() -> list[dict]:
        """The rows of the steps done since the last row written (its window, :func:`window_row`)."""
        return [row for row in (*carried, *history) if row["step"] > logged]
    checkpointed = start  # the steps the checkpoint in out holds (0: none)

    def random_states(per_rank: list[dict]) -> dict:
        return {"tasks": task_rng.bit_generator.state, "tasks_drawn": tasks_drawn, "torch": torch.get_rng_state(),
                "ranks": per_rank}

    def this_ranks_random_states() -> dict:
        return {"sampling": policy._generator.get_state(), "segments": segment_rng.get_state()}

    def save(done: int, rng_states: dict) -> None:
        """Checkpoint the weights and the optimizer after ``done`` steps (every rank takes part)."""
        nonlocal checkpointed
        state = checkpoint_state(model, optimizer, keep=ranks.is_main)  # FSDP: every rank gathers

        def write() -> None:
            log.drop_rerun_rows()  # a result of this run's own: the rows of the steps it reran go
            save_checkpoint(out, state=state, step=done, config=config.to_dict(), base_model=base_model,
                            base_model_path=base_model_path, base_model_from_files=base_model_from_files,
                            base_model_in_memory=base_in_memory,
                            env_from_caller=env_from_caller,
                            # (imported by now: its file, for a resume that cannot find it)
                            env_module_file=getattr(sys.modules.get(env_module), "__file__", None),
                            rng_states=rng_states, keep=config.keep_checkpoints,
                            unlogged_metrics=[row for row in unlogged() if row["step"] <= done])

        # The others wait for the writing rank, and stop with it if it cannot write.
        ranks.together(lambda: ranks.is_main and write())
        checkpointed = done
        if footprint is not None:
            footprint.results_written = True

    def keep_finished_steps(done: int, rng_states: Callable[[], dict]) -> None:
        """A stopped run keeps what it finished: the checkpoint after ``done`` steps (with the
        random states ``rng_states()`` gives: on every rank of a launch, which all save it), the
        last finished step's metrics row (logged as a run's last step always is), and the
        learning curve."""
        nonlocal logged
        if not history:  # stopped in its first step: nothing to keep (and nothing is left behind)
            return
        if history[-1]["step"] > logged:
            if log is not None:
                log.write(history[-1]["step"], window_row(unlogged()))
            logged = history[-1]["step"]
        if done > checkpointed:
            if ranks.is_main:
                say(f"rftgym train: stopping; saving the checkpoint after step {done} first")
            save(done, rng_states())
        if log is not None:
            _close_outputs(log, out)

    def evaluate(number: int) -> dict:
        """The evaluation after step ``number`` (0: before the first), every rank's share of it."""
        nonlocal eval_columns
        if eval_columns is None:
            eval_columns = ranks.together(lambda: columns_of_made_env(make_eval_env))
        share = len(ranks.shard(list(range(config.eval_episodes))))  # (as evaluate_policy deals the seeds out)
        with keeping_finished_episodes(out, number, share, ranks, phase="evaluation"):
            return evaluate_policy(make_eval_env, policy, model, config, ranks, autocast, eval_columns)

    if config.eval_before_training and start == 0:
        # The baseline, logged as step 0. No result of the run: stopped in its first step, the run
        # still leaves its output directory as it found it.
        baseline = evaluate(0)
        ranks.together(lambda: log is not None and log.write(0, baseline))
        if ranks.is_main:
            print(f"before training: eval reward {baseline['eval_reward_mean']:.3f}  success "
                  f"{baseline['eval_success_rate']:.3f}", file=sys.stderr)

    # A dataset served by seed is gone through in epochs, each item once per epoch (task_order).
    dataset_size = ranks.together(lambda: served_dataset_size(make_env))
    if dataset_size and ranks.is_main:
        epochs = config.steps * config.tasks_per_step / dataset_size
        print(f"tasks: the env's {dataset_size} dataset items, each once per epoch in a shuffled order "
              f"({epochs:.3g} epochs in {config.steps} steps of {config.tasks_per_step}"
              + (", more with the refill's rollouts" if config.max_rollout_batches > 1 else "") + ")", file=sys.stderr)

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
            # (an error from together() is every rank's, at one point: under a launch they keep the
            # finished steps together there, as one process does)
            with keeping_finished_steps(lambda: keep_finished_steps(step, at_step_start), stops_save,
                                        raised_together=lambda exc: RankFailures.of(exc) is not None):
                started = time.perf_counter()

                def draw_tasks(batch: int) -> tuple[list[int], list[int], list]:
                    """1. Sample tasks: this rank's share of the batch's ``tasks_per_step`` tasks (their
                    indices over all ranks and batches), each seed repeated group_size times so that a
                    group shares its task, and each episode's sampling stream: (step, task index,
                    member of the group)."""
                    nonlocal tasks_drawn
                    if dataset_size:
                        task_seeds = epoch_task_seeds(config.seed, dataset_size, tasks_drawn, config.tasks_per_step)
                    else:
                        task_seeds = task_rng.integers(0, 2**31 - 1, size=config.tasks_per_step).tolist()
                    tasks_drawn += config.tasks_per_step
                    tasks = ranks.shard(list(enumerate(task_seeds, start=batch * config.tasks_per_step)))
                    seeds = [seed for _, seed in tasks for _ in range(config.group_size)]
                    indices = [task for task, _ in tasks]
                    return indices, seeds, training_keys(step, indices, config.group_size)

                # 2. Roll out with the current policy (its sampled tokens and log-probs are recorded).
                # Each rank runs its share alone; an error there (an env breaking its contract) stops
                # every rank, not just this one. A rollout that fails keeps the episodes the step
                # had finished in the output directory (failed_rollouts), for a look at them.
                def roll_out(seeds: list[int], sample_keys: list, earlier: list) -> list:
                    with autocast(), full_parameters(model), \
                            keeping_finished_episodes(out, number, len(earlier) + len(seeds), ranks):
                        try:
                            return run_episodes(make_env, policy, seeds, sample_keys=sample_keys,
                                                config=RolloutConfig(num_envs=config.rollout_batch_size))
                        except Exception as exc:  # (an earlier batch's episodes were finished too)
                            if earlier:
                                exc.finished_episodes = [*earlier, *getattr(exc, "finished_episodes", ())]
                            raise

                model.eval()
                prefix = policy.prefix_cache.stats
                asked, prefilled, evicted = prefix.prompt_tokens, prefix.prefilled_tokens, prefix.evicted_bytes
                # DAPO's refill (max_rollout_batches > 1): more tasks while fewer than tasks_per_step
                # groups over all ranks have rewards that vary.
                batches, task_indices = [], []  # this rank's episodes per batch, and its tasks' indices
                varied: list[int] | None = None  # the tasks over all ranks whose groups vary (with the refill)
                varied_mine = 0  # how many of them are this rank's
                while True:
                    indices, seeds, sample_keys = draw_tasks(len(batches))
                    episodes = [e for batch in batches for e in batch]
                    batches.append(ranks.together(lambda: roll_out(seeds, sample_keys, episodes)))
                    task_indices += indices
                    if config.max_rollout_batches == 1:
                        break
                    varied_here = [task for task, vary in zip(indices, varied_groups(
                        group_episodes(batches[-1], config.group_size))) if vary]
                    varied = (varied or []) + [task for tasks in ranks.gather_objects(varied_here) for task in tasks]
                    varied_mine += len(varied_here)
                    if len(varied) >= config.tasks_per_step or len(batches) == config.max_rollout_batches:
                        break
                episodes = [e for batch in batches for e in batch]
                # The update makes the rollout's cached prefix states stale; FSDP refills the same
                # buffers with the new weights, which the cache's fingerprint cannot tell apart.
                held = policy.prefix_cache.nbytes
                policy.clear_prefix_cache()
                rollout_seconds = time.perf_counter() - started
                prefill = (prefix.prompt_tokens - asked, prefix.prefilled_tokens - prefilled,
                           prefix.evicted_bytes - evicted, held)

                # 3. Advantages -> per-token training samples (an error, e.g. a policy without
                # log-probs, stops every rank and keeps all the step's episodes).
                def samples_of_the_step():
                    groups = group_episodes(episodes, config.group_size)
                    trained = groups
                    if varied is not None:  # the first tasks_per_step tasks whose groups vary, over all ranks
                        chosen = first_varied_tasks(varied, config.tasks_per_step)
                        trained = [group for task, group in zip(task_indices, groups) if task in chosen]
                    with keeping_episodes_of_failed_samples(out, number, episodes, ranks):
                        samples, stats = build_samples(trained, config, segment_rng,
                                                       split_tokens=evaluation_split(policy))
                    if varied is not None:  # (the counts of the groups rolled out, not only of those trained)
                        stats.groups, stats.groups_uniform = len(groups), len(groups) - varied_mine
                    return samples, stats

                samples, batch_stats = ranks.together(samples_of_the_step)
                unused = unused_signal(config.algo, episodes) if step == start and ranks.is_main else None
                if unused:
                    warn_caller(unused)
            launch_stops.stop_if_asked(lambda: keep_finished_steps(step, at_step_start))

            # From the update on the weights change: a stop waits until the step is done and saved.
            lost = (f"step {number}" if checkpointed == step else f"steps {checkpointed + 1} to {number}") \
                + (f" (the last checkpoint is at step {checkpointed})" if checkpointed else " (no checkpoint yet)")
            with finishing_the_step(lambda: keep_finished_steps(number, at_step_end), stops_save, lost=lost):
                # 4. Update: epochs of minibatches over the samples, at this step's learning rate.
                update_started = time.perf_counter()
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
                update_seconds = time.perf_counter() - update_started
                # Trained in place: its weights are no longer its directory's, but this run's.
                policy.source_dir, policy.trained_in, policy.default_model = None, str(out.resolve()), False
                ranks.together(lambda: check_finite_update(update, number, out, episodes, config))

                # Episode statistics over all ranks (optimise's loss statistics are already).
                metrics = {
                    **rollout_metrics(ranks, episodes, batch_stats, prefill, rollout_seconds, config),
                    "update_seconds": update_seconds,
                    "step_seconds": time.perf_counter() - started,
                    "learning_rate": learning_rate,
                    **({"epoch": tasks_drawn / dataset_size} if dataset_size else {}),
                    **({"rollout_batches": len(batches)} if config.max_rollout_batches > 1 else {}),
                    **recomputed,
                    **update,
                }
                if config.eval_every and (number % config.eval_every == 0 or number == config.steps):
                    metrics.update(evaluate(number))
                history.append({"step": number, **metrics})
                if number % config.log_every == 0 or number == config.steps or "eval_reward_mean" in metrics:
                    # An evaluation is always logged. Only rank 0 writes; the others stop with it if it cannot.
                    # (with --log-every above 1, the row stands for the steps since the last one)
                    row = window_row(unlogged())
                    ranks.together(lambda: log is not None and log.write(number, row))
                    if config.log_episodes:   # (rank 0's share of the step)
                        ranks.together(lambda: log is not None and write_step_episodes(
                            out, number, episodes[:config.log_episodes]))
                    logged = number
                    if footprint is not None:
                        footprint.results_written = True
                # 5. Checkpoint (weights, optimizer, every random state) for an exact resume.
                if number % config.save_every == 0 or number == config.steps:
                    save(number, at_step_end())
                if on_step is not None:
                    try:  # (on the writing rank; every rank raises when it does)
                        ranks.together(lambda: ranks.is_main and on_step(history[-1]))
                    except Exception:
                        # The caller stops the run (early stopping raises here): every rank keeps the
                        # steps it finished, this one too, so that the run can be resumed.
                        keep_finished_steps(number, at_step_end)
                        raise
                    except BaseException:  # (not sent to the other ranks: Ctrl-C reaches them itself)
                        if ranks.world_size == 1:
                            keep_finished_steps(number, at_step_end)
                        raise
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
    plot_learning_curve(out / METRICS_FILE, out / LEARNING_CURVE)


def untrained_run(history: list[dict], config: TrainConfig) -> str | None:
    """Why no step of the run updated the model (no rank had a sample to train on), or None when
    one did (``samples`` is summed over ranks)."""
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
