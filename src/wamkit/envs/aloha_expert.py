"""Scripted experts for ALOHA's two tasks, made the way the ACT paper made its scripted demonstrations.

Each arm follows a plan of keyframes in end-effector space (where its fingertips go, the gripper's
orientation and opening, at a step), laid out from the objects' poses. The plan is played in gym-aloha's
mocap-driven end-effector scene (``bimanual_viperx_end_effector_*.xml``: each gripper welded to a mocap
body, the fingers position-controlled), where MuJoCo's constraint solver does the inverse kinematics.
The joint positions that scene passes through, led by part of each joint's gravity sag in the
joint-space scene and with each gripper's joint replaced by its commanded opening (normalised as
gym-aloha's action space takes it), are the expert's joint targets: replayed in the joint-space scene,
they are what a dataset records as actions (row t: the joints after the end-effector scene has played
step t of the plan). The planning scene's welds are made stiffer than gym-aloha's (docs/aloha.md
lists where the expert departs from the paper's scripts, and why).

Keyframe times and offsets (approach 8 cm above an object, the hand-over and insertion meeting points,
the grippers' orientations) follow the ACT paper's scripted policies (arXiv 2304.13705, Section 5;
``scripted_policy.py`` of its repository); the code is wamkit's. Where the paper's scripts place the weld's
point, these place the fingertips, measured every step (docs/aloha.md says why).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from wamkit.actions.rotations import axis_angle_to_quat

# the gripper openings of a plan, in gym-aloha's normalised gripper position
OPEN, CLOSED = 1.0, 0.0
# steps after which the objects lie where they dropped (they start 3 cm above their resting height);
# the plans reach them far later
SETTLE_STEPS = 25
# the most the mocap is commanded away from where the fingertips should be (m): the weld's own offset
# from the fingertips is about 2 cm
MAX_SHIFT = 0.04
# steps the plans span (the suite's limit); the last keyframe holds after it
PLAN_STEPS = 400
# the end-effector scene's welds, stiffer than gym-aloha's (see joint_targets)
WELD_SOLIMP = (0.99, 0.999, 0.001)
WELD_SOLREF = (0.005, 1.0)
# the share of each arm joint's gravity sag in the joint-space scene that the recorded targets add back,
# and how far below the socket's axis the insertion aims the peg (m): replayed, the peg arrives above
# where the end-effector scene put it (5.8 +- 1.9 mm over the solved seeds 0-99 of a plan aimed on the
# axis; 10-19 mm for those that jammed against the socket's top wall). Insertion seeds solved of 100
# (seeds 0-99) as the two were chosen: share 0 / 0.5 / 0.6 with the drop 6 mm: 96 / 98 / 99,
# share 1.0 with 5 / 8 mm: 93 / 99; share 0.6 with no drop: 92. Full compensation overshoots as the wrists'
# weak servos (kp 10-50) also yield to the insertion's contacts
GRAVITY_SHARE = 0.6
PEG_DROP = 0.006
# the arms' six joints each: their degrees of freedom in both scenes, their columns in a 14-D action
ARM_DOFS = [0, 1, 2, 3, 4, 5, 8, 9, 10, 11, 12, 13]
ARM_COLUMNS = [0, 1, 2, 3, 4, 5, 7, 8, 9, 10, 11, 12]


def _rot(axis: tuple[float, float, float], degrees: float) -> np.ndarray:
    """A mocap orientation, (w, x, y, z), turned ``degrees`` about ``axis`` from the starting one (the
    starting mocap orientations are the identity, so this is the orientation itself)."""
    return axis_angle_to_quat(np.asarray(axis, np.float64) * np.deg2rad(degrees), order="wxyz")


LEVEL = np.array([1.0, 0.0, 0.0, 0.0])
PITCH_DOWN_RIGHT = _rot((0, 1, 0), -60)  # the right gripper tilted 60 degrees down towards the table
PITCH_DOWN_LEFT = _rot((0, 1, 0), 60)
ROLL_LEFT = _rot((1, 0, 0), 90)  # the left gripper's fingers vertical, to take the cube held flat


@dataclass(frozen=True)
class Key:
    """One keyframe of an arm's plan: at step ``t`` the mocap is at ``xyz`` (m, world) turned to
    ``quat`` (w, x, y, z), the gripper commanded to ``grip`` (0 closed, 1 open)."""

    t: int
    xyz: np.ndarray
    quat: np.ndarray
    grip: float
    anchor: str = ""
    moves: str = "tip"  # what ``xyz`` places: the fingertips, or an object held in the gripper


def _at(keys: list[Key], t: float, anchors: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray, float]:
    """The plan's fingertip target, orientation and gripper at step ``t``: eased between keyframes
    (smoothstep, so each move starts and stops at rest; the orientation normalised), the last keyframe
    held after it. A keyframe's ``xyz`` is an offset from its
    ``anchor``'s position in ``anchors`` (an object where it is now), or from the world's origin."""

    def where(k: Key) -> np.ndarray:
        if not k.anchor:
            return k.xyz
        return k.xyz + anchors[k.anchor]

    for a, b in zip(keys, keys[1:]):
        if t < b.t:
            f = (t - a.t) / (b.t - a.t)
            f = f * f * (3.0 - 2.0 * f)
            q = a.quat + (b.quat - a.quat) * f
            pa, pb = where(a), where(b)
            return pa + (pb - pa) * f, q / np.linalg.norm(q), a.grip + (b.grip - a.grip) * f
    last = keys[-1]
    return where(last), last.quat, last.grip


# where the left fingertips take the cube from the right gripper, from the cube's centre (m)
HANDOVER = np.array([-0.005, 0.0, 0.0])


def transfer_cube_plan() -> dict[str, list[Key]]:
    """The right arm picks the cube up and holds it at the hand-over point; the left arm takes it there
    and carries it away. Anchors: ``cube0`` (where the cube came to rest), ``cube`` (where it is now),
    ``left0`` / ``right0`` (where each arm's fingertips started)."""
    meet = np.array([0.0, 0.5, 0.25])
    z = np.zeros(3)
    right = [
        Key(0, z, LEVEL, CLOSED, "right0"),
        Key(90, np.array([0.0, 0.0, 0.08]), PITCH_DOWN_RIGHT, OPEN, "cube0"),  # above the cube
        Key(130, np.array([0.0, 0.0, -0.005]), PITCH_DOWN_RIGHT, OPEN, "cube0"),  # fingertips around it
        Key(170, np.array([0.0, 0.0, -0.005]), PITCH_DOWN_RIGHT, CLOSED, "cube0"),  # grasp
        Key(215, meet + np.array([0.05, 0.0, 0.0]), PITCH_DOWN_RIGHT, CLOSED),  # lift towards the left arm
        Key(235, meet, PITCH_DOWN_RIGHT, CLOSED),
        Key(310, meet, PITCH_DOWN_RIGHT, OPEN),  # let go as the left gripper closes
        Key(360, meet + np.array([0.1, 0.0, 0.0]), PITCH_DOWN_RIGHT, OPEN),  # back off
        Key(PLAN_STEPS, meet + np.array([0.1, 0.0, 0.0]), PITCH_DOWN_RIGHT, OPEN),
    ]
    left = [
        Key(0, z, LEVEL, CLOSED, "left0"),
        Key(100, meet + np.array([-0.1, 0.0, 0.0]), ROLL_LEFT, OPEN),  # wait beside the hand-over point
        Key(235, meet + np.array([-0.1, 0.0, 0.0]), ROLL_LEFT, OPEN),  # until the cube is there
        Key(260, HANDOVER, ROLL_LEFT, OPEN, "cube"),  # fingertips at the held cube, following it
        Key(310, HANDOVER, ROLL_LEFT, CLOSED, "cube"),  # grasp
        Key(360, meet + np.array([-0.1, 0.0, -0.02]), LEVEL, CLOSED),  # carry it away
        Key(PLAN_STEPS, meet + np.array([-0.1, 0.0, -0.02]), LEVEL, CLOSED),
    ]
    return {"left": left, "right": right}


def insertion_plan() -> dict[str, list[Key]]:
    """The right arm picks up the peg, the left the socket; both lift them to face each other above the
    table's middle, and the right pushes the peg along the socket's axis until it touches the pin
    inside. Anchors as :func:`transfer_cube_plan`'s, with ``peg0`` / ``socket0`` and, for the push, a
    keyframe that places the peg (``moves="peg"``) relative to the ``socket`` where it is now."""
    meet = np.array([0.0, 0.5, 0.15])
    z = np.zeros(3)
    up = np.array([0.0, 0.0, 0.08])
    # the fingertips' height at the grasp, from the object's centre: the peg is 2 cm thick and lies on
    # the table, so lower fingertips would press into the table and jam the closing fingers
    peg_down, socket_down = np.array([0.0, 0.0, 0.01]), np.array([0.0, 0.0, -0.005])

    def pick(side: str, obj: str, quat: np.ndarray, sign: float, down: np.ndarray) -> list[Key]:
        return [
            Key(0, z, LEVEL, CLOSED, f"{side}0"),
            Key(120, up, quat, OPEN, obj),  # above the object
            Key(170, down, quat, OPEN, obj),  # fingertips around it
            Key(220, down, quat, CLOSED, obj),  # grasp
            Key(285, meet + np.array([0.12 * sign, 0.0, 0.0]), quat, CLOSED),  # lift to face the other
        ]

    # the peg's centre on the socket's axis: 16 cm from the socket's centre is just outside it (each is
    # 12 cm long); 9 cm is past where the peg's end meets the pin (10 cm), so the push ends in contact.
    # PEG_DROP below the axis: replayed in the joint-space scene the peg arrives higher than planned
    entry, pushed = np.array([0.16, 0.0, -PEG_DROP]), np.array([0.09, 0.0, -PEG_DROP])
    right = pick("right", "peg0", PITCH_DOWN_RIGHT, +1.0, peg_down) + [
        Key(310, entry, PITCH_DOWN_RIGHT, CLOSED, "socket", moves="peg"),
        Key(370, pushed, PITCH_DOWN_RIGHT, CLOSED, "socket", moves="peg"),
        Key(PLAN_STEPS, pushed, PITCH_DOWN_RIGHT, CLOSED, "socket", moves="peg"),
    ]
    left = pick("left", "socket0", PITCH_DOWN_LEFT, -1.0, socket_down) + [
        Key(PLAN_STEPS, meet + np.array([-0.12, 0.0, 0.0]), PITCH_DOWN_LEFT, CLOSED),
    ]
    return {"left": left, "right": right}


PLANS = {"transfer_cube": transfer_cube_plan, "insertion": insertion_plan}
# the free bodies of each task's scene, in qpos order after the arms' 16 joints
OBJECTS = {"transfer_cube": ("cube",), "insertion": ("peg", "socket")}


class _Fingertips:
    """Where each gripper's fingertips are, in world coordinates: a point fixed to the gripper's body,
    found at the start as the middle of the far ends of its two finger meshes (the tenth of each mesh's
    vertices farthest from the gripper's base). The fingers open and close symmetrically, so the middle
    stays put; a point fixed to the gripper does not follow a finger pushed aside by what it holds
    (servoing that motion shakes a held cube loose)."""

    def __init__(self, physics) -> None:
        import mujoco

        self.m, self.d = physics.model.ptr, physics.data.ptr
        self.points: dict[str, tuple[int, np.ndarray]] = {}  # per side: the gripper's body, the point in it
        for side in ("left", "right"):
            base = self.d.xpos[
                mujoco.mj_name2id(self.m, mujoco.mjtObj.mjOBJ_BODY, f"vx300s_{side}/gripper_link")
            ]
            out = []
            for finger in ("left", "right"):
                g = mujoco.mj_name2id(
                    self.m, mujoco.mjtObj.mjOBJ_GEOM, f"vx300s_{side}/10_{finger}_gripper_finger"
                )
                mesh = self.m.geom_dataid[g]
                local = self.m.mesh_vert[
                    self.m.mesh_vertadr[mesh] : self.m.mesh_vertadr[mesh] + self.m.mesh_vertnum[mesh]
                ]
                far = np.linalg.norm(self._world(g, local) - base, axis=1)
                out.append((g, local[far >= np.quantile(far, 0.9)].astype(np.float64)))
            middle = np.mean([self._world(g, v).mean(axis=0) for g, v in out], axis=0)
            body = mujoco.mj_name2id(self.m, mujoco.mjtObj.mjOBJ_BODY, f"vx300s_{side}/gripper_link")
            turn = self.d.xmat[body].reshape(3, 3)
            self.points[side] = (body, turn.T @ (middle - self.d.xpos[body]))

    def _world(self, g: int, local: np.ndarray) -> np.ndarray:
        return self.d.geom_xpos[g] + local @ self.d.geom_xmat[g].reshape(3, 3).T

    def __call__(self, side: str) -> np.ndarray:
        body, point = self.points[side]
        return self.d.xpos[body] + self.d.xmat[body].reshape(3, 3) @ point


def joint_targets(
    task: str, objects: np.ndarray, steps: int = PLAN_STEPS, trace: list | None = None
) -> np.ndarray:
    """The expert's joint targets for an episode whose objects start at ``objects`` (the free bodies'
    qpos: the cube's 7 numbers, or the peg's then the socket's): float64 [steps, 14], row t the action
    of step t (gym-aloha's joint-space action layout). Returns also when the plan fails; the replay
    in the joint-space scene decides success. ``trace``: a list that gets, per step, the end-effector
    scene's reward and each arm's fingertip error (m)."""
    from dm_control.rl import control
    from gym_aloha.constants import DT, normalize_puppet_gripper_position
    from gym_aloha.tasks.sim_end_effector import BimanualViperXEndEffectorTask

    from wamkit.envs.aloha_env import end_effector_scene

    if task not in PLANS:
        raise ValueError(f"aloha: no scripted expert for task {task!r} (valid: {', '.join(PLANS)})")
    physics, task_obj = end_effector_scene(task, objects)
    # gym-aloha's welds (solref 0.01, solimp 0.25) let a gripper sag under MuJoCo 3: one pitched 60
    # degrees down hangs about 19 degrees short. Stiffer welds make the scene a faithful inverse
    # kinematics of the planned poses (the scene only plans; the joint-space scene is untouched)
    physics.model.eq_solimp[:, :3] = WELD_SOLIMP
    physics.model.eq_solref[:] = WELD_SOLREF
    gain = _position_gains(task)
    env = control.Environment(physics, task_obj, float("inf"), control_timestep=DT, flat_observation=False)
    env.reset()
    tips = _Fingertips(physics)
    qpos = physics.data.qpos

    def objects_now() -> dict[str, np.ndarray]:
        return {name: qpos[16 + 7 * i : 19 + 7 * i].copy() for i, name in enumerate(OBJECTS[task])}

    anchors = {f"{n}0": p for n, p in objects_now().items()}
    anchors.update(left0=tips("left"), right0=tips("right"))
    plan = PLANS[task]()
    out = np.empty((steps, 14))
    for t in range(steps):
        now = objects_now()
        anchors.update(now)
        if t < SETTLE_STEPS:  # the objects start above the table and drop onto it
            anchors.update({f"{n}0": p for n, p in now.items()})
        ee, errors = [], []
        for i, side in enumerate(("left", "right")):
            goal, quat, grip = _at(plan[side], t, anchors)
            key = _current(plan[side], t)
            tip = tips(side)
            if key.moves != "tip":  # the keyframes place an object held in this gripper
                goal = goal - (anchors[key.moves] - tip)
            # servo the fingertips, not the weld's point: the mocap goes where the fingertips should be,
            # shifted by how far the weld's point now sits from them (at most MAX_SHIFT, so an arm that
            # is held back does not wind the weld up)
            shift = physics.data.mocap_pos[i] - tip
            shift *= min(1.0, MAX_SHIFT / max(float(np.linalg.norm(shift)), 1e-9))
            mocap = goal + shift
            errors.append(float(np.linalg.norm(goal - tip)))
            ee.append(np.concatenate([mocap, quat, [grip]]))
        try:
            ts = env.step(np.concatenate(ee))
        except control.PhysicsError:  # the plan drove the scene to diverge: hold the last targets
            out[t:] = out[t - 1] if t else BimanualViperXEndEffectorTask.get_qpos(physics)
            break
        if trace is not None:
            trace.append((ts.reward, *errors))
        q = BimanualViperXEndEffectorTask.get_qpos(physics)
        # the joint-space scene holds each joint with a position servo of gain kp, which sags by the
        # gravity torque over kp (the wrists' gains are 10-50): the target leads the pose by part of it
        q[ARM_COLUMNS] += GRAVITY_SHARE * physics.data.qfrc_bias[ARM_DOFS] / gain[ARM_DOFS]
        ctrl = physics.data.ctrl
        q[6] = normalize_puppet_gripper_position(ctrl[0])  # the commanded opening, not the fingers'
        q[13] = normalize_puppet_gripper_position(ctrl[2])
        out[t] = q
    return out


def _position_gains(task: str) -> np.ndarray:
    """The joint-space scene's position-servo gain (kp) per degree of freedom of the arms (16): each
    actuator drives one joint, in the joints' order."""
    from wamkit.envs.aloha_env import joint_scene

    physics, _ = joint_scene(task)
    m = physics.model
    try:
        gains = np.zeros(16)
        for a in range(m.nu):
            gains[m.jnt_dofadr[m.actuator_trnid[a][0]]] = m.actuator_gainprm[a][0]
    finally:
        physics.free()
    return gains


def _current(keys: list[Key], t: int) -> Key:
    """The keyframe a step heads to (the last after the plan's end)."""
    return next((k for k in keys if t < k.t), keys[-1])
