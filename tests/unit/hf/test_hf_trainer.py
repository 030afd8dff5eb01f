"""framework.hf.Trainer, the drop-in for transformers.Trainer: the translation of every
TrainingArguments field, HF's optimizer and schedule, callbacks and their control, the data
collator, the loss function, save_model and resume, compute_metrics, evaluate and predict, the
best model and early stopping, report_to's integrations, and a resume from a checkpoint that
transformers.Trainer wrote (one process, in-process); and a
transformers.Trainer LoRA script run through plain transformers and through the drop-in on 2
ranks, with a rank killed under --max-restarts 1 (one batch of launches)."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import signal
import time

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

from transformers import EarlyStoppingCallback, TrainerCallback, TrainingArguments  # noqa: E402

from framework.config.schema import ConfigError  # noqa: E402
from framework.hf import Trainer  # noqa: E402
from framework.hf import arguments  # noqa: E402
from harness.hf_script import StrideBytes, build_model  # noqa: E402
from harness.launch import ROOT, launch  # noqa: E402

SCRIPT = ROOT / "harness" / "hf_script.py"


def targs(tmp_path, **overrides) -> TrainingArguments:
    kw = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, max_steps=6, learning_rate=3e-3,
              logging_steps=2, save_steps=3, report_to="none", disable_tqdm=True)
    return TrainingArguments(**{**kw, **overrides})


def config_of(args, steps_per_epoch: int = 10) -> dict:
    return arguments.to_config(args, steps_per_epoch=steps_per_epoch, resume="none")


# --- the translation ---------------------------------------------------------------------------

def test_every_training_arguments_field_is_in_exactly_one_table():
    names = {f.name for f in dataclasses.fields(TrainingArguments) if f.init}
    tables = [arguments.MAPPED, arguments.WARNED, arguments.REFUSED]
    assert not (names - set().union(*tables)), "fields of this transformers that no table names"
    for a, b in [(0, 1), (0, 2), (1, 2)]:
        assert not (tables[a] & tables[b])


@pytest.mark.parametrize("overrides, key, expected", [
    ({"per_device_train_batch_size": 3}, "data.batch_size", 3),
    ({"gradient_accumulation_steps": 4}, "data.gradient_accumulation_steps", 4),
    ({"max_steps": 17}, "train.max_steps", 17),
    ({"max_steps": 17}, "train.num_epochs", 17),  # epochs enough at any world size: max_steps decides
    # Whole epochs stay epochs: the engine counts their steps at the run's global batch.
    ({"max_steps": -1, "num_train_epochs": 2}, "train.max_steps", 0),
    ({"max_steps": -1, "num_train_epochs": 2}, "train.num_epochs", 2),
    ({"max_steps": -1, "num_train_epochs": 1.5}, "train.max_steps", 15),
    ({"max_steps": -1, "num_train_epochs": 1.5}, "train.num_epochs", 2),
    ({"learning_rate": 1e-4}, "optim.lr", 1e-4),
    ({"max_grad_norm": 0.5}, "optim.grad_clip", 0.5),
    ({"max_grad_norm": 0.0}, "optim.grad_clip", 0.0),
    ({"bf16": True, "use_cpu": True}, "precision.autocast", "true"),
    ({"fp16": False, "bf16": False}, "precision.autocast", "false"),
    ({"gradient_checkpointing": True}, "memory.activation_checkpointing", "non_reentrant"),
    ({"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": True}},
     "memory.activation_checkpointing", "reentrant"),
    ({"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"offload": True}},
     "memory.activation_checkpointing", "offload"),
    ({"torch_compile": True, "torch_compile_backend": "aot_eager"}, "compile.backend", "aot_eager"),
    ({"logging_steps": 7}, "logging.interval", 7),
    ({"eval_strategy": "steps", "eval_steps": 4}, "eval.interval", 4),
    ({"eval_strategy": "epoch"}, "eval.interval", 10),
    ({"eval_strategy": "no"}, "eval.interval", 0),
    ({"save_strategy": "steps", "save_steps": 0.5}, "checkpoint.every_steps", 3),
    ({"save_strategy": "epoch"}, "checkpoint.every_epochs", 1),
    ({"save_strategy": "no"}, "checkpoint.every_steps", 0),
    ({"save_total_limit": 2}, "checkpoint.keep_last", 2),
    ({"seed": 7}, "train.seed", 7),
    ({"full_determinism": True}, "train.deterministic", True),
    ({"dataloader_num_workers": 2}, "data.num_workers", 2),
    ({"dataloader_pin_memory": False}, "data.pin_memory", False),
    ({"ddp_find_unused_parameters": True}, "ddp.find_unused_parameters", "true"),
    ({"ddp_find_unused_parameters": None}, "ddp.find_unused_parameters", "auto"),
    ({"ddp_static_graph": True}, "ddp.static_graph", "true"),
    ({"ddp_bucket_cap_mb": 50}, "ddp.bucket_cap_mb", 50.0),
    ({"ddp_broadcast_buffers": False}, "ddp.broadcast_buffers", False),
    ({"ddp_backend": "gloo"}, "ddp.backend", "gloo"),
    ({"ddp_timeout": 120}, "ddp.timeout_s", 120.0),
    ({"disable_tqdm": True}, "logging.progress_bar", "false"),
    ({"torch_empty_cache_steps": 25}, "memory.cleanup_interval", 25),
])
def test_a_mapped_field_reaches_its_key(tmp_path, overrides, key, expected):
    overrides = dict(overrides)
    section, name = key.split(".")
    late = {k: overrides.pop(k) for k in list(overrides) if k == "ddp_backend"}  # its __post_init__ needs a group
    args = targs(tmp_path, **{"max_steps": 6, "save_steps": 6, **overrides})
    for field_name, value in late.items():
        setattr(args, field_name, value)
    cfg = config_of(args)
    assert cfg[section][name] == expected
    from framework.config import resolve_config
    resolve_config(cfg)  # the framework accepts what the translation produced


def test_output_dir_holds_checkpoints_and_logs(tmp_path):
    cfg = config_of(targs(tmp_path))
    assert cfg["checkpoint"]["dir"] == str(tmp_path / "out" / "checkpoints")
    assert cfg["logging"]["dir"] == str(tmp_path / "out" / "logs")


def test_refused_fields_are_named_one_line_each(tmp_path):
    with pytest.raises(ConfigError) as err:
        Trainer(model=build_model(), args=targs(tmp_path, label_smoothing_factor=0.1, data_seed=3),
                train_dataset=StrideBytes(64))
    assert [p.split("=")[0] for p in err.value.problems] == ["TrainingArguments.label_smoothing_factor",
                                                             "TrainingArguments.data_seed"]
    assert all("\n" not in p for p in err.value.problems)


def test_a_framework_config_sets_what_training_arguments_cannot_and_nothing_they_set(tmp_path):
    """framework_config= lays framework keys over the TrainingArguments' translation (a drop-in
    choice such as spike.guard too); a key a TrainingArguments field sets, an unknown key and a
    bad value are refused when the Trainer is built, one line each."""
    ours = arguments.with_framework_config(config_of(targs(tmp_path)), {"recovery": {"peer_timeout_s": 3},
                                                                        "spike.guard": "rollback"})
    assert (ours["recovery"]["peer_timeout_s"], ours["spike"]["guard"]) == (3.0, "rollback")
    assert ours["data"]["batch_size"] == 4  # the TrainingArguments' own, untouched
    for given, expected in [({"data": {"batch_size": 8}}, "framework_config: data.batch_size=8: set from the "
                                                          "TrainingArguments"),
                            ({"optim.lr": 0.1, "train.max_steps": 2}, "framework_config: optim.lr=0.1"),
                            ({"recovery.peer_timeout": 3}, "unknown key 'recovery.peer_timeout'"),
                            ({"spike": {"guard": "loud"}}, "spike.guard='loud'")]:
        with pytest.raises(ConfigError) as err:
            Trainer(model=build_model(), args=targs(tmp_path), train_dataset=StrideBytes(64), framework_config=given)
        assert expected in err.value.problems[0] and all("\n" not in p for p in err.value.problems), err.value
    with pytest.raises(ConfigError) as err:
        Trainer(model=build_model(), args=targs(tmp_path), train_dataset=StrideBytes(64),
                framework_config={"optim.lr": 0.1, "train.max_steps": 2})
    assert len(err.value.problems) == 2


def test_unknown_values_and_unsupported_arguments_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="save_strategy='best'"):
        config_of(targs(tmp_path, save_strategy="best", metric_for_best_model="loss"))
    with pytest.raises(ConfigError, match="model_init"):
        Trainer(model=build_model(), args=targs(tmp_path), train_dataset=StrideBytes(64), model_init=build_model)


def test_warned_fields_get_one_warning(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="framework.hf"):
        Trainer(model=build_model(), args=targs(tmp_path, eval_delay=2, skip_memory_metrics=False),
                train_dataset=StrideBytes(64))
    lines = [r.getMessage() for r in caplog.records if "not used by framework.hf.Trainer" in r.getMessage()]
    assert len(lines) == 1 and "eval_delay" in lines[0] and "skip_memory_metrics" in lines[0]


# --- one process, in-process ---------------------------------------------------------------------

class Recorder(TrainerCallback):
    def __init__(self, stop_at: int = 0, save_at: int = 0):
        self.events, self.logs, self.stop_at, self.save_at = [], [], stop_at, save_at

    def on_train_begin(self, args, state, control, **kw):
        self.events.append(("train_begin", state.global_step))

    def on_step_end(self, args, state, control, **kw):
        self.events.append(("step_end", state.global_step))
        control.should_training_stop = state.global_step == self.stop_at
        control.should_save = state.global_step == self.save_at
        return control

    def on_log(self, args, state, control, logs=None, **kw):
        self.logs.append((state.global_step, dict(logs)))

    def on_evaluate(self, args, state, control, metrics=None, **kw):
        self.events.append(("evaluate", state.global_step, metrics["eval_loss"]))

    def on_save(self, args, state, control, **kw):
        self.events.append(("save", state.global_step))

    def on_train_end(self, args, state, control, **kw):
        self.events.append(("train_end", state.global_step))


@pytest.mark.slow
def test_callbacks_get_their_events_and_control_is_honoured(tmp_path):
    rec = Recorder(stop_at=5, save_at=1)
    trainer = Trainer(model=build_model(), args=targs(tmp_path, max_steps=8, eval_strategy="steps", eval_steps=4),
                      train_dataset=StrideBytes(128), eval_dataset=StrideBytes(16, seed=1), callbacks=[rec])
    out = trainer.train()
    assert out.global_step == 5, "should_training_stop at step 5 stops there"
    kinds = [e[0] for e in rec.events]
    assert kinds[0] == "train_begin" and kinds[-1] == "train_end"
    assert [e[1] for e in rec.events if e[0] == "step_end"] == [1, 2, 3, 4, 5]
    saves = [e[1] for e in rec.events if e[0] == "save"]
    assert 1 in saves and 3 in saves, saves  # should_save at step 1, save_steps=3
    assert (tmp_path / "out" / "checkpoints" / "step_00000001.pt").exists()
    assert [e[1] for e in rec.events if e[0] == "evaluate"][:1] == [4]
    step_logs = [(s, logs) for s, logs in rec.logs if "loss" in logs]
    assert [s for s, _ in step_logs][:2] == [2, 4]
    assert {"loss", "learning_rate", "grad_norm", "epoch"} <= set(step_logs[0][1])
    assert trainer.state.log_history and trainer.state.log_history[0]["step"] == 2


@pytest.mark.slow
def test_optimizer_and_schedule_are_the_ones_transformers_builds(tmp_path):
    rec = Recorder()
    args = targs(tmp_path, max_steps=8, logging_steps=1, warmup_steps=2, weight_decay=0.1,
                 lr_scheduler_type="cosine", adam_beta2=0.98, adam_epsilon=1e-6)
    model = build_model()
    trainer = Trainer(model=model, args=args, train_dataset=StrideBytes(128), callbacks=[rec])
    trainer.train()
    hf_cls, hf_kwargs = transformers.Trainer.get_optimizer_cls_and_kwargs(args, model)
    assert type(trainer.optimizer) is hf_cls
    group = trainer.optimizer.param_groups[0]
    assert group["betas"] == (0.9, 0.98) and group["eps"] == 1e-6
    assert {g["weight_decay"] for g in trainer.optimizer.param_groups} == {0.1, 0.0}
    # Logged after step s (as transformers logs it): the rate that step used, the schedule's at s - 1:
    # linear warmup over 2 steps from 0, then cosine to 0 at step 8.
    expected = [3e-3 * (c / 2 if c < 2 else 0.5 * (1 + math.cos(math.pi * (c - 2) / 6))) for c in range(8)]
    got = [logs["learning_rate"] for _, logs in rec.logs if "learning_rate" in logs]
    assert got == pytest.approx(expected, rel=1e-6)


@pytest.mark.slow
def test_data_collator_and_compute_loss_func_are_used(tmp_path):
    calls = {"collate": 0, "loss": 0}

    def collate(samples):
        calls["collate"] += 1
        return transformers.default_data_collator(samples)

    def loss_func(outputs, labels, num_items_in_batch=None):
        calls["loss"] += 1
        logits = outputs.logits[:, :-1].flatten(0, 1)
        return torch.nn.functional.cross_entropy(logits, labels[:, 1:].flatten())

    trainer = Trainer(model=build_model(), args=targs(tmp_path, max_steps=3, save_steps=3),
                      train_dataset=StrideBytes(64), data_collator=collate, compute_loss_func=loss_func)
    trainer.train()
    assert calls["collate"] >= 3 and calls["loss"] >= 3


@pytest.mark.slow
def test_save_model_and_resume_from_checkpoint(tmp_path):
    model = build_model()
    first = Trainer(model=model, args=targs(tmp_path, max_steps=6, save_steps=3), train_dataset=StrideBytes(128))
    first.train()
    first.save_model()
    assert (tmp_path / "out" / "adapter_model.safetensors").exists()
    assert (tmp_path / "out" / "adapter_config.json").exists()
    rec = Recorder()
    again = Trainer(model=build_model(), args=targs(tmp_path, max_steps=9, save_steps=3),
                    train_dataset=StrideBytes(128), callbacks=[rec])
    out = again.train(resume_from_checkpoint=True)
    assert out.global_step == 9
    assert [e[1] for e in rec.events if e[0] == "step_end"] == [7, 8, 9], "resumed at step 6"
    assert [h["step"] for h in again.state.log_history if "loss" in h][:3] == [2, 4, 6], "log history restored"


def test_evaluate_returns_eval_loss(tmp_path):
    trainer = Trainer(model=build_model(), args=targs(tmp_path), train_dataset=StrideBytes(64),
                      eval_dataset=StrideBytes(16, seed=1))
    metrics = trainer.evaluate()
    assert math.isfinite(metrics["eval_loss"]) and 4.0 < metrics["eval_loss"] < 7.0  # about ln(256) untrained


# --- 2 ranks: plain transformers' crash, the drop-in, and a kill -9 ---------------------------------

@pytest.mark.dist
@pytest.mark.slow
def test_a_transformers_script_runs_under_the_drop_in_and_survives_kill_9(tmp_path):
    def run(name, *flags, extra=None):
        return launch(SCRIPT, [str(tmp_path / name), *flags], tmp_path / name, timeout=400, torchrun_extra=extra)

    crash = run("plain_reentrant", "--plain", "--reentrant", "--max-steps", "2")
    assert crash.returncode != 0 and "marked as ready twice" in crash.output, crash.output[-3000:]

    ref = run("dropin", "--reentrant")
    assert ref.returncode == 0, ref.output[-3000:]
    assert ref.results[0]["sha256"] == ref.results[1]["sha256"]

    killed = run("dropin_killed", "--reentrant", "--kill-rank", "1", "--kill-step", "7",
                 extra=["--max-restarts", "1"])
    assert killed.returncode == 0, killed.output[-3000:]
    assert [killed.results[r]["restarts"] for r in (0, 1)] == [1, 1]
    assert killed.results[0]["sha256"] == ref.results[0]["sha256"], "the restarted run is bit-exact"
    assert "terminate called" not in ref.output + killed.output
    # The drop-in joins the process group before the trainer: closing the trainer must still drop
    # its DDP wrapper, or the group is freed in the interpreter's finalisation (an abort 3 times
    # in 5 before the fix).
    for name in ("dropin", "dropin_killed"):
        for rank in (0, 1):
            last_restart = (tmp_path / name / "logs" / f"rank_{rank}.log").read_text().split("process group up")[-1]
            assert "still referenced" not in last_restart

    # The recipe learns; that each step's loss is transformers.Trainer's on the same batch is
    # test_a_padded_step_weighs_every_labelled_token_as_transformers_does's (in process).
    losses = {h["step"]: h["loss"] for h in ref.results[0]["log_history"] if "loss" in h}
    assert sorted(losses) == [5, 10, 15, 20] and losses[5] - losses[20] > 0.2, losses


def test_the_remaining_mapped_fields(tmp_path, caplog):
    """The fields the parametrised test does not reach: the alias, the columns kept, the refused
    sampling strategy, the first-step log and the warning for the samples drop_last leaves out."""
    alias = targs(tmp_path, activation_checkpointing=True, activation_checkpointing_kwargs={"use_reentrant": True})
    assert config_of(alias)["memory"]["activation_checkpointing"] == "reentrant"
    with pytest.raises(ConfigError, match="gradient_checkpointing_kwargs"):
        config_of(targs(tmp_path, gradient_checkpointing=True, gradient_checkpointing_kwargs={"preserve": 1}))
    args = targs(tmp_path)
    args.train_sampling_strategy = "sequential"
    with pytest.raises(ConfigError, match="train_sampling_strategy='sequential'"):
        config_of(args)

    class Extra(StrideBytes):
        def __getitem__(self, i):
            return {**super().__getitem__(i), "source": 7}  # not a forward() argument

    model = build_model()
    kept = Trainer(model=model, args=targs(tmp_path), train_dataset=Extra(8))._collated(Extra(8))
    assert "source" not in kept[0] and {"input_ids", "labels", "attention_mask"} <= set(kept[0])
    assert "source" in Trainer(model=model, args=targs(tmp_path, remove_unused_columns=False),
                               train_dataset=Extra(8))._collated(Extra(8))[0]
    assert "source" in Trainer(model=model, args=targs(tmp_path, label_names=["source"]),
                               train_dataset=Extra(8))._collated(Extra(8))[0]

    rec = Recorder()
    with caplog.at_level(logging.WARNING, logger="framework.hf"):
        Trainer(model=model, args=targs(tmp_path, max_steps=2, logging_steps=5, logging_first_step=True,
                                        save_strategy="no"),
                train_dataset=StrideBytes(70), callbacks=[rec]).train()
    assert [s for s, logs in rec.logs if "loss" in logs] == [1, 2], "the first step is logged, and the last"
    assert any("the last 2 samples of each epoch" in r.getMessage() for r in caplog.records)


class PaddedBytes(torch.utils.data.Dataset):
    """StrideBytes of different lengths, right-padded to 16 with labels -100: micro-batches that
    hold different numbers of labelled tokens, as an SFT dataset's do."""

    def __init__(self, lengths=(16, 4, 12, 3)):
        self.items = []
        for i, n in enumerate(lengths):
            ids = (torch.arange(16) + 37 * i) % 256
            mask = (torch.arange(16) < n).long()
            self.items.append({"input_ids": ids * mask, "attention_mask": mask,
                               "labels": torch.where(mask.bool(), ids, torch.full_like(ids, -100))})

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        return self.items[i]


def lora_weights(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("across_devices", [True, False])
def test_a_padded_step_weighs_every_labelled_token_as_transformers_does(tmp_path, across_devices):
    """transformers.Trainer divides a step's summed loss by its labelled tokens (num_items_in_batch),
    not by micro-batches: with gradient accumulation over micro-batches of 16 and 4 labelled tokens,
    the drop-in averaged the two micro-batch means instead, and its step differed. One step of SGD
    over the whole (4-sample) dataset, so the sample order does not matter."""
    from transformers import Trainer as HFTrainer

    def one_step(trainer_cls, run, **extra):
        model = build_model()
        args = targs(run, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=1,
                     save_steps=10, learning_rate=0.5, lr_scheduler_type="constant", use_cpu=True,
                     average_tokens_across_devices=across_devices, **extra)
        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
        trainer_cls(model=model, args=args, train_dataset=PaddedBytes(), optimizers=(optimizer, None)).train()
        return lora_weights(model)

    theirs = one_step(HFTrainer, tmp_path / "hf")
    ours = one_step(Trainer, tmp_path / "ours")
    before = lora_weights(build_model())
    moved = max(float((theirs[n] - before[n]).abs().max()) for n in theirs)
    assert moved > 1e-3
    for name in theirs:
        torch.testing.assert_close(ours[name], theirs[name], rtol=1e-5, atol=1e-6, msg=name)


# --- compute_metrics, evaluate and predict ---------------------------------------------------------

def next_token_accuracy(prediction) -> dict:
    """A compute_metrics: the share of next tokens predicted (predictions are argmax ids)."""
    return {"accuracy": float((prediction.predictions[:, :-1] == prediction.label_ids[:, 1:]).mean())}


def argmax(logits, labels):
    return logits.argmax(-1)


def test_merge_shards_puts_every_rank_s_samples_back_in_order():
    """Each rank predicts a strided shard (rank r: samples r, r + W, ...), in batches whose
    lengths differ: the gathered predictions are the whole set, in its order, padded with -100
    as transformers pads them; a rank with no samples adds none."""
    from framework.hf.trainer import _concat, merge_shards

    rows = {i: torch.full((2 + i % 3,), i) for i in range(7)}  # sample i: length 2..4, every value i

    def shard(rank, world=3):
        mine = list(range(7))[rank::world]
        batches = [_concat([rows[i][None] for i in mine[lo:lo + 2]]) for lo in range(0, len(mine), 2)]
        return mine, _concat(batches), (_concat(batches), {"ids": torch.tensor(mine)})

    preds, labels = merge_shards([shard(0), shard(1), shard(2), ([], None, None)])
    assert preds.shape == (7, 4)
    for i in range(7):
        assert preds[i, :2 + i % 3].eq(i).all() and preds[i, 2 + i % 3:].eq(-100).all()
    assert labels[1]["ids"].tolist() == list(range(7)) and labels[0].equal(preds)


def test_evaluate_and_predict_return_transformers_results(tmp_path):
    """evaluate(): eval_loss, compute_metrics' results over the whole set (with
    preprocess_logits_for_metrics per batch) and the speed metrics, logged and given to
    on_evaluate; predict(): a PredictionOutput of the whole set in its order."""
    from transformers.trainer_utils import PredictionOutput

    seen, rec = [], Recorder()

    def metrics(prediction):
        seen.append(prediction)
        return next_token_accuracy(prediction)

    evaluation = StrideBytes(10, seed=1)  # 10 samples in batches of 4: the last one short
    trainer = Trainer(model=build_model(), args=targs(tmp_path, per_device_eval_batch_size=4),
                      train_dataset=StrideBytes(64), eval_dataset=evaluation, compute_metrics=metrics,
                      preprocess_logits_for_metrics=argmax, callbacks=[rec])
    out = trainer.evaluate()
    assert {"eval_loss", "eval_accuracy", "eval_runtime", "eval_samples_per_second"} <= set(out)
    assert seen[-1].predictions.shape == (10, 32), "argmax ids of every sample"
    assert (seen[-1].label_ids == evaluation.ids.numpy()).all(), "every sample's labels, in the dataset's order"
    with torch.no_grad():  # the same accuracy computed directly
        logits = trainer.model(input_ids=evaluation.ids).logits
    direct = float((logits.argmax(-1)[:, :-1] == evaluation.ids[:, 1:]).float().mean())
    assert out["eval_accuracy"] == pytest.approx(direct)
    assert [e[0] for e in rec.events] == ["evaluate"] and rec.logs[-1][1]["eval_accuracy"] == out["eval_accuracy"]
    assert trainer.state.log_history[-1]["eval_accuracy"] == out["eval_accuracy"]

    predicted = trainer.predict(evaluation)
    assert isinstance(predicted, PredictionOutput)
    assert predicted.predictions.shape == (10, 32) and (predicted.label_ids == evaluation.ids.numpy()).all()
    assert predicted.metrics["test_accuracy"] == pytest.approx(direct)
    assert predicted.metrics["test_loss"] == pytest.approx(out["eval_loss"])


@pytest.mark.slow
def test_compute_metrics_runs_at_each_evaluation_during_training(tmp_path):
    rec = Recorder()
    metrics_seen = []

    class Metrics(TrainerCallback):
        def on_evaluate(self, args, state, control, metrics=None, **kw):
            metrics_seen.append(dict(metrics))

    trainer = Trainer(model=build_model(), args=targs(tmp_path, max_steps=4, eval_strategy="steps", eval_steps=2,
                                                      save_strategy="no"),
                      train_dataset=StrideBytes(64), eval_dataset=StrideBytes(10, seed=1),
                      compute_metrics=next_token_accuracy, preprocess_logits_for_metrics=argmax,
                      callbacks=[rec, Metrics()])
    trainer.train()
    evaluations = [h for h in trainer.state.log_history if "eval_loss" in h]
    assert [h["step"] for h in evaluations] == [2, 4]
    assert all(0.0 <= h["eval_accuracy"] <= 1.0 for h in evaluations)
    assert [m["eval_accuracy"] for m in metrics_seen] == [h["eval_accuracy"] for h in evaluations]
    assert trainer.evaluate()["eval_accuracy"] == pytest.approx(evaluations[-1]["eval_accuracy"])


# --- the best model and early stopping ---------------------------------------------------------------

@pytest.mark.slow
def test_early_stopping_stops_and_the_best_model_is_loaded_at_the_end(tmp_path):
    """transformers' own EarlyStoppingCallback with a metric that only gets worse: the best is the
    first evaluation's (step 2), patience 1 stops the run at the second (step 4, as
    transformers.Trainer does), and the model ends with step 2's
    weights, kept in output_dir/best_model though checkpoints are pruned to the last one."""
    from transformers import EarlyStoppingCallback

    calls = []

    def worsening(prediction):
        calls.append(1)
        return {"worse": float(len(calls))}

    at = {}

    class Weights(TrainerCallback):
        def on_evaluate(self, args, state, control, model=None, **kw):
            at[state.global_step] = lora_weights(model)

        def on_train_end(self, args, state, control, model=None, **kw):
            at["end"] = lora_weights(model)

    model = build_model()
    args = targs(tmp_path, max_steps=20, eval_strategy="steps", eval_steps=2, save_steps=2, save_total_limit=1,
                 load_best_model_at_end=True, metric_for_best_model="worse", greater_is_better=False)
    trainer = Trainer(model=model, args=args, train_dataset=StrideBytes(128), eval_dataset=StrideBytes(8, seed=1),
                      compute_metrics=worsening, callbacks=[EarlyStoppingCallback(early_stopping_patience=1),
                                                            Weights()])
    out = trainer.train()
    assert out.global_step == 4, "stopped at the second evaluation"
    assert [e["step"] for e in trainer.state.log_history if "eval_loss" in e] == [2, 4], "not evaluated twice"
    assert trainer.state.best_metric == 1.0 and trainer.state.best_global_step == 2
    best = tmp_path / "out" / "best_model"
    assert trainer.state.best_model_checkpoint == str(best)
    assert (best / "adapter_model.safetensors").exists()
    assert len(list((tmp_path / "out" / "checkpoints").glob("step_*.pt"))) == 1, "pruned to the last"
    final = lora_weights(model)
    assert any(not torch.equal(final[n], at["end"][n]) for n in final), "the last step's weights differ"
    for name in final:
        assert torch.equal(final[name], at[2][name]), name


@pytest.mark.slow
def early_stopping_run(tmp_path, early, *extra) -> Trainer:
    """Evaluated every 2 steps with a metric that worsens at every evaluation (1, 2, 3, ... over
    the test, resumed runs included), checkpointed every 2 steps: patience 3 stops at step 8."""
    calls = early.calls = getattr(early, "calls", [])

    def worsening(prediction):
        calls.append(1)
        return {"worse": float(len(calls))}

    args = targs(tmp_path, max_steps=20, eval_strategy="steps", eval_steps=2, save_steps=2,
                 metric_for_best_model="worse", greater_is_better=False)
    return Trainer(model=build_model(), args=args, train_dataset=StrideBytes(128),
                   eval_dataset=StrideBytes(8, seed=1), compute_metrics=worsening, callbacks=[early, *extra])


def test_early_stoppings_patience_counter_is_saved_and_continues_after_a_resume(tmp_path):
    """EarlyStoppingCallback's counter (its exported state) is in the checkpoint of the step it was
    evaluated at: a crash after step 5 resumes from step 4's checkpoint, whose evaluation raised the
    counter to 1, so patience 3 stops the resumed run at step 8, as the uninterrupted run stops.
    (Saved before step 4's evaluation, the checkpoint held 0, and the run stopped at step 10.)"""
    counters = []

    class Probe(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            counters.append(early.early_stopping_patience_counter)

    class CrashAfter5(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if state.global_step == 5:
                raise RuntimeError("a crash at step 5")

    early = EarlyStoppingCallback(early_stopping_patience=3)
    with pytest.raises(RuntimeError, match="a crash at step 5"):
        early_stopping_run(tmp_path, early, Probe(), CrashAfter5()).train()
    early = EarlyStoppingCallback(early_stopping_patience=3)
    out = early_stopping_run(tmp_path, early, Probe()).train(resume_from_checkpoint=True)
    assert counters == [0, 1], "the resumed run's callback starts at the counter of step 4's evaluation"
    assert out.global_step == 8


def test_an_early_stop_is_in_the_checkpoint_and_a_run_resumed_there_ends(tmp_path, caplog):
    """A callback's stop at the evaluation of step 4, then a preemption request before the run
    ends: the preemption's checkpoint of step 4 records the stop, and the resumed run ends there
    with no step trained and no evaluation run again (it trained on to max_steps 20 before)."""
    class StopAt4AndPreempt(TrainerCallback):
        def on_evaluate(self, args, state, control, **kw):
            if state.global_step == 4:
                control.should_training_stop = True
                os.kill(os.getpid(), signal.SIGUSR1)

    early = EarlyStoppingCallback(early_stopping_patience=100)
    with caplog.at_level(logging.INFO):
        assert early_stopping_run(tmp_path, early, StopAt4AndPreempt()).train().global_step == 4
        assert "preempted: checkpoint of step 4 saved" in caplog.text
        caplog.clear()
        resumed = early_stopping_run(tmp_path, early)
        out = resumed.train(resume_from_checkpoint=True)
    assert out.global_step == 4
    assert "stopped early at step 4" in caplog.text
    evaluated = [entry["step"] for entry in resumed.state.log_history if "eval_loss" in entry]
    assert evaluated == [2, 4], evaluated
    assert len(early.calls) == 2, "the resumed run evaluated again"


def test_a_stop_asked_at_an_evaluation_a_preemption_interrupted_ends_the_resumed_run_there(tmp_path):
    """A preemption request stops step 4's evaluation (its first batch), and the relaunch runs
    that owed evaluation first, where the callback asks for a stop: the run ends at step 4, as it
    would have without the preemption (the resumed run trained step 5 before)."""
    class PreemptAfter4(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if state.global_step == 4:
                os.kill(os.getpid(), signal.SIGUSR1)

    class StopAt4(TrainerCallback):
        def on_evaluate(self, args, state, control, **kw):
            control.should_training_stop = state.global_step == 4

    early = EarlyStoppingCallback(early_stopping_patience=100)
    assert early_stopping_run(tmp_path, early, StopAt4(), PreemptAfter4()).train().global_step == 4
    assert len(early.calls) == 1, "step 4's evaluation was not stopped"
    resumed = early_stopping_run(tmp_path, early, StopAt4())
    assert resumed.train(resume_from_checkpoint=True).global_step == 4
    assert [e["step"] for e in resumed.state.log_history if "eval_loss" in e] == [2, 4]


def test_a_checkpoint_a_callback_asks_for_with_its_stop_records_the_stop(tmp_path):
    """A callback sets should_save and should_training_stop at step 5; the final evaluation then
    crashes. The checkpoint of step 5 records the stop, so the resumed run ends at step 5 (saved
    before the stop was taken, it trained on to step 20)."""
    class SaveAndStopAt5(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if state.global_step == 5:
                control.should_save = control.should_training_stop = True

    class CrashAtTheFinalEvaluation(TrainerCallback):
        def on_evaluate(self, args, state, control, **kw):
            if state.global_step == 5:
                raise RuntimeError("a crash in the final evaluation")

    early = EarlyStoppingCallback(early_stopping_patience=100)
    with pytest.raises(RuntimeError, match="a crash in the final evaluation"):
        early_stopping_run(tmp_path, early, SaveAndStopAt5(), CrashAtTheFinalEvaluation()).train()
    resumed = early_stopping_run(tmp_path, early)
    assert resumed.train(resume_from_checkpoint=True).global_step == 5
    assert [e["step"] for e in resumed.state.log_history if "eval_loss" in e] == [2, 4, 5]


# --- report_to -------------------------------------------------------------------------------------

@pytest.mark.slow
def test_report_to_tensorboard_writes_event_files(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.delenv("TENSORBOARD_LOGGING_DIR", raising=False)
    trainer = Trainer(model=build_model(), args=targs(tmp_path, max_steps=4, eval_strategy="steps", eval_steps=2,
                                                      save_strategy="no", report_to="tensorboard"),
                      train_dataset=StrideBytes(64), eval_dataset=StrideBytes(8, seed=1))
    assert [type(cb).__name__ for cb in trainer.reporters] == ["TensorBoardCallback"]
    trainer.train()
    events = list((tmp_path / "out" / "runs").glob("*/events.out.tfevents.*"))
    assert len(events) == 1, events
    scalars = EventAccumulator(str(events[0].parent)).Reload().Tags()["scalars"]
    assert {"train/loss", "train/learning_rate", "eval/loss"} <= set(scalars), scalars


@pytest.mark.slow
def test_report_to_wandb_offline_records_the_run(tmp_path, monkeypatch):
    try:
        import wandb
    except ImportError:
        pytest.skip("wandb is not installed here (pip install wandb): report_to='wandb' is not tested")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    trainer = Trainer(model=build_model(), args=targs(tmp_path, max_steps=4, save_strategy="no", report_to="wandb",
                                                      run_name="drop-in"),
                      train_dataset=StrideBytes(64))
    assert [type(cb).__name__ for cb in trainer.reporters] == ["WandbCallback"]
    try:
        trainer.train()
    finally:
        wandb.finish()
    runs = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1, list(tmp_path.rglob("*"))
    # wandb's own service process writes the file: on a loaded machine its records land after finish()
    # returns (CI once read the header alone), so they are waited for, 30 s at most
    deadline = time.monotonic() + 30
    while b"train/loss" not in runs[0].read_bytes() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert b"train/loss" in runs[0].read_bytes()


# --- a checkpoint written by transformers.Trainer ------------------------------------------------------

@pytest.mark.slow
def test_resume_from_a_checkpoint_transformers_trainer_wrote(tmp_path, caplog):
    """transformers.Trainer trains 6 steps of AdamW with a linear schedule, saving checkpoint-3; the
    drop-in resumes that folder (adapter weights, optimizer.pt, scheduler.pt, trainer_state.json)
    and trains steps 4 to 6. Every step takes the whole (4-sample) dataset, so the sample order
    does not matter: the weights end where transformers' own did."""
    from transformers import Trainer as HFTrainer

    def args(run):
        return targs(run, per_device_train_batch_size=4, max_steps=6, save_steps=3, logging_steps=1,
                     learning_rate=1e-2, use_cpu=True)

    from transformers.trainer_callback import ExportableState

    class Tally(TrainerCallback, ExportableState):  # a stateful callback: transformers saves its count
        def __init__(self):
            self.count = 0

        def on_step_end(self, args, state, control, **kw):
            self.count += 1

        def state(self) -> dict:
            return {"args": {}, "attributes": {"count": self.count}}

    theirs_model = build_model()
    theirs = HFTrainer(model=theirs_model, args=args(tmp_path / "hf"), train_dataset=PaddedBytes(),
                       callbacks=[Tally()])
    theirs.train()
    checkpoint = tmp_path / "hf" / "out" / "checkpoint-3"
    assert (checkpoint / "optimizer.pt").exists() and (checkpoint / "adapter_model.safetensors").exists()

    assert (checkpoint / "rng_state.pth").exists()
    rec, tally = Recorder(), Tally()
    ours_model = build_model()
    ours = Trainer(model=ours_model, args=args(tmp_path / "ours"), train_dataset=PaddedBytes(),
                   callbacks=[rec, tally])
    with caplog.at_level(logging.INFO, logger="framework.hf.trainer"):
        out = ours.train(resume_from_checkpoint=str(checkpoint))
    assert out.global_step == 6
    assert tally.count == 6, "its state from trainer_state.json's stateful_callbacks, then steps 4 to 6"
    assert "rng_state.pth: " in caplog.text and "superseded" in caplog.text
    assert [e[1] for e in rec.events if e[0] == "step_end"] == [4, 5, 6], "continued at step 3"
    history = [(h["step"], h["learning_rate"]) for h in ours.state.log_history if "loss" in h]
    assert history == pytest.approx([(h["step"], h["learning_rate"]) for h in theirs.state.log_history
                                     if "loss" in h], rel=1e-6), "its log history, and the schedule continued"
    mine, hf = lora_weights(ours_model), lora_weights(theirs_model)
    moved = max(float((hf[n] - lora_weights(build_model())[n]).abs().max()) for n in hf)
    assert moved > 1e-3
    for name in hf:
        torch.testing.assert_close(mine[name], hf[name], rtol=1e-4, atol=1e-5, msg=name)

    # resume_from_checkpoint=True in transformers' output_dir (no framework checkpoint there): its newest
    # checkpoint-N, here the last step's, so nothing is left to train
    again_model = build_model()
    again = Trainer(model=again_model, args=args(tmp_path / "hf"), train_dataset=PaddedBytes())
    assert again.train(resume_from_checkpoint=True).global_step == 6
    for name, value in lora_weights(again_model).items():
        torch.testing.assert_close(value, hf[name], rtol=0, atol=0, msg=name)


def test_a_callbacks_state_is_saved_as_plain_types_or_left_out_with_one_warning(tmp_path, caplog):
    """transformers saves an ExportableState callback's state as JSON, which takes numpy scalars;
    a framework checkpoint holds plain types only, so a state is saved as JSON has it, and one
    that JSON cannot hold is left out with one warning rather than failing every save."""
    import enum

    import numpy as np
    from transformers.trainer_callback import ExportableState

    from framework.hf.callbacks import HFCallbacks
    from framework.state.checkpoint_files import to_cpu

    class Mode(enum.Enum):
        FAST = "fast"

    class Best(TrainerCallback, ExportableState):
        def __init__(self):
            self.best, self.mode, self.curve = np.float64(0.5), Mode.FAST, np.arange(3)

        def state(self):
            return {"args": {}, "attributes": {"best": self.best, "mode": self.mode, "curve": self.curve}}

    class Odd(TrainerCallback, ExportableState):
        def state(self):
            return {"args": {}, "attributes": {"thing": object()}}

    def bridge(*callbacks):
        return HFCallbacks(list(callbacks), TrainingArguments(output_dir=str(tmp_path), report_to="none"),
                           steps_per_epoch=4, max_steps=8, logging_interval=1, logging_first_step=False,
                           components={})

    with caplog.at_level(logging.WARNING, logger="framework.hf.callbacks"):
        ours = bridge(Best(), Odd())
        state = ours.state_dict()
        ours.state_dict()
    saved = state["stateful_callbacks"]
    assert saved == {"Best": {"args": {}, "attributes": {"best": 0.5, "mode": "fast", "curve": [0, 1, 2]}}}
    assert type(saved["Best"]["attributes"]["best"]) is float
    to_cpu(state)  # what the checkpoint writer takes
    assert caplog.text.count("the state of the callback Odd is not saved") == 1
    other = Best()
    other.best = None
    with caplog.at_level(logging.WARNING, logger="framework.hf.callbacks"):
        bridge(other).load_state_dict({**state, "stateful_callbacks": {**saved, "Gone": {"attributes": {}}}})
    assert other.best == 0.5 and other.curve == [0, 1, 2]
    assert "callbacks this run does not have: Gone" in caplog.text


def test_a_damaged_rng_state_of_a_transformers_checkpoint_does_not_stop_the_resume(tmp_path, caplog):
    from framework.hf.trainer import _note_rng_state

    (tmp_path / "rng_state.pth").write_bytes(b"")  # truncated to nothing
    with caplog.at_level(logging.INFO, logger="framework.hf.trainer"):
        _note_rng_state(tmp_path)
    assert "rng_state.pth: present (not readable as weights only: " in caplog.text
    assert "superseded" in caplog.text
