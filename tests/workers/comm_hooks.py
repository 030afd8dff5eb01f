"""Run under torchrun with 2 ranks: DDP communication hooks (ddp_comm_hook). fp16 and bf16
gradients against fp32 ones after one step (and torch's own bf16 hook on gloo), PowerSGD's loss
after N steps against plain all-reduce, PowerSGD saved and resumed (with and without its state),
a non-finite step under PowerSGD, and the log line naming the hook. Every case's result goes
into result_rank{r}.json for tests/unit/ddp/test_comm_hooks.py."""

from __future__ import annotations

import os
import shutil

import torch
import torch.distributed as dist

from tests.dist_helper import finish_worker, recorded, register_worker

GRAD_BASE = {"vocab_size": 32, "hidden_size": 32, "num_layers": 2, "num_heads": 2, "seq_len": 16, "dataset_size": 256,
             "dropout": 0.0, "num_workers": 0, "logging.tensorboard": False, "learning_rate": 1e-3,
             "optim.warmup_steps": 2, "log_interval": 1, "eval.interval": 0, "eval.steps": 2, "target_loss": 0.0,
             "train.seed": 7, "batch_size": 4}
# hidden 128: 1.55 MiB of gradients in one bucket in DDP's first backward, then in two rebuilt ones
# (bucket_cap_mb=1): PowerSGD's per-bucket state must only ever see the rebuilt ones.
TRAIN_BASE = {**GRAD_BASE, "hidden_size": 128, "learning_rate": 3e-3, "train.max_steps": 30,
              "checkpoint.every_steps": 10,
              "checkpoint.keep_last": 5, "ddp.bucket_cap_mb": 1}
POWERSGD = {"ddp.comm_hook": "powersgd", "ddp.powersgd_rank": 8, "ddp.powersgd_start_iter": 4}
RESUME_AT = 10
# static_graph (its warm-up is also PowerSGD's) with no_sync() accumulation: PowerSGD counts synced steps.
STATIC_ACCUM = {"ddp.static_graph": "true", "data.gradient_accumulation_steps": 2, "batch_size": 2,
                "train.max_steps": 12, "checkpoint.every_steps": 6}


def grads_after_one_step(name: str, overrides: dict, out_dir) -> dict[str, torch.Tensor]:
    from framework.trainer import DDPTrainer

    trainer = DDPTrainer({**GRAD_BASE, **overrides, "logging.dir": str(out_dir / name),
                          "checkpoint.dir": str(out_dir / name / "ck")})
    micro = [next(iter(trainer.stream.loader))]
    trainer.forward_backward(micro)
    grads = {n: p.grad.detach().clone() for n, p in trainer.raw_model.named_parameters()}
    trainer.close()
    return grads


def run_compressed_case(name: str, out_dir, rank: int) -> dict:
    """fp16- or bf16-compressed gradients against fp32 all-reduced ones, per tensor relative to its largest entry."""
    exact = grads_after_one_step("grad_none", {"ddp.comm_hook": "none"}, out_dir)
    half = grads_after_one_step(f"grad_{name}", {"ddp.comm_hook": name}, out_dir)
    rel = {n: ((half[n] - g).abs().max() / g.abs().max()).item() for n, g in exact.items() if g.abs().max() > 0}
    diff = {n: (half[n] - g).abs().max().item() for n, g in exact.items()}
    log = (out_dir / f"grad_{name}" / f"rank_{rank}.log").read_text()
    return {"max_rel_diff": max(rel.values()), "worst_param": max(rel, key=rel.get), "max_abs_diff": max(diff.values()),
            "logged": [line.split("INFO ", 1)[-1] for line in log.splitlines() if "communication hook" in line]}


def run_torch_bf16_hook_on_gloo() -> dict:
    """Plain torch: its own bf16 hook on a gloo DDP model, one backward."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
    model.register_comm_hook(None, default_hooks.bf16_compress_hook)
    model(torch.randn(2, 4)).sum().backward()
    return {"raised": None}


def train(name: str, overrides: dict, out_dir, **kwargs) -> dict:
    from framework.trainer import DDPTrainer

    cfg = {**TRAIN_BASE, **overrides, "logging.dir": str(out_dir / name), "checkpoint.dir": str(out_dir / name / "ck")}
    trainer = DDPTrainer(cfg, **kwargs)
    summary = trainer.train()
    state = trainer.comm_hook.state
    log = (out_dir / name / f"rank_{dist.get_rank()}.log").read_text()
    return {"summary": summary, "powersgd_iter": None if state is None else state.iter,
            "static_graph": trainer.decision.static_graph,
            "buckets_with_state": None if state is None else sorted(state.error_dict),
            "logged": [line.split("INFO ", 1)[-1] for line in log.splitlines() if "communication hook" in line]}


def strip_comm_hook_state(src, dst) -> None:
    """A copy of checkpoint ``src`` without PowerSGD's state (rank 0 writes it; every rank waits)."""
    if dist.get_rank() == 0:
        state = torch.load(src, weights_only=True)
        assert state["comm_hook"]["ranks"], "the checkpoint holds no PowerSGD state to strip"
        state["comm_hook"] = {}
        dst.parent.mkdir(parents=True, exist_ok=True)
        torch.save(state, dst)
    dist.barrier()


def run_powersgd_cases(out_dir, rank: int) -> dict:
    out = {"none": recorded(train, "train_none", {}, out_dir),
           "powersgd": recorded(train, "train_powersgd", POWERSGD, out_dir)}
    saved = out_dir / "train_powersgd" / "ck" / f"step_{RESUME_AT:08d}.pt"
    out["resumed"] = recorded(train, "resumed", {**POWERSGD, "checkpoint.resume": str(saved)}, out_dir)
    stripped = out_dir / "stripped" / "step.pt"
    recorded(strip_comm_hook_state, saved, stripped)
    out["resumed_without_state"] = recorded(train, "resumed_without_state", {**POWERSGD,
                                                                             "checkpoint.resume": str(stripped)},
                                            out_dir)
    static = {**POWERSGD, **STATIC_ACCUM}
    out["static_accum"] = recorded(train, "static_accum", static, out_dir)
    saved = out_dir / "static_accum" / "ck" / f"step_{STATIC_ACCUM['checkpoint.every_steps']:08d}.pt"
    out["static_accum_resumed"] = recorded(train, "static_accum_resumed", {**static, "checkpoint.resume": str(saved)},
                                           out_dir)
    return out


class NanOnce:
    """Makes rank 1's model output NaN in the step after ``step``, once."""

    def __init__(self, step: int):
        self.step, self.armed, self.fired = step, False, 0

    def on_step_end(self, trainer, step, metrics) -> None:
        if step == self.step and not self.fired:
            self.armed = True

    def forward_hook(self, module, args, output):
        if self.armed and dist.get_rank() == 1:
            self.armed, self.fired = False, self.fired + 1
            return output * float("nan")
        return output


def run_nonfinite_case(name: str, out_dir, keep_finite: bool) -> dict:
    """PowerSGD through one non-finite step (after compression started); ``keep_finite=False``
    disables the reset of the poisoned error feedback, to show that the test can fail."""
    from framework.ddp.comm_hooks import CommHook
    from framework.model.gpt import GPT, GPTConfig
    from framework.config import resolve_config

    cfg = {**TRAIN_BASE, **POWERSGD, "train.max_steps": 16, "checkpoint.every_steps": 0, "max_errors_per_epoch": 3}
    torch.manual_seed(cfg["train.seed"])
    model = GPT(GPTConfig.from_train_config(resolve_config(cfg)))
    nan = NanOnce(step=8)
    model.register_forward_hook(nan.forward_hook)
    original = CommHook._keep_finite
    if not keep_finite:
        CommHook._keep_finite = lambda self, state, index, reduced: reduced
    try:
        result = recorded(train, name, cfg, out_dir, model=model, callbacks=[nan])
    finally:
        CommHook._keep_finite = original
        dist.barrier()
    result["nan_fired"] = nan.fired
    return result


def main() -> None:
    out_dir = register_worker()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    results = {name: recorded(run_compressed_case, name, out_dir, rank) for name in ("fp16", "bf16")}
    results.update(run_powersgd_cases(out_dir, rank))
    results["nonfinite"] = run_nonfinite_case("nonfinite", out_dir, keep_finite=True)
    shutil.rmtree(out_dir / "nonfinite_unguarded", ignore_errors=True)
    results["nonfinite_unguarded"] = run_nonfinite_case("nonfinite_unguarded", out_dir, keep_finite=False)
    results["torch_bf16_on_gloo"] = recorded(run_torch_bf16_hook_on_gloo)  # last: it leaves its DDP mid-backward
    finish_worker(out_dir, rank, {"cases": results})


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
