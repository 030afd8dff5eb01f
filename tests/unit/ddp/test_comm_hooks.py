"""DDP communication hooks on 2 gloo ranks (one torchrun launch for every case), PowerSGD's
checkpointed state, and the hook settings' checks."""

import json
import subprocess
import sys

import pytest
import torch

import ddp_training
from framework.ddp.comm_hooks import capture_powersgd, restore_powersgd
from tests.dist_helper import ROOT, case, cli_args, launch
from tests.workers.comm_hooks import POWERSGD, RESUME_AT, STATIC_ACCUM, TRAIN_BASE

WORKER = "tests/workers/comm_hooks.py"
WORKER_TIMEOUT = 420  # seconds, for the conftest two_ranks fixture
# fp16 keeps 11 significant bits: each rank's gradient / 2 and their sum are rounded once each,
# so an entry is off by at most ~2^-11 of the two ranks' magnitudes; per tensor, relative to its
# largest entry, 2^-10 bounds it (a missing or doubled average would be off by 0.5 or more).
FP16_TOL = 2 ** -10
# bf16 keeps 8 significant bits: the same argument gives 2^-7.
BF16_TOL = 2 ** -7
# PowerSGD (rank 8: 8x fewer values for a 128 x 128 gradient; plain all-reduce for 4 steps) after
# 30 steps: its train loss within this of plain all-reduce's (measured: 1.786 against 1.752, from
# 3.510), while plain all-reduce's own loss falls by far more. Rank 2 lags by 0.29 here, rank 4 by 0.13.
POWERSGD_LOSS_MARGIN = 0.1


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize(("name", "tol"), [("fp16", FP16_TOL), ("bf16", BF16_TOL)])
@pytest.mark.dist
def test_compressed_gradients_within_tolerance_of_fp32(two_ranks, rank, name, tol):
    out = case(two_ranks, rank, name)
    assert out["max_rel_diff"] <= tol, out
    assert out["max_abs_diff"] > 0, f"{name} gradients are bit-identical to fp32 ones: the hook did not run"
    assert out["logged"] == [f"framework.ddp.comm_hooks: DDP communication hook: {name} (gradients all-reduced in "
                             f"{name}, averaged, then cast back)"]


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.dist
def test_torch_bf16_hook_fails_on_gloo_where_the_frameworks_runs(two_ranks, rank):
    """Reproduced with plain torch 2.13: its bf16 hook refuses gloo, which sums bf16 fine."""
    got = two_ranks[rank]["cases"]["torch_bf16_on_gloo"]
    assert got.get("error", "").startswith("TypeError: BF16 all reduce communication hook required CUDA"), got
    assert case(two_ranks, rank, "bf16")["max_rel_diff"] <= BF16_TOL


@pytest.mark.dist
def test_powersgd_loss_within_margin_of_plain_all_reduce(two_ranks):
    none, psgd = case(two_ranks, 0, "none"), case(two_ranks, 0, "powersgd")
    n, p = none["summary"], psgd["summary"]
    assert n["steps"] == p["steps"] == TRAIN_BASE["train.max_steps"]
    assert abs(p["final_train_loss"] - n["final_train_loss"]) <= POWERSGD_LOSS_MARGIN, (n, p)
    assert n["first_train_loss"] - n["final_train_loss"] > 10 * POWERSGD_LOSS_MARGIN, n
    # PowerSGD really compressed: it ran every step, on both rebuilt buckets, and changed the result.
    assert psgd["powersgd_iter"] == TRAIN_BASE["train.max_steps"]
    assert psgd["buckets_with_state"] == [0, 1]
    assert p["model_sha256"] != n["model_sha256"]
    assert case(two_ranks, 1, "powersgd")["summary"]["model_sha256"] == p["model_sha256"]
    assert none["logged"] == ["framework.ddp.comm_hooks: DDP communication hook: none (fp32 all-reduce)"]
    assert psgd["logged"] == [f"framework.ddp.comm_hooks: DDP communication hook: powersgd (rank 8, error feedback, "
                              f"warm start; plain all-reduce until iteration"
                              f" {POWERSGD['ddp.powersgd_start_iter']}, now at 0)"]


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.dist
def test_powersgd_resume_is_exact(two_ranks, rank):
    uninterrupted, resumed = case(two_ranks, rank, "powersgd"), case(two_ranks, rank, "resumed")
    assert resumed["logged"][0].endswith(f"now at {RESUME_AT})")
    assert resumed["summary"]["steps"] == uninterrupted["summary"]["steps"]
    assert resumed["summary"]["model_sha256"] == uninterrupted["summary"]["model_sha256"]
    # Without its state (error feedback, warm start, iteration) the same resume ends elsewhere.
    blank = case(two_ranks, rank, "resumed_without_state")
    assert blank["logged"][0].endswith("now at 0)")
    assert blank["summary"]["model_sha256"] != uninterrupted["summary"]["model_sha256"]


@pytest.mark.dist
def test_powersgd_killed_and_restarted_by_torchrun_ends_as_uninterrupted(two_ranks, tmp_path):
    cfg = {**TRAIN_BASE, **POWERSGD, "logging.dir": str(tmp_path / "logs"), "checkpoint.dir": str(tmp_path / "ck"),
           "recovery.fault_inject": "sigkill@step=15,rank=1"}
    run = launch(ROOT / "ddp_training.py", cli_args(cfg), tmp_path, nproc=2, timeout=300,
                 torchrun_extra=["--max-restarts", "1"])
    assert run.returncode == 0, run.output[-4000:]
    log = (tmp_path / "logs" / "rank_0.log").read_text()
    assert f"resumed from step {RESUME_AT}" in log
    assert f"plain all-reduce until iteration {POWERSGD['ddp.powersgd_start_iter']}, now at {RESUME_AT})" in log
    summary = json.loads((tmp_path / "logs" / "summary.json").read_text())
    assert summary["restarts"] == 1 and summary["steps"] == TRAIN_BASE["train.max_steps"]
    assert summary["model_sha256"] == case(two_ranks, 0, "powersgd")["summary"]["model_sha256"]
    assert not run.leftovers


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.dist
def test_powersgd_with_static_graph_and_accumulation_resumes_exactly(two_ranks, rank):
    uninterrupted, resumed = case(two_ranks, rank, "static_accum"), case(two_ranks, rank, "static_accum_resumed")
    assert uninterrupted["powersgd_iter"] == STATIC_ACCUM["train.max_steps"]  # synced backwards only: one per step
    assert resumed["logged"][0].endswith(f"now at {STATIC_ACCUM['checkpoint.every_steps']})")
    assert resumed["summary"]["model_sha256"] == uninterrupted["summary"]["model_sha256"]
    assert uninterrupted["static_graph"] and resumed["static_graph"]


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.dist
def test_powersgd_survives_a_non_finite_step(two_ranks, rank):
    out = case(two_ranks, rank, "nonfinite")
    assert out["nan_fired"] == (1 if rank == 1 else 0)
    assert out["summary"]["skipped_steps"] == 1 and out["summary"]["steps"] == 16
    assert torch.isfinite(torch.tensor(out["summary"]["final_train_loss"]))
    # Without the reset, the NaN stays in the error feedback and every later step is skipped.
    unguarded = two_ranks[rank]["cases"]["nonfinite_unguarded"]
    assert "non-finite loss or gradients at steps [8, 9, 10, 11]" in unguarded.get("error", ""), unguarded


def test_powersgd_state_round_trips_through_the_safe_loader(tmp_path):
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

    state = PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=2, random_seed=3)
    state.iter, state.error_dict, state.q_memory_dict = 7, {0: torch.randn(5), 1: torch.randn(3)}, {0: torch.randn(4)}
    state.rng.randint(1000)
    state.rng.standard_normal()  # leaves a cached gaussian in the state
    torch.save(capture_powersgd(state), tmp_path / "s.pt")
    back = PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=2, random_seed=0)
    restore_powersgd(back, torch.load(tmp_path / "s.pt", weights_only=True), torch.device("cpu"))
    assert back.iter == 7 and back.error_dict.keys() == {0, 1} and back.p_memory_dict == {}
    assert all(torch.equal(back.error_dict[i], state.error_dict[i]) for i in (0, 1))
    assert torch.equal(back.q_memory_dict[0], state.q_memory_dict[0])
    assert [back.rng.randint(10**9) for _ in range(3)] == [state.rng.randint(10**9) for _ in range(3)]
    assert back.rng.standard_normal() == state.rng.standard_normal()
    # Another rank: the error feedback and the counter stay, the rank-sized warm start does not.
    other = PowerSGDState(None, matrix_approximation_rank=4, start_powerSGD_iter=2)
    restore_powersgd(other, capture_powersgd(state), torch.device("cpu"))
    assert other.iter == 7 and other.error_dict.keys() == {0, 1} and other.q_memory_dict == {}


def test_bf16_with_gloo_passes_check_config_without_torch(tmp_path):
    out = subprocess.run([sys.executable, "-X", "importtime", str(ROOT / "ddp_training.py"), "--check-config",
                          "--ddp.comm_hook", "bf16", "--ddp.backend", "gloo", "--logging.dir", str(tmp_path)],
                         capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    said = [line for line in out.stderr.splitlines() if not line.startswith("import time:")]
    assert said == ["configuration is valid"]
    imported = [line.split("|")[-1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")]
    assert not [m for m in imported if m == "torch" or m.startswith("torch.")]


@pytest.mark.parametrize(("argv", "code", "needle"), [
    (["--ddp.comm_hook", "bf16"], 0, "configuration is valid"),
    (["--ddp.comm_hook", "fp16"], 0, "configuration is valid"),
    (["--ddp.comm_hook", "powersgd", "--ddp.powersgd_start_iter", "1"], 2, "ddp.powersgd_start_iter=1: must be >= 2"),
    (["--ddp.comm_hook", "powersgd", "--ddp.powersgd_rank", "0"], 2, "ddp.powersgd_rank=0: must be >= 1"),
    (["--ddp.comm_hook", "int8"], 2, "command line: ddp.comm_hook='int8': allowed: none, fp16, bf16, powersgd"),
])
def test_comm_hook_settings_checked(argv, code, needle, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("framework.config.checks._cuda_available", lambda: False)
    try:
        got = ddp_training.main(["--check-config", "--logging.dir", str(tmp_path), *argv])
    except SystemExit as exc:
        got = exc.code
    err = capsys.readouterr().err
    assert got == code and err.strip().splitlines() == [f"error: {needle}" if code else needle], err


def test_powersgd_state_loaded_after_registration_applies_at_once():
    """An in-process rollback (spike_guard) restores a checkpoint while the hook is running."""
    from types import SimpleNamespace

    from framework.ddp.comm_hooks import CommHook
    from framework.config import resolve_config

    cfg = resolve_config({"ddp.comm_hook": "powersgd", "ddp.powersgd_rank": 2, "ddp.powersgd_start_iter": 3})
    hook = CommHook(cfg.ddp, env=SimpleNamespace(rank=0, world_size=1, distributed=False, device=torch.device("cpu")),
                    seed=cfg.train.seed)
    registered = []
    hook.register(SimpleNamespace(register_comm_hook=lambda state, fn: registered.append((state, fn))))
    assert registered[0][0] is hook.state and hook.state.iter == 0
    saved = hook.state_dict()
    hook.state.iter, hook.state.error_dict = 9, {0: torch.ones(3)}
    later = hook.state_dict()
    hook.load_state_dict(saved)
    assert hook.state is registered[0][0] and hook.state.iter == 0 and hook.state.error_dict == {}
    hook.load_state_dict(later)
    assert hook.state.iter == 9 and torch.equal(hook.state.error_dict[0], torch.ones(3))
    hook.load_state_dict({})  # saved with another hook: PowerSGD starts afresh
    assert hook.state.iter == 0 and hook.state.error_dict == {}


def test_one_process_ignores_the_hook_and_says_so(tmp_path):
    from framework.trainer import DDPTrainer
    from tests.workers.comm_hooks import GRAD_BASE

    cfg = {**GRAD_BASE, **POWERSGD, "train.max_steps": 2, "logging.dir": str(tmp_path / "logs"),
           "checkpoint.dir": str(tmp_path / "ck")}
    summary = DDPTrainer(cfg, rank=0, world_size=1).train()
    assert summary["steps"] == 2
    assert "ddp.comm_hook=powersgd: not used by one process" in (tmp_path / "logs" / "rank_0.log").read_text()
    assert torch.load(tmp_path / "ck" / "step_00000002.pt", weights_only=True)["comm_hook"] == {}
