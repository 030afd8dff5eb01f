"""Run under torchrun with 2 gloo ranks: Hugging Face models, LoRA and a per-expert MoE under DDP.

Two kinds of case, all in this one launch:
  PLAIN: plain torch DDP reproduces a failure (it raises the stated error, or its gradients are off
         the single-process reference or differ across ranks), on a process group of its own;
  FRAMEWORK: DDPTrainer runs the model: the gradients of one forward_backward equal one process's on
         the global batch (both ranks' batches concatenated in rank order, the model without any
         checkpointing or tiling), and after one optimizer step every rank holds the same parameters.

The models and data are importable: tests/unit/model/test_hf_models.py uses them in one process. Results go
to result_rank{r}.json.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import os
import traceback
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

from tests.dist_helper import error_record, finish_worker, register_worker
from tests.equivalence import max_diff

WORLD = 2
SEED = 5
VOCAB = 64
SEQ = 12  # tokens per sample: inputs are the first SEQ, labels the last SEQ of SEQ + 1
BATCH = 2  # per rank and micro-batch
SAMPLES = 32
ITERATIONS = 3  # plain-torch runs: errors may only show in a later iteration
LORA_TARGETS = ["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"]
MODES = ("off", "non_reentrant", "reentrant", "offload")

MARKED_TWICE = "Expected to mark a variable ready only once"
GRAPH_CHANGED = "Your training graph has changed in this iteration"
UNFINISHED = "Expected to have finished reduction in the prior iteration"


# --- models ------------------------------------------------------------------------------------

def llama(lora: bool, *, lora_dropout: float = 0.0) -> nn.Module:
    """A tiny LlamaForCausalLM, under PEFT LoRA when ``lora``. LoRA's B starts at zero, which would
    make every A gradient zero; it gets small seeded values so both have gradients to compare."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=2))
    if not lora:
        return model
    from peft import LoraConfig, get_peft_model

    with warnings.catch_warnings():  # PEFT reads transformers 5's deprecated is_gradient_checkpointing
        warnings.simplefilter("ignore", FutureWarning)
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=lora_dropout,
                                                 target_modules=LORA_TARGETS))
    g = torch.Generator().manual_seed(SEED + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model


class MoELayer(nn.Module):
    """x + expert_e(x) * p_e for each token's top-1 expert e: one nn.Linear per expert, and only the
    experts some token is routed to take part in the forward (the used set changes by batch)."""

    def __init__(self, dim: int, experts: int):
        super().__init__()
        self.router = nn.Linear(dim, experts)
        self.experts = nn.ModuleList(nn.Linear(dim, dim) for _ in range(experts))

    def forward(self, x):
        prob, choice = self.router(x).softmax(-1).max(-1)
        out = torch.zeros_like(x)
        for e in choice.unique().tolist():
            routed = choice == e
            out = out.index_put((routed,), self.experts[e](x[routed]) * prob[routed].unsqueeze(-1))
        return x + out


class MoE(nn.Module):
    """Embedding -> 2 MoE layers (8 experts each) -> head. ``reentrant``: each layer is checkpointed
    with plain torch's reentrant checkpoint (the framework's own cases leave that to the config)."""

    def __init__(self, reentrant: bool = False, dim: int = 16, experts: int = 8):
        super().__init__()
        self.reentrant = reentrant
        self.emb = nn.Embedding(VOCAB, dim)
        self.layers = nn.ModuleList(MoELayer(dim, experts) for _ in range(2))
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, x):
        h = self.emb(x)
        for layer in self.layers:
            h = checkpoint(layer, h, use_reentrant=True) if self.reentrant else layer(h)
        return self.head(h)


def moe(reentrant: bool = False) -> nn.Module:
    torch.manual_seed(SEED)
    return MoE(reentrant)


BUILD = {"lora": lambda: llama(True), "full": lambda: llama(False), "moe": moe}


def lm_loss(output, labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy on logits, or on a Hugging Face output's ``.logits``."""
    logits = getattr(output, "logits", output)
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


class TokenPairs(torch.utils.data.Dataset):
    """Random token sequences as (input_ids, labels): labels are the inputs shifted by one."""

    def __init__(self, n: int = SAMPLES, seed: int = SEED + 2):
        tokens = torch.randint(0, VOCAB, (n, SEQ + 1), generator=torch.Generator().manual_seed(seed))
        self.x, self.y = tokens[:, :-1], tokens[:, 1:]

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]

    def __getitems__(self, indices):
        return self.x[indices], self.y[indices]


# --- comparing ---------------------------------------------------------------------------------

def trainable_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
            for n, p in model.named_parameters() if p.requires_grad}


def reference_grads(kind: str, batches: list) -> dict[str, torch.Tensor]:
    """One process, the model without checkpointing or tiling, on the concatenated batches
    (each a list of micro-batches; the loss averaged over micro-batches as accumulation does)."""
    model = BUILD[kind]()
    for micro in zip(*batches, strict=True):
        x = torch.cat([b[0] for b in micro])
        y = torch.cat([b[1] for b in micro])
        (lm_loss(model(x), y) / len(batches[0])).backward()
    return trainable_grads(model)


def params_sha(model: nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


# --- cases -------------------------------------------------------------------------------------

@dataclass
class Plain:
    kind: str  # "lora_hf_reentrant" or "moe_reentrant"
    ddp: dict  # DDP keyword arguments


PLAIN_CASES: dict[str, Plain] = {
    "plain-lora-hf_reentrant-find_unused": Plain("lora_hf_reentrant", dict(find_unused_parameters=True)),
    "plain-moe-reentrant-default": Plain("moe_reentrant", {}),
    "plain-moe-reentrant-find_unused": Plain("moe_reentrant", dict(find_unused_parameters=True)),
    "plain-moe-reentrant-static": Plain("moe_reentrant", dict(static_graph=True)),
    "plain-moe-reentrant-static-find_unused": Plain("moe_reentrant", dict(static_graph=True,
                                                                          find_unused_parameters=True)),
}

BASE = {"batch_size": BATCH, "num_workers": 0, "logging.tensorboard": False, "target_loss": 0.0, "train.seed": SEED,
        "ddp.backend": "gloo", "ddp.timeout_s": 60, "logging.progress_bar": "false", "learning_rate": 1e-2,
        "optim.warmup_steps": 0, "train.max_steps": 4, "recovery.consistency_check_interval": 0}

FRAMEWORK_CASES: dict[str, tuple[str, dict]] = {
    f"lora-{mode}-tiled{chunks}": ("lora", {"memory.activation_checkpointing": mode, "memory.tiled_mlp_chunks": chunks,
                                            "memory.tiled_mlp_modules": "LlamaMLP" if chunks else ""})
    for mode in MODES for chunks in (0, 4)}
FRAMEWORK_CASES.update({
    "full-reentrant-tiled4": ("full", {"memory.activation_checkpointing": "reentrant", "memory.tiled_mlp_chunks": 4,
                                       "memory.tiled_mlp_modules": "LlamaMLP"}),
    "full-offload-tiled0": ("full", {"memory.activation_checkpointing": "offload"}),
    "lora-framework_wrap-reentrant-tiled4": ("lora", {"memory.activation_checkpointing": "reentrant",
                                                      "memory.activation_checkpointing_modules": "LlamaDecoderLayer",
                                                      "memory.tiled_mlp_chunks": 4,
                                                      "memory.tiled_mlp_modules": "LlamaMLP"}),
    "moe-reentrant-auto": ("moe", {"memory.activation_checkpointing": "reentrant",
                                   "memory.activation_checkpointing_modules": "MoELayer",
                                   "data.gradient_accumulation_steps": 2}),
})
# Forced DDP settings: the switch is not allowed, and no setting fits: a clear error.
FORCED_CASES = {"moe-reentrant-forced_static": ("moe", {"memory.activation_checkpointing": "reentrant",
                                                        "memory.activation_checkpointing_modules": "MoELayer",
                                                        "ddp.static_graph": "true"})}


def plain_model(kind: str) -> nn.Module:
    if kind == "moe_reentrant":
        return moe(reentrant=True)
    model = llama(True)
    with warnings.catch_warnings():  # transformers 5 deprecates the name; it is what users call
        warnings.simplefilter("ignore", FutureWarning)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    return model


def run_plain(case: Plain, rank: int) -> dict:
    """Plain DDP with the case's settings, ITERATIONS iterations, on a process group of its own."""
    from framework.data.sampler import ResumableDistributedSampler
    from framework.data.batches import fetch

    # A rank whose graph changed raises while the other waits in its all-reduce until this timeout.
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=10))
    model = plain_model(case.kind)
    ddp = DDP(model, process_group=group, **case.ddp)
    data = TokenPairs()
    micro_batches = iter(ResumableDistributedSampler(len(data), WORLD, rank, BATCH, 1, SEED))
    used, grads, error = [], [], None
    try:
        for _ in range(ITERATIONS):
            batch = fetch(data, next(micro_batches))
            used.append([batch])
            model.zero_grad(set_to_none=True)
            lm_loss(ddp(batch[0]), batch[1]).backward()
            grads.append(trainable_grads(model))
    except RuntimeError as err:  # the failure under test; the reducer is unusable afterwards
        error = error_record(err, len(grads), chars=1500)
    del ddp
    everyone: list = [None] * WORLD
    dist.all_gather_object(everyone, {"batches": used, "grads": grads, "error": error})
    kind = "moe" if case.kind == "moe_reentrant" else "lora"
    done = min(len(e["grads"]) for e in everyone)
    ref_diff, rank_diff = [], []
    for it in range(done):
        ref = reference_grads(kind, [e["batches"][it] for e in everyone])
        ref_diff.append(max(max_diff(e["grads"][it], ref)[0] for e in everyone))
        rank_diff.append(max_diff(everyone[0]["grads"][it], everyone[1]["grads"][it])[0])
    return {"errors": [e["error"] for e in everyone], "iterations_done": done,
            "max_ref_diff": max(ref_diff, default=None), "max_rank_diff": max(rank_diff, default=None)}


def trainer_for(name: str, kind: str, overrides: dict, out_dir):
    from framework.trainer import DDPTrainer

    cfg = {**BASE, **overrides, "logging.dir": str(out_dir / name), "checkpoint.dir": str(out_dir / name / "ck")}
    return DDPTrainer(cfg, model=BUILD[kind](), train_dataset=TokenPairs(), loss_fn=lm_loss)


def run_framework(name: str, kind: str, overrides: dict, out_dir) -> dict:
    """One forward_backward against the single-process reference, then one optimizer step."""
    trainer = trainer_for(name, kind, overrides, out_dir)
    try:
        batches = iter(trainer.stream.loader)
        micro = [next(batches) for _ in range(trainer.sampler.accumulation)]
        with trainer.model.no_sync():  # a rank's own un-reduced gradient: the comparison can fail
            lm_loss(trainer.model(micro[0][0]), micro[0][1]).backward()
        local = trainable_grads(trainer.raw_model)
        trainer.optimizer.zero_grad(set_to_none=True)
        loss = trainer.forward_backward(micro)
        grads = trainable_grads(trainer.raw_model)
        before = params_sha(trainer.raw_model)
        trainer.optimizer_step(loss)
        after = params_sha(trainer.raw_model)
    finally:
        trainer.close()
    everyone: list = [None] * WORLD
    dist.all_gather_object(everyone, {"batches": micro, "grads": grads, "sha": after})
    ref = reference_grads(kind, [e["batches"] for e in everyone])
    diff, worst = max_diff(grads, ref)
    log_lines = (out_dir / name / f"rank_{dist.get_rank()}.log").read_text().splitlines()
    return {"log": [line.split(": ", 1)[-1] for line in log_lines
                    if "activation checkpointing" in line or "switched" in line or "tiled MLP" in line],
            "max_abs_diff": diff, "worst_param": worst, "unreduced_local_diff": max_diff(local, ref)[0],
            "rank_gap": max_diff(everyone[0]["grads"], everyone[1]["grads"])[0],
            "sha_after_step": [e["sha"] for e in everyone], "moved": before != after,
            "trainable": len(ref), "checkpointing": {"path": trainer.activation_checkpointing.path,
                                                     "mode": trainer.activation_checkpointing.mode,
                                                     "wrapped": len(trainer.activation_checkpointing.wrapped)},
            "offload_packed": trainer.activation_checkpointing.stats.packed,
            "decision": dataclasses.asdict(trainer.decision), "report": dataclasses.asdict(trainer.report)}


def run_forced(name: str, kind: str, overrides: dict, out_dir) -> dict:
    try:
        trainer_for(name, kind, overrides, out_dir).close()
    except RuntimeError as err:  # DDPConfigurationError expected
        return {"error_type": type(err).__name__, "error": str(err)}
    return {"error_type": None, "error": None}


def guarded(fn, *args) -> dict:
    try:
        return fn(*args)
    except Exception as err:  # recorded per case so one failure does not hide the others
        return {"harness_error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}


def main() -> None:
    out_dir = register_worker()
    import peft  # noqa: F401  imported before any case, so no rank waits for the other's import in a collective
    import transformers  # noqa: F401
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    assert dist.get_world_size() == WORLD
    results: dict[str, dict] = {}
    for name, case in PLAIN_CASES.items():
        results[name] = guarded(run_plain, case, rank)
    for name, (kind, overrides) in FRAMEWORK_CASES.items():
        results[name] = guarded(run_framework, name, kind, overrides, out_dir)
    for name, (kind, overrides) in FORCED_CASES.items():
        results[name] = guarded(run_forced, name, kind, overrides, out_dir)
    finish_worker(out_dir, rank, {"cases": results})


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
