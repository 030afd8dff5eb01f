"""Real data: tiny Shakespeare at nanoGPT's CPU size reaches val loss <= 2.5 within 300 steps."""

from pathlib import Path

import pytest

from framework import DDPTrainer
from framework.config import parse_command_line

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_nanogpt_cpu_size_300_steps(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    cfg, _ = parse_command_line(["--config", "configs/nanogpt_shakespeare_char.toml", "--train.max_steps", "300",
                                 "--eval.interval", "0", "--logging.tensorboard", "false",
                                 "--logging.dir", str(tmp_path / "logs"), "--checkpoint.dir", str(tmp_path / "ck")],
                                env={})
    m = cfg.model
    assert (m.num_layers, m.num_heads, m.hidden_size, m.seq_len, cfg.data.batch_size) == (4, 4, 128, 64, 12)
    summary = DDPTrainer(cfg).train()
    assert summary["steps"] == 300
    assert summary["final_val_loss"] <= 2.5, summary
