"""The configuration's shape: ``TrainConfig`` assembles the sections, each a dataclass of documented,
bounded fields that lives beside the components that own it (``framework/<package>/config.py``:
``recovery`` in framework/resilience/config.py, read by ``Watchdog.Config`` and the others), and
the tables every source and check reads (``FIELDS``, ``ALIASES``, ``RESUME``...).

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

from ..data.config import DataSection
from ..ddp.config import CompileSection, DDPSection
from ..model.config import MemorySection, ModelSection
from ..observability.config import LoggingSection
from ..resilience.config import RecoverySection, SpikeSection, StragglerSection
from ..state.config import CheckpointSection
from ..train.config import EvalSection, OptimSection, PrecisionSection, TrainSection

from .fields import (AUTO, RESUME_CLASSES, ActivationCheckpointing, Builtin, GradientCheckpointing, Resume, Switch,
                     bounded, option)

__all__ = [
    "ALIASES", "AUTO", "COMPACT", "FIELDS", "KEYS", "RESUME", "RESUME_CLASSES", "SECTIONS", "TYPES",
    "ActivationCheckpointing", "Builtin", "CheckpointSection", "CompileSection", "ConfigError", "DDPSection",
    "DataSection", "EvalSection", "GradientCheckpointing", "LoggingSection", "MemorySection", "ModelSection",
    "OptimSection", "PrecisionSection", "RecoverySection", "Resume", "SpikeSection", "StragglerSection", "Switch",
    "TrainConfig", "TrainSection", "applicable_keys", "bounded", "describe_default", "describe_type", "dotted",
    "field_docs", "from_dotted", "get", "is_auto", "option",
]


class ConfigError(ValueError):
    """A user's configuration is wrong. ``problems`` holds one line per mistake."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("invalid configuration:\n" + "\n".join(f"  {p}" for p in self.problems))


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
    """Dotted key -> the string literal under its field. Parsed from the sections' sources on first
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
