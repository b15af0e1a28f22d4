"""maintainers/libero_bundle.py: what LIBERO's bundle for the GPU machine keeps, and that it installs whole.

The full build (every LIBERO-10 task built and reset, about ten minutes here) is run by hand
(maintainers/README.md); these tests check its selection and packing on a few files of the installed extra.
"""

from __future__ import annotations

import importlib.util
import io
import tarfile
from argparse import Namespace
from importlib import metadata
from pathlib import Path

import pytest

pytestmark = [pytest.mark.libero]
pytest.importorskip("robosuite")
pytest.importorskip("libero")

SCRIPT = Path(__file__).resolve().parents[1] / "maintainers" / "libero_bundle.py"


def _script():
    spec = importlib.util.spec_from_file_location("libero_bundle", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_bundle_keeps_what_the_target_lacks_with_each_distributions_metadata(tmp_path):
    lb = _script()
    site = lb._site()
    opened = {
        site / "robosuite" / "models" / "base.py",
        site / "libero" / "libero" / "__init__.py",
        site / "numpy" / "__init__.py",  # the GPU machine's image has numpy: never packed
    }
    kept = lb._kept(opened)
    assert "robosuite/models/base.py" in kept and "numpy/__init__.py" not in kept
    # the package directories the modules live in come with their __init__.py
    assert {"robosuite/__init__.py", "robosuite/models/__init__.py"} <= set(kept)
    # and the distributions' METADATA, so that the target reports their versions (plan.json's stack)
    infos = {name for name in kept if name.endswith(".dist-info/METADATA")}
    assert {n.split("-")[0] for n in infos} == {"robosuite", "libero"}

    # packed as build packs, installed by install: the versions read back from the target
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:xz") as tar:
        for name in sorted(kept):
            tar.add(kept[name], arcname=name, recursive=False)
    bundle, target = tmp_path / "bundle", tmp_path / "site"
    bundle.mkdir()
    blob = buf.getvalue()
    half = len(blob) // 2
    (bundle / "part-000").write_bytes(blob[:half])  # in pieces, as a large bundle travels
    (bundle / "part-001").write_bytes(blob[half:])
    assert lb.install(Namespace(bundle=str(bundle), target=str(target))) == 0
    assert (target / "robosuite" / "models" / "base.py").read_bytes() == kept[
        "robosuite/models/base.py"
    ].read_bytes()
    found = {d.metadata["Name"].lower(): d.version for d in metadata.distributions(path=[str(target)])}
    assert found == {"robosuite": metadata.version("robosuite"), "libero": metadata.version("libero")}


def test_install_names_a_missing_bundle(tmp_path, capsys):
    assert _script().install(Namespace(bundle=str(tmp_path), target=str(tmp_path / "site"))) == 1
    assert f"no pieces under {tmp_path}" in capsys.readouterr().err
