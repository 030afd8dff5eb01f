#!/usr/bin/env python3
"""Fine-tune a small Llama-style model with LoRA adapters (PEFT) under DDPTrainer; export the adapters.

    torchrun --nproc-per-node 2 examples/finetune_hf_lora.py       # 2 processes (gloo on CPU, NCCL on GPUs)
    python examples/finetune_hf_lora.py --max-steps 20             # one process

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
    out = Path(args.out)
    return {
        "model": {"seq_len": args.seq_len},
        "data": {"batch_size": args.batch_size, "num_workers": 0},
        "optim": {"lr": args.learning_rate, "warmup_steps": min(10, args.max_steps // 10), "weight_decay": 0.0},
        "train": {"max_steps": args.max_steps, "num_epochs": 1, "target_loss": 0.0},
        "memory": {"activation_checkpointing": "non_reentrant", "activation_checkpointing_modules": "LlamaDecoderLayer",
                   "tiled_mlp_chunks": 2, "tiled_mlp_modules": "LlamaMLP"},
        "eval": {"interval": 0, "steps": 8},
        "logging": {"interval": 10, "dir": str(out / "logs")},
        "checkpoint": {"dir": str(out / "checkpoints"), "export_dir": str(out / "adapters")},
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max-steps", type=int, default=200)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    parser.add_argument("--data", default=str(ROOT / "data" / "tinyshakespeare.txt"))
    parser.add_argument("--out", default="runs/finetune_hf_lora", help="logs, checkpoints and the adapters")
    return parser.parse_args(argv)


def run(argv: list[str] | None = None) -> tuple[PeftModel, dict]:
    """Train; returns the trained model and the run's summary."""
    args = parse_args(argv)
    model = build_model(args.seq_len)
    train, val = byte_datasets(args.data, args.seq_len)
    summary = DDPTrainer(train_config(args), model=model, train_dataset=train, val_dataset=val,
                         loss_fn=causal_lm_loss).train()
    return model, summary


if __name__ == "__main__":
    _, summary = run()
    if int(os.environ.get("RANK", "0")) == 0:
        adapters = Path(parse_args(None).out) / "adapters"
        print("preempted: run the same command to resume" if summary["preempted"] else
              f"val loss {summary['final_val_loss']:.4f} after {summary['steps']} steps; adapters in {adapters}")
