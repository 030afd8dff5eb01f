"""An IterableDataset on 2 gloo ranks: exact resume of a stream with a state after kill -9, and
no hang when one rank's shard runs out a batch early."""

import json

import pytest

from framework.streaming import StreamPosition
from tests.dist_helper import ROOT, launch

WORKER = ROOT / "tests" / "workers" / "streaming.py"


def run(run_dir, fault="", rows_on_rank_1=48, restarts=0):
    out = launch(WORKER, [str(run_dir), fault, str(rows_on_rank_1)], run_dir, nproc=2, timeout=180,
                 torchrun_extra=["--max-restarts", str(restarts)])
    assert out.returncode == 0, out.output[-4000:]
    assert not out.leftovers
    return {r: json.loads((run_dir / f"result_rank{r}.json").read_text()) for r in (0, 1)}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    return run(tmp_path_factory.mktemp("stream_reference"))


def test_a_stream_is_sharded_and_read_once(uninterrupted):
    assert uninterrupted[0]["summary"]["steps"] == 12  # 48 rows per rank, batch 4
    assert sorted(uninterrupted[0]["ids"]) == list(range(0, 96, 2))
    assert sorted(uninterrupted[1]["ids"]) == list(range(1, 96, 2))


def test_kill_9_resumes_a_stream_with_a_state_exactly(uninterrupted, tmp_path):
    result = run(tmp_path, fault="sigkill@step=6,rank=1", restarts=1)
    assert "resumed from step 4" in (tmp_path / "logs" / "rank_0.log").read_text()
    for rank in (0, 1):
        assert sorted(result[rank]["ids"]) == sorted(uninterrupted[rank]["ids"])  # none lost, none twice
    assert result[0]["summary"]["model_sha256"] == uninterrupted[0]["summary"]["model_sha256"]


def test_a_rank_with_one_batch_fewer_ends_the_epoch_on_both(tmp_path):
    result = run(tmp_path, rows_on_rank_1=44)
    assert result[0]["summary"]["steps"] == result[1]["summary"]["steps"] == 11


def test_a_stream_needs_max_steps_and_cannot_halve_its_micro_batch():
    from types import SimpleNamespace

    from framework.markers import FatalError
    position = StreamPosition(world_size=2, batch_size=4, accumulation=1)
    with pytest.raises(ValueError, match="max_steps"):
        position.last_step(0, SimpleNamespace(max_steps=0))
    with pytest.raises(FatalError, match="a stream cannot do"):
        position.set_micro_batch(2, 2)
