"""DDPTrainer: composes config, distributed setup, model, data, optimizer and metrics into a run."""

from __future__ import annotations

import contextlib
import itertools
import dataclasses
import json
import logging
import math
import os
import random
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from . import __version__, ddp_policy, distributed
from .activation import apply_checkpointing
from .checkpoint import atomic_torch_save, atomic_write_bytes, model_sha256, unwrap
from .config import TrainConfig, as_dict, resolve_config
from .control import agree
from .data import (ResumableDistributedSampler, build_datasets, eval_indices, fetch, make_loader,
                   workers_per_rank)
from .logs import setup_logging
from .memory import GcPolicy, in_use_gb, memory_stats
from .metrics import Metrics
from .model import GPT, GPTConfig, lm_loss
from .optim import build_optimizer, lr_at

log = logging.getLogger(__name__)


class DDPTrainer:
    """Train the built-in GPT, or a user's ``model`` on ``train_dataset`` with ``loss_fn``, on
    1..N processes. ``config`` is a dict, a TrainConfig or None (defaults). ``rank`` and
    ``world_size`` default to torchrun's environment, or to a single process without it.

    A user's dataset yields ``(inputs, targets)``; ``loss_fn(model(inputs), targets)`` returns
    the mean loss of the batch. ``doctor=True`` only runs the DDP preflight (``report`` and
    ``decision``) and does not wrap the model.
    """

    def __init__(self, config: TrainConfig | dict | None = None, *, rank: int | None = None,
                 world_size: int | None = None, model: torch.nn.Module | None = None,
                 train_dataset=None, val_dataset=None,
                 loss_fn: Callable[[Any, Any], torch.Tensor] | None = None, debug: bool = False,
                 doctor: bool = False):
        cfg = resolve_config(config)
        self._owns_process_group = not dist.is_initialized()
        self.log_path = setup_logging(distributed.read_env(rank, world_size)[0], cfg.log_dir, debug=debug)
        self.env = distributed.setup(cfg.backend, cfg.timeout_s, rank=rank, world_size=world_size)
        env = self.env
        if cfg.deterministic:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)
            torch.backends.cudnn.benchmark = False

        if train_dataset is None:
            bundle = build_datasets(cfg)
            train_dataset, val_dataset = bundle.train, bundle.val
            if bundle.vocab_size != cfg.vocab_size:
                log.info("vocab_size set to %d from the data", bundle.vocab_size)
                cfg = dataclasses.replace(cfg, vocab_size=bundle.vocab_size)
            log.info("data: %s", bundle.description)
            if bundle.loss_floor is not None and cfg.target_loss and cfg.target_loss < bundle.loss_floor:
                log.warning("target_loss=%g is below this data's loss floor %.4f: it cannot stop the run",
                            cfg.target_loss, bundle.loss_floor)
        self.cfg = cfg
        self.train_dataset, self.val_dataset = train_dataset, val_dataset

        torch.manual_seed(cfg.seed)
        if model is None:
            model = GPT(GPTConfig.from_train_config(cfg))
        elif cfg.tiled_mlp_chunks:
            log.warning("tiled_mlp_chunks applies to the built-in model only; use framework.activation.tiled_mlp "
                        "in your model's MLP")
        self.raw_model = model.to(env.device)
        targets = [t.strip() for t in cfg.checkpoint_modules.split(",") if t.strip()]
        self.checkpointed, self.offload_stats = apply_checkpointing(self.raw_model, cfg.gradient_checkpointing,
                                                                    targets)
        self.loss_fn = loss_fn or lm_loss
        # Model init used the shared seed; dropout and everything after draw per-rank streams.
        seed_everything(cfg.seed + 1 + env.rank)

        self.amp = cfg.use_amp == "true" or (cfg.use_amp == "auto" and env.device.type == "cuda")
        self.amp_dtype = torch.bfloat16 if cfg.amp_dtype == "bf16" else torch.float16
        self.scaler = torch.amp.GradScaler(env.device.type, enabled=self.amp and self.amp_dtype == torch.float16)
        self.optimizer = build_optimizer(self.raw_model, lr=cfg.learning_rate, weight_decay=cfg.weight_decay,
                                         betas=(cfg.beta1, cfg.beta2))

        self.sampler = ResumableDistributedSampler(len(train_dataset), env.world_size, env.rank, cfg.batch_size,
                                                   cfg.gradient_accumulation_steps, cfg.seed)
        if self.sampler.steps_per_epoch == 0:
            raise ValueError(f"dataset_size: {len(train_dataset)} training samples are fewer than one global "
                             f"batch of {self.sampler.global_batch} (batch_size x world_size x accumulation)")
        self.num_workers = workers_per_rank(cfg.num_workers, env.local_world_size)
        self.loader = make_loader(train_dataset, self.sampler, num_workers=self.num_workers,
                                  pin_memory=cfg.pin_memory and env.device.type == "cuda",
                                  seed=cfg.seed + env.rank, timeout_s=cfg.timeout_s)
        self.step = 0
        self.skipped_this_epoch: list[int] = []
        self.total_steps = self._total_steps()
        self._log_start()
        self.report = self.decision = None
        if doctor:
            self.model = self.raw_model
            self.preflight()
        else:
            self.model = self._wrap() if env.distributed else self.raw_model

    # --- construction helpers ----------------------------------------------------------------
    def probe_batches(self, n: int = 2) -> list:
        """This rank's first ``n`` micro-batches of the current epoch, read without consuming them."""
        indices = list(itertools.islice(iter(self.sampler), n))
        return [self._to_device(fetch(self.train_dataset, batch)) for batch in indices]

    def preflight(self) -> tuple[ddp_policy.ProbeReport, ddp_policy.Decision]:
        """Probe the unwrapped model on this rank's first batches, OR the findings over the ranks,
        and decide DDP's settings."""
        report = ddp_policy.probe(self.raw_model, self.probe_batches(), self.loss_fn, self._autocast)
        report = ddp_policy.agree_on_report(report, self.raw_model)
        cfg = self.cfg
        decision = ddp_policy.decide(report, static_graph=cfg.ddp_static_graph, find_unused=cfg.find_unused_parameters,
                                     checkpointing=cfg.gradient_checkpointing,
                                     accumulation=cfg.gradient_accumulation_steps)
        self.report, self.decision = report, decision
        return report, decision

    def _wrap(self) -> DDP:
        cfg = self.cfg
        report, decision = self.preflight()
        for reason in decision.reasons:
            log.info("DDP policy: %s", reason)
        if not decision.safe:
            forced = cfg.ddp_static_graph != "auto" or cfg.find_unused_parameters != "auto"
            message = "DDP preflight: these settings will fail for this model:\n" + ddp_policy.format_report(
                report, decision)
            if not forced:
                raise ddp_policy.DDPConfigurationError(message)
            log.warning("%s\n(kept because ddp_static_graph/find_unused_parameters were set explicitly)", message)
        model = ddp_policy.wrap(self.raw_model, self.env.device, decision, bucket_cap_mb=cfg.bucket_cap_mb,
                                gradient_as_bucket_view=cfg.gradient_as_bucket_view,
                                broadcast_buffers=cfg.broadcast_buffers)
        if decision.static_graph:
            ddp_policy.warm_up(model, self.probe_batches(1)[0], self.loss_fn, self._autocast)
        return model

    def _total_steps(self) -> int:
        by_epochs = self.cfg.num_epochs * self.sampler.steps_per_epoch
        return min(self.cfg.max_steps, by_epochs) if self.cfg.max_steps else by_epochs

    def _log_start(self) -> None:
        cfg, env, s = self.cfg, self.env, self.sampler
        log.info("framework %s, torch %s, config: %s", __version__, torch.__version__,
                 json.dumps(as_dict(cfg), sort_keys=True))
        log.info("model: %s, %.2fM parameters, amp=%s", type(self.raw_model).__name__,
                 sum(p.numel() for p in self.raw_model.parameters()) / 1e6,
                 f"on ({cfg.amp_dtype})" if self.amp else "off (fp32)")
        log.info("effective batch: %d per rank x %d ranks x %d accumulation = %d samples per step",
                 cfg.batch_size, env.world_size, cfg.gradient_accumulation_steps, s.global_batch)
        log.info("rank %d share: %d steps/epoch x %d samples = %d of %d samples per epoch; %d loader workers",
                 env.rank, s.steps_per_epoch, cfg.batch_size * cfg.gradient_accumulation_steps,
                 s.steps_per_epoch * cfg.batch_size * cfg.gradient_accumulation_steps,
                 s.num_samples, self.num_workers)
        log.info("schedule: %d steps (%d per epoch, num_epochs=%d, max_steps=%d)", self.total_steps,
                 s.steps_per_epoch, cfg.num_epochs, cfg.max_steps)
        if env.is_main:
            atomic_write_bytes(Path(cfg.log_dir) / "config.json",
                               json.dumps(as_dict(cfg), indent=2, sort_keys=True).encode())

    # --- one step ----------------------------------------------------------------------------
    def _autocast(self):
        return torch.autocast(self.env.device.type, dtype=self.amp_dtype, enabled=self.amp)

    def _to_device(self, batch):
        return tuple(t.to(self.env.device, non_blocking=True) for t in batch)

    def forward_backward(self, micro_batches: list) -> torch.Tensor:
        """Accumulate gradients over ``micro_batches``; only the last backward all-reduces.
        Returns this rank's mean loss over them as a (device) tensor."""
        n = len(micro_batches)
        total = torch.zeros((), device=self.env.device)
        try:
            for i, batch in enumerate(micro_batches):
                inputs, targets = self._to_device(batch)
                sync = i == n - 1 or not isinstance(self.model, DDP)
                with contextlib.nullcontext() if sync else self.model.no_sync():
                    with self._autocast():
                        loss = self.loss_fn(self.model(inputs), targets) / n
                    self.scaler.scale(loss).backward()
                total += loss.detach()
        except RuntimeError as err:
            diagnosed = ddp_policy.diagnose(err)
            if diagnosed is None:
                raise
            raise diagnosed from err
        return total

    def optimizer_step(self, loss: torch.Tensor, stop: bool = False):
        """Clip, agree with the other ranks, then step (or skip a non-finite step everywhere)."""
        cfg = self.cfg
        lr = lr_at(self.step, lr=cfg.learning_rate, warmup_steps=cfg.warmup_steps,
                   total_steps=self.total_steps, min_lr=cfg.min_lr)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.scaler.unscale_(self.optimizer)
        params = [p for p in self.raw_model.parameters() if p.grad is not None]
        if cfg.grad_clip > 0:
            grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        else:
            grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        # With a GradScaler, overflow is the scaler's to handle; otherwise a non-finite step is skipped.
        nonfinite = (~torch.isfinite(grad_norm) | ~torch.isfinite(loss)) if not self.scaler.is_enabled() else False
        agreed = agree(loss=loss, world_size=self.env.world_size, distributed=self.env.distributed,
                       nonfinite=nonfinite, stop=stop)
        if agreed.nonfinite:
            self.optimizer.zero_grad(set_to_none=True)
            self.scaler.update()
            self._record_skip()
        else:
            self.scaler.step(self.optimizer)
            self.scaler.update()
            self.optimizer.zero_grad(set_to_none=True)
        return agreed, lr, grad_norm

    def _record_skip(self) -> None:
        self.skipped_this_epoch.append(self.step)
        log.warning("step %d: non-finite loss or gradients on some rank; step skipped on all ranks",
                    self.step)
        if len(self.skipped_this_epoch) > self.cfg.max_errors_per_epoch:
            raise RuntimeError(f"non-finite loss or gradients at steps {self.skipped_this_epoch}: more than "
                               f"max_errors_per_epoch={self.cfg.max_errors_per_epoch} in epoch {self.sampler.epoch}")

    # --- evaluation --------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> float | None:
        """Mean validation loss over the first ``eval_steps * batch_size`` validation samples, each
        rank taking an unpadded shard; sums and counts are all-reduced, so it is exact for any
        world size."""
        if self.val_dataset is None or len(self.val_dataset) == 0:
            return None
        cfg, env = self.cfg, self.env
        was_training = self.model.training
        self.model.eval()
        indices = eval_indices(len(self.val_dataset), cfg.eval_steps * cfg.batch_size, env.world_size, env.rank)
        sums = torch.zeros(2, dtype=torch.float64, device=env.device)
        for lo in range(0, len(indices), cfg.batch_size):
            inputs, targets = self._to_device(fetch(self.val_dataset, indices[lo:lo + cfg.batch_size]))
            with self._autocast():
                loss = self.loss_fn(self.raw_model(inputs), targets)
            sums[0] += loss.double() * inputs.shape[0]
            sums[1] += inputs.shape[0]
        if env.distributed:
            dist.all_reduce(sums)
        self.model.train(was_training)
        total, count = sums.tolist()
        return total / count

    # --- the loop ----------------------------------------------------------------------------
    def train(self) -> dict:
        """Run to max_steps, num_epochs or target_loss; returns the summary (rank 0 also writes it)."""
        try:
            return self._train()
        finally:
            self.close()

    def _train(self) -> dict:
        cfg, env = self.cfg, self.env
        metrics = Metrics(enabled=env.is_main, log_dir=cfg.log_dir, tensorboard=cfg.tensorboard,
                          progress_bar=cfg.progress_bar, total_steps=self.total_steps, initial_step=self.step)
        self.model.train()
        start = time.perf_counter()
        window_start, window_tokens, tokens_total = start, 0, 0
        loss = val_loss = None
        first_loss = None
        stop = self.step >= self.total_steps
        try:
            with GcPolicy(cfg.cleanup_interval, env.device) as gc_policy:
                while not stop and self.sampler.epoch < cfg.num_epochs:
                    batches = iter(self.loader)
                    for _ in range(self.sampler.steps_remaining()):
                        micro = [next(batches) for _ in range(self.sampler.accumulation)]
                        step_tokens = sum(b[0].numel() for b in micro) * env.world_size
                        agreed, lr, grad_norm = self.optimizer_step(self.forward_backward(micro))
                        self.sampler.advance()
                        self.step += 1
                        loss = agreed.loss
                        first_loss = loss if first_loss is None else first_loss
                        window_tokens += step_tokens
                        tokens_total += step_tokens
                        metrics.progress(loss)
                        gc_policy.step(self.step)
                        if self.step % cfg.log_interval == 0:
                            now = time.perf_counter()
                            tps = window_tokens / (now - window_start)
                            log.info("step %d/%d | epoch %d | loss %.4f | lr %.3e | grad_norm %.3f | %.0f tok/s",
                                     self.step, self.total_steps, self.sampler.epoch, loss, lr,
                                     float(grad_norm), tps)
                            metrics.scalars(self.step, {"train/loss": loss, "train/lr": lr,
                                                        "train/grad_norm": float(grad_norm),
                                                        "train/tokens_per_sec": tps})
                            window_start, window_tokens = now, 0
                        if self.step % cfg.memory_check_interval == 0:
                            self._check_memory(metrics)
                        stop = (self.step >= self.total_steps or agreed.stop
                                or (cfg.target_loss > 0 and loss <= cfg.target_loss))
                        if cfg.eval_interval and self.step % cfg.eval_interval == 0 and not stop:
                            val_loss = self._eval_and_log(metrics)
                        if stop:
                            break
                    else:
                        self.sampler.set_epoch(self.sampler.epoch + 1)
                        self.skipped_this_epoch = []
            wall = time.perf_counter() - start
            if loss is not None and cfg.target_loss > 0 and loss <= cfg.target_loss:
                log.info("target_loss %g reached at step %d (loss %.4f)", cfg.target_loss, self.step, loss)
            val_loss = self._eval_and_log(metrics)
        finally:
            metrics.close()
        return self._finish(first_loss, loss, val_loss, tokens_total, wall)

    def _eval_and_log(self, metrics: Metrics) -> float | None:
        val_loss = self.evaluate()
        if val_loss is not None:
            log.info("step %d | val_loss %.4f", self.step, val_loss)
            metrics.scalars(self.step, {"val/loss": val_loss})
        return val_loss

    def _check_memory(self, metrics: Metrics) -> None:
        stats = memory_stats(self.env.device)
        log.info("memory: %s", ", ".join(f"{k} {v:.2f}" for k, v in stats.items()))
        metrics.scalars(self.step, {f"memory/{k}": v for k, v in stats.items()})
        if in_use_gb(stats) > self.cfg.max_memory_gb:
            log.warning("memory in use %.2f GiB exceeds max_memory_gb=%g", in_use_gb(stats), self.cfg.max_memory_gb)

    def _finish(self, first_loss, loss, val_loss, tokens_total, wall) -> dict:
        cfg, env = self.cfg, self.env
        per_epoch = self.sampler.steps_per_epoch * self.sampler.global_batch
        summary = {
            "first_train_loss": first_loss,
            "final_train_loss": loss,
            "final_val_loss": val_loss,
            "steps": self.step,
            "epochs": self.sampler.epoch + self.sampler.consumed / per_epoch,
            "tokens_per_sec": tokens_total / wall if wall > 0 else 0.0,
            "wall_s": wall,
            "world_size": env.world_size,
            "model_sha256": model_sha256(self.raw_model),
        }
        if env.is_main:
            atomic_torch_save(unwrap(self.model).state_dict(), Path(cfg.checkpoint_dir) / "final_model.pt")
            atomic_write_bytes(Path(cfg.log_dir) / "summary.json", json.dumps(summary, indent=2).encode())
        log.info("done: %s", json.dumps(summary))
        return summary

    def close(self) -> None:
        """Release the loader's workers and, if this trainer created it, the process group."""
        if getattr(self, "loader", None) is not None and getattr(self.loader, "_iterator", None) is not None:
            self.loader._iterator._shutdown_workers()
        if self._owns_process_group:
            distributed.teardown()


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
