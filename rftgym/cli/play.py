"""``rftgym play``: an environment played by hand, the user typing the assistant's turns."""

from __future__ import annotations

import argparse
import sys

from .common import UsageError
from .environments import _make_env, _parse_env_args, env_arg_pair


def cmd_play(args: argparse.Namespace) -> int:
    from ..envs.common import INFO_IF_CUT, REWARD_IF_CUT, settle_cut
    from ..rollout.engine import checked_reset, checked_step

    if sys.stdin is None or getattr(sys.stdin, "closed", False):
        raise UsageError("the assistant's turns are read from stdin, which is closed; type them, or pipe in a "
                         "file of them")
    env_kwargs = _parse_env_args(args.env_arg)
    _refuse_policy_options(args.env, env_kwargs)
    if env_kwargs.get("render_mode") == "human":
        raise UsageError("--env-arg render_mode=human prints the whole context on every step, and play shows each "
                         "message already (once, as it comes); drop it here")
    env = _make_env(args.env, env_kwargs)
    print(f"{args.env}: you are the assistant. End a line with '\\' to continue on the next line; "
          "Ctrl-D quits.\n")
    # A terminal shows what the user types; piped turns (a file of them) would leave the transcript
    # with prompts and no answers, so those are printed after their prompts.
    echo = not _is_terminal(sys.stdin)
    if hasattr(sys.stdin, "reconfigure"):
        # Undecodable bytes reach _valid_text (as U+FFFD) instead of failing a whole buffered read.
        sys.stdin.reconfigure(errors="surrogateescape")
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(errors="replace")  # a terminal that is not UTF-8 shows '?' for '…'

    try:
        for episode in range(args.episodes):
            # Held to the protocol as `rftgym eval` holds it: an env's own error, or a reward that is
            # not a finite number, is an error naming the env, the seed and the turn.
            seed = None if args.seed is None else args.seed + episode
            context, info = checked_reset(env, seed)
            done, turns = False, 0
            seen: set[str] = set()  # (message ids are unique within an episode only)
            while not done:
                _show_new_messages(context, seen)
                try:
                    text = _read_turn(echo)
                except _InputEnded as end:
                    print()  # ends the prompt's line
                    if echo:  # a file of turns ran out (Ctrl-D at a terminal needs no telling)
                        print(_input_ended_note(episode, args.episodes, turns, end.unsent_lines))
                    print("bye")
                    return 0
                before = context
                context, reward, terminated, truncated, info = checked_step(env, seed, turns, text)
                turns += 1
                if truncated and not terminated:  # paid and reported as rftgym eval records it
                    reward, info = settle_cut(reward, info)
                    # (what the cut pays is in the reward shown now: not shown again beside it)
                    info = {k: v for k, v in info.items() if k not in (REWARD_IF_CUT, INFO_IF_CUT)}
                # The user's own turn is the first assistant message the step added; any other is the env's.
                own = next((m for m in context if m.role == "assistant" and m.id not in before.ids), None)
                if own is not None:
                    seen.add(own.id)
                # An env may edit the context (e.g. a memory prune): say what the model no longer sees.
                kept = set(context.ids)
                removed = [m for m in before if m.id not in kept]
                if removed:
                    print(f"[context edited: {len(removed)} earlier message(s) removed]")
                    for message in removed:
                        print(f"  - {message.id} ({message.role}): {_first_line(message.content)}")
                    print()
                done = terminated or truncated
                print(f"reward={reward:.3f} terminated={terminated} truncated={truncated} "
                      f"info={_brief(info, final=done)}\n")
            _show_new_messages(context, seen)  # the last observation: why the episode ended, say
    finally:
        env.close()
    return 0


def _show_new_messages(context, seen: set[str]) -> None:
    """Print the messages of ``context`` not shown yet (the user's own turns are marked seen)."""
    for message in context:
        if message.id not in seen:
            print(f"[{message.role}]\n{message.content}\n")
            seen.add(message.id)


# The longest collection (its repr, in characters) that an episode's last turn shows as it is.
SHORT_COLLECTION = 80


def _short(collection) -> bool:
    return len(collection) > 0 and len(repr(collection)) <= SHORT_COLLECTION


def _brief(info: dict, final: bool = False) -> dict:
    """``info`` for a person playing: collections by their size (CodeTCG's tests hold every
    expected output, and a wall of text per turn hides the rest), long text cut, empty values left
    out. At the episode's end (``final``) a short collection is shown as it is: the expected
    answers, say, which would have given the task away before."""
    shown = {}
    for key, value in info.items():
        if value is None or (isinstance(value, (str, list, tuple, dict, set)) and len(value) == 0):
            continue  # (`in` would compare arrays)
        if isinstance(value, (list, tuple, dict, set)) and not (final and _short(value)):
            value = f"<{len(value)} item{'s' if len(value) != 1 else ''}>"
        elif isinstance(value, str) and len(value) > 200:
            value = value[:197] + "..."
        shown[key] = value
    return shown


class _InputEnded(Exception):
    """stdin ran out (Ctrl-D, or the end of a piped file) before a whole turn was read."""

    def __init__(self, unsent_lines: int):
        super().__init__(f"input ended with {unsent_lines} line(s) of the turn read")
        self.unsent_lines = unsent_lines  # lines that ended in '\\' and so waited for more


def _read_turn(echo: bool = False) -> str:
    """One assistant turn: lines ending in '\\' continue on the next. ``echo`` prints each line
    after its prompt, as it goes into the turn, for input that no terminal shows."""
    lines = []
    prompt = "assistant> "
    while True:
        try:
            line = _valid_text(input(prompt))
        except EOFError:
            raise _InputEnded(len(lines)) from None
        except UnicodeDecodeError as exc:  # stdin decoded strictly (e.g. PYTHONIOENCODING=utf-8)
            if echo:
                print()  # the prompt's line ends here, as a terminal's would at Enter
            retry = "it was skipped" if echo else "type it again"
            print(f"\n(that line was not valid {exc.encoding}; {retry})", file=sys.stderr)
            continue
        line = line.removesuffix("\r")  # piped Windows text: its continuation mark sits before a CR
        continues = line.endswith("\\")
        if continues:
            line = line[:-1]
        if echo:
            print(line)
        lines.append(line)
        if not continues:
            return "\n".join(lines)
        prompt = "........> "


def _input_ended_note(episode: int, episodes: int, turns: int, unsent_lines: int) -> str:
    """What a piped run's early end left undone: the episode cut short, and a turn never sent."""
    note = (f"(end of input: episode {episode + 1} of {episodes} stops unfinished after {turns} "
            f"turn{'s' if turns != 1 else ''}")
    if unsent_lines:
        lines = f"{unsent_lines} line{'s' if unsent_lines != 1 else ''}"
        note += f"; a turn begun with {lines} ending in '\\' was not sent, as no line came to finish it"
    return note + ")"


def _is_terminal(stream) -> bool:
    try:
        return stream is not None and stream.isatty()
    except (AttributeError, ValueError):  # a stand-in stream, or one closed
        return False


def _first_line(text: str, width: int = 70) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= width else line[:width - 3] + "..."


def _valid_text(line: str) -> str:
    """The line with any undecodable input bytes as U+FFFD: stdin decoded with surrogateescape (a
    C or UTF-8 locale) keeps them as lone surrogates, which no encoder, tokenizer or file accepts."""
    try:
        return line.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    except UnicodeEncodeError:  # a surrogate that is not an escaped byte
        return line.encode("utf-8", "replace").decode("utf-8")


def _refuse_policy_options(env_id: str, env_kwargs: dict) -> None:
    """An option that stands for the policy acting in the env (CodeTCG's ``step_scorer=rollout``)
    has none to stand for here: the user plays the assistant."""
    from ..envs.common import env_metadata

    try:
        bound = env_metadata(env_id).get("policy_options") or {}
    except Exception:  # noqa: BLE001 (an env id that does not resolve is said by _make_env)
        return
    given = [name for name in bound if isinstance(env_kwargs.get(name), str)]
    if given:
        flags = " and ".join(f"--env-arg {env_arg_pair(name, env_kwargs[name])}" for name in given)
        raise UsageError(f"{flags} stands for the policy acting in the env, and in rftgym play you are the "
                         "assistant: no policy is there to bind it to. Drop it here; rftgym eval (with --agent) and "
                         "rftgym train bind their policy to it")
