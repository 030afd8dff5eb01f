"""Run under torchrun with 2 gloo ranks: the failure matrix of issue 3.

For every case:
  (A) plain torch DDP with the case's settings fails: it raises the stated error, or (the silent
      cases) its gradients are off the single-process reference or differ across ranks;
  (B) DDPTrainer in auto mode (or with the case's setting forced) runs the same model for
      ITERATIONS iterations of forward_backward with gradients equal to the reference on both ranks.

The reference is the same architecture from the same seed in one process, without DDP, on each
global micro-batch (both ranks' micro-batches concatenated in rank order). Gradients are zeroed
between iterations and the optimizer never steps, so every iteration uses the initial weights.

Each plain-torch run gets its own process group, so a reducer that an error left mid-iteration
cannot stall the next case. The ranks then exchange their batches, gradients and errors once per
run on the default group, whatever happened, so they stay in lockstep. Results go to
result_rank{r}.json for tests/integration/test_failure_matrix.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

from tests.dist_helper import error_record, finish_worker, register_worker
from tests.equivalence import max_diff
from tests.workers.naive_tiled_mlp import grad_then_backward_tiled_mlp, naive_tiled_mlp

WORLD = 2
SEED = 11
BATCH = 4  # per rank and micro-batch
SAMPLES = 48  # 3 optimizer steps with accumulation 2
DIM = 8
SEQ = 8
ITERATIONS = 3
SILENT = "silent"  # expectation: no error, gradients off the reference or different across ranks
CORRECT = "correct"  # expectation: no error, gradients equal to the reference (a control)

MARKED_TWICE = "Expected to mark a variable ready only once"
GRAPH_CHANGED = "Your training graph has changed in this iteration"
UNFINISHED = "Expected to have finished reduction in the prior iteration"
HOOKS_ASSERT = "expect_autograd_hooks_ INTERNAL ASSERT FAILED"


# --- models ------------------------------------------------------------------------------------

def requiring_grad(inputs: torch.Tensor) -> torch.Tensor:
    """The input as a leaf that requires grad, like HF's enable_input_require_grads() for frozen
    embeddings: reentrant recomputation needs an input that requires grad, and no parameter lies
    before the first layer, so that layer's hooks are the last DDP waits for."""
    return inputs.detach().requires_grad_()


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, dim)
        self.fc2 = nn.Linear(dim, dim)

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(x)))


class CheckpointedNet(nn.Module):
    """pre -> reentrant-checkpointed block -> head."""

    def __init__(self):
        super().__init__()
        self.pre, self.block, self.head = nn.Linear(DIM, DIM), Block(DIM), nn.Linear(DIM, DIM)

    def forward(self, x):
        h = checkpoint(self.block, self.pre(x), use_reentrant=True)
        return self.head(h)


class TiedCheckpointedNet(nn.Module):
    """pre -> block_a -> block_b -> head, both blocks reentrant-checkpointed, fc1 weights tied."""

    def __init__(self):
        super().__init__()
        self.pre, self.block_a, self.block_b = nn.Linear(DIM, DIM), Block(DIM), Block(DIM)
        self.head = nn.Linear(DIM, DIM)
        self.block_b.fc1.weight = self.block_a.fc1.weight

    def forward(self, x):
        h = checkpoint(self.block_a, self.pre(x), use_reentrant=True)
        h = checkpoint(self.block_b, h, use_reentrant=True)
        return self.head(h)


class ReusedBlockNet(nn.Module):
    """One block applied twice, each application reentrant-checkpointed, as the first layer."""

    def __init__(self):
        super().__init__()
        self.block, self.head = Block(DIM), nn.Linear(DIM, DIM)

    def forward(self, x):
        h = checkpoint(self.block, requiring_grad(x), use_reentrant=True)
        h = checkpoint(self.block, h, use_reentrant=True)
        return self.head(h)


class BranchNet(nn.Module):
    """``extra`` is used only when the last input feature is positive for the whole batch."""

    def __init__(self):
        super().__init__()
        self.pre, self.extra, self.head = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)

    def forward(self, x):
        h = torch.tanh(self.pre(x))
        if bool((x[:, -1] > 0).all()):
            h = h + self.extra(h)
        return self.head(h)


class UnusedParamNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.pre, self.unused, self.head = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)

    def forward(self, x):
        return self.head(torch.tanh(self.pre(x)))


class PlainNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.pre, self.head = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)

    def forward(self, x):
        return self.head(torch.tanh(self.pre(x)))


def _plain_mlp(x, chunks, fc, proj):
    return proj(F.gelu(fc(x)))


def _sturdy_mlp(x, chunks, fc, proj):
    from framework.model.tiled_mlp import tiled_mlp
    return tiled_mlp(x, chunks, fc, proj)


MLP_IMPLS = {"plain": _plain_mlp, "sturdy": _sturdy_mlp, "naive": naive_tiled_mlp,
             "grad_then_backward": grad_then_backward_tiled_mlp}


class TiledMLPNet(nn.Module):
    """(B, T, C): [pre ->] proj(gelu(fc(x))) over ``chunks`` sequence chunks -> head.

    Without ``pre`` the MLP is the first layer, so its weights are the last ones DDP waits for."""

    def __init__(self, impl: str, chunks: int, pre: bool):
        super().__init__()
        self.impl, self.chunks = impl, chunks
        self.pre = nn.Linear(DIM, DIM) if pre else None
        self.fc, self.proj = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)
        self.head = nn.Linear(DIM, DIM)

    def forward(self, x):
        x = self.pre(x) if self.pre is not None else requiring_grad(x)
        return self.head(MLP_IMPLS[self.impl](x, self.chunks, self.fc, self.proj))


def seeded(cls, *args) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        torch.manual_seed(SEED)
        return cls(*args)
    return build


# --- data --------------------------------------------------------------------------------------

class Pairs(torch.utils.data.Dataset):
    def __init__(self, x: torch.Tensor, y: torch.Tensor):
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]

    def __getitems__(self, indices):
        return self.x[indices], self.y[indices]


def vectors() -> Pairs:
    g = torch.Generator().manual_seed(SEED + 1)
    return Pairs(torch.randn(SAMPLES, DIM, generator=g), torch.randn(SAMPLES, DIM, generator=g))


def sequences() -> Pairs:
    g = torch.Generator().manual_seed(SEED + 2)
    return Pairs(torch.randn(SAMPLES, SEQ, DIM, generator=g), torch.randn(SAMPLES, SEQ, DIM, generator=g))


def branch_switching() -> Pairs:
    """Vectors whose last feature is positive exactly in global micro-batch 1 of the sampler's
    epoch-0 order: BranchNet leaves ``extra`` unused in iteration 1 and uses it in iteration 2,
    on both ranks, and the framework's probe (first two micro-batches) sees the change."""
    from framework.data.sampler import ResumableDistributedSampler
    perm = ResumableDistributedSampler(SAMPLES, WORLD, 0, BATCH, 1, SEED).permutation(0)
    data = vectors()
    sign = -torch.ones(SAMPLES)
    sign[perm[WORLD * BATCH:2 * WORLD * BATCH]] = 1.0
    data.x[:, -1] = sign * (0.5 + data.x[:, -1].abs())
    return data


# --- cases -------------------------------------------------------------------------------------

@dataclass
class Case:
    build: Callable[[], nn.Module]
    data: Callable[[], Pairs]
    plain: dict  # DDP keyword arguments for part A
    expect: tuple[str, ...]  # acceptable outcomes of part A: error substrings, SILENT or CORRECT
    framework: dict | None = None  # config overrides for part B; None: no part B
    decision: tuple[bool, bool] | None = None  # expected (static_graph, find_unused_parameters)
    error_iteration: int | None = None  # where part A's error must appear (0-based)
    reference: Callable[[], nn.Module] | None = None  # default: build
    accumulation: int = 1
    plain_chunks: list[int] = field(default_factory=list)  # tiled models: chunk count per iteration
    framework_chunks: list[int] = field(default_factory=list)


def tiled(impl: str, pre: bool, chunks: int = 4):
    return seeded(TiledMLPNet, impl, chunks, pre)


CASES: dict[str, Case] = {
    "1a_reentrant_find_unused": Case(
        seeded(CheckpointedNet), vectors, dict(find_unused_parameters=True), (MARKED_TWICE,),
        framework={}, decision=(False, False), error_iteration=0),
    "1b_tied_reentrant_default": Case(
        seeded(TiedCheckpointedNet), vectors, {}, (MARKED_TWICE,),
        framework={}, decision=(True, False), error_iteration=0),
    "2_graph_changes_static": Case(
        seeded(BranchNet), branch_switching, dict(static_graph=True), (GRAPH_CHANGED,),
        framework={}, decision=(False, True), error_iteration=1),
    "3_unused_param_default": Case(
        seeded(UnusedParamNet), vectors, {}, (UNFINISHED,),
        framework={}, decision=(False, True), error_iteration=1),
    # The MLP is the first layer: chunk 0's hooks complete DDP's reduction, the other chunks'
    # gradients are added locally afterwards (silent); with a layer before it, see the next case.
    "4_naive_tiled_mlp_default": Case(
        tiled("naive", pre=False), sequences, {}, (SILENT, MARKED_TWICE),
        framework={}, decision=(False, False), reference=tiled("plain", pre=False)),
    "4_naive_tiled_mlp_pending_default": Case(
        tiled("naive", pre=True), sequences, {}, (MARKED_TWICE,),
        error_iteration=0, reference=tiled("plain", pre=True)),
    "5_static_accumulation_no_sync_first": Case(
        seeded(PlainNet), vectors, dict(static_graph=True), (HOOKS_ASSERT,),
        framework={"ddp.static_graph": "true"}, decision=(True, False), error_iteration=0, accumulation=2),
    "6_reused_reentrant_block_default": Case(
        seeded(ReusedBlockNet), vectors, {}, (SILENT,),
        framework={}, decision=(True, False)),
    "7_grad_then_backward_find_unused": Case(
        tiled("grad_then_backward", pre=True), sequences, dict(find_unused_parameters=True), (MARKED_TWICE,),
        framework={"ddp.find_unused_parameters": "true"}, decision=(False, True), error_iteration=0,
        reference=tiled("plain", pre=True)),
    # Control: the original fix does work with DDP's default settings.
    "7_grad_then_backward_default": Case(
        tiled("grad_then_backward", pre=True), sequences, {}, (CORRECT,), reference=tiled("plain", pre=True)),
    # Correct while the chunk count stays 2 (iterations 0 and 1), fails when it becomes 4.
    "8_naive_tiled_static_chunks_change": Case(
        tiled("naive", pre=True), sequences, dict(static_graph=True), (GRAPH_CHANGED,),
        framework={"ddp.static_graph": "true"}, decision=(True, False), error_iteration=2,
        reference=tiled("plain", pre=True), plain_chunks=[2, 2, 4], framework_chunks=[2, 4, 3]),
}

# Part B runs the same architecture with the framework's tiled MLP (the sturdy design).
FRAMEWORK_BUILD = {
    "4_naive_tiled_mlp_default": tiled("sturdy", pre=False),
    "7_grad_then_backward_find_unused": tiled("sturdy", pre=True),
    "8_naive_tiled_static_chunks_change": tiled("sturdy", pre=True, chunks=2),
}


# --- running and comparing ---------------------------------------------------------------------

def set_chunks(model: nn.Module, chunks: list[int], iteration: int) -> None:
    if chunks:
        model.chunks = chunks[iteration]


def grads_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: (torch.zeros_like(p) if p.grad is None else p.grad.detach().clone())
            for n, p in model.named_parameters()}


def compare(case: Case, used: list, grads: list, error: dict | None, chunks: list[int]) -> dict:
    """Exchange every rank's batches, gradients and error on the default group (exactly once per
    run on every rank) and compare each iteration with the single-process reference."""
    everyone: list = [None] * WORLD
    dist.all_gather_object(everyone, {"batches": used, "grads": grads, "error": error})
    reference = (case.reference or case.build)()
    done = min(len(e["grads"]) for e in everyone)
    iterations = []
    for it in range(done):
        set_chunks(reference, chunks, it)
        reference.zero_grad(set_to_none=True)
        n = len(everyone[0]["batches"][it])
        for m in range(n):
            x = torch.cat([e["batches"][it][m][0] for e in everyone])
            y = torch.cat([e["batches"][it][m][1] for e in everyone])
            (F.mse_loss(reference(x), y) / n).backward()
        ref = grads_of(reference)
        off = [max_diff(e["grads"][it], ref) for e in everyone]
        across = max_diff(everyone[0]["grads"][it], everyone[1]["grads"][it])
        iterations.append({"ref_diff": [d for d, _ in off], "ref_worst": [w for _, w in off],
                           "rank_diff": across[0], "rank_worst": across[1]})
    return {"errors": [e["error"] for e in everyone], "iterations_done": done, "iterations": iterations,
            "max_ref_diff": max((max(i["ref_diff"]) for i in iterations), default=None),
            "max_rank_diff": max((i["rank_diff"] for i in iterations), default=None)}


def run_plain(case: Case, rank: int) -> dict:
    """Part A: plain DDP with the case's settings on a process group of its own."""
    from framework.data.sampler import ResumableDistributedSampler
    from framework.data.batches import fetch
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=30))
    model = case.build()
    ddp = DDP(model, process_group=group, **case.plain)
    data = case.data()
    micro_batches = iter(ResumableDistributedSampler(len(data), WORLD, rank, BATCH, case.accumulation, SEED))
    used, grads, error = [], [], None
    try:
        for it in range(ITERATIONS):
            set_chunks(model, case.plain_chunks, it)
            micro = [fetch(data, next(micro_batches)) for _ in range(case.accumulation)]
            used.append(micro)
            model.zero_grad(set_to_none=True)
            for i, (x, y) in enumerate(micro):
                with contextlib.nullcontext() if i == len(micro) - 1 else ddp.no_sync():
                    (F.mse_loss(ddp(x), y) / len(micro)).backward()
            grads.append(grads_of(model))
    except RuntimeError as err:  # the failure under test; the reducer is unusable afterwards
        error = error_record(err, it)
    del ddp
    return compare(case, used, grads, error, case.plain_chunks)


def run_framework(name: str, case: Case, rank: int, out_dir) -> dict:
    """Part B: DDPTrainer with the case's config on the same model."""
    from framework.trainer import DDPTrainer
    cfg = {"batch_size": BATCH, "data.gradient_accumulation_steps": case.accumulation, "num_workers": 0,
           "logging.tensorboard": False, "dropout": 0.0, "target_loss": 0.0, "train.seed": SEED, "ddp.backend": "gloo",
           "ddp.timeout_s": 60, "logging.progress_bar": "false", "logging.dir": str(out_dir / name),
           "checkpoint.dir": str(out_dir / name / "ck"), **case.framework}
    model = FRAMEWORK_BUILD.get(name, case.build)()
    trainer = DDPTrainer(cfg, model=model, train_dataset=case.data(), loss_fn=F.mse_loss)
    used, grads, error = [], [], None
    try:
        batches = iter(trainer.stream.loader)
        for it in range(ITERATIONS):
            set_chunks(trainer.raw_model, case.framework_chunks, it)
            micro = [next(batches) for _ in range(trainer.sampler.accumulation)]
            used.append(micro)
            trainer.optimizer.zero_grad(set_to_none=True)
            trainer.forward_backward(micro)
            grads.append(grads_of(trainer.raw_model))
    except RuntimeError as err:  # recorded: the test reports it
        error = error_record(err, it)
    finally:
        trainer.close()
    result = compare(case, used, grads, error, case.framework_chunks)
    result["decision"] = dataclasses.asdict(trainer.decision)
    result["report"] = dataclasses.asdict(trainer.report)
    return result


def main() -> None:
    out_dir = register_worker()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    assert dist.get_world_size() == WORLD
    results: dict[str, dict] = {}
    for name, case in CASES.items():
        results[name] = {}
        for part in ("plain", "framework"):
            if part == "framework" and case.framework is None:
                continue
            start = time.perf_counter()
            try:
                if part == "plain":
                    results[name][part] = run_plain(case, rank)
                else:
                    results[name][part] = run_framework(name, case, rank, out_dir)
            except Exception as err:  # recorded per case so one failure does not hide the others
                results[name][part] = {"harness_error": f"{type(err).__name__}: {err}",
                                       "traceback": traceback.format_exc()}
            results[name][part]["seconds"] = round(time.perf_counter() - start, 3)
    finish_worker(out_dir, rank, {"cases": results})


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
