"""A script that simply ends (no os._exit) exits 0: the framework frees its process group while the
interpreter is whole, not during its finalisation (where torch 2.13 with gloo occasionally aborts,
"terminate called without an active exception")."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.dist_helper import ROOT, launch

WORKER = ROOT / "tests" / "workers" / "clean_exit.py"


def os_exit_calls(path: Path) -> list[int]:
    """The lines of ``path`` that call os._exit."""
    return [node.lineno for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "_exit"]


@pytest.mark.parametrize("script", ["ddp_training.py", "examples/finetune_hf_lora.py"])
def test_the_entry_point_and_the_example_end_without_os_exit(script):
    assert os_exit_calls(ROOT / script) == []


@pytest.mark.dist
def test_a_script_that_simply_ends_exits_0_with_its_process_groups_freed(tmp_path):
    """One 2-rank launch: LoRA through train() (the reported case), then a trainer stepped by hand,
    never closed and kept in a module global. After train() and after the exit handlers, no gloo
    thread is left: nothing of the process group is left for the interpreter's finalisation."""
    run = launch(WORKER, [], tmp_path, env={"CLEAN_EXIT_CASES": "lora,manual"}, timeout=400)
    assert run.returncode == 0, run.output[-4000:]
    assert "terminate called" not in run.output
    for rank in (0, 1):
        for case in ("lora", "manual"):
            assert f"rank {rank}: {case} trained 3 steps" in run.output, run.output[-4000:]
        assert f"rank {rank} gloo threads after lora: []" in run.output, run.output[-4000:]
        assert f"rank {rank} gloo threads at exit: []" in run.output, run.output[-4000:]
