"""The layout promises: packages by concern with no import cycle, short functions, no module but
the trainer reaching into the trainer, a torch-free config check, and a docs/architecture.md module list
that matches framework/."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FRAMEWORK = ROOT / "framework"


def module_name(path: Path) -> str:
    """framework/state/checkpointer.py -> "state.checkpointer"; framework/trainer.py -> "trainer"."""
    return ".".join(path.relative_to(FRAMEWORK).with_suffix("").parts)


def framework_modules() -> list[Path]:
    """Every module of framework/ but the package __init__ files (they import nothing)."""
    return [p for p in sorted(FRAMEWORK.rglob("*.py")) if p.name != "__init__.py"]


def framework_imports() -> dict[str, set[str]]:
    """Each module -> the framework modules it imports at module level (not inside functions)."""
    paths = framework_modules()
    modules = {module_name(p) for p in paths}
    graph = {}
    for path in paths:
        name = module_name(path)
        package = name.split(".")[:-1]
        deps = set()
        for node in ast.parse(path.read_text()).body:
            if not (isinstance(node, ast.ImportFrom) and node.level >= 1):
                continue
            base = package[:len(package) - (node.level - 1)] + (node.module.split(".") if node.module else [])
            for alias in node.names:
                as_module = ".".join(base + [alias.name])
                target = as_module if as_module in modules else ".".join(base)
                # a package's __init__ re-exports its modules (framework/config): depend on all of them
                deps.update([target] if target in modules else [m for m in modules if m.startswith(target + ".")])
        graph[name] = (deps & modules) - {name}
    return graph


def import_order() -> list[str]:
    """The modules, each after every module it imports (ties by name); fails on a cycle."""
    graph, order = framework_imports(), []
    while len(order) < len(graph):
        ready = sorted(m for m in graph if m not in order and graph[m] <= set(order))
        assert ready, f"import cycle among {sorted(set(graph) - set(order))}"
        order += ready
    return order


def test_the_import_graph_sees_the_packages():
    graph = framework_imports()
    assert {"state.checkpointer", "resilience.markers", "config.schema"} <= graph["trainer"]
    assert "state.checkpoint_files" in graph["state.checkpointer"]  # a sibling, "from .checkpoint_files import"
    assert "state.atomic" in graph["resilience.markers"]  # another package, "from ..state import atomic"


def test_no_function_over_60_lines():
    long = []
    for path in framework_modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > 60:
                    long.append(f"{module_name(path)}:{node.name} ({length} lines)")
    assert not long


def reaches_into_the_trainer(path: Path) -> list[str]:
    """Where a module reads or writes the trainer's state: an attribute of a name ``trainer`` (or of
    ``x.trainer``), or a parameter named ``trainer`` that would receive it."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute):
            owner = node.value
            if (isinstance(owner, ast.Name) and owner.id == "trainer") or (
                    isinstance(owner, ast.Attribute) and owner.attr == "trainer"):
                found.append(f"{module_name(path)}:{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.arg) and node.arg == "trainer":
            found.append(f"{module_name(path)}:{node.lineno}: parameter 'trainer'")
    return found


def test_no_module_but_the_trainer_reaches_into_the_trainer():
    """The trainer owns its lifecycle; the components it composes get what they need as arguments.
    train/callbacks.py needs no exception: it hands the trainer to user callbacks as an opaque
    ``owner`` and reads nothing of it. framework/hf/ sits above the trainer, as a user's
    script does: it may use the trainer's public surface, and nothing private (checked below)."""
    found = [line for path in framework_modules() if path != FRAMEWORK / "trainer.py"
             and path.parent != FRAMEWORK / "hf" for line in reaches_into_the_trainer(path)]
    assert found == []


def test_the_hf_drop_in_uses_only_the_trainers_public_surface():
    private = []
    for path in (FRAMEWORK / "hf").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                    and isinstance(node.value, ast.Name) and node.value.id in ("trainer", "engine")):
                private.append(f"{path.name}:{node.lineno}: {node.value.id}.{node.attr}")
    assert private == []


def test_the_trainer_check_sees_an_access(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("def finish(trainer):\n    return trainer.step\n\n\ndef f(self):\n    self.trainer.cfg = 1\n")
    global FRAMEWORK
    saved, FRAMEWORK = FRAMEWORK, tmp_path
    try:
        assert len(reaches_into_the_trainer(sample)) == 3
    finally:
        FRAMEWORK = saved


def test_no_import_cycle():
    assert "trainer" in import_order()


def test_check_config_imports_no_torch(tmp_path):
    out = subprocess.run([sys.executable, "-X", "importtime", str(ROOT / "ddp_training.py"), "--check-config",
                          "--logging.dir", str(tmp_path)], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    imported = [line.split("|")[-1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")]
    assert "framework.config" in imported
    assert not [m for m in imported if m == "torch" or m.startswith("torch.")]


def test_docs_architecture_lists_the_modules_in_import_order():
    page = (ROOT / "docs" / "architecture.md").read_text()
    section = page.split("<!-- architecture:start -->\n")[1].split("<!-- architecture:end -->")[0]
    listed = [line.split("`")[1].removeprefix("framework/").removesuffix(".py").replace("/", ".")
              for line in section.splitlines() if line.startswith("- `framework/")]
    assert listed == import_order()


def test_every_numeric_config_field_declares_its_bounds():
    from framework.config import FIELDS
    numeric = {key: f for key, f in FIELDS.items() if f.type in ("int", "float")}
    assert numeric and [key for key, f in numeric.items() if "bounds" not in f.metadata] == []