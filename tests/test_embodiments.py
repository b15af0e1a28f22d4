"""One profile per embodiment (wamkit.embodiments): the facts the env backends, the suite registry
and the data stage read, declared once; a toy embodiment registered here (tests/toy_embodiment.py,
its profile and env backend) is built and resolved by the env layer with no other edit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from wamkit import embodiments
from wamkit.config import ConfigError, EnvConfig
from wamkit.constants import OBS_STATE
from wamkit.envs.base import EpisodeSpec
from wamkit.envs.suites import make_env, protocol, resolve_env_config, suite_info, suites


@pytest.fixture
def toy():
    from . import toy_embodiment

    embodiments.register("toy", toy_embodiment.__name__)
    yield toy_embodiment.PROFILE
    embodiments._MODULES.pop("toy")
    embodiments._LOADED.pop("toy", None)


def test_a_registered_embodiment_reaches_the_env_layer(toy):
    assert "toy_line" in suites() and embodiments.for_suite("toy_line") is toy
    assert suite_info("toy_line").max_steps == 12 and protocol("toy_line").trials == 3
    cfg = resolve_env_config(EnvConfig(suite="toy_line", cameras=["top"], image_size=16))
    assert (cfg.render_quality, cfg.seed_rule) == ("fast", "per_trial")  # its protocol's, resolved
    env = make_env(cfg)
    obs = env.reset(EpisodeSpec("toy_line", "reach", 0, 5))
    assert obs[OBS_STATE].shape == (toy.state_dim,)
    with pytest.raises(ConfigError, match="seeds a task once and relies on stored initial states"):
        resolve_env_config(EnvConfig(suite="toy_line", seed_rule="openpi"))


def test_its_reference_clients_keys_reach_the_server_and_the_openpi_backend(toy):
    import numpy as np

    from wamkit.actions.spec import PreprocessSpec
    from wamkit.constants import PROMPT, image_key
    from wamkit.envs.suites import suite_info as info
    from wamkit.eval.backends import openpi
    from wamkit.models.base import ModelIO
    from wamkit.serve.policy import RequestError, ServedPolicy

    io = ModelIO(cameras=("top",), image_size=8, state_dim=1, action_dim=1, chunk=2)

    class _NoModel:
        name, supports_rtc, module = "none", False, torch.nn.Module()  # no parameters: no autocast

    _NoModel.io = io
    spec = PreprocessSpec.identity(representation="raw", cameras=io.cameras, image_size=8, state_dim=1,
                                   action_dim=1, chunk=2)  # fmt: skip
    policy = ServedPolicy(_NoModel(), spec)
    frame = np.full((8, 8, 3), 5, np.uint8)
    req = policy.prepare({"toy/top_camera": frame, "toy/position": np.array([0.25]), PROMPT: "reach 1"})
    np.testing.assert_array_equal(req.batch[image_key("top")][0], frame)
    assert req.batch[OBS_STATE][0, 0] == 0.25
    assert policy.metadata()["inputs"]["openpi_keys"]["toy/top_camera"] == image_key("top")
    # openpi's LIBERO keys are still taken (every profile's keys are), each key once
    assert "observation/image" in policy.metadata()["inputs"]["openpi_keys"]
    with pytest.raises(RequestError, match="given twice"):
        policy.prepare({"toy/top_camera": frame, image_key("top"): frame, OBS_STATE: [0.0], PROMPT: "x"})

    keys = openpi.request_keys(info("toy_line"))
    assert keys == (("toy/top_camera",), "toy/position")
    sent = openpi.request(
        {image_key("top"): frame, OBS_STATE: np.array([0.5]), "task": "reach 1"}, ("top",), keys
    )
    assert sorted(sent) == ["prompt", "toy/position", "toy/top_camera"]


def test_after_it_is_gone_its_suite_is_refused_by_name():
    with pytest.raises(ConfigError, match="env.suite: unknown suite 'toy_line'"):
        suite_info("toy_line")


def test_each_profile_agrees_with_its_backend_and_each_list_exists_once():
    from wamkit.data import sft_dataset
    from wamkit.embodiments import libero, metaworld
    from wamkit.envs import libero_env, metaworld_env

    assert embodiments.names()[:2] == ["libero", "metaworld"]
    for prof, mod in ((libero.PROFILE, libero_env), (metaworld.PROFILE, metaworld_env)):
        assert (prof.state_dim, prof.action_dim, prof.fps) == (mod.STATE_DIM, mod.ACTION_DIM, mod.FPS)
        assert mod.PROTOCOL is prof.protocol and embodiments.get(prof.name) is prof
    assert (libero.PROFILE.state_dim, libero.PROFILE.action_dim) == (8, 7)  # LIBERO's published layout
    assert (metaworld.PROFILE.state_dim, metaworld.PROFILE.action_dim) == (39, 4)
    for prof in map(embodiments.get, embodiments.names()):  # a unit for every dim it names
        assert len(prof.state_units) == prof.state_dim and len(prof.action_units) == prof.action_dim, (
            prof.name
        )
    assert set(libero.TRAINING_SUITES) < set(libero.SUITES) and "libero_90" not in libero.TRAINING_SUITES
    assert not hasattr(sft_dataset, "LIBERO_SUITES")  # the data stage reads the profile's mix
    from wamkit.embodiments import libero_pro

    assert suites() == [*libero.SUITES, "metaworld", *libero_pro.SUITES, "aloha", "maniskill"]
    # LIBERO-PRO is LIBERO's robot and protocol on other suites: only what it declares apart differs
    same = ("state_names", "action_names", "cameras", "fps", "protocol", "settle_steps", "gripper")
    assert all(getattr(libero_pro.PROFILE, k) == getattr(libero.PROFILE, k) for k in same)
    assert not set(libero_pro.SUITES) & set(libero.SUITES)
    # the facts other projects define: Cosmos3's domain table (diffusers) and our representations
    from diffusers.pipelines.cosmos.pipeline_cosmos3_omni import _EMBODIMENT_TO_DOMAIN_ID

    from wamkit.actions.representations import names as representations
    from wamkit.models.cosmos3.presets import Cosmos3Options

    assert libero.PROFILE.cosmos3_domain in _EMBODIMENT_TO_DOMAIN_ID
    assert Cosmos3Options.domain_name == libero.PROFILE.cosmos3_domain
    assert {libero.PROFILE.representation, metaworld.PROFILE.representation} <= set(representations())
    with pytest.raises(KeyError, match="unknown embodiment 'koch'"):
        embodiments.get("koch")
    # ALOHA: gym-aloha's layout (constants.JOINTS: left arm, its gripper, right arm, its gripper)
    from gym_aloha.constants import JOINTS

    aloha = embodiments.get("aloha")
    assert [n.split("_arm_")[-1] for n in JOINTS] == [n.split("_", 1)[1] for n in aloha.state_names]
    assert aloha.grippers == (JOINTS.index("left_arm_gripper"), JOINTS.index("right_arm_gripper"))
    assert aloha.hold_action(np.arange(14.0)).tolist() == list(range(14))


def test_a_run_resolves_its_auto_env_settings_once_and_backends_take_them_resolved(monkeypatch, tmp_path):
    """run_eval resolves env.render_quality and env.seed_rule once, at its start (a ResolvedEnv); the
    stages below take that and resolve nothing again; the plan and an env backend refuse an unresolved
    config."""
    import importlib

    from wamkit.envs import metaworld_env
    from wamkit.eval import runner

    suites_mod = importlib.import_module("wamkit.envs.suites")

    calls = []
    real = suites_mod.resolve_env_config

    def spy(cfg):
        out = real(cfg)
        calls.append(out is not cfg)  # True: this call resolved something
        return out

    monkeypatch.setattr(suites_mod, "resolve_env_config", spy)
    from .eval_helpers import eval_config

    cfg = eval_config("ws://127.0.0.1:9", tmp_path / "out", "eval.server_timeout_s=0.2")
    assert (cfg.env.render_quality, cfg.env.seed_rule) == ("auto", "auto")

    def no_server(url, env_cfg, patience):
        raise ConnectionError(f"nothing listens at {url}")

    with pytest.raises(ConnectionError):  # the run stops at its first connection, after plan and journal
        runner.run_eval(cfg, progress=False, policy_factory=no_server)
    assert calls == [True], calls  # one resolution, at the run's start: the plan and journal take it

    from wamkit.eval.episodes import plan_episodes

    with pytest.raises(TypeError, match="plan_episodes takes an env config resolved"):
        plan_episodes(EnvConfig(suite="metaworld", tasks=["reach-v3"]), cfg.eval)

    with pytest.raises(ConfigError, match=r"MetaWorldEnv: env.render_quality, env.seed_rule still 'auto'"):
        metaworld_env.make(EnvConfig(suite="metaworld", tasks=["reach-v3"]))


def test_libero_is_named_in_at_most_six_files_outside_its_profiles_and_backends():
    """What LIBERO is lives in its profiles (embodiments/libero*.py) and env backends (envs/libero*, their
    drift pins included). Counted as a grep counts, prose, presets and data files included, the rest
    of the package names it in at most six files: the registry lines, the name of the representation
    its saved files keep, Cosmos3's recipe embodiment, the client of cosmos-framework's server (whose
    protocol and module names carry it) and the recipe's two presets. No stage names it otherwise."""
    from pathlib import Path

    import wamkit

    root = Path(wamkit.__file__).parent

    def own(p: Path) -> bool:
        return p.parent.name in ("embodiments", "envs") and p.name.startswith("libero")

    named = sorted(
        str(p.relative_to(root))
        for p in root.rglob("*")
        if p.is_file()
        and p.suffix in (".py", ".yaml", ".json", ".md", ".txt")
        and not own(p)
        and "libero" in p.read_text(errors="replace").lower()
    )
    assert len(named) <= 6, named
    stages = ("eval/", "serve/", "train/", "data/", "envs/", "check/", "bench/", "export/")
    assert [n for n in named if n.startswith(stages)] == ["eval/backends/cosmos_http.py"], named
