"""``framework.hf.SFTTrainer``: TRL's ``SFTTrainer`` with one import changed, trained by DDPTrainer.

    from framework.hf import SFTConfig, SFTTrainer      # was: from trl import SFTConfig, SFTTrainer

TRL does what it does best, with its own code: it builds the PEFT model from ``peft_config``,
formats the data (the text field, ``formatting_func``, conversations through the chat template,
prompt-completion pairs with the completion-only loss, the assistant-only loss), tokenises,
truncates to ``max_length``, adds EOS, packs (``bfd``, ``wrapped``) and collates (``padding_free``).
A ``trl.SFTTrainer`` is built for that and dropped; its model, prepared datasets and collator go
to ``framework.hf.Trainer``, whose engine trains them with the framework's DDP policy, checkpoints,
restarts and run health.

Tokenise once: the global rank 0 prepares the data alone and saves it under
``output_dir/prepared/<key>`` (the key: the datasets' fingerprints and every argument that shapes
them); the other ranks, and every restart, load it instead of tokenising again.

The loss is TRL's: the mean negative log-likelihood over the labelled tokens of the step (TRL's
fused LM head computes the same from log-probabilities, without the full logits).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import inspect
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch

from ..config.schema import ConfigError
from ..ddp import process_group
from .trainer import Trainer, from_rank0

log = logging.getLogger(__name__)

# The keywords older TRL releases took on SFTTrainer itself, and where they live today.
LEGACY_KEYWORDS = {
    "tokenizer": "processing_class", "dataset_text_field": "SFTConfig.dataset_text_field",
    "max_seq_length": "SFTConfig.max_length", "packing": "SFTConfig.packing",
    "dataset_num_proc": "SFTConfig.dataset_num_proc", "dataset_kwargs": "SFTConfig.dataset_kwargs",
    "eval_packing": "SFTConfig.eval_packing", "dataset_batch_size": None, "neftune_noise_alpha": None,
}

# SFTConfig's fields that shape the prepared data (the cache key holds their values).
SHAPING = ("dataset_text_field", "dataset_kwargs", "eos_token", "pad_token", "max_length", "truncation_mode",
           "shuffle_dataset", "packing", "packing_strategy", "padding_free", "eval_packing", "completion_only_loss",
           "assistant_only_loss", "chat_template_path")

# The signature columns TRL keeps (SFTTrainer._set_signature_columns_if_needed): the collator's inputs.
COLUMNS = frozenset({"input_ids", "labels", "seq_lengths"})


def sft_args(args, legacy: dict[str, Any], processing_class):
    """``args`` as an SFTConfig (a TrainingArguments is converted, as TRL does), with the older
    keywords of ``legacy`` applied, each with one line naming today's spelling; returns
    ``(args, processing_class)``. An unknown keyword, or one with no counterpart, is refused."""
    from transformers import TrainingArguments
    from trl import SFTConfig

    if args is None:
        args = SFTConfig(output_dir="trainer_output")
    elif isinstance(args, TrainingArguments) and not isinstance(args, SFTConfig):
        fields = {f.name for f in dataclasses.fields(SFTConfig)}
        args = SFTConfig(**{k: v for k, v in args.to_dict().items() if k in fields})
    problems = []
    for name, value in legacy.items():
        where = LEGACY_KEYWORDS.get(name, "unknown")
        if where in (None, "unknown"):
            problems.append(f"SFTTrainer({name}=...): " + (
                "not a keyword of SFTTrainer or SFTConfig" if where == "unknown" else
                "removed from TRL, with no counterpart in framework.hf (it would train something else)"))
            continue
        if name == "tokenizer":
            if processing_class is not None and processing_class is not value:
                problems.append("SFTTrainer(tokenizer=..., processing_class=...): pass only processing_class")
                continue
            processing_class = value
        else:
            setattr(args, where.split(".", 1)[1], value)
        log.warning("SFTTrainer(%s=...) is %s in TRL today: applied as such", name,
                    "processing_class=..." if name == "tokenizer" else f"{where.replace('.', '(', 1)}=...)")
    if problems:
        raise ConfigError(problems)
    return args, processing_class


def refuse_unrunnable(args, model) -> None:
    """One line for what this machine cannot run: bitsandbytes' 8-bit and paged optimizers need it
    installed and a CUDA GPU; Unsloth's FastLanguageModel is GPU-only."""
    optim = str(getattr(args.optim, "value", args.optim))
    problems = []
    if ("8bit" in optim or "bnb" in optim or "paged" in optim) and not (_has("bitsandbytes")
                                                                       and torch.cuda.is_available()):
        problems.append(f"SFTConfig.optim={optim!r}: needs bitsandbytes and a CUDA GPU, and this machine has "
                        f"{'no CUDA GPU' if not torch.cuda.is_available() else 'no bitsandbytes'}; allowed here: "
                        "adamw_torch, adamw_torch_fused, adafactor, sgd (or install bitsandbytes on a GPU machine)")
    if type(model).__module__.startswith("unsloth") or getattr(model, "_unsloth", False) or hasattr(
            model, "max_seq_length") and "unsloth" in type(model).__qualname__.lower():
        if not torch.cuda.is_available():
            problems.append("model: Unsloth's FastLanguageModel runs on a CUDA GPU only; here load the model with "
                            "transformers (AutoModelForCausalLM) and pass peft_config")
    if problems:
        raise ConfigError(problems)


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def _tokenizer_digest(processing_class) -> str:
    tokenizer = getattr(processing_class, "tokenizer", processing_class)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    parts = [type(processing_class).__name__, backend.to_str() if backend is not None else repr(tokenizer),
             str(getattr(processing_class, "chat_template", None)),
             json.dumps(getattr(tokenizer, "special_tokens_map", {}), sort_keys=True, default=str)]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def _function_digest(function: Callable | None) -> str:
    if function is None:
        return "none"
    try:
        return hashlib.sha256(inspect.getsource(function).encode()).hexdigest()
    except (OSError, TypeError):  # no source (a builtin, a lambda in a REPL): its name stands in
        return getattr(function, "__qualname__", repr(function))


def _fingerprint(dataset) -> str:
    """A datasets.Dataset's fingerprint (content-derived: the same data and transforms, the same
    value in every process and restart)."""
    value = getattr(dataset, "_fingerprint", None)
    if value is None:
        raise ConfigError([f"SFTTrainer: train_dataset/eval_dataset must be a datasets.Dataset (got "
                           f"{type(dataset).__name__})"])
    return str(value)


def cache_key(train_dataset, eval_dataset, args, processing_class, formatting_func) -> str:
    """The prepared data's key: the datasets, the arguments that shape them, the tokenizer and
    chat template, the formatting function's source, and TRL's version."""
    import trl

    parts = {"train": _fingerprint(train_dataset),
             "eval": None if eval_dataset is None else _fingerprint(eval_dataset),
             "args": {name: getattr(args, name, None) for name in SHAPING},
             "seed": args.seed if args.shuffle_dataset else None,
             "tokenizer": _tokenizer_digest(processing_class), "formatting_func": _function_digest(formatting_func),
             "trl": trl.__version__}
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


@contextlib.contextmanager
def _alone():
    """TRL prepares under accelerate's main_process_first, whose barriers every rank must enter:
    the global rank 0 prepares alone here while the others wait for its result."""
    from trl.trainer import sft_trainer

    saved = sft_trainer.global_then_local_main_first
    sft_trainer.global_then_local_main_first = contextlib.nullcontext
    try:
        yield
    finally:
        sft_trainer.global_then_local_main_first = saved


@contextlib.contextmanager
def _skipping_preparation(args):
    saved = args.dataset_kwargs
    args.dataset_kwargs = {**(saved or {}), "skip_prepare_dataset": True}
    try:
        yield
    finally:
        args.dataset_kwargs = saved


def _save(dataset, target: Path) -> None:
    """``dataset`` saved at ``target`` whole or not at all (a temp directory renamed)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        dataset.save_to_disk(str(tmp))
        os.replace(tmp, target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not target.is_dir():
            raise


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1



@dataclasses.dataclass
class Prepared:
    model: torch.nn.Module
    processing_class: Any
    data_collator: Callable
    train_dataset: Any
    eval_dataset: Any
    cache: Path
    tokenised_here: bool


def prepare(model, args, *, data_collator, train_dataset, eval_dataset, processing_class, peft_config,
            formatting_func, quantization_config=None) -> Prepared:
    """TRL's SFTTrainer builds the model, the collator and (on the global rank 0 only, once per
    key) the prepared datasets; every other rank, and every restart, loads them."""
    import datasets
    from trl import SFTTrainer as TRLTrainer

    if isinstance(eval_dataset, dict):
        raise ConfigError(["SFTTrainer(eval_dataset={...}): a dict of evaluation sets is not supported; pass one "
                           "datasets.Dataset"])
    if processing_class is None:
        raise ConfigError(["SFTTrainer: processing_class (the tokenizer) is required: nothing can be downloaded "
                           "here, and framework.hf does not guess one from the model"])
    key = cache_key(train_dataset, eval_dataset, args, processing_class, formatting_func)
    cache = Path(args.output_dir or "trainer_output") / "prepared" / key
    rank = process_group.read_env()[0]

    def build(train, evaluate, *, skip: bool):
        kwargs = dict(model=model, args=args, data_collator=data_collator, train_dataset=train,
                      eval_dataset=evaluate, processing_class=processing_class, peft_config=peft_config,
                      formatting_func=None if skip else formatting_func)
        if quantization_config is not None:
            kwargs["quantization_config"] = quantization_config
        try:
            with _skipping_preparation(args) if skip else _alone():
                return TRLTrainer(**kwargs)
        except (ValueError, TypeError) as err:  # TRL's checks of its arguments and data: a user's mistake
            raise ConfigError([f"SFTTrainer: {(str(err).splitlines() or [type(err).__name__])[0]}"]) from err

    built = None
    if not from_rank0(lambda: (cache / "train").is_dir(), rank=rank, distributed=_distributed(),
                      what="looking for the prepared data"):
        built = _prepare_on_rank0(lambda: build(train_dataset, eval_dataset, skip=False), cache, rank)
    tokenised = built is not None
    if not tokenised:
        log.info("loading the prepared data from %s (tokenised once, by rank 0)", cache)
        train = datasets.load_from_disk(str(cache / "train"))
        evaluate = datasets.load_from_disk(str(cache / "eval")) if (cache / "eval").is_dir() else None
        built = build(train, evaluate, skip=True)
    else:
        log.info("prepared the data once, for every rank and restart: %s", cache)
    prepared = Prepared(model=built.model, processing_class=built.processing_class,
                        data_collator=built.data_collator, train_dataset=built.train_dataset,
                        eval_dataset=built.eval_dataset, cache=cache, tokenised_here=tokenised)
    return prepared


def _prepare_on_rank0(build: Callable, cache: Path, rank: int):
    """On rank 0: TRL's trainer built with the data prepared, the prepared data saved at ``cache``
    (returned); elsewhere: None, once rank 0's data is there. An error on rank 0 reaches every rank
    (no rank waits for data that never comes)."""
    def prepare_and_save():
        built = build()
        _save(built.train_dataset, cache / "train")
        if built.eval_dataset is not None:
            _save(built.eval_dataset, cache / "eval")
        return built

    built = from_rank0(prepare_and_save, rank=rank, distributed=_distributed(), what="preparing the data",
                       share=False)
    if not (cache / "train").is_dir():
        raise ConfigError([f"SFTTrainer: the prepared data {cache} is not readable from rank {rank}: "
                           "output_dir must be on a file system every node shares"])
    return built


class SFTTrainer(Trainer):
    """trl.SFTTrainer's constructor and methods (``train``, ``evaluate``, ``save_model``, ...),
    trained by DDPTrainer. See the module docstring and docs/huggingface.md."""

    def __init__(self, model=None, args=None, data_collator: Callable | None = None, train_dataset=None,
                 eval_dataset=None, processing_class=None, compute_loss_func: Callable | None = None,
                 compute_metrics=None, callbacks: list | None = None, optimizers: tuple = (None, None),
                 optimizer_cls_and_kwargs: tuple | None = None, preprocess_logits_for_metrics=None,
                 peft_config=None, formatting_func: Callable | None = None, quantization_config=None,
                 framework_config=None, **legacy):
        args, processing_class = sft_args(args, legacy, processing_class)
        if model is None:
            raise ConfigError(["framework.hf.SFTTrainer: model is required"])
        if train_dataset is None:
            raise ConfigError(["framework.hf.SFTTrainer: train_dataset is required"])
        refuse_unrunnable(args, model)
        if args.loss_type != "nll":
            raise ConfigError([f"SFTConfig.loss_type={args.loss_type!r}: allowed: 'nll' (the loss is the model's "
                               "own mean negative log-likelihood)"])
        if args.activation_offloading:
            raise ConfigError(["SFTConfig.activation_offloading=True: not supported; allowed: False (for memory, "
                               "gradient_checkpointing_kwargs={'offload': True} keeps checkpointed inputs on CPU)"])
        prepared = prepare(model, args, data_collator=data_collator, train_dataset=train_dataset,
                           eval_dataset=eval_dataset, processing_class=processing_class, peft_config=peft_config,
                           formatting_func=formatting_func, quantization_config=quantization_config)
        self.prepared_cache = prepared.cache
        self.tokenised_here = prepared.tokenised_here
        super().__init__(model=prepared.model, args=args, data_collator=prepared.data_collator,
                         train_dataset=prepared.train_dataset, eval_dataset=prepared.eval_dataset,
                         processing_class=prepared.processing_class, compute_loss_func=compute_loss_func,
                         compute_metrics=compute_metrics, callbacks=callbacks, optimizers=optimizers,
                         optimizer_cls_and_kwargs=optimizer_cls_and_kwargs,
                         preprocess_logits_for_metrics=preprocess_logits_for_metrics, framework_config=framework_config)

    def _columns(self) -> frozenset[str] | None:
        return COLUMNS if self.args.remove_unused_columns else None
