"""ManiSkill3's Panda tabletop tasks (mani-skill 3.0.1 on SAPIEN 3.0.3), the ones it ships motion-planning
solutions for.

- tasks: ``PickCube-v1``, ``StackCube-v1``, ``PegInsertionSide-v1``, ``PushCube-v1`` (and the other Panda
  tasks with a solution: ``PullCube-v1``, ``LiftPegUpright-v1``, ``PlugCharger-v1``);
- state [18]: the robot's joint positions then velocities (ManiSkill's ``obs["agent"]``: ``qpos`` and
  ``qvel``, seven arm joints and two fingers): the part of its state every task shares;
- action [7]: ManiSkill's ``pd_ee_delta_pose`` controller, normalised to [-1, 1]: the hand's translation
  in the robot's base frame (0.1 m a unit), its rotation as XYZ Euler angles in that frame (0.1 rad a
  unit), and the gripper (-1 close: the fingers' target -0.01 m; +1 open: 0.04 m);
- 20 Hz (ManiSkill's control frequency), each task's horizon that of ManiSkill's own diffusion-policy
  baselines (``examples/baselines/diffusion_policy/baselines.sh``: 100, 200, 300, 100 steps), success =
  the task's ``evaluate()["success"]``, each episode's placement drawn from its seed;
- cameras: ``base_camera``, each task's own sensor camera (128 px in ManiSkill's defaults).
"""

from __future__ import annotations

from wamkit.embodiments import Embodiment, SuiteProtocol

_JOINTS = (*(f"panda_joint{i}" for i in range(1, 8)), "panda_finger_joint1", "panda_finger_joint2")
_UNITS = ("rad",) * 7 + ("m", "m")

PROFILE = Embodiment(
    name="maniskill",
    env_backend="wamkit.envs.maniskill_env",
    suites={"maniskill": 300},
    robot_type="panda",
    fps=20,
    cameras={"base_camera": "base_camera"},
    default_cameras=("base_camera",),
    dataset_cameras=("base_camera",),
    state_names=(*_JOINTS, *(f"{j}_vel" for j in _JOINTS)),
    state_source="ManiSkill3's obs['agent']: the Panda's qpos then qvel (seven arm joints, two fingers)",
    axis_angle_dims=(),
    action_names=("dx", "dy", "dz", "drx", "dry", "drz", "gripper"),
    gripper="-1 close, +1 open (ManiSkill's normalised finger target, -0.01 to 0.04 m)",
    # each episode's placement comes from its seed (env.reset(seed=...)); ManiSkill's default shader
    protocol=SuiteProtocol(render_quality="default", seed_rule="per_trial", trials=50),
    packages=("mani-skill", "sapien", "mplib"),
    state_units=(*_UNITS, *(f"{u}/s" for u in _UNITS)),
    action_units=("0.1 m", "0.1 m", "0.1 m", "0.1 rad", "0.1 rad", "0.1 rad", "command"),
    gripper_open=1.0,
    gripper_close=-1.0,
    scripted_expert=True,  # ManiSkill3's motion-planning solutions, converted to pd_ee_delta_pose
    # no drift pins yet: they are taken in the checking process, which here is not ManiSkill's venv
)
