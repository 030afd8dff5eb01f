"""Comparing the weights of two runs that summed the same gradients in different orders (another
micro-batch split, world size or accumulation): what fp32 summation-order noise leaves, and the
one part of a GPT left out of the comparison because it holds nothing but that noise; and
``max_diff``, the largest gap between two sets of gradients and where it is."""

import torch


def _without_key_bias(name: str, t: torch.Tensor) -> torch.Tensor:
    """The fused attention qkv bias without its key third, which is pure summation-order noise:
    a key bias adds q_i . b_k to every score of query i, which the softmax cancels, so its
    gradient is 0 exactly. fp32 leaves ~1e-10 there instead, and AdamW divides that by
    sqrt(v) + eps (eps 1e-8): the key bias walks by up to lr x noise / (noise + eps) a step, a walk
    that differs with the summation order and says nothing about the training. In
    tests/unit/resilience/test_run_health.py's synced-backward OOM test (16 steps, lr 2e-3) it made the whole
    difference: 1.01e-05 in blocks.0.attn.qkv.bias[96:192] (CI's failure, reproduced here), where
    the reference's key bias itself was 6e-6; every other weight was within 6.5e-7."""
    if name.endswith("attn.qkv.bias"):
        n = t.numel() // 3
        return torch.cat([t[:n], t[2 * n:]])
    return t


def max_weight_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest absolute difference between two state dicts' tensors (the same keys), the
    attention key biases left out (see ``_without_key_bias``)."""
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max((_without_key_bias(k, a[k]) - _without_key_bias(k, b[k])).abs().max().item() for k in a)


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[float, str]:
    """The largest absolute difference between the tensors of ``a`` and ``b`` over ``b``'s names (the
    reference's), and the name where it is."""
    diffs = {n: (a[n] - b[n]).abs().max().item() for n in b}
    worst = max(diffs, key=diffs.get)
    return diffs[worst], worst
