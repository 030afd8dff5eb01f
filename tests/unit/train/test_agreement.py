"""The per-step agreement (one all-reduce of the loss and the control flags), and ``spread``."""

import pytest
import torch
import torch.distributed as dist

from framework.train.agreement import SLOTS, Agreement, agree, spread
from tests.dist_helper import one_process_group

FLAGS = SLOTS[1:]


def test_without_a_group_returns_the_loss_and_flags():
    assert not dist.is_initialized()
    agreed = agree(loss=torch.tensor(2.5), world_size=1, distributed=False)
    assert agreed == Agreement(loss=2.5, stop=False, nonfinite=False, oom=False, preempt=False)
    for name in FLAGS:
        agreed = agree(loss=torch.tensor(1.0), world_size=1, distributed=False, **{name: True})
        assert {f: getattr(agreed, f) for f in FLAGS} == {f: f == name for f in FLAGS}
    agreed = agree(loss=torch.tensor(1.0), world_size=1, distributed=False, stop=True, preempt=True, oom=False)
    assert agreed.stop and agreed.preempt and not agreed.oom and not agreed.nonfinite


def test_tensor_flags_and_loss():
    loss = torch.tensor([[0.75]], requires_grad=True) * 2  # any shape of one element, with a graph
    grad_norm = torch.tensor(float("inf"))
    agreed = agree(loss=loss, world_size=1, distributed=False, nonfinite=~torch.isfinite(grad_norm),
                   stop=torch.tensor(False), oom=torch.tensor(1), preempt=torch.tensor(0.0))
    assert agreed == Agreement(loss=1.5, stop=False, nonfinite=True, oom=True, preempt=False)
    assert isinstance(agreed.loss, float) and isinstance(agreed.nonfinite, bool)
    agreed = agree(loss=torch.tensor(float("nan")), world_size=1, distributed=False,
                   nonfinite=torch.isnan(torch.tensor(float("nan"))))
    assert agreed.nonfinite and agreed.loss != agreed.loss  # NaN passes through


def test_unknown_flag_fails():
    with pytest.raises(AssertionError, match="unknown control flags.*halt"):
        agree(loss=torch.tensor(1.0), world_size=1, distributed=False, halt=True)
    with pytest.raises(AssertionError, match="loss_sum"):
        agree(loss=torch.tensor(1.0), world_size=1, distributed=False, loss_sum=True)


def test_loss_is_averaged_by_world_size():
    # Without a group the buffer is this rank's only; the division is what the all-reduce sum needs.
    assert agree(loss=torch.tensor(6.0), world_size=3, distributed=False).loss == 2.0
    assert agree(loss=torch.tensor(1.0, dtype=torch.bfloat16), world_size=4, distributed=False).loss == 0.25


def test_one_process_group_gives_the_same_result():
    cases = [dict(loss=torch.tensor(2.5)),
             dict(loss=torch.tensor(0.1), stop=True, oom=torch.tensor(True)),
             dict(loss=torch.tensor(3.0), nonfinite=torch.tensor(False), preempt=True)]
    local = [agree(world_size=1, distributed=False, **case) for case in cases]
    one_process_group()
    try:
        assert [agree(world_size=1, distributed=True, **case) for case in cases] == local
        # the all-reduce path divides the sum by world_size too
        assert agree(loss=torch.tensor(6.0), world_size=3, distributed=True).loss == 2.0
    finally:
        dist.destroy_process_group()


def test_spread_on_one_rank_finds_no_difference():
    one_process_group()
    try:
        assert spread({"train_dataset length": 100, "val": -1, "lr": 0.5}) == {}
    finally:
        dist.destroy_process_group()
