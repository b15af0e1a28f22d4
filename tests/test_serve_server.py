"""The server with real sockets and the unchanged openpi-client: metadata, transforms, keys, modes, errors."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
from openpi_client.websocket_client_policy import WebsocketClientPolicy
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from wamkit.actions.stats import FeatureStats, StatsFile
from wamkit.config import ModelConfig, ServeConfig, load_config
from wamkit.models import build_model
from wamkit.models.pretrained import save_pretrained
from wamkit.serve.client import PolicyClient, ServerError
from wamkit.serve.codec import packb, unpackb
from wamkit.serve.loading import load_served, random_init
from wamkit.serve.policy import RequestError, ServedPolicy
from wamkit.serve.server import start_server_in_thread

from .child_env import start_logged, wait_for_log
from .conftest import spec_of
from .exactness import assert_rounding_close

STATE_Q = (-2.0, 3.0)  # q01, q99 of every state dim
ACT_Q01, ACT_Q99 = np.array([-0.5, 0.0, 1.0, -1.0]), np.array([0.5, 2.0, 3.0, 1.0])


def metaworld_stats() -> StatsFile:
    def feat(q01, q99):
        q01, q99 = np.asarray(q01, float), np.asarray(q99, float)
        return FeatureStats(
            mean=((q01 + q99) / 2).tolist(), std=[1.0] * len(q01), min=q01.tolist(), max=q99.tolist(),
            q01=q01.tolist(), q99=q99.tolist(), count=10,
        )  # fmt: skip

    return StatsFile(
        features={
            "action": feat(ACT_Q01, ACT_Q99),
            "observation.state": feat([STATE_Q[0]] * 39, [STATE_Q[1]] * 39),
        },
        metadata={"representation": "raw", "chunk": 16, "action_dim": 4, "fps": 10, "gripper": "env"},
    )


def metaworld_spec(io):
    return spec_of(metaworld_stats(), io)


def expected_actions(state: np.ndarray, image: np.ndarray, offset: float = 0.0) -> np.ndarray:
    """The delay model's env-ready reply, computed by hand from the formulas (quantile norm both ways)."""
    s = 2 * (state - STATE_Q[0]) / (STATE_Q[1] - STATE_Q[0]) - 1
    m = image.astype(np.float64).mean() / 255
    t = np.arange(16)[:, None]
    y = np.tanh(s[np.arange(4) % 39][None] + 0.1 * t + 0.5 * m) + offset
    return (y + 1) / 2 * (ACT_Q99 - ACT_Q01) + ACT_Q01


def obs(seed: int, size: int = 128) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "observation.images.corner": rng.integers(0, 256, (size, size, 3), dtype=np.uint8),
        "observation.state": rng.uniform(-2, 3, 39).astype(np.float32),
        "prompt": f"task {seed}",
    }


@pytest.fixture(scope="module")
def policy() -> ServedPolicy:
    adapter = build_model(ModelConfig(name="delay", preset="small"))
    return ServedPolicy(adapter, metaworld_spec(adapter.io))


@pytest.fixture(scope="module")
def server(policy):
    with start_server_in_thread(policy, max_wait_ms=1.0) as srv:
        yield srv


def test_openpi_client_reads_metadata_and_gets_env_ready_actions(server):
    client = WebsocketClientPolicy("127.0.0.1", server.port)
    meta = client.get_server_metadata()
    assert meta["model"] == "delay" and meta["chunk"] == 16 and meta["action_space"]["dim"] == 4
    assert meta["inputs"]["image_keys"] == ["observation.images.corner"] and meta["inputs"]["state_dim"] == 39
    for seed in range(3):
        o = obs(seed)
        reply = client.infer(o)
        assert reply["actions"].shape == (16, 4) and reply["actions"].dtype == np.float32
        np.testing.assert_allclose(
            reply["actions"],
            expected_actions(o["observation.state"], o["observation.images.corner"]),
            atol=1e-5,
        )
        assert reply["server_timing"]["batch_size"] >= 1 and reply["server_timing"]["infer_ms"] >= 0


def test_raw_actions_flag_returns_model_output(policy):
    raw = ServedPolicy(policy.adapter, policy.spec, raw_actions=True)
    with start_server_in_thread(raw) as srv, PolicyClient(srv.url) as client:
        assert client.metadata["action_space"]["raw"] is True
        o = obs(7)
        got = client.infer(o)["actions"]
    want = (expected_actions(o["observation.state"], o["observation.images.corner"]) - ACT_Q01) / (
        ACT_Q99 - ACT_Q01
    ) * 2 - 1
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_batched_request_equals_single_requests_and_images_are_resized(server):
    with PolicyClient(server.url) as client:
        singles = [obs(s) for s in range(5)]
        batched = {
            k: np.stack([o[k] for o in singles]) for k in ("observation.images.corner", "observation.state")
        }
        batched["prompt"] = [o["prompt"] for o in singles]
        reply = client.infer(batched)["actions"]
        assert reply.shape == (5, 16, 4)
        for i, o in enumerate(singles):
            np.testing.assert_allclose(reply[i], client.infer(o)["actions"], atol=1e-6)
        big = obs(3, size=256)  # a uniform-ish random image keeps its mean under resizing
        got = client.infer(big)["actions"]
        np.testing.assert_allclose(
            got, expected_actions(big["observation.state"], big["observation.images.corner"]), atol=2e-3
        )


def test_openpi_libero_keys_map_to_cameras_in_order():
    policy = random_init("delay", "libero", device="cpu")
    assert policy.env_action_dim == 7
    rng = np.random.default_rng(0)
    agent, wrist = (
        rng.integers(0, 128, (128, 128, 3), np.uint8),
        rng.integers(128, 256, (128, 128, 3), np.uint8),
    )
    state = rng.standard_normal(8).astype(np.float32)
    with start_server_in_thread(policy) as srv:
        client = WebsocketClientPolicy(srv.url)
        assert (
            client.get_server_metadata()["inputs"]["openpi_keys"]["observation/wrist_image"]
            == "observation.images.wrist"
        )
        openpi = client.infer(
            {
                "observation/image": agent,
                "observation/wrist_image": wrist,
                "observation/state": state,
                "prompt": "p",
            }
        )
        ours = client.infer(
            {
                "observation.images.agentview": agent,
                "observation.images.wrist": wrist,
                "observation.state": state,
                "prompt": "p",
            }
        )
        swapped = client.infer(
            {
                "observation/image": wrist,
                "observation/wrist_image": agent,
                "observation/state": state,
                "prompt": "p",
            }
        )
    assert openpi["actions"].shape == (16, 7)
    np.testing.assert_array_equal(openpi["actions"], ours["actions"])
    assert not np.allclose(openpi["actions"], swapped["actions"])


def test_modes_inverse_and_forward_dynamics(server, policy):
    o = obs(1)
    goal = np.full((128, 128, 3), 255, np.uint8)
    with PolicyClient(server.url) as client:
        inv = client.infer({**o, "mode": "inverse_dynamics", "goal_image": goal, "seed": 3})["actions"]
        fwd = client.infer({**o, "mode": "forward_dynamics", "actions": np.ones((16, 4), np.float32)})[
            "frames"
        ]
    base = expected_actions(o["observation.state"], o["observation.images.corner"])
    np.testing.assert_allclose(
        inv, base + (ACT_Q99 - ACT_Q01) / 2, atol=1e-4
    )  # + goal mean 1.0 in model space
    assert fwd.shape == (128, 128, 3) and fwd.dtype == np.uint8
    assert not np.array_equal(fwd, o["observation.images.corner"])


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"observation.state": np.zeros(5, np.float32)}, r"observation\.state: expected shape \[39\]"),
        ({"observation.images.corner": np.zeros((128, 128, 3), np.float32)}, "expected dtype uint8"),
        ({"observation.images.corner": np.zeros((128, 128), np.uint8)}, r"expected uint8 images \[H, W, 3\]"),
        ({"observation.images.top": np.zeros((8, 8, 3), np.uint8)}, "unknown key 'observation.images.top'"),
        ({"prompt": ["a", "b"]}, "prompt: expected a string"),
        ({"mode": "dream"}, "mode: 'dream' is not one of"),
        ({"observation.state": np.full(39, np.nan, np.float32)}, "non-finite"),
        ({"goal_image": np.zeros((8, 8, 3), np.uint8)}, "belongs to mode 'inverse_dynamics'"),
    ],
)
def test_bad_request_gets_text_frame_naming_it_then_close_1011(server, change, needle):
    with connect(server.url) as ws:
        unpackb(ws.recv(timeout=60))  # metadata
        ws.send(packb({**obs(0), **change}))
        text = ws.recv(timeout=60)
        assert isinstance(text, str) and re.search(needle, text), text
        with pytest.raises(ConnectionClosed):  # not a TimeoutError: the server closed it
            ws.recv(timeout=60)
        assert ws.close_code == 1011
    with PolicyClient(server.url) as client:  # the server is still fine
        assert client.infer(obs(0))["actions"].shape == (16, 4)


def test_client_raises_server_error_and_recovers(server):
    with PolicyClient(server.url) as client:
        with pytest.raises(ServerError, match="lacks observation.state"):
            client.infer({"prompt": "x", "observation.images.corner": np.zeros((8, 8, 3), np.uint8)})
        assert client.infer(obs(2))["actions"].shape == (16, 4)  # reconnected by itself


def test_healthz_and_metrics(server):
    base = f"http://127.0.0.1:{server.port}"
    assert urllib.request.urlopen(f"{base}/healthz").status == 200
    with PolicyClient(server.url) as client:
        client.infer(obs(0))
    text = urllib.request.urlopen(f"{base}/metrics").read().decode()
    values = dict(re.findall(r"^(\S+) (\S+)$", text, re.M))
    assert float(values["wamkit_requests_total"]) >= 1
    assert (
        float(values['wamkit_batch_size_bucket{le="+Inf"}']) == float(values["wamkit_model_calls_total"]) >= 1
    )
    assert 'wamkit_request_latency_seconds{quantile="0.99"}' in values
    assert float(values['wamkit_errors_total{kind="request"}']) >= 0


def _start_cli(log: Path, *args: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "wamkit", "serve", *args, "--port", "0", "--device", "cpu"]
    return start_logged(cmd, log)


def _port(proc: subprocess.Popen, log: Path) -> int:
    """The port a ``wamkit serve --port 0`` process logged."""
    return int(wait_for_log(proc, log, r"serving \S+ on ws://127\.0\.0\.1:(\d+)", timeout=120).group(1))


def _export(root) -> np.ndarray:
    """A serving directory of the delay model (offset 0.25) with the stats above; return obs(4)'s answer."""
    adapter = build_model(ModelConfig(name="delay", preset="small", options={"delay_ms": 1}))
    with torch.no_grad():
        adapter.module.offset.fill_(0.25)
    save_pretrained(adapter, root)
    metaworld_spec(adapter.io).save(root / "preprocess.json")
    o = obs(4)
    return expected_actions(o["observation.state"], o["observation.images.corner"], offset=0.25)


def test_serving_directory_loads_exactly(tmp_path):
    want = _export(tmp_path / "export")
    np.testing.assert_allclose(
        load_served(tmp_path / "export", "cpu").infer(obs(4))["actions"], want, atol=1e-5
    )


def test_serve_cli_starts_and_answers(tmp_path):
    want = _export(tmp_path / "export")
    # both processes start at once (the imports dominate)
    logs = [tmp_path / "export.log", tmp_path / "delay.log"]
    procs = [
        _start_cli(logs[0], str(tmp_path / "export")),
        _start_cli(logs[1], "--model", "delay", "--random-init", "--option", "delay_ms=20"),
    ]
    try:
        with PolicyClient(f"127.0.0.1:{_port(procs[0], logs[0])}") as client:
            np.testing.assert_allclose(client.infer(obs(4))["actions"], want, atol=1e-5)
        with PolicyClient(f"127.0.0.1:{_port(procs[1], logs[1])}") as client:
            assert client.metadata["source"] == "random-init delay/small"
            assert client.infer(obs(4))["actions"].shape == (16, 4)
        procs[1].send_signal(signal.SIGINT)  # Ctrl-C: the model's (main) thread stops the server
        assert procs[1].wait(20) == 0
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(20)


def test_serving_directory_missing_file_is_named(tmp_path):
    (tmp_path / "model.json").write_text("{}")
    with pytest.raises(ValueError, match="lacks model.safetensors, preprocess.json"):
        load_served(tmp_path, "cpu")


def test_serving_directory_from_before_the_spec_is_refused_with_the_fix(tmp_path):
    _export(tmp_path)
    (tmp_path / "preprocess.json").rename(tmp_path / "stats.json")
    with pytest.raises(ValueError, match=r"exported before the preprocessing spec.*wamkit convert"):
        load_served(tmp_path, "cpu")


def test_tiny_model_seeded_request_matches_in_process_call():
    policy = random_init("tiny", "small", {"num_steps": 2}, device="cpu")
    o = obs(5)
    with start_server_in_thread(policy, max_wait_ms=20.0) as srv, PolicyClient(srv.url) as client:
        served = client.infer({**o, "seed": 11})["actions"]
        batched = client.infer({k: (np.stack([v, v]) if k != "prompt" else [v, v]) for k, v in o.items()})[
            "actions"
        ]
    np.testing.assert_array_equal(served, policy.infer({**o, "seed": 11})["actions"])
    assert batched.shape == (2, 16, 4) and np.isfinite(batched).all()
    assert not np.array_equal(batched[0], batched[1])  # unseeded: each observation draws its own noise


def test_seeded_requests_from_two_clients_share_a_model_call_and_keep_their_own_noise():
    """Seeded requests batch together (no longer a call each): every row draws its noise from its own
    seed, so each reply equals the in-process call with that seed, up to the reordered float32 sums of
    another batch size (tests/exactness.py; the tiny model is 160 wide, 3 deep, 2 steps)."""
    import threading

    policy = random_init("tiny", "small", {"num_steps": 2}, device="cpu")
    sent = {0: {**obs(5), "seed": 11}, 1: {**obs(6), "seed": 12}}
    replies: dict[int, dict] = {}
    with start_server_in_thread(policy, max_wait_ms=300.0) as srv:
        clients = {i: PolicyClient(srv.url) for i in sent}
        barrier = threading.Barrier(len(sent))

        def ask(i):
            barrier.wait()
            replies[i] = clients[i].infer(sent[i])

        threads = [threading.Thread(target=ask, args=(i,)) for i in sent]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        batched = clients[0].infer(
            {k: (np.stack([v, v]) if k != "prompt" else [v, v]) for k, v in obs(5).items()}
            | {"seed": [11, 3]}
        )["actions"]
        for c in clients.values():
            c.close()
    assert [replies[i]["server_timing"]["batch_size"] for i in sent] == [2, 2]  # one model call
    for i, o in sent.items():
        assert_rounding_close(replies[i]["actions"], policy.infer(o)["actions"], length=160 * 3 * 2)
    assert_rounding_close(batched[0], replies[0]["actions"], length=160 * 3 * 2)
    assert not np.allclose(batched[0], batched[1])
    two = {k: (np.stack([v, v]) if k != "prompt" else [v, v]) for k, v in obs(5).items()}
    assert policy.prepare({**two, "seed": 4}).seeds == [4, 5]
    assert policy.prepare({**two, "seed": np.array([9, 2])}).seeds == [9, 2]
    with pytest.raises(RequestError, match=r"seed: expected an integer or 2 integers \(one per row\)"):
        policy.prepare({**two, "seed": [1, 2, 3]})


def test_two_camera_dynamics_take_every_cameras_goal_and_return_the_rollout():
    pytest.importorskip("diffusers")
    policy = random_init("cosmos3", "tiny", device="cpu")
    cams = policy.io.cameras
    assert len(cams) == 2
    rng = np.random.default_rng(0)
    size = policy.io.image_size
    o = {f"observation.images.{c}": rng.integers(0, 256, (size, size, 3), dtype=np.uint8) for c in cams}
    o |= {
        "observation.state": np.zeros(policy.io.state_dim, np.float32),
        "prompt": "put the bowl on the plate",
    }
    goals = {f"goal_image.{c}": rng.integers(0, 256, (size, size, 3), dtype=np.uint8) for c in cams}
    with pytest.raises(RequestError, match=f"lacks goal_image.{cams[1]}"):
        policy.prepare({**o, "mode": "inverse_dynamics", "goal_image": goals[f"goal_image.{cams[0]}"]})
    acts = policy.infer({**o, "mode": "inverse_dynamics", "seed": 0, **goals})["actions"]
    assert acts.shape == (policy.io.chunk, policy.env_action_dim)
    chunk = np.zeros((policy.io.chunk, policy.env_action_dim), np.float32)
    reply = policy.infer({**o, "mode": "forward_dynamics", "seed": 0, "actions": chunk})
    assert reply["video"].dtype == np.uint8 and reply["video"].ndim == 4
    np.testing.assert_array_equal(reply["frames"], reply["video"][-1])


def test_precision_resolves_per_device_and_enters_the_identity(tmp_path):
    want = _export(tmp_path / "export")
    policy = load_served(tmp_path / "export", "cpu")  # auto on the CPU: fp32, no autocast
    assert policy.autocast is None and policy.metadata()["identity"]["autocast"] == "off"
    np.testing.assert_allclose(policy.infer(obs(4))["actions"], want, atol=1e-5)
    with pytest.raises(
        ValueError, match=r"serve.precision=bf16 needs the model on a CUDA device; it is on cpu"
    ):
        load_served(tmp_path / "export", "cpu", precision="bf16")
    with pytest.raises(
        ValueError, match=r"serve.precision: expected one of auto, fp32, bf16, fp8, got 'half'"
    ):
        ServeConfig(precision="half")  # the setting is checked once, by its config
    with pytest.raises(ValueError, match=r"serve.precision=bf16 needs a CUDA device"):
        load_config(None, ["serve.precision=bf16", "serve.device=cpu"])
    # the autocast a CUDA server resolves to wraps the model call (bf16 autocast runs on the CPU too)
    policy.autocast = torch.bfloat16
    got = policy.infer(obs(4))["actions"]
    assert not np.array_equal(got, want)  # computed in bf16 ...
    np.testing.assert_allclose(got, want, atol=0.1)  # ... as the same model
