#!/usr/bin/env python3
"""Fine-tune with TRL's SFTTrainer API, trained by the framework: a script written for TRL with its
import changed, LoRA adapters on a small Llama-style model, Tiny Shakespeare as text.

    torchrun --nproc-per-node 2 examples/finetune_sft.py       # 2 processes (gloo on CPU, NCCL on GPUs)
    python examples/finetune_sft.py --max-steps 20             # one process

The SFTConfig below is TRL's; the framework's settings it has no field for (the MLP tiling, timed
checkpoints, the peer timeout) come from the recipe configs/sft_lora.toml (``--config`` names
another), passed as ``framework_config``. At the end rank 0 writes the adapters into OUT with
``trainer.save_model()``; a kill or a preemption resumes from OUT/checkpoints on the next start.

Nothing is downloaded: the tokenizer is a byte-level BPE trained here on the text, the model a
2-layer Llama from a config. With a real model: ``AutoTokenizer.from_pretrained(...)`` and
``AutoModelForCausalLM.from_pretrained(...)``. Needs the trl extra: ``pip install -e .[trl]``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout, installed or not
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from peft import LoraConfig  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: E402

from framework.hf import SFTConfig, SFTTrainer  # was: from trl import SFTConfig, SFTTrainer  # noqa: E402


def texts(path: Path, size: int = 400) -> list[str]:
    """The file cut into pieces of about ``size`` characters, at line ends."""
    out, piece = [], ""
    for line in path.read_text(encoding="utf-8")[:200_000].splitlines(keepends=True):
        piece += line
        if len(piece) >= size:
            out.append(piece)
            piece = ""
    return out


def build_tokenizer(lines: list[str]) -> PreTrainedTokenizerFast:
    """A byte-level BPE of 512 tokens trained on ``lines``; every rank trains the same one."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=512, special_tokens=["<unk>", "<pad>", "</s>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="</s>")


def build_model(tokenizer, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, use_cache=False))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "sft_lora.toml"),
                        help="the framework's settings (default: configs/sft_lora.toml)")
    parser.add_argument("--max-steps", type=int, default=200)
    parser.add_argument("--data", default=str(ROOT / "data" / "tinyshakespeare.txt"))
    parser.add_argument("--out", default="runs/finetune_sft", help="checkpoints, logs and the adapters")
    return parser.parse_args(argv)


def trainer(argv: list[str] | None = None) -> SFTTrainer:
    """The script up to ``train()``: the data, the tokenizer, the model and TRL's SFTConfig."""
    args = parse_args(argv)
    lines = texts(Path(args.data))
    tokenizer = build_tokenizer(lines)
    on_gpu = torch.cuda.is_available()
    config = SFTConfig(output_dir=args.out, per_device_train_batch_size=4, max_steps=args.max_steps, max_length=128,
                       learning_rate=2e-3, warmup_steps=min(10, args.max_steps // 10), logging_steps=10,
                       save_strategy="steps", save_steps=50, report_to="none", use_cpu=not on_gpu,
                       bf16=on_gpu and torch.cuda.is_bf16_supported(), gradient_checkpointing=True)
    lora = LoraConfig(r=8, lora_alpha=16, task_type="CAUSAL_LM", target_modules=["q_proj", "v_proj"])
    return SFTTrainer(model=build_model(tokenizer), args=config, train_dataset=Dataset.from_dict({"text": lines}),
                      processing_class=tokenizer, peft_config=lora, framework_config=args.config)


if __name__ == "__main__":
    sft = trainer()
    sft.train()
    sft.save_model()  # rank 0 writes the adapters into --out
    if sft.is_world_process_zero():
        print(f"trained {sft.state.global_step} steps; adapters in {sft.args.output_dir}")
