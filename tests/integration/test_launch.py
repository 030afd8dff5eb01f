"""launch_training.sh end to end: real torchrun, 2 gloo processes.

Tests using the ``shim`` fixture point $PYTHON at a stand-in that records the environment,
arguments and working directory torchrun would get (and exits 0 instead of starting it), can fake
the GPU count the launcher probes, and runs the real interpreter for everything else.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "launch_training.sh"

pytestmark = pytest.mark.dist


LAUNCHER_ENV = ("DDP_", "CUDA_VISIBLE_DEVICES", "GLOO_SOCKET_IFNAME", "MASTER_ADDR", "PYTHON")

SHIM = f"""#!{sys.executable}
import json, os, sys
args = sys.argv[1:]
if args[:2] == ["-m", "torch.distributed.run"]:
    with open(os.environ["SHIM_RECORD"], "w") as f:
        json.dump({{"argv": args[2:], "cwd": os.getcwd(), "env": dict(os.environ)}}, f)
    if "SHIM_MARKER" in os.environ:  # a marker the workers would have written, then torchrun's exit
        with open(os.environ["SHIM_MARKER"], "w") as f:
            f.write("a torchrun agent died; the run reached step 7")
    sys.exit(int(os.environ.get("SHIM_EXIT", "0")))
if "SHIM_GPUS" in os.environ and args[:1] == ["-c"] and "torch.cuda.device_count()" in args[1]:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")  # as CUDA reads it: unset = every GPU
    print(int(os.environ["SHIM_GPUS"]) if visible is None else len([v for v in visible.split(",") if v]))
    sys.exit(0)
os.execv(sys.executable, [sys.executable, *args])
"""


def run_script(args, timeout=120, cwd=ROOT, env=None, **kw):
    base = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHER_ENV)}
    return subprocess.run([str(SCRIPT), *args], cwd=cwd, env={**base, **(env or {})}, capture_output=True,
                          text=True, timeout=timeout, **kw)


@pytest.fixture
def shim(tmp_path):
    """run(args, gpus=None, **env) -> (process, what torchrun would have got, or None)."""
    path = tmp_path / "shim" / "python"
    path.parent.mkdir()
    path.write_text(SHIM)
    path.chmod(0o755)
    record = tmp_path / "shim" / "torchrun.json"

    def run(args, gpus=None, cwd=ROOT, **env):
        env = {"PYTHON": str(path), "SHIM_RECORD": str(record), **env}
        record.unlink(missing_ok=True)  # an earlier call's
        if gpus is not None:
            env["SHIM_GPUS"] = str(gpus)
        proc = run_script(args, timeout=60, cwd=cwd, env=env)
        return proc, json.loads(record.read_text()) if record.exists() else None
    return run


def option(argv, name):
    return argv[argv.index(name) + 1]


def leftovers(marker: str) -> list[int]:
    return [p.pid for p in psutil.process_iter(["cmdline"])
            if p.info["cmdline"] and any(marker in part for part in p.info["cmdline"])]


@pytest.mark.requires(gpus=2)
def test_two_gpus_train_over_nccl_with_the_same_model_on_each_rank(tmp_path):
    """--gpus 0,1: one process per GPU over NCCL, the --test run to its end, and the ranks'
    consistency check (identical parameters) passes."""
    proc = run_script(["--gpus", "0,1", "--test", "-l", str(tmp_path / "logs"), "-c", str(tmp_path / "ck"), "--",
                       "--recovery.consistency_check_interval", "10"], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "logs" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["first_train_loss"] > summary["final_train_loss"]
    log0 = (tmp_path / "logs" / "rank_0.log").read_text()
    assert "process group up: backend=nccl rank=0/2 local_rank=0 device=cuda:0" in log0
    assert not leftovers(str(tmp_path))


def test_cpu_test_mode_trains_in_under_30s(tmp_path):
    start = time.monotonic()
    proc = run_script(["--cpu", "--test", "-l", str(tmp_path / "logs"), "-c", str(tmp_path / "ck")])
    elapsed = time.monotonic() - start
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert elapsed <= 30, elapsed
    summary = json.loads((tmp_path / "logs" / "summary.json").read_text())
    assert summary["world_size"] == 2
    assert summary["first_train_loss"] - summary["final_train_loss"] >= 1.0, summary
    assert (tmp_path / "ck" / "final_model.pt").is_file()
    assert {p.name for p in (tmp_path / "logs").glob("rank_*.log")} == {"rank_0.log", "rank_1.log"}
    assert "[rank 1]" not in proc.stderr  # the console shows rank 0 only
    assert "[rank 1]" in (tmp_path / "logs" / "rank_1.log").read_text()
    assert not leftovers(str(tmp_path))
    # The first screen is read by a person: no line over 400 characters; the whole configuration
    # and summary are in config.json and summary.json (and the rank's log file).
    screen = (proc.stdout + proc.stderr).splitlines()
    assert max(map(len, screen)) <= 400, max(screen, key=len)
    finished = next(line for line in screen if "framework.trainer: finished: step 60," in line)
    assert f"model_sha256 {summary['model_sha256'][:12]}" in finished and "summary.json" in finished
    assert re.search(r" and \d+ more \(saved as ", next(line for line in screen if "metrics: config: " in line))
    assert json.loads((tmp_path / "logs" / "config.json").read_text())["train"]["max_steps"] == 60


def test_bad_config_exits_2_before_torchrun(tmp_path):
    proc = run_script(["--cpu", "--test", "-l", str(tmp_path), "--", "--hiden-size", "3", "--dropout", "2"])
    assert proc.returncode == 2
    assert "did you mean 'model.hidden_size'" in proc.stderr and "dropout=2.0: must be <= 0.999" in proc.stderr
    assert "Traceback" not in proc.stderr and "torch.distributed" not in proc.stderr
    assert not (tmp_path / "rank_0.log").exists()


@pytest.mark.parametrize("args, needle", [
    (["--bogus"], "unknown option '--bogus'"),
    (["--gpus", "0;rm"], "--gpus '0;rm': must be a comma-separated list"),
    (["--cpu", "--nproc", "two"], "--nproc 'two': must be a positive integer"),
    (["--cpu", "--gpus", "0"], "--gpus and --cpu exclude each other"),
    (["--batch-size"], "--batch-size needs a value"),
    (["--cpu", "--heal", "--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:29500", "--rdzv-id", "x"],
     "--heal --nnodes 2 needs --node-rank R, R from 0 to 1 (node 0 hosts the run's store)"),
    (["--cpu", "--heal", "--nnodes", "1:2", "--node-rank", "0", "--rdzv-endpoint", "127.0.0.1:29500", "--rdzv-id",
      "x"], "--heal --nnodes 1:2: a fixed node count"),
    (["--cpu", "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "127.0.0.1:29500", "--rdzv-id", "x"],
     "--node-rank 1: only with --heal on several nodes"),
])
def test_bad_launcher_options_exit_2(args, needle):
    proc = run_script(args, timeout=30)
    assert proc.returncode == 2
    assert needle in proc.stderr


def test_help_lists_options():
    proc = run_script(["--help"], timeout=30)
    assert proc.returncode == 0
    for flag in ("--gpus", "--cpu", "--nproc", "--batch-size", "--epochs", "--log-dir", "--checkpoint-dir",
                 "--config", "--data", "--test", "--debug"):
        assert flag in proc.stdout


def test_shellcheck_passes():
    shellcheck = shutil.which("shellcheck")
    assert shellcheck, "shellcheck is installed by requirements-dev.txt"
    proc = subprocess.run([shellcheck, str(SCRIPT), str(ROOT / "examples" / "slurm" / "train.sbatch")],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


# --debug with the modes' extremes: none, and reentrant checkpointing (DDP's "marked ready twice"
# under find_unused); every mode, tiled or not, on 2 ranks: tests/unit/model/test_memory_modes.py.
@pytest.mark.parametrize("mode", ["off", "reentrant"])
def test_debug_runs_with_the_memory_modes(tmp_path, mode):
    proc = run_script(["--cpu", "--test", "--debug", "-l", str(tmp_path / "logs"), "-c", str(tmp_path / "ck"),
                       "--", "--memory.activation_checkpointing", mode, "--memory.tiled_mlp_chunks", "4",
                       "--train.max_steps", "6"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = (tmp_path / "logs" / "rank_0.log").read_text()
    assert "DEBUG framework.observability.metrics: step 6: loss" in log
    assert "TORCH_DISTRIBUTED_DEBUG=INFO" in log  # DETAIL segfaults on gloo in torch 2.13
    assert json.loads((tmp_path / "logs" / "summary.json").read_text())["steps"] == 6
    assert not leftovers(str(tmp_path))


@pytest.mark.parametrize("args, gpus", [(["--cpu"], 2), ([], 0)], ids=["explicit", "no-gpu"])
def test_cpu_hides_gpus_from_workers(shim, args, gpus):
    proc, torchrun = shim(args, gpus=gpus)
    assert proc.returncode == 0, proc.stderr
    assert torchrun["env"]["CUDA_VISIBLE_DEVICES"] == ""
    assert option(torchrun["argv"], "--nproc-per-node") == "2" and "gloo" in torchrun["argv"]


def test_gpus_without_a_gpu_exits_2_before_torchrun(tmp_path):
    host = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    count = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
                           env=host, capture_output=True, text=True, check=True).stdout.strip()
    if count != "0":
        pytest.skip(f"this host has {count} GPU(s)")
    proc = run_script(["--gpus", "0,1", "--test", "-l", str(tmp_path / "logs"), "-c", str(tmp_path / "ck")],
                      timeout=60, env={"CUDA_VISIBLE_DEVICES": "0,1"})
    assert proc.returncode == 2
    assert proc.stderr == ("launch_training.sh: --gpus 0,1: no CUDA GPU is visible on this host "
                           "(torch.cuda.device_count() = 0); use --cpu\n")
    assert proc.stdout == ""


@pytest.mark.parametrize("gpus, ids, message", [
    (0, "0", "--gpus 0: no CUDA GPU is visible on this host (torch.cuda.device_count() = 0); use --cpu"),
    (2, "1,2", "--gpus 1,2: GPU 2 does not exist; allowed: 0 to 1"),
    (2, "0,0", "--gpus 0,0: GPU 0 is listed twice; each GPU takes one process"),
    (2, "01", "--gpus '01': must be a comma-separated list of GPU ids, e.g. 0,1"),
])
def test_bad_gpu_ids_exit_2_before_torchrun(shim, gpus, ids, message):
    proc, torchrun = shim(["--gpus", ids], gpus=gpus)
    assert proc.returncode == 2
    assert proc.stderr == f"launch_training.sh: {message}\n"
    assert torchrun is None


def test_nproc_on_a_gpu_host_uses_its_gpus_or_refuses_in_one_line(shim):
    """--nproc N without --cpu on a GPU host switched it to N CPU processes without a word."""
    proc, torchrun = shim(["--nproc", "1"], gpus=2)
    assert proc.returncode == 0, proc.stderr
    assert option(torchrun["argv"], "--nproc-per-node") == "1" and "gloo" not in torchrun["argv"]
    assert torchrun["env"].get("CUDA_VISIBLE_DEVICES") != ""
    proc, torchrun = shim(["--nproc", "3"], gpus=2)
    assert proc.returncode == 2 and torchrun is None
    assert proc.stderr == ("launch_training.sh: --nproc 3: this host has 2 GPU(s); use --nproc 1 to 2, --gpus IDS, "
                           "or --cpu for CPU processes\n")


def test_gpus_index_the_hosts_gpus_whatever_the_callers_visible_devices(shim):
    proc, torchrun = shim(["--gpus", "1"], gpus=2, CUDA_VISIBLE_DEVICES="")
    assert proc.returncode == 0, proc.stderr
    assert torchrun["env"]["CUDA_VISIBLE_DEVICES"] == "1"
    assert option(torchrun["argv"], "--nproc-per-node") == "1" and "gloo" not in torchrun["argv"]


@pytest.mark.parametrize("nnodes, ifname, expected", [
    (1, None, "lo"), (1, "eth7", "eth7"), (2, None, None), (2, "eth7", "eth7"),
])
def test_loopback_only_for_one_node(shim, nnodes, ifname, expected):
    env = {"GLOO_SOCKET_IFNAME": ifname} if ifname else {}
    rdzv = ["--rdzv-endpoint", "node0:29500", "--rdzv-id", "job7"] if nnodes > 1 else []
    proc, torchrun = shim(["--cpu", "--nnodes", str(nnodes), *rdzv], **env)
    assert proc.returncode == 0, proc.stderr
    assert torchrun["env"].get("GLOO_SOCKET_IFNAME") == expected
    assert torchrun["env"].get("MASTER_ADDR") == ("127.0.0.1" if nnodes == 1 else None)
    assert option(torchrun["argv"], "--nnodes") == str(nnodes)


def test_an_elastic_node_range_reaches_torchrun_with_bounded_rendezvous_waits(shim):
    rdzv = ["--rdzv-endpoint", "node0:29500", "--rdzv-id", "job7"]
    proc, torchrun = shim(["--cpu", "--nnodes", "1:2", *rdzv, "--rdzv-join-timeout", "40"])
    assert proc.returncode == 0, proc.stderr
    argv = torchrun["argv"]
    assert option(argv, "--nnodes") == "1:2" and option(argv, "--rdzv-backend") == "c10d"
    conf = dict(kv.split("=") for kv in option(argv, "--rdzv-conf").split(","))
    assert conf == {"join_timeout": "40", "last_call_timeout": "5", "keep_alive_interval": "2",
                    "keep_alive_max_attempt": "3"}
    env = torchrun["env"]
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1" and env["RDZV_STORE_ENDPOINT"] == "c10d://node0:29500"
    proc, torchrun = shim(["--cpu", "--nnodes", "2", *rdzv])  # a fixed size keeps torchrun's shared store
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in torchrun["env"] and "RDZV_STORE_ENDPOINT" not in torchrun["env"]
    proc, torchrun = shim(["--cpu", "--nnodes", "2", "--rdzv-backend", "etcd-v2", "--rdzv-endpoint", "etcd0:2379",
                           "--rdzv-id", "job7"])
    assert option(torchrun["argv"], "--rdzv-backend") == "etcd-v2"
    assert torchrun["env"]["RDZV_STORE_ENDPOINT"] == "etcd-v2://etcd0:2379"
    for bad, says in ((["--nnodes", "3:2", *rdzv], "MIN must not exceed MAX"),
                      (["--nnodes", "1:2"], "needs --rdzv-endpoint"),
                      (["--nnodes", "2:", *rdzv], "a positive integer N or a range MIN:MAX"),
                      (["--nnodes", "2", *rdzv, "--rdzv-last-call", "0"], "--rdzv-last-call '0'"),
                      (["--nnodes", "2", *rdzv, "--rdzv-backend", "etcd"], "allowed: c10d, etcd-v2")):
        proc, torchrun = shim(["--cpu", *bad])
        assert proc.returncode == 2 and says in proc.stderr and torchrun is None, (bad, proc.stderr)


def test_a_lost_node_makes_the_launcher_exit_75_where_torchrun_exits_1(shim, tmp_path):
    """torchrun exits 1 whatever its workers said; the workers' NODE_LOST marker (written after a
    node loss, tests/unit/resilience/test_preemption.py) makes the launcher exit 75, a scheduler's cue to requeue."""
    ck = tmp_path / "ck"
    ck.mkdir()
    proc, _ = shim(["--cpu", "-c", str(ck), "-l", str(tmp_path / "logs")], SHIM_MARKER=str(ck / "NODE_LOST"),
                   SHIM_EXIT="1")
    assert proc.returncode == 75 and "a node of the run was lost (a torchrun agent died" in proc.stderr, proc.stderr
    # The marker of an earlier launch is not this one's.
    proc, _ = shim(["--cpu", "-c", str(ck), "-l", str(tmp_path / "logs")], SHIM_EXIT="1")
    assert proc.returncode == 1


def test_a_fatal_marker_of_the_launch_comes_before_node_lost(shim, tmp_path):
    """A peer of a rank that stopped on a deterministic error sees it vanish and writes NODE_LOST:
    the launcher must not turn that FATAL stop into 75, which a batch script requeues forever."""
    ck = tmp_path / "ck"
    ck.mkdir()
    shim_python = tmp_path / "shim" / "python"
    wrapper = tmp_path / "shim" / "python-fatal"  # the shim, writing FATAL beside NODE_LOST
    wrapper.write_text(f"#!/bin/sh\n[ \"$1 $2\" = '-m torch.distributed.run' ] && echo 'rank 1: FatalError: cannot "
                       f"halve further' > {ck / 'FATAL'}\nexec {shim_python} \"$@\"\n")
    wrapper.chmod(0o755)
    proc, _ = shim(["--cpu", "-c", str(ck), "-l", str(tmp_path / "logs")], SHIM_MARKER=str(ck / "NODE_LOST"),
                   SHIM_EXIT="1", PYTHON=str(wrapper))
    assert proc.returncode == 1, proc.stderr
    assert "a relaunch would fail the same way: rank 1: FatalError: cannot halve further" in proc.stderr
    assert "a node of the run was lost" not in proc.stderr


@pytest.mark.parametrize("faults, max_restarts, fatal", [
    # rank 1 fails the same way in every restart; the restart-loop guard stops it with FATAL
    ("crash@step=10,rank=1,restart=*", 2, True),
    # a transient kill of rank 1 (survived), then an unrelated failure of every rank later on
    ("sigkill@step=3,rank=1; crash@step=10,restart=1", 1, False),
])
def test_a_launch_whose_last_restart_lost_no_node_does_not_exit_75(tmp_path, faults, max_restarts, fatal):
    """Issue 33, bug 1: both exited 75 (a requeue, in train.sbatch, until the time limit)."""
    ck, logs = tmp_path / "ck", tmp_path / "logs"
    proc = run_script(["--cpu", "-n", "2", "--test", "--max-restarts", str(max_restarts), "-c", str(ck),
                       "-l", str(logs), "--", "--recovery.fault_inject", faults,
                       "--recovery.max_no_progress_restarts", "1", "--checkpoint.every_steps", "8"], timeout=240)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert (ck / "FATAL").exists() == fatal
    if fatal:
        assert "restarts in a row" in (ck / "FATAL").read_text() and "crash at step 10" in (ck / "FATAL").read_text()
    assert not (ck / "NODE_LOST").exists() or fatal
    assert "a node of the run was lost" not in proc.stderr
    assert not leftovers(str(tmp_path))


def fake_scontrol(tmp_path: Path, hosts: list[str]) -> str:
    """A PATH whose scontrol answers `scontrol show hostnames LIST` with ``hosts``."""
    bin_dir = tmp_path / "slurm-bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/sh\n[ \"$1 $2\" = 'show hostnames' ] || exit 1\nprintf '%s\\n' "
                                      + " ".join(hosts) + "\n")
    (bin_dir / "scontrol").chmod(0o755)
    return f"{bin_dir}:{os.environ['PATH']}"


SLURM = {"SLURM_JOB_ID": "41234", "SLURM_JOB_NODELIST": "cpu[07-08]", "SLURM_JOB_NUM_NODES": "2",
         "SLURM_CPUS_ON_NODE": "3", "SLURM_RESTART_COUNT": "1"}


def test_under_slurm_the_nodes_endpoint_run_id_and_processes_come_from_the_allocation(shim, tmp_path):
    path = fake_scontrol(tmp_path, ["cpu07", "cpu08"])
    proc, torchrun = shim(["--cpu"], PATH=path, **SLURM)
    assert proc.returncode == 0, proc.stderr
    argv = torchrun["argv"]
    assert option(argv, "--nnodes") == "2"
    assert option(argv, "--rdzv-endpoint") == f"cpu07:{20000 + 41234 % 20000}"  # the first host, a port from the id
    assert option(argv, "--rdzv-id") == "slurm-41234-1"  # the job and its requeue count
    assert option(argv, "--nproc-per-node") == "3"  # one process per allocated CPU
    assert torchrun["env"]["OMP_NUM_THREADS"] == "1" and "MASTER_ADDR" not in torchrun["env"]
    # What the user says still wins; one node of the allocation trains on loopback.
    proc, torchrun = shim(["--cpu", "--nproc", "1", "--rdzv-id", "mine"], PATH=path, **SLURM)
    assert option(torchrun["argv"], "--rdzv-id") == "mine" and option(torchrun["argv"], "--nproc-per-node") == "1"
    proc, torchrun = shim(["--cpu"], **{**SLURM, "SLURM_JOB_NUM_NODES": "1", "SLURM_JOB_NODELIST": "cpu07"})
    assert option(torchrun["argv"], "--nnodes") == "1" and torchrun["env"]["MASTER_ADDR"] == "127.0.0.1"
    # An srun step on one node of a 2-node job: the step's nodes count, not the job's.
    proc, torchrun = shim(["--cpu"], PATH=path, **SLURM, SLURM_STEP_NUM_NODES="1", SLURM_STEP_NODELIST="cpu08")
    assert option(torchrun["argv"], "--nnodes") == "1"


def test_under_kubeflow_torchrun_reads_pet_and_the_launcher_overrides_none_of_it(shim):
    pet = {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "1", "PET_NODE_RANK": "1", "PET_MASTER_ADDR": "trainer-node-0",
           "PET_MASTER_PORT": "23456"}
    proc, torchrun = shim(["--cpu"], **pet)
    assert proc.returncode == 0, proc.stderr
    argv = torchrun["argv"]
    for flag in ("--nnodes", "--nproc-per-node", "--rdzv-endpoint", "--rdzv-backend", "--rdzv-id", "--local-addr",
                 "--master-addr", "--node-rank"):
        assert flag not in argv, (flag, argv)
    assert {k: torchrun["env"][k] for k in pet} == pet
    assert "MASTER_ADDR" not in torchrun["env"] and "GLOO_SOCKET_IFNAME" not in torchrun["env"]
    # An elastic Kubeflow job: the workers are told where the rendezvous store is, as for a range here.
    elastic = {"PET_NNODES": "1:3", "PET_RDZV_BACKEND": "c10d", "PET_RDZV_ENDPOINT": "job-master:29400",
               "PET_RDZV_ID": "job"}
    proc, torchrun = shim(["--cpu", "--nproc", "2"], **elastic)
    assert option(torchrun["argv"], "--nproc-per-node") == "2" and "--nnodes" not in torchrun["argv"]
    assert torchrun["env"]["RDZV_STORE_ENDPOINT"] == "c10d://job-master:29400"
    proc, torchrun = shim(["--cpu", "--nnodes", "3"], **pet)
    assert proc.returncode == 2 and "under Kubeflow (PET_* set)" in proc.stderr and torchrun is None
    # torchrun's older etcd backend has no store the workers could use: left alone.
    proc, torchrun = shim(["--cpu", "--nproc", "2"], **{**elastic, "PET_RDZV_BACKEND": "etcd"})
    assert "RDZV_STORE_ENDPOINT" not in torchrun["env"]


def test_relative_config_data_and_resume_are_the_callers(shim, tmp_path):
    work = tmp_path / "work"
    (work / "in").mkdir(parents=True)
    (work / "in" / "run.toml").write_text('data.source = "in/corpus.txt"\ntrain.max_steps = 3\n')
    (work / "in" / "corpus.txt").write_text("to be or not to be\n" * 300)
    (work / "in" / "step.pt").write_bytes(b"")  # --check-config only checks that it is a file
    for args in (["--cpu", "--config", "in/run.toml", "--data", "in/corpus.txt", "--",
                  "--checkpoint.resume", "in/step.pt"],
                 ["--cpu", "--", "--config=in/run.toml", "--data.source", "in/corpus.txt",
                  "--checkpoint.resume=in/step.pt"]):
        proc, torchrun = shim(args, cwd=work)
        assert proc.returncode == 0, proc.stderr
        assert torchrun["cwd"] == str(work)


def test_relative_dirs_and_test_outputs_land_in_the_callers_directory(tmp_path):
    logs = f"logs-{tmp_path.name}"  # unique, so it also finds this run's processes
    # The flat --max-steps, after the --train.max_steps 60 that --test passes first: on a command
    # line the later of an alias and its dotted key wins (framework/config/sources.py).
    proc = run_script(["--cpu", "--test", "-l", logs, "--", "--max-steps", "5"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((tmp_path / logs / "summary.json").read_text())["steps"] == 5
    assert (tmp_path / "runs" / "test" / "checkpoints" / "final_model.pt").is_file()
    assert not (ROOT / logs).exists()
    assert not leftovers(logs)


def test_sigterm_from_another_directory_preempts_and_exits_0(tmp_path):
    logs = f"logs-{tmp_path.name}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHER_ENV)}
    proc = subprocess.Popen([str(SCRIPT), "--cpu", "--test", "-l", logs, "-c", "ck", "--",
                             "--train.max_steps", "100000", "--log-interval", "1"],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    log = tmp_path / logs / "rank_0.log"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (log.exists() and "step 3/" in log.read_text()):
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr[-3000:]
    assert "launch_training.sh: preempted; preempted at step" in stderr
    assert (tmp_path / "ck" / "PREEMPTED").is_file()
    time.sleep(0.5)
    assert not leftovers(logs)


def test_sigterm_during_the_final_evaluation_preempts_it_and_the_relaunch_finishes(tmp_path):
    """A SIGTERM in the final evaluation stops it at the next batch (a scheduler's grace is too short
    to wait for a long evaluation): the workers save the last step and write PREEMPTED, the worker
    with no traceback, and the launcher exits 0 although torchrun exits 1 after forwarding a signal. The
    same command then evaluates and finishes."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHER_ENV)}
    # A final evaluation of about 2 s (2,000 validation sequences of 128 tokens).
    command = [str(SCRIPT), "--cpu", "--nproc", "1", "-l", "logs", "-c", "ck", "--",
               "--vocab-size", "64", "--hidden-size", "128", "--num-layers", "2", "--num-heads", "2",
               "--seq-len", "128", "--dataset-size", "20000", "--batch-size", "16", "--eval.steps", "125",
               "--eval.interval", "0", "--train.max_steps", "6", "--log-interval", "1", "--num-workers", "0",
               "--logging.tensorboard", "false", "--target-loss", "0"]
    proc = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    log = tmp_path / "logs" / "rank_0.log"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (log.exists() and "evaluating at step 6" in log.read_text()):
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr[-3000:]
    assert "preempted; preempted at step 6" in stderr
    worker = log.read_text()
    assert "race condition" not in worker + stderr
    # the one traceback is torchrun's own, of the SIGTERM it was sent; none is the worker's
    assert stderr.count("Traceback (most recent call last)") == stderr.count("SignalException: Process")
    assert "evaluation at step 6 stopped before batch" in worker
    summary = json.loads((tmp_path / "logs" / "summary.json").read_text())
    assert summary["preempted"] and summary["steps"] == 6 and summary["final_val_loss"] is None
    assert (tmp_path / "ck" / "PREEMPTED").read_text() == "preempted at step 6"
    assert not (tmp_path / "ck" / "final_model.pt").exists()
    assert json.loads((tmp_path / "ck" / "manifest.json").read_text())[-1]["step"] == 6
    relaunch = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert relaunch.returncode == 0, relaunch.stderr[-3000:]
    assert (tmp_path / "ck" / "final_model.pt").is_file()
    summary = json.loads((tmp_path / "logs" / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["final_val_loss"] is not None and not summary["preempted"]


def test_sigusr1_an_ssh_drop_and_a_killed_launcher_save_and_leave_no_process(tmp_path):
    """SIGUSR1 to the launcher, SIGHUP to its process group (an ssh drop: the login shell hangs up
    its jobs), and kill -9 of the launcher itself each preempt the run: the workers save and exit, and
    torchrun and every worker end (a killed launcher's torchrun gets SIGTERM through PR_SET_PDEATHSIG).
    The runs go at once, each in its own session as a shell job would be."""
    from tests.dist_helper import kill_matching
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHER_ENV)}
    runs = {}
    for name in ("usr1", "hup", "kill9"):
        (tmp_path / name).mkdir()
        logs = f"logs-{name}-{tmp_path.name}"  # unique: it also finds this run's processes
        # As a login shell starts its jobs: SIGHUP at its default, even where this test runs under
        # nohup (a shell cannot trap a signal ignored on entry, so the hangup would be lost).
        proc = subprocess.Popen([str(SCRIPT), "--cpu", "--nproc", "1", "--test", "-l", logs, "-c", "ck", "--",
                                 "--train.max_steps", "100000", "--num-epochs", "1000", "--log-interval", "1",
                                 "--checkpoint.every_steps", "1000"],
                                cwd=tmp_path / name, env=env, stdout=subprocess.DEVNULL,
                                stderr=(tmp_path / name / "stderr").open("w"), start_new_session=True,
                                preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))
        runs[name] = (proc, logs)
    try:
        for name, (_, logs) in runs.items():
            log = tmp_path / name / logs / "rank_0.log"
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline and not (log.exists() and "step 3/" in log.read_text()):
                time.sleep(0.05)
            assert log.exists() and "step 3/" in log.read_text(), name
        os.kill(runs["usr1"][0].pid, signal.SIGUSR1)
        os.killpg(runs["hup"][0].pid, signal.SIGHUP)
        os.kill(runs["kill9"][0].pid, signal.SIGKILL)
        outcome = {}
        for name, (proc, logs) in runs.items():
            proc.wait(timeout=90)
            deadline = time.monotonic() + 60  # a killed launcher's torchrun and workers end on their own
            while leftovers(logs) and time.monotonic() < deadline:
                time.sleep(0.2)
            ck = tmp_path / name / "ck"
            outcome[name] = {"exit": proc.returncode, "left running": bool(leftovers(logs)),
                             "launcher": "preempted; preempted at step" in (tmp_path / name / "stderr").read_text(),
                             "PREEMPTED": (ck / "PREEMPTED").is_file(), "checkpoint": bool(list(ck.glob("step_*.pt"))),
                             "worker": "preempted: {" in (tmp_path / name / logs / "rank_0.log").read_text()}
        expected = {"exit": 0, "left running": False, "launcher": True, "PREEMPTED": True, "checkpoint": True,
                    "worker": True}
        killed = {**expected, "exit": -signal.SIGKILL, "launcher": False}  # it died before it could say so
        assert outcome == {"usr1": expected, "hup": expected, "kill9": killed}
    finally:
        for proc, logs in runs.values():
            if proc.poll() is None:
                proc.kill()
            kill_matching(logs)
