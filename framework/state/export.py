"""The final weights of a finished run: ``final_model.pt`` and the safetensors export for other tools.

The export (rank 0, into ``export_dir``, by default ``checkpoint_dir/export``) takes the model out of
its DDP/compile wrappers and writes CPU tensors:

- a transformers ``PreTrainedModel`` or a PEFT model: ``save_pretrained(export_dir, safe_serialization=True)``;
  a PEFT model writes only its adapters (``PeftModel.from_pretrained(base, export_dir)`` loads them);
- the built-in GPT: ``model.safetensors`` and ``config.json`` (the GPTConfig fields); ``load_exported``
  rebuilds it;
- any other module: ``model.safetensors`` of its state_dict; ``load_weights`` reads it back as a state_dict.

safetensors refuses tensors that share memory: a second name for the same tensor (tied weights) is
written once and recorded as an alias in the file's metadata, which ``load_weights`` restores
(``safetensors.torch.load_model`` also reads such a file); any other view of shared memory is
written as a copy.

The export replaces only what it wrote itself. Its files are written into a private temp directory
inside ``export_dir``, synced, and each renamed into place (so each file is whole: the previous
export's or this one's); ``export_dir/.framework_export.json`` lists them. A later export replaces
or removes only the files that list names; anything else in ``export_dir`` (the run's checkpoint_dir
and log_dir nested in it, the user's files) is left alone, and a file the export would replace but
did not write is kept, with an ERROR. framework/config/checks.py refuses, at check time, the overlaps the
export cannot honour: export_dir = log_dir, and an export_dir holding a config.json or
model.safetensors that no export wrote.

safetensors is a runtime dependency (requirements.txt, pyproject.toml). Where it is missing, a run
writes ``final_model.pt`` only, with one WARNING; an ``export_dir`` set explicitly makes the
configuration invalid instead (framework/config/checks.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path, PurePosixPath

import torch

from .. import __version__
from ..config import EXPORT_RECORD, export_path, export_record
from ..ddp.policy import unwrap
from ..model.gpt import GPT, GPTConfig
from ..resilience.markers import FatalError
from . import atomic
from .checkpoint_files import to_cpu

log = logging.getLogger(__name__)

FINAL_MODEL = "final_model.pt"
WEIGHTS = "model.safetensors"
CONFIG = "config.json"
GPT_MARKER = "framework.model.GPT"  # the format's name for the built-in GPT (framework/model/gpt.py), kept
ALIASES = "framework.aliases"  # metadata key: JSON {dropped name: the name written}
INSTALL_HINT = "pip install -e .[hf]"
PARTIAL = ".framework_export.partial."  # the private temp directory of an export in progress


def safetensors_available() -> bool:
    return importlib.util.find_spec("safetensors") is not None


DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG)
"""A full, over-quota or read-only directory (or a file-size limit): a restart fails the same way."""


def disk_full(err: BaseException) -> str | None:
    """What ``err`` says when it is a full (over-quota, read-only) disk, else None; safetensors'
    own error names the OS error only in its message."""
    if isinstance(err, OSError) and err.errno in DISK_FULL:
        return err.strerror or os.strerror(err.errno)
    return "No space left on device" if "No space left on device" in str(err) else None


def save_final_weights(model: torch.nn.Module, cfg) -> None:
    """Rank 0, at the end of a finished run: ``checkpoint_dir/final_model.pt``, then the export. A
    full disk is a FatalError naming the directories: a restart would fail the same way, and once
    there is room a relaunch of the finished run exports again."""
    try:
        _save_final_weights(model, cfg)
    except Exception as err:
        why = disk_full(err)
        if why is None:
            raise
        raise FatalError(f"checkpoint.dir={cfg.checkpoint.dir!r}, checkpoint.export_dir={cfg.checkpoint.export_dir!r}: "
                         f"{why} while writing the final weights; free space or use other directories, then launch "
                         "again: the finished run writes them again") from err


def _save_final_weights(model: torch.nn.Module, cfg) -> None:
    state = to_cpu(model.state_dict())
    atomic.torch_save(state, Path(cfg.checkpoint.dir) / FINAL_MODEL)
    export_dir = export_path(cfg)
    if export_dir is None:
        return
    if not safetensors_available():
        log.warning("safetensors is not installed: the final weights are not exported (only %s is written); "
                    "install it with `%s`, or set checkpoint.export_dir=none to turn the export off", FINAL_MODEL,
                    INSTALL_HINT)
        return
    inner = unwrap(model)
    kind = export_model(inner, export_dir, state=state if inner is model else None)
    log.info("exported the final weights (%s) to %s", kind, export_dir)


def export_model(model: torch.nn.Module, export_dir: str | Path, *, state: dict | None = None) -> str:
    """Write ``model``'s weights as safetensors into ``export_dir``, replacing only the files an earlier
    export wrote there (see the module doc). ``state`` is the unwrapped model's state_dict on the
    CPU, when already at hand. Returns what was written, for the log."""
    model = unwrap(model)
    state = to_cpu(model.state_dict()) if state is None else state
    directory = Path(export_dir)
    directory.mkdir(parents=True, exist_ok=True)
    with _exclusive(directory):
        _remove_partials(directory)
        tmp = Path(tempfile.mkdtemp(prefix=PARTIAL, dir=directory))
        try:
            kind = _write(model, state, tmp)
            _install(tmp, directory)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # after an error, that error matters, not a failed cleanup
    return kind


def _write(model: torch.nn.Module, state: dict, tmp: Path) -> str:
    if _inherits(model, "peft", "PeftModel"):
        model.save_pretrained(tmp, safe_serialization=True, state_dict=state)
        return "PEFT adapters, save_pretrained"
    if _inherits(model, "transformers", "PreTrainedModel"):
        model.save_pretrained(tmp, safe_serialization=True, state_dict=state)
        return "transformers save_pretrained"
    save_weights(state, tmp / WEIGHTS)
    if not isinstance(model, GPT):
        return WEIGHTS
    config = {"model": GPT_MARKER, "framework_version": __version__, **dataclasses.asdict(model.cfg)}
    (tmp / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return f"{WEIGHTS} and {CONFIG} of the built-in GPT"


def _inherits(model: torch.nn.Module, package: str, class_name: str) -> bool:
    """Whether ``model`` is a ``package``'s ``class_name``, without importing ``package``."""
    return any(c.__name__ == class_name and c.__module__.split(".")[0] == package for c in type(model).__mro__)


def save_weights(state: dict[str, torch.Tensor], path: str | Path) -> None:
    """``state`` (CPU tensors) as a safetensors file; tied tensors are written once (see the module doc)."""
    from safetensors.torch import save_file

    tensors, aliases = _unshared(state)
    metadata = {"format": "pt"}
    if aliases:
        metadata[ALIASES] = json.dumps(aliases, sort_keys=True)
    save_file(tensors, str(path), metadata=metadata)


def _unshared(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """``state`` with no two tensors sharing memory: a second name for the same view becomes an
    alias of the first; another view of memory already written, or a non-contiguous one, a copy."""
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    views: dict[tuple, str] = {}
    storages: set[int] = set()
    for name, t in state.items():
        if t.numel() == 0:  # empty tensors have no memory to share
            tensors[name] = t.contiguous()
            continue
        ptr = t.untyped_storage().data_ptr()
        view = (ptr, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        if view in views:
            aliases[name] = views[view]
            continue
        views[view] = name
        if ptr in storages or not t.is_contiguous():
            t = t.clone(memory_format=torch.contiguous_format)
        storages.add(ptr)
        tensors[name] = t
    return tensors, aliases


def load_weights(path: str | Path, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """A file written by ``save_weights`` as a state_dict, aliases (tied weights) restored."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt", device=str(device)) as f:
        metadata = f.metadata() or {}
        state = {name: f.get_tensor(name) for name in f.keys()}
    for name, kept in json.loads(metadata.get(ALIASES, "{}")).items():
        state[name] = state[kept]
    return state


def load_exported(export_dir: str | Path, device: str | torch.device = "cpu") -> GPT:
    """The built-in GPT exported into ``export_dir``, rebuilt from its config.json and weights, in eval mode."""
    directory = Path(export_dir)
    config = json.loads((directory / CONFIG).read_text())
    if config.pop("model", None) != GPT_MARKER:
        raise ValueError(f"{directory / CONFIG}: not an export of {GPT_MARKER}; load {WEIGHTS} with "
                         "framework.state.export.load_weights into your own model")
    config.pop("framework_version", None)
    model = GPT(GPTConfig(**config))
    model.load_state_dict(load_weights(directory / WEIGHTS), strict=True)
    return model.to(device).eval()


def _install(tmp: Path, directory: Path) -> None:
    """Rename the files written into ``tmp`` into ``directory``, each replacing a file of the previous
    export or taking a free name; then remove the previous export's files this one did not write.
    The record lists every file of either export from before the first rename until the last
    removal, so that a crash in between leaves no file of ours unlisted."""
    previous = {name for name in export_record(directory) if _inside(directory, name)}
    written = sorted(p.relative_to(tmp).as_posix() for p in tmp.rglob("*") if p.is_file())
    ours = []
    for name in written:
        _fsync(tmp / name)
        if name in previous or not os.path.lexists(directory / name):
            ours.append(name)
        else:
            log.error("%s exists and no earlier export wrote it: not replaced, so this export lacks it; move it "
                      "away and export again, or choose another checkpoint.export_dir", directory / name)
    _write_record(directory, previous | set(ours))
    for name in ours:
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp / name, directory / name)
    for folder in {(directory / name).parent for name in ours}:
        atomic.fsync_dir(folder)
    for name in sorted(previous - set(ours)):
        log.info("removing %s, written by the previous export", directory / name)
        (directory / name).unlink(missing_ok=True)
    _write_record(directory, set(ours))


def _write_record(directory: Path, files: set[str]) -> None:
    record = {"files": sorted(files), "framework_version": __version__}
    atomic.write_bytes(directory / EXPORT_RECORD, (json.dumps(record, indent=2) + "\n").encode())


def _inside(directory: Path, name: str) -> bool:
    """Whether ``directory/name`` lies in ``directory`` through no symlinked folder (a record's names
    are removed and replaced; a planted link must not point them elsewhere)."""
    parent = PurePosixPath(name).parent
    return Path(os.path.realpath(directory / parent)) == Path(os.path.realpath(directory)) / parent


def _remove_partials(directory: Path) -> None:
    for stale in directory.glob(f"{PARTIAL}*"):
        log.warning("removing %s, left by an interrupted export", stale)
        if stale.is_dir() and not stale.is_symlink():
            shutil.rmtree(stale)
        else:
            stale.unlink(missing_ok=True)


@contextlib.contextmanager
def _exclusive(directory: Path):
    """Hold an exclusive flock on ``directory`` itself: a second export into it waits for this one (whose
    temp directory it would otherwise remove as stale)."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as e:
            if e.errno not in (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EBADF):
                raise
            log.warning("cannot lock %s (%s): nothing stops a second export into it at the same time", directory,
                        e.strerror)
        yield
    finally:
        os.close(fd)  # releases the lock


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
