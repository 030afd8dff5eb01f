"""transformers.TrainingArguments translated into the framework's configuration.

Every field of TrainingArguments is in exactly one table below (tests/unit/hf/test_hf_trainer.py checks
this against the installed transformers, so a field a new release adds fails the test):

- ``MAPPED``: translated by ``to_config`` or applied by the drop-in Trainer itself;
- ``WARNED``: no counterpart, but ignoring it cannot change the trained weights (logging levels,
  the Hub, evaluation extras, loader tuning): a value other than the default gets one warning;
- ``REFUSED``: no counterpart, and ignoring it would train something else: a value other than the
  default is an error. A field no table names (a newer transformers) counts as refused.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import logging
import math
from typing import Any

from ..config.schema import ConfigError

log = logging.getLogger(__name__)

MAPPED = frozenset({
    "output_dir", "per_device_train_batch_size", "gradient_accumulation_steps", "num_train_epochs", "max_steps",
    "learning_rate", "lr_scheduler_type", "lr_scheduler_kwargs", "warmup_steps", "optim", "optim_args",
    "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon", "max_grad_norm", "bf16", "fp16", "tf32",
    "gradient_checkpointing", "gradient_checkpointing_kwargs", "activation_checkpointing",
    "activation_checkpointing_kwargs", "torch_compile", "torch_compile_backend", "torch_compile_mode",
    "logging_strategy", "logging_steps", "logging_first_step", "eval_strategy", "eval_steps",
    "save_strategy", "save_steps", "save_total_limit", "enable_jit_checkpoint",
    "seed", "full_determinism", "dataloader_num_workers", "dataloader_pin_memory", "dataloader_drop_last",
    "remove_unused_columns", "ddp_find_unused_parameters", "ddp_bucket_cap_mb", "ddp_broadcast_buffers",
    "ddp_static_graph", "ddp_backend", "ddp_timeout", "use_cpu", "resume_from_checkpoint",
    "torch_empty_cache_steps", "local_rank", "per_device_eval_batch_size", "label_names",
    "average_tokens_across_devices", "train_sampling_strategy", "disable_tqdm",
    # the best model (framework/hf/callbacks.py tracks it; trainer.py keeps and loads its weights)
    "load_best_model_at_end", "metric_for_best_model", "greater_is_better", "batch_eval_metrics",
    # the callbacks' exported states are saved with every checkpoint and always restored (callbacks.py)
    "restore_callback_states_from_checkpoint",
    # given to transformers' own integration callbacks, which run on rank 0
    "report_to", "run_name", "project", "trackio_space_id", "trackio_bucket_id", "trackio_static_space_id",
})

WARNED = frozenset({
    "log_level", "log_level_replica", "log_on_each_node", "logging_nan_inf_filter",
    "include_num_input_tokens_seen", "skip_memory_metrics", "debug", "do_train", "do_eval", "do_predict",
    "push_to_hub", "hub_token", "hub_private_repo", "hub_model_id", "hub_strategy", "hub_always_push",
    "hub_revision", "save_on_each_node", "save_only_model", "prediction_loss_only", "eval_on_start", "eval_delay",
    "eval_do_concat_batches", "eval_use_gather_object", "eval_accumulation_steps", "include_for_metrics",
    "bf16_full_eval", "fp16_full_eval", "length_column_name",
    "dataloader_persistent_workers", "dataloader_prefetch_factor", "dataloader_multiprocessing_context",
    "dataloader_in_order", "use_cache",
})

# trl.SFTConfig's own fields: TRL's preparation, collator and model set-up apply them (framework/hf/sft.py).
SFT_MAPPED = frozenset({
    "model_init_kwargs", "trust_remote_code", "router_aux_loss_coef", "chat_template_path", "dataset_text_field",
    "dataset_kwargs", "dataset_num_proc", "eos_token", "max_length", "truncation_mode", "shuffle_dataset",
    "packing", "packing_strategy", "padding_free", "pad_to_multiple_of", "eval_packing", "completion_only_loss",
    "assistant_only_loss", "pad_token", "loss_type", "activation_offloading",
})

REFUSED = frozenset({
    "label_smoothing_factor", "optim_target_modules", "use_liger_kernel", "liger_kernel_config",
    "neftune_noise_alpha", "auto_find_batch_size", "ignore_data_skip", "data_seed", "accelerator_config",
    "parallelism_config", "fsdp", "fsdp_config", "deepspeed",
})

_WHY_REFUSED = {
    "label_smoothing_factor": "the loss is the model's own (or compute_loss_func)",
    "ignore_data_skip": "a resumed run always continues at its next sample",
    "data_seed": "the sample order follows seed",
    "fsdp": "DDP only", "fsdp_config": "DDP only", "deepspeed": "DDP only", "parallelism_config": "DDP only",
}


def _plain(value: Any) -> Any:
    """A field's value with the spellings TrainingArguments normalises folded together."""
    if isinstance(value, enum.Enum):
        value = value.value
    if value in (None, "", "none", [], ["none"], {}):
        return None
    return value


@functools.cache
def _defaults(cls: type, output_dir: str | None, use_cpu: bool) -> Any:
    """An instance of ``cls`` (TrainingArguments or a subclass) with every default, normalised by
    its ``__post_init__`` as the user's is (``report_to``, ``accelerator_config``, enums). With the
    user's ``use_cpu``: SFTConfig's default bf16 refuses a machine without a GPU otherwise."""
    return cls(output_dir=output_dir, use_cpu=use_cpu)


def _default(args, name: str) -> Any:
    return getattr(_defaults(type(args), args.output_dir, bool(args.use_cpu)), name)


def non_default(args) -> dict[str, Any]:
    """The fields of ``args`` whose value differs from its TrainingArguments default."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(args)
            if f.init and _plain(getattr(args, f.name)) != _plain(_default(args, f.name))}


def check_fields(args) -> list[str]:
    """Raise ConfigError naming every refused field set away from its default (and every field no
    table knows); return the warned fields so set, for one warning."""
    changed = non_default(args)
    refused = [name for name in changed if name in REFUSED or name not in MAPPED | WARNED | SFT_MAPPED]
    if refused:
        raise ConfigError([f"TrainingArguments.{name}={changed[name]!r}: framework.hf.Trainer cannot honour it "
                           f"({_WHY_REFUSED.get(name, 'no counterpart')}); allowed: the default, "
                           f"{_plain(_default(args, name))!r}" for name in refused])
    return [name for name in changed if name in WARNED]


def checkpointing_mode(args) -> str:
    """memory.activation_checkpointing for HF's gradient (activation) checkpointing settings."""
    on = bool(args.gradient_checkpointing or getattr(args, "activation_checkpointing", False))
    if not on:
        return "off"
    kwargs = dict(args.gradient_checkpointing_kwargs or getattr(args, "activation_checkpointing_kwargs", None) or {})
    unknown = set(kwargs) - {"use_reentrant", "offload"}
    if unknown:
        raise ConfigError([f"TrainingArguments.gradient_checkpointing_kwargs: {sorted(unknown)} not supported; "
                          "allowed: use_reentrant, offload"])
    if kwargs.get("offload"):
        return "offload"
    return "reentrant" if kwargs.get("use_reentrant", False) else "non_reentrant"


def _switch(value: bool | None) -> str:
    return "auto" if value is None else ("true" if value else "false")


def _interval(strategy, steps: float, steps_per_epoch: int, total_steps: int, key: str) -> int:
    """Steps between events for an HF ``*_strategy`` and ``*_steps`` (a float below 1 is a
    fraction of the run); 0 for ``no``."""
    strategy = _plain(strategy) or "no"
    if strategy == "no":
        return 0
    if strategy == "epoch":
        return max(1, steps_per_epoch)
    if strategy == "steps":
        return max(1, math.ceil(steps * total_steps) if 0 < steps < 1 else int(steps))
    raise ConfigError([f"TrainingArguments.{key}={strategy!r}: allowed: no, steps, epoch"])


def ddp_backend(args) -> str:
    """ddp.backend for ``args.ddp_backend``."""
    backend = _plain(args.ddp_backend) or "auto"
    if backend not in ("auto", "gloo", "nccl"):
        raise ConfigError([f"TrainingArguments.ddp_backend={backend!r}: allowed: gloo, nccl (or unset)"])
    return backend


def total_steps(args, steps_per_epoch: int) -> int:
    """The optimizer steps of the run, as transformers.Trainer counts them."""
    if args.max_steps > 0:
        return args.max_steps
    return math.ceil(args.num_train_epochs * steps_per_epoch)


def intervals(args, steps_per_epoch: int, total: int) -> dict[str, int]:
    """Steps between logs, evaluations and step-counted saves for ``args`` (0: none), counted in
    epochs of ``steps_per_epoch`` steps and a run of ``total``."""
    eval_steps = args.eval_steps if args.eval_steps is not None else args.logging_steps
    return {"logging": _interval(args.logging_strategy, args.logging_steps, steps_per_epoch, total, "logging_strategy"),
            "eval": _interval(args.eval_strategy, eval_steps, steps_per_epoch, total, "eval_strategy"),
            "save": _interval(args.save_strategy, args.save_steps, steps_per_epoch, total, "save_strategy")}


def run_length(args, steps_per_epoch: int) -> dict:
    """train.max_steps and train.num_epochs for ``args``. A resume at another world size keeps the
    run's global batch, so its length must not be counted at this world size: max_steps stays
    max_steps (with epochs enough for any world size), whole epochs stay epochs (the engine counts
    their steps at the run's global batch). Only a fraction of an epoch is counted here, at this
    world size's ``steps_per_epoch`` (framework.hf.Trainer recounts it, and the ``epoch``
    intervals, in the run's epochs once the engine has loaded the checkpoint)."""
    if args.max_steps > 0:
        return {"max_steps": args.max_steps, "num_epochs": args.max_steps}
    epochs = float(args.num_train_epochs)
    if epochs.is_integer():
        return {"max_steps": 0, "num_epochs": max(1, int(epochs))}
    return {"max_steps": math.ceil(epochs * steps_per_epoch), "num_epochs": math.ceil(epochs)}


def to_config(args, *, steps_per_epoch: int, resume: str) -> dict:
    """The framework configuration (sectioned dict) for ``args``; ``steps_per_epoch`` is the
    number of optimizer steps of one epoch; ``resume`` the checkpoint.resume value."""
    out = args.output_dir or "trainer_output"
    total = total_steps(args, steps_per_epoch)
    backend = ddp_backend(args)
    if (_plain(args.train_sampling_strategy) or "random") != "random":
        raise ConfigError([f"TrainingArguments.train_sampling_strategy={args.train_sampling_strategy!r}: "
                          "allowed: random"])
    every = intervals(args, steps_per_epoch, total)
    logging_interval, save_every = every["logging"], every["save"]
    if _plain(args.save_strategy) == "best":
        raise ConfigError(["TrainingArguments.save_strategy='best': allowed: no, steps, epoch"])
    return {
        "data": {"batch_size": args.per_device_train_batch_size,
                 "gradient_accumulation_steps": args.gradient_accumulation_steps,
                 "num_workers": args.dataloader_num_workers, "pin_memory": bool(args.dataloader_pin_memory)},
        "optim": {"lr": args.learning_rate, "grad_clip": float(args.max_grad_norm or 0.0)},
        "train": {**run_length(args, steps_per_epoch), "target_loss": 0.0, "seed": args.seed,
                  "deterministic": bool(args.full_determinism)},
        "precision": {"autocast": "true" if (args.bf16 or args.fp16) else "false",
                      "dtype": "fp16" if args.fp16 else "bf16"},
        "memory": {"activation_checkpointing": checkpointing_mode(args), "activation_checkpointing_modules": "",
                   **({"cleanup_interval": args.torch_empty_cache_steps} if args.torch_empty_cache_steps else {})},
        "eval": {"interval": every["eval"], "steps": 0},
        "logging": {"dir": f"{out}/logs", "interval": logging_interval or total or 1,
                    "progress_bar": "false" if args.disable_tqdm else "auto"},
        "checkpoint": {"dir": f"{out}/checkpoints", "every_steps": save_every if _plain(args.save_strategy) == "steps"
                       else 0, "every_epochs": 1 if _plain(args.save_strategy) == "epoch" else 0,
                       "every_minutes": 0,  # save_strategy is the user's whole schedule
                       "keep_last": args.save_total_limit or 10**6, "resume": resume, "export_dir": "none"},
        "ddp": {"backend": backend, "timeout_s": float(args.ddp_timeout),
                "find_unused_parameters": _switch(args.ddp_find_unused_parameters),
                "static_graph": _switch(args.ddp_static_graph),
                "broadcast_buffers": True if args.ddp_broadcast_buffers is None else bool(args.ddp_broadcast_buffers),
                **({"bucket_cap_mb": float(args.ddp_bucket_cap_mb)} if args.ddp_bucket_cap_mb else {})},
        "compile": {"enabled": bool(args.torch_compile),
                    **({"backend": args.torch_compile_backend} if args.torch_compile_backend else {}),
                    **({"mode": args.torch_compile_mode} if args.torch_compile_mode else {})},
        # transformers.Trainer has no spike guard and no straggler alarm: a drop-in adds no stop of its own.
        "spike": {"guard": "warn"},
    }


# What to_config sets as the drop-in's own choice, not from a TrainingArguments field: a
# framework_config may set these too.
DROP_IN_CHOICES = frozenset({"spike.guard", "checkpoint.every_minutes", "checkpoint.export_dir", "train.target_loss",
                             "eval.steps", "memory.activation_checkpointing_modules"})


def with_framework_config(config: dict, source) -> dict:
    """``config`` (to_config's, sectioned) with the settings of ``source`` over it: a .toml/.json
    path or a dict of framework keys for what TrainingArguments has no field for (``recovery``,
    ``spike``, ``straggler``, the MLP tiling, ...). A key that a TrainingArguments field sets is
    refused by name: it has one place to be set."""
    from ..config import dotted, read_settings

    settings = read_settings(source, "framework_config")
    ours = dotted(config)
    owned = sorted(key for key in settings if key in ours and key not in DROP_IN_CHOICES)
    if owned:
        raise ConfigError([f"framework_config: {key}={settings[key]!r}: set from the TrainingArguments; allowed: "
                           "keys they have no field for (e.g. recovery.*, spike.*, straggler.*, memory.tiled_mlp_*)"
                           for key in owned])
    merged: dict = {}
    for key, value in {**ours, **settings}.items():
        section, name = key.split(".")
        merged.setdefault(section, {})[name] = value
    return merged
