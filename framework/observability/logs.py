"""Rank-aware logging: every rank appends to log_dir/rank_N.log; the console shows rank 0, without
the records marked ``extra=DETAIL`` (the full configuration, routine scores and readings), which
only the log file keeps."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

FORMAT = "%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s"
_HANDLER_TAG = "_ddp_framework_handler"
DETAIL = {"detail": True}
"""``log.info(..., extra=DETAIL)``: for the rank's log file only, not the console."""


def _not_detail(record: logging.LogRecord) -> bool:
    return not getattr(record, "detail", False)


def setup_logging(rank: int, log_dir: str | Path, *, debug: bool = False, file_rank: int | None = None) -> Path:
    """Configure the ``framework`` logger (and the root logger's console) for this rank.
    Idempotent: handlers from an earlier call are replaced. Returns the rank's log file,
    ``rank_{file_rank}.log`` (default: ``rank``; a run that heals in place keeps each replica's
    file while its rank changes)."""
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    path = log_dir / f"rank_{rank if file_rank is None else file_rank}.log"
    formatter = logging.Formatter(FORMAT.format(rank=rank), datefmt="%Y-%m-%d %H:%M:%S")
    root = logging.getLogger()
    for handler in [h for h in root.handlers if getattr(h, _HANDLER_TAG, False)]:
        root.removeHandler(handler)
        handler.close()
    handlers: list[logging.Handler] = [logging.FileHandler(path, mode="a", encoding="utf-8")]
    if rank == 0:
        console = logging.StreamHandler(sys.stderr)
        console.addFilter(_not_detail)
        handlers.append(console)
    for handler in handlers:
        handler.setFormatter(formatter)
        setattr(handler, _HANDLER_TAG, True)
        root.addHandler(handler)
    level = logging.DEBUG if debug else logging.INFO
    root.setLevel(level)
    logging.getLogger("framework").setLevel(level)
    return path


def log_file_stream(path: Path):
    """The open stream of the handler writing ``path`` (for faulthandler), or None."""
    handler = next((h for h in logging.getLogger().handlers
                    if getattr(h, "baseFilename", None) == str(Path(path).resolve())), None)
    return handler.stream if handler is not None else None


def close_logging() -> None:
    root = logging.getLogger()
    for handler in [h for h in root.handlers if getattr(h, _HANDLER_TAG, False)]:
        root.removeHandler(handler)
        handler.close()
