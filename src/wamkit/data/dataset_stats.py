"""Dataset statistics in the representation a model trains on, streamed one data file at a time.

``action`` statistics are taken over **action chunks** as the training pipeline builds them: for
every start frame, the next ``chunk`` actions of the episode, converted to the training representation
(e.g. 10-D ``[dpos, rot6d, gripper]`` frame-wise relative deltas), padding steps excluded.
``observation.state`` statistics are over frames. Memory is bounded by one data file plus the
accumulators' reservoirs, whatever the dataset size; results are deterministic for a given seed.

Only the data files' numeric columns are read: **no video is decoded** unless ``image_stats`` asks for
camera statistics (per channel, pixel values in [0, 1], over every ``image_stride``-th frame and pixel
row/column), which decodes those frames.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from wamkit.actions.gripper import GripperError, detect_gripper, get_convention
from wamkit.actions.representations import RepresentationError, get_representation
from wamkit.actions.stats import FeatureStats, StatsAccumulator, StatsFile
from wamkit.constants import ACTION, EPISODE_INDEX, OBS_STATE
from wamkit.data.meta import DatasetError, DatasetMeta, column_to_numpy, read_parquet


def chunk_windows(actions: np.ndarray, chunk: int) -> np.ndarray:
    """All non-padded chunk steps of one episode's actions (L, D): rows of ``actions[s + k]`` for every
    start ``s`` and step ``k < chunk`` with ``s + k < L``, shape (sum_s min(chunk, L - s), D)."""
    L = len(actions)
    starts = np.arange(L)[:, None] + np.arange(chunk)[None, :]
    return actions[starts[starts < L]]


def compute_stats(
    root: str | Path,
    representation: str = "raw",
    chunk: int = 16,
    seed: int = 0,
    gripper: str | None = None,
    finger_dims: tuple[int, int] | None = None,
    image_stats: bool = False,
    image_stride: int = 4,
) -> StatsFile:
    """The stats file of the dataset at ``root`` (see the module docstring for what is counted).

    The metadata records the gripper convention of the last action channel: ``gripper`` if given,
    else the one the dataset's ``meta/info.json`` records (``wamkit.gripper``: ``wamkit collect``
    writes ``env``), else detected from the actions' range and, with ``finger_dims`` (two state dims holding the finger
    positions, a profile's last two dims for a Panda), from which value precedes the fingers opening.
    """
    try:
        rep = get_representation(representation)
        if gripper is not None:
            get_convention(gripper)
    except (RepresentationError, GripperError) as err:
        raise DatasetError(str(err)) from None
    if chunk < 1:
        raise DatasetError(f"chunk: expected a positive integer, got {chunk}")
    meta = DatasetMeta(root)
    for key in (ACTION, OBS_STATE):
        if key not in meta.features:
            raise DatasetError(
                f"{meta.root}/meta/info.json: no '{key}' feature (features: {list(meta.features)})"
            )
    files: dict[tuple[int, int], list[int]] = {}
    for ep, info in meta.episodes.items():
        files.setdefault(info.data_file, []).append(ep)
    act_acc = state_acc = None
    grip_acc: list[np.ndarray] = []
    width_acc: list[np.ndarray] = []
    episode_acc: list[np.ndarray] = []
    for data_file, eps in sorted(files.items()):
        path = data_file
        table = read_parquet(path, columns=[ACTION, OBS_STATE, EPISODE_INDEX])
        action = column_to_numpy(table, ACTION, meta.features[ACTION]["shape"], path).reshape(len(table), -1)
        state = column_to_numpy(table, OBS_STATE, meta.features[OBS_STATE]["shape"], path).reshape(
            len(table), -1
        )
        ep_col = column_to_numpy(table, EPISODE_INDEX, [1], path).reshape(-1)
        for ep in eps:
            rows = np.flatnonzero(ep_col == ep)
            if len(rows) != meta.episodes[ep].length:
                raise DatasetError(
                    f"{path}: has {len(rows)} rows of episode {ep}; meta/episodes says {meta.episodes[ep].length}"
                )
            try:
                a = rep.to_model(chunk_windows(action[rows].astype(np.float64), chunk))
            except ValueError as err:
                raise DatasetError(
                    f"{path}: action cannot be converted to {representation!r}: {err}"
                ) from None
            if act_acc is None:
                act_acc = StatsAccumulator(a.shape[-1], seed=seed)
                state_acc = StatsAccumulator(state.shape[-1], seed=seed + 1)
            act_acc.update(a)
            state_acc.update(state[rows])  # type: ignore[union-attr]
            grip_acc.append(action[rows, -1])
            episode_acc.append(np.full(len(rows), ep))
            if finger_dims is not None:
                width_acc.append(state[rows, finger_dims[0]] - state[rows, finger_dims[1]])
    if act_acc is None or state_acc is None:
        raise DatasetError(f"{meta.root}: no frames to compute statistics on")
    recorded = (meta.info.get("wamkit") or {}).get("gripper")
    if gripper is None and recorded is not None:
        try:
            get_convention(recorded)
        except GripperError as err:
            raise DatasetError(f"{meta.root}/meta/info.json: wamkit.gripper: {err}") from None
        gripper, evidence = (
            recorded,
            "recorded in meta/info.json by the writer (wamkit collect: the env's own commands)",
        )
    elif gripper is None:
        try:
            widths = np.concatenate(width_acc) if width_acc else None
            episodes = np.concatenate(episode_acc)
            gripper, evidence = detect_gripper(np.concatenate(grip_acc), widths, episodes)
        except GripperError as err:
            raise DatasetError(f"{meta.root}: {err}; pass the convention explicitly (--gripper)") from None
    else:
        evidence = "given explicitly"
    names = meta.features[ACTION].get("names")
    metadata = {
        "representation": representation,
        "fps": meta.fps,
        "chunk": chunk,
        "action_dim": act_acc.dim,
        "feature_names": {ACTION: rep.model_names(names if isinstance(names, list) else None, act_acc.dim)},
        "gripper": gripper,
        "gripper_evidence": evidence,
        "source": str(meta.root),
    }
    render_quality = (meta.info.get("wamkit") or {}).get("render_quality")
    if render_quality is not None:
        metadata["render_quality"] = render_quality
    features = {ACTION: act_acc.result(), OBS_STATE: state_acc.result()}
    if image_stats:
        features.update(camera_stats(meta.root, image_stride, seed))
    return StatsFile(features=features, metadata=metadata)


def camera_stats(root: Path, stride: int, seed: int) -> dict[str, FeatureStats]:
    """Per-channel statistics in [0, 1] of every camera, over every ``stride``-th frame (decoded in
    order) and every ``stride``-th pixel row and column."""
    from wamkit.data.dataset import LeRobotDataset  # decoding: only when asked for

    ds = LeRobotDataset(root)
    out = {}
    for key in ds.camera_keys:
        one = LeRobotDataset(root, cameras=[key])
        acc = StatsAccumulator(3, seed=seed)
        for row in range(0, len(one), max(1, stride)):
            img = one[row][key].numpy()[::stride, ::stride]
            acc.update(img.reshape(-1, 3).astype(np.float64) / 255.0)
        out[key] = acc.result()
    return out
