"""The learning-rate schedule and optimizer groups."""

import math

import pytest
import torch

from framework.optim import build_optimizer, lr_at


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
