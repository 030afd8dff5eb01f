"""framework.hf.SFTTrainer, the drop-in for TRL's SFTTrainer, with the real TRL: text data,
prompt-completion data packed with the completion-only loss, and conversations through a chat
template (a tokenizer built offline), each against TRL's own loss on the same batches; the
older keywords; what this machine cannot run; tokenising once; a Trainer subclass's overrides;
and the Kaggle guide's script shape under torchrun, killed -9 and restarted in place."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("peft")
datasets = pytest.importorskip("datasets")

from framework.config.schema import ConfigError  # noqa: E402
from framework.data.sampler import ResumableDistributedSampler  # noqa: E402
from framework.hf import SFTConfig, SFTTrainer  # noqa: E402
from harness.launch import ROOT, launch  # noqa: E402
from harness.sft_script import build_model, build_tokenizer, dataset, lora_config  # noqa: E402

GUIDE = ROOT / "harness" / "sft_script.py"
HF_SCRIPT = ROOT / "harness" / "hf_script.py"


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def sft_args(tmp_path, **overrides) -> SFTConfig:
    kw = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, max_steps=6, learning_rate=2e-3,
              logging_steps=1, max_length=64, save_strategy="no", report_to="none", disable_tqdm=True, bf16=False,
              use_cpu=True, gradient_checkpointing=False)
    return SFTConfig(**{**kw, **overrides})


# --- the losses are TRL's -----------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("kind, extra", [
    ("text", {}),
    ("prompt_completion", {"packing": True, "packing_strategy": "bfd", "completion_only_loss": True}),
    ("conversational", {"assistant_only_loss": True}),
    ("text", {"packing": True, "packing_strategy": "wrapped"}),
    ("text", {"padding_free": True, "max_length": None}),
    ("prompt_completion", {"max_length": 24, "completion_only_loss": True}),
])
def test_each_steps_loss_is_trls_loss_on_the_same_batch(tmp_path, tokenizer, kind, extra):
    """learning_rate 0, so the model stays as built: every step's logged loss must equal TRL's
    compute_loss (its fused LM head's mean negative log-likelihood) on the batch of that step, the
    framework's own sample order rebuilt from its sampler and seed."""
    from trl import SFTTrainer as TRLTrainer

    args = sft_args(tmp_path, learning_rate=0.0, **extra)
    model = build_model(tokenizer)
    ours = SFTTrainer(model=model, args=args, train_dataset=dataset(kind, 64), processing_class=tokenizer,
                      peft_config=lora_config())
    prepared, collator = ours.train_dataset, ours.data_collator
    if kind == "prompt_completion":  # the completion-only loss: the prompt's tokens carry no label
        assert any(-100 in row["labels"] for row in prepared)
    ours.train()
    steps = {e["step"]: e["loss"] for e in ours.state.log_history if "loss" in e}
    assert sorted(steps) == list(range(1, 7))

    with_skip = sft_args(tmp_path / "trl", learning_rate=0.0, dataset_kwargs={"skip_prepare_dataset": True},
                         **extra)
    trl = TRLTrainer(model=ours.model, args=with_skip, train_dataset=prepared, processing_class=tokenizer)
    order = ResumableDistributedSampler(len(prepared), 1, 0, 4, 1, args.seed).permutation(0).tolist()
    ours.model.eval()  # no dropout in either: the same forward
    with torch.no_grad():
        for step in range(1, 7):
            rows = [{k: v for k, v in prepared[i].items() if k in ("input_ids", "labels", "seq_lengths")}
                    for i in order[(step - 1) * 4:step * 4]]
            batch = collator(rows)
            trl_loss = trl.compute_loss(ours.model, dict(batch)).item()
            assert steps[step] == pytest.approx(trl_loss, rel=1e-5, abs=1e-6), (step, steps[step], trl_loss)


@pytest.mark.slow
def test_peft_config_makes_trl_build_the_lora_model(tmp_path, tokenizer):
    trainer = SFTTrainer(model=build_model(tokenizer), args=sft_args(tmp_path), train_dataset=dataset("text", 32),
                         processing_class=tokenizer, peft_config=lora_config())
    trainable = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    changed = {n for n, p in trainer.model.named_parameters() if not torch.equal(p, before[n])}
    assert changed == set(trainable)


# --- what the original documents pass, and what this machine cannot run ---------------------------

def test_the_older_keywords_are_applied_with_one_line_naming_todays_spelling(tmp_path, tokenizer, caplog):
    from transformers import TrainingArguments

    caplog.set_level(logging.WARNING, logger="framework.hf.sft")
    args = TrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, max_steps=2,
                             report_to="none", use_cpu=True)
    trainer = SFTTrainer(model=build_model(tokenizer), args=args, train_dataset=dataset("text", 16),
                         tokenizer=tokenizer, dataset_text_field="text", max_seq_length=48, packing=False)
    assert isinstance(trainer.args, SFTConfig) and trainer.args.max_length == 48 and not trainer.args.packing
    assert trainer.processing_class is tokenizer
    lines = [r.getMessage() for r in caplog.records]
    assert "SFTTrainer(max_seq_length=...) is SFTConfig(max_length=...) in TRL today: applied as such" in lines
    assert "SFTTrainer(tokenizer=...) is processing_class=... in TRL today: applied as such" in lines
    assert max(len(row["input_ids"]) for row in trainer.train_dataset) <= 48
    with pytest.raises(ConfigError) as info:
        SFTTrainer(model=build_model(tokenizer), args=args, train_dataset=dataset("text", 16),
                   processing_class=tokenizer, neftune_noise_alpha=5, max_seq_lenght=48)
    assert len(info.value.problems) == 2 and "max_seq_lenght" in info.value.problems[1]


@pytest.mark.parametrize("optim", ["adamw_8bit", "paged_adamw_8bit"])
def test_an_8bit_optimizer_without_bitsandbytes_on_cuda_is_one_line(tmp_path, tokenizer, optim):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the refusal is for machines without it")
    with pytest.raises(ConfigError) as info:
        SFTTrainer(model=build_model(tokenizer), args=sft_args(tmp_path, optim=optim),
                   train_dataset=dataset("text", 16), processing_class=tokenizer)
    assert info.value.problems == [
        f"SFTConfig.optim={optim!r}: needs bitsandbytes and a CUDA GPU, and this machine has no CUDA GPU; allowed "
        "here: adamw_torch, adamw_torch_fused, adafactor, sgd (or install bitsandbytes on a GPU machine)"]


SCRIPT_WITH_A_BAD_OPTIMIZER = """
import sys
sys.path.insert(0, {root!r})
from framework.hf import SFTConfig, SFTTrainer
from harness.sft_script import build_model, build_tokenizer, dataset
tok = build_tokenizer()
SFTTrainer(model=build_model(tok), args=SFTConfig(output_dir={out!r}, optim="adamw_8bit", use_cpu=True,
           report_to="none"), train_dataset=dataset("text", 16), processing_class=tok)
"""


@pytest.mark.slow
def test_a_script_that_passes_what_cannot_run_ends_with_one_line_and_exit_2(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the refusal is for machines without it")
    proc = subprocess.run([sys.executable, "-c", SCRIPT_WITH_A_BAD_OPTIMIZER.format(root=str(ROOT),
                                                                                     out=str(tmp_path))],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [line for line in proc.stderr.splitlines() if "adamw_8bit" in line]
    assert len(errors) == 1 and "needs bitsandbytes and a CUDA GPU" in errors[0]
    assert "Traceback" not in proc.stderr


# --- tokenise once ------------------------------------------------------------------------------

@pytest.mark.slow
def test_the_prepared_data_is_cached_by_its_key_and_read_back(tmp_path, tokenizer, monkeypatch):
    first = SFTTrainer(model=build_model(tokenizer), args=sft_args(tmp_path), train_dataset=dataset("text", 32),
                       processing_class=tokenizer)
    assert first.tokenised_here and (first.prepared_cache / "train").is_dir()
    import trl.trainer.sft_trainer as sft_module

    def no_tokenising(*args, **kwargs):
        raise AssertionError("tokenised again")

    monkeypatch.setattr(sft_module.SFTTrainer, "_prepare_dataset", no_tokenising)
    again = SFTTrainer(model=build_model(tokenizer), args=sft_args(tmp_path), train_dataset=dataset("text", 32),
                       processing_class=tokenizer)
    assert not again.tokenised_here and again.prepared_cache == first.prepared_cache
    assert again.train_dataset["input_ids"] == first.train_dataset["input_ids"]
    monkeypatch.undo()
    other = SFTTrainer(model=build_model(tokenizer), args=sft_args(tmp_path, max_length=32),
                       train_dataset=dataset("text", 32), processing_class=tokenizer)
    assert other.tokenised_here and other.prepared_cache != first.prepared_cache


# --- a subclass's overrides ----------------------------------------------------------------------

def test_a_subclass_compute_loss_and_create_optimizer_are_honoured(tmp_path, tokenizer):
    """Issue 30: a subclass overriding compute_loss or create_optimizer was silently ignored."""
    calls = []

    class Doubled(SFTTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            calls.append(num_items_in_batch)
            return 2 * super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

        def create_optimizer(self):
            self.optimizer = torch.optim.SGD([p for p in self.model.parameters() if p.requires_grad], lr=0.0)
            return self.optimizer

    plain = SFTTrainer(model=build_model(tokenizer), args=sft_args(tmp_path / "a", learning_rate=0.0),
                       train_dataset=dataset("text", 32), processing_class=tokenizer)
    plain.train()
    doubled = Doubled(model=build_model(tokenizer), args=sft_args(tmp_path / "b"),
                      train_dataset=dataset("text", 32), processing_class=tokenizer)
    doubled.train()
    assert isinstance(doubled.optimizer, torch.optim.SGD) and len(calls) == 6
    base = [e["loss"] for e in plain.state.log_history if "loss" in e]
    twice = [e["loss"] for e in doubled.state.log_history if "loss" in e]
    assert twice == pytest.approx([2 * x for x in base], rel=1e-5)


def test_a_transformers_trainer_subclass_compute_loss_is_honoured(tmp_path):
    """Issue 30's failing-first case, on framework.hf.Trainer: the override was silently ignored."""
    from transformers import TrainingArguments

    from framework.hf import Trainer
    from harness.hf_script import StrideBytes
    from harness.hf_script import build_model as build_lora_llama

    class Tripled(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return 3 * model(**inputs).loss

    losses = []
    for cls in (Trainer, Tripled):
        args = TrainingArguments(output_dir=str(tmp_path / cls.__name__), per_device_train_batch_size=4,
                                 max_steps=2, learning_rate=0.0, logging_steps=1, report_to="none",
                                 disable_tqdm=True, use_cpu=True)
        trainer = cls(model=build_lora_llama(), args=args, train_dataset=StrideBytes(32))
        trainer.train()
        losses.append([e["loss"] for e in trainer.state.log_history if "loss" in e])
    assert losses[1] == pytest.approx([3 * x for x in losses[0]], rel=1e-5)


@pytest.mark.parametrize("method", ["training_step", "get_train_dataloader"])
def test_a_subclass_override_the_framework_cannot_call_is_refused_by_name(tmp_path, tokenizer, method):
    from framework.hf import Trainer

    subclass = type("Custom", (Trainer,), {method: lambda self, *a, **k: None})
    with pytest.raises(ConfigError) as info:
        subclass(model=build_model(tokenizer), args=sft_args(tmp_path), train_dataset=dataset("text", 8))
    assert len(info.value.problems) == 1 and info.value.problems[0].startswith(f"Custom.{method}: overriding it is "
                                                                               "not supported by framework.hf")


# --- the guide's script, and another world size, under torchrun ------------------------------------

def results(run) -> list[dict]:
    assert run.returncode == 0, run.output[-4000:]
    assert not run.leftovers
    return [run.results[r] for r in sorted(run.results)]


@pytest.mark.dist
def test_the_guides_script_runs_with_the_import_changed_and_a_kill_9_restarts_in_place_bit_exact(tmp_path):
    """The guide's own init_process_group, DDP wrapping and .module, a save_strategy that only rank
    0 sets, rank 0's save_pretrained and destroy_process_group: with trl it stops at its first save;
    here it runs, and a rank killed -9 mid-step restarts in place from the step its peer saved
    alone, to the same weights, without tokenising again."""
    run = launch(GUIDE, [str(tmp_path / "whole")], tmp_path / "whole_run", nproc=2, timeout=180)
    whole = results(run)
    assert [r["steps"] for r in whole] == [20, 20] and whole[0]["sha256"] == whole[1]["sha256"]
    assert [r["tokenised_here"] for r in whole] == [True, False]  # rank 0 prepares, rank 1 reads its result
    assert (tmp_path / "whole" / "final_adapter" / "adapter_config.json").is_file()
    assert ("the TrainingArguments differ between ranks: checkpoint.every_steps (10 on rank 0, 0 on rank 1)"
            in run.output)
    assert "terminate called" not in run.output
    killed = launch(GUIDE, [str(tmp_path / "killed"), "--kill-rank", "1", "--kill-step", "13", "--kill-mid-step"],
                    tmp_path / "killed_run", nproc=2, timeout=240, torchrun_extra=["--max-restarts", "2"])
    resumed = results(killed)
    assert [(r["steps"], r["restarts"], r["tokenised_here"]) for r in resumed] == [(20, 1, False), (20, 1, False)]
    assert resumed[0]["sha256"] == whole[0]["sha256"]
    log0 = (tmp_path / "killed" / "logs" / "rank_0.log").read_text()
    assert "this rank saved step 13, the last step every rank finished, alone" in log0
    assert "resumed from step 13" in log0


@pytest.mark.dist
@pytest.mark.parametrize("first, then, length, steps", [
    # 512 samples, 8 a step; at 1 rank HF counted 128 a step-epoch. (1->2 with epochs, where HF counted
    # 8-step epochs instead of 16, is the next test's, with a fraction of an epoch.)
    (2, 1, ["--max-steps", "96"], 96),
])
def test_a_drop_in_run_resumed_at_another_world_size_keeps_its_length_and_schedule(tmp_path, first, then, length,
                                                                                 steps):
    """Issue 30: the drop-in recounted HF's steps at the new world size while the sampler kept the
    run's global batch: 2->1 with max_steps=96 stopped at step 64 (and 1->2 with 3 epochs ended at
    1.5 epochs with the LR at 0)."""
    samples = "64" if first == 1 else "512"
    out = str(tmp_path / "out")
    interrupted = launch(HF_SCRIPT, [out, *length, "--samples", samples, "--kill-rank", "0", "--kill-step", "12"],
                         tmp_path / "first", nproc=first, timeout=180)
    assert interrupted.returncode != 0
    resumed = results(launch(HF_SCRIPT, [out, *length, "--samples", samples, "--resume"], tmp_path / "then",
                             nproc=then, timeout=240))
    assert [r["steps"] for r in resumed] == [steps] * then
    rates = {e["step"]: e["learning_rate"] for e in resumed[0]["log_history"] if "learning_rate" in e}
    # The linear schedule over the run's own horizon: step k trains at 1e-2 x (steps - k + 1) / steps.
    assert rates and max(rates) == steps
    for step, rate in rates.items():
        assert rate == pytest.approx(1e-2 * (steps - step + 1) / steps, rel=1e-6), (step, rate)


def test_trls_own_refusal_of_its_arguments_is_one_config_error_line(tmp_path, tokenizer):
    """assistant_only_loss on data that is not conversational: TRL's ValueError, as one line."""
    with pytest.raises(ConfigError) as info:
        SFTTrainer(model=build_model(tokenizer), args=sft_args(tmp_path, assistant_only_loss=True),
                   train_dataset=dataset("text", 8), processing_class=tokenizer)
    assert len(info.value.problems) == 1 and "assistant_only_loss" in info.value.problems[0]


@pytest.mark.slow
def test_a_formatting_func_shapes_the_text_and_is_part_of_the_cache_key(tmp_path, tokenizer):
    def as_dialogue(row):
        return f"Q: {row['speaker']}A: {row['line']}"

    def as_play(row):
        return f"{row['speaker']}{row['line']}"

    rows = dataset("prompt_completion", 16)
    data = datasets.Dataset.from_dict({"speaker": rows["prompt"], "line": rows["completion"]})
    first = SFTTrainer(model=build_model(tokenizer), args=sft_args(tmp_path), train_dataset=data,
                       processing_class=tokenizer, formatting_func=as_dialogue)
    assert tokenizer.decode(first.train_dataset[0]["input_ids"]).startswith("Q: Who speaks?")
    other = SFTTrainer(model=build_model(tokenizer), args=sft_args(tmp_path), train_dataset=data,
                       processing_class=tokenizer, formatting_func=as_play)
    assert other.tokenised_here and other.prepared_cache != first.prepared_cache
    assert tokenizer.decode(other.train_dataset[0]["input_ids"]).startswith("Who speaks?")


@pytest.mark.dist
def test_a_fraction_of_an_epoch_and_epoch_intervals_are_the_runs_epochs_at_another_world_size(tmp_path):
    """num_train_epochs=2.5 with eval_strategy and logging_strategy "epoch", 1->2 ranks: the run's
    epochs have 16 steps (64 samples, its global batch of 4 kept), so it ends at step 40 and logs and
    evaluates at 16 and 32 (and the last step), not at this world size's 8-step epochs, where 2.5
    epochs were 20 steps. The resumed script sets its epoch strategies on rank 0 only (an
    ``if is_main_process`` switch): every rank counts with rank 0's arguments, or only rank 0 would
    enter the evaluations' collectives."""
    out, length = str(tmp_path / "out"), ["--epochs", "2.5", "--epoch-intervals", "--samples", "64"]
    interrupted = launch(HF_SCRIPT, [out, *length, "--kill-rank", "0", "--kill-step", "12"], tmp_path / "first",
                         nproc=1, timeout=180)
    assert interrupted.returncode != 0
    resumed = results(launch(HF_SCRIPT, [out, *length, "--resume", "--on-rank-0-only"], tmp_path / "then", nproc=2,
                             timeout=240))
    assert [r["steps"] for r in resumed] == [40, 40]
    history = resumed[0]["log_history"]
    rates = {e["step"]: e["learning_rate"] for e in history if "learning_rate" in e}
    assert sorted(rates) == [16, 32, 40]
    for step, rate in rates.items():
        assert rate == pytest.approx(1e-2 * (40 - step + 1) / 40, rel=1e-6), (step, rate)
    assert [e["step"] for e in history if "eval_loss" in e] == [16, 32, 40]
    assert [e["step"] for e in resumed[1]["log_history"] if "eval_loss" in e] == [16, 32, 40]
