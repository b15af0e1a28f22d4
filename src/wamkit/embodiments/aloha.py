"""ALOHA in simulation: two ViperX 300s arms in gym-aloha's MuJoCo scenes (the ACT paper's tasks).

- tasks: ``transfer_cube`` (the right arm picks the cube up and hands it to the left) and ``insertion``
  (the arms pick up the peg and the socket and insert one into the other), as gym-aloha 0.1.5 builds them;
- state [14]: joint positions, left arm then right, each six arm joints and the gripper as gym-aloha
  normalises it (the finger position mapped to 0 = closed, 1 = open: ``normalize_puppet_gripper_position``);
- action [14]: absolute joint-position targets in the same layout (gym-aloha's ``sim.py`` action space);
  the grippers 0 = close, 1 = open, so the action that holds the arms still is the state;
- 50 Hz (``DT`` 0.02 s: 10 MuJoCo steps of 2 ms), 400 steps (LeRobot's ``AlohaEnv.episode_length``),
  success = the task's highest reward (4) reached, as gym-aloha's ``is_success`` and LeRobot's
  evaluation count it; each episode's object poses drawn from its seed by gym-aloha's own samplers;
- cameras: ``top`` (what LeRobot's ALOHA datasets record as ``observation.images.top``), ``angle`` and
  ``vis`` (the scene's ``front_close``), the three gym-aloha renders; frames are 4:3 in gym-aloha
  (640 x 480), squeezed to ``env.image_size`` squares.
"""

from __future__ import annotations

from wamkit.embodiments import DriftPlan, Embodiment, SuiteProtocol

_ARM = ("waist", "shoulder", "elbow", "forearm_roll", "wrist_angle", "wrist_rotate", "gripper")
_NAMES = tuple(f"{side}_{j}" for side in ("left", "right") for j in _ARM)
_UNITS = ("rad",) * 6 + ("1",)

PROFILE = Embodiment(
    name="aloha",
    env_backend="wamkit.envs.aloha_env",
    suites={"aloha": 400},
    robot_type="aloha",
    fps=50,
    cameras={"top": "top", "angle": "angle", "vis": "front_close"},
    default_cameras=("top",),
    dataset_cameras=("top",),
    state_names=_NAMES,
    state_source="gym-aloha's qpos: six arm joints and the normalised gripper, left arm then right",
    axis_angle_dims=(),
    action_names=_NAMES,
    gripper="0 close, 1 open (gym-aloha's normalised gripper position), one per arm",
    # each episode's object poses come from its seed (gym-aloha's sample_box_pose(seed)); LeRobot's
    # evaluation renders gym-aloha's default look; 50 trials per task, as the ACT paper evaluates
    protocol=SuiteProtocol(render_quality="default", seed_rule="per_trial", trials=50),
    packages=("mujoco", "dm-control", "gym-aloha"),
    state_units=_UNITS * 2,
    action_units=_UNITS * 2,
    gripper_dims=(6, 13),
    gripper_open=1.0,
    gripper_close=0.0,
    absolute_actions=True,
    scripted_expert=True,
    camera_aspect=4 / 3,
    # both tasks' first two seeds in gym-aloha's look, then 10 steps of the scripted expert (the physics)
    drift=DriftPlan(
        cameras=("top",),
        looks=("default",),
        episodes={"aloha": (("transfer_cube", 0), ("insertion", 1))},
        expert_steps=10,
    ),
    # no request aliases: openpi's ALOHA client (examples/aloha_sim/env.py) sends nested keys
    # ({"state", "images": {"cam_high": CHW}}) that the flat OpenPI keys cannot name
)
