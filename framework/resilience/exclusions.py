"""The samples a loss-spike rollback excluded, kept in checkpoint_dir/EXCLUDED_SAMPLES.json so
that a restart after the rollback (before any newer checkpoint holds them) still excludes them.
The same file, or a plain JSON list of sample indices, is what ``exclude_samples`` reads.

The record names the lineage of the run that rolled back (markers.LINEAGE); a run takes it only
when it is one of its own lineages or the lineage of the checkpoint it resumed from, and a
rollback of another lineage keeps it beside its own ("other_lineages"). A record without a
lineage (written before lineages were recorded, or outside a trainer) applies to any run.
Torch-free: the config check reads it."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from ..state import atomic
from . import markers

log = logging.getLogger(__name__)

FILE = "EXCLUDED_SAMPLES.json"


def read(path: str | Path) -> list[int]:
    """The sample indices in ``path``: a JSON list, or an object with a ``samples`` list.
    Raises ValueError saying what is wrong."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ValueError("file not found") from None
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"unreadable: {err}") from None
    return _samples(data)


def _samples(data) -> list[int]:
    samples = data.get("samples") if isinstance(data, dict) else data
    if not isinstance(samples, list) or not all(isinstance(i, int) and i >= 0 for i in samples):
        raise ValueError('allowed: a JSON list of sample indices (integers >= 0), or {"samples": [...]}')
    return samples


def read_recorded(directory: str | Path) -> dict | None:
    """``{"samples", "rollbacks"}`` recorded by a rollback of this run's lineages in ``directory``
    (see the module), or None."""
    path = Path(directory) / FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        records = _records(data)
    except (ValueError, OSError, AttributeError, TypeError) as err:
        raise ValueError(f"{path}: {err}; it holds the samples a loss-spike rollback excluded: fix it (a JSON "
                         f"list of sample indices) or delete it to train on them again") from None
    ours = markers.recorded_lineages(directory)
    if ours is None or None in records:
        return records.get(None) or next(iter(records.values()))
    for lineage in [*ours["lineages"], ours["resumed"]]:
        if lineage in records:
            return records[lineage]
    log.info("%s holds the exclusions of lineages %s, not of this run's: not applied", path, ", ".join(records))
    return None


def _records(data) -> dict[str | None, dict]:
    """lineage (None: unknown) -> {"samples", "rollbacks"}, the file's own record first."""
    records = {data.get("lineage") if isinstance(data, dict) else None:
               {"samples": _samples(data), "rollbacks": list(data.get("rollbacks", []) if isinstance(data, dict)
                                                             else [])}}
    for lineage, record in (data.get("other_lineages", {}) if isinstance(data, dict) else {}).items():
        records.setdefault(lineage, {"samples": _samples(record), "rollbacks": list(record.get("rollbacks", []))})
    return records


def record(directory: str | Path, samples: list[int], rollbacks: list[dict]) -> None:
    """Record this run's exclusions (its lineage from markers.LINEAGE), keeping other lineages'."""
    path = Path(directory) / FILE
    ours = markers.recorded_lineages(directory)
    lineage = None if ours is None else ours["current"]
    try:
        others = {k: v for k, v in _records(json.loads(path.read_text())).items() if k not in (None, lineage)}
    except FileNotFoundError:
        others = {}
    except (ValueError, OSError, AttributeError, TypeError) as err:
        log.warning("%s is unreadable (%s): replacing it", path, err)
        others = {}
    data = {"samples": samples, "rollbacks": rollbacks, "lineage": lineage,
            **({"other_lineages": others} if others else {})}
    atomic.write_bytes(path, json.dumps(data, indent=1).encode())
