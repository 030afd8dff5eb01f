"""Run health: parameter hashes, the model fingerprint, the consistency check and the watchdog."""

import logging
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from framework.ddp.policy import unwrap
from framework.resilience.consistency import ConsistencyCheck, first_divergent, model_sha256, parameter_hashes
from framework.resilience.watchdog import Watchdog
from framework.resilience.config import RecoverySection
from tests.dist_helper import one_process_group


def small_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))


def nudge(model: nn.Module, param: int, index: int) -> None:
    p = list(model.parameters())[param]
    with torch.no_grad():
        flat = p.view(-1)
        flat[index] = torch.nextafter(flat[index], torch.tensor(float("inf")))


# --- fingerprints ------------------------------------------------------------------------------
def test_parameter_hashes_stable_and_see_one_ulp_anywhere():
    model = small_model()
    base = parameter_hashes(model)
    assert base.dtype == torch.int64 and base.shape == (len(list(model.parameters())),)
    assert torch.equal(parameter_hashes(model), base)
    assert torch.equal(parameter_hashes(small_model()), base)
    for param, index in [(0, 0), (0, 31), (1, 5), (3, 7), (5, 1)]:
        m = small_model()
        nudge(m, param, index)
        changed = (parameter_hashes(m) != base).nonzero().flatten().tolist()
        assert changed == [param], (param, index)


def test_parameter_hashes_see_a_swap_and_sign_of_zero():
    model = small_model()
    base = parameter_hashes(model)
    with torch.no_grad():
        w = model[0].weight.view(-1)
        w[0], w[1] = w[1].clone(), w[0].clone()  # same sum, different positions
    assert parameter_hashes(model)[0] != base[0]
    zeros, negzeros = nn.Linear(2, 2), nn.Linear(2, 2)
    with torch.no_grad():
        for p in zeros.parameters():
            p.fill_(0.0)
        for p in negzeros.parameters():
            p.fill_(-0.0)
    assert not torch.equal(parameter_hashes(zeros), parameter_hashes(negzeros))


def test_parameter_hashes_other_dtypes():
    for dtype in (torch.float64, torch.bfloat16, torch.float16):
        a, b = small_model().to(dtype), small_model().to(dtype)
        assert torch.equal(parameter_hashes(a), parameter_hashes(b))
        with torch.no_grad():
            b[2].bias.view(-1)[1] = torch.nextafter(b[2].bias[1], torch.tensor(float("inf"), dtype=dtype))
        assert (parameter_hashes(a) != parameter_hashes(b)).tolist() == [False] * 5 + [True], dtype


def test_model_sha256_equal_iff_bit_identical():
    a, b = small_model(), small_model()
    assert model_sha256(a) == model_sha256(b)
    assert len(model_sha256(a)) == 64
    nudge(b, 3, 2)
    assert model_sha256(a) != model_sha256(b)
    assert model_sha256(small_model(seed=1)) != model_sha256(a)
    # buffers count too
    bn_a, bn_b = nn.BatchNorm1d(3), nn.BatchNorm1d(3)
    assert model_sha256(bn_a) == model_sha256(bn_b)
    bn_b.num_batches_tracked += 1
    assert model_sha256(bn_a) != model_sha256(bn_b)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # importing torch._dynamo
def test_model_sha256_independent_of_wrappers():
    model = small_model()
    digest = model_sha256(model)
    compiled = torch.compile(model)  # lazy: nothing compiles until it is called
    assert list(compiled.state_dict())[0].startswith("_orig_mod.")  # the wrapper does rename the keys
    assert unwrap(compiled) is model
    assert model_sha256(compiled) == digest
    one_process_group()
    try:
        ddp = DDP(model)
        assert list(ddp.state_dict())[0].startswith("module.")
        assert unwrap(ddp) is model and unwrap(torch.compile(ddp)) is model and unwrap(DDP(compiled)) is model
        assert model_sha256(ddp) == digest
        assert model_sha256(torch.compile(ddp)) == digest
    finally:
        dist.destroy_process_group()


# --- consistency check -------------------------------------------------------------------------
def test_first_divergent_on_one_rank_is_none():
    model = small_model()
    one_process_group()
    try:
        assert first_divergent(model, torch.device("cpu")) is None
        check = ConsistencyCheck(RecoverySection(consistency_check_interval=2), model=model, device=torch.device("cpu"),
                                 distributed=True)
        for step in range(5):
            check.maybe_check(step)  # every rank agrees with itself: no FatalError
    finally:
        dist.destroy_process_group()


def test_consistency_check_interval():
    model = small_model()
    cpu = torch.device("cpu")
    check = ConsistencyCheck(RecoverySection(consistency_check_interval=3), model=model, device=cpu, distributed=True)
    assert [s for s in range(1, 11) if check.should_run(s)] == [3, 6, 9]
    never = ConsistencyCheck(RecoverySection(consistency_check_interval=0), model=model, device=cpu, distributed=True)
    assert not any(never.should_run(s) for s in range(10))
    single = ConsistencyCheck(RecoverySection(consistency_check_interval=3), model=model, device=cpu, distributed=False)
    assert not any(single.should_run(s) for s in range(10))
    for step in range(10):
        single.maybe_check(step)  # off: no collective without a group


# --- watchdog ----------------------------------------------------------------------------------
@pytest.fixture
def log_file(tmp_path):
    with open(tmp_path / "watchdog.log", "w") as f:
        yield f


def watchdog(log_file, *, step_timeout_s=60.0, factor=3.0, **kw):
    return Watchdog(RecoverySection(step_timeout_s=step_timeout_s, step_timeout_factor=factor),
                    **{"log_file": log_file, "rank": 0, "world_size": 1, **kw})


def test_deadline_is_the_larger_of_minimum_and_factor_times_median(log_file):
    w = watchdog(log_file, step_timeout_s=5.0, factor=3.0)
    try:
        assert w.enabled and w.deadline() == 5.0
        w.durations.extend([1.0, 5.0, 2.0])
        assert w.deadline() == 6.0  # 3 x median 2.0 (not the mean)
        w.durations.extend([0.1, 0.1, 0.1, 0.1])
        assert w.deadline() == 5.0  # 3 x median 0.1 < minimum
        w.durations.extend([100.0] * 50)  # a window of the last 50
        assert w.deadline() == 300.0 and len(w.durations) == 50
    finally:
        w.close()


def test_arm_and_disarm_record_step_durations(log_file):
    w = watchdog(log_file)
    try:
        w.disarm()  # not armed: nothing to record
        assert not w.durations
        for step in range(3):
            w.arm(step)
            time.sleep(0.02)
            w.disarm()
        assert len(w.durations) == 3 and all(0.015 < d < 5 for d in w.durations)
        w.disarm()  # a second disarm records nothing
        assert len(w.durations) == 3
    finally:
        w.close()


def test_disabled_watchdog_does_nothing(log_file):
    w = watchdog(log_file, step_timeout_s=0)
    try:
        assert not w.enabled
        w.dump_on(15)
        for step in range(3):
            w.arm(step)
            w.disarm()
        assert not w.durations
    finally:
        w.close()
    w.close()  # closing twice is harmless


def test_heartbeat_and_straggler_report(log_file, caplog):
    store = dist.HashStore()
    w = watchdog(log_file, world_size=2, store=store)
    try:
        with caplog.at_level(logging.ERROR, logger="framework.resilience"):
            w.arm(7)  # faulthandler armed at 80 s: close() cancels it long before
            w._deadline = 0.4  # the monitor beats after a quarter and reports after three quarters
            end = time.monotonic() + 10
            while not caplog.records and time.monotonic() < end:
                time.sleep(0.05)
            w.disarm()
        assert store.get("heartbeat/0").decode().split()[0] == "7"
        [record] = caplog.records
        assert "step 7 is about to time out" in record.getMessage()
        assert "straggler rank 1 (last heartbeat at step -1)" in record.getMessage()
        assert "rank 0" not in record.getMessage()
    finally:
        w.close()
    assert w._monitor is None and w.store is None


def test_every_rank_stuck_report(log_file, caplog):
    store = dist.HashStore()
    store.set("heartbeat/0", "4 0.0")
    store.set("heartbeat/1", "4 0.0")
    w = watchdog(log_file, world_size=2, store=store)
    try:
        with caplog.at_level(logging.ERROR, logger="framework.resilience"):
            w._name_stragglers(4)
            w._name_stragglers(5)
        assert "every rank is stuck inside it" in caplog.records[0].getMessage()
        assert "straggler rank 0 (last heartbeat at step 4); rank 1 (last heartbeat at step 4)" in \
            caplog.records[1].getMessage()
    finally:
        w.close()


def test_the_consistency_check_listens_at_step_end_and_skips_a_step_about_to_be_rolled_back():
    from framework.train.agreement import Agreement
    from framework.train.events import StepResult
    pending = []
    check = ConsistencyCheck(RecoverySection(consistency_check_interval=2), model=small_model(),
                             device=torch.device("cpu"), distributed=True, skip=lambda: bool(pending))
    checked = []
    check.maybe_check = checked.append

    def end(step):
        check.step_end(StepResult(step, 0, Agreement(1.0, False, False, False, False), 0.1, torch.tensor(1.0), 8, []),
                       None)
    end(1)
    end(2)
    pending.append("spike at step 4")  # the spike guard holds a spike: the loop rolls step 4 back
    end(4)
    pending.clear()
    end(6)
    assert checked == [2, 6]
