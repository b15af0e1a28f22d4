"""Serving warm: every batch bucket run once before the first answer (/healthz says "warming i/n"
meanwhile), compiled steps kept on disk between starts (wamkit.models.compile_cache) under a key of
everything that changes the code, and serve.precision=fp8 refused where it cannot run."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
import torch

from wamkit.config import ConfigError, ServeConfig, load_config
from wamkit.eval.server_proc import free_port
from wamkit.models.compile_cache import ARTIFACTS, MANIFEST, CompileCache, environment
from wamkit.serve.loading import random_init

FIELDS = {"model": "toy", "transformer": {"hidden": 64, "layers": 2}, "dtype": "torch.float32"}


def _compile_something():
    """Compile a small function with inductor on the CPU (what a served step leaves in torch's caches)."""
    torch._dynamo.reset()
    f = torch.compile(lambda x: (x.sin() * 3 + 1).sum(dim=-1), dynamic=False)
    return f(torch.ones(4, 8))


def test_the_key_changes_with_the_models_shape_dtype_and_torch(tmp_path):
    env = environment("cpu")
    base = CompileCache(tmp_path, "toy", {**FIELDS, **env})
    changed = [
        {**FIELDS, "transformer": {"hidden": 128, "layers": 2}, **env},
        {**FIELDS, "dtype": "torch.bfloat16", **env},
        {**FIELDS, **env, "torch": "0.0.0"},
    ]
    keys = {base.key} | {CompileCache(tmp_path, "toy", f).key for f in changed}
    assert len(keys) == 4 and env["torch"] == torch.__version__


def test_an_entry_is_loaded_for_its_key_only_and_a_stale_one_says_why(tmp_path, caplog):
    fields = {**FIELDS, **environment("cpu")}
    first = CompileCache(tmp_path, "toy", fields)
    with caplog.at_level(logging.INFO, "wamkit.models.compile_cache"):
        assert not first.load() and first.loaded == "missing"
        _compile_something()
        assert first.save([1, 2]) == first.dir
        manifest = json.loads((first.dir / MANIFEST).read_text())
        assert manifest["buckets"] == [1, 2] and manifest["fields"]["torch"] == torch.__version__
        again = CompileCache(tmp_path, "toy", fields)
        assert again.load() and again.loaded == "hit"
        caplog.clear()
        newer = CompileCache(tmp_path, "toy", {**fields, "torch": "9.9.9"})  # another torch: never loaded
        assert not newer.load() and newer.loaded == "stale"
    assert f"torch: '{torch.__version__}' -> '9.9.9'" in caplog.text
    assert newer.dir != first.dir


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_corrupt_entry_is_recompiled_and_the_log_says_why(tmp_path, caplog, damage):
    fields = {**FIELDS, **environment("cpu")}
    cache = CompileCache(tmp_path, "toy", fields)
    _compile_something()
    cache.save([1])
    blob = cache.dir / ARTIFACTS
    data = bytearray(blob.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0xFF
    else:
        del data[len(data) // 3 :]
    blob.write_bytes(bytes(data))
    again = CompileCache(tmp_path, "toy", fields)
    with caplog.at_level(logging.WARNING, "wamkit.models.compile_cache"):
        assert not again.load()
    assert again.loaded == "corrupt" and "sha256 does not match" in caplog.text
    again.save([1])  # this start's compiles replace it
    assert CompileCache(tmp_path, "toy", fields).load()


def test_fp8_is_refused_on_the_cpu_with_the_reason():
    with pytest.raises(ConfigError, match=r"serve.precision=fp8 needs a CUDA device"):
        load_config(None, ["serve.precision=fp8", "serve.device=cpu"])
    with pytest.raises(ConfigError, match=r"serve.precision=fp8: FP8 needs a CUDA GPU with FP8 tensor cores"):
        random_init("tiny", "small", {}, "cpu", precision="fp8")


def test_warm_sizes_cover_every_bucket_up_to_max_batch():
    policy = random_init("delay", "small", {"delay_ms": 0}, "cpu")
    assert policy.warm_sizes(32, "auto") == []  # nothing compiled or captured: nothing to warm
    assert policy.warm_sizes(32, "all") == [1, 2, 4, 8, 16, 32]
    assert policy.warm_sizes(24, "all") == [1, 2, 4, 8, 16, 24]
    assert policy.warm_sizes(1, "all") == [1] and policy.warm_sizes(32, "none") == []
    with pytest.raises(ConfigError, match="serve.warm: expected one of auto, all, none, got 'sometimes'"):
        ServeConfig(warm="sometimes")  # the setting is checked once, by its config


def test_a_warming_server_says_so_and_answers_after(tmp_path):
    """/healthz is 503 "warming i/n" while the buckets run, then 200; requests that come meanwhile wait."""
    port = free_port("127.0.0.1")
    cmd = [sys.executable, "-m", "wamkit", "serve", "--model", "delay", "--random-init", "--device", "cpu",
           "--option", "delay_ms=400", "--warm", "all", "--max-batch", "8", "--port", str(port)]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen, deadline = [], time.monotonic() + 120
    try:
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as r:
                    seen.append((r.status, r.read().decode().strip()))
                    break
            except urllib.error.HTTPError as err:
                seen.append((err.code, err.read().decode().strip()))
            except OSError:
                pass
            time.sleep(0.1)
    finally:
        proc.terminate()
        out = proc.communicate(timeout=30)[0]
    warming = [text for code, text in seen if code == 503]
    assert warming and all(t.startswith("warming ") and t.endswith("/4") for t in warming), seen
    assert seen[-1] == (200, "OK")
    assert "warmed batch 8 (4/4)" in out


def test_warm_only_runs_the_buckets_and_exits():
    out = subprocess.run(
        [sys.executable, "-m", "wamkit", "serve", "--model", "delay", "--random-init", "--device", "cpu",
         "--max-batch", "4", "--warm-only", "--compile-cache", ""],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    log = out.stdout + out.stderr
    assert "warmed batch 4 (3/3)" in log and "warm-only: 3 buckets [1, 2, 4]" in log


def test_warming_runs_the_model_at_each_size(tmp_path):
    policy = random_init("delay", "small", {"delay_ms": 0}, "cpu")
    seen = []
    out = policy.warm([1, 2, 4], "", lambda done, total, n, s: seen.append((done, total, n)))
    assert seen == [(1, 3, 1), (2, 3, 2), (3, 3, 4)] and out["cache"] == "off"
    req = policy.warm_request(3)
    assert req["observation.state"].shape == (3, policy.io.state_dim)
    assert all(np.asarray(req[k]).dtype == np.uint8 for k in req if k.startswith("observation.images."))


KEY_OF_TINY = """
from wamkit.serve.loading import random_init
p = random_init("cosmos3", "tiny", {"step_graph": "compile"}, "cpu")
p.adapter.fast.compile_on_cpu = True  # as on CUDA, where the step compiles
print(p.compile_cache("/nonexistent").key)
"""


@pytest.mark.slow
def test_the_same_model_has_the_same_key_in_every_process():
    """A key that differed between processes (a set's order, an address) would never hit."""
    keys = {
        subprocess.run(
            [sys.executable, "-c", KEY_OF_TINY], capture_output=True, text=True, check=True
        ).stdout.strip()
        for _ in range(2)
    }
    assert len(keys) == 1 and len(next(iter(keys))) == 64


@pytest.mark.slow
def test_serve_start_bench_times_two_starts_and_says_where_the_time_went(tmp_path):
    """``wamkit bench serve-start`` on the CPU: two real server processes, each asked once per bucket;
    the build, hash and warm-up times come from the servers' own logs."""
    out = subprocess.run(
        [sys.executable, "-m", "wamkit", "bench", "serve-start", "--model", "delay", "--preset", "small",
         "--device", "cpu", "--max-batch", "2", "--keep", str(tmp_path), "--json", str(tmp_path / "s.json")],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    rows = json.loads((tmp_path / "s.json").read_text())["rows"]
    assert [r["run"] for r in rows] == ["cold", "warm"]
    for r in rows:
        assert sorted(r["first_answer_s"]) == ["1", "2"] and r["compile_cache"] == "off"
        assert r["ready_s"] <= r["answered_s"]
        assert all(r[k] is not None and 0 <= r[k] <= r["ready_s"] for k in ("build_s", "hash_s", "warm_s"))
    assert (tmp_path / "serve_cold.log").exists() and (tmp_path / "serve_warm.log").exists()


def test_the_served_digest_hashes_every_tensor_whatever_the_threads():
    """The identity's digest: per-tensor sha256s (computed here independently) in name order; the same
    for one thread or several, and another for one changed element or one renamed tensor."""
    import hashlib

    from wamkit.models.base import weights_digest

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4)).to(
        torch.bfloat16
    )
    want = hashlib.sha256()
    for name, t in sorted(m.state_dict().items()):
        d = hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
        want.update(f"{name}|{t.dtype}|{list(t.shape)}|{d}\n".encode())
    assert weights_digest(m, threads=1) == weights_digest(m, threads=4) == want.hexdigest()
    with torch.no_grad():
        m[2].weight[3, 1] += 1
    assert weights_digest(m) != want.hexdigest()
    assert weights_digest(None) == ""


def test_cosmos3_warms_in_two_denoising_steps_and_serves_with_its_own():
    """Every denoising step runs the same compiled velocity, so a warm-up request needs two; requests
    after it denoise in num_inference_steps again."""
    policy = random_init("cosmos3", "tiny", {}, "cpu")
    steps = policy.adapter.options.num_inference_steps
    seen, run = [], policy.run

    def counting(batch):
        seen.append(policy.adapter.options.num_inference_steps)
        return run(batch)

    policy.run = counting
    policy.warm([1, 2])
    policy.infer(policy.warm_request(1))
    assert steps > 2 and seen == [2, 2, steps]
