"""The cluster path for real: a two-node Ray cluster on this machine runs an evaluation.

The head is started as docs/eval.md starts the GPU node (``--num-cpus 0``: it hosts no env actor); a
second node joins with 2 CPUs and a ``wamkit_env_node`` resource that names it. ``wamkit eval
eval.executor=ray eval.ray_address=...`` runs as its own process (as a user would run it), and its
env actors must all be placed on the second node, with the results of the local executor.

The cluster lives in its own temp dir, on free ports, with a token of its own, and is stopped by
killing its process groups, not by ``ray stop``: ``ray stop`` kills every Ray process of the
machine, other users' clusters included.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.eval_helpers import DELAY, results
from wamkit.config import load_config
from wamkit.eval.runner import run_eval
from wamkit.eval.server_proc import free_port, start_server_process

RAY = shutil.which("ray") or str(Path(sys.executable).parent / "ray")
OVERRIDES = [
    "env.tasks=reach-v3",
    "env.image_size=32",
    "env.max_steps=16",
    "eval.trials=4",
    "eval.num_envs=2",
    "eval.pipeline_stages=2",
    "eval.workers=2",
    "eval.replan_interval=4",
    "eval.videos=0",
    "eval.calibrate_s=0",
]
NODE_RESOURCE = "wamkit_env_node"


def _free_ports(n: int) -> list[int]:
    ports: set[int] = set()
    while len(ports) < n:
        ports.add(free_port())
    return sorted(ports)


def _start_node(args: list[str], env: dict[str, str], log: Path) -> int:
    """``ray start ARGS`` in a session of its own; return that session's process group id (the node's
    daemons stay in it when ``ray start`` returns)."""
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [RAY, "start", "--disable-usage-stats", *args],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        if proc.wait(timeout=120) != 0:
            raise RuntimeError(f"ray start {' '.join(args)} failed:\n{log.read_text()[-3000:]}")
    return proc.pid


def _stop_group(pgid: int, grace_s: float = 5.0) -> None:
    """SIGTERM the node's process group, SIGKILL what is left after ``grace_s``."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            os.killpg(pgid, 0)  # raises ProcessLookupError once the group is gone
            time.sleep(0.2)
        os.killpg(pgid, signal.SIGKILL)


@contextlib.contextmanager
def two_node_cluster() -> Iterator[tuple[str, dict[str, str]]]:
    """``(address, env)``: a head with no CPU and a node with 2 CPUs; ``env`` reaches the cluster."""
    tmp = Path(tempfile.mkdtemp(prefix="wr", dir="/tmp"))  # short: Ray's socket paths must stay short
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    env.pop("RAY_ADDRESS", None)
    env.pop("RAY_AUTH_TOKEN_PATH", None)
    port, client, dash, agent_head, agent_node = _free_ports(5)
    groups: list[int] = []
    try:
        groups.append(
            _start_node(
                ["--head", "--num-cpus", "0", "--port", str(port), "--temp-dir", str(tmp),
                 "--include-dashboard=false", "--dashboard-port", str(dash),
                 "--ray-client-server-port", str(client), "--dashboard-agent-listen-port", str(agent_head)],
                env,
                tmp.parent / f"{tmp.name}_head.log",
            )
        )  # fmt: skip
        address = f"127.0.0.1:{port}"
        groups.append(
            _start_node(
                ["--address", address, "--num-cpus", "2", "--resources", json.dumps({NODE_RESOURCE: 2}),
                 "--dashboard-agent-listen-port", str(agent_node)],
                env,
                tmp.parent / f"{tmp.name}_node.log",
            )
        )  # fmt: skip
        yield address, env
    finally:
        for pgid in reversed(groups):
            _stop_group(pgid)
        shutil.rmtree(tmp, ignore_errors=True)
        for suffix in ("_head.log", "_node.log"):
            (tmp.parent / f"{tmp.name}{suffix}").unlink(missing_ok=True)


NODES_SCRIPT = """
import json, sys, ray
ray.init(address=sys.argv[1], log_to_driver=False)
print(json.dumps([{"id": n["NodeID"], "alive": n["Alive"], "resources": n["Resources"]} for n in ray.nodes()]))
"""


@pytest.mark.skipif(not Path(RAY).is_file(), reason="the ray CLI is missing (pip install 'wamkit[ray]')")
@pytest.mark.slow  # a two-node Ray cluster (25 s)
def test_a_two_node_ray_cluster_runs_the_env_actors_on_the_worker_node(tmp_path):
    with start_server_process(DELAY) as server:
        url = f"eval.server_url={server.url}"
        run_eval(load_config(None, [*OVERRIDES, url, f"eval.out_dir={tmp_path / 'local'}"]), progress=False)
        with two_node_cluster() as (address, env):
            out = tmp_path / "ray"
            cmd = [sys.executable, "-m", "wamkit", "eval", *OVERRIDES, url, f"eval.out_dir={out}"]
            cmd += ["eval.executor=ray", f"eval.ray_address={address}", "--no-progress"]
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
            assert done.returncode == 0, done.stderr[-3000:]
            listed = subprocess.run(
                [sys.executable, "-c", NODES_SCRIPT, address],
                env=env,
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert listed.returncode == 0, listed.stderr[-3000:]
    nodes = [n for n in json.loads(listed.stdout.strip().splitlines()[-1]) if n["alive"]]
    head = [n["id"] for n in nodes if "node:__internal_head__" in n["resources"]]
    workers = [n["id"] for n in nodes if NODE_RESOURCE in n["resources"]]
    assert len(nodes) == 2 and len(head) == 1 and len(workers) == 1 and head != workers
    tp = json.loads((out / "summary.json").read_text())["throughput"]
    assert tp["executor"] == "ray" and len(tp["worker_nodes"]) == 2
    assert {n["node_id"] for n in tp["worker_nodes"]} == set(workers)  # every env actor on the CPU node
    assert results(out) == results(tmp_path / "local")
