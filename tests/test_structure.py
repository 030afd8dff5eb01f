"""The layout promises: a composing trainer, short functions, no import cycle, a torch-free
config check, and a README architecture list that matches framework/."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FRAMEWORK = ROOT / "framework"


def framework_imports() -> dict[str, set[str]]:
    """Each module -> the framework modules it imports at module level (not inside functions)."""
    graph = {}
    units = [(p.stem, [p], 1) for p in sorted(FRAMEWORK.glob("*.py"))]
    units += [(d.name, sorted(d.glob("*.py")), 2) for d in sorted(FRAMEWORK.iterdir()) if (d / "__init__.py").is_file()]
    for name, paths, level in units:  # a subpackage is one unit: its modules import the rest with level 2
        deps = set()
        for node in (n for path in paths for n in ast.parse(path.read_text()).body):
            if isinstance(node, ast.ImportFrom) and node.level == level:
                if node.module:
                    deps.add(node.module.split(".")[0])
                else:
                    deps.update(alias.name for alias in node.names)
        graph[name] = deps
    modules = set(graph)
    return {name: (deps & modules) - {name, "__init__"} for name, deps in graph.items()}


def import_order() -> list[str]:
    """The modules, each after every module it imports (ties by name); fails on a cycle."""
    graph, order = framework_imports(), []
    while len(order) < len(graph):
        ready = sorted(m for m in graph if m not in order and graph[m] <= set(order))
        assert ready, f"import cycle among {sorted(set(graph) - set(order))}"
        order += ready
    return [m for m in order if m != "__init__"]


def test_trainer_stays_a_composer():
    assert len((FRAMEWORK / "trainer.py").read_text().splitlines()) <= 351


def test_no_function_over_60_lines():
    long = []
    for path in FRAMEWORK.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > 60:
                    long.append(f"{path.name}:{node.name} ({length} lines)")
    assert not long


def test_no_import_cycle():
    assert "trainer" in import_order()


def test_check_config_imports_no_torch(tmp_path):
    out = subprocess.run([sys.executable, "-X", "importtime", str(ROOT / "ddp_training.py"), "--check-config",
                          "--log-dir", str(tmp_path)], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    imported = [line.split("|")[-1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")]
    assert "framework.config" in imported
    assert not [m for m in imported if m == "torch" or m.startswith("torch.")]


def test_readme_architecture_lists_the_modules_in_import_order():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("<!-- architecture:start -->\n")[1].split("<!-- architecture:end -->")[0]
    listed = [line.split("`")[1].removeprefix("framework/").removesuffix(".py").removesuffix("/")
              for line in section.splitlines() if line.startswith("- `framework/")]
    assert listed == import_order()


def test_every_numeric_config_field_declares_its_bounds():
    from framework.config import FIELDS
    numeric = {key: f for key, f in FIELDS.items() if f.type in ("int", "float")}
    assert numeric and [key for key, f in numeric.items() if "bounds" not in f.metadata] == []
