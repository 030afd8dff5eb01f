"""The built-in GPT: causality, shapes, tied embeddings."""

import pytest
import torch

from framework.model import GPT, GPTConfig, lm_loss


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
