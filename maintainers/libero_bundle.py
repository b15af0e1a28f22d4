"""LIBERO for a machine with no package registry (the GPU machine): only the files LIBERO uses.

robosuite's wheel is 193 MB and LIBERO's assets 5 x 71 MB, more than one copy to that machine may carry
(64 MiB). What the suites one evaluates really open is far less. ``build`` records it while it builds
and resets every task of the suites, here, with LIBERO installed (``make setup-libero``):

- files Python opens (an audit hook on ``open``: modules, bddl files, init states, XML), and
- files MuJoCo opens from C (meshes, textures), read from each built model's XML,

keeps those under site-packages that the GPU machine's image lacks, and packs them (tar + xz) into
pieces of at most ``--part-mb``. It also writes each task's fingerprint at trial 0 (state after reset
and settle, a coarse image signature: wamkit.envs.drift) made with this stack.

    python maintainers/libero_bundle.py build --suites libero_10          # here: .libero_bundle/
    python3 maintainers/libero_bundle.py install                           # there: into /tmp/site
    python3 maintainers/libero_bundle.py check --suites libero_10          # there: same episode starts?

``install`` unpacks the pieces into ``--target`` (default /tmp/site, which maintainers/gpu_env.sh puts on
PYTHONPATH) and ``check`` rebuilds every task, resets trial 0 and compares with the fingerprints made
here, naming task and quantity (states to 1e-4; image block means to a looser tolerance, as another
renderer draws them).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import sys
import sysconfig
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

# Top-level packages the GPU machine's image already has, or that maintainers/gpu_carry.sh carries (sim).
PROVIDED = {
    "numpy", "scipy", "torch", "cv2", "numba", "llvmlite", "h5py", "PIL", "yaml", "matplotlib", "tqdm",
    "cloudpickle", "mujoco", "gymnasium", "metaworld", "glfw", "OpenGL", "farama_notifications", "absl",
    "etils", "packaging", "typing_extensions", "six", "networkx", "jinja2", "markupsafe", "sympy",
    "mpmath", "filelock", "fsspec", "kiwisolver", "cycler", "fontTools", "pyparsing", "dateutil",
    "contourpy", "wamkit", "_distutils_hack", "pkg_resources", "setuptools", "typing_extensions.py",
    "charset_normalizer", "torchgen", "requests", "urllib3", "idna", "certifi",
    "cffi", "pycparser",  # optional for glfw and numba; the image's own are used where present
}  # fmt: skip
SIZE, CAMERAS = 64, ["agentview", "wrist"]
IMAGE_TOL_HERE, IMAGE_TOL_OTHER_RENDERER = 2.0, 12.0


def _site() -> Path:
    return Path(sysconfig.get_paths()["purelib"])


def _source_of(path: Path) -> Path:
    """A cached ``pkg/__pycache__/mod.cpython-311.pyc`` stands for ``pkg/mod.py`` (the target's Python
    compiles its own)."""
    if path.suffix == ".pyc" and path.parent.name == "__pycache__":
        return path.parent.parent / (path.name.split(".")[0] + ".py")
    return path


def _model_files(env) -> set[Path]:
    """Files the built MuJoCo model references (``file="..."``: meshes, textures, heightfields)."""
    xml = env._env.env.sim.model.get_xml()
    return {Path(p) for p in re.findall(r'file="([^"]+)"', xml) if os.path.isabs(p)}


def _fingerprints_and_files(suites: list[str]) -> tuple[dict, set[Path]]:
    opened: set[Path] = set()  # the hook comes first: every import below is recorded
    sys.addaudithook(lambda event, args: opened.add(Path(os.fsdecode(args[0])))
                     if event == "open" and isinstance(args[0], str | bytes) else None)  # fmt: skip
    from wamkit.config import EnvConfig
    from wamkit.envs.base import EpisodeSpec, episode_seed
    from wamkit.envs.drift import fingerprint
    from wamkit.envs.libero_env import LiberoEnv
    from wamkit.envs.suites import expand_tasks, resolve_env_config

    prints: dict[str, list] = {}
    for suite in suites:
        cfg = resolve_env_config(EnvConfig(suite=suite, tasks=[], cameras=CAMERAS, image_size=SIZE))
        env = LiberoEnv(cfg)
        try:
            for i, task in enumerate(expand_tasks(suite, ["all"])):
                spec = EpisodeSpec(suite, task, 0, episode_seed(cfg.seed_rule, 0, 0))
                prints.setdefault(suite, []).append(fingerprint(env, spec, CAMERAS))
                opened |= _model_files(env)
                print(f"  {suite} task {i}: reset and fingerprinted", flush=True)
        finally:
            env.close()
    return prints, opened


def _kept(opened: set[Path]) -> dict[str, Path]:
    """arcname (relative to site-packages, as opened) -> the file, for packages the target lacks."""
    site, out = _site(), {}
    for path in opened:
        path = _source_of(Path(os.path.abspath(path)))
        try:
            rel = path.relative_to(site)
        except ValueError:
            continue
        if rel.parts[0] in PROVIDED or rel.parts[0].endswith((".dist-info", ".pth")) or not path.is_file():
            continue
        out[str(rel)] = path
    # each kept package's distribution METADATA, so that importlib.metadata.version() answers there and
    # a run's plan.json records the robosuite and LIBERO versions it ran (stack_versions)
    from importlib import metadata

    owners = metadata.packages_distributions()
    for top in sorted({Path(name).parts[0].removesuffix(".py") for name in out}):
        for dist in owners.get(top, []):
            for f in metadata.distribution(dist).files or []:
                path = Path(f.locate())
                if f.name == "METADATA" and path.parent.suffix == ".dist-info" and path.parent.parent == site:
                    out.setdefault(str(path.relative_to(site)), path)
    for name in list(out):  # every package directory the modules live in needs its __init__.py
        parent = Path(name).parent
        while parent.parts:
            init = site / parent / "__init__.py"
            if init.is_file():
                out.setdefault(str(parent / "__init__.py"), init)
            parent = parent.parent
    return out


def build(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("part-*"):
        old.unlink()
    prints, opened = _fingerprints_and_files(args.suites)
    files = _kept(opened)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:xz") as tar:
        for name in sorted(files):
            tar.add(files[name], arcname=name, recursive=False)  # follows the assets symlink
    blob, step = buf.getvalue(), int(args.part_mb * 2**20)
    for i in range(0, len(blob), step):
        (out / f"part-{i // step:03d}").write_bytes(blob[i : i + step])
    size = sum(f.stat().st_size for f in files.values())
    (out / "fingerprints.json").write_text(json.dumps({"suites": prints, "cameras": CAMERAS, "size": SIZE}))
    print(f"{len(files)} files ({size / 2**20:.1f} MiB) -> {len(blob) / 2**20:.1f} MiB xz in "
          f"{(len(blob) + step - 1) // step} piece(s) under {out}")  # fmt: skip
    return 0


def install(args: argparse.Namespace) -> int:
    parts = sorted(Path(args.bundle).glob("part-*"))
    if not parts:
        print(f"no pieces under {args.bundle}", file=sys.stderr)
        return 1
    blob = b"".join(p.read_bytes() for p in parts)
    with tarfile.open(fileobj=io.BytesIO(blob), mode="r:xz") as tar:
        tar.extractall(args.target, filter="data")
    print(f"installed {len(parts)} piece(s) into {args.target}")
    return 0


def check(args: argparse.Namespace) -> int:
    from wamkit.envs.drift import compare

    here = json.loads((Path(args.bundle) / "fingerprints.json").read_text())
    got, _ = _fingerprints_and_files(args.suites)
    tol = {"state": 1e-4, "image": args.image_tol}
    problems = []
    for suite in args.suites:
        for pin, fp in zip(here["suites"][suite], got[suite]):
            problems += compare(pin, fp, f"{suite} task {pin['task']} trial 0", tol)
    print(
        "\n".join(problems) or f"{', '.join(args.suites)}: every task's trial 0 matches the bundle's machine"
    )
    return 1 if problems else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("build", "install", "check"):
        s = sub.add_parser(name)
        s.add_argument("--bundle", "--out", dest="out", default=str(REPO / ".libero_bundle"))
        s.add_argument("--suites", nargs="+", default=["libero_10"])
    sub.choices["build"].add_argument("--part-mb", type=float, default=60.0)
    sub.choices["install"].add_argument("--target", default="/tmp/site")
    sub.choices["check"].add_argument("--image-tol", type=float, default=IMAGE_TOL_OTHER_RENDERER)
    args = p.parse_args()
    args.bundle = args.out
    return {"build": build, "install": install, "check": check}[args.cmd](args)


if __name__ == "__main__":
    raise SystemExit(main())
