"""``wamkit infer`` on real image/video/JSON files, the ``delay`` benchmark model, and ``wamkit bench serve``."""

from __future__ import annotations

import json

import av
import numpy as np
import pytest
import torch

from wamkit.cli import main as wamkit
from wamkit.config import ConfigError, ModelConfig
from wamkit.models import build_model
from wamkit.serve.infer import read_frames, write_video
from wamkit.serve.loading import random_init


def _png(path, value: int, size: int = 64) -> None:
    with av.open(str(path), "w", format="image2") as c:
        s = c.add_stream("png")
        s.width = s.height = size
        s.pix_fmt = "rgb24"
        c.mux(s.encode(av.VideoFrame.from_ndarray(np.full((size, size, 3), value, np.uint8), format="rgb24")))
        c.mux(s.encode())


@pytest.fixture
def samples(tmp_path):
    d = tmp_path / "samples"
    d.mkdir()
    _png(d / "start.png", 60)
    write_video(d / "clip.mp4", np.stack([np.full((64, 64, 3), v, np.uint8) for v in (20, 120, 220)]), 10)
    np.save(d / "acts.npy", np.full((16, 4), 0.5, np.float32))
    cases = {
        "a": {"prompt": "reach", "vision_path": "start.png", "seed": 3, "state": [0.1] * 39},
        "b": {
            "model_mode": "forward_dynamics",
            "vision_path": "clip.mp4",
            "action_path": "acts.npy",
            "fps": 5,
        },
        "c": {"model_mode": "inverse_dynamics", "vision_path": "clip.mp4", "name": "inverse"},
        "bad_chunk": {"vision_path": "start.png", "action_chunk_size": 8},
        "extra_fields": {
            "vision_path": "start.png",
            "colour": "red",
            "view_point": "ego_view",
            "model_mode": "wam",
        },
        "bad_url": {"vision_path": "https://example.com/clip.mp4"},
        "bad_vision": {"vision_path": "missing.png"},
        "bad_inverse": {"model_mode": "inverse_dynamics", "vision_path": "start.png"},
        "bad_mode": {"model_mode": ["wam"], "vision_path": "start.png"},
    }
    for name, body in cases.items():
        (d / f"{name}.json").write_text(json.dumps(body))
    (d / "utf16.json").write_text(json.dumps(cases["a"]), encoding="utf-16")  # not UTF-8: unreadable
    return d


def test_infer_writes_outputs_and_reports_invalid_samples(samples, tmp_path, capsys):
    out = tmp_path / "out"
    rc = wamkit(
        [
            "infer",
            "-i",
            str(samples / "*.json"),
            "-o",
            str(out),
            "--model",
            "delay",
            "--random-init",
            "--device",
            "cpu",
        ]
    )
    printed = capsys.readouterr().out
    assert rc == 1
    assert "4 sample(s) written" in printed and "6 invalid" in printed  # the bad ones do not stop the rest
    assert "extra_fields.json: fields recorded but not used: colour, view_point" in printed
    for needle in [
        "bad_chunk.json: field 'action_chunk_size'",
        "bad_url.json: field 'vision_path': https://example.com/clip.mp4 is a URL",
        "bad_vision.json: field 'vision_path': cannot read",
        "bad_inverse.json: field 'vision_path': inverse_dynamics needs a video",
        "bad_mode.json: field 'model_mode': ['wam'] is not one of",
        "utf16.json: not a readable JSON file (UnicodeDecodeError",
    ]:
        assert needle in printed, printed

    args = json.loads((out / "a" / "sample_args.json").read_text())
    assert set(args) >= {"model_mode", "name", "prompt", "vision_path", "domain_name", "action_chunk_size"}
    assert (
        args["action_chunk_size"] == 16 and args["model_mode"] == "wam" and args["wamkit"]["mode"] == "policy"
    )
    assert args["wamkit"]["autocast"] == "off"  # the CPU computes fp32
    extra = json.loads((out / "extra_fields" / "sample_args.json").read_text())
    assert extra["colour"] == "red" and extra["wamkit"]["unused_fields"] == ["colour", "view_point"]
    result = json.loads((out / "a" / "sample_outputs.json").read_text())
    assert result["status"] == "success" and result["args"]["name"] == "a"
    assert result["outputs"][0]["files"] == [str(out / "a" / "vision.mp4")]
    actions = np.asarray(result["outputs"][0]["content"]["action"])
    # identity stats: the delay model's formula with state 0.1 and a uniform image of value 60
    t = np.arange(16)[:, None]
    np.testing.assert_allclose(actions, np.tanh(0.1 + 0.1 * t + 0.5 * 60 / 255) * np.ones((1, 4)), atol=2e-3)

    frames = read_frames(out / "b" / "vision.mp4")
    assert frames.shape == (2, 128, 128, 3)
    assert abs(frames[0].mean() - 20) < 4 and abs(frames[1].mean() - 25) < 4  # first frame + 10 x mean action
    assert read_frames(out / "a" / "vision.mp4").shape == (1, 128, 128, 3)  # vision.mp4 in every mode
    inv = np.asarray(
        json.loads((out / "inverse" / "sample_outputs.json").read_text())["outputs"][0]["content"]["action"]
    )
    assert inv.shape == (16, 4)
    np.testing.assert_allclose(inv[0], np.tanh(0.5 * 20 / 255) + 220 / 255, atol=2e-2)  # goal = last frame
    assert read_frames(out / "inverse" / "vision.mp4").shape[0] == 3  # the observed clip


def test_infer_cosmos3_reads_a_cosmos_sample_as_it_is(tmp_path, capsys):
    """A cosmos-framework sample file (LIBERO concat_view clip) through the tiny cosmos3: one image per
    camera, the predicted future frames in vision.mp4, inverse dynamics on the whole clip."""
    pytest.importorskip("diffusers")
    d = tmp_path / "s"
    d.mkdir()
    rng = np.random.default_rng(0)
    left = rng.integers(0, 100, (17, 64, 64, 3), dtype=np.uint8)
    right = rng.integers(150, 256, (17, 64, 64, 3), dtype=np.uint8)
    write_video(d / "clip.mp4", np.concatenate([left, right], axis=2), 20)
    common = {"action_chunk_size": 16, "domain_name": "libero", "fps": 20, "image_size": 64,
              "view_point": "concat_view", "extra": {"golden_mse_max": 0.05}, "seed": 0,
              "prompt": "put the bowl on the plate", "vision_path": "clip.mp4"}  # fmt: skip
    (d / "policy.json").write_text(json.dumps({**common, "model_mode": "wam", "name": "p"}))
    (d / "inverse.json").write_text(json.dumps({**common, "model_mode": "inverse_dynamics", "name": "i"}))
    out = tmp_path / "out"
    argv = ["infer", "-i", str(d / "*.json"), "-o", str(out), "--model", "cosmos3", "--preset", "tiny"]
    argv += ["--random-init", "--device", "cpu", "--option", "num_inference_steps=2"]
    assert wamkit(argv) == 0, capsys.readouterr().out
    video = read_frames(out / "p" / "vision.mp4")
    assert video.shape[0] == 17 and video.shape[2] == 2 * video.shape[1]  # observation + 16 predicted
    result = json.loads((out / "p" / "sample_outputs.json").read_text())
    assert np.asarray(result["outputs"][0]["content"]["action"]).shape[0] == 16
    assert result["args"]["wamkit"]["unused_fields"] == ["extra", "image_size", "view_point"]
    inv = json.loads((out / "i" / "sample_outputs.json").read_text())
    assert np.isfinite(np.asarray(inv["outputs"][0]["content"]["action"])).all()


def test_infer_without_matching_files(tmp_path, capsys):
    assert (
        wamkit(
            [
                "infer",
                "-i",
                str(tmp_path / "*.json"),
                "-o",
                str(tmp_path),
                "--model",
                "delay",
                "--random-init",
            ]
        )
        == 2
    )


def test_delay_model_options_are_checked():
    # the messages every model's options give (wamkit.config.from_dict)
    with pytest.raises(
        ConfigError, match="unknown key 'model.options.delay'; did you mean 'model.options.delay_ms'"
    ):
        build_model(ModelConfig(name="delay", options={"delay": 5}))
    with pytest.raises(ConfigError, match="model.options.delay_ms: expected a non-negative"):
        build_model(ModelConfig(name="delay", options={"delay_ms": -1}))
    with pytest.raises(ConfigError, match="not a delay preset"):
        build_model(ModelConfig(name="delay", preset="huge"))
    with pytest.raises(ConfigError, match="model.options.host_calls: expected an integer, got 2.5"):
        build_model(ModelConfig(name="delay", options={"host_calls": 2.5}))
    with pytest.raises(
        ConfigError, match="model.options.host_calls: expected a non-negative whole number of calls"
    ):
        build_model(ModelConfig(name="delay", options={"host_calls": -1}))


def test_delay_model_host_calls_run_on_the_host_and_change_no_action():
    """``host_calls``: that many small torch calls per predict (a launch-bound stand-in); the actions are
    those of a model without them."""
    plain = build_model(ModelConfig(name="delay", preset="libero"))
    busy = build_model(ModelConfig(name="delay", preset="libero", options={"host_calls": 500}))
    assert busy.config_dict()["options"]["host_calls"] == 500
    before = float(busy._scratch[0])
    rng = np.random.default_rng(1)
    batch = {
        "observation.images.agentview": rng.integers(0, 256, (2, 128, 128, 3), dtype=np.uint8),
        "observation.images.wrist": rng.integers(0, 256, (2, 128, 128, 3), dtype=np.uint8),
        "observation.state": rng.standard_normal((2, 8)).astype(np.float32),
        "task": ["a", "b"],
    }
    np.testing.assert_array_equal(busy.predict(batch)["actions"], plain.predict(batch)["actions"])
    assert float(busy._scratch[0]) - before == 500  # every call ran


def test_delay_model_is_deterministic_and_input_dependent():
    policy = random_init("delay", "libero", device="cpu")
    rng = np.random.default_rng(0)
    obs = {
        "observation.images.agentview": rng.integers(0, 256, (3, 128, 128, 3), dtype=np.uint8),
        "observation.images.wrist": rng.integers(0, 256, (3, 128, 128, 3), dtype=np.uint8),
        "observation.state": rng.standard_normal((3, 8)).astype(np.float32),
        "prompt": ["a", "b", "c"],
    }
    a, b = policy.infer(obs)["actions"], policy.infer(obs)["actions"]
    assert a.shape == (3, 16, 7) and np.isfinite(a).all()
    np.testing.assert_array_equal(a, b)
    assert not np.allclose(a[0], a[1])


def test_bench_serve_prints_ratios(capsys):
    rc = wamkit(
        [
            "bench",
            "serve",
            "--seconds",
            "0.3",
            "--batch",
            "1,4",
            "--concurrency",
            "1,4",
            "--option",
            "delay_ms=2",
            "--device",
            "cpu",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0 and "BENCHMARK MODEL" in out
    rows = [line.split() for line in out.splitlines() if line.startswith(("batched", "dynamic"))]
    assert [(r[0], r[1], r[2]) for r in rows] == [
        ("batched", "1", "1"),
        ("batched", "1", "4"),
        ("dynamic", "1", "1"),
        ("dynamic", "4", "1"),
    ]
    for r in rows:
        obs_s, ratio = float(r[3]), float(r[7])
        assert obs_s > 0 and 0 < ratio < 5


@pytest.mark.slow
def test_bench_serve_spreads_dynamic_connections_over_client_processes(tmp_path):
    from wamkit.bench.serve import _split

    assert _split(32, 8) == [4] * 8 and _split(5, 2) == [3, 2] and _split(2, 8) == [1, 1]
    out = tmp_path / "serve.json"
    argv = ["bench", "serve", "--seconds", "0.3", "--batch", "2", "--concurrency", "4"]
    argv += ["--client-processes", "2", "--option", "delay_ms=2", "--device", "cpu", "--json", str(out)]
    assert wamkit(argv) == 0
    (row,) = [r for r in json.loads(out.read_text())["rows"] if r["kind"] == "dynamic"]
    # both processes' replies count: 4 connections' worth in one window
    assert row["client_processes"] == 2 and row["connections"] == 4
    assert row["obs_s"] > 0 and row["server_batch"] >= 1


def test_random_init_servers_started_alike_serve_the_same_weights():
    """Two random-init servers of one model (one evaluation's stages spread over them) must hold the same
    weights: the evaluator refuses servers whose weights hashes differ."""
    from wamkit.models.base import weights_sha256

    torch.manual_seed(123)  # whatever the process drew before, the weights are the preset's seed's
    a = random_init("tiny", "small", device="cpu")
    b = random_init("tiny", "small", device="cpu")
    assert weights_sha256(a.adapter.module) == weights_sha256(b.adapter.module)


def test_bench_serve_repeats_give_each_row_its_median_pass(tmp_path, capsys):
    from wamkit.bench.serve import _median_rows

    passes = [[{"ratio_to_in_process": r, "pass": i}] for i, r in enumerate((0.9, 0.5, 0.7))]
    assert _median_rows(passes) == [{"ratio_to_in_process": 0.7, "pass": 2}]
    out = tmp_path / "serve.json"
    argv = ["bench", "serve", "--seconds", "0.2", "--batch", "2", "--concurrency", "2", "--repeats", "2"]
    argv += ["--option", "delay_ms=2", "--device", "cpu", "--json", str(out)]
    assert wamkit(argv) == 0
    result = json.loads(out.read_text())
    assert len(result["passes"]) == 2
    for i, row in enumerate(result["rows"]):  # each table row is one of its passes
        assert {k: v for k, v in row.items() if k != "speedup_over_single"} in [
            p[i] for p in result["passes"]
        ]
        assert row["ratio_to_in_process"] == row["obs_s"] / row["in_process_obs_s"] > 0
    assert "medians of 2 passes" in capsys.readouterr().out


MODELS = [
    ("tiny", "small", []),
    ("delay", "small", []),
    ("cosmos3", "tiny", ["num_inference_steps=2"]),
    ("cosmos3", "tiny", ["num_inference_steps=2", "sampler=euler"]),
]


@pytest.mark.parametrize("model,preset,options", MODELS, ids=["tiny", "delay", "cosmos3", "cosmos3-euler"])
def test_infer_and_a_websocket_request_give_the_same_actions(model, preset, options, tmp_path, capsys):
    """One transform path: a sample through ``wamkit infer`` and the same observation sent to ``wamkit
    serve`` over a websocket, as a client sends it, give the same actions for the same seed (each the
    served policy's ``prepare`` then ``run``; the same kernels on the same shapes, so to the bit). The
    image is written at the model's size, so neither side resizes it."""
    from wamkit.eval.server_proc import start_server_process
    from wamkit.serve.client import PolicyClient

    if model == "cosmos3":
        pytest.importorskip("diffusers")
    serve = ["--model", model, "--preset", preset, "--random-init", "--device", "cpu"]
    for opt in options:
        serve += ["--option", opt]
    with start_server_process(serve, log_path=tmp_path / "serve.log") as server:
        client = PolicyClient(server.url)
        inputs = client.metadata["inputs"]
        size, state_dim, cams = inputs["image_size"], inputs["state_dim"], inputs["cameras"]
        rng = np.random.default_rng(1)
        views = [rng.integers(0, 256, (size, size, 3), dtype=np.uint8) for _ in cams]
        state = rng.normal(size=state_dim).astype(np.float32)
        obs = {inputs["image_keys"][i]: v for i, v in enumerate(views)}
        obs.update({inputs["state_key"]: state, inputs["prompt_key"]: "open the drawer", "seed": 5})
        served = np.asarray(client.infer(obs)["actions"])
        client.close()
    d = tmp_path / "s"
    d.mkdir()
    write_video(d / "obs.mp4", np.concatenate(views, axis=1)[None].repeat(2, 0), 10)  # cameras side by side
    png = np.concatenate(views, axis=1)
    import PIL.Image

    PIL.Image.fromarray(png).save(d / "obs.png")
    sample = {"vision_path": "obs.png", "prompt": "open the drawer", "seed": 5, "state": state.tolist()}
    (d / "a.json").write_text(json.dumps(sample))
    argv = ["infer", "-i", str(d / "a.json"), "-o", str(tmp_path / "out"), *serve]
    assert wamkit(argv) == 0, capsys.readouterr().out
    out = json.loads((tmp_path / "out" / "a" / "sample_outputs.json").read_text())
    np.testing.assert_array_equal(np.asarray(out["outputs"][0]["content"]["action"], np.float32), served)
