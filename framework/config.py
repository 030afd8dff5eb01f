"""The one training configuration: a validated dataclass and the sources it is read from.

Sources, lowest to highest precedence: field defaults, a config file (``--config run.toml`` or
``.json``), environment variables ``DDP_<KEY>``, then command-line flags ``--key value``.
Every problem found in any source is collected and reported at once, as one line each.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import importlib.util
import inspect
import json
import math
import os
import shutil
import tomllib
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

ENV_PREFIX = "DDP_"


class ConfigError(ValueError):
    """A user's configuration is wrong. ``problems`` holds one line per mistake."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("invalid configuration:\n" + "\n".join(f"  {p}" for p in self.problems))


GradientCheckpointing = Literal["off", "non_reentrant", "reentrant", "offload"]
Switch = Literal["auto", "true", "false"]


def bounded(default: int | float, *, lo: int | float | None, hi: int | float | None = None):
    """A numeric field whose value must lie in [lo, hi] (None: no bound on that side). Every
    numeric field is declared through this, so a missing bound is a visible choice."""
    return field(default=default, metadata={"bounds": (lo, hi)})


@dataclass
class TrainConfig:
    # --- model -------------------------------------------------------------------------------
    vocab_size: int = bounded(10000, lo=2)
    """Vocabulary size of the built-in model; text data sets it from the corpus."""
    hidden_size: int = bounded(512, lo=1)
    """Width of the residual stream (embedding dimension)."""
    num_layers: int = bounded(6, lo=1)
    """Number of transformer blocks."""
    num_heads: int = bounded(8, lo=1)
    """Attention heads per block; must divide hidden_size."""
    dropout: float = bounded(0.1, lo=0.0, hi=0.999)
    """Dropout probability in attention, MLP and embeddings."""
    tie_embeddings: bool = False
    """Share the token embedding with the output projection."""
    seq_len: int = bounded(128, lo=1)
    """Tokens per training sequence (context length)."""

    # --- memory savers -----------------------------------------------------------------------
    gradient_checkpointing: GradientCheckpointing = "off"
    """Recompute activations in backward: non_reentrant (recommended), reentrant, or offload (CPU-held inputs)."""
    checkpoint_modules: str = "Block"
    """Comma-separated class names or module-name patterns to checkpoint (for a user's model)."""
    tiled_mlp_chunks: int = bounded(0, lo=0)
    """Run the MLP over this many sequence chunks, recomputing each in backward; 0 = off."""
    tiled_mlp_modules: str = ""
    """Comma-separated class names or module-name patterns of a user model's SwiGLU MLPs to tile (e.g. LlamaMLP)."""

    # --- data --------------------------------------------------------------------------------
    data: str = "synthetic"
    """'synthetic' (seeded Markov chain), a .txt file (character-level) or a .bin uint16 token file."""
    dataset_size: int = bounded(10000, lo=1)
    """Number of training sequences generated for data=synthetic."""
    batch_size: int = bounded(32, lo=1)
    """Sequences per micro-batch on each rank."""
    gradient_accumulation_steps: int = bounded(1, lo=1)
    """Micro-batches per optimizer step; all but the last run under no_sync()."""
    num_workers: int = bounded(4, lo=0)
    """DataLoader workers per node; divided among local ranks and capped by free cores."""
    pin_memory: bool = True
    """Pin host memory for batches; used only on CUDA."""

    # --- optimisation ------------------------------------------------------------------------
    learning_rate: float = bounded(1e-4, lo=0.0)
    """Peak AdamW learning rate."""
    min_lr: float = bounded(0.0, lo=0.0)
    """Learning rate at the end of the cosine decay."""
    warmup_steps: int = bounded(0, lo=0)
    """Linear warmup steps from 0 to learning_rate."""
    beta1: float = bounded(0.9, lo=0.0, hi=0.999999)
    """AdamW beta1."""
    beta2: float = bounded(0.95, lo=0.0, hi=0.999999)
    """AdamW beta2."""
    weight_decay: float = bounded(0.01, lo=0.0)
    """AdamW weight decay, applied to matrices only (not biases, norms or embeddings' positions)."""
    optimizer_impl: Literal["auto", "fused", "foreach", "for_loop"] = "auto"
    """The built-in AdamW's kernels: auto = fused (one kernel for all parameters; CPU, CUDA), foreach, for_loop."""
    grad_clip: float = bounded(1.0, lo=0.0)
    """Clip the global gradient norm to this value; 0 disables clipping."""
    num_epochs: int = bounded(10, lo=1)
    """Passes over the training set (an upper bound when max_steps is set)."""
    max_steps: int = bounded(0, lo=0)
    """Stop after this many optimizer steps; 0 means num_epochs decides."""
    target_loss: float = bounded(0.01, lo=0.0)
    """Stop once the all-reduced training loss is at or below this; 0 disables."""
    seed: int = bounded(1337, lo=0, hi=2**63 - 1)
    """Seed for model init, data order and dropout."""
    deterministic: bool = False
    """Use deterministic kernels only (bit-reproducible runs, slower on CUDA)."""

    # --- precision ---------------------------------------------------------------------------
    use_amp: Switch = "auto"
    """Autocast: auto = on for CUDA, off (fp32) on CPU; true forces it, false disables it."""
    amp_dtype: Literal["bf16", "fp16"] = "bf16"
    """Autocast dtype; fp16 adds a GradScaler and needs CUDA."""

    # --- evaluation and logging --------------------------------------------------------------
    eval_interval: int = bounded(500, lo=0)
    """Evaluate every this many steps (and at the end); 0 evaluates only at the end."""
    eval_steps: int = bounded(20, lo=0)
    """Validation batches per evaluation (the same global prefix of the validation set on any world size); 0 = all."""
    log_interval: int = bounded(10, lo=1)
    """Log training metrics every this many steps."""
    log_dir: str = "logs"
    """Directory for per-rank logs, TensorBoard events, the resolved config and summary.json."""
    tensorboard: bool = True
    """Write TensorBoard scalars from rank 0."""
    progress_bar: Switch = "auto"
    """tqdm bar on rank 0: auto shows it only when stderr is a terminal."""
    memory_check_interval: int = bounded(50, lo=1)
    """Log memory usage every this many steps."""
    cleanup_interval: int = bounded(100, lo=1)
    """Run a garbage collection on every rank every this many steps."""
    max_memory_gb: float = bounded(16.0, lo=0.0)
    """Warn when a rank's memory use exceeds this many GiB."""

    # --- checkpoints and recovery ------------------------------------------------------------
    checkpoint_dir: str = "checkpoints"
    """Directory for checkpoints and the final model."""
    export_dir: str = ""
    """Where a finished run exports its final weights as safetensors: '' = checkpoint_dir/export; none = no export."""
    save_interval: int = bounded(5, lo=0)
    """Save a checkpoint every this many epochs; 0 disables epoch checkpoints."""
    max_errors_per_epoch: int = bounded(5, lo=0)
    """Skipped (non-finite) steps allowed per epoch before the run aborts."""
    save_every_steps: int = bounded(0, lo=0)
    """Save a checkpoint every this many optimizer steps; 0 disables step checkpoints."""
    keep_last: int = bounded(3, lo=1)
    """Number of checkpoints kept in checkpoint_dir (older ones are deleted)."""
    resume: str = "auto"
    """auto = the newest valid checkpoint in checkpoint_dir, none = start fresh, or a checkpoint file."""
    record_samples: bool = False
    """Append each committed step's sample indices to log_dir/samples_rank_N.jsonl (an audit trail)."""
    fault_inject: str = ""
    """Faults to rehearse, e.g. 'nan@step=5,rank=1; sigterm@step=8' (see README); empty = none."""
    agree_nonfinite: bool = True
    """Skip a step on every rank when any rank sees a non-finite loss or gradient (false: each rank alone)."""
    consistency_check_interval: int = bounded(100, lo=0)
    """Check every this many steps that all ranks hold bit-identical parameters; 0 disables."""
    step_timeout_s: float = bounded(600.0, lo=0.0, hi=86400.0)
    """Hang watchdog: a step may take max(this, step_timeout_factor x median step time); 0 disables."""
    step_timeout_factor: float = bounded(10.0, lo=1.0, hi=1000.0)
    """Hang watchdog: multiple of the median step time allowed for one step."""
    max_loader_restarts: int = bounded(3, lo=0)
    """DataLoader rebuilds allowed per epoch after a worker died or timed out."""
    oom_recovery: Switch = "auto"
    """On out-of-memory, halve the micro-batch and double accumulation; auto = on with CUDA."""
    max_no_progress_restarts: int = bounded(3, lo=1)
    """Elastic restarts in a row that resume from the same checkpoint step before the run stops with FATAL."""

    # --- stragglers --------------------------------------------------------------------------
    straggler_interval: int = bounded(50, lo=0)
    """Share every rank's section timings every this many steps (one small all-gather); 0 = off."""
    straggler_threshold: float = bounded(1.3, lo=1.0)
    """A rank this many times slower than the fastest in a section (and straggler_min_ms more) is slow."""
    straggler_min_ms: float = bounded(5.0, lo=0.0)
    """A rank must also be this many ms slower than the fastest: sub-millisecond noise never counts."""
    straggler_patience: int = bounded(2, lo=1)
    """Checks in a row a rank must be slow before it is named."""
    straggler_action: Literal["warn", "fatal"] = "warn"
    """warn names a persistent straggler in a WARNING; fatal stops the run with FATAL naming it."""

    # --- loss spikes -------------------------------------------------------------------------
    spike_guard: Literal["off", "warn", "rollback"] = "warn"
    """Loss-spike guard: warn logs a spike; rollback returns to the checkpoint before it and excludes its samples."""
    spike_threshold: float = bounded(6.0, lo=1.0)
    """A spike: the loss this many deviations above the trend of the last spike_window steps."""
    spike_warmup: int = bounded(50, lo=0)
    """Steps observed before the guard judges (the early loss falls too fast for a trend)."""
    spike_window: int = bounded(50, lo=3)
    """Steps in the window the trend and its deviation are fitted to."""
    max_rollbacks: int = bounded(3, lo=0)
    """Rollbacks allowed in a run; one more stops it with FATAL naming the steps and samples."""
    spike_lr_cooldown: int = bounded(0, lo=0)
    """After a rollback, ramp the learning rate back up linearly over this many steps; 0 = off."""
    exclude_samples: str = ""
    """A JSON file of training-sample indices left out of every epoch (e.g. a rollback's EXCLUDED_SAMPLES.json)."""

    # --- distributed -------------------------------------------------------------------------
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """Process-group backend: auto = nccl with CUDA, else gloo; nccl under torchrun makes a group even for 1 process."""
    timeout_s: float = bounded(600.0, lo=1.0, hi=86400.0)
    """Timeout in seconds for every collective (and, unless init_timeout_s is set, process-group init)."""
    init_timeout_s: float = bounded(0.0, lo=0.0, hi=86400.0)
    """Timeout for process-group init and everything up to the first step's end (then timeout_s); 0 = timeout_s."""
    ddp_static_graph: Switch = "auto"
    """DDP static_graph; auto decides from a preflight probe of the model (env DDP_STATIC_GRAPH=0|1)."""
    find_unused_parameters: Switch = "auto"
    """DDP find_unused_parameters; auto decides from the preflight probe (env DDP_FIND_UNUSED_PARAMETERS=0|1)."""
    bucket_cap_mb: float = bounded(25.0, lo=0.0)
    """DDP gradient bucket size in MiB."""
    gradient_as_bucket_view: bool = False
    """Let gradients alias DDP's communication buckets (saves one copy of the gradients)."""
    broadcast_buffers: bool = True
    """Broadcast module buffers from rank 0 at every forward."""
    compile: bool = False
    """torch.compile the model after the DDP preflight and wrapping (DDP's graph split at bucket boundaries)."""
    compile_mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] = "default"
    """torch.compile mode."""
    compile_backend: Literal["inductor", "aot_eager", "eager"] = "inductor"
    """torch.compile backend: inductor generates kernels (needs a C compiler on CPU); aot_eager only traces."""
    ddp_comm_hook: Literal["none", "fp16", "bf16", "powersgd"] = "none"
    """Gradient all-reduce: none = fp32, fp16/bf16 = 16-bit (gloo or NCCL), powersgd = low-rank (see README)."""
    powersgd_rank: int = bounded(1, lo=1, hi=1024)
    """PowerSGD's matrix approximation rank (1 = strongest compression; try 2, 4, ... if the loss suffers)."""
    powersgd_start_iter: int = bounded(1000, lo=2)
    """PowerSGD runs plain all-reduce for this many synced backward passes (optimizer steps) first; at least 2."""




def _field_docs(cls: type) -> dict[str, str]:
    """The string literal under each field of ``cls`` (attribute docstrings, as litgpt writes them)."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:], strict=False):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)):
            docs[node.target.id] = nxt.value.value.strip()
    return docs


FIELD_DOCS = _field_docs(TrainConfig)
_TYPES = typing.get_type_hints(TrainConfig)
KEYS = [f.name for f in fields(TrainConfig)]


def describe_type(key: str) -> str:
    tp = _TYPES[key]
    if typing.get_origin(tp) is Literal:
        return "|".join(typing.get_args(tp))
    return tp.__name__


def _coerce(key: str, value: Any) -> Any:
    """Convert ``value`` (a string from the CLI or environment, or a file/dict value) to the
    field's type. Raises ValueError with a message that names what is allowed."""
    tp = _TYPES[key]
    if typing.get_origin(tp) is Literal:
        choices = typing.get_args(tp)
        text = str(value).lower() if isinstance(value, bool) else str(value).strip().lower()
        if "true" in choices and text in ("1", "0"):
            text = "true" if text == "1" else "false"
        if text not in choices:
            raise ValueError(f"allowed: {', '.join(choices)}")
        return text
    if tp is bool:
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("true", "1", "yes", "on"):
            return True
        if text in ("false", "0", "no", "off"):
            return False
        raise ValueError("allowed: true or false")
    if tp is int:
        if isinstance(value, bool):
            raise ValueError("expected an integer")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        try:
            return int(str(value).strip())
        except ValueError:
            raise ValueError("expected an integer") from None
    if tp is float:
        if isinstance(value, bool):
            raise ValueError("expected a number")
        try:
            out = float(value)
        except (TypeError, ValueError):
            raise ValueError("expected a number") from None
        if not math.isfinite(out):
            raise ValueError("expected a finite number")
        return out
    if tp is str:
        if not isinstance(value, str):
            raise ValueError("expected a string")
        return value
    raise AssertionError(f"unhandled field type {tp} for {key}")


def _unknown_key(key: str, source: str) -> str:
    close = difflib.get_close_matches(key, KEYS, n=1, cutoff=0.6)
    hint = f"; did you mean '{close[0]}'?" if close else "; see --help for the list of keys"
    return f"{source}: unknown key '{key}'{hint}"


def _check_values(cfg: TrainConfig) -> list[str]:
    """Range and cross-field checks on an already typed config."""
    problems = []
    for f in fields(cfg):
        if "bounds" not in f.metadata:
            continue
        lo, hi = f.metadata["bounds"]
        key, value = f.name, getattr(cfg, f.name)
        if lo is not None and value < lo:
            problems.append(f"{key}={value!r}: must be >= {lo}")
        elif hi is not None and value > hi:
            problems.append(f"{key}={value!r}: must be <= {hi}")
    if cfg.num_heads >= 1 and cfg.hidden_size % cfg.num_heads:
        problems.append(f"hidden_size={cfg.hidden_size}: must be divisible by num_heads={cfg.num_heads}")
    if cfg.min_lr > cfg.learning_rate:
        problems.append(f"min_lr={cfg.min_lr}: must be <= learning_rate={cfg.learning_rate}")
    if cfg.data != "synthetic":
        path = Path(cfg.data)
        if path.suffix not in (".txt", ".bin"):
            problems.append(f"data={cfg.data!r}: allowed: synthetic, a .txt file or a .bin file")
        elif not path.is_file():
            problems.append(f"data={cfg.data!r}: file not found")
        else:
            problems += data_file_problems(cfg)
    for key in ("log_dir", "checkpoint_dir"):
        problem = _unwritable_dir(getattr(cfg, key))
        if problem:
            problems.append(f"{key}={getattr(cfg, key)!r}: {problem}; allowed: a directory this user can write")
    if cfg.export_dir not in ("", "none"):
        if importlib.util.find_spec("safetensors") is None:
            problems.append(f"export_dir={cfg.export_dir!r}: the export needs safetensors, which is not installed: "
                            "pip install -e .[hf] (or safetensors==0.8.0), or leave export_dir unset")
        elif problem := _unwritable_dir(cfg.export_dir):
            problems.append(f"export_dir={cfg.export_dir!r}: {problem}; allowed: a directory this user can write")
    problems += _check_export_dir(cfg)
    if cfg.resume not in ("auto", "none") and not Path(cfg.resume).is_file():
        problems.append(f"resume={cfg.resume!r}: allowed: auto, none, or an existing checkpoint file")
    if cfg.fault_inject:
        from .testing.faults import parse
        try:
            parse(cfg.fault_inject)
        except ValueError as err:
            problems.append(f"fault_inject={cfg.fault_inject!r}: {err}")
    problems += _check_run_health_and_speed(cfg)
    if cfg.use_amp == "true" and cfg.amp_dtype == "fp16" and not _cuda_available():
        problems.append("amp_dtype='fp16': needs CUDA (use bf16 on CPU, or use_amp=false)")
    if cfg.backend == "nccl" and not _cuda_available():
        problems.append("backend='nccl': needs CUDA; allowed on this machine: auto, gloo")
    return problems


def _check_run_health_and_speed(cfg: TrainConfig) -> list[str]:
    """The checks of the compile and loss-spike keys."""
    problems = []
    if cfg.compile and cfg.compile_backend == "inductor" and not any(
            shutil.which(c) for c in (os.environ.get("CXX", ""), "g++", "c++", "clang++") if c):
        problems.append("compile_backend='inductor': needs a C++ compiler (g++, c++ or clang++ on PATH, or CXX); "
                        "allowed without one: aot_eager, eager")
    if cfg.spike_guard == "rollback" and not cfg.save_every_steps:
        problems.append("spike_guard='rollback': needs save_every_steps > 0 (a checkpoint before the spike to "
                        "return to); allowed with save_every_steps=0: off, warn")
    if cfg.exclude_samples:
        from .resilience.exclusions import read
        try:
            read(cfg.exclude_samples)
        except ValueError as err:
            problems.append(f"exclude_samples={cfg.exclude_samples!r}: {err}")
    return problems


# --- the built-in data, checked before a run builds it ---------------------------------------
# Torch-free, for --check-config; framework/data.py builds the datasets these describe.

VAL_FRACTION_TEXT = "the last 10% is the validation split"


def split_tokens(n: int) -> int:
    """Tokens of a data file's training split (the first 90%); the rest is the validation split."""
    return int(0.9 * n)


def _min_tokens(seq_len: int, train_windows: int) -> int:
    """The fewest tokens of a data file whose validation split holds one window of seq_len + 1
    tokens and whose training split holds ``train_windows`` (stride 1)."""
    n = max(1, 10 * seq_len, math.ceil((seq_len + train_windows) / 0.9) - 2)
    while n - split_tokens(n) < seq_len + 1 or split_tokens(n) - seq_len < train_windows:
        n += 1
    return n


@functools.lru_cache(maxsize=8)
def _scan_data_file(path: str, size: int, mtime_ns: int, inode: int) -> tuple[int, int, str]:
    """``(tokens, largest token id or -1, problem or '')`` of a data file. Cached by size and
    mtime: the command line and the trainer check the same file in one process. A .bin file is
    read once here, at --check-config, as the start of every rank reads it: a token id beyond
    vocab_size is refused before anything starts, at the cost of one pass over the file."""
    if path.endswith(".bin"):
        if size % 2:
            return 0, -1, f"{size} bytes, not a whole number of 2-byte tokens; allowed: a .bin file of uint16 token ids"
        if size == 0:
            return 0, -1, ""
        import numpy as np
        tokens = np.memmap(path, dtype=np.uint16, mode="r")
        chunk = 2**24
        return len(tokens), max(int(tokens[i:i + chunk].max()) for i in range(0, len(tokens), chunk)), ""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        return 0, -1, f"not UTF-8 text ({err.reason} at byte {err.start}); allowed: a UTF-8 text file"
    # framework/data.py encode_text: one token per character, or per UTF-8 byte beyond 256 characters
    return (len(text) if len(set(text)) <= 256 else len(text.encode("utf-8"))), -1, ""


def data_file_facts(cfg: TrainConfig) -> tuple[int, list[str]]:
    """The tokens in ``cfg.data`` (a .txt or .bin file) and what is wrong with it: every
    problem that would stop the built-in data from being built, one line each."""
    try:
        st = os.stat(cfg.data)
        tokens, top, problem = _scan_data_file(str(cfg.data), st.st_size, st.st_mtime_ns, st.st_ino)
    except OSError as err:
        return 0, [f"data={cfg.data!r}: unreadable: {err}; allowed: a readable .txt or .bin file"]
    if problem:
        return 0, [f"data={cfg.data!r}: {problem}"]
    problems = []
    need = _min_tokens(cfg.seq_len, 1)
    if tokens < need:
        problems.append(f"data={cfg.data!r}: {tokens} tokens; with seq_len={cfg.seq_len} it needs at least {need} "
                        f"({VAL_FRACTION_TEXT}, and each split needs seq_len + 1 tokens); allowed: a longer file, "
                        f"or a smaller seq_len")
    if top >= cfg.vocab_size:
        problems.append(f"vocab_size={cfg.vocab_size}: data={cfg.data!r} holds token id {top}; "
                        f"allowed: vocab_size >= {top + 1}")
    return tokens, problems


def data_file_problems(cfg: TrainConfig) -> list[str]:
    return data_file_facts(cfg)[1]


def _global_batch(cfg: TrainConfig, world_size: int) -> tuple[int, str]:
    size = cfg.batch_size * cfg.gradient_accumulation_steps * world_size
    return size, (f"{size} samples (batch_size={cfg.batch_size} x gradient_accumulation_steps="
                  f"{cfg.gradient_accumulation_steps} x world size {world_size})")


def training_set_problems(cfg: TrainConfig, samples: int, world_size: int, *, head: str, count: str,
                          allowed: str) -> list[str]:
    """Whether ``samples`` training samples hold one global batch of ``world_size`` ranks, also
    once exclude_samples is taken out. ``head`` names the samples' key and value (``dataset_size=8``),
    ``count`` says how many there are in words ('' or 'its 8 samples are '), and ``allowed`` what
    would hold a global batch of ``{need}`` samples."""
    need, described = _global_batch(cfg, world_size)
    smaller = "or a smaller batch_size or gradient_accumulation_steps"
    if samples < need:
        return [f"{head}: {count}fewer than one global batch of {described}; "
                f"allowed: {allowed.format(need=need)}, {smaller}"]
    if not cfg.exclude_samples:
        return []
    from .resilience.exclusions import read
    try:
        excluded = set(read(cfg.exclude_samples))
    except ValueError:  # reported by _check_run_health_and_speed
        return []
    key = f"exclude_samples={cfg.exclude_samples!r}"
    outside = sorted(i for i in excluded if i >= samples)
    if outside:
        more = f" (and {len(outside) - 1} more)" if len(outside) > 1 else ""
        return [f"{key}: sample index {outside[0]}{more} is outside the {samples} training samples; "
                f"allowed: indices 0 to {samples - 1}"]
    if samples - len(excluded) < need:
        return [f"{key}: excluding {len(excluded)} of the {samples} training samples leaves "
                f"{samples - len(excluded)}, fewer than one global batch of {described}; "
                f"allowed: fewer excluded samples, {smaller}"]
    return []


def builtin_data_problems(cfg: TrainConfig, world_size: int) -> list[str]:
    """The built-in data (what the command line trains on) against the global batch of
    ``world_size`` ranks and exclude_samples. A dataset given from Python is checked when the
    run builds its sampler (framework/loader.py)."""
    if cfg.data == "synthetic":
        return training_set_problems(cfg, cfg.dataset_size, world_size, head=f"dataset_size={cfg.dataset_size}",
                                     count="", allowed="dataset_size >= {need}")
    if Path(cfg.data).suffix not in (".txt", ".bin") or not Path(cfg.data).is_file():
        return []  # reported by _check_values
    tokens, problems = data_file_facts(cfg)
    if problems:
        return []  # reported by _check_values
    windows = split_tokens(tokens) - cfg.seq_len
    return training_set_problems(
        cfg, windows, world_size, head=f"data={cfg.data!r}", count=f"its {windows} training windows are ",
        allowed="a file of at least " + str(_min_tokens(cfg.seq_len, _global_batch(cfg, world_size)[0]))
        + " tokens for seq_len=" + str(cfg.seq_len))


def world_size_from(env) -> int:
    """The world size torchrun (or the launcher, for its check) puts in WORLD_SIZE; 1 without it."""
    text = str(env.get("WORLD_SIZE", "")).strip()
    return int(text) if text.isdigit() and int(text) > 0 else 1


EXPORT_RECORD = ".framework_export.json"
"""The file in which the export (framework/export.py) lists the files it wrote into export_dir: the
only ones a later export replaces or removes."""
_EXPORT_NAMES = ("config.json", "model.safetensors")  # written by every export but those of PEFT models


def export_path(cfg: TrainConfig) -> Path | None:
    """Where the export goes: ``export_dir``, '' = ``checkpoint_dir/export``, 'none' = nowhere."""
    if cfg.export_dir == "none":
        return None
    return Path(cfg.export_dir) if cfg.export_dir else Path(cfg.checkpoint_dir) / "export"


def export_record(directory: str | Path) -> set[str]:
    """The files (relative paths) that the last export into ``directory`` recorded as its own;
    empty when there is no readable record. Paths that leave ``directory`` are ignored."""
    try:
        files = json.loads((Path(directory) / EXPORT_RECORD).read_text(encoding="utf-8"))["files"]
    except (OSError, ValueError, TypeError, KeyError):  # no record, or not one this framework wrote
        return set()
    if not isinstance(files, list):
        return set()
    return {f for f in files if isinstance(f, str) and f and not f.startswith("/")
            and ".." not in f.split("/") and f != EXPORT_RECORD}


def _check_export_dir(cfg: TrainConfig) -> list[str]:
    """The overlaps of export_dir that the export cannot honour, since it replaces only its own files."""
    directory = export_path(cfg)
    if directory is None or importlib.util.find_spec("safetensors") is None:
        return []  # no export (the missing safetensors of an explicit export_dir is reported above)
    key = (f"export_dir={cfg.export_dir!r}" if cfg.export_dir
           else f"export_dir='' (checkpoint_dir/export = {str(directory)!r})")
    if os.path.realpath(directory) == os.path.realpath(cfg.log_dir):
        return [f"{key} and log_dir={cfg.log_dir!r} are the same directory: the export's config.json would "
                "replace the run's; allowed: an export_dir apart from log_dir"]
    own = export_record(directory)
    foreign = [name for name in _EXPORT_NAMES if os.path.lexists(directory / name) and name not in own]
    if foreign:
        return [f"{key}: holds {' and '.join(foreign)}, which no earlier export wrote (its {EXPORT_RECORD} "
                "does not list it) and the export would replace; allowed: a directory without it (move it "
                "away, or choose another export_dir)"]
    return []


def _unwritable_dir(directory: str) -> str | None:
    """Why ``directory`` cannot be created or written, or None. Nothing is created here."""
    path = Path(directory)
    while not path.exists():
        if path.parent == path:
            return None
        path = path.parent
    if not path.is_dir():
        return f"cannot be created: {path} is a file"
    if not os.access(path, os.W_OK | os.X_OK):
        return f"{path} is not writable"
    return None


def _cuda_available() -> bool:
    import torch
    return torch.cuda.is_available()


def build_config(
    overrides: dict[str, Any] | None = None,
    *,
    file: str | Path | None = None,
    env: dict[str, str] | None = None,
    cli: list[tuple[str, str]] | None = None,
    problems: list[str] | None = None,
    world_size: int | None = None,
) -> TrainConfig:
    """Merge the sources (lowest first: defaults, ``overrides``, file, env, cli), validate, and
    return the config. Raises ConfigError listing every problem, including ``problems`` found
    earlier by the caller (e.g. malformed command-line flags). With ``world_size`` the run will
    train on the built-in data, which must then hold one global batch of that many ranks."""
    problems = list(problems or [])
    values: dict[str, Any] = {}

    def take(source: str, items) -> None:
        for key, raw in items:
            norm = key.replace("-", "_").lower()
            if norm not in _TYPES:
                problems.append(_unknown_key(norm, source))
                continue
            try:
                values[norm] = _coerce(norm, raw)
            except ValueError as err:
                problems.append(f"{source}: {norm}={raw!r}: {err}")

    if overrides:
        take("config", overrides.items())
    if file is not None:
        try:
            take(f"config file {file}", load_config_file(file).items())
        except ConfigError as err:
            problems.extend(err.problems)
    env = os.environ if env is None else env
    take("environment", ((_ENV_ALIASES.get(k[len(ENV_PREFIX):].lower(), k[len(ENV_PREFIX):]), v)
                         for k, v in sorted(env.items()) if k.startswith(ENV_PREFIX)))
    if cli:
        take("command line", cli)

    cfg = TrainConfig(**values)
    problems.extend(_check_values(cfg))
    if world_size is not None and not problems:
        problems.extend(builtin_data_problems(cfg, world_size))
    if problems:
        raise ConfigError(problems)
    return cfg


# Operator overrides spelled as DDP users know them: DDP_STATIC_GRAPH=0|1.
_ENV_ALIASES = {"static_graph": "ddp_static_graph"}


def load_config_file(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError([f"--config {path}: file not found"])
    try:
        if path.suffix == ".toml":
            with path.open("rb") as f:
                data = tomllib.load(f)
        elif path.suffix == ".json":
            data = json.loads(path.read_text())
        else:
            raise ConfigError([f"--config {path}: allowed: a .toml or .json file"])
    except (tomllib.TOMLDecodeError, json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ConfigError([f"--config {path}: cannot parse: {err}"]) from None
    if not isinstance(data, dict):
        raise ConfigError([f"--config {path}: must hold a table of key = value"])
    return data


def as_dict(cfg: TrainConfig) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def resolve_config(config: TrainConfig | dict | None) -> TrainConfig:
    """What DDPTrainer accepts: the dataclass (re-validated), a plain dict, or None (defaults)."""
    if isinstance(config, TrainConfig):
        return build_config(as_dict(config), env={})
    if config is None or isinstance(config, dict):
        return build_config(config or {}, env={})
    raise ConfigError([f"config={type(config).__name__}: allowed: a dict, a TrainConfig or None"])


def help_text() -> str:
    lines = []
    for f in fields(TrainConfig):
        kind = "true|false" if _TYPES[f.name] is bool else describe_type(f.name).upper()
        lines.append(f"  --{f.name.replace('_', '-')} {kind}  (default: {f.default})")
        lines.append(f"      {FIELD_DOCS[f.name]}")
    return "\n".join(lines)


# Flags of ddp_training.py that are actions, not config keys.
ACTION_FLAGS = ("check-config", "doctor", "debug", "help")


def parse_command_line(argv: list[str], env: dict[str, str] | None = None) -> tuple[TrainConfig, set[str]]:
    """Parse ``--key value`` / ``--key=value`` flags plus ``--config FILE`` and the action flags.
    Returns the validated config and the set of actions given. Raises ConfigError."""
    problems: list[str] = []
    cli: list[tuple[str, str]] = []
    actions: set[str] = set()
    config_file = None
    i = 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if arg in ("-h", "--help"):
            actions.add("help")
            continue
        if not arg.startswith("--") or arg == "--":
            problems.append(f"command line: unexpected argument {arg!r}; flags look like --key value")
            continue
        name, eq, value = arg[2:].partition("=")
        name = name.replace("_", "-").lower()
        if name in ACTION_FLAGS:
            if eq:
                problems.append(f"command line: --{name} takes no value")
            actions.add(name)
            continue
        if not eq:
            if i >= len(argv) or (argv[i].startswith("--") and len(argv[i]) > 2):
                problems.append(f"command line: --{name} needs a value")
                continue
            value = argv[i]
            i += 1
        if name == "config":
            config_file = value
        else:
            cli.append((name, value))
    if "help" in actions:
        return TrainConfig(), actions
    # The command line always trains on the built-in data.
    cfg = build_config(file=config_file, env=env, cli=cli, problems=problems,
                       world_size=world_size_from(os.environ if env is None else env))
    return cfg, actions


def markdown_table() -> str:
    """The README's configuration table, generated from the field docstrings."""
    rows = ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
    for f in fields(TrainConfig):
        rows.append(f"| `{f.name}` | {describe_type(f.name)} | `{f.default}` | {FIELD_DOCS[f.name]} |")
    return "\n".join(rows)
