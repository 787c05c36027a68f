"""``rftgym eval``: an agent (and an env's baselines) on one or more environments, each finished
episode streamed to a file, and the table of results."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Sequence

import gymnasium as gym

from ..core.errors import ConfigError
from ..core.jsonl import is_jsonl
from ..envs.common import short_env_name, with_policy_options, with_policy_stand_in
from .agents import _agent_label, _build_agent, _check_agent_flags
from .common import UsageError, _json_object, check_seed_range
from .environments import _env_class, _make_env, _parse_env_args
from .eval_output import (_claim_unique, _finished_episodes, _holds_finished_episodes, _partial, _partial_settings,
                          _users_sources, _writable_file, absolute_file_options, data_file_fingerprints, holds_partial,
                          release_partials)
from .sigterm import say, stop_reason
from .user_code import _load_object, load_failure


DEFAULT_EVAL_EPISODES = 32
MAX_EVAL_EPISODES = 1_000_000
EVAL_COLUMNS = ["env", "agent", "episodes", "reward", "success", "turns", "format_err", "sampled_tok", "prompt_tok",
                "ep/s"]


def _cell(value) -> str:
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def cmd_eval(args: argparse.Namespace) -> int:
    if args.episodes is not None and args.episodes < 1:
        raise UsageError(f"--episodes must be at least 1, got {args.episodes}")
    if args.episodes is not None and args.episodes > MAX_EVAL_EPISODES:
        raise UsageError(f"--episodes {args.episodes} is more than one evaluation holds ({MAX_EVAL_EPISODES:,}: every "
                         "episode is kept for the table); split it into runs with --seed S --episodes N")
    if args.num_envs < 1:
        raise UsageError(f"--num-envs must be at least 1, got {args.num_envs}")
    if args.resume and (not args.out or len(args.env) > 1 or args.baselines):
        raise UsageError("--resume finishes one environment's evaluation of one agent, whose episodes are in --out's "
                         "partial file (OUT.partial); give that environment and that --out, without --baselines "
                         "(several environments write files of new names, which no later run finds, and a baseline's "
                         "run that finished keeps no note of its settings)")
    _check_agent_flags(args)
    repeated = sorted({env_id for env_id in args.env if args.env.count(env_id) > 1})
    if repeated:
        raise UsageError(f"{', '.join(repeated)} is given more than once; give each environment once (its "
                         "episodes are set by --episodes and --seed)")
    env_ids = list(args.env)
    env_kwargs = _parse_env_args(args.env_arg)
    episodes_per_env = {}
    for env_id in env_ids:
        # Fail fast on a bad env id or option, before loading a model (an option bound to the policy,
        # such as CodeTCG's step_scorer=rollout, is checked bound to a stand-in for it).
        probe = _make_env(env_id, with_policy_stand_in(_env_class(env_id).metadata, env_kwargs))
        # An env over a fixed benchmark (e.g. HumanEval) names its size, so that the default
        # evaluation covers each task once; others get DEFAULT_EVAL_EPISODES seeded episodes.
        episodes_per_env[env_id] = args.episodes or getattr(probe.unwrapped, "eval_episodes", None) \
            or DEFAULT_EVAL_EPISODES
        probe.close()
    most = max(episodes_per_env.values())
    check_seed_range(args.seed, most, f"{most} episodes")  # an env's default number (a given --episodes was checked)
    for env_id in env_ids:
        _check_eval_metadata(env_id, args.baselines)
    if args.baselines and not any(_env_class(e).metadata.get("eval_baselines") for e in env_ids):
        raise UsageError(f"{', '.join(env_ids)} {'declares' if len(env_ids) == 1 else 'declare'} no evaluation "
                         "baselines; drop --baselines")
    rows, written = [], []  # rows: (headers, row); each env has its own columns after the shared ones
    # per env: episodes ended for want of context, and replies cut at --max-new-tokens (of how many)
    context_full: dict[str, int] = {}
    cut_replies: dict[str, tuple[int, int]] = {}
    agent = None
    outs: dict[str, Path] = {}
    paths: list[Path] = []
    made = _folders_to_make(args.out, len(env_ids))
    try:
        outs = _output_paths(args.out, env_ids, args.agent)
        # Every run's file (each baseline's too): a bad path is refused now, not after the runs before it.
        paths = [path for env_id in env_ids for path in _baseline_paths(env_id, outs[env_id], args.baselines).values()]
        if len(set(paths)) < len(paths):  # e.g. a baseline's file and another env's; never one file for two runs
            raise UsageError(f"two runs of this evaluation would write the same file ({', '.join(map(str, paths))}); "
                             "give another --out")
        sources = _users_sources(env_ids, args.agent, args.baselines)
        for path in paths:
            _writable_file(path, "--out", env_kwargs, {"--model": args.model} if args.agent == "hf" and args.model
                           else {}, sources, resuming=args.resume)
        if args.resume and not any(_holds_finished_episodes(path) for path in paths):
            raise UsageError(f"--resume: nothing to resume, no {' or '.join(str(_partial(p)) for p in paths)} holds "
                             "episodes; drop --resume to run the evaluation")
        agent = _build_agent(args)
        for env_id in env_ids:
            for row, path, summary in _evaluate_env(args, env_id, agent, env_kwargs, episodes_per_env[env_id],
                                                    outs[env_id]):
                rows.append(row)
                written.append(path)
                if summary["context_full"]:
                    context_full[env_id] = context_full.get(env_id, 0) + summary["context_full"]
                if summary["cut_replies"]:
                    cut, replies = cut_replies.get(env_id, (0, 0))
                    cut_replies[env_id] = (cut + summary["cut_replies"], replies + summary["replies"])
    except BaseException:
        if written:  # the runs that completed before a later one failed are shown, not hidden behind the error
            _print_eval_results(len(env_ids), rows, written, context_full, cut_replies, args.max_new_tokens)
        raise
    finally:  # the agent, also after a failure; the (empty) partial files of runs that never started
        if agent is not None:
            _close_agent(agent)
        _remove_empty_partials([*paths, *outs.values()])  # outs: default names claimed before a refusal
        release_partials([*paths, *outs.values()])
        _remove_empty_folders(made)  # a refusal leaves no folder it made for --out
    _print_eval_results(len(env_ids), rows, written, context_full, cut_replies, args.max_new_tokens)
    return 0


def _close_agent(agent) -> None:
    """Close the agent; a close() that raises is said, not raised: the episodes are written by then,
    and the results table (or the error that stopped the run) is what the user needs to see."""
    try:
        agent.close()
    except Exception as exc:  # noqa: BLE001 (an agent of your own may raise anything)
        say(f"warning: agent {getattr(agent, 'name', type(agent).__name__)!r}: close() raised {type(exc).__name__}: "
            f"{exc} (the episodes and results are kept)")


def _output_paths(out: str | None, env_ids: Sequence[str], agent: str) -> dict[str, Path]:
    """Each env's episodes file: ``--out`` itself for one env, else a default name in ``--out``
    (a directory) or in runs/eval, claimed at once so that no other evaluation writes it."""
    if out and len(env_ids) > 1 and (is_jsonl(out) or Path(out).is_file()):
        raise UsageError("with several environments --out is a directory (one JSONL per environment), "
                         f"not a file; got {out}")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    outs: dict[str, Path] = {}
    for env_id in env_ids:
        if len(env_ids) == 1 and out and not out.endswith(("/", os.sep)):
            outs[env_id] = Path(out)
        else:
            outs[env_id] = _claim_unique((Path(out) if out else Path("runs") / "eval")
                                         / f"{short_env_name(env_id)}-{_agent_label(agent)}-{stamp}.jsonl",
                                         set(outs.values()))
    return outs


def _folders_to_make(out: str | None, env_count: int) -> list[Path]:
    """The folders that writing this evaluation's files will make (none of them exists yet), the
    deepest first."""
    folder = Path(out).parent if out and env_count == 1 and not out.endswith(("/", os.sep)) \
        else Path(out) if out else Path("runs") / "eval"
    missing = []
    while not folder.exists() and folder != folder.parent:
        missing.append(folder)
        folder = folder.parent
    return missing


def _remove_empty_partials(paths: Sequence[Path]) -> None:
    """Remove the empty partial files this process made for ``paths`` (and let go of them); an
    empty one another evaluation holds is its own, and is left alone."""
    for path in dict.fromkeys(paths):
        partial = _partial(path)
        if not holds_partial(path):
            continue
        try:
            if partial.is_file() and partial.stat().st_size == 0:
                partial.unlink()
                _partial_settings(path).unlink(missing_ok=True)
        except OSError:  # e.g. a name too long: it was refused, and nothing was made there
            pass


def _remove_empty_folders(folders: Sequence[Path]) -> None:
    """Remove those of ``folders`` (:func:`_folders_to_make`) that are still empty."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:  # holds episodes (or another evaluation's files), or was never made
            pass


def _print_eval_results(env_count: int, rows, written: Sequence[Path], context_full: dict[str, int],
                        cut_replies: dict[str, tuple[int, int]], max_new_tokens: int | None) -> None:
    """The table of the runs in ``rows``, notes on their episodes, and where they were written."""
    from ..rollout import format_table

    if env_count == 1:
        print(format_table([row for _, row in rows], rows[0][0]))
    else:
        # Envs have different own columns: the shared ones, then each env's as key=value text.
        shared = len(EVAL_COLUMNS)
        table = [row[:shared] + [" ".join(f"{h}={_cell(v)}" for h, v in zip(row_headers[shared:], row[shared:]))]
                 for row_headers, row in rows]
        print(format_table(table, EVAL_COLUMNS + ["env metrics"]))
    for env_id, full in context_full.items():
        print(f"note: {full} {env_id} episode(s) ended because the context left no room for another reply "
              "(info context_full, scored as unfinished); lower --max-new-tokens or use a longer-context model")
    limit = f"--max-new-tokens {max_new_tokens}" if max_new_tokens else "the agent's own limit"
    for env_id, (cut, replies) in cut_replies.items():
        print(f"note: {cut} of {replies} {env_id} replies stopped at the token limit ({limit}, finish_reason "
              "'length'): a reply cut there may have lost its answer or the end of its code; raise --max-new-tokens "
              "if the tasks need longer replies")
    # Flushed: after a failure the error follows on stderr, and should not come before this.
    print("episodes written to " + ", ".join(str(p) for p in written), flush=True)


def _check_eval_metadata(env_id: str, baselines: bool) -> None:
    """An env's own eval columns and baselines (its class's metadata; the baselines' wrappers are
    loaded when they will run, with ``--baselines``), checked before any episode runs: a
    malformed entry would otherwise fail after the whole evaluation, or after the envs before it."""
    from ..rollout.metrics import metric_spec_problem

    metadata = _env_class(env_id).metadata
    problem = metric_spec_problem(metadata.get("eval_metrics", ()), EVAL_COLUMNS, "the table's own")
    if problem:
        raise ConfigError(f"{env_id}: metadata['eval_metrics'] is malformed: {problem}; e.g. "
                          "(('hit_rate', 'hit', 'final_rate'),) adds a column hit_rate, the share of episodes whose "
                          "last turn's info['hit'] is true")
    declared = metadata.get("eval_baselines", ())
    entries = declared if isinstance(declared, (list, tuple)) else [declared]
    labels = []
    for entry in entries:
        if not (isinstance(entry, (list, tuple)) and len(entry) == 3 and isinstance(entry[0], str)
                and isinstance(entry[1], dict) and (entry[2] is None or isinstance(entry[2], str))):
            raise ConfigError(f"{env_id}: metadata['eval_baselines'] has the entry {entry!r}; each is a (label, env "
                              "options dict, 'module:AgentWrapper' or None) triple")
        label, _, wrapper = entry
        # The label names the baseline's row and its episodes' file (beside the agent's own).
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", label) or label in labels:
            raise ConfigError(f"{env_id}: metadata['eval_baselines'] has the label {label!r}"
                              f"{' twice' if label in labels else ''}; labels are distinct, non-empty and made of "
                              "letters, digits, '_', '.' and '-' (they name files)")
        labels.append(label)
        if wrapper is not None and baselines:  # --baselines: the wrappers will run
            try:
                _load_object(wrapper)
            except Exception as exc:  # noqa: BLE001 (the user's module may raise anything while importing)
                raise ConfigError(f"{env_id}: the baseline {label!r}'s agent wrapper {wrapper!r} cannot be loaded: "
                                  f"{load_failure(wrapper.partition(':')[0], exc, form='module:Wrapper')}") from None


def _evaluate_env(args, env_id: str, agent, env_kwargs: dict, episodes: int, out: Path):
    """One env: the agent as it is, then each baseline the env declares (the same agent under other
    env options, or wrapped), all on the same seeds. Yields ``((headers, row), path, summary)``
    for each run as it completes, so that a later run's failure does not hide it."""
    from ..core.records import write_episodes_jsonl

    env_class = _env_class(env_id)
    given_kwargs = env_kwargs
    # The options that stand for the policy (a token counter, CodeTCG's step_scorer=rollout) are its own.
    env_kwargs = with_policy_options(env_class.metadata, env_kwargs, agent)
    seeds = [args.seed + i for i in range(episodes)]
    out.parent.mkdir(parents=True, exist_ok=True)
    runs = [("", agent, env_kwargs)]
    for label, overrides, wrapper in env_class.metadata.get("eval_baselines", ()) if args.baselines else ():
        runs.append((label, _load_object(wrapper)(agent) if wrapper else agent, {**env_kwargs, **overrides}))
    paths = list(_baseline_paths(env_id, out, args.baselines).values())
    weights = _weights_of(agent)  # (a baseline's wrapper acts with the same model)
    data_files = data_file_fingerprints(given_kwargs)  # (and reads the same files: hashed once)
    for (label, run_agent, run_kwargs), path in zip(runs, paths):
        settings = _run_settings(args, env_id, label, given_kwargs, seeds, **weights, data_files=data_files)
        run_episodes_, elapsed, ran = _evaluate(args, env_id, run_agent, run_kwargs, seeds, label, path, settings)
        target = path.resolve()  # a symlinked --out is written through, not replaced
        complete = target.with_name(target.name + ".complete")
        try:  # in seed order, then in place of any earlier file at once
            write_episodes_jsonl(complete, run_episodes_,
                                 compressed=path.name.lower().endswith(".gz") or target.name.lower().endswith(".gz"))
            os.replace(complete, target)
        except OSError as exc:
            raise UsageError(f"cannot write the episodes to {path} ({exc.strerror or exc}); they are all in "
                             f"{_partial(path)}") from None
        finally:
            complete.unlink(missing_ok=True)
        _keep_settings(path)  # (while the partial file is held: no other evaluation has noted its settings)
        _partial(path).unlink(missing_ok=True)
        release_partials([path])  # its lock too: another evaluation may take the name now
        headers, row, summary = _eval_row(env_id, env_class, label or getattr(run_agent, "name", args.agent),
                                          run_episodes_, elapsed, ran)
        yield (headers, row), path, summary


def settings_file(path: Path) -> Path:
    """Where a completed evaluation's settings stay beside its episodes: ``OUT.settings.json``."""
    return path.with_name(path.name + ".settings.json")


def _keep_settings(path: Path) -> None:
    """Keep the settings noted beside the partial file (what was evaluated: the model's path, the
    run's step and its weights' fingerprint, the sampling) as ``OUT.settings.json``: the episodes
    alone do not say which model wrote them. A note that cannot be kept is said, not an error:
    the episodes are written."""
    try:
        os.replace(_partial_settings(path), settings_file(path))
    except OSError as exc:
        say(f"note: could not keep this evaluation's settings as {settings_file(path)} ({exc.strerror or exc})")
        for stale in (_partial_settings(path), settings_file(path)):  # (an earlier evaluation's: not these episodes')
            try:
                stale.unlink(missing_ok=True)
            except OSError:
                pass


def _baseline_paths(env_id: str, out: Path, baselines: bool) -> dict[str, Path]:
    """Where each run of an env's evaluation writes its episodes, by label: ``""`` (the agent as it
    is) to ``out``, and with ``--baselines`` each baseline the env declares beside it."""
    labels = [label for label, _, _ in _env_class(env_id).metadata.get("eval_baselines", ())] if baselines else []
    suffix = out.name[-len(".jsonl.gz"):] if out.name.lower().endswith(".jsonl.gz") else out.suffix
    stem = out.name[:len(out.name) - len(suffix)]
    return {"": out, **{label: out.with_name(f"{stem}-{label}{suffix}") for label in labels}}


def _weights_of(agent) -> dict:
    """A fingerprint of the weights a local agent acts with, and the dtype it holds them in (None
    for an agent without a torch model: a server's, or one of your own): ``--model RUN`` names a
    directory whose weights change as the run goes on, a model directory may be written over, and
    the same weights load in bfloat16 on CUDA, in float32 on a CPU."""
    model = getattr(agent, "model", None)
    if not hasattr(model, "named_parameters"):
        return {"weights": None, "dtype": None}
    from ..train.base_model import weights_fingerprint

    dtype = next((str(p.dtype).removeprefix("torch.") for p in model.parameters()), None)
    return {"weights": weights_fingerprint(model), "dtype": dtype}


def _run_settings(args, env_id: str, label: str, env_kwargs: dict, seeds: Sequence[int],
                  weights: str | None = None, dtype: str | None = None, data_files: dict | None = None) -> dict:
    """What the episodes of one run of an evaluation depend on, as noted beside its partial file
    (JSON's form of them, so that a resume compares like with like); how they are batched, and
    the transport to an API server (its address: a server restarted on another port serves the
    same model), are not. ``--api-extra`` counts as the object it gives, however it is spaced.
    ``model`` is the directory's full path (the same folder named another way is the same
    model); ``weights`` and ``dtype`` (:func:`_weights_of`) what it held when the evaluation ran;
    an env's file options (``dataset_path``, ``corpus_path``) their full paths, and ``data_files``
    the sha256 of what those files held (a file rewritten in place is another dataset; given, as
    :func:`~.eval_output.data_file_fingerprints` gives them, when several runs read the same files).
    Env options that say how a service is reached (the env's ``metadata["transport_options"]``:
    a remote retriever's address, timeout and retries) are noted, but a resume does not compare
    them (:func:`~.eval_output._finished_episodes`), as it does not an API server's address."""
    model = args.model
    if model is not None and Path(model).expanduser().exists():
        model = str(Path(model).expanduser().resolve())
    settings = {"env": env_id, "run": label or "the agent", "agent": args.agent, "model": model,
                "model_step": getattr(args, "model_step", None), "weights": weights,
                "dtype": dtype,
                "api_model": args.api_model, "api_extra": _json_object(args.api_extra, "--api-extra"),
                "env_args": absolute_file_options(env_kwargs),
                "data_files": data_file_fingerprints(env_kwargs) if data_files is None else data_files,
                "seed": seeds[0], "episodes": len(seeds),
                "max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "top_p": args.top_p,
                "sample_seed": args.sample_seed, "stop": list(getattr(args, "stop", None) or ())}
    return json.loads(json.dumps(settings, default=repr))


def _evaluate(args, env_id, agent, env_kwargs, seeds, label, path: Path, settings: dict):
    """Run the episodes; each finished one is appended at once to ``path``'s partial file, so an
    interrupted or failed evaluation keeps what it finished, and an earlier ``path`` is left as it
    was until the evaluation completes. With ``--resume``, the episodes a partial file of the same
    ``settings`` holds are kept and the others run. Returns the episodes in seed order, the seconds
    taken and how many episodes ran."""
    from tqdm import tqdm

    from ..core.records import append_episode_jsonl
    from ..rollout import RolloutConfig, run_episodes

    started = time.perf_counter()
    desc = f"eval {env_id}" + (f" ({label})" if label else "")
    finished = 0
    partial = _partial(path)
    transport = _env_class(env_id).metadata.get("transport_options", ())
    kept = _finished_episodes(path, env_id, seeds, settings, transport) \
        if args.resume and _holds_finished_episodes(path) else []
    done_seeds = {episode.seed for episode in kept}
    todo = [seed for seed in seeds if seed not in done_seeds]
    try:
        handle = open(partial, "a" if kept else "w", encoding="utf-8")
        if not kept:
            _partial_settings(path).write_text(json.dumps(settings, indent=1), encoding="utf-8")
    except OSError as exc:
        raise UsageError(f"--out {path}: cannot write {partial} ({exc.strerror or exc})") from None
    if kept:
        say(f"--resume: {len(kept)} of {len(seeds)} episodes were finished in {partial}; running the other "
            f"{len(todo)}")
    with handle, tqdm(total=len(todo), desc=desc, unit="ep", file=sys.stderr) as bar:
        def done(episode):
            nonlocal finished
            try:
                append_episode_jsonl(handle, episode)
            except OSError as exc:
                raise UsageError(f"cannot write episodes to {partial} ({exc.strerror or exc}); the "
                                 f"{finished + len(kept)} finished before are there") from None
            finished += 1
            bar.update(1)

        try:
            episodes = run_episodes(lambda: gym.make(env_id, **env_kwargs), agent, todo,
                                    config=RolloutConfig(num_envs=args.num_envs), on_episode=done) if todo else []
        except BaseException as exc:
            why = stop_reason(exc)[0] if isinstance(exc, KeyboardInterrupt) else "stopped by an error"
            as_it_was = f"; {path} is as it was" if path.exists() else ""
            if finished or kept:
                resumable = len(args.env) == 1 and not args.baselines  # (what --resume takes)
                how = f"; the same command with --out {path} --resume runs the others" if resumable else ""
                say(f"\n{why}: the {finished + len(kept)} finished episodes are in {partial}{as_it_was}{how}")
            else:
                partial.unlink(missing_ok=True)
                _partial_settings(path).unlink(missing_ok=True)
                if isinstance(exc, KeyboardInterrupt):
                    say(f"\n{why} before any episode finished{as_it_was}")
            if isinstance(exc, KeyboardInterrupt):
                exc.reported = True
            raise
    by_seed = {episode.seed: episode for episode in [*kept, *episodes]}
    return [by_seed[seed] for seed in seeds], time.perf_counter() - started, len(episodes)


def _eval_row(env_id, env_class, agent_name, episodes, elapsed, ran):
    from ..rollout import summarize
    from ..rollout.metrics import env_metrics

    s = summarize(episodes)
    headers = list(EVAL_COLUMNS)
    row = [env_id, agent_name, s["episodes"], s["reward"], s["success"], s["turns"],  # (NaN shows as "-")
           s["format_error_rate"], s["sampled_tokens"], s["prompt_tokens"], ran / elapsed if ran else "-"]
    extra = env_metrics(episodes, env_class.metadata.get("eval_metrics", ()))
    return headers + list(extra), row + ["-" if v is None else v for v in extra.values()], s
