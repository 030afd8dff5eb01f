#!/usr/bin/env python3
"""Activation memory of the built-in GPT under each memory saver, on this machine, in one run.

Model: framework.model.GPT, 8 layers, hidden 384, 6 heads (head size 64), vocab 256, seq_len 2048,
batch 1, dropout 0 (nanoGPT's shakespeare-char width; 15.4M parameters), fp32 on CPU. Steps go
through DDPTrainer (1 process, so no DDP wrapper): ``forward_backward`` then ``optimizer_step``
(grad clip 1.0, AdamW), on the synthetic Markov data. Every process uses torch.set_num_threads(2).

Modes, each in a fresh subprocess of this script, run one after another (never concurrently):
  off              no saver
  non_reentrant    gradient_checkpointing=non_reentrant on every Block
  reentrant        gradient_checkpointing=reentrant on every Block
  offload          non_reentrant + CpuOffload of what checkpointing keeps
  tiled8           tiled_mlp_chunks=8, checkpointing off
  nr+tiled8        non_reentrant + tiled_mlp_chunks=8

Per mode, 3 steps (forward+backward+AdamW step):
  saved bytes      torch.autograd.graph.saved_tensors_hooks wrapped around the forward (model call
                   and loss), an outer counting hook that keeps every tensor as it is. Bytes are
                   counted once per distinct storage (views of one buffer count once) and
                   parameters are left out (tensors sharing a parameter's storage, or leaves that
                   require grad). Inside a checkpointed region torch's own inner hook takes
                   precedence, so the outer hook sees what stays alive from forward to backward:
                   the block inputs checkpointing keeps, plus everything outside the blocks. In
                   offload mode CpuOffload is the inner hook for the block inputs, so the outer
                   hook does not see them; OffloadStats.packed_bytes shows them (on a GPU machine
                   those bytes live in CPU memory).
  peak RSS         resource.getrusage(RUSAGE_SELF).ru_maxrss of the mode's process (KiB), and
                   the RSS just before the first step (model, optimizer, data, imports).
  step time        wall (perf_counter) and process CPU time of forward_backward+optimizer_step;
                   the median over the steps after the first. Since other jobs share the machine,
                   the checkpointing cost is also measured in --timing-rounds extra processes
                   (default 2) that each build an off, a non_reentrant and a reentrant trainer and
                   alternate their steps (off, nr, re, off, nr, re, ...; the first round is
                   warm-up): the ratio is the median over the step pairs that ran side by side.
  CUDA peak        torch.cuda.max_memory_allocated, only when torch.cuda.is_available().

The MLP's peak intermediate memory is measured in a separate process on one MLP module of the
same width (CPU, fp32, input (1, T, C) requiring grad, one forward+backward):
  - torch.profiler (profile_memory=True): the allocation/free events give the live bytes of the
    4C-wide buffers (allocations of exactly B*t*4C*4 bytes, t = T or a chunk length; the sizes
    are checked not to collide with weight-, bias- or C-wide buffers): the peak over forward +
    backward and the amount still live at the end of forward. Also the peak of all allocations
    (grads of x and of the weights included), for reference.
  - saved_tensors_hooks around the forward and the backward (the tiled backward recomputes under
    them): the 4C-wide tensors saved for backward, live bytes tracked until autograd frees them.
Analytic: plain MLP holds fc(x) and gelu(fc(x)), 2*B*T*4C*4 bytes, from forward to backward and
peaks at 3*B*T*4C*4 in backward (plus the gradient of gelu's output); the tiled MLP holds none and
peaks at 3*B*(T/k)*4C*4 while recomputing one chunk.

Targets (issue 3): checkpointing cuts saved activations by >= 60% vs off; tiled MLP (8 chunks)
cuts the MLP's peak intermediate memory by >= 3x; checkpointing costs <= 40% more step time;
on CUDA, offload's peak GPU memory is below non_reentrant's (n/a without a GPU).

usage: python bench/memory.py [--quick] [--steps N] [--timing-rounds N] [--out PATH]
Writes bench/results/memory.json (--quick: seq_len 512, one timing round, and the JSON goes to
$TMPDIR/bench_memory_quick.json unless --out is given). Takes 2-3 minutes on an idle machine (--quick: about 1).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SCRIPT = Path(__file__).resolve()
RESULTS = ROOT / "bench" / "results" / "memory.json"
THREADS = 2

MODEL = dict(vocab_size=256, hidden_size=384, num_layers=8, num_heads=6, dropout=0.0, batch_size=1)
SEQ_LEN, QUICK_SEQ_LEN = 2048, 512
TILE_CHUNKS = 8

# name -> (gradient_checkpointing, tiled_mlp_chunks)
MODES = {
    "off": ("off", 0),
    "non_reentrant": ("non_reentrant", 0),
    "reentrant": ("reentrant", 0),
    "offload": ("offload", 0),
    "tiled8": ("off", TILE_CHUNKS),
    "nr+tiled8": ("non_reentrant", TILE_CHUNKS),
}
CHECKPOINTED = ("non_reentrant", "reentrant", "offload", "nr+tiled8")
TIMED = ("off", "non_reentrant", "reentrant")  # interleaved step-time comparison

TARGET_SAVED_CUT = 0.60
TARGET_MLP_RATIO = 3.0
TARGET_TIME_OVERHEAD = 0.40


# ============================================================================ worker side ====
def rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def maxrss_kib() -> int:
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux


class SavedCounter:
    """Outer saved-tensor hook: counts what is saved for backward, keeps every tensor as it is."""

    def __init__(self, exclude_ptrs: set[int]):
        self.exclude = exclude_ptrs
        self.reset()

    def reset(self) -> None:
        self.storages: dict[int, int] = {}  # storage data_ptr -> storage bytes
        self.tensors = 0
        self.tensor_bytes = 0  # sum of the saved tensors' own sizes (views counted each time)
        self.skipped_params = 0

    def pack(self, t):
        import torch
        try:
            storage = t.untyped_storage()
            ptr, nbytes = storage.data_ptr(), storage.nbytes()
        except (RuntimeError, NotImplementedError, TypeError):
            return t
        if ptr in self.exclude or isinstance(t, torch.nn.Parameter) or (t.is_leaf and t.requires_grad):
            self.skipped_params += 1
            return t
        if nbytes == 0:
            return t
        self.tensors += 1
        self.tensor_bytes += t.numel() * t.element_size()
        self.storages.setdefault(ptr, nbytes)
        return t

    @staticmethod
    def unpack(t):
        return t

    @property
    def unique_bytes(self) -> int:
        return sum(self.storages.values())

    def hooks(self):
        import torch
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


def build_trainer(mode: str, workdir: Path, seq_len: int, steps: int):
    from framework.trainer import DDPTrainer
    ckpt, chunks = MODES[mode]
    cfg = dict(MODEL, seq_len=seq_len, gradient_checkpointing=ckpt, tiled_mlp_chunks=chunks,
               data="synthetic", dataset_size=max(4, steps), num_workers=0, max_steps=steps,
               target_loss=0.0, eval_interval=0, tensorboard=False, progress_bar="false",
               log_dir=str(workdir / "logs"), checkpoint_dir=str(workdir / "checkpoints"))
    return DDPTrainer(cfg)


class Stepper:
    """Runs DDPTrainer steps (forward_backward + optimizer_step), optionally under the counter."""

    def __init__(self, trainer, count: bool):
        import torch
        self.trainer = trainer
        self.cuda = trainer.env.device.type == "cuda"
        raw = trainer.raw_model
        self.counter = counter = SavedCounter({p.untyped_storage().data_ptr() for p in raw.parameters()})
        if count:
            class Counted(torch.nn.Module):
                """The model call under the counting hook; the trainer calls it as its model."""

                def __init__(self, inner):
                    super().__init__()
                    self.inner = inner

                def forward(self, *a, **kw):
                    with counter.hooks():
                        return self.inner(*a, **kw)

            loss_fn = trainer.loss_fn

            def counted_loss(logits, targets):
                with counter.hooks():
                    return loss_fn(logits, targets)

            trainer.model = Counted(trainer.model)  # forward_backward only calls self.model(inputs)
            trainer.loss_fn = counted_loss
        trainer.model.train()
        self.batches = iter(trainer.loader)

    def step(self) -> dict:
        import torch
        trainer, counter, stats = self.trainer, self.counter, self.trainer.offload_stats
        micro = [next(self.batches) for _ in range(trainer.sampler.accumulation)]
        counter.reset()
        packed0 = stats.packed_bytes
        t0, c0 = time.perf_counter(), time.process_time()
        loss = trainer.forward_backward(micro)
        trainer.optimizer_step(loss)
        if self.cuda:
            torch.cuda.synchronize()
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        trainer.sampler.advance()
        trainer.step += 1
        return dict(wall_s=wall, cpu_s=cpu, loss=float(loss), saved_bytes=counter.unique_bytes,
                    saved_tensor_bytes=counter.tensor_bytes, saved_tensors=counter.tensors,
                    skipped_param_saves=counter.skipped_params,
                    offload_packed_bytes=stats.packed_bytes - packed0)


def worker_mode(args) -> dict:
    import torch
    torch.set_num_threads(THREADS)
    trainer = build_trainer(args.mode, Path(args.workdir), args.seq_len, args.steps)
    stepper = Stepper(trainer, count=True)
    rss_before = rss_kib()
    if stepper.cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    steps = [stepper.step() for _ in range(args.steps)]
    ckpt, chunks = MODES[args.mode]
    return dict(mode=args.mode, gradient_checkpointing=ckpt, tiled_mlp_chunks=chunks,
                checkpointed_modules=len(trainer.checkpointed), device=str(trainer.env.device),
                amp=bool(trainer.amp), threads=torch.get_num_threads(),
                parameters=sum(p.numel() for p in trainer.raw_model.parameters()), steps=steps,
                rss_before_steps_kib=rss_before, peak_rss_kib=maxrss_kib(),
                cuda_peak_bytes=torch.cuda.max_memory_allocated() if stepper.cuda else None)


def worker_timing(args) -> dict:
    """Step time only: one trainer per TIMED mode in this process, their steps interleaved
    (off, nr, re, off, nr, re, ...), so the machine's drift hits every mode alike."""
    import torch
    torch.set_num_threads(THREADS)
    steppers = {m: Stepper(build_trainer(m, Path(args.workdir) / m, args.seq_len, args.steps + 1), count=False)
                for m in TIMED}
    steps = {m: [] for m in TIMED}
    for _ in range(args.steps + 1):  # the first round is warm-up
        for m, s in steppers.items():
            steps[m].append(s.step())
    return dict(steps=steps)


def worker_mlp(args) -> dict:
    """Peak intermediate memory of one MLP, plain and tiled, measured (profiler + hooks)."""
    import weakref

    import torch
    from torch.profiler import ProfilerActivity, profile

    from framework.model import MLP, GPTConfig
    torch.set_num_threads(THREADS)
    B, T, C = MODEL["batch_size"], args.seq_len, MODEL["hidden_size"]
    results = {}
    for chunks in (0, TILE_CHUNKS):
        torch.manual_seed(0)
        mlp = MLP(GPTConfig(MODEL["vocab_size"], T, C, MODEL["num_layers"], MODEL["num_heads"], 0.0,
                            False, chunks)).train()
        x = torch.randn(B, T, C, requires_grad=True)
        grad_out = torch.randn(B, T, C)
        lengths = sorted({c.size(1) for c in x.detach().chunk(chunks, dim=1)}) if chunks else [T]
        wide_sizes = {B * t * 4 * C * 4 for t in lengths}
        other_sizes = ({4 * C * C * 4, 4 * C * 4, C * 4, B * T * C * 4}
                       | {B * t * C * 4 for t in lengths})
        collision = bool(wide_sizes & other_sizes)

        # Saved-tensor hooks, live bytes tracked through a holder object that autograd drops
        # when it frees the saved tensor.
        exclude = {p.untyped_storage().data_ptr() for p in mlp.parameters()} | {x.untyped_storage().data_ptr()}
        live = {"now": 0, "peak": 0, "saves": 0}

        class Held:
            __slots__ = ("t", "__weakref__")

        def release(n, live=live):
            live["now"] -= n

        def pack(t, live=live, exclude=exclude):
            if t.untyped_storage().data_ptr() in exclude or t.dim() == 0 or t.size(-1) != 4 * C:
                return t
            h = Held()
            h.t = t
            n = t.numel() * t.element_size()
            live["now"] += n
            live["saves"] += 1
            live["peak"] = max(live["peak"], live["now"])
            weakref.finalize(h, release, n)
            return h

        def unpack(h):
            return h.t if isinstance(h, Held) else h

        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                y = mlp(x)
                held_after_forward = live["now"]
                with torch.profiler.record_function("bench::backward"):
                    y.backward(grad_out)
            del y
        events = [e for e in prof.profiler.kineto_results.events()]
        boundary = min((e.start_ns() for e in events if e.name() == "bench::backward"), default=None)
        mem = sorted((e.start_ns(), e.nbytes()) for e in events
                     if e.name() == "[memory]" and e.device_type().name == "CPU")
        total = peak_total = wide = peak_wide = 0
        wide_at_boundary = None
        for ts, n in mem:
            if boundary is not None and wide_at_boundary is None and ts >= boundary:
                wide_at_boundary = wide
            total += n
            peak_total = max(peak_total, total)
            if abs(n) in wide_sizes:
                wide += n
                peak_wide = max(peak_wide, wide)
        if wide_at_boundary is None:
            wide_at_boundary = wide
        unit = B * T * 4 * C * 4
        results["tiled" if chunks else "plain"] = dict(
            chunks=chunks, shape=[B, T, C], chunk_lengths=lengths,
            profiler_peak_4c_bytes=peak_wide, profiler_4c_live_after_forward_bytes=wide_at_boundary,
            profiler_peak_all_bytes=peak_total, profiler_size_collision=collision,
            hooks_saved_after_forward_bytes=held_after_forward, hooks_peak_saved_bytes=live["peak"],
            hooks_saves=live["saves"],
            analytic_held_bytes=0 if chunks else 2 * unit,
            analytic_peak_4c_bytes=3 * B * max(lengths) * 4 * C * 4,
            analytic_saved_peak_bytes=2 * B * max(lengths) * 4 * C * 4,
            grads_bytes=B * T * C * 4 + sum(p.numel() * 4 for p in mlp.parameters()))
    return results


# ============================================================================ driver side ====
def run_worker(kind: str, args, workdir: Path, extra: list[str]) -> dict:
    result = workdir / f"{kind}.json"
    cmd = [sys.executable, str(SCRIPT), "--worker", kind, "--result", str(result), "--workdir", str(workdir),
           "--seq-len", str(args.seq_len), "--steps", str(args.steps), *extra]
    env = dict(os.environ, OMP_NUM_THREADS=str(THREADS), PYTHONUNBUFFERED="1")
    env.pop("WORLD_SIZE", None)
    env.pop("RANK", None)
    workdir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          stdin=subprocess.DEVNULL, text=True, timeout=args.timeout)
    if proc.returncode != 0 or not result.exists():
        sys.stdout.write(proc.stdout[-4000:])
        raise SystemExit(f"worker {kind} {extra} failed with exit code {proc.returncode}")
    out = json.loads(result.read_text())
    out["process_wall_s"] = time.perf_counter() - t0
    return out


def mib(n) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}"


def median_after_first(steps, key="wall_s"):
    vals = [s[key] for s in steps[1:]] or [s[key] for s in steps]
    return statistics.median(vals)


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help=f"seq_len {QUICK_SEQ_LEN}, one timing round")
    p.add_argument("--steps", type=int, default=3, help="training steps per mode (default 3)")
    p.add_argument("--timing-rounds", type=int, default=None,
                   help="extra processes that interleave off/non_reentrant/reentrant steps (default 2, quick 1)")
    p.add_argument("--seq-len", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, default=None, help="JSON path (default bench/results/memory.json)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per worker process")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--mode", choices=list(MODES), help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--workdir", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.seq_len is None:
        args.seq_len = QUICK_SEQ_LEN if args.quick else SEQ_LEN

    if args.worker:
        out = {"mlp": worker_mlp, "timing": worker_timing, "mode": worker_mode}[args.worker](args)
        Path(args.result).write_text(json.dumps(out, indent=2))
        return 0

    if args.steps < 2:
        p.error("--steps must be at least 2 (the first step is excluded from timing)")
    rounds = args.timing_rounds if args.timing_rounds is not None else (1 if args.quick else 2)
    out_path = args.out or (Path(tempfile.gettempdir()) / "bench_memory_quick.json" if args.quick else RESULTS)
    import torch
    cuda = torch.cuda.is_available()
    started = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="bench_memory_"))
    print(f"GPT {MODEL['num_layers']} layers, hidden {MODEL['hidden_size']}, {MODEL['num_heads']} heads, "
          f"vocab {MODEL['vocab_size']}, seq_len {args.seq_len}, batch {MODEL['batch_size']}, dropout 0, "
          f"{args.steps} steps/mode, {THREADS} threads, torch {torch.__version__}, "
          f"{'cuda' if cuda else 'cpu'}", flush=True)

    print("MLP probe ...", flush=True)
    mlp = run_worker("mlp", args, tmp / "mlp", [])
    modes = {}
    for name in MODES:
        print(f"mode {name} ...", end=" ", flush=True)
        modes[name] = run_worker("mode", args, tmp / f"mode_{name}", ["--mode", name])
        print(f"{median_after_first(modes[name]['steps']):.2f} s/step", flush=True)
    rounds_out = []
    for r in range(rounds):
        print(f"timing round {r + 1}/{rounds}: {', '.join(TIMED)} interleaved in one process ...", end=" ", flush=True)
        res = run_worker("timing", args, tmp / f"timing_{r}", [])
        rounds_out.append(res["steps"])
        print(", ".join(f"{m} {median_after_first(v):.2f}" for m, v in res["steps"].items()) + " s/step", flush=True)

    # ------------------------------------------------------------------------------ table ----
    off_saved = modes["off"]["steps"][-1]["saved_bytes"]
    rows = []
    header = (f"{'mode':<14} {'saved MiB':>9} {'vs off':>7} {'offload MiB':>11} {'peak RSS MiB':>12} "
              f"{'RSS0 MiB':>8} {'step s':>7} {'cpu s':>6} {'CUDA peak MiB':>13}")
    print()
    print(header)
    print("-" * len(header))
    for name, res in modes.items():
        last = res["steps"][-1]
        saved = last["saved_bytes"]
        off_b = last["offload_packed_bytes"] if name == "offload" else None
        row = dict(mode=name, saved_bytes=saved, saved_vs_off=saved / off_saved,
                   saved_bytes_per_step=[s["saved_bytes"] for s in res["steps"]],
                   saved_tensors=last["saved_tensors"], saved_tensor_bytes=last["saved_tensor_bytes"],
                   offload_packed_bytes=off_b, peak_rss_kib=res["peak_rss_kib"],
                   rss_before_steps_kib=res["rss_before_steps_kib"],
                   median_step_s=median_after_first(res["steps"]),
                   median_step_cpu_s=median_after_first(res["steps"], "cpu_s"),
                   step_wall_s=[s["wall_s"] for s in res["steps"]],
                   step_cpu_s=[s["cpu_s"] for s in res["steps"]],
                   losses=[s["loss"] for s in res["steps"]],
                   cuda_peak_bytes=res["cuda_peak_bytes"], checkpointed_modules=res["checkpointed_modules"])
        rows.append(row)
        print(f"{name:<14} {mib(saved):>9} {saved / off_saved:>7.1%} {mib(off_b):>11} "
              f"{res['peak_rss_kib'] / 1024:>12.0f} {res['rss_before_steps_kib'] / 1024:>8.0f} "
              f"{row['median_step_s']:>7.2f} {row['median_step_cpu_s']:>6.2f} "
              f"{mib(res['cuda_peak_bytes']) if cuda else 'n/a (no GPU)':>13}")
    print("saved = distinct non-parameter storages saved for backward in forward+loss (outer hook); "
          "offload = OffloadStats.packed_bytes per step (block inputs, on CPU on a GPU machine)")

    pl, ti = mlp["plain"], mlp["tiled"]
    print()
    hidden = MODEL["hidden_size"]
    print(f"MLP (B=1, T={args.seq_len}, C={hidden}, 4C={4 * hidden}), one forward+backward:")
    print(f"  {'':<8} {'peak 4C MiB':>11} {'analytic':>8} {'4C after fwd':>12} {'saved peak':>10} "
          f"{'analytic':>8} {'peak all MiB':>12}")
    for label, r in (("plain", pl), (f"tiled{TILE_CHUNKS}", ti)):
        print(f"  {label:<8} {mib(r['profiler_peak_4c_bytes']):>11} {mib(r['analytic_peak_4c_bytes']):>8} "
              f"{mib(r['profiler_4c_live_after_forward_bytes']):>12} {mib(r['hooks_peak_saved_bytes']):>10} "
              f"{mib(r['analytic_saved_peak_bytes']):>8} {mib(r['profiler_peak_all_bytes']):>12}")
    print("  peak 4C = live (B,t,4C) fp32 buffers from torch.profiler memory events; saved peak = live 4C-wide "
          "tensors saved for backward (saved_tensors_hooks, recompute included); peak all = every allocation "
          "(incl. grads of x and weights)")

    # ------------------------------------------------------------------------------ ratios ---
    targets = []

    def target(name, value, ok, text):
        targets.append(dict(name=name, value=value, passed=ok, text=text))
        print(f"{verdict(ok)}  {text}")

    print()
    for name in CHECKPOINTED:
        row = next(r for r in rows if r["mode"] == name)
        cut = 1 - row["saved_vs_off"]
        extra = ""
        if name == "offload":
            both = row["saved_bytes"] + (row["offload_packed_bytes"] or 0)
            extra = f" (device-resident; {1 - both / off_saved:.1%} counting the offloaded bytes too)"
        target(f"saved_cut_{name}", cut, cut >= TARGET_SAVED_CUT,
               f"saved activations {name} vs off: -{cut:.1%}{extra} (target >= {TARGET_SAVED_CUT:.0%})")
    ratio = pl["profiler_peak_4c_bytes"] / max(1, ti["profiler_peak_4c_bytes"])
    hooks_ratio = pl["hooks_peak_saved_bytes"] / max(1, ti["hooks_peak_saved_bytes"])
    analytic = pl["analytic_peak_4c_bytes"] / ti["analytic_peak_4c_bytes"]
    target("mlp_peak_ratio", ratio, ratio >= TARGET_MLP_RATIO and not ti["profiler_size_collision"],
           f"MLP peak intermediate plain/tiled{TILE_CHUNKS}: {ratio:.2f}x profiler, {hooks_ratio:.2f}x "
           f"saved-tensor hooks, {analytic:.2f}x analytic (target >= {TARGET_MLP_RATIO:.0f}x)")
    all_ratio = pl["profiler_peak_all_bytes"] / max(1, ti["profiler_peak_all_bytes"])
    print(f"info  MLP peak of all allocations plain/tiled{TILE_CHUNKS}: {all_ratio:.2f}x "
          f"({mib(pl['profiler_peak_all_bytes'])} vs {mib(ti['profiler_peak_all_bytes'])} MiB; includes "
          f"{mib(pl['grads_bytes'])} MiB of x/weight grads)")

    # Step time. Paired: within each timing round, step i of a mode over step i of off (the
    # steps alternate, so both saw the same load); the median over all rounds' timed steps.
    # Separate: each mode's own process from the table, over off's (noisier).
    off_t = statistics.median(s["wall_s"] for s in modes["off"]["steps"][1:])
    off_c = statistics.median(s["cpu_s"] for s in modes["off"]["steps"][1:])
    step_time = dict(separate_off_median_s=off_t, paired={}, rounds=rounds_out)
    for name in [m for m in MODES if m != "off"]:
        row = next(r for r in rows if r["mode"] == name)
        sep, sep_c = row["median_step_s"] / off_t - 1, row["median_step_cpu_s"] / off_c - 1
        text = f"{sep:+.1%} wall, {sep_c:+.1%} CPU time in separate processes"
        value = sep
        if name in TIMED and rounds_out:
            pairs = [(steps[name][i], steps["off"][i]) for steps in rounds_out for i in range(1, len(steps["off"]))]
            wall = statistics.median(a["wall_s"] / o["wall_s"] for a, o in pairs) - 1
            cpu = statistics.median(a["cpu_s"] / o["cpu_s"] for a, o in pairs) - 1
            med_a = statistics.median(a["wall_s"] for a, _ in pairs)
            med_o = statistics.median(o["wall_s"] for _, o in pairs)
            step_time["paired"][name] = dict(wall_overhead=wall, cpu_overhead=cpu, pairs=len(pairs),
                                             median_s=med_a, off_median_s=med_o)
            text = (f"{wall:+.1%} wall, {cpu:+.1%} CPU time (median of {len(pairs)} interleaved step pairs, "
                    f"{med_a:.2f} vs {med_o:.2f} s); " + text)
            value = wall
        if name in ("non_reentrant", "reentrant"):
            target(f"time_overhead_{name}", value, value <= TARGET_TIME_OVERHEAD,
                   f"step time {name} vs off: {text} (target <= {TARGET_TIME_OVERHEAD:.0%})")
        else:
            print(f"info  step time {name} vs off: {text}")
    if cuda:
        nr_peak = modes["non_reentrant"]["cuda_peak_bytes"]
        of_peak = modes["offload"]["cuda_peak_bytes"]
        target("cuda_offload_below_non_reentrant", of_peak / nr_peak, of_peak < nr_peak,
               f"CUDA peak offload vs non_reentrant: {mib(of_peak)} vs {mib(nr_peak)} MiB")
    else:
        targets.append(dict(name="cuda_offload_below_non_reentrant", value=None, passed=None,
                            text="n/a (no GPU)"))
        print("n/a   CUDA peak memory offload vs non_reentrant: n/a (no GPU)")

    elapsed = time.perf_counter() - started
    print(f"\ntotal {elapsed:.0f} s")
    result = dict(
        description="activation memory per memory-saving mode; see bench/memory.py docstring",
        quick=args.quick, torch=torch.__version__, python=platform.python_version(), cores=os.cpu_count(),
        threads=THREADS, device="cuda" if cuda else "cpu",
        model=dict(MODEL, seq_len=args.seq_len, parameters=modes["off"]["parameters"]),
        steps_per_mode=args.steps, timing_rounds=rounds, modes=rows, mlp=mlp,
        step_time=step_time,
        targets=targets, elapsed_s=elapsed)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=2) + "\n")
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"wrote {out_path.relative_to(ROOT) if out_path.is_relative_to(ROOT) else out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
