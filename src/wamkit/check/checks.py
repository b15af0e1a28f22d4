"""The individual convention checks: each compares one fact of a dataset with the env and adds findings.

Every check reads a :class:`~wamkit.check.probe.DataView` (the dataset) and an
:class:`~wamkit.check.probe.EnvProbe` (the env after reset), never a model: the question is whether the
data was recorded the way this env produces and consumes observations and actions.
"""

from __future__ import annotations

import numpy as np

from wamkit.actions.gripper import CONVENTIONS, detect_gripper, get_convention, polarity
from wamkit.check.probe import DataView, EnvProbe
from wamkit.check.report import Report

# image orientations a dataset's frames may have relative to the env's (upright) frames
# each its own inverse; UNDO: the slicing that brings such frames back to the env's orientation
UNDO = {
    "rotated 180°": "img[::-1, ::-1]",
    "flipped upside down": "img[::-1]",
    "mirrored left-right": "img[:, ::-1]",
}
ORIENTATIONS = {
    "as the env": lambda x: x,
    "rotated 180°": lambda x: x[..., ::-1, ::-1, :],
    "flipped upside down": lambda x: x[..., ::-1, :, :],
    "mirrored left-right": lambda x: x[..., :, ::-1, :],
}
DECISIVE = 0.7  # the best orientation must be this much closer than the next to decide
JUMP = np.pi  # an axis-angle component that moves more than this in one frame has been flipped


def check_fps(data: DataView, env: EnvProbe, report: Report) -> None:
    if data.fps == env.fps:
        report.add("fps", "ok", f"{data.fps} fps, the env's control rate")
        return
    report.add(
        "fps",
        "error",
        f"the dataset is recorded at {data.fps} fps; the env steps at {env.fps} Hz, so each recorded delta "
        f"is {env.fps / data.fps:.2g}x the motion of one env step",
        f"resample or re-record the dataset at {env.fps} fps (stats of other rates do not fit either)",
    )


def check_action(
    data: DataView, env: EnvProbe, report: Report, names: tuple[str, ...], absolute: bool = False
) -> None:
    dim = data.actions.shape[1]
    if dim != env.action_dim:
        guess = " (10-D looks like [dpos, rot6d, gripper])" if dim == 10 else ""
        report.add(
            "action",
            "error",
            f"actions are {dim}-D{guess}; the env takes {env.action_dim}-D [{', '.join(names)}]",
            "store the env's raw actions in the dataset; a training representation "
            "(data.representation) is applied by the loader and decoded by the server",
        )
        return
    if absolute:  # joint targets in the state's units: no normalised range to check them against
        report.add("action", "ok", f"{dim}-D [{', '.join(names)}], absolute targets laid out as the state")
        return
    lo, hi = data.actions.min(axis=0), data.actions.max(axis=0)
    out = [i for i in range(dim - 1) if lo[i] < -1.0 - 1e-6 or hi[i] > 1.0 + 1e-6]
    if out:
        spans = "; ".join(f"{names[i]} in [{lo[i]:.3g}, {hi[i]:.3g}]" for i in out)
        report.add(
            "action",
            "warn",
            f"{spans}: outside the env's [-1, 1] action range (the env clips), so not the env's "
            "normalised delta actions (absolute poses? radians?)",
            f"store the env's delta actions [{', '.join(names)}] as the env receives them",
        )
        return
    report.add("action", "ok", f"{dim}-D [{', '.join(names)}], within the env's [-1, 1]")


def check_gripper(
    data: DataView,
    env: EnvProbe,
    report: Report,
    width_of,
    close_value: float = 1.0,
    open_value: float = -1.0,
) -> None:
    """The gripper command (the last action dim) against the env's convention: ``close_value`` and
    ``open_value`` are the commands the env takes (the embodiment profile's)."""
    g = data.actions[:, -1]
    if g.std() < 1e-9:
        report.add(
            "gripper", "info", f"the gripper command is constant ({g[0]:.3g}): its convention cannot be told"
        )
        return
    width = width_of(data.states) if data.states.shape[1] == env.state_dim else None
    recorded = (data.info.get("wamkit") or {}).get("gripper")
    if recorded is not None and recorded not in CONVENTIONS:
        report.add(
            "gripper",
            "error",
            f"meta/info.json: wamkit.gripper is {recorded!r}, not a known convention",
            f"one of {', '.join(CONVENTIONS)}",
        )
        return
    if recorded is not None:  # the writer said what it stored (wamkit collect: the env's commands)
        name, evidence = recorded, f"recorded as {recorded} in meta/info.json (wamkit.gripper)"
    else:
        name, evidence = detect_gripper(g, width)
    env_says = (
        f"{close_value:+g} closes the fingers"
        if env.close_shrinks
        else f"{close_value:+g} opens the fingers (unexpected)"
    )
    takes = f"{open_value:+g} = open, {close_value:+g} = close"
    if name != "env":
        report.add(
            "gripper",
            "warn",
            f"{evidence}: stored as {name} ({CONVENTIONS[name].doc}); the env takes {takes} "
            f"(measured: {env_says})",
            f"record the convention so the preprocessing spec maps it: `wamkit stats DATASET --gripper {name}` "
            f"(or data.gripper={name})",
        )
    else:
        report.add("gripper", "ok", f"{evidence}; the env's convention (measured: {env_says})")
    if width is None:
        return
    r = polarity(get_convention(name).to_env(g), width, data.episode_of_row)
    if r is None or abs(r) < 0.1:
        report.add(
            "gripper", "info", "polarity: the fingers barely move in the data; cannot tell which end opens"
        )
        return
    # in the data, the value the env reads as close precedes the fingers closing
    closes = r < 0 if close_value > open_value else r > 0
    if closes == env.close_shrinks:
        report.add(
            "gripper", "ok", f"polarity: the command the env reads as close precedes closing (r={r:.2f})"
        )
        return
    other = {
        "env": "negate the gripper channel (g -> -g)",
        "open_1": "--gripper close_1",
        "close_1": "--gripper open_1",
    }
    report.add(
        "gripper",
        "error",
        f"polarity inverted: read as {name}, the command the env takes as close ({close_value:+g}) is followed "
        f"by the fingers opening in the data (r={r:+.2f}); so the data's {get_convention(name).close_value:g} "
        "means open",
        f"{other[name]} in the dataset or its stats (the env: {takes})",
    )


def _describe_dims(idx: list[int], names: tuple[str, ...]) -> str:
    return ", ".join(f"state[{i}] ({names[i]})" if i < len(names) else f"state[{i}]" for i in idx)


def check_state(data: DataView, env: EnvProbe, report: Report, names, rot_dims, source: str) -> None:
    if data.states.shape[1] != env.state_dim:
        report.add(
            "state",
            "error",
            f"the state is {data.states.shape[1]}-D; the env gives {env.state_dim}-D",
            f"store the env's state: {source}",
        )
        return
    lo, hi = data.states.min(axis=0), data.states.max(axis=0)
    margin = 0.05 * (hi - lo) + 1e-3
    starts = env.starts or {"reset": env.states}
    outside = {kind: _uncovered(s, lo, hi, margin) for kind, s in starts.items()}
    fits = [kind for kind, bad in outside.items() if not bad]
    before = len(report.errors)
    if fits:
        which = _closest_start(data, {k: starts[k] for k in fits}) if len(fits) > 1 else fits[0]
        if len(starts) > 1:
            report.add(
                "state",
                "ok",
                f"the data starts as the env does {which}"
                + (
                    f" (the data's ranges cover the env's starts {' and '.join(fits)} too)"
                    if len(fits) > 1
                    else ""
                )
                + "",
            )
    else:
        for i in sorted({i for bad in outside.values() for i in bad}):
            ranges = "; ".join(
                f"{kind} {s[:, i].min():.4g}..{s[:, i].max():.4g}" for kind, s in starts.items()
            )
            large = _mistake_scale(lo[i], hi[i], i in rot_dims) + margin[i]
            if _excess(starts, i, lo[i], hi[i]) <= large:  # like other initial states, not a convention
                report.add(
                    "state",
                    "warn",
                    f"{_describe_dims([i], names)}: the env starts at {ranges}; the dataset's values span "
                    f"{lo[i]:.4g}..{hi[i]:.4g}, {_how_far(starts, i, lo[i], hi[i])}: within the "
                    f"{large:.3g} a start from other initial states (a benchmark's demonstrations, not the "
                    "trials probed here) can differ by; a convention mistake moves it further",
                    "",
                )
                continue
            report.add(
                "state",
                "error",
                f"{_describe_dims([i], names)}: the env starts at {ranges}; the dataset's values span "
                f"{lo[i]:.4g}..{hi[i]:.4g}, {_how_far(starts, i, lo[i], hi[i])}, beyond the "
                f"{large:.3g} allowed"
                + (" (axis-angle: an antipodal flip or another quaternion order?)" if i in rot_dims else ""),
                f"store the state the env produces: {source}",
            )
    if rot_dims:
        _check_rotation_sign(data, env, report, names, rot_dims, source)
        _check_rotation_jumps(data, report, names, rot_dims, source)
    _check_same_episode_states(data, env, report, names)
    if len(report.errors) == before and len(starts) == 1:
        report.add(
            "state", "ok", f"every dimension's data range covers the env's {len(env.states)} reset states"
        )


def _uncovered(starts: np.ndarray, lo: np.ndarray, hi: np.ndarray, margin: np.ndarray) -> list[int]:
    """Dimensions where some env start lies beyond the data's range by more than the margin."""
    s_lo, s_hi = starts.min(axis=0), starts.max(axis=0)
    return [i for i in range(len(lo)) if s_lo[i] < lo[i] - margin[i] or s_hi[i] > hi[i] + margin[i]]


# How far the env's starts may lie beyond the data's range before a convention mistake is the likelier
# cause. An axis-angle component moved by a quaternion order or sign mistake moves by radians (the
# antipodal flip by up to 2 pi); one from other initial states by tenths of a radian (a benchmark's
# stored starts: up to 0.09 rad, tests/test_check.py). A position or width in other units (mm, cm,
# degrees) or another frame moves by a multiple of its own magnitude; other starts by a fraction of it.
ROTATION_SCALE = 0.5  # radians


def _mistake_scale(lo: float, hi: float, rotation: bool) -> float:
    return ROTATION_SCALE if rotation else 0.5 * max(abs(lo), abs(hi), hi - lo)


def _excess(starts: dict[str, np.ndarray], i: int, lo: float, hi: float) -> float:
    """How far the env's starts reach beyond the data's range in dimension ``i`` (0 inside it)."""
    s_lo = min(float(s[:, i].min()) for s in starts.values())
    s_hi = max(float(s[:, i].max()) for s in starts.values())
    return max(lo - s_lo, s_hi - hi, 0.0)


def _how_far(starts: dict[str, np.ndarray], i: int, lo: float, hi: float) -> str:
    """How far the env's starts reach past the data's range in dimension ``i``, said as it is: below its
    lowest, above its highest, or both (never 'disjoint' for ranges that overlap)."""
    s_lo = min(float(s[:, i].min()) for s in starts.values())
    s_hi = max(float(s[:, i].max()) for s in starts.values())
    parts = []
    if s_lo < lo:
        parts.append(f"the env's lowest start is {lo - s_lo:.3g} below the data's lowest")
    if s_hi > hi:
        who = "its highest" if parts else "the env's highest start is"
        parts.append(f"{who} {s_hi - hi:.3g} above the data's highest")
    return " and ".join(parts) or "inside it"


def _closest_start(data: DataView, starts: dict[str, np.ndarray]) -> str:
    """The kind of start the dataset's first frames lie nearest to (median over the env's starts of the
    distance to the nearest episode start of the data)."""
    first = data.states[data.starts]
    dist = {
        kind: float(np.median([np.abs(first - s).max(axis=1).min() for s in states]))
        for kind, states in starts.items()
    }
    return min(dist, key=dist.get)


def _antipodal_flips(r: np.ndarray, same: np.ndarray) -> tuple[int, float]:
    """Consecutive axis-angle pairs (within episodes) that are the antipodal flip's signature: both of
    angle ~pi and pointing opposite ways (r' ~ -r), a jump the rotation itself did not make."""
    a, b = r[:-1][same], r[1:][same]
    near_pi = (np.abs(np.linalg.norm(a, axis=1) - np.pi) < 0.5) & (
        np.abs(np.linalg.norm(b, axis=1) - np.pi) < 0.5
    )
    flip = near_pi & (np.linalg.norm(a + b, axis=1) < 0.5) & (np.linalg.norm(a - b, axis=1) > JUMP)
    jump = float(np.abs(b - a).max()) if len(a) else 0.0
    return int(flip.sum()), jump


def _check_rotation_sign(data: DataView, env: EnvProbe, report: Report, names, rot_dims, source: str) -> None:
    """Near angle pi, q and -q encode one rotation as r and (almost) -r. Without the antipodal flip (the
    env's convention) every such vector points the way the env's does; flipped data also holds the
    opposite ones, even where no single episode crosses the cut and the range check passes."""
    e, d = env.states[:, list(rot_dims)], data.states[:, list(rot_dims)]
    e, d = (
        e[np.abs(np.linalg.norm(e, axis=1) - np.pi) < 0.5],
        d[np.abs(np.linalg.norm(d, axis=1) - np.pi) < 0.5],
    )
    if not len(e) or not len(d):
        return
    axis = e.mean(axis=0) / np.linalg.norm(e.mean(axis=0))
    opposite = int(((d / np.linalg.norm(d, axis=1, keepdims=True)) @ axis < -0.5).sum())
    if opposite:
        report.add(
            "state",
            "error",
            f"{_describe_dims(list(rot_dims), names)}: {opposite} of {len(d)} data states at an angle near pi "
            f"point opposite to the env's reset rotation ({np.round(e.mean(axis=0), 2).tolist()}): the same "
            "rotation stored with the other sign, the antipodal flip (q -> -q when w < 0)",
            f"recompute the axis-angle without the flip: {source}",
        )


def _check_rotation_jumps(data: DataView, report: Report, names, rot_dims, source: str) -> None:
    same = data.episode_of_row[1:] == data.episode_of_row[:-1]
    flips, jump = _antipodal_flips(data.states[:, list(rot_dims)], same)
    dims = _describe_dims(list(rot_dims), names)
    if flips:
        report.add(
            "state",
            "error",
            f"{dims} flip sign between consecutive frames {flips} time(s) at an angle of ~pi (jumps up to "
            f"{jump:.3g}): the antipodal flip of a quaternion -> axis-angle conversion (q -> -q when w < 0), "
            "discontinuous at the gripper-down pose",
            f"recompute the axis-angle without the flip: {source}",
        )
    elif jump > JUMP:
        report.add(
            "state",
            "warn",
            f"{dims} jump by up to {jump:.3g} between consecutive frames (not an antipodal flip): a "
            "discontinuous rotation encoding, or frames out of order",
            f"store the state the env produces: {source}",
        )


def _check_same_episode_states(data: DataView, env: EnvProbe, report: Report, names) -> None:
    """Datasets with a journal: the first recorded state of an episode is the env's after reset."""
    pairs = [
        (k, i)
        for k, spec in enumerate(env.specs)
        for i, ep in enumerate(data.episodes)
        if data.journal.get(ep) == spec
    ]
    if not pairs:
        return
    diff = np.stack([np.abs(data.states[data.starts[i]] - env.states[k]) for k, i in pairs]).max(axis=0)
    bad = [int(i) for i in np.flatnonzero(diff > 1e-3)]
    if bad:
        report.add(
            "state",
            "error",
            f"the same {len(pairs)} episode(s) (named by the collect journal) start from other states: "
            f"{_describe_dims(bad, names)} differ by up to {diff.max():.3g}",
            "collect and evaluate with the same simulator stack and env settings (see the drift pins)",
        )


def _gray(frames: np.ndarray, size: int = 16) -> np.ndarray:
    """uint8 [..., H, W, 3] -> float [..., size, size] block means of the grey level."""
    h, w = frames.shape[-3:-1]
    g = frames[..., : h // size * size, : w // size * size, :].astype(np.float64).mean(axis=-1)
    return g.reshape(*g.shape[:-2], size, h // size, size, w // size).mean(axis=(-3, -1))


def _pairs(data: DataView, env: EnvProbe, cam: str) -> tuple[np.ndarray, np.ndarray, str]:
    """Data and env frames to compare: the same episodes where a journal names them, else the mean
    first frame over the probed tasks' episodes against the mean env frame."""
    d, e = data.first_frames[cam], env.frames[cam]
    same = [
        (k, j)
        for k, spec in enumerate(env.specs)
        for j, i in enumerate(data.framed)
        if data.journal.get(data.episodes[i]) == spec
    ]
    if same:
        return d[[j for _, j in same]], e[[k for k, _ in same]], f"{len(same)} same episode(s)"
    texts = set(env.texts)
    idx = [j for j, i in enumerate(data.framed) if data.tasks[i] in texts] or list(range(len(d)))
    return d[idx].mean(axis=0, keepdims=True), e.mean(axis=0, keepdims=True), "mean first frames"


def check_images(data: DataView, env: EnvProbe, report: Report) -> None:
    cams = [c for c in data.cameras if c in env.frames]
    for cam in [c for c in data.cameras if c not in env.frames]:
        report.add(
            "image",
            "warn",
            f"camera '{cam}' has no counterpart in the env",
            "name the dataset's cameras as the env's (env.cameras)",
        )
    for cam in cams:
        d, e, how = _pairs(data, env, cam)
        gd = _gray(d)
        dist = {
            name: float(np.abs(gd - _gray(np.ascontiguousarray(f(e)))).mean())
            for name, f in ORIENTATIONS.items()
        }
        ranked = sorted(dist, key=dist.get)
        best, second = ranked[0], ranked[1]
        decided = dist[best] < DECISIVE * dist[second]
        nums = ", ".join(f"{k} {v:.1f}" for k, v in dist.items())
        if best == "as the env" and decided:
            report.add(
                "image", "ok", f"{cam}: frames are oriented as the env's ({how}; grey-level distance {nums})"
            )
        elif not decided:
            report.add(
                "image", "info", f"{cam}: orientation inconclusive ({how}; grey-level distance {nums})"
            )
        else:
            report.add(
                "image",
                "error",
                f"{cam}: the dataset's frames are {best} relative to the env's ({how}; grey-level distance {nums})",
                f"store frames as the env gives them ({UNDO[best]} on these; the env backend already applies "
                "the suite's own convention, as its reference client and published datasets do)",
            )


def check_render(data: DataView, report: Report, look: str) -> None:
    recorded = (data.info.get("wamkit") or {}).get("render_quality")
    if recorded is None:
        report.add("render", "info", f"the dataset does not record its render look; the env renders '{look}'")
    elif recorded != look:
        report.add(
            "render", "warn", f"the dataset was rendered '{recorded}', the suite's protocol look is '{look}'",
            f"evaluate with env.render_quality={recorded}, or re-render the data",
        )  # fmt: skip
    else:
        report.add("render", "ok", f"rendered '{recorded}', as the env")
