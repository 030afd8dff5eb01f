"""A user's own model, optimizer, scheduler and stateful callback under DDP: a LoRA Llama on dict
batches resumes bit-exact after kill -9 with an elastic restart."""

import json

import pytest
import torch

from tests.dist_helper import ROOT, launch

pytestmark = pytest.mark.dist

WORKER = ROOT / "tests" / "workers" / "user_pieces.py"


def run(run_dir, fault="", restarts=0):
    out = launch(WORKER, [str(run_dir), fault], run_dir, nproc=2, timeout=240,
                 torchrun_extra=["--max-restarts", str(restarts)])
    assert out.returncode == 0, out.output[-4000:]
    assert not out.leftovers
    return json.loads((run_dir / "result.json").read_text())


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    return run(tmp_path_factory.mktemp("user_pieces_reference"))


def test_uninterrupted_run_uses_the_users_pieces(uninterrupted):
    assert uninterrupted["summary"]["steps"] == 40
    assert uninterrupted["tally"]["steps"] == 40
    # The user's OneCycleLR, stepped once per step, drove the rate (not the built-in cosine schedule).
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.2, total_steps=40)
    for _ in range(40):
        opt.step()
        sched.step()
    assert uninterrupted["lr"] == opt.param_groups[0]["lr"]
    assert uninterrupted["summary"]["final_train_loss"] < uninterrupted["summary"]["first_train_loss"]


def test_kill_9_and_restart_resumes_bit_exact_with_the_users_state(uninterrupted, tmp_path):
    result = run(tmp_path, fault="sigkill@step=21,rank=1", restarts=1)
    log0 = (tmp_path / "logs" / "rank_0.log").read_text()
    assert "resumed from step 16" in log0
    assert result["summary"]["model_sha256"] == uninterrupted["summary"]["model_sha256"]
    assert result["tally"] == uninterrupted["tally"]  # the callback's state came back with the checkpoint
    assert result["lr"] == uninterrupted["lr"]
