"""Docs that cannot drift: every concrete claim README.md and docs/*.md make about the code, checked
against the code itself.

Each page is parsed once into inline code spans (with their line and the paragraph or table row they
sit in) and fenced code blocks. One extractor per kind of claim turns them into ``Claim``s, and one
test per kind checks them, failing with one "page:line: claim: why" line per wrong claim:

- configuration keys (`checkpoint.every_steps`, `optim.lr=3e-4`, `--spike.threshold 6`,
  `DDP_RECOVERY__FAULT_INJECT`, ``{"spike": {"threshold": 6}}``) exist, and their values are accepted;
- flags of the launcher, of ``python ddp_training.py``, of torchrun and of a bench or example script
  are in that program's help or argparse;
- repo paths exist; run outputs (<checkpoint.dir>/..., <logging.dir>/..., summary.json) are names the code writes;
- ``framework.x.y`` names and ``from framework.x import Y`` lines import;
- exit codes the text names are codes the framework or the launcher exits with;
- lines quoted from the example files (`#SBATCH --requeue`) are in them;
- the cheap commands (``--help``, ``--check-config``) run and exit 0 (the launcher's in a test marked
  dist, as conftest.py requires), and every documented command line's or TOML block's configuration
  is valid as a whole.

The docs write every key dotted (``train.max_steps``, ``<logging.dir>/summary.json``): a deprecated flat key of
before sections fails, except where a passage talks about the old spellings (FLAT_PASSAGE), a compact key of
the original API (``batch_size``), or a name that is another thing's there (NOT_OUR_KEYS: a transformers or TRL
argument on the Hugging Face page). ``python tests/project/test_docs_claims.py`` lists them.
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import os
import re
import shlex
import subprocess
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CODE_FILES = [*sorted((ROOT / "framework").rglob("*.py")), ROOT / "ddp_training.py", ROOT / "launch_training.sh",
              *sorted((ROOT / "bench").glob("*.py")), *sorted((ROOT / "examples").rglob("*.*"))]
REPO_DIRS = ("framework", "bench", "examples", "configs", "tests", "docs", "data")
FILE_EXTENSIONS = ("py", "toml", "sh", "sbatch", "yaml", "yml", "md", "txt", "json", "jsonl", "pt", "pth", "log",
                   "safetensors", "bin", "cfg", "ini")
# Words the docs write in place of a value or a name part: `--max-restarts N`, `step_NNNNNNNN.pt`.
PLACEHOLDERS = {"N", "NNNNNNNN", "K", "M", "R", "S", "J", "X", "PATH", "FILE", "DIR", "ID", "HOST", "PORT", "LOG",
                "MIN:MAX", "N|MIN:MAX", "IDS", "B", "..."}
# Dotted names that start like a section but are no configuration key.
NOT_CONFIG = {
    "model.module": "the module inside a DDP wrapper (huggingface.md: a script hands over model.module)",
}
# Run outputs written by another program than this one (no framework source writes their name).
OUTPUTS_OF_OTHERS = {
    "output_dir/runs/<date>_<host>": "transformers' TensorBoard logging_dir under output_dir",
    "scaler.pt": "transformers.Trainer's GradScaler file in its checkpoint-N folder (not carried over)",
    "adapter_config.json": "written by PEFT's save_pretrained into the export",
}
# The directories a run writes into: a configured one, written as its dotted key (<checkpoint.dir>,
# <logging.dir>, <checkpoint.export_dir>; output_dir is transformers' TrainingArguments.output_dir), its default
# (checkpoints, logs), or runs/ (--test, the examples). A flat key's (log_dir/...) is no root: it fails
# test_docs_use_dotted_keys.
OUTPUT_ROOTS = ("runs", "checkpoints", "logs", "output_dir", "logging.dir", "checkpoint.dir", "checkpoint.export_dir",
                "<logging.dir>", "<checkpoint.dir>", "<checkpoint.export_dir>")
# Flags of other tools that the docs name on their own (not in a command line the test parses).
OTHER_TOOLS_FLAGS = {
    "--gpus-per-node": "sbatch", "--cpus-per-task": "sbatch", "--ntasks-per-node": "sbatch", "--signal": "sbatch",
    "--requeue": "sbatch", "--open-mode": "sbatch", "--nodes": "sbatch", "--no-build-isolation": "pip",
}
# Problems that say the value is fine but this machine cannot run it (no GPU, no C++ compiler here), or
# that a file a run writes (a checkpoint, EXCLUDED_SAMPLES.json) is not here.
MACHINE_DEPENDENT = ("needs CUDA", "needs a C++ compiler", "file not found", "an existing checkpoint file",
                     "a directory this user can write")
# Passages that talk about the old spellings on purpose (flat keys there are not reported).
FLAT_PASSAGE = re.compile(r"flat (?:key|name|alias|spelling)|old(?:er)? (?:spelling|name|key)|deprecat|compact key|"
                          r"original API", re.I)
# Names spelled like a deprecated flat key that are not this framework's configuration key on that page:
# (page, name) -> what the name is there. test_docs_use_dotted_keys leaves them alone.
NOT_OUR_KEYS = {
    # docs/huggingface.md maps transformers.TrainingArguments (and trl.SFTConfig, a subclass) onto the
    # configuration: these are the arguments' own fields, which share a name with an old flat key.
    ("docs/huggingface.md", "gradient_accumulation_steps"):
        "TrainingArguments.gradient_accumulation_steps (the framework's data.gradient_accumulation_steps)",
    ("docs/huggingface.md", "max_steps"): "TrainingArguments.max_steps (the framework's train.max_steps)",
    ("docs/huggingface.md", "warmup_steps"): "TrainingArguments.warmup_steps (the framework's optim.warmup_steps)",
    ("docs/huggingface.md", "gradient_checkpointing"):
        "TrainingArguments.gradient_checkpointing (the framework's memory.activation_checkpointing)",
    ("docs/huggingface.md", "eval_steps"): "TrainingArguments.eval_steps (the framework's eval.interval)",
    ("docs/huggingface.md", "ddp_static_graph"):
        "TrainingArguments.ddp_static_graph (the framework's ddp.static_graph)",
    # Not a key at all: DDPTrainer's public attribute, listed with the trainer's other parts.
    ("docs/python-api.md", "spike_guard"): "the attribute trainer.spike_guard (the guard; its key is spike.guard)",
}


# ---------------------------------------------------------------------------------------------------
# The pages, parsed once


@dataclass(frozen=True)
class Span:
    """An inline code span: its text (whitespace normalized), its line, and the paragraph (or, in a
    table, the row) around it."""
    page: str
    line: int
    text: str
    context: str


@dataclass(frozen=True)
class Block:
    """A fenced code block: its language and its lines, each with its line number."""
    page: str
    lang: str
    lines: tuple[tuple[int, str], ...]


@dataclass
class Page:
    name: str
    text: str
    spans: list[Span] = field(default_factory=list)
    blocks: list[Block] = field(default_factory=list)
    prose: list[tuple[int, str]] = field(default_factory=list)  # lines outside code blocks

    def region(self, line: int, start: str, end: str) -> bool:
        """Whether ``line`` lies between the HTML comments ``start`` and ``end``."""
        lines = self.text.splitlines()
        marks = [i + 1 for i, text in enumerate(lines) if text.strip() in (start, end)]
        return any(a < line < b for a, b in zip(marks[::2], marks[1::2], strict=False))


@dataclass(frozen=True)
class Claim:
    page: str
    line: int
    kind: str
    text: str  # the claim as the page writes it
    detail: tuple = ()  # what the extractor found in it (a key and value, a program and flag, ...)

    def bad(self, why: str) -> str:
        return f"{self.page}:{self.line}: {self.text}: {why}"


def parse_page(path: Path) -> Page:
    name = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name
    text = path.read_text()
    page = Page(name, text)
    fence = None
    block: list[tuple[int, str]] = []
    paragraph: list[tuple[int, str]] = []

    def flush() -> None:
        rows = [p for p in paragraph if p[1].lstrip().startswith("|")]
        groups = [[row] for row in rows] if rows else ([paragraph] if paragraph else [])
        for group in groups:
            joined = "\n".join(t for _, t in group)
            for m in re.finditer(r"`([^`]+)`", joined):
                line = group[0][0] + joined.count("\n", 0, m.start())
                page.spans.append(Span(name, line, " ".join(m.group(1).split()), " ".join(joined.split())))
        paragraph.clear()

    for number, line in enumerate(text.splitlines(), 1):
        m = re.match(r"\s*```(\w*)", line)
        if fence is None and m:
            flush()
            fence, block = m.group(1) or "text", []
        elif fence is not None and m:
            page.blocks.append(Block(name, fence, tuple(block)))
            fence = None
        elif fence is not None:
            block.append((number, line))
        else:
            page.prose.append((number, line))
            if line.strip():
                paragraph.append((number, line))
            else:
                flush()
    flush()
    return page


PARSED = [parse_page(p) for p in PAGES]


# ---------------------------------------------------------------------------------------------------
# What the code says


@functools.cache
def config():
    import framework.config as cfg
    return cfg


@functools.cache
def code_text() -> str:
    return "\n".join(p.read_text(errors="replace") for p in CODE_FILES if p.is_file())


@functools.cache
def tracked_files() -> tuple[str, ...]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    files = out.stdout.split() if out.returncode == 0 else []
    return tuple(files or (str(p.relative_to(ROOT)) for p in ROOT.rglob("*") if p.is_file()))


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("DDP_")}


def run_ddp_training(args: list[str]) -> tuple[int, str, str]:
    """python ddp_training.py ARGS for --help and --check-config, which start nothing: in-process."""
    import contextlib
    import io

    import ddp_training
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            code = ddp_training.main(list(args))
        except SystemExit as exc:
            code = exc.code
    return code, out.getvalue(), err.getvalue()


@functools.cache
def launcher_help() -> str:
    """What ./launch_training.sh --help prints: its usage heredoc, read without running it (the launcher
    is a multi-process command for conftest.py; test_documented_launcher_commands_run runs it)."""
    text = (ROOT / "launch_training.sh").read_text()
    m = re.search(r"^usage\(\) \{\n\s*cat <<'EOF'\n(.*?)^EOF$", text, re.M | re.S)
    assert m, "launch_training.sh has no usage() heredoc any more"
    return m.group(1)


@functools.cache
def launcher_flags() -> frozenset[str]:
    """The long and short options ./launch_training.sh --help lists."""
    text = launcher_help()
    flags = set()
    for line in text.splitlines():
        m = re.match(r"\s+(-\w)?,?\s*(--[\w-]+)", line)
        if m:
            flags.update(f for f in m.groups() if f)
    return frozenset(flags)


@functools.cache
def ddp_training_flags() -> frozenset[str]:
    """The flags python ddp_training.py --help lists (not the flat names after "was")."""
    text = run_ddp_training(["--help"])[1]
    text = re.sub(r"was --[\w-]+", "", text)
    return frozenset(re.findall(r"(?<![\w-])(--[\w.-]+|-h)\b", text)) - {"--"}


@functools.cache
def argparse_flags(path: Path) -> frozenset[str]:
    """The option strings of every add_argument call in a script (and in the bench modules it imports)."""
    flags: set[str] = set()
    seen: set[Path] = set()
    todo = [path]
    while todo:
        p = todo.pop()
        if p in seen or not p.is_file():
            continue
        seen.add(p)
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
                flags.update(a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("-"))
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
                names += [a.name for a in node.names] if isinstance(node, ast.Import) else []
                todo += [p.parent / f"{n.split('.')[-1]}.py" for n in names if n]
    return frozenset(flags)


@functools.cache
def torchrun_flags() -> frozenset[str]:
    spec = importlib.util.find_spec("torch")
    assert spec and spec.origin
    return argparse_flags(Path(spec.origin).parent / "distributed" / "run.py")


@functools.cache
def exit_codes() -> frozenset[int]:
    """Every exit status the framework, ddp_training.py and the launcher use, read from their code."""
    codes: set[int] = set()
    for path in [*sorted((ROOT / "framework").rglob("*.py")), ROOT / "ddp_training.py"]:
        text = path.read_text()
        codes.update(int(c) for c in re.findall(r"(?:sys\.exit|os\._exit|SystemExit)\((\d+)\)", text))
        codes.update(int(c) for c in re.findall(r"\bEXIT_\w+ = (\d+)", text))
    main = ast.get_source_segment(src := (ROOT / "ddp_training.py").read_text(),
                                  next(n for n in ast.parse(src).body if getattr(n, "name", "") == "main"))
    codes.update(int(c) for c in re.findall(r"\breturn (\d+)(?: if .* else \d+)?", main or ""))
    codes.update(int(c) for c in re.findall(r"\breturn \d+ if .* else (\d+)", main or ""))
    sh = (ROOT / "launch_training.sh").read_text()
    codes.update(int(code) for pair in re.findall(r"\bexit (\d+)|\bstatus=(\d+)", sh) for code in pair if code)
    return frozenset(codes)


# ---------------------------------------------------------------------------------------------------
# Command lines: which program each flag belongs to


@dataclass(frozen=True)
class Command:
    """One program's part of a command line in a code block or span."""
    page: str
    line: int
    text: str
    program: str  # "launcher", "ddp_training", "torchrun", or a script path
    args: tuple[str, ...]
    ddp_args: tuple[str, ...] = ()  # for the launcher: its --config and what follows --
    whole: bool = True  # False for a span of flags alone (a fragment, not a command to run)


def tokens(text: str) -> list[str]:
    try:
        return shlex.split(text, comments=True)
    except ValueError:
        return text.split()


def block_commands(block: Block) -> list[tuple[int, str]]:
    """The shell command lines of a code block, with continuation lines joined."""
    out, pending, start = [], "", 0
    for number, line in block.lines:
        if not pending:
            start = number
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        out.append((start, pending + line))
        pending = ""
    return out


def split_command(page: str, line: int, text: str) -> list[Command]:
    toks = tokens(text)
    out: list[Command] = []
    i = 0
    while i < len(toks):
        t = toks[i]
        rest = toks[i + 1:]
        if t.endswith("launch_training.sh"):
            own, ddp = (rest[:rest.index("--")], rest[rest.index("--") + 1:]) if "--" in rest else (rest, [])
            cfg = [own[own.index("--config") + 1]] if "--config" in own[:-1] else []
            out.append(Command(page, line, text, "launcher", tuple(own),
                               tuple((["--config", *cfg] if cfg else []) + ddp)))
            return out
        if t in ("ddp-train", "ddp_training.py", "./ddp_training.py") or (t == "-m" and rest[:1] == ["ddp_training"]):
            args = rest[1:] if t == "-m" else rest
            out.append(Command(page, line, text, "ddp_training", tuple(args), tuple(args)))
            return out
        if t.endswith(".sbatch"):
            out.append(Command(page, line, text, "ddp_training", tuple(rest), tuple(rest)))
            return out
        if t.endswith(".py") and t.split("/")[0] in ("bench", "examples"):
            out.append(Command(page, line, text, t, tuple(rest)))
            return out
        if t == "torchrun":
            j = i + 1
            while j < len(toks) and toks[j].startswith("-") and toks[j] != "-m":
                j += 1 if "=" in toks[j] or toks[j] in ("--no-python", "--standalone") else 2
            out.append(Command(page, line, text, "torchrun", tuple(toks[i + 1:j])))
            i = j
            continue
        i += 1
    return out


def is_command(text: str) -> bool:
    return bool(re.match(r"(\./)?launch_training\.sh\b|python3? |torchrun |sbatch |srun |ddp-train\b", text))


@functools.cache
def commands() -> tuple[Command, ...]:
    out = []
    for page in PARSED:
        for block in page.blocks:
            if block.lang in ("bash", "sh", "shell", "console", "text"):
                for line, text in block_commands(block):
                    text = re.sub(r"^\s*\$ ", "", text)
                    if block.lang != "text" or is_command(text.strip()):  # a plain block: a listing, a log
                        out += split_command(page.name, line, text)
        for span in page.spans:
            if is_command(span.text):
                out += split_command(page.name, span.line, span.text)
            elif span.text.startswith("--") and len(span.text) > 2:
                first = span.text.split()[0].split("=")[0][2:]
                if "." in first:  # `--checkpoint.export_dir runs/x --checkpoint.dir ...`: ddp_training.py flags
                    args = tuple(tokens(span.text))
                    out.append(Command(page.name, span.line, span.text, "ddp_training", args, args, whole=False))
    return tuple(out)


def ddp_flag_items(args: tuple[str, ...]) -> list[tuple[str, str | None]]:
    """(flag, value) pairs of a ddp_training.py argument list; the value None where none is given."""
    out, i = [], 0
    while i < len(args):
        a = args[i]
        i += 1
        if not a.startswith("--") or a == "--":
            continue
        name, eq, value = a.partition("=")
        if eq:
            out.append((name, value))
        elif name.replace("_", "-")[2:] in config().ACTION_FLAGS:
            out.append((name, None))
        elif i < len(args) and not args[i].startswith("--"):
            out.append((name, args[i]))
            i += 1
        else:
            out.append((name, None))
    return out


def placeholder(value) -> bool:
    if value is not None and not isinstance(value, str):
        return False
    return value is None or value in PLACEHOLDERS or bool(re.search(r"\.\.\.|<|\||\$|^[A-Z_]+$", value)) \
        or bool(re.search(r"(?<![A-Za-z])[A-Z](?![A-Za-z])", value))  # step=K, ms=M


# ---------------------------------------------------------------------------------------------------
# Extractors, one per kind of claim


def flat_passage(span: Span) -> bool:
    return bool(FLAT_PASSAGE.search(span.context))


def config_claims() -> list[Claim]:
    """Dotted keys, key=value, `[section]`, DDP_<SECTION>__<KEY> variables, dict literals and
    --section.key flags, each as (key, value or None)."""
    sections = config().SECTIONS
    out = []
    for page in PARSED:
        for s in page.spans:
            text = s.text
            if text.startswith("--") or is_command(text) or text in NOT_CONFIG:
                continue  # flags: from the command lines below
            m = re.fullmatch(r"\[(\w+)\]", text)
            if m:
                out.append(Claim(s.page, s.line, "config", text, (f"[{m.group(1)}]", None)))
                continue
            m = re.fullmatch(r"DDP_([A-Z]+)__([A-Z_]+)(?:=(\S+))?", text)
            if m:
                key = f"{m.group(1).lower()}.{m.group(2).lower()}"
                out.append(Claim(s.page, s.line, "config", text, (key, m.group(3))))
                continue
            if text.startswith("{"):
                try:
                    literal = ast.literal_eval(text)
                except (ValueError, SyntaxError):
                    continue
                for key, value in flatten(literal):
                    if "." in key and key.split(".")[0] in sections:
                        out.append(Claim(s.page, s.line, "config", text, (key, str(value))))
                continue
            m = re.fullmatch(r"([a-z_]+)\.([a-z_*]+)(?:\s*=\s*(.+))?", text)
            if m and m.group(1) in sections and m.group(2) not in FILE_EXTENSIONS:
                value = m.group(3).strip("\"'") if m.group(3) else None
                out.append(Claim(s.page, s.line, "config", text, (f"{m.group(1)}.{m.group(2)}", value)))
        for block in page.blocks:
            if block.lang == "toml":
                for key, value, line in toml_items(block):
                    if "." in key:
                        out.append(Claim(block.page, line, "config", f"{key} = {value!r}", (key, value)))
            if block.lang == "python":
                for line, text in block.lines:
                    for m in re.finditer(r"[\"']([a-z_]+\.[a-z_]+)[\"']\s*:\s*([^,}]+)", text):
                        if m.group(1).split(".")[0] in sections:
                            out.append(Claim(block.page, line, "config", m.group(0),
                                             (m.group(1), m.group(2).strip().strip("\"'"))))
    for c in commands():
        if c.program in ("ddp_training", "launcher"):
            for flag, value in ddp_flag_items(c.ddp_args):
                name = flag[2:]
                if "." in name and name.lower() not in ("section.key",):
                    out.append(Claim(c.page, c.line, "config", f"{flag} {value or ''}".strip(),
                                     (name.replace("-", "_"), value)))
    return out


def toml_items(block: Block) -> list[tuple[str, object, int]]:
    """A TOML block's keys (dotted under their [section]) with their values and lines."""
    import tomllib
    try:
        data = tomllib.loads("\n".join(t for _, t in block.lines))
    except tomllib.TOMLDecodeError:
        return []
    out = []
    lines = dict(block.lines)
    for key, value in flatten(data):
        top, _, name = key.rpartition(".")
        line = next((n for n, t in lines.items() if re.match(rf"\s*{re.escape(name)}\s*=", t)
                     and (not top or any(f"[{top}]" in lines[k] for k in lines if k < n))), block.lines[0][0])
        out.append((key, value, line))
    return out


def flatten(value, prefix: str = "") -> list[tuple[str, object]]:
    if not isinstance(value, dict):
        return [(prefix, value)] if prefix else []
    out = []
    for k, v in value.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        out += flatten(v, key) if isinstance(v, dict) else [(key, v)]
    return out


def flag_claims() -> list[Claim]:
    """Flags that are no configuration key, each with the program it is given to ("lone": a span of
    flags alone, whose program is any the paragraph or page names)."""
    out = []
    for c in commands():
        if c.program == "launcher":
            own = [a for a in c.args if a.startswith("-") and a != "--" and not re.fullmatch(r"-\d.*", a)]
            out += [Claim(c.page, c.line, "flag", a, ("launcher", a.split("=")[0])) for a in own]
        if c.program in ("launcher", "ddp_training"):
            for flag, _ in ddp_flag_items(c.ddp_args):
                if "." not in flag:
                    out.append(Claim(c.page, c.line, "flag", flag, ("ddp_training", flag)))
        if c.program == "torchrun":
            out += [Claim(c.page, c.line, "flag", a, ("torchrun", a.split("=")[0])) for a in c.args
                    if a.startswith("--")]
        if c.program.endswith(".py"):
            out += [Claim(c.page, c.line, "flag", a, (c.program, a.split("=")[0])) for a in c.args
                    if a.startswith("--")]
    for page in PARSED:
        scripts = set(re.findall(r"\b((?:bench|examples)/[\w/]+\.py)", page.text))
        for s in page.spans:
            if not re.match(r"-[a-z-]", s.text) or s.text in ("--", "--section.key") or "." in s.text.split()[0]:
                continue
            near = set(re.findall(r"\b((?:bench|examples)/[\w/]+\.py)", s.context)) or scripts
            for a in (part for t in tokens(s.text) if t.startswith("-") for part in t.split("/")):  # -g/--gpus
                if a.startswith("--") and a != "--" and "." not in a.split("=")[0]:
                    out.append(Claim(s.page, s.line, "flag", a, ("lone", a.split("=")[0], tuple(sorted(near)))))
    return out


def path_claims() -> list[Claim]:
    """Spans that are a path or a file name (with `: Symbol` or `::test` checked too), and the repo
    paths in command lines."""
    out = []
    ext = "|".join(FILE_EXTENSIONS)
    for page in PARSED:
        for s in page.spans:
            text, symbol = s.text, None
            m = re.fullmatch(r"(\S+?)(?::\s+(\w+)|::(\w+))", text)
            if m and "/" in m.group(1):
                text, symbol = m.group(1), m.group(2) or m.group(3)
            if not re.fullmatch(r"[\w.<>*/-]+", text) or text.startswith("-") or "//" in text:
                continue
            if (text.split("/")[0] in REPO_DIRS + OUTPUT_ROOTS and "/" in text) or text.endswith("/") \
                    or re.search(rf"\.({ext})$", text):  # not a metric tag (health/loss_z) or adam_beta1/2
                out.append(Claim(s.page, s.line, "path", s.text, (text, symbol)))
        for block in page.blocks:
            if block.lang in ("bash", "sh", "shell"):
                for line, text in block_commands(block):
                    for t in tokens(text):
                        if t.split("/")[0] in REPO_DIRS and "/" in t:
                            out.append(Claim(page.name, line, "path", t, (t, None)))
    return out


def python_claims() -> list[Claim]:
    """`framework.x.y` names in spans, and framework imports in Python code blocks, as (module, names)."""
    out = []
    for page in PARSED:
        for s in page.spans:
            if "/" in s.text:
                continue
            for m in re.finditer(r"(?<![\w.])framework(?:\.\w+)+", s.text):
                out.append(Claim(s.page, s.line, "python", m.group(0), (m.group(0), ())))
        for block in page.blocks:
            if block.lang != "python":
                continue
            for line, text in block.lines:
                m = re.match(r"\s*from (framework[\w.]*) import ([\w, ]+)", text)
                if m:
                    names = tuple(n.strip().split(" as ")[0] for n in m.group(2).split(",") if n.strip())
                    out.append(Claim(page.name, line, "python", m.group(0).strip(), (m.group(1), names)))
                m = re.match(r"\s*import (framework[\w.]*)", text)
                if m:
                    out.append(Claim(page.name, line, "python", m.group(0).strip(), (m.group(1), ())))
    return out


EXIT_PHRASE = re.compile(r"\bexit(?:s|ed|ing)?(?: with| code| status)?(?: code)?(?: is)? (\d+)\b(?! times)", re.I)


def exit_claims() -> list[Claim]:
    """"exit 2", "exits 75", "exit code 1" in the prose, and the first column of a `| code |` table."""
    out = []
    for page in PARSED:
        in_code_table = False
        for line, text in page.prose:
            cells = [c.strip() for c in text.strip().strip("|").split("|")] if text.lstrip().startswith("|") else []
            if cells and cells[0] == "code":
                in_code_table = True
            elif not cells:
                in_code_table = False
            elif in_code_table and cells[0].isdigit():
                out.append(Claim(page.name, line, "exit", f"| {cells[0]} |", (int(cells[0]),)))
            for m in EXIT_PHRASE.finditer(text):
                out.append(Claim(page.name, line, "exit", m.group(0), (int(m.group(1)),)))
    return out


def example_claims() -> list[Claim]:
    """Lines quoted from the example files: `#SBATCH ...` (examples/slurm/train.sbatch), and `key: value`
    in a paragraph that names a .yaml example."""
    out = []
    for page in PARSED:
        for s in page.spans:
            if s.text.startswith("#SBATCH "):
                out.append(Claim(s.page, s.line, "example", s.text, ("examples/slurm/train.sbatch", s.text)))
            elif re.fullmatch(r"[A-Za-z]\w*: \S+", s.text):
                for yaml in re.findall(r"\b(examples/[\w/]+\.ya?ml)\b", s.context):
                    out.append(Claim(s.page, s.line, "example", s.text, (yaml, s.text)))
    return out


def run_claims() -> list[Claim]:
    """Cheap, safe command lines the pages give whole: --help, and --check-config without placeholders."""
    out = []
    for c in commands():
        if c.program not in ("launcher", "ddp_training") or any(placeholder(a) and a.startswith(".") for a in c.args):
            continue
        head = c.text.split(" -- ")[0]
        if re.match(r"(\./)?launch_training\.sh --help$", c.text.strip()) or (
                c.program == "ddp_training" and not c.text.startswith(("sbatch", "torchrun"))
                and {"--help", "--check-config"} & set(c.args) and "..." not in c.args):
            out.append(Claim(c.page, c.line, "run", head.split("#")[0].strip(), (c.program, c.args)))
    return out


def flat_claims() -> list[Claim]:
    """Flat keys of before sections: `alias`, `alias=value`, `--alias-flag`, DDP_ALIAS, "alias": in Python."""
    aliases = config().ALIASES
    hf_fields = hf_argument_fields()
    out = []
    for page in PARSED:
        for s in page.spans:
            if flat_passage(s) or page.region(s.line, "<!-- config-table:start -->", "<!-- config-table:end -->"):
                continue
            m = re.fullmatch(r"([a-z_]+)(?:\s*=\s*(\S+|\"[^\"]*\"))?", s.text)
            if m and m.group(1) in aliases and ("_" in m.group(1) or m.group(2) is not None):
                if m.group(1) in torch_ddp_arguments() and m.group(2) in (None, "True", "False"):
                    continue  # torch's own DDP argument (find_unused_parameters=True), not the config's key
                if not (page.name == "docs/huggingface.md" and m.group(1) in hf_fields):
                    out.append(Claim(s.page, s.line, "flat", s.text, (m.group(1),)))
            m = re.fullmatch(r"DDP_([A-Z_]+?)(?:=\S*)?", s.text)
            if m and "__" not in m.group(1) and m.group(1).lower() in aliases:
                out.append(Claim(s.page, s.line, "flat", s.text, (m.group(1).lower(),)))
        for block in page.blocks:
            if block.lang == "toml":
                out += [Claim(block.page, line, "flat", f"{key} = {value!r}", (key,))
                        for key, value, line in toml_items(block) if key in aliases]
            if block.lang == "python":
                for line, text in block.lines:
                    for m in re.finditer(r"[\"']([a-z_]+)[\"']\s*:", text):
                        if m.group(1) in aliases:
                            out.append(Claim(block.page, line, "flat", m.group(0), (m.group(1),)))
    for c in commands():
        if c.program in ("launcher", "ddp_training"):
            for flag, _ in ddp_flag_items(c.ddp_args):
                if flag[2:].replace("-", "_") in aliases:
                    out.append(Claim(c.page, c.line, "flat", flag, (flag[2:].replace("-", "_"),)))
    return out


@functools.cache
def torch_ddp_arguments() -> frozenset[str]:
    """DistributedDataParallel's own arguments, which some flat keys were named after."""
    import inspect

    from torch.nn.parallel import DistributedDataParallel
    return frozenset(inspect.signature(DistributedDataParallel.__init__).parameters)


@functools.cache
def hf_argument_fields() -> frozenset[str]:
    """TrainingArguments' and SFTConfig's fields: on the Hugging Face page `max_steps` is theirs."""
    import dataclasses
    names = set()
    for module, cls in (("transformers", "TrainingArguments"), ("trl", "SFTConfig")):
        try:
            names |= {f.name for f in dataclasses.fields(getattr(importlib.import_module(module), cls))}
        except ImportError:
            pass
    return frozenset(names)


# ---------------------------------------------------------------------------------------------------
# Checks


def config_problems(key: str, value: str | None) -> list[str]:
    cfg = config()
    if key.startswith("["):
        return [] if key[1:-1] in cfg.SECTIONS else [f"no section {key[1:-1]!r}"]
    if key.endswith(".*"):
        return [] if key[:-2] in cfg.SECTIONS else [f"no section {key[:-2]!r}"]
    if key not in cfg.FIELDS:
        section = key.split(".")[0]
        known = [k for k in cfg.KEYS if k.startswith(section + ".")]
        return [f"no such key (section {section!r} has: {', '.join(known) or 'no such section'})"]
    if placeholder(value):
        return []
    try:
        cfg.build_config({key: value}, env={})
    except cfg.ConfigError as err:
        # The value alone: its type or choices, its bounds, a fault plan's syntax. A check that needs
        # another key (spike.guard=rollback needs checkpoint.every_steps) is the command lines' test.
        return [p for p in err.problems if p.startswith("config: ") or re.search(r": must be [<>]= ", p)
                or p.startswith("recovery.fault_inject=")]
    return []


def report(bad: list[str], checked: int, kind: str) -> None:
    assert checked, f"no {kind} claims found: the extractor is broken"
    assert not bad, f"{len(bad)} wrong ({checked} {kind} claims checked):\n" + "\n".join(bad)


def test_configuration_keys_exist_and_their_values_are_accepted():
    claims = config_claims()
    bad = []
    for c in claims:
        key, value = c.detail
        bad += [c.bad(p) for p in config_problems(key, value)]
    report(bad, len(claims), "configuration")


def test_flags_are_in_their_programs_help():
    cfg = config()
    launcher, ddp, torchrun = launcher_flags(), ddp_training_flags(), torchrun_flags()
    flat = {"--" + k.replace("_", "-") for k in cfg.ALIASES} | {"--" + k for k in cfg.ALIASES}
    claims = flag_claims()
    bad = []
    for c in claims:
        program, flag = c.detail[:2]
        if program == "launcher":
            ok = flag in launcher
            why = "not an option of ./launch_training.sh --help"
        elif program == "ddp_training":
            ok = flag.replace("_", "-") in ddp or flag in flat
            why = "not a flag of python ddp_training.py --help"
        elif program == "torchrun":
            ok = flag in torchrun
            why = "not a torchrun option"
        elif program == "lone":
            scripts = c.detail[2]
            known = launcher | ddp | torchrun | flat | set(OTHER_TOOLS_FLAGS)
            known |= {f for s in scripts for f in argparse_flags(ROOT / s)}
            ok = flag in known or (flag.endswith("*") and any(k.startswith(flag[:-1]) for k in known))
            why = ("not a flag of the launcher, python ddp_training.py, torchrun"
                   + (f" or {', '.join(scripts)}" if scripts else ""))
        else:
            ok = flag in argparse_flags(ROOT / program)
            why = f"not in {program}'s argparse"
        if not ok:
            bad.append(c.bad(why))
    report(bad, len(claims), "flag")


def output_written(path: str) -> bool:
    """Whether the code names a run output like ``path`` (e.g. checkpoint_dir/RESTARTS.json, runs/test/,
    log_dir/rank_N.log), a placeholder (N, <...>, *) matching anything on the same line of code."""
    parts = [p for p in path.split("/") if p]
    if len(parts) > 1 and parts[0] != "runs":  # a configured directory: the name under it is the claim
        parts = parts[1:]
    name = "/".join(parts)
    fragments = [f for f in re.split(r"<[^>]*>|\*|\d+|(?<![A-Za-z])(?:N+|K)(?![A-Za-z])", name) if f]
    pattern = r"[^\n]*?".join(re.escape(f) for f in fragments)
    return bool(fragments) and re.search(pattern, code_text()) is not None


def path_problem(text: str, symbol: str | None) -> str | None:
    first = text.split("/")[0]
    if text in OUTPUTS_OF_OTHERS:
        return None
    if first in OUTPUT_ROOTS and "/" in text:
        return None if output_written(text) else "a run output no framework code names"
    literal = "/".join(p for p in text.split("/") if p and not re.search(r"<|\*", p) and p not in PLACEHOLDERS)
    if "/" not in text.rstrip("/"):  # a bare file or directory name
        name = text.rstrip("/")
        if (ROOT / name).exists() or (ROOT / "framework" / name).is_dir():
            return None
        if any(Path(f).name == name for f in tracked_files()):
            return None
        if re.search(r"<|\*|N", name) and output_written(name):
            return None
        return None if name in code_text() else "no such file in the repo, and no code writes that name"
    if re.search(r"<|\*", text) or any(p in PLACEHOLDERS for p in text.split("/")):
        if "*" in text and not re.search(r"<", text):
            return None if list(ROOT.glob(text)) else "no file matches"
        return None if (ROOT / literal).exists() else f"no such directory {literal}"
    target = ROOT / text
    if not target.exists():
        return "no such file or directory"
    if symbol:
        body = target.read_text()
        if not re.search(rf"^\s*(?:class|def|async def) {symbol}\b|^{symbol}\s*[:=]", body, re.M):
            return f"{symbol} is not defined in {text}"
    return None


def test_paths_exist_and_outputs_are_written_by_the_code():
    claims = path_claims()
    bad = []
    for c in claims:
        why = path_problem(*c.detail)
        if why:
            bad.append(c.bad(why))
    report(bad, len(claims), "path")


def resolve(dotted: str) -> str | None:
    """None when ``dotted`` (a module, or a module then attributes) resolves, else why not."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError as err:
            if err.name and not ".".join(parts[:i]).startswith(err.name):
                return f"importing {'.'.join(parts[:i])} failed: {err}"
            continue
        for j, attr in enumerate(parts[i:], i):
            if not hasattr(obj, attr):
                return f"{'.'.join(parts[:j])} has no attribute {attr!r}"
            obj = getattr(obj, attr)
        return None
    return f"no module {parts[0]}"


def test_framework_names_and_imports_resolve():
    claims = python_claims()
    bad = []
    for c in claims:
        module, names = c.detail
        whys = [resolve(f"{module}.{n}") for n in names] if names else [resolve(module)]
        bad += [c.bad(why) for why in whys if why]
    report(bad, len(claims), "Python name")


def test_example_files_hold_the_lines_the_docs_quote():
    claims = example_claims()
    bad = []
    for c in claims:
        path, quoted = c.detail
        lines = [" ".join(line.split("  #")[0].split()) for line in (ROOT / path).read_text().splitlines()]
        if not any(line == quoted or line.startswith(quoted + " ") for line in lines):
            bad.append(c.bad(f"no such line in {path}"))
    report(bad, len(claims), "example file")


def test_exit_codes_are_ones_the_code_uses():
    codes = exit_codes()
    assert {0, 1, 2, 75} <= codes, codes  # the codes docs/clusters.md's table explains
    claims = exit_claims()
    bad = [c.bad(f"no code exits with {c.detail[0]} (the code uses {sorted(codes)})") for c in claims
           if c.detail[0] not in codes]
    report(bad, len(claims), "exit code")


def test_documented_commands_run():
    """python ddp_training.py --help and --check-config lines, run as ddp-train/python ddp_training.py
    would run them (in-process: they start nothing)."""
    claims = [c for c in run_claims() if c.detail[0] == "ddp_training"]
    bad = []
    for c in claims:
        code, _, err = run_ddp_training(list(c.detail[1]))
        if code != 0:
            bad.append(c.bad(f"exited {code}: {(err.strip().splitlines() or [''])[-1]}"))
    report(bad, len(claims), "command")


@pytest.mark.dist  # conftest.py counts any launch_training.sh command as multi-process
def test_documented_launcher_commands_run():
    claims = [c for c in run_claims() if c.detail[0] == "launcher"]
    bad = []
    for c in claims:
        out = subprocess.run(["bash", "launch_training.sh", *c.detail[1]], cwd=ROOT, capture_output=True, text=True,
                             timeout=60, env=clean_env())
        if out.returncode != 0:
            bad.append(c.bad(f"exited {out.returncode}: {out.stderr.strip()[-300:]}"))
        elif "--help" in c.detail[1] and out.stdout != launcher_help():
            bad.append(c.bad("prints something else than the usage text the flag checks read"))
    report(bad, len(claims), "launcher command")


def test_documented_command_lines_are_valid_configurations():
    """The ddp_training.py part of every command line (the launcher's --config and what follows --)
    parses as --check-config would parse it; a config file that is not in the repo (`my.toml`) is left out."""
    cfg = config()
    claims = []
    for c in commands():
        if not c.whole:
            continue
        args = list(c.ddp_args)
        if "--config" in args[:-1]:
            i = args.index("--config")
            if not (ROOT / args[i + 1]).is_file():
                del args[i:i + 2]
        if not args or any(placeholder(v) and v is not None for _, v in ddp_flag_items(tuple(args))
                           ) or "..." in args or any("$" in a for a in args):
            continue
        claims.append(Claim(c.page, c.line, "command line", c.text, (tuple(args),)))
    for page in PARSED:
        for block in page.blocks:
            items = toml_items(block) if block.lang == "toml" else []
            if items:
                claims.append(Claim(page.name, block.lines[0][0], "config file", "the TOML block",
                                    (tuple(f"--{k}={v}".lower() if isinstance(v, bool) else f"--{k}={v}"
                                           for k, v, _ in items),)))
    bad = []
    for c in claims:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                cfg.parse_command_line(list(c.detail[0]), env={})
            except cfg.ConfigError as err:
                bad += [c.bad(p) for p in err.problems if not any(m in p for m in MACHINE_DEPENDENT)]
    report(bad, len(claims), "command line")


def dotted_key_claims() -> list[Claim]:
    """The deprecated flat keys the docs write (flat_claims, less the compact keys of the original API and
    NOT_OUR_KEYS), and the run outputs written under a flat key's directory, even in a passage about the old
    spellings: `log_dir/summary.json` or `<checkpoint_dir>/FATAL` for `<logging.dir>/summary.json` or
    `<checkpoint.dir>/FATAL`."""
    cfg = config()
    out = [c for c in flat_claims()
           if c.detail[0] not in cfg.COMPACT and (c.page, c.detail[0]) not in NOT_OUR_KEYS]
    for page in PARSED:
        for s in page.spans:
            root = s.text.split("/")[0]
            name = root.strip("<>")  # not data/, the repo's directory
            if "/" in s.text and root not in REPO_DIRS and name in cfg.ALIASES and name not in cfg.COMPACT:
                out.append(Claim(s.page, s.line, "flat", s.text, (name,)))
    return out


def test_docs_use_dotted_keys():
    """A deprecated flat key still works, with a note; the docs teach the dotted key alone."""
    fields = hf_argument_fields()  # empty without transformers and trl
    if fields:
        hf = {name for page, name in NOT_OUR_KEYS if page == "docs/huggingface.md"}
        assert hf <= fields, f"NOT_OUR_KEYS names no TrainingArguments/SFTConfig field: {sorted(hf - fields)}"
    aliases = config().ALIASES
    bad = [c.bad(f"a deprecated flat key; write {aliases[c.detail[0]]}") for c in dotted_key_claims()]
    assert not bad, f"{len(bad)} deprecated flat keys in the docs:\n" + "\n".join(bad)


def test_the_extractors_see_every_kind_on_every_page_they_should():
    """A guard against an extractor that silently finds nothing."""
    pages = {c.page for c in config_claims()}
    assert {"docs/configuration.md", "docs/running.md", "docs/troubleshooting.md"} <= pages
    assert any(c.detail[0] == "launcher" for c in flag_claims())
    assert any(c.text == "framework/config/schema.py" for c in path_claims())
    assert any(c.detail[0] == "framework.hf" for c in python_claims())
    assert {c.detail[0] for c in exit_claims()} >= {0, 1, 2, 75}
    assert any(c.detail[0] == "examples/slurm/train.sbatch" for c in example_claims())
    assert {c.detail[0] for c in run_claims()} == {"launcher", "ddp_training"}


if __name__ == "__main__":  # the counts, and the flat keys, for a report
    sys.path.insert(0, str(ROOT))
    kinds = {"configuration": config_claims(), "flag": flag_claims(), "path": path_claims(),
             "python": python_claims(), "exit": exit_claims(), "example": example_claims(), "run": run_claims(),
             "flat": dotted_key_claims()}
    for kind, claims in kinds.items():
        print(f"{kind}: {len(claims)}")
    for c in kinds["flat"]:
        print(c.bad(f"a deprecated flat key; write {config().ALIASES[c.detail[0]]}"))


# ---------------------------------------------------------------------------------------------------
# Quoted output: the lines the docs say a program prints are lines its code can print
#
# Which spans are quotes: a span in a table column headed "what you see" or "you see", or a span in a
# sentence that says it is output ("What you see:", "prints", "logs", "says", "warns", "the line",
# "message", ...), unless it reads as code (a command, a flag, a path, a key, Python). Each must be
# printable by the code (framework/, ddp_training.py, launch_training.sh, bench/*.py, examples/): a
# run of the code's strings (Python string literals and f-strings; the launcher's and the batch
# script's lines), where a %s, {name} or $VAR holds a value. The page may write N, K, PATH, <...>, a
# number or "..." for a value, and "..." for left-out text. Every string is used whole but the first
# (the quote may start inside it) and the last (it may end inside it); a value holds at most
# QUOTE_VALUE_WORDS words of the page's own (one at a string's end), or more of the code's strings
# ("DDP policy: %s" holding a policy's reason). So a changed literal word fails, a changed value not.

QUOTE_HOLE = "\x00"   # where the code fills in a value: %s, %(name)d, {name}, {x:.2f}, $VAR, $(...)
QUOTE_VALUE = "\x01"  # a number, or a value the page writes as a placeholder (N, K, PATH, <job id>)
QUOTE_VALUE_WORDS = 3
QUOTE_VALUES = re.compile(r"<[^<>]*>|(?<![\w.])\d+(?:[.:]\d+)*(?:e-?\d+)?(?![\d.])|"
                          r"(?<![A-Za-z])(?:[A-Z]|PATH|FILE|DIR|ID|HOST|PORT)(?![A-Za-z])")
QUOTE_TRIGGER = re.compile(r"you see|\bprint(?:s|ed)?\b|\blog(?:s|ged)\b|\bsays?\b|\bwarns?\b|\b(?:the|a|one) line\b|"
                           r"\bmessage\b|\breads\b|\bshows?\b|\bnames?\b|\bin rank \d's log", re.I)
QUOTE_TOOLS = re.compile(r"(?:kill|pip|tensorboard|scontrol|scancel|mkdocs|ruff|git|bash|export|echo|cat|ls|grep|"
                         r"sbatch|srun|curl)\b")
# Quoted lines the code cannot show as it prints them, each with why.
NOT_PRINTED_AS_QUOTED = {
    "Timeout (0:01:00)!": "faulthandler.dump_traceback_later's own first line, as the hang watchdog arms it",
    "Timeout (0:00:06)!": "faulthandler.dump_traceback_later's own first line, as the hang watchdog arms it",
    "Rendezvous'ing worker group": "torchrun's elastic agent logs it",
    "[i/N] FAULT@MOMENT CHOICES: ok (S s)": "bench/explore.py's progress line f\"[{i}/{n}] {trial}: {status} ({s} s)\" "
                                            "is values alone, no word of its own to anchor it",
    "... FAIL invariant: why": "bench/explore.py's status \"FAIL \" + \"; \".join(f\"{k}: {why}\"): values alone",
    "error: command line: ddp.comm_hook='bogus': allowed: none, fp16, bf16, powersgd":
        "framework/config/sources.py's f\"{source}: {key}={value!r}: {why}\" is values alone",
}


def quote_normalized(text: str) -> str:
    return QUOTE_VALUES.sub(QUOTE_VALUE, re.sub(r"\s+", " ", text))


@functools.cache
def quote_templates() -> tuple[tuple[str, ...], ...]:
    """Every string the code may print, as its literal pieces around the values it fills in: those with
    a space and a word of 3 letters, and the punctuation that joins them (")", "; ")."""
    found = set()
    for path in CODE_FILES:
        if not path.is_file():
            continue
        text = path.read_text(errors="replace")
        if path.suffix == ".py":
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, ast.Constant) and isinstance(node.value, str):
                    found.add(node.value)
                elif isinstance(node, ast.JoinedStr):
                    found.add("".join(v.value if isinstance(v, ast.Constant) else QUOTE_HOLE for v in node.values))
        else:  # a shell script's lines, and its quoted strings (echo "a node was lost" inside $(...))
            for line in text.splitlines():
                found.update([line, *re.findall(r'"([^"$]*)"', line)])
    holes = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(?:\d+|\*)?(?:\.\d+)?[sdifgGeErxXc]|\{[^{}\s]*\}|"
                       r"\$\{[^}]*\}|\$\([^)]*\)|\$\w+|\$[@*#?]")
    out = set()
    for s in found:
        s = quote_normalized(holes.sub(QUOTE_HOLE, s).replace("%%", "%"))
        words = " " in s and re.search(r"[A-Za-z]{3}", s)
        if words or (s.strip() and not re.search(r"\w", s) and QUOTE_HOLE not in s):
            out.add(tuple(re.sub(QUOTE_HOLE + "+", QUOTE_HOLE, s).split(QUOTE_HOLE)))
    return tuple(sorted(out))


@functools.cache
def quote_template_index() -> tuple[dict[str, list[int]], frozenset[int]]:
    """The templates by the words they hold, and those of punctuation alone."""
    index, bare = {}, set()
    for i, pieces in enumerate(quote_templates()):
        words = set(re.findall(r"[a-z]{3,}", "".join(pieces).lower()))
        if not words:
            bare.add(i)
        for w in words:
            index.setdefault(w, []).append(i)
    return index, frozenset(bare)


def quote_words(text: str) -> int:
    return len(text.replace(", ", ",").split())  # a list of values (none, fp16, bf16) is one


def printed_by_the_code(D: str) -> bool:
    """Whether the code can print D (normalized): see the comment above QUOTE_HOLE."""
    L, T = len(D), quote_templates()
    index, bare = quote_template_index()
    cands = set(bare).union(*(index.get(w, ()) for w in set(re.findall(r"[a-z]{3,}", D.lower()))))

    def found(piece: str) -> list[int]:
        """Where piece is in D, and where D ends inside it."""
        at, i = [], D.find(piece[0], max(0, L - len(piece) + 1))
        while i >= 0:
            if piece.startswith(D[i:]):
                at.append(i)
            i = D.find(piece[0], i + 1)
        i = D.find(piece)
        while i >= 0:
            at.append(i)
            i = D.find(piece, i + 1)
        return at

    starts, leads = {}, []  # templates by where their first piece is in D; those that start with a value
    for c in cands:
        first = T[c][0]
        if first:
            for i in found(first):
                if i + len(first) <= L or re.search(r"[A-Za-z]{3}", D[i:]):  # D ends in it after a word
                    starts.setdefault(i, []).append(c)
        elif len(T[c]) > 1 and T[c][1] and found(T[c][1]):
            leads.append(c)

    @functools.cache
    def own_words(p: int, most: int) -> frozenset[int]:
        return frozenset(r for r in range(p, L + 1) if quote_words(D[p:r]) <= most)

    @functools.cache
    def value(p: int, head: bool, last: bool) -> frozenset[int]:
        """The ends of a value that starts at p (last: nothing of its string follows it); with head, D
        may end in it."""
        ends = {r for r in own_words(p, 1 if last else QUOTE_VALUE_WORDS) if r < L} | messages(p, False)
        if head and (quote_words(D[p:]) <= 1 or L in messages(p, True)):
            ends.add(L)
        return frozenset(ends)

    @functools.cache
    def render(c: int, k: int, off: int, p: int, head: bool, anchored: bool = False) -> frozenset[int]:
        """The ends q where D[p:q] renders template c from offset off of its piece k to its end (with
        head, D may end inside it), once a word of its own is in D (anchored)."""
        pieces = T[c]
        piece = pieces[k][off:]
        if not D.startswith(piece, p):
            cut = head and p < L and piece.startswith(D[p:]) and (anchored or re.search(r"[A-Za-z]{3}", D[p:]))
            return frozenset({L} if cut else ())
        anchored = anchored or c in bare or bool(re.search(r"[A-Za-z]{3}", piece))
        q = p + len(piece)
        if k == len(pieces) - 1:
            return frozenset({q} if anchored else ())
        out = set()
        for r in value(q, head, k + 2 == len(pieces) and not pieces[-1]):
            if r == L and head and anchored:
                out.add(L)
            out |= render(c, k + 1, 0, r, head, anchored)
        return frozenset(out)

    @functools.cache
    def messages(p: int, head: bool, leads_ok: bool = True) -> frozenset[int]:
        """The ends q > p where D[p:q] is one or more of the code's strings (with head, the last may be
        cut short)."""
        reach, todo = set(), [p]
        while todo:
            i = todo.pop()
            ends = set()
            for c in starts.get(i, ()):
                ends |= render(c, 0, 0, i, head)
            for c in leads if leads_ok else ():  # its first value: a number, N, ..., or the code's strings
                for r in ({r for r in own_words(i, 1) if not re.search(r"[A-Za-z]{2}", D[i:r])}
                          | messages(i, False, False)) - {i}:
                    ends |= render(c, 1, 0, r, head)
            for q in ends - reach:
                if q > i:
                    reach.add(q)
                    todo.append(q)
        return frozenset(reach)

    def resumed(q: int) -> bool:
        """Whether D[q:] goes on with the string the first one was a value of (`frozen, or cut off):
        ending this restart ...`: the end of one message, then the rest of the one that holds it)."""
        for c in cands:
            for k in range(1, len(T[c])):
                if T[c][k].strip() and D.startswith(T[c][k], q):
                    ends = render(c, k, 0, q, True)
                    if L in ends or any(L in messages(e, True) for e in ends if e > q):
                        return True
        return False

    if L in messages(0, True):
        return True
    for c in cands:  # D starts inside one of the code's strings
        for k, whole in enumerate(T[c]):
            s = whole.find(D[0], 1 if k == 0 else 0)
            while s >= 0:
                if D.startswith(whole[s:]) or whole[s:].startswith(D):
                    ends = render(c, k, s, 0, True)
                    if L in ends or any(L in messages(q, True) or resumed(q) for q in ends):
                        return True
                s = whole.find(D[0], s + 1)
    return False


def quote_problem(text: str) -> str | None:
    parts = re.split(r"\.\.\.|…", quote_normalized(text).strip())
    for i, part in enumerate(parts):
        # Next to "...", punctuation may be the left-out value's: `parameter '...' differs`.
        part = re.sub(r"^[^\w\x01]+", "", part) if i else part
        part = re.sub(r"[^\w\x01]+$", "", part) if i < len(parts) - 1 else part
        part = part.strip()
        if re.search(r"[A-Za-z]{3}", part) and not printed_by_the_code(part):
            return f"no string of the code prints {part.replace(QUOTE_VALUE, '<value>')!r}"
    return None


def reads_as_code(text: str) -> bool:
    """A command, a flag, a #SBATCH line, a single name or path, a signature, or Python with code in it."""
    if is_command(text) or QUOTE_TOOLS.match(text) or text[0] in "-#" or " " not in re.sub(r"<[^>]*>", "", text):
        return True
    if re.fullmatch(r"[\w.\[\]]+ -> [\w.\[\]]+", text) or re.fullmatch(r"\S+\.py(?:::|: )\w+", text):
        return True
    try:
        ast.parse(text)
    except SyntaxError:
        return False
    return bool(re.search(r"[()\[\]{}=.:*+]", text))  # `configuration is valid` parses, and is no code


def quote_sentences(span: Span) -> list[str]:
    """The sentences (or list items) around each place the span is in its paragraph, spans masked."""
    masked = re.sub(r"`[^`]*`", lambda m: "`" + "x" * (len(m.group(0)) - 2) + "`", span.context)
    out = []
    for m in re.finditer(re.escape(f"`{span.text}`"), span.context):
        start = max(masked.rfind(". ", 0, m.start()), masked.rfind(" - ", 0, m.start()))
        ends = [e for e in (masked.find(". ", m.end()), masked.find(" - ", m.end())) if e >= 0]
        out.append(span.context[start + 1:min(ends, default=len(masked))])
    return out


def in_you_see_column(page: Page, span: Span) -> bool | None:
    """For a span in a table row: whether its column is headed "what you see" (None: not in a table)."""
    lines = page.text.splitlines()
    if not lines[span.line - 1].lstrip().startswith("|"):
        return None
    top = span.line - 1
    while top > 0 and lines[top - 1].lstrip().startswith("|"):
        top -= 1
    header = [c.strip().lower() for c in lines[top].strip().strip("|").split("|")]
    cells = lines[span.line - 1].strip().strip("|").split("|")
    column = next((n for n, c in enumerate(cells) if f"`{span.text}`" in " ".join(c.split())), None)
    return column is not None and column < len(header) and "you see" in header[column]


def quote_claims() -> list[Claim]:
    """Spans the docs give as a program's output (see the comment above QUOTE_HOLE), and the lines of
    ```console and ```log blocks (but a console's $ commands)."""
    out = []
    for page in PARSED:
        for s in page.spans:
            if reads_as_code(s.text) or (re.fullmatch(r"[A-Za-z]\w*: \S+", s.text)
                                         and re.search(r"\.ya?ml\b", s.context)):  # an example's YAML line
                continue
            column = in_you_see_column(page, s)
            if column or (column is None and any(QUOTE_TRIGGER.search(x) for x in quote_sentences(s))):
                out.append(Claim(s.page, s.line, "quote", s.text))
        for block in page.blocks:
            if block.lang in ("console", "log"):
                out += [Claim(page.name, n, "quote", " ".join(t.split())) for n, t in block.lines
                        if t.strip() and not t.lstrip().startswith("$")]
    return out


def test_quoted_output_lines_are_printed_by_the_code():
    claims = [c for c in quote_claims() if c.text not in NOT_PRINTED_AS_QUOTED]
    bad = [c.bad(why) for c in claims if (why := quote_problem(c.text))]
    # The check itself: the quote that once named spike_guard where the code prints spike.guard fails.
    assert quote_problem("loss spike at step 31: ...; spike_guard=warn: continuing")
    report(bad, len(claims), "quoted output")
