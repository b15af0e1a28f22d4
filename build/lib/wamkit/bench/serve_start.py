"""``wamkit bench serve-start``: how long a server takes from its start to its first answer at every
batch bucket it warms, started twice in one run: cold (nothing compiled on this machine), then warm
(the compile cache the first start wrote; inductor's own on-disk cache emptied, so that only
``serve.compile_cache`` carries the compiled code over).

Each start is ``wamkit serve --random-init ... --warm all`` in a fresh process; the clock starts when
the process is spawned, the server is ready when ``/healthz`` answers 200 (it answers 503 "warming"
while it runs the buckets), and then one request of each bucket's size is sent and timed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

from wamkit.eval.server_proc import free_port


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="cosmos3", help="registered model (default: cosmos3)")
    parser.add_argument("--preset", default="nano", help="its size preset (default: nano)")
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda")
    parser.add_argument("--max-batch", type=int, default=8, help="largest bucket warmed (default: 8)")
    parser.add_argument("--option", action="append", default=[], metavar="KEY=VALUE", help="a model option")
    parser.add_argument("--precision", default="auto", help="serve.precision (default: auto)")
    parser.add_argument(
        "--timeout", type=float, default=1500.0, help="seconds a start may take (default: 1500)"
    )
    parser.add_argument(
        "--keep", help="keep the compile cache and logs in this folder (default: a temporary one)"
    )
    parser.add_argument(
        "--runs",
        default="cold,warm",
        help="which starts, in order (default: cold,warm; with --keep, "
        "the warm start may come in a later call)",
    )
    parser.add_argument("--json", help="write the figures here")


def _request(meta: dict[str, Any], n: int) -> dict[str, Any]:
    inp = meta["inputs"]
    s = int(inp["image_size"])
    obs: dict[str, Any] = {k: np.zeros((n, s, s, 3), np.uint8) for k in inp["image_keys"]}
    obs[inp["state_key"]] = np.zeros((n, int(inp["state_dim"])), np.float32)
    obs[inp["prompt_key"]] = ["put the black bowl on the plate and close the top drawer of the cabinet"] * n
    return obs


def start_once(args, root: Path, run: str, sizes: list[int]) -> dict[str, Any]:
    from wamkit.serve.client import PolicyClient

    port = free_port("127.0.0.1")
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(root / f"inductor_{run}")}
    cmd = [sys.executable, "-m", "wamkit", "serve", "--random-init", "--model", args.model, "--preset", args.preset,
           "--device", args.device, "--precision", args.precision, "--max-batch", str(args.max_batch),
           "--warm", "all", "--compile-cache", str(root / "compile"), "--port", str(port)]  # fmt: skip
    for opt in args.option:
        cmd += ["--option", opt]
    log_path = root / f"serve_{run}.log"
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    warming_seen, ready = False, None
    try:
        while time.perf_counter() - t0 < args.timeout:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited ({proc.returncode}): {log_path.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as r:
                    if r.status == 200:
                        ready = time.perf_counter() - t0
                        break
            except urllib.error.HTTPError as err:
                warming_seen |= err.code == 503
            except OSError:
                pass
            time.sleep(0.2)
        if ready is None:
            raise TimeoutError(f"the server was not ready within {args.timeout:g} s ({log_path})")
        client = PolicyClient(f"ws://127.0.0.1:{port}")
        first = {}
        for n in sizes:
            t = time.perf_counter()
            client.infer(_request(client.metadata, n))
            first[n] = time.perf_counter() - t
        answered = time.perf_counter() - t0
        client.close()
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    text = log_path.read_text()
    # what wamkit.models.compile_cache logged; "off" when nothing is compiled (or serve.compile_cache="")
    said = {
        "compile cache: loaded": "hit",
        "no entry": "missing",
        "is stale": "stale",
        "is corrupt": "corrupt",
    }
    cache = next((v for k, v in said.items() if k in text), "off")
    # where the start's time went, as the server logged it (wamkit.serve.cli_serve, wamkit.serve.server)
    parts = {}
    for key, pattern in (("build_s", r"built in ([0-9.]+) s"), ("hash_s", r"weights hashed in ([0-9.]+) s"),
                         ("warm_s", r"warm in ([0-9.]+) s")):  # fmt: skip
        m = re.search(pattern, text)
        parts[key] = float(m.group(1)) if m else None
    return {"run": run, "ready_s": ready, "answered_s": answered, "first_answer_s": first,
            "warming_seen": warming_seen, "compile_cache": cache, **parts}  # fmt: skip


def main(args: argparse.Namespace) -> int:
    from wamkit.serve.policy import bucket_sizes

    sizes = bucket_sizes(args.max_batch)
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="wamkit_serve_start_"))
    root.mkdir(parents=True, exist_ok=True)
    print(f"{args.model}/{args.preset}: buckets {sizes}; logs and compile cache in {root}", flush=True)
    print(
        f"{'start':<6} {'ready s':>8} {'all answered s':>15} {'built s':>8} {'hashed s':>9} {'warmed s':>9} "
        f"{'compile cache':>14}  first answer per bucket (s)"
    )
    rows = []
    try:
        for run in [r for r in args.runs.split(",") if r]:
            if run not in ("cold", "warm"):
                raise SystemExit(f"wamkit bench serve-start: --runs {run!r}; expected cold and/or warm")
            if run == "cold":
                shutil.rmtree(root / "compile", ignore_errors=True)
            r = start_once(args, root, run, sizes)
            rows.append(r)
            per = "  ".join(f"{n}: {s:.2f}" for n, s in r["first_answer_s"].items())
            took = "".join(
                f" {'-' if r[k] is None else format(r[k], '.1f'):>{w}}"
                for k, w in (("build_s", 8), ("hash_s", 9), ("warm_s", 9))
            )
            print(
                f"{run:<6} {r['ready_s']:>8.1f} {r['answered_s']:>15.1f}{took} {r['compile_cache']:>14}  {per}",
                flush=True,
            )
        print(
            f"warm / cold, start to every bucket answered: {rows[1]['answered_s'] / rows[0]['answered_s']:.2f}"
        )
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"sizes": sizes, "rows": rows}, indent=1))
    return 0
