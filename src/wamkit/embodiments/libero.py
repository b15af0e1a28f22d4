"""LIBERO's Franka Panda, as openpi's LIBERO client evaluates it (docs/libero.md cites each choice).

- suites and their step limits: openpi's ``examples/libero/main.py`` (220 / 280 / 300 / 520 / 400);
- 50 trials per task from LIBERO's stored initial states, 10 settle steps of a no-op after each
  reset, seeds by openpi's rule (the task's env seeded once with 7, trials in order);
- cameras ``agentview`` and ``wrist`` (robosuite's ``robot0_eye_in_hand``); ``image`` and
  ``wrist_image`` are the names the published LeRobot LIBERO datasets use for the same two views;
- state [8]: eef position, eef orientation as robosuite's axis-angle, the two finger joints;
- action [7]: OSC_POSE deltas and the gripper at 20 Hz, gripper -1 open, +1 close.
"""

from __future__ import annotations

from wamkit.embodiments import DriftPlan, Embodiment, SuiteProtocol

SUITES = {"libero_spatial": 220, "libero_object": 280, "libero_goal": 300, "libero_10": 520, "libero_90": 400}
# the four suites of the published LIBERO training mix (libero_90 is not part of it)
TRAINING_SUITES = ("libero_spatial", "libero_object", "libero_goal", "libero_10")

PROFILE = Embodiment(
    name="libero",
    env_backend="wamkit.envs.libero_env",
    suites=SUITES,
    robot_type="panda",
    fps=20,
    cameras={
        "agentview": "agentview",
        "wrist": "robot0_eye_in_hand",
        "image": "agentview",
        "wrist_image": "robot0_eye_in_hand",
    },
    default_cameras=("agentview", "wrist"),
    dataset_cameras=("image", "wrist_image"),
    state_names=("eef_x", "eef_y", "eef_z", "eef_ax", "eef_ay", "eef_az", "finger_left", "finger_right"),
    state_source=(
        "robot0_eef_pos, robosuite's quat2axisangle(robot0_eef_quat) (xyzw, no antipodal flip), "
        "robot0_gripper_qpos"
    ),
    axis_angle_dims=(3, 4, 5),
    action_names=("dx", "dy", "dz", "rx", "ry", "rz", "gripper"),
    gripper="-1 open, +1 close (robosuite's gripper command)",
    protocol=SuiteProtocol(render_quality="default", seed_rule="openpi", trials=50),
    settle_steps=10,
    stored_initial_states=True,
    representation="libero_rot6d",
    training_suites=TRAINING_SUITES,
    cosmos3_domain="libero",
    cosmos3_view_point="concat_view",
    # cosmos' LIBERO dataset describes its concat_view layout (agent view left, wrist camera right) so
    cosmos3_view_description="The left half shows the third-person view; the right half shows the wrist-mounted camera.",
    packages=("mujoco", "robosuite", "libero"),
    bench_suite="libero_10",
    state_units=("m", "m", "m", "rad", "rad", "rad", "m", "m"),
    # robosuite's OSC_POSE (controllers/config/osc_pose.json): input [-1, 1] to 0.05 m and 0.5 rad
    action_units=("0.05 m", "0.05 m", "0.05 m", "0.5 rad", "0.5 rad", "0.5 rad", "command"),
    random_action_scale=0.3,  # OSC deltas over the full range fling the arm into its joint limits
    # openpi's LIBERO client (examples/libero/main.py:130-141): the agent view, the wrist view, the state
    request_images=("observation/image", "observation/wrist_image"),
    request_state="observation/state",
    # two tasks of each suite, the first's trial 0 and another's trial 2, after the settle steps
    drift=DriftPlan(
        cameras=("agentview", "wrist"),
        looks=("default",),
        episodes={
            "libero_spatial": (("0", 0), ("5", 2)),
            "libero_object": (("0", 0), ("6", 2)),
            "libero_goal": (("0", 0), ("3", 2)),
            "libero_10": (("0", 0), ("5", 2)),
            "libero_90": (("0", 0), ("40", 2)),
        },
    ),  # fmt: skip
)
