#!/usr/bin/env python3
"""Attention precision on CPU under bf16 autocast, at the nanoGPT CPU size (batch 6, 4 heads,
context 64, head size 32; 1 thread).

torch 2.13's CPU flash attention (``scaled_dot_product_attention``) is far slower in bf16 than in
fp32, which made bf16 autocast barely faster than fp32 for the built-in GPT. The GPT therefore
attends in fp32 on CPU (framework/model/gpt.py). This script measures, interleaved and repeated:

  sdpa_fp32        the kernel alone, fp32 inputs, forward + backward
  sdpa_bf16        the same in bf16
  sdpa_bf16_fp32   bf16 inputs cast to fp32 around the kernel (what the GPT does)
  gpt_fp32         a whole GPT step (forward, backward, fused AdamW), fp32
  gpt_bf16         the same under bf16 autocast, attention in fp32 (the framework)
  gpt_bf16_attn    the same, attention left in bf16 (the GPT before this change)

and prints the medians and their ratios; JSON in bench/results/attention.json.

usage: python bench/attention.py [--repeats N] [--iters N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from framework.model import gpt  # noqa: E402

B, HEADS, T, HEAD_SIZE = 6, 4, 64, 32


def sdpa_case(dtype: torch.dtype, upcast: bool):
    q, k, v = (torch.randn(B, HEADS, T, HEAD_SIZE, dtype=dtype, requires_grad=True) for _ in range(3))
    grad = torch.randn(B, HEADS, T, HEAD_SIZE, dtype=dtype)

    def run():
        inputs = (t.float() for t in (q, k, v)) if upcast else (q, k, v)
        F.scaled_dot_product_attention(*inputs, is_causal=True).to(dtype).backward(grad)
    return run


def gpt_case(amp: bool, bf16_attention: bool = False):
    torch.manual_seed(0)
    model = gpt.GPT(gpt.GPTConfig(vocab_size=65, seq_len=T, hidden_size=HEADS * HEAD_SIZE, num_layers=4,
                                  num_heads=HEADS))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    idx = torch.randint(0, 65, (B, T + 1))

    def run():
        if bf16_attention:  # attend in autocast's dtype, as a plain call of the kernel would
            gpt.CausalSelfAttention.forward = _bf16_attention_forward
        try:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
                loss = gpt.lm_loss(model(idx[:, :-1]), idx[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        finally:
            gpt.CausalSelfAttention.forward = _FORWARD
    return run


_FORWARD = gpt.CausalSelfAttention.forward


def _bf16_attention_forward(self, x):
    Bx, Tx, C = x.shape
    q, k, v = self.qkv(x).split(C, dim=2)
    q, k, v = (t.view(Bx, Tx, self.num_heads, C // self.num_heads).transpose(1, 2) for t in (q, k, v))
    y = self._attend(q, k, v).transpose(1, 2).contiguous().view(Bx, Tx, C)
    return self.resid_drop(self.proj(y))


def time_ms(fn, iters: int) -> float:
    for _ in range(5):
        fn()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters * 1e3


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "attention.json"))
    args = p.parse_args()
    torch.set_num_threads(1)
    cases = {"sdpa_fp32": sdpa_case(torch.float32, False), "sdpa_bf16": sdpa_case(torch.bfloat16, False),
             "sdpa_bf16_fp32": sdpa_case(torch.bfloat16, True), "gpt_fp32": gpt_case(False),
             "gpt_bf16": gpt_case(True), "gpt_bf16_attn": gpt_case(True, bf16_attention=True)}
    runs = {name: [] for name in cases}
    for _ in range(args.repeats):
        for name, fn in cases.items():
            runs[name].append(time_ms(fn, args.iters))
    med = {name: statistics.median(v) for name, v in runs.items()}
    print(f"torch {torch.__version__}, 1 thread, {args.repeats} interleaved repeats x {args.iters} iterations")
    print(f"{'case':<16} {'median ms':>10}  runs")
    for name, v in runs.items():
        print(f"{name:<16} {med[name]:>10.3f}  {' '.join(f'{x:.2f}' for x in v)}")
    ratios = {"sdpa_bf16_over_fp32": med["sdpa_bf16"] / med["sdpa_fp32"],
              "sdpa_bf16_over_upcast": med["sdpa_bf16"] / med["sdpa_bf16_fp32"],
              "gpt_fp32_over_bf16": med["gpt_fp32"] / med["gpt_bf16"],
              "gpt_fp32_over_bf16_attn": med["gpt_fp32"] / med["gpt_bf16_attn"],
              "gpt_bf16_attn_over_bf16": med["gpt_bf16_attn"] / med["gpt_bf16"]}
    for name, ratio in ratios.items():
        print(f"{name:<26} {ratio:.2f}x")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"torch": torch.__version__, "shape": [B, HEADS, T, HEAD_SIZE],
                                          "repeats": args.repeats, "iters": args.iters, "runs_ms": runs,
                                          "median_ms": med, "ratios": ratios}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
