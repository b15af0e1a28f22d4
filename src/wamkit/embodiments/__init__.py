"""What one embodiment is, declared once: its simulator backend and suites, cameras, state and action
layouts, gripper convention, control rate and evaluation protocol (:class:`Embodiment`). One module
per embodiment (see ``_MODULES``), registered by name and imported when first asked for;
every other stage reads the profile instead of naming the embodiment.

This is the bottom layer: a profile imports nothing of wamkit, so ``data/`` (which cannot import
``envs/``) and the evaluator read the same facts the env backends do.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

_MODULES: dict[str, str] = {
    "libero": "wamkit.embodiments.libero",  # Franka Panda in LIBERO (robosuite 1.4), openpi's protocol
    "metaworld": "wamkit.embodiments.metaworld",  # Sawyer in MetaWorld v3, the default suite
    "libero_pro": "wamkit.embodiments.libero_pro",  # LIBERO's suites under perturbation (LIBERO-PRO)
    "aloha": "wamkit.embodiments.aloha",  # bimanual ViperX arms in gym-aloha (the ACT paper's tasks)
    "maniskill": "wamkit.embodiments.maniskill",  # Franka Panda in ManiSkill3 (SAPIEN), its own venv
}
_LOADED: dict[str, Embodiment] = {}


@dataclass(frozen=True)
class SuiteProtocol:
    """What a suite's evaluation protocol fixes, and so what ``auto`` config values resolve to: the
    render look, the seed rule and the trials per task."""

    render_quality: str
    seed_rule: str
    trials: int


@dataclass(frozen=True)
class DriftPlan:
    """The episode starts its drift pins fingerprint (``wamkit.envs.drift``): the cameras and looks
    they are rendered in, ``episodes``: suite -> ``((task, trial), ...)``, and how many steps of the
    scripted expert run after the reset before the state is pinned again (0: none)."""

    cameras: tuple[str, ...]
    looks: tuple[str, ...]
    episodes: dict[str, tuple[tuple[str, int], ...]]
    expert_steps: int = 0


@dataclass(frozen=True)
class Embodiment:
    """One embodiment's conventions, as data. ``suites``: the suites its env backend builds, with each
    one's ``max_steps`` (policy steps; settle steps excluded). ``cameras``: the camera names a config
    may use, to the simulator's own; ``default_cameras``: what ``wamkit collect`` records unless told
    otherwise. ``stored_initial_states``: episodes start from the suite's stored states, so a seed
    rule that seeds a task once (openpi's) can be honoured."""

    name: str
    env_backend: str  # the module under wamkit.envs that builds its envs
    suites: dict[str, int]  # suite -> max steps
    robot_type: str
    fps: int  # env steps per simulated second (what datasets record)
    cameras: dict[str, str]
    default_cameras: tuple[str, ...]
    state_names: tuple[str, ...]
    state_source: str
    axis_angle_dims: tuple[int, ...]  # state dims holding an axis-angle orientation
    action_names: tuple[str, ...]
    gripper: str  # what the last action dimension means
    protocol: SuiteProtocol
    settle_steps: int = 0  # no-op steps after a reset, before the policy's first
    stored_initial_states: bool = False
    representation: str = "raw"  # the action representation its models train in (wamkit.actions)
    training_suites: tuple[str, ...] = ()  # the suites a multi-suite training run mixes
    cosmos3_domain: str = ""  # Cosmos3's embodiment (domain) name, "" where it has none
    # the row of Cosmos3's action heads for a domain diffusers' table lacks (a model trained from
    # scratch); None: the table's row for ``cosmos3_domain``
    cosmos3_domain_id: int | None = None
    # the framing of a Cosmos3 action caption (diffusers' view points: concat_view for cameras side by
    # side, third_person_view for one fixed camera, ...), "" where it has none
    cosmos3_view_point: str = ""
    # the sentence of a Cosmos3 action caption saying which half of the side-by-side frame is which
    # camera (its view layout), "" where it has none
    cosmos3_view_description: str = ""
    random_action_scale: float = 1.0  # the share of the action range random actions use (benchmarks)
    # the request keys of its reference client (the OpenPI websocket protocol): one per camera, in the
    # order of the model's cameras, and the state's; a wamkit server takes them as aliases
    request_images: tuple[str, ...] = ()
    request_state: str = ""
    drift: DriftPlan | None = None  # what its drift pins hold (None: no pins)
    # the state dims that are the robot's own (env.state=proprio); None: the whole state is
    proprio_dims: tuple[int, ...] | None = None
    # the Python distributions of its simulator stack, whose versions a run records (a change can
    # change what an episode looks like)
    packages: tuple[str, ...] = ()
    bench_suite: str = ""  # the suite `wamkit bench env` measures unless told ("": none)
    # one unit per state dim ("m", "rad", "1" for a unitless number) and per action dim (what an
    # action of 1.0 means: "0.05 m" a delta of 5 cm; "command" for the gripper); () where not declared
    state_units: tuple[str, ...] = ()
    action_units: tuple[str, ...] = ()
    # the camera keys of its published datasets (LeRobot's ``observation.images.<key>``), in the
    # order of ``default_cameras``; () where it has none
    dataset_cameras: tuple[str, ...] = ()
    # the action dims that command a gripper; None: the last one
    gripper_dims: tuple[int, ...] | None = None
    # the gripper command values that open and close the fingers (what ``gripper`` says, as numbers)
    gripper_open: float = -1.0
    gripper_close: float = 1.0
    # the actions are absolute targets laid out as the state (joint positions): the action that holds the
    # robot where it is is its state (``hold_action``); False: normalised deltas, zero holds
    absolute_actions: bool = False
    # its env backend has a scripted expert (``Env.expert_action``), so ``wamkit collect`` can record it
    scripted_expert: bool = False
    # the camera images' width over height as the simulator frames them; a square ``env.image_size``
    # image is that frame resized (squeezed horizontally), so the whole view is kept
    camera_aspect: float = 1.0

    @property
    def state_dim(self) -> int:
        return len(self.state_names)

    def state_dims(self, state: str) -> tuple[int, ...]:
        """The dims of the full state that ``env.state`` keeps: all for ``full``, the robot's own for
        ``proprio``."""
        if state == "full" or self.proprio_dims is None:
            return tuple(range(self.state_dim))
        if state != "proprio":
            raise ValueError(f"env.state: {state!r} is not full or proprio")
        return self.proprio_dims

    def state_names_of(self, state: str) -> tuple[str, ...]:
        return tuple(self.state_names[i] for i in self.state_dims(state))

    @property
    def action_dim(self) -> int:
        return len(self.action_names)

    @property
    def grippers(self) -> tuple[int, ...]:
        """The action dims that command a gripper."""
        return self.gripper_dims if self.gripper_dims is not None else (self.action_dim - 1,)

    def hold_action(self, state=None):
        """The action that keeps the robot where it is, float64 [action_dim]: zeros for delta actions
        (grippers at their open value), the ``full`` state itself for absolute ones (``state`` needed)."""
        import numpy as np

        if not self.absolute_actions:
            out = np.zeros(self.action_dim)
            out[list(self.grippers)] = self.gripper_open
            return out
        if state is None:
            raise ValueError(f"{self.name}: the hold action of absolute actions is the state; none given")
        return np.asarray(state, np.float64)[: self.action_dim].copy()


def register(name: str, module: str) -> None:
    """Make ``name`` an embodiment whose profile is ``module``'s ``PROFILE`` (imported when asked for)."""
    _MODULES[name] = module
    _LOADED.pop(name, None)


def names() -> list[str]:
    return list(_MODULES)


def get(name: str) -> Embodiment:
    """The profile of embodiment ``name`` (``KeyError`` naming the known ones if there is none)."""
    if name not in _LOADED:
        if name not in _MODULES:
            raise KeyError(f"unknown embodiment {name!r} (known: {', '.join(_MODULES)})")
        _LOADED[name] = importlib.import_module(_MODULES[name]).PROFILE
    return _LOADED[name]


def suites() -> dict[str, Embodiment]:
    """Every registered suite, to the embodiment that runs it, in registration order."""
    return {s: e for e in map(get, _MODULES) for s in e.suites}


def for_suite(suite: str) -> Embodiment | None:
    """The embodiment of ``suite``, or None when no registered embodiment has it."""
    return suites().get(suite)


def for_cosmos3_domain(domain: str) -> Embodiment | None:
    """The embodiment whose profile names Cosmos3's ``domain`` (embodiment) as its own, or None."""
    return next((e for e in map(get, _MODULES) if domain and e.cosmos3_domain == domain), None)


def stack_packages() -> tuple[str, ...]:
    """Every registered embodiment's simulator packages, each once, in registration order."""
    return tuple(dict.fromkeys(p for e in map(get, _MODULES) for p in e.packages))


def request_aliases() -> list[tuple[tuple[str, ...], str]]:
    """Every registered embodiment's reference-client keys: ``(image keys in camera order, state
    key)``, in registration order, those without any left out."""
    out = []
    for e in map(get, _MODULES):
        keys = (e.request_images, e.request_state)
        if (e.request_images or e.request_state) and keys not in out:
            out.append(keys)
    return out
