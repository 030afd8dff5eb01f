"""The built-in model: a decoder-only GPT.

Pre-LayerNorm blocks, causal self-attention through ``scaled_dot_product_attention``, a GELU
MLP, learned positions and optionally tied input/output embeddings. Shapes use B (batch),
T (sequence), C (hidden size), nh (heads), hs (head size = C / nh), V (vocabulary).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .tiled_mlp import tiled_mlp


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int
    seq_len: int
    hidden_size: int
    num_layers: int
    num_heads: int
    dropout: float = 0.0
    tie_embeddings: bool = False
    tiled_mlp_chunks: int = 0

    @classmethod
    def from_train_config(cls, cfg) -> "GPTConfig":
        return cls(cfg.model.vocab_size, cfg.model.seq_len, cfg.model.hidden_size, cfg.model.num_layers,
                   cfg.model.num_heads, cfg.model.dropout, cfg.model.tie_embeddings, cfg.memory.tiled_mlp_chunks)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        # (B, T, C) -> (B, nh, T, hs)
        q, k, v = (t.view(B, T, self.num_heads, C // self.num_heads).transpose(1, 2) for t in (q, k, v))
        dtype = q.dtype
        if q.device.type == "cpu" and dtype in (torch.bfloat16, torch.float16):
            # torch 2.13's CPU flash attention is ~4x slower in bf16 than in fp32, forward and backward
            # together (0.70 against 2.55 ms at the nanoGPT CPU size): attend in fp32, autocast off.
            with torch.autocast("cpu", enabled=False):
                y = self._attend(q.float(), k.float(), v.float()).to(dtype)
        else:
            y = self._attend(q, k, v)
        # (B, nh, T, hs) -> (B, T, C)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_drop(self.proj(y))


    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                              dropout_p=self.dropout if self.training else 0.0)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.hidden_size, 4 * cfg.hidden_size)
        self.proj = nn.Linear(4 * cfg.hidden_size, cfg.hidden_size)
        self.drop = nn.Dropout(cfg.dropout)
        self.chunks = cfg.tiled_mlp_chunks  # > 0: tiled over the sequence (framework/model/activation_checkpointing.py)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.chunks > 0:
            # Dropout stays outside the tiled function, so its recomputation needs no RNG replay.
            return self.drop(tiled_mlp(x, self.chunks, self.fc, self.proj))
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.hidden_size)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.hidden_size)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.hidden_size)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.ln_f = nn.LayerNorm(cfg.hidden_size)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        self.apply(self._init_weights)
        # GPT-2: residual projections scaled by 1/sqrt(2 * num_layers).
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.num_layers))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """idx (B, T) token ids -> logits (B, T, V)."""
        B, T = idx.shape
        if T > self.cfg.seq_len:
            raise ValueError(f"sequence of {T} tokens is longer than seq_len={self.cfg.seq_len}")
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))  # (B, T, V)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy: logits (B, T, V), targets (B, T)."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))
