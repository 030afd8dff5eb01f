"""The configuration's shape: one section per owning component, each a dataclass of documented,
bounded fields, and ``TrainConfig`` holding the sections.

Every field declares

- ``resume``: what a resume does when the value differs from the checkpoint's
  (see ``RESUME_CLASSES``);
- ``was``: its flat name before the config had sections, still accepted as a deprecated alias.
"""

from __future__ import annotations

import ast
import functools
import inspect
import typing
from dataclasses import dataclass, field, fields
from typing import Any, Literal


class ConfigError(ValueError):
    """A user's configuration is wrong. ``problems`` holds one line per mistake."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("invalid configuration:\n" + "\n".join(f"  {p}" for p in self.problems))


ActivationCheckpointing = Literal["off", "non_reentrant", "reentrant", "offload"]
GradientCheckpointing = ActivationCheckpointing  # the name before sections
Switch = Literal["auto", "true", "false"]
Resume = Literal["neutral", "changes", "refused", "refused_builtin_data"]

RESUME_CLASSES: dict[str, str] = {
    "neutral": "may change on resume (where and how often things happen, not what is computed)",
    "changes": "may change on resume; the run differs from there on (logged as a WARNING)",
    "refused": "a resume with another value is refused (the saved position would be meaningless)",
    "refused_builtin_data": "refused when the run trains on the built-in data; ignored for a user's dataset",
}


AUTO = -1
"""What an int field declared with ``auto=True`` holds for "auto" (spelled auto or -1 in every
source): the component that owns it resolves the value for the machine it runs on."""


Builtin = Literal["model", "data"]
"""What only some runs use: the built-in GPT (no ``model`` given to DDPTrainer) or the built-in
data (no ``train_dataset``)."""


def bounded(default: int | float, *, lo: int | float | None, hi: int | float | None = None,
            resume: Resume, was: str | None, auto: bool = False, used_by: tuple[Builtin, ...] = ()):
    """A numeric field whose value must lie in [lo, hi] (None: no bound on that side), or be
    ``AUTO`` when ``auto``. Every numeric field is declared through this, so a missing bound is a
    visible choice. ``used_by``: the built-in parts that read it (none: every run does)."""
    return field(default=default, metadata={"bounds": (lo, hi), "resume": resume, "was": was, "auto": auto,
                                            "used_by": used_by})


def option(default: Any, *, resume: Resume, was: str | None, used_by: tuple[Builtin, ...] = ()):
    """A non-numeric field (a string, a switch or a choice). ``was``: its flat name before the
    configuration had sections (None for a key added since, which has no old name)."""
    return field(default=default, metadata={"resume": resume, "was": was, "used_by": used_by})


@dataclass
class ModelSection:
    vocab_size: int = bounded(10000, lo=2, resume="changes", was="vocab_size", used_by=("model", "data"))
    """Vocabulary size of the built-in model; text data sets it from the corpus."""
    hidden_size: int = bounded(512, lo=1, resume="changes", was="hidden_size", used_by=("model",))
    """Width of the residual stream (embedding dimension)."""
    num_layers: int = bounded(6, lo=1, resume="changes", was="num_layers", used_by=("model",))
    """Number of transformer blocks."""
    num_heads: int = bounded(8, lo=1, resume="changes", was="num_heads", used_by=("model",))
    """Attention heads per block; must divide hidden_size."""
    dropout: float = bounded(0.1, lo=0.0, hi=0.999, resume="changes", was="dropout", used_by=("model",))
    """Dropout probability in attention, MLP and embeddings."""
    tie_embeddings: bool = option(False, resume="changes", was="tie_embeddings", used_by=("model",))
    """Share the token embedding with the output projection."""
    seq_len: int = bounded(128, lo=1, resume="changes", was="seq_len", used_by=("model", "data"))
    """Tokens per training sequence (context length)."""


@dataclass
class MemorySection:
    activation_checkpointing: ActivationCheckpointing = option("off", resume="changes", was="gradient_checkpointing")
    """Recompute activations in backward: non_reentrant (recommended), reentrant, or offload (CPU-held inputs)."""
    activation_checkpointing_modules: str = option("Block", resume="neutral", was="checkpoint_modules")
    """Comma-separated class names or module-name patterns whose activations are recomputed (for a user's model)."""
    tiled_mlp_chunks: int = bounded(0, lo=0, resume="changes", was="tiled_mlp_chunks")
    """Run the MLP over this many sequence chunks, recomputing each in backward; 0 = off."""
    tiled_mlp_modules: str = option("", resume="changes", was="tiled_mlp_modules")
    """Comma-separated class names or module-name patterns of a user model's SwiGLU MLPs to tile (e.g. LlamaMLP)."""
    cleanup_interval: int = bounded(100, lo=1, resume="neutral", was="cleanup_interval")
    """Run a garbage collection on every rank every this many steps."""
    check_interval: int = bounded(50, lo=1, resume="neutral", was="memory_check_interval")
    """Log memory usage every this many steps."""
    max_gb: float = bounded(16.0, lo=0.0, resume="neutral", was="max_memory_gb")
    """Warn when a rank's memory use exceeds this many GiB."""


@dataclass
class DataSection:
    source: str = option("synthetic", resume="refused_builtin_data", was="data", used_by=("data",))
    """'synthetic' (seeded Markov chain), a .txt file (character-level) or a .bin uint16 token file."""
    synthetic_size: int = bounded(10000, lo=1, resume="refused_builtin_data", was="dataset_size",
                                 used_by=("data",))
    """Number of training sequences generated for data.source=synthetic."""
    batch_size: int = bounded(32, lo=1, resume="changes", was="batch_size")
    """Sequences per micro-batch on each rank."""
    gradient_accumulation_steps: int = bounded(1, lo=1, resume="changes", was="gradient_accumulation_steps")
    """Micro-batches per optimizer step; all but the last run under no_sync()."""
    global_batch_size: int = bounded(0, lo=0, resume="changes", was=None)
    """Samples per optimizer step on all ranks, re-split at any world size; 0: batch_size x accumulation x ranks."""
    world_size_change: Literal["keep_global_batch", "scale_global_batch"] = option(
        "keep_global_batch", resume="neutral", was=None)
    """On resume at another world size: keep the checkpoint's global batch (re-split per rank), or scale it."""
    num_workers: int = bounded(AUTO, lo=0, resume="neutral", was="num_workers", auto=True)
    """DataLoader workers per rank, capped by the cores left after one per rank (min 1); auto: up to 4, 0 if none."""
    pin_memory: bool = option(True, resume="neutral", was="pin_memory")
    """Pin host memory for batches; used only on CUDA."""
    exclude_samples: str = option("", resume="neutral", was="exclude_samples")
    """A JSON file of training-sample indices left out of every epoch (e.g. a rollback's EXCLUDED_SAMPLES.json)."""


@dataclass
class OptimSection:
    lr: float = bounded(1e-4, lo=0.0, resume="changes", was="learning_rate")
    """Peak AdamW learning rate."""
    min_lr: float = bounded(0.0, lo=0.0, resume="changes", was="min_lr")
    """Learning rate at the end of the cosine decay."""
    warmup_steps: int = bounded(0, lo=0, resume="changes", was="warmup_steps")
    """Linear warmup steps from 0 to optim.lr."""
    beta1: float = bounded(0.9, lo=0.0, hi=0.999999, resume="changes", was="beta1")
    """AdamW beta1."""
    beta2: float = bounded(0.95, lo=0.0, hi=0.999999, resume="changes", was="beta2")
    """AdamW beta2."""
    weight_decay: float = bounded(0.01, lo=0.0, resume="changes", was="weight_decay")
    """AdamW weight decay, applied to matrices only (not biases, norms or embeddings' positions)."""
    impl: Literal["auto", "fused", "foreach", "for_loop"] = option("auto", resume="changes", was="optimizer_impl")
    """The built-in AdamW's kernels: auto = fused (one kernel for all parameters; CPU, CUDA), foreach, for_loop."""
    grad_clip: float = bounded(1.0, lo=0.0, resume="changes", was="grad_clip")
    """Clip the global gradient norm to this value; 0 disables clipping."""


@dataclass
class TrainSection:
    num_epochs: int = bounded(10, lo=1, resume="neutral", was="num_epochs")
    """Passes over the training set (an upper bound when max_steps is set)."""
    max_steps: int = bounded(0, lo=0, resume="neutral", was="max_steps")
    """Stop after this many optimizer steps; 0 means num_epochs decides."""
    target_loss: float = bounded(0.01, lo=0.0, resume="neutral", was="target_loss")
    """Stop once the all-reduced training loss is at or below this; 0 disables."""
    seed: int = bounded(1337, lo=0, hi=2**63 - 1, resume="refused", was="seed")
    """Seed for model init, data order and dropout."""
    deterministic: bool = option(False, resume="changes", was="deterministic")
    """Use deterministic kernels only (bit-reproducible runs, slower on CUDA)."""
    loss_average: Literal["micro_batch", "tokens", "rank_tokens"] = option("micro_batch", resume="changes", was=None)
    """How a step's loss averages: micro_batch = each micro-batch's mean, averaged; tokens = every labelled
    token (label != -100) of the global batch weighs the same (transformers' average_tokens_across_devices);
    rank_tokens = each rank's tokens weigh the same, then the ranks are averaged."""


@dataclass
class PrecisionSection:
    autocast: Switch = option("auto", resume="changes", was="use_amp")
    """Autocast: auto = on for CUDA, off (fp32) on CPU; true forces it, false disables it."""
    dtype: Literal["bf16", "fp16"] = option("bf16", resume="changes", was="amp_dtype")
    """Autocast dtype; fp16 adds a GradScaler and needs CUDA."""


@dataclass
class EvalSection:
    interval: int = bounded(500, lo=0, resume="neutral", was="eval_interval")
    """Evaluate every this many steps (and at the end); 0 evaluates only at the end."""
    steps: int = bounded(20, lo=0, resume="neutral", was="eval_steps")
    """Validation batches per evaluation (the same global prefix of the validation set on any world size); 0 = all."""


@dataclass
class LoggingSection:
    dir: str = option("logs", resume="neutral", was="log_dir")
    """Directory for per-rank logs, TensorBoard events, the resolved config and summary.json."""
    interval: int = bounded(10, lo=1, resume="neutral", was="log_interval")
    """Log training metrics every this many steps."""
    tensorboard: bool = option(True, resume="neutral", was="tensorboard")
    """Write TensorBoard scalars from rank 0."""
    progress_bar: Switch = option("auto", resume="neutral", was="progress_bar")
    """tqdm bar on rank 0: auto shows it only when stderr is a terminal."""
    record_samples: bool = option(False, resume="neutral", was="record_samples")
    """Append each committed step's sample indices to logging.dir/samples_rank_N.jsonl (an audit trail)."""


@dataclass
class CheckpointSection:
    dir: str = option("checkpoints", resume="neutral", was="checkpoint_dir")
    """Directory for checkpoints and the final model."""
    every_steps: int = bounded(0, lo=0, resume="neutral", was="save_every_steps")
    """Save a checkpoint every this many optimizer steps; 0 disables step checkpoints."""
    every_epochs: int = bounded(5, lo=0, resume="neutral", was="save_interval")
    """Save a checkpoint every this many epochs; 0 disables epoch checkpoints."""
    every_minutes: float = bounded(10.0, lo=0.0, resume="neutral", was=None)
    """Save a checkpoint once this many minutes of training have passed since the last save (rank 0's
    clock, agreed at the step); 0 disables timed checkpoints."""
    keep_last: int = bounded(3, lo=1, resume="neutral", was="keep_last")
    """Number of checkpoints kept in checkpoint.dir (older ones are deleted)."""
    resume: str = option("auto", resume="neutral", was="resume")
    """auto = the newest valid checkpoint in checkpoint.dir, none = start fresh, or a checkpoint file."""
    export_dir: str = option("", resume="neutral", was="export_dir")
    """Where a finished run exports its final weights as safetensors: '' = checkpoint.dir/export; none = no export."""
    save_on_peer_loss: bool = option(True, resume="neutral", was=None)
    """When a peer process goes away mid-step (killed, or its node lost), a surviving rank saves the last
    step every rank finished, alone, so that the restart redoes no step."""


@dataclass
class RecoverySection:
    max_errors_per_epoch: int = bounded(5, lo=0, resume="neutral", was="max_errors_per_epoch")
    """Skipped (non-finite) steps allowed per epoch before the run aborts."""
    agree_nonfinite: bool = option(True, resume="changes", was="agree_nonfinite")
    """Skip a step on every rank when any rank sees a non-finite loss or gradient (false: each rank alone)."""
    consistency_check_interval: int = bounded(100, lo=0, resume="neutral", was="consistency_check_interval")
    """Check every this many steps that all ranks hold bit-identical parameters; 0 disables."""
    step_timeout_s: float = bounded(600.0, lo=0.0, hi=86400.0, resume="neutral", was="step_timeout_s")
    """Hang watchdog: a step may take max(this, step_timeout_factor x median step time); 0 disables."""
    step_timeout_factor: float = bounded(10.0, lo=1.0, hi=1000.0, resume="neutral", was="step_timeout_factor")
    """Hang watchdog: multiple of the median step time allowed for one step."""
    max_loader_restarts: int = bounded(3, lo=0, resume="neutral", was="max_loader_restarts")
    """DataLoader rebuilds allowed per epoch after a worker died or timed out."""
    oom: Switch = option("auto", resume="neutral", was="oom_recovery")
    """On out-of-memory, halve the micro-batch and double accumulation; auto = on with CUDA."""
    peer_timeout_s: float = bounded(10.0, lo=0.0, hi=86400.0, resume="neutral", was=None)
    """A peer silent this long (frozen, or cut off: no heartbeat) ends the restart with exit 75 at once,
    not after ddp.timeout_s; 0 disables."""
    max_no_progress_restarts: int = bounded(3, lo=1, resume="neutral", was="max_no_progress_restarts")
    """Elastic restarts in a row that resume from the same checkpoint step before the run stops with FATAL."""
    fault_inject: str = option("", resume="neutral", was="fault_inject")
    """Faults to rehearse, e.g. 'nan@step=5,rank=1; sigterm@step=8' (docs/run-health.md); empty = none."""


@dataclass
class StragglerSection:
    interval: int = bounded(50, lo=0, resume="neutral", was="straggler_interval")
    """Share every rank's section timings every this many steps (one small all-gather); 0 = off."""
    threshold: float = bounded(1.3, lo=1.0, resume="neutral", was="straggler_threshold")
    """A rank this many times slower than the fastest in a section (and straggler.min_ms more) is slow."""
    min_ms: float = bounded(5.0, lo=0.0, resume="neutral", was="straggler_min_ms")
    """A rank must also be this many ms slower than the fastest: sub-millisecond noise never counts."""
    patience: int = bounded(2, lo=1, resume="neutral", was="straggler_patience")
    """Checks in a row a rank must be slow before it is named."""
    action: Literal["warn", "fatal"] = option("warn", resume="neutral", was="straggler_action")
    """warn names a persistent straggler in a WARNING; fatal stops the run with FATAL naming it."""


@dataclass
class SpikeSection:
    guard: Literal["off", "warn", "rollback"] = option("warn", resume="neutral", was="spike_guard")
    """Loss-spike guard: warn logs a spike; rollback returns to the checkpoint before it and excludes its samples."""
    threshold: float = bounded(6.0, lo=1.0, resume="neutral", was="spike_threshold")
    """A spike: the loss this many deviations above the trend of the last spike.window steps."""
    warmup: int = bounded(50, lo=0, resume="neutral", was="spike_warmup")
    """Steps observed before the guard judges (the early loss falls too fast for a trend)."""
    window: int = bounded(50, lo=3, resume="neutral", was="spike_window")
    """Steps in the window the trend and its deviation are fitted to."""
    max_rollbacks: int = bounded(3, lo=0, resume="neutral", was="max_rollbacks")
    """Rollbacks allowed in a run; one more stops it with FATAL naming the steps and samples."""
    lr_cooldown: int = bounded(0, lo=0, resume="neutral", was="spike_lr_cooldown")
    """After a rollback, ramp the learning rate back up linearly over this many steps; 0 = off."""


@dataclass
class DDPSection:
    backend: Literal["auto", "gloo", "nccl"] = option("auto", resume="neutral", was="backend")
    """Process-group backend: auto = nccl with CUDA, else gloo; nccl under torchrun makes a group even for 1 process."""
    timeout_s: float = bounded(600.0, lo=1.0, hi=86400.0, resume="neutral", was="timeout_s")
    """Timeout in seconds for every collective (and, unless init_timeout_s is set, process-group init)."""
    init_timeout_s: float = bounded(0.0, lo=0.0, hi=86400.0, resume="neutral", was="init_timeout_s")
    """Timeout for process-group init and everything up to the first step's end (then timeout_s); 0 = timeout_s."""
    static_graph: Switch = option("auto", resume="neutral", was="ddp_static_graph")
    """DDP static_graph; auto decides from a preflight probe of the model (env DDP_STATIC_GRAPH=0|1)."""
    find_unused_parameters: Switch = option("auto", resume="neutral", was="find_unused_parameters")
    """DDP find_unused_parameters; auto decides from the preflight probe (env DDP_FIND_UNUSED_PARAMETERS=0|1)."""
    bucket_cap_mb: float = bounded(25.0, lo=0.0, resume="neutral", was="bucket_cap_mb")
    """DDP gradient bucket size in MiB."""
    gradient_as_bucket_view: bool = option(False, resume="neutral", was="gradient_as_bucket_view")
    """Let gradients alias DDP's communication buckets (saves one copy of the gradients)."""
    broadcast_buffers: bool = option(True, resume="changes", was="broadcast_buffers")
    """Broadcast module buffers from rank 0 at every forward."""
    comm_hook: Literal["none", "fp16", "bf16", "powersgd"] = option("none", resume="changes", was="ddp_comm_hook")
    """All-reduce: none = fp32, fp16/bf16 = 16-bit (gloo or NCCL), powersgd = low-rank (docs/performance.md)"""
    powersgd_rank: int = bounded(1, lo=1, hi=1024, resume="changes", was="powersgd_rank")
    """PowerSGD's matrix approximation rank (1 = strongest compression; try 2, 4, ... if the loss suffers)."""
    powersgd_start_iter: int = bounded(1000, lo=2, resume="changes", was="powersgd_start_iter")
    """PowerSGD runs plain all-reduce for this many synced backward passes (optimizer steps) first; at least 2."""


@dataclass
class CompileSection:
    enabled: bool = option(False, resume="neutral", was="compile")
    """torch.compile the model after the DDP preflight and wrapping (DDP's graph split at bucket boundaries)."""
    mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] = option(
        "default", resume="neutral", was="compile_mode")
    """torch.compile mode."""
    backend: Literal["inductor", "aot_eager", "eager"] = option("inductor", resume="neutral", was="compile_backend")
    """torch.compile backend: inductor generates kernels (needs a C compiler on CPU); aot_eager only traces."""


@dataclass
class TrainConfig:
    """The whole configuration: one section per component that owns it."""
    model: ModelSection = field(default_factory=ModelSection)
    memory: MemorySection = field(default_factory=MemorySection)
    data: DataSection = field(default_factory=DataSection)
    optim: OptimSection = field(default_factory=OptimSection)
    train: TrainSection = field(default_factory=TrainSection)
    precision: PrecisionSection = field(default_factory=PrecisionSection)
    eval: EvalSection = field(default_factory=EvalSection)
    logging: LoggingSection = field(default_factory=LoggingSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    recovery: RecoverySection = field(default_factory=RecoverySection)
    straggler: StragglerSection = field(default_factory=StragglerSection)
    spike: SpikeSection = field(default_factory=SpikeSection)
    ddp: DDPSection = field(default_factory=DDPSection)
    compile: CompileSection = field(default_factory=CompileSection)


SECTIONS: dict[str, type] = {f.name: f.default_factory for f in fields(TrainConfig)}  # type: ignore[misc]
"""Section name -> its dataclass, in the order of TrainConfig."""


def _field_docs(cls: type) -> dict[str, str]:
    """The string literal under each field of ``cls`` (attribute docstrings, as litgpt writes them)."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:], strict=False):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)):
            docs[node.target.id] = " ".join(nxt.value.value.split())  # a long one spans lines
    return docs


FIELDS = {f"{name}.{f.name}": f for name, cls in SECTIONS.items() for f in fields(cls)}
"""Dotted key ('spike.threshold') -> its dataclass field."""
KEYS = list(FIELDS)
TYPES = {f"{name}.{key}": tp for name, cls in SECTIONS.items() for key, tp in typing.get_type_hints(cls).items()}
ALIASES = {f.metadata["was"]: key for key, f in FIELDS.items() if f.metadata["was"] is not None}
"""Flat key of the config before sections ('spike_threshold') -> its dotted key."""
COMPACT = frozenset({
    "batch_size", "learning_rate", "num_epochs", "use_amp", "vocab_size", "hidden_size", "num_layers", "num_heads",
    "dropout", "weight_decay", "dataset_size", "seq_len", "num_workers", "pin_memory", "log_interval",
    "save_interval", "memory_check_interval", "cleanup_interval", "max_errors_per_epoch", "max_memory_gb",
    "target_loss",
})
"""The original Python API's keys (``{'batch_size': 32, 'learning_rate': 1e-4, 'num_epochs': 10,
'use_amp': True}``): first-class, the compact form of their dotted keys, accepted without a note.
The other flat keys are deprecated (accepted with one note each)."""
RESUME = {key: f.metadata["resume"] for key, f in FIELDS.items()}


@functools.cache
def field_docs() -> dict[str, str]:
    """Dotted key -> the string literal under its field. Parsed from this module's source on first
    use (help, docs, tests), not at import: that takes 0.1 s, which every worker's start would pay."""
    return {f"{name}.{key}": doc for name, cls in SECTIONS.items() for key, doc in _field_docs(cls).items()}


def applicable_keys(*, builtin_model: bool = True, builtin_data: bool = True) -> list[str]:
    """The dotted keys that apply to a run on the built-in GPT or a user's model, and the built-in
    data or a user's dataset: what its logged and saved configuration shows, and what a resume
    compares. A key read only by built-in parts the run does not use is left out."""
    uses = {"model": builtin_model, "data": builtin_data}
    return [key for key, f in FIELDS.items()
            if not f.metadata["used_by"] or any(uses[part] for part in f.metadata["used_by"])]


def get(cfg: TrainConfig, key: str) -> Any:
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


def from_dotted(values: dict[str, Any]) -> TrainConfig:
    """A TrainConfig from dotted keys (the rest at their defaults); values are not checked."""
    by_section: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
    for key, value in values.items():
        section, name = key.split(".")
        by_section[section][name] = value
    return TrainConfig(**{name: SECTIONS[name](**kw) for name, kw in by_section.items()})


def dotted(saved: dict[str, Any]) -> dict[str, Any]:
    """A saved config dict (nested by section, or flat as written before sections) as dotted keys.
    Flat keys are mapped through ``ALIASES``; keys this version does not know are dropped."""
    out = {}
    for key, value in saved.items():
        if isinstance(value, dict) and key in SECTIONS:
            out.update((f"{key}.{k}", v) for k, v in value.items() if f"{key}.{k}" in FIELDS)
        elif key in ALIASES:
            out.setdefault(ALIASES[key], value)
        elif key in FIELDS:
            out[key] = value
    return out


def is_auto(key: str, value: Any) -> bool:
    """``value`` is the "auto" of a field that has one."""
    return bool(FIELDS[key].metadata.get("auto")) and value == AUTO


def describe_type(key: str) -> str:
    tp = TYPES[key]
    if typing.get_origin(tp) is Literal:
        return "|".join(typing.get_args(tp))
    return tp.__name__ + ("|auto" if FIELDS[key].metadata.get("auto") else "")


def describe_default(key: str) -> Any:
    default = FIELDS[key].default
    return "auto" if is_auto(key, default) else default
