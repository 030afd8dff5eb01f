"""Fault injection: the spec parser, when a planned fault is due, and what each in-process fault does."""

import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from framework.resilience.faults import ANY_RESTART, KINDS, Fault, FaultPlan, middle_module, nudge_one_ulp, parse

ROOT = Path(__file__).resolve().parents[3]


class Blocks(nn.Module):
    """A small model with a ``blocks`` ModuleList, like the transformer's."""

    def __init__(self, n_blocks: int = 3, width: int = 4):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(3, width)
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(n_blocks))
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x).sum()


def no_hooks_left(model: nn.Module) -> bool:
    return all(not m._forward_hooks for m in model.modules())


def run_micro(plan, model, step, micro, last_micro, kill=lambda: None, calls=None):
    """One micro-step as framework.train.step runs it: forward, on_loss(loss), backward."""
    with plan.micro_step(step, micro, last_micro, model, kill) as on_loss:
        loss = model(torch.ones(2, 3))
        on_loss(loss)
        if calls is not None:
            calls.append(("before backward", len(calls)))
        loss.backward()


# --- parse -----------------------------------------------------------------------------------
def test_parse_good_specs():
    assert parse("") == []
    assert parse(" ; ;") == []
    assert parse("nan@step=5,rank=1; oom@step=8; sigterm@step=4") == [
        Fault("nan", 5, 1), Fault("oom", 8), Fault("sigterm", 4)]
    assert parse(" oom @ step=3 , micro=0 , restart=2 ;") == [Fault("oom", 3, None, 2, 0)]
    assert parse("kill_worker@step=0,rank=0,restart=1") == [Fault("kill_worker", 0, 0, 1, None)]
    assert parse("slow@step=5,rank=1,ms=40") == [Fault("slow", 5, 1, ms=40)]
    assert parse("crash@step=3,restart=*") == [Fault("crash", 3, restart=ANY_RESTART)]
    for kind in set(KINDS) - {"slow"}:
        assert parse(f"{kind}@step=7") == [Fault(kind, 7)]


@pytest.mark.parametrize("spec, names", [
    ("boom@step=1", ["'boom@step=1'", "unknown kind 'boom'", "allowed: nan, oom, kill_worker, hang, sigterm"]),
    ("nan@step=1; explode@step=2", ["'explode@step=2'", "unknown kind 'explode'", "allowed:"]),
    ("nan@step=x", ["'nan@step=x'", "'step=x'",
                    "step=N, rank=N, restart=N|*, micro=N, ms=N or at=step|eval|save"]),
    ("nan@step=-1", ["'step=-1'", "must be step=N"]),
    ("nan@when=3", ["'when=3'", "must be step=N"]),
    ("nan@step", ["'step'", "must be step=N"]),
    ("nan@rank=1", ["'nan@rank=1'", "needs step=N", "nan@step=5"]),
    ("oom", ["'oom'", "needs step=N", "oom@step=5"]),
])
def test_parse_rejects_bad_specs_naming_the_part(spec, names):
    with pytest.raises(ValueError) as err:
        parse(spec)
    for name in names:
        assert name in str(err.value)


def test_process_faults_take_a_moment_and_others_refuse_one():
    assert parse("crash@step=3,rank=1,at=eval") == [Fault("crash", 3, 1, at="eval")]
    assert parse("hang@step=3,at=step") == [Fault("hang", 3)]
    for spec in ("nan@step=3,at=eval", "crash@step=3,at=end"):
        with pytest.raises(ValueError, match=re.escape("allowed: at=step, or at=eval|save|export for sigterm, "
                                                       "sigkill, sigstop, crash, hang")):
            parse(spec)


def test_an_eval_fault_fires_in_the_evaluation_not_at_the_step():
    plan = FaultPlan("crash@step=4,at=eval", rank=0, group_restarts=0)
    plan.fire_process_faults(4)  # the start of step 4: not its moment
    with pytest.raises(RuntimeError, match=r"fault injection: crash at step 4 \(eval\)"):
        plan.fire_process_faults(4, at="eval")
    plan.fire_process_faults(4, at="eval")  # once


# --- due -------------------------------------------------------------------------------------
def test_due_fires_once_on_the_planned_step_rank_and_restart():
    spec = "nan@step=3,rank=1; oom@step=4; ulp@step=5,restart=2"
    plan = FaultPlan(spec, rank=1, group_restarts=0)
    assert not plan.due("nan", 2) and not plan.due("oom", 3) and not plan.due("ulp", 5)
    assert plan.due("nan", 3)
    assert not plan.due("nan", 3)  # once
    assert plan.due("oom", 4) and not plan.due("oom", 4)

    other_rank = FaultPlan(spec, rank=0, group_restarts=0)
    assert not other_rank.due("nan", 3)  # planned for rank 1 only
    assert other_rank.due("oom", 4)  # no rank: every rank

    restarted = FaultPlan(spec, rank=1, group_restarts=1)
    assert not restarted.due("nan", 3) and not restarted.due("oom", 4)  # restart 0 only
    assert not restarted.due("ulp", 5)
    assert FaultPlan(spec, rank=1, group_restarts=2).due("ulp", 5)


def test_due_micro_defaults_to_the_last_micro_step():
    plan = FaultPlan("oom@step=2", 0, 0)
    assert not plan.due("oom", 2, micro=0, last_micro=2)
    assert not plan.due("oom", 2, micro=1, last_micro=2)
    assert plan.due("oom", 2, micro=2, last_micro=2)
    plan = FaultPlan("oom@step=2,micro=1", 0, 0)
    assert not plan.due("oom", 2, micro=2, last_micro=2)
    assert plan.due("oom", 2, micro=1, last_micro=2)
    assert not plan.due("oom", 2, micro=1, last_micro=2)


def test_two_faults_of_a_kind_fire_at_their_own_steps():
    plan = FaultPlan("nan@step=1; nan@step=4", 0, 0)
    assert [s for s in range(6) if plan.due("nan", s)] == [1, 4]


# --- micro_step: oom and kill_worker -------------------------------------------------------------
def test_oom_fault_raises_from_the_middle_blocks_backward():
    model = Blocks()
    plan = FaultPlan("oom@step=2", 0, 0)
    run_micro(plan, model, step=2, micro=0, last_micro=1)  # not the last micro-step: no fault
    assert all(p.grad is not None for p in model.parameters())
    model.zero_grad(set_to_none=True)
    with pytest.raises(torch.OutOfMemoryError, match="injected OOM"):
        run_micro(plan, model, step=2, micro=1, last_micro=1)
    # The backward got past the head and the last block, and stopped before the first block.
    assert model.head.weight.grad is not None
    assert model.inp.weight.grad is None and model.blocks[0].weight.grad is None
    assert no_hooks_left(model)
    model.zero_grad(set_to_none=True)
    run_micro(plan, model, step=2, micro=1, last_micro=1)  # fired once: the retry works
    assert all(p.grad is not None for p in model.parameters())


def test_oom_fault_on_a_chosen_micro_step():
    model = Blocks(n_blocks=4)
    plan = FaultPlan("oom@step=0,micro=0", 0, 0)
    with pytest.raises(torch.OutOfMemoryError):
        run_micro(plan, model, step=0, micro=0, last_micro=3)
    assert model.blocks[1].weight.grad is None and model.blocks[3].weight.grad is not None
    assert no_hooks_left(model)


def test_no_due_fault_backward_works_and_leaves_no_hook():
    reference = Blocks()
    reference(torch.ones(2, 3)).backward()
    for spec, rank in (("", 0), ("oom@step=9", 0), ("oom@step=2,rank=1", 0), ("nan@step=2", 0)):
        model = Blocks()
        run_micro(FaultPlan(spec, rank, 0), model, step=2, micro=0, last_micro=0)
        assert no_hooks_left(model)
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad)


def test_kill_worker_called_once_during_the_last_backward():
    model = Blocks()
    plan = FaultPlan("kill_worker@step=4", 0, 0)
    calls = []

    def kill():
        calls.append(("kill", len(calls)))
        return 1234

    run_micro(plan, model, step=3, micro=1, last_micro=1, kill=kill, calls=calls)
    run_micro(plan, model, step=4, micro=0, last_micro=1, kill=kill, calls=calls)
    assert [c for c in calls if c[0] == "kill"] == []  # wrong step, then not the last micro-step
    calls.clear()
    run_micro(plan, model, step=4, micro=1, last_micro=1, kill=kill, calls=calls)
    assert calls == [("before backward", 0), ("kill", 1)]  # during the backward, not before
    calls.clear()
    run_micro(plan, model, step=4, micro=1, last_micro=1, kill=kill, calls=calls)
    assert calls == [("before backward", 0)]
    assert no_hooks_left(model)


def test_kill_worker_only_on_its_rank():
    calls = []
    run_micro(FaultPlan("kill_worker@step=0,rank=1", 0, 0), Blocks(), 0, 0, 0, kill=lambda: calls.append(1))
    assert calls == []
    run_micro(FaultPlan("kill_worker@step=0,rank=1", 1, 0), Blocks(), 0, 0, 0, kill=lambda: calls.append(1))
    assert calls == [1]


# --- on_gradients, on_step_end ---------------------------------------------------------------------
def test_on_gradients_puts_one_nan_only_when_due():
    model = Blocks()
    model(torch.ones(2, 3)).backward()
    model.inp.weight.grad = None  # the NaN goes into the first parameter that has a gradient
    clean = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    plan = FaultPlan("nan@step=1,rank=0", 0, 0)
    plan.gradients(0, model)
    FaultPlan("nan@step=1,rank=1", 0, 0).gradients(1, model)
    assert not any(p.grad.isnan().any() for p in model.parameters() if p.grad is not None)
    plan.gradients(1, model)
    nans = [int(p.grad.isnan().sum()) for p in model.parameters() if p.grad is not None]
    assert nans == [1] + [0] * (len(nans) - 1)
    assert model.inp.bias.grad.view(-1)[0].isnan()
    assert torch.equal(model.inp.bias.grad.view(-1)[1:], clean[1].view(-1)[1:])
    model.inp.bias.grad = clean[1].clone()
    plan.gradients(1, model)  # once
    assert not model.inp.bias.grad.isnan().any()


def result_of(step):
    from framework.train.agreement import Agreement
    from framework.train.events import StepResult
    return StepResult(step, 0, Agreement(1.0, False, False, False, False), 0.1, torch.tensor(1.0), 64, [])


def test_on_step_end_moves_one_element_by_one_ulp_when_due():
    model = Blocks()
    before = [p.detach().clone() for p in model.parameters()]
    plan = FaultPlan("ulp@step=2", 0, 0)
    plan.step_end(result_of(1), model)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    plan.step_end(result_of(2), model)
    changed = sum(int((p != b).sum()) for p, b in zip(model.parameters(), before, strict=True))
    assert changed == 1
    first = model.inp.weight.view(-1)[0]
    assert first == torch.nextafter(before[0].view(-1)[0], torch.tensor(float("inf")))
    assert first.view(torch.int32) - before[0].view(-1)[0].view(torch.int32) in (1, -1)
    plan.step_end(result_of(2), model)  # once
    assert model.inp.weight.view(-1)[0] == first


# --- helpers ---------------------------------------------------------------------------------
@pytest.mark.parametrize("value, dtype", [(1.0, torch.float32), (-2.5, torch.float32), (0.0, torch.float64)])
def test_nudge_one_ulp(value, dtype):
    model = nn.Linear(2, 2).to(dtype)
    with torch.no_grad():
        model.weight.fill_(value)
    bias = model.bias.detach().clone()
    assert nudge_one_ulp(model) == "weight"
    w = model.weight.detach().view(-1)
    assert w[0] > value and torch.equal(w[1:], torch.full((3,), value, dtype=dtype))
    assert w[0] == torch.nextafter(torch.tensor(value, dtype=dtype), torch.tensor(float("inf"), dtype=dtype))
    assert torch.equal(model.bias, bias)


def test_middle_module():
    model = Blocks(n_blocks=5)
    assert middle_module(model) is model.blocks[2]
    model = Blocks(n_blocks=2)
    assert middle_module(model) is model.blocks[1]
    seq = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
    assert middle_module(seq) is seq[2]  # the middle of the modules holding parameters
    seq.blocks = nn.ModuleList()  # an empty ``blocks`` falls back as well
    assert middle_module(seq) is seq[2]


# --- process faults ----------------------------------------------------------------------------
def test_sigterm_fault_signals_this_process_once_at_its_step():
    received = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    try:
        plan = FaultPlan("sigterm@step=3,rank=0", 0, 0)
        plan.fire_process_faults(2)
        assert received == []
        plan.fire_process_faults(3)
        plan.fire_process_faults(3)
        FaultPlan("sigterm@step=3,rank=1", 0, 0).fire_process_faults(3)
        assert received == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_sigkill_fault_kills_the_process():
    code = ("from framework.resilience.faults import FaultPlan\n"
            "plan = FaultPlan('sigkill@step=1', 0, 0)\n"
            "plan.fire_process_faults(0)\n"
            "print('step 0 ok', flush=True)\n"
            "plan.fire_process_faults(1)\n"
            "print('survived')\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert proc.stdout == "step 0 ok\n"


# --- the seam: fault injection reaches the run only through its moments ------------------------
def test_the_moments_reach_every_listener_in_order_and_a_fault_at_export_fires_before_the_export(tmp_path,
                                                                                                  monkeypatch):
    from framework import DDPTrainer
    from tests.tiny import tiny
    from framework.train.agreement import Agreement
    from framework.train.events import EventBus, Listener, StepResult

    heard = []

    class Recorder(Listener):
        def step_start(self, step):
            heard.append(("step_start", step))

        def micro_batch(self, step, micro, batch):
            heard.append(("micro_batch", step))
            return batch

        def step_end(self, result, model):
            heard.append(("step_end", result.step, sorted(result.metrics())))

        def evaluation(self, step):
            heard.append(("evaluation", step))

        def save(self, step):
            heard.append(("save", step))

        def export(self, step):
            heard.append(("export", step))

    seam = EventBus(Recorder(), Recorder())
    seam.step_start(0)
    assert seam.micro_batch(0, 0, "batch") == "batch"
    seam.step_end(StepResult(1, 0, Agreement(1.0, False, False, False, False), 0.1, torch.tensor(2.0), 64, [0]), None)
    assert heard == ([("step_start", 0)] * 2 + [("micro_batch", 0)] * 2
                     + [("step_end", 1, ["grad_norm", "loss", "lr", "tokens"])] * 2)

    cfg = tiny(tmp_path, {"train.max_steps": 2, "checkpoint.every_steps": 2,
                          "recovery.fault_inject": "crash@step=2,at=export",
                          "checkpoint.export_dir": str(tmp_path / "export")})
    with pytest.raises(RuntimeError, match=r"fault injection: crash at step 2 \(export\)"):
        DDPTrainer(cfg).train()
    assert list((tmp_path / "ck").glob("step_00000002*.pt"))  # the final save came first
    assert not (tmp_path / "export").exists()
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # a fault fires in the first start (restart 0) only
    summary = DDPTrainer(cfg).train()
    assert summary["steps"] == 2 and (tmp_path / "export").is_dir()


def test_production_code_calls_the_seam_never_the_fault_plan():
    """Only the trainer takes the fault plan (config/checks.py only parses a spec), and only to attach
    it to the run's moments (or detach it, to build it anew after healing in place)."""
    import ast
    framework = ROOT / "framework"
    importers = sorted(str(p.relative_to(framework)) for p in framework.rglob("*.py") if p.name != "faults.py"
                       and any(isinstance(node, ast.ImportFrom) and "FaultPlan" in [a.name for a in node.names]
                               for node in ast.walk(ast.parse(p.read_text()))))
    assert importers == ["trainer.py"]
    tree = ast.parse((framework / "trainer.py").read_text())
    built = [node for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
             and node.func.id == "FaultPlan"]
    assert len(built) == 1  # the one plan, built once as self.faults (the class declares its type)
    # self.faults is read only to attach it to the bus: in the listeners attach() is called with,
    # or as the place another listener goes (attach(..., before=self.faults)).
    reads = [node for node in ast.walk(tree) if isinstance(node, ast.Attribute) and node.attr == "faults"
             and isinstance(node.ctx, ast.Load)]
    allowed = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "attach":
            allowed |= {id(k.value) for k in node.keywords if k.arg == "before"}
        if isinstance(node, ast.For) and any(isinstance(n, ast.Call) and getattr(n.func, "attr", None) in ("attach",
                                                                                                       "detach")
                                             for n in ast.walk(node)):
            allowed |= {id(n) for n in ast.walk(node.iter)}
    assert reads and all(id(node) in allowed for node in reads)
