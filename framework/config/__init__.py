"""The one training configuration: sections of validated dataclass fields, each owned by a
component, and the sources they are read from. Imports no torch (``--check-config`` runs without it).

- ``schema``: ``TrainConfig``, assembled from the sections beside their owners
  (``framework/<package>/config.py``, built with ``fields``), each field's bounds, resume class and flat alias;
- ``sources``: defaults, dicts, files, environment and flags, merged (and the flat aliases);
- ``checks``: the validation, before any process group starts;
- ``help``: the ``--help`` text and the generated configuration table.
"""

from .checks import (EXPORT_RECORD, VAL_FRACTION_TEXT, builtin_data_problems, check_values, data_file_facts,
                     data_file_problems, export_path, export_record, split_tokens, training_set_problems,
                     world_size_from)
from .help import help_text, markdown_table
from .schema import (ALIASES, AUTO, COMPACT, FIELDS, KEYS, RESUME, RESUME_CLASSES, SECTIONS, ActivationCheckpointing,
                     CheckpointSection, CompileSection, ConfigError, DataSection, DDPSection, EvalSection,
                     GradientCheckpointing, LoggingSection, MemorySection, ModelSection, OptimSection,
                     PrecisionSection, RecoverySection, SpikeSection, StragglerSection, Switch, TrainConfig,
                     TrainSection, applicable_keys, bounded, describe_type, dotted, from_dotted, get)
from .sources import (ACTION_FLAGS, ENV_PREFIX, ENV_SHORTCUTS, as_dict, build_config, load_config_file, non_default,
                      parse_command_line, read_settings, resolve_config)

__all__ = [
    "ACTION_FLAGS", "ALIASES", "AUTO", "COMPACT", "ENV_PREFIX", "ENV_SHORTCUTS", "EXPORT_RECORD", "FIELDS",
    "FIELD_DOCS", "KEYS",
    "RESUME", "RESUME_CLASSES", "SECTIONS", "VAL_FRACTION_TEXT", "ActivationCheckpointing", "CheckpointSection",
    "CompileSection", "ConfigError", "DDPSection", "DataSection", "EvalSection", "GradientCheckpointing",
    "LoggingSection", "MemorySection", "ModelSection", "OptimSection", "PrecisionSection", "RecoverySection",
    "SpikeSection", "StragglerSection", "Switch", "TrainConfig", "TrainSection", "applicable_keys", "as_dict",
    "bounded", "non_default",
    "build_config", "builtin_data_problems", "check_values", "data_file_facts", "data_file_problems",
    "describe_type", "dotted", "export_path", "export_record", "from_dotted", "get", "help_text",
    "load_config_file", "markdown_table", "parse_command_line", "read_settings", "resolve_config", "split_tokens",
    "training_set_problems", "world_size_from",
]


def __getattr__(name: str):
    if name == "FIELD_DOCS":  # parsed on first use (framework/config/schema.py field_docs)
        from .schema import field_docs
        return field_docs()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
