"""The TOML recipes in configs/: each is a valid configuration spelled in dotted keys (its
sections as tables), and the ones a CPU can run, run."""

import importlib.util
import json
import logging
from pathlib import Path

import pytest

from framework import DDPTrainer
from framework.config import load_config_file, parse_command_line

ROOT = Path(__file__).resolve().parents[2]
RECIPES = {"cpu_smoke", "gpu_node", "elastic_multinode", "hf_lora", "sft_lora", "nanogpt_shakespeare_char"}


def recipe(name: str) -> Path:
    return ROOT / "configs" / f"{name}.toml"


def test_the_recipes_are_the_documented_six():
    assert {p.stem for p in (ROOT / "configs").glob("*.toml")} == RECIPES


@pytest.mark.slow
def test_every_recipe_is_valid_in_dotted_keys_and_the_cpu_ones_run(tmp_path, caplog):
    """Each recipe passes the configuration's checks (what --check-config runs) with no
    deprecated spelling; then the CPU smoke test trains its 30 steps, checkpointing every 10, and
    examples/finetune_hf_lora.py reads configs/hf_lora.toml, its flags over it (tests/unit/state/test_export.py
    trains it 3 steps and loads its adapters). gpu_node needs GPUs and elastic_multinode several
    hosts: they are checked, not run; the Shakespeare recipe runs 300 steps in test_shakespeare.py."""
    for name in sorted(RECIPES):
        sections = load_config_file(recipe(name))
        assert all(isinstance(table, dict) for table in sections.values()), f"{name}: a key outside its section"
        with caplog.at_level(logging.WARNING):
            parse_command_line(["--config", str(recipe(name))])
        assert "deprecated" not in caplog.text, (name, caplog.text)

    cfg, _ = parse_command_line(["--config", str(recipe("cpu_smoke")), "--logging.dir", str(tmp_path / "logs"),
                                 "--checkpoint.dir", str(tmp_path / "ck")])
    summary = DDPTrainer(cfg).train()
    assert summary["steps"] == 30 and not summary["preempted"]
    assert summary["final_train_loss"] < summary["first_train_loss"]
    manifest = json.loads((tmp_path / "ck" / "manifest.json").read_text())
    assert {10, 20, 30} <= {entry["step"] for entry in manifest}

    pytest.importorskip("peft")
    spec = importlib.util.spec_from_file_location("finetune_hf_lora", ROOT / "examples" / "finetune_hf_lora.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    args = example.parse_args(["--max-steps", "3", "--seq-len", "32", "--out", str(tmp_path / "lora")])
    assert Path(args.config) == recipe("hf_lora")  # the example's default: tests/unit/state/test_export.py runs it
    config = example.train_config(args)
    assert config["memory"]["activation_checkpointing_modules"] == "LlamaDecoderLayer"  # the recipe's
    assert config["train"]["max_steps"] == 3 and config["optim"]["warmup_steps"] == 0  # the flags'
    assert config["checkpoint"]["export_dir"] == str(tmp_path / "lora" / "adapters")


@pytest.mark.slow
def test_the_sft_recipe_runs_through_the_drop_in_with_its_framework_settings(tmp_path):
    """examples/finetune_sft.py, a TRL SFTTrainer script with the import changed, trains 3 steps with
    configs/sft_lora.toml as its framework_config: the recipe's settings reach the engine (the MLPs
    are tiled, the timed checkpoints and the peer timeout are the recipe's), the SFTConfig's the rest."""
    pytest.importorskip("trl")
    pytest.importorskip("peft")
    spec = importlib.util.spec_from_file_location("finetune_sft", ROOT / "examples" / "finetune_sft.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    sft = example.trainer(["--max-steps", "3", "--out", str(tmp_path / "out")])
    assert sft.framework_config == str(recipe("sft_lora"))  # the example's default
    sft.train()
    assert sft.state.global_step == 3
    used = json.loads((tmp_path / "out" / "logs" / "config.json").read_text())  # the resolved config
    assert (used["memory"]["tiled_mlp_chunks"], used["checkpoint"]["every_minutes"]) == (2, 10.0)
    assert used["recovery"]["peer_timeout_s"] == 10.0
    assert used["data"]["batch_size"] == 4 and used["train"]["max_steps"] == 3  # the SFTConfig's
    mlps = [m for m in sft.model.modules() if type(m).__name__ == "LlamaMLP"]
    assert len(mlps) == 2 and all(getattr(m.forward, "func", None).__name__ == "_tiled_swiglu_forward" for m in mlps)
