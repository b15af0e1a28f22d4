"""LeRobot's ACT and Diffusion Policy through wamkit's adapter, checked against LeRobot 0.6.1's own code.

These run in .venv-lerobot (``make setup-lerobot``; ``make test`` runs them there): LeRobot needs Python
3.12 and torch < 2.12. The LeRobot side of every comparison is LeRobot's function: the env-frame
conversion (``lerobot.envs.utils.preprocess_observation``), the policy's ``forward`` and
``predict_action_chunk``, ``from_pretrained`` and the processor pipelines loaded from the folder.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

lerobot = pytest.importorskip("lerobot")  # tests/conftest.py leaves this file out where it is missing

from lerobot.envs.utils import preprocess_observation  # noqa: E402
from lerobot.policies.factory import get_policy_class, make_pre_post_processors  # noqa: E402

from tests.child_env import child_env, start_logged, wait_for_log  # noqa: E402
from tests.test_train_support import killed_and_resumed  # noqa: E402
from wamkit.actions.spec import PreprocessSpec  # noqa: E402
from wamkit.config import ConfigError, ModelConfig  # noqa: E402
from wamkit.models import build_model  # noqa: E402
from wamkit.models.base import ModelIO  # noqa: E402
from wamkit.models.pretrained import load_pretrained  # noqa: E402
from wamkit.train.metrics import read_losses  # noqa: E402

IO = ModelIO(cameras=("corner", "wrist"), image_size=64, state_dim=5, action_dim=4, chunk=16)
SMALL = {
    "act": {"dim_model": 64, "dim_feedforward": 128, "n_encoder_layers": 2, "n_vae_encoder_layers": 1},
    "diffusion": {"down_dims": [32, 64], "num_inference_steps": 6, "crop_shape": [56, 56], "diffusion_step_embed_dim": 32},
}  # fmt: skip


def _build(policy: str, **options) -> object:
    return build_model(ModelConfig(name="lerobot", preset=policy, options={**SMALL[policy], **options}), IO)


def _batch(b: int = 3, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {
        **{
            f"observation.images.{c}": rng.integers(0, 256, (b, 64, 64, 3), dtype=np.uint8)
            for c in IO.cameras
        },
        "observation.state": rng.standard_normal((b, IO.state_dim)).astype(np.float32),
        "action": rng.standard_normal((b, IO.chunk, IO.action_dim)).astype(np.float32),
        "action_is_pad": np.arange(IO.chunk)[None].repeat(b, 0) >= np.array([16, 11, 5])[:b, None],
        "task": ["reach"] * b,
    }


def _theirs(adapter, batch: dict) -> dict:
    """The batch as LeRobot makes it: its env conversion, then its own normaliser with ImageNet's
    statistics on the cameras (lerobot-train's default; the state here is normalised already, so the
    pipeline has no statistics for it and passes it through), and Diffusion's history axis."""
    from lerobot.utils.constants import IMAGENET_STATS

    obs = preprocess_observation(
        {
            "pixels": {c: batch[f"observation.images.{c}"] for c in IO.cameras},
            "agent_pos": batch["observation.state"],
        }
    )
    stats = {
        f"observation.images.{c}": {k: torch.tensor(v) for k, v in IMAGENET_STATS.items()} for c in IO.cameras
    }
    pre, _ = make_pre_post_processors(adapter.config, dataset_stats=stats)
    done = pre(obs)
    obs = {k: done[k] for k in obs}
    assert torch.equal(obs["observation.state"], torch.from_numpy(batch["observation.state"]))
    if adapter.policy_type == "diffusion":
        obs = {k: v.unsqueeze(1) if k == "observation.state" else v for k, v in obs.items()}
    return obs


@pytest.mark.parametrize("policy", ["act", "diffusion"])
def test_the_loss_is_the_policys_forward_loss_bit_for_bit(policy):
    adapter = _build(policy)
    batch = _batch()
    adapter.module.train()
    torch.manual_seed(11)
    mine = adapter.sft_loss({**batch, "action": torch.from_numpy(batch["action"])})
    theirs_batch = {
        **_theirs(adapter, batch),
        "action": torch.from_numpy(batch["action"]),
        "action_is_pad": torch.from_numpy(batch["action_is_pad"]),
    }
    torch.manual_seed(11)
    loss, info = adapter.module.forward(theirs_batch)
    assert torch.equal(mine["loss"], loss)
    if policy == "act":  # the terms beside it, as LeRobot logs them
        assert float(mine["l1_loss"]) == pytest.approx(info["l1_loss"], rel=1e-6)
        assert float(mine["kld_loss"]) == pytest.approx(info["kld_loss"], rel=1e-6)
    if policy == "diffusion":  # LeRobot's Diffusion Policy keeps padded steps in its loss by default
        assert adapter.config.do_mask_loss_for_padding is False
        return
    # ACT leaves padded steps out of the loss: changing their targets changes nothing
    changed = batch["action"].copy()
    changed[batch["action_is_pad"]] += 5.0
    torch.manual_seed(11)
    again = adapter.sft_loss({**batch, "action": torch.from_numpy(changed)})
    assert torch.equal(again["loss"], mine["loss"])


@pytest.mark.parametrize("policy", ["act", "diffusion"])
def test_actions_are_lerobots_inference_path_bit_for_bit(policy):
    adapter = _build(policy)
    batch = _batch()
    torch.manual_seed(5)
    mine = adapter.predict(batch)["actions"]
    adapter.module.eval()  # as lerobot-eval runs it (predict leaves the module's mode as it found it)
    adapter.module.reset()
    obs = _theirs(adapter, batch)
    torch.manual_seed(5)
    theirs = adapter.module.predict_action_chunk(obs).numpy()
    n = adapter.config.n_action_steps
    assert mine.shape == (3, IO.chunk, IO.action_dim) and theirs.shape == (3, n, IO.action_dim)
    assert np.array_equal(mine[:, :n], theirs)


def test_a_diffusion_rows_seeded_actions_depend_on_its_own_seed_alone():
    adapter = _build("diffusion")
    batch = _batch()
    both = adapter.predict(batch, seed=[7, 8, 9])["actions"]
    alone = adapter.predict({k: v[1:2] for k, v in batch.items()}, seed=[8])["actions"]
    # the same noise (row 1's generators); the network's sums over a batch of 3 against 1 may round
    # otherwise in float32: a few ulps of each action, through 6 denoising steps
    np.testing.assert_allclose(both[1:2], alone, rtol=1e-5, atol=1e-5)
    assert np.array_equal(adapter.predict(batch, seed=7)["actions"], both)  # an int s seeds row i with s + i
    same = {k: v[[0, 0]] if k != "task" else ["reach", "reach"] for k, v in batch.items()}
    two = adapter.predict(same, seed=[3, 4])["actions"]
    assert np.abs(two[0] - two[1]).max() > 1e-2  # one observation, two seeds: two samples


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"dim_modle": 64},
            "unknown key 'model.options.dim_modle'; did you mean 'model.options.dim_model'? (valid here: ",
        ),
        ({"dim_model": "wide"}, "model.options.dim_model: expected an integer, got 'wide'"),
        ({"chunk_size": 20}, "model.options.chunk_size: 20, but the data's action chunk (data.chunk) is 16"),
        ({"input_features": {}}, "model.options.input_features: set by wamkit from the data and the run"),
        ({"optimizer_lr": 1e-4}, "model.options.optimizer_lr: the optimizer is wamkit's: train.lr"),
        ({"temporal_ensemble_coeff": 0.01}, "ensembling is the evaluator's: eval.chunk_blend=ensemble"),
        # valid for LeRobot's config, refused by torchvision's ResNet-18 when the policy is built
        (
            {"replace_final_stride_with_dilation": 1},
            "model.options: LeRobot's act policy cannot be built: NotImplementedError: Dilation > 1 not "
            "supported in BasicBlock (its options: {",
        ),
    ],
)
def test_bad_options_are_refused_naming_the_field(options, message):
    with pytest.raises(ConfigError) as err:
        _build("act", **options)
    assert message in str(err.value)


def test_an_unknown_policy_and_observation_history_are_refused():
    with pytest.raises(
        ConfigError, match=r"model.preset: 'actt' is not a LeRobot policy .*did you mean 'act'"
    ):
        build_model(ModelConfig(name="lerobot", preset="actt"), IO)
    with pytest.raises(ConfigError, match="model.options.n_obs_steps: 2; .* the current observation only"):
        _build("diffusion", n_obs_steps=2)


def _raw_state(spec: PreprocessSpec, rng: np.random.Generator, b: int = 2) -> np.ndarray:
    """``b`` raw states drawn uniformly inside the spec's min/max statistics."""
    s = spec.stats["observation.state"]
    lo, hi = np.asarray(s.min), np.asarray(s.max)
    return (lo + rng.random((b, len(lo))) * (hi - lo)).astype(np.float32)


def _spec(kind: str, seed: int = 0) -> PreprocessSpec:
    """A spec of ``kind`` normalisation over made-up statistics of IO's state and actions."""
    from wamkit.actions.stats import FeatureStats, StatsFile

    rng = np.random.default_rng(seed)

    def feature(dim: int) -> FeatureStats:
        mean = rng.normal(0, 2, dim)
        std = rng.uniform(0.2, 3, dim)
        lo, hi = mean - 2.5 * std, mean + 2.5 * std
        return FeatureStats(
            list(mean), list(std), list(lo), list(hi), list(lo + 0.3 * std), list(hi - 0.3 * std), 100
        )

    stats = StatsFile(
        {"action": feature(IO.action_dim), "observation.state": feature(IO.state_dim)},
        {"representation": "raw", "chunk": IO.chunk, "action_dim": IO.action_dim, "gripper": "env"},
    )
    return PreprocessSpec.create(stats, normalization=kind, clip=False, image_size=64, resize="bilinear_antialias",
                                 cameras=IO.cameras, chunk=IO.chunk)  # fmt: skip


@pytest.mark.parametrize(
    ("policy", "kind"), [("act", "mean_std"), ("act", "min_max"), ("diffusion", "quantile")]
)
def test_an_exported_folder_gives_wamkits_actions_in_lerobots_pipeline_and_served_as_it_is(
    tmp_path, policy, kind
):
    """``export_extra`` (``wamkit convert --to extra``) for each normalisation kind: LeRobot's
    ``from_pretrained`` and processors turn a raw observation into the env actions of wamkit's path
    (spec, adapter, decode); the folder served as it is (its processors run) with per-row seeds gives
    LeRobot's pipeline's actions."""
    from wamkit.models.lerobot.adapter import LeRobotAdapter

    adapter, spec = _build(policy), _spec(kind)
    adapter.export_extra(tmp_path / "folder", spec=spec)
    rng = np.random.default_rng(1)
    state = _raw_state(spec, rng)
    images = {c: rng.integers(0, 256, (2, 64, 64, 3), dtype=np.uint8) for c in IO.cameras}
    raw = {**{f"observation.images.{c}": v for c, v in images.items()}, "task": ["x", "x"]}
    torch.manual_seed(2)
    mine = spec.decode_actions(
        adapter.predict({**raw, "observation.state": spec.encode_state(state)})["actions"]
    )

    policy_cls = get_policy_class(policy)
    loaded = policy_cls.from_pretrained(str(tmp_path / "folder"))
    loaded.eval()
    pre, post = make_pre_post_processors(loaded.config, pretrained_path=str(tmp_path / "folder"))
    obs = pre(preprocess_observation({"pixels": images, "agent_pos": state}))
    normalised = spec.encode_state(state)
    # the state, normalised by the two: float64 then float32 against float32 throughout (MEAN_STD's
    # divisor std + 1e-8 against max(std, 1e-8), 1e-8 / std < 1e-7 here): a few float32 ulps
    np.testing.assert_allclose(obs["observation.state"].numpy(), normalised, rtol=1e-6, atol=1e-6)
    obs = {k: obs[k] for k in ("observation.state", *[f"observation.images.{c}" for c in IO.cameras])}
    if policy == "diffusion":
        obs["observation.state"] = obs["observation.state"].unsqueeze(1)
    torch.manual_seed(2)
    theirs = post(loaded.predict_action_chunk(obs)).numpy()
    n = loaded.config.n_action_steps
    # the same network on inputs that differ by those ulps, its output unnormalised by each side's map:
    # within 1e-4 of each action dimension's range
    scale = np.asarray(spec.stats["action"].max) - np.asarray(spec.stats["action"].min)
    np.testing.assert_allclose(mine[:, :n], theirs, rtol=0, atol=float(scale.max()) * 1e-4)

    served = LeRobotAdapter.from_folder(tmp_path / "folder")
    seeded = served.predict({**raw, "observation.state": state}, seed=[5, 6])["actions"]
    again = served.predict({k: v[1:] for k, v in {**raw, "observation.state": state}.items()}, seed=[6])[
        "actions"
    ]
    assert seeded.shape == (2, IO.chunk, IO.action_dim)
    np.testing.assert_allclose(seeded[1:], again, rtol=1e-5, atol=1e-5 * float(scale.max()))
    if policy == "act":  # deterministic: LeRobot's pipeline, in this process, on the same tensors
        assert np.array_equal(seeded[:, :n], theirs)


def _train(run: Path, root: Path, *extra: str, policy: str = "act") -> list[str]:
    options = [f"model.options.{k}={v}" for k, v in SMALL[policy].items()]
    return [
        sys.executable, "-m", "wamkit", "train", f"data.root={root}", "data.num_workers=1", "model.name=lerobot",
        f"model.preset={policy}", *options,
        "train.max_steps=10", "train.micro_batch=2", "train.global_batch=4", "train.save_interval=5",
        "train.log_interval=1", "train.warmup_steps=2", "train.lr=1e-4", "train.ema=true",
        f"train.run_dir={run}", *extra,
    ]  # fmt: skip


def _killed_resumes_exactly(tmp_path: Path, root: Path, policy: str) -> Path:
    """``wamkit train`` as a user types it, twice at once: one run uninterrupted, one SIGKILLed after
    its first checkpoint and resumed with ``--resume auto``; both log the same losses, and the loss
    falls. Returns the uninterrupted run's folder."""
    full, cut = tmp_path / "full", tmp_path / "cut"
    killed_and_resumed(lambda run: _train(run, root, policy=policy), full, cut, 7, timeout_s=400)
    want, got = read_losses(full), read_losses(cut)
    assert [r["step"] for r in got] == list(range(1, 11))
    assert got == want
    assert want[-1]["loss"] < want[0]["loss"]
    return full


def test_diffusion_trains_in_wamkit_and_resumes_exactly_after_sigkill(tmp_path, libero_tiny):
    """LeRobot's Diffusion Policy in one process, killed after its first checkpoint and resumed: the
    losses of the uninterrupted run, bit for bit (its noise, timesteps and crops drawn again alike)."""
    _killed_resumes_exactly(tmp_path, libero_tiny, "diffusion")


def test_act_trains_in_wamkit_resumes_exactly_after_sigkill_and_exports_a_folder_lerobot_runs(
    tmp_path, libero_tiny
):
    """``wamkit train`` as a user types it (LIBERO's fixture, LeRobot's ACT): killed after its first
    checkpoint and resumed, the same losses as an uninterrupted run; then ``wamkit convert --to extra``
    writes a LeRobot folder whose processors and policy, loaded by LeRobot, give the actions of
    wamkit's own path (spec, adapter, decode) for the same raw observation."""
    full = _killed_resumes_exactly(tmp_path, libero_tiny, "act")

    serve, folder = tmp_path / "serve", tmp_path / "lerobot_act"
    for args in (
        [str(full / "checkpoints" / "step_000010"), "--out", str(serve)],
        [str(serve), "--to", "extra", "--out", str(folder)],
    ):
        conv = subprocess.run(
            [sys.executable, "-m", "wamkit", "convert", *args],
            env=child_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert conv.returncode == 0, conv.stderr[-3000:]
    assert {"config.json", "model.safetensors", "policy_preprocessor.json", "policy_postprocessor.json"} <= {
        p.name for p in folder.iterdir()
    }

    adapter = load_pretrained(serve)
    spec = PreprocessSpec.load(serve / "preprocess.json")
    rng = np.random.default_rng(3)
    state = _raw_state(spec, rng)
    size = adapter.io.image_size
    images = {c: rng.integers(0, 256, (2, size, size, 3), dtype=np.uint8) for c in adapter.io.cameras}
    mine = adapter.predict(
        {**{f"observation.images.{c}": v for c, v in images.items()}, "observation.state": spec.encode_state(state),
         "task": ["x", "x"]}
    )["actions"]  # fmt: skip
    mine = spec.decode_actions(mine)

    policy = get_policy_class("act").from_pretrained(str(folder))
    pre, post = make_pre_post_processors(
        policy.config, pretrained_path=str(folder)
    )  # as lerobot-eval loads them
    obs = pre(preprocess_observation({"pixels": images, "agent_pos": state}))
    theirs = post(policy.predict_action_chunk(obs)).numpy()
    # the same network on inputs normalised by two float32 implementations of one affine map (LeRobot
    # divides by std + 1e-8, wamkit by max(std, 1e-8); float64 then float32 here): the actions agree to
    # a few float32 roundings of each action's scale, amplified by the network's gain
    scale = np.asarray(spec.stats["action"].q99) - np.asarray(spec.stats["action"].q01)
    assert mine.shape == theirs.shape
    np.testing.assert_allclose(mine, theirs, rtol=0, atol=float(np.max(np.abs(scale))) * 1e-4)


@pytest.mark.parametrize("policy", ["act", "diffusion"])
def test_fsdp2_on_two_gloo_processes_resumes_exactly(tmp_path, libero_tiny, policy):
    """``torchrun`` with two processes (gloo): ACT's transformer layers, or Diffusion Policy's U-Net
    whole, and the rest sharded by FSDP2, a checkpoint at step 3; resumed from it, the run logs the
    losses of the uninterrupted one (Diffusion's noise, timesteps and crops drawn again alike)."""
    run = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "wamkit",
        *_train(run, libero_tiny, "train.max_steps=6", "train.save_interval=3", "train.global_batch=8",
                "train.keep_last=3", policy=policy)[3:],
    ]  # fmt: skip
    first = subprocess.run(cmd, env=child_env(), capture_output=True, text=True, timeout=400)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "2 process(es)" in first.stderr and "= 2 x 2 x 2" in first.stderr  # accumulation 2
    want = read_losses(run)
    assert [r["step"] for r in want] == list(range(1, 7))
    shutil.rmtree(run / "checkpoints" / "step_000006")
    again = subprocess.run(
        [*cmd, "--resume", "auto"], env=child_env(), capture_output=True, text=True, timeout=400
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from" in again.stderr and "step_000003" in again.stderr
    assert read_losses(run) == want


def _lerobot_train_act(root: Path, repo_id: str, out: Path, chunk: int, steps: int) -> Path:
    """``lerobot-train`` (LeRobot's own trainer, offline, on the CPU) of a small ACT on the dataset at
    ``root`` for ``steps`` steps, executing half its chunk; returns the pretrained folder it saved."""
    train = subprocess.run(
        [str(Path(sys.executable).with_name("lerobot-train")), f"--dataset.repo_id={repo_id}",
         f"--dataset.root={root}", "--policy.type=act", "--policy.pretrained_backbone_weights=null",
         "--policy.dim_model=64", "--policy.dim_feedforward=128", "--policy.n_encoder_layers=2",
         "--policy.n_vae_encoder_layers=1", f"--policy.chunk_size={chunk}", f"--policy.n_action_steps={chunk // 2}",
         "--policy.push_to_hub=false", "--policy.device=cpu", f"--steps={steps}", "--batch_size=2",
         f"--save_freq={steps}", "--num_workers=0", f"--output_dir={out}", "--wandb.enable=false"],
        env={**child_env(), "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True, timeout=400,
    )  # fmt: skip
    assert train.returncode == 0, train.stderr[-3000:]
    return out / "checkpoints" / f"{steps:06d}" / "pretrained_model"


def test_a_folder_lerobot_train_wrote_is_served_as_it_is(tmp_path, libero_tiny):
    """``lerobot-train`` (LeRobot's own trainer, offline, on LIBERO's fixture) writes a folder;
    ``wamkit serve FOLDER`` serves it with no conversion (its processors normalise; the spec is the
    identity), and over a real socket a raw observation gets the actions LeRobot's own pipeline gives
    (preprocessor, ``predict_action_chunk``, postprocessor) in this process."""
    from wamkit.serve.client import PolicyClient

    folder = _lerobot_train_act(
        libero_tiny, "local/libero_tiny", tmp_path / "lerobot_train", chunk=16, steps=3
    )

    log = tmp_path / "serve.log"
    cmd = [sys.executable, "-m", "wamkit", "serve", str(folder), "--port", "0", "--device", "cpu"]
    proc = start_logged(cmd, log, env=child_env())
    try:
        port = int(wait_for_log(proc, log, r"serving \S+ on ws://127\.0\.0\.1:(\d+)", timeout=300).group(1))
        client = PolicyClient(f"ws://127.0.0.1:{port}")
        rng = np.random.default_rng(4)
        images = {c: rng.integers(0, 256, (64, 64, 3), dtype=np.uint8) for c in ("image", "wrist_image")}
        state = rng.standard_normal(8).astype(np.float32)
        got = client.infer(
            {
                **{f"observation.images.{c}": v for c, v in images.items()},
                "observation.state": state,
                "prompt": "x",
            }
        )["actions"]
    finally:
        proc.terminate()
        proc.wait(30)

    policy = get_policy_class("act").from_pretrained(str(folder))
    pre, post = make_pre_post_processors(policy.config, pretrained_path=str(folder))
    obs = pre(
        preprocess_observation({"pixels": {c: v[None] for c, v in images.items()}, "agent_pos": state[None]})
    )
    want = post(policy.predict_action_chunk(obs)).numpy()[0]
    assert got.shape == want.shape == (16, 7)
    # the same code on the same inputs, but in another process (one thread, the server's batch bucket):
    # sums in other orders differ by float32 roundings, a few ulps through ACT's dozen layers
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_lerobots_reader_loads_the_executed_actions_a_perturbed_collection_writes(tmp_path):
    """A perturbed `wamkit collect` (DART noise, late actions) writes `executed_action` beside
    `action`, described as collect describes it; LeRobot's own LeRobotDataset loads both, frame by
    frame, as written."""
    from lerobot.datasets.lerobot_dataset import LeRobotDataset as LeRobotsDataset

    from wamkit.constants import ACTION, EXECUTED_ACTION, OBS_STATE, TASK
    from wamkit.data import LeRobotDatasetWriter

    features = {
        "observation.images.corner": {"dtype": "video", "shape": [32, 32, 3], "names": ["height", "width", "channel"]},
        OBS_STATE: {"dtype": "float32", "shape": [4], "names": None},
        ACTION: {"dtype": "float32", "shape": [4], "names": None},
        EXECUTED_ACTION: {"dtype": "float32", "shape": [4], "names": None},
    }  # fmt: skip
    rng = np.random.default_rng(3)
    writer = LeRobotDatasetWriter.create(tmp_path / "late", 80, features, robot_type="sawyer")
    written = []
    for length in (6, 5):
        for _ in range(length):
            frame = {
                "observation.images.corner": rng.integers(0, 255, (32, 32, 3), dtype=np.uint8),
                OBS_STATE: rng.normal(size=4).astype(np.float32),
                ACTION: rng.uniform(-1, 1, 4).astype(np.float32),
                EXECUTED_ACTION: rng.uniform(-1, 1, 4).astype(np.float32),
                TASK: "open the door",
            }
            writer.add_frame(frame)
            written.append(frame)
        writer.save_episode()
    writer.finalize()
    ds = LeRobotsDataset("local/late", root=tmp_path / "late")
    assert len(ds) == len(written) and EXECUTED_ACTION in ds.features
    for i in (0, 5, 6, 10):
        item = ds[i]
        np.testing.assert_array_equal(item[EXECUTED_ACTION].numpy(), written[i][EXECUTED_ACTION])
        np.testing.assert_array_equal(item[ACTION].numpy(), written[i][ACTION])


@pytest.mark.parametrize("task", ["transfer_cube", "insertion"])
def test_lerobot_reads_an_aloha_collection_and_lerobot_train_trains_on_it(tmp_path, task):
    """``wamkit collect --suite aloha`` as typed writes what LeRobot 0.6.1 takes as one of its ALOHA
    datasets: its LeRobotDataset loads every frame as written (wamkit's reader beside it: the same
    state, action, task and decoded top image), with LeRobot's ALOHA feature names and 50 fps; and
    ``lerobot-train`` (LeRobot's own trainer, offline) trains ACT on it and saves a checkpoint."""
    from lerobot.datasets.lerobot_dataset import LeRobotDataset as LeRobotsDataset

    from wamkit.data import LeRobotDataset

    pytest.importorskip("gym_aloha")
    out = tmp_path / "aloha"
    collect = subprocess.run(
        [str(Path(sys.executable).with_name("wamkit")), "collect", "--suite", "aloha", "--tasks", task,
         "--episodes", "2", "--image-size", "32", "--keep-failed", "--workers", "1", "--out", str(out),
         "env.max_steps=25"],
        env=child_env(user_shell=True), capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )  # fmt: skip
    assert collect.returncode == 0, collect.stderr[-3000:]
    theirs = LeRobotsDataset(f"local/aloha_{task}", root=out)
    ours = LeRobotDataset(out)
    assert theirs.fps == 50 and theirs.meta.robot_type == "aloha" and len(theirs) == len(ours) == 50
    assert theirs.meta.camera_keys == ["observation.images.top"]
    assert theirs.features["observation.state"]["shape"] == (14,) and theirs.features["action"]["shape"] == (
        14,
    )
    for i in (0, 24, 25, 49):  # both episodes' first and last frames
        a, b = theirs[i], ours[i]
        assert int(a["episode_index"]) == int(b["episode_index"]) and int(a["frame_index"]) == int(
            b["frame_index"]
        )
        np.testing.assert_array_equal(a["observation.state"].numpy(), np.asarray(b["observation.state"]))
        np.testing.assert_array_equal(a["action"].numpy(), np.asarray(b["action"]))
        assert a["task"] == b["task"]
        # both decode the same mp4 frame: LeRobot's float in [0, 1] channels first, wamkit's uint8
        img = np.asarray(b["observation.images.top"])
        img = img if img.shape[0] == 3 else img.transpose(2, 0, 1)
        np.testing.assert_allclose(
            a["observation.images.top"].numpy() * 255, img.astype(np.float32), atol=0.51
        )

    folder = _lerobot_train_act(out, f"local/aloha_{task}", tmp_path / "lerobot_train", chunk=10, steps=2)
    assert (folder / "model.safetensors").is_file()


@pytest.mark.skipif(
    not (Path(__file__).resolve().parents[1] / ".venv-maniskill" / "bin" / "python").is_file(),
    reason="ManiSkill3's venv is built by `make setup-maniskill`",
)
def test_lerobot_reads_a_maniskill_collection(tmp_path):
    """``wamkit collect --suite maniskill`` as typed (its workers in ManiSkill3's venv) writes what
    LeRobot 0.6.1's ``LeRobotDataset`` loads frame for frame as wamkit's reader does: 20 fps, the Panda,
    the 18-D state, the 7-D ``pd_ee_delta_pose`` action and the ``base_camera`` image."""
    from lerobot.datasets.lerobot_dataset import LeRobotDataset as LeRobotsDataset

    from wamkit.data import LeRobotDataset

    out = tmp_path / "maniskill"
    collect = subprocess.run(
        [str(Path(sys.executable).with_name("wamkit")), "collect", "--suite", "maniskill", "--tasks",
         "PushCube-v1", "--episodes", "1", "--image-size", "32", "--keep-failed", "--workers", "1",
         "--out", str(out), "env.max_steps=12"],
        env=child_env(user_shell=True), capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )  # fmt: skip
    assert collect.returncode == 0, collect.stderr[-3000:]
    theirs = LeRobotsDataset("local/maniskill_push", root=out)
    ours = LeRobotDataset(out)
    assert theirs.fps == 20 and theirs.meta.robot_type == "panda" and len(theirs) == len(ours) == 12
    assert theirs.meta.camera_keys == ["observation.images.base_camera"]
    assert theirs.features["observation.state"]["shape"] == (18,)
    assert theirs.features["action"]["shape"] == (7,)
    for i in (0, 11):
        a, b = theirs[i], ours[i]
        np.testing.assert_array_equal(a["observation.state"].numpy(), np.asarray(b["observation.state"]))
        np.testing.assert_array_equal(a["action"].numpy(), np.asarray(b["action"]))
        assert a["task"] == b["task"] == "push the cube to the red and white target"
        img = np.asarray(b["observation.images.base_camera"])
        img = img if img.shape[0] == 3 else img.transpose(2, 0, 1)
        np.testing.assert_allclose(
            a["observation.images.base_camera"].numpy() * 255, img.astype(np.float32), atol=0.51
        )
