"""A transformers.Trainer LoRA script, as a user writes it, for tests and bench/hf_peer.py: run
with ``--plain`` it uses ``transformers.Trainer``, else ``framework.hf.Trainer`` (the one import
that differs). A tiny Llama (random weights, nothing downloaded) learns byte sequences with a
constant stride, so the loss falls within tens of steps.

    torchrun --nproc-per-node 2 -m harness.hf_script OUT [--plain] [--reentrant]
        [--max-steps N | --epochs E] [--resume] [--epoch-intervals [--on-rank-0-only]]
        [--kill-rank R --kill-step S]

``--kill-*``: the rank sends itself SIGKILL after step S in the first start (restart 0) (torchrun's
restart count 0). Each rank writes result_rank{N}.json into TEST_OUT_DIR (default OUT): the
trainable weights' sha256, the log history, the steps done and the restart count."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

import torch


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--plain", action="store_true", help="transformers.Trainer instead of the drop-in")
    parser.add_argument("--reentrant", action="store_true", help="gradient_checkpointing use_reentrant=True")
    parser.add_argument("--max-steps", type=int, default=20)
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--kill-rank", type=int, default=-1)
    parser.add_argument("--kill-step", type=int, default=-1)
    parser.add_argument("--epochs", type=float, default=0, help="num_train_epochs (max_steps -1) instead of max-steps")
    parser.add_argument("--resume", action="store_true", help="resume_from_checkpoint=True")
    parser.add_argument("--epoch-intervals", action="store_true", help='eval and logging_strategy="epoch"')
    parser.add_argument("--on-rank-0-only", action="store_true",
                        help="--epoch-intervals on rank 0 only (a script's `if is_main_process` switch)")
    return parser.parse_args(argv)


class StrideBytes(torch.utils.data.Dataset):
    """Sequences ``start, start+1, start+2, ...`` mod 256 from random starts: the next byte follows
    from the last one, which adapters on a random base model learn within tens of steps."""

    def __init__(self, n: int, seq_len: int = 32, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, 256, (n, 1), generator=g)
        self.ids = (start + torch.arange(seq_len)) % 256

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "attention_mask": torch.ones_like(self.ids[i]), "labels": self.ids[i]}


def build_model():
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                        use_cache=False))
    lora = LoraConfig(r=8, lora_alpha=16, task_type="CAUSAL_LM",
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    return get_peft_model(base, lora)


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    from framework.resilience.consistency import model_sha256
    from harness.launch import register_worker, write_result

    register_worker()
    if args.plain:
        from transformers import Trainer
    else:
        from framework.hf import Trainer
    from transformers import TrainerCallback, TrainingArguments

    class KillAt(TrainerCallback):
        def on_step_end(self, targs, state, control, **kwargs):
            if (state.global_step == args.kill_step and int(os.environ.get("RANK", 0)) == args.kill_rank
                    and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) == 0):
                os.kill(os.getpid(), signal.SIGKILL)

    training_args = TrainingArguments(
        output_dir=args.out, per_device_train_batch_size=4, learning_rate=1e-2,
        **({"max_steps": -1, "num_train_epochs": args.epochs} if args.epochs else {"max_steps": args.max_steps}),
        logging_steps=5, save_steps=5, gradient_checkpointing=True,
        **({"eval_strategy": "epoch", "logging_strategy": "epoch"}
           if args.epoch_intervals and (not args.on_rank_0_only or int(os.environ.get("RANK", 0)) == 0) else {}),
        gradient_checkpointing_kwargs={"use_reentrant": args.reentrant}, report_to="none", disable_tqdm=True,
        use_cpu=not torch.cuda.is_available())  # transformers 5 on CPU runs DDP under torchrun only with use_cpu
    model = build_model()
    hf_trainer = Trainer(model=model, args=training_args, train_dataset=StrideBytes(args.samples),
                      eval_dataset=StrideBytes(64, seed=1), callbacks=[KillAt()])
    start = time.perf_counter()
    hf_trainer.train(resume_from_checkpoint=True if args.resume else None)
    train_s = time.perf_counter() - start
    rank = int(os.environ.get("RANK", 0))
    write_result(Path(os.environ.get("TEST_OUT_DIR", args.out)), rank, {
        "sha256": model_sha256(model), "log_history": hf_trainer.state.log_history,
        "steps": hf_trainer.state.global_step, "train_s": train_s,
        "restarts": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))})
    sys.stdout.flush()


if __name__ == "__main__":
    main()
