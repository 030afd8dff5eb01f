"""Error recovery and run health on 2 gloo ranks: rank-consistent NaN skips, OOM recovery, a
DataLoader worker killed mid-backward, the hang watchdog, and the divergence check."""

import json
import re

import pytest
import torch

from framework.data.sampler import ResumableDistributedSampler
from tests.dist_helper import ROOT, args_for, launch, rank_log, summary
from tests.equivalence import max_weight_diff
from tests.workers.run_health import BASE

WORKER = "tests/workers/run_health.py"  # the conftest two_ranks_run fixture launches it

pytestmark = pytest.mark.dist


def case(run, name, rank):
    out = run[1][rank]["cases"][name]
    assert "steps_per_epoch" in out, out.get("traceback")  # the case's harness itself finished
    return out


def logs(run, name, rank):
    return (run[0] / name / "logs" / f"rank_{rank}.log").read_text()


def test_nan_on_one_rank_is_skipped_on_both(two_ranks_run):
    for rank in (0, 1):
        out = case(two_ranks_run, "nan_skip", rank)
        assert "error" not in out, out.get("traceback")
        assert out["summary"]["steps"] == BASE["train.max_steps"]
        assert "step 4: non-finite loss or gradients on some rank; step skipped on all ranks" in logs(
            two_ranks_run, "nan_skip", rank)
    assert (case(two_ranks_run, "nan_skip", 0)["summary"]["model_sha256"]
            == case(two_ranks_run, "nan_skip", 1)["summary"]["model_sha256"])


def test_without_agreement_the_divergence_check_catches_the_split(two_ranks_run):
    for rank in (0, 1):
        out = case(two_ranks_run, "nan_no_agreement", rank)
        assert "FatalError: ranks diverged by step 6" in out["error"], out
    assert "skipped" in logs(two_ranks_run, "nan_no_agreement", 1)
    assert "skipped" not in logs(two_ranks_run, "nan_no_agreement", 0)
    marker = (two_ranks_run[0] / "nan_no_agreement" / "ck" / "FATAL").read_text()
    assert "ranks diverged" in marker


def test_one_ulp_on_one_rank_is_caught_within_the_interval(two_ranks_run):
    for rank in (0, 1):
        out = case(two_ranks_run, "ulp", rank)
        assert "ranks diverged by step 6: parameter 'tok_emb.weight' differs" in out["error"], out


def test_naive_tiled_mlp_desync_is_caught(two_ranks_run):
    for rank in (0, 1):
        out = case(two_ranks_run, "naive_tiled", rank)
        assert "ranks diverged by step 2" in out.get("error", ""), out


def test_oom_in_a_no_sync_micro_step_halves_the_micro_batch_everywhere(two_ranks_run):
    for rank in (0, 1):
        out = case(two_ranks_run, "oom_no_sync", rank)
        assert "error" not in out, out.get("traceback")
        assert out["micro_batch"] == [2, 4]
        assert "micro-batch 4 -> 2, gradient accumulation 2 -> 4" in logs(two_ranks_run, "oom_no_sync", rank)
    got = torch.load(two_ranks_run[0] / "oom_no_sync" / "ck" / "final_model.pt", weights_only=True)
    ref = torch.load(two_ranks_run[0] / "oom_no_sync_reference" / "ck" / "final_model.pt", weights_only=True)
    # Measured: 2.3e-7 without the attention key biases (1.7e-6 with them); see tests/equivalence.py.
    assert max_weight_diff(got, ref) <= 1e-5


def test_killed_loader_worker_is_replaced_and_no_sample_is_lost(two_ranks_run):
    out0 = case(two_ranks_run, "kill_worker", 0)
    assert "error" not in out0, out0.get("traceback")
    assert out0["killed_worker_pids"] and out0["killed_alive"] == [False]
    assert "rebuilding the DataLoader" in logs(two_ranks_run, "kill_worker", 0)
    per_epoch = out0["steps_per_epoch"]
    records = [json.loads(line) for rank in (0, 1) for line in
               (two_ranks_run[0] / "kill_worker" / "logs" / f"samples_rank_{rank}.jsonl").read_text().splitlines()]
    sampler = ResumableDistributedSampler(BASE["dataset_size"], 2, 0, BASE["batch_size"], 1, BASE["train.seed"])
    epoch0 = sorted(i for r in records if r["epoch"] == 0 for i in r["indices"])
    n = min(per_epoch, BASE["train.max_steps"]) * 2 * BASE["batch_size"]
    assert epoch0 == sorted(sampler.permutation(0)[:n].tolist())


def test_oom_in_the_synced_backward_restarts_with_half_the_micro_batch(tmp_path):
    ref_dir, oom_dir = tmp_path / "reference", tmp_path / "oom"
    ref = launch(ROOT / "ddp_training.py", args_for(ref_dir, {"data.gradient_accumulation_steps": 2,
                                                              "train.max_steps": 16, "checkpoint.every_steps": 4,
                                                              "logging.record_samples": False},
                                                    batch_size=2, dropout=0.0), ref_dir)
    assert ref.returncode == 0, ref.output[-3000:]
    run = launch(ROOT / "ddp_training.py", args_for(oom_dir, {"train.max_steps": 16, "checkpoint.every_steps": 4,
                                                              "logging.record_samples": False,
                                                              "recovery.fault_inject": "oom@step=6,rank=1",
                                                              "recovery.oom": True}, dropout=0.0),
                 oom_dir, torchrun_extra=["--max-restarts", "1"])
    assert run.returncode == 0, run.output[-4000:]
    assert "out of memory in the synced forward/backward of step 6" in rank_log(oom_dir, 1)
    # Rank 0, its peer gone from the all-reduce, saved step 6 alone (checkpoint.save_on_peer_loss).
    assert "this rank saved step 6, the last step every rank finished, alone" in rank_log(oom_dir, 0)
    assert "resumed from step 6" in rank_log(oom_dir, 0)
    assert "micro-batch 2 x 2 accumulation steps, recorded after" in rank_log(oom_dir, 0)
    got = torch.load(oom_dir / "ck" / "final_model.pt", weights_only=True)
    want = torch.load(ref_dir / "ck" / "final_model.pt", weights_only=True)
    # Steps 1-6 ran micro-batch 4 x 1 here and 2 x 2 in the reference: the same gradients summed in
    # another order. Measured: 6.5e-7 (15x under the bound) once the attention key biases, pure fp32
    # noise that AdamW amplifies, are left out; with them, 1.01e-5 (CI's failure). One micro-batch
    # counted twice and its neighbour dropped at step 7 (the code broken on purpose) gave 4.0e-3.
    assert max_weight_diff(got, want) <= 1e-5
    assert not run.leftovers


def test_hung_rank_holding_the_gil_is_killed_by_the_watchdog(tmp_path):
    """Rank 0 hangs holding the GIL at step 10: the watchdog (its own thread cannot run Python)
    dumps the stacks and kills it, which ends the attempt (a hang would outlast the launch's 120 s);
    the restart resumes and finishes."""
    run = launch(ROOT / "ddp_training.py", args_for(tmp_path, {"train.max_steps": 24, "logging.record_samples": False,
                                                               "recovery.fault_inject": "hang@step=10,rank=0",
                                                               "recovery.step_timeout_s": 5}),
                 tmp_path, torchrun_extra=["--max-restarts", "1"], timeout=120)
    log0 = rank_log(tmp_path, 0)
    assert "fault injection: hang at step 10 on rank 0" in log0
    log1 = rank_log(tmp_path, 1)
    assert re.search(r"Timeout \(0:00:\d", log0 + log1)  # the watchdog's faulthandler dump
    assert re.search(r'File ".*faults.py", line \d+ in fire_process_faults', log0)  # where rank 0 hung
    assert "straggler rank 0" in log1
    assert run.returncode == 0, run.output[-4000:]
    assert "resumed from step 8" in log0
    assert summary(tmp_path)["steps"] == 24
    assert not run.leftovers


def test_datasets_of_different_lengths_stop_every_rank_with_one_error(two_ranks_run):
    for rank in (0, 1):
        out = case(two_ranks_run, "uneven_datasets", rank)
        assert out["error"].startswith("FatalError: the ranks hold different datasets: train_dataset length ranges "
                                       "from 96 to 128"), out
    assert "different datasets" in (two_ranks_run[0] / "uneven_datasets" / "ck" / "FATAL").read_text()


def test_oom_in_the_preflight_probe_halves_the_micro_batch_on_every_rank(two_ranks_run):
    for rank in (0, 1):
        out = case(two_ranks_run, "oom_in_preflight", rank)
        assert "error" not in out, out.get("traceback")
        assert out["micro_batch"] == [2, 2] and out["summary"]["steps"] == BASE["train.max_steps"]
        assert "out of memory in the DDP preflight probe at micro-batch 4: micro-batch 4 -> 2" in logs(
            two_ranks_run, "oom_in_preflight", rank)


def test_a_final_save_that_fails_on_rank_0_stops_every_rank(two_ranks_run):
    """Otherwise rank 1 exits 0 and, on 2 nodes, the other agent's restart waits for it forever."""
    assert case(two_ranks_run, "final_save_fails_on_rank_0", 0)["error"].startswith("FatalError: checkpoint.dir=")
    assert "File too large" in case(two_ranks_run, "final_save_fails_on_rank_0", 0)["error"]
    assert case(two_ranks_run, "final_save_fails_on_rank_0", 1)["error"] == (
        "FatalError: rank 0 could not write the final checkpoint of step 10; see its log")
