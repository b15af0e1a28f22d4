"""Logging set-up shared by every command."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any, TextIO

LEVELS = ("debug", "info", "warning", "error")


class _Stderr(logging.StreamHandler):
    """A stream handler that writes to whatever ``sys.stderr`` is at each record (a redirect or a
    test's capture made after set-up), never to a stream that has since been closed."""

    @property
    def stream(self) -> TextIO:  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, _value: TextIO) -> None:
        pass


# what optional libraries say while they are imported, about parts of themselves wamkit does not use:
# torchao (the LoRA int8 base) on a torch newer than its compiled extensions logs each one it cannot
# load, that it finds no Triton on a CPU machine, and torch's pytree deprecations its import triggers;
# diffusers then warns that torchao's tensor types (for loading torchao-serialized checkpoints) are
# missing. Shown with --log-level debug.
IMPORT_CHATTER = ("torchao", "torch.utils._pytree", "diffusers.quantizers.torchao.torchao_quantizer")


def setup_logging(level: str = "info", file: str | None = None) -> None:
    """Configure the root logger once: a terse stream handler, plus a file handler if given."""
    root = logging.getLogger()
    root.setLevel(level.upper())
    for name in IMPORT_CHATTER:
        logging.getLogger(name).setLevel(logging.DEBUG if level.lower() == "debug" else logging.ERROR)
    fmt = logging.Formatter("%(asctime)s %(levelname).1s %(name)s: %(message)s", "%H:%M:%S")
    if not any(getattr(h, "_wamkit", False) for h in root.handlers):
        handler = _Stderr()
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


# a progress bar written to a file or a pipe: one line this often at most (plus its first and last)
PROGRESS_LINE_S = 30.0


class _Lines:
    """A stream for tqdm that writes each of its redraws as a whole line, and a redraw that says nothing
    new not at all: a bar's carriage returns would otherwise make one line of a log file, with the log's
    own lines cut into it."""

    def __init__(self, stream: TextIO):
        self.stream, self.last = stream, ""
        self.encoding = getattr(stream, "encoding", "utf-8")

    def write(self, text: str) -> None:
        for part in text.replace("\r", "\n").split("\n"):
            part = part.strip()
            if part and part != self.last:
                self.stream.write(part + "\n")
                self.last = part

    def flush(self) -> None:
        self.stream.flush()


def progress_bar(**kwargs: Any):
    """A tqdm bar on stderr: redrawn in place on a terminal; elsewhere (a file, a pipe) a plain line
    every :data:`PROGRESS_LINE_S` seconds at most."""
    from tqdm import tqdm

    stream = sys.stderr
    if stream is None or stream.isatty():
        return tqdm(file=stream, dynamic_ncols=True, **kwargs)
    return tqdm(file=_Lines(stream), mininterval=PROGRESS_LINE_S, ascii=True, ncols=100, **kwargs)
