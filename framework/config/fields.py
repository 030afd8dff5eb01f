"""How a configuration field is declared: ``bounded`` (a number in a range) and ``option`` (a
string, switch or choice), each with its resume class and its flat name before sections. The
sections beside their owners (``framework/<package>/config.py``) are built from these. Imports no torch."""

from __future__ import annotations

from dataclasses import field
from typing import Any, Literal

ActivationCheckpointing = Literal["off", "non_reentrant", "reentrant", "offload"]
GradientCheckpointing = ActivationCheckpointing  # the name before sections
Switch = Literal["auto", "true", "false"]
Resume = Literal["neutral", "changes", "refused", "refused_builtin_data"]

RESUME_CLASSES: dict[str, str] = {
    "neutral": "may change on resume (where and how often things happen, not what is computed)",
    "changes": "may change on resume; the run differs from there on (logged as a WARNING)",
    "refused": "a resume with another value is refused (the saved position would be meaningless)",
    "refused_builtin_data": "refused when the run trains on the built-in data; ignored for a user's dataset",
}


AUTO = -1
"""What an int field declared with ``auto=True`` holds for "auto" (spelled auto or -1 in every
source): the component that owns it resolves the value for the machine it runs on."""


Builtin = Literal["model", "data"]
"""What only some runs use: the built-in GPT (no ``model`` given to DDPTrainer) or the built-in
data (no ``train_dataset``)."""


def bounded(default: int | float, *, lo: int | float | None, hi: int | float | None = None,
            resume: Resume, was: str | None, auto: bool = False, used_by: tuple[Builtin, ...] = ()):
    """A numeric field whose value must lie in [lo, hi] (None: no bound on that side), or be
    ``AUTO`` when ``auto``. Every numeric field is declared through this, so a missing bound is a
    visible choice. ``used_by``: the built-in parts that read it (none: every run does)."""
    return field(default=default, metadata={"bounds": (lo, hi), "resume": resume, "was": was, "auto": auto,
                                            "used_by": used_by})


def option(default: Any, *, resume: Resume, was: str | None, used_by: tuple[Builtin, ...] = ()):
    """A non-numeric field (a string, a switch or a choice). ``was``: its flat name before the
    configuration had sections (None for a key added since, which has no old name)."""
    return field(default=default, metadata={"resume": resume, "was": was, "used_by": used_by})
