#!/usr/bin/env python3
"""Activation memory of the built-in GPT and of a LoRA Llama under each memory saver, on this machine.

Model: framework.model.gpt.GPT, 8 layers, hidden 384, 6 heads (head size 64), vocab 256, seq_len 2048,
batch 1, dropout 0 (nanoGPT's shakespeare-char width; 15.4M parameters), fp32 on CPU. Steps go
through DDPTrainer (1 process, so no DDP wrapper): ``forward_backward`` then ``optimizer_step``
(grad clip 1.0, AdamW), on the synthetic Markov data. Every process uses torch.set_num_threads(2).

Modes, each in a fresh subprocess of this script, run one after another (never concurrently):
  off              no saver
  non_reentrant    memory.activation_checkpointing=non_reentrant on every Block
  reentrant        memory.activation_checkpointing=reentrant on every Block
  offload          non_reentrant + CpuOffload of what checkpointing keeps
  tiled8           memory.tiled_mlp_chunks=8, checkpointing off
  nr+tiled8        non_reentrant + memory.tiled_mlp_chunks=8

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

LoRA Llama (--model lora-llama): transformers' LlamaForCausalLM built from a LlamaConfig (random
weights, nothing downloaded): 4 layers, hidden 256, intermediate 1024, 4 heads (4 KV heads), vocab
256, seq_len 1024, batch 1, use_cache off, SDPA attention, fp32, with PEFT LoRA r=8, alpha 16, dropout
0 on q_proj, v_proj, gate_proj, up_proj, down_proj (4.48M parameters, 156K trainable). Each of the
same MODES is applied with the framework's own functions in DDPTrainer._build_model's order:
tile_user_mlps(model, chunks, "LlamaMLP"), then enable_checkpointing(model, mode, checkpoint_modules).
memory.activation_checkpointing_modules is DDPTrainer's default "Block", which names nothing in a
Llama, so checkpointing takes the Hugging Face path (the model's own, per LlamaDecoderLayer; offload
runs each layer's checkpoint inside CpuOffload); --llama-checkpoint-modules LlamaDecoderLayer
measures the framework's wrapping instead. One worker process, torch.set_num_threads(1), builds one
model per mode (same seed, so the same weights) and AdamW over its LoRA parameters. A step is forward
(model call and lm_loss on the logits) + backward + AdamW step + zero_grad, on a random batch that
every mode gets.
  round 0          every mode once, under the same SavedCounter as the GPT (outer hook around the
                   model call and the loss, distinct non-parameter, non-buffer storages; they all
                   stay alive until backward, so this is the peak live bytes saved in forward);
                   OffloadStats.packed_bytes for offload. Its loss and LoRA gradient norm are
                   recorded: every mode must agree. Not timed (warm-up).
  rounds 1..R      (--repeats, default 12) every mode once per round, no hooks, the order rotated
                   by one mode each round. Step time: the median wall and CPU time per mode, and
                   vs off: the median over rounds of the mode's step time over off's in that round.
The MLP probe, in its own process (1 thread): layer 0's LlamaMLP of the same model, LoRA on gate,
up and down, plain and tiled by tile_user_mlps (8 chunks), input (1, T, C) requiring grad, one
forward+backward, measured as for the GPT's MLP with the I-wide (intermediate_size) buffers in
place of the 4C-wide ones (I = 4C here): profiler peak and live-after-forward of (B, t, I) fp32
allocations, saved-tensor-hook peak of I-wide saved tensors, profiler peak of all allocations.
The plain LoRA LlamaMLP saves gate, act(gate), up and act(gate)*up (down's LoRA A needs its input):
4*B*T*I*4 bytes. No targets: the LoRA Llama's figures are printed as information.

usage: python bench/memory.py [--model gpt|lora-llama|all] [--quick] [--steps N] [--timing-rounds N]
                              [--repeats N] [--llama-seq-len N] [--llama-checkpoint-modules M] [--out PATH]
Writes bench/results/memory.json: the GPT's results at its top level, the LoRA Llama's under
"lora_llama"; a run of one model keeps the other's results already in the file. --quick: GPT
seq_len 512 and one timing round, LoRA Llama seq_len 256 and 2 rounds, and the JSON goes to
$TMPDIR/bench_memory_quick.json unless --out is given. The GPT takes 2-3 minutes on an idle machine
(--quick: about 1), the LoRA Llama 1-2 (--quick: 15 s).
"""

from __future__ import annotations

import argparse
import contextlib
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

# The LoRA Llama (--model lora-llama): transformers' LlamaForCausalLM from a config, PEFT LoRA on it,
# the same MODES applied by framework.model, one thread, every mode in one process.
LLAMA = dict(vocab_size=256, hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=4)
LORA = dict(r=8, lora_alpha=16, lora_dropout=0.0,
            target_modules=["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"])
LLAMA_TILED_MODULES = "LlamaMLP"
LLAMA_SEQ_LEN, LLAMA_QUICK_SEQ_LEN = 1024, 256
LLAMA_REPEATS = 12
LLAMA_THREADS = 1
LLAMA_SEED = 1337

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
    cfg = {**MODEL, "seq_len": seq_len, "memory.activation_checkpointing": ckpt, "memory.tiled_mlp_chunks": chunks,
           "data.source": "synthetic", "dataset_size": max(4, steps), "num_workers": 0, "train.max_steps": steps,
           "target_loss": 0.0, "eval.interval": 0, "logging.tensorboard": False, "logging.progress_bar": "false",
           "logging.dir": str(workdir / "logs"), "checkpoint.dir": str(workdir / "checkpoints")}
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
            steps = getattr(trainer, "train_step", None)  # TrainStep runs the step with its own references
            if steps is not None:
                steps.model, steps.loss_fn = trainer.model, counted_loss
        trainer.model.train()
        self.batches = iter(trainer.stream.loader)

    def step(self) -> dict:
        import torch
        trainer, counter, stats = self.trainer, self.counter, self.trainer.activation_checkpointing.stats
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
                checkpointed_modules=len(trainer.activation_checkpointing.wrapped), device=str(trainer.env.device),
                amp=trainer.precision.autocast, threads=torch.get_num_threads(),
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


def measure_mlp_peaks(mlp, x, grad_out, width: int, wide_sizes: set[int]) -> dict:
    """One forward+backward of ``mlp`` on ``x``: the live bytes of ``width``-wide intermediates.

    torch.profiler memory events: the live bytes of the buffers whose allocation size is in
    ``wide_sizes`` (their peak over forward + backward and what is live at the end of forward), and
    the peak of all allocations. Saved-tensor hooks around forward and backward (a tiled backward
    recomputes under them): the ``width``-wide tensors saved for backward, live bytes tracked
    through a holder object that autograd drops when it frees the saved tensor."""
    import weakref

    import torch
    from torch.profiler import ProfilerActivity, profile

    exclude = {p.untyped_storage().data_ptr() for p in mlp.parameters()} | {x.untyped_storage().data_ptr()}
    live = {"now": 0, "peak": 0, "saves": 0}

    class Held:
        __slots__ = ("t", "__weakref__")

    def release(n, live=live):
        live["now"] -= n

    def pack(t, live=live, exclude=exclude):
        if t.untyped_storage().data_ptr() in exclude or t.dim() == 0 or t.size(-1) != width:
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
    return dict(profiler_peak_wide_bytes=peak_wide, profiler_wide_live_after_forward_bytes=wide_at_boundary,
                profiler_peak_all_bytes=peak_total, hooks_saved_after_forward_bytes=held_after_forward,
                hooks_peak_saved_bytes=live["peak"], hooks_saves=live["saves"])


def worker_mlp(args) -> dict:
    """Peak intermediate memory of one MLP, plain and tiled, measured (profiler + hooks)."""
    import torch

    from framework.model.gpt import MLP, GPTConfig
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
        m = measure_mlp_peaks(mlp, x, grad_out, 4 * C, wide_sizes)
        unit = B * T * 4 * C * 4
        results["tiled" if chunks else "plain"] = dict(
            chunks=chunks, shape=[B, T, C], chunk_lengths=lengths,
            profiler_peak_4c_bytes=m["profiler_peak_wide_bytes"],
            profiler_4c_live_after_forward_bytes=m["profiler_wide_live_after_forward_bytes"],
            profiler_peak_all_bytes=m["profiler_peak_all_bytes"], profiler_size_collision=collision,
            hooks_saved_after_forward_bytes=m["hooks_saved_after_forward_bytes"],
            hooks_peak_saved_bytes=m["hooks_peak_saved_bytes"], hooks_saves=m["hooks_saves"],
            analytic_held_bytes=0 if chunks else 2 * unit,
            analytic_peak_4c_bytes=3 * B * max(lengths) * 4 * C * 4,
            analytic_saved_peak_bytes=2 * B * max(lengths) * 4 * C * 4,
            grads_bytes=B * T * C * 4 + sum(p.numel() * 4 for p in mlp.parameters()))
    return results


# ---------------------------------------------------------------------------- LoRA Llama ----
def build_lora_llama(mode: str, seq_len: int, checkpoint_modules: str):
    """The PEFT LoRA Llama with ``mode`` applied as DDPTrainer._build_model applies it to a user's
    model: tile_user_mlps, then enable_checkpointing. Same seed, so every mode gets the same weights."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from framework.model.activation_checkpointing import enable_checkpointing
    from framework.model.tiled_mlp import tile_user_mlps
    torch.manual_seed(LLAMA_SEED)
    base = LlamaForCausalLM(LlamaConfig(**LLAMA, max_position_embeddings=seq_len, use_cache=False,
                                        tie_word_embeddings=False))
    model = get_peft_model(base, LoraConfig(task_type="CAUSAL_LM", **LORA))
    ckpt, chunks = MODES[mode]
    tiled = tile_user_mlps(model, chunks, LLAMA_TILED_MODULES)
    plan = enable_checkpointing(model, ckpt, checkpoint_modules)
    model.train()
    return model, tiled, plan


class LlamaStepper:
    """One mode's model and AdamW over its trainable (LoRA) parameters; a step is forward (model and
    loss, optionally under the SavedCounter), backward, AdamW step, zero_grad."""

    def __init__(self, mode: str, seq_len: int, checkpoint_modules: str):
        import torch
        self.mode = mode
        self.model, self.tiled, self.plan = build_lora_llama(mode, seq_len, checkpoint_modules)
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.trainable, lr=1e-3)
        frozen = [*self.model.parameters(), *self.model.buffers()]
        self.counter = SavedCounter({t.untyped_storage().data_ptr() for t in frozen})

    def step(self, inputs, targets, count: bool) -> dict:
        import torch

        from framework.model.gpt import lm_loss
        counter, stats = self.counter, self.plan.stats
        counter.reset()
        packed0 = stats.packed_bytes
        grad_norm = None
        t0, c0 = time.perf_counter(), time.process_time()
        with counter.hooks() if count else contextlib.nullcontext():
            loss = lm_loss(self.model(input_ids=inputs).logits, targets)
        loss.backward()
        if count:  # the first (untimed) round only: the modes must agree on the gradients
            grad_norm = float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in self.trainable])))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        return dict(wall_s=wall, cpu_s=cpu, loss=float(loss), grad_norm=grad_norm,
                    saved_bytes=counter.unique_bytes if count else None,
                    saved_tensor_bytes=counter.tensor_bytes if count else None,
                    saved_tensors=counter.tensors if count else None,
                    offload_packed_bytes=stats.packed_bytes - packed0)


def worker_llama(args) -> dict:
    """Every mode's model in this one process; round 0 counts saved tensors (warm-up, untimed), then
    --repeats timed rounds, each running every mode once, the order rotated from round to round."""
    import torch
    torch.set_num_threads(LLAMA_THREADS)
    steppers = {m: LlamaStepper(m, args.seq_len, args.llama_checkpoint_modules) for m in MODES}
    gen = torch.Generator().manual_seed(LLAMA_SEED)
    names = list(MODES)
    steps: dict[str, list] = {m: [] for m in names}
    orders = []
    for r in range(args.repeats + 1):
        tokens = torch.randint(0, LLAMA["vocab_size"], (1, args.seq_len + 1), generator=gen)
        order = names[r % len(names):] + names[:r % len(names)]
        orders.append(order)
        for m in order:
            steps[m].append(steppers[m].step(tokens[:, :-1], tokens[:, 1:], count=r == 0))
    any_model = next(iter(steppers.values())).model
    return dict(modes={m: dict(gradient_checkpointing=MODES[m][0], tiled_mlp_chunks=MODES[m][1],
                               checkpointing_path=s.plan.path, checkpointing_mode=s.plan.mode,
                               checkpointed_modules=len(s.plan.wrapped), tiled_modules=len(s.tiled),
                               steps=steps[m]) for m, s in steppers.items()},
                orders=orders, threads=torch.get_num_threads(),
                attn_implementation=any_model.config._attn_implementation,
                parameters=sum(p.numel() for p in any_model.parameters()),
                trainable_parameters=sum(p.numel() for p in steppers["off"].trainable))


def worker_llama_mlp(args) -> dict:
    """Peak intermediate memory of one LoRA LlamaMLP (layer 0 of the model), plain and tiled by
    tile_user_mlps, measured as worker_mlp measures the GPT's (profiler + hooks)."""
    import torch
    torch.set_num_threads(LLAMA_THREADS)
    B, T, C, inter, r = 1, args.seq_len, LLAMA["hidden_size"], LLAMA["intermediate_size"], LORA["r"]
    results = {}
    for mode in ("off", f"tiled{TILE_CHUNKS}"):
        chunks = MODES[mode][1]
        model, tiled, _ = build_lora_llama(mode, T, "Block")
        mlp = model.get_base_model().model.layers[0].mlp
        torch.manual_seed(0)
        x = torch.randn(B, T, C, requires_grad=True)
        grad_out = torch.randn(B, T, C)
        lengths = sorted({c.size(1) for c in x.detach().chunk(chunks, dim=1)}) if chunks else [T]
        wide_sizes = {B * t * inter * 4 for t in lengths}
        other_sizes = ({p.numel() * p.element_size() for p in mlp.parameters()}
                       | {B * t * w * 4 for t in {T, *lengths} for w in (C, r)})
        m = measure_mlp_peaks(mlp, x, grad_out, inter, wide_sizes)
        results["tiled" if chunks else "plain"] = dict(
            m, chunks=chunks, tiled_modules=tiled[:1], shape=[B, T, C], intermediate_size=inter,
            chunk_lengths=lengths, profiler_size_collision=bool(wide_sizes & other_sizes),
            unit_bytes=B * T * inter * 4)
    return results


# ============================================================================ driver side ====
def run_worker(kind: str, args, workdir: Path, extra: list[str], *, threads: int = THREADS,
               seq_len: int | None = None) -> dict:
    result = workdir / f"{kind}.json"
    cmd = [sys.executable, str(SCRIPT), "--worker", kind, "--result", str(result), "--workdir", str(workdir),
           "--seq-len", str(seq_len or args.seq_len), "--steps", str(args.steps), *extra]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
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


def run_gpt(args, tmp: Path) -> dict:
    """The built-in GPT: every mode in its own process, the timing rounds, the MLP probe; prints
    the tables and targets and returns the JSON (the top level of memory.json)."""
    rounds = args.timing_rounds if args.timing_rounds is not None else (1 if args.quick else 2)
    import torch
    cuda = torch.cuda.is_available()
    started = time.perf_counter()
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
    return result


def run_llama(args, tmp: Path) -> dict:
    """The LoRA Llama: the MLP probe, then every mode in one process, interleaved; prints the tables
    and returns the JSON (memory.json's "lora_llama")."""
    import torch
    started = time.perf_counter()
    T = args.llama_seq_len
    print(f"LoRA Llama (PEFT r={LORA['r']} on {', '.join(LORA['target_modules'])}): {LLAMA['num_hidden_layers']} "
          f"layers, hidden {LLAMA['hidden_size']}, intermediate {LLAMA['intermediate_size']}, "
          f"{LLAMA['num_attention_heads']} heads, vocab {LLAMA['vocab_size']}, seq_len {T}, batch 1, "
          f"checkpoint_modules={args.llama_checkpoint_modules}, tiled_mlp_modules={LLAMA_TILED_MODULES}, "
          f"{args.repeats} timed rounds, {LLAMA_THREADS} thread, torch {torch.__version__}", flush=True)
    print("LoRA LlamaMLP probe ...", flush=True)
    mlp = run_worker("llama-mlp", args, tmp / "llama_mlp", [], threads=LLAMA_THREADS, seq_len=T)
    print(f"modes {', '.join(MODES)} in one process, interleaved ...", end=" ", flush=True)
    res = run_worker("llama", args, tmp / "llama", ["--repeats", str(args.repeats), "--llama-checkpoint-modules",
                                                    args.llama_checkpoint_modules], threads=LLAMA_THREADS, seq_len=T)
    print(f"{res['process_wall_s']:.0f} s", flush=True)

    modes = res["modes"]
    off_steps = modes["off"]["steps"]
    off_saved = off_steps[0]["saved_bytes"]
    rows = []
    header = (f"{'mode':<14} {'saved MiB':>9} {'vs off':>7} {'offload MiB':>11} {'step s':>7} {'vs off':>7} "
              f"{'cpu s':>6} {'vs off':>7}  checkpointing")
    print()
    print(header)
    print("-" * len(header))
    for name, m in modes.items():
        steps, first = m["steps"], m["steps"][0]
        pairs = list(zip(steps[1:], off_steps[1:], strict=True))
        saved = first["saved_bytes"]
        off_b = first["offload_packed_bytes"] or None
        row = dict(mode=name, gradient_checkpointing=m["gradient_checkpointing"],
                   tiled_mlp_chunks=m["tiled_mlp_chunks"], checkpointing_path=m["checkpointing_path"],
                   checkpointed_modules=m["checkpointed_modules"], tiled_modules=m["tiled_modules"],
                   saved_bytes=saved, saved_vs_off=saved / off_saved, saved_tensors=first["saved_tensors"],
                   saved_tensor_bytes=first["saved_tensor_bytes"], offload_packed_bytes=off_b,
                   median_step_s=statistics.median(s["wall_s"] for s in steps[1:]),
                   median_step_cpu_s=statistics.median(s["cpu_s"] for s in steps[1:]),
                   step_time_vs_off=statistics.median(a["wall_s"] / o["wall_s"] for a, o in pairs),
                   cpu_time_vs_off=statistics.median(a["cpu_s"] / o["cpu_s"] for a, o in pairs),
                   timed_pairs=len(pairs), first_loss=first["loss"], first_grad_norm=first["grad_norm"],
                   step_wall_s=[s["wall_s"] for s in steps], step_cpu_s=[s["cpu_s"] for s in steps],
                   losses=[s["loss"] for s in steps])
        rows.append(row)
        path = f"{m['checkpointing_path']}, {m['checkpointed_modules']} modules"
        path = "-" if m["checkpointing_path"] == "off" else path
        print(f"{name:<14} {mib(saved):>9} {saved / off_saved:>7.1%} {mib(off_b):>11} {row['median_step_s']:>7.3f} "
              f"{row['step_time_vs_off']:>7.2f} {row['median_step_cpu_s']:>6.3f} {row['cpu_time_vs_off']:>7.2f}  "
              f"{path}")
    print(f"saved = distinct non-parameter storages saved for backward in forward+loss (outer hook, round 0); "
          f"offload = OffloadStats.packed_bytes; step = forward+backward+AdamW, median of {args.repeats} "
          f"interleaved rounds; vs off = median of the per-round ratios")
    loss_diff = max(abs(r["first_loss"] - rows[0]["first_loss"]) for r in rows)
    grad_diff = max(abs(r["first_grad_norm"] - rows[0]["first_grad_norm"]) / rows[0]["first_grad_norm"] for r in rows)
    print(f"info  first step across modes: loss {rows[0]['first_loss']:.6f} (max abs diff {loss_diff:.1e}), "
          f"LoRA grad norm {rows[0]['first_grad_norm']:.4e} (max rel diff {grad_diff:.1e})")

    pl, ti = mlp["plain"], mlp["tiled"]
    print()
    print(f"LoRA LlamaMLP (B=1, T={T}, C={LLAMA['hidden_size']}, I={pl['intermediate_size']}, LoRA on gate, up, "
          "down; layer 0 of the model), one forward+backward:")
    print(f"  {'':<8} {'peak I MiB':>10} {'I after fwd':>11} {'saved peak':>10} {'peak all MiB':>12}")
    for label, r in (("plain", pl), (f"tiled{TILE_CHUNKS}", ti)):
        print(f"  {label:<8} {mib(r['profiler_peak_wide_bytes']):>10} "
              f"{mib(r['profiler_wide_live_after_forward_bytes']):>11} {mib(r['hooks_peak_saved_bytes']):>10} "
              f"{mib(r['profiler_peak_all_bytes']):>12}")
    ratio = pl["profiler_peak_wide_bytes"] / max(1, ti["profiler_peak_wide_bytes"])
    hooks_ratio = pl["hooks_peak_saved_bytes"] / max(1, ti["hooks_peak_saved_bytes"])
    collision = pl["profiler_size_collision"] or ti["profiler_size_collision"]
    print("  peak I = live (B,t,I) fp32 buffers from torch.profiler memory events; saved peak = live I-wide tensors "
          "saved for backward (saved_tensors_hooks, recompute included); peak all = every allocation")
    print(f"info  LoRA LlamaMLP peak intermediate plain/tiled{TILE_CHUNKS}: {ratio:.2f}x profiler"
          f"{' (sizes collide: not exact)' if collision else ''}, {hooks_ratio:.2f}x saved-tensor hooks")

    elapsed = time.perf_counter() - started
    print(f"\nLoRA Llama total {elapsed:.0f} s")
    return dict(
        description="PEFT LoRA Llama (transformers) under each memory saver, modes applied with "
                    "framework.model.tiled_mlp.tile_user_mlps and enable_checkpointing; see bench/memory.py docstring",
        quick=args.quick, torch=torch.__version__, python=platform.python_version(), cores=os.cpu_count(),
        threads=res["threads"], device="cpu",
        model=dict(LLAMA, seq_len=T, batch_size=1, attn_implementation=res["attn_implementation"],
                   parameters=res["parameters"], trainable_parameters=res["trainable_parameters"]),
        lora=LORA, checkpoint_modules=args.llama_checkpoint_modules, tiled_mlp_modules=LLAMA_TILED_MODULES,
        timed_rounds=args.repeats, orders=res["orders"], modes=rows, mlp=mlp,
        mlp_peak_ratio=ratio, mlp_hooks_peak_ratio=hooks_ratio,
        first_step_max_loss_diff=loss_diff, first_step_max_grad_norm_rel_diff=grad_diff, elapsed_s=elapsed)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=("gpt", "lora-llama", "all"), default="all",
                   help="which model's table to measure (default all); the JSON keeps the other's results")
    p.add_argument("--quick", action="store_true",
                   help=f"seq_len {QUICK_SEQ_LEN} (LoRA Llama {LLAMA_QUICK_SEQ_LEN}), one timing round (2 repeats)")
    p.add_argument("--steps", type=int, default=3, help="GPT: training steps per mode (default 3)")
    p.add_argument("--timing-rounds", type=int, default=None,
                   help="GPT: extra processes that interleave off/non_reentrant/reentrant steps (default 2, quick 1)")
    p.add_argument("--repeats", type=int, default=None,
                   help=f"LoRA Llama: timed rounds, each running every mode once (default {LLAMA_REPEATS}, quick 2)")
    p.add_argument("--llama-seq-len", type=int, default=None,
                   help=f"LoRA Llama: sequence length (default {LLAMA_SEQ_LEN}, quick {LLAMA_QUICK_SEQ_LEN})")
    p.add_argument("--llama-checkpoint-modules", default="Block",
                   help="LoRA Llama: memory.activation_checkpointing_modules (default Block, DDPTrainer's default, "
                        "which names nothing in a Llama: the model's own checkpointing; LlamaDecoderLayer: the "
                        "framework's wrapping)")
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
    if args.llama_seq_len is None:
        args.llama_seq_len = LLAMA_QUICK_SEQ_LEN if args.quick else LLAMA_SEQ_LEN
    if args.repeats is None:
        args.repeats = 2 if args.quick else LLAMA_REPEATS

    if args.worker:
        workers = {"mlp": worker_mlp, "timing": worker_timing, "mode": worker_mode, "llama": worker_llama,
                   "llama-mlp": worker_llama_mlp}
        out = workers[args.worker](args)
        Path(args.result).write_text(json.dumps(out, indent=2))
        return 0

    if args.steps < 2:
        p.error("--steps must be at least 2 (the first step is excluded from timing)")
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    out_path = args.out or (Path(tempfile.gettempdir()) / "bench_memory_quick.json" if args.quick else RESULTS)
    # The JSON holds the GPT's results at its top level and the LoRA Llama's under "lora_llama"; a run
    # of one model keeps the other's results from the file.
    previous = json.loads(out_path.read_text()) if out_path.exists() else {}
    tmp = Path(tempfile.mkdtemp(prefix="bench_memory_"))
    if args.model in ("gpt", "all"):
        result = run_gpt(args, tmp)
        if "lora_llama" in previous:
            result["lora_llama"] = previous["lora_llama"]
    else:
        result = previous
    if args.model in ("lora-llama", "all"):
        if args.model == "all":
            print()
        result["lora_llama"] = run_llama(args, tmp)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=2) + "\n")
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"wrote {out_path.relative_to(ROOT) if out_path.is_relative_to(ROOT) else out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
