"""``rftgym train``: the TrainConfig its arguments describe (a resume's from its checkpoint), the
run, and what an interrupted run says about resuming it."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..core.errors import ConfigError
from ..envs.common import same_env_id, with_policy_stand_in
from .common import UsageError, _check_model_dir, _flagged
from .environments import _env_class, _make_env, _parse_env_args
from .launcher import _launch
from .sigterm import _restore_handlers, _stop_on_sigterm, say, stop_reason
from .train_file import apply_train_file, read_train_file
from .train_flags import AUTO_SWITCH, TRAIN_FLAGS


def train_config_from_args(args: argparse.Namespace):
    """The :class:`~rftgym.train.TrainConfig` that ``rftgym train``'s arguments describe."""
    from ..core.errors import ConfigError
    from ..train import TrainConfig

    from_file: set[str] = set()
    if getattr(args, "config", None):   # under the flags given, over the defaults (train_file)
        from_file = apply_train_file(args, read_train_file(args.config), getattr(args, "given", None))
        if getattr(args, "given", None) is not None:
            args.given = args.given | from_file
    output_dir = args.output_dir or _default_output_dir(args)
    settings = {field_name: getattr(args, field_name) for _, field_name, _ in TRAIN_FLAGS}
    settings.update(env_id=args.env, output_dir=output_dir, seed=args.seed,
                    env_kwargs={**getattr(args, "config_env_kwargs", {}), **_parse_env_args(args.env_arg)},
                    eval_env_kwargs={**getattr(args, "config_eval_env_kwargs", {}),
                                     **_parse_env_args(args.eval_env_kwargs or [], "--eval-env-arg")},
                    **{name: AUTO_SWITCH[settings[name]] for name in ("compile", "checkpoint_mlp")},
                    dtype=None if args.dtype == "auto" else args.dtype)

    def refused(exc: ConfigError) -> UsageError:
        if from_file & set(exc.fields):
            return UsageError(f"--config {args.config}: {exc}")
        return _flagged(exc, _train_field_flags()) or UsageError(str(exc))

    if getattr(args, "resume", False):
        try:
            settings = _with_checkpoint_settings(settings, getattr(args, "given", None), Path(output_dir))
        except _RefusedAsGiven as given:
            raise refused(given.error) from given.error
    try:
        return TrainConfig(**settings)
    except ConfigError as exc:
        raise refused(exc) from exc


class _RefusedAsGiven(Exception):
    """A resume's setting refused for the value its command line (or --config) gives, not the checkpoint's."""

    def __init__(self, error: ConfigError):
        super().__init__(str(error))
        self.error = error


def _train_field_flags() -> dict[str, str]:
    """TrainConfig's fields and the parts of ``rftgym train``'s command line that set them."""
    flags = {field_name: flag for flag, field_name, _ in TRAIN_FLAGS}
    flags.update(env_id="ENV", env_kwargs="--env-arg", seed="--seed", output_dir="--output-dir")
    return flags


def _default_output_dir(args: argparse.Namespace) -> str:
    """runs/train/<env>-<algo>. A resume that names neither the folder nor the algorithm resumes
    the one run of the env with a checkpoint there (not necessarily the default algorithm's), and
    is refused where there are several."""
    from ..train.config import ALGORITHMS, default_output_dir
    from ..train.run_dir import has_checkpoint

    def folder(algo: str) -> Path:
        return Path(default_output_dir(args.env, algo))

    given = getattr(args, "given", None)
    if getattr(args, "resume", False) and given is not None and "algo" not in given:
        runs = [folder(algo) for algo in ALGORITHMS if has_checkpoint(folder(algo))]
        if len(runs) == 1:  # (the run says which it resumes, from which step)
            return str(runs[0])
        if len(runs) > 1:
            raise UsageError(f"--resume: {len(runs)} runs of {args.env} have a checkpoint ("
                             + ", ".join(map(str, runs)) + "); say which with --output-dir (or --algo)")
    return str(folder(args.algo))


def _with_checkpoint_settings(settings: dict, given: set[str] | None, output_dir: Path) -> dict:
    """A resume's settings: those its command line gives, and the checkpoint's for the rest, not
    TrainConfig's defaults (which would quietly turn the run into another: another group size or
    reply length). ``--env-arg`` pairs update the checkpoint's env options, ``--eval-env-arg`` pairs
    its evaluation's. ``given`` (the fields
    whose flags were on the command line) None, or no readable checkpoint: the settings as they
    are (a missing or damaged checkpoint is refused later, with its message). Saved settings that
    TrainConfig refuses (a state.json edited by hand) are refused here, naming their flags: the
    defaults in their place would quietly resume another run."""
    from ..core.errors import ConfigError
    from ..train import TrainConfig
    from ..train.run_dir import has_checkpoint, resumed_model, saved_state

    if given is None or not has_checkpoint(output_dir):
        return settings
    try:
        state = saved_state(output_dir)
    except ConfigError:
        return settings
    # A setting given on the command line replaces the saved one, so that it can mend a bad one;
    # the evaluation's env options are merged over the saved ones instead (below), as the env's are.
    overrides = {name: settings[name] for name in given if name in settings and name != "eval_env_kwargs"}
    try:
        saved = TrainConfig.from_saved({**state["config"], **overrides}).to_dict()
    except (ConfigError, TypeError, ValueError) as exc:
        if set(getattr(exc, "fields", ())) & set(overrides):  # the value given now, not the checkpoint's
            raise _RefusedAsGiven(exc) from None
        flags = {field_name: flag for flag, field_name, _ in TRAIN_FLAGS}
        named = [flags[field] for field in getattr(exc, "fields", ()) if field in flags]
        fix = f"give {' and '.join(dict.fromkeys(named))} to set it for this run, or " if named else ""
        raise UsageError(f"--resume: the settings saved with the checkpoint in {output_dir} (the 'config' of "
                         f"checkpoint/state.json) are refused: {exc}. The checkpoint is left as it is; {fix}mend "
                         "state.json, or start a new run in another output directory") from None
    merged = {name: value if name in given or name not in saved else saved[name] for name, value in settings.items()}
    # The checkpoint's env options are its env's: another env (which the resume then refuses, saying
    # so) would be made with them first, and refused as given options it does not know.
    same_env = isinstance(saved.get("env_id"), str) and same_env_id(saved["env_id"], settings["env_id"])
    saved_options = (saved.get("env_kwargs") or {}) if same_env else {}
    saved_eval_options = (saved.get("eval_env_kwargs") or {}) if same_env else {}
    merged.update(env_id=settings["env_id"], output_dir=settings["output_dir"],
                  env_kwargs={**saved_options, **settings["env_kwargs"]},
                  eval_env_kwargs={**saved_eval_options, **settings["eval_env_kwargs"]})
    if "model" not in given:
        merged["model"] = resumed_model(state, merged["model"])
    return merged


def _progress(steps: int):
    """A step's one line on stderr as it ends (the table on stdout comes at the end of the run)."""
    def show(metrics: dict) -> None:
        loss = metrics.get("loss")
        evaluated = (f"  eval reward {metrics['eval_reward_mean']:.3f}" if "eval_reward_mean" in metrics else "")
        print(f"step {metrics['step']}/{steps}: reward {metrics['reward_mean']:.3f}  success "
              f"{metrics['success_rate']:.3f}  loss {'-' if loss is None else f'{loss:.4g}'}{evaluated}  "
              f"{metrics['step_seconds']:.1f} s", file=sys.stderr, flush=True)
    return show


def _where_the_run_found(config) -> str:
    """For a resume that cannot import its ``module:EnvId`` env: where the run found the module."""
    from ..train.run_dir import has_checkpoint, saved_state

    output_dir = Path(config.output_dir)
    if ":" not in config.env_id or not has_checkpoint(output_dir):
        return ""
    try:
        found = saved_state(output_dir).get("env_module_file")
    except Exception:  # noqa: BLE001 (a checkpoint that cannot be read is refused later, saying why)
        return ""
    if not isinstance(found, str):
        return ""
    # The folder the import found it in: above its packages (pkg/sub.py for pkg.sub, pkg/__init__.py for pkg).
    depth = config.env_id.rpartition(":")[0].count(".") + (Path(found).name == "__init__.py")
    folder = str(Path(found).parents[min(depth, len(Path(found).parents) - 1)])
    return (f" (the run in {output_dir} imported it from {found}: run this from {folder}, or add {folder} to "
            "PYTHONPATH)")


def _option_sources(args: argparse.Namespace, flag_dest: str, field: str, options: dict) -> dict[str, str]:
    """Where each of a run's env options came from, where that is not its flag (``flag_dest``'s
    pairs, which win): the --config file's ``field``, or the checkpoint's settings."""
    given = _parse_env_args(getattr(args, flag_dest, None) or [])
    from_file = getattr(args, f"config_{field}", None) or {}
    return {key: f"--config {args.config}'s {field}" if key in from_file else f"the checkpoint's {field}"
            for key in options if key not in given}


def cmd_train(args: argparse.Namespace) -> int:
    from ..train.signals import refuse_idle_algorithm

    from ..core.errors import ConfigError

    config = train_config_from_args(args)
    _check_model_dir(config.model)
    try:
        env_class = _env_class(config.env_id)  # an unknown env id is refused here
    except UsageError as exc:
        raise UsageError(f"{exc}{_where_the_run_found(config) if args.resume else ''}") from None
    try:  # before the env is made: that may read its data files
        refuse_idle_algorithm(config.algo, config.env_id)
    except ConfigError as exc:
        raise (_flagged(exc, _train_field_flags()) or UsageError(str(exc))) from exc
    # Fail fast on a bad env id or option (one that training binds to the policy, such as CodeTCG's
    # step_scorer=rollout, bound to a stand-in for it: the policy is not loaded yet).
    sources = _option_sources(args, "env_arg", "env_kwargs", config.env_kwargs)
    _make_env(config.env_id, with_policy_stand_in(env_class.metadata, config.env_kwargs), "--env-arg",
              sources).close()
    if config.eval_env_kwargs:  # and the evaluation's, with its own options
        eval_sources = _option_sources(args, "eval_env_kwargs", "eval_env_kwargs", config.eval_env_kwargs)
        _make_env(config.env_id, with_policy_stand_in(env_class.metadata,
                                                      {**config.env_kwargs, **config.eval_env_kwargs}),
                  "--eval-env-arg", {**{key: where for key, where in sources.items()
                                        if key not in config.eval_env_kwargs}, **eval_sources}).close()
    output_dir = config.output_dir

    from ..train.loop import train  # (torch loads here, once the flags and the env are known good)

    # train() checks the output directory (on the writing rank, before the model loads).
    replaced = _stop_on_sigterm()
    try:
        history = train(config, resume=args.resume, on_step=_progress(config.steps))
    except ConfigError as exc:  # a setting the model refuses (e.g. --max-new-tokens past its context), by its flag
        flagged = _flagged(exc, _train_field_flags())
        if flagged is None:
            raise
        raise flagged from exc
    except KeyboardInterrupt as stop:
        from ..train.run_dir import METRICS_FILE, saved_state

        how, code = stop_reason(stop)
        rank, world = _launch()
        if world > 1 and rank != 0:  # a launcher stops every rank at once: rank 0 says where to resume
            say(f"\nrftgym train: rank {rank}: {how}, see rank 0")
            return code
        try:
            step = saved_state(Path(output_dir))["step"]
        except ConfigError:
            metrics = Path(output_dir) / METRICS_FILE
            logged = metrics.is_file() and metrics.stat().st_size > 0
            say(f"\n{how} before the first checkpoint, so there is nothing to resume; "
                + (f"start again with another --output-dir (or delete {output_dir})" if logged
                   else "run the same command to start again"))
        else:
            say(f"\n{how}: the checkpoint in {output_dir}/checkpoint is at step {step}; run the same "
                "command with --resume to continue from there")
        return code
    finally:  # (main leaves the launcher's process group, after any error is reported)
        _restore_handlers(replaced)
    if _launch()[0] != 0:  # under a launcher, rank 0 reports for the run
        return 0
    from ..rollout.metrics import format_table

    def significant(value) -> str:  # a loss or KL of 3e-7 (GSPO's narrow clip) is no "0.000"
        return "-" if value is None else f"{value:.3g}"

    rows = [[h["step"], h["reward_mean"], h["success_rate"], significant(h["loss"]), significant(h.get("kl_ref")),
             f"{h['learning_rate']:.3g}", h["step_seconds"]]
            + ([h.get("eval_reward_mean", "-"), h.get("eval_success_rate", "-")] if config.eval_every else [])
            for h in history]
    print(format_table(rows, ["step", "reward", "success", "loss", "kl_ref", "lr", "seconds"]
                       + (["eval reward", "eval success"] if config.eval_every else [])))
    full = [h["context_full_rate"] for h in history if h.get("context_full_rate")]
    if full:
        print(f"note: in {len(full)} of {len(history)} steps some episodes ended because the context left no room "
              f"for another reply (up to {max(full):.0%}; context_full_rate in metrics.jsonl); see "
              "--max-prompt-tokens and --max-new-tokens")
    print(f"metrics: {output_dir}/metrics.jsonl  curve: {output_dir}/learning_curve.png  "
          f"checkpoint: {output_dir}/checkpoint")
    return 0
