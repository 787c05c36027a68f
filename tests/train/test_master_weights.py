"""Float32 master weights for 16-bit models: updates below bf16 precision are not lost."""

from __future__ import annotations

import copy

import pytest
import torch

from rftgym.core.errors import ConfigError
from rftgym.train import TrainConfig
from rftgym.train.master_weights import MasterWeights, needs_master_weights
from rftgym.train.speed import make_optimizer


def tiny_net(dtype):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3)).to(dtype)


def set_grads(model, seed):
    generator = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=generator).to(p.dtype)


def test_steps_match_float32_adamw_and_the_model_holds_their_rounding():
    model = tiny_net(torch.bfloat16)
    reference = copy.deepcopy(model).float()  # the same starting values in float32
    optimizer = make_optimizer(model.parameters(), lr=1e-2)
    plain = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.0)
    assert isinstance(optimizer, MasterWeights)
    for step in range(5):
        set_grads(model, step)
        for p, r in zip(model.parameters(), reference.parameters()):
            r.grad = p.grad.float()  # the same gradients
        optimizer.step()
        plain.step()
        optimizer.zero_grad()
    for master, want, param in zip(optimizer.masters, reference.parameters(), model.parameters()):
        torch.testing.assert_close(master, want.detach(), rtol=1e-6, atol=1e-7)
        assert torch.equal(param.detach(), want.detach().to(torch.bfloat16))
        assert param.grad is None


def test_updates_below_bf16_precision_accumulate():
    # lr 1e-4 against weights of ~0.3: each step is ~0.03% of the weight, under bf16's 0.4%.
    lost, kept = tiny_net(torch.bfloat16), tiny_net(torch.bfloat16)
    start = [p.detach().clone() for p in lost.parameters()]
    bare = torch.optim.AdamW(lost.parameters(), lr=1e-4, weight_decay=0.0)  # steps on the bf16 weights
    master = make_optimizer(kept.parameters(), lr=1e-4)
    for step in range(40):
        for model, optimizer in ((lost, bare), (kept, master)):
            for p in model.parameters():
                p.grad = torch.ones_like(p)  # the same direction every step
            optimizer.step()
            optimizer.zero_grad()
    weights = [p for p, s in zip(lost.parameters(), start) if s.abs().min() > 0.05]
    assert weights  # there are weights large enough for the point to be made
    lost_changed = sum(int((p.detach() != s).sum()) for p, s in zip(lost.parameters(), start))
    kept_changed = sum(int((p.detach() != s).sum()) for p, s in zip(kept.parameters(), start))
    total = sum(p.numel() for p in kept.parameters())
    assert kept_changed == total  # 40 steps of 1e-4 moved every weight by ~4e-3
    assert lost_changed < total // 2  # most bf16 steps rounded away


def test_state_dict_round_trip_continues_exactly():
    def run(steps, resume_from=None):
        model = tiny_net(torch.bfloat16)
        optimizer = make_optimizer(model.parameters(), lr=1e-3)
        if resume_from is not None:
            model.load_state_dict(resume_from[0])
            optimizer.load_state_dict(resume_from[1])
        for step in range(*steps):
            set_grads(model, step)
            optimizer.step()
            optimizer.zero_grad()
        return model, optimizer

    straight, straight_opt = run((0, 6))
    half, half_opt = run((0, 3))
    saved = (copy.deepcopy(half.state_dict()), copy.deepcopy(half_opt.state_dict()))
    assert all("master" in entry for entry in saved[1]["state"].values())
    resumed, resumed_opt = run((3, 6), resume_from=saved)
    for a, b in zip(straight_opt.masters, resumed_opt.masters):
        assert torch.equal(a, b)  # float32 values, not their bf16 rounding
    for a, b in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


def test_float32_models_get_plain_adamw():
    model = tiny_net(torch.float32)
    assert not needs_master_weights(model.parameters())
    assert type(make_optimizer(model.parameters(), lr=1e-3)) is torch.optim.AdamW
    frozen = tiny_net(torch.bfloat16).requires_grad_(False)
    assert not needs_master_weights(frozen.parameters())


def test_fsdp_refuses_a_16_bit_policy(tmp_path, monkeypatch, make_char_policy):
    from support import SayAEnv

    from rftgym.train.distributed import Distributed
    from rftgym.train.loop import train

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(Distributed, "from_env", classmethod(lambda cls, *args, **kwargs: cls(rank=0, world_size=1)))
    policy = make_char_policy()
    policy.model.to(torch.bfloat16)
    with pytest.raises(ConfigError, match="16-bit, and FSDP would step the optimizer on them"):
        train(TrainConfig(parallelism="fsdp", output_dir=str(tmp_path), device="cpu"), policy=policy,
              make_env=SayAEnv)


def test_dtype_checks():
    with pytest.raises(ConfigError, match="leave dtype unset"):
        TrainConfig(parallelism="fsdp", dtype="bfloat16")
    with pytest.raises(ConfigError, match="dtype must be None"):
        TrainConfig(dtype="bf16")


def test_a_bf16_model_trains_and_resumes_exactly(tmp_path, make_char_policy):
    from support import SayAEnv

    from rftgym.train.loop import train

    def policy():
        p = make_char_policy(seed=0)
        p.model.to(torch.bfloat16)
        return p

    def config(name, steps):
        return TrainConfig(steps=steps, tasks_per_step=1, group_size=8, max_new_tokens=8, learning_rate=1e-3,
                           minibatch_size=4, output_dir=str(tmp_path / name), seed=0, save_every=1, device="cpu",
                           dtype="bfloat16")

    straight = train(config("straight", 4), policy=policy(), make_env=SayAEnv)
    assert any(h["updates"] > 0 for h in straight)
    train(config("resumed", 2), policy=policy(), make_env=SayAEnv)
    resumed = train(config("resumed", 4), policy=policy(), make_env=SayAEnv, resume=True)
    for a, b in zip(straight[2:], resumed):
        assert a["reward_mean"] == b["reward_mean"]
        assert (a["loss"] is None) == (b["loss"] is None)
        if a["loss"] is not None:
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-6)


def test_the_float32_copies_of_gradients_do_not_outlive_the_step():
    model = tiny_net(torch.bfloat16)
    optimizer = make_optimizer(model.parameters(), lr=1e-3)
    set_grads(model, 0)
    optimizer.step()
    assert all(master.grad is None for master in optimizer.masters)
    with pytest.raises(NotImplementedError, match="make a new one"):
        optimizer.add_param_group({"params": [torch.zeros(2, requires_grad=True)]})


def save(tmp_path, model, optimizer):
    from rftgym.train.checkpoint import checkpoint_state, save_checkpoint

    save_checkpoint(tmp_path, state=checkpoint_state(model, optimizer), step=1, rng_states={}, config={})


def test_resume_a_float32_checkpoint_in_bf16_starts_from_its_weights(tmp_path):
    from rftgym.train.checkpoint import load_checkpoint

    trained = tiny_net(torch.float32)
    optimizer = make_optimizer(trained.parameters(), lr=1e-2)
    set_grads(trained, 0)
    optimizer.step()
    save(tmp_path, trained, optimizer)
    model = tiny_net(torch.bfloat16)  # the starting weights again
    resumed = make_optimizer(model.parameters(), lr=1e-2)
    load_checkpoint(tmp_path, model=model, optimizer=resumed)
    for master, param, want in zip(resumed.masters, model.parameters(), trained.parameters()):
        assert torch.equal(master, want.detach().to(torch.bfloat16).float())  # not the starting weights
        assert torch.equal(param.detach(), want.detach().to(torch.bfloat16))


def test_resume_a_bf16_checkpoint_in_float32_takes_its_masters_as_weights(tmp_path):
    from rftgym.train.checkpoint import load_checkpoint

    model = tiny_net(torch.bfloat16)
    optimizer = make_optimizer(model.parameters(), lr=1e-2)
    set_grads(model, 0)
    next(model.parameters()).grad = None  # one parameter without a step: its entry holds only a master
    optimizer.step()
    save(tmp_path, model, optimizer)
    plain_model = tiny_net(torch.float32)
    plain = make_optimizer(plain_model.parameters(), lr=1e-2)
    load_checkpoint(tmp_path, model=plain_model, optimizer=plain)
    assert all("master" not in entry for entry in plain.state.values())
    for param, master in zip(plain_model.parameters(), optimizer.masters):
        assert torch.equal(param.detach(), master)  # the float32 values, not their bf16 rounding
    set_grads(plain_model, 1)
    plain.step()  # and it steps on


def test_microbatch_gradients_add_up_in_float32():
    from rftgym.train.master_weights import gradient_tensors

    # 64 microbatches each adding 1e-3 to a gradient of 1: bf16 (8 significant bits) rounds each
    # addition away, 1 + 1e-3 == 1, so its sum stays 1; float32 reaches 1.064.
    weight = torch.nn.Parameter(torch.ones(1, dtype=torch.bfloat16))
    optimizer = make_optimizer([weight], lr=1e-3)
    (weight * 1.0).sum().backward()
    for _ in range(64):
        (weight * 1e-3).sum().backward()
    assert weight.grad is None  # moved to the master as each backward pass finished
    (held,) = gradient_tensors(optimizer, [weight])
    assert held is optimizer.masters[0] and held.grad.dtype == torch.float32
    assert held.grad.item() == pytest.approx(1.064, rel=1e-3)
    bare = torch.nn.Parameter(torch.ones(1, dtype=torch.bfloat16))
    for scale in [1.0] + [1e-3] * 64:
        (bare * scale).sum().backward()
    assert bare.grad.item() == 1.0  # what accumulating in bf16 gives
    optimizer.zero_grad()
    assert held.grad is None


def test_a_new_optimizer_takes_the_gradients_over():
    model = tiny_net(torch.bfloat16)
    first = make_optimizer(model.parameters(), lr=1e-3)
    second = make_optimizer(model.parameters(), lr=1e-3)
    model(torch.ones(2, 6, dtype=torch.bfloat16)).sum().backward()
    assert all(m.grad is None for m in first.masters)
    assert all(m.grad is not None for m in second.masters)


def test_a_discarded_optimizer_lets_go_of_the_model():
    import gc
    import pickle
    import weakref

    model = tiny_net(torch.bfloat16)
    optimizer = make_optimizer(model.parameters(), lr=1e-3)
    pickle.dumps(model)  # the hooks leave the model picklable
    master = weakref.ref(optimizer.masters[0])
    del optimizer
    gc.collect()
    assert master() is None  # the float32 copies are freed with their optimizer
    plain = torch.optim.SGD(model.parameters(), lr=1e-1)
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.ones(2, 6, dtype=torch.bfloat16)).sum().backward()
    assert all(p.grad is not None for p in model.parameters())  # left on the model for the next optimizer
    plain.step()
    assert all(not torch.equal(b, p.detach()) for b, p in zip(before, model.parameters()))
