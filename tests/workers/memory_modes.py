"""Run under torchrun with 2 ranks: every memory-saving mode and combination, trained through
DDPTrainer's automatic DDP policy, against the plain single-process model on the global batch."""

from __future__ import annotations

import itertools
import os

import torch
import torch.distributed as dist

from tests.dist_helper import finish_worker, recorded, register_worker

BASE = {"vocab_size": 32, "hidden_size": 32, "num_layers": 2, "num_heads": 2, "seq_len": 16, "dataset_size": 64,
        "batch_size": 2, "dropout": 0.0, "num_workers": 0, "logging.tensorboard": False, "eval.interval": 0,
        "target_loss": 0.0, "train.seed": 11, "learning_rate": 1e-3}
MODES = ("off", "non_reentrant", "reentrant", "offload")
COMBOS = {f"{gc}-tiled{t}-tie{int(tie)}": {"memory.activation_checkpointing": gc, "memory.tiled_mlp_chunks": t,
                                           "model.tie_embeddings": tie}
          for gc, t, tie in itertools.product(MODES, (0, 4), (False, True))}
FORCED = {
    "tiled4-find_unused_true": {"memory.tiled_mlp_chunks": 4, "ddp.find_unused_parameters": "true"},
    "tiled4-static_true": {"memory.tiled_mlp_chunks": 4, "ddp.static_graph": "true"},
    "tiled4-static_true-accum2": {"memory.tiled_mlp_chunks": 4, "ddp.static_graph": "true",
                                  "data.gradient_accumulation_steps": 2},
    "tiled-changing-chunks-static_true": {"memory.tiled_mlp_chunks": 4, "ddp.static_graph": "true",
                                          "chunk_schedule": (4, 2, 3)},
    "tiled-changing-chunks-auto": {"memory.tiled_mlp_chunks": 4, "chunk_schedule": (2, 4, 1)},
    "offload-tiled4-tie-accum2": {"memory.activation_checkpointing": "offload", "memory.tiled_mlp_chunks": 4,
                                  "model.tie_embeddings": True, "data.gradient_accumulation_steps": 2},
}
ITERATIONS = 3


def reference_grads(cfg, batches):
    """The plain model (no checkpointing, no tiling, no DDP) on the global micro-batches."""
    from framework.model.gpt import GPT, GPTConfig, lm_loss

    torch.manual_seed(cfg.train.seed)
    m = cfg.model
    model = GPT(GPTConfig(m.vocab_size, m.seq_len, m.hidden_size, m.num_layers, m.num_heads, 0.0, m.tie_embeddings, 0))
    for x, y in batches:
        (lm_loss(model(x), y) / len(batches)).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def run_case(name, overrides, out_dir, rank, world):
    from framework.data.sampler import ResumableDistributedSampler
    from framework.data.batches import fetch
    from framework.trainer import DDPTrainer

    overrides = dict(overrides)
    schedule = overrides.pop("chunk_schedule", None)
    trainer = DDPTrainer({**BASE, **overrides, "logging.dir": str(out_dir / name)})
    cfg = trainer.config
    glob = ResumableDistributedSampler(len(trainer.train_dataset), 1, 0, cfg.data.batch_size * world,
                                       cfg.data.gradient_accumulation_steps, cfg.train.seed)
    mine, full = iter(trainer.stream.loader), iter(glob)
    diffs, rank_gaps = [], []
    for it in range(ITERATIONS):
        if schedule:
            for block in trainer.raw_model.blocks:
                block.mlp.chunks = schedule[it]
        micro = [next(mine) for _ in range(cfg.data.gradient_accumulation_steps)]
        trainer.forward_backward(micro)
        ref = reference_grads(cfg, [fetch(trainer.train_dataset, next(full))
                                    for _ in range(cfg.data.gradient_accumulation_steps)])
        grads = {n: p.grad.detach().clone() for n, p in trainer.raw_model.named_parameters()}
        diffs.append(max((grads[n] - ref[n]).abs().max().item() for n in ref))
        flat = torch.cat([g.reshape(-1) for g in grads.values()])
        gathered = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(gathered, flat)
        rank_gaps.append(max((g - flat).abs().max().item() for g in gathered))
        trainer.optimizer.zero_grad(set_to_none=True)
    out = {"max_abs_diff": max(diffs), "rank_gap": max(rank_gaps),
           "static_graph": trainer.decision.static_graph,
           "find_unused_parameters": trainer.decision.find_unused_parameters,
           "reasons": trainer.decision.reasons,
           "offload_packed": trainer.activation_checkpointing.stats.packed,
           "offload_unpacked": trainer.activation_checkpointing.stats.unpacked}
    trainer.close()
    return out


def run_sha_case(name, out_dir, rank, world):
    """A block applied twice under reentrant checkpointing: auto picks static_graph; training with
    the probe gives the same model as training with that choice forced."""
    from framework.model.gpt import GPT, GPTConfig
    from framework.trainer import DDPTrainer

    shas = {}
    for label, forced in (("auto", {}), ("forced", {"ddp.static_graph": "true",
                                                    "ddp.find_unused_parameters": "false"})):
        cfg = {**BASE, "memory.activation_checkpointing": "reentrant", "train.max_steps": 4, **forced,
               "logging.dir": str(out_dir / name / label), "checkpoint.dir": str(out_dir / name / label / "ck")}
        torch.manual_seed(BASE["train.seed"])
        model = GPT(GPTConfig(32, 16, 32, 2, 2))
        model.blocks[1] = model.blocks[0]
        trainer = DDPTrainer(cfg, model=model)
        decision = (trainer.decision.static_graph, trainer.decision.find_unused_parameters)
        shas[label] = {"sha": trainer.train()["model_sha256"], "decision": decision,
                       "multi_fire": trainer.report.multi_fire}
    return shas


def main():
    out_dir = register_worker()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {}
    for name, overrides in {**COMBOS, **FORCED}.items():
        results[name] = recorded(run_case, name, overrides, out_dir, rank, world)
    results["probe_vs_forced_sha"] = recorded(run_sha_case, "probe_vs_forced_sha", out_dir, rank, world)
    finish_worker(out_dir, rank, {"cases": results})


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
