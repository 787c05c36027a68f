"""The distributed paths: two CPU processes (gloo) started by torchrun train in lockstep, with
the model replicated (DDP-style gradient averaging) or sharded (FSDP2)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

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
                         minibatch_size=4, output_dir=out, seed=0, save_every=100, eval_every=3, eval_episodes=3)
    keys, act_tokens = [], policy.act_tokens

    def recording(contexts, spans, **keyed):  # the sample keys of this rank's replies
        keys.extend(keyed.get("sample_keys") or [])
        return act_tokens(contexts, spans, **keyed)

    policy.act_tokens = recording
    class Declaring(SayAEnv):  # an env column, gathered over the ranks' evaluation episodes
        metadata = {"render_modes": [], "eval_metrics": (("won", "success", "final_rate"),)}

    history = train(config, policy=policy, make_env=Declaring)
    rank = Distributed.from_env().rank
    weights = torch.cat([p.detach().reshape(-1) for p in policy.model.parameters()])
    json.dump({"history": history, "checksum": float(weights.double().sum()), "keys": keys,
               "first": weights[:8].tolist()}, open(f"{result_dir}/rank{rank}.json", "w"))
''')


# Every script ends its process group itself: left to the interpreter's exit, gloo's threads can
# abort a process that finished well (SIGABRT, "terminate called without an active exception").
LEAVE_GROUP = """
from rftgym.train.distributed import leave_process_group as _leave
_leave()
"""


def torchrun(script_text: str, tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    script = tmp_path / "run.py"
    script.write_text(script_text + LEAVE_GROUP)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS_DIR), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               str(script), *args]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_two_processes_stay_in_lockstep(tmp_path):
    torchrun(SCRIPT, tmp_path, str(tmp_path / "run"), str(tmp_path))
    rank0 = json.loads((tmp_path / "rank0.json").read_text())
    rank1 = json.loads((tmp_path / "rank1.json").read_text())
    # The same averaged gradients on both ranks: identical weights after three steps.
    assert rank0["checksum"] == rank1["checksum"] and rank0["first"] == rank1["first"]
    # Episode metrics are over both ranks' rollouts (one task each), so both report the same numbers.
    assert [h["reward_mean"] for h in rank0["history"]] == [h["reward_mean"] for h in rank1["history"]]
    # So are the evaluation's, over 3 episodes shared out unevenly (seeds 0 and 2 on rank 0, 1 on rank 1).
    assert "eval_reward_mean" in rank0["history"][-1]
    assert all(rank0["history"][-1][k] == rank1["history"][-1][k]
               for k in ("eval_reward_mean", "eval_success_rate", "eval_won"))  # (the env's own column too)
    assert rank0["history"][-1]["eval_won"] == rank0["history"][-1]["eval_success_rate"]  # over all 3 episodes
    # Only rank 0 writes the metrics and the checkpoint.
    rows = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["step"] for r in rows] == [1, 2, 3]
    assert (tmp_path / "run" / "checkpoint" / "state.json").is_file()
    # The loss statistics are over both ranks' samples too (as one process would compute them).
    assert [h["loss"] for h in rank0["history"]] == [h["loss"] for h in rank1["history"]]
    # Each rank rolled out its own task each step (so the lockstep is no accident of identical
    # data): training keys (kind 4: step, task, member, turn) split the tasks between the ranks.
    tasks = [{(step, task) for kind, step, task, *_ in map(tuple, r["keys"]) if kind == 4} for r in (rank0, rank1)]
    assert tasks[0] and tasks[1] and not tasks[0] & tasks[1]
    assert tasks[0] | tasks[1] == {(step, task) for step in range(3) for task in range(2)}


REFILL_SCRIPT = textwrap.dedent('''
    import json, sys
    from support import SayAEnv, make_char_policy
    from rftgym.train import TrainConfig
    from rftgym.train.loop import train
    from rftgym.train.distributed import Distributed

    out, result_dir = sys.argv[1], sys.argv[2]
    config = TrainConfig(steps=6, tasks_per_step=4, group_size=2, max_new_tokens=8, learning_rate=1e-2,
                         minibatch_size=8, output_dir=out, seed=0, save_every=100, max_rollout_batches=4)
    policy = make_char_policy(seed=0)
    history = train(config, policy=policy, make_env=SayAEnv)
    weights = [float(p.detach().double().abs().sum()) for p in policy.model.parameters()]
    json.dump({"history": history, "weights": weights},
              open(f"{result_dir}/rank{Distributed.from_env().rank}.json", "w"))
''')


def test_the_refill_under_a_launch_trains_the_groups_one_process_would(tmp_path, make_char_policy):
    # Keyed sampling rolls out the same episodes on 2 ranks (2 tasks each, dealt in turn) as on one;
    # the ranks must then agree on refilling and train the same first varied groups, in the order the
    # tasks were drawn, as the one process does (rank by rank they were others).
    from support import SayAEnv
    from rftgym.train import TrainConfig
    from rftgym.train.loop import train

    torchrun(REFILL_SCRIPT, tmp_path, str(tmp_path / "run"), str(tmp_path))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    policy = make_char_policy(seed=0)
    one = train(TrainConfig(steps=6, tasks_per_step=4, group_size=2, max_new_tokens=8, learning_rate=1e-2,
                            minibatch_size=16, output_dir=str(tmp_path / "one"), seed=0, save_every=100,
                            max_rollout_batches=4), policy=policy, make_env=SayAEnv)
    assert any(row["rollout_batches"] > 1 for row in one), one
    for a, b, c in zip(one, *(r["history"] for r in ranks), strict=True):
        assert a["rollout_batches"] == b["rollout_batches"] == c["rollout_batches"]
        assert a["reward_mean"] == b["reward_mean"] == c["reward_mean"]
        assert a["groups_kept"] == b["groups_kept"] and a["samples"] == b["samples"]
        assert b["loss"] == c["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-7)
    # The same groups trained: the same weights at the end (a rank that took another group would differ).
    weights = [float(p.detach().double().abs().sum()) for p in policy.model.parameters()]
    assert ranks[0]["weights"] == ranks[1]["weights"] == pytest.approx(weights, rel=1e-5)


def test_tasks_must_split_evenly_across_ranks(tmp_path, monkeypatch, make_char_policy):
    from support import SayAEnv

    from rftgym.core.errors import ConfigError
    from rftgym.train import TrainConfig
    from rftgym.train.distributed import Distributed
    from rftgym.train.loop import train

    monkeypatch.setattr(Distributed, "from_env", classmethod(lambda cls, *args, **kwargs: cls(rank=0, world_size=2)))
    with pytest.raises(ConfigError, match="multiple of the number of processes"):
        train(TrainConfig(tasks_per_step=3, output_dir=str(tmp_path)), policy=make_char_policy(), make_env=SayAEnv)


# Several runs in one launch (starting torchrun costs more than a 3-step run of the tiny model).
# Every rank returns its history and its weights, gathered whole from the shards.
FSDP_SCRIPT = textwrap.dedent('''
    import sys, torch, torch.distributed as dist
    from support import SayAEnv, make_char_policy
    from rftgym.train import TrainConfig
    from rftgym.train.loop import train
    from rftgym.train.distributed import full_tensor

    out, result_dir = sys.argv[1], sys.argv[2]

    class IdleOnRank1(SayAEnv):
        """Rank 1's groups all score 0, so zero-variance filtering leaves that rank no samples."""
        def step(self, action):
            obs, reward, terminated, truncated, info = super().step(action)
            return obs, (0.0 if dist.get_rank() == 1 else reward), terminated, truncated, info

    def run(name, parallelism, steps, env=SayAEnv, resume=False, **extra):
        policy = make_char_policy(seed=0)
        config = TrainConfig(steps=steps, tasks_per_step=2, group_size=8, max_new_tokens=8, learning_rate=1e-2,
                             minibatch_size=4, output_dir=f"{out}/{name}", seed=0, save_every=2,
                             parallelism=parallelism, **extra)
        history = train(config, policy=policy, make_env=env, resume=resume)
        weights = {n: full_tensor(p.detach()).clone() for n, p in policy.model.named_parameters()}
        return history, weights

    results = {"ddp": run("ddp", "ddp", 3), "fsdp": run("fsdp", "fsdp", 3)}
    run("resumed", "fsdp", 2)  # interrupted after its step-2 checkpoint ...
    results["resumed"] = run("resumed", "fsdp", 3, resume=True)  # ... and continued by a fresh start
    results["idle_ddp"] = run("idle_ddp", "ddp", 2, env=IdleOnRank1)
    results["idle_fsdp"] = run("idle_fsdp", "fsdp", 2, env=IdleOnRank1)
    results["lora_kl"] = run("lora_kl", "fsdp", 2, lora_rank=4, kl_coef=0.1)
    results["lora_kl_ddp"] = run("lora_kl_ddp", "ddp", 2, lora_rank=4, kl_coef=0.1)
    results["full_kl"] = run("full_kl", "fsdp", 2, kl_coef=0.1)
    results["full_kl_ddp"] = run("full_kl_ddp", "ddp", 2, kl_coef=0.1)
    results["fsdp_micro"] = run("fsdp_micro", "fsdp", 3, microbatch_size=3)
    results["fsdp_checkpointing"] = run("fsdp_checkpointing", "fsdp", 3, gradient_checkpointing=True)
    results["fsdp_mlp_recompute"] = run("fsdp_mlp_recompute", "fsdp", 3, checkpoint_mlp=True)
    results["idle_fsdp_micro"] = run("idle_fsdp_micro", "fsdp", 2, env=IdleOnRank1, microbatch_size=3)
    # Samples of 29-32 tokens: a 60-token pass holds one or two, so the ranks' pass counts differ.
    results["fsdp_tokens"] = run("fsdp_tokens", "fsdp", 3, microbatch_tokens=60)
    results["idle_fsdp_tokens"] = run("idle_fsdp_tokens", "fsdp", 2, env=IdleOnRank1, microbatch_tokens=60,
                                      pack_sequences=True)
    results["idle_ddp_recompute"] = run("idle_ddp_recompute", "ddp", 2, env=IdleOnRank1, old_logprobs="recompute",
                                        rollout_is_cap=2.0)
    results["idle_fsdp_recompute"] = run("idle_fsdp_recompute", "fsdp", 2, env=IdleOnRank1, old_logprobs="recompute",
                                         rollout_is_cap=2.0)
    torch.save(results, f"{result_dir}/rank{dist.get_rank()}.pt")
''')


def assert_same_run(a, b, rel=1e-4, weights_atol=1e-5):
    (history_a, weights_a), (history_b, weights_b) = a, b
    assert [h["reward_mean"] for h in history_a] == [h["reward_mean"] for h in history_b]
    for x, y in zip(history_a, history_b):
        assert (x["loss"] is None) == (y["loss"] is None)
        if x["loss"] is not None:
            assert y["loss"] == pytest.approx(x["loss"], rel=rel, abs=1e-6)
            assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=rel)
    assert weights_a.keys() == weights_b.keys()
    for name in weights_a:
        torch.testing.assert_close(weights_b[name], weights_a[name], rtol=1e-4, atol=weights_atol, msg=name)


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("fsdp")
    torchrun(FSDP_SCRIPT, tmp_path, str(tmp_path / "runs"), str(tmp_path))
    return tmp_path, [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]


def test_fsdp_trains_like_data_parallel(fsdp_runs):
    _, ranks = fsdp_runs
    for rank in ranks:
        # Same rollouts (same seeds, same weights), so sharding must not change the numbers: the
        # same losses, gradient norms (clipped over all shards) and weights as replicated training.
        assert_same_run(rank["ddp"], rank["fsdp"])
        assert rank["fsdp"][0][0]["updates"] > 0
    # Every rank gathers the same parameters from the shards.
    for name, tensor in ranks[0]["fsdp"][1].items():
        assert torch.equal(tensor, ranks[1]["fsdp"][1][name]), name
    # Both ranks report the loss over both ranks' samples.
    assert [h["loss"] for h in ranks[0]["fsdp"][0]] == [h["loss"] for h in ranks[1]["fsdp"][0]]


def test_fsdp_rank_without_samples_still_joins(fsdp_runs):
    _, ranks = fsdp_runs
    # Rank 1 has nothing to train on; it runs zero-weighted padding minibatches so that the
    # collectives match, and the update is rank 0's alone (averaged over contributing ranks). Its
    # loss, rank 0's, is what both report.
    assert all(h["loss"] is not None and h["updates"] > 0 for h in ranks[1]["idle_fsdp"][0])
    assert [h["loss"] for h in ranks[0]["idle_fsdp"][0]] == [h["loss"] for h in ranks[1]["idle_fsdp"][0]]
    for rank in ranks:
        assert_same_run(rank["idle_ddp"], rank["idle_fsdp"])
    # The gradient is every rank's: the idle rank logs its norm too, the same as the busy one's.
    for run in ("idle_ddp", "idle_fsdp"):
        for idle, busy in zip(ranks[1][run][0], ranks[0][run][0]):
            assert idle["grad_norm"] == pytest.approx(busy["grad_norm"], rel=1e-5)


def test_fsdp_microbatches_give_the_same_training(fsdp_runs):
    # Minibatches of 4 in microbatches of 3 and 1: the same gradients, so the same run. Where rank
    # 1 has no samples it runs as many padding passes as rank 0 has microbatches.
    _, ranks = fsdp_runs
    for rank in ranks:
        assert_same_run(rank["fsdp"], rank["fsdp_micro"])
        assert_same_run(rank["idle_ddp"], rank["idle_fsdp_micro"])
    assert all(h["loss"] is not None and h["updates"] > 0 for h in ranks[1]["idle_fsdp_micro"][0])


def test_fsdp_passes_sized_by_tokens_give_the_same_training(fsdp_runs):
    # Each rank plans its own passes by length; every rank runs the most passes any rank has.
    _, ranks = fsdp_runs
    for rank in ranks:
        # Passes of other sizes add the same gradients in another order: float32 rounding, which
        # AdamW at lr 1e-2 turns into weight differences of about 1e-5 where an element's gradient
        # is near 0 (one of 2,048 in a layer's MLP differed by 1.15e-5); a wrong pass is off by
        # about the learning rate.
        assert_same_run(rank["fsdp"], rank["fsdp_tokens"], weights_atol=5e-5)
        assert_same_run(rank["idle_ddp"], rank["idle_fsdp_tokens"], weights_atol=5e-5)


def test_fsdp_with_recomputation_trains_alike(fsdp_runs):
    # Whole-layer gradient checkpointing, or recomputing only the MLPs, inside FSDP units.
    _, ranks = fsdp_runs
    for rank in ranks:
        assert_same_run(rank["fsdp"], rank["fsdp_checkpointing"])
        assert_same_run(rank["fsdp"], rank["fsdp_mlp_recompute"])


def test_fsdp_recomputes_old_logprobs_like_data_parallel(fsdp_runs):
    # Rank 1 has no samples: it still joins every recomputing forward pass (FSDP's collectives).
    _, (rank0, _) = fsdp_runs
    assert_same_run(rank0["idle_ddp_recompute"], rank0["idle_fsdp_recompute"])
    assert all(h["old_logprob_gap"] < 1e-4 for h in rank0["idle_fsdp_recompute"][0])
    # The gap and the importance weights are over every rank's tokens: rank 1, with none of its
    # own, reports rank 0's, as it reports the update's loss.
    rank1 = fsdp_runs[1][1]
    for name in ("idle_ddp_recompute", "idle_fsdp_recompute"):
        for mine, theirs in zip(rank0[name][0], rank1[name][0]):
            for key in ("old_logprob_gap", "old_logprob_gap_max", "rollout_is_weight_mean", "rollout_is_capped"):
                assert theirs[key] == pytest.approx(mine[key]), (name, key)


def test_fsdp_resume_is_exact(fsdp_runs):
    _, ranks = fsdp_runs
    for rank in ranks:
        history, weights = rank["resumed"]
        assert [h["step"] for h in history] == [3]
        assert_same_run((rank["fsdp"][0][2:], rank["fsdp"][1]), (history, weights), rel=1e-5)


def test_fsdp_lora_trains_adapters_only_and_kl_references_work(fsdp_runs, make_char_policy):
    _, ranks = fsdp_runs
    initial = dict(make_char_policy(seed=0).model.named_parameters())
    history, weights = ranks[0]["lora_kl"]
    assert all("kl_ref" in h for h in history if h["loss"] is not None)
    base = {n.replace("base_model.model.", "").replace(".base_layer", ""): w for n, w in weights.items()
            if "lora_" not in n}
    assert base.keys() == initial.keys()
    assert all(torch.equal(w, initial[n].detach()) for n, w in base.items())  # frozen base weights
    assert any(w.abs().sum() > 0 for n, w in weights.items() if "lora_B" in n)  # B starts at zero
    history, _ = ranks[0]["full_kl"]  # a sharded frozen copy as the reference
    assert any(h.get("kl_ref", 0) > 0 for h in history)
    # Both reference forms (adapters off: a forward through the trained model itself; a frozen
    # copy) give the numbers replicated training gives.
    for rank in ranks:
        assert_same_run(rank["lora_kl_ddp"], rank["lora_kl"])
        assert_same_run(rank["full_kl_ddp"], rank["full_kl"])


def test_fsdp_checkpoint_loads_in_one_process(fsdp_runs, make_char_policy):
    from rftgym.train.checkpoint import load_checkpoint

    tmp_path, ranks = fsdp_runs
    policy = make_char_policy(seed=0)
    optimizer = torch.optim.AdamW(policy.model.parameters(), lr=1e-2)
    step, rng, _ = load_checkpoint(tmp_path / "runs" / "fsdp", model=policy.model, optimizer=optimizer)
    assert step == 3 and len(rng["ranks"]) == 2
    for name, p in policy.model.named_parameters():
        assert torch.equal(p.detach(), ranks[0]["fsdp"][1][name]), name
        assert optimizer.state[p]["exp_avg"].shape == p.shape  # whole moments, not one rank's shard


# Each rank updates on its own samples (rank 0: two short ones; rank 1: four long ones, one with
# nothing trained); one process updates on all six. A token mean (or sequence mean) over the
# minibatch is then the same number either way, so the weights must match.
GLOBAL_MEAN_SCRIPT = textwrap.dedent('''
    import sys, torch, torch.distributed as dist
    from support import tiny_llama
    from rftgym.train import TrainConfig
    from rftgym.train.batching import TrainSample
    from rftgym.train.distributed import Distributed, full_tensor, shard_model
    from rftgym.train.update import decoder_logprobs, optimise

    result_dir = sys.argv[1]
    ranks = Distributed.from_env(process_group_for_one=True)

    def sample(n, prompt, value, seed):
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(3, 40, (n,), generator=g).tolist()
        return TrainSample(ids, [0] * prompt + [1] * (n - prompt), (-torch.rand(n, generator=g)).tolist(),
                           [0.0] * prompt + [value] * (n - prompt), 0, seed)

    per_rank = [[sample(4, 2, 1.0, 1), sample(5, 3, -0.5, 2)],
                [sample(12, 2, 0.7, 3), sample(11, 1, -1.2, 4), sample(9, 9, 0.3, 5), sample(10, 4, 0.4, 6)]]
    results = {}
    for aggregation in ("token_mean", "sequence_mean", "constant_normalizer"):
        config = TrainConfig(minibatch_size=4, aggregation=aggregation, max_new_tokens=12, group_size=2, kl_coef=0.0)
        single = TrainConfig(minibatch_size=8, aggregation=aggregation, max_new_tokens=12, group_size=2, kl_coef=0.0)
        for mode in ("ddp", "fsdp", "one"):
            model = tiny_llama()
            trained = model
            if mode == "fsdp":
                trained = shard_model(model, decoder_logprobs, mixed_precision=False)
            optimizer = torch.optim.SGD(trained.parameters(), lr=0.1)
            if mode == "one":
                if ranks.rank == 0:
                    stats = optimise(model, None, optimizer, per_rank[0] + per_rank[1], single, 0,
                                     torch.Generator().manual_seed(0))
            else:
                stats = optimise(trained, None, optimizer, per_rank[ranks.rank], config, 0,
                                 torch.Generator().manual_seed(0), ranks)
            results[(aggregation, mode, "stats")] = stats
            results[(aggregation, mode)] = {n: full_tensor(p.detach()).clone() for n, p in model.named_parameters()}
    torch.save(results, f"{result_dir}/rank{ranks.rank}.pt")
''')


def test_a_minibatch_mean_spans_all_ranks(tmp_path):
    torchrun(GLOBAL_MEAN_SCRIPT, tmp_path, str(tmp_path))
    results, other_rank = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    start = __import__("support").tiny_llama().state_dict()
    for aggregation in ("token_mean", "sequence_mean", "constant_normalizer"):
        one = results[(aggregation, "one")]
        assert max((one[n] - start[n]).abs().max() for n in one) > 0
        for mode in ("ddp", "fsdp"):
            got = results[(aggregation, mode)]
            for name in one:
                torch.testing.assert_close(got[name], one[name], rtol=1e-4, atol=1e-6,
                                           msg=f"{aggregation} {mode} {name}")
            # The loss and its statistics every rank reports are the minibatch's, as one process's.
            single = results[(aggregation, "one", "stats")]
            for stats in (results[(aggregation, mode, "stats")], other_rank[(aggregation, mode, "stats")]):
                for key in ("loss", "pg_loss", "entropy", "clip_fraction", "approx_kl", "ratio_mean"):
                    assert stats[key] == pytest.approx(single[key], rel=1e-4, abs=1e-6), (aggregation, mode, key)


AVERAGE_SCRIPT = textwrap.dedent('''
    import json, sys, torch
    from rftgym.train.distributed import Distributed

    ranks = Distributed.from_env(process_group_for_one=True)
    rank = ranks.rank
    params = [torch.nn.Parameter(torch.zeros(2)) for _ in range(3)]
    # Parameter 0: both ranks have a gradient; 1: rank 0 only; 2: no rank.
    params[0].grad = torch.tensor([1.0, 2.0]) * (rank + 1)
    if rank == 0:
        params[1].grad = torch.tensor([4.0, 8.0])
    ranks.average_gradients(params)
    first = [None if p.grad is None else p.grad.tolist() for p in params]
    # Rank 1 ran no samples: it joins with zeros, and only rank 0 counts in the mean.
    for p in params:
        p.grad = torch.ones(2) * 6.0 if rank == 0 else None
    params[2].grad = None
    ranks.average_gradients(params, contributed=rank == 0)
    second = [None if p.grad is None else p.grad.tolist() for p in params]
    json.dump({"first": first, "second": second}, open(f"{sys.argv[1]}/avg{rank}.json", "w"))
''')


def test_gradient_averaging_leaves_parameters_no_rank_trained_without_a_gradient(tmp_path):
    torchrun(AVERAGE_SCRIPT, tmp_path, str(tmp_path))
    for rank in (0, 1):
        result = json.loads((tmp_path / f"avg{rank}.json").read_text())
        # Mean over the two contributing ranks; a rank without a gradient adds zeros.
        assert result["first"] == [[1.5, 3.0], [2.0, 4.0], None]
        # None, not zeros: AdamW skips it, as one process would (zeros would decay the weight).
        assert result["second"] == [[6.0, 6.0], [6.0, 6.0], None]


LOCKED_SCRIPT = textwrap.dedent('''
    import json, sys
    from support import SayAEnv, make_char_policy
    from rftgym.core.errors import ConfigError
    from rftgym.train import TrainConfig
    from rftgym.train.loop import train
    from rftgym.train.distributed import Distributed

    out, result_dir = sys.argv[1], sys.argv[2]
    rank = Distributed.from_env().rank
    try:
        train(TrainConfig(steps=1, tasks_per_step=2, group_size=2, max_new_tokens=4, output_dir=out),
              policy=make_char_policy(seed=0), make_env=SayAEnv)
        message = None
    except ConfigError as exc:
        message = str(exc)
    json.dump({"message": message}, open(f"{result_dir}/locked{rank}.json", "w"))
''')


def test_a_locked_output_directory_stops_every_rank(tmp_path):
    from rftgym.train.run_dir import OutputLock

    (tmp_path / "run").mkdir()
    held = OutputLock(tmp_path / "run")  # another run, in this process
    try:
        torchrun(LOCKED_SCRIPT, tmp_path, str(tmp_path / "run"), str(tmp_path))
    finally:
        held.release()
    for rank in (0, 1):
        message = json.loads((tmp_path / f"locked{rank}.json").read_text())["message"]
        assert message is not None and "is writing to" in message, (rank, message)


RANK_FAILS_SCRIPT = textwrap.dedent('''
    import json, sys
    from support import SayAEnv, make_char_policy
    from rftgym.core.errors import EnvContractError
    from rftgym.train import TrainConfig
    from rftgym.train.distributed import Distributed, PeerRankError
    from rftgym.train.loop import train

    out, result_dir, phase = sys.argv[1], sys.argv[2], sys.argv[3]
    rank = Distributed.from_env().rank

    class BrokenOnRankOne(SayAEnv):  # a NaN reward breaks the env contract, on one rank only
        def step(self, action):
            observation, reward, terminated, truncated, info = super().step(action)
            return observation, float("nan") if rank == 1 else reward, terminated, truncated, info

    # "train": rank 1's rollout fails in the second step; "eval": only its evaluation episodes do.
    import rftgym.train.evaluation as evaluation
    import rftgym.train.loop as loop
    state = {"steps": 0, "evaluating": False}
    build_samples, run_episodes = loop.build_samples, evaluation.run_episodes

    def counting_steps(*args, **kwargs):
        state["steps"] += 1
        return build_samples(*args, **kwargs)

    def evaluating(*args, **kwargs):
        state["evaluating"] = True
        try:
            return run_episodes(*args, **kwargs)
        finally:
            state["evaluating"] = False

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    loop.build_samples, evaluation.run_episodes = counting_steps, evaluating
    if phase == "save" and rank == 0:  # "save": the writing rank cannot write its checkpoint
        loop.save_checkpoint = disk_full
    if phase == "log" and rank == 0:  # "log": nor its metrics
        loop.MetricsLog.write = disk_full

    def make_env():
        broken = state["evaluating"] if phase == "eval" else phase == "train" and state["steps"] >= 1
        return BrokenOnRankOne() if broken else SayAEnv()

    # (training: no regular save, so a checkpoint after the failure is the one the failure kept)
    config = TrainConfig(steps=3, tasks_per_step=2, group_size=2, max_new_tokens=4, minibatch_size=4,
                         output_dir=out, save_every=100 if phase == "train" else 1,
                         **(dict(eval_every=1, eval_episodes=2) if phase == "eval" else {}))
    try:
        train(config, policy=make_char_policy(seed=0), make_env=make_env)
        outcome = None
    except (EnvContractError, OSError, PeerRankError) as exc:
        outcome = [type(exc).__name__, str(exc)]
    json.dump({"outcome": outcome, "steps": state["steps"]}, open(f"{result_dir}/{phase}{rank}.json", "w"))
''')


@pytest.mark.parametrize("phase", ["train", "eval", "save", "log"])
def test_an_error_on_one_rank_stops_every_rank(tmp_path, phase):
    # Without the ranks agreeing, the rank that did not fail would go on to its next collective
    # alone: it waits there (until the process group's timeout) or, under torchrun, is killed
    # without writing its result file.
    torchrun(RANK_FAILS_SCRIPT, tmp_path, str(tmp_path / "run"), str(tmp_path), phase)
    rank0 = json.loads((tmp_path / f"{phase}0.json").read_text())
    rank1 = json.loads((tmp_path / f"{phase}1.json").read_text())
    on_rank0 = phase in ("save", "log")
    failed, other = (rank0, rank1) if on_rank0 else (rank1, rank0)
    error, words = ("OSError", "No space left") if on_rank0 else ("EnvContractError", "reward")
    assert failed["outcome"][0] == error and words in failed["outcome"][1]
    assert other["outcome"][0] == "PeerRankError"
    assert other["outcome"][1].startswith(f"rank {0 if on_rank0 else 1} stopped the run with {error}")
    assert words in other["outcome"][1]
    # Training: rank 1 failed in the second step's rollout, and rank 0 stopped with it before
    # building that step's samples (the first step trained on both). Evaluation, metrics and
    # checkpoint: after the first step.
    assert (rank0["steps"], rank1["steps"]) == (1, 1)
    if phase == "train":  # the ranks met where the rollout failed, and kept step 1 together, as one process does
        assert json.loads((tmp_path / "run" / "checkpoint" / "state.json").read_text())["step"] == 1


# A stop reaching one rank of a launch, in its rollout or its update (SIGTERM, as `rftgym train`
# handles it): every rank saves the finished steps together, then stops. The checkpoint's
# regular saves never come (save_every=100), so any checkpoint there is the stop's.
STOP_SCRIPT = textwrap.dedent('''
    import json, os, signal, sys, torch
    from support import SayAEnv, make_char_policy
    from rftgym.cli.sigterm import _stop_on_sigterm
    from rftgym.train import TrainConfig, loop
    from rftgym.train.loop import train

    out, result_dir = sys.argv[1], sys.argv[2]
    rank = int(os.environ["RANK"])
    _stop_on_sigterm()  # as `rftgym train` does: SIGTERM stops a run as Ctrl-C does

    class TerminatedInStep3(SayAEnv):
        """Rank 1 alone gets SIGTERM in the second of its 8 episodes of step 3 (its 18th env step)."""
        calls = 0

        def step(self, action):
            type(self).calls += 1
            if rank == 1 and type(self).calls == 18:
                os.kill(os.getpid(), signal.SIGTERM)
            return super().step(action)

    real_optimise = loop.optimise

    def terminated_in_update_4(*args, **kwargs):
        """Rank 0 alone gets SIGTERM in step 4's update."""
        terminated_in_update_4.calls += 1
        if rank == 0 and terminated_in_update_4.calls == 4:
            os.kill(os.getpid(), signal.SIGTERM)
        return real_optimise(*args, **kwargs)

    def run(name, steps, env=SayAEnv, resume=False):
        policy = make_char_policy(seed=0)
        config = TrainConfig(steps=steps, tasks_per_step=2, group_size=8, max_new_tokens=8, learning_rate=1e-2,
                             minibatch_size=4, output_dir=f"{out}/{name}", seed=0, save_every=100)
        try:
            return train(config, policy=policy, make_env=env, resume=resume), dict(policy.model.named_parameters())
        except KeyboardInterrupt as stop:  # what the stop kept, before a resume writes over it
            state = json.load(open(f"{config.output_dir}/checkpoint/state.json"))
            logged = [json.loads(line)["step"] for line in open(f"{config.output_dir}/metrics.jsonl")]
            return {"stopped_by": type(stop).__name__, "checkpoint_step": state["step"], "logged": logged}

    results = {"straight": run("straight", 5), "in_rollout": run("in_rollout", 5, env=TerminatedInStep3)}
    results["resumed_from_rollout"] = run("in_rollout", 5, resume=True)
    terminated_in_update_4.calls = 0
    loop.optimise = terminated_in_update_4
    results["in_update"] = run("in_update", 5)
    loop.optimise = real_optimise
    results["resumed_from_update"] = run("in_update", 5, resume=True)
    torch.save(results, f"{result_dir}/rank{rank}.pt")
''')


def test_a_stop_on_one_rank_stops_every_rank_with_the_finished_steps_saved(tmp_path):
    done = torchrun(STOP_SCRIPT, tmp_path, str(tmp_path / "runs"), str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    for stopped, saved_at in (("in_rollout", 2), ("in_update", 4)):
        for rank in ranks:
            # Both ranks stopped, each as its own SIGTERM handler stops (the CLI's exit status 143),
            # after saving the steps finished before the stop: a stop in step 3's rollout keeps
            # steps 1-2 (its update had not begun); one in step 4's update keeps step 4 too.
            assert rank[stopped] == {"stopped_by": "_Terminated", "checkpoint_step": saved_at,
                                     "logged": list(range(1, saved_at + 1))}
            # The resumed run goes on as the uninterrupted one did, on each rank.
            history, weights = rank[f"resumed_from_{stopped.split('_')[1]}"]
            assert [h["step"] for h in history] == list(range(saved_at + 1, 6))
            straight_history, straight_weights = rank["straight"]
            assert_same_run((straight_history[saved_at:], straight_weights), (history, weights), rel=1e-5)
    # Rank 0 says so when the stop reaches it (in step 4's update), and what it saves each time.
    assert done.stderr.count("rftgym train: stopping every rank once they reach the end") == 1
    assert done.stderr.count("saving the checkpoint after step 2 first") == 1
    assert done.stderr.count("saving the checkpoint after step 4 first") == 1


def test_together_names_the_failed_rank_and_keeps_the_own_error_first():
    from rftgym.train.distributed import Distributed, PeerRankError

    class Reports(Distributed):  # rank 0 of 3, the others' reports given
        def __init__(self, others):
            super().__init__(rank=0, world_size=3)
            self.others = others

        def gather_objects(self, obj):
            if self.others is None:
                raise RuntimeError("the collective failed")
            return [obj, *self.others]

    assert Reports([None, None]).together(lambda: 7) == 7
    with pytest.raises(PeerRankError, match=r"^rank 2 stopped the run with ValueError: bad reward; rank 0 stops too"):
        Reports([None, "ValueError: bad reward"]).together(lambda: 7)
    with pytest.raises(PeerRankError, match=r"^rank 1 \(and 1 more ranks\) stopped the run with KeyError: 'a'"):
        Reports(["KeyError: 'a'", "OSError: full"]).together(lambda: 7)
    with pytest.raises(ZeroDivisionError):  # its own error, not a report of the others'
        Reports(["OSError: full", None]).together(lambda: 1 / 0)
    # A collective that fails too: the work's own error still comes first, caused by it.
    with pytest.raises(ZeroDivisionError) as raised:
        Reports(None).together(lambda: 1 / 0)
    assert isinstance(raised.value.__cause__, RuntimeError)
    with pytest.raises(RuntimeError, match="the collective failed"):
        Reports(None).together(lambda: 7)


def test_the_train_command_leaves_its_process_group(monkeypatch):
    """`rftgym train` ends its part in the launcher's process group itself, whatever the run's
    outcome, so that the collective backend's threads do not abort the process at exit."""
    import socket

    import torch.distributed as dist

    from rftgym import cli
    from rftgym.cli import train as cli_train
    from rftgym.train import loop

    def joins_then_fails(config, resume=False, on_step=None):
        with socket.socket() as probe:  # a free port on loopback for the one-process group's store
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
        raise RuntimeError("the run failed")

    monkeypatch.setattr(loop, "train", joins_then_fails)
    made = type("E", (), {"close": lambda self: None})
    monkeypatch.setattr(cli_train, "_make_env", lambda env_id, kwargs, *where: made())
    with pytest.raises(RuntimeError, match="the run failed"):
        cli.main(["train", "rftgym/VerifiableQA-v0", "--steps", "1"])
    assert not dist.is_initialized()


HUNG_RANK_SCRIPT = textwrap.dedent('''
    import json, os, sys, time
    from support import SayAEnv, make_char_policy
    from rftgym.train import TrainConfig
    from rftgym.train.loop import train

    out, result_dir = sys.argv[1], sys.argv[2]
    rank = int(os.environ["RANK"])

    class HangsOnRankOne(SayAEnv):  # a stuck env (or server) on one rank only
        def step(self, action):
            if rank == 1:
                time.sleep(120)
                open(f"{result_dir}/rank1-woke", "w").close()
            return super().step(action)

    config = TrainConfig(steps=2, tasks_per_step=2, group_size=2, max_new_tokens=4, minibatch_size=4,
                         output_dir=out, dist_timeout_s=3)
    try:
        train(config, policy=make_char_policy(seed=0), make_env=HangsOnRankOne)
        outcome = None
    except Exception as exc:
        outcome = [type(exc).__name__, str(exc), os.path.exists(f"{result_dir}/rank1-woke")]
    json.dump({"outcome": outcome}, open(f"{result_dir}/hung{rank}.json", "w"))
    sys.exit(1 if outcome else 0)
''')


def test_dist_timeout_stops_the_ranks_a_hung_rank_holds(tmp_path):
    script = tmp_path / "run.py"
    script.write_text(HUNG_RANK_SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS_DIR), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(script), str(tmp_path / "run"), str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=110)
    assert done.returncode != 0
    outcome = json.loads((tmp_path / "hung0.json").read_text())["outcome"]
    # rank 0 gave up waiting while rank 1 was still stuck (not at the default 30 minutes)
    assert outcome is not None and outcome[2] is False, outcome
    assert outcome[0] == "PeerRankError" and "this rank waited for the other ranks past the process group's " \
        "timeout" in outcome[1] and "Raise --dist-timeout" in outcome[1], outcome


# Early stopping from on_step under a launch: the callback runs on rank 0; every rank saves the
# step and stops, rank 0 with the callback's own exception.
ON_STEP_SCRIPT = textwrap.dedent('''
    import json, sys
    from support import SayAEnv, make_char_policy
    from rftgym.train import TrainConfig
    from rftgym.train.distributed import Distributed
    from rftgym.train.loop import train

    out, result_dir = sys.argv[1], sys.argv[2]
    rank = Distributed.from_env().rank

    class GoodEnough(Exception):
        pass

    seen = []

    def stop_at_2(row):
        seen.append(row["step"])
        if row["step"] == 2:
            raise GoodEnough("step 2 is good enough")

    config = TrainConfig(steps=5, tasks_per_step=2, group_size=4, max_new_tokens=8, minibatch_size=4,
                         output_dir=out, seed=0, save_every=100)
    try:
        train(config, policy=make_char_policy(seed=0), make_env=SayAEnv, on_step=stop_at_2)
        outcome = ["finished", ""]
    except Exception as exc:
        outcome = [type(exc).__name__, str(exc)]
    json.dump({"outcome": outcome, "seen": seen}, open(f"{result_dir}/rank{rank}.json", "w"))
''')


def test_an_on_step_that_raises_under_a_launch_stops_every_rank_with_the_step_saved(tmp_path):
    torchrun(ON_STEP_SCRIPT, tmp_path, str(tmp_path / "run"), str(tmp_path))
    rank0, rank1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert rank0 == {"outcome": ["GoodEnough", "step 2 is good enough"], "seen": [1, 2]}
    assert rank1["seen"] == [] and rank1["outcome"][0] == "PeerRankError"
    assert rank1["outcome"][1].startswith("rank 0 stopped the run with GoodEnough: step 2 is good enough")
    assert json.loads((tmp_path / "run" / "checkpoint" / "state.json").read_text())["step"] == 2
    assert [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()] == [1, 2]
