"""Run under torchrun with 2 ranks: the DDP step under torch.compile (backend aot_eager, which
traces like inductor but runs aten ops, so it is fast to compile) against one eager process on
the global batch, for each memory mode; and a compiled run's checkpoint resumed uncompiled.
Every case's result goes into result_rank{r}.json for tests/unit/ddp/test_compile.py."""

from __future__ import annotations

import os

import torch.distributed as dist

from tests.dist_helper import finish_worker, recorded, register_worker
from tests.workers.ddp_equivalence import BASE, reference_grads

COMPILED = {"compile.enabled": True, "compile.backend": "aot_eager", "batch_size": 4}
GRAD_CASES = {
    "off": dict(),
    "non_reentrant": {"memory.activation_checkpointing": "non_reentrant"},
    "tiled": {"memory.tiled_mlp_chunks": 4},
    "reentrant": {"memory.activation_checkpointing": "reentrant"},
    "non_reentrant_tiled_accum2": {"memory.activation_checkpointing": "non_reentrant", "memory.tiled_mlp_chunks": 4,
                                   "data.gradient_accumulation_steps": 2},
    "offload": {"memory.activation_checkpointing": "offload"},
}


def run_grad_case(name: str, overrides: dict, out_dir, world: int) -> dict:
    from framework.ddp.compile import is_ddp
    from framework.trainer import DDPTrainer

    cfg = {**BASE, **COMPILED, **overrides, "logging.dir": str(out_dir / name), "checkpoint.dir": str(out_dir / name)}
    import torch._dynamo
    from torch._dynamo.utils import counters
    torch._dynamo.reset()  # no graph reused from the previous case
    graphs_before = counters["frames"]["ok"]
    trainer = DDPTrainer(cfg)
    assert is_ddp(trainer.model) and trainer.model is not trainer.raw_model
    batches = iter(trainer.stream.loader)
    trainer.forward_backward([next(batches) for _ in range(trainer.sampler.accumulation)])
    ref = reference_grads({**COMPILED, **overrides}, world)
    diffs = {n: (p.grad - ref[n]).abs().max().item() for n, p in trainer.raw_model.named_parameters()}
    trainer.close()
    return {"max_abs_diff": max(diffs.values()), "worst_param": max(diffs, key=diffs.get),
            "compiled_frames": counters["frames"]["ok"] - graphs_before}


def run_train(name: str, out_dir, overrides: dict | None = None, /, **keys) -> dict:
    from framework.trainer import DDPTrainer

    cfg = {**BASE, "batch_size": 4, "train.max_steps": 6, "checkpoint.every_steps": 2, **(overrides or {}), **keys,
           "logging.dir": str(out_dir / name / "logs"), "checkpoint.dir": str(out_dir / name / "ck")}
    summary = DDPTrainer(cfg).train()
    shas = [None] * dist.get_world_size()
    dist.all_gather_object(shas, summary["model_sha256"])
    return {"summary": summary, "all_sha256": shas}


def main() -> None:
    out_dir = register_worker()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    results: dict[str, dict] = {}
    for name, overrides in GRAD_CASES.items():
        results[name] = recorded(run_grad_case, name, overrides, out_dir, world)
    results["eager_6"] = recorded(run_train, "eager_6", out_dir)
    results["compiled_6"] = recorded(run_train, "compiled_6", out_dir, **COMPILED)
    # 4 compiled steps, then resumed uncompiled to 6; and 4 uncompiled, resumed compiled.
    results["compiled_4"] = recorded(run_train, "mixed", out_dir, {"train.max_steps": 4}, **COMPILED)
    results["then_eager_6"] = recorded(run_train, "mixed", out_dir)
    results["eager_4"] = recorded(run_train, "mixed_back", out_dir, {"train.max_steps": 4})
    results["then_compiled_6"] = recorded(run_train, "mixed_back", out_dir, **COMPILED)
    finish_worker(out_dir, rank, {"cases": results})


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
