"""The package: pip builds its metadata offline and would install nothing else here (the installed
torch satisfies it); the console script's target is the entry point; pins agree with requirements."""

import json
import subprocess
import sys
import tomllib

import pytest

from framework import __version__
from tests.dist_helper import ROOT

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def requirement_lines(name: str) -> list[str]:
    lines = (ROOT / name).read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith(("#", "-r"))]


@pytest.mark.dist
def test_pip_builds_the_metadata_offline_and_needs_nothing_new(tmp_path):
    report = tmp_path / "report.json"
    out = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-index", "--no-build-isolation",
                          "--disable-pip-version-check", "--quiet", "--report", str(report), "-e", str(ROOT)],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    install = json.loads(report.read_text())["install"]
    assert [item["metadata"]["name"] for item in install] == ["ddp-framework"]  # torch etc. already satisfy it
    metadata = install[0]["metadata"]
    assert metadata["version"] == __version__
    assert "torch>=2.13" in metadata["requires_dist"]
    assert metadata["provides_extra"] == ["hf", "trl", "etcd"]
    assert not list(ROOT.glob("*.egg-info"))


def test_the_console_script_runs_the_entry_point(tmp_path):
    assert PYPROJECT["project"]["scripts"] == {"ddp-train": "ddp_training:cli"}
    setuptools = PYPROJECT["tool"]["setuptools"]
    assert setuptools["py-modules"] == ["ddp_training"]
    module, function = PYPROJECT["project"]["scripts"]["ddp-train"].split(":")
    call = f"import {module}; {module}.{function}()"  # what the generated script does
    ok = subprocess.run([sys.executable, "-c", call, "--check-config", "--logging.dir", str(tmp_path / "logs"),
                         "--checkpoint.dir", str(tmp_path / "ck")], capture_output=True, text=True, cwd=ROOT,
                        timeout=60)
    assert ok.returncode == 0 and ok.stdout.strip() == str(tmp_path / "ck"), ok.stderr
    bad = subprocess.run([sys.executable, "-c", call, "--no-such-key", "1"], capture_output=True, text=True,
                         cwd=ROOT, timeout=60)
    assert bad.returncode == 2 and bad.stderr.startswith("error: command line: unknown key 'no_such_key'")


def test_the_package_holds_every_subpackage():
    """What setuptools finds with pyproject's include is framework/ and every package under it."""
    from setuptools import find_packages
    found = find_packages(where=str(ROOT), **PYPROJECT["tool"]["setuptools"]["packages"]["find"])
    on_disk = [".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "framework").rglob("__init__.py")]
    assert sorted(found) == sorted(on_disk) and "framework.state" in found and "framework" in found


def test_dependencies_agree_with_the_requirement_files():
    runtime = PYPROJECT["project"]["dependencies"]
    assert "torch>=2.13" in runtime  # never a pin that would replace an installed CUDA or CPU build
    names = {r.split(">")[0].split("=")[0] for r in requirement_lines("requirements.txt")}
    assert {r.split(">")[0] for r in runtime} <= names
    hf_names = ("transformers", "peft", "accelerate")  # safetensors, the export format, is a runtime dependency
    hf = [r for r in requirement_lines("requirements-dev.txt") if r.split("==")[0] in hf_names]
    assert PYPROJECT["project"]["optional-dependencies"]["hf"] == hf
    etcd = [r for r in requirement_lines("requirements-dev.txt") if r.startswith("python-etcd==")]
    assert PYPROJECT["project"]["optional-dependencies"]["etcd"] == etcd
    trl = [r for r in requirement_lines("requirements-dev.txt") if r.split("==")[0] in ("trl", "datasets")]
    assert PYPROJECT["project"]["optional-dependencies"]["trl"] == trl + hf  # TRL with the hf extra's pins
