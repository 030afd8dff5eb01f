"""The DDP policy in one process: decisions from probe findings, the probe's hygiene, diagnoses, --doctor."""

import random

import numpy as np
import pytest
import torch
import torch.nn as nn

import ddp_training
from framework.ddp.policy import ProbeReport, decide, diagnose, probe
from framework.trainer import DDPTrainer
from tests.dist_helper import launch_cases
from tests.workers.reentrant_inputs import CASES, FrozenThenAdapter, dataset


def report(**kw):
    return ProbeReport(num_parameters=10, num_tensors=2, **kw)


def choose(rep, static="auto", unused="auto", ckpt="off", accum=1):
    d = decide(rep, static_graph=static, find_unused=unused, checkpointing=ckpt, accumulation=accum)
    return d.static_graph, d.find_unused_parameters, d.safe, d.reasons


def test_clean_model_gets_the_fastest_settings():
    assert choose(report())[:3] == (False, False, True)


def test_unused_parameters_turn_on_find_unused():
    static, unused, safe, reasons = choose(report(unused=["head.weight"], changing=["head.weight"]))
    assert (static, unused, safe) == (False, True, True)
    assert "parameters without a gradient (head.weight) -> find_unused_parameters on" in reasons[0]


def test_shared_parameters_under_reentrant_turn_on_static_graph():
    rep = report(multi_fire=["shared.weight"], shared=["a.weight = b.weight"])
    static, unused, safe, reasons = choose(rep, ckpt="reentrant", accum=2)
    assert (static, unused, safe) == (True, False, True)
    assert reasons[0].startswith("gradient checkpointing (reentrant) with shared parameters")
    assert "-> static_graph on" in reasons[0]
    assert any("warm-up" in r for r in reasons)


def test_unused_and_hidden_parameters_use_static_graph():
    assert choose(report(unused=["x"], hidden=["y"]), ckpt="reentrant")[:3] == (True, False, True)


def test_no_setting_fits_multi_fire_with_changing_graph():
    static, _, safe, reasons = choose(report(multi_fire=["w"], changing=["v"], unused=["v"]))
    assert static and not safe and "no DDP setting fits" in reasons[-1]


def test_forced_settings_are_kept_and_flagged():
    static, unused, safe, reasons = choose(report(unused=["head.weight"]), unused="false")
    assert (static, unused, safe) == (False, False, False)
    assert "ddp.find_unused_parameters forced false (the probe suggests true)" in reasons
    assert choose(report(hidden=["w"]), unused="true", ckpt="reentrant")[2] is False
    assert choose(report(), static="true")[:3] == (True, False, True)


class Branchy(nn.Module):
    """A shared weight, an unused layer, a data-dependent branch, and a buffer."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.b.weight = self.a.weight
        self.unused = nn.Linear(4, 4)
        self.branch = nn.Linear(4, 4)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls += 1
        h = self.b(torch.relu(self.a(x)))
        if x[0, 0] > 0:
            h = self.branch(h)
        return h + torch.nn.functional.dropout(h, 0.5)


def test_probe_finds_unused_shared_changing_and_restores_state():
    model = Branchy()
    model.a.bias.grad = torch.ones(4)
    batches = [(-torch.ones(2, 4), torch.zeros(2, 4)), (torch.ones(2, 4), torch.zeros(2, 4))]
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = (random.random(), np.random.rand(), torch.rand(1))
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    rep = probe(model, batches, nn.functional.mse_loss, lambda: torch.autocast("cpu", enabled=False))
    assert rep.unused == ["branch.bias", "branch.weight", "unused.bias", "unused.weight"]
    assert rep.changing == ["branch.bias", "branch.weight"]
    assert rep.shared == ["a.weight = b.weight"]
    assert rep.multi_fire == [] and rep.hidden == []
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # weights and the buffer
    assert torch.equal(model.a.bias.grad, torch.ones(4))
    assert all(p.grad is None for n, p in model.named_parameters() if n != "a.bias")
    assert (random.random(), np.random.rand(), torch.rand(1)) == rng


def test_probe_detects_reentrant_double_firing_and_hidden_params():
    from torch.utils.checkpoint import checkpoint

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = nn.Linear(4, 4)

        def forward(self, x):
            for _ in range(2):
                x = checkpoint(self.block, x, use_reentrant=True)
            return x

    batch = (torch.randn(2, 4, requires_grad=True), torch.zeros(2, 4))
    rep = probe(Twice(), [batch, batch], nn.functional.mse_loss, lambda: torch.autocast("cpu", enabled=False))
    assert rep.multi_fire == ["block.bias", "block.weight"]
    assert rep.hidden == ["block.bias", "block.weight"]


def test_reentrant_hidden_parameters_get_one_consistent_reason():
    from torch.utils.checkpoint import checkpoint

    class Once(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = nn.Linear(4, 4)
            self.head = nn.Linear(4, 4)

        def forward(self, x):
            return self.head(checkpoint(self.block, x, use_reentrant=True))

    batch = (torch.randn(2, 4, requires_grad=True), torch.zeros(2, 4))
    rep = probe(Once(), [batch, batch], nn.functional.mse_loss, lambda: torch.autocast("cpu", enabled=False))
    assert rep.hidden == ["block.bias", "block.weight"] and not rep.multi_fire and not rep.unused
    static, unused, safe, reasons = choose(rep, ckpt="reentrant")
    assert (static, unused, safe) == (False, False, True)
    assert not any("exactly one gradient" in r for r in reasons), reasons
    assert len(reasons) == 1 and "block.bias, block.weight" in reasons[0], reasons
    assert "find_unused_parameters off" in reasons[0] and "marked ready twice" in reasons[0], reasons
    # Reentrant checkpointing the probe found no hidden parameter under: one reason, no "hidden" claim.
    reasons = choose(report(), ckpt="reentrant")[3]
    assert len(reasons) == 1 and "hidden from the forward graph (" not in reasons[0], reasons


@pytest.mark.parametrize("message, fix", [
    ("Expected to mark a variable ready only once. This error ...", "ddp.static_graph=auto"),
    ("Your training graph has changed in this iteration, ...", "ddp.static_graph=false"),
    ("Expected to have finished reduction in the prior iteration before starting a new one.",
     "ddp.find_unused_parameters=true"),
    ("expect_autograd_hooks_ INTERNAL ASSERT FAILED at ...", "warm-up"),
])
def test_diagnoses_name_the_fix(message, fix):
    err = diagnose(RuntimeError(message))
    assert err is not None and fix in str(err) and "Fix:" in str(err)
    assert diagnose(RuntimeError("CUDA error: device-side assert")) is None


def test_doctor_reports_and_exits_0(tmp_path, capsys):
    code = ddp_training.main(["--doctor", "--hidden-size", "32", "--num-heads", "2", "--num-layers", "2",
                              "--vocab-size", "32", "--dataset-size", "64", "--seq-len", "16",
                              "--memory.activation_checkpointing", "reentrant", "--model.tie_embeddings", "true",
                              "--logging.dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0
    assert "shared parameters: tok_emb.weight = lm_head.weight" in out
    assert "parameters hidden from the forward graph: blocks.0" in out
    assert "chosen: static_graph=False, find_unused_parameters=False" in out
    assert "training would be safe" in out


def test_doctor_exits_1_when_forced_settings_would_fail(tmp_path, capsys):
    class WithUnused(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(32, 8)
            self.out = nn.Linear(8, 32)
            self.spare = nn.Linear(8, 8)

        def forward(self, x):
            return self.out(self.emb(x))

    trainer = DDPTrainer({"vocab_size": 32, "seq_len": 8, "dataset_size": 64, "batch_size": 4,
                          "ddp.find_unused_parameters": "false", "logging.dir": str(tmp_path), "num_workers": 0,
                          "checkpoint.dir": str(tmp_path / "ck")},
                         model=WithUnused(), doctor=True)
    assert trainer.report.unused == ["spare.bias", "spare.weight"]
    assert not trainer.decision.safe


@pytest.mark.parametrize("targets", ["adapter,head", "adapter"])
def test_reentrant_module_whose_inputs_need_no_grad_is_switched_and_trained(targets, tmp_path):
    """A reentrant-checkpointed module fed only by tensors that need no grad (a frozen encoder's
    output): plain torch raises autograd's raw 'element 0 ... does not require grad' (or silently
    leaves the module untrained). The preflight sees every parameter trained after the switch, and
    the run trains the module."""
    data = dataset()
    cfg = {"memory.activation_checkpointing": "reentrant", "memory.activation_checkpointing_modules": targets,
           "batch_size": 8, "num_workers": 0,
           "logging.dir": str(tmp_path / "logs"), "checkpoint.dir": str(tmp_path / "ck"), "train.max_steps": 4,
           "learning_rate": 0.01, "logging.tensorboard": False}
    doctor = DDPTrainer(cfg, model=FrozenThenAdapter(), train_dataset=data, loss_fn=nn.functional.mse_loss,
                        doctor=True)
    doctor.close()
    assert doctor.report.unused == [] and doctor.decision.safe
    assert doctor.activation_checkpointing.mode == "non_reentrant"
    assert any("non_reentrant" in r and "'adapter'" in r for r in doctor.decision.reasons), doctor.decision.reasons
    model = FrozenThenAdapter()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    DDPTrainer({**cfg, "checkpoint.resume": "none"}, model=model, train_dataset=data,
               loss_fn=nn.functional.mse_loss).train()
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]) == name.startswith("encoder."), name


@pytest.mark.dist
def test_reentrant_module_whose_inputs_need_no_grad_gets_exact_ddp_gradients(tmp_path):
    """The same model on 2 gloo ranks: every rank switches, the preflight finds no unused
    parameter (so find_unused_parameters stays off), and the gradients equal the plain model's
    on the global batch."""
    results = launch_cases("tests/workers/reentrant_inputs.py", tmp_path, timeout=300)
    for rank in (0, 1):
        for name in CASES:
            out = results[rank]["cases"][name]
            assert "error" not in out, out.get("traceback")
            assert out["mode"] == "non_reentrant" and out["unused"] == [], out
            assert not out["find_unused_parameters"], out
            assert out["max_abs_diff"] <= 1e-6, out
