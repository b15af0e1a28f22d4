"""MetaWorld v3's Sawyer (the default suite): 50 tasks, each with a scripted expert.

- state [39]: MetaWorld's full observation: hand xyz, gripper opening, two objects' pose, the same 18
  numbers of the previous step, the goal; ``env.state=proprio`` keeps the first 4 (the robot's own);
- action [4]: ``[dx, dy, dz, gripper]`` in [-1, 1] (1 cm of mocap motion per unit), gripper -1 open,
  +1 close (MetaWorld's grab effort);
- 80 Hz (frame_skip 5 x 2.5 ms), 500 steps, each trial's placement drawn from its seed.
"""

from __future__ import annotations

from wamkit.embodiments import DriftPlan, Embodiment, SuiteProtocol

_OBJ = ("x", "y", "z", "qx", "qy", "qz", "qw")
_OBJ_UNITS = ("m", "m", "m", "1", "1", "1", "1")
_NOW_UNITS = ("m", "m", "m", "1", *_OBJ_UNITS, *_OBJ_UNITS)
_NOW = ("hand_x", "hand_y", "hand_z", "gripper", *(f"obj1_{n}" for n in _OBJ), *(f"obj2_{n}" for n in _OBJ))

PROFILE = Embodiment(
    name="metaworld",
    env_backend="wamkit.envs.metaworld_env",
    suites={"metaworld": 500},
    robot_type="sawyer",
    fps=80,
    cameras={
        c: c for c in ("corner", "corner2", "corner3", "corner4", "topview", "behindGripper", "gripperPOV")
    },
    default_cameras=("corner",),
    state_names=(*_NOW, *(f"prev_{n}" for n in _NOW), "goal_x", "goal_y", "goal_z"),
    state_source="MetaWorld's full 39-D observation (goal observable)",
    axis_angle_dims=(),
    action_names=("dx", "dy", "dz", "gripper"),
    gripper="-1 open, +1 close (MetaWorld's grab effort)",
    # the placement comes from the episode's seed, so each trial is seeded; the fast look is what
    # `wamkit collect` records by default (a model is evaluated on the look it was trained on)
    protocol=SuiteProtocol(render_quality="fast", seed_rule="per_trial", trials=10),
    # Cosmos3 has no MetaWorld domain: a model trained from scratch takes a row of its action heads that
    # diffusers' table leaves unused (_EMBODIMENT_TO_DOMAIN_ID, pipeline_cosmos3_omni.py:227-245 in
    # 0.42.1: ids 0-20 of the 32 rows), and one fixed camera is a third-person view
    cosmos3_domain="metaworld",
    cosmos3_domain_id=31,
    cosmos3_view_point="third_person_view",
    packages=("mujoco", "metaworld"),
    bench_suite="metaworld",
    scripted_expert=True,  # metaworld.policies: one per task
    # the gripper: the pads' distance normalised to [0, 1]; quaternions are unitless
    state_units=(*_NOW_UNITS, *_NOW_UNITS, "m", "m", "m"),
    action_units=("0.01 m", "0.01 m", "0.01 m", "command"),  # SawyerXYZEnv.action_scale = 1/100
    # hand xyz and the gripper opening (metaworld/envs/sawyer_xyz_env.py: _get_curr_obs_combined_no_goal)
    proprio_dims=(0, 1, 2, 3),
    # openpi has no MetaWorld client: the names its robosuite client uses, for the one camera and the state
    request_images=("observation/image",),
    request_state="observation/state",
    # three tasks in both looks, then 10 steps of the scripted expert (the physics)
    drift=DriftPlan(
        cameras=("corner",),
        looks=("fast", "default"),
        episodes={"metaworld": (("reach-v3", 0), ("pick-place-v3", 1), ("door-open-v3", 2))},
        expert_steps=10,
    ),
)
