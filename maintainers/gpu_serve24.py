"""Cosmos3-Nano served in 24 GB (issue 52 item 5; docs/cosmos3.md "Serving in 24 GB"; maintainers, not a test).

    carry core:  source maintainers/gpu_env.sh && bash maintainers/gpu_runs.sh serve24

``measure device``: the default server's model (``serve.text_tower=device``), uncapped: it does not
fit 24 GB. ``measure host CAP_GB``: ``serve.text_tower=host`` in a process capped at ``CAP_GB`` (10^9
bytes) by ``torch.cuda.set_per_process_memory_fraction`` before anything is allocated. Both build the
served policy as ``wamkit serve --random-init --model cosmos3 --preset nano`` does (random weights drawn
on the GPU: the same model, the same weights hash), at ``serve.max_batch`` 8 and a text cache of 32
prompts, warm every bucket (the default step, compile_layers), then measure in the server's model
call (:meth:`ServedPolicy.infer`, no socket):

- obs/s at batch 1 and 8, prompts cached: the median of ``REPEATS`` calls;
- a new prompt's first answer at batch 1 (three prompts never seen), and its text encode alone;
- memory: torch's peak reserved and allocated, the device's used memory (``mem_get_info``) and the
  driver's per-process used memory (``nvidia-smi``, context included), both polled every 0.1 s;
- the plan's device total for the same settings, beside the measured peak;
- the actions of fixed seeded requests (saved for the comparison).

``compare DIR``: the two runs' ratios (host / device obs/s at 1 and 8, the target ≥ 0.9), the first
answers (target ≤ 2 s), the driver peak against the cap, and max |Δa| between the two servers' actions
(bit-equal expected: the same kernels on the same shapes). Without arguments: both measures, each in
its own process, then the comparison; one JSON line each. ``SERVE24_DEVICE=cpu SERVE24_PRESET=tiny``:
a dry run of the whole script on a CPU (no cap, no memory figures; its timings mean nothing), to find
a broken script before GPU time is spent on it.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import types
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PRESET = os.environ.get("SERVE24_PRESET", "nano")  # tiny: a one-minute check that the script runs
# cpu (with SERVE24_PRESET=tiny): a dry run of the script where no GPU is (no cap, no memory figures)
DEVICE = torch.device(os.environ.get("SERVE24_DEVICE", "cuda"))
CUDA = DEVICE.type == "cuda"
REPEATS = 5
MAX_BATCH = 8
OPTIONS = {"text_cache_size": 32}
TASKS = [
    "put both the alphabet soup and the tomato sauce in the basket",
    "put the black bowl on the plate and close the top drawer of the cabinet",
    "turn on the stove and put the moka pot on it",
    "put the white mug on the left plate and put the yellow and white mug on the right plate",
]
NEW = ["pick up the book and place it in the back compartment of the caddy",
       "put both moka pots on the stove", "put the yellow and white mug in the microwave and close it"]  # fmt: skip


class Peaks(threading.Thread):
    """The device's used memory (mem_get_info) and this process's driver-reported memory (nvidia-smi),
    their maxima over the run."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.used = self.driver = 0
        self.stop = threading.Event()

    def _driver(self) -> int:
        out = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, check=False,
        ).stdout  # fmt: skip
        mine = [
            int(m)
            for p, m in (line.split(",") for line in out.splitlines() if "," in line)
            if int(p) == os.getpid()
        ]
        return mine[0] * 2**20 if mine else 0

    def run(self) -> None:
        while not self.stop.is_set():
            free, total = torch.cuda.mem_get_info()
            self.used = max(self.used, total - free)
            self.driver = max(self.driver, self._driver())
            time.sleep(0.1)


def obs(policy, tasks: list[str], seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    s, n = policy.spec.image_size, len(tasks)
    out = {
        f"observation.images.{c}": rng.integers(0, 256, (n, s, s, 3), dtype=np.uint8)
        for c in policy.io.cameras
    }
    out["observation.state"] = np.zeros((n, policy.io.state_dim), np.float32)
    out["prompt"] = list(tasks)
    out["seed"] = 1000
    return out


def timed(fn) -> float:
    if CUDA:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if CUDA:
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def measure(where: str, cap_gb: float, out_dir: Path) -> dict:
    from wamkit.config import ModelConfig
    from wamkit.serve import plan
    from wamkit.serve.loading import random_init

    dev = torch.device("cuda", 0) if CUDA else DEVICE
    if cap_gb and CUDA:
        torch.cuda.set_per_process_memory_fraction(
            cap_gb * 1e9 / torch.cuda.get_device_properties(dev).total_memory, dev
        )
    peaks = Peaks()
    if CUDA:
        peaks.start()
    model = ModelConfig(name="cosmos3", preset=PRESET, options=dict(OPTIONS))
    resolved = plan.resolve_text_tower(
        where, model, None, None, dev, MAX_BATCH
    )  # refused here if it does not fit
    ad = plan.planning_adapter(model, None)
    budget = plan.device_budget(dev) if CUDA else 0
    planned = plan.plan_for(ad.serving_footprint(MAX_BATCH, dev.type), resolved, MAX_BATCH, budget, dev.type)
    t0 = time.perf_counter()
    policy = random_init("cosmos3", PRESET, OPTIONS, device=str(dev), text_tower=resolved)
    built = time.perf_counter() - t0
    weights_gib = torch.cuda.memory_allocated(dev) / 2**30 if CUDA else 0.0
    ident = policy.identity()["weights_sha256"]
    t0 = time.perf_counter()
    policy.warm(policy.warm_sizes(MAX_BATCH, "all"))
    warmed = time.perf_counter() - t0
    result = {"preset": PRESET, "where": resolved, "cap_gb": cap_gb, "build_s": round(built, 1), "warm_s": round(warmed, 1),
              "weights_gib": round(weights_gib, 2), "weights_sha256": ident[:16],
              "planned_device_gib": round(planned.device_total / 2**30, 2)}  # fmt: skip
    for n in (1, MAX_BATCH):
        request = obs(policy, (TASKS * n)[:n])
        policy.infer(request)  # the prompts cached
        times = [timed(lambda r=request: policy.infer(r)) for _ in range(REPEATS)]
        result[f"b{n}_s"] = round(statistics.median(times), 3)
        result[f"b{n}_obs_s"] = round(n / statistics.median(times), 2)
    # a new prompt's first answer, then the same prompt again (cached): the difference is its text
    # encode (a prompt whose length falls in a text bucket not compiled yet would add that compile)
    first = [round(timed(lambda t=t: policy.infer(obs(policy, [t]))), 3) for t in NEW]
    again = [round(timed(lambda t=t: policy.infer(obs(policy, [t]))), 3) for t in NEW]
    result.update(new_prompt_s=first, same_prompt_again_s=again)
    ad = policy.adapter
    _, hw, _ = ad._nominal_request()
    seg = types.SimpleNamespace(text=ad._text_segment(ad.prompt("a task never seen before", hw, 0), hw))
    result["encode_s"] = round(timed(lambda: ad.fast.text_kv(("encode",), seg)), 3)
    actions = policy.infer(obs(policy, TASKS, seed=1))["actions"]
    np.save(out_dir / f"actions_{resolved}.npy", actions)
    if not CUDA:
        return result
    peaks.stop.set()
    peaks.join()
    result.update(
        peak_reserved_gib=round(torch.cuda.max_memory_reserved(dev) / 2**30, 2),
        peak_allocated_gib=round(torch.cuda.max_memory_allocated(dev) / 2**30, 2),
        device_used_peak_gb=round(peaks.used / 1e9, 2),
        driver_peak_gb=round(peaks.driver / 1e9, 2),
    )
    return result


def compare(out_dir: Path) -> dict:
    runs = {r["where"]: r for r in map(json.loads, (out_dir / "runs.jsonl").read_text().splitlines())}
    d, h = runs["device"], runs["host"]
    a, b = np.load(out_dir / "actions_device.npy"), np.load(out_dir / "actions_host.npy")
    return {
        "b1_ratio": round(d["b1_s"] / h["b1_s"], 3),
        "b8_ratio": round(h[f"b{MAX_BATCH}_obs_s"] / d[f"b{MAX_BATCH}_obs_s"], 3),
        "new_prompt_s_max": max(h["new_prompt_s"]),
        "driver_peak_gb": h.get("driver_peak_gb"),
        "device_used_peak_gb": h.get("device_used_peak_gb"),
        "cap_gb": h["cap_gb"],
        "same_weights": d["weights_sha256"] == h["weights_sha256"],
        "max_abs_action_diff": float(np.abs(a - b).max()),
    }


def main(argv: list[str]) -> None:
    if argv[:1] == ["measure"]:
        out_dir = Path(os.environ.get("SERVE24_DIR", tempfile.gettempdir()))
        result = measure(argv[1], float(argv[2]) if len(argv) > 2 else 0.0, out_dir)
        with open(out_dir / "runs.jsonl", "a") as f:
            f.write(json.dumps(result) + "\n")
        print(json.dumps(result), flush=True)
    elif argv[:1] == ["compare"]:
        print(json.dumps(compare(Path(argv[1]))), flush=True)
    else:
        out_dir = Path(tempfile.mkdtemp())
        env = {**os.environ, "SERVE24_DIR": str(out_dir)}
        for args in (["device"], ["host", "24"]):
            subprocess.run([sys.executable, __file__, "measure", *args], env=env, check=True)
        main(["compare", str(out_dir)])


if __name__ == "__main__":
    main(sys.argv[1:])
