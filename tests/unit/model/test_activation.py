"""Activation checkpointing, CPU offload and the tiled MLP, in one process."""

import functools
import logging

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from framework.model.activation_checkpointing import MODES, apply_checkpointing, enable_checkpointing
from framework.model.offload import OffloadStats
from framework.model.tiled_mlp import tiled_mlp
from framework.model.gpt import GPT, GPTConfig, lm_loss
from tests.workers.reentrant_inputs import FrozenThenAdapter


def gpt(dropout=0.0, chunks=0, tie=False, layers=3):
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=40, seq_len=24, hidden_size=32, num_layers=layers, num_heads=4,
                         dropout=dropout, tie_embeddings=tie, tiled_mlp_chunks=chunks))


def grads_of(model, x, y, seed=123):
    torch.manual_seed(seed)
    model.zero_grad(set_to_none=True)
    lm_loss(model(x), y).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


DATA = torch.randint(0, 40, (3, 25), generator=torch.Generator().manual_seed(1))
X, Y = DATA[:, :-1], DATA[:, 1:]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("chunks", [0, 4])
def test_rng_replay_with_dropout(mode, chunks):
    """dropout 0.1: recomputation replays the same masks, so gradients equal the plain model's."""
    ref = grads_of(gpt(dropout=0.1), X, Y)
    model = gpt(dropout=0.1, chunks=chunks)
    apply_checkpointing(model, mode, ["Block"])
    got = grads_of(model, X, Y)
    assert max((got[n] - ref[n]).abs().max().item() for n in ref) <= 1e-5
    # a different dropout draw changes the gradients: the comparison can fail
    other = grads_of(model, X, Y, seed=7)
    assert max((other[n] - ref[n]).abs().max().item() for n in ref) > 1e-4


def test_offload_counts_what_it_packs():
    model = gpt(layers=3)
    _, stats = apply_checkpointing(model, "offload", ["Block"])
    torch.manual_seed(0)
    loss = lm_loss(model(X), Y)
    block_input_bytes = X.numel() * 32 * 4  # (B, T, C) fp32 per block
    assert (stats.packed, stats.packed_bytes) == (3, 3 * block_input_bytes)
    assert stats.unpacked == 0
    loss.backward()
    assert (stats.unpacked, stats.unpacked_bytes) == (3, 3 * block_input_bytes)


def test_checkpointing_user_model_by_type_and_by_name():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8))
            self.head = nn.Linear(8, 1)

        def forward(self, x):
            return self.head(self.encoder(x))

    net = Net()
    keys = list(net.state_dict())
    wrapped, _ = apply_checkpointing(net, "non_reentrant", ["encoder"])
    assert wrapped == ["encoder"] and list(net.state_dict()) == keys
    wrapped, _ = apply_checkpointing(Net(), "reentrant", ["Linear"])
    assert wrapped == ["encoder.0", "encoder.2", "head"]
    x = torch.randn(5, 4, requires_grad=True)
    net(x).sum().backward()
    assert all(p.grad is not None for p in net.parameters())
    with pytest.raises(ValueError, match="no submodule matches"):
        apply_checkpointing(Net(), "non_reentrant", ["Conv2d"])


def test_checkpointing_skips_under_no_grad():
    model = gpt()
    _, stats = apply_checkpointing(model, "offload", ["Block"])
    with torch.no_grad():
        model(X)
    assert stats == OffloadStats()


@pytest.mark.parametrize("chunks", [1, 3, 4, 24, 50])
def test_tiled_mlp_matches_plain_mlp(chunks):
    torch.manual_seed(0)
    fc, proj = nn.Linear(16, 64), nn.Linear(64, 16)
    x = torch.randn(2, 24, 16, requires_grad=True)
    ref = proj(torch.nn.functional.gelu(fc(x)))
    g = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, (x, fc.weight, fc.bias, proj.weight, proj.bias), g)
    out = tiled_mlp(x, chunks, fc, proj)
    assert torch.allclose(out, ref, atol=1e-6)
    got = torch.autograd.grad(out, (x, fc.weight, fc.bias, proj.weight, proj.bias), g)
    for a, b in zip(got, ref_grads, strict=False):
        assert torch.allclose(a, b, atol=1e-5)


def test_tiled_mlp_fires_each_weight_hook_once():
    torch.manual_seed(0)
    fc, proj = nn.Linear(8, 32), nn.Linear(32, 8)
    fires = {}
    for name, p in [("fc.w", fc.weight), ("fc.b", fc.bias), ("proj.w", proj.weight), ("proj.b", proj.bias)]:
        p.register_post_accumulate_grad_hook(lambda p, name=name: fires.__setitem__(name, fires.get(name, 0) + 1))
    tiled_mlp(torch.randn(2, 16, 8), 4, fc, proj).sum().backward()
    assert fires == {"fc.w": 1, "fc.b": 1, "proj.w": 1, "proj.b": 1}


def test_tiled_mlp_keeps_no_chunk_intermediates():
    torch.manual_seed(0)
    fc, proj = nn.Linear(8, 32), nn.Linear(32, 8)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        tiled_mlp(torch.randn(2, 16, 8, requires_grad=True), 4, fc, proj)
    # only the input and the four weight tensors; no (B, T, 4C) hidden activation
    assert sorted(saved) == sorted([2 * 16 * 8, 32 * 8, 32, 8 * 32, 8])


def plain_reentrant(model, names):
    for name in names:
        module = getattr(model, name)
        module.forward = functools.partial(checkpoint, module.forward, use_reentrant=True)
    return model


XS = torch.randn(6, 4, generator=torch.Generator().manual_seed(2))


def test_plain_torch_reentrant_fails_or_drops_gradients_when_inputs_need_no_grad():
    """The failure the framework diagnoses: plain torch raises autograd's raw error when every
    path runs through such a module, and silently gives its parameters no gradient otherwise."""
    model = plain_reentrant(FrozenThenAdapter(), ["adapter", "head"])
    with pytest.warns(UserWarning, match="None of the inputs have requires_grad=True"):
        loss = model(XS).square().mean()
    with pytest.raises(RuntimeError, match="element 0 of tensors does not require grad"):
        loss.backward()
    model = plain_reentrant(FrozenThenAdapter(), ["adapter"])
    with pytest.warns(UserWarning, match="None of the inputs have requires_grad=True"):
        model(XS).square().mean().backward()
    assert model.adapter.weight.grad is None and model.head.weight.grad is not None


@pytest.mark.parametrize("targets", [["adapter", "head"], ["adapter"]])
def test_reentrant_module_without_grad_inputs_switches_to_non_reentrant(targets, caplog):
    ref = FrozenThenAdapter()
    ref(XS).square().mean().backward()
    model = FrozenThenAdapter()
    plan = enable_checkpointing(model, "reentrant", ",".join(targets))
    with caplog.at_level(logging.WARNING, logger="framework.model"):
        model(XS).square().mean().backward()
    assert plan.mode == "non_reentrant"
    assert "switched from reentrant to non_reentrant" in caplog.text and "'adapter'" in caplog.text
    for name, p in ref.named_parameters():
        got = model.get_parameter(name).grad
        assert (got is None) == (p.grad is None), name
        if p.grad is not None:
            assert torch.allclose(got, p.grad, atol=1e-6), name


def test_reentrant_module_with_grad_inputs_stays_reentrant():
    model = FrozenThenAdapter()
    plan = enable_checkpointing(model, "reentrant", "head")  # its input comes from the trainable adapter
    model(XS).square().mean().backward()
    assert plan.mode == "reentrant" and model.adapter.weight.grad is not None
