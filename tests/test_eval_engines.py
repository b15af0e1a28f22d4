"""The backends for the Cosmos3 engines (SGLang, vLLM-Omni, cosmos-framework's LIBERO server), on real
sockets against stand-ins built from the engines' own request and response code
(tests/engine_servers.py): every request wamkit builds is read and validated by that code, every answer
the backend parses is written by it. The client's preprocessing is the model's own: the caption and
canvas equal the Cosmos3 adapter's, the decoding the run's spec."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from wamkit.actions.normalize import make_normalizer

pytest.importorskip("diffusers")

from tests import engine_servers as es  # noqa: E402
from tests.eval_helpers import eval_config, results  # noqa: E402
from wamkit.actions.cosmos3 import action_canvas, action_prompt  # noqa: E402
from wamkit.actions.gripper import get_convention  # noqa: E402
from wamkit.actions.pose import from_rot6d_action  # noqa: E402
from wamkit.actions.spec import PreprocessSpec  # noqa: E402
from wamkit.actions.stats import FeatureStats, StatsFile  # noqa: E402
from wamkit.config import ConfigError, ModelConfig  # noqa: E402
from wamkit.constants import ACTION, OBS_STATE, TASK, image_key  # noqa: E402
from wamkit.data import compute_stats  # noqa: E402
from wamkit.envs.suites import suite_info  # noqa: E402
from wamkit.eval import backends  # noqa: E402
from wamkit.eval.backends import sglang, vllm_omni  # noqa: E402
from wamkit.eval.backends.base import (  # noqa: E402
    BackendError,
    Patience,  # noqa: E402
    Target,
)
from wamkit.eval.backends.cosmos3 import Cosmos3Client  # noqa: E402
from wamkit.eval.runner import run_eval  # noqa: E402
from wamkit.files import MODEL_FILE, model_json  # noqa: E402
from wamkit.models import ModelIO, build_model  # noqa: E402
from wamkit.serve.codec import packb  # noqa: E402

CAMS = ("image", "wrist_image")
TASKS = ["put the black bowl on the plate", "open the top drawer of the cabinet", "stop"]
ENGINES = ("sglang", "vllm_omni", "cosmos_http")


@pytest.fixture(scope="module")
def adapter():
    """A tiny Cosmos3 model of LIBERO's shape: its model.json and prompts are the reference."""
    return build_model(
        ModelConfig(name="cosmos3", preset="tiny"), ModelIO(CAMS, 32, 8, 10, 16, "libero_rot6d")
    )


def write_serving_dir(path: Path, spec: PreprocessSpec, adapter) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    spec.save(path / "preprocess.json")
    (path / MODEL_FILE).write_text(json.dumps(model_json(adapter.config_dict())))
    return path


@pytest.fixture(scope="module")
def libero_dir(adapter, libero_tiny, tmp_path_factory):
    """A LIBERO run's saved preprocessing: quantile stats of rot6d actions from the lerobot fixture."""
    stats = compute_stats(libero_tiny, "libero_rot6d", chunk=16)
    spec = PreprocessSpec.create(stats, normalization="quantile", clip=False, image_size=32,
                                 resize="bilinear_antialias", cameras=CAMS, chunk=16)  # fmt: skip
    return write_serving_dir(tmp_path_factory.mktemp("libero_serving"), spec, adapter)


@pytest.fixture(scope="module")
def metaworld_dir(adapter, tmp_path_factory):
    """A MetaWorld run's saved preprocessing (the suite the small evaluation runs), with stats that are
    not the identity, so that the decoding shows."""
    info = suite_info("metaworld")
    rng = np.random.default_rng(0)
    acts = rng.uniform(-1, 1, (500, info.action_dim)) * [0.5, 0.4, 0.3, 1.0]
    meta = {
        "representation": "raw",
        "gripper": "env",
        "fps": info.fps,
        "chunk": 4,
        "action_dim": info.action_dim,
    }
    stats = StatsFile({ACTION: FeatureStats.from_array(acts),
                       OBS_STATE: FeatureStats.from_array(rng.normal(size=(500, info.state_dim)))}, meta)  # fmt: skip
    spec = PreprocessSpec.create(stats, normalization="quantile", clip=False, image_size=32,
                                 resize="bilinear_antialias", cameras=("corner",), chunk=4)  # fmt: skip
    return write_serving_dir(tmp_path_factory.mktemp("metaworld_serving"), spec, adapter)


def libero_obs(n: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{image_key(c): rng.integers(0, 256, (48, 48, 3), dtype=np.uint8) for c in CAMS}
            | {OBS_STATE: np.zeros(8), TASK: TASKS[i % len(TASKS)]} for i in range(n)]  # fmt: skip


def target(url: str, serving: Path, **options) -> Target:
    return Target(url, CAMS, options={"serving_dir": str(serving), **options})


def expected(client: Cosmos3Client, obs: dict, normalized: bool = True) -> np.ndarray:
    """What the stand-in's model answers for ``obs``, decoded by the run's spec."""
    a = es.toy_actions(client.frame(obs), obs[TASK], client.chunk, client.spec.action_dim)
    return client.spec.decode_actions(a, normalized=normalized)


# -- the client's preprocessing is the model's own -----------------------------------------------------
def test_the_clients_views_canvas_and_caption_are_the_adapters(adapter, libero_dir):
    client = Cosmos3Client.load("sglang", target("http://x", libero_dir))
    obs = libero_obs(1)[0]
    frame = client.frame(obs)
    batch = {image_key(c): client.spec.resize_images(obs[image_key(c)])[None] for c in CAMS}
    np.testing.assert_array_equal(frame, adapter._views(batch)[0])  # side by side, as training composed it
    assert frame.shape == (32, 64, 3)
    for hw in [(32, 64), (256, 512), (128, 128), (480, 640)]:  # the canvas: diffusers' rule, as the adapter's
        assert client.canvas(np.zeros((*hw, 3), np.uint8)) == adapter._canvas_hw(np.zeros((*hw, 3), np.uint8))
    hw = client.canvas(frame)
    assert client.caption(obs[TASK], hw) == adapter.prompt(obs[TASK], hw, adapter.inference_idle_frames)


def test_decoding_undoes_the_run_s_normalisation_and_rot6d(libero_dir):
    client = Cosmos3Client.load("sglang", target("http://x", libero_dir))
    a = es.toy_actions(np.full((4, 4, 3), 90, np.uint8), "x", 16, 10)
    env = client.decode(a[None], 1, "values", normalized=True)[0]
    raw = make_normalizer(client.spec.normalization, client.spec.stats[ACTION]).unnormalize(
        a.astype(np.float64)
    )
    want = from_rot6d_action(raw)  # rot6d -> axis-angle, as LIBERO's env takes it
    np.testing.assert_allclose(env[:, :6], want[:, :6], rtol=0, atol=1e-5)  # float32 of a float64 result
    np.testing.assert_array_equal(
        env[:, 6], get_convention(client.spec.gripper).to_env(raw[:, -1]).astype(np.float32)
    )
    assert env.shape == (16, 7)
    # a server that undid the normalisation itself: only the representation and the gripper change
    np.testing.assert_allclose(client.decode(raw[None], 1, "values", normalized=False)[0], env, atol=1e-5)


def test_sglang_requests_pass_sglangs_own_validation(libero_dir):
    """What the backend sends, read by SGLang's msgpack hook, request-to-observation and Cosmos3
    request code into its Cosmos3SamplingParams (whose _adjust runs), holds the run's preprocessing."""
    sg = es.sglang()
    client = Cosmos3Client.load("sglang", target("http://x", libero_dir))
    obs = libero_obs(3)
    payload = sg.protocol.unpack_msgpack(packb(sglang.request(client, obs, seed=7)))
    sp = sg.cosmos3.build_cosmos3_action_sampling_params(
        payload,
        sg.protocol._action_request_to_observation(payload),
        es.sglang_server_args(8),
        sg.SamplingParams,
    )
    assert sp.prompt == [o[TASK] for o in obs] and sp.action_mode == "policy"
    for image, o in zip(sp.image_path, obs):
        np.testing.assert_array_equal(np.asarray(image), client.frame(o))
    assert (sp.height, sp.width) == action_canvas((32, 64), 256)
    assert sp.num_frames == 17 and sp.raw_action_dim == 10 and sp.domain_name == "libero"
    assert sp.action_view_point == "concat_view" and sp.fps == 20 and sp.seed == 7
    assert sp.num_inference_steps == client.steps
    # the caption SGLang writes from these (cosmos3_action.py:125-161) is diffusers' own, without the
    # view description and idle-frame entry wamkit's LIBERO recipe trains with (docs/eval.md says so)
    sglang_caption = sg_caption(sp.prompt[0], sp)
    plain = action_prompt(sp.prompt[0], view_point="concat_view", view_description="", num_frames=17,
                          fps=20.0, height=sp.height, width=sp.width, idle_frames=None, chunk=16)  # fmt: skip
    assert json.loads(sglang_caption) == json.loads(plain)
    assert sglang_caption != client.caption(sp.prompt[0], (sp.height, sp.width))


def sg_caption(task: str, sp) -> str:
    import importlib.util

    path = (
        es.SGLANG
        / "sglang/multimodal_gen/runtime/pipelines_core/stages/model_specific_stages/cosmos3_action.py"
    )
    spec = importlib.util.spec_from_file_location("sglang_cosmos3_action", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.build_action_prompt(task, sp.action_view_point, sp.num_frames, sp.fps, sp.height, sp.width)


def test_vllm_omni_forms_pass_vllm_omnis_own_model(libero_dir):
    vo = es.vllm_omni()
    client = Cosmos3Client.load("vllm_omni", target("http://x", libero_dir))
    obs = libero_obs(1)[0]
    fields, png = vllm_omni.form(client, obs, seed=3)
    req = vo.videos.VideoGenerationRequest(**{k: v for k, v in fields.items() if k != "extra_params"},
                                           extra_params=json.loads(fields["extra_params"]))  # fmt: skip
    vp = req.resolve_video_params()
    hw = client.canvas(client.frame(obs))
    assert (vp.height, vp.width, vp.num_frames, vp.fps) == (hw[0], hw[1], 17, 20.0)
    assert req.num_inference_steps == client.steps and req.seed == 3
    assert req.extra_params == {"action_mode": "policy", "domain_name": "libero", "raw_action_dim": 10,
                                "action_chunk_size": 16}  # fmt: skip
    assert req.prompt == client.caption(obs[TASK], hw)  # the caption training wrote, as the client's
    assert set(req.extra_params) <= es_cosmos3_extra_params()


def es_cosmos3_extra_params() -> frozenset:
    import importlib.util

    path = es.VLLM_OMNI / "vllm_omni/model_extras/cosmos3.py"
    spec = importlib.util.spec_from_file_location("vllm_omni_cosmos3_extras", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.COSMOS3_EXTRA_BODY_PARAMS


# -- batches, answers, identity: one policy call through each backend -----------------------------------
@pytest.mark.parametrize("engine", ENGINES)
def test_a_stage_goes_as_the_engine_takes_it_and_comes_back_decoded(engine, libero_dir):
    state = {"max_batch": 2} if engine == "sglang" else {}
    if engine == "cosmos_http":
        state["info"] = es.cosmos_info(16, 10)
    with es.serve(engine, **state) as srv:
        policy = backends.connect(
            engine, target(srv.url, libero_dir), Patience(retries=0, connect_timeout_s=5)
        )
        try:
            obs = libero_obs(5)
            actions, _, _ = policy(obs)
            np.testing.assert_array_equal(actions, np.stack([expected(policy.client, o) for o in obs]))
            sizes = {"sglang": [2, 2, 1], "vllm_omni": [1] * 5, "cosmos_http": [5]}[engine]
            assert [_size(r) for r in srv.requests] == sizes
            canvas = policy.client.canvas(policy.client.frame(obs[0]))  # what the engine resized to
            assert {_canvas(r) for r in srv.requests} == {canvas if engine != "cosmos_http" else (32, 64)}
            assert policy.identity["backend"] == engine
            assert policy.identity["client_stats_sha256"] == policy.client.spec.stats_hash()
        finally:
            policy.close()
        if engine == "vllm_omni":
            assert len(srv.state["deleted"]) == 5 and not srv.state["jobs"]  # every finished job deleted


def _canvas(request) -> tuple[int, int]:
    """The (height, width) an engine was asked for: the canvas (SGLang, vLLM-Omni), or the frame's
    size that cosmos-framework places itself."""
    if isinstance(request, list):
        im = es.Image.open(es.io.BytesIO(es.base64.b64decode(request[0]["image"])))
        assert request[0]["image_size"] == im.height
        return im.height, im.width
    if isinstance(request, tuple):
        return request[0].height, request[0].width
    return request.height, request.width


def _size(request) -> int:
    if isinstance(request, list):  # cosmos_http: the items
        return len(request)
    if isinstance(request, tuple):  # vllm_omni: one job
        return 1
    return len(request.prompt) if isinstance(request.prompt, list) else 1


def test_cosmos_http_takes_the_servers_word_on_the_normalisation(libero_dir):
    info = es.cosmos_info(16, 10, action_stats_path="/ckpt/action_stats.json")
    with es.serve("cosmos_http", info=info) as srv:
        policy = backends.connect("cosmos_http", target(srv.url, libero_dir), Patience())
        obs = libero_obs(2)
        actions, infer_s, _ = policy(obs)
        np.testing.assert_array_equal(actions, np.stack([expected(policy.client, o, False) for o in obs]))
        assert infer_s == pytest.approx(0.0005)  # the server's own inference time
        policy.close()


# -- faults ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize(
    "fault, error, match",
    [
        (
            "http",
            BackendError,
            r"eval.backend={e} at {url}: .*(batching-max-size|engine died|CUDA out of memory)",
        ),
        ("width", BackendError, r"eval.backend={e} at {url}: .*action width 11, expected 10"),
        ("nan", BackendError, r"eval.backend={e} at {url}: .*holds NaN or infinite values"),
        ("garbage", BackendError, r"eval.backend={e} at {url}: .*not a valid body"),
        ("slow", TimeoutError, r"eval.backend={e}.*eval.server_timeout_s"),
    ],
)
def test_engine_faults_name_the_backend_the_url_and_the_field(engine, fault, error, match, libero_dir):
    state = {"info": es.cosmos_info(16, 10)} if engine == "cosmos_http" else {}
    with es.serve(engine, slow_s=1.5, **state) as srv:
        policy = backends.connect(
            engine, target(srv.url, libero_dir), Patience(retries=0, reply_timeout_s=0.5)
        )
        srv.fault = fault
        with pytest.raises(error, match=match.format(e=engine, url=srv.url)):
            policy(libero_obs(2))
        policy.close()


def test_a_dropped_connection_is_retried_then_named(libero_dir):
    with es.serve("sglang") as srv:
        policy = backends.connect(
            "sglang", target(srv.url, libero_dir), Patience(retries=2, connect_timeout_s=2)
        )
        srv.fault = "drop"
        with pytest.raises(ConnectionError, match=r"eval.backend=sglang: .*dropped the connection .* 3 time"):
            policy(libero_obs(1))
        srv.fault = None
        assert policy(libero_obs(1))[0].shape == (1, 16, 7)  # the next request reconnects
        policy.close()


def test_a_malformed_answer_names_the_field(libero_dir):
    with es.serve("sglang") as srv:
        policy = backends.connect("sglang", target(srv.url, libero_dir), Patience())
        srv.fault = "malformed"
        with pytest.raises(BackendError, match=r"data: expected a list of 2 results, got 1"):
            policy(libero_obs(2))
        policy.close()


def test_results_in_another_order_come_back_in_input_order(libero_dir):
    with es.serve("sglang") as srv:
        policy = backends.connect("sglang", target(srv.url, libero_dir), Patience())
        srv.fault = "reorder"
        obs = libero_obs(3)
        np.testing.assert_array_equal(policy(obs)[0], np.stack([expected(policy.client, o) for o in obs]))
        policy.close()


def test_a_server_that_closed_an_idle_connection_costs_no_retry(libero_dir):
    """A kept-alive connection the server closed meanwhile is reopened without using a retry (with
    several servers a request has none)."""
    with es.serve("sglang", close_idle=True) as srv:
        policy = backends.connect("sglang", target(srv.url, libero_dir), Patience(retries=0))
        for _ in range(3):  # each request finds the connection of the one before closed
            assert policy(libero_obs(1))[0].shape == (1, 16, 7)
        policy.close()


@pytest.mark.parametrize("engine", ENGINES)
def test_an_unreachable_engine_fails_at_connect(engine, libero_dir):
    with pytest.raises(ConnectionError, match=rf"eval.backend={engine}: cannot reach http://127.0.0.1:9/"):
        backends.connect(engine, target("http://127.0.0.1:9", libero_dir), Patience(connect_timeout_s=0.3))


def test_a_missing_or_foreign_serving_dir_is_refused(libero_dir, tmp_path):
    with pytest.raises(BackendError, match=r"eval.backend_options.serving_dir: give the directory"):
        Cosmos3Client.load("sglang", Target("http://x", CAMS))
    with pytest.raises(BackendError, match=r"preprocess.json does not exist"):
        Cosmos3Client.load("sglang", target("http://x", tmp_path))
    (tmp_path / "preprocess.json").write_text((libero_dir / "preprocess.json").read_text())
    (tmp_path / MODEL_FILE).write_text(json.dumps({"name": "tiny", "options": {}}))
    with pytest.raises(BackendError, match=r"model.json: 'name' is 'tiny'; this backend serves Cosmos3"):
        Cosmos3Client.load("sglang", target("http://x", tmp_path))


# -- whole evaluations: the journal, the plan and --resume are the evaluator's ------------------------
def _engine_state(engine: str, model: str) -> dict:
    if engine == "cosmos_http":
        return {"info": es.cosmos_info(4, 4, checkpoint=f"/ckpt/{model}")}
    return {"model": model}


# make test runs a whole evaluation against one engine (each engine's requests and faults are tested
# above); make test-slow against every one
@pytest.mark.parametrize(
    "engine", [e if e == "sglang" else pytest.param(e, marks=pytest.mark.slow) for e in ENGINES]
)
def test_an_evaluation_against_each_engine_and_resume_against_another_model(engine, metaworld_dir, tmp_path):
    opts = [f"eval.backend={engine}", f"eval.backend_options={{serving_dir: {metaworld_dir}}}"]
    with es.serve(engine, **_engine_state(engine, "Cosmos3-Nano-libero")) as srv:
        run_eval(eval_config(srv.url, tmp_path, *opts), progress=False)
        first = results(tmp_path)
        plan = json.loads((tmp_path / "plan.json").read_text())
        said = plan["server"]["identity"]["server"]
        assert plan["server"]["identity"]["backend"] == engine
        assert "Cosmos3-Nano-libero" in json.dumps(said)
    assert len(first) == 2 and all(r["length"] == 16 for r in first.values())
    journal = tmp_path / "episodes.jsonl"
    journal.write_text("".join(journal.read_text().splitlines(keepends=True)[:-1]))
    other_model = es.serve(engine, **_engine_state(engine, "Cosmos3-Nano-bridge"))
    with other_model as other, pytest.raises(ConfigError, match=r"Cosmos3-Nano-libero"):
        run_eval(eval_config(other.url, tmp_path, *opts), resume=True, progress=False)
    with es.serve(engine, **_engine_state(engine, "Cosmos3-Nano-libero")) as same:  # same model, new URL
        run_eval(eval_config(same.url, tmp_path, *opts), resume=True, progress=False)
    assert results(tmp_path) == first


def test_a_run_stopped_by_an_engine_error_loses_nothing_and_resumes(metaworld_dir, tmp_path):
    """The engine starts refusing mid-run: the run stops naming it, the episodes journaled stay, and
    --resume against a healthy engine gives the undisturbed run's episodes, none twice."""
    opts = ["eval.backend=sglang", f"eval.backend_options={{serving_dir: {metaworld_dir}}}", "eval.trials=4"]
    with es.serve("sglang") as srv:
        run_eval(eval_config(srv.url, tmp_path / "whole", *opts), progress=False)
    journal = tmp_path / "cut" / "episodes.jsonl"
    # the engine fails from the moment two episodes are journaled on
    failing = es.serve(
        "sglang", fail_when=lambda: journal.is_file() and len(journal.read_text().splitlines()) >= 2
    )
    with failing as srv, pytest.raises(BackendError, match=rf"eval.backend=sglang at {srv.url}: .*HTTP 400"):
        run_eval(eval_config(srv.url, tmp_path / "cut", *opts), progress=False)
    cut = results(tmp_path / "cut")
    assert 0 < len(cut) < 4
    with es.serve("sglang") as srv:
        run_eval(eval_config(srv.url, tmp_path / "cut", *opts), resume=True, progress=False)
    assert results(tmp_path / "cut") == results(tmp_path / "whole")


@pytest.mark.slow
def test_several_engine_servers_serve_one_evaluation(metaworld_dir, tmp_path):
    """Two SGLang servers share the stages (each serves whole pipeline stages); two that name other
    models are refused before any episode runs."""
    opts = ["eval.backend=sglang", f"eval.backend_options={{serving_dir: {metaworld_dir}}}", "eval.trials=4"]
    with es.serve("sglang") as a, es.serve("sglang") as b:
        run_eval(eval_config([a.url, b.url], tmp_path / "two", *opts), progress=False)
        assert a.requests and b.requests  # both served
    with es.serve("sglang") as one:
        run_eval(eval_config(one.url, tmp_path / "one", *opts), progress=False)
    assert results(tmp_path / "two") == results(tmp_path / "one")
    other = es.serve("sglang", model="Cosmos3-Nano-bridge")
    with es.serve("sglang") as a, other as b, pytest.raises(ConfigError, match="serves another model"):
        run_eval(eval_config([a.url, b.url], tmp_path / "mixed", *opts), progress=False)
    journal = tmp_path / "mixed" / "episodes.jsonl"
    assert not journal.exists() or not journal.read_text().strip()  # refused before any episode ran
