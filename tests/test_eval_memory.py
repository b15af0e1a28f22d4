"""Long evaluations and the host's memory: the evaluator measures what one env takes before it builds
the others and refuses a ``num_envs`` the host cannot hold; ``wamkit bench soak`` reads every process's
memory, descriptors and threads from /proc after each round."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.conftest import REPO
from tests.eval_helpers import DELAY, eval_config
from wamkit.config import ConfigError
from wamkit.eval.process_memory import available_bytes, sample
from wamkit.eval.runner import run_eval
from wamkit.eval.server_proc import start_server_process


def test_a_process_sample_is_what_proc_says():
    s = sample(os.getpid())
    assert s is not None and s.pid == os.getpid() and s.rss > 10_000_000
    assert abs(s.fds - len(os.listdir("/proc/self/fd"))) <= 1  # listdir holds one of its own open
    assert s.threads >= 1 and available_bytes() > 0
    assert sample(2**22 + 12345) is None  # no such process


@pytest.mark.slow
def test_num_envs_the_host_cannot_hold_is_refused_before_the_others_are_built(tmp_path):
    with start_server_process(DELAY) as srv:
        cfg = eval_config(srv.url, tmp_path / "out", "eval.num_envs=1000000", "eval.workers=1")
        with pytest.raises(ConfigError) as err:
            run_eval(cfg, progress=False, prebuild=True)
    msg = str(err.value)
    assert msg.startswith("eval.num_envs=1000000: the envs need about")
    assert "MB per env, measured on worker 0 at start-up" in msg and "GB available" in msg
    fits = int(re.search(r"at most (\d+) envs fit \(eval.num_envs=(\d+)\)", msg).group(1))
    assert 1 <= fits < 1000000
    assert not (tmp_path / "out" / "summary.json").exists()  # nothing was run


@pytest.mark.slow
def test_soak_prints_every_process_at_the_warm_up_and_the_end(tmp_path):
    cmd = [sys.executable, "-m", "wamkit", "--log-level", "warning", "bench", "soak", "--episodes", "40",
           "--tasks", "reach-v3", "--max-steps", "6", "--num-envs", "2", "--workers", "2", "--interval", "0.05",
           "--json", str(tmp_path / "soak.json")]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(REPO / "src")})  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    m = re.search(r"after the warm-up \((\d+) episodes\) -> after (\d+) episodes", text)
    assert m and 4 <= int(m[1]) <= int(m[2]) < 40, text  # a tenth done, to the last sample while running
    rows = re.findall(r"^(evaluator|env worker \d|server)\s+([\d.]+)\s+([\d.]+)\s+(-?[\d.]+)%\s+(\d+)->(\d+)\s+(\d+)->(\d+)",
                      text, re.M)  # fmt: skip
    assert [r[0] for r in rows] == ["evaluator", "env worker 0", "env worker 1", "server"], text
    for name, a, b, growth, *_ in rows:  # the growth column is the two RSS columns' ratio
        assert abs(float(growth) - 100 * (float(b) - float(a)) / float(a)) < 0.2, name
    assert re.search(r"env memory measured at start-up: [\d.]+ MB per env", text)
    import json

    samples = json.loads((tmp_path / "soak.json").read_text())["samples"]
    done = [s["episodes"] for s in samples]
    assert done == sorted(done) and done[-1] == 40  # the journal's count, sampled as it grows
    assert all(s["samples"]["server"]["fds"] > 0 for s in samples)
