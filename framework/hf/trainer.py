"""``framework.hf.Trainer``: transformers.Trainer's constructor and methods, trained by DDPTrainer.

A script written for ``transformers.Trainer`` changes one import. The TrainingArguments are
translated field by field (framework/hf/arguments.py); the optimizer and learning-rate schedule
are the ones transformers.Trainer would build from them (its own ``get_optimizer_cls_and_kwargs``
and ``get_scheduler``); HF callbacks get their events (framework/hf/callbacks.py). DDP settings come
from the framework's policy, and checkpoints, restarts, preemption and run health from DDPTrainer."""

from __future__ import annotations

import inspect
import logging
from pathlib import Path
from typing import Any, Callable

import torch
from torch.utils.data import Dataset, IterableDataset

from ..config.schema import ConfigError
from ..data.sampler import ResumableDistributedSampler
from ..ddp import process_group
from ..model.hf_checkpointing import accepts_loss_kwargs, hf_model_in
from ..trainer import DDPTrainer
from . import arguments
from .callbacks import HFCallbacks

log = logging.getLogger(__name__)

_LABEL_COLUMNS = ("label", "label_ids", "labels")


class Collated(Dataset):
    """``dataset`` whose batches are ``collator``'s output on its samples (the loader passes a
    dataset's ``__getitems__`` result through as the batch). ``columns``: the sample keys the
    model takes (transformers.Trainer's ``remove_unused_columns``); None keeps every key."""

    def __init__(self, dataset, collator: Callable, columns: frozenset[str] | None):
        self.dataset, self.collator, self.columns = dataset, collator, columns

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        sample = self.dataset[index]
        if self.columns is not None and isinstance(sample, dict):
            sample = {k: v for k, v in sample.items() if k in self.columns}
        return sample

    def __getitems__(self, indices: list[int]):
        return self.collator([self[i] for i in indices])


def _model_columns(model: torch.nn.Module, label_names: list[str] | None) -> frozenset[str]:
    """The keys transformers.Trainer keeps: the forward's parameters (of the base model under
    PEFT) and the label names."""
    inspected = hf_model_in(model) or model
    names = set(inspect.signature(inspected.forward).parameters)
    return frozenset(names | set(_LABEL_COLUMNS) | set(label_names or ()))


# Methods a subclass of transformers.Trainer commonly overrides. Honoured: compute_loss (called for
# every micro-batch's loss, with num_items_in_batch=None: the framework weighs each micro-batch's
# mean by its labelled tokens), create_optimizer and create_scheduler. Refused, with one line each:
# the framework's own step and data order replace these, and ignoring them would train something else.
REFUSED_OVERRIDES = {
    "training_step": "the framework's step replaces it (DDP's no_sync, the OOM retry, the non-finite skip): put "
                     "the loss in compute_loss, or what runs around a step in a TrainerCallback",
    "get_train_dataloader": "the framework's resumable sampler decides the data order: pass the data as "
                            "train_dataset and the batching as data_collator",
    "get_eval_dataloader": "the framework evaluates eval_dataset with data_collator",
    "_inner_training_loop": "the framework's loop replaces it",
    "optimizer_step": "the framework's optimizer step replaces it",
}


def _overridden(cls: type, name: str) -> bool:
    """Whether a class below framework.hf's own defines ``name``."""
    own = {c for c in cls.__mro__ if c.__module__.startswith("framework.hf.")} | {object}
    return any(name in vars(c) for c in cls.__mro__ if c not in own)


def _default_collator(processing_class):
    from transformers import DataCollatorWithPadding, default_data_collator

    if processing_class is not None and hasattr(processing_class, "pad"):
        return DataCollatorWithPadding(processing_class)
    return default_data_collator


class Trainer:
    """transformers.Trainer's interface (see the module docstring and docs/huggingface.md).
    ``model_init``, ``compute_metrics`` and ``preprocess_logits_for_metrics`` are not supported."""

    def __init__(self, model: torch.nn.Module | None = None, args=None, data_collator: Callable | None = None,
                 train_dataset=None, eval_dataset=None, processing_class=None, model_init=None,
                 compute_loss_func: Callable | None = None, compute_metrics=None, callbacks: list | None = None,
                 optimizers: tuple = (None, None), optimizer_cls_and_kwargs: tuple | None = None,
                 preprocess_logits_for_metrics=None):
        from transformers import TrainingArguments
        from transformers.trainer_callback import TrainerState

        unsupported = [name for name, value in (("model_init", model_init), ("compute_metrics", compute_metrics),
                                                ("preprocess_logits_for_metrics", preprocess_logits_for_metrics))
                       if value is not None]
        if unsupported:
            raise ConfigError([f"framework.hf.Trainer: {', '.join(unsupported)} not supported (pass model; "
                              "evaluation reports eval_loss)"])
        if model is None:
            raise ConfigError(["framework.hf.Trainer: model is required"])
        refused = [name for name in REFUSED_OVERRIDES if _overridden(type(self), name)]
        if refused:
            raise ConfigError([f"{type(self).__name__}.{name}: overriding it is not supported by framework.hf "
                               f"({REFUSED_OVERRIDES[name]})" for name in refused])
        if isinstance(train_dataset, IterableDataset) or isinstance(eval_dataset, IterableDataset):
            raise ConfigError(["framework.hf.Trainer: an IterableDataset is not supported yet; pass a map-style "
                              "dataset, or use DDPTrainer, which streams IterableDatasets"])
        self.args = args if args is not None else TrainingArguments(output_dir="trainer_output")
        warned = arguments.check_fields(self.args)
        if warned:
            log.warning("TrainingArguments: %s set but not used by framework.hf.Trainer (they cannot change "
                        "the trained weights)", ", ".join(warned))
        self.model, self.processing_class = model, processing_class
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        self.data_collator = data_collator or _default_collator(processing_class)
        self.compute_loss_func = compute_loss_func
        self.callbacks = list(callbacks or [])
        self.optimizer, self.lr_scheduler = optimizers
        self.optimizer_cls_and_kwargs = optimizer_cls_and_kwargs
        self.state = TrainerState()
        self._engine: DDPTrainer | None = None
        if self.args.tf32 is not None and torch.cuda.is_available():
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = bool(self.args.tf32)

    # --- what transformers.Trainer offers ------------------------------------------------------

    def is_world_process_zero(self) -> bool:
        return process_group.read_env()[0] == 0

    def add_callback(self, callback) -> None:
        self.callbacks.append(callback() if isinstance(callback, type) else callback)

    def train(self, resume_from_checkpoint: bool | str | None = None, **kwargs):
        """Train; ``resume_from_checkpoint`` None starts afresh (a restart of this launch still
        continues its own checkpoints), True resumes the newest checkpoint in output_dir, a path
        resumes that checkpoint. Returns transformers' ``TrainOutput``."""
        from transformers.trainer_utils import TrainOutput

        if kwargs:
            raise ConfigError([f"framework.hf.Trainer.train: {', '.join(sorted(kwargs))} not supported"])
        resume = resume_from_checkpoint if resume_from_checkpoint is not None else self.args.resume_from_checkpoint
        engine, bridge = self._build(resume="auto" if resume is True else "none" if not resume else str(resume))
        try:
            summary = engine.train()
        finally:
            # The DDP wrapper holds the process group: dropped here (also when train raises, e.g.
            # PeerLost after a node loss), while the group lives. A script's own
            # destroy_process_group() may come next, and a DDP module freed after it hangs at
            # exit; else the group goes at exit's teardown, not in the interpreter's finalisation.
            engine.close(release_model=True)
            self._engine = engine = None
        self.state = bridge.state
        return TrainOutput(summary["steps"], bridge.run_loss / max(1, bridge.run_steps),
                           {"train_runtime": summary["wall_s"], "train_loss": summary["final_train_loss"],
                            "epoch": bridge.state.epoch})

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """The mean loss over the evaluation set (every rank gets the same value)."""
        from ..train.evaluation import validation_loss

        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if dataset is None:
            raise ConfigError(["framework.hf.Trainer.evaluate: no eval_dataset"])
        env = process_group.setup(arguments.ddp_backend(self.args), float(self.args.ddp_timeout))
        self.model.to(env.device)
        was_training = self.model.training
        self.model.eval()
        try:
            loss = validation_loss(self.model, self._collated(dataset), self._loss_fn(), limit=len(dataset),
                                   batch_size=self.args.per_device_eval_batch_size, rank=env.rank,
                                   world_size=env.world_size, device=env.device, autocast=self._autocast(env),
                                   distributed=env.distributed)
        finally:
            self.model.train(was_training)
        metrics = {f"{metric_key_prefix}_loss": loss, "epoch": self.state.epoch}
        self.state.log_history.append({**metrics, "step": self.state.global_step})
        return metrics

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Rank 0 writes the model with ``save_pretrained`` (a PEFT model: its adapters) into
        ``output_dir`` (default: args.output_dir), with the processing class; other ranks return."""
        if not self.is_world_process_zero():
            return
        target = Path(output_dir or self.args.output_dir or "trainer_output")
        target.mkdir(parents=True, exist_ok=True)
        if hasattr(self.model, "save_pretrained"):
            self.model.save_pretrained(str(target))
        else:
            from safetensors.torch import save_file

            tensors = {k: v.contiguous() for k, v in self.model.state_dict().items()}
            save_file(tensors, str(target / "model.safetensors"))
        if self.processing_class is not None and hasattr(self.processing_class, "save_pretrained"):
            self.processing_class.save_pretrained(str(target))
        log.info("model saved to %s", target)

    # --- the translation ------------------------------------------------------------------------

    def _autocast(self, env):
        dtype = torch.float16 if self.args.fp16 else torch.bfloat16
        return lambda: torch.autocast(env.device.type, dtype=dtype, enabled=bool(self.args.bf16 or self.args.fp16))

    def _columns(self) -> frozenset[str] | None:
        """The sample keys the batches keep (None: every key)."""
        return _model_columns(self.model, self.args.label_names) if self.args.remove_unused_columns else None

    def _collated(self, dataset) -> Collated:
        return Collated(dataset, self.data_collator, self._columns())

    def compute_loss(self, model, inputs, return_outputs: bool = False, num_items_in_batch=None):
        """The batch's loss, as transformers.Trainer computes it: the model's own (from the labels
        in ``inputs``), or ``compute_loss_func``'s. A subclass may override it (see
        REFUSED_OVERRIDES for what it may not)."""
        outputs = model(**inputs)
        if self.compute_loss_func is not None:
            loss = self.compute_loss_func(outputs, inputs["labels"], num_items_in_batch=num_items_in_batch)
        else:
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs[0]
        return (loss, outputs) if return_outputs else loss

    def _loss_fn(self) -> Callable | None:
        if _overridden(type(self), "compute_loss"):
            def subclass_loss(model, batch, model_kwargs):
                return self.compute_loss(model, dict(batch), return_outputs=False, num_items_in_batch=None)
            subclass_loss.calls_model = True
            return subclass_loss
        if self.compute_loss_func is None:
            return None  # the model's own loss, from the labels in the batch
        user = self.compute_loss_func
        return lambda outputs, batch: user(outputs, batch["labels"], num_items_in_batch=None)

    def _steps_per_epoch(self) -> int:
        sampler = ResumableDistributedSampler(len(self.train_dataset), process_group.read_env()[2], 0,
                                              self.args.per_device_train_batch_size,
                                              self.args.gradient_accumulation_steps)
        steps, per_step = sampler.steps_per_epoch, sampler.global_batch
        dropped = len(self.train_dataset) - steps * per_step
        if dropped:
            log.warning("the last %d samples of each epoch (less than one global batch of %d) are not trained: "
                        "every step takes full batches on every rank", dropped, per_step)
        if steps == 0:
            raise ConfigError([f"train_dataset: {len(self.train_dataset)} samples is less than one global batch "
                              f"({per_step}: per_device_train_batch_size x world size x gradient_accumulation_steps)"])
        return steps

    def create_optimizer(self) -> torch.optim.Optimizer:
        """``self.optimizer``, built as transformers.Trainer builds it unless given (a subclass may
        override it)."""
        if self.optimizer is None:
            self.optimizer = self._make_optimizer()
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None):
        """``self.lr_scheduler``, built by transformers' ``get_scheduler`` from the arguments unless
        given (a subclass may override it)."""
        from transformers import get_scheduler

        if self.lr_scheduler is None:
            self.lr_scheduler = get_scheduler(self.args.lr_scheduler_type, optimizer or self.optimizer,
                                              num_warmup_steps=self.args.get_warmup_steps(num_training_steps),
                                              num_training_steps=num_training_steps,
                                              scheduler_specific_kwargs=self.args.lr_scheduler_kwargs)
        return self.lr_scheduler

    def _make_optimizer(self) -> torch.optim.Optimizer:
        """The optimizer transformers.Trainer.create_optimizer builds: no weight decay on biases and norms."""
        from transformers import Trainer as HFTrainer

        cls, kwargs = self.optimizer_cls_and_kwargs or HFTrainer.get_optimizer_cls_and_kwargs(self.args, self.model)
        decay = set(HFTrainer.get_decay_parameter_names(None, self.model))
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        groups = [{"params": [p for n, p in named if n in decay], "weight_decay": self.args.weight_decay},
                  {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]
        return cls(groups, **kwargs)

    def _scheduler_factory(self, total: int) -> Callable[[torch.optim.Optimizer], Any]:
        return lambda optimizer: self.create_scheduler(total, optimizer)

    def _keep_the_runs_length(self, engine: DDPTrainer, bridge: HFCallbacks, steps_per_epoch: int,
                              total: int, built_scheduler: bool) -> None:
        """A run resumed at another world size keeps its global batch, so its epochs have the
        run's number of steps, not this world size's: HF's counts and the schedule's horizon
        follow the engine's (transformers.Trainer recounts them at the new size)."""
        run_steps, run_total = engine.sampler.steps_per_epoch, engine.total_steps
        if (run_steps, run_total) == (steps_per_epoch, total):
            return
        log.warning("the run's global batch is %d samples (%d steps an epoch, %d steps in all), not this world "
                    "size's %d steps an epoch: HF's epochs, max_steps and learning-rate schedule stay the run's",
                    engine.sampler.global_batch, run_steps, run_total, steps_per_epoch)
        bridge.set_run_length(run_steps, run_total)
        scheduler = self.lr_scheduler
        if not built_scheduler or not hasattr(scheduler, "lr_lambdas"):
            log.warning("the learning-rate scheduler was given: its horizon is left as built")
            return
        for rate in scheduler.lr_lambdas:  # transformers' schedules: partials of the horizon
            keywords = getattr(rate, "keywords", None)
            if keywords is not None and "num_training_steps" in keywords:
                keywords["num_training_steps"] = run_total
            if keywords is not None and "num_warmup_steps" in keywords:
                keywords["num_warmup_steps"] = self.args.get_warmup_steps(run_total)
        for group, base, rate in zip(self.optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas,
                                     strict=True):
            group["lr"] = base * rate(scheduler.last_epoch)
        scheduler._last_lr = [group["lr"] for group in self.optimizer.param_groups]

    def _agreed_config(self, config: dict) -> dict:
        """Rank 0's configuration on every rank: arguments that differ between ranks (a script's
        ``save_strategy="steps" if is_main else "no"``) would have only some ranks enter a
        checkpoint's collectives. The differences are named once, by rank 0."""
        import torch.distributed as dist

        from ..config import dotted

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            return config
        configs: list = [None] * dist.get_world_size()
        dist.all_gather_object(configs, config)
        ours = dotted(configs[0])
        differ = sorted({f"{key} ({ours.get(key)!r} on rank 0, {value!r} on rank {rank})"
                         for rank, other in enumerate(configs[1:], 1) for key, value in dotted(other).items()
                         if ours.get(key) != value})
        if differ and dist.get_rank() == 0:
            log.warning("the TrainingArguments differ between ranks: %s; every rank uses rank 0's",
                        "; ".join(differ))
        return configs[0]

    def _build(self, *, resume: str) -> tuple[DDPTrainer, HFCallbacks]:
        if self.train_dataset is None:
            raise ConfigError(["framework.hf.Trainer.train: no train_dataset"])
        steps_per_epoch = self._steps_per_epoch()
        config = self._agreed_config(arguments.to_config(self.args, steps_per_epoch=steps_per_epoch, resume=resume))
        total = arguments.total_steps(self.args, steps_per_epoch)
        # transformers.Trainer averages over tokens when the batches have labels and the model takes
        # num_items_in_batch (or a compute_loss_func is given); across devices, unless
        # average_tokens_across_devices=False.
        first = self._collated(self.train_dataset)[0]
        if (isinstance(first, dict) and "labels" in first
                and (accepts_loss_kwargs(self.model) or self.compute_loss_func is not None)):
            config["train"]["loss_average"] = "tokens" if self.args.average_tokens_across_devices else "rank_tokens"
        if self.args.ddp_find_unused_parameters is None and hf_model_in(self.model) is not self.model:
            log.info("ddp_find_unused_parameters unset: transformers.Trainer would turn it on for %s (not a "
                     "PreTrainedModel), which fails with reentrant checkpointing; the framework's DDP policy "
                     "chooses instead", type(self.model).__name__)
        bridge = HFCallbacks(self.callbacks, self.args, steps_per_epoch=steps_per_epoch, max_steps=total,
                             logging_interval=config["logging"]["interval"],
                             logging_first_step=bool(self.args.logging_first_step),
                             components={"processing_class": self.processing_class})
        optimizer = self.create_optimizer()
        built_scheduler = self.lr_scheduler is None
        use_eval = self.eval_dataset is not None and config["eval"]["interval"] > 0
        self._engine = DDPTrainer(config, model=self.model, train_dataset=self._collated(self.train_dataset),
                                  val_dataset=self._collated(self.eval_dataset) if use_eval else None,
                                  loss_fn=self._loss_fn(), optimizer=optimizer,
                                  lr_scheduler=self._scheduler_factory(total), callbacks=[bridge])
        bridge.components["lr_scheduler"] = self.lr_scheduler
        self._keep_the_runs_length(self._engine, bridge, steps_per_epoch, total, built_scheduler)
        return self._engine, bridge
