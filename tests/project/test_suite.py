"""The test suite's own rules: bench/ stands without tests/, and the multi-process marker is honest."""

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import conftest
from tests.conftest import NotMarkedDist, dist_command

ROOT = Path(__file__).resolve().parents[2]


def test_bench_never_imports_tests():
    offenders = []
    for path in sorted((ROOT / "bench").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""] if node.level == 0 else ["." * node.level]
            else:
                continue
            offenders += [f"{path.name}:{node.lineno} {name}" for name in names
                          if name == "tests" or name.startswith("tests.")]
    assert list((ROOT / "bench").glob("*.py")) and offenders == []


def test_a_test_not_marked_dist_cannot_start_torchrun(tmp_path):
    marker = tmp_path / "started"
    with pytest.raises(NotMarkedDist, match="test_a_test_not_marked_dist_cannot_start_torchrun starts "
                                             "torch.distributed.run but is not marked @pytest.mark.dist"):
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                        "--no-python", "touch", str(marker)], timeout=120)
    assert not marker.exists()
    assert dist_command([str(ROOT / "launch_training.sh"), "--cpu"]) == "launch_training.sh"
    assert dist_command(f"{sys.executable} ddp_training.py --max-steps 2") == "ddp_training.py"
    assert dist_command([sys.executable, "ddp_training.py", "--check-config"]) is None
    assert dist_command([sys.executable, "-c", "print(1)"]) is None


def test_a_test_not_marked_dist_cannot_start_torchrun_through_a_child_either(tmp_path):
    """A child process (a bench script, say) inherits the refusal: torchrun_cmd raises there too."""
    script = tmp_path / "child.py"
    script.write_text("from harness.launch import torchrun_cmd\ntorchrun_cmd('x.py', [])\n")
    out = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 1
    assert out.stderr.strip().splitlines()[-1] == (
        "RuntimeError: tests/project/test_suite.py::"
        "test_a_test_not_marked_dist_cannot_start_torchrun_through_a_child_either "
        "starts torchrun but is not marked @pytest.mark.dist")


@pytest.mark.dist
def test_a_dist_test_may_start_torchrun():
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--help"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and "--nproc-per-node" in out.stdout


def test_requires_gpus_skips_with_how_many_the_host_has_and_runs_where_there_are_enough(monkeypatch):
    class Item:
        nodeid = "tests/x.py::test_x"

        def __init__(self, mark):
            self.mark = mark

        def get_closest_marker(self, name):
            return self.mark if name == "requires" else None

    monkeypatch.setattr(conftest, "cuda_gpus", lambda: 1)
    with pytest.raises(pytest.skip.Exception, match=r"needs 2 CUDA GPU\(s\); this host has 1"):
        conftest.pytest_runtest_setup(Item(pytest.mark.requires(gpus=2).mark))
    conftest.pytest_runtest_setup(Item(pytest.mark.requires(gpus=1).mark))  # enough: runs
    conftest.pytest_runtest_setup(Item(None))  # unmarked: runs
    with pytest.raises(pytest.UsageError, match="gpus=N only"):
        conftest.pytest_runtest_setup(Item(pytest.mark.requires(cpus=4).mark))
