"""The evaluator's backends (wamkit.eval.backends): chosen by eval.backend from a registry, each behind
the interface the scheduler uses. The OpenPI backend runs against a real wamkit server that sends empty
metadata (as openpi's servers and cosmos-framework's RoboLab server do) and against openpi-client's own
msgpack types; faults (a malformed reply, an error frame, an unreachable server) are real sockets.
"""

from __future__ import annotations

import contextlib
import json
import threading
from types import SimpleNamespace

import numpy as np
import pytest
from openpi_client import msgpack_numpy as openpi_msgpack
from websockets.sync.server import serve as sync_serve

from tests.eval_helpers import DELAY, eval_config, results
from wamkit.config import ConfigError
from wamkit.constants import OBS_STATE, TASK, image_key
from wamkit.eval import backends
from wamkit.eval.backends import openpi
from wamkit.eval.backends.base import BackendError, Patience, Target
from wamkit.eval.runner import UNIDENTIFIED, run_eval
from wamkit.eval.server_proc import start_server_process
from wamkit.serve.codec import packb, unpackb

CONNECTED: list[str] = []  # the toy backend's connections (its module is this one)


def connect(target, patience):
    """A toy backend, registered at test time: wamkit's own connection, counted."""
    CONNECTED.append(target.url)
    return backends.connect("wamkit", target, patience)


@pytest.fixture(scope="module")
def served():
    """A delay server as wamkit sends it, and one that sends {} on connect."""
    with start_server_process(DELAY) as full, start_server_process([*DELAY, "--empty-metadata"]) as bare:
        yield full, bare


@pytest.fixture(scope="module")
def wamkit_run(served, tmp_path_factory):
    out = tmp_path_factory.mktemp("wamkit")
    run_eval(eval_config(served[0].url, out), progress=False)
    return out


def plan(out):
    return json.loads((out / "plan.json").read_text())


def test_an_unknown_backend_is_refused_naming_the_registered_ones(tmp_path):
    with pytest.raises(
        ConfigError,
        match=r"eval.backend='sglangg'; expected one of cosmos_http, openpi, sglang, vllm_omni, wamkit",
    ):
        run_eval(eval_config("ws://127.0.0.1:1", tmp_path, "eval.backend=sglangg"), progress=False)


def test_a_backend_registered_at_test_time_reaches_the_evaluator(served, wamkit_run, tmp_path):
    """A new engine is a module and a registry line: nothing else in the evaluator changes."""
    backends.register("toy", __name__)
    CONNECTED.clear()
    run_eval(eval_config(served[0].url, tmp_path, "eval.backend=toy"), progress=False)
    assert CONNECTED and set(CONNECTED) == {served[0].url}
    assert results(tmp_path) == results(wamkit_run)
    assert plan(tmp_path)["server"]["backend"] == "toy"


def test_openpi_backend_evaluates_a_server_that_says_nothing(served, wamkit_run, tmp_path):
    """One observation per request in openpi's LIBERO keys, concurrent over the stage: the same
    episodes as wamkit's batched requests to the same model; plan.json says nothing could be told."""
    run_eval(eval_config(served[1].url, tmp_path, "eval.backend=openpi"), progress=False)
    assert results(tmp_path) == results(wamkit_run)
    server = plan(tmp_path)["server"]
    assert server["backend"] == "openpi" and server["identity"] is None
    assert server["unidentified"] == UNIDENTIFIED
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["plan"]["server"]["unidentified"] == UNIDENTIFIED
    assert f"server: {UNIDENTIFIED}" in (tmp_path / "results.md").read_text()
    # --resume through another backend is another evaluation: refused, naming what changed (one
    # episode taken out of the journal, so that there is something to resume)
    journal = tmp_path / "episodes.jsonl"
    journal.write_text("".join(journal.read_text().splitlines(keepends=True)[:-1]))
    with pytest.raises(ConfigError, match=r"backend: 'openpi' -> None"):
        run_eval(eval_config(served[1].url, tmp_path), resume=True, progress=False)


def test_openpi_backend_reads_what_a_wamkit_server_says(served):
    target = Target(served[0].url, ("corner",))
    policy = backends.connect("openpi", target, Patience())
    try:
        assert policy.identity["model"] == "delay"  # the metadata's identity, as the wamkit backend reads it
    finally:
        policy.close()


def test_openpi_requests_are_openpi_clients_own_types():
    """What the backend sends decodes with openpi-client's msgpack_numpy into the keys and types of
    openpi's LIBERO example (examples/libero/main.py): uint8 images, float32 state, a str prompt."""
    obs = {
        image_key("agentview"): np.full((8, 8, 3), 7, np.uint8),
        image_key("wrist"): np.full((8, 8, 3), 9, np.uint8),
        OBS_STATE: np.arange(8, dtype=np.float64),
        TASK: "put the bowl on the plate",
    }
    keys = openpi.request_keys(SimpleNamespace(suite="libero_10"))  # the LIBERO profile's client keys
    got = openpi_msgpack.unpackb(packb(openpi.request(obs, ("agentview", "wrist"), keys)))
    assert sorted(got) == ["observation/image", "observation/state", "observation/wrist_image", "prompt"]
    assert got["observation/image"].dtype == np.uint8 and got["observation/image"].shape == (8, 8, 3)
    assert (got["observation/wrist_image"] == 9).all()
    assert got["observation/state"].dtype == np.float32
    np.testing.assert_array_equal(got["observation/state"], np.arange(8))
    assert got["prompt"] == "put the bowl on the plate"


@contextlib.contextmanager
def fake_openpi(reply):
    """An OpenPI websocket server on a real socket: {} on connect, then ``reply(request)`` (bytes or
    str) for each request."""

    def handler(ws):
        ws.send(openpi_msgpack.packb({}))
        for message in ws:
            ws.send(reply(openpi_msgpack.unpackb(message)))

    with sync_serve(handler, "127.0.0.1", 0, compression=None, max_size=None) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            yield f"ws://127.0.0.1:{server.socket.getsockname()[1]}"
        finally:
            server.shutdown()


OBS = {image_key("corner"): np.zeros((4, 4, 3), np.uint8), OBS_STATE: np.zeros(4, np.float32), TASK: "reach"}


def test_openpi_replies_built_with_openpi_clients_packer_are_read(tmp_path):
    """``actions`` (openpi) or ``action`` (cosmos-framework's RoboLab server), packed by openpi-client."""
    for key in ("actions", "action"):
        with fake_openpi(lambda req, key=key: openpi_msgpack.packb({key: np.ones((5, 4))})) as url:
            policy = backends.connect(
                "openpi", Target(url, ("corner",), options={"connections": 2}), Patience()
            )
            actions, _, call = policy([OBS, OBS, OBS])
            policy.close()
        assert actions.shape == (3, 5, 4) and actions.dtype == np.float32 and call == 3


@pytest.mark.parametrize(
    ("reply", "match"),
    [
        (
            lambda req: openpi_msgpack.packb({"pose": np.ones((5, 4))}),
            r"reply lacks 'actions' \(keys: \['pose'\]\)",
        ),
        (
            lambda req: openpi_msgpack.packb({"actions": np.ones(4)}),
            r"actions: shape \[4\], expected \[1, horizon, action_dim\]",
        ),
        (lambda req: openpi_msgpack.packb({"actions": np.full((5, 4), np.nan)}), r"actions: holds NaN"),
    ],
    ids=["no actions", "wrong shape", "nan"],
)
@pytest.mark.parametrize("backend", ["openpi", "wamkit"])
def test_a_wrong_reply_names_the_backend_the_url_and_the_field(reply, match, backend):
    """Every backend checks its replies alike (wamkit's own sends a batch axis: a [5, 4] reply to one
    observation is one chunk of 5 steps to it too)."""
    with fake_openpi(reply) as url:
        policy = backends.connect(backend, Target(url, ("corner",)), Patience())
        with pytest.raises(BackendError, match=rf"eval.backend={backend} at {url}: {match}"):
            policy([OBS])
        policy.close()


def test_the_note_of_a_server_that_names_nothing_is_not_part_of_its_location():
    """A plan written before the note existed resumes against the same server; another URL is still
    another server."""
    from wamkit.eval.journal import server_diff

    old = {"url": "ws://127.0.0.1:8000", "backend": "openpi", "identity": None}
    new = {**old, "unidentified": UNIDENTIFIED}
    assert server_diff(old, new) == []
    assert server_diff(new, {**new, "url": "ws://127.0.0.1:8001"}) == [
        "url: 'ws://127.0.0.1:8000' -> 'ws://127.0.0.1:8001'"
    ]


def test_an_action_of_another_width_than_the_env_takes_is_refused():
    from wamkit.envs import suite_info

    info = suite_info("metaworld")
    with fake_openpi(lambda req: openpi_msgpack.packb({"actions": np.ones((5, info.action_dim + 3))})) as url:
        policy = backends.connect("openpi", Target(url, ("corner",), info), Patience())
        with pytest.raises(
            BackendError, match=rf"action width {info.action_dim + 3}, expected {info.action_dim}"
        ):
            policy([OBS])
        policy.close()


def test_an_unreachable_server_fails_at_connect_naming_its_url():
    """The evaluator connects once before any env worker starts (runner._probe): that connection fails."""
    with pytest.raises(ConnectionError, match=r"cannot connect to ws://127.0.0.1:9"):
        backends.connect("openpi", Target("ws://127.0.0.1:9", ("corner",)), Patience(connect_timeout_s=0.3))


def test_an_error_frame_is_the_servers_own_message():
    from wamkit.serve.client import ServerError

    with fake_openpi(lambda req: "Traceback: the policy broke") as url:
        policy = backends.connect("openpi", Target(url, ("corner",)), Patience())
        with pytest.raises(ServerError, match="the policy broke"):
            policy([OBS])
        policy.close()


def test_unpackb_reads_openpi_clients_arrays():
    """The codec the backends share reads openpi-client's own packing (both ways)."""
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    np.testing.assert_array_equal(unpackb(openpi_msgpack.packb({"x": a}))["x"], a)
    np.testing.assert_array_equal(openpi_msgpack.unpackb(packb({"x": a}))["x"], a)
