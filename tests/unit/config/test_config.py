"""Configuration: sources, precedence, validation and the CLI's exit code 2 (all in-process)."""

import json

import pytest

import ddp_training
from framework.config import (ALIASES, FIELD_DOCS, KEYS, ConfigError, TrainConfig, TrainSection, build_config, get,
                              parse_command_line, resolve_config)

SPEC_DEFAULTS = dict(vocab_size=10000, hidden_size=512, num_layers=6, num_heads=8, dropout=0.1, batch_size=32,
                     learning_rate=1e-4, weight_decay=0.01, num_epochs=10, dataset_size=10000, seq_len=128,
                     pin_memory=True, log_interval=10, save_interval=5, memory_check_interval=50,
                     cleanup_interval=100, max_errors_per_epoch=5, max_memory_gb=16.0, target_loss=0.01)
ADDED_KEYS = ["seed", "data", "max_steps", "gradient_accumulation_steps", "warmup_steps", "min_lr", "grad_clip",
              "eval_interval", "eval_steps", "log_dir", "checkpoint_dir", "amp_dtype", "tie_embeddings",
              "deterministic", "backend", "timeout_s", "use_amp"]


def run_main(argv, capsys):
    try:
        code = ddp_training.main(argv)
    except SystemExit as exc:
        code = exc.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_spec_defaults_and_added_keys():
    cfg = TrainConfig()
    for key, value in SPEC_DEFAULTS.items():
        assert get(cfg, ALIASES[key]) == value, key
    assert set(ADDED_KEYS) <= set(ALIASES)
    assert cfg.precision.autocast == "auto"


def test_every_field_has_a_docstring():
    assert set(FIELD_DOCS) == set(KEYS)
    assert all(len(doc) > 10 for doc in FIELD_DOCS.values())


def test_precedence_file_env_cli(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[model]\nhidden_size = 256\nnum_layers = 3\n[data]\nbatch_size = 8\n')
    env = {"DDP_MODEL__NUM_LAYERS": "4", "DDP_DATA__BATCH_SIZE": "16", "UNRELATED": "x"}
    cfg, actions = parse_command_line(["--config", str(path), "--data.batch_size", "24", "--precision.autocast=false"],
                                      env=env)
    assert (cfg.model.hidden_size, cfg.model.num_layers, cfg.data.batch_size, cfg.precision.autocast) == (
        256, 4, 24, "false")
    assert actions == set()


def test_json_config_file(tmp_path):
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"model": {"hidden_size": 64, "num_heads": 4}, "model.tie_embeddings": True}))
    cfg, _ = parse_command_line(["--config", str(path)], env={})
    assert (cfg.model.hidden_size, cfg.model.num_heads, cfg.model.tie_embeddings) == (64, 4, True)


def test_dict_and_dataclass_accepted():
    assert resolve_config({"model": {"hidden_size": 64, "num_heads": 2}}).model.hidden_size == 64
    assert resolve_config({"model.hidden_size": 64, "model.num_heads": 2}).model.hidden_size == 64
    assert resolve_config(TrainConfig(train=TrainSection(seed=3))).train.seed == 3
    with pytest.raises(ConfigError, match="did you mean 'model.hidden_size'"):
        resolve_config({"model": {"hiden_size": 64}})
    with pytest.raises(ConfigError, match="did you mean 'model.hidden_size'"):
        resolve_config({"hiden_size": 64})


def test_all_problems_listed_at_once():
    with pytest.raises(ConfigError) as err:
        build_config({"model": {"hidden_sise": 5, "dropout": 1.5, "hidden_size": 30, "num_heads": 4},
                      "data": {"batch_size": "many"}, "ddp": {"backend": "mpi"}}, env={})
    problems = err.value.problems
    assert len(problems) == 5, problems
    text = "\n".join(problems)
    for needle in ("unknown key 'model.hidden_sise'; did you mean 'model.hidden_size'",
                   "model.dropout=1.5: must be <= 0.999", "data.batch_size='many': expected an integer",
                   "ddp.backend='mpi': allowed: auto, gloo, nccl",
                   "model.hidden_size=30: must be divisible by model.num_heads=4"):
        assert needle in text


@pytest.mark.parametrize("argv, needle", [
    (["--hiden-size", "3"], "unknown key 'hiden_size'; did you mean 'model.hidden_size'?"),
    (["--data.batch_size", "0"], "data.batch_size=0: must be >= 1"),
    (["--data.batch_size", "2.5"], "data.batch_size='2.5': expected an integer"),
    (["--optim.lr", "fast"], "optim.lr='fast': expected a number"),
    (["--optim.lr", "nan"], "expected a finite number"),
    (["--precision.autocast", "maybe"], "precision.autocast='maybe': allowed: auto, true, false"),
    (["--data.pin_memory", "yess"], "data.pin_memory='yess': allowed: true or false"),
    (["--precision.dtype", "fp8"], "allowed: bf16, fp16"),
    (["--data.source", "missing.txt"], "data.source='missing.txt': file not found"),
    (["--data.source", "corpus.csv"], "allowed: synthetic, a .txt file or a .bin file"),
    (["--optim.min_lr", "1", "--optim.lr", "0.1"], "optim.min_lr=1.0: must be <= optim.lr=0.1"),
    (["--model.seq_len"], "--model.seq-len needs a value"),
    (["positional"], "unexpected argument 'positional'"),
    (["--config", "nope.toml"], "--config nope.toml: file not found"),
    (["--ddp.backend", "nccl"], "ddp.backend='nccl': needs CUDA"),
    (["--precision.autocast", "true", "--precision.dtype", "fp16"], "precision.dtype='fp16': needs CUDA"),
    (["--recovery.step_timeout_s", "1e12"], "recovery.step_timeout_s=1000000000000.0: must be <= 86400.0"),
    (["--ddp.timeout_s", "1e9"], "ddp.timeout_s=1000000000.0: must be <= 86400.0"),
    (["--recovery.step_timeout_factor", "1e300"], "recovery.step_timeout_factor=1e+300: must be <= 1000.0"),
    (["--logging.dir", "README.md/logs"], "logging.dir='README.md/logs': cannot be created: README.md is a file"),
    (["--checkpoint.dir", "README.md"], "checkpoint.dir='README.md': cannot be created: README.md is a file"),
])
def test_cli_bad_input_exits_2_with_one_line(argv, needle, capsys, monkeypatch):
    monkeypatch.setattr("framework.config.checks._cuda_available", lambda: False)
    code, out, err = run_main(argv, capsys)
    assert code == 2
    assert needle in err
    assert "Traceback" not in err
    assert all(line.startswith("error: ") for line in err.strip().splitlines())


def test_bad_environment_variable_exits_2(capsys, monkeypatch):
    monkeypatch.setenv("DDP_DATA__BATCH_SIZE", "-1")
    monkeypatch.setenv("DDP_SEQLEN", "5")
    code, _, err = run_main(["--check-config"], capsys)
    assert code == 2
    assert "data.batch_size=-1: must be >= 1" in err
    assert "environment: unknown key 'seqlen'; did you mean 'model.seq_len'?" in err


def test_bad_config_file_exits_2(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text("hidden_size = \n")
    code, _, err = run_main(["--config", str(bad)], capsys)
    assert code == 2 and "cannot parse" in err and "Traceback" not in err
    typed = tmp_path / "typed.toml"
    typed.write_text('[model]\nnum_layers = "six"\n')
    code, _, err = run_main(["--config", str(typed)], capsys)
    assert code == 2 and f"config file {typed}: model.num_layers='six': expected an integer" in err


def test_check_config_ok_and_help(capsys):
    code, _, err = run_main(["--check-config", "--model.hidden_size", "64"], capsys)
    assert code == 0 and "configuration is valid" in err
    code, out, _ = run_main(["--help"], capsys)
    assert code == 0
    for key in KEYS:
        assert f"--{key} " in out
        assert FIELD_DOCS[key] in out


def test_shipped_config_files_parse():
    from pathlib import Path
    files = sorted(Path(__file__).resolve().parents[3].glob("configs/*.toml"))
    assert files
    for path in files:
        cfg, _ = parse_command_line(["--config", str(path)], env={})
        assert isinstance(cfg, TrainConfig)


def test_docs_config_table_matches_docstrings():
    from pathlib import Path
    from framework.config import markdown_table
    page = (Path(__file__).resolve().parents[3] / "docs" / "configuration.md").read_text()
    table = page.split("<!-- config-table:start -->\n")[1].split("\n<!-- config-table:end -->")[0]
    assert table == markdown_table()


def test_num_workers_is_auto_by_default_and_by_name(capsys):
    from framework.config import AUTO, markdown_table
    assert TrainConfig().data.num_workers == AUTO
    for spelled in ("auto", " Auto ", AUTO, str(AUTO)):
        assert build_config({"data": {"num_workers": spelled}}, env={}).data.num_workers == AUTO, spelled
    assert build_config({"data": {"num_workers": 3}}, env={}).data.num_workers == 3
    assert "auto" in FIELD_DOCS["data.num_workers"]
    assert "| `data.num_workers` | int\\|auto | `auto` |" in markdown_table()
    code, _, err = run_main(["--check-config", "--data.num_workers", "auto"], capsys)
    assert code == 0, err
    code, _, err = run_main(["--check-config", "--data.num_workers", "-2"], capsys)
    assert code == 2 and "error: data.num_workers=-2: must be >= 0 (or auto)" in err, err
    code, _, err = run_main(["--check-config", "--data.num_workers", "many"], capsys)
    assert code == 2 and "data.num_workers='many': expected an integer or auto" in err, err


def test_the_keys_that_apply_to_a_run():
    from framework.config import KEYS, applicable_keys, as_dict, non_default
    gpt = {"model.hidden_size", "model.num_layers", "model.num_heads", "model.dropout", "model.tie_embeddings"}
    tokens = {"model.vocab_size", "model.seq_len"}  # the built-in data's too
    data = {"data.source", "data.synthetic_size"}
    assert applicable_keys() == KEYS
    assert set(KEYS) - set(applicable_keys(builtin_model=False)) == gpt
    assert set(KEYS) - set(applicable_keys(builtin_data=False)) == data
    assert set(KEYS) - set(applicable_keys(builtin_model=False, builtin_data=False)) == gpt | tokens | data
    cfg = resolve_config({"model": {"hidden_size": 64, "num_heads": 2, "seq_len": 16}, "data": {"batch_size": 4}})
    assert non_default(cfg) == {"model.hidden_size": 64, "model.num_heads": 2, "model.seq_len": 16,
                                "data.batch_size": 4}
    assert non_default(cfg, builtin_model=False) == {"model.seq_len": 16, "data.batch_size": 4}
    assert non_default(cfg, builtin_model=False, builtin_data=False) == {"data.batch_size": 4}
    user = as_dict(cfg, builtin_model=False, builtin_data=False)
    assert "model" not in user and set(user["data"]) == {k.split(".")[1] for k in KEYS if k.startswith("data.")} - {
        "source", "synthetic_size"}
    assert as_dict(cfg, builtin_model=False)["model"] == {"vocab_size": 10000, "seq_len": 16}
    assert as_dict(cfg) == as_dict(cfg, builtin_model=True, builtin_data=True)


def test_operator_overrides_for_ddp_settings():
    cfg = build_config(env={"DDP_STATIC_GRAPH": "1", "DDP_FIND_UNUSED_PARAMETERS": "0"})
    assert (cfg.ddp.static_graph, cfg.ddp.find_unused_parameters) == ("true", "false")


def test_fault_inject_spec_is_validated(capsys):
    code, _, err = run_main(["--recovery.fault_inject", "explode@step=3"], capsys)
    assert code == 2 and "unknown kind 'explode'" in err
    code, _, err = run_main(["--recovery.fault-inject", "nan@rank=1"], capsys)
    assert code == 2 and "needs step=N" in err


def _bad_data_files(d):
    """The data files of the bad-input cases below, made in ``d``."""
    import numpy as np
    np.arange(1001, dtype=np.uint16).tofile(d / "odd.bin")
    with (d / "odd.bin").open("ab") as f:
        f.write(b"x")  # 2003 bytes: half a token at the end
    (d / "empty.bin").write_bytes(b"")
    np.arange(1000, dtype=np.uint16).tofile(d / "ids.bin")
    (d / "empty.txt").write_text("")
    (d / "short.txt").write_text("abcdefghij" * 5)  # 50 tokens: the 10% validation split has 5 < seq_len + 1
    (d / "small.txt").write_text("abcdefghij" * 12)  # 120 tokens: 100 training windows of 9 tokens
    (d / "latin1.txt").write_bytes("caf\xe9 ".encode("latin-1") * 40)
    (d / "far.json").write_text("[5, 99999]")
    (d / "many.json").write_text(json.dumps(list(range(10))))


# Each case: flags (FILE is replaced by the file's path), an environment, and what the one error line must say.
BAD_INPUTS = [
    (["--data.synthetic_size", "8", "--data.batch_size", "32"], {},
     "data.synthetic_size=8: fewer than one global batch of 32 samples (data.batch_size=32 x "
     "data.gradient_accumulation_steps=1 x world size 1); allowed: data.synthetic_size >= 32"),
    (["--data.synthetic_size", "40", "--data.batch_size", "8", "--data.gradient_accumulation_steps", "8"], {},
     "data.synthetic_size=40: fewer than one global batch of 64 samples"),
    (["--data.synthetic_size", "40", "--data.batch_size", "16"], {"WORLD_SIZE": "4"},
     "data.synthetic_size=40: fewer than one global batch of 64 samples (data.batch_size=16 x "
     "data.gradient_accumulation_steps=1 x world size 4)"),
    (["--data.source", "FILE/odd.bin", "--model.vocab_size", "2000"], {},
     "odd.bin': 2003 bytes, not a whole number of 2-byte tokens; allowed: a .bin file of uint16 token ids"),
    (["--data.source", "FILE/empty.bin"], {}, "empty.bin': 0 tokens; with model.seq_len=8 it needs at least 81"),
    (["--data.source", "FILE/empty.txt"], {}, "empty.txt': 0 tokens; with model.seq_len=8 it needs at least 81"),
    (["--data.source", "FILE/short.txt"], {}, "short.txt': 50 tokens; with model.seq_len=8 it needs at least 81"),
    (["--data.source", "FILE/ids.bin", "--model.vocab_size", "50"], {},
     "model.vocab_size=50: data.source='FILE/ids.bin' holds token id 999; allowed: model.vocab_size >= 1000"),
    (["--data.source", "FILE/latin1.txt"], {}, "latin1.txt': not UTF-8 text"),
    (["--data.source", "FILE/small.txt", "--data.batch_size", "128"], {},
     "small.txt': its 100 training windows are fewer than one global batch of 128 samples"),
    (["--data.exclude_samples", "FILE/far.json", "--data.synthetic_size", "100"], {},
     "data.exclude_samples='FILE/far.json': sample index 99999 is outside the 100 training samples; "
     "allowed: indices 0 to 99"),
    (["--data.exclude_samples", "FILE/many.json", "--data.synthetic_size", "40", "--data.batch_size", "32"], {},
     "data.exclude_samples='FILE/many.json': excluding 10 of the 40 training samples leaves 30, fewer than one "
     "global batch of 32 samples"),
]


@pytest.mark.parametrize("argv, env, needle", BAD_INPUTS,
                         ids=[f"{i}:{' '.join(c[0][:2])}" for i, c in enumerate(BAD_INPUTS)])
def test_bad_data_input_refused_at_check_config(argv, env, needle, tmp_path, capsys, monkeypatch):
    """Inputs that passed --check-config and then failed with a traceback on every restart."""
    _bad_data_files(tmp_path)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    argv = [a.replace("FILE", str(tmp_path)) for a in argv]
    common = ["--model.seq_len", "8", "--data.batch_size", "2", "--logging.dir", str(tmp_path / "l"),
              "--checkpoint.dir", str(tmp_path / "c")]
    code, out, err = run_main(["--check-config", *common, *argv], capsys)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert needle.replace("FILE", str(tmp_path)) in lines[0]
    assert not (tmp_path / "c").exists() and not (tmp_path / "l").exists()


def test_data_that_just_fits_passes_check_config(tmp_path, capsys, monkeypatch):
    _bad_data_files(tmp_path)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    common = ["--check-config", "--model.seq_len", "8", "--logging.dir", str(tmp_path / "l")]
    for argv in (["--data.synthetic_size", "32", "--data.batch_size", "32"],
                 ["--data.source", str(tmp_path / "small.txt"), "--data.batch_size", "100"],
                 ["--data.source", str(tmp_path / "ids.bin"), "--model.vocab_size", "1000"],
                 ["--data.exclude_samples", str(tmp_path / "many.json"), "--data.synthetic_size", "42",
                  "--data.batch_size", "32"]):
        code, _, err = run_main(common + argv, capsys)
        assert code == 0, (argv, err)
