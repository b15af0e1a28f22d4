"""Key names shared by datasets, models, the server and the evaluator.

They follow LeRobot's naming so that datasets and user code port over unchanged.
"""

OBS_STATE = "observation.state"
OBS_IMAGES = "observation.images"  # camera features are f"{OBS_IMAGES}.{camera}"
ACTION = "action"
ACTION_IS_PAD = "action_is_pad"
TASK = "task"
EPISODE_INDEX = "episode_index"
FRAME_INDEX = "frame_index"
TIMESTAMP = "timestamp"
INDEX = "index"
TASK_INDEX = "task_index"
PROMPT = "prompt"  # the instruction's request key (TASK in datasets and model batches)


def image_key(camera: str) -> str:
    """The feature key of one camera, e.g. ``observation.images.corner``."""
    return f"{OBS_IMAGES}.{camera}"


def camera_of(key: str) -> str | None:
    """The camera name of an image feature key, or None if ``key`` is not one."""
    prefix = OBS_IMAGES + "."
    return key[len(prefix) :] if key.startswith(prefix) else None


# World-model targets: f"{FUTURE_IMAGES}.{camera}" holds uint8 [K, H, W, 3] per sample (B, K, ... batched):
# the frames at the offsets a model declares in ``future_frame_offsets`` after the current one.
FUTURE_IMAGES = "observation.future_images"


def future_image_key(camera: str) -> str:
    """The batch key of one camera's future frames, e.g. ``observation.future_images.corner``."""
    return f"{FUTURE_IMAGES}.{camera}"


# Per-sample extras a model may ask for (its ``sample_extras``), computed by the data stage.
IDLE_FRAMES = "idle_frames"  # int: idle frames of the sample's action chunk (wamkit.actions.idle)
# [chunk, D]: the actions the env executed over the sample's chunk, encoded as the action chunk is. A
# collection with perturbations (DART noise, late actions) stores them in this column beside the
# expert's recorded ``action``; a dataset without the column executed its actions as recorded
EXECUTED_ACTION = "executed_action"
