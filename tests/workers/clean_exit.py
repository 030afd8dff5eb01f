"""Run under torchrun with 2 gloo ranks: train a few steps with DDPTrainer and simply end.

No ``os._exit``: the process must end through the interpreter's own finalisation with exit code 0.
``CLEAN_EXIT_CASES`` (comma-separated, run in order in this one process) picks what runs:

  gpt     the built-in GPT, ``DDPTrainer(...).train()``
  lora    a tiny transformers LlamaForCausalLM under PEFT LoRA, as examples/finetune_hf_lora.py
  manual  the built-in GPT stepped by hand (forward_backward, optimizer_step), never closed, the
          trainer left in a module global: only the exit handlers can free its process group

After each ``train()`` and once more at exit (after the framework's exit handlers) every rank
prints the gloo threads still alive: a process group freed before the interpreter's finalisation
leaves none.
"""

from __future__ import annotations

import atexit
import glob
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from framework import DDPTrainer  # noqa: E402
from harness.launch import register_worker  # noqa: E402
from tests.tiny import tiny  # noqa: E402

STEPS = 3
KEPT: list[DDPTrainer] = []  # the manual case's trainer, alive until the interpreter's finalisation


def gloo_threads() -> list[str]:
    names = []
    for comm in glob.glob("/proc/self/task/*/comm"):
        try:
            names.append(Path(comm).read_text().strip())
        except OSError:  # the thread ended while listed
            continue
    return sorted(n for n in names if "gloo" in n)


def report(when: str) -> None:
    print(f"[clean_exit] rank {os.environ.get('RANK')} gloo threads {when}: {gloo_threads()}", flush=True)


def gpt(run_dir: str) -> None:
    summary = DDPTrainer(tiny(run_dir, {"train.max_steps": STEPS, "eval.interval": 0})).train()
    print(f"rank {os.environ.get('RANK')}: gpt trained {summary['steps']} steps", flush=True)


def lora(run_dir: str) -> None:
    sys.path.insert(0, str(ROOT / "examples"))
    from finetune_hf_lora import build_model, byte_datasets, causal_lm_loss, parse_args, train_config

    args = parse_args(["--max-steps", str(STEPS), "--seq-len", "16", "--batch-size", "2", "--out", run_dir])
    train, val = byte_datasets(ROOT / "data" / "tinyshakespeare.txt", args.seq_len)
    config = train_config(args)
    config["eval"]["steps"] = 1
    summary = DDPTrainer(config, model=build_model(args.seq_len), train_dataset=train, val_dataset=val,
                         loss_fn=causal_lm_loss).train()
    print(f"rank {os.environ.get('RANK')}: lora trained {summary['steps']} steps", flush=True)


def manual(run_dir: str) -> None:
    cfg = tiny(run_dir, {"train.max_steps": STEPS, "eval.interval": 0})
    trainer = DDPTrainer(cfg)
    generator = torch.Generator().manual_seed(int(os.environ.get("RANK", 0)))
    for _ in range(STEPS):
        tokens = torch.randint(0, cfg["vocab_size"], (cfg["batch_size"], cfg["seq_len"] + 1), generator=generator)
        trainer.optimizer_step(trainer.forward_backward([(tokens[:, :-1], tokens[:, 1:])]))
    KEPT.append(trainer)
    print(f"rank {os.environ.get('RANK')}: manual trained {STEPS} steps", flush=True)


def main() -> None:
    if "TEST_OUT_DIR" in os.environ:
        register_worker()
    atexit.register(report, "at exit")  # registered first: runs after the framework's exit handlers
    base = os.environ.get("TEST_OUT_DIR") or tempfile.gettempdir()
    for case in os.environ.get("CLEAN_EXIT_CASES", "gpt").split(","):
        run_dir = os.path.join(base, f"{case}_{os.environ.get('TORCHELASTIC_RUN_ID', 'local')}")
        {"gpt": gpt, "lora": lora, "manual": manual}[case](run_dir)
        report(f"after {case}")


if __name__ == "__main__":
    main()
