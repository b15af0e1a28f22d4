"""LoRA SFT (``train.lora``, wamkit.train.lora) on the tiny Cosmos3: peft's adapters in the generation
tower learn while its weights stay the base's; a checkpoint holds the adapters and the action heads with
the base's hash; a run killed with SIGKILL resumes to the uninterrupted run's losses and weights, bit for
bit; FSDP2 shards it over two gloo processes; `wamkit convert` merges the adapters into a plain serving
directory whose actions are the adapted model's; bad settings are refused in one line naming the key."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.child_env import child_env
from tests.exactness import assert_rounding_close, rounding_atol

pytest.importorskip("diffusers", reason="cosmos3 needs the wamkit[cosmos3] extra")
pytest.importorskip("peft", reason="train.lora needs peft (the wamkit[cosmos3] extra)")

from torch.distributed.checkpoint import FileSystemReader  # noqa: E402
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save  # noqa: E402

from wamkit.config import ConfigError, LoraConfig, ModelConfig, load_config  # noqa: E402
from wamkit.constants import OBS_STATE, TASK, image_key  # noqa: E402
from wamkit.data.synthetic import write_pattern_dataset  # noqa: E402
from wamkit.models import build_model  # noqa: E402
from wamkit.models.cosmos3.latents import LATENTS  # noqa: E402
from wamkit.models.cosmos3.towers import GEN_LINEARS, param_role  # noqa: E402
from wamkit.train import lora  # noqa: E402
from wamkit.train.loop import train  # noqa: E402
from wamkit.train.metrics import read_losses  # noqa: E402

from .conftest import REPO  # noqa: E402
from .test_cosmos3_train import IO, fixture_batch  # noqa: E402
from .test_train_support import killed_and_resumed  # noqa: E402

CONFIG = REPO / "configs" / "libero_10_cosmos3.yaml"
# 4 layers of the tiny preset: 64 wide, MLP 192 wide, about 300 keys per attention (as in
# test_cosmos3_text_kv): the longest chain of sums from the inputs to one velocity
CHAIN = 4 * (64 + 300 + 192)


def _overrides(data: Path, run: Path, *extra: str) -> list[str]:
    return [
        "model.preset=tiny", "model.pretrained=", "model.options.gradient_checkpointing=false",
        f"data.root={data}", "data.num_workers=0", "train.max_steps=6", "train.micro_batch=2",
        "train.global_batch=2", "train.precision=fp32", "train.device=cpu", "train.ema=true", "train.compile=false",
        "train.save_interval=2", "train.log_interval=1", "train.warmup_steps=0", "train.lr=0.002",
        "train.lora.rank=4", "train.lora.alpha=8", f"train.run_dir={run}", *extra,
    ]  # fmt: skip


def _cfg(data: Path, run: Path, *extra: str):
    return load_config(CONFIG, _overrides(data, run, *extra))


def _keys(ckpt: Path) -> set[str]:
    return set(FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return write_pattern_dataset(tmp_path_factory.mktemp("lora") / "ds", [5, 4], camera_dtype="image")


def _tiny():
    torch.manual_seed(0)
    return build_model(ModelConfig(name="cosmos3", preset="tiny", options={"caption_dropout": 0.0}), IO)


def _loss(adapter, batch, seed: int = 123) -> torch.Tensor:
    torch.manual_seed(seed)  # the same noise levels and noise each time
    with torch.no_grad():
        return adapter.sft_loss(batch)["loss"]


@pytest.mark.numerics  # float results across code paths (tests/conftest.py)
def test_adapters_learn_the_base_stays_and_the_merge_is_the_adapted_model():
    """In process, on a fixed batch: the adapters in each generation-tower linear layer and the action
    heads train, nothing else moves, the loss falls; merged into their layers (peft's merge_and_unload)
    they give the adapted model's loss up to reordered fp32 sums, with no peft layer left."""
    torch.set_num_threads(2)
    batch = fixture_batch([90])
    adapter = _tiny()
    with torch.no_grad():  # the clip latents once (what a latent cache holds): no VAE in each loss
        batch[LATENTS] = adapter.encode_clips(batch)
    base = {n: p.detach().clone() for n, p in adapter.module.named_parameters()}
    base_loss = _loss(adapter, batch)
    spec = lora.resolve(LoraConfig(rank=4, alpha=8.0), adapter)
    assert len(spec.targets) == len(GEN_LINEARS) * 4 and spec.full_groups == ("action_heads",)
    applied = lora.inject(adapter, spec, seed=0)
    assert [g.name for g in applied.groups] == ["action_heads", "lora"]
    trained = {n for n, p in adapter.module.named_parameters() if p.requires_grad}
    in_groups = {id(p) for g in applied.groups for p in g.params}
    assert {id(p) for n, p in adapter.module.named_parameters() if n in trained} == in_groups
    assert all(".lora_" in n or param_role(n) == "action_heads" for n in trained)
    before = _loss(adapter, batch)
    assert before == base_loss  # B = 0: the adapted model starts as the base, to the bit
    # the adapters at a higher rate than the heads: their own share of the loss then shows (below)
    opt = torch.optim.AdamW([{"params": g.params, "lr": 5e-3 if g.name == "action_heads" else 3e-2}
                             for g in applied.groups])  # fmt: skip
    for step in range(3):
        torch.manual_seed(step)
        opt.zero_grad()
        adapter.sft_loss(batch)["loss"].backward()
        opt.step()
    after = _loss(adapter, batch)
    assert after < 0.9 * before, (before, after)
    now = dict(adapter.module.named_parameters())
    for n, p in now.items():
        plain = n.replace(".base_layer.", ".")
        if n in trained:
            assert plain not in base or not torch.equal(p, base[plain]), n  # B moved from 0, heads moved
        else:
            assert torch.equal(p, base[plain]), f"{n} is frozen under LoRA but changed"

    applied.tuner.disable_adapter_layers()  # the trained heads on the base, without the adapters
    without = _loss(adapter, batch)
    applied.tuner.enable_adapter_layers()

    parts = {t: (now[f"{t}.lora_A.default.weight"], now[f"{t}.lora_B.default.weight"]) for t in spec.targets}
    # the merge's math, in float64: W + (alpha / r) B A
    want = {t: base[f"{t}.weight"].double() + spec.alpha / spec.rank * (b.double() @ a.double())
            for t, (a, b) in parts.items()}  # fmt: skip
    applied.merge()
    assert set(adapter.module.state_dict()) == set(base)  # a plain Cosmos3OmniTransformer again
    merged_w = dict(adapter.module.named_parameters())
    for t, w in want.items():  # one rounding of an r-term sum and of the addition
        assert_rounding_close(merged_w[f"{t}.weight"].detach(), w, length=spec.rank + 1)
    merged = _loss(adapter, batch)
    assert_rounding_close(merged, after, length=CHAIN)
    # the adapters' own share of the loss is far outside that bound: a merge that lost them, or their
    # scale alpha / rank, would fail it
    assert abs(float(after) - float(without)) > 20 * rounding_atol(after, CHAIN)


def test_bad_lora_settings_are_refused_in_one_line_naming_the_key(data, tmp_path, capsys):
    for override, match in [
        ("train.lora.rank=-1", "train.lora.rank: expected >= 0"),
        ("train.lora.dropout=1.5", r"train.lora.dropout: expected a probability in \[0, 1\)"),
        ("train.lora.alpha=-2", "train.lora.alpha: expected >= 0"),
    ]:
        with pytest.raises(ConfigError, match=match):
            _cfg(data, tmp_path / "x", override)
    with pytest.raises(ConfigError, match=r"train.lora.target_modules is set but train.lora.rank=0"):
        load_config(CONFIG, ["train.lora.target_modules=mlp_moe_gen.up_proj"])
    adapter = build_model(ModelConfig(name="cosmos3", preset="tiny"), IO, device="meta")
    with pytest.raises(
        ConfigError, match=r"'mlp.up_proj' names frozen layers.*may name end in: .*mlp_moe_gen.up_proj"
    ):
        lora.resolve(LoraConfig(rank=4, target_modules=["mlp.up_proj"]), adapter)  # the understanding tower

    from wamkit.cli import main

    run = tmp_path / "run"
    code = main(["train", str(CONFIG), *_overrides(data, run, "train.lora.target_modules=add_q_proj,qkv")])
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        code == 2 and err[-1].startswith("wamkit train: config error: ") and "Traceback" not in "".join(err)
    )
    assert "train.lora.target_modules: 'qkv' matches no linear layer of cosmos3" in err[-1]
    assert not run.exists()  # a refused run leaves no folder


@pytest.mark.numerics  # float results across code paths (tests/conftest.py)
def test_a_lora_run_saves_adapters_and_heads_converts_merged_and_serves(data, tmp_path):
    from wamkit.cli import main
    from wamkit.serve.loading import load_served

    torch.set_num_threads(2)
    run = train(_cfg(data, tmp_path / "run", "train.max_steps=4"))
    full = train(_cfg(data, tmp_path / "full", "train.max_steps=1", "train.lora.rank=0"))
    # step 1's loss is computed before any update: the adapted model is the base there, to the bit
    assert read_losses(run)[0]["loss"] == read_losses(full)[0]["loss"]
    ckpt = run / "checkpoints" / "step_000004"
    meta = json.loads((ckpt / "meta.json").read_text())
    assert meta["lora"]["rank"] == 4 and meta["lora"]["alpha"] == 8.0
    assert meta["base"]["kind"] == "preset" and meta["base"]["whole"] is True
    keys = _keys(ckpt)
    model = {k.removeprefix("model.") for k in keys if k.startswith("model.")}
    assert model == {k.removeprefix("ema.") for k in keys if k.startswith("ema.")}
    heads = {n for n, _ in _tiny().module.named_parameters() if param_role(n) == "action_heads"}
    adapters = {f"{t}.lora_{m}.default.weight" for t in meta["lora"]["targets"] for m in "AB"}
    assert model == heads | adapters  # no base weight: not the adapted layers', not the tower's

    # resumed under other LoRA settings: refused naming the key, before any step
    with pytest.raises(ConfigError, match=r"train.lora.rank is 8 in this run but 4 in the checkpoint"):
        train(_cfg(data, run, "train.max_steps=6", "train.lora.rank=8", "train.resume=auto"))
    with pytest.raises(ConfigError, match=r"trained without LoRA \(full SFT\)"):
        train(_cfg(data, full, "train.max_steps=2", "train.resume=auto"))

    assert main(["convert", str(run), "--out", str(tmp_path / "serve")]) == 0
    source = json.loads((tmp_path / "serve" / "source.json").read_text())
    assert source["lora_merged"] == {"rank": 4, "alpha": 8.0}
    served = load_served(tmp_path / "serve", device="cpu").adapter
    fresh = _tiny().module.state_dict()
    got = served.module.state_dict()
    assert set(got) == set(fresh)  # a plain model: no peft names, no peft needed to load it
    changed = {n for n in got if not torch.equal(got[n], fresh[n])}
    adapted = {f"{t}.weight" for t in meta["lora"]["targets"]}
    assert changed == adapted | heads  # the adapters merged into their layers; the rest is the base

    # the adapted model before the merge (the checkpoint's adapters on the base) against the served one
    unmerged = _tiny()
    lora.inject(unmerged, lora.LoraSpec.from_meta(meta["lora"]))
    dcp_to_torch_save(ckpt, tmp_path / "ckpt.pt")
    result = unmerged.module.load_state_dict(
        torch.load(tmp_path / "ckpt.pt", weights_only=False)["model"], strict=False
    )
    assert not result.unexpected_keys and not set(result.missing_keys) & model
    unmerged.module.eval()
    io = served.io
    obs = two_observations(io)
    want = unmerged.predict(obs, seed=0)["actions"]
    have = served.predict(obs, seed=0)["actions"]
    base = _tiny()
    base.module.eval()
    steps = int(served.options.num_inference_steps)
    # each sampler step adds one velocity's rounding (CHAIN-term sums) to the actions
    assert_rounding_close(torch.as_tensor(have), torch.as_tensor(want), length=steps * CHAIN)
    moved = np.abs(want - base.predict(obs, seed=0)["actions"]).max()
    assert moved > 100 * np.abs(have - want).max()  # training moved the actions far past rounding


def _train_cmd(data: Path, run: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "wamkit", "train", str(CONFIG), *_overrides(data, run, *extra)]


@pytest.mark.slow
def test_sigkill_at_a_random_step_then_resume_auto_gives_identical_losses(data, tmp_path):
    """The trainer's exact resume (tests/test_train_resume.py) with LoRA: the killed run, resumed from its
    last checkpoint (adapters, heads, their moments and EMA; the base rebuilt and checked by hash), logs
    the uninterrupted run's losses and ends with its adapters, heads and EMA, bit for bit."""
    # with dropout in the adapters: its draws come from the RNG state the checkpoint restores
    resume_after_sigkill(data, tmp_path, 8, ("train.lora.dropout=0.1",), "LoRA rank 4")


def resume_after_sigkill(data, tmp_path, steps: int, args: tuple[str, ...], logged: str) -> None:
    """A LoRA run of ``steps`` steps (a checkpoint every 3) killed with SIGKILL at a random step after
    the first checkpoint and resumed with ``--resume auto`` (its log saying ``logged``) against the same
    run uninterrupted: the same losses, adapters, heads and EMA, bit for bit."""
    args = (f"train.max_steps={steps}", "train.save_interval=3", *args)
    full, cut = tmp_path / "full", tmp_path / "cut"
    kill_at = random.randint(4, steps - 1)  # after the first checkpoint (step 3), before the end
    err = killed_and_resumed(lambda run: _train_cmd(data, run, *args), full, cut, kill_at)
    assert "resumed from" in err and logged in err, err[-3000:]

    want, got = read_losses(full), read_losses(cut)
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(1, steps + 1)), kill_at
    for a, b in zip(want, got):
        assert a == b, f"killed at step {kill_at}: step {a['step']} differs: {a} != {b}"
    final = {}
    for name, r in (("full", full), ("cut", cut)):
        dcp_to_torch_save(r / "checkpoints" / f"step_{steps:06d}", tmp_path / f"{name}.pt")
        final[name] = torch.load(tmp_path / f"{name}.pt", weights_only=False)
    for part in ("model", "ema"):
        a, b = final["full"][part], final["cut"][part]
        assert a.keys() == b.keys() and any(".lora_B." in k for k in a), part
        for k in a:
            assert torch.equal(a[k], b[k]), f"killed at step {kill_at}: {part}.{k} differs"


@pytest.mark.slow  # two processes (35 s); the one-process LoRA tests are the fast check
def test_two_process_fsdp2_shards_the_adapters_resumes_exactly_and_converts(data, tmp_path):
    """FSDP2 over two gloo processes (torchrun): each decoder layer, its LoRA layers inside, is sharded;
    the checkpoint's two shards hold the adapters and heads; resumed from step 2 under two processes the
    run logs the same losses; the 2-shard checkpoint converts in one process."""
    from wamkit.export import checkpoint_to_serving

    run = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "wamkit",
        "train", str(CONFIG), *_overrides(data, run, "train.max_steps=4", "train.micro_batch=1"),
    ]  # fmt: skip
    first = subprocess.run(cmd, env=child_env(), capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "2 process(es)" in first.stderr
    step4 = run / "checkpoints" / "step_000004"
    assert sorted(p.name for p in step4.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    model = {k for k in _keys(step4) if k.startswith("model.")}
    assert model and all(
        ".lora_" in k or param_role(k.removeprefix("model.")) == "action_heads" for k in model
    )

    want = read_losses(run)
    shutil.rmtree(step4)
    again = subprocess.run(
        [*cmd, "--resume", "auto"], env=child_env(), capture_output=True, text=True, timeout=300
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from" in again.stderr and "step_000002" in again.stderr
    assert read_losses(run) == want
    serving = checkpoint_to_serving(step4, tmp_path / "serve")
    assert (serving / "model.safetensors").is_file()


def test_lora_plans_nano_sft_on_one_80gb_gpu_without_offload(capsys):
    """The recipe's model with rank-16 adapters on one 80 GB GPU and a 128 GB host: the plan counts the
    adapters and heads as trained (46M of Nano's 15.2B parameters) and keeps everything on the device,
    where full SFT is refused there (tests/test_train_placement.py)."""
    from wamkit.cli import main

    one_gpu = ["--plan", "--world-size", "1", "--device-memory", "80GB", "--host-memory", "128GB"]
    assert main(["train", str(CONFIG), "train.lora.rank=16", *one_gpu]) == 0
    out = capsys.readouterr().out
    assert "(15.156B frozen, 0.046B trained)" in out and "offload=none" in out
    assert "trained master (fp32)           0.17  device" in out
    device = float(out.split("device total ")[1].split(" GiB")[0])
    assert device <= 74.5  # GiB of 80 GB


def two_observations(io) -> dict:
    """Two random observations of ``io``'s cameras and state, with two task prompts."""
    rng = np.random.default_rng(0)
    obs = {image_key(c): rng.integers(0, 255, (2, io.image_size, io.image_size, 3), dtype=np.uint8)
           for c in io.cameras}  # fmt: skip
    obs[OBS_STATE] = rng.standard_normal((2, io.state_dim)).astype(np.float32)
    obs[TASK] = ["pick up the cube", "open the drawer"]
    return obs
