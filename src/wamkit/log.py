"""Logging set-up shared by every command."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

LEVELS = ("debug", "info", "warning", "error")


def setup_logging(level: str = "info", file: str | None = None) -> None:
    """Configure the root logger once: a terse stream handler, plus a file handler if given."""
    root = logging.getLogger()
    root.setLevel(level.upper())
    fmt = logging.Formatter("%(asctime)s %(levelname).1s %(name)s: %(message)s", "%H:%M:%S")
    if not any(getattr(h, "_wamkit", False) for h in root.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(fmt)
        handler._wamkit = True  # type: ignore[attr-defined]
        root.addHandler(handler)
    if file is not None:
        fh = logging.FileHandler(file)
        fh.setFormatter(fmt)
        fh._wamkit = True  # type: ignore[attr-defined]
        root.addHandler(fh)


def close_file_logs(folder: str | Path) -> None:
    """Detach and close the file handlers that write into ``folder`` (before it is removed)."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        if isinstance(handler, logging.FileHandler) and Path(handler.baseFilename).is_relative_to(
            Path(folder).resolve()
        ):
            root.removeHandler(handler)
            handler.close()
