"""The process's random number generators: seed_all, capture and restore."""

import copy
import io
import random

import numpy as np
import pytest
import torch

from framework.state import rng


def draws() -> dict:
    """The next few values of every generator the framework manages."""
    return {"python": [random.random() for _ in range(3)] + [random.gauss(0, 1)],
            "numpy": np.random.rand(3).tolist() + [np.random.randint(1 << 30)],
            "torch": torch.rand(3).tolist() + torch.randn(2).tolist() + [torch.randint(1 << 30, ()).item()],
            "numpy_generator": rng.numpy_generator().random(3).tolist()}


@pytest.fixture(autouse=True)
def _keep_global_rng_state():
    """These tests reseed the global generators; leave them as they were for later tests."""
    state = rng.capture()
    yield
    rng.restore(state)


def round_trip(state: dict) -> dict:
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def test_seed_all_makes_draws_deterministic():
    rng.seed_all(123)
    a = draws()
    rng.seed_all(123)
    assert draws() == a
    rng.seed_all(124)
    b = draws()
    assert all(a[k] != b[k] for k in a)  # every generator is seeded, not only some
    rng.seed_all(2**40 + 123)  # numpy's legacy seed takes 32 bits: reduced, not an error
    draws()


def test_capture_restore_reproduces_the_next_draws():
    rng.seed_all(7)
    draws()
    random.gauss(0, 1)  # leaves a cached gauss_next in python's state
    state = rng.capture()
    expected = draws()
    after = draws()
    assert after != expected
    rng.restore(state)
    assert draws() == expected
    assert draws() == after


def test_state_survives_torch_save_and_weights_only_load():
    rng.seed_all(5)
    np.random.standard_normal()  # numpy's legacy state caches a gaussian too
    state = rng.capture()
    expected = draws()
    assert set(state) >= {"python", "torch", "numpy", "numpy_generator"}
    loaded = round_trip({"rng": state, "step": 3})["rng"]
    rng.seed_all(0)
    rng.restore(loaded)
    assert draws() == expected


def test_restore_of_a_state_missing_keys_fails():
    state = rng.capture()
    rng.seed_all(3)
    before = draws()
    rng.seed_all(3)
    for missing in ("python", "torch", "numpy", "numpy_generator"):
        partial = {k: v for k, v in state.items() if k != missing}
        with pytest.raises(ValueError, match=f"lacks \\['{missing}'\\].*framework.state.rng.capture"):
            rng.restore(partial)
    with pytest.raises(ValueError, match="'python', 'torch', 'numpy', 'numpy_generator'"):
        rng.restore({})
    assert draws() == before  # a rejected state changes nothing


def test_seed_step_depends_on_seed_rank_and_step_alone():
    def draws():
        return (torch.rand(3).tolist(), random.random(), float(np.random.rand()), float(rng.numpy_generator().random()))

    rng.seed_step(5, 1, 7)
    first = draws()
    torch.rand(100), random.random(), np.random.rand(7)  # whatever the step drew
    rng.seed_step(5, 1, 7)
    assert draws() == first
    for other in ((5, 0, 7), (5, 1, 8), (6, 1, 7)):
        rng.seed_step(*other)
        assert all(a != b for a, b in zip(draws(), first, strict=True)), other


def test_what_is_drawn_between_steps_does_not_shift_the_next_steps_dropout(tmp_path):
    """Each step seeds every rank's generators from (seed, rank, step) at its start: a resumed run,
    or one restarted from a survivor checkpoint, skips what was drawn between the steps before
    (an evaluation, a callback), and must still draw each step's dropout as the uninterrupted run."""
    from framework import DDPTrainer
    from tests.tiny import tiny

    class DrawsOnSave:
        def on_save(self, trainer, step):
            torch.rand(100), random.random(), np.random.rand(3)

    shas = []
    for name, callbacks in (("quiet", []), ("drawing", [DrawsOnSave()])):
        cfg = tiny(tmp_path / name, {"train.max_steps": 6, "checkpoint.every_steps": 2, "eval.interval": 0},
                   dropout=0.2)
        shas.append(DDPTrainer(cfg, callbacks=callbacks).train()["model_sha256"])
    assert shas[0] == shas[1]


def test_step_start_buffers_gives_the_buffers_as_at_the_step_start():
    """A forward changes BatchNorm's running statistics (without bumping the tensors' versions)
    before any collective can fail: the survivor checkpoint writes them as they were at the step's start;
    off rank 0 only buffers that no step changes (DDP's buffers are rank 0's)."""
    from framework.state.checkpointer import StepStartBuffers

    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    watch = StepStartBuffers(model)
    assert sorted(watch.buffers) == ["1.num_batches_tracked", "1.running_mean", "1.running_var"]
    assert watch.model_state(is_main=True) == (None, "no step started yet")
    for _ in range(2):
        watch.at_step_start()
        before = {k: v.clone() for k, v in model.state_dict().items()}
        model(torch.randn(8, 3))
    state, why = watch.model_state(is_main=True)
    assert why is None and state.keys() == before.keys()
    assert all(torch.equal(state[k], before[k]) for k in before)
    assert not torch.equal(model.state_dict()["1.running_mean"], before["1.running_mean"])
    assert watch.model_state(is_main=False) == (None, "the buffers that a step changes (BatchNorm statistics) "
                                                      "are rank 0's")
    model.eval()  # no step changes them now: another rank's copies are rank 0's
    for _ in range(2):
        watch.at_step_start()
        model(torch.randn(8, 3))
    assert watch.model_state(is_main=False)[1] is None
    plain = StepStartBuffers(torch.nn.Linear(3, 4))  # no persistent buffer: nothing is copied
    plain.at_step_start()
    assert plain.copies is None and plain.model_state(is_main=False)[1] is None


class OutOfPlace(torch.nn.Module):
    """A counter buffer reassigned out of place, and an extra state made anew at each call (as fp8
    scaling histories are): both are read by name, not through the objects seen at construction."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)
        self.register_buffer("n", torch.zeros(()))
        self.history = [0.0]

    def forward(self, x):
        self.n = self.n + 1
        self.history = self.history + [float(x.abs().max())]
        return self.lin(x)

    def get_extra_state(self):
        return {"history": torch.tensor(self.history)}

    def set_extra_state(self, state):
        self.history = state["history"].tolist()


def test_step_start_buffers_reads_buffers_and_extra_state_by_name_at_each_step_start():
    """Issue 33, bug 2: the watch kept the tensors it saw at construction, so a buffer updated out
    of place or a new extra state was saved with its construction-time value, and off rank 0 the
    frozen copies always compared equal."""
    from framework.state.checkpointer import StepStartBuffers

    model = OutOfPlace()
    watch = StepStartBuffers(model)
    for _ in range(3):
        watch.at_step_start()
        at_start = copy.deepcopy(model.state_dict())
        model(torch.randn(4, 3))  # the step's forward, before a peer is lost
    state, why = watch.model_state(is_main=True)
    assert why is None and float(state["n"]) == 2.0 == float(at_start["n"])
    assert torch.equal(state["_extra_state"]["history"], at_start["_extra_state"]["history"])
    assert len(state["_extra_state"]["history"]) == 3 and len(model.get_extra_state()["history"]) == 4
    assert watch.model_state(is_main=False) == (None, "the buffers that a step changes (BatchNorm statistics) "
                                                      "are rank 0's")
    restored = OutOfPlace()
    restored.load_state_dict(state)
    assert float(restored.n) == 2.0 and restored.history == model.history[:3]
