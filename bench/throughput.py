#!/usr/bin/env python3
"""Training throughput of DDPTrainer against a bare PyTorch loop, on CPU, in one run.

With CUDA, both run on the GPU of their local rank (NCCL between ranks), the bare loop with the
framework's autocast and GradScaler (framework.train.optim.Precision), and every step's stamp is taken
after torch.cuda.synchronize(). One GPU cannot hold 2 NCCL ranks: there, run 1-process variants
only (--variants ab, --compile --max-procs 1), as bench/gpu_check.py does.

Model and data: configs/nanogpt_shakespeare_char.toml (GPT, 4 layers, 4 heads, hidden 128,
seq_len 64, dropout 0, AdamW, grad clip 1.0) on data/tinyshakespeare.txt, batch 12 per rank for
every variant. Every process runs one compute thread (OMP_NUM_THREADS=1, torch.set_num_threads(1)).

Variants, each in fresh processes:
  (a) DDPTrainer, 1 process                        (as users run it: logging, TensorBoard,
  (c) DDPTrainer, 2 processes under torchrun        per-step control all-reduce, default loader)
  (b) bare loop, 1 process                         (framework.model.gpt.GPT + lm_loss, the framework's
  (d) bare loop in torch DDP (gloo), 2 processes    AdamW (fused), clip 1.0, same LR schedule; batches
                                                    indexed straight out of the same token array)
  (e) two copies of (b) at once, no communication: the 2-process ceiling of this machine
      (sum of their tokens/s over the time both were running).
(c) and (d) use the same launch: torchrun, c10d rendezvous on a free port, GLOO_SOCKET_IFNAME=lo.

Timing, the same for every variant: each process records time.perf_counter() at the end of every
optimizer step (for DDPTrainer by wrapping the instance's ``optimizer_step``, which changes
nothing else; for the bare loop right after ``zero_grad``). The first ``--warmup`` steps are
excluded; tokens/s = steps * global tokens per step / (stamp[warmup + steps - 1] - stamp[warmup - 1]),
so the window holds exactly ``steps`` whole loop iterations, data loading, logging, TensorBoard,
memory checks and GC included, and excludes start-up, the first steps, the final evaluation and
the final checkpoint. For DDPTrainer, eval_interval is set to 0 (evaluation is not training
throughput; the bare loop has none) and eval_steps to 1 (the final evaluation runs after the
timed window and only costs wall time); everything else is the config file's. DDPTrainer's own
summary tokens_per_sec (which includes start-up and warm-up steps) is shown for reference.

(a) and (b) are interleaved and repeated (b a b a ...), as are (c) and (d), to spread the drift
of this shared machine over both; the median of the repeats is reported. Results are printed as a
table with the ratios a/b, c/d, c/a, d/b, e/b and written to bench/results/throughput.json.

--comm-hooks instead runs (c) once per setting in COMM_SETTINGS (plain DDP as the peers run it,
the framework's fused AdamW, the compression hooks, bucket settings, bf16 autocast), the settings
round-robin within each repeat (b a e c1 c2 ... cN, repeated), and reports each setting's c/a (its
scaling; for the autocast settings it is a speed-up, not a scaling) against e/b (the ceiling) and
its tokens/s against plain; written to bench/results/comm_hooks.json.

--compile instead runs (a) and (c) eager and with compile=true (inductor), interleaved in every
repeat, and reports tokens/s, the paired ratio to eager, the first step (which holds the
compilation) and the whole process's wall time; written to bench/results/compile.json. Inductor
caches what it compiled (in /tmp): later runs of the same model compile in seconds;
--cold-cache gives every run a fresh cache, as a first run has.

usage: python bench/throughput.py [--quick] [--steps N] [--warmup N] [--repeats N] [--comm-hooks | --compile]
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

CONFIG = ROOT / "configs" / "nanogpt_shakespeare_char.toml"
RESULTS = ROOT / "bench" / "results" / "throughput.json"
COMM_RESULTS = ROOT / "bench" / "results" / "comm_hooks.json"
COMPILE_RESULTS = ROOT / "bench" / "results" / "compile.json"
# --comm-hooks: (c) under each of these settings. "plain" is plain DDP as the peers run it: DDP's
# defaults, fp32, torch's default AdamW (foreach); every other setting starts from the framework's
# defaults (fused AdamW) and changes what its name says.
COMM_SETTINGS = {
    "plain": {"optim.impl": "foreach"},
    "fused AdamW (default)": {},
    "fp16 hook": {"ddp.comm_hook": "fp16"},
    "bf16 hook": {"ddp.comm_hook": "bf16"},
    "bucket 1 MiB": {"ddp.bucket_cap_mb": 1},
    "grad as bucket view": {"ddp.gradient_as_bucket_view": True},
    "bf16 hook+bucket view": {"ddp.comm_hook": "bf16", "ddp.gradient_as_bucket_view": True},
    "bf16 autocast": {"precision.autocast": "true"},
    "bf16 autocast+bf16 hook": {"precision.autocast": "true", "ddp.comm_hook": "bf16"},
}
SCRIPT = Path(__file__).resolve()


# ============================================================================ worker side ====
def load_cfg(workdir: Path, total_steps: int, overrides: dict | None = None):
    from framework.config import build_config, load_config_file
    values = {f"{section}.{key}": value for section, keys in load_config_file(CONFIG).items()
              for key, value in keys.items()}
    run = {"train.max_steps": total_steps, "eval.interval": 0, "eval.steps": 1, "logging.tensorboard": True,
           "logging.dir": str(workdir / "logs"), "checkpoint.dir": str(workdir / "checkpoints"), **(overrides or {})}
    values.update(run)  # dotted keys, as the file's [section] tables give them
    return build_config(values, env={})


class Clock:
    """End-of-step stamps: wall (perf_counter, CLOCK_MONOTONIC, comparable across processes) and
    the training thread's CPU time (thread_time), which other load on the machine barely moves."""

    def __init__(self):
        self.wall: list[float] = []
        self.cpu: list[float] = []
        import torch
        self.cuda = torch.cuda.is_available()

    def tick(self) -> None:
        if self.cuda:  # a stamp after the step's kernels ran, not after they were queued
            import torch
            torch.cuda.synchronize()
        self.wall.append(time.perf_counter())
        self.cpu.append(time.thread_time())


def run_framework(cfg, clock: Clock) -> dict:
    from framework.trainer import DDPTrainer
    trainer = DDPTrainer(cfg)
    step = trainer.optimizer_step

    def timed_step(*args, **kwargs):
        out = step(*args, **kwargs)
        clock.tick()
        return out

    trainer.optimizer_step = timed_step  # instance attribute: _train() calls it, nothing else changes
    train_start = time.perf_counter()
    summary = trainer.train()
    ddp = getattr(trainer.model, "_orig_mod", trainer.model)
    # DDP's own averages over its sampled iterations (ns): backward compute, all-reduce, their overlap.
    ddp_logging = {k: v for k, v in ddp._get_ddp_logging_data().items()
                   if k.startswith("avg_") or k in ("rebuilt_bucket_sizes", "num_buckets_reduced")} if hasattr(
        ddp, "_get_ddp_logging_data") else {}
    return {"first_step_s": clock.wall[0] - train_start, "ddp_logging": ddp_logging,
            "loader_workers": trainer.num_workers,
            "world_size": trainer.env.world_size,
            "rank": trainer.env.rank, "self_reported_tokens_per_sec": summary["tokens_per_sec"],
            "tokens_per_step": cfg.data.batch_size * cfg.model.seq_len * trainer.env.world_size}


def run_bare(cfg, clock: Clock, seed_offset: int = 0) -> dict:
    """The bare loop: same model, loss, optimizer, schedule and clip; batches indexed from the
    same token array; torch DDP when launched by torchrun with WORLD_SIZE > 1; on the GPU the
    framework would pick (NCCL), else the CPU (gloo)."""
    import torch
    import torch.distributed as dist
    from framework.data.datasets import build_datasets
    from framework.ddp.process_group import select_device
    from framework.model.gpt import GPT, GPTConfig, lm_loss
    from framework.train.optim import Precision, build_optimizer, lr_at
    world = int(os.environ.get("WORLD_SIZE", 1))
    cuda = torch.cuda.is_available()
    device = select_device(int(os.environ.get("LOCAL_RANK", 0)), cuda, torch.cuda.device_count() if cuda else 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank = dist.get_rank() if world > 1 else 0
    bundle = build_datasets(cfg)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=bundle.vocab_size))
    data = torch.from_numpy(bundle.train.tokens.astype("int64"))  # the framework's train tokens
    torch.manual_seed(cfg.train.seed)
    raw = GPT(GPTConfig.from_train_config(cfg)).to(device)
    ids = [device.index] if device.type == "cuda" else None
    model = torch.nn.parallel.DistributedDataParallel(raw, device_ids=ids) if world > 1 else raw
    opt = build_optimizer(raw, lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay,
                          betas=(cfg.optim.beta1, cfg.optim.beta2), impl=cfg.optim.impl)  # the framework's kernels
    mixed = Precision(cfg.precision, device=device)  # the framework's autocast and GradScaler
    amp, amp_dtype, scaler = mixed.autocast, mixed.dtype, mixed.scaler
    gen = torch.Generator().manual_seed(cfg.train.seed + 1 + rank + 100 * seed_offset)
    offsets = torch.arange(cfg.model.seq_len + 1)
    B, T = cfg.data.batch_size, cfg.model.seq_len
    model.train()
    for step in range(cfg.train.max_steps):
        lr = lr_at(step, lr=cfg.optim.lr, warmup_steps=cfg.optim.warmup_steps,
                   total_steps=cfg.train.max_steps, min_lr=cfg.optim.min_lr)
        for group in opt.param_groups:
            group["lr"] = lr
        ix = torch.randint(len(data) - T - 1, (B,), generator=gen)
        rows = data[ix[:, None] + offsets].to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp):
            loss = lm_loss(model(rows[:, :-1]), rows[:, 1:])
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(raw.parameters(), cfg.optim.grad_clip)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        clock.tick()
        if (step + 1) % cfg.logging.interval == 0 and rank == 0:
            print(f"step {step + 1} loss {loss.item():.4f}", flush=True)
    if world > 1:
        dist.destroy_process_group()
    return {"loader_workers": 0, "world_size": world, "rank": rank,
            "self_reported_tokens_per_sec": None, "tokens_per_step": B * T * world}


def worker_main(args) -> None:
    import torch
    torch.set_num_threads(1)
    workdir = Path(args.workdir)
    cfg = load_cfg(workdir, args.warmup + args.steps, json.loads(args.set))
    clock = Clock()
    if args.worker == "framework":
        info = run_framework(cfg, clock)
    else:
        info = run_bare(cfg, clock, args.copy)
    if info["rank"] == 0:
        info.update(stamps=clock.wall, cpu_stamps=clock.cpu, warmup=args.warmup, steps=args.steps,
                    threads=torch.get_num_threads())
        Path(args.result).write_text(json.dumps(info))


# ====================================================================== orchestrator side ====
CHILDREN: list[subprocess.Popen] = []


def kill_children() -> None:
    """Terminate every process this script started and their descendants (torchrun's ranks,
    DataLoader workers), by pid: SIGTERM, then SIGKILL for what is left after 10 s."""
    import psutil
    procs = []
    for child in CHILDREN:
        if child.poll() is None:
            try:
                top = psutil.Process(child.pid)
                procs += [top] + top.children(recursive=True)
            except psutil.NoSuchProcess:
                pass
    for p in procs:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=10)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    for child in CHILDREN:
        try:
            child.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
    CHILDREN.clear()


def _on_signal(signum, frame):
    kill_children()
    sys.exit(128 + signum)


def clean_up_children_on_exit() -> None:
    """Whatever ends the orchestrator (return, exception, SIGTERM, Ctrl-C) ends its children too."""
    atexit.register(kill_children)
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)


def write_results(path: str | Path, out: dict) -> None:
    """Write ``out`` as JSON to ``path`` atomically (a temp file renamed over it)."""
    dest = Path(path)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp_path = dest.with_name(dest.name + ".tmp")
    tmp_path.write_text(json.dumps(out, indent=2) + "\n")
    os.replace(tmp_path, dest)
    print(f"\nwrote {dest}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env() -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("DDP_") and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                                     "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo",
               PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""))
    return env


def start(kind: str, nproc: int, tmp: Path, name: str, args, copy: int = 0, overrides: dict | None = None):
    workdir = tmp / name
    workdir.mkdir(parents=True)
    result = workdir / "result.json"
    cmd = [sys.executable]
    if nproc > 1:
        cmd += ["-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc),
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}"]
    cmd += [str(SCRIPT), "--worker", kind, "--steps", str(args.steps), "--warmup", str(args.warmup),
            "--workdir", str(workdir), "--result", str(result), "--copy", str(copy),
            "--set", json.dumps(overrides or {})]
    log = open(workdir / "output.log", "w")
    env = child_env()
    if getattr(args, "cold_cache", False):  # compile from scratch, as a first run does
        env["TORCHINDUCTOR_CACHE_DIR"] = str(workdir / "inductor_cache")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL)
    log.close()
    CHILDREN.append(proc)
    return proc, result, workdir / "output.log"


def finish(proc, result: Path, log: Path, name: str, timeout: float) -> dict:
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_children()
        raise SystemExit(f"{name}: no result after {timeout:.0f} s; output:\n{log.read_text()[-3000:]}") from None
    CHILDREN.remove(proc)
    if rc != 0 or not result.is_file():
        raise SystemExit(f"{name}: exit code {rc}; output:\n{log.read_text()[-3000:]}")
    return json.loads(result.read_text())


def rate(res: dict) -> float:
    s, w = res["stamps"], res["warmup"]
    return res["steps"] * res["tokens_per_step"] / (s[-1] - s[w - 1])


def run_variant(kind: str, nproc: int, tmp: Path, name: str, args, overrides: dict | None = None) -> dict:
    t0 = time.perf_counter()
    res = finish(*start(kind, nproc, tmp, name, args, overrides=overrides), name, args.timeout)
    res["tokens_per_sec"] = rate(res)
    res["process_wall_s"] = time.perf_counter() - t0
    res["ms_per_step"] = 1000 * (res["stamps"][-1] - res["stamps"][res["warmup"] - 1]) / res["steps"]
    res["cpu_ms_per_step"] = 1000 * (res["cpu_stamps"][-1] - res["cpu_stamps"][res["warmup"] - 1]) / res["steps"]
    print(f"  {name:<14} {res['tokens_per_sec']:>9.0f} tok/s  {res['ms_per_step']:6.2f} ms/step  "
          f"{res['cpu_ms_per_step']:6.2f} cpu ms/step  (process wall {time.perf_counter() - t0:.1f} s)", flush=True)
    return res


def run_concurrent_pair(tmp: Path, name: str, args) -> dict:
    """(e): two bare single-process copies at once; sums their rates over the interval in which
    both were past warm-up and still stepping (perf_counter is CLOCK_MONOTONIC, shared by processes)."""
    t0 = time.perf_counter()
    started = [start("bare", 1, tmp, f"{name}_{i}", args, copy=i) for i in range(2)]
    results = [finish(*s, name, args.timeout) for s in started]
    lo = max(r["stamps"][r["warmup"] - 1] for r in results)
    hi = min(r["stamps"][-1] for r in results)
    if hi - lo < 0.5 * min(r["stamps"][-1] - r["stamps"][r["warmup"] - 1] for r in results):
        print("  warning: the two copies overlapped for less than half their timed window")
    rates = [sum(lo < t <= hi for t in r["stamps"]) * r["tokens_per_step"] / (hi - lo) for r in results]
    total = sum(rates)
    print(f"  {name:<14} {total:>9.0f} tok/s  = {rates[0]:.0f} + {rates[1]:.0f} over {hi - lo:.1f} s shared "
          f"(process wall {time.perf_counter() - t0:.1f} s)", flush=True)
    return {"tokens_per_sec": total, "per_copy_tokens_per_sec": rates, "overlap_s": hi - lo,
            "loader_workers": 0, "ms_per_step": None, "cpu_ms_per_step": None,
            "self_reported_tokens_per_sec": None}


def busy_fraction(seconds: float = 2.0) -> float:
    """Fraction of all cores busy over ``seconds`` (from /proc/stat; 1-min load average elsewhere)."""
    def sample():
        with open("/proc/stat") as f:
            values = [int(v) for v in f.readline().split()[1:8]]
        return sum(values), values[3] + values[4]
    try:
        total0, idle0 = sample()
        time.sleep(seconds)
        total1, idle1 = sample()
    except OSError:
        return os.getloadavg()[0] / (os.cpu_count() or 1)
    return 1.0 - (idle1 - idle0) / max(1, total1 - total0)


def git_state() -> dict:
    """The commit and whether framework/ had uncommitted edits (it changes under other people's hands)."""
    def git(*cmd):
        out = subprocess.run(["git", *cmd], cwd=ROOT, capture_output=True, text=True)
        return out.stdout.strip() if out.returncode == 0 else None
    status = git("status", "--porcelain", "--", "framework")
    return {"commit": git("rev-parse", "HEAD"), "framework_dirty": bool(status) if status is not None else None}


def orchestrate(args) -> int:
    clean_up_children_on_exit()
    import torch
    cores = len(os.sched_getaffinity(0))
    load_before = os.getloadavg()
    busy_before = busy_fraction()
    print(f"torch {torch.__version__}, {cores} cores; warm-up {args.warmup} steps, timed {args.steps} "
          f"steps, {args.repeats} repeat(s) of a/b and c/d; CPU busy before start {busy_before:.0%}", flush=True)
    if busy_before > 0.1:
        print("  note: other processes are using this machine; expect noisy numbers", flush=True)
    runs: dict[str, list[dict]] = {k: [] for k in "abcde"}
    with tempfile.TemporaryDirectory(prefix="bench_throughput_") as tmpdir:
        tmp = Path(tmpdir)
        plan = {"b": ("bare", 1), "a": ("framework", 1), "d": ("bare", 2), "c": ("framework", 2)}
        for pair in ("ba", "dc"):  # interleaved: b a b a ..., then d c d c ...
            for i in range(args.repeats):
                for k in pair:
                    if k in args.variants:
                        kind, nproc = plan[k]
                        runs[k].append(run_variant(kind, nproc, tmp, f"{k}{i}_{kind}_{nproc}p", args))
        if "e" in args.variants:
            runs["e"].append(run_concurrent_pair(tmp, "e_2x_bare", args))
        kill_children()

    labels = {"a": ("DDPTrainer", 1), "b": ("bare loop", 1), "c": ("DDPTrainer torchrun", 2),
              "d": ("bare loop torch DDP", 2), "e": ("2 x bare loop, no comm", 2)}
    labels = {k: v for k, v in labels.items() if runs[k]}
    runs = {k: v for k, v in runs.items() if v}
    med = {k: statistics.median(r["tokens_per_sec"] for r in v) for k, v in runs.items()}
    print()
    print(f"{'variant':<30} {'procs':>5} {'loader':>6} {'tok/s (median)':>15} {'ms/step':>8} {'cpu ms':>7} "
          f"{'runs tok/s':>20} {'self-reported':>13}")
    for k, (label, nproc) in labels.items():
        v = runs[k]
        ms = [r["ms_per_step"] for r in v if r["ms_per_step"]]
        selfrep = [r["self_reported_tokens_per_sec"] for r in v if r["self_reported_tokens_per_sec"]]
        ms_text = f"{statistics.median(ms):.2f}" if ms else "-"
        cpu = [r["cpu_ms_per_step"] for r in v if r["cpu_ms_per_step"]]
        cpu_text = f"{statistics.median(cpu):.2f}" if cpu else "-"
        runs_text = " ".join(f"{r['tokens_per_sec']:.0f}" for r in v)
        self_text = f"{statistics.median(selfrep):.0f}" if selfrep else "-"
        print(f"({k}) {label:<26} {nproc:>5} {v[0]['loader_workers']:>6} {med[k]:>15.0f} "
              f"{ms_text:>8} {cpu_text:>7} {runs_text:>20} {self_text:>13}")
    print("  loader = DataLoader worker processes per rank (DDPTrainer: its default num_workers=auto, "
          "scaled by workers_per_rank);\n"
          "  cpu ms = training thread's CPU time per step (rank 0; excludes loader workers and gloo threads);\n"
          "  self-reported = DDPTrainer's summary tokens_per_sec (includes start-up and warm-up steps)")
    ratios = {name: med[name[0]] / med[name[2]] for name in ("a/b", "c/d", "c/a", "d/b", "e/b")
              if name[0] in med and name[2] in med}
    targets = {"a/b": 0.97, "c/d": 0.97}
    print()
    for name, value in ratios.items():
        note = (f"  (target >= {targets[name]}: {'met' if value >= targets[name] else 'NOT met'})"
                if name in targets else "")
        print(f"{name} = {value:.3f}{note}")

    out = {
        "description": "training tokens/s, global over ranks; see bench/throughput.py docstring",
        "quick": args.quick, "torch": torch.__version__, "cores": cores, "config": str(CONFIG.relative_to(ROOT)),
        "git": git_state(),
        "cpu_busy_before_start": busy_before,
        "load_average_1min": {"before": load_before[0], "after": os.getloadavg()[0]},
        "variants_run": args.variants, "warmup_steps": args.warmup, "timed_steps": args.steps, "repeats": args.repeats,
        "threads_per_process": 1, "batch_size_per_rank": 12, "seq_len": 64,
        "variants": {k: {"label": labels[k][0], "processes": labels[k][1], "median_tokens_per_sec": med[k],
                         "loader_workers_per_rank": runs[k][0]["loader_workers"],
                         "runs": [{key: r.get(key) for key in ("tokens_per_sec", "ms_per_step", "cpu_ms_per_step",
                                                               "self_reported_tokens_per_sec",
                                                               "per_copy_tokens_per_sec", "overlap_s")
                                   if r.get(key) is not None} for r in runs[k]]}
                     for k in labels},
        "ratios": ratios,
        "targets_met": {name: ratios[name] >= t for name, t in targets.items() if name in ratios},
    }
    write_results(args.out, out)
    return 0


def orchestrate_comm_hooks(args) -> int:
    """(c) under each of COMM_SETTINGS, with (a), (b) and (e), round-robin in every repeat."""
    clean_up_children_on_exit()
    import torch
    load_before, busy_before = os.getloadavg(), busy_fraction()
    print(f"torch {torch.__version__}, {len(os.sched_getaffinity(0))} cores; warm-up {args.warmup} steps, timed "
          f"{args.steps} steps, {args.repeats} repeat(s); CPU busy before start {busy_before:.0%}", flush=True)
    runs: dict[str, list[float]] = {k: [] for k in ("a", "b", "e", *COMM_SETTINGS)}
    step_ms: dict[str, list[float]] = {k: [] for k in COMM_SETTINGS}
    ddp_logs: dict[str, list[dict]] = {k: [] for k in COMM_SETTINGS}
    with tempfile.TemporaryDirectory(prefix="bench_comm_hooks_") as tmpdir:
        tmp = Path(tmpdir)
        for i in range(args.repeats):
            runs["b"].append(run_variant("bare", 1, tmp, f"b{i}", args)["tokens_per_sec"])
            runs["a"].append(run_variant("framework", 1, tmp, f"a{i}", args)["tokens_per_sec"])
            runs["e"].append(run_concurrent_pair(tmp, f"e{i}", args)["tokens_per_sec"])
            for j, (name, overrides) in enumerate(COMM_SETTINGS.items()):
                res = run_variant("framework", 2, tmp, f"c{i}_{j}", args, overrides)
                runs[name].append(res["tokens_per_sec"])
                step_ms[name].append(res["ms_per_step"])
                ddp_logs[name].append(res["ddp_logging"])
        kill_children()
    med = {k: statistics.median(v) for k, v in runs.items()}
    ceiling = med["e"] / med["b"]
    rows = []
    print(f"\n(a) DDPTrainer 1 process {med['a']:.0f} tok/s, (b) bare loop {med['b']:.0f}, (e) 2 x bare loop "
          f"{med['e']:.0f}: ceiling e/b = {ceiling:.3f}\n")
    print(f"{'(c) setting, 2 processes':<26} {'tok/s (median)':>15} {'c/a':>6} {'vs plain':>9} {'paired':>7} "
          f"{'runs tok/s':>26}")
    for name, overrides in COMM_SETTINGS.items():
        # paired: the median over repeats of this setting's tokens/s over plain's in the same repeat
        paired = statistics.median(x / y for x, y in zip(runs[name], runs["plain"], strict=True))
        row = {"setting": name, "overrides": overrides, "median_tokens_per_sec": med[name],
               "c_over_a": med[name] / med["a"], "vs_plain": med[name] / med["plain"], "vs_plain_paired": paired,
               "runs": runs[name]}
        rows.append(row)
        print(f"{name:<26} {med[name]:>15.0f} {row['c_over_a']:>6.3f} {row['vs_plain']:>9.3f} {paired:>7.3f} "
              f"{' '.join(f'{r:.0f}' for r in runs[name]):>26}")
    print(f"\nwhere a step's time goes (DDP's own logging, rank 0, medians over repeats; ms): "
          f"{'step':>6} {'bwd compute':>12} {'all-reduce':>11} {'overlap':>8} {'exposed comm':>13}  bucket bytes")
    for name in COMM_SETTINGS:
        def median_ms(key, logs=ddp_logs[name]):
            values = [d[key] / 1e6 for d in logs if key in d]
            return statistics.median(values) if values else float("nan")
        compute, comm = median_ms("avg_backward_compute_time"), median_ms("avg_backward_comm_time")
        overlap = median_ms("avg_backward_compute_comm_overlap_time")
        buckets = ddp_logs[name][-1].get("rebuilt_bucket_sizes", "") if ddp_logs[name] else ""
        row = next(r for r in rows if r["setting"] == name)
        row.update(step_ms=statistics.median(step_ms[name]), backward_compute_ms=compute, allreduce_ms=comm,
                   overlap_ms=overlap, exposed_comm_ms=comm - overlap, bucket_sizes=buckets)
        print(f"{name:<26} {row['step_ms']:>6.1f} {compute:>12.1f} {comm:>11.1f} {overlap:>8.1f} "
              f"{comm - overlap:>13.1f}  {buckets}")
    # The paired ratio decides: a repeat's settings ran back to back, so drift between repeats cancels.
    best = max(rows, key=lambda r: r["vs_plain_paired"])
    best_fp32 = max((r for r in rows if r["overrides"].get("precision.autocast") != "true"),
                    key=lambda r: r["vs_plain_paired"])
    spread = {k: (max(v) - min(v)) / statistics.median(v) for k, v in runs.items()}
    print(f"\nbest (paired): {best['setting']} at {best['vs_plain_paired']:.3f}x plain DDP (target >= 1.05: "
          f"{'met' if best['vs_plain_paired'] >= 1.05 else 'NOT met'}); its c/a {best['c_over_a']:.3f} against the "
          f"ceiling e/b {ceiling:.3f}; run-to-run spread (max - min) / median: {min(spread.values()):.0%} to "
          f"{max(spread.values()):.0%}")
    print(f"best in fp32 (no autocast): {best_fp32['setting']} at {best_fp32['vs_plain_paired']:.3f}x plain DDP")
    out = {"description": "(c) DDPTrainer on 2 processes under DDP settings; tokens/s global over ranks; see "
                          "bench/throughput.py docstring",
           "torch": torch.__version__, "cores": len(os.sched_getaffinity(0)), "config": str(CONFIG.relative_to(ROOT)),
           "git": git_state(), "cpu_busy_before_start": busy_before,
           "load_average_1min": {"before": load_before[0], "after": os.getloadavg()[0]},
           "warmup_steps": args.warmup, "timed_steps": args.steps, "repeats": args.repeats,
           "a_median_tokens_per_sec": med["a"], "b_median_tokens_per_sec": med["b"],
           "e_median_tokens_per_sec": med["e"], "ceiling_e_over_b": ceiling,
           "runs": {k: runs[k] for k in ("a", "b", "e")}, "settings": rows, "best": best["setting"],
           "best_vs_plain_paired": best["vs_plain_paired"], "best_fp32": best_fp32["setting"],
           "best_fp32_vs_plain_paired": best_fp32["vs_plain_paired"], "spread": spread}
    write_results(args.out, out)
    return 0


def orchestrate_compile(args) -> int:
    """(a) and (c), eager and compiled (inductor), interleaved in every repeat."""
    clean_up_children_on_exit()
    import torch
    busy_before = busy_fraction()
    print(f"torch {torch.__version__}; warm-up {args.warmup} steps, timed {args.steps} steps, {args.repeats} "
          f"repeat(s); CPU busy before start {busy_before:.0%}", flush=True)
    variants = {f"{kind} {n} process{'es' if n > 1 else ''}": (n, overrides) for n in (1, 2)[:args.max_procs]
                for kind, overrides in (("eager", {}), ("compiled", {"compile.enabled": True}))}
    runs: dict[str, list[dict]] = {k: [] for k in variants}
    with tempfile.TemporaryDirectory(prefix="bench_compile_") as tmpdir:
        for i in range(args.repeats):
            for j, (name, (nproc, overrides)) in enumerate(variants.items()):
                runs[name].append(run_variant("framework", nproc, Path(tmpdir), f"r{i}_{j}", args, overrides))
        kill_children()
    rows = []
    print(f"\n{'variant':<22} {'tok/s':>8} {'vs eager (paired)':>18} {'first step s':>13} {'process wall s':>15}")
    for name, results in runs.items():
        eager = runs[name.replace("compiled", "eager")]
        row = {"variant": name, "median_tokens_per_sec": statistics.median(r["tokens_per_sec"] for r in results),
               "vs_eager_paired": statistics.median(r["tokens_per_sec"] / e["tokens_per_sec"]
                                                    for r, e in zip(results, eager, strict=True)),
               "median_first_step_s": statistics.median(r["first_step_s"] for r in results),
               "median_process_wall_s": statistics.median(r["process_wall_s"] for r in results),
               "runs_tokens_per_sec": [r["tokens_per_sec"] for r in results]}
        rows.append(row)
        print(f"{name:<22} {row['median_tokens_per_sec']:>8.0f} {row['vs_eager_paired']:>18.3f} "
              f"{row['median_first_step_s']:>13.2f} {row['median_process_wall_s']:>15.1f}")
    out = {"description": "DDPTrainer eager vs compile=true (inductor), 1 and 2 processes; first_step_s holds the "
                          "compilation; see bench/throughput.py docstring",
           "torch": torch.__version__, "git": git_state(), "cpu_busy_before_start": busy_before,
           "warmup_steps": args.warmup, "timed_steps": args.steps, "repeats": args.repeats, "variants": rows}
    write_results(args.out, out)
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="short smoke run (few steps, one repeat)")
    p.add_argument("--steps", type=int, help="timed steps per run (default 150; 30 with --quick)")
    p.add_argument("--warmup", type=int, help="untimed warm-up steps per run (default 20; 5 with --quick)")
    p.add_argument("--repeats", type=int, help="interleaved repeats of a/b and c/d (default 3; 1 with --quick)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds allowed per variant run")
    p.add_argument("--variants", default="abcde", help="subset of abcde to run (default: all)")
    p.add_argument("--out", help=f"JSON output path (default {RESULTS.relative_to(ROOT)}, or "
                   f"{COMM_RESULTS.relative_to(ROOT)} with --comm-hooks)")
    # worker mode (internal)
    p.add_argument("--worker", choices=["framework", "bare"], help=argparse.SUPPRESS)
    p.add_argument("--workdir", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--copy", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--set", default="{}", help=argparse.SUPPRESS)
    p.add_argument("--comm-hooks", action="store_true",
                   help="compare DDP communication hooks and bucket settings (see above)")
    p.add_argument("--settings", help="with --comm-hooks: a comma-separated subset of the settings (plain is "
                   "always run)")
    p.add_argument("--compile", action="store_true", help="compare eager and compile=true at 1 and 2 processes")
    p.add_argument("--max-procs", type=int, choices=(1, 2), default=2,
                   help="with --compile: 1 = the 1-process variants only (one GPU cannot hold 2 NCCL ranks)")
    p.add_argument("--cold-cache", action="store_true",
                   help="with --compile: each run compiles into a fresh inductor cache (a first run's cost)")
    args = p.parse_args()
    args.steps = args.steps or (30 if args.quick else 150)
    args.warmup = args.warmup or (5 if args.quick else 20)
    args.repeats = args.repeats or (1 if args.quick else 3)
    args.out = args.out or str(COMM_RESULTS if args.comm_hooks else COMPILE_RESULTS if args.compile else RESULTS)
    if args.worker:
        worker_main(args)
        return 0
    if args.comm_hooks:
        if args.settings:
            wanted = {"plain", *args.settings.split(",")}
            if wanted - set(COMM_SETTINGS):
                p.error(f"--settings: unknown {sorted(wanted - set(COMM_SETTINGS))}; "
                        f"allowed: {', '.join(COMM_SETTINGS)}")
            for name in set(COMM_SETTINGS) - wanted:
                del COMM_SETTINGS[name]
        return orchestrate_comm_hooks(args)
    if args.compile:
        return orchestrate_compile(args)
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
