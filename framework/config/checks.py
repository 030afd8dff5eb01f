"""The configuration's checks: ranges, cross-field rules, and the files and directories it names,
all before any process group starts (``--check-config``). Torch-free."""

from __future__ import annotations

import functools
import importlib.util
import json
import math
import os
import shutil
from pathlib import Path

from .schema import FIELDS, TrainConfig, get, is_auto


def check_values(cfg: TrainConfig) -> list[str]:
    """Range and cross-field checks on an already typed config."""
    problems = []
    for key, f in FIELDS.items():
        if "bounds" not in f.metadata:
            continue
        lo, hi = f.metadata["bounds"]
        value = get(cfg, key)
        if is_auto(key, value):
            continue
        if lo is not None and value < lo:
            problems.append(f"{key}={value!r}: must be >= {lo}" + (" (or auto)" if f.metadata.get("auto") else ""))
        elif hi is not None and value > hi:
            problems.append(f"{key}={value!r}: must be <= {hi}")
    if cfg.model.num_heads >= 1 and cfg.model.hidden_size % cfg.model.num_heads:
        problems.append(f"model.hidden_size={cfg.model.hidden_size}: must be divisible by "
                        f"model.num_heads={cfg.model.num_heads}")
    if cfg.optim.min_lr > cfg.optim.lr:
        problems.append(f"optim.min_lr={cfg.optim.min_lr}: must be <= optim.lr={cfg.optim.lr}")
    if cfg.data.source != "synthetic":
        path = Path(cfg.data.source)
        if path.suffix not in (".txt", ".bin"):
            problems.append(f"data.source={cfg.data.source!r}: allowed: synthetic, a .txt file or a .bin file")
        elif not path.is_file():
            problems.append(f"data.source={cfg.data.source!r}: file not found")
        else:
            problems += data_file_problems(cfg)
    for key in ("logging.dir", "checkpoint.dir"):
        problem = _unwritable_dir(get(cfg, key))
        if problem:
            problems.append(f"{key}={get(cfg, key)!r}: {problem}; allowed: a directory this user can write")
    if cfg.checkpoint.export_dir not in ("", "none"):
        if importlib.util.find_spec("safetensors") is None:
            problems.append(f"checkpoint.export_dir={cfg.checkpoint.export_dir!r}: the export needs safetensors, which "
                            "is not installed: pip install -e .[hf] (or safetensors==0.8.0), or leave it unset")
        elif problem := _unwritable_dir(cfg.checkpoint.export_dir):
            problems.append(f"checkpoint.export_dir={cfg.checkpoint.export_dir!r}: {problem}; allowed: a directory "
                            "this user can write")
    problems += _check_export_dir(cfg)
    if cfg.checkpoint.resume not in ("auto", "none") and not Path(cfg.checkpoint.resume).is_file():
        problems.append(f"checkpoint.resume={cfg.checkpoint.resume!r}: allowed: auto, none, or an existing "
                        "checkpoint file")
    if cfg.recovery.fault_inject:
        from ..resilience.faults import parse
        problems += _unparsable("recovery.fault_inject", cfg.recovery.fault_inject, parse)
    problems += _check_run_health_and_speed(cfg)
    if cfg.precision.autocast == "true" and cfg.precision.dtype == "fp16" and not _cuda_available():
        problems.append("precision.dtype='fp16': needs CUDA (use bf16 on CPU, or precision.autocast=false)")
    if cfg.ddp.backend == "nccl" and not _cuda_available():
        problems.append("ddp.backend='nccl': needs CUDA; allowed on this machine: auto, gloo")
    return problems


def _check_run_health_and_speed(cfg: TrainConfig) -> list[str]:
    """The checks of the compile and loss-spike keys."""
    problems = []
    if cfg.compile.enabled and cfg.compile.backend == "inductor" and not any(
            shutil.which(c) for c in (os.environ.get("CXX", ""), "g++", "c++", "clang++") if c):
        problems.append("compile.backend='inductor': needs a C++ compiler (g++, c++ or clang++ on PATH, or CXX); "
                        "allowed without one: aot_eager, eager")
    if cfg.spike.guard == "rollback" and not cfg.checkpoint.every_steps:
        problems.append("spike.guard='rollback': needs checkpoint.every_steps > 0 (a checkpoint before the spike to "
                        "return to); allowed with checkpoint.every_steps=0: off, warn")
    if cfg.recovery.heal == "in_place" and cfg.ddp.comm_hook == "powersgd":
        problems.append("recovery.heal='in_place' with ddp.comm_hook='powersgd': PowerSGD's error feedback is each "
                        "rank's and goes with a lost rank; allowed with powersgd: recovery.heal=restart")
    if cfg.data.exclude_samples:
        from ..resilience.exclusions import read
        problems += _unparsable("data.exclude_samples", cfg.data.exclude_samples, read)
    return problems


def _unparsable(key: str, value: str, parse) -> list[str]:
    """The problem of a value ``parse`` rejects with ValueError, as one line; none when it parses."""
    try:
        parse(value)
    except ValueError as err:
        return [f"{key}={value!r}: {err}"]
    return []


# --- the built-in data, checked before a run builds it ---------------------------------------
# Torch-free, for --check-config; framework/data/datasets.py builds the datasets these describe.

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
    # framework/data/datasets.py encode_text: one token per character, or per UTF-8 byte beyond 256 characters
    return (len(text) if len(set(text)) <= 256 else len(text.encode("utf-8"))), -1, ""


def data_file_facts(cfg: TrainConfig) -> tuple[int, list[str]]:
    """The tokens in ``cfg.data.source`` (a .txt or .bin file) and what is wrong with it: every
    problem that would stop the built-in data from being built, one line each."""
    try:
        st = os.stat(cfg.data.source)
        tokens, top, problem = _scan_data_file(str(cfg.data.source), st.st_size, st.st_mtime_ns, st.st_ino)
    except OSError as err:
        return 0, [f"data.source={cfg.data.source!r}: unreadable: {err}; allowed: a readable .txt or .bin file"]
    if problem:
        return 0, [f"data.source={cfg.data.source!r}: {problem}"]
    problems = []
    need = _min_tokens(cfg.model.seq_len, 1)
    if tokens < need:
        problems.append(f"data.source={cfg.data.source!r}: {tokens} tokens; with model.seq_len={cfg.model.seq_len} "
                        f"it needs at least {need} ({VAL_FRACTION_TEXT}, and each split needs seq_len + 1 tokens); "
                        f"allowed: a longer file, or a smaller model.seq_len")
    if top >= cfg.model.vocab_size:
        problems.append(f"model.vocab_size={cfg.model.vocab_size}: data.source={cfg.data.source!r} holds token id "
                        f"{top}; allowed: model.vocab_size >= {top + 1}")
    return tokens, problems


def data_file_problems(cfg: TrainConfig) -> list[str]:
    return data_file_facts(cfg)[1]


def _global_batch(cfg: TrainConfig, world_size: int) -> tuple[int, str]:
    if cfg.data.global_batch_size:
        return cfg.data.global_batch_size, f"{cfg.data.global_batch_size} samples (data.global_batch_size)"
    size = cfg.data.batch_size * cfg.data.gradient_accumulation_steps * world_size
    return size, (f"{size} samples (data.batch_size={cfg.data.batch_size} x data.gradient_accumulation_steps="
                  f"{cfg.data.gradient_accumulation_steps} x world size {world_size})")


def global_batch_problems(cfg: TrainConfig, world_size: int) -> list[str]:
    """data.global_batch_size against the world size the run starts at (an elastic run or a heal
    checks each later world size when it gets there: framework/data/sampler.py, UnevenSplit). A
    world size that does not divide it splits it unevenly, each rank's loss weighted by its
    samples; a share smaller than the largest share's number of micro-batches cannot."""
    g, cap = cfg.data.global_batch_size, cfg.data.batch_size
    if not g or g % world_size == 0:
        return []
    base = g // world_size
    micro_batches = -(-(base + 1) // cap)
    if base < micro_batches:
        return [f"data.global_batch_size={g}: does not split over world size {world_size} in micro-batches of at "
                f"most data.batch_size={cap}; allowed: a multiple of {world_size}, or at least "
                f"{world_size * micro_batches} samples (or a larger data.batch_size)"]
    return []


def training_set_problems(cfg: TrainConfig, samples: int, world_size: int, *, head: str, count: str,
                          allowed: str) -> list[str]:
    """Whether ``samples`` training samples hold one global batch of ``world_size`` ranks, also
    once exclude_samples is taken out. ``head`` names the samples' key and value (``dataset_size=8``),
    ``count`` says how many there are in words ('' or 'its 8 samples are '), and ``allowed`` what
    would hold a global batch of ``{need}`` samples."""
    need, described = _global_batch(cfg, world_size)
    smaller = "or a smaller data.batch_size or data.gradient_accumulation_steps"
    if samples < need:
        return [f"{head}: {count}fewer than one global batch of {described}; "
                f"allowed: {allowed.format(need=need)}, {smaller}"]
    if not cfg.data.exclude_samples:
        return []
    from ..resilience.exclusions import read
    try:
        excluded = set(read(cfg.data.exclude_samples))
    except ValueError:  # reported by _check_run_health_and_speed
        return []
    key = f"data.exclude_samples={cfg.data.exclude_samples!r}"
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
    run builds its sampler (`check_datasets` in framework/data/datasets.py)."""
    if cfg.data.source == "synthetic":
        return training_set_problems(cfg, cfg.data.synthetic_size, world_size,
                                     head=f"data.synthetic_size={cfg.data.synthetic_size}", count="",
                                     allowed="data.synthetic_size >= {need}")
    if Path(cfg.data.source).suffix not in (".txt", ".bin") or not Path(cfg.data.source).is_file():
        return []  # reported by _check_values
    tokens, problems = data_file_facts(cfg)
    if problems:
        return []  # reported by _check_values
    windows = split_tokens(tokens) - cfg.model.seq_len
    return training_set_problems(
        cfg, windows, world_size, head=f"data.source={cfg.data.source!r}",
        count=f"its {windows} training windows are ",
        allowed="a file of at least " + str(_min_tokens(cfg.model.seq_len, _global_batch(cfg, world_size)[0]))
        + " tokens for model.seq_len=" + str(cfg.model.seq_len))


def world_size_from(env) -> int:
    """The world size torchrun (or the launcher, for its check) puts in WORLD_SIZE; 1 without it."""
    text = str(env.get("WORLD_SIZE", "")).strip()
    return int(text) if text.isdigit() and int(text) > 0 else 1


EXPORT_RECORD = ".framework_export.json"
"""The file in which the export (framework/state/export.py) lists the files it wrote into export_dir: the
only ones a later export replaces or removes."""
_EXPORT_NAMES = ("config.json", "model.safetensors")  # written by every export but those of PEFT models


def export_path(cfg: TrainConfig) -> Path | None:
    """Where the export goes: ``export_dir``, '' = ``checkpoint_dir/export``, 'none' = nowhere."""
    if cfg.checkpoint.export_dir == "none":
        return None
    return Path(cfg.checkpoint.export_dir) if cfg.checkpoint.export_dir else Path(cfg.checkpoint.dir) / "export"


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
    key = (f"checkpoint.export_dir={cfg.checkpoint.export_dir!r}" if cfg.checkpoint.export_dir
           else f"checkpoint.export_dir='' (checkpoint.dir/export = {str(directory)!r})")
    if os.path.realpath(directory) == os.path.realpath(cfg.logging.dir):
        return [f"{key} and logging.dir={cfg.logging.dir!r} are the same directory: the export's config.json would "
                "replace the run's; allowed: a checkpoint.export_dir apart from logging.dir"]
    own = export_record(directory)
    foreign = [name for name in _EXPORT_NAMES if os.path.lexists(directory / name) and name not in own]
    if foreign:
        return [f"{key}: holds {' and '.join(foreign)}, which no earlier export wrote (its {EXPORT_RECORD} "
                "does not list it) and the export would replace; allowed: a directory without it (move it "
                "away, or choose another checkpoint.export_dir)"]
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


