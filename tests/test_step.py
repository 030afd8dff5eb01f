"""The step's own logic: halving the micro-batch, the skip budget, the recorded micro-batch."""

import pytest

from framework import markers
from framework.data import ResumableDistributedSampler
from framework.markers import FatalError
from framework.step import SkipBudget, apply_recorded_micro_batch, halve_micro_batch


def test_halving_keeps_the_global_batch_until_it_cannot():
    sampler = ResumableDistributedSampler(64, 2, 0, batch_size=4, accumulation=1)
    assert halve_micro_batch(sampler, "oom") == (2, 2)
    assert halve_micro_batch(sampler, "oom") == (1, 4)
    assert sampler.global_batch == 8
    with pytest.raises(FatalError, match="oom at micro-batch 1: cannot halve"):
        halve_micro_batch(sampler, "oom")
    odd = ResumableDistributedSampler(64, 1, 0, batch_size=3)
    with pytest.raises(FatalError, match="micro-batch 3"):
        halve_micro_batch(odd, "oom")


def test_skip_budget_allows_the_limit_then_stops_naming_the_steps():
    skips = SkipBudget(limit=2)
    skips.record(3, epoch=0)
    skips.record(5, epoch=0)
    with pytest.raises(FatalError, match=r"steps \[3, 5, 9\]: more than max_errors_per_epoch=2 in epoch 0"):
        skips.record(9, epoch=0)
    restored = SkipBudget(limit=2)
    restored.load_state_dict(skips.state_dict())
    assert restored.steps == [3, 5, 9]
    restored.new_epoch()
    assert restored.steps == []


def test_recorded_micro_batch_is_applied_only_when_the_batch_matches(tmp_path):
    sampler = ResumableDistributedSampler(64, 2, 0, batch_size=8, accumulation=1)
    apply_recorded_micro_batch(sampler, tmp_path)
    assert (sampler.batch_size, sampler.accumulation) == (8, 1)
    markers.record_micro_batch(tmp_path, 4, 2, "oom")
    apply_recorded_micro_batch(sampler, tmp_path)
    assert (sampler.batch_size, sampler.accumulation) == (4, 2)
    other = ResumableDistributedSampler(64, 2, 0, batch_size=16, accumulation=1)  # the user changed batch_size
    apply_recorded_micro_batch(other, tmp_path)
    assert (other.batch_size, other.accumulation) == (16, 1)
