"""The learning-rate schedule and optimizer groups."""

import math

import pytest
import torch

from framework.train.optim import build_optimizer, lr_at


def test_warmup_is_linear_from_zero():
    lrs = [lr_at(s, lr=1.0, warmup_steps=10, total_steps=100, min_lr=0.1) for s in range(10)]
    assert lrs == pytest.approx([(s + 1) / 10 for s in range(10)])


def test_cosine_decay_hits_peak_midpoint_and_floor():
    kw = dict(lr=1.0, warmup_steps=10, total_steps=110, min_lr=0.1)
    assert lr_at(10, **kw) == pytest.approx(1.0)
    assert lr_at(60, **kw) == pytest.approx(0.1 + 0.5 * 0.9)
    assert lr_at(110, **kw) == pytest.approx(0.1)
    assert lr_at(500, **kw) == pytest.approx(0.1)
    for s in range(10, 110):
        assert lr_at(s + 1, **kw) <= lr_at(s, **kw)
    expected = 0.1 + 0.5 * (1 + math.cos(math.pi * 25 / 100)) * 0.9
    assert lr_at(35, **kw) == pytest.approx(expected)


def test_no_warmup_starts_at_peak():
    assert lr_at(0, lr=3e-4, warmup_steps=0, total_steps=10, min_lr=0.0) == pytest.approx(3e-4)


def test_weight_decay_only_on_matrices():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    opt = build_optimizer(model, lr=1e-3, weight_decay=0.1)
    decayed, plain = opt.param_groups
    assert decayed["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0
    assert [p.dim() for p in decayed["params"]] == [2]
    assert len(plain["params"]) == 3


def _train(opt_impl: str, steps: int, model=None, state=None):
    torch.manual_seed(0)
    model = model or torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 1))
    opt = build_optimizer(model, lr=1e-2, weight_decay=0.1, impl=opt_impl)
    if state is not None:
        opt.load_state_dict(state)
    data = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(32, 8, generator=data)
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model, opt


@pytest.mark.parametrize("impl", ["auto", "fused", "for_loop"])
def test_optimizer_kernels_agree_with_foreach(impl):
    reference, _ = _train("foreach", 20)
    model, opt = _train(impl, 20)
    assert bool(opt.defaults["fused"]) is (impl in ("auto", "fused"))  # auto picks the fused kernel on CPU
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_a_foreach_checkpoint_resumes_into_the_fused_optimizer():
    """A checkpoint written before the default became fused continues under it."""
    reference, _ = _train("foreach", 20)
    model, opt = _train("foreach", 10)
    state = torch.nn.Module.state_dict(model), opt.state_dict()
    resumed = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 1))
    resumed.load_state_dict(state[0])
    fused = build_optimizer(resumed, lr=1e-2, weight_decay=0.1, impl="fused")
    fused.load_state_dict(state[1])
    data = torch.Generator().manual_seed(1)
    for _ in range(10):
        torch.randn(32, 8, generator=data)  # the 10 batches already seen
    for _ in range(10):
        resumed(torch.randn(32, 8, generator=data)).pow(2).mean().backward()
        fused.step()
        fused.zero_grad(set_to_none=True)
    for got, want in zip(resumed.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
