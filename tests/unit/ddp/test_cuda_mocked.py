"""The CUDA paths without a GPU: device selection, DDP's device_ids, autocast and GradScaler,
pinned offload, and the NCCL settings, with CUDA mocked where the code asks torch about it. The
launcher's --cpu and --gpus logic is tested against a fake GPU count in tests/integration/test_launch.py."""

import datetime
import os
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

from framework.ddp import process_group
from framework.model.offload import CpuOffload, OffloadStats
from framework.config import resolve_config
from framework.ddp.policy import Decision, wrap
from framework.train.optim import Precision
from tests.tiny import tiny as tiny_config


@pytest.mark.parametrize("local_rank, cuda, count, expected", [
    (0, True, 2, "cuda:0"), (1, True, 2, "cuda:1"), (3, True, 2, "cuda:1"),  # more ranks than GPUs: wrap around
    (1, False, 0, "cpu"), (0, True, 0, "cpu"),
])
def test_each_local_rank_gets_its_gpu(local_rank, cuda, count, expected):
    assert process_group.select_device(local_rank, cuda, count) == torch.device(expected)


def test_setup_pins_a_single_process_to_its_gpu(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    with mock.patch("torch.cuda.is_available", return_value=True), \
            mock.patch("torch.cuda.device_count", return_value=2), mock.patch("torch.cuda.set_device") as set_device:
        env = process_group.setup("auto", rank=0, world_size=1)
    assert env.device == torch.device("cuda", 1) and not env.distributed
    set_device.assert_called_once_with(torch.device("cuda", 1))


@pytest.mark.parametrize("device, device_ids", [(torch.device("cuda", 1), [1]), (torch.device("cpu"), None)])
def test_ddp_gets_the_rank_s_gpu_as_device_ids(device, device_ids):
    with mock.patch("framework.ddp.policy.DDP") as ddp:
        wrap(torch.nn.Linear(2, 2), device, Decision(False, False, []), bucket_cap_mb=25, gradient_as_bucket_view=False,
             broadcast_buffers=True)
    assert ddp.call_args.kwargs["device_ids"] == device_ids


@pytest.mark.parametrize("use_amp, amp_dtype, device, amp, dtype, scaler", [
    ("auto", "bf16", "cuda", True, torch.bfloat16, False),
    ("auto", "fp16", "cuda", True, torch.float16, True),
    ("auto", "fp16", "cpu", False, torch.float16, False),  # auto: autocast only on CUDA
    ("false", "fp16", "cuda", False, torch.float16, False),
    ("true", "bf16", "cpu", True, torch.bfloat16, False),
])
def test_autocast_dtype_and_grad_scaler(use_amp, amp_dtype, device, amp, dtype, scaler):
    cfg = SimpleNamespace(precision=SimpleNamespace(autocast=use_amp, dtype=amp_dtype))
    with mock.patch("torch.cuda.is_available", return_value=True):
        got = Precision(cfg.precision, device=torch.device(device))
    assert (got.autocast, got.dtype, got.scaler.is_enabled()) == (amp, dtype, scaler)


def test_fp16_without_cuda_is_a_config_error():
    with mock.patch("torch.cuda.is_available", return_value=False), pytest.raises(ValueError, match="needs CUDA"):
        resolve_config({"use_amp": "true", "precision.dtype": "fp16"})


def test_offload_copies_a_cuda_tensor_into_pinned_host_memory_without_blocking():
    stats = OffloadStats()
    hooks = CpuOffload(stats)
    gpu_tensor = mock.MagicMock(device=torch.device("cuda", 0), dtype=torch.float32, layout=torch.strided)
    gpu_tensor.numel.return_value, gpu_tensor.element_size.return_value = 6, 4
    gpu_tensor.size.return_value = torch.Size([2, 3])
    host = mock.MagicMock()
    with mock.patch("torch.empty", return_value=host) as empty:
        device, kept, nbytes = hooks.pack_hook(gpu_tensor)
    assert empty.call_args.kwargs["pin_memory"] is True
    host.copy_.assert_called_once_with(gpu_tensor, non_blocking=True)
    assert (device, kept, nbytes, stats.packed_bytes) == (torch.device("cuda", 0), host, 24, 24)
    hooks.unpack_hook((device, host, nbytes))
    host.to.assert_called_once_with(torch.device("cuda", 0), non_blocking=True)


def test_nccl_gets_torchtitan_s_settings_but_never_overrides_the_user_s(tmp_path):
    got = process_group.nccl_environment(str(tmp_path), {"TORCH_NCCL_TRACE_BUFFER_SIZE": "5"})
    assert got == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
                   "TORCH_FR_DUMP_TEMP_FILE": os.path.join(str(tmp_path), "nccl_trace_rank_")}


def test_nccl_settings_are_in_place_before_the_process_group_starts(monkeypatch, tmp_path):
    for key in ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT",
                "TORCH_FR_DUMP_TEMP_FILE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("MASTER_PORT", "29999")
    seen = {}

    def init_process_group(**kwargs):
        seen.update(kwargs, env={k: os.environ.get(k) for k in ("TORCH_NCCL_ASYNC_ERROR_HANDLING",
                                                                "TORCH_FR_DUMP_TEMP_FILE")})
    with mock.patch.dict(os.environ), mock.patch("torch.cuda.is_available", return_value=True), \
            mock.patch("torch.cuda.device_count", return_value=2), mock.patch("torch.cuda.set_device"), \
            mock.patch("torch.distributed.init_process_group", side_effect=init_process_group), \
            mock.patch("torch.distributed.is_initialized", return_value=False):
        env = process_group.setup("auto", 1800, rank=1, world_size=2, log_dir=str(tmp_path))
    assert env.backend == "nccl" and env.device == torch.device("cuda", 1)
    assert seen["backend"] == "nccl" and seen["device_id"] == torch.device("cuda", 1)
    assert seen["timeout"] == datetime.timedelta(seconds=1800)
    assert seen["env"] == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
                           "TORCH_FR_DUMP_TEMP_FILE": os.path.join(str(tmp_path), "nccl_trace_rank_")}
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in os.environ  # patch.dict undid what setup set


@pytest.mark.parametrize("environ, expected", [
    ({"TORCHELASTIC_RUN_ID": "x", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}, "3"),  # torchrun's default
    ({"TORCHELASTIC_RUN_ID": "x", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}, None),  # the user's
    ({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}, None),  # no torchrun: the user's
])
def test_torchrun_s_async_error_handling_default_is_replaced_but_a_user_s_value_is_kept(tmp_path, environ,
                                                                                       expected):
    assert process_group.nccl_environment(str(tmp_path), environ).get("TORCH_NCCL_ASYNC_ERROR_HANDLING") == expected


@pytest.mark.dist
def test_under_torchrun_a_worker_gets_async_error_handling_3(tmp_path):
    """torchrun's agent itself puts TORCH_NCCL_ASYNC_ERROR_HANDLING=1 into its workers' environment."""
    import subprocess
    from tests.dist_helper import torchrun_cmd, worker_env
    script = tmp_path / "show.py"
    script.write_text("import os, sys\nfrom framework.ddp.process_group import nccl_environment\n"
                      "sys.stdout.write(os.environ['TORCH_NCCL_ASYNC_ERROR_HANDLING'] + ' '\n"
                      "                 + nccl_environment('logs', os.environ)['TORCH_NCCL_ASYNC_ERROR_HANDLING'])\n")
    env = {k: v for k, v in worker_env().items() if k != "TORCH_NCCL_ASYNC_ERROR_HANDLING"}
    out = subprocess.run(torchrun_cmd(script, [], nproc=1), env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "1 3"


@pytest.mark.parametrize("user", [{"TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/mine/fr_"}, {"TORCH_FR_BUFFER_SIZE": "7"}])
def test_the_flight_recorder_s_other_names_count_as_set_by_the_user(tmp_path, user):
    got = process_group.nccl_environment(str(tmp_path), user)
    assert not {"TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"} <= {*got, *user}
    assert not {"TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_FR_BUFFER_SIZE"} <= {*got, *user}
    assert got["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"


@pytest.mark.parametrize("backend, torchrun, group", [("nccl", True, True), ("auto", True, False),
                                                     ("gloo", True, False), ("nccl", False, False)])
def test_one_process_builds_an_nccl_group_only_when_nccl_is_asked_for_under_torchrun(monkeypatch, tmp_path,
                                                                                     backend, torchrun, group):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    if torchrun:
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "gpu_check")
    monkeypatch.setenv("MASTER_PORT", "29999")
    with mock.patch.dict(os.environ), mock.patch("torch.cuda.is_available", return_value=True), \
            mock.patch("torch.cuda.device_count", return_value=1), mock.patch("torch.cuda.set_device"), \
            mock.patch("torch.distributed.init_process_group") as init, \
            mock.patch("torch.distributed.is_initialized", return_value=False):
        env = process_group.setup(backend, rank=0, world_size=1, log_dir=str(tmp_path))
        nccl_env = os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")
    assert env.distributed is group and init.called is group
    if group:
        assert init.call_args.kwargs["backend"] == "nccl" and init.call_args.kwargs["world_size"] == 1
        assert nccl_env == "3"


def test_the_steady_timeout_replaces_the_init_timeout_once(monkeypatch):
    monkeypatch.setattr(process_group, "_steady", False)
    with mock.patch("torch.distributed.is_initialized", return_value=True), \
            mock.patch("torch.distributed.distributed_c10d._set_pg_timeout") as set_timeout:
        process_group.set_steady_timeout(1800, 300)
        process_group.set_steady_timeout(1800, 300)
    set_timeout.assert_called_once_with(datetime.timedelta(seconds=300), None)


def test_a_one_rank_group_trains_through_ddp_and_switches_to_the_steady_timeout(tmp_path):
    """What backend=nccl at one process builds, on gloo: DDP over a 1-rank group, the init timeout
    replaced by timeout_s after the first step."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from framework.trainer import DDPTrainer
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        trainer = DDPTrainer(tiny_config(tmp_path, {"train.max_steps": 4, "eval.interval": 0,
                                                    "checkpoint.export_dir": "none", "checkpoint.resume": "none",
                                                    "ddp.init_timeout_s": 900, "ddp.timeout_s": 60}, dataset_size=64))
        assert trainer.env.distributed and isinstance(trainer.model, DistributedDataParallel)
        assert trainer.train()["steps"] == 4
    finally:
        dist.destroy_process_group()
    assert "collective timeout after the first step: 60 s (init timeout 900 s)" in trainer.log_path.read_text()
