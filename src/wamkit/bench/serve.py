"""``wamkit bench serve``: served obs/s and latency against in-process calls, measured in one run.

The server runs in its own process (as in production: clients never share its interpreter) with a
random-init model; clients are asyncio connections in this process. Three measurements:

1. in-process: ``ServedPolicy.infer`` on a batch of B observations (prepare + predict + decode), the
   ceiling for serving at that batch;
2. batch sweep: one connection sending batched requests of B observations; ratio to (1) at the same B;
3. concurrency sweep: C connections each sending one observation per request, so every batch is formed
   by the server's dynamic batcher; ratio to (1) at B = C (capped at max_batch). The connections are
   spread over ``--client-processes`` processes (as many robots' clients are separate processes; one
   Python process answering 32 connections in turn would time its own event loop, not the server's).

The speed-up is each row's obs/s over one connection sending one observation per request. With the
``delay`` model (the default) the figures measure the server alone: it is a benchmark model, not a policy.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import signal
import time
from typing import Any

import numpy as np

from wamkit.config import SERVE_PRECISIONS, parse_override

# the delay model's cost when --model delay is given no --option; other models keep their preset
DELAY_DEFAULTS = ["delay_ms=10", "per_obs_ms=0.05"]


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="delay", help="registered model, random weights (default: delay)")
    parser.add_argument("--preset", default="small", help="model preset (default: small)")
    parser.add_argument(
        "--option",
        action="append",
        default=None,
        metavar="KEY=VALUE",
        help=f"model option, repeatable (default for the delay model: {DELAY_DEFAULTS})",
    )
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda")
    parser.add_argument(
        "--precision",
        choices=SERVE_PRECISIONS,
        default="auto",
        help="serve.precision in both processes (default: auto, bf16 autocast for fp32 weights on CUDA)",
    )
    parser.add_argument(
        "--batch", type=_ints, default=[1, 8, 32], help="batch sizes per request (default: 1,8,32)"
    )
    parser.add_argument(
        "--concurrency", type=_ints, default=[1, 4, 16, 32], help="connections (default: 1,4,16,32)"
    )
    parser.add_argument("--max-batch", type=int, default=32, help="server max_batch (default: 32)")
    parser.add_argument("--max-wait-ms", type=float, default=2.0, help="server max_wait_ms (default: 2)")
    parser.add_argument("--seconds", type=float, default=2.0, help="measuring time per row (default: 2)")
    parser.add_argument(
        "--threads", type=int, default=0, help="torch CPU threads in both processes (0: torch's default)"
    )
    parser.add_argument(
        "--client-processes",
        type=int,
        default=0,
        help="processes the dynamic rows' connections are spread over (0: auto, one per 4 cores, at most "
        "one per connection)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="passes over every row, each against in-process figures taken just before it; the table "
        "gives each row's median pass (a launch-bound model's speed drifts with the host's). Above 1 the "
        "in-process model stays loaded beside the server's: two copies on the device (default: 1)",
    )
    parser.add_argument("--json", help="also write the results to this JSON file")


def _options(args: argparse.Namespace) -> dict[str, Any]:
    defaults = DELAY_DEFAULTS if args.model == "delay" else []
    return dict(parse_override(t) for t in (defaults if args.option is None else args.option))


def make_obs(meta_io: dict[str, Any], batch: int | None, seed: int = 0) -> dict[str, Any]:
    """A random observation (``batch=None``: single) for a model's inputs as the metadata describes them."""
    rng = np.random.default_rng(seed)
    lead = () if batch is None else (batch,)
    size = meta_io["image_size"]
    obs: dict[str, Any] = {
        k: rng.integers(0, 256, (*lead, size, size, 3), dtype=np.uint8) for k in meta_io["image_keys"]
    }
    obs[meta_io["state_key"]] = rng.standard_normal((*lead, meta_io["state_dim"])).astype(np.float32)
    obs["prompt"] = "pick up the object" if batch is None else ["pick up the object"] * batch
    return obs


def _end_with_parent() -> None:
    """Stop this process as Ctrl-C would once the benchmark that started it is gone (killed, say):
    it holds a port and maybe a GPU, and is not a daemon (it is stopped as a server is, by Ctrl-C)."""
    import threading

    parent = mp.parent_process()
    if parent is None:
        return
    # Ctrl-C is how this process stops (here and from the benchmark's finally), also when it was
    # started with SIGINT ignored (a background job of a non-interactive shell)
    signal.signal(signal.SIGINT, signal.default_int_handler)

    def watch() -> None:
        parent.join()
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=watch, name="wamkit-bench-parent", daemon=True).start()


def _serve_process(
    model: str,
    preset: str,
    options: dict,
    device: str,
    precision: str,
    max_batch: int,
    max_wait_ms: float,
    threads: int,
    q,
) -> None:
    import torch

    if threads:
        torch.set_num_threads(threads)
    from wamkit.serve.loading import random_init
    from wamkit.serve.server import run_server

    _end_with_parent()
    policy = random_init(model, preset, options, device, precision=precision)
    # as `wamkit serve` does: the model on the main thread, the event loop in a thread; sends the bound
    # port back, then serves until interrupted
    run_server(
        policy,
        "127.0.0.1",
        0,
        started=q.put,
        max_batch=max_batch,
        max_wait_ms=max_wait_ms,
    )


async def _drive(
    url: str, connections: int, obs: dict, seconds: float, start_at: float | None = None
) -> tuple[list[float], list[dict[str, float]], float]:
    """``connections`` clients sending ``obs`` in a loop: a warm-up, then ``seconds`` recorded (from
    ``start_at`` on the wall clock when given, so that several processes measure the same window).
    Returns the latencies (s), the replies' server timings and the recorded window's length."""
    from wamkit.serve.client import AsyncPolicyClient

    clients = [await AsyncPolicyClient(url).connect() for _ in range(connections)]
    latencies: list[float] = []
    timings: list[dict[str, float]] = []

    async def worker(c: AsyncPolicyClient, until: float, record: bool) -> None:
        while time.perf_counter() < until:
            t0 = time.perf_counter()
            reply = await c.infer(obs)
            if record:
                latencies.append(time.perf_counter() - t0)
                timings.append(reply.get("server_timing") or {})

    warm = min(0.5, seconds / 4)
    if start_at is not None:
        warm = max(start_at - time.time(), 0.0)  # warm up until the common start
    warm_until = time.perf_counter() + warm
    await asyncio.gather(*(worker(c, warm_until, False) for c in clients))
    start = time.perf_counter()
    await asyncio.gather(*(worker(c, start + seconds, True) for c in clients))
    wall = time.perf_counter() - start
    for c in clients:
        await c.close()
    return latencies, timings, wall


def _client_process(url: str, connections: int, obs: dict, seconds: float, start_at: float, q) -> None:
    q.put(asyncio.run(_drive(url, connections, obs, seconds, start_at)))


def _split(connections: int, processes: int) -> list[int]:
    """``connections`` spread as evenly as possible over at most ``processes`` processes."""
    k = max(1, min(processes, connections))
    return [connections // k + (1 if i < connections % k else 0) for i in range(k)]


def _load(url: str, connections: int, obs: dict, n_obs: int, seconds: float,
          processes: int = 1) -> dict[str, float]:  # fmt: skip
    shares = _split(connections, processes)
    if len(shares) == 1:
        latencies, timings, wall = asyncio.run(_drive(url, connections, obs, seconds))
    else:  # every process records the same window, started together after a common warm-up
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        start_at = time.time() + 5.0 + min(0.5, seconds / 4)  # spawned interpreters import wamkit first
        procs = [ctx.Process(target=_client_process, args=(url, k, obs, seconds, start_at, q), daemon=True)
                 for k in shares]  # fmt: skip
        for p in procs:
            p.start()
        parts = [q.get(timeout=120 + seconds) for _ in procs]
        for p in procs:
            p.join(10)
        latencies = [x for part in parts for x in part[0]]
        timings = [t for part in parts for t in part[1]]
        wall = float(np.mean([part[2] for part in parts]))
    lat = np.asarray(latencies) * 1000.0

    def mean(key: str) -> float:
        values = [t[key] for t in timings if key in t]
        return float(np.mean(values)) if values else float("nan")

    return {
        "obs_s": len(lat) * n_obs / wall,
        "p50_ms": float(np.percentile(lat, 50)),
        "p99_ms": float(np.percentile(lat, 99)),
        # where a request's time goes on the server: the model call, the wait for it, the batch it rode
        "server_infer_ms": mean("infer_ms"),
        "server_total_ms": mean("total_ms"),
        "server_batch": mean("batch_size"),
    }


def _in_process(policy, obs: dict, seconds: float) -> float:  # obs/s
    n = len(obs["prompt"])
    policy.infer(obs)
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds or calls < 3:
        policy.infer(obs)
        calls += 1
    return calls * n / (time.perf_counter() - start)


def _served_rows(args, url: str, meta: dict, inproc: dict[int, float], client_processes: int) -> list[dict]:
    """One pass of every served row, each with its ratio to the in-process figure at its batch."""
    rows = []
    for b in args.batch:
        r = _load(url, 1, make_obs(meta, b), b, args.seconds)
        rows.append(
            {"kind": "batched", "connections": 1, "obs_per_request": b, "in_process_obs_s": inproc[b], **r}
        )
    for c in args.concurrency:
        r = _load(url, c, make_obs(meta, None), 1, args.seconds, client_processes)
        r["client_processes"] = len(_split(c, client_processes))
        b = min(c, args.max_batch)
        rows.append(
            {"kind": "dynamic", "connections": c, "obs_per_request": 1, "in_process_obs_s": inproc[b], **r}
        )
    for r in rows:
        r["ratio_to_in_process"] = r["obs_s"] / r["in_process_obs_s"]
    return rows


def _median_rows(passes: list[list[dict]]) -> list[dict]:
    """Per row, the pass with the median ratio (the lower middle one of an even count): its own figures."""
    return [
        dict(sorted(same, key=lambda r: r["ratio_to_in_process"])[(len(same) - 1) // 2])
        for same in zip(*passes, strict=True)
    ]


def main(args: argparse.Namespace) -> int:
    from wamkit.serve.loading import random_init

    options = _options(args)
    if args.repeats < 1:
        raise SystemExit(f"wamkit bench serve: --repeats {args.repeats}; expected >= 1")
    client_processes = args.client_processes or max(1, (os.cpu_count() or 1) // 4)
    if client_processes < 1:
        raise SystemExit(f"wamkit bench serve: --client-processes {args.client_processes}; expected >= 0")
    if args.threads:  # on a busy CPU, oversubscribed OpenMP threads make in-process figures meaningless
        import torch

        torch.set_num_threads(args.threads)
    policy = random_init(args.model, args.preset, options, args.device, precision=args.precision)
    meta = policy.metadata()["inputs"]
    print(
        f"model: {args.model}/{args.preset} {options} on {args.device}, autocast {'bf16' if policy.autocast else 'off'}"
        + (" (BENCHMARK MODEL: a fixed delay, not a policy)" if args.model == "delay" else "")
    )
    sizes = sorted({*args.batch, *(min(c, args.max_batch) for c in args.concurrency)})
    inproc = {b: _in_process(policy, make_obs(meta, b), args.seconds) for b in sizes}
    if args.repeats == 1:
        del policy  # one pass: the served rows need the device's memory only

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(
        target=_serve_process,
        args=(
            args.model,
            args.preset,
            options,
            args.device,
            args.precision,
            args.max_batch,
            args.max_wait_ms,
            args.threads,
            q,
        ),
        daemon=False,  # stopped by Ctrl-C, as a server is (_end_with_parent)
    )
    proc.start()
    try:
        url = f"ws://127.0.0.1:{q.get(timeout=300)}"
        passes: list[list[dict[str, Any]]] = []
        for k in range(args.repeats):
            if k:  # each pass's ratios against in-process figures taken just before it, on the same host
                inproc = {b: _in_process(policy, make_obs(meta, b), args.seconds) for b in sizes}
            passes.append(_served_rows(args, url, meta, inproc, client_processes))
    finally:
        if proc.is_alive():  # Ctrl-C, as `wamkit serve` is stopped
            os.kill(proc.pid, signal.SIGINT)
        proc.join(30)
        if proc.is_alive():
            proc.kill()
            proc.join(10)
    rows = _median_rows(passes)
    base = next((r["obs_s"] for r in rows if r["connections"] == 1 and r["obs_per_request"] == 1), None)
    print(
        f"{'mode':8} {'conns':>5} {'obs/req':>7} {'obs/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'in-proc obs/s':>13} "
        f"{'ratio':>6} {'speed-up':>8} {'srv batch':>9} {'srv infer ms':>12} {'srv total ms':>12}"
    )
    for r in rows:
        r["speedup_over_single"] = r["obs_s"] / base if base else None  # no 1-connection, 1-obs row
        speedup = f"{r['speedup_over_single']:.2f}x" if base else "-"
        print(
            f"{r['kind']:8} {r['connections']:5d} {r['obs_per_request']:7d} {r['obs_s']:9.1f} {r['p50_ms']:8.2f} "
            f"{r['p99_ms']:8.2f} {r['in_process_obs_s']:13.1f} {r['ratio_to_in_process']:6.2f} {speedup:>8} "
            f"{r['server_batch']:9.1f} {r['server_infer_ms']:12.2f} {r['server_total_ms']:12.2f}"
        )
    print(
        "ratio: served obs/s / in-process obs/s at the same batch (dynamic rows: batch = min(conns, max_batch));"
    )
    print("speed-up: obs/s / obs/s of one connection sending one observation per request.")
    print("srv: the server's own timing, per request: the batch it rode in, the model call, decode to reply.")
    print(f"the dynamic rows' connections are spread over up to {client_processes} client process(es).")
    if args.repeats > 1:
        print(
            f"medians of {args.repeats} passes (the row of the median ratio); each pass's in-process figures were "
            "taken just before its served rows. ratios per pass:"
        )
        for i, r in enumerate(rows):
            ratios = " ".join(f"{p[i]['ratio_to_in_process']:.2f}" for p in passes)
            print(f"  {r['kind']:8} {r['connections']:5d} {r['obs_per_request']:7d}  {ratios}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "model": args.model,
                    "preset": args.preset,
                    "options": options,
                    "rows": rows,
                    "passes": passes,
                },
                f,
                indent=1,
            )
    return 0
