"""The sectioned configuration: nested and dotted keys in every source, today's flat keys as
deprecated aliases, each field's resume class, and resuming from a checkpoint whose config is flat."""

import json
import logging
import os
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from framework.config import (ALIASES, COMPACT, FIELDS, KEYS, RESUME, RESUME_CLASSES, SECTIONS, ConfigError, as_dict,
                              build_config, dotted, parse_command_line, resolve_config)
from framework.config.schema import TYPES

ROOT = Path(__file__).resolve().parents[3]

# The flat keys of the config before sections (framework 0.x, 83 fields), in their order then.
FLAT_KEYS = (
    "vocab_size hidden_size num_layers num_heads dropout tie_embeddings seq_len gradient_checkpointing "
    "checkpoint_modules tiled_mlp_chunks tiled_mlp_modules data dataset_size batch_size gradient_accumulation_steps "
    "num_workers pin_memory learning_rate min_lr warmup_steps beta1 beta2 weight_decay optimizer_impl grad_clip "
    "num_epochs max_steps target_loss seed deterministic use_amp amp_dtype eval_interval eval_steps log_interval "
    "log_dir tensorboard progress_bar memory_check_interval cleanup_interval max_memory_gb checkpoint_dir export_dir "
    "save_interval max_errors_per_epoch save_every_steps keep_last resume record_samples fault_inject "
    "agree_nonfinite consistency_check_interval step_timeout_s step_timeout_factor max_loader_restarts oom_recovery "
    "max_no_progress_restarts straggler_interval straggler_threshold straggler_min_ms straggler_patience "
    "straggler_action spike_guard spike_threshold spike_warmup spike_window max_rollbacks spike_lr_cooldown "
    "exclude_samples backend timeout_s init_timeout_s ddp_static_graph find_unused_parameters bucket_cap_mb "
    "gradient_as_bucket_view broadcast_buffers compile compile_mode compile_backend ddp_comm_hook powersgd_rank "
    "powersgd_start_iter").split()

# resume.py's hand-written classes before each field declared its own (the behaviour to keep).
OLD_REFUSED = ("seed", "data", "dataset_size")
OLD_NEUTRAL = frozenset((
    "log_dir checkpoint_dir resume log_interval tensorboard progress_bar memory_check_interval max_memory_gb "
    "eval_interval eval_steps save_interval save_every_steps keep_last record_samples fault_inject step_timeout_s "
    "step_timeout_factor timeout_s num_workers max_loader_restarts consistency_check_interval cleanup_interval "
    "max_errors_per_epoch backend pin_memory oom_recovery target_loss num_epochs max_steps ddp_static_graph "
    "find_unused_parameters gradient_as_bucket_view bucket_cap_mb checkpoint_modules export_dir "
    "max_no_progress_restarts spike_guard spike_threshold spike_warmup spike_window max_rollbacks spike_lr_cooldown "
    "exclude_samples straggler_interval straggler_threshold straggler_min_ms straggler_patience straggler_action "
    "init_timeout_s compile compile_mode compile_backend").split())

# Values other than the defaults that pass --check-config on a CPU machine.
SPECIAL = {"data": "synthetic", "export_dir": "none", "resume": "none", "exclude_samples": "", "fault_inject": "",
           "checkpoint_modules": "Layer", "tiled_mlp_modules": "LlamaMLP", "backend": "gloo",
           "compile_backend": "eager", "spike_guard": "off", "use_amp": "false"}


def non_default(flat: str, tmp_path: Path):
    """A valid value of ``flat`` other than its default."""
    if flat in ("log_dir", "checkpoint_dir"):
        return str(tmp_path / flat)
    if flat in SPECIAL:
        return SPECIAL[flat]
    key = ALIASES[flat]
    f, tp = FIELDS[key], TYPES[key]
    if tp is bool:
        return not f.default
    if typing.get_origin(tp) is typing.Literal:
        return [c for c in typing.get_args(tp) if c != f.default][-1]
    lo, hi = f.metadata["bounds"]
    step = 1 if tp is int else 0.5
    return f.default + step if hi is None or f.default + step <= hi else f.default - step / 5000


def toml_value(value) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else json.dumps(value)


def flat_and_sectioned_files(tmp_path: Path) -> tuple[Path, Path, dict]:
    values = {flat: non_default(flat, tmp_path) for flat in FLAT_KEYS}
    flat = tmp_path / "flat.toml"
    flat.write_text("".join(f"{k} = {toml_value(v)}\n" for k, v in values.items()))
    lines = []
    for section in SECTIONS:
        lines.append(f"[{section}]")
        lines += [f"{ALIASES[k].split('.')[1]} = {toml_value(v)}" for k, v in values.items()
                  if ALIASES[k].startswith(section + ".")]
    sectioned = tmp_path / "sectioned.toml"
    sectioned.write_text("\n".join(lines) + "\n")
    return flat, sectioned, values


@pytest.fixture
def fresh_notes(monkeypatch):
    """The deprecation notes are given once per key and process: start each test without any."""
    monkeypatch.setattr("framework.config.sources._NOTED", set())


def test_every_flat_key_is_an_alias_of_one_field():
    added = {key for key in KEYS if FIELDS[key].metadata["was"] is None}  # keys added since: no old name
    assert added == {"train.loss_average", "data.world_size_change", "data.global_batch_size",
                     "checkpoint.save_on_peer_loss", "checkpoint.every_minutes", "recovery.peer_timeout_s",
                     "recovery.heal"}
    assert len(FLAT_KEYS) == 83 == len(KEYS) - len(added)
    assert sorted(ALIASES) == sorted(FLAT_KEYS)
    assert sorted(ALIASES.values()) == sorted(set(KEYS) - added)


def test_a_file_of_every_flat_key_loads_as_its_sectioned_form(tmp_path, fresh_notes, caplog):
    flat, sectioned, values = flat_and_sectioned_files(tmp_path)
    with caplog.at_level(logging.WARNING, logger="framework.config"):
        old = build_config(file=flat, env={})
    new = build_config(file=sectioned, env={})
    assert as_dict(old) == as_dict(new)
    assert as_dict(new) != as_dict(build_config(env={}))
    for flat_key, value in values.items():
        assert dotted(as_dict(new))[ALIASES[flat_key]] == value, flat_key
    notes = "\n".join(r.getMessage() for r in caplog.records)
    assert len(caplog.records) == 83 - len(COMPACT) == 62  # the original API's 21 keys are first-class
    for flat_key in FLAT_KEYS:
        noted = f"'{flat_key}' is deprecated, use '{ALIASES[flat_key]}'" in notes
        assert noted == (flat_key not in COMPACT), flat_key


def test_check_config_on_a_flat_file_exits_0_with_one_note_per_key(tmp_path):
    flat, _, _ = flat_and_sectioned_files(tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDP_") and k != "WORLD_SIZE"}
    out = subprocess.run([sys.executable, str(ROOT / "ddp_training.py"), "--check-config", "--config", str(flat)],
                         capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    notes = [line for line in out.stderr.splitlines() if "is deprecated" in line]
    assert len(notes) == 62, out.stderr
    assert f"config file {flat}: 'spike_threshold' is deprecated, use 'spike.threshold' (the flat key still works)" \
        in notes
    assert out.stdout.strip() == str(tmp_path / "checkpoint_dir")


def test_a_sectioned_run_prints_no_deprecation(tmp_path):
    _, sectioned, _ = flat_and_sectioned_files(tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDP_") and k != "WORLD_SIZE"}
    out = subprocess.run([sys.executable, str(ROOT / "ddp_training.py"), "--check-config", "--config",
                          str(sectioned), "--spike.threshold", "7"], capture_output=True, text=True, cwd=ROOT,
                         env=env, timeout=120)
    assert out.returncode == 0 and "deprecated" not in out.stderr, out.stderr


def test_flat_aliases_in_flags_env_and_dicts(fresh_notes, caplog):
    with caplog.at_level(logging.WARNING, logger="framework.config"):
        cfg, _ = parse_command_line(["--spike-threshold", "7", "--straggler_interval=9", "--data", "synthetic"],
                                    env={"DDP_SAVE_INTERVAL": "2", "DDP_COMPILE_MODE": "max-autotune"})
        from_dict = resolve_config({"learning_rate": 0.5, "compile": False, "max_memory_gb": 3})
        resolve_config({"learning_rate": 0.25})  # noted once per key
    assert (cfg.spike.threshold, cfg.straggler.interval, cfg.data.source) == (7.0, 9, "synthetic")
    assert (cfg.checkpoint.every_epochs, cfg.compile.mode) == (2, "max-autotune")
    assert (from_dict.optim.lr, from_dict.compile.enabled, from_dict.memory.max_gb) == (0.5, False, 3.0)
    notes = [r.getMessage() for r in caplog.records]
    assert "command line: 'spike_threshold' is deprecated, use 'spike.threshold' (the flat key still works)" in notes
    # save_interval, learning_rate and max_memory_gb are the original API's compact keys: no note
    assert not [n for n in notes if any(f"'{k}'" in n for k in ("save_interval", "learning_rate", "max_memory_gb"))]
    assert "command line: 'straggler_interval' is deprecated, use 'straggler.interval' (the flat key still works)" \
        in notes
    assert len(notes) == 5 and len(set(notes)) == 5, notes  # 5 deprecated flat keys, each noted once


def test_nested_and_dotted_keys_in_every_source(tmp_path, fresh_notes, caplog):
    toml = tmp_path / "run.toml"
    toml.write_text('straggler.interval = 7\n[spike]\nthreshold = 6.5\n[ddp]\ncomm_hook = "bf16"\n')
    js = tmp_path / "run.json"
    js.write_text(json.dumps({"spike": {"threshold": 4.5}, "straggler.patience": 5}))
    with caplog.at_level(logging.WARNING, logger="framework.config"):
        a = build_config(file=toml, env={"DDP_STRAGGLER__MIN_MS": "2.5", "DDP_STATIC_GRAPH": "1"})
        b, _ = parse_command_line(["--config", str(js), "--spike.window", "9", "--eval.interval=3",
                                   "--spike.lr-cooldown", "4"], env={})
        c = resolve_config({"spike": {"guard": "off"}, "train.seed": 5})
    assert (a.straggler.interval, a.spike.threshold, a.ddp.comm_hook, a.straggler.min_ms) == (7, 6.5, "bf16", 2.5)
    assert a.ddp.static_graph == "true"  # the operator's override, not deprecated
    assert (b.spike.threshold, b.straggler.patience, b.spike.window, b.eval.interval, b.spike.lr_cooldown) == (
        4.5, 5, 9, 3, 4)
    assert (c.spike.guard, c.train.seed) == ("off", 5)
    assert not caplog.records


@pytest.mark.parametrize("source", ["dict", "file", "env"])
def test_a_flat_alias_and_its_new_key_with_different_values_is_an_error(source, tmp_path):
    if source == "dict":
        run = lambda: build_config({"spike": {"threshold": 6}, "spike_threshold": 5}, env={})  # noqa: E731
    elif source == "file":
        (tmp_path / "c.toml").write_text("spike_threshold = 5\n[spike]\nthreshold = 6\n")
        run = lambda: build_config(file=tmp_path / "c.toml", env={})  # noqa: E731
    else:
        run = lambda: build_config(env={"DDP_SPIKE_THRESHOLD": "5", "DDP_SPIKE__THRESHOLD": "6"})  # noqa: E731
    with pytest.raises(ConfigError) as err:
        run()
    [problem] = err.value.problems
    assert "spike_threshold=5.0" in problem and "spike.threshold=6.0" in problem
    assert "('spike_threshold' is the old name of 'spike.threshold'); allowed: one of them" in problem
    assert build_config({"spike.threshold": 6, "spike_threshold": 6}, env={}).spike.threshold == 6.0


def test_on_the_command_line_the_later_flag_wins():
    cfg, _ = parse_command_line(["--data.batch_size", "16", "--batch-size", "8"], env={})
    assert cfg.data.batch_size == 8


def test_unknown_keys_suggest_sectioned_names():
    with pytest.raises(ConfigError) as err:
        build_config({"spike_treshold": 5, "spike": {"treshold": 5}, "sppike.threshold": 5}, env={})
    assert err.value.problems == [
        "config: unknown key 'spike_treshold'; did you mean 'spike.threshold'?",
        "config: unknown key 'spike.treshold'; did you mean 'spike.threshold'?",
        "config: unknown key 'sppike.threshold'; did you mean 'spike.threshold'?"]


def test_every_field_declares_its_resume_class_as_before():
    assert set(RESUME) == set(KEYS) and set(RESUME.values()) <= set(RESUME_CLASSES)
    for flat, key in ALIASES.items():
        expected = ("refused" if flat == "seed" else "refused_builtin_data" if flat in OLD_REFUSED
                    else "neutral" if flat in OLD_NEUTRAL else "changes")
        assert RESUME[key] == expected, (flat, key)


def test_config_changes_read_a_flat_saved_config():
    from framework.state.checkpointer import config_changes
    cfg = resolve_config({"optim": {"lr": 0.5}, "spike": {"threshold": 9}, "train": {"seed": 2}})
    flat = {flat: dotted(as_dict(resolve_config(None)))[key] for flat, key in ALIASES.items()}
    flat["some_key_of_a_newer_version"] = 1
    refused, changed = config_changes(flat, cfg, builtin_data=True)
    assert refused == ["train.seed: 1337 -> 2"]
    assert changed == ["optim.lr: 0.0001 -> 0.5"]
    assert config_changes(as_dict(resolve_config(None)), cfg, builtin_data=True) == (refused, changed)
    data = resolve_config({"data": {"synthetic_size": 99}})
    assert config_changes(flat, data, builtin_data=True)[0] == ["data.synthetic_size: 10000 -> 99"]
    assert config_changes(flat, data, builtin_data=False) == ([], [])


def test_config_changes_ignore_the_keys_that_do_not_apply():
    """A checkpoint that saved every key (as before a user's run left the built-in ones out),
    resumed by a user's model: the built-in GPT's keys it changes are not the run's changes."""
    from framework.state.checkpointer import config_changes
    saved = as_dict(resolve_config(None))
    cfg = resolve_config({"model": {"hidden_size": 64, "num_heads": 2, "seq_len": 16}, "optim": {"lr": 0.5}})
    assert config_changes(saved, cfg, builtin_data=True)[1] == [
        "model.hidden_size: 512 -> 64", "model.num_heads: 8 -> 2", "model.seq_len: 128 -> 16",
        "optim.lr: 0.0001 -> 0.5"]
    assert config_changes(saved, cfg, builtin_data=True, builtin_model=False)[1] == [
        "model.seq_len: 128 -> 16", "optim.lr: 0.0001 -> 0.5"]
    assert config_changes(saved, cfg, builtin_data=False, builtin_model=False)[1] == ["optim.lr: 0.0001 -> 0.5"]


TINY = {"model": {"vocab_size": 32, "hidden_size": 32, "num_layers": 1, "num_heads": 2, "seq_len": 16,
                  "dropout": 0.0},
        "data": {"synthetic_size": 128, "batch_size": 8, "num_workers": 0}, "optim": {"lr": 3e-3},
        "train": {"target_loss": 0.0}, "eval": {"steps": 2, "interval": 0},
        "logging": {"interval": 2, "tensorboard": False}}


def test_resume_from_a_checkpoint_whose_config_is_flat(tmp_path, caplog):
    """A checkpoint written before sections stores its config flat: a resume maps it through the
    aliases, so an unchanged config resumes, a changed lr is named, and a changed seed is refused."""
    import torch

    from framework import DDPTrainer
    from framework.state.checkpoint_files import CheckpointError

    def sectioned(**sections):  # the config nested by section, as a checkpoint holds it
        cfg = {name: dict(values) for name, values in TINY.items()}
        for name, values in sections.items():
            cfg.setdefault(name, {}).update(values)
        cfg["logging"]["dir"] = str(tmp_path / "logs")
        cfg["checkpoint"] = {"dir": str(tmp_path / "ck"), **cfg.get("checkpoint", {})}
        return cfg

    DDPTrainer(sectioned(train={"max_steps": 2}, checkpoint={"every_steps": 2})).train()
    state = torch.load(tmp_path / "ck" / "step_00000002.pt", weights_only=True)
    assert state["config"]["spike"]["threshold"] == 6.0  # written nested now
    state["config"] = {flat: dotted(state["config"])[key] for flat, key in ALIASES.items()}  # as 0.x wrote it
    old = tmp_path / "flat_config_step_2.pt"
    torch.save(state, old)

    with caplog.at_level(logging.WARNING, logger="framework.state.checkpointer"):
        trainer = DDPTrainer(sectioned(train={"max_steps": 4}, checkpoint={"resume": str(old)}))
    assert trainer.step == 2
    assert not [r for r in caplog.records if "changed configuration" in r.getMessage()]
    assert trainer.train()["steps"] == 4
    with caplog.at_level(logging.WARNING, logger="framework.state.checkpointer"):
        DDPTrainer(sectioned(train={"max_steps": 4}, optim={"lr": 1e-3}, checkpoint={"resume": str(old)})).close()
    assert "optim.lr: 0.003 -> 0.001" in caplog.text
    with pytest.raises(CheckpointError, match=r"train\.seed: 1337 -> 7"):
        DDPTrainer(sectioned(train={"max_steps": 4, "seed": 7}, checkpoint={"resume": str(old)}))
