#!/usr/bin/env python3
"""Fine-tune a small Llama-style model with LoRA adapters (PEFT) under DDPTrainer; export the adapters.

    torchrun --nproc-per-node 2 examples/finetune_hf_lora.py       # 2 processes (gloo on CPU, NCCL on GPUs)
    python examples/finetune_hf_lora.py --max-steps 20             # one process

The framework's settings are the recipe configs/hf_lora.toml (``--config`` names another); the
flags --max-steps, --seq-len, --batch-size, --learning-rate and --out override it.

The base model is a tiny LlamaConfig with random weights (nothing is downloaded), the data
data/tinyshakespeare.txt as bytes (token ids 0..255). Training uses non-reentrant activation
checkpointing of every decoder layer and the tiled MLP. At the end rank 0 writes the adapters with
``save_pretrained`` into OUT/adapters; ``PeftModel.from_pretrained(build_base(), "OUT/adapters")`` loads them.

With a real checkpoint, ``build_base`` returns ``AutoModelForCausalLM.from_pretrained(...)`` and the text
is tokenized with the model's tokenizer (see README: "Fine-tuning a transformers model with LoRA").
Needs the hf extra: ``pip install -e .[hf]``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout, installed or not

from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from framework import DDPTrainer  # noqa: E402
from framework.config import load_config_file  # noqa: E402
from framework.data.datasets import TokenWindows  # noqa: E402
from framework.model.gpt import lm_loss  # noqa: E402

SEED = 1337


def build_base(seq_len: int = 64, seed: int = SEED) -> LlamaForCausalLM:
    """The base model; every rank builds the same one from the same seed."""
    torch.manual_seed(seed)
    # A real checkpoint instead:  return AutoModelForCausalLM.from_pretrained("your/model-or-path")
    return LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq_len,
                                        use_cache=False, tie_word_embeddings=False))


def build_model(seq_len: int = 64, seed: int = SEED) -> PeftModel:
    """The base model with LoRA adapters on the attention's query and value projections."""
    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                      task_type="CAUSAL_LM")
    return get_peft_model(build_base(seq_len, seed), lora)


def byte_datasets(path: str | Path, seq_len: int) -> tuple[TokenWindows, TokenWindows]:
    """(inputs, targets) windows over the file's bytes: every offset of the first 90% for training,
    non-overlapping windows of the last 10% for validation. A real tokenizer's ids work the same."""
    tokens = np.frombuffer(Path(path).read_bytes(), dtype=np.uint8)
    split = int(0.9 * len(tokens))
    return TokenWindows(tokens[:split], seq_len, stride=1), TokenWindows(tokens[split:], seq_len, stride=seq_len)


def causal_lm_loss(output, targets: torch.Tensor) -> torch.Tensor:
    """The model returns a CausalLMOutput; the targets are the inputs shifted by one token."""
    return lm_loss(output.logits, targets)


def train_config(args: argparse.Namespace) -> dict:
    """The recipe's sections, with the flags given on the command line set over them."""
    config = load_config_file(args.config)
    section = config.setdefault
    if args.max_steps is not None:
        section("train", {})["max_steps"] = args.max_steps
        optim = section("optim", {})
        optim["warmup_steps"] = min(optim.get("warmup_steps", 0), args.max_steps // 10)
    if args.seq_len is not None:
        section("model", {})["seq_len"] = args.seq_len
    if args.batch_size is not None:
        section("data", {})["batch_size"] = args.batch_size
    if args.learning_rate is not None:
        section("optim", {})["lr"] = args.learning_rate
    if args.out is not None:
        out = Path(args.out)
        section("logging", {})["dir"] = str(out / "logs")
        section("checkpoint", {}).update(dir=str(out / "checkpoints"), export_dir=str(out / "adapters"))
    return config


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "hf_lora.toml"),
                        help="the framework's settings (default: configs/hf_lora.toml)")
    parser.add_argument("--max-steps", type=int, help="default: the recipe's train.max_steps (200)")
    parser.add_argument("--seq-len", type=int, help="default: the recipe's model.seq_len (64)")
    parser.add_argument("--batch-size", type=int, help="default: the recipe's data.batch_size (8)")
    parser.add_argument("--learning-rate", type=float, help="default: the recipe's optim.lr (3e-3)")
    parser.add_argument("--data", default=str(ROOT / "data" / "tinyshakespeare.txt"))
    parser.add_argument("--out", help="logs, checkpoints and the adapters (default: the recipe's, under "
                                      "runs/finetune_hf_lora)")
    return parser.parse_args(argv)


def run(argv: list[str] | None = None) -> tuple[PeftModel, dict]:
    """Train; returns the trained model and the run's summary."""
    args = parse_args(argv)
    config = train_config(args)
    seq_len = config.get("model", {}).get("seq_len", 64)
    model = build_model(seq_len)
    train, val = byte_datasets(args.data, seq_len)
    summary = DDPTrainer(config, model=model, train_dataset=train, val_dataset=val, loss_fn=causal_lm_loss).train()
    return model, summary


if __name__ == "__main__":
    _, summary = run()
    if int(os.environ.get("RANK", "0")) == 0:
        adapters = train_config(parse_args(None))["checkpoint"]["export_dir"]
        print("preempted: run the same command to resume" if summary["preempted"] else
              f"val loss {summary['final_val_loss']:.4f} after {summary['steps']} steps; adapters in {adapters}")
