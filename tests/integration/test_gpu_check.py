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


@pytest.mark.dist
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


@pytest.mark.dist
def test_the_bf16_row_trains_on_cpu_through_torchrun(gpu_check, tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check, "TINY", {**gpu_check.TINY, "hidden_size": 32, "num_layers": 1, "num_heads": 2,
                                            "seq_len": 32, "dataset_size": 512, "batch_size": 8, "train.max_steps": 40})
    row = gpu_check.check_amp(tmp_path, "bf16")
    assert row["ok"], row["detail"]
    assert "amp=on (bf16)" in (tmp_path / "bf16" / "logs" / "rank_0.log").read_text()


@pytest.mark.dist
def test_the_throughput_row_runs_the_bench_and_reads_its_json(gpu_check, tmp_path):
    row = gpu_check.check_throughput(tmp_path)
    assert row["ok"] and row["detail"].startswith("a/b = "), row["detail"]
    assert row["result"]["variants_run"] == "ab"


def test_the_oom_row_limits_memory_to_8_samples_from_two_probes(gpu_check, tmp_path, monkeypatch):
    """The row's arithmetic with CUDA and the trainer faked: probes at 2 and 4 samples (100 MB
    fixed, 10 MB a sample) give a limit that holds 8 samples and not 16; the row passes only when
    the trainer ends with a smaller micro-batch times accumulation = 32."""
    import torch
    from framework import trainer as trainer_module
    from unittest import mock
    made, fraction = [], []

    class FakeTrainer:
        def __init__(self, cfg):
            made.append(cfg)
            self.sampler = mock.Mock(batch_size=cfg["batch_size"], accumulation=1)

        def train(self):
            if self.sampler.batch_size == 32:
                self.sampler.batch_size, self.sampler.accumulation = 8, 4
            return {"steps": 3}
    monkeypatch.setattr(trainer_module, "DDPTrainer", FakeTrainer)
    mb = 2**20
    peak = mock.Mock(side_effect=lambda: (100 + 10 * made[-1]["batch_size"]) * mb)
    with mock.patch.multiple(torch.cuda, empty_cache=mock.DEFAULT, reset_peak_memory_stats=mock.DEFAULT,
                             memory_allocated=mock.Mock(return_value=0), max_memory_allocated=peak,
                             memory_reserved=mock.Mock(return_value=0),
                             get_device_properties=mock.Mock(return_value=mock.Mock(total_memory=1000 * mb)),
                             set_per_process_memory_fraction=mock.Mock(side_effect=fraction.append)):
        row = gpu_check.check_oom_halving(tmp_path)
    assert [cfg["batch_size"] for cfg in made] == [2, 4, 32] and made[2]["recovery.oom"] == "true"
    assert 180 * mb < fraction[0] * 1000 * mb < 260 * mb and fraction[1] == 1.0  # 8 samples fit, 16 do not
    assert row["ok"] and "32 -> 8 x 4" in row["detail"], row["detail"]


def test_with_a_gpu_faked_it_prints_a_row_each_and_writes_the_json(gpu_check, tmp_path, monkeypatch, capsys):
    """main()'s GPU path with CUDA faked and the rows replaced: every row in the table and the
    JSON (a missing key's row as n/a), the total time, and exit 1 only because a row failed."""
    import json
    import torch
    from unittest import mock
    rows = {"good": gpu_check.Row(lambda tmp: {"ok": True, "detail": "fine"}),
            "future": gpu_check.Row(lambda tmp: {"ok": True, "detail": "never"}, ("no_such_key",)),
            "bad": gpu_check.Row(lambda tmp: {"ok": False, "detail": "loss 5.5 -> 5.4"})}
    monkeypatch.setattr(gpu_check, "checks", lambda gpus: dict(rows))
    monkeypatch.setattr(gpu_check, "RESULTS", tmp_path / "gpu_check.json")
    monkeypatch.setattr(sys, "argv", ["gpu_check.py"])
    with mock.patch.multiple(torch.cuda, is_available=mock.Mock(return_value=True),
                             device_count=mock.Mock(return_value=1), get_device_name=mock.Mock(return_value="Fake")):
        assert gpu_check.main() == 1
        lines = capsys.readouterr().out.splitlines()
        del rows["bad"]
        monkeypatch.setattr(sys, "argv", ["gpu_check.py", "--only", "good,future"])
        assert gpu_check.main() == 0
    assert [line.split()[:2] for line in lines[:3]] == [["good", "ok"], ["future", "n/a"], ["bad", "FAILED"]]
    assert lines[3].startswith("total ") and lines[3].endswith(f"wrote {tmp_path / 'gpu_check.json'}")
    out = json.loads((tmp_path / "gpu_check.json").read_text())
    assert out["device"] == "Fake" and list(out["checks"]) == ["good", "future"] and out["total_seconds"] >= 0
    assert out["checks"]["future"]["ok"] is None and "no_such_key" in out["checks"]["future"]["detail"]


@pytest.mark.dist
def test_the_memory_row_runs_the_memory_bench_and_reads_every_mode(gpu_check, tmp_path):
    """The row's command and its reading of bench/memory.py's JSON, on CPU (--quick): every memory
    mode is read, and with no torch.cuda peak to report the row fails and says which are missing."""
    # every mode, on shorter sequences and the fewest steps the bench takes
    row = gpu_check.check_memory(tmp_path, "--quick", "--seq-len", "64", "--steps", "2")
    assert set(row["peaks_bytes"]) == {"off", "non_reentrant", "reentrant", "offload", "tiled8", "nr+tiled8"}
    assert row["ok"] is False and row["detail"].startswith("no torch.cuda peak recorded for off, non_reentrant")


@pytest.mark.parametrize("non_reentrant_mib, ok", [(40, True), (100, False)])
def test_the_memory_row_passes_only_when_checkpointing_lowers_the_cuda_peak(gpu_check, tmp_path, monkeypatch,
                                                                           non_reentrant_mib, ok):
    import json
    import subprocess as sp
    from pathlib import Path
    mib = {"off": 100, "non_reentrant": non_reentrant_mib, "offload": 30, "tiled8": 70}

    def fake_bench(*args, timeout):
        out = args[args.index("--out") + 1]
        modes = [{"mode": m, "cuda_peak_bytes": v * 2**20} for m, v in mib.items()]
        Path(out).write_text(json.dumps({"modes": modes}))
        return sp.CompletedProcess(args, 0, "", "")
    monkeypatch.setattr(gpu_check, "run_script", fake_bench)
    row = gpu_check.check_memory(tmp_path)
    assert row["ok"] is ok and row["detail"] == f"off 100 MiB, non_reentrant {non_reentrant_mib} MiB, " \
                                                "offload 30 MiB, tiled8 70 MiB"


@pytest.mark.slow
def test_the_scaler_overflow_row_on_cpu_with_an_enabled_grad_scaler(gpu_check, tmp_path, monkeypatch):
    """The row itself, in process on CPU: fp16 autocast cannot run here, so the trainer gets fp32
    with an enabled CPU GradScaler (what fp16 gives it). The injected NaN gradient at step 20 is
    the scaler's to skip: every step done, none counted as non-finite, the saved scale lowered."""
    import torch
    from framework import trainer as trainer_module
    class Fp16OnCpu(trainer_module.Precision):
        def __init__(self, section, *, device):
            super().__init__(section, device=device)
            self.autocast, self.dtype, self.scaler = False, torch.float32, torch.amp.GradScaler("cpu", enabled=True)

    monkeypatch.setattr(trainer_module, "Precision", Fp16OnCpu)
    small = {**gpu_check.TINY, "hidden_size": 32, "num_layers": 1, "num_heads": 2, "seq_len": 32,
             "dataset_size": 512, "batch_size": 8, "train.max_steps": 30, "save_interval": 10}

    def in_process(tmp, name, overrides=None, /, nproc=1, **keys):
        # fp16 autocast cannot run here: the patched Precision stands for it
        overrides = {k: v for k, v in {**(overrides or {}), **keys}.items() if k not in ("use_amp", "precision.dtype")}
        run = tmp / name
        summary = trainer_module.DDPTrainer({**small, **overrides, "logging.dir": str(run / "logs"),
                                             "checkpoint.dir": str(run / "ck")}).train()
        return {**summary, "log": (run / "logs" / "rank_0.log").read_text()}
    monkeypatch.setattr(gpu_check, "TINY", small)
    monkeypatch.setattr(gpu_check, "train", in_process)
    row = gpu_check.check_scaler_overflow(tmp_path)
    assert row["ok"], row["detail"]
    assert row["detail"].startswith("skipped_steps 0, 30 steps, final GradScaler scale 32768")


def test_the_compile_row_asks_for_one_process_per_gpu_and_reads_the_paired_ratio(gpu_check, tmp_path, monkeypatch):
    import json
    import subprocess as sp
    from pathlib import Path
    commands = []

    def fake_bench(*args, timeout):
        commands.append(args)
        rows = [{"variant": "eager 1 process", "median_tokens_per_sec": 1000.0, "vs_eager_paired": 1.0,
                 "median_first_step_s": 1.0},
                {"variant": "compiled 1 process", "median_tokens_per_sec": 1300.0, "vs_eager_paired": 1.3,
                 "median_first_step_s": 42.0}]
        Path(args[args.index("--out") + 1]).write_text(json.dumps({"variants": rows}))
        return sp.CompletedProcess(args, 0, "", "")
    monkeypatch.setattr(gpu_check, "run_script", fake_bench)
    row = gpu_check.check_compile(tmp_path, gpus=1)
    assert commands[0][:3] == ("bench/throughput.py", "--compile", "--cold-cache")
    assert commands[0][commands[0].index("--max-procs") + 1] == "1"
    assert row["ok"] and row["detail"] == "compiled/eager 1.300 at 1 process after 42 s of compilation"
    gpu_check.check_compile(tmp_path, gpus=4)
    assert commands[1][commands[1].index("--max-procs") + 1] == "2"
