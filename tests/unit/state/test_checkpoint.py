"""Checkpoint store, safe loading, markers, shape checks, and RNG capture/restore."""

import errno
import hashlib
import io
import json
import logging
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from framework.state import atomic, checkpoint_files, rng
from framework.state.checkpoint_files import (CheckpointDirLocked, CheckpointError, CheckpointStore, load_file,
                                              step_file)
from framework.resilience.markers import FATAL, PREEMPTED
from framework.resilience.markers import clear as clear_marker
from framework.resilience.markers import read as read_marker
from framework.resilience.markers import write as write_marker
from framework.state.checkpointer import check_model_shapes


def choose_checkpoint(resume_value: str, store: CheckpointStore, env) -> dict | None:
    """What rank 0 resumes from (``resume`` = auto | none | PATH), as the trainer chooses it."""
    from types import SimpleNamespace

    from framework.state.checkpointer import Checkpointer
    if resume_value == "none":
        return None
    cfg = SimpleNamespace(checkpoint=SimpleNamespace(resume=resume_value))
    checkpointer = Checkpointer(cfg, env, store, {}, builtin_data=True)
    return checkpointer._choose()[1]


def state_at(step: int) -> dict:
    return {"step": step, "model": {"w": torch.full((4, 3), float(step)), "b": torch.arange(3) + step},
            "sampler": {"epoch": 0, "consumed": 8 * step}, "note": f"step {step}", "lr": 0.1 * step,
            "history": [1, 2.5, "x", None, (True, False)]}


def assert_same(a, b):
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=False):
            assert_same(x, y)
    else:
        assert a == b


def save_steps(directory, steps, keep_last=3):
    with CheckpointStore(directory, keep_last=keep_last) as store:
        for step in steps:
            store.save(state_at(step), step)
    return store


def manifest(directory):
    return json.loads((directory / "manifest.json").read_text())


# --- writing ---------------------------------------------------------------------------------
def test_round_trip_and_manifest(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        store = save_steps(tmp_path, [5])
    assert not caplog.records
    [entry] = manifest(tmp_path)
    data = (tmp_path / "step_00000005.pt").read_bytes()
    assert entry == {"file": "step_00000005.pt", "step": 5, "bytes": len(data),
                     "sha256": hashlib.sha256(data).hexdigest(), "lineage": store.lineage, "seq": 1}
    path, state = CheckpointStore(tmp_path).latest_valid()
    assert path == tmp_path / "step_00000005.pt"
    assert_same(state, state_at(5))


def test_only_final_names_remain_after_saves(tmp_path):
    (tmp_path / ".step_00000001.pt.tmp.999").write_bytes(b"left by a crash")  # an older version's name
    (tmp_path / ".manifest.json.tmp.k2x_9qzv").write_bytes(b"left by a crash")  # a mkstemp name
    save_steps(tmp_path, [1, 2, 3, 4])
    assert sorted(os.listdir(tmp_path)) == ["manifest.json", "step_00000002.pt", "step_00000003.pt",
                                            "step_00000004.pt"]


def test_a_symlink_planted_in_checkpoint_dir_does_not_redirect_a_write(tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    directory = tmp_path / "ck"
    store = CheckpointStore(directory)  # its stale-temp cleanup is done: another user plants them now
    for name in (step_file(1), "manifest.json", step_file(2)):
        (directory / f".{name}.tmp.{os.getpid()}").symlink_to(victim)
    store.save(state_at(1), 1, blocking=True)
    store.save(state_at(2), 2, blocking=True)
    assert victim.read_bytes() == b"precious"
    assert [e["step"] for e in manifest(directory)] == [1, 2]
    assert_same(store.latest_valid()[1], state_at(2))
    store.close()


MEMORY_PROBE = """
import sys
import torch
from framework.state.checkpoint_files import CheckpointStore

def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))

state = {"model": {f"w{i}": torch.randn(1024, 4096) for i in range(8)}, "step": 1}  # 8 x 16 MiB
size = sum(t.numel() * t.element_size() for t in state["model"].values())
store = CheckpointStore(sys.argv[1])
store.save({"step": 0}, 0, blocking=True)  # imports and the writer's first use
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # resets VmHWM, the peak resident memory, to the current VmRSS
before = status("VmRSS")
store.save(state, 1, blocking=True)
print((status("VmHWM") - before) / size)
"""


@pytest.mark.dist
def test_a_checkpoint_write_holds_about_one_copy_of_the_state_in_memory(tmp_path):
    """The CPU snapshot is the one copy: the file is streamed from it, not serialised into memory first."""
    out = subprocess.run([sys.executable, "-c", MEMORY_PROBE, str(tmp_path)], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    copies = float(out.stdout.strip())
    assert 0.9 <= copies <= 1.3, f"a write held {copies:.2f}x the state's size at its peak"
    path, state = CheckpointStore(tmp_path).latest_valid()  # size and checksum verified
    assert path.name == step_file(1) and state["model"]["w7"].shape == (1024, 4096)


def test_keep_last_prunes_oldest(tmp_path):
    save_steps(tmp_path, [10, 20, 30, 40, 50], keep_last=2)
    assert [e["step"] for e in manifest(tmp_path)] == [40, 50]
    assert sorted(p.name for p in tmp_path.glob("step_*.pt")) == ["step_00000040.pt", "step_00000050.pt"]


def test_other_ranks_do_not_write_but_can_load(tmp_path):
    other = CheckpointStore(tmp_path / "ck", rank=1)
    assert other.save(state_at(1), 1, blocking=True) is None
    assert not (tmp_path / "ck").exists()
    save_steps(tmp_path / "ck", [1])
    assert other.latest_valid()[1]["step"] == 1


def test_unsaveable_value_is_refused_before_the_write(tmp_path):
    with CheckpointStore(tmp_path) as store, \
            pytest.raises(CheckpointError, match=r"state\['sampler'\]\['consumed'\]: numpy.int64"):
        store.save({"sampler": {"consumed": np.int64(3)}}, 1)
    assert not list(tmp_path.iterdir())


@pytest.fixture
def gated_write(monkeypatch):
    """Make every atomic write wait until the returned event is set."""
    gate = threading.Event()
    real_bytes, real_torch = atomic.write_bytes, atomic.torch_save

    def slow_bytes(path, data):
        assert gate.wait(10), "test never opened the gate"
        real_bytes(path, data)

    def slow_torch(obj, path):
        assert gate.wait(10), "test never opened the gate"
        return real_torch(obj, path)

    monkeypatch.setattr(atomic, "write_bytes", slow_bytes)
    monkeypatch.setattr(atomic, "torch_save", slow_torch)
    return gate


def test_save_returns_before_the_write_and_snapshots_the_state(tmp_path, gated_write):
    store = CheckpointStore(tmp_path)
    state = state_at(1)
    start = time.perf_counter()
    store.save(state, 1)
    assert time.perf_counter() - start < 1.0
    assert not (tmp_path / "step_00000001.pt").exists()
    state["model"]["w"].fill_(-1.0)  # training goes on while the write is pending
    gated_write.set()
    store.wait()
    assert store.last_stall_s < 1.0 and store.last_write_s > 0
    assert torch.equal(store.latest_valid()[1]["model"]["w"], torch.full((4, 3), 1.0))


def test_second_save_waits_for_the_first(tmp_path, gated_write):
    store = CheckpointStore(tmp_path)
    store.save(state_at(1), 1)
    second = threading.Thread(target=store.save, args=(state_at(2), 2))
    second.start()
    second.join(0.3)
    assert second.is_alive(), "the second save did not wait for the first write"
    gated_write.set()
    second.join(10)
    store.close()
    assert [e["step"] for e in manifest(tmp_path)] == [1, 2]


def test_writer_error_surfaces_from_wait(tmp_path, monkeypatch):
    def disk_full(path, data):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    store = CheckpointStore(tmp_path)
    monkeypatch.setattr(atomic, "write_bytes", disk_full)
    store.save(state_at(1), 1)
    with pytest.raises(OSError, match="No space left"):
        store.wait()
    store.wait()  # raised once, then cleared
    monkeypatch.undo()
    store.save(state_at(2), 2, blocking=True)
    assert store.latest_valid()[1]["step"] == 2


def test_writer_error_surfaces_from_the_next_save(tmp_path, monkeypatch):
    def broken_save(obj, f):
        raise RuntimeError("boom")

    store = CheckpointStore(tmp_path)
    monkeypatch.setattr(checkpoint_files.torch, "save", broken_save)
    store.save(state_at(1), 1)
    with pytest.raises(RuntimeError, match="boom"):
        store.save(state_at(2), 2)


# --- finding the newest intact checkpoint: real damage on disk ----------------------------------
def test_truncated_newest_falls_back_to_previous(tmp_path, caplog):
    save_steps(tmp_path, [1, 2, 3])
    newest = tmp_path / "step_00000003.pt"
    os.truncate(newest, newest.stat().st_size // 2)
    with caplog.at_level(logging.WARNING, logger="framework.state.checkpoint_files"):
        path, state = CheckpointStore(tmp_path).latest_valid()
    assert path.name == "step_00000002.pt" and state["step"] == 2
    assert "step_00000003.pt" in caplog.text and "truncated" in caplog.text


def test_flipped_byte_is_a_checksum_mismatch(tmp_path, caplog):
    save_steps(tmp_path, [1, 2, 3])
    newest = tmp_path / "step_00000003.pt"
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF
    newest.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="framework.state.checkpoint_files"):
        path, state = CheckpointStore(tmp_path).latest_valid()
    assert state["step"] == 2
    assert "step_00000003.pt" in caplog.text and "checksum mismatch" in caplog.text


def test_missing_manifest_scans_files_and_skips_truncated(tmp_path, caplog):
    save_steps(tmp_path, [1, 2, 3])
    (tmp_path / "manifest.json").unlink()
    newest = tmp_path / "step_00000003.pt"
    os.truncate(newest, newest.stat().st_size // 2)
    with caplog.at_level(logging.WARNING, logger="framework.state.checkpoint_files"):
        path, state = CheckpointStore(tmp_path).latest_valid()
    assert path.name == "step_00000002.pt" and state["step"] == 2
    assert "manifest.json is missing" in caplog.text and "step_00000003.pt" in caplog.text


def test_garbled_manifest_scans_files(tmp_path):
    save_steps(tmp_path, [1, 2])
    (tmp_path / "manifest.json").write_text('[{"file": "step_000')
    assert CheckpointStore(tmp_path).latest_valid()[1]["step"] == 2


def test_saving_without_manifest_keeps_the_older_files(tmp_path):
    save_steps(tmp_path, [1, 2])
    (tmp_path / "manifest.json").unlink()
    save_steps(tmp_path, [3])
    assert [e["step"] for e in manifest(tmp_path)] == [1, 2, 3]


def test_empty_directory_has_no_checkpoint(tmp_path):
    assert CheckpointStore(tmp_path / "none").latest_valid() is None


# --- safe loading ------------------------------------------------------------------------------
class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {shlex.quote(str(self.marker))}",)


def test_malicious_pickle_is_refused_and_never_runs(tmp_path, caplog):
    marker = tmp_path / "pwned"
    evil = tmp_path / "step_00000002.pt"
    torch.save({"model": _Payload(marker)}, evil)
    with zipfile.ZipFile(evil) as z:
        assert b"system" in z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
    with pytest.raises(CheckpointError, match="step_00000002.pt: refused: not a plain tensor/dict checkpoint"):
        load_file(evil)
    # Listed in the manifest with a matching checksum, it is still refused and the previous one used.
    save_steps(tmp_path, [1])
    data = evil.read_bytes()
    entries = manifest(tmp_path) + [{"file": evil.name, "step": 2, "bytes": len(data),
                                     "sha256": hashlib.sha256(data).hexdigest()}]
    (tmp_path / "manifest.json").write_text(json.dumps(entries))
    with caplog.at_level(logging.WARNING, logger="framework.state.checkpoint_files"):
        assert CheckpointStore(tmp_path).latest_valid()[1]["step"] == 1
    assert "step_00000002.pt" in caplog.text and "refused" in caplog.text
    assert not marker.exists()


def test_whole_training_state_loads_weights_only(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict(),
             "sampler": {"epoch": 1, "consumed": 48}, "rng": rng.capture(), "step": 7, "config": {"lr": 1e-3}}
    with CheckpointStore(tmp_path) as store:
        store.save(state, 7, blocking=True)
    loaded = load_file(tmp_path / "step_00000007.pt")
    assert_same(loaded, state)
    assert loaded["model"]._metadata == state["model"]._metadata
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
    check_model_shapes(loaded["model"], fresh)
    fresh.load_state_dict(loaded["model"])
    torch.optim.AdamW(fresh.parameters()).load_state_dict(loaded["optimizer"])
    rng.restore(loaded["rng"])


# --- markers and shape checks ----------------------------------------------------------------
def test_markers(tmp_path):
    assert read_marker(tmp_path, PREEMPTED) is None
    write_marker(tmp_path, PREEMPTED, "SIGTERM at step 12")
    write_marker(tmp_path, FATAL, "non-finite loss")
    assert read_marker(tmp_path, PREEMPTED) == "SIGTERM at step 12"
    clear_marker(tmp_path, PREEMPTED)
    clear_marker(tmp_path, PREEMPTED)
    assert read_marker(tmp_path, PREEMPTED) is None and read_marker(tmp_path, FATAL) == "non-finite loss"
    assert sorted(os.listdir(tmp_path)) == [FATAL]


def test_shape_mismatch_names_every_key():
    model = torch.nn.ModuleDict({"fc": torch.nn.Linear(256, 1024), "head": torch.nn.Linear(4, 4)})
    state = {"fc.weight": torch.zeros(512, 128), "fc.bias": torch.zeros(1024), "extra": torch.zeros(1)}
    with pytest.raises(CheckpointError) as info:
        check_model_shapes(state, model)
    message = str(info.value)
    assert message.startswith("checkpoint does not fit the model: fc.weight is (512, 128) in the checkpoint "
                              "but (1024, 256) in the model")
    assert "head.weight is missing from the checkpoint" in message
    assert "extra is in the checkpoint but not in the model" in message
    assert "fc.bias" not in message


def test_shape_check_diagnoses_a_ddp_prefix():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(CheckpointError, match="'module.'.*unwrap"):
        check_model_shapes({f"module.{k}": v for k, v in model.state_dict().items()}, model)


# --- RNG -------------------------------------------------------------------------------------
def draws():
    return (random.random(), random.gauss(0, 1), torch.rand(3).tolist(), np.random.rand(2).tolist(),
            np.random.standard_normal(), rng.numpy_generator().integers(0, 2**62, 3).tolist())


def test_rng_capture_restore_round_trip():
    rng.seed_all(123)
    random.gauss(0, 1)  # leaves a cached second normal in Python's state
    np.random.standard_normal()  # and in numpy's legacy state
    state = rng.capture()
    first = draws()
    rng.restore(state)
    assert draws() == first


def test_rng_state_is_plain_and_survives_weights_only(tmp_path):
    rng.seed_all(7)
    state = rng.capture()

    def leaves(obj):
        if isinstance(obj, dict):
            return [x for v in obj.values() for x in leaves(v)]
        if isinstance(obj, (list, tuple)):
            return [x for v in obj for x in leaves(v)]
        return [obj]

    assert {type(x) for x in leaves(state)} <= {int, float, str, type(None), torch.Tensor}
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    first = draws()
    rng.restore(loaded)
    assert draws() == first


def test_rng_restore_rejects_a_foreign_state():
    with pytest.raises(ValueError, match="numpy_generator"):
        rng.restore({"python": [], "torch": torch.get_rng_state(), "numpy": {}})


# --- runs sharing a checkpoint_dir: lineages ---------------------------------------------------
MAIN = SimpleNamespace(is_main=True, distributed=False)


def step_names(directory):
    return sorted(p.name for p in directory.glob("step_*.pt"))


def contents(directory, names):
    return {name: (directory / name).read_bytes() for name in names}


def test_fresh_run_in_a_used_directory_keeps_both_runs_checkpoints(tmp_path, caplog):
    first = save_steps(tmp_path, [100, 200, 300])
    old = contents(tmp_path, step_names(tmp_path))
    with caplog.at_level(logging.WARNING, logger="framework.state.checkpoint_files"), \
            CheckpointStore(tmp_path, keep_last=3) as second:
        assert choose_checkpoint("none", second, MAIN) is None
        second.save(state_at(50), 50, blocking=True)
        assert (tmp_path / "step_00000050.pt").is_file()
        path, state = second.latest_valid()
        assert path.name == "step_00000050.pt" and state["step"] == 50
        for step in (60, 70, 80):
            second.save(state_at(step), step)
    assert second.lineage != first.lineage
    assert step_names(tmp_path) == [step_file(s) for s in (60, 70, 80, 100, 200, 300)]
    assert contents(tmp_path, old) == old
    a, b = first.lineage, second.lineage
    assert [(e["step"], e["lineage"], e["seq"]) for e in manifest(tmp_path)] == [
        (100, a, 1), (200, a, 2), (300, a, 3), (60, b, 5), (70, b, 6), (80, b, 7)]
    other_runs = [r.getMessage() for r in caplog.records if "other runs" in r.getMessage()]
    assert len(other_runs) == 1 and "3 checkpoints of 1 other runs" in other_runs[0]
    with CheckpointStore(tmp_path) as third:
        assert choose_checkpoint("auto", third, MAIN)["step"] == 80
        assert third.lineage == second.lineage


def test_rollback_keeps_the_resumed_from_file_and_resumes_the_newest_written(tmp_path):
    first = save_steps(tmp_path, [100, 200, 300])
    old = contents(tmp_path, step_names(tmp_path))
    written = []
    with CheckpointStore(tmp_path, keep_last=3) as second:
        assert choose_checkpoint(str(tmp_path / "step_00000100.pt"), second, MAIN)["step"] == 100
        assert second.resumed_from == "step_00000100.pt" and second.lineage != first.lineage
        for step in (150, 200, 250, 300, 350):
            written.append(second.save(state_at(step), step, blocking=True))
            assert contents(tmp_path, old) == old
            path, state = second.latest_valid()
            assert path == written[-1] and state["step"] == step
    assert written[1].name == f"step_00000200-{second.lineage}.pt"
    assert written[3].name == f"step_00000300-{second.lineage}.pt"
    assert step_names(tmp_path) == sorted([*old, *(p.name for p in written[2:])])
    with CheckpointStore(tmp_path) as third:
        assert choose_checkpoint("auto", third, MAIN)["step"] == 350
        assert third.lineage == second.lineage


def test_restart_continues_the_lineage_and_keeps_its_origin(tmp_path, caplog):
    first = save_steps(tmp_path, [100, 200, 300])
    with caplog.at_level(logging.WARNING, logger="framework.state.checkpoint_files"), \
            CheckpointStore(tmp_path, keep_last=3) as restarted:
        assert choose_checkpoint("auto", restarted, MAIN)["step"] == 300
        assert restarted.lineage == first.lineage
        for step in (400, 500, 600):
            restarted.save(state_at(step), step)
    assert step_names(tmp_path) == [step_file(s) for s in (300, 400, 500, 600)]
    assert "other runs" not in caplog.text
    # The next restart's origin is 600: 300 is no longer any run's origin.
    with CheckpointStore(tmp_path, keep_last=3) as again:
        choose_checkpoint("auto", again, MAIN)
        again.save(state_at(700), 700)
    assert step_names(tmp_path) == [step_file(s) for s in (500, 600, 700)]


def test_saving_the_resumed_step_again_keeps_the_origin_file(tmp_path):
    save_steps(tmp_path, [100, 200])
    origin = (tmp_path / "step_00000200.pt").read_bytes()
    with CheckpointStore(tmp_path, keep_last=1) as restarted:
        restarted.mark_resumed(tmp_path / "step_00000200.pt")
        path = restarted.save(state_at(200), 200, blocking=True)
    assert path.name == f"step_00000200-{restarted.lineage}.pt"
    assert (tmp_path / "step_00000200.pt").read_bytes() == origin
    assert step_names(tmp_path) == sorted(["step_00000200.pt", path.name])


def test_saving_a_step_twice_in_one_lineage_replaces_it(tmp_path):
    store = save_steps(tmp_path, [1, 2, 2])
    assert [(e["file"], e["seq"]) for e in manifest(tmp_path)] == [("step_00000001.pt", 1), ("step_00000002.pt", 3)]
    assert step_names(tmp_path) == ["step_00000001.pt", "step_00000002.pt"]
    assert {e["lineage"] for e in manifest(tmp_path)} == {store.lineage}


def strip_lineages(directory):
    entries = [{k: e[k] for k in ("file", "step", "sha256", "bytes")} for e in manifest(directory)]
    (directory / "manifest.json").write_text(json.dumps(entries[::-1]))


def test_legacy_manifest_loads_in_step_order_and_a_restart_continues_it(tmp_path):
    save_steps(tmp_path, [100, 200, 300])
    strip_lineages(tmp_path)
    with CheckpointStore(tmp_path, keep_last=3) as restarted:
        assert choose_checkpoint("auto", restarted, MAIN)["step"] == 300
        assert restarted.lineage == "legacy"
        restarted.save(state_at(400), 400)
    assert [(e["step"], e["lineage"], e["seq"]) for e in manifest(tmp_path)] == [
        (200, "legacy", 2), (300, "legacy", 3), (400, "legacy", 4)]
    assert step_names(tmp_path) == [step_file(s) for s in (200, 300, 400)]


def test_fresh_run_on_a_legacy_manifest_keeps_the_old_files(tmp_path):
    save_steps(tmp_path, [100, 200, 300])
    strip_lineages(tmp_path)
    with CheckpointStore(tmp_path, keep_last=1) as fresh:
        for step in (10, 20):
            fresh.save(state_at(step), step)
        assert fresh.latest_valid()[1]["step"] == 20
    assert step_names(tmp_path) == [step_file(s) for s in (20, 100, 200, 300)]


def test_rebuilding_a_lost_manifest_deletes_no_other_runs_file(tmp_path):
    first = save_steps(tmp_path, [100, 200, 300])
    with CheckpointStore(tmp_path) as rollback:
        rollback.mark_resumed(tmp_path / "step_00000100.pt")
        rollback.save(state_at(200), 200)
    (tmp_path / "manifest.json").unlink()
    before = step_names(tmp_path)
    assert before == sorted([step_file(s) for s in (100, 200, 300)] + [f"step_00000200-{rollback.lineage}.pt"])
    with CheckpointStore(tmp_path) as scanning:
        assert scanning.latest_valid()[1]["step"] == 300
    with CheckpointStore(tmp_path, keep_last=1) as fresh:
        for step in (10, 20):
            fresh.save(state_at(step), step)
    assert step_names(tmp_path) == sorted(before + [step_file(20)])
    lineages = {e["file"]: e["lineage"] for e in manifest(tmp_path)}
    assert lineages[f"step_00000200-{rollback.lineage}.pt"] == rollback.lineage
    # each file as it records its lineage (a plain name's, "legacy", only for a file that records none)
    assert lineages["step_00000100.pt"] == first.lineage and lineages[step_file(20)] == fresh.lineage


def test_a_step_file_whose_writer_died_before_the_manifest_stays_in_its_lineage(tmp_path, monkeypatch):
    """Rank 0 killed between its step file's rename and the manifest's update (healing in place,
    seen under load: kill -9 at step 5 while step 4's write was in flight): the rank that takes
    over its lineage lists that file again as its lineage's, so that keep_last prunes it, whether
    the manifest was older or missing. Before, a lost manifest listed it as another run's
    ("legacy", never deleted), and an older one never listed it. A plain-named file that no
    lineage wrote stays another run's."""
    real = atomic.write_bytes

    def dies_before_the_manifest(path, data):
        if Path(path).name == "manifest.json":
            raise KeyboardInterrupt  # the process dies here; its step file is in place
        real(path, data)

    for steps, lost_manifest in (([1, 2], False), ([], True)):
        directory = tmp_path / f"lost{lost_manifest}"
        first = save_steps(directory, steps, keep_last=2)
        atomic.torch_save(state_at(0), directory / step_file(0))  # a plain file no lineage wrote
        writer = CheckpointStore(directory, keep_last=2)
        writer.lineage = first.lineage
        monkeypatch.setattr(atomic, "write_bytes", dies_before_the_manifest)
        with pytest.raises(KeyboardInterrupt):
            writer.save(state_at(3), 3, blocking=True)
        writer.release()
        monkeypatch.setattr(atomic, "write_bytes", real)
        assert (directory / step_file(3)).is_file()
        assert (directory / "manifest.json").is_file() != lost_manifest
        survivor = CheckpointStore(directory, keep_last=2, rank=1)
        survivor.take_over(lineage=first.lineage, began_from=None)
        for step in (4, 5):
            survivor.save(state_at(step), step, blocking=True)
        survivor.close()
        lineages = {e["file"]: e["lineage"] for e in manifest(directory)}
        # (a plain file that no manifest lists is left alone, as before; a rebuilt manifest lists it)
        assert lineages == {**({step_file(0): "legacy"} if lost_manifest else {}), step_file(4): first.lineage,
                            step_file(5): first.lineage}
        assert step_names(directory) == [step_file(0), step_file(4), step_file(5)]
        assert_same(CheckpointStore(directory).latest_valid()[1], state_at(5))

    # An older file of the lineage that pruning could not delete stays as it is (left in place,
    # unlisted): never taken for the newest, which would prune the newer ones (a reviewer's case).
    directory = tmp_path / "undeletable"
    unlink = Path.unlink

    def busy(path, missing_ok=False):
        if path.name == step_file(1):
            raise OSError(errno.EBUSY, "Device or resource busy", str(path))
        unlink(path, missing_ok=missing_ok)

    with CheckpointStore(directory, keep_last=2) as store:
        for step in (1, 2):
            store.save(state_at(step), step, blocking=True)
        monkeypatch.setattr(Path, "unlink", busy)
        store.save(state_at(3), 3, blocking=True)
        monkeypatch.setattr(Path, "unlink", unlink)
    again = CheckpointStore(directory, keep_last=2)
    again.lineage = store.lineage
    again.save(state_at(4), 4, blocking=True)
    again.close()
    assert [e["step"] for e in manifest(directory)] == [3, 4]
    assert step_names(directory) == [step_file(1), step_file(3), step_file(4)]


def test_a_rollbacks_lineage_adopts_its_own_unlisted_file_and_never_the_rolled_back_over_ones(tmp_path, monkeypatch):
    """Where a rollback meets a writer's death: lineage A wrote steps 2, 4, 6 and rolled back to 4,
    so lineage B redoes steps 5 and 6 (its step 6 beside A's) and its writer dies after step 7's
    file and before the manifest. The rank that takes B over lists B's step 7 and prunes B's own
    with keep_last; A's files, the rolled-back-over step 6 included, are never B's."""
    first = save_steps(tmp_path, [2, 4, 6], keep_last=3)
    rolled = CheckpointStore(tmp_path, keep_last=2)
    rolled.mark_resumed(tmp_path / step_file(4))  # older than A's newest: a lineage of its own
    assert rolled.lineage != first.lineage
    for step in (5, 6):
        rolled.save(state_at(step), step, blocking=True)
    real = atomic.write_bytes

    def dies_before_the_manifest(path, data):
        if Path(path).name == "manifest.json":
            raise KeyboardInterrupt
        real(path, data)

    monkeypatch.setattr(atomic, "write_bytes", dies_before_the_manifest)
    with pytest.raises(KeyboardInterrupt):
        rolled.save(state_at(7), 7, blocking=True)
    monkeypatch.setattr(atomic, "write_bytes", real)
    rolled.release()
    survivor = CheckpointStore(tmp_path, keep_last=2, rank=1)
    survivor.take_over(lineage=rolled.lineage, began_from=None)
    survivor.resumed_from = step_file(4)  # as the record restores it: rank 0 resumed from A's step 4
    survivor.save(state_at(8), 8, blocking=True)
    survivor.close()
    b_six = f"step_00000006-{rolled.lineage}.pt"
    listed = {e["file"]: e["lineage"] for e in manifest(tmp_path)}
    assert listed == {step_file(2): first.lineage, step_file(4): first.lineage, step_file(6): first.lineage,
                      step_file(7): rolled.lineage, step_file(8): rolled.lineage}
    assert step_names(tmp_path) == sorted([step_file(2), step_file(4), step_file(6), step_file(7), step_file(8)])
    assert b_six not in step_names(tmp_path)  # B's own older files pruned, A's kept
    assert_same(CheckpointStore(tmp_path, rank=1).latest_valid()[1], state_at(8))


def test_checkpoints_deleted_by_hand_leave_the_manifest(tmp_path):
    save_steps(tmp_path, [100, 200, 300])
    with CheckpointStore(tmp_path) as second:
        second.save(state_at(1), 1, blocking=True)
        (tmp_path / "step_00000100.pt").unlink()
        (tmp_path / "step_00000200.pt").unlink()
        second.save(state_at(2), 2, blocking=True)
    assert [e["step"] for e in manifest(tmp_path)] == [300, 1, 2]


# --- the checkpoint_dir lock -----------------------------------------------------------------
ROOT = Path(__file__).resolve().parents[3]


def test_second_manager_on_a_locked_directory_fails_with_one_line(tmp_path):
    first = CheckpointStore(tmp_path)
    in_progress = tmp_path / ".step_00000007.pt.tmp.4242"
    in_progress.write_bytes(b"the first run's write in progress")
    with pytest.raises(CheckpointDirLocked) as info:
        CheckpointStore(tmp_path)
    message = str(info.value)
    assert isinstance(info.value, RuntimeError) and "\n" not in message
    assert message.startswith(f"checkpoint.dir {tmp_path} is in use by another run "
                              f"(pid {os.getpid()} on {socket.gethostname()}")
    assert message.endswith("wait for it to finish, or use another checkpoint.dir")
    assert in_progress.exists()
    assert CheckpointStore(tmp_path, rank=1).latest_valid() is None  # other ranks take no lock
    first.close()
    assert not (tmp_path / ".lock").exists()
    with CheckpointStore(tmp_path) as second:
        assert not in_progress.exists()
        second.save(state_at(1), 1)


def test_lock_goes_with_the_manager_and_a_save_after_close_takes_it_again(tmp_path):
    store = CheckpointStore(tmp_path)
    del store
    with CheckpointStore(tmp_path) as store:
        store.save(state_at(1), 1)
    store.save(state_at(2), 2, blocking=True)
    with pytest.raises(CheckpointDirLocked):
        CheckpointStore(tmp_path)
    store.close()
    assert store.latest_valid()[1]["step"] == 2


def test_a_survivor_checkpoint_continues_the_lineage_takes_the_lock_and_prunes_nothing(tmp_path):
    """A survivor of a peer's loss writes alone (Checkpointer.save_survivor): from rank 0, after its
    pending write; from another rank only once rank 0 (and its lock) is gone; once per step."""
    rank0 = CheckpointStore(tmp_path, keep_last=1)
    rank0.save(state_at(4), 4)
    rank0.save(state_at(8), 8)  # pending in the background when the survivor checkpoint comes
    lineage = rank0.lineage
    other = CheckpointStore(tmp_path, keep_last=1, rank=1)
    assert other.write_survivor(state_at(9), 9, lineage=lineage) is None  # rank 0 holds the lock
    assert rank0.write_survivor(state_at(9), 9, lineage=lineage) == tmp_path / "step_00000009.pt"
    rank0.close()  # rank 0 gone, and its lock
    assert other.write_survivor(state_at(9), 9, lineage=lineage) is None  # its lineage has step 9
    assert other.write_survivor(state_at(10), 10, lineage=lineage) == tmp_path / "step_00000010.pt"
    assert not (tmp_path / ".lock").exists()
    # No pruning (keep_last=1): a survivor does not know which file the run resumed from.
    assert [(e["step"], e["lineage"]) for e in manifest(tmp_path)] == [(8, lineage), (9, lineage), (10, lineage)]
    restarted = CheckpointStore(tmp_path, keep_last=1)
    path, state = restarted.latest_valid(lineages=[lineage])
    assert path == tmp_path / "step_00000010.pt"
    assert_same(state, state_at(10))
    restarted.mark_resumed(path)
    assert restarted.lineage == lineage
    restarted.save(state_at(11), 11, blocking=True)
    assert [e["step"] for e in manifest(tmp_path)] == [10, 11]  # the restart prunes, keeping its origin
    restarted.close()


def test_a_survivor_checkpoint_writes_a_lineages_origin_and_never_without_a_real_lock(tmp_path, monkeypatch):
    """The first entry of a lineage that began from a file elsewhere (resume=PATH) names it, so a
    resume can go back there; another rank writes only while it really holds the lock (two
    survivors on a file system without flock would write side by side)."""
    import framework.state.checkpoint_files as checkpoint_files

    origin = str(tmp_path / "elsewhere" / "step_00000004.pt")
    ck = tmp_path / "ck"
    assert CheckpointStore(ck, rank=1).write_survivor(state_at(5), 5, lineage="aaa", began_from=origin)
    assert manifest(ck)[0]["began_from"] == origin
    monkeypatch.setattr(checkpoint_files, "_locked_fd", lambda *args: None)  # ENOLCK: no lock, a warning
    assert CheckpointStore(ck, rank=1).write_survivor(state_at(6), 6, lineage="aaa") is None
    assert [e["step"] for e in manifest(ck)] == [5]


HOLD_LOCK = ("import sys, time\n"
             "from framework.state.checkpoint_files import CheckpointStore\n"
             "store = CheckpointStore(sys.argv[1])\n"
             "print('locked', flush=True)\n"
             "time.sleep(120)\n")


@pytest.mark.dist
def test_lock_of_a_process_killed_with_sigkill_is_free(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(tmp_path)], cwd=ROOT,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "locked\n"
        with pytest.raises(CheckpointDirLocked, match=f"pid {holder.pid} on "):
            CheckpointStore(tmp_path)
    finally:
        holder.kill()
        holder.wait(timeout=30)
        holder.stdout.close()
    assert holder.returncode == -signal.SIGKILL
    with CheckpointStore(tmp_path) as store:
        store.save(state_at(1), 1, blocking=True)
    assert manifest(tmp_path)[0]["step"] == 1


HOLD_LOCK_FOR = ("import sys, time\n"
                 "from framework.state.checkpoint_files import CheckpointStore\n"
                 "store = CheckpointStore(sys.argv[1])\n"
                 "print('locked', flush=True)\n"
                 "time.sleep(float(sys.argv[2]))\n"
                 "store.close()\n")


@pytest.mark.dist
@pytest.mark.parametrize("holder_run", ["job7", "other"])
def test_a_restart_waits_for_a_survivor_of_its_run_that_still_holds_the_lock(tmp_path, monkeypatch, holder_run):
    """Issue 33, bug 4: a survivor checkpoint of a large model outlasts the next round's last
    call; the new rank 0 got CheckpointDirLocked, exited 2 and burnt a restart (or ended the run).
    A restart waits for a holder of its own torchrun run; another run's fails at once."""
    from framework.config import resolve_config
    from framework.ddp.process_group import DistEnv
    from framework.state.checkpointer import open_store

    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK_FOR, str(tmp_path), "2"], cwd=ROOT,
                              stdout=subprocess.PIPE, text=True, env={**os.environ, "TORCHELASTIC_RUN_ID": holder_run})
    try:
        assert holder.stdout.readline() == "locked\n"
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job7")
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # a restart of the launch
        cfg = resolve_config({"checkpoint.dir": str(tmp_path), "ddp.timeout_s": 60})
        env = DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, device=torch.device("cpu"), backend=None)
        start = time.monotonic()
        if holder_run == "other":
            with pytest.raises(CheckpointDirLocked, match=f"pid {holder.pid} on "):
                open_store(cfg, env)
            assert time.monotonic() - start < 1
        else:
            store = open_store(cfg, env)
            assert 1 < time.monotonic() - start < 30 and holder.wait(timeout=30) == 0
            store.save(state_at(1), 1, blocking=True)
            store.close()
    finally:
        holder.kill()
        holder.wait(timeout=30)
        holder.stdout.close()


@pytest.mark.dist
def test_a_second_run_on_a_busy_checkpoint_dir_exits_2_with_one_line(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    args = ["--vocab-size=32", "--hidden-size=32", "--num-layers=1", "--num-heads=2", "--seq-len=16",
            "--dataset-size=128", "--batch-size=8", "--num-workers=0", "--logging.tensorboard=false",
            "--eval.interval=0", "--log-interval=1",
            f"--checkpoint.dir={tmp_path / 'ck'}"]
    first = subprocess.Popen([sys.executable, str(root / "ddp_training.py"), *args, "--train.max_steps=100000",
                              "--num-epochs=100000", "--target-loss=0", f"--logging.dir={tmp_path / 'a'}"], cwd=root,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        log_a = tmp_path / "a" / "rank_0.log"
        while not log_a.exists() or "step 1/" not in log_a.read_text():
            assert time.monotonic() < deadline and first.poll() is None
            time.sleep(0.05)
        second = subprocess.run([sys.executable, str(root / "ddp_training.py"), *args, "--train.max_steps=2",
                                 f"--logging.dir={tmp_path / 'b'}"], cwd=root, capture_output=True, text=True,
                                timeout=60)
    finally:
        first.kill()
        first.wait()
    assert second.returncode == 2
    assert second.stderr.strip().splitlines()[-1].startswith(f"error: checkpoint.dir {tmp_path / 'ck'} is in use by "
                                                             f"another run (pid {first.pid}")
    assert "Traceback" not in second.stderr


# --- issue 19: transient read errors, candidates by lineage -----------------------------------
def test_an_unreadable_checkpoint_is_skipped_naming_its_errno_and_none_left_raises_unreadable(
        tmp_path, monkeypatch, caplog):
    from framework.state.checkpoint_files import CheckpointUnreadable
    save_steps(tmp_path, [1, 2])
    read_bytes = Path.read_bytes

    def stale(self):
        if self.name.startswith("step_"):
            if self.name == step_file(2) or stale.all:
                raise OSError(errno.ESTALE, "Stale file handle", str(self))
        return read_bytes(self)

    stale.all = False
    monkeypatch.setattr(Path, "read_bytes", stale)
    with CheckpointStore(tmp_path) as store, caplog.at_level(logging.WARNING):
        path, state = store.latest_valid()
        assert path.name == step_file(1) and state["step"] == 1
        assert f"{tmp_path / step_file(2)} is unusable: unreadable (ESTALE: Stale file handle)" in caplog.text
        stale.all = True
        with pytest.raises(CheckpointUnreadable, match=r"step_00000002.pt: ESTALE.*step_00000001.pt: ESTALE"):
            store.latest_valid()
    assert isinstance(CheckpointUnreadable("x"), OSError) and not isinstance(CheckpointUnreadable("x"), CheckpointError)


def test_latest_valid_with_lineages_takes_only_theirs_or_the_named_files(tmp_path):
    save_steps(tmp_path, [1, 2])
    with CheckpointStore(tmp_path) as ours:
        ours.save(state_at(3), 3, blocking=True)
        theirs = {e["lineage"] for e in manifest(tmp_path)} - {ours.lineage}
        assert ours.latest_valid(lineages={ours.lineage})[1]["step"] == 3
        assert ours.latest_valid(before=3, lineages={ours.lineage}) is None
        assert ours.latest_valid(before=3, lineages={ours.lineage}, files={step_file(1)})[1]["step"] == 1
        assert ours.latest_valid(before=3)[1]["step"] == 2  # without lineages: any run's
        assert ours.lineage_of(tmp_path / step_file(2)) in theirs
        (tmp_path / "manifest.json").unlink()  # the scan knows a lineage only from a file's name
        assert ours.latest_valid(lineages={ours.lineage}) is None


def test_an_old_checkpoint_that_cannot_be_deleted_fails_no_save(tmp_path, caplog):
    """The explorer's unreadable_newest (a step file replaced by a directory): once keep_last drops it,
    the unlink fails (EISDIR); the new checkpoint is written and listed all the same, and the file
    stays for a person to look at."""
    save_steps(tmp_path, [1, 2])
    (tmp_path / step_file(1)).unlink()
    (tmp_path / step_file(1)).mkdir()
    with CheckpointStore(tmp_path, keep_last=2) as restarted, caplog.at_level(logging.WARNING):
        choose_checkpoint("auto", restarted, MAIN)
        restarted.save(state_at(3), 3, blocking=True)
        restarted.save(state_at(4), 4, blocking=True)
    assert [e["step"] for e in manifest(tmp_path)] == [2, 3, 4]  # 2: the origin, kept
    assert (tmp_path / step_file(1)).is_dir()
    assert f"could not remove old checkpoint {tmp_path / step_file(1)}" in caplog.text


def test_a_lost_manifest_is_rebuilt_past_a_step_file_that_cannot_be_read(tmp_path, caplog):
    save_steps(tmp_path, [1, 2])
    (tmp_path / "manifest.json").unlink()
    (tmp_path / step_file(2)).unlink()
    (tmp_path / step_file(2)).mkdir()
    with CheckpointStore(tmp_path, keep_last=3) as store, caplog.at_level(logging.WARNING):
        store.save(state_at(3), 3, blocking=True)
    assert [e["step"] for e in manifest(tmp_path)] == [1, 3]
    assert f"{tmp_path / step_file(2)} is unreadable" in caplog.text


def test_a_replica_that_takes_over_a_run_resuming_from_its_checkpoint_never_writes_over_a_newer_file(tmp_path):
    """Healing in place, a replica joining a restart generation as rank 0 takes over checkpoint_dir
    and resumes from the checkpoint; the newest (step 8) is unreadable, so it resumes from step 4
    and redoes steps 5-8: it must write step 8 beside the newer file, under a lineage of its own,
    as a restarted process does (an explorer trial wrote over the unreadable file, failed, and
    crashed at the final save). Taking over with the members' state in memory continues the lineage."""
    from types import SimpleNamespace

    from framework.resilience import markers
    from framework.state.checkpointer import Checkpointer

    first = save_steps(tmp_path, [4, 8])
    markers.record_lineages(tmp_path, current=first.lineage, lineages=[first.lineage], resumed=None, began_from=None)
    (tmp_path / "step_00000008.pt").unlink()
    (tmp_path / "step_00000008.pt").mkdir()  # unreadable (EISDIR), still listed
    cfg = SimpleNamespace(checkpoint=SimpleNamespace(resume="auto"))
    for was_main, resuming in ((False, False), (False, True), (True, True)):
        store = CheckpointStore(tmp_path, rank=0 if was_main else 1)
        if was_main:  # rank 0 survived, in the lineage it wrote, and nobody holds a state: it resumes too
            store.lineage = first.lineage
        checkpointer = Checkpointer(cfg, SimpleNamespace(is_main=was_main), store, {}, builtin_data=True)
        checkpointer.take_over(SimpleNamespace(is_main=True), resuming=resuming)
        try:
            assert (store.lineage == first.lineage) == (not resuming)
            if resuming:
                store.mark_resumed(tmp_path / "step_00000004.pt")
                path = store.save(state_at(8), 8, blocking=True)
                assert path.name == f"step_00000008-{store.lineage}.pt" and (tmp_path / "step_00000008.pt").is_dir()
        finally:
            store.close()


@pytest.mark.parametrize("resume", ["none", "PATH"])
def test_a_generation_healed_in_place_from_the_checkpoint_continues_the_launch_not_its_start(tmp_path, resume):
    """Healing in place, a generation in which no member holds a state resumes from the checkpoint
    (``take_over(resuming=True)``). Before any restart of the group, it must still continue this
    launch's own lineage, as a restart does: under checkpoint.resume=none it started afresh at
    step 0, and under resume=PATH it went back to PATH, losing every step the launch had trained."""
    from framework.resilience import markers
    from framework.state.checkpointer import Checkpointer

    start = save_steps(tmp_path / "elsewhere", [2])
    path = "none" if resume == "none" else str(tmp_path / "elsewhere" / step_file(2))
    cfg = SimpleNamespace(checkpoint=SimpleNamespace(resume=path))
    store = CheckpointStore(tmp_path / "run", rank=0)
    checkpointer = Checkpointer(cfg, MAIN, store, {}, builtin_data=True)
    try:
        assert (checkpointer._choose()[0] is None) == (resume == "none")  # the launch's start
        for step in (4, 8):
            store.save(state_at(step), step, blocking=True)
        checkpointer.take_over(MAIN, resuming=True)  # rank 0 survived; nobody holds a state
        chosen, state = checkpointer._choose()
        assert chosen is not None and state["step"] == 8, (chosen, start.lineage)
        assert markers.recorded_lineages(tmp_path / "run")["current"] == store.lineage
    finally:
        store.close()


def test_a_replica_that_takes_over_from_a_lost_rank_0_keeps_the_file_the_launch_resumed_from(tmp_path):
    """Healing in place, a survivor that becomes rank 0 (rank 0 was lost) must protect the file
    the launch resumed from as rank 0 did: pruning never deletes it, and a rollback may go back to
    it. Before, the new rank 0 had no ``resumed_from``, and its next saves pruned that file with
    ``keep_last``."""
    from framework.state.checkpointer import Checkpointer

    save_steps(tmp_path, [2, 4], keep_last=2)
    cfg = SimpleNamespace(checkpoint=SimpleNamespace(resume="auto"))
    store = CheckpointStore(tmp_path, rank=0, keep_last=2)
    first = Checkpointer(cfg, MAIN, store, {}, builtin_data=True)
    assert first._choose()[0].name == step_file(4)  # the launch resumes from step 4, continuing its lineage
    for step in (5, 6):
        store.save(state_at(step), step, blocking=True)
    assert step_file(4) in step_names(tmp_path)
    store.release()  # rank 0 is lost; its lock goes with it
    survivor_store = CheckpointStore(tmp_path, rank=1, keep_last=2)
    survivor = Checkpointer(cfg, SimpleNamespace(is_main=False, distributed=False), survivor_store, {},
                            builtin_data=True)
    survivor.take_over(MAIN)
    try:
        assert survivor_store.lineage == store.lineage
        for step in (7, 8):
            survivor_store.save(state_at(step), step, blocking=True)
        assert step_names(tmp_path) == [step_file(4), step_file(7), step_file(8)]
        assert survivor.origin == step_file(4)
        chosen, state = survivor._choose(before=7)  # a rollback past every kept step goes back to the origin
        assert chosen.name == step_file(4) and state["step"] == 4
    finally:
        survivor_store.close()

    # The launch resumed from an older file of another run's lineage (resume=PATH in the directory):
    # it writes a lineage of its own, and only the origin it spared leads a rollback back there.
    directory = tmp_path / "older"
    save_steps(directory, [2, 4, 6], keep_last=3)
    cfg = SimpleNamespace(checkpoint=SimpleNamespace(resume=str(directory / step_file(4))))
    store = CheckpointStore(directory, rank=0, keep_last=2)
    assert Checkpointer(cfg, MAIN, store, {}, builtin_data=True)._choose()[0].name == step_file(4)
    for step in (7, 8):
        store.save(state_at(step), step, blocking=True)
    store.release()
    survivor_store = CheckpointStore(directory, rank=1, keep_last=2)
    survivor = Checkpointer(cfg, SimpleNamespace(is_main=False, distributed=False), survivor_store, {},
                            builtin_data=True)
    survivor.take_over(MAIN)
    try:
        chosen, state = survivor._choose(before=7)
        assert chosen is not None and chosen.name == step_file(4) and state["step"] == 4
    finally:
        survivor_store.close()
