"""The command line: every command's arguments, and a parser that refuses a flag's prefix, names
the flag meant, and under a launcher leaves its errors to :func:`~rftgym.cli.main`."""

from __future__ import annotations

import argparse
import difflib
from typing import Sequence

from .agents import AGENTS, SAMPLING_FLAGS, _agent_choice, _NoteGiven, _NoteGivenRepeated
from .environments import cmd_envs
from .evaluate import DEFAULT_EVAL_EPISODES, cmd_eval
from .export import cmd_export
from .launcher import _launch
from .play import cmd_play
from .serve_retriever import cmd_serve_retriever
from .train import cmd_train
from .train_flags import TRAIN_FLAGS


def _seed_or_none(value: str) -> int | None:
    if value.strip().lower() == "none":
        return None
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid value: {value!r} (an integer, or none)") from None


def build_parser(defaults: bool = True) -> argparse.ArgumentParser:
    """The command line. ``defaults=False`` leaves ``rftgym train``'s flags without defaults, so a
    parse holds only the flags given (:func:`given_train_flags`)."""
    parser = _Parser(prog="rftgym", description="Environments, agents and trainers for RL fine-tuning of LLM agents.")
    sub = parser.add_subparsers(dest="command", metavar="{envs,play,eval,train,export,serve-retriever}")
    sub.required = True

    def command(name: str, help: str, **options) -> argparse.ArgumentParser:
        """A subcommand whose --help starts with what it does (its line in `rftgym --help`)."""
        return sub.add_parser(name, help=help, **{"description": help[0].upper() + help[1:] + ".", **options})

    p = command("envs", help="list registered environments")
    p.set_defaults(func=cmd_envs)

    def env_args(p: argparse.ArgumentParser, seed_default=0,
                 seed_help: str = "seed of the first episode (default 0)") -> None:
        p.add_argument("env", help="environment id, e.g. rftgym/VerifiableQA-v0 (see `rftgym envs`)")
        p.add_argument("--env-arg", action="append", default=[], metavar="KEY=VALUE",
                       help="environment option (JSON value or bare string); repeatable")
        p.add_argument("--seed", type=int, default=seed_default, help=seed_help)

    p = command("play", help="play an environment by typing the assistant's turns")
    env_args(p)
    p.add_argument("--episodes", type=int, default=1, help="episodes to play, one after another (default 1)")
    p.set_defaults(func=cmd_play)

    p = command("eval", help="evaluate an agent on one or more environments and print a table")
    p.add_argument("env", nargs="+", help="environment id(s), e.g. rftgym/VerifiableQA-v0 (see `rftgym envs`); with "
                                          "several, --env-arg applies to each and --out is a directory")
    p.add_argument("--env-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="environment option (JSON value or bare string); repeatable")
    p.add_argument("--seed", type=int, default=0, help="seed of the first episode (default 0)")
    p.add_argument("--sample-seed", type=_seed_or_none, default=SAMPLING_FLAGS["--sample-seed"][1], metavar="{N,none}",
                   action=_NoteGiven,
                   help="seed of the agent's sampling (with --temperature above 0; also of the random and "
                        "adversarial agents): the default and hf agents draw for each episode from a stream keyed "
                        "by this seed, its task seed and its turn, so it samples alike in any batch and in a run of "
                        "other --seed/--episodes; the api agent sends a seed so derived with each request. none: "
                        "fresh randomness, and no seed sent (default 0)")
    p.add_argument("--agent", type=_agent_choice, default="default", metavar="{" + ",".join(AGENTS) + ",module:name}",
                   action=_NoteGiven,
                   help="default: SmolLM2-135M-Instruct (local); hf: --model DIR (implied by --model); api: an "
                        "OpenAI-compatible server (implied by its --api-* flags); "
                        "random/adversarial: scripted text; module:name: an agent of your own (an Agent, or a class "
                        "or function that makes one; the sampling flags given are passed to it as temperature=, top_p=, "
                        "max_new_tokens=, seed=, stop=)")
    p.add_argument("--episodes", type=int, default=None,
                   help=f"episodes, with seeds --seed, --seed+1, ... (default: every task once for an env over a "
                        f"fixed benchmark such as CodeTCG's HumanEval, else {DEFAULT_EVAL_EPISODES})")
    p.add_argument("--num-envs", type=int, default=16, help="episodes run side by side (the agent's batch; default 16)")
    p.add_argument("--out", help="episodes JSONL path (default runs/eval/<env>-<agent>-<time>.jsonl)")
    p.add_argument("--model", help="local Hugging Face model directory for --agent hf")
    p.add_argument("--device", help="torch device for local models (default: cuda if available, else cpu)")
    p.add_argument("--prefix-cache-mb", type=float, default=None, metavar="MB",
                   help="memory for the local models' prefix reuse: a turn's prompt is prefilled from where what "
                        "the model already ran ends (on the generic decode loop, i.e. on CPU); 0 = off (default 1024)")
    p.add_argument("--api-base", help="OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1")
    p.add_argument("--api-model", help="model name to send to the API server")
    p.add_argument("--api-timeout", type=float, default=None,
                   help="seconds each attempt at a request to the API server may take in all, from connecting "
                        "to the reply's last byte (the server's whole generation included), before it is retried "
                        "(default 60)")
    p.add_argument("--api-max-retries", type=int, default=None,
                   help="retries of a request that failed for a passing reason (connection, timeout, HTTP 408, 409, "
                        "429, 5xx) before the evaluation stops (default 5)")
    p.add_argument("--api-backoff", type=float, default=None,
                   help="seconds the first retry waits at most; each later one up to twice as long, at most 8 s, "
                        "at random so that requests spread out (default 0.5)")
    p.add_argument("--api-extra", default=None, metavar="JSON",
                   help="a JSON object merged into every request body, for server options such as vLLM's "
                        "'{\"top_k\": 20}' or '{\"chat_template_kwargs\": {\"enable_thinking\": false}}'")
    p.add_argument("--max-new-tokens", type=int, default=SAMPLING_FLAGS["--max-new-tokens"][1], action=_NoteGiven,
                   help="tokens per reply at most (default 256)")
    p.add_argument("--temperature", type=float, default=SAMPLING_FLAGS["--temperature"][1], action=_NoteGiven,
                   help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=SAMPLING_FLAGS["--top-p"][1], action=_NoteGiven,
                   help="nucleus sampling's probability mass (default 1.0: off)")
    p.add_argument("--stop", default=SAMPLING_FLAGS["--stop"][1], action=_NoteGivenRepeated, metavar="STRING",
                   help="a string that ends a reply, e.g. '</search>' (the default and hf agents keep it, with the "
                        "token that completes it; a server leaves it out, and rftgym puts back the one it reports); "
                        "repeatable")
    p.add_argument("--baselines", action="store_true",
                   help="also run the env's baselines side by side (e.g. no-memory and heuristic pruning for MemoryQA)")
    p.add_argument("--resume", action="store_true",
                   help="finish an evaluation that stopped: the episodes it finished (in --out's partial file, "
                        "OUT.partial) are kept and only the others run; give the command that started it")
    p.set_defaults(func=cmd_eval)

    p = command("train", help="train a local model on an environment (GRPO family, PCAR, DCPO, RFT)",
                       description="Train a local model on an environment. Every TrainConfig field has a flag "
                                   "(defaults shown); see rftgym/train/config.py.")
    env_args(p, seed_default=0 if defaults else argparse.SUPPRESS,
             seed_help="seed of the run: the tasks each step draws, the policy's sampling and the model's initial "
                       "random state (LoRA adapters); the same seed and settings give the same run (default 0)")
    p.add_argument("--resume", action="store_true", help="continue from the checkpoint in --output-dir; the "
                                                         "flags not given are the checkpoint's settings")
    p.add_argument("--config", metavar="FILE", default=None if defaults else argparse.SUPPRESS,
                   help="TrainConfig settings from a JSON or YAML file, keyed by field as checkpoint/state.json's "
                        "'config' is (learning_rate, tasks_per_step, env_kwargs: {...}); flags given here win")
    groups = {}
    for flag, field_name, options in TRAIN_FLAGS:
        options = dict(options)
        if not defaults:
            options["default"] = argparse.SUPPRESS
        group = options.pop("group")
        if group not in groups:
            groups[group] = p.add_argument_group(group)
        groups[group].add_argument(flag, dest=field_name, **options)
    p.set_defaults(func=cmd_train)

    p = command("export", help="save a training run's model (LoRA merged) as a Hugging Face model directory")
    p.add_argument("run", help="the run's output directory (rftgym train --output-dir)")
    p.add_argument("out", help="a new directory for the model and its tokenizer")
    p.add_argument("--base-model", default=None, metavar="DIR",
                   help="where the run's base model is now, if it has moved (default: where the run loaded it)")
    p.add_argument("--adapter-only", action="store_true",
                   help="a LoRA run's adapters alone, as peft saves them (adapter_config.json naming the base "
                        "model's directory), for PeftModel.from_pretrained or vLLM's --lora-modules")
    p.set_defaults(func=cmd_export)

    from ..envs.search.server import DEFAULT_MAX_CONNECTIONS  # standard library only, with the retriever's names

    p = command("serve-retriever", help="serve a corpus index over HTTP (Search-R1's /retrieve shape)")
    p.add_argument("--corpus", default=None, help="corpus file (HotpotQA JSON, {title: [sentences]}, [{title, text}], "
                                                  "or FlashRAG JSONL)")
    p.add_argument("--world-seed", type=int, default=None, metavar="N",
                   help="instead of --corpus: the generated world with this seed, which an env without dataset_path "
                        "searches (its world_seed)")
    p.add_argument("--world-size", type=int, default=None, metavar="N",
                   help="the generated world's size, the env's world_size (default 30, SearchEvalQA's; MemoryQA's "
                        "is 60)")
    p.add_argument("--index", choices=("bm25", "dense"), default="bm25",
                   help="bm25 (default) or dense (all-MiniLM-L6-v2 embeddings, FAISS)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to serve on (default 127.0.0.1: this machine only; 0.0.0.0 for every interface)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    p.add_argument("--max-connections", type=int, default=DEFAULT_MAX_CONNECTIONS, metavar="N",
                   help=f"connections handled at once (default {DEFAULT_MAX_CONNECTIONS}); more wait their turn to "
                        "be accepted, none is refused")
    p.set_defaults(func=cmd_serve_retriever)
    return parser


def given_train_flags(argv: Sequence[str] | None) -> set[str]:
    """The TrainConfig fields (and ``seed``) whose flags ``rftgym train``'s command line gives: the
    same arguments parsed again with no defaults, so that only what was given remains."""
    namespace = vars(build_parser(defaults=False).parse_args(argv))
    return {name for name in namespace if name in {field for _, field, _ in TRAIN_FLAGS} | {"seed"}}


class _LaunchedArgumentError(Exception):
    """An argparse error under a launcher: :func:`main` prints it once for the run."""

    def __init__(self, parser: argparse.ArgumentParser, message: str):
        super().__init__(message)
        self.parser = parser


class _Parser(argparse.ArgumentParser):
    """argparse's parser (and its subcommands', which add_subparsers makes of the same class),
    whose errors under a launcher go to :func:`main`, which prints them once for the run instead of
    once per rank. A flag must be given whole: argparse would take a prefix (--ste for --steps),
    which means another flag, or none, once a flag is added; refused, it is named with the flag it
    is probably short for (:meth:`parse_args`)."""

    def __init__(self, *args, allow_abbrev: bool = False, **kwargs):
        super().__init__(*args, allow_abbrev=allow_abbrev, **kwargs)

    def error(self, message):
        if _launch()[1] > 1:
            raise _LaunchedArgumentError(self, message)
        super().error(message)

    def format_usage(self) -> str:
        """argparse's usage, or where it runs past a few lines (train's lists some 80 options, and
        hid the error under them) its positional arguments, pointing at ``--help`` for the rest."""
        usage = super().format_usage()
        if usage.count("\n") <= 4:
            return usage
        positional = [action.metavar or action.dest for action in self._actions
                      if not action.option_strings and not isinstance(action, argparse._SubParsersAction)]
        return f"usage: {self.prog} {' '.join(positional)} [options] ({self.prog} --help lists them)\n"

    def parse_args(self, args=None, namespace=None):
        """argparse's parse, but an argument that no parser took is reported by the subcommand it
        came after (its usage, and the option it is probably a slip of), not by the top level."""
        parsed, unknown = self.parse_known_args(args, namespace)
        if unknown:
            commands = [action for action in self._actions if isinstance(action, argparse._SubParsersAction)]
            command = commands[0].choices.get(getattr(parsed, commands[0].dest, None)) if commands else None
            reporter = command or self
            known = [option for action in reporter._actions for option in action.option_strings]
            close = [match for typed in unknown if typed.startswith("--")
                     for match in _meant(typed.partition("=")[0], known)]
            guess = f" (did you mean {' or '.join(dict.fromkeys(close))}?)" if close else ""
            reporter.error(f"unrecognized arguments: {' '.join(unknown)}{guess}")
        return parsed


def _meant(typed: str, known: list[str]) -> list[str]:
    """The flags ``typed`` is probably a slip of: those it begins (an abbreviation, refused: see
    :class:`_Parser`), else the closest one."""
    started = [option for option in known if option.startswith(typed)]
    return started[:3] or difflib.get_close_matches(typed, known, n=1)
