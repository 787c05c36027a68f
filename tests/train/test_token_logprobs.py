"""The fused chunked log-probs against numbers computed by hand and against plain autograd."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rftgym.core.errors import ConfigError
from rftgym.train.token_logprobs import LogitTransform, chunked_token_logprobs, logit_transform

LN = math.log


def close(actual, expected, atol=1e-5):
    expected = torch.as_tensor(expected, dtype=actual.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert torch.allclose(actual, expected, atol=atol, rtol=0), (actual, expected)


def test_chunked_logprobs_two_tokens_by_hand():
    # V = 3, H = 2, W = [[1, 0], [0, 1], [0, 0]] -> logits = [h0, h1, 0]
    # token 1: h = [ln 2, 0] -> logits [ln 2, 0, 0] -> probs [2, 1, 1] / 4; target 0 -> ln(1/2) = -0.693147
    #   entropy = 1/2 ln 2 + 2 * 1/4 ln 4 = 1.5 ln 2 = 1.039721
    # token 2: h = [0, ln 3] -> logits [0, ln 3, 0] -> probs [1, 3, 1] / 5; target 2 -> ln(1/5) = -1.609438
    #   entropy = 2 * 1/5 ln 5 + 3/5 ln(5/3) = 0.950271
    # temperature 2, token 1: logits [ln 2 / 2, 0, 0] -> p0 = sqrt2 / (sqrt2 + 2) = sqrt2 - 1 -> ln = -0.881374
    weight = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]])
    hidden = torch.tensor([[[LN(2), 0.0], [0.0, LN(3)]]])
    targets = torch.tensor([[0, 2]])
    lp, ent = chunked_token_logprobs(hidden, weight, targets, chunk_size=1, with_entropy=True)
    close(lp, [[-0.693147, -1.609438]])
    close(ent, [[1.039721, 0.950271]])
    lp, ent = chunked_token_logprobs(hidden, weight, targets, temperature=2.0)
    assert ent is None
    close(lp[:, :1], [[-0.881374]])


def naive(hidden, weight, targets, temperature, transform=None):
    logits = hidden.double() @ weight.double().T
    if transform is not None:
        logits = logits * transform.scale / transform.divisor
        if transform.softcap is not None:
            logits = transform.softcap * torch.tanh(logits / transform.softcap)
    logits = logits / temperature
    logp = torch.log_softmax(logits, dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1), entropy


@pytest.mark.parametrize("chunk_size", [1, 5, 7, 24, 1000])
def test_chunked_logprobs_match_naive_values_and_gradients(chunk_size):
    torch.manual_seed(0)
    B, T, H, V = 3, 8, 6, 11  # 24 tokens; 5 and 7 do not divide 24
    hidden = torch.randn(B, T, H, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(V, H, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, V, (B, T))
    coef = torch.randn(B, T, dtype=torch.float64)

    lp, ent = chunked_token_logprobs(hidden, weight, targets, temperature=0.7, chunk_size=chunk_size, with_entropy=True)
    ref_lp, ref_ent = naive(hidden, weight, targets, 0.7)
    assert lp.dtype == torch.float64
    assert torch.allclose(lp, ref_lp, atol=1e-10)
    assert torch.allclose(ent, ref_ent, atol=1e-10)

    gh, gw = torch.autograd.grad((lp * coef).sum() + 0.3 * ent.sum(), (hidden, weight))
    rh, rw = torch.autograd.grad((ref_lp * coef).sum() + 0.3 * ref_ent.sum(), (hidden, weight))
    assert torch.allclose(gh, rh, atol=1e-10)
    assert torch.allclose(gw, rw, atol=1e-10)


def test_chunked_logprobs_float32_without_grad():
    torch.manual_seed(1)
    hidden, weight = torch.randn(2, 5, 4), torch.randn(9, 4)
    targets = torch.randint(0, 9, (2, 5))
    with torch.no_grad():
        lp, _ = chunked_token_logprobs(hidden, weight, targets, chunk_size=3)
    assert lp.dtype == torch.float32 and lp.shape == (2, 5)
    assert torch.allclose(lp.double(), naive(hidden, weight, targets, 1.0)[0], atol=1e-5)


def test_chunked_logprobs_bf16_hidden():
    torch.manual_seed(2)
    hidden = torch.randn(2, 6, 8).to(torch.bfloat16)
    targets = torch.randint(0, 13, (2, 6))
    for weight in (torch.randn(13, 8).to(torch.bfloat16), torch.randn(13, 8)):
        h = hidden.clone().requires_grad_(True)
        lp, ent = chunked_token_logprobs(h, weight, targets, chunk_size=5, with_entropy=True)
        assert lp.dtype == torch.float32 and ent.dtype == torch.float32  # upcast per chunk
        ref_lp, ref_ent = naive(h.detach(), weight, targets, 1.0)
        # bf16 has ~3 significant digits, and the matmul runs in the weight's dtype
        assert torch.allclose(lp.double(), ref_lp, atol=0.1)
        assert torch.allclose(ent.double(), ref_ent, atol=0.1)
        lp.sum().backward()
        assert h.grad.dtype == torch.bfloat16 and torch.isfinite(h.grad.float()).all()


class _RowsOfVocabTensors(TorchDispatchMode):
    """Records the row count of every tensor an op creates whose last dimension is the vocab."""

    def __init__(self, vocab):
        super().__init__()
        self.vocab, self.rows = vocab, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for o in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(o, torch.Tensor) and o.dim() >= 2 and o.shape[-1] == self.vocab:
                self.rows.append(o.numel() // self.vocab)
        return out


def test_chunked_logprobs_never_materialize_full_vocab_tensor():
    B, T, H, V, chunk = 2, 16, 4, 37, 8
    hidden = torch.randn(B, T, H, requires_grad=True)
    weight = torch.randn(V, H, requires_grad=True)
    targets = torch.randint(0, V, (B, T))
    saved = []
    tracker = _RowsOfVocabTensors(V)
    with tracker, torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(tuple(x.shape)) or x, lambda x: x):
        lp, ent = chunked_token_logprobs(hidden, weight, targets, chunk_size=chunk, with_entropy=True)
    with tracker:
        (lp.sum() + ent.sum()).backward()
    # forward and backward create vocab-wide tensors, but never more than one chunk's rows
    assert tracker.rows and max(tracker.rows) <= chunk
    # and autograd keeps none between forward and backward (checkpointing recomputes them)
    assert not any(len(s) >= 2 and s[-1] == V for s in saved), saved


def test_chunked_logprobs_validation():
    h, w, t = torch.zeros(1, 2, 3), torch.zeros(4, 3), torch.zeros(1, 2, dtype=torch.long)
    with pytest.raises(ConfigError, match="temperature"):
        chunked_token_logprobs(h, w, t, temperature=0.0)
    with pytest.raises(ConfigError, match="chunk_size"):
        chunked_token_logprobs(h, w, t, chunk_size=0)
    with pytest.raises(ValueError, match="hidden"):
        chunked_token_logprobs(h, torch.zeros(4, 5), t)
    lp, ent = chunked_token_logprobs(torch.zeros(0, 2, 3), w, torch.zeros(0, 2, dtype=torch.long), with_entropy=True)
    assert lp.shape == (0, 2) and ent.shape == (0, 2)


def test_chunked_logprobs_under_autocast_match_autocast_autograd():
    # Under bf16 autocast the matmul runs in bf16 (as nn.Linear's would) and the softmax in
    # float32; values and gradients match plain autograd through the same autocast computation.
    torch.manual_seed(3)
    hidden = torch.randn(2, 7, 8, requires_grad=True)
    weight = torch.randn(19, 8, requires_grad=True)
    targets = torch.randint(0, 19, (2, 7))
    coef = torch.randn(2, 7)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp, ent = chunked_token_logprobs(hidden, weight, targets, temperature=0.9, chunk_size=4, with_entropy=True)
        logits = (hidden @ weight.t()).float() / 0.9
    assert lp.dtype == torch.float32 and ent.dtype == torch.float32
    logp_all = torch.log_softmax(logits, dim=-1)
    ref_lp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ref_ent = -(logp_all.exp() * logp_all).sum(-1)
    assert torch.allclose(lp, ref_lp, atol=1e-4) and torch.allclose(ent, ref_ent, atol=1e-4)
    got = torch.autograd.grad((lp * coef).sum() + 0.5 * ent.sum(), (hidden, weight))
    want = torch.autograd.grad((ref_lp * coef).sum() + 0.5 * ref_ent.sum(), (hidden, weight))
    for g, w in zip(got, want):
        assert g.dtype == torch.float32  # the master weights' and the input's dtype
        # both multiply bf16-rounded gradients; the sum over chunks may round differently
        assert torch.allclose(g, w, rtol=2e-2, atol=2e-2), (g - w).abs().max()


def test_chunked_logprobs_frozen_head_gives_hidden_gradient_only():
    # LoRA freezes the (tied) output layer: only the hidden states get a gradient.
    torch.manual_seed(4)
    hidden = torch.randn(1, 9, 5, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(6, 5, dtype=torch.float64)
    targets = torch.randint(0, 6, (1, 9))
    lp, _ = chunked_token_logprobs(hidden, weight, targets, chunk_size=4)
    (grad,) = torch.autograd.grad(lp.sum(), hidden)
    (want,) = torch.autograd.grad(naive(hidden, weight, targets, 1.0)[0].sum(), hidden)
    assert torch.allclose(grad, want, atol=1e-10)
    assert weight.grad is None


def test_compiled_passes_match_eager():
    # On CUDA the two elementwise passes run compiled (fused kernels); the compiler must give the
    # eager numbers, for chunks of any size (dynamic shapes) and both dtypes of logits.
    from rftgym.train import token_logprobs as tl
    from rftgym.train.speed import compile_works

    if compile_works("cpu"):
        pytest.skip(f"torch.compile does not work on this machine: {compile_works('cpu')}")
    statistics = torch.compile(tl.logit_statistics, dynamic=True)
    gradient = torch.compile(tl.logit_gradient, dynamic=True)
    torch.manual_seed(5)
    for rows, dtype in ((5, torch.float32), (12, torch.bfloat16)):
        logits = (3 * torch.randn(rows, 23)).to(dtype)
        targets = torch.randint(0, 23, (rows,))
        eager = tl.logit_statistics(logits, targets, 1 / 0.7)
        # entropy = lse - E[s] cancels: float32 rounding alone moves it by ~1e-5 either way
        for got, want in zip(statistics(logits, targets, 1 / 0.7), eager):
            assert got.dtype == torch.float32 and torch.allclose(got, want, atol=1e-4)
        _, lse, entropy = eager
        for upstream in ((torch.randn(rows), torch.randn(rows)), (torch.randn(rows), None)):
            got = gradient(logits, targets, lse, entropy, *upstream, 1 / 0.7)
            want = tl.logit_gradient(logits, targets, lse, entropy, *upstream, 1 / 0.7)
            assert got.dtype == dtype
            assert torch.allclose(got.float(), want.float(), atol=1e-5 if dtype == torch.float32 else 2e-2)


def test_a_pass_that_fails_to_compile_warns_once_and_runs_eagerly(monkeypatch):
    from torch.utils.checkpoint import checkpoint

    from rftgym.train import token_logprobs as tl

    def broken(function):
        def fail(*_):
            raise RuntimeError("no compiler here")
        return fail

    monkeypatch.setattr(tl, "_compiled", broken)
    monkeypatch.setattr(tl, "_compile_failed", set())
    logits, targets = torch.randn(3, 7), torch.randint(0, 7, (3,))
    cuda = torch.device("cuda")  # only selects the compiled route; the tensors stay on the CPU
    with pytest.warns(UserWarning, match="could not compile the fused log-prob pass logit_statistics") as caught:
        # Run inside torch's frames (checkpoint's here; autograd's Function.apply runs the fused
        # passes), the warning still names this line.
        first = checkpoint(tl._pass, tl.logit_statistics, cuda, logits, targets, 1.0, use_reentrant=False)
    assert [w.filename for w in caught] == [__file__]
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        second = tl._pass(tl.logit_statistics, cuda, logits, targets, 1.0)
    for a, b, c in zip(first, second, tl.logit_statistics(logits, targets, 1.0)):
        assert torch.equal(a, c) and torch.equal(b, c)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.filterwarnings("error:could not compile")
def test_cuda_compiled_path_matches_float64_autograd(monkeypatch):
    # The GPU route: bf16 autocast over float32 master weights, compiled elementwise passes. A
    # compile failure would fall back to eager passes with a warning: here it fails the test.
    import rftgym.train.token_logprobs as tl

    monkeypatch.setattr(tl, "_compile_failed", set())
    torch.manual_seed(6)
    hidden = torch.randn(3, 50, 64, device="cuda", requires_grad=True)
    weight = (0.3 * torch.randn(1000, 64, device="cuda")).requires_grad_(True)
    targets = torch.randint(0, 1000, (3, 50), device="cuda")
    coef = torch.randn(3, 50, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        lp, ent = chunked_token_logprobs(hidden, weight, targets, temperature=0.8, chunk_size=64, with_entropy=True)
    ref_lp, ref_ent = naive(hidden, weight, targets, 0.8)
    assert torch.allclose(lp.double(), ref_lp, atol=0.1) and torch.allclose(ent.double(), ref_ent, atol=0.1)
    gh, gw = torch.autograd.grad((lp * coef).sum(), (hidden, weight))
    rh, rw = torch.autograd.grad((ref_lp * coef.double()).sum(), (hidden, weight))
    assert gh.dtype == torch.float32 and gw.dtype == torch.float32
    for got, want in ((gh, rh), (gw, rw)):
        relative = (got.double() - want).norm() / want.norm()
        assert relative < 0.02, relative  # bf16 matmuls
    assert tl._compile_failed == set()


# --- logit transforms (soft cap, scale) ------------------------------------------------------

def test_soft_capped_logprob_by_hand():
    # cap 1, logits [atanh(1/2), 0] -> scores [1/2, 0] -> p0 = e^0.5 / (e^0.5 + 1) = 0.622459
    #   log p0 = -0.474077; entropy = -(0.622459 ln 0.622459 + 0.377541 ln 0.377541) = 0.662847
    # with scale 2 as well: scores [tanh(2 atanh(1/2)), 0] = [0.8, 0] -> p0 = e^0.8 / (e^0.8 + 1)
    #   = 0.689974 -> log p0 = -0.371101
    weight = torch.eye(2, dtype=torch.float64)
    hidden = torch.tensor([[[math.atanh(0.5), 0.0]]], dtype=torch.float64)
    lp, ent = chunked_token_logprobs(hidden, weight, torch.tensor([[0]]), with_entropy=True,
                                     transform=LogitTransform(softcap=1.0))
    close(lp, [[-0.474077]])
    close(ent, [[0.662847]])
    lp, _ = chunked_token_logprobs(hidden, weight, torch.tensor([[0]]), transform=LogitTransform(scale=2.0, softcap=1.0))
    close(lp, [[-0.371101]])


@pytest.mark.parametrize("transform", [LogitTransform(scale=0.25), LogitTransform(divisor=3.0),
                                       LogitTransform(softcap=3.0), LogitTransform(scale=1.7, softcap=2.0)])
def test_transformed_logprobs_match_naive_values_and_gradients(transform):
    torch.manual_seed(7)
    hidden = (2 * torch.randn(2, 6, 5, dtype=torch.float64)).requires_grad_(True)
    weight = torch.randn(9, 5, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 9, (2, 6))
    coef = torch.randn(2, 6, dtype=torch.float64)
    lp, ent = chunked_token_logprobs(hidden, weight, targets, temperature=0.8, chunk_size=5, with_entropy=True,
                                     transform=transform)
    ref_lp, ref_ent = naive(hidden, weight, targets, 0.8, transform)
    assert torch.allclose(lp, ref_lp, atol=1e-10) and torch.allclose(ent, ref_ent, atol=1e-10)
    got = torch.autograd.grad((lp * coef).sum() + 0.3 * ent.sum(), (hidden, weight))
    want = torch.autograd.grad((ref_lp * coef).sum() + 0.3 * ref_ent.sum(), (hidden, weight))
    for g, w in zip(got, want):
        assert torch.allclose(g, w, atol=1e-10)


def test_logit_transform_read_from_model_configs():
    from transformers import CohereConfig, Gemma2Config, GraniteConfig, LlamaConfig

    assert logit_transform(LlamaConfig()) == LogitTransform()
    assert logit_transform(Gemma2Config(final_logit_softcapping=30.0)) == LogitTransform(softcap=30.0)
    assert logit_transform(Gemma2Config(final_logit_softcapping=None)) == LogitTransform()
    assert logit_transform(CohereConfig(logit_scale=0.0625)) == LogitTransform(scale=0.0625)
    assert logit_transform(GraniteConfig(logits_scaling=8.0)) == LogitTransform(divisor=8.0)


def test_logit_transform_validation():
    with pytest.raises(ConfigError, match="logit scale and divisor"):
        LogitTransform(scale=0.0)
    with pytest.raises(ConfigError, match="logit scale and divisor"):
        LogitTransform(divisor=-2.0)
    with pytest.raises(ConfigError, match="soft cap"):
        LogitTransform(softcap=-1.0)


def test_a_transform_under_autocast_rounds_like_the_model():
    # Gemma 2 caps its bf16 logits in bf16; training must see the same rounded numbers, or the
    # first PPO ratio is off by rounding alone (up to ~0.15 nats at a cap of 30).
    torch.manual_seed(8)
    hidden = torch.randn(2, 9, 16)
    weight = 8 * torch.randn(500, 16)
    targets = torch.randint(0, 500, (2, 9))
    transform = LogitTransform(softcap=30.0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp, _ = chunked_token_logprobs(hidden, weight, targets, chunk_size=7, transform=transform)
        logits = hidden @ weight.t()  # bf16
        model_logits = torch.tanh(logits / 30.0) * 30.0  # as Gemma2ForCausalLM does, in bf16
    assert model_logits.dtype == torch.bfloat16 and model_logits.abs().max() > 20
    theirs = torch.log_softmax(model_logits.float(), -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(lp, theirs, atol=1e-5), (lp - theirs).abs().max()


def test_gradients_stay_accurate_for_very_unlikely_targets():
    # log p_target around -1e4: the log-sum-exp is taken where nothing cancels.
    torch.manual_seed(9)
    hidden = (1e3 * torch.randn(1, 4, 6)).requires_grad_(True)
    weight = torch.randn(11, 6, requires_grad=True)
    with torch.no_grad():
        targets = (hidden @ weight.t()).argmin(-1)  # the least likely token of each row
    lp, _ = chunked_token_logprobs(hidden, weight, targets, chunk_size=3)
    ref_lp, _ = naive(hidden, weight, targets, 1.0)
    assert ref_lp.max() < -100
    got = torch.autograd.grad(lp.sum(), (hidden, weight))
    want = torch.autograd.grad(ref_lp.sum(), (hidden, weight))
    for g, w in zip(got, want):
        assert ((g.double() - w).norm() / w.norm()) < 1e-5


def test_masked_logits_give_finite_entropy_and_gradients():
    # A -inf logit (a masked token) has probability 0: the statistics and gradient must equal
    # those over the remaining tokens, not nan from 0 * -inf. Both dtypes, with and without
    # the entropy in the loss.
    from rftgym.train import token_logprobs as tl

    torch.manual_seed(4)
    for dtype in (torch.float32, torch.float64):
        finite = torch.randn(3, 5, dtype=dtype)
        logits = torch.full((3, 8), float("-inf"), dtype=dtype)
        logits[:, [0, 2, 3, 5, 7]] = finite
        targets_full, targets_finite = torch.tensor([0, 3, 7]), torch.tensor([0, 2, 4])
        got = tl.logit_statistics(logits, targets_full, 1 / 0.7)
        want = tl.logit_statistics(finite, targets_finite, 1 / 0.7)
        for g, w in zip(got, want):
            assert torch.isfinite(g).all()
            torch.testing.assert_close(g, w)
        _, lse, entropy = want
        for grad_entropy in (torch.randn(3, dtype=dtype), None):
            grad = tl.logit_gradient(logits, targets_full, lse, entropy, torch.randn(3, dtype=dtype).abs() + 1,
                                     grad_entropy, 1 / 0.7)
            assert torch.isfinite(grad).all()
            assert (grad[:, [1, 4, 6]] == 0).all()
