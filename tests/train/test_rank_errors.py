"""`rftgym train` under a launcher (two CPU processes, gloo): an error every rank hits is printed
once, by rank 0, the other rank saying one line; an error one rank hit alone is printed by that
rank, with its rank; every rank exits with the error's status."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rftgym.core.errors import ConfigError, EnvContractError
from rftgym.train.distributed import Distributed, ErrorReport, PeerRankError, RankFailures, who_reports

TESTS_DIR = Path(__file__).resolve().parents[1]

# One launch runs every case through the command's main(), one after another: starting torchrun
# costs more than these runs of the tiny model. The process group is kept from one case to the
# next (under torchrun a process cannot join a second one: the launcher's store still holds the
# first one's addresses), and left at the end.
SCRIPT = textwrap.dedent('''
    import contextlib, io, json, os, sys
    import gymnasium as gym
    import torch.distributed as dist
    from support import SayAEnv
    from rftgym.cli import main

    leave, dist.destroy_process_group = dist.destroy_process_group, lambda *args, **kwargs: None

    tmp, model = sys.argv[1], sys.argv[2]
    rank = int(os.environ["RANK"])

    class NanRewardOnRankOne(SayAEnv):  # rank 1's episodes break the env contract, rank 0's do not
        def step(self, action):
            observation, reward, terminated, truncated, info = super().step(action)
            return observation, float("nan") if rank == 1 else reward, terminated, truncated, info

    gym.register("mine/NanOnRankOne-v0", entry_point=NanRewardOnRankOne)
    base = ["train", "mine/NanOnRankOne-v0", "--model", model, "--device", "cpu", "--steps", "1",
            "--tasks-per-step", "2", "--group-size", "2", "--max-new-tokens", "4", "--minibatch-size", "4"]
    cases = {  # the first one finds no process group yet
        "arguments": base + ["--steps", "two"],  # refused by argparse
        "settings": base + ["--lr", "nan"],  # by the command, before training
        "output_dir": base + ["--output-dir", f"{tmp}/a-file"],  # by the writing rank, for all
        "in_the_run": base + ["--output-dir", f"{tmp}/new/run", "--max-new-tokens", "100000"],  # when the model loads
        "one_rank": base + ["--output-dir", f"{tmp}/one-rank"],  # in rank 1's rollout only
    }
    results = {}
    for name, argv in cases.items():
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            try:
                code = main(argv)
            except SystemExit as stop:
                code = stop.code
        lines = [line for line in err.getvalue().splitlines() if line.startswith("rftgym train:")]
        results[name] = {"code": code, "lines": lines}
    json.dump(results, open(f"{tmp}/rank{rank}.json", "w"))
    dist.barrier()
    leave()
''')


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """Each rank's exit status and its ``rftgym train:`` lines, by case."""
    from support import make_char_policy

    tmp = tmp_path_factory.mktemp("launched")
    policy = make_char_policy()
    policy.model.save_pretrained(tmp / "model")
    policy.tokenizer.save_pretrained(tmp / "model")
    (tmp / "run.py").write_text(SCRIPT)
    (tmp / "a-file").touch()  # an output directory that is a file
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS_DIR), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(tmp / "run.py"), str(tmp), str(tmp / "model")],
                          env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return tmp, [json.loads((tmp / f"rank{rank}.json").read_text()) for rank in (0, 1)]


@pytest.mark.parametrize("case, status, message", [
    ("arguments", 2, "rftgym train: error: argument --steps: invalid int value: 'two'"),
    ("settings", 2, "rftgym train: error: --lr must be a finite number, got nan"),
    ("output_dir", 2, "rftgym train: error: the output directory {tmp}/a-file is a file; choose a directory"),
    ("in_the_run", 2, "rftgym train: error: --max-new-tokens=100000 does not fit the model's "
                      "context of 512 tokens (max_position_embeddings); ask for fewer new tokens"),
])
def test_an_error_every_rank_hits_is_printed_once_by_rank_0(launched, case, status, message):
    tmp, (rank0, rank1) = launched
    assert rank0[case] == {"code": status, "lines": [message.format(tmp=tmp)]}
    assert rank1[case] == {"code": status, "lines": ["rftgym train: rank 1: stopped, see rank 0"]}


def test_an_error_one_rank_hits_is_printed_by_that_rank_with_its_rank(launched):
    _, (rank0, rank1) = launched
    assert rank0["one_rank"] == {"code": 1, "lines": ["rftgym train: rank 0: stopped, see rank 1"]}
    assert rank1["one_rank"]["code"] == 1
    [line] = rank1["one_rank"]["lines"]
    assert line.startswith("rftgym train: rank 1: error: ") and "reward" in line, line


def test_a_run_stopped_under_a_launcher_before_any_result_leaves_no_output_directory(launched):
    tmp, _ = launched
    assert not (tmp / "new").exists() and not (tmp / "one-rank").exists()


def test_who_reports_an_error():
    shared = ConfigError("bad setting")
    assert who_reports(shared, 1, 2, same_on_every_rank=True) == ErrorReport(0, True)
    assert who_reports(RuntimeError("device lost"), 1, 2, same_on_every_rank=False) == ErrorReport(1, False)
    peer = RankFailures((None, None, "OSError: disk full")).attach(PeerRankError("rank 2 stopped the run"))
    assert who_reports(peer, 0, 3, False) == ErrorReport(2, False)
    # Reports gathered by Distributed.together: the first rank with this rank's error reports it.
    own = RankFailures((None, "EnvContractError: nan reward", "EnvContractError: nan reward")).attach(
        EnvContractError("nan reward"))
    assert who_reports(own, 2, 3, same_on_every_rank=False) == ErrorReport(1, False)
    RankFailures(("EnvContractError: nan reward",) * 3).attach(own)
    assert who_reports(own, 2, 3, same_on_every_rank=False) == ErrorReport(0, True)
    # Bad input one rank alone hit (its own data) is reported by that rank, not taken for rank 0's.
    data = RankFailures((None, "ConfigError: rank 1's file")).attach(ConfigError("rank 1's file"))
    assert who_reports(data, 1, 2, same_on_every_rank=True) == ErrorReport(1, False)
    # A front end's error made from it (a flag named) keeps the ranks' reports.
    try:
        raise ValueError("--flag: rank 1's file") from data
    except ValueError as flagged:
        assert who_reports(flagged, 1, 2, same_on_every_rank=True) == ErrorReport(1, False)


class _RankOf(Distributed):
    """Rank ``rank`` of ``len(reports)`` processes, whose peers' work ended as ``reports`` say."""

    def __init__(self, rank: int, reports: list[str | None]):
        super().__init__(rank=rank, world_size=len(reports))
        self.reports = reports

    def gather_objects(self, obj):
        return [obj if peer == self.rank else report for peer, report in enumerate(self.reports)]


def _raised_on(rank: int, reports: list[str | None]) -> Exception:
    """What ``rank`` raises from :meth:`Distributed.together` when the ranks' work fails as ``reports``
    say (an ``"EnvContractError: ..."`` report, or None: no error)."""
    def work():
        if reports[rank] is not None:
            raise EnvContractError(reports[rank].removeprefix("EnvContractError: "))

    with pytest.raises(Exception) as raised:
        _RankOf(rank, reports).together(work)
    return raised.value


@pytest.mark.parametrize("reports, reporters", [
    ([None, "EnvContractError: nan reward", "EnvContractError: nan reward"], [1, 1, 1]),
    ([None, "EnvContractError: nan reward", "EnvContractError: no reward"], [1, 1, 2]),  # rank 2's own error
    (["EnvContractError: nan reward"] * 3, [0, 0, 0]),
])
def test_every_rank_of_a_failure_in_together_agrees_who_reports_it(reports, reporters):
    # The rank that did not fail (a PeerRankError) names the rank that prints the error in full.
    errors = [_raised_on(rank, reports) for rank in range(3)]
    assert [type(error) for error in errors] == [PeerRankError if report is None else EnvContractError
                                                 for report in reports]
    assert [who_reports(error, rank, 3, same_on_every_rank=False).reporter
            for rank, error in enumerate(errors)] == reporters


def test_an_error_made_from_a_peer_rank_error_is_reported_by_the_rank_that_failed():
    peer = _raised_on(0, [None, "EnvContractError: nan reward"])
    try:
        raise ValueError("--env-arg: the env stopped") from peer
    except ValueError as flagged:  # not printed by rank 0 as if every rank had this input error
        assert who_reports(flagged, 0, 2, same_on_every_rank=True) == ErrorReport(1, False)


def test_the_ranks_reports_are_found_along_a_chain_of_causes():
    own = _raised_on(1, [None, "EnvContractError: nan reward"])
    try:
        try:
            raise ConfigError("the env's reward is not a number") from own
        except ConfigError as restated:
            raise ValueError("--env-arg: the env's reward is not a number") from restated
    except ValueError as flagged:
        assert who_reports(flagged, 1, 2, same_on_every_rank=True) == ErrorReport(1, False)
    # A cycle of causes ends the search.
    first, second = RuntimeError("a"), RuntimeError("b")
    first.__cause__, second.__cause__ = second, first
    assert who_reports(first, 1, 2, same_on_every_rank=False) == ErrorReport(1, False)
