"""The data-parallel path: two CPU processes (gloo) started by torchrun train in lockstep."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

TESTS_DIR = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent('''
    import json, sys, torch
    from support import SayAEnv, make_char_policy
    from rftgym.train import TrainConfig
    from rftgym.train.loop import train
    from rftgym.train.distributed import Distributed

    out, result_dir = sys.argv[1], sys.argv[2]
    policy = make_char_policy(seed=0)
    config = TrainConfig(steps=3, tasks_per_step=2, group_size=8, max_new_tokens=8, learning_rate=1e-2,
                         minibatch_size=4, output_dir=out, seed=0, save_every=100)
    history = train(config, policy=policy, make_env=SayAEnv)
    rank = Distributed.from_env().rank
    weights = torch.cat([p.detach().reshape(-1) for p in policy.model.parameters()])
    json.dump({"history": history, "checksum": float(weights.double().sum()),
               "first": weights[:8].tolist()}, open(f"{result_dir}/rank{rank}.json", "w"))
''')


def test_two_processes_stay_in_lockstep(tmp_path):
    script = tmp_path / "run.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS_DIR), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               str(script), str(tmp_path / "run"), str(tmp_path)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rank0 = json.loads((tmp_path / "rank0.json").read_text())
    rank1 = json.loads((tmp_path / "rank1.json").read_text())
    # The same averaged gradients on both ranks: identical weights after three steps.
    assert rank0["checksum"] == rank1["checksum"] and rank0["first"] == rank1["first"]
    # Episode metrics are over both ranks' rollouts (one task each), so both report the same numbers.
    assert [h["reward_mean"] for h in rank0["history"]] == [h["reward_mean"] for h in rank1["history"]]
    # Only rank 0 writes the metrics and the checkpoint.
    rows = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["step"] for r in rows] == [0, 1, 2]
    assert (tmp_path / "run" / "checkpoint" / "state.json").is_file()
    # The rollouts differ between ranks (different tasks and sampling seeds), so the lockstep is
    # not an accident of identical data: each rank's own loss statistics differ.
    losses0 = [h["loss"] for h in rank0["history"]]
    losses1 = [h["loss"] for h in rank1["history"]]
    assert losses0 != losses1


def test_tasks_must_split_evenly_across_ranks(tmp_path, monkeypatch, make_char_policy):
    from support import SayAEnv

    from rftgym.core.errors import ConfigError
    from rftgym.train import TrainConfig
    from rftgym.train.distributed import Distributed
    from rftgym.train.loop import train

    monkeypatch.setattr(Distributed, "from_env", classmethod(lambda cls, device=None: cls(rank=0, world_size=2)))
    with pytest.raises(ConfigError, match="multiple of the number of processes"):
        train(TrainConfig(tasks_per_step=3, output_dir=str(tmp_path)), policy=make_char_policy(), make_env=SayAEnv)
