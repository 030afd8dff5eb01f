"""Where the configuration comes from, lowest to highest precedence: field defaults, a Python dict,
a config file (``--config run.toml`` or ``.json``), environment variables, command-line flags.

Keys are dotted by section in every source: ``[spike]`` tables or ``spike.threshold = 6`` in a
file, ``DDP_SPIKE__THRESHOLD`` (a double underscore for the dot), ``--spike.threshold 6``, and
``{"spike": {"threshold": 6}}`` or ``{"spike.threshold": 6}`` from Python. The flat keys of the
config before sections (``spike_threshold``, ``DDP_SPIKE_THRESHOLD``, ``--spike-threshold``) still
work, each with a one-line deprecation note. Every problem in any source is collected and
reported at once, as one line each.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import logging
import math
import os
import tomllib
import typing
from pathlib import Path
from typing import Any, Literal

from .checks import builtin_data_problems, check_values, global_batch_problems, world_size_from
from .schema import (AUTO, ALIASES, COMPACT, FIELDS, KEYS, SECTIONS, TYPES, ConfigError, TrainConfig,
                     applicable_keys, dotted, from_dotted)

log = logging.getLogger(__name__)

ENV_PREFIX = "DDP_"

# Operator overrides spelled as DDP users know them (DDP_STATIC_GRAPH=0|1): not deprecated.
ENV_SHORTCUTS = {"static_graph": "ddp.static_graph", "find_unused_parameters": "ddp.find_unused_parameters"}

_NOTED: set[str] = set()  # the flat keys whose deprecation note this process has given


def _coerce(key: str, value: Any) -> Any:
    """Convert ``value`` (a string from the CLI or environment, or a file/dict value) to the
    field's type. Raises ValueError with a message that names what is allowed."""
    tp = TYPES[key]
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
        auto = FIELDS[key].metadata.get("auto")
        expected = "expected an integer" + (" or auto" if auto else "")
        if isinstance(value, bool):
            raise ValueError(expected)
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if auto and str(value).strip().lower() == "auto":
            return AUTO
        try:
            return int(str(value).strip())
        except ValueError:
            raise ValueError(expected) from None
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
    close = difflib.get_close_matches(key, KEYS + list(ALIASES), n=1, cutoff=0.6)
    hint = f"; did you mean '{ALIASES.get(close[0], close[0])}'?" if close else "; see --help for the list of keys"
    return f"{source}: unknown key '{key}'{hint}"


def _items(data: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """A nested dict's items with dotted keys: ``{"spike": {"threshold": 6}}`` -> ``spike.threshold``.
    A dict value under a key that is not a section stays a value (and is refused as one)."""
    out = []
    for key, value in data.items():
        if not prefix and isinstance(value, dict) and str(key).replace("-", "_").lower() in SECTIONS:
            out += _items(value, f"{key}.")
        else:
            out.append((f"{prefix}{key}", value))
    return out


def _note_deprecated(flat: str, key: str, source: str) -> None:
    if flat not in _NOTED and flat not in COMPACT:
        _NOTED.add(flat)
        log.warning("%s: '%s' is deprecated, use '%s' (the flat key still works)", source, flat, key)


def _read_source(source: str, items, values: dict[str, Any], problems: list[str], *, ordered: bool = False) -> None:
    """Coerce one source's ``(key, raw value)`` pairs into ``values`` (dotted keys). A flat alias
    and its dotted key with different values are refused, unless the source is ``ordered`` (the
    command line, where the later flag wins, as a repeated flag does: launch_training.sh --test
    puts its flags before the user's)."""
    spelled: dict[str, tuple[str, Any]] = {}  # dotted key -> the spelling and value this source gave
    for key, raw in items:
        norm = str(key).replace("-", "_").lower()
        if norm in ALIASES:
            target = ALIASES[norm]
            _note_deprecated(norm, target, source)
        elif norm in TYPES:
            target = norm
        else:
            problems.append(_unknown_key(norm, source))
            continue
        try:
            value = _coerce(target, raw)
        except ValueError as err:
            problems.append(f"{source}: {norm}={raw!r}: {err}")
            continue
        if not ordered and target in spelled and spelled[target][0] != norm and spelled[target][1] != value:
            other, before = spelled[target]
            flat = other if other != target else norm
            problems.append(f"{source}: {other}={before!r} and {norm}={value!r} set the same key to different "
                            f"values ('{flat}' is the old name of '{target}'); allowed: one of them")
            continue
        spelled[target] = (norm, value)
        values[target] = value


def _env_items(env) -> list[tuple[str, str]]:
    items = []
    for name, value in sorted(env.items()):
        if not name.startswith(ENV_PREFIX):
            continue
        key = name[len(ENV_PREFIX):].lower()
        items.append((ENV_SHORTCUTS.get(key, key.replace("__", ".")), value))
    return items


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
    if overrides:
        _read_source("config", _items(overrides), values, problems)
    if file is not None:
        try:
            _read_source(f"config file {file}", _items(load_config_file(file)), values, problems)
        except ConfigError as err:
            problems.extend(err.problems)
    _read_source("environment", _env_items(os.environ if env is None else env), values, problems)
    if cli:
        _read_source("command line", cli, values, problems, ordered=True)

    cfg = from_dotted(values)
    problems.extend(check_values(cfg))
    if world_size is not None and not problems:
        problems.extend(global_batch_problems(cfg, world_size) or builtin_data_problems(cfg, world_size))
    if problems:
        raise ConfigError(problems)
    return cfg


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


def read_settings(source: str | Path | dict[str, Any], label: str = "config") -> dict[str, Any]:
    """The keys one source sets, dotted and coerced: ``source`` is a .toml/.json path or a dict
    (nested, dotted or flat keys). Raises ConfigError naming each unknown key or bad value; the
    values are checked against each other only when a config is built from them."""
    problems: list[str] = []
    if isinstance(source, dict):
        data = source
    else:
        data, label = load_config_file(source), f"{label} {source}"
    values: dict[str, Any] = {}
    _read_source(label, _items(data), values, problems)
    if problems:
        raise ConfigError(problems)
    return values


def as_dict(cfg: TrainConfig, *, builtin_model: bool = True, builtin_data: bool = True) -> dict[str, Any]:
    """The config nested by section, as saved in log_dir/config.json and in checkpoints: the keys
    that apply to a run with or without the built-in model and data (``applicable_keys``); a
    section left without keys is left out."""
    full = dataclasses.asdict(cfg)
    if builtin_model and builtin_data:
        return full
    out: dict[str, dict[str, Any]] = {}
    for key in applicable_keys(builtin_model=builtin_model, builtin_data=builtin_data):
        section, name = key.split(".")
        out.setdefault(section, {})[name] = full[section][name]
    return out


def non_default(cfg: TrainConfig, *, builtin_model: bool = True, builtin_data: bool = True) -> dict[str, Any]:
    """The dotted keys that apply (see ``as_dict``) whose value differs from its default (the
    console's summary of a run)."""
    default = dotted(as_dict(TrainConfig()))
    now = dotted(as_dict(cfg, builtin_model=builtin_model, builtin_data=builtin_data))
    return {key: value for key, value in now.items() if default.get(key) != value}


def resolve_config(config: TrainConfig | dict | None) -> TrainConfig:
    """What DDPTrainer accepts: the dataclass (re-validated), a plain dict (nested, dotted or
    flat keys), or None (defaults)."""
    if isinstance(config, TrainConfig):
        return build_config(as_dict(config), env={})
    if config is None or isinstance(config, dict):
        return build_config(config or {}, env={})
    raise ConfigError([f"config={type(config).__name__}: allowed: a dict, a TrainConfig or None"])


# Flags of ddp_training.py that are actions, not config keys.
ACTION_FLAGS = ("check-config", "doctor", "debug", "help")


def parse_command_line(argv: list[str], env: dict[str, str] | None = None) -> tuple[TrainConfig, set[str]]:
    """Parse ``--section.key value`` / ``--section.key=value`` flags (and the flat ``--key value``
    of before), ``--config FILE`` and the action flags. Returns the validated config and the set
    of actions given. Raises ConfigError."""
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
            problems.append(f"command line: unexpected argument {arg!r}; flags look like --section.key value")
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
