"""A user's own training script, run under torchrun: a tiny Llama with PEFT LoRA on dict batches,
trained with the user's SGD-with-momentum optimizer, OneCycleLR and a stateful callback.
Rank 0 writes the summary and the callback's state to TEST_OUT_DIR/result.json.

usage: torchrun ... tests/workers/user_pieces.py RUN_DIR [FAULT_SPEC]
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from torch.utils.data import Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from framework import DDPTrainer  # noqa: E402

STEPS = 40


class TokenDicts(Dataset):
    """Dict samples as a transformers model takes them: input_ids and labels; each sequence counts
    up from a random start, so there is something to learn."""

    def __init__(self, n: int, seed: int):
        starts = torch.randint(0, 64, (n, 1), generator=torch.Generator().manual_seed(seed))
        self.tokens = (starts + torch.arange(16)) % 64

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, i):
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


class LossTally:
    """A callback with a state: the steps it saw and the sum of their losses."""

    def __init__(self):
        self.steps, self.loss_sum = 0, 0.0

    def on_step_end(self, trainer, step, metrics):
        self.steps += 1
        self.loss_sum += metrics["loss"]

    def state_dict(self):
        return {"steps": self.steps, "loss_sum": self.loss_sum}

    def load_state_dict(self, state):
        self.steps, self.loss_sum = state["steps"], state["loss_sum"]


def lora_llama() -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=2))
    return get_peft_model(base, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                           target_modules=["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"]))


def main(run_dir: Path, fault: str) -> None:
    cfg = {"batch_size": 4, "train.max_steps": STEPS, "checkpoint.every_steps": 8, "log_interval": 1,
           "eval.interval": 0, "eval.steps": 2, "num_workers": 0, "logging.tensorboard": False, "target_loss": 0.0,
           "train.deterministic": True, "train.seed": 3, "recovery.fault_inject": fault,
           "logging.record_samples": True, "logging.dir": str(run_dir / "logs"), "checkpoint.dir": str(run_dir / "ck")}
    tally = LossTally()
    trainer = DDPTrainer(cfg, model=lora_llama(), train_dataset=TokenDicts(256, 1), val_dataset=TokenDicts(32, 2),
                         optimizer=lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
                         lr_scheduler=lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.2,
                                                                                      total_steps=STEPS),
                         callbacks=[tally])
    summary = trainer.train()
    if trainer.env.rank == 0:
        (run_dir / "result.json").write_text(json.dumps({"summary": summary, "tally": tally.state_dict(),
                                                         "lr": trainer.optimizer.param_groups[0]["lr"]}))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "")
    sys.stdout.flush()
    os._exit(0)
