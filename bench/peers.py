#!/usr/bin/env python3
"""The framework against its peers: the same GPT, data, optimizer, schedule, clip and thread
count under DDPTrainer, PyTorch Lightning's Trainer, HF Accelerate and a bare loop, at 1 and 2
processes, in fresh processes, interleaved and repeated.

Everything but the training loop comes from bench/throughput.py: the config
(configs/nanogpt_shakespeare_char.toml, batch 12 per process, 1 thread per process, fp32 on CPU),
the model (framework.model.gpt.GPT), AdamW with the framework's parameter groups, kernels and warmup/cosine
schedule, clip 1.0, the end-of-step clock, the launch (torchrun, c10d on 127.0.0.1, gloo), and the
steady-state tokens/s over the same window of steps. The bare loop, Lightning and Accelerate draw
the same random windows of the same token array (the bare loop's generator); DDPTrainer reads its
own sampler's order. Lightning and Accelerate are optional: a missing one is reported as "not
installed", never an error (pip install lightning accelerate).

Reports per variant: steady-state tokens/s (median of the repeats), whole-process wall time
(start-up, the final evaluation and save of DDPTrainer included), and the final training loss.

usage: python bench/peers.py [--steps 150] [--warmup 20] [--repeats 2]
Prints a table and writes bench/results/peers.json.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "bench"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import throughput  # noqa: E402  (bench/throughput.py, after the path is set)

RESULTS = ROOT / "bench" / "results" / "peers.json"
PEERS = ("framework", "bare", "lightning", "accelerate")
OPTIONAL = {"lightning": "lightning", "accelerate": "accelerate"}


# ============================================================================ worker side ====
def windows(cfg, rank: int):
    """The bare loop's batches: the framework's train tokens, random windows from a per-rank generator."""
    import torch
    from framework.data.datasets import build_datasets
    bundle = build_datasets(cfg)
    data = torch.from_numpy(bundle.train.tokens.astype("int64"))
    gen = torch.Generator().manual_seed(cfg.train.seed + 1 + rank)
    offsets = torch.arange(cfg.model.seq_len + 1)
    for _ in range(cfg.train.max_steps):
        ix = torch.randint(len(data) - cfg.model.seq_len - 1, (cfg.data.batch_size,), generator=gen)
        yield data[ix[:, None] + offsets]


def model_and_optimizer(cfg):
    import dataclasses

    import torch
    from framework.data.datasets import build_datasets
    from framework.model.gpt import GPT, GPTConfig
    from framework.train.optim import build_optimizer, lr_at
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=build_datasets(cfg).vocab_size))
    torch.manual_seed(cfg.train.seed)
    model = GPT(GPTConfig.from_train_config(cfg))
    # The framework's AdamW kernels (optimizer_impl) for every peer: the comparison is of the loops.
    opt = build_optimizer(model, lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay,
                          betas=(cfg.optim.beta1, cfg.optim.beta2), impl=cfg.optim.impl)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: lr_at(
        step, lr=cfg.optim.lr, warmup_steps=cfg.optim.warmup_steps, total_steps=cfg.train.max_steps,
        min_lr=cfg.optim.min_lr) / cfg.optim.lr)
    return cfg, model, opt, sched


def run_lightning(cfg, clock) -> dict:
    import lightning as L
    import torch
    from lightning.pytorch.strategies import DDPStrategy
    from framework.model.gpt import lm_loss
    world = int(os.environ.get("WORLD_SIZE", 1))
    rank = int(os.environ.get("RANK", 0))
    cfg, model, opt, sched = model_and_optimizer(cfg)
    batches = list(windows(cfg, rank))

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.gpt = model
            self.last_loss = None

        def training_step(self, rows, _):
            loss = lm_loss(self.gpt(rows[0, :, :-1]), rows[0, :, 1:])
            self.last_loss = loss.detach()
            return loss

        def on_train_batch_end(self, *args):
            clock.tick()

        def configure_optimizers(self):
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    # One item per step, already this rank's batch: no sampler of Lightning's reorders it.
    loader = torch.utils.data.DataLoader([b.unsqueeze(0) for b in batches], batch_size=None)
    strategy = DDPStrategy(process_group_backend="gloo") if world > 1 else "auto"
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=cfg.train.max_steps,
                        gradient_clip_val=cfg.optim.grad_clip, enable_checkpointing=False, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                        num_sanity_val_steps=0)
    module = Module()
    trainer.fit(module, loader)
    return {"rank": rank, "world_size": world, "final_train_loss": float(module.last_loss),
            "tokens_per_step": cfg.data.batch_size * cfg.model.seq_len * world}


def run_accelerate(cfg, clock) -> dict:
    import torch
    from accelerate import Accelerator
    from framework.model.gpt import lm_loss
    accelerator = Accelerator(cpu=True)
    rank, world = accelerator.process_index, accelerator.num_processes
    cfg, model, opt, sched = model_and_optimizer(cfg)
    # The scheduler stays out of prepare(): Accelerate would step it once per process per step.
    model, opt = accelerator.prepare(model, opt)
    model.train()
    loss = None
    for rows in windows(cfg, rank):
        loss = lm_loss(model(rows[:, :-1]), rows[:, 1:])
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        clock.tick()
    accelerator.end_training()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return {"rank": rank, "world_size": world, "final_train_loss": float(loss),
            "tokens_per_step": cfg.data.batch_size * cfg.model.seq_len * world}


def worker_main(args) -> None:
    import torch
    torch.set_num_threads(1)
    workdir = Path(args.workdir)
    # The bare loop prints its loss every log_interval steps: every step, so that the last is its final loss.
    cfg = throughput.load_cfg(workdir, args.warmup + args.steps, {"log_interval": 1} if args.worker == "bare" else {})
    clock = throughput.Clock()
    run = {"framework": throughput.run_framework, "bare": throughput.run_bare, "lightning": run_lightning,
           "accelerate": run_accelerate}[args.worker]
    info = run(cfg, clock)
    if info["rank"] == 0:
        info.update(stamps=clock.wall, warmup=args.warmup, steps=args.steps)
        Path(args.result).write_text(json.dumps(info))


# ====================================================================== orchestrator side ====
def launch(kind: str, nproc: int, tmp: Path, name: str, args) -> dict:
    workdir = tmp / name
    workdir.mkdir(parents=True)
    result, log = workdir / "result.json", workdir / "output.log"
    cmd = [sys.executable]
    if nproc > 1:
        cmd += ["-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc),
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{throughput.free_port()}"]
    cmd += [str(Path(__file__).resolve()), "--worker", kind, "--steps", str(args.steps), "--warmup",
            str(args.warmup), "--workdir", str(workdir), "--result", str(result)]
    t0 = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=throughput.child_env(), stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)
    throughput.CHILDREN.append(proc)
    res = throughput.finish(proc, result, log, name, args.timeout)
    res["process_wall_s"] = time.perf_counter() - t0
    res["tokens_per_sec"] = throughput.rate(res)
    if "final_train_loss" not in res:  # DDPTrainer: its summary; the bare loop: its last printed loss
        summary = workdir / "logs" / "summary.json"
        losses = re.findall(r"loss (\d+\.\d+)", log.read_text())
        res["final_train_loss"] = (json.loads(summary.read_text())["final_train_loss"] if summary.is_file()
                                   else float(losses[-1]) if losses else None)
    print(f"  {name:<22} {res['tokens_per_sec']:>9.0f} tok/s  wall {res['process_wall_s']:6.1f} s  "
          f"loss {res['final_train_loss']}", flush=True)
    return res


def orchestrate(args) -> int:
    throughput.clean_up_children_on_exit()
    import torch
    missing = {k for k, module in OPTIONAL.items() if importlib.util.find_spec(module) is None}
    peers = [p for p in PEERS if p not in missing]
    busy_before = throughput.busy_fraction()
    print(f"torch {torch.__version__}; warm-up {args.warmup}, timed {args.steps} steps, {args.repeats} repeat(s); "
          f"not installed: {', '.join(sorted(missing)) or 'none'}; CPU busy before start {busy_before:.0%}", flush=True)
    runs: dict[str, list[dict]] = {f"{p} {n}": [] for n in (1, 2) for p in peers}
    with tempfile.TemporaryDirectory(prefix="bench_peers_") as tmpdir:
        for i in range(args.repeats):
            for name in runs:
                peer, nproc = name.split()
                runs[name].append(launch(peer, int(nproc), Path(tmpdir), f"{peer}_{nproc}_{i}", args))
        throughput.kill_children()
    rows = []
    print(f"\n{'peer, processes':<18} {'tok/s':>8} {'vs framework':>13} {'wall s':>7} {'vs framework':>13} "
          f"{'final loss':>11}")
    for name, results in runs.items():
        ours = runs["framework " + name.split()[1]]
        row = {"variant": name, "median_tokens_per_sec": statistics.median(r["tokens_per_sec"] for r in results),
               "tokens_per_sec_vs_framework_paired": statistics.median(
                   r["tokens_per_sec"] / o["tokens_per_sec"] for r, o in zip(results, ours, strict=True)),
               "median_process_wall_s": statistics.median(r["process_wall_s"] for r in results),
               "wall_vs_framework_paired": statistics.median(
                   r["process_wall_s"] / o["process_wall_s"] for r, o in zip(results, ours, strict=True)),
               "final_train_loss": [r["final_train_loss"] for r in results]}
        rows.append(row)
        losses = ", ".join(f"{v:.3f}" for v in row["final_train_loss"] if v is not None)
        print(f"{name:<18} {row['median_tokens_per_sec']:>8.0f} {row['tokens_per_sec_vs_framework_paired']:>13.3f} "
              f"{row['median_process_wall_s']:>7.1f} {row['wall_vs_framework_paired']:>13.3f} {losses:>11}")
    out = {"description": "DDPTrainer vs Lightning, Accelerate and a bare loop; see bench/peers.py docstring",
           "torch": torch.__version__, "not_installed": sorted(missing), "cpu_busy_before_start": busy_before,
           "warmup_steps": args.warmup, "timed_steps": args.steps, "repeats": args.repeats, "variants": rows}
    throughput.write_results(args.out, out)
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=150, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=20, help="untimed warm-up steps per run")
    p.add_argument("--repeats", type=int, default=2, help="interleaved repeats")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds allowed per run")
    p.add_argument("--out", default=str(RESULTS), help="JSON output path")
    p.add_argument("--worker", choices=PEERS, help=argparse.SUPPRESS)
    p.add_argument("--workdir", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker_main(args)
        return 0
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
