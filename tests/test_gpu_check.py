"""bench/gpu_check.py on CPU: the one line without a GPU, the rows it plans, a row whose config
keys are missing, a failing row, and two real rows on CPU: the bf16 training run (through the
same torchrun launch and summary it uses on a GPU) and the throughput bench."""

import importlib.util
import os
import subprocess
import sys

import pytest

from tests.dist_helper import ROOT


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "bench" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    yield module
    del sys.modules["gpu_check"]


def test_without_a_gpu_it_says_so_in_one_line_and_exits_0():
    out = subprocess.run([sys.executable, "bench/gpu_check.py"], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [out.stdout.strip()] and "no CUDA GPU visible" in out.stdout
    assert out.stderr == ""


def test_it_plans_every_row_and_the_second_nccl_row_only_with_two_gpus(gpu_check):
    assert list(gpu_check.checks(1)) == ["nccl_1", "bf16", "fp16", "scaler_overflow", "oom_halving", "memory",
                                         "comm_hook", "compile", "throughput"]
    assert "nccl_2" in gpu_check.checks(2)
    assert gpu_check.missing_keys(tuple(k for row in gpu_check.checks(2).values() for k in row.keys)) == []
    assert gpu_check.loss_falls({"first_train_loss": 5.5, "final_train_loss": 2.0, "tokens_per_sec": 1})["ok"]
    assert not gpu_check.loss_falls({"first_train_loss": 5.5, "final_train_loss": 5.3, "tokens_per_sec": 1})["ok"]


def test_a_row_whose_config_key_this_version_lacks_says_so(gpu_check, tmp_path, capsys):
    def never_runs(tmp):
        raise AssertionError("a row without its config keys must not run")
    result = gpu_check.run_row("future", gpu_check.Row(never_runs, ("compile", "no_such_key")), tmp_path)
    assert result["ok"] is None
    assert result["detail"] == "not available in this version (no config key no_such_key)"
    assert capsys.readouterr().out.split()[:2] == ["future", "n/a"]


def test_a_failing_row_is_a_failed_row_and_the_others_still_run(gpu_check, tmp_path, capsys):
    def broken(tmp):
        raise RuntimeError("exit 1: boom")
    result = gpu_check.run_row("broken", gpu_check.Row(broken), tmp_path)
    assert result["ok"] is False and result["detail"] == "RuntimeError: exit 1: boom"
    assert capsys.readouterr().out.split()[:2] == ["broken", "FAILED"]


def test_the_bf16_row_trains_on_cpu_through_torchrun(gpu_check, tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check, "TINY", {**gpu_check.TINY, "hidden_size": 32, "num_layers": 1, "num_heads": 2,
                                            "seq_len": 32, "dataset_size": 512, "batch_size": 8, "max_steps": 40})
    row = gpu_check.check_amp(tmp_path, "bf16")
    assert row["ok"], row["detail"]
    assert "amp=on (bf16)" in (tmp_path / "bf16" / "logs" / "rank_0.log").read_text()


def test_the_throughput_row_runs_the_bench_and_reads_its_json(gpu_check, tmp_path):
    row = gpu_check.check_throughput(tmp_path)
    assert row["ok"] and row["detail"].startswith("a/b = "), row["detail"]
    assert row["result"]["variants_run"] == "ab"
