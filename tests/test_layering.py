"""The import layering of docs/design.md, kept true: a stage imports only the stages before it in the flow
(and the bottom layer), ``eval/`` reaches models only through the server protocol, and ``data/`` never
imports ``models/``. Every import counts, including the lazy ones inside functions."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "wamkit"
DESIGN = SRC.parents[1] / "docs" / "design.md"

# Shared by every stage; they import nothing of wamkit but each other (device: config).
BOTTOM = {"__init__", "files", "constants", "config", "log", "device", "versions", "embodiments"}
# The flow, in order: each may import the bottom layer and what comes before it, except as noted.
ORDER = ["actions", "data", "envs", "models", "train", "export", "serve", "eval"]
FORBIDDEN = {
    "eval": {"models", "train", "export"},  # a user can point the evaluator at any OpenPI server
    "data": {"models"},  # the latent cache gets its VAE through the model adapter, never by import
}
# Above the flow: they assemble stages and may use any of them.
TOP = {"bench", "check", "demo", "demo_report", "cli", "__main__"}


def _imports(path: Path) -> set[str]:
    """The wamkit sub-package (or bottom module) each import in ``path`` names."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module == "wamkit":
            out.add("__init__")  # `from wamkit import __version__`: the package itself
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "wamkit" and len(parts) > 1:
                out.add(parts[1])
    return out


def _stage(path: Path) -> str:
    rel = path.relative_to(SRC)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _allowed(stage: str) -> set[str]:
    if stage in TOP:
        return BOTTOM | set(ORDER) | TOP
    if stage in BOTTOM:
        return BOTTOM
    before = ORDER[: ORDER.index(stage) + 1]
    return (BOTTOM | set(before)) - FORBIDDEN.get(stage, set())


FILES = sorted(SRC.rglob("*.py"))


def test_every_module_belongs_to_a_known_stage():
    unknown = {_stage(p) for p in FILES} - BOTTOM - set(ORDER) - TOP
    assert not unknown, f"place {unknown} in ORDER, BOTTOM or TOP of this test (and in docs/design.md)"


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(SRC)))
def test_imports_follow_the_flow(path):
    stage = _stage(path)
    if stage not in BOTTOM | set(ORDER) | TOP:
        pytest.skip(f"{stage} is not placed yet")
    bad = sorted(_imports(path) - _allowed(stage))
    assert not bad, f"{path.relative_to(SRC)} ({stage}) imports {bad}, which come later in the flow"


def test_the_bottom_layer_imports_no_stage():
    for name in ("files", "constants", "config", "log"):
        assert _imports(SRC / f"{name}.py") <= {"files", "constants", "config", "log"}, name


def test_the_design_page_states_these_layers():
    """docs/design.md's "Layers" table names the same layers, in the same order, as this test checks."""
    text = DESIGN.read_text()
    table = text[text.index("## Layers") :].split("\n## ", 1)[0]
    rows = [line.split("|")[1:3] for line in table.splitlines() if line.startswith("| ") and "`" in line]
    layers = {label.strip(): re.findall(r"`([^`]+)`", names) for label, names in rows}
    assert set(layers["bottom"]) == BOTTOM and set(layers["top"]) == TOP
    assert [layers[str(i + 1)][0] for i in range(len(ORDER))] == ORDER
