"""Run under torchrun with 2 ranks: gradient equivalence of the trainer's DDP step against one
process on the global batch, parameters after several steps, and the sharded validation loss.
Every case's result goes into result_rank{r}.json for tests/unit/ddp/test_ddp_equivalence.py."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from tests.dist_helper import finish_worker, recorded, register_worker

BASE = {"vocab_size": 32, "hidden_size": 32, "num_layers": 2, "num_heads": 2, "seq_len": 16, "dataset_size": 256,
        "dropout": 0.0, "num_workers": 0, "logging.tensorboard": False, "learning_rate": 1e-3, "optim.warmup_steps": 2,
        "log_interval": 1, "eval.interval": 0, "eval.steps": 5, "target_loss": 0.0, "train.seed": 7}

# name -> config overrides; per-rank batch b, compared with one process on batch world_size * b.
GRAD_CASES = {
    "grad_b4_accum1": {"batch_size": 4, "data.gradient_accumulation_steps": 1},
    "grad_b4_accum2": {"batch_size": 4, "data.gradient_accumulation_steps": 2},
    "grad_b3_accum3_tied": {"batch_size": 3, "data.gradient_accumulation_steps": 3, "model.tie_embeddings": True},
}
TRAIN_CASES = {
    "train_b4_accum1": {"batch_size": 4, "data.gradient_accumulation_steps": 1, "train.max_steps": 6},
    "train_b2_accum2": {"batch_size": 2, "data.gradient_accumulation_steps": 2, "train.max_steps": 6},
    # data.global_batch_size=9 on 2 ranks: shares of 5 and 4 samples (micro-batches 3+2 and 2+2),
    # each micro-batch's loss weighted by its samples; rank_tokens weighs each rank by its share
    "train_uneven": {"batch_size": 3, "data.global_batch_size": 9, "train.max_steps": 6},
    "train_uneven_rank_tokens": {"batch_size": 3, "data.global_batch_size": 9, "train.max_steps": 6,
                                 "train.loss_average": "rank_tokens"},
}
TOKENS_CASE = {"batch_size": 4, "data.gradient_accumulation_steps": 2}  # train.loss_average=tokens, masked targets
EVAL_CASE = {"batch_size": 7, "eval.steps": 5}  # 35 samples: unequal shards of 18 and 17


def reference_grads(cfg_overrides: dict, world_size: int) -> dict[str, torch.Tensor]:
    """One plain process, no DDP, on the global micro-batches of the first step."""
    from framework.config import resolve_config
    from framework.data.sampler import ResumableDistributedSampler
    from framework.data.datasets import build_datasets
    from framework.data.batches import fetch
    from framework.model.gpt import GPT, GPTConfig, lm_loss

    cfg = resolve_config({**BASE, **cfg_overrides})
    torch.manual_seed(cfg.train.seed)
    model = GPT(GPTConfig.from_train_config(cfg))
    train = build_datasets(cfg).train
    sampler = ResumableDistributedSampler(len(train), 1, 0, cfg.data.batch_size * world_size,
                                          cfg.data.gradient_accumulation_steps, cfg.train.seed)
    batches = iter(sampler)
    n = cfg.data.gradient_accumulation_steps
    for _ in range(n):
        x, y = fetch(train, next(batches))
        (lm_loss(model(x), y) / n).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def run_grad_case(name: str, overrides: dict, out_dir, rank: int, world: int) -> dict:
    from framework.trainer import DDPTrainer

    cfg = {**BASE, **overrides, "logging.dir": str(out_dir / name), "checkpoint.dir": str(out_dir / name / "ck")}
    trainer = DDPTrainer(cfg)
    batches = iter(trainer.stream.loader)
    micro = [next(batches) for _ in range(trainer.sampler.accumulation)]
    trainer.forward_backward(micro)
    ref = reference_grads(overrides, world)
    diffs = {n: (p.grad - ref[n]).abs().max().item() for n, p in trainer.raw_model.named_parameters()}
    # Prove the comparison can fail: the rank's own un-reduced gradient differs from the reference.
    trainer.optimizer.zero_grad(set_to_none=True)
    x, y = (t for t in micro[0])
    with trainer.model.no_sync():
        trainer.loss_fn(trainer.model(x), y).backward()
    local_diff = max((p.grad - ref[n]).abs().max().item() for n, p in trainer.raw_model.named_parameters()
                     if p.grad is not None)
    trainer.close()
    return {"max_abs_diff": max(diffs.values()), "worst_param": max(diffs, key=diffs.get),
            "unreduced_local_diff": local_diff}


def run_train_case(name: str, overrides: dict, out_dir, rank: int, world: int) -> dict:
    from framework.trainer import DDPTrainer

    cfg = {**BASE, **overrides, "logging.dir": str(out_dir / name), "checkpoint.dir": str(out_dir / name / "ck")}
    summary = DDPTrainer(cfg).train()
    shas = [None] * world
    dist.all_gather_object(shas, summary["model_sha256"])
    return {"summary": summary, "all_sha256": shas,
            "final_model": str(out_dir / name / "ck" / "final_model.pt")}


def masked_targets(n: int = 64):
    """Random sequences whose targets are -100 past a random length: every micro-batch holds a
    different number of labelled tokens."""
    from torch.utils.data import TensorDataset

    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, BASE["vocab_size"], (n, BASE["seq_len"]), generator=g)
    y = torch.randint(0, BASE["vocab_size"], (n, BASE["seq_len"]), generator=g)
    lengths = torch.randint(1, BASE["seq_len"] + 1, (n, 1), generator=g)
    return TensorDataset(x, torch.where(torch.arange(BASE["seq_len"]) < lengths, y, -100))


def token_mean_grads(world_size: int, *, per_micro_batch: bool = False) -> dict[str, torch.Tensor]:
    """One plain process on the first step's global micro-batches: the summed cross-entropy over
    every labelled token, divided by their count (or, ``per_micro_batch``, the mean of the
    micro-batch means: what train.loss_average=micro_batch computes)."""
    from framework.config import resolve_config
    from framework.data.batches import fetch
    from framework.data.sampler import ResumableDistributedSampler
    from framework.model.gpt import GPT, GPTConfig

    cfg = resolve_config({**BASE, **TOKENS_CASE})
    torch.manual_seed(cfg.train.seed)
    model = GPT(GPTConfig.from_train_config(cfg))
    data, n = masked_targets(), cfg.data.gradient_accumulation_steps
    sampler = ResumableDistributedSampler(len(data), 1, 0, cfg.data.batch_size * world_size, n, cfg.train.seed)
    batches = iter(sampler)
    micro = [fetch(data, next(batches)) for _ in range(n)]
    total = sum(int((y != -100).sum()) for _, y in micro)
    for x, y in micro:
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="sum")
        (loss / (y != -100).sum() / n if per_micro_batch else loss / total).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def run_tokens_case(name: str, overrides: dict, out_dir, rank: int, world: int) -> dict:
    from framework.trainer import DDPTrainer

    cfg = {**BASE, **overrides, "train.loss_average": "tokens", "logging.dir": str(out_dir / name),
           "checkpoint.dir": str(out_dir / name / "ck")}
    trainer = DDPTrainer(cfg, train_dataset=masked_targets())
    batches = iter(trainer.stream.loader)
    trainer.forward_backward([next(batches) for _ in range(trainer.sampler.accumulation)])
    ref, other = token_mean_grads(world), token_mean_grads(world, per_micro_batch=True)
    grads = {n: p.grad for n, p in trainer.raw_model.named_parameters()}
    trainer.close()
    return {"max_abs_diff": max((grads[n] - ref[n]).abs().max().item() for n in ref),
            "micro_batch_mean_diff": max((other[n] - ref[n]).abs().max().item() for n in ref)}


def run_eval_case(out_dir, rank: int, world: int) -> dict:
    from framework.trainer import DDPTrainer

    trainer = DDPTrainer({**BASE, **EVAL_CASE, "logging.dir": str(out_dir / "eval")})
    shard = len(range(rank, 35, world))
    return {"val_loss": trainer.evaluate(), "shard_size": shard}


def main() -> None:
    out_dir = register_worker()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    results: dict[str, dict] = {}
    cases = [(n, run_grad_case, o) for n, o in GRAD_CASES.items()]
    cases += [(n, run_train_case, o) for n, o in TRAIN_CASES.items()]
    for name, fn, overrides in cases:
        results[name] = recorded(fn, name, overrides, out_dir, rank, world)
    results["tokens"] = recorded(run_tokens_case, "tokens", TOKENS_CASE, out_dir, rank, world)
    results["eval"] = recorded(run_eval_case, out_dir, rank, world)
    finish_worker(out_dir, rank, {"world_size": world, "cases": results})


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
