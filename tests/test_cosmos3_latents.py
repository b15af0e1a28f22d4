"""The Cosmos3 latent cache (``wamkit cache-latents``, ``model.options.latent_cache``) on a small
LIBERO-shaped pattern dataset with the tiny preset in fp32: training from the cache gives the losses of
encoding on the fly with the VAE never called; a cache of other settings is refused naming the field;
a cache of other data (same suite names and lengths, other frames) is refused naming the suite; a model
without latent targets given a cache is refused; a partial build resumes to the very files of a whole
one; a missing or corrupt shard is named; the build computes no statistics."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest
import torch

from tests.exactness import assert_rounding_close

pytest.importorskip("diffusers", reason="cosmos3 needs the wamkit[cosmos3] extra")

from wamkit.cli import main  # noqa: E402
from wamkit.config import ConfigError, ModelConfig, load_config  # noqa: E402
from wamkit.data.synthetic import write_pattern_dataset  # noqa: E402
from wamkit.models import build_model  # noqa: E402
from wamkit.models.cosmos3.latents import (  # noqa: E402
    LatentCache,
    LatentCacheError,
    dataset_contents,
    shard_path,
)
from wamkit.train.latent_cache import cache_latents  # noqa: E402
from wamkit.train.loop import train  # noqa: E402
from wamkit.train.metrics import read_losses  # noqa: E402

from .conftest import REPO

ROWS = 9  # two episodes of 5 and 4 frames: shards of 4, 4 and 1 rows


def _cfg(root: Path, run_dir: Path | None = None, *overrides: str):
    return load_config(
        REPO / "configs" / "libero_10_cosmos3.yaml",
        [
            "model.preset=tiny", "model.pretrained=", "model.options.gradient_checkpointing=false",
            f"data.root={root}", "data.num_workers=0", "train.max_steps=3", "train.micro_batch=2",
            "train.global_batch=2", "train.precision=fp32", "train.device=cpu", "train.ema=false", "train.compile=false",
            "train.log_interval=1", f"train.run_dir={run_dir or root / 'unused'}", *overrides,
        ],
    )  # fmt: skip


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    torch.set_num_threads(2)
    tmp = tmp_path_factory.mktemp("latents")
    return write_pattern_dataset(tmp / "ds", [5, 4], camera_dtype="image")


@pytest.fixture(scope="module")
def cache(data: Path) -> Path:
    """The whole cache of ``data`` in fp32, built through the CLI."""
    out = data.parent / "cache"
    argv = ["cache-latents", str(REPO / "configs" / "libero_10_cosmos3.yaml"), *_cfg_overrides(data)]
    argv += ["--out", str(out), "--device", "cpu", "--dtype", "float32", "--shard-size", "4", "--no-progress"]
    assert main(argv) == 0
    return out


def _cfg_overrides(root: Path) -> list[str]:
    return ["model.preset=tiny", "model.pretrained=", f"data.root={root}", "data.num_workers=0"]


def test_training_from_cached_latents_gives_the_on_the_fly_losses(data, cache, tmp_path):
    on_the_fly = train(_cfg(data, tmp_path / "encode"))

    def no_vae(cfg, io):  # the cached run must never encode
        adapter = build_model(cfg.model, io)

        def refuse(*_):
            raise AssertionError("the VAE encoded a clip in a run with a latent cache")

        adapter.pipe._encode_video = refuse
        return adapter

    cached = train(_cfg(data, tmp_path / "cached", f"model.options.latent_cache={cache}"), adapter_fn=no_vae)
    a, b = read_losses(on_the_fly), read_losses(cached)
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 3]
    # the same batches, noise and updates; the cache was encoded in VAE batches of 4 and the run encodes
    # batches of 2, which another CPU may convolve with other blockings: the VAE's reordered sums (about
    # 1024 deep) and the transformer's (192 wide, 4 deep, forward and back) over 3 steps
    for ra, rb in zip(a, b):
        for key in ("loss", "flow_matching_loss_vision", "flow_matching_loss_action", "grad_norm"):
            assert_rounding_close(rb[key], ra[key], length=3 * (1024 + 2 * 192 * 4))


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("data.resize=nearest", "resize: cache 'bilinear_antialias', this run 'nearest'"),
        ("model.options.resolution_tier=480", "resolution_tier: cache 256, this run 480"),
        ("data.cameras=[wrist_image,image]", "cameras: cache ['image', 'wrist_image'], this run ['wrist_"),
    ],
)
def test_a_cache_of_other_settings_is_refused_naming_the_field(data, cache, tmp_path, override, field):
    cfg = _cfg(data, tmp_path / "run", f"model.options.latent_cache={cache}", override)
    with pytest.raises(LatentCacheError, match=re.escape(field)):
        train(cfg)


def test_a_cache_of_other_data_is_refused_naming_the_suite(data, cache, tmp_path):
    """Same suite name and episode lengths, other frames: both training and writing into it refuse."""
    other = write_pattern_dataset(tmp_path / "other" / "ds", [5, 4], camera_dtype="image", first_pattern=7)
    cfg = _cfg(other, tmp_path / "run", f"model.options.latent_cache={cache}")
    with pytest.raises(
        LatentCacheError, match=r"other data than this run's \(suite 'ds': other data: .*, data \(cache"
    ):
        train(cfg)
    with pytest.raises(LatentCacheError, match=r"suite 'ds': other data: .*, data \(cache: 2 files"):
        cache_latents(_cfg(other), cache, device="cpu", dtype="float32", shard_size=4, progress=False)


def test_a_copy_of_the_data_has_the_same_contents(data, tmp_path):
    copy = shutil.copytree(data, tmp_path / "copy" / "ds")
    for path in copy.rglob("*"):  # a copy's times differ; the contents do not
        os.utime(path, (1, 1))
    assert dataset_contents(copy) == dataset_contents(data)
    assert dataset_contents(data)["data"]["files"] >= 1


def test_a_model_without_latent_targets_given_a_cache_is_refused(data, cache, tmp_path):
    def tiny(cfg, io):
        return build_model(ModelConfig(name="tiny", preset="small"), io)

    cfg = _cfg(data, tmp_path / "run", f"model.options.latent_cache={cache}")
    with pytest.raises(ConfigError, match=r"model.options.latent_cache: model 'tiny' reads no latent cache"):
        train(cfg, adapter_fn=tiny)


def test_the_build_computes_no_statistics(data, tmp_path, monkeypatch):
    import wamkit.data

    def refuse(*_, **__):
        raise AssertionError("cache-latents computed the dataset statistics")

    monkeypatch.setattr(wamkit.data, "compute_stats", refuse)
    assert not (data / "meta" / "wamkit_stats.json").exists()
    report = cache_latents(_cfg(data), tmp_path / "c", device="cpu", dtype="float32", shard_size=4,
                           max_shards=1, progress=False)  # fmt: skip
    assert report["written"] == 1


@pytest.mark.parametrize("flag", ["--batch", "--shard-size", "--max-shards"])
def test_a_flag_of_zero_is_refused_naming_it(data, flag, tmp_path, capsys):
    argv = ["cache-latents", str(REPO / "configs" / "libero_10_cosmos3.yaml"), *_cfg_overrides(data)]
    argv += ["--out", str(tmp_path / "c"), "--device", "cpu", "--no-progress", flag, "0"]
    with pytest.raises(SystemExit):
        main(argv)
    assert f"argument {flag}: expected a positive integer, got '0'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="latent cache batch_size: expected a positive number, got 0"):
        cache_latents(_cfg(data), batch_size=0)


def test_writing_into_a_cache_of_other_settings_is_refused(data, cache):
    with pytest.raises(LatentCacheError, match="resize: cache 'bilinear_antialias', this run 'nearest'"):
        cache_latents(_cfg(data, None, "data.resize=nearest"), cache, device="cpu", dtype="float32",
                      shard_size=4, progress=False)  # fmt: skip
    with pytest.raises(LatentCacheError, match="dtype: cache 'float32', this run 'bfloat16'"):
        cache_latents(_cfg(data), cache, device="cpu", dtype="bfloat16", shard_size=4, progress=False)


def test_an_interrupted_build_resumes_to_the_whole_cache(data, cache, tmp_path):
    out = tmp_path / "partial"
    kw = dict(device="cpu", dtype="float32", shard_size=4, progress=False)
    first = cache_latents(_cfg(data), out, max_shards=1, **kw)
    assert (first["written"], first["remaining"]) == (1, 2)
    with pytest.raises(LatentCacheError, match="shard-000001.safetensors is missing"):
        LatentCache(out)
    shard_path(out, "ds", 1).with_suffix(".tmp.safetensors").write_bytes(b"torn")  # a killed write
    second = cache_latents(_cfg(data), out, **kw)
    assert (second["written"], second["remaining"], second["rows"]) == (2, 0, ROWS)
    for k in range(3):  # the very files one uninterrupted build writes
        assert shard_path(out, "ds", k).read_bytes() == shard_path(cache, "ds", k).read_bytes()
    assert cache_latents(_cfg(data), out, **kw)["written"] == 0  # complete: nothing left to do


def test_a_missing_or_corrupt_shard_is_named(cache, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(cache, broken)
    shard_path(broken, "ds", 2).unlink()
    with pytest.raises(LatentCacheError, match=r"ds/shard-000002.safetensors is missing.*cache-latents"):
        LatentCache(broken)
    shutil.copy(shard_path(cache, "ds", 2), shard_path(broken, "ds", 2))
    path = shard_path(broken, "ds", 0)
    path.write_bytes(path.read_bytes()[:100])  # truncated
    with pytest.raises(LatentCacheError, match=r"ds/shard-000000.safetensors: not a readable latent shard"):
        LatentCache(broken)
    shutil.rmtree(broken)
    with pytest.raises(LatentCacheError, match="broken/manifest.json does not exist"):
        LatentCache(broken)


def test_cached_latents_are_the_adapter_encoding(data, cache):
    """Row r of the cache is ``encode_clips`` of sample r, the code sft_loss runs without a cache."""
    from wamkit.data.loader import collate
    from wamkit.train.latent_cache import _setup

    adapter, dataset, _, _ = _setup(_cfg(data))
    got = LatentCache(cache)
    want = adapter.encode_clips(collate([dataset[i] for i in (0, 6)]))
    # encoded in a batch of 4 there and of 2 here: the VAE's reordered sums, about 1024 deep
    assert_rounding_close(torch.stack([got.get("ds", 0), got.get("ds", 6)]), want, length=1024)


def test_bench_train_latents_encodes_the_targets_once(monkeypatch, capsys):
    """``wamkit bench train --latents`` times Cosmos3 steps on latents encoded once, as a latent cache
    gives them: the VAE runs once per measured variant (bare, trainer), never in a step."""
    from wamkit.cli import main as wamkit
    from wamkit.models.cosmos3.adapter import Cosmos3Adapter

    calls = []
    encode = Cosmos3Adapter._encode

    def counted(self, *a, **k):
        out = encode(self, *a, **k)
        calls.append(out.shape[0])  # clips encoded (the benchmark encodes one at a time)
        return out

    monkeypatch.setattr(Cosmos3Adapter, "_encode", counted)
    argv = ["bench", "train", "--model", "cosmos3", "--preset", "tiny", "--micro-batch", "2"]
    assert wamkit([*argv, "--steps", "2", "--warmup", "1", "--latents", "--device", "cpu"]) == 0
    # each variant's 2 clips once; 3 steps each of bare and trainer would make it 12
    assert sum(calls) == 2 * 2
    assert "trainer step" in capsys.readouterr().out
