"""examples/slurm/train.sbatch against a real SLURM: munged, slurmctld and slurmd (Debian's
slurm-wlm 22.05) started as a one-host cluster in a temporary directory, installed when missing.
Three jobs: one that trains and exits 0; one sent `scancel --signal=USR1 --batch` mid-run, which
saves, requeues itself and resumes bit-exact; one cancelled (SIGTERM), which saves and is not
requeued. Every daemon is stopped by its pid at the end, pass or fail."""

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.tiny import tiny
from tests.dist_helper import ROOT, cli_args, free_port, kill_matching, rank_log, summary, wait_for

pytestmark = [pytest.mark.dist, pytest.mark.slurm]

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "scancel", "sinfo")
# 256 samples, 2 ranks x 4 (one process per allocated CPU): 30 steps, each slowed to >= 150 ms so
# that a signal lands mid-run.
JOB = tiny(None, {"train.max_steps": 30, "train.deterministic": True, "eval.interval": 0, "checkpoint.every_steps": 5,
                  "recovery.fault_inject": "slow@step=0,ms=150,restart=*"}, vocab_size=32, hidden_size=32,
           num_layers=1, dataset_size=256, batch_size=4, log_interval=1)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """The environment (SLURM_CONF) of a running one-host cluster with 2 CPUs a node at most."""
    if any(shutil.which(name) is None for name in DAEMONS):
        install = subprocess.run("apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "
                                 "slurm-wlm munge", shell=True, capture_output=True, text=True, timeout=900)
        missing = [name for name in DAEMONS if shutil.which(name) is None]
        if install.returncode != 0 or missing:
            why = (install.stderr.strip().splitlines() or [f"still missing: {missing}"])[-1]
            pytest.skip(f"SLURM (slurm-wlm, munge) could not be installed: {why}")
    d = tmp_path_factory.mktemp("slurm")
    (d / "state").mkdir()
    (d / "spool").mkdir()
    (d / "munge.key").write_bytes(os.urandom(1024))
    (d / "munge.key").chmod(0o600)
    host = socket.gethostname().split(".")[0]
    cpus = min(2, os.sysconf("SC_NPROCESSORS_ONLN"))  # not nproc(1): it obeys OMP_NUM_THREADS
    # cred_expire: how long a requeued job waits before it may start again (120 s by default; slurm takes 5 at least).
    (d / "slurm.conf").write_text(f"""ClusterName=ddptest
SlurmctldHost={host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
AuthType=auth/munge
AuthInfo=socket={d}/munge.socket,cred_expire=5
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
ReturnToService=2
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
JobRequeue=1
KillWait=30
MinJobAge=600
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP
""")
    env = {**os.environ, "SLURM_CONF": str(d / "slurm.conf")}
    env.pop("SLURM_JOB_ID", None)
    daemons = []
    try:
        for cmd in (["munged", "-F", "--force", f"--key-file={d}/munge.key", f"--socket={d}/munge.socket",
                     f"--pid-file={d}/munged.pid", f"--log-file={d}/munged.log", f"--seed-file={d}/munged.seed"],
                    ["slurmctld", "-D", "-f", str(d / "slurm.conf")],
                    ["slurmd", "-D", "-f", str(d / "slurm.conf"), "-N", host]):
            with open(d / f"{cmd[0]}.out", "w") as out:
                daemons.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT))
            if cmd[0] == "munged":
                wait_for(lambda: (d / "munge.socket").exists(), 30, "munged's socket")
        wait_for(lambda: "idle" in subprocess.run(["sinfo", "-h", "-o", "%t"], env=env, capture_output=True,
                                                  text=True).stdout, 60, "the node to be idle")
        yield env
    finally:
        subprocess.run(["scancel", "--full", "--signal=KILL", "--user=root"], env=env, capture_output=True)
        for proc in reversed(daemons):
            proc.send_signal(signal.SIGTERM)
        for proc in reversed(daemons):
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        kill_matching(str(d))


def submit(env, run_dir: Path, *extra: str, train: tuple[str, ...] = ()) -> str:
    run_dir.mkdir(parents=True, exist_ok=True)
    flags = cli_args({**JOB, "logging.dir": str(run_dir / "logs"), "checkpoint.dir": str(run_dir / "ck")})
    proc = subprocess.run(["sbatch", "--parsable", f"--output={run_dir / 'job.out'}", *extra,
                           str(ROOT / "examples" / "slurm" / "train.sbatch"), *flags, *train],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().split(";")[0]


def job_field(env, job: str, name: str) -> str:
    out = subprocess.run(["scontrol", "show", "job", job], env=env, capture_output=True, text=True).stdout
    return next((part.split("=", 1)[1] for part in out.split() if part.startswith(f"{name}=")), "")


def wait_done(env, job: str, timeout: float) -> str:
    wait_for(lambda: job_field(env, job, "JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"), timeout,
             f"job {job} to end")
    return job_field(env, job, "JobState")


@pytest.fixture(scope="module")
def job1(slurm, tmp_path_factory):
    """Job 1, uninterrupted: its id and directory."""
    run_dir = tmp_path_factory.mktemp("job1")
    job = submit(slurm, run_dir)
    wait_done(slurm, job, 120)
    return job, run_dir


@pytest.fixture(scope="module")
def uninterrupted(job1):
    return summary(job1[1])["model_sha256"]


def test_a_job_trains_with_one_process_per_allocated_cpu_and_exits_0(slurm, job1):
    job, run_dir = job1
    out = (run_dir / "job.out").read_text()
    assert job_field(slurm, job, "JobState") == "COMPLETED" and job_field(slurm, job, "ExitCode") == "0:0", out[-3000:]
    # 2 CPUs: 2 processes
    assert "effective batch: 4 per rank x 2 ranks x 1 accumulation" in rank_log(run_dir, missing_ok=True)
    result = summary(run_dir)
    assert result["steps"] == 30 and result["world_size"] == 2 and not result["preempted"]


def test_usr1_saves_requeues_the_job_and_the_requeued_job_resumes_bit_exact(slurm, uninterrupted, tmp_path):
    job = submit(slurm, tmp_path)
    wait_for(lambda: "step 10/" in rank_log(tmp_path, missing_ok=True), 90, "step 10")
    signalled = time.monotonic()
    subprocess.run(["scancel", "--signal=USR1", "--batch", job], env=slurm, check=True)
    wait_for(lambda: job_field(slurm, job, "Restarts") == "1", 60, "the job to requeue itself")
    requeued = time.monotonic()
    wait_for(lambda: "resumed from step" in rank_log(tmp_path, missing_ok=True), 60, "the requeued job to resume")
    wait_for(lambda: "start-up took" in rank_log(tmp_path, missing_ok=True).split("resumed from step")[-1], 60,
             "its first step")
    first_step = time.monotonic()
    assert wait_done(slurm, job, 120) == "COMPLETED"
    out = (tmp_path / "job.out").read_text()
    assert "train.sbatch: saved on a signal; requeueing job" in out and "received SIGUSR1" in out
    result = summary(tmp_path)
    assert result["steps"] == 30 and not result["preempted"] and result["model_sha256"] == uninterrupted
    print(f"USR1 -> requeued {requeued - signalled:.1f} s; requeued -> first step {first_step - requeued:.1f} s "
          "(of which the requeue delay, cred_expire, is 5 s)")


def test_scancel_saves_and_the_job_ends_without_a_requeue(slurm, tmp_path):
    job = submit(slurm, tmp_path)
    wait_for(lambda: "step 10/" in rank_log(tmp_path, missing_ok=True), 90, "step 10")
    subprocess.run(["scancel", job], env=slurm, check=True)
    saved = wait_for(lambda: "preempted: checkpoint of step" in rank_log(tmp_path, missing_ok=True), 30, "the save")
    assert wait_done(slurm, job, 60) == "CANCELLED"
    time.sleep(2)  # a requeue would show now
    assert job_field(slurm, job, "Restarts") == "0" and job_field(slurm, job, "JobState") == "CANCELLED"
    result = summary(tmp_path)
    assert result["preempted"] and 10 <= result["steps"] < 30
    manifest = (tmp_path / "ck" / "manifest.json").read_text()
    assert f"step_{result['steps']:08d}.pt" in manifest and (tmp_path / "ck" / "PREEMPTED").is_file()
    print(f"scancel -> saved {saved:.1f} s")


def test_a_deterministic_error_on_one_rank_fails_the_job_without_a_requeue(slurm, tmp_path):
    """Issue 33, bug 1: rank 1 fails at step 10 in every restart; rank 0 sees it vanish
    (NODE_LOST) and the restart-loop guard stops the launch with FATAL. The job fails once; it
    was requeued until its time limit, each requeue clearing FATAL as a new launch does."""
    job = submit({**slurm, "MAX_RESTARTS": "2"}, tmp_path, train=(
        "--recovery.fault_inject", "crash@step=10,rank=1,restart=*", "--recovery.max_no_progress_restarts", "1",
        "--checkpoint.every_steps", "8"))
    assert wait_done(slurm, job, 180) == "FAILED"
    time.sleep(2)  # a requeue would show now
    out = (tmp_path / "job.out").read_text()
    assert job_field(slurm, job, "Restarts") == "0", out[-3000:]
    assert "not requeueing job" in out and "requeueing job" not in out.replace("not requeueing job", "")
    assert "crash at step 10" in (tmp_path / "ck" / "FATAL").read_text()
