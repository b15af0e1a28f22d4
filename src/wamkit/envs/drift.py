"""Simulator drift pins: small golden fingerprints of episode starts, kept next to each env backend.

A MuJoCo, robosuite or renderer upgrade can change what an episode looks like without any error
(a robosuite scene's floors rendered darker after MuJoCo 3.3.3; its start states broke after 3.4.0). The pins
catch that: ``<embodiment>_pins.json`` in this folder holds, for the episodes its profile's ``drift``
names (a few tasks and trials per suite), a fingerprint made by the suite's protocol at 64 px:

- ``state``: the state after reset (and the suite's settle steps);
- ``state_after``: where the plan asks for it, the state after some steps of the scripted expert
  (physics);
- ``images``: per camera, a coarse signature: the mean of each colour channel over a 4 x 4 grid of
  blocks (uint8 grey levels), blind to single pixels, not to a darker floor or a moved object.

:func:`check_pins` rebuilds each fingerprint with the installed stack and returns one message per
quantity that moved past its tolerance, naming suite, task, trial and the quantity. Regenerate a file
(after a deliberate upgrade, reviewing the diff) with ``python -m wamkit.envs.drift --write <embodiment>``.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

import numpy as np

from wamkit import embodiments
from wamkit.config import EnvConfig
from wamkit.constants import OBS_STATE, image_key
from wamkit.envs.base import EpisodeSpec, stack_versions
from wamkit.files import atomic_write_text

HERE = Path(__file__).resolve().parent
FORMAT = "wamkit.drift_pins/1"
SIZE = 64
GRID = 4
TOLERANCE = {"state": 1e-4, "image": 2.0}  # state units; grey levels of a block mean


def plan(backend: str) -> Any:
    """The pinned episodes of embodiment ``backend`` (its profile's ``drift``)."""
    profile = embodiments.get(backend)
    if profile.drift is None:
        raise KeyError(f"embodiment {backend!r} declares no drift pins")
    return profile.drift


def pinned_embodiments() -> list[str]:
    return [name for name in embodiments.names() if embodiments.get(name).drift is not None]


def pins_path(backend: str) -> Path:
    return HERE / f"{backend}_pins.json"


def image_signature(img: np.ndarray, grid: int = GRID) -> list[list[float]]:
    """Mean of each channel over a ``grid`` x ``grid`` split of a uint8 [H, W, 3] image, row-major:
    ``[[r, g, b], ...]`` (``grid**2`` rows), rounded to 0.01 grey levels."""
    h, w, c = img.shape
    blocks = img[: h // grid * grid, : w // grid * grid].reshape(grid, h // grid, grid, w // grid, c)
    return np.round(blocks.astype(np.float64).mean(axis=(1, 3)).reshape(grid * grid, c), 2).tolist()


def fingerprint(env, spec: EpisodeSpec, cameras: list[str], expert_steps: int = 0) -> dict[str, Any]:
    """The fingerprint of ``spec`` in ``env`` (built by the suite's protocol): see the module doc."""
    obs = env.reset(spec)
    out: dict[str, Any] = {
        "task": spec.task,
        "trial": spec.trial,
        "seed": spec.seed,
        "state": np.round(obs[OBS_STATE].astype(np.float64), 6).tolist(),
        "images": {c: image_signature(obs[image_key(c)]) for c in cameras},
    }
    if expert_steps:
        for _ in range(expert_steps):
            obs, *_ = env.step(env.expert_action(obs))
        out["state_after"] = np.round(obs[OBS_STATE].astype(np.float64), 6).tolist()
    return out


def _env_config(suite: str, cameras: list[str], look: str) -> EnvConfig:
    return EnvConfig(suite=suite, tasks=[], cameras=list(cameras), image_size=SIZE, render_quality=look)


def make_fingerprints(backend: str, suites: list[str] | None = None, first_only: bool = False):
    """``{suite: {look: [fingerprint, ...]}}`` of the pinned episodes, made with the installed stack."""
    from wamkit.envs.base import episode_seed
    from wamkit.envs.suites import make_env, resolve_env_config

    pins = plan(backend)
    cameras = list(pins.cameras)
    out: dict[str, dict[str, list]] = {}
    for suite, episodes in pins.episodes.items():
        if suites is not None and suite not in suites:
            continue
        for look in pins.looks:
            cfg = resolve_env_config(_env_config(suite, cameras, look))
            env = make_env(cfg)
            try:
                prints = []
                for task, trial in episodes[:1] if first_only else episodes:
                    seed = episode_seed(cfg.seed_rule, 0, trial)
                    spec = EpisodeSpec(suite, task, trial, seed)
                    prints.append(fingerprint(env, spec, cameras, pins.expert_steps))
            finally:
                env.close()
            out.setdefault(suite, {})[look] = prints
    return out


def write_pins(backend: str) -> Path:
    """Make every pinned fingerprint with the installed stack and write ``<backend>_pins.json``."""
    pins = make_fingerprints(backend)  # first: a backend that installs its stack apart is imported now
    data = {
        "format": FORMAT,
        "made_with": stack_versions(embodiments.get(backend).packages),  # its own stack
        "image_size": SIZE,
        "cameras": list(plan(backend).cameras),
        "tolerance": TOLERANCE,
        "pins": pins,
    }
    text = json.dumps(data, indent=1)
    # one line per list of numbers: the file stays short and a drift shows as a one-line diff
    text = re.sub(r"\[\s+([-\d.,eE\s]+?)\s+\]", lambda m: "[" + " ".join(m.group(1).split()) + "]", text)
    return atomic_write_text(pins_path(backend), text + "\n")


def load_pins(backend: str) -> dict[str, Any]:
    path = pins_path(backend)
    data = json.loads(path.read_text())
    if data.get("format") != FORMAT:
        raise ValueError(f"{path}: format {data.get('format')!r}, expected {FORMAT!r}")
    return data


def compare(pinned: dict[str, Any], got: dict[str, Any], where: str, tol: dict[str, float]) -> list[str]:
    """Messages, one per quantity of fingerprint ``got`` that differs from ``pinned`` past ``tol``."""
    out = []
    for key in ("state", "state_after"):
        if key not in pinned:
            continue
        a, b = np.asarray(got[key]), np.asarray(pinned[key])
        for i in np.flatnonzero(np.abs(a - b) > tol["state"]):
            out.append(f"{where}: {key}[{i}] is {a[i]:.6f}, pinned {b[i]:.6f} (tolerance {tol['state']:g})")
    for cam, sig in pinned["images"].items():
        a, b = np.asarray(got["images"][cam]), np.asarray(sig)
        diff = np.abs(a - b)
        if diff.max() > tol["image"]:
            blk, ch = np.unravel_index(int(diff.argmax()), diff.shape)
            row, col = divmod(int(blk), GRID)
            out.append(
                f"{where}: image {cam} block ({row}, {col}) channel {'RGB'[ch]} mean is {a[blk, ch]:.2f}, "
                f"pinned {b[blk, ch]:.2f} ({int((diff > tol['image']).sum())} of {diff.size} block means "
                f"moved more than {tol['image']:g} grey levels; overall mean {a.mean():.2f} vs {b.mean():.2f})"
            )
    return out


def check_pins(backend: str, suites: list[str] | None = None, first_only: bool = False) -> list[str]:
    """Rebuild the pinned fingerprints of ``backend`` and return what drifted (empty: none)."""
    data = load_pins(backend)
    got = make_fingerprints(backend, suites, first_only)
    problems = []
    for suite, looks in got.items():
        for look, prints in looks.items():
            for fp, pin in zip(prints, data["pins"][suite][look]):
                where = f"{suite} ({look} look) task {pin['task']} trial {pin['trial']} seed {pin['seed']}"
                problems += compare(pin, fp, where, data["tolerance"])
    return problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m wamkit.envs.drift", description=__doc__.split("\n")[0])
    p.add_argument("backend", choices=pinned_embodiments())
    p.add_argument("--write", action="store_true", help="regenerate the pins file with the installed stack")
    args = p.parse_args(argv)
    if args.write:
        print(write_pins(args.backend))
        return 0
    problems = check_pins(args.backend)
    print("\n".join(problems) or f"{args.backend}: the installed stack reproduces every pin")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
