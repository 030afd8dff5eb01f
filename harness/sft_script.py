"""A TRL SFT script in the Kaggle 2xT4 guide's shape, and the tiny pieces the SFT tests share.

The script does what the guide's complete example does: it imports, calls
``dist.init_process_group`` itself, wraps the model in DDP by hand and hands ``model.module`` to
the trainer, sets ``save_strategy="steps" if is_main_process else "no"``, trains, lets rank 0
call ``save_pretrained`` and ends with ``dist.destroy_process_group()``. With ``--plain`` it
imports ``trl``'s SFTConfig and SFTTrainer, else ``framework.hf``'s: the one line that differs.

    torchrun --nproc-per-node 2 harness/sft_script.py OUT [--plain] [--max-steps N]
        [--kill-rank R --kill-step S] [--data text|prompt_completion|conversational] [--packing]

``--kill-*``: that rank sends itself SIGKILL after step S in the first start (restart 0). Each rank
writes result_rank{N}.json into TEST_OUT_DIR (default OUT): the trainable weights' sha256, the log
history, the steps, the restart count and whether this rank tokenised the data.

Nothing is downloaded: the tokenizer is a byte-level BPE trained here on a slice of Tiny
Shakespeare (or, without the file, a built-in text), the model a 2-layer Llama from a config.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

CHAT_TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
                 "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}"
                 "{% endgeneration %}{% else %}{{ message['content'] + '<|im_end|>' }}{% endif %}{{ '\n' }}"
                 "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
FALLBACK_TEXT = ("First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n\n"
                 "First Citizen:\nYou are all resolved rather to die than to famish?\n\nAll:\nResolved. resolved.\n\n")


def corpus() -> str:
    path = ROOT / "data" / "tinyshakespeare.txt"
    return path.read_text(encoding="utf-8")[:200_000] if path.exists() else FALLBACK_TEXT * 200


def build_tokenizer():
    """A byte-level BPE of 512 tokens with ChatML's special tokens and chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    text = corpus()
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    bpe = trainers.BpeTrainer(vocab_size=512, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<unk>", "<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"])
    tok.train_from_iterator([text[i:i + 1000] for i in range(0, len(text), 1000)], bpe)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", bos_token="<s>",
                                 eos_token="</s>")
    hf.chat_template = CHAT_TEMPLATE
    return hf


def build_model(tokenizer, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, use_cache=False))


def lora_config():
    from peft import LoraConfig

    return LoraConfig(r=8, lora_alpha=16, task_type="CAUSAL_LM",
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])


def passages(n: int) -> list[str]:
    parts = [p.strip() for p in corpus().split("\n\n") if len(p.strip()) > 20]
    return [parts[i % len(parts)] for i in range(n)]


def dataset(kind: str, n: int):
    """``text``: {"text"}; ``prompt_completion``: {"prompt", "completion"}; ``conversational``:
    {"messages"} with a user and an assistant turn."""
    import datasets

    rows = passages(n)
    if kind == "text":
        return datasets.Dataset.from_dict({"text": rows})
    heads = [r.split("\n", 1)[0] for r in rows]
    bodies = [r.split("\n", 1)[1] if "\n" in r else r for r in rows]
    if kind == "prompt_completion":
        return datasets.Dataset.from_dict({"prompt": [f"Who speaks? {h}\n" for h in heads], "completion": bodies})
    if kind == "conversational":
        return datasets.Dataset.from_dict({"messages": [
            [{"role": "user", "content": f"What does {h.rstrip(':')} say?"}, {"role": "assistant", "content": b}]
            for h, b in zip(heads, bodies, strict=True)]})
    raise ValueError(f"data kind {kind!r}")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--plain", action="store_true", help="trl's SFTTrainer instead of the drop-in")
    parser.add_argument("--max-steps", type=int, default=20)
    parser.add_argument("--save-steps", type=int, default=10)
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--data", default="text")
    parser.add_argument("--packing", action="store_true")
    parser.add_argument("--kill-rank", type=int, default=-1)
    parser.add_argument("--kill-step", type=int, default=-1)
    parser.add_argument("--same-save-strategy", action="store_true",
                        help="save_strategy 'steps' on every rank (the guide's per-rank one hangs trl)")
    parser.add_argument("--kill-mid-step", action="store_true",
                        help="die in the forward of the step after --kill-step (the peer saves alone)")
    return parser.parse_args(argv)


def config_kwargs(args: argparse.Namespace, is_main_process: bool) -> dict:
    """The guide's SFTConfig, save_strategy set on rank 0 only (unless --same-save-strategy)."""
    return dict(
        output_dir=args.out, per_device_train_batch_size=4, gradient_accumulation_steps=1,
        max_steps=args.max_steps, learning_rate=2e-3, logging_steps=5, max_length=64, packing=args.packing,
        save_strategy="steps" if is_main_process or args.same_save_strategy else "no", save_steps=args.save_steps,
        gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False},
        report_to="none", disable_tqdm=True, bf16=False, use_cpu=not torch.cuda.is_available(),
        ddp_find_unused_parameters=False)


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if args.plain:
        from trl import SFTConfig, SFTTrainer
    else:
        from framework.hf import SFTConfig, SFTTrainer
    import torch.distributed as dist
    from peft import get_peft_model
    from torch.nn.parallel import DistributedDataParallel as DDP
    from transformers import TrainerCallback

    from framework.resilience.consistency import model_sha256
    from harness.launch import register_worker, write_result

    # The guide's set-up, by hand.
    dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
    local_rank, rank = int(os.environ.get("LOCAL_RANK", 0)), dist.get_rank()
    is_main_process = rank == 0
    if "TEST_OUT_DIR" in os.environ:
        register_worker()
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")

    armed = []

    began_at = []

    class KillAt(TrainerCallback):
        def on_train_begin(self, targs, state, control, **kwargs):
            began_at.append(state.global_step)

        def on_step_end(self, targs, state, control, **kwargs):
            if (state.global_step == args.kill_step and rank == args.kill_rank
                    and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) == 0):
                if not args.kill_mid_step:
                    os.kill(os.getpid(), signal.SIGKILL)
                armed.append(True)

    def kill_in_forward(module, inputs):
        if armed:
            os.kill(os.getpid(), signal.SIGKILL)

    tokenizer = build_tokenizer()
    model = get_peft_model(build_model(tokenizer), lora_config()).to(device)
    model.register_forward_pre_hook(kill_in_forward)
    model = DDP(model, device_ids=[local_rank] if torch.cuda.is_available() else None)
    training_args = SFTConfig(**config_kwargs(args, is_main_process))
    sft_trainer = SFTTrainer(model=model.module, args=training_args, train_dataset=dataset(args.data, args.samples),
                         processing_class=tokenizer, callbacks=[KillAt()])
    start = time.perf_counter()
    sft_trainer.train()
    train_s = time.perf_counter() - start
    if is_main_process:
        sft_trainer.model.save_pretrained(os.path.join(args.out, "final_adapter"))
    write_result(Path(os.environ.get("TEST_OUT_DIR", args.out)), rank, {
        "sha256": model_sha256(sft_trainer.model), "log_history": sft_trainer.state.log_history,
        "steps": sft_trainer.state.global_step, "train_s": train_s,
        "restarts": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)), "began_at": began_at[0],
        "tokenised_here": getattr(sft_trainer, "tokenised_here", None)})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
