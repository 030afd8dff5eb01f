#!/usr/bin/env python3
"""A transformers.Trainer script run through the drop-in (``framework.hf.Trainer``): the explorer's
HF trials. A tiny Llama built from a config (random weights, nothing downloaded) learns
harness/hf_script.py's stride bytes, fully fine-tuned (no adapters).

    python bench/explore_hf.py --out DIR [--max-steps N] [--samples N] [--save-steps N]
        [--save-total-limit N] [--checkpointing off|non_reentrant|reentrant] [--resume none|auto]
        [--eval-steps N] [--save-model DIR]

alone or under torchrun. ``--resume auto`` is ``train(resume_from_checkpoint=True)`` (a user's
relaunch); ``none`` starts afresh (a torchrun restart of this launch still continues its own
checkpoints). output_dir holds checkpoints/ and logs/ (summary.json, metrics.jsonl, rank_N.log).
``--eval-steps N`` evaluates every N steps (and at the end); ``--save-model DIR`` ends the script
with ``trainer.save_model(DIR)``, as a fine-tuner's script ends.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

LAUNCHER_PID = os.getppid()
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--max-steps", type=int, default=10)
    parser.add_argument("--samples", type=int, default=48)
    parser.add_argument("--save-steps", type=int, default=4, help="0: no periodic checkpoint")
    parser.add_argument("--save-total-limit", type=int, default=3)
    parser.add_argument("--checkpointing", choices=("off", "non_reentrant", "reentrant"), default="off")
    parser.add_argument("--resume", choices=("none", "auto"), default="none")
    parser.add_argument("--seed", type=int, default=5)
    parser.add_argument("--eval-steps", type=int, default=0, help="0: no evaluation")
    parser.add_argument("--save-model", default="", help="a folder for trainer.save_model at the end")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse(argv)
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

    from framework.hf import Trainer
    from harness.hf_script import StrideBytes
    from framework.trainer import FatalError

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16,
                                         use_cache=False))
    checkpointing = args.checkpointing != "off"
    training_args = TrainingArguments(
        output_dir=args.out, per_device_train_batch_size=4, max_steps=args.max_steps, learning_rate=2e-3,
        logging_steps=1, save_strategy="steps" if args.save_steps else "no", save_steps=args.save_steps or 500,
        save_total_limit=args.save_total_limit, seed=args.seed, gradient_checkpointing=checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": args.checkpointing == "reentrant"} if checkpointing else None,
        report_to="none", disable_tqdm=True, use_cpu=not torch.cuda.is_available(),
        eval_strategy="steps" if args.eval_steps else "no", eval_steps=args.eval_steps or None)
    trainer = Trainer(model=model, args=training_args, train_dataset=StrideBytes(args.samples, seq_len=16),
                      eval_dataset=StrideBytes(8, seq_len=16, seed=1) if args.eval_steps else None)
    try:
        output = trainer.train(resume_from_checkpoint=True if args.resume == "auto" else None)
        if args.save_model and output.global_step == args.max_steps:  # not after a preemption
            trainer.save_model(args.save_model)
    except FatalError as err:
        print(f"fatal: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    if "TORCHELASTIC_RUN_ID" in os.environ:
        from framework.ddp.process_group import die_with_parent
        die_with_parent(LAUNCHER_PID)
    code = main(sys.argv[1:])
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
