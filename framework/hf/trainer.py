"""``framework.hf.Trainer``: transformers.Trainer's constructor and methods, trained by DDPTrainer.

A script written for ``transformers.Trainer`` changes one import. The TrainingArguments are
translated field by field (framework/hf/arguments.py); the optimizer and learning-rate schedule
are the ones transformers.Trainer would build from them (its own ``get_optimizer_cls_and_kwargs``
and ``get_scheduler``); HF callbacks get their events (framework/hf/callbacks.py), and ``report_to``'s integrations
(TensorBoard, W&B, ...) run on rank 0. ``compute_metrics`` sees the whole evaluation set, gathered
from every rank's shard; ``load_best_model_at_end`` keeps the best weights aside in
``output_dir/best_model``. A transformers ``checkpoint-N`` folder resumes at step N. DDP settings
come from the framework's policy, and checkpoints, restarts, preemption and run health from
DDPTrainer."""

from __future__ import annotations

import inspect
import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.utils.data import Dataset, IterableDataset

from ..config.schema import ConfigError
from ..data.batches import fetch, num_samples, to_device
from ..data.sampler import ResumableDistributedSampler, eval_indices
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
# mean by its labelled tokens), create_optimizer, create_scheduler and prediction_step. Refused, with one line each:
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


# --- predictions gathered from every rank's shard ---------------------------------------------------

def _to_cpu(value):
    """A batch's logits or labels (a tensor, or a tuple/list/dict of them) detached on the CPU."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    return value


def _concat(parts: list):
    """``parts`` (one per batch) joined along the first dimension, as transformers' ``nested_concat``
    joins them: tensors of different lengths past the first dimension are padded with -100."""
    first = parts[0]
    if isinstance(first, torch.Tensor):
        parts = [p.reshape(1) if p.dim() == 0 else p for p in parts]
        if all(p.shape[1:] == parts[0].shape[1:] for p in parts):
            return torch.cat(parts)
        shape = [max(p.shape[d] for p in parts) for d in range(1, parts[0].dim())]
        out = parts[0].new_full((sum(len(p) for p in parts), *shape), -100)
        row = 0
        for p in parts:
            out[(slice(row, row + len(p)), *(slice(0, n) for n in p.shape[1:]))] = p
            row += len(p)
        return out
    if isinstance(first, dict):
        return {k: _concat([p[k] for p in parts]) for k in first}
    if isinstance(first, (list, tuple)):
        return type(first)(_concat([p[i] for p in parts]) for i in range(len(first)))
    return first


def _rows(value, order: torch.Tensor):
    """``value``'s samples in ``order`` (a per-batch output, of another length, is left as it is)."""
    if isinstance(value, torch.Tensor):
        return value[order] if len(value) == len(order) else value
    if isinstance(value, dict):
        return {k: _rows(v, order) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_rows(v, order) for v in value)
    return value


def merge_shards(shards: list[tuple[list[int], Any, Any]]) -> tuple[Any, Any]:
    """Every rank's ``(sample indices, predictions, labels)`` as the whole evaluation set's
    ``(predictions, labels)``, in the dataset's order (each rank holds a strided shard; a rank
    with no samples, or no labels, adds none)."""
    def field(k: int):
        held = [s for s in shards if s[k] is not None and len(s[0])]
        if not held:
            return None
        order = torch.argsort(torch.tensor([i for s in held for i in s[0]]))
        return _rows(_concat([s[k] for s in held]), order)
    return field(1), field(2)


def _numpy(value):
    """transformers' ``nested_numpify``: bf16 goes to float32."""
    if isinstance(value, torch.Tensor):
        return (value.float() if value.dtype == torch.bfloat16 else value).numpy()
    if isinstance(value, dict):
        return {k: _numpy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_numpy(v) for v in value)
    return value


def _gather(obj, env, *, everyone: bool) -> list | None:
    """Every rank's ``obj``, on rank 0 (``everyone``: on every rank); None on the others."""
    if not env.distributed:
        return [obj]
    out = [None] * env.world_size
    if everyone:
        dist.all_gather_object(out, obj)
        return out
    dist.gather_object(obj, out if env.rank == 0 else None, dst=0)
    return out if env.rank == 0 else None


def from_rank0(compute: Callable[[], Any], *, rank: int, distributed: bool, what: str, share: bool = True):
    """``compute()`` run on rank 0 alone; its result on every rank (only on rank 0 unless
    ``share``). A failure there raises on every rank, so that none waits for what never comes:
    rank 0 its own error, the others a ConfigError with its lines, or a RuntimeError naming
    ``what``."""
    result = error = failure = None
    if rank == 0:
        try:
            result = compute()
        except Exception as err:  # noqa: BLE001  (the others raise with it, not wait for it)
            error = err
            failure = err.problems if isinstance(err, ConfigError) else f"{type(err).__name__}: {err}"
    if distributed:
        box = [result if share else None, failure]
        dist.broadcast_object_list(box, src=0)
        if rank != 0:
            result, failure = box
    if error is not None:
        raise error
    if isinstance(failure, list):
        raise ConfigError(failure)
    if failure is not None:
        raise RuntimeError(f"{what} failed on rank 0: {failure}")
    return result


# --- transformers checkpoints ------------------------------------------------------------------------

_ADAPTER_FILES = ("adapter_model.safetensors", "adapter_model.bin")
_MODEL_FILES = ("model.safetensors", "pytorch_model.bin")
_INDEX_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def _read_tensors(path: Path) -> dict:
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    return torch.load(path, map_location="cpu", weights_only=True)


def is_transformers_checkpoint(path) -> bool:
    """Whether ``path`` is a folder written by transformers (a ``checkpoint-N`` of Trainer, or
    ``save_pretrained``'s): one holding trainer_state.json or model/adapter weights."""
    folder = Path(path)
    return folder.is_dir() and any((folder / name).is_file() for name in
                                   ("trainer_state.json", *_ADAPTER_FILES, *_MODEL_FILES, *_INDEX_FILES))


def load_weights(model: torch.nn.Module, folder) -> None:
    """The weights in a transformers folder (a PEFT model's adapters, or a model's safetensors or
    bin files, sharded or not) copied into ``model`` in place (an optimizer's parameters stay its own)."""
    folder = Path(folder)
    adapter = next((folder / n for n in _ADAPTER_FILES if (folder / n).is_file()), None)
    if adapter is not None and hasattr(model, "peft_config"):
        from peft import set_peft_model_state_dict

        result = set_peft_model_state_dict(model, _read_tensors(adapter), adapter_name=model.active_adapter)
        unexpected = list(getattr(result, "unexpected_keys", []))
        if unexpected:
            raise ConfigError([f"{adapter}: {len(unexpected)} tensors this model's adapter does not have, e.g. "
                               f"{unexpected[:3]}"])
        return
    index = next((folder / n for n in _INDEX_FILES if (folder / n).is_file()), None)
    single = next((folder / n for n in _MODEL_FILES if (folder / n).is_file()), None)
    if index is not None:
        state = {}
        for name in sorted(set(json.loads(index.read_text())["weight_map"].values())):
            state.update(_read_tensors(folder / name))
    elif single is not None:
        state = _read_tensors(single)
    else:
        raise ConfigError([f"{folder}: no weights ({', '.join(_ADAPTER_FILES + _MODEL_FILES + _INDEX_FILES)}) "
                           f"{'for this model (not a PEFT model)' if adapter is not None else ''}"])
    result = model.load_state_dict(state, strict=False)  # save_pretrained writes tied weights once
    if result.unexpected_keys:
        raise ConfigError([f"{folder}: {len(result.unexpected_keys)} tensors this model does not have, e.g. "
                           f"{result.unexpected_keys[:3]}"])
    if result.missing_keys:
        log.warning("%s: %d of the model's tensors are not in the checkpoint (tied weights are saved once): %s",
                    folder, len(result.missing_keys), result.missing_keys[:5])


def _note_rng_state(folder: Path) -> None:
    """One line on a transformers checkpoint's ``rng_state*.pth``: read (as weights only) but not
    applied, since the framework seeds every step's generators from (seed, rank, step)."""
    files = sorted(folder.glob("rng_state*.pth"))
    if not files:
        return
    try:
        for path in files:
            torch.load(path, weights_only=True, map_location="cpu")
        how = "read"
    except Exception as err:  # noqa: BLE001  (its numpy state, never unpickled beyond weights_only; a damaged
        # file: the framework does not use it, so it never stops the resume)
        how = f"present (not readable as weights only: {type(err).__name__})"
    log.info("%s: %s, and superseded: the framework seeds every step's generators from (seed, rank, step), so "
             "the steps from here draw what an uninterrupted run draws, whatever RNG state was saved",
             ", ".join(p.name for p in files), how)


class Trainer:
    """transformers.Trainer's interface (see the module docstring and docs/huggingface.md).
    ``model_init`` is not supported."""

    def __init__(self, model: torch.nn.Module | None = None, args=None, data_collator: Callable | None = None,
                 train_dataset=None, eval_dataset=None, processing_class=None, model_init=None,
                 compute_loss_func: Callable | None = None, compute_metrics=None, callbacks: list | None = None,
                 optimizers: tuple = (None, None), optimizer_cls_and_kwargs: tuple | None = None,
                 preprocess_logits_for_metrics=None, framework_config=None):
        from transformers import TrainingArguments
        from transformers.trainer_callback import TrainerControl, TrainerState

        if model_init is not None:
            raise ConfigError(["framework.hf.Trainer: model_init not supported (pass model)"])
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
        self.compute_metrics, self.preprocess_logits_for_metrics = compute_metrics, preprocess_logits_for_metrics
        self.callbacks = list(callbacks or [])
        self.optimizer, self.lr_scheduler = optimizers
        self.optimizer_cls_and_kwargs = optimizer_cls_and_kwargs
        # the framework's settings that TrainingArguments has no field for: a .toml/.json path or a dict
        self.framework_config = framework_config
        if framework_config is not None:  # its unknown keys and bad values, now
            arguments.with_framework_config(arguments.to_config(self.args, steps_per_epoch=1, resume="auto"),
                                            framework_config)
        self.state, self.control = TrainerState(), TrainerControl()
        self.reporters = self._reporting_callbacks()
        self._ignore_keys_for_eval: list[str] | None = None
        self._engine: DDPTrainer | None = None
        if self.args.tf32 is not None and torch.cuda.is_available():
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = bool(self.args.tf32)

    # --- what transformers.Trainer offers ------------------------------------------------------

    def is_world_process_zero(self) -> bool:
        return process_group.read_env()[0] == 0

    def add_callback(self, callback) -> None:
        self.callbacks.append(callback() if isinstance(callback, type) else callback)

    def train(self, resume_from_checkpoint: bool | str | None = None, trial=None,
              ignore_keys_for_eval: list[str] | None = None, **kwargs):
        """Train; ``resume_from_checkpoint`` None starts afresh (a restart of this launch still
        continues its own checkpoints), True resumes the newest checkpoint in output_dir (the
        framework's, else the newest transformers ``checkpoint-N``), a path resumes that checkpoint
        (a framework checkpoint file, or a transformers ``checkpoint-N`` folder). Returns
        transformers' ``TrainOutput``."""
        from transformers.trainer_utils import TrainOutput

        if trial is not None:
            kwargs["trial"] = trial
        if kwargs:
            raise ConfigError([f"framework.hf.Trainer.train: {', '.join(sorted(kwargs))} not supported"])
        self._ignore_keys_for_eval = ignore_keys_for_eval
        resume = resume_from_checkpoint if resume_from_checkpoint is not None else self.args.resume_from_checkpoint
        transformers_checkpoint = self._transformers_checkpoint(resume)
        if transformers_checkpoint is not None:
            load_weights(self.model, transformers_checkpoint)  # a restart's own checkpoint replaces them
            resume = None
        engine, bridge = self._build(resume="auto" if resume is True else "none" if not resume else str(resume))
        if transformers_checkpoint is not None and engine.step == 0:
            self._continue_from(transformers_checkpoint, engine, bridge)
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
        if self.args.load_best_model_at_end and not summary["preempted"]:
            self._load_best_model()
        return TrainOutput(summary["steps"], bridge.run_loss / max(1, bridge.run_steps),
                           {"train_runtime": summary["wall_s"], "train_loss": summary["final_train_loss"],
                            "epoch": bridge.state.epoch})

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """transformers.Trainer.evaluate's dict: ``<prefix>_loss``, ``compute_metrics``' results
        (``<prefix>_<name>``) over the whole set, the speed metrics and ``epoch`` (once trained), the
        same on every rank; logged, and given to the callbacks' ``on_evaluate``."""
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if dataset is None:
            raise ConfigError(["framework.hf.Trainer.evaluate: no eval_dataset"])
        env = self._env()
        output = self._predict(self.model, dataset, env, ignore_keys=ignore_keys, prefix=metric_key_prefix,
                               loss_only=self.compute_metrics is None, everyone=False)
        metrics = output.metrics
        if self.state.epoch is not None:
            metrics["epoch"] = self.state.epoch
        self._event("on_log", env, logs=metrics)
        self.state.log_history.append({**metrics, "step": self.state.global_step})
        self._event("on_evaluate", env, metrics=metrics)
        return metrics

    def predict(self, test_dataset, ignore_keys: list[str] | None = None, metric_key_prefix: str = "test"):
        """transformers' ``PredictionOutput(predictions, label_ids, metrics)`` for the whole of
        ``test_dataset``, in its order, on every rank (gathered from every rank's shard)."""
        env = self._env()
        output = self._predict(self.model, test_dataset, env, ignore_keys=ignore_keys, prefix=metric_key_prefix,
                               loss_only=False, everyone=True)
        self._event("on_predict", env, metrics=output.metrics)
        return output

    def prediction_step(self, model, inputs: dict, prediction_loss_only: bool, ignore_keys: list[str] | None = None):
        """transformers.Trainer.prediction_step: ``(loss, logits, labels)`` of one batch (the loss
        from ``compute_loss`` when the batch has its labels). A subclass may override it."""
        names = self._label_names()
        has_labels = bool(names) and all(inputs.get(k) is not None for k in names)
        if ignore_keys is None:
            config = getattr(hf_model_in(model) or model, "config", None)
            ignore_keys = list(getattr(config, "keys_to_ignore_at_inference", None) or [])
        labels = None
        if has_labels:
            labels = tuple(inputs[k].detach() for k in names)
            labels = labels[0] if len(labels) == 1 else labels
        with torch.no_grad():
            if has_labels:
                loss, outputs = self.compute_loss(model, inputs, return_outputs=True)
                loss = loss.detach().mean()
            else:
                loss, outputs = None, model(**inputs)
        if prediction_loss_only:
            return loss, None, None
        if isinstance(outputs, dict):
            logits = tuple(v for k, v in outputs.items() if k not in [*ignore_keys, "loss"])
        else:
            logits = tuple(outputs[1:] if has_labels else outputs)
        logits = tuple(v.detach() if isinstance(v, torch.Tensor) else v for v in logits)
        return loss, logits[0] if len(logits) == 1 else logits, labels

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

    # --- evaluation, predictions and metrics -----------------------------------------------------

    def _env(self):
        env = process_group.setup(arguments.ddp_backend(self.args), float(self.args.ddp_timeout))
        self.model.to(env.device)
        return env

    def _label_names(self) -> list[str]:
        from transformers.utils import find_labels

        if self.args.label_names is not None:
            return list(self.args.label_names)
        return find_labels(type(hf_model_in(self.model) or self.model)) or ["labels"]

    def _event(self, name: str, env, **kwargs) -> None:
        """A callback event outside training (evaluate, predict): the reporters' and the user's."""
        self.state.is_world_process_zero = env.rank == 0
        self.state.is_local_process_zero = env.local_rank == 0
        for cb in [*self.reporters, *self.callbacks]:
            result = getattr(cb, name)(self.args, self.state, self.control, model=self.model,
                                       processing_class=self.processing_class, **kwargs)
            if result is not None:
                self.control = result

    def _predict(self, model, dataset, env, *, ignore_keys, prefix: str, loss_only: bool, everyone: bool):
        """One pass over ``dataset`` (each rank its strided shard, per_device_eval_batch_size at a
        time): the mean loss, exact for any world size, and unless ``loss_only`` the predictions
        and labels (``preprocess_logits_for_metrics`` applied per batch) gathered on rank 0 (or
        on ``everyone``) in the dataset's order, with ``compute_metrics``' results, computed on
        rank 0 and the same on every rank. Returns a ``PredictionOutput`` (numpy arrays)."""
        from transformers.trainer_utils import PredictionOutput, speed_metrics

        start = time.time()
        collated, size = self._collated(dataset), len(dataset)
        mine = eval_indices(size, size, env.world_size, env.rank)
        batch_size = self.args.per_device_eval_batch_size
        sums = torch.zeros(2, dtype=torch.float64, device=env.device)
        preds, labels = [], []
        autocast = self._autocast(env)
        was_training = model.training
        model.eval()
        try:
            for lo in range(0, len(mine), batch_size):
                batch = to_device(fetch(collated, mine[lo:lo + batch_size]), env.device)
                with autocast():
                    loss, logits, label = self.prediction_step(model, dict(batch), loss_only, ignore_keys)
                if loss is not None:
                    count = num_samples(batch)
                    sums += torch.stack([loss.double() * count, torch.tensor(count, dtype=torch.float64,
                                                                                 device=env.device)])
                if logits is not None and self.preprocess_logits_for_metrics is not None:
                    logits = self.preprocess_logits_for_metrics(logits, label)
                if logits is not None:
                    preds.append(_to_cpu(logits))
                if label is not None:
                    labels.append(_to_cpu(label))
        finally:
            model.train(was_training)
        if env.distributed:
            dist.all_reduce(sums)
        total, count = sums.tolist()
        all_preds = all_labels = None
        if not loss_only:
            shards = _gather((mine, _concat(preds) if preds else None, _concat(labels) if labels else None), env,
                             everyone=everyone)
            if shards is not None:
                all_preds, all_labels = (_numpy(x) for x in merge_shards(shards))

        metrics = {} if loss_only else from_rank0(lambda: self._computed_metrics(all_preds, all_labels), rank=env.rank,
                                                 distributed=env.distributed, what="compute_metrics")
        if count:
            metrics["loss"] = total / count
        metrics = {k if k.startswith(f"{prefix}_") else f"{prefix}_{k}": v for k, v in metrics.items()}
        per_step = batch_size * env.world_size
        metrics.update(speed_metrics(prefix, start, num_samples=size, num_steps=-(-size // per_step)))
        return PredictionOutput(predictions=all_preds, label_ids=all_labels, metrics=metrics)

    def _computed_metrics(self, predictions, label_ids) -> dict:
        """``compute_metrics`` on the whole set (rank 0 calls it), or nothing."""
        from transformers.trainer_utils import EvalPrediction, denumpify_detensorize

        if self.compute_metrics is None or predictions is None or label_ids is None:
            return {}
        prediction = EvalPrediction(predictions=predictions, label_ids=label_ids)
        if self.args.batch_eval_metrics:  # a batch-wise function, given the whole set as its one batch
            return denumpify_detensorize(self.compute_metrics(prediction, compute_result=True))
        return denumpify_detensorize(self.compute_metrics(prediction))

    def _metrics_at_evaluation(self, engine: DDPTrainer) -> dict:
        """``compute_metrics``' results at an evaluation during training (every rank, the same step):
        a prediction pass over eval_dataset with the unwrapped model."""
        output = self._predict(engine.raw_model, self.eval_dataset, engine.env, ignore_keys=self._ignore_keys_for_eval,
                               prefix="eval", loss_only=False, everyone=False)
        return {k: v for k, v in output.metrics.items()
                if k not in ("eval_loss", "eval_runtime", "eval_samples_per_second", "eval_steps_per_second")}

    def _reporting_callbacks(self) -> list:
        """transformers' integration callbacks for ``report_to`` (rank 0 only); one that cannot be
        made here (its package is not installed) is named in one warning and left out."""
        from transformers.integrations import get_reporting_integration_callbacks

        if not self.is_world_process_zero():
            return []
        made, missing = [], []
        for cls in get_reporting_integration_callbacks(self.args.report_to):
            try:
                made.append(cls())
            except (ImportError, RuntimeError) as err:
                missing.append(f"{cls.__name__} ({err})")
        if missing:
            log.warning("report_to: %s not available here: left out", "; ".join(missing))
        return made

    # --- the best model ---------------------------------------------------------------------------

    def _best_dir(self) -> Path:
        return Path(self.args.output_dir or "trainer_output") / "best_model"

    def _keep_best(self, engine: DDPTrainer, step: int) -> str:
        """Rank 0 writes the new best step's weights with ``save_pretrained`` into output_dir/best_model
        (beside, not among, the framework's checkpoints, so checkpoint.keep_last never prunes them)."""
        target = self._best_dir()
        if engine.env.is_main:
            staging = target.with_name(target.name + ".tmp")
            shutil.rmtree(staging, ignore_errors=True)
            self.save_model(str(staging))
            (staging / "best_step.json").write_text(json.dumps({"step": step}))
            shutil.rmtree(target, ignore_errors=True)
            staging.rename(target)
            log.info("step %d is the best so far (%s): its weights are in %s", step, self.args.metric_for_best_model,
                     target)
        return str(target)

    def _load_best_model(self) -> None:
        """transformers.Trainer's ``load_best_model_at_end``: every rank loads the best step's weights."""
        best = self.state.best_model_checkpoint
        if best is None or not Path(best).is_dir():
            log.warning("load_best_model_at_end: no best model was recorded (%s): the model is the last step's",
                        best or "no evaluation with metric_for_best_model")
            return
        record = Path(best) / "best_step.json"
        if record.is_file() and json.loads(record.read_text())["step"] != self.state.best_global_step:
            log.warning("load_best_model_at_end: %s holds step %s, the state's best is step %s", best,
                        json.loads(record.read_text())["step"], self.state.best_global_step)
        load_weights(self.model, best)
        log.info("loaded the best model, of step %s (%s=%s), from %s", self.state.best_global_step,
                 self.args.metric_for_best_model, self.state.best_metric, best)

    # --- a transformers checkpoint ------------------------------------------------------------------

    def _transformers_checkpoint(self, resume) -> Path | None:
        """The transformers ``checkpoint-N`` folder to resume from: ``resume`` itself, or for True the
        newest in output_dir when the framework has no checkpoint there."""
        from transformers.trainer_utils import get_last_checkpoint

        out = Path(self.args.output_dir or "trainer_output")
        if isinstance(resume, (str, Path)) and not isinstance(resume, bool) and is_transformers_checkpoint(resume):
            return Path(resume)
        if resume is True and out.is_dir() and not any((out / "checkpoints").glob("step_*.pt")):
            last = get_last_checkpoint(str(out))
            return Path(last) if last is not None else None
        return None

    def _continue_from(self, folder: Path, engine: DDPTrainer, bridge: HFCallbacks) -> None:
        """The rest of a transformers checkpoint, its weights loaded already: the optimizer and
        scheduler, the TrainerState (global_step, log history, best metric), and the engine placed
        at its step N, N global batches into the run's data order (the framework's order: not the
        one transformers' sampler would have continued)."""
        from transformers.trainer_callback import TrainerState

        state_file = folder / "trainer_state.json"
        if state_file.is_file():
            saved = TrainerState.load_from_json(str(state_file))
        else:
            saved = TrainerState(global_step=int(folder.name.rsplit("-", 1)[-1]))
        step = int(saved.global_step)
        parts = []
        if (folder / "optimizer.pt").is_file():
            try:
                state = torch.load(folder / "optimizer.pt", weights_only=True, map_location="cpu")
                engine.optimizer.load_state_dict(state)
            except ValueError as err:
                raise ConfigError([f"{folder}/optimizer.pt does not fit this optimizer ({err}): build the optimizer "
                                   "as the checkpoint's run did"]) from err
            parts.append("optimizer")
        if (folder / "scheduler.pt").is_file() and self.lr_scheduler is not None:
            state = torch.load(folder / "scheduler.pt", weights_only=True, map_location="cpu")
            self.lr_scheduler.load_state_dict(state)
            parts.append("scheduler")
        sampler = engine.sampler
        sampler.load_state_dict({"epoch": step // sampler.steps_per_epoch,
                                 "consumed": step % sampler.steps_per_epoch * sampler.global_batch})
        engine.step = step
        bridge.adopt(saved)
        log.info("resumed the transformers checkpoint %s at step %d: weights, %s and its TrainerState; the data "
                 "continue %d global batches into the framework's sample order (not transformers')", folder, step,
                 ", ".join(parts) or "no optimizer", step)
        _note_rng_state(folder)

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
        run's number of steps, not this world size's: HF's counts, a fraction of an epoch, the
        ``epoch`` intervals and the schedule's horizon follow the run's epochs (transformers.Trainer
        recounts them at the new size)."""
        run_steps = engine.sampler.steps_per_epoch
        if (run_steps, engine.total_steps) == (steps_per_epoch, total):
            return
        if run_steps != steps_per_epoch:
            self._recount(engine, bridge, run_steps)
        run_total = engine.total_steps
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

    def _recount(self, engine: DDPTrainer, bridge: HFCallbacks, run_steps: int) -> None:
        """The run's length and intervals counted in its epochs of ``run_steps`` steps, as the
        checkpoint's world size counted them."""
        def counts() -> tuple[int, dict[str, int]]:
            every = arguments.intervals(self.args, run_steps, arguments.total_steps(self.args, run_steps))
            return arguments.run_length(self.args, run_steps)["max_steps"], every

        # Rank 0's arguments, as _agreed_config made them the run's: a script's per-rank
        # save_strategy or eval_strategy must not give the ranks different schedules.
        max_steps, every = from_rank0(counts, rank=engine.env.rank, distributed=engine.env.distributed,
                                      what="counting the run's length")
        engine.recount(max_steps=max_steps, eval_interval=every["eval"])
        logging_interval = every["logging"] or engine.total_steps or 1
        engine.config.logging.interval = bridge.logging_interval = bridge.state.logging_steps = logging_interval
        if engine.config.checkpoint.every_steps:  # save_strategy="steps"
            engine.config.checkpoint.every_steps = every["save"]

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
        config = arguments.to_config(self.args, steps_per_epoch=steps_per_epoch, resume=resume)
        total = arguments.total_steps(self.args, steps_per_epoch)
        # transformers.Trainer averages over tokens when the batches have labels and the model takes
        # num_items_in_batch (or a compute_loss_func is given); across devices, unless
        # average_tokens_across_devices=False.
        first = self._collated(self.train_dataset)[0]
        if (isinstance(first, dict) and "labels" in first
                and (accepts_loss_kwargs(self.model) or self.compute_loss_func is not None)):
            config["train"]["loss_average"] = "tokens" if self.args.average_tokens_across_devices else "rank_tokens"
        if self.framework_config is not None:
            config = arguments.with_framework_config(config, self.framework_config)
        config = self._agreed_config(config)
        if self.args.ddp_find_unused_parameters is None and hf_model_in(self.model) is not self.model:
            log.info("ddp_find_unused_parameters unset: transformers.Trainer would turn it on for %s (not a "
                     "PreTrainedModel), which fails with reentrant checkpointing; the framework's DDP policy "
                     "chooses instead", type(self.model).__name__)
        use_eval = self.eval_dataset is not None and config["eval"]["interval"] > 0
        if self.args.load_best_model_at_end and not use_eval:
            raise ConfigError(["TrainingArguments.load_best_model_at_end=True: needs an eval_dataset and an "
                               "eval_strategy (the best model is chosen at the evaluations)"])
        bridge = HFCallbacks([*self.reporters, *self.callbacks], self.args, steps_per_epoch=steps_per_epoch,
                             max_steps=total, logging_interval=config["logging"]["interval"],
                             logging_first_step=bool(self.args.logging_first_step),
                             components={"processing_class": self.processing_class},
                             metrics=self._metrics_at_evaluation if self.compute_metrics is not None else None,
                             keep_best=self._keep_best if self.args.load_best_model_at_end else None)
        optimizer = self.create_optimizer()
        built_scheduler = self.lr_scheduler is None
        self._engine = DDPTrainer(config, model=self.model, train_dataset=self._collated(self.train_dataset),
                                  val_dataset=self._collated(self.eval_dataset) if use_eval else None,
                                  loss_fn=self._loss_fn(), optimizer=optimizer,
                                  lr_scheduler=self._scheduler_factory(total), callbacks=[bridge])
        bridge.components["lr_scheduler"] = self.lr_scheduler
        self._keep_the_runs_length(self._engine, bridge, steps_per_epoch, total, built_scheduler)
        return self._engine, bridge
