"""The built-in GPT: causality, shapes, tied embeddings."""

import pytest
import torch

from framework.model.gpt import GPT, GPTConfig, lm_loss


def make(tie=False, dropout=0.0):
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=50, seq_len=16, hidden_size=32, num_layers=2, num_heads=4,
                         dropout=dropout, tie_embeddings=tie)).eval()


@pytest.mark.parametrize("tie", [False, True])
def test_future_tokens_never_change_earlier_logits(tie):
    model = make(tie)
    idx = torch.randint(0, 50, (3, 16))
    base = model(idx)
    for t in range(15):
        changed = idx.clone()
        changed[:, t + 1:] = (changed[:, t + 1:] + 7) % 50
        out = model(changed)
        assert torch.equal(out[:, :t + 1], base[:, :t + 1]), t
        # and the change is visible from position t+1 on, so the test can fail
        assert not torch.allclose(out[:, t + 1:], base[:, t + 1:])


def test_shapes_loss_and_tied_weights():
    model = make(tie=True)
    assert model.lm_head.weight is model.tok_emb.weight
    idx = torch.randint(0, 50, (2, 10))
    logits = model(idx)
    assert logits.shape == (2, 10, 50)
    loss = lm_loss(logits, idx)
    assert abs(loss.item() - torch.log(torch.tensor(50.0)).item()) < 0.5  # near uniform at init
    untied = make(tie=False)
    assert untied.num_parameters() - model.num_parameters() == 50 * 32


def test_too_long_sequence_is_rejected():
    with pytest.raises(ValueError, match="longer than seq_len=16"):
        make()(torch.zeros(1, 17, dtype=torch.long))


@pytest.mark.parametrize("amp", [False, True])
def test_attention_runs_in_fp32_on_cpu_even_under_bf16_autocast(amp, monkeypatch):
    """torch 2.13's CPU flash attention is ~4x slower in bf16 (bench/attention.py): the built-in GPT
    attends in fp32 there, and hands the next layer autocast's dtype back."""
    import framework.model.gpt as model_module

    seen = []
    real = model_module.F.scaled_dot_product_attention

    def spy(q, k, v, **kwargs):
        seen.append((q.dtype, k.dtype, v.dtype, torch.is_autocast_enabled("cpu")))
        return real(q, k, v, **kwargs)

    monkeypatch.setattr(model_module.F, "scaled_dot_product_attention", spy)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, seq_len=16, hidden_size=32, num_layers=2, num_heads=2))
    idx = torch.randint(0, 32, (3, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        logits = model(idx)
    assert seen == [(torch.float32,) * 3 + (False,)] * 2
    assert logits.dtype == (torch.bfloat16 if amp else torch.float32)
    if amp:  # bf16 autocast stays close to the fp32 model
        torch.testing.assert_close(logits.float(), model(idx), atol=0.1, rtol=0.05)
