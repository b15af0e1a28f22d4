"""``wamkit bench eval``: the evaluator's env-steps/s for the same episodes under three schedules.

(a) serial: one env, one observation per request (openpi's client loop);
(b) lock-step: all N envs stepped together, one batched request per step (LeRobot's ``AsyncVectorEnv``
    loop), which is the pipeline with P = 1;
(c) pipelined: N envs in P stages, P in ``--stages`` (``auto``: measured on a warm-up).

Every schedule runs the same episodes through the real evaluator (worker processes, websocket server,
journal); simulators are built before the clock starts, and each run calibrates first (which warms the
server at every batch size it will send). Each schedule runs ``--repeats`` times (2 by default), the
schedules interleaved (a, b, c..., a, b, c...), so a slow spell of a shared machine hits all of them;
each figure printed is the median over the repeats. ``--repeats 1`` is for runs too long to repeat (all
500 episodes of a benchmark suite): the table then says it holds one run per schedule, not medians. Printed: wall
time, env-steps/s, ratios to (a) and (b), the efficiency against the calibrated, independent bound and
the utilisation of the run's own busy times (:func:`wamkit.eval.report.throughput`). Runs must agree episode by episode (the delay model is
deterministic), which the benchmark checks.

The env workers are started once per shape, (a)'s one env on one worker and the others' N envs over W
workers, and every run of that shape reuses them (``run_eval(env_workers=...)``), where each run used
to start its own: a run of robosuite envs spent half a minute building the simulators the previous run had built.
Every episode still resets its env from its own seed, so results do not change, and every run still
calibrates, on those workers. Local workers only: with ``--executor ray`` each run starts its own
actors, as both shapes' actors at once would not fit a local Ray cluster (:func:`_shared_workers`).

Figures as they come: each run prints one line as it finishes (wall, env-steps/s, efficiency,
utilisation) and rewrites ``--json`` with everything measured so far, ``"complete": false`` until the
last run and ``"complete": true`` with the final medians. An interrupted benchmark (Ctrl-C,
``timeout -s INT``) prints the medians of the runs that finished, each short row saying how many of
``--repeats`` it holds, and exits non-zero (130).

By default the server is the FIXED-LATENCY ``delay`` model: inference is a sleep of ``--delay-ms`` (+
``--per-obs-ms`` per observation; by default 20 ms + 2 ms, the shape of a 1B-class policy on one GPU:
launch-bound at small batches), which measures the scheduler alone; ``--model NAME --preset P`` serves
a real model with random weights instead, ``--server-url`` any running server.

``--servers S`` (or ``--devices cuda:0,cuda:1``, one server per device, or ``--server-url`` given S
times) compares one server with S: each pipelined schedule of ``--stages`` runs once against the first
server and once against all S (:mod:`wamkit.eval.servers`: whole stages per server), the two runs
interleaved in every repeat; printed side by side with the ratio of their env-steps/s.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from wamkit import embodiments
from wamkit.config import SERVE_PRECISIONS, ConfigError, ServeConfig, load_config
from wamkit.constants import OBS_STATE, TASK, image_key
from wamkit.files import atomic_write_json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--suite", default="metaworld", help="env suite (default: metaworld)")
    parser.add_argument(
        "--tasks", default="reach-v3,push-v3", help="comma-separated tasks (default: reach-v3,push-v3)"
    )
    parser.add_argument("--trials", type=int, default=4, help="trials per task (default: 4)")
    parser.add_argument(
        "--max-steps", type=int, default=40, help="policy steps per episode at most (default: 40)"
    )
    parser.add_argument("--image-size", type=int, default=64, help="camera resolution in px (default: 64)")
    parser.add_argument(
        "--cameras",
        default="",
        help="comma-separated cameras (default: the suite's embodiment's default cameras)",
    )
    parser.add_argument("--render-quality", default="fast", choices=["fast", "default"])
    parser.add_argument(
        "--render-gpu",
        type=int,
        default=-1,
        help="env.render_gpu: EGL device the env workers render on (-1: EGL's choice)",
    )
    parser.add_argument("--num-envs", type=int, default=8, help="envs for (b) and (c) (default: 8)")
    parser.add_argument("--workers", type=int, default=0, help="env worker processes (default: CPU count)")
    parser.add_argument(
        "--replan-interval", type=int, default=8, help="actions applied per chunk (default: 8)"
    )
    parser.add_argument("--stages", default="2,4,auto", help="pipelined stage counts (default: 2,4,auto)")
    parser.add_argument(
        "--schedules",
        default="serial,lockstep,pipelined",
        help="which schedules run, from serial, lockstep, pipelined (default: all three)",
    )
    parser.add_argument(
        "--serial-trials",
        type=int,
        default=0,
        help="(a) runs only the first this many trials per task (its env-steps/s is compared; the "
        "episodes it shares with the others must agree) (default: all, as --trials)",
    )
    parser.add_argument(
        "--executor",
        default="local",
        choices=["local", "ray"],
        help="env workers: local processes, started once per shape (serial's, the others') and reused "
        "by every run of it, or Ray actors, started by each run (default: local)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="runs of each schedule, interleaved; medians (default: 2; 1 for runs too long to repeat)",
    )
    parser.add_argument(
        "--calibrate-s", type=float, default=3.0, help="calibration seconds per run (default: 3)"
    )
    server = parser.add_argument_group("server (default: the fixed-latency delay model)")
    server.add_argument(
        "--delay-ms", type=float, default=20.0, help="delay model: ms per model call (default: 20)"
    )
    server.add_argument(
        "--per-obs-ms", type=float, default=2.0, help="delay model: extra ms per observation (default: 2)"
    )
    server.add_argument("--model", default="", help="serve this registered model with random weights instead")
    server.add_argument("--preset", default="", help="its size preset")
    server.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a model option for --model (repeatable)",
    )
    server.add_argument("--device", default="auto", help="server device (default: auto)")
    server.add_argument(
        "--precision",
        choices=SERVE_PRECISIONS,
        default="auto",
        help="serve.precision of a --model server (default: auto, bf16 autocast for fp32 weights on CUDA)",
    )
    server.add_argument(
        "--server-url",
        action="append",
        default=[],
        help="use a running server instead of starting one (repeat it for several servers)",
    )
    server.add_argument(
        "--servers",
        type=int,
        default=0,
        help="compare 1 server with this many, started locally (default: as many as --devices or "
        "--server-url name, else 1)",
    )
    server.add_argument(
        "--devices",
        default="",
        help="one device per started server, comma-separated (e.g. cuda:0,cuda:1; default: --device "
        "for each); a cuda:N server sees GPU N only (CUDA_VISIBLE_DEVICES)",
    )
    server.add_argument(
        "--fit-shapes",
        action="store_true",
        help="random-weight models only: fit observations/actions to the model's shapes (e.g. cosmos3 on MetaWorld)",
    )
    parser.add_argument(
        "--out", default="", help="keep each run's outputs here (default: a temporary folder)"
    )
    parser.add_argument(
        "--json",
        default="",
        help='also write the figures to this JSON file, rewritten after every run ("complete": false '
        "until the last)",
    )


def _serve_args(args: argparse.Namespace, device: str = "") -> tuple[list[str], ServeConfig, str]:
    """What to serve (``wamkit serve`` arguments), the server's ``serve`` section, and a label saying
    what the server is."""
    device = device or args.device
    if args.model:
        serve = ServeConfig(device=device, precision=args.precision)
        cmd = ["--model", args.model, "--random-init"]
        if args.preset:
            cmd += ["--preset", args.preset]
        for opt in args.option:
            cmd += ["--option", opt]
        fitted = ", observations fitted to its input shapes (--fit-shapes)" if args.fit_shapes else ""
        name = f"model '{args.model}'" + (f" preset {args.preset}" if args.preset else "")
        name += "".join(f" {opt}" for opt in args.option)
        return cmd, serve, f"{name}, random weights, {device}, precision {args.precision}{fitted}"
    cmd = ["--model", "delay", "--random-init"]
    cmd += ["--option", f"delay_ms={args.delay_ms}", "--option", f"per_obs_ms={args.per_obs_ms}"]
    profile = embodiments.for_suite(args.suite)
    if profile is not None:  # the delay server of the suite's embodiment (its shapes)
        cmd += ["--preset", profile.name]
    label = (
        f"FIXED-LATENCY DELAY SERVER (not a model): {args.delay_ms:g} ms per call + {args.per_obs_ms:g} ms "
        "per observation; measures the scheduler alone"
    )
    if (args.delay_ms, args.per_obs_ms) == (20.0, 2.0):
        label += " (the default cost: the shape of a 1B-class policy on one GPU)"
    return cmd, ServeConfig(device="cpu"), label


def _modes(args: argparse.Namespace, servers: int = 1) -> list[tuple[str, int, int]]:
    """``(label, num_envs, stages)``; stages 0 = auto. Comparing servers: the pipelined ones only, each
    with a stage per server at least."""
    n = args.num_envs
    chosen = [x.strip() for x in args.schedules.split(",") if x.strip()]
    unknown = sorted(set(chosen) - set(SCHEDULES))
    if unknown or not chosen:
        raise ConfigError(
            f"--schedules: {args.schedules!r}; expected a comma list from {', '.join(SCHEDULES)}"
        )
    modes = [
        ("(a) serial, 1 obs/request (openpi)", 1, 1),
        ("(b) lock-step, 1 batched request (LeRobot)", n, 1),
    ]
    modes = [m for m, name in zip(modes, SCHEDULES) if name in chosen]
    if servers > 1:
        modes = []
        if n % servers:
            raise ConfigError(f"--num-envs={n} must be a multiple of the {servers} servers")
        if "pipelined" not in chosen:
            raise ConfigError("--schedules: several servers are compared on the pipelined schedule alone")
    if "pipelined" not in chosen:
        return modes
    for token in [t.strip() for t in args.stages.split(",") if t.strip()]:
        if token == "auto":
            modes.append(("(c) pipelined, auto", n, 0))
            continue
        if not token.isdigit() or int(token) < 1 or n % int(token):
            raise ConfigError(f"--stages: {token!r} must be 'auto' or a divisor of --num-envs={n}")
        if servers > 1 and int(token) < servers:
            raise ConfigError(
                f"--stages: P={token} is fewer than the {servers} servers (each serves whole stages)"
            )
        if int(token) > 1:
            modes.append((f"(c) pipelined, P={token}", n, int(token)))
    if not modes:
        raise ConfigError("--stages: no pipelined schedule to compare the servers on (e.g. --stages auto)")
    return modes


SCHEDULES = ("serial", "lockstep", "pipelined")


class FittedPolicy:
    """BENCHMARK ONLY (``--fit-shapes``): feeds a random-weight model whose inputs differ from the env's.

    The server's image keys get the env's cameras in turn, the state is zero-padded or cut to the
    model's ``state_dim`` and the actions are cut or zero-padded to the env's ``action_dim``. The costs
    (request size, model call) are the model's; the behaviour means nothing, which random weights never do.
    """

    def __init__(self, url: str, env_cfg, patience) -> None:
        from wamkit.envs import suite_info

        self.client = patience.client(url)
        self.reply_timeout_s = patience.reply_timeout_s
        inputs = self.client.metadata.get("inputs") or {}
        self.image_keys = list(inputs.get("image_keys") or [])
        self.state_dim = int(inputs.get("state_dim") or 0)
        self.cameras = [image_key(c) for c in env_cfg.cameras]
        self.action_dim = suite_info(env_cfg.suite).action_dim

    @property
    def identity(self) -> dict[str, Any] | None:
        from wamkit.eval.backends.wamkit import served_identity

        return served_identity(self.client.metadata or {})

    def __call__(
        self, obs_list: list[dict[str, Any]], seeds: list[int] | None = None
    ) -> tuple[np.ndarray, float, int]:
        from wamkit.eval.backends.wamkit import reply_timing

        req: dict[str, Any] = {}
        for i, key in enumerate(self.image_keys or self.cameras):
            req[key] = np.stack([o[self.cameras[i % len(self.cameras)]] for o in obs_list])
        state = np.stack([np.asarray(o[OBS_STATE], np.float32) for o in obs_list])
        if self.state_dim:
            fitted = np.zeros((len(obs_list), self.state_dim), np.float32)
            n = min(self.state_dim, state.shape[1])
            fitted[:, :n] = state[:, :n]
            state = fitted
        req[OBS_STATE] = state
        req["prompt"] = [str(o[TASK]) for o in obs_list]
        t0 = time.perf_counter()
        reply = self.client.infer(req, timeout_s=self.reply_timeout_s)
        rtt = time.perf_counter() - t0
        actions = np.asarray(reply["actions"], np.float32)
        out = np.zeros((*actions.shape[:2], self.action_dim), np.float32)
        n = min(self.action_dim, actions.shape[2])
        out[..., :n] = actions[..., :n]
        return (out, *reply_timing(reply, rtt, len(obs_list)))

    def close(self) -> None:
        self.client.close()


def _config(args, urls: list[str], out: Path, num_envs: int, stages: int, workers: int, trials: int = 0):
    """One run's evaluation config: the same envs for every schedule, its own shape and output folder."""
    cameras = [c for c in args.cameras.split(",") if c]
    overrides = [
        f"env.suite={args.suite}",
        f"env.tasks={args.tasks}",
        f"env.image_size={args.image_size}",
        f"env.render_quality={args.render_quality}",
        f"env.render_gpu={args.render_gpu}",
        f"env.max_steps={args.max_steps}",
        f"eval.server_url={','.join(urls)}",
        f"eval.out_dir={out}",
        f"eval.trials={trials or args.trials}",
        f"eval.num_envs={num_envs}",
        f"eval.pipeline_stages={stages}",
        f"eval.workers={min(workers, num_envs)}",
        f"eval.replan_interval={args.replan_interval}",
        f"eval.executor={args.executor}",
        f"eval.calibrate_s={args.calibrate_s}",
        "eval.videos=0",
    ]
    profile = embodiments.for_suite(args.suite)
    cameras = cameras or (list(profile.default_cameras) if profile is not None else [])
    if cameras:
        overrides.append(f"env.cameras=[{', '.join(cameras)}]")
    return load_config(None, overrides)


def _shared_workers(stack: contextlib.ExitStack, pools: dict, cfg):
    """The local env workers of ``cfg``'s shape (slots per worker), started by the first run of that
    shape and handed to every later one; closed with ``stack``. Serial is one shape, the others another.

    None (each run starts its own) with Ray: both shapes' actors at once ask for 1 + W CPUs, and a local
    Ray cluster has as many as the machine has cores, so the second shape's actors would wait forever
    for a CPU; local processes ask for none (serial's one worker idles while the others run)."""
    from wamkit.eval.runner import slots_per_worker, start_env_workers

    if cfg.eval.executor != "local":
        return None
    shape = tuple(slots_per_worker(cfg.eval))
    if shape not in pools:
        pools[shape] = stack.enter_context(start_env_workers(cfg))
    return pools[shape]


def _run_mode(args, cfg, env_workers) -> dict[str, Any]:
    """One run of ``cfg`` on ``env_workers``: its throughput and its outcome per episode."""
    from wamkit.eval.runner import run_eval

    factory = FittedPolicy if args.fit_shapes else None
    summary = run_eval(cfg, progress=False, prebuild=True, policy_factory=factory, env_workers=env_workers)
    records = [
        json.loads(line) for line in (Path(cfg.eval.out_dir) / "episodes.jsonl").read_text().splitlines()
    ]
    outcome = {
        f"{r['task']}/{r['trial']}": (r["success_once"], r["length"], round(r["return"], 6)) for r in records
    }
    return {"throughput": summary["throughput"], "outcome": outcome}


def _server_count(args: argparse.Namespace) -> int:
    """How many servers: ``--servers``, else as many as ``--devices`` or ``--server-url`` name, else 1."""
    devices = [d for d in args.devices.split(",") if d]
    n = args.servers or max(len(devices), len(args.server_url), 1)
    for option, given in (("--devices", len(devices)), ("--server-url", len(args.server_url))):
        if given and given != n:
            raise ConfigError(f"{option} names {given} server(s) but --servers={n}: give one per server")
    return n


def _device_env(device: str) -> tuple[str, dict[str, str]]:
    """``(serve --device, environment)``: a ``cuda:N`` server sees only GPU N, as ``cuda``."""
    kind, _, index = device.partition(":")
    if kind != "cuda" or not index:
        return device, {}
    visible = [v for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v]
    if not index.isdigit() or (visible and int(index) >= len(visible)):
        raise ConfigError(
            f"--devices: {device!r} is not one of the visible GPUs (CUDA_VISIBLE_DEVICES="
            f"{','.join(visible)}: cuda:0..cuda:{len(visible) - 1})"
        )
    return "cuda", {"CUDA_VISIBLE_DEVICES": visible[int(index)] if visible else index}


def _start_servers(args, stack: contextlib.ExitStack, root: Path, n: int) -> tuple[list[str], str]:
    """The servers' URLs (started here unless ``--server-url``) and a label saying what they are."""
    from wamkit.eval.server_proc import start_server_process

    if args.server_url:
        return list(args.server_url), f"running server(s) at {', '.join(args.server_url)}"
    devices = [d for d in args.devices.split(",") if d] or [args.device] * n
    urls, labels = [], []
    for i, device in enumerate(devices):
        serve_device, env = _device_env(device)
        cmd, serve, label = _serve_args(args, serve_device)
        log_path = root / ("server.log" if n == 1 else f"server{i}.log")
        urls.append(
            stack.enter_context(start_server_process(cmd, log_path=log_path, env=env, serve=serve)).url
        )
        labels.append(label)
    if n == 1:
        return urls, labels[0]
    where = f", one per device: {', '.join(devices)}" if args.model or args.devices else ""
    return urls, f"{labels[0]}; {n} servers{where}"


def main(args: argparse.Namespace) -> int:
    if args.repeats < 1:
        raise ConfigError(f"--repeats: expected >= 1 run per schedule, got {args.repeats}")
    if not 0 <= args.serial_trials <= args.trials:
        raise ConfigError(f"--serial-trials: expected 0..--trials={args.trials}, got {args.serial_trials}")
    if args.calibrate_s <= 0:
        raise ConfigError("--calibrate-s: expected > 0 seconds: the efficiency column needs the calibration")
    workers = args.workers or os.cpu_count() or 1
    servers = _server_count(args)
    modes = _modes(args, servers)
    if threading.current_thread() is threading.main_thread():
        # Ctrl-C (or `timeout -s INT`) ends the benchmark with the medians of the runs that finished,
        # also when it was started with SIGINT ignored (a background job of a non-interactive shell,
        # whose servers, given SIGINT with it, would otherwise stop under a benchmark that goes on)
        signal.signal(signal.SIGINT, signal.default_int_handler)
    with contextlib.ExitStack() as stack:
        root = Path(args.out) if args.out else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        root.mkdir(parents=True, exist_ok=True)  # --out may name a folder that does not exist yet
        urls, label = _start_servers(args, stack, root, servers)
        bench = Runs(args, label, workers, modes, servers)
        pools: dict[tuple[int, ...], Any] = {}  # env workers by shape, kept for every run of it
        try:
            for r in range(args.repeats):  # interleaved: a, b, c, ..., a, b, c, ... (1 and S servers each)
                for i, (name, n, p) in enumerate(modes):
                    for c in bench.counts:
                        out = root / (
                            f"mode{i}_run{r}" if c == servers == 1 else f"mode{i}_servers{c}_run{r}"
                        )
                        if out.exists():
                            raise ConfigError(f"--out: {out} already exists; choose an empty folder")
                        trials = args.serial_trials if name.startswith("(a)") else 0
                        cfg = _config(args, urls[:c], out, n, p, workers, trials)
                        bench.add(i, c, r, _run_mode(args, cfg, _shared_workers(stack, pools, cfg)))
        except KeyboardInterrupt:
            # before the workers and servers are closed (which takes a while): what finished, at once
            print("\ninterrupted: medians of the runs that finished", flush=True)
            bench.report(complete=False)
            raise
    same = bench.report(complete=True)
    deterministic = not args.model and not args.server_url  # the delay model: results must agree
    return 0 if same or not deterministic else 1


class Runs:
    """The runs measured so far, by ``(schedule index, servers)``. Each run is printed on one line as it
    finishes and the ``--json`` file rewritten (``"complete": false`` until every run is in), so a
    benchmark stopped part-way still leaves the figures of what it measured."""

    def __init__(self, args, label: str, workers: int, modes: list[tuple[str, int, int]], servers: int):
        self.args, self.label, self.workers, self.modes, self.servers = args, label, workers, modes, servers
        self.counts = [1, servers] if servers > 1 else [1]  # servers per run: one, and all of them
        self.runs: dict[tuple[int, int], list[dict[str, Any]]] = {
            (i, c): [] for i in range(len(modes)) for c in self.counts
        }

    def add(self, i: int, c: int, repeat: int, result: dict[str, Any]) -> None:
        self.runs[(i, c)].append(result)
        print(self._line(i, c, repeat, result["throughput"]), flush=True)
        self.write_json(complete=False)

    def _line(self, i: int, c: int, repeat: int, tp: dict[str, Any]) -> str:
        name, _, stages = self.modes[i]
        where = f", {c} server{'s' if c > 1 else ''}" if self.servers > 1 else ""
        chosen = "" if stages else f" (P={tp['stages']})"  # auto: the stage count it chose
        return (
            f"run {repeat + 1} of {self.args.repeats}: {name}{chosen}{where}: "
            f"wall {tp['wall']:.2f} s, {tp['env_steps_per_s']:.1f} env-steps/s, efficiency "
            f"{_percent(tp['efficiency'])}, utilisation {_percent(tp['utilisation'])}"
        )

    def figures(self) -> list[dict[str, Any]]:
        """One row per schedule (and server count) with a finished run: medians, and every run."""
        rows = []
        for i, (name, n, _) in enumerate(self.modes):
            for c in self.counts:
                done = self.runs[(i, c)]
                if done:
                    row = {"mode": name, "num_envs": n, **({"servers": c} if self.servers > 1 else {})}
                    row.update(_median(done)["throughput"], runs=[x["throughput"] for x in done])
                    rows.append(row)
        return rows

    def write_json(self, complete: bool) -> None:
        """``--json``: the figures so far; ``repeats`` is the runs asked per schedule, ``len(row["runs"])``
        the runs that finished (fewer only when ``complete`` is false)."""
        if self.args.json:
            doc = {"server": self.label, "complete": complete, "repeats": self.args.repeats}
            atomic_write_json(self.args.json, {**doc, "runs": self.figures()})

    def report(self, complete: bool) -> bool:
        """Print the medians (of the runs that finished, when not ``complete``), write ``--json``;
        return whether every run agrees with every other, episode by episode."""
        self.write_json(complete)
        finished = [x["outcome"] for results in self.runs.values() for x in results]
        same = _agree(finished)
        if not finished:
            print("no run finished", flush=True)
        elif self.servers > 1:
            _print_servers(self.args, self.label, self.workers, self.modes, self.runs, self.servers, same)
        else:
            rows = [(name, n, self.runs[(i, 1)]) for i, (name, n, _) in enumerate(self.modes)]
            _print(self.args, self.label, self.workers, rows)
        sys.stdout.flush()
        return same


def _percent(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


MEDIAN_KEYS = ("wall", "env_steps_per_s", "sim", "infer", "busy_bound", "utilisation", "bound_sim",
               "bound_infer", "bound", "efficiency", "env_steps")  # fmt: skip


def _agree(outcomes: list[dict[str, Any]]) -> bool:
    """Whether runs agree on every episode they share (a subset run, ``--serial-trials``, shares its
    episodes with the full ones; each run must share at least one)."""
    if not outcomes:
        return False
    common = set.intersection(*(set(o) for o in outcomes))
    return bool(common) and all(o[k] == outcomes[0][k] for o in outcomes for k in common)


def _median(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One schedule's repeats as one row: the median of every figure, the stage counts chosen, and the
    episode outcome (the first run's, or None if the repeats disagree)."""
    tps = [r["throughput"] for r in results]
    tp = dict(tps[0])
    for key in MEDIAN_KEYS:
        values = [t[key] for t in tps if t.get(key) is not None]
        tp[key] = statistics.median(values) if values else None
    tp["stages_chosen"] = [t["stages"] for t in tps]
    idles = [t["server_idle"] for t in tps if t.get("server_idle")]
    if idles:  # each cause's median over the repeats
        tp["server_idle"] = {k: statistics.median(i[k] for i in idles) for k in idles[0]}
    b_sim, b_infer = tp["bound_sim"], tp["bound_infer"]
    tp["bound_side"] = None if b_sim is None else ("simulation" if b_sim >= b_infer else "inference")
    # the flag of a run that beat its bound belongs to that run; the row says only whether its median does
    tp.pop("bound_above_run", None)
    tp["runs_above_bound"] = sum(1 for t in tps if t.get("bound_above_run"))
    same = all(r["outcome"] == results[0]["outcome"] for r in results)
    return {"throughput": tp, "outcome": results[0]["outcome"] if same else None}


def _stages_label(tp: dict[str, Any]) -> str:
    chosen = sorted(set(tp["stages_chosen"]))
    return str(chosen[0]) if len(chosen) == 1 else "/".join(map(str, tp["stages_chosen"]))


def _finished(k: int, repeats: int) -> str:
    """A row's note when fewer runs finished than were asked (an interrupted benchmark)."""
    return "" if k == repeats else f"  {k} of {repeats} runs"


def _runs_label(repeats: int, interrupted: bool, per: str) -> str:
    """What a table's figures are: medians of ``repeats`` runs ``per`` row, one run, or what finished."""
    if interrupted:
        return f"INTERRUPTED: medians of the runs that finished ({repeats} asked {per})"
    if repeats == 1:
        return f"ONE run {per} (--repeats 1): no medians, no spread"
    return f"medians of {repeats} interleaved runs {per}"


def _print(args, label: str, workers: int, schedules: list[tuple[str, int, list]]) -> None:
    """The medians table; ``schedules``: ``(name, num_envs, finished runs)``, at least one run in all."""
    rows = [(name, n, _median(done), len(done)) for name, n, done in schedules if done]
    short = len(rows) < len(schedules) or any(k < args.repeats for *_, k in rows)
    medians = _runs_label(args.repeats, short, "per schedule")
    # the episodes of a run (a sampling model's medians carry no common outcome; each run has its own)
    n_ep = len([done for _, _, done in schedules if done][-1][0]["outcome"])
    print(
        f"wamkit bench eval: {args.suite} {args.tasks}, {n_ep} episodes of <= {args.max_steps} steps, "
        f"{args.image_size} px {args.render_quality} render, replan every {args.replan_interval}, "
        f"{workers} workers ({args.executor}); {medians}"
    )
    print(f"server: {label}")
    if args.serial_trials:
        print(
            f"(a) ran the first {args.serial_trials} trial(s) of each task only (--serial-trials); its "
            "env-steps/s is what compares"
        )
    head = f"{'schedule':44} {'envs':>4} {'P':>3} {'wall s':>7} {'steps/s':>8} {'vs (a)':>6} {'vs (b)':>6} "
    head += f"{'bound s':>7} {'side':>5} {'effic.':>6} {'busy s':>7} {'util.':>5}"
    print(head)
    by_label = {name[:3]: res["throughput"] for name, _, res, _ in rows}  # "(a)", "(b)", "(c)"
    base_a = by_label["(a)"]["env_steps_per_s"] if "(a)" in by_label else None
    base_b = by_label["(b)"]["env_steps_per_s"] if "(b)" in by_label else None

    def vs(sps: float, base: float | None) -> str:
        return f"{sps / base:>5.2f}x" if base else f"{'-':>6}"

    for name, n, res, k in rows:
        tp = res["throughput"]
        sps = tp["env_steps_per_s"]
        print(
            f"{name:44} {n:>4} {_stages_label(tp):>3} {tp['wall']:>7.2f} {sps:>8.1f} {vs(sps, base_a)} "
            f"{vs(sps, base_b)} {tp['bound']:>7.2f} {tp['bound_side'][:5]:>5} "
            f"{100 * tp['efficiency']:>5.0f}% {tp['busy_bound']:>7.2f} {100 * tp['utilisation']:>4.0f}%"
            f"{_finished(k, args.repeats)}"
        )
    for name, n, done in schedules:
        if not done:
            print(f"{name:44} {n:>4}   no run finished")
    b = by_label.get("(b)") or rows[0][2]["throughput"]
    ratio = (b["bound_sim"]) / max(b["bound_infer"], 1e-9)
    cal = b.get("calibration") or {}
    lat = ", ".join(f"{k}: {1000 * v:.1f}" for k, v in (cal.get("latency") or {}).items())
    print(
        f"calibration of (b): {1000 * cal.get('t_step', 0):.2f} ms per env step per worker, "
        f"{1000 * cal.get('t_reset', 0):.1f} ms per episode start, server ms by batch size {{{lat}}}"
    )
    print(
        f"(b)'s calibrated simulation per worker / inference = {ratio:.2f} "
        f"({'within' if 0.5 <= ratio <= 2 else 'outside'} 2x of each other)"
    )
    print(
        "efficiency = bound / wall, bound = max((sim per step x steps + sim per start x starts) / workers, "
        "sum of latency(batch) over the model calls), both measured before each run (apart from it); "
        "utilisation = busy / wall, busy = max(summed worker busy time / workers, union of the server's "
        "busy intervals), the run's own times"
    )
    over = [
        f"{name}: {res['throughput']['runs_above_bound']} of {k} runs"
        for name, _, res, k in rows
        if res["throughput"]["runs_above_bound"]
    ]
    if over:
        print(
            f"runs over 100% efficiency ({'; '.join(over)}): they beat their calibrated bound, so a calibration "
            "overestimated a cost (each run's latency table is in its log); those efficiencies are not reliable"
        )
    same = all(res["outcome"] is not None for _, _, res, _ in rows) and _agree(
        [res["outcome"] for _, _, res, _ in rows]
    )
    if same:
        print("episode results identical across schedules and repeats: yes")
    elif args.model or args.server_url:
        print(
            "episode results differ across runs: expected, the model samples (only 'delay' is deterministic)"
        )
    else:
        print(
            "episode results identical across schedules and repeats: NO (a scheduling bug: the delay model is deterministic)"
        )


def _print_servers(args, label: str, workers: int, modes, runs, servers: int, same: bool) -> None:
    """One row per schedule: one server and all S side by side (medians), and the ratio. Interrupted,
    the schedules with a finished run on both sides have a row (with how many), the others a note."""
    both = [i for i in range(len(modes)) if runs[(i, 1)] and runs[(i, servers)]]
    medians = _runs_label(args.repeats, any(len(done) < args.repeats for done in runs.values()), "each")
    n_ep = len(next(done for done in runs.values() if done)[0]["outcome"])
    print(
        f"wamkit bench eval: {args.suite} {args.tasks}, {n_ep} episodes of <= {args.max_steps} steps, "
        f"{args.image_size} px {args.render_quality} render, replan every {args.replan_interval}, "
        f"{workers} workers ({args.executor}); 1 server vs {servers}, {medians}"
    )
    print(f"server: {label}")
    s = str(servers)
    print(
        f"{'schedule':24} {'envs':>4} {'P(1)':>5} {'steps/s (1)':>11} {'side (1)':>10} {'effic.':>6} "
        f"{'P(' + s + ')':>5} {'steps/s (' + s + ')':>11} {'side (' + s + ')':>10} {'effic.':>6} "
        f"{s + ' vs 1':>7}"
    )
    for i, (name, n, _) in enumerate(modes):
        k1, ks = len(runs[(i, 1)]), len(runs[(i, servers)])
        if i not in both:
            print(
                f"{name[4:]:24} {n:>4}   not measured on both sides (runs finished: 1 server {k1}, {s} {ks})"
            )
            continue
        one, many = (_median(runs[(i, c)])["throughput"] for c in (1, servers))
        cells = []
        for tp in (one, many):
            eff = f"{100 * tp['efficiency']:.0f}%" if tp["efficiency"] is not None else "-"
            cells.append(
                f"{_stages_label(tp):>5} {tp['env_steps_per_s']:>11.1f} {tp['bound_side']:>10} {eff:>6}"
            )
        ratio = many["env_steps_per_s"] / max(one["env_steps_per_s"], 1e-9)
        short = "" if k1 == ks == args.repeats else f"  {k1} and {ks} of {args.repeats} runs"
        print(f"{name[4:]:24} {n:>4} {cells[0]} {cells[1]} {ratio:>6.2f}x{short}")
    for i in both:  # where each side's servers idled (medians): the cause a ratio short of S hides
        cells = []
        for c in (1, servers):
            tp = _median(runs[(i, c)])["throughput"]
            idle = tp.get("server_idle")
            if idle:
                cells.append(
                    f"{c} server(s) {idle['idle']:.2f} s of {tp['wall']:.2f} s: waiting for simulation "
                    f"{idle['simulation']:.2f}, request to model call {idle['transit']:.2f}, fill and drain "
                    f"{idle['fill_drain']:.2f}"
                )
        if cells:
            print(f"server idle per server, {modes[i][0][4:]}: " + "; ".join(cells))
    cal = (_median(runs[(both[0], servers)])["throughput"].get("calibration") or {}) if both else {}
    for k, table in enumerate(cal.get("server_latency") or []):
        lat = ", ".join(f"{b}: {1000 * v:.1f}" for b, v in table.items())
        print(f"calibration: server {k} ms by batch size {{{lat}}}")
    print(
        f"side: which side of the calibrated bound is the larger (inference divides over the {servers} "
        "servers); efficiency = bound / wall"
    )
    if same:
        print("episode results identical across server counts, schedules and repeats: yes")
    elif args.model or args.server_url:
        print(
            "episode results differ across runs: expected, the model samples (only 'delay' is deterministic)"
        )
    else:
        print("episode results identical across server counts, schedules and repeats: NO (a scheduling bug)")
