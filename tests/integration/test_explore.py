"""The randomized explorer (bench/explore.py): its invariant checker catches each kind of
violation in a synthetic trial result, its shrinker reduces a failing trial to the one choice that
matters, and a small fixed-seed slice of real trials passes every invariant."""

from __future__ import annotations

import copy
import json
import random
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import explore  # noqa: E402

SIMPLEST = {k: v[0] for k, v in explore.DIMS.items()}


def clean_result(cfg: dict) -> dict:
    """What an uninterrupted 10-step run that broke nothing leaves, as run_trial records it."""
    n = explore.total_steps(cfg)
    rows = [{"step": s, "train/loss": 3.5 - s / 10} for s in range(1, n + 1)]
    per_epoch = explore.STEPS_PER_EPOCH * explore.BATCH
    return {"launches": [{"codes": [0], "timed_out": False, "wall_s": 3.0, "stderr": "", "left_behind": 0}],
            "notes": [], "hit": None, "timed_out": False, "changed": [], "manifest_present": True,
            "manifest_missing": [], "fatal": None, "preempted_marker": False, "metrics": rows,
            "summary": {"steps": n, "preempted": False, "model_sha256": "a" * 64,
                        "final_train_loss": rows[-1]["train/loss"]},
            "samples": {"0": {str(i): 1 for i in range(per_epoch)}, "1": {str(i): 1 for i in range(16)}}, "torn": 0,
            "written_steps": explore.periodic_saves(cfg) + [n], "export_present": True, "resumed_foreign": False,
            "logs_present": {"rank_0.log": True, "metrics.jsonl": True, "summary.json": True}}


def reference_of(res: dict) -> dict:
    return {"finished": True, "model_sha256": res["summary"]["model_sha256"], "samples": res["samples"]}


def violations(verdict: dict) -> dict:
    return {k: v for k, v in verdict.items() if v and v != "n/a"}


def test_the_checker_passes_a_clean_result_and_catches_each_broken_invariant():
    trial = {"config": dict(SIMPLEST), "fault": "kill9_worker", "moment": "mid_step"}
    good = clean_result(trial["config"])
    assert violations(explore.check(trial, good, reference_of(good))) == {}

    def broken(change) -> dict:
        res = copy.deepcopy(good)
        change(res)
        return violations(explore.check(trial, res, reference_of(good)))

    # a restart that repeats steps with no purge (issue 19, bug 2)
    found = broken(lambda r: r["metrics"].extend([{"step": 1, "train/loss": 3.4}, {"step": 2, "train/loss": 3.3}]))
    assert "not increasing (again at [1])" in found["accounting"]
    # a deleted file of another lineage, and an export that took the checkpoints with it (bug 1, bug 6)
    found = broken(lambda r: r["changed"].append("another run's step_00000004.pt deleted"))
    assert "step_00000004.pt deleted" in found["nothing_lost"]
    found = broken(lambda r: r.update(manifest_present=False, logs_present={"rank_0.log": False,
                                                                             "metrics.jsonl": False,
                                                                             "summary.json": True}))
    assert "no manifest.json" in found["nothing_lost"] and "rank_0.log" in found["nothing_lost"]
    # a resumed run that does not end with the uninterrupted model
    found = broken(lambda r: r["summary"].update(model_sha256="b" * 64))
    assert "!= reference" in found["equivalence"]
    # the last logged loss is not the summary's
    found = broken(lambda r: r["summary"].update(final_train_loss=1.0))
    assert "!= summary's" in found["accounting"]
    # a sample committed twice in an epoch
    found = broken(lambda r: r["samples"]["0"].update({"3": 2}))
    assert "samples seen twice [3]" in found["accounting"]
    # a hang, and a process left behind
    found = broken(lambda r: r["launches"][0].update(timed_out=True))
    assert "ran past its bound" in found["no_hang"]
    found = broken(lambda r: r["launches"][0].update(left_behind=2))
    assert "left behind" in found["no_hang"]
    # a transient fault that ends in FATAL (bug 8), and a stop with only a traceback
    stopped = {"summary": None, "fatal": "rank 0: CheckpointError: step_00000008.pt unreadable"}
    found = broken(lambda r: r.update(stopped))
    assert "FATAL after a transient fault" in found["explained"]
    found = broken(lambda r: r.update(summary=None, launches=[{
        "codes": [1], "timed_out": False, "wall_s": 3.0, "left_behind": 0,
        "stderr": "Traceback (most recent call last):\n  ...\nValueError: Queue is closed\n"}]))
    assert "without a FATAL or one-line reason: ValueError: Queue is closed" in found["explained"]
    # the run's only checkpoint made unreadable for good (trial 100 of seed 2000): no restart can
    # read it, so an explained stop naming it is expected, and a traceback alone is not one
    only = {**trial, "fault": "unreadable_newest", "moment": "eval"}
    res = copy.deepcopy(good)
    res.update(summary=None, unreadable_only="step_00000004.pt", launches=[{
        "codes": [1], "timed_out": False, "wall_s": 3.0, "left_behind": 0,
        "stderr": "Traceback (most recent call last):\nCheckpointUnreadable: no checkpoint could be read\n"}])
    found = violations(explore.check(only, res, reference_of(good)))
    assert "stopped without a FATAL naming it" in found["explained"]
    res["fatal"] = "rank 0: CheckpointError: no checkpoint in ck could be read: step_00000004.pt: EISDIR; no restart"
    assert violations(explore.check(only, res, reference_of(good))) == {}
    survived = copy.deepcopy(good)  # resume=none starts afresh, or resume=auto takes another run's: both fine
    survived["unreadable_only"] = "step_00000004.pt"
    assert violations(explore.check(only, survived, reference_of(good))) == {}
    # an uninterrupted run that skips a due checkpoint (bug 3, bug 7)
    plain = {**trial, "fault": "none", "moment": "startup"}
    res = copy.deepcopy(good)
    res["written_steps"] = [explore.total_steps(plain["config"])]
    found = explore.check(plain, res, reference_of(good))
    assert "due checkpoints never written: steps [4, 8]" in found["nothing_lost"]

    # a user's mistake: exit 2 and one line, never a traceback (bug 9)
    user = {**trial, "fault": "user_error", "moment": "startup"}
    res = copy.deepcopy(good)
    res.update(summary=None, launches=[{"codes": [1], "timed_out": False, "wall_s": 3.0, "left_behind": 0,
                                        "stderr": "Traceback (most recent call last):\nValueError: num_samples=0\n"}])
    found = violations(explore.check(user, res, None))
    assert "passed --check-config" in found["explained"] and "traceback" in found["explained"]
    res["launches"][0].update(codes=[2], stderr="error: dataset_size=2: smaller than one batch\n")
    assert violations(explore.check(user, res, None)) == {}


def test_the_checker_judges_issue_33s_dimensions_and_faults():
    import torch

    base = {"config": dict(SIMPLEST), "fault": "kill9_worker", "moment": "mid_step"}
    good = clean_result(base["config"])
    ref = reference_of(good)
    # a relaunch on another world size: the weights within 1e-5 of the reference's, not bit-exact
    changed = {**base, "config": {**SIMPLEST, "topology": "1x2", "world_change": "2to1"}}
    weights = {"w": torch.zeros(3), "blocks.0.attn.qkv.bias": torch.zeros(6)}
    res = copy.deepcopy(good)
    res["summary"]["model_sha256"] = "b" * 64
    res.update(world_changes=["2 -> 1"], final_weights={k: v + 5e-6 for k, v in weights.items()})
    near = {**ref, "weights": weights}
    assert violations(explore.check(changed, res, near)) == {}
    res["final_weights"]["blocks.0.attn.qkv.bias"][2:4] += 1.0  # the key third: summation noise, left out
    assert violations(explore.check(changed, res, near)) == {}
    res["final_weights"]["w"] += 1e-4
    assert "final weights 1.05e-04 from the reference's" in violations(explore.check(changed, res, near))["equivalence"]
    # a deterministic error on one rank: exit 1 with the restart-loop guard's FATAL, no NODE_LOST
    crash = {**base, "config": {**SIMPLEST, "topology": "1x2"}, "fault": "crash_one_rank"}
    stopped = copy.deepcopy(good)
    stopped.update(summary=None, fatal="rank 0: FatalError: 2 restarts in a row resumed from step 3 with no progress "
                   "in between (recovery.max_no_progress_restarts=1); the last error: rank 1: RuntimeError: "
                   "fault injection",
                   launches=[{"codes": [1], "timed_out": False, "wall_s": 9.0, "left_behind": 0, "stderr": ""}])
    assert violations(explore.check(crash, stopped, None)) == {}
    stopped.update(node_lost_marker=True)
    stopped["launches"][0]["codes"] = [75]
    found = violations(explore.check(crash, stopped, None))["explained"]
    assert "exited [75], not 1" in found and "left NODE_LOST" in found
    # the explorer's twitchy spike guard past max_rollbacks after an injected spike: the guard's doing
    fatal = "rank 1: FatalError: more than spike.max_rollbacks=3 loss-spike rollbacks: step 5; step 7; step 8; step 8"
    guard = copy.deepcopy(good)
    guard.update(summary=None, fatal=fatal, launches=stopped["launches"][:1])
    guard["launches"][0]["codes"] = [1, 1]
    spiked = {"config": {**SIMPLEST, "spike_guard": "rollback"}, "fault": "bad_data", "moment": "epoch_boundary"}
    assert violations(explore.check(spiked, guard, None)) == {}
    assert violations(explore.check({**spiked, "fault": "nan"}, guard, None)) == {}
    assert "FATAL after a transient fault" in violations(explore.check({**spiked, "fault": "kill9_worker"}, guard,
                                                                       ref))["explained"]
    # a survivor slowed while it held the lock to write the survivor checkpoint, whose checkpoint never came
    slow = {**base, "config": {**SIMPLEST, "topology": "1x2"}, "fault": "kill9_slow_save"}
    res = copy.deepcopy(good)
    res.update(froze_survivor=True, saved_alone=True)
    assert violations(explore.check(slow, res, ref)) == {}
    res["saved_alone"] = False
    assert "never wrote its checkpoint" in violations(explore.check(slow, res, ref))["nothing_lost"]


def test_issue_33s_dimensions_and_faults_are_drawn_and_a_rerun_fills_them_with_their_simplest_values():
    drawn = [explore.draw(random.Random(5000 + i)) for i in range(400)]
    for dim in ("world_change", "nnodes", "loss_average", "trainer", "save_every_minutes", "peer_timeout"):
        assert {t["config"][dim] for t in drawn} == set(explore.DIMS[dim]), dim
    assert {"sigstop_worker", "crash_one_rank", "kill9_slow_save"} <= {t["fault"] for t in drawn}
    hf = [t for t in drawn if t["config"]["trainer"] == "hf"]
    assert 0.05 < len(hf) / len(drawn) < 0.2
    assert all(t["config"][k] == v for t in hf for k, v in explore.HF_FIXED.items())
    # the drop-in's script meets its faults at its evaluations, final save and own save_model too, on 2 nodes
    assert {"eval", "final_save", "export"} <= {t["moment"] for t in hf}
    assert "2x1" in {t["config"]["topology"] for t in hf}
    # a trial of before these dimensions: --rerun gives each its first value, what it ran with
    old = {k: v for k, v in SIMPLEST.items()
           if k not in ("world_change", "nnodes", "loss_average", "trainer", "save_every_minutes", "peer_timeout")}
    filled = {**SIMPLEST, **old}
    assert explore.applicable({"config": filled, "fault": "kill9_worker", "moment": "mid_step"}) is None
    args = explore.config_args({"config": filled, "fault": "none", "moment": "startup"},
                               explore.Layout(Path("w"), Path("ck"), Path("logs"), None))
    assert args["train.loss_average"] == "micro_batch" and args["checkpoint.every_minutes"] == 0


def test_issue_31s_heal_dimension_is_drawn_judged_and_launched_under_the_launcher():
    import torch

    # Drawn last: every earlier seed's trials keep their other choices; --fix heal=in_place draws only those
    drawn = [explore.draw(random.Random(5000 + i)) for i in range(400)]
    assert {t["config"]["heal"] for t in drawn} == {"restart", "in_place"}
    fixed = [explore.draw(random.Random(31000 + i), {"heal": "in_place"}) for i in range(100)]
    assert all(t["config"]["heal"] == "in_place" and explore.applicable(t) is None for t in fixed)
    assert {"kill9_worker", "sigstop_worker"} <= {t["fault"] for t in fixed}
    assert {t["config"]["topology"] for t in fixed} == {"1x2", "2x1"} and "stream" not in {t["config"]["data"]
                                                                                             for t in fixed}
    healing = {"config": {**SIMPLEST, "topology": "1x2", "heal": "in_place"}, "fault": "kill9_worker",
               "moment": "mid_step"}
    assert explore.applicable({**healing, "fault": "kill9_agent"}) is not None
    # on 2 nodes of 1 process: a launcher each (node 0 serves the run's store), and node 1's loss is
    # drawn (on one node it is not: there is no second node); with restarts left node 1 comes back
    nodes = {"config": {**healing["config"], "topology": "2x1", "max_restarts": 2}, "fault": "kill9_node",
             "moment": "mid_step"}
    assert explore.applicable(nodes) is None and explore.applicable({**healing, "fault": "kill9_node"}) is not None
    assert explore.rejoins(nodes) and not explore.rejoins({**nodes, "config": {**nodes["config"], "max_restarts": 0}})
    class Built(explore.Job):
        def start(self, cmd, node):  # built, not started
            return None

    job = Built(nodes, {"train.max_steps": 1}, Path("."), "t")
    assert [cmd[cmd.index("--node-rank") + 1] for cmd in job.cmds] == ["0", "1"]
    assert all("--heal" in cmd and cmd[cmd.index("--nnodes") + 1] == "2" for cmd in job.cmds)
    # node 1 as on another host where allowed (root): a UTS namespace of its own
    assert (job.cmds[1][:2] == ["unshare", "--uts"]) == explore.OTHER_HOST_OK and job.cmds[0][0] != "unshare"
    # a partition: drawn last in place of node 1's SIGSTOP (half the time), never elsewhere, never with
    # the peer monitor off (nothing could name a member silent on another host)
    cut = {**nodes, "fault": "cut_link", "moment": "eval", "config": {**nodes["config"], "peer_timeout": 10}}
    assert (explore.applicable(cut) is None) == explore.PARTITIONS_OK
    assert explore.applicable({**cut, "config": {**cut["config"], "peer_timeout": 0}}) is not None
    assert explore.applicable({**cut, "config": {**cut["config"], "topology": "1x2"}}) is not None
    assert explore.applicable({**cut, "config": {**cut["config"], "heal": "restart"}}) is not None
    drawn_faults = {t["fault"] for t in fixed}
    assert ("cut_link" in drawn_faults) == explore.PARTITIONS_OK, drawn_faults
    assert "cut_link" not in {t["fault"] for t in drawn if t["config"]["heal"] == "restart"}
    assert explore.applicable({**healing, "config": {**healing["config"], "comm_hook": "powersgd"}}) is not None
    # launched as a user would: launch_training.sh --heal; a SIGSTOP inside a step from fault_inject
    lay = explore.Layout(Path("w"), Path("ck"), Path("logs"), None)
    args = explore.config_args(healing, lay)
    assert args["dropout"] == 0.0 and args["data.global_batch_size"] == 2 * explore.BATCH
    assert explore.injected(healing) == "sigkill@step=3,rank=1"
    assert explore.injected({**healing, "fault": "sigstop_worker"}) == "sigstop@step=3,rank=1"
    assert "recovery.step_timeout_s" not in explore.config_args({**healing, "fault": "sigstop_worker"}, lay)

    # judged: a kill inside a step heals in place, within the world-size tolerance of the reference
    good = clean_result(healing["config"])
    weights = {"w": torch.zeros(3)}
    good.update(healed=1, restarted_in_store=False, world_changes=["2 -> 1 in place", "1 -> 2 in place"],
                final_weights={"w": torch.full((3,), 2e-6)})
    good["summary"]["model_sha256"] = "b" * 64
    ref = {**reference_of(good), "model_sha256": "a" * 64, "weights": weights}
    assert violations(explore.check(healing, good, ref)) == {}
    restarted = copy.deepcopy(good)
    restarted.update(healed=0, restarted_in_store=True, world_changes=[])
    restarted["summary"]["model_sha256"] = "a" * 64
    found = violations(explore.check(healing, restarted, ref))
    assert found == {"in_place": "kill9_worker at mid_step did not heal in place; kill9_worker at mid_step "
                                 "restarted from the checkpoint"}
    # a loss in an evaluation restarts from the checkpoint by design; a trial without heal is n/a
    assert violations(explore.check({**healing, "moment": "eval"}, restarted, ref)) == {}
    assert explore.check({"config": dict(SIMPLEST), "fault": "kill9_worker", "moment": "mid_step"}, good,
                         ref)["in_place"] == "n/a"


def test_a_failing_trial_is_shrunk_to_the_choice_that_fails_and_replayed_from_one_line():
    """A synthetic failure that needs only the nested layout: every other choice is simplified away."""
    rng = random.Random(4)
    while True:  # a drawn trial with a fault, that these choices leave applicable
        trial = explore.draw(rng)
        trial["config"].update(layout="nested", topology="1x2", data="map2", accum=2, keep_last=1)
        if trial["fault"] not in ("none", "user_error") and explore.applicable(trial) is None:
            break
    runs = []

    def fake_evaluate(t: dict) -> dict:
        runs.append(t)
        bad = t["config"]["layout"] == "nested"
        return {"trial": t, "failed": ["nothing_lost"] if bad else [],
                "verdict": {"nothing_lost": "runs/x/checkpoints deleted" if bad else None}}

    first = fake_evaluate(trial)
    small = explore.shrink(first, fake_evaluate, budget=100, log=lambda *_: None)
    assert small["failed"] == ["nothing_lost"]
    assert small["trial"]["config"] == {**SIMPLEST, "layout": "nested"}
    assert small["trial"]["fault"] == "none"
    line = explore.repro(small["trial"])
    assert line.startswith("python bench/explore.py --replay '")
    assert json.loads(line.split("--replay ", 1)[1].strip("'")) == small["trial"]
    assert len(runs) <= 40


def test_the_uneven_split_is_drawn_last_where_the_global_batch_is_named():
    """Issue 31's uneven split: a global batch one sample larger than an even one, so that every
    world size the run takes splits it unevenly; drawn after the rest (earlier seeds' trials keep
    their other choices), only where the global batch is named, never for a stream."""
    drawn = [explore.draw(random.Random(5000 + i)) for i in range(300)]
    uneven = [t for t in drawn if t["config"]["split"] == "uneven"]
    assert uneven and all(explore.elastic(t["config"]) and t["config"]["data"] != "stream" for t in uneven)
    assert all(explore.applicable(t) is None for t in uneven)
    fixed = [explore.draw(random.Random(35000 + i), {"split": "uneven"}) for i in range(40)]
    assert {t["config"]["heal"] for t in fixed} == {"restart", "in_place"}
    trial = {"config": {**SIMPLEST, "topology": "1x2", "split": "uneven", "world_change": "2to1"},
             "fault": "kill9_worker", "moment": "mid_step"}
    assert explore.applicable(trial) is None
    args = explore.config_args(trial, explore.Layout(Path("w"), Path("ck"), Path("logs"), None))
    # 9 samples on 2 ranks (5 and 4), 6 steps an epoch as an even trial's
    assert (args["data.global_batch_size"], args["dataset_size"]) == (9, 9 * explore.STEPS_PER_EPOCH)
    assert explore.applicable({**trial, "config": {**trial["config"], "world_change": "none"}}) is not None
    assert explore.ref_key(trial) != explore.ref_key({**trial, "config": {**trial["config"], "split": "even"}})


def test_rank_0_is_drawn_as_the_victim_of_a_worker_fault_when_healing_in_place(tmp_path):
    """Healing in place, rank 0 (which proposes a grow, writes the checkpoints' shared files, logs
    the metrics and exports) is drawn as the rank a worker's fault strikes, last, after the split
    (earlier seeds' trials keep their other choices); its fault_inject spec and its signal target
    replica 0, and a heal is read from the survivor's log."""
    fixed = [explore.draw(random.Random(39500 + i), {"heal": "in_place"}) for i in range(120)]
    first = [t for t in fixed if t["config"]["victim"] == "first"]
    assert first and all(t["fault"] in explore.VICTIM_FAULTS and explore.applicable(t) is None for t in first)
    assert {t["config"]["victim"] for t in fixed if t["fault"] in explore.VICTIM_FAULTS} == {"first", "last"}
    assert all(t["config"]["victim"] == "last" for t in map(explore.draw, map(random.Random, range(5000, 5300)))
               if t["config"]["heal"] == "restart")
    healing = {"config": {**SIMPLEST, "topology": "1x2", "heal": "in_place", "victim": "first"},
               "fault": "kill9_worker", "moment": "mid_step"}
    assert explore.applicable(healing) is None
    assert explore.applicable({**healing, "config": {**healing["config"], "heal": "restart"}}) is not None
    assert explore.applicable({**healing, "fault": "nan"}) is not None
    assert explore.injected(healing) == "sigkill@step=3,rank=0"
    assert explore.injected({**healing, "fault": "sigstop_worker"}) == "sigstop@step=3,rank=0"
    assert explore.ref_key(healing) == explore.ref_key({**healing, "config": {**healing["config"], "victim": "last"}})
    # the survivor's log (replica 1's) tells of the heal, not replica 0's
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "rank_0.log").write_text("step 3/10 |\n")
    (logs / "rank_1.log").write_text("healed in place: a peer was lost\ngeneration 2 goes on with 1 of 2 ranks\n")
    lay = explore.Layout(tmp_path, tmp_path / "ck", logs, None)
    found = explore.verdict_inputs(healing, lay, {}, {})
    assert found["healed"] == 1 and "2 -> 1 in place" in found["world_changes"]
    assert explore.verdict_inputs({**healing, "config": {**healing["config"], "victim": "last"}}, lay, {},
                                  {})["healed"] == 0
    # a change of world size that only the other replica's log tells (seed 42000's trial 67: the
    # victim's restarted process resumed alone, then grew back; judged bit for bit before)
    (logs / "rank_1.log").write_text("effective batch: 4 per rank x 1 ranks x 4 accumulation = 16 samples\n"
                                     "generation 3 trains on 2 ranks (was 1; this rank 0 -> 0)\n")
    found = explore.verdict_inputs({**healing, "config": {**healing["config"], "victim": "last"}}, lay, {}, {})
    assert {"2 -> 1 in place", "1 -> 2 in place"} <= set(found["world_changes"]), found["world_changes"]

    class Signalled:
        sent = []

        def send_signal(self, sig):
            self.sent.append(sig)

    class Workers:
        procs, cmds = [], []

        def workers(self):
            return {0: Signalled(), 1: None}

    job = Workers()
    assert explore.deliver({**healing, "moment": "export"}, job, lay, set(), {"notes": []})
    assert Signalled.sent == [__import__("signal").SIGKILL]


def test_draws_are_seeded_and_applicable():
    a = [explore.draw(random.Random(7 + i)) for i in range(50)]
    assert a == [explore.draw(random.Random(7 + i)) for i in range(50)]
    assert all(explore.applicable(t) is None for t in a)
    assert len({t["fault"] for t in a}) > 8


# The slice, as drawn by seed 24283 before the explorer had the save_on_peer_loss dimension (one
# process each): a kill -9 at a checkpoint write, restarted by torchrun (--max-restarts 2), and a
# SIGTERM after a loss-spike rollback (a preemption), relaunched. Then the first one on 2 ranks,
# killed mid-step: the survivor saves alone, under resume=PATH and keep_last=1; all three with timed
# checkpoints every 0.12 s besides the schedule's. (The dimensions added since take their first
# values, as --rerun gives them.)
_SLICE_CONFIG = {"topology": "1", "max_restarts": 2, "resume": "path", "layout": "apart", "foreign": True,
                 "data": "map2", "spike_guard": "rollback", "accum": 1, "act_ckpt": "offload", "tiled_mlp": 2,
                 "comm_hook": "bf16", "save_every_steps": 4, "save_interval": 1, "keep_last": 1,
                 "stop": "num_epochs", "save_on_peer_loss": True, "world_change": "none", "nnodes": "fixed",
                 "loss_average": "micro_batch", "trainer": "builtin", "save_every_minutes": 0.002}
# (Issue 33's world-size change is tests/integration/test_elastic.py's and test_fault_tolerance.py's
# relaunch at another size; a deterministic error on rank 1 under launch_training.sh, crash_one_rank,
# is tests/integration/test_launch.py's test_a_launch_whose_last_restart_lost_no_node_does_not_exit_75;
# a worker stopped (SIGSTOP) and named by the peer monitor is
# tests/integration/test_fault_tolerance.py's test_a_frozen_rank_is_named_in_seconds_and_the_restart_trains_on_bit_exact
# on one node, and tests/integration/test_partition.py's on two.)
_SIMPLEST = {k: v[0] for k, v in explore.DIMS.items()}  # every dimension's first value
SLICE = [
    {"config": _SLICE_CONFIG, "fault": "kill9_worker", "moment": "ckpt_write"},
    {"config": {**_SLICE_CONFIG, "max_restarts": 0, "resume": "none", "layout": "nested", "foreign": False,
                "save_every_steps": 3, "save_interval": 0}, "fault": "sigterm_worker", "moment": "rollback"},
    {"config": {**_SLICE_CONFIG, "topology": "1x2"}, "fault": "kill9_worker", "moment": "mid_step"},
    # Issue 31's: healing in place under launch_training.sh --heal, rank 0 (the victim dimension's
    # "first": it writes the checkpoints and proposes the grow) killed mid-step, with data loader
    # workers and accumulation; its torchrun starts it again, and it rejoins in place if the run
    # has not ended (no rank resumes from the checkpoint: the in_place invariant).
    {"config": {**_SIMPLEST, "topology": "1x2", "heal": "in_place", "max_restarts": 2, "data": "map2", "accum": 2,
                "victim": "first"}, "fault": "kill9_worker", "moment": "mid_step"},
]


@pytest.mark.dist
def test_a_fixed_seed_slice_of_real_trials_breaks_no_invariant(tmp_path):
    lines = []
    assert all(explore.applicable(t) is None for t in SLICE)
    # two at a time, as the explorer runs: a stopped worker's 30 s wait overlaps the other trials
    results = explore.explore(0, 0, 2, tmp_path, do_shrink=False, log=lines.append, trials=SLICE)
    assert len(results) == len(SLICE)
    failing = {explore.describe(r["trial"]): {k: r["verdict"][k] for k in r["failed"]} for r in results if r["failed"]}
    assert failing == {}, "\n".join(lines)
    # the trials ran the faults they drew (none missed its moment): a restart, a rollback, a preemption
    assert all(r["hit"] is not False for r in results), [r["notes"] for r in results]
    assert results[0]["trial"]["config"]["max_restarts"] == 2 and len(results[0]["codes"]) == 1  # restarted
    assert len(results[1]["codes"]) == 2  # preempted, then relaunched
    assert [r["saved_alone"] for r in results[:3]] == [False, False, True]  # rank 0 saved alone, rank 1 killed
    # healed in place (2 -> 1) in one launch, within 1e-5 of the uninterrupted 2-rank run, with no
    # rank resumed from the checkpoint; grown back (1 -> 2) when the restarted rank 0 was up before
    # the run's end (4 of 9 such explorer trials: a race; under the launcher it is
    # tests/integration/test_heal.py's test_under_the_launcher_a_killed_rank_restarted_by_its_torchrun_rejoins_...)
    heal = results[3]
    assert heal["world_changes"] in (["2 -> 1 in place"], ["2 -> 1 in place", "1 -> 2 in place"]), heal
    assert len(heal["codes"]) == 1 and heal["verdict"]["in_place"] is None and heal["weight_diff"] <= 1e-5


def test_a_guard_stop_is_judged_against_the_uninterrupted_run():
    """Under the explorer's twitchy spike guard a run may end in the guard's FATAL: after a
    transient fault that is the expected outcome when the uninterrupted reference ended with the
    same FATAL (the same spikes and samples), and a failure when it did not; with timed
    checkpoints, a rollback's target is the clock's, so the weights are not compared."""
    trial = {"config": {**SIMPLEST, "spike_guard": "rollback"}, "fault": "sigstop_worker", "moment": "ckpt_write"}
    fatal = "more than spike.max_rollbacks=3 loss-spike rollbacks: step 5 (samples [37, 18]); step 8 (samples [6, 4])"
    res = copy.deepcopy(clean_result(trial["config"]))
    res.update(summary=None, fatal=f"rank 1: FatalError: {fatal}")
    res["launches"][0]["codes"] = [1]
    stopped_too = {**reference_of(clean_result(trial["config"])), "finished": False,
                   "fatal": f"rank 0: FatalError: {fatal}"}
    assert "explained" not in violations(explore.check(trial, res, stopped_too))
    finished = reference_of(clean_result(trial["config"]))
    assert "not survived" in violations(explore.check(trial, res, finished))["explained"]
    other = {**stopped_too, "fatal": "rank 0: FatalError: " + fatal.replace("step 8", "step 9")}
    assert "not survived" in violations(explore.check(trial, res, other))["explained"]
    # the uninterrupted run's own check (fault none) takes its guard stop as the configuration's outcome
    alone = {**trial, "fault": "none", "moment": "startup"}
    assert "explained" not in violations(explore.check(alone, res, None))
    # a bit-exact run that finished where the uninterrupted one stopped has not made the guard's decisions
    done = clean_result(trial["config"])
    assert "the uninterrupted run stopped" in violations(explore.check(trial, done, stopped_too))["equivalence"]
    timed = {**trial, "config": {**trial["config"], "save_every_minutes": 0.002}, "fault": "kill9_worker"}
    moved = copy.deepcopy(clean_result(timed["config"]))
    moved["summary"]["model_sha256"] = "c" * 64
    moved["samples"]["0"] = {str(i): 1 for i in range(16)}  # the exclusions after another rollback point
    verdict = explore.check(timed, moved, reference_of(clean_result(timed["config"])))
    assert verdict["equivalence"] == "n/a" and verdict["accounting"] is None, verdict
    untimed = {**timed, "config": {**timed["config"], "save_every_minutes": 0}}
    verdict = violations(explore.check(untimed, moved, reference_of(clean_result(untimed["config"]))))
    assert "8 samples missing" in verdict["accounting"] and "model_sha256" in verdict["equivalence"]
    moved["world_changes"] = ["2 -> 4"]  # the guard decides on other losses: not compared either
    verdict = explore.check(untimed, moved, reference_of(clean_result(untimed["config"])))
    assert verdict["equivalence"] == "n/a" and verdict["accounting"] is None, verdict
    assert explore.ref_key(timed) != explore.ref_key({**timed, "config": {**timed["config"], "save_every_minutes": 0}})
    # The rollback moment reached at a natural spike, before the injected one: the preempted launch
    # ended before step 7, the relaunch injects nothing, and the run finished where the reference
    # (which kept the injected spike) stopped with the guard's FATAL (seed 9000's trial 240).
    early = {**trial, "fault": "sigterm_worker", "moment": "rollback"}
    relaunched = copy.deepcopy(clean_result(early["config"]))
    relaunched["injected_spike"] = False
    assert explore.check(early, relaunched, stopped_too)["equivalence"] == "n/a"
    relaunched["injected_spike"] = True  # it fired: the trial's losses are the reference's
    assert "the uninterrupted run stopped" in violations(explore.check(early, relaunched, stopped_too))["equivalence"]
    # A survivor checkpoint of step 4 became the rollback's target, where the reference went back to step 3
    # (seed 9000's trial 751): other checkpoints, so other weights; the same targets are compared.
    alone = {**trial, "fault": "kill9_worker", "moment": "eval"}
    other = copy.deepcopy(clean_result(alone["config"]))
    other["summary"]["model_sha256"], other["rollback_targets"] = "d" * 64, [4]
    ref = {**reference_of(clean_result(alone["config"])), "rollback_targets": [3]}
    assert explore.check(alone, other, ref)["equivalence"] == "n/a"
    assert "model_sha256" in violations(explore.check(alone, other, {**ref, "rollback_targets": [4]}))["equivalence"]
    # The only checkpoint made unreadable, a relaunch afresh, then the guard's accepted stop (trial 792)
    unread = {"config": {**trial["config"], "save_every_minutes": 0.002}, "fault": "unreadable_newest",
              "moment": "eval"}
    stopped = copy.deepcopy(res)
    stopped["unreadable_only"] = "step_00000003.pt"
    assert "explained" not in violations(explore.check(unread, stopped, reference_of(clean_result(unread["config"]))))


def test_a_hung_trial_has_its_processes_stacks_dumped_before_the_kill(tmp_path):
    """A hang seen once (seed 9000's trial 195) must show where it waited: explore.dump_stacks
    writes every process of the trial's (its command line names the trial's directory) stack."""
    import shutil
    import subprocess
    import time
    if shutil.which("py-spy") is None:
        pytest.skip("py-spy is not installed (requirements-dev.txt pins it)")
    marker = str(tmp_path / "trial-hung")
    script = "import sys, time\ndef waiting_in_a_collective():\n    time.sleep(60)\nwaiting_in_a_collective()\n"
    proc = subprocess.Popen([sys.executable, "-c", script, marker])
    try:
        time.sleep(1.0)  # into the sleep
        path = explore.dump_stacks(marker, tmp_path / "hang_stacks.txt")
        text = Path(path).read_text()
        assert f"=== pid {proc.pid}:" in text and "waiting_in_a_collective" in text, text[-2000:]
    finally:
        proc.kill()
        proc.wait()


def test_a_trial_never_signals_a_pid_its_exited_agent_left_behind(monkeypatch):
    """Once the explorer has reaped an agent, the agent's pid may belong to any process on the
    machine (a concurrent trial's, a test's). A sigterm_worker then went to such a process: a
    script run beside the explorer received SIGTERM. workers() must not name it."""
    import subprocess

    agent = subprocess.Popen([sys.executable, "-c", "pass"])
    agent.wait()  # reaped: the pid is free for reuse

    class Reused:  # what psutil finds at that pid now: some other process that looks like a worker
        pid = agent.pid

        def __init__(self, pid):
            assert pid == agent.pid

        def children(self, recursive=False):
            return []

        def environ(self):
            return {"RANK": "0", "TORCHELASTIC_RESTART_COUNT": "0"}

    monkeypatch.setattr(explore.psutil, "Process", Reused)
    job = object.__new__(explore.Job)
    job.procs, job.script = [agent], explore.ROOT / "ddp_training.py"
    job.cmds = [[sys.executable, str(job.script)]]
    assert job.workers() == {}
