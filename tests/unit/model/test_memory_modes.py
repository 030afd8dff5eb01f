"""Every gradient_checkpointing x tiled_mlp_chunks x tie_embeddings combination, and the forced
DDP settings, on 2 gloo ranks (one torchrun launch) and in one process, against the plain model."""

import pytest

from framework.trainer import DDPTrainer
from tests.dist_helper import case
from tests.workers.memory_modes import BASE, COMBOS, FORCED, ITERATIONS, reference_grads

WORKER = "tests/workers/memory_modes.py"
WORKER_TIMEOUT = 300  # seconds, for the conftest two_ranks fixture

TOL = 1e-5


@pytest.mark.parametrize("name", list(COMBOS) + list(FORCED))
@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.dist
def test_two_ranks_match_single_process(two_ranks, name, rank):
    out = case(two_ranks, rank, name)
    assert out["max_abs_diff"] <= TOL, out
    assert out["rank_gap"] == 0.0, out
    overrides = {**COMBOS, **FORCED}[name]
    if overrides.get("ddp.static_graph") == "true":
        assert out["static_graph"]
    if overrides.get("ddp.find_unused_parameters") == "true":
        assert out["find_unused_parameters"]
    if overrides.get("memory.activation_checkpointing") == "offload":
        accum = overrides.get("data.gradient_accumulation_steps", 1)
        forwards = 2 + ITERATIONS * accum  # two probe batches, then the real micro-steps
        assert out["offload_packed"] == out["offload_unpacked"] == forwards * BASE["num_layers"]


@pytest.mark.dist
def test_probe_and_forced_settings_train_the_same_model(two_ranks):
    for rank in (0, 1):
        out = case(two_ranks, rank, "probe_vs_forced_sha")
        assert out["auto"]["decision"] == [True, False]  # a block reached twice -> static_graph
        assert "blocks.0.mlp.fc.weight" in out["auto"]["multi_fire"]
        assert out["auto"]["sha"] == out["forced"]["sha"]
    sha = [case(two_ranks, rank, "probe_vs_forced_sha")["auto"]["sha"] for rank in (0, 1)]
    assert sha[0] == sha[1]


@pytest.mark.parametrize("name", list(COMBOS))
def test_one_process_matches_plain_model(tmp_path, name):
    trainer = DDPTrainer({**BASE, **COMBOS[name], "logging.dir": str(tmp_path), "checkpoint.dir": str(tmp_path / "ck")},
                         rank=0, world_size=1)
    cfg = trainer.config
    batches = iter(trainer.stream.loader)
    for _ in range(2):
        micro = [next(batches)]
        trainer.forward_backward(micro)
        ref = reference_grads(cfg, micro)
        worst = max((p.grad - ref[n]).abs().max().item() for n, p in trainer.raw_model.named_parameters())
        assert worst <= TOL, (name, worst)
        trainer.optimizer.zero_grad(set_to_none=True)
