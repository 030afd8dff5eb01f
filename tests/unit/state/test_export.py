"""The safetensors export of the final weights: PEFT adapters, a full transformers model, the built-in
GPT, any module with tied weights; written at the end of a finished run and not after a preemption;
atomic; safetensors optional; and the LoRA fine-tuning example at world size 1."""

import errno
import importlib.util
import json
import logging
import sys

import pytest
import torch

from framework import ConfigError, DDPTrainer
from framework.config import build_config
from framework.state.export import ALIASES, CONFIG, WEIGHTS, export_model, load_exported, load_weights
from framework.model.gpt import GPT, GPTConfig
from tests.tiny import TINY, tiny
from tests.dist_helper import ROOT



def logits_of(model, ids: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        out = model(ids)
    return getattr(out, "logits", out)


# --- the built-in GPT and any other module -------------------------------------------------------

def test_trainer_exports_the_gpt_at_the_end_and_load_exported_rebuilds_it(tmp_path):
    trainer = DDPTrainer(tiny(tmp_path, {"train.max_steps": 3, "model.tie_embeddings": True}))
    summary = trainer.train()
    export_dir = tmp_path / "ck" / "export"  # the default: checkpoint_dir/export
    assert sorted(p.name for p in export_dir.iterdir()) == [".framework_export.json", CONFIG, WEIGHTS]
    assert json.loads((export_dir / ".framework_export.json").read_text())["files"] == [CONFIG, WEIGHTS]
    assert (tmp_path / "ck" / "final_model.pt").is_file()
    config = json.loads((export_dir / CONFIG).read_text())
    assert config["model"] == "framework.model.GPT" and config["tie_embeddings"] is True
    loaded = load_exported(export_dir)
    assert loaded.cfg == GPTConfig.from_train_config(trainer.config)
    assert loaded.lm_head.weight is loaded.tok_emb.weight  # still tied
    ids = torch.randint(0, 32, (2, 16), generator=torch.Generator().manual_seed(0))
    assert torch.equal(logits_of(loaded, ids), logits_of(trainer.raw_model, ids))
    from safetensors.torch import load_model
    plain = GPT(loaded.cfg)
    load_model(plain, str(export_dir / WEIGHTS))  # safetensors' own loader reads it too
    assert torch.equal(logits_of(plain, ids), logits_of(loaded, ids))
    assert summary["steps"] == 3
    assert "exported the final weights" in (tmp_path / "logs" / "rank_0.log").read_text()


class Shared(torch.nn.Module):
    """A tied weight, and a buffer that is a partial view of a parameter: both refused by safetensors."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.b = torch.nn.Linear(4, 4)
        self.b.weight = self.a.weight
        self.register_buffer("row", self.a.bias.data[:2])
        self.register_buffer("empty", torch.zeros(0))

    def forward(self, x):
        return self.b(self.a(x)) + self.row.sum()


def test_any_module_with_shared_tensors_round_trips(tmp_path):
    torch.manual_seed(0)
    model = Shared()
    assert export_model(model, tmp_path / "out") == WEIGHTS
    from safetensors import safe_open
    with safe_open(str(tmp_path / "out" / WEIGHTS), framework="pt") as f:
        assert json.loads(f.metadata()[ALIASES]) == {"b.weight": "a.weight"}
    torch.manual_seed(1)
    fresh = Shared()
    fresh.load_state_dict(load_weights(tmp_path / "out" / WEIGHTS), strict=True)
    x = torch.randn(3, 4)
    assert torch.equal(fresh(x), model(x))
    with pytest.raises(ValueError, match="not an export of framework.model.GPT"):
        (tmp_path / "out" / CONFIG).write_text("{}")
        load_exported(tmp_path / "out")


def test_a_re_export_replaces_only_its_own_files_and_a_failed_one_changes_nothing(tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("the user's")
    export_model(GPT(GPTConfig(vocab_size=8, hidden_size=8, num_layers=1, num_heads=2, seq_len=4)), out)
    assert sorted(p.name for p in out.iterdir()) == [".framework_export.json", CONFIG, WEIGHTS, "notes.txt"]
    (out / ".framework_export.partial.x1y2z3").mkdir()  # left by a crash
    export_model(torch.nn.Linear(2, 3), out)  # writes no config.json: the first export's is removed
    assert sorted(p.name for p in out.iterdir()) == [".framework_export.json", WEIGHTS, "notes.txt"]
    assert load_weights(out / WEIGHTS)["weight"].shape == (3, 2)
    assert (out / "notes.txt").read_text() == "the user's"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    before = (out / WEIGHTS).read_bytes()

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("framework.state.export.save_weights", disk_full)
    with pytest.raises(OSError, match="No space"):
        export_model(torch.nn.Linear(2, 4), out)
    assert sorted(p.name for p in out.iterdir()) == [".framework_export.json", WEIGHTS, "notes.txt"]
    assert (out / WEIGHTS).read_bytes() == before


def test_an_export_never_replaces_a_file_it_did_not_write(tmp_path, caplog):
    out = tmp_path / "out"
    out.mkdir()
    (out / CONFIG).write_text("the user's")  # --check-config refuses this; it may appear during the run
    with caplog.at_level(logging.WARNING):
        export_model(GPT(GPTConfig(vocab_size=8, hidden_size=8, num_layers=1, num_heads=2, seq_len=4)), out)
    assert (out / CONFIG).read_text() == "the user's" and (out / WEIGHTS).is_file()
    assert f"{out / CONFIG} exists and no earlier export wrote it: not replaced" in caplog.text
    export_model(torch.nn.Linear(2, 3), out)
    assert (out / CONFIG).read_text() == "the user's"


def test_the_nested_layout_keeps_checkpoints_and_logs_and_a_re_export_replaces_its_own(tmp_path):
    run = tmp_path / "runs" / "x"
    run.mkdir(parents=True)
    (run / "notes.txt").write_text("the user's")
    cfg = tiny(tmp_path, {"train.max_steps": 4, "checkpoint.every_steps": 2, "checkpoint.export_dir": str(run),
                          "checkpoint.dir": str(run / "checkpoints"), "logging.dir": str(run / "logs")})
    DDPTrainer(cfg).train()
    first = (run / WEIGHTS).read_bytes()
    DDPTrainer({**cfg, "train.max_steps": 6}).train()  # resumes from step 4 and exports again
    assert (run / WEIGHTS).read_bytes() != first
    assert load_exported(run).cfg.hidden_size == 32
    checkpoints = {p.name for p in (run / "checkpoints").iterdir()}
    assert {"manifest.json", "final_model.pt", "step_00000004.pt", "step_00000006.pt"} <= checkpoints
    logs = {p.name for p in (run / "logs").iterdir()}
    assert {"rank_0.log", "metrics.jsonl", "summary.json", "config.json"} <= logs
    assert json.loads((run / "logs" / "summary.json").read_text())["steps"] == 6
    assert (run / "notes.txt").read_text() == "the user's"
    assert {p.name for p in run.iterdir()} == {".framework_export.json", CONFIG, WEIGHTS, "checkpoints", "logs",
                                               "notes.txt"}


def test_export_dir_dot_exports_into_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    DDPTrainer({**TINY, "train.max_steps": 2, "checkpoint.export_dir": ".", "checkpoint.dir": "ck",
                "logging.dir": "logs"}).train()
    assert load_exported(tmp_path).cfg.hidden_size == 32
    assert (tmp_path / "ck" / "final_model.pt").is_file() and (tmp_path / "logs" / "summary.json").is_file()


@pytest.mark.parametrize("case", ["same as log_dir", "default same as log_dir", "holds a config.json",
                                  "holds a model.safetensors"])
def test_an_export_dir_overlap_it_cannot_honour_exits_2_at_check_config(tmp_path, capsys, case):
    import ddp_training
    ck, logs, out = tmp_path / "ck", tmp_path / "logs", tmp_path / "out"
    args = {"same as log_dir": ["--checkpoint.export_dir", str(logs)],
            "default same as log_dir": [],
            "holds a config.json": ["--checkpoint.export_dir", str(out)],
            "holds a model.safetensors": ["--checkpoint.export_dir", str(out)]}[case]
    if case == "default same as log_dir":
        logs = ck / "export"
    if case.startswith("holds"):
        out.mkdir()
        (out / case.split()[-1]).write_text("the user's")
    with pytest.raises(SystemExit) as exit_:
        ddp_training.main(["--check-config", "--checkpoint.dir", str(ck), "--logging.dir", str(logs), *args])
    assert exit_.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: checkpoint.export_dir="), lines
    expected = {"same as log_dir": f"and logging.dir={str(logs)!r} are the same directory",
                "default same as log_dir": f"and logging.dir={str(logs)!r} are the same directory",
                "holds a config.json": "holds config.json, which no earlier export wrote",
                "holds a model.safetensors": "holds model.safetensors, which no earlier export wrote"}[case]
    assert expected in lines[0]
    assert not ck.exists()


# --- when the trainer exports ----------------------------------------------------------------------

def test_no_export_after_a_preemption(tmp_path):
    summary = DDPTrainer(tiny(tmp_path, {"train.max_steps": 10, "recovery.fault_inject": "sigterm@step=2"})).train()
    assert summary["preempted"] and summary["steps"] < 10
    assert (tmp_path / "ck" / "PREEMPTED").is_file()
    assert not (tmp_path / "ck" / "export").exists() and not (tmp_path / "ck" / "final_model.pt").exists()


def test_export_dir_none_turns_it_off_and_a_set_one_is_used(tmp_path):
    DDPTrainer(tiny(tmp_path, {"train.max_steps": 1, "checkpoint.export_dir": "none"})).train()
    assert (tmp_path / "ck" / "final_model.pt").is_file() and not (tmp_path / "ck" / "export").exists()
    DDPTrainer(tiny(tmp_path, {"train.max_steps": 1, "checkpoint.resume": "none",
                               "checkpoint.export_dir": str(tmp_path / "mine")})).train()
    assert (tmp_path / "mine" / WEIGHTS).is_file() and not (tmp_path / "ck" / "export").exists()


def test_without_safetensors_one_warning_and_no_export(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "safetensors", None)  # import fails, find_spec says absent
    assert importlib.util.find_spec("safetensors") is None
    DDPTrainer(tiny(tmp_path, {"train.max_steps": 1})).train()
    log = (tmp_path / "logs" / "rank_0.log").read_text()
    assert log.count("safetensors is not installed") == 1 and "pip install -e .[hf]" in log
    assert (tmp_path / "ck" / "final_model.pt").is_file() and not (tmp_path / "ck" / "export").exists()


def test_without_safetensors_an_explicit_export_dir_is_a_config_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "safetensors", None)
    with pytest.raises(ConfigError) as err:
        build_config({"checkpoint.export_dir": str(tmp_path / "out")}, env={})
    assert len(err.value.problems) == 1 and "pip install -e .[hf]" in err.value.problems[0]
    import ddp_training
    with pytest.raises(SystemExit) as exit_:
        ddp_training.main(["--check-config", "--checkpoint.export_dir", str(tmp_path / "out"),
                           "--logging.dir", str(tmp_path)])
    assert exit_.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: checkpoint.export_dir=")


# --- transformers and PEFT ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def example():
    """examples/finetune_hf_lora.py as a module (it needs transformers and peft)."""
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    spec = importlib.util.spec_from_file_location("finetune_hf_lora", ROOT / "examples" / "finetune_hf_lora.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def lora_run(example, tmp_path_factory):
    """The example at world size 1 for 3 steps: (trained model, summary, output directory)."""
    out = tmp_path_factory.mktemp("lora")
    model, summary = example.run(["--max-steps", "3", "--seq-len", "32", "--batch-size", "4", "--out", str(out)])
    return model, summary, out


@pytest.mark.slow
def test_the_example_fine_tunes_and_exports_only_the_adapters(lora_run):
    _, summary, out = lora_run
    assert summary["steps"] == 3 and not summary["preempted"]
    assert summary["final_train_loss"] < summary["first_train_loss"]
    adapters = out / "adapters"
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in adapters.iterdir()}
    assert not (adapters / WEIGHTS).exists()
    from safetensors import safe_open
    with safe_open(str(adapters / "adapter_model.safetensors"), framework="pt") as f:
        keys = list(f.keys())
    assert keys and all("lora_" in k for k in keys)


@pytest.mark.slow
def test_exported_adapters_load_onto_a_fresh_base_with_the_same_logits(example, lora_run):
    from peft import PeftModel
    model, _, out = lora_run
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    trained = logits_of(model, ids)
    loaded = PeftModel.from_pretrained(example.build_base(32), out / "adapters")
    assert (logits_of(loaded, ids) - trained).abs().max().item() <= 1e-6
    untrained = logits_of(example.build_model(32), ids)
    assert (untrained - trained).abs().max().item() > 1e-4  # the adapters did train


def test_a_full_transformers_model_exports_through_save_pretrained(example, tmp_path):
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16,
                                         use_cache=False, tie_word_embeddings=True))
    train, val = example.byte_datasets(ROOT / "data" / "tinyshakespeare.txt", 16)
    DDPTrainer(tiny(tmp_path, {"train.max_steps": 2}, batch_size=4), model=model, train_dataset=train, val_dataset=val,
               loss_fn=example.causal_lm_loss).train()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "ck" / "export")
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    assert (logits_of(loaded, ids) - logits_of(model, ids)).abs().max().item() <= 1e-6


@pytest.mark.parametrize("error", [OSError(errno.ENOSPC, "No space left on device"),
                                   RuntimeError("Error while serializing: I/O error: No space left on device "
                                                "(os error 28)")])  # safetensors' own
def test_a_full_disk_at_the_final_weights_is_a_fatal_error_naming_the_directories(tmp_path, monkeypatch, error):
    """A full disk while writing final_model.pt or the export fails the same way after a restart:
    a FatalError naming the directories (an explorer trial, full_disk at the export, ended with a
    bare traceback after every restart once the final checkpoint was no longer written again)."""
    from types import SimpleNamespace

    from framework.resilience.markers import FatalError
    from framework.state import export

    def full(*args, **kwargs):
        raise error
    monkeypatch.setattr(export.atomic, "torch_save", full)
    cfg = SimpleNamespace(checkpoint=SimpleNamespace(dir=str(tmp_path), export_dir=""))
    with pytest.raises(FatalError, match=r"checkpoint.dir=.*No space left on device while writing the final weights"):
        export.save_final_weights(torch.nn.Linear(2, 2), cfg)
    monkeypatch.setattr(export.atomic, "torch_save", lambda *a, **k: (_ for _ in ()).throw(OSError(errno.EIO, "x")))
    with pytest.raises(OSError):  # another error is passed on as it is
        export.save_final_weights(torch.nn.Linear(2, 2), cfg)
