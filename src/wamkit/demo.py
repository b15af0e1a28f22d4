"""``wamkit demo``: the whole flow on MetaWorld with the built-in model, on a CPU.

collect (scripted experts) -> stats -> train (`tiny`) -> export (serving directory) -> serve ->
pipelined evaluation on seeds never used in training -> the same model with its cameras blanked, and
the chance level beside it (training demonstrations replayed blind) -> a report with a success table
beside the expert's rate.

Every stage writes a ``.done`` marker with what it produced into ``<out>/stages/``; a re-run skips a
finished stage and says so. An interrupted stage resumes where it can (collect keeps its journal,
training resumes from its newest complete checkpoint, evaluation from its journal).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from wamkit.config import PRESETS_DIR, RunConfig, load_config, save_config
from wamkit.files import atomic_write_json

log = logging.getLogger("wamkit.demo")
DEFAULT_CONFIG = PRESETS_DIR / "demo.yaml"  # packaged (wamkit.config.preset_path)
# The vision control's episodes per task: the first trials of the evaluation's own seeds. A blind model
# fails by running to env.max_steps, so each of its episodes costs the most; 10 a task shows chance.
BLIND_TRIALS = 10


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "config", nargs="?", default=None, help=f"YAML preset (default: {DEFAULT_CONFIG.name})"
    )
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.max_steps=200")
    parser.add_argument(
        "--out", default="runs/demo", help="folder for every stage's outputs (default: runs/demo)"
    )
    parser.add_argument(
        "--fresh", action="store_true", help="ignore finished stages and run everything again"
    )


def _stage(out: Path, name: str, fresh: bool, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    marker = out / "stages" / f"{name}.done"
    if marker.exists() and not fresh:
        result = json.loads(marker.read_text())
        print(f"[demo] {name}: already done, skipped ({marker})", flush=True)
        return result
    print(f"[demo] {name} ...", flush=True)
    t0 = time.perf_counter()
    result = fn()
    result["seconds"] = round(time.perf_counter() - t0, 1)
    atomic_write_json(marker, result, default=str)
    print(f"[demo] {name}: done in {result['seconds']:.0f} s", flush=True)
    return result


def demo_config(config: str | None, overrides: list[str], out: Path) -> RunConfig:
    """The demo's config with every output path placed under ``out``."""
    cfg = load_config(config or DEFAULT_CONFIG, overrides)
    data = str(out / "data")
    return replace(
        cfg,
        collect=replace(cfg.collect, out=data),
        data=replace(cfg.data, root=data, stats=str(out / "stats.json")),
        train=replace(cfg.train, run_dir=str(out / "train"), resume="auto"),
        eval=replace(cfg.eval, out_dir=str(out / "eval"), serve_dir=str(out / "serve"), server_url=""),
    )


def run_demo(cfg: RunConfig, out: Path, fresh: bool = False) -> dict[str, Any]:
    from wamkit.data import compute_stats
    from wamkit.envs.collect import collect
    from wamkit.eval.report import markdown_table
    from wamkit.eval.runner import run_eval
    from wamkit.export.checkpoint import checkpoint_to_serving
    from wamkit.train.checkpoint import list_checkpoints
    from wamkit.train.loop import train

    out.mkdir(parents=True, exist_ok=True)
    save_config(cfg, out / "config.yaml")

    def _collect() -> dict[str, Any]:
        from wamkit.envs.collect_journal import CollectJournal

        summary = collect(cfg)
        kept = CollectJournal(cfg.collect.out).kept()  # counts earlier, resumed runs too
        short = {t: kept[t] for t in summary["tasks"] if kept[t] < cfg.collect.episodes}
        if short:
            # training on fewer demonstrations than configured would quietly weaken the demo
            raise RuntimeError(
                f"collect: the scripted expert kept too few episodes {short} of {cfg.collect.episodes} per task; raise env.max_steps or check the tasks"
            )
        return summary

    _stage(out, "collect", fresh, _collect)
    _stage(
        out,
        "stats",
        fresh,
        lambda: {
            "path": str(
                compute_stats(cfg.data.root, cfg.data.representation, cfg.data.chunk, cfg.data.seed).save(
                    cfg.data.stats
                )
            )
        },
    )

    def _train() -> dict[str, Any]:
        run_dir = train(cfg)
        return {"run_dir": str(run_dir), "checkpoint": str(list_checkpoints(run_dir / "checkpoints")[-1])}

    trained = _stage(out, "train", fresh, _train)
    _stage(
        out,
        "export",
        fresh,
        lambda: {
            "serve_dir": str(
                # with train.ema on, the model served and evaluated is the EMA of the trained weights
                checkpoint_to_serving(
                    trained["checkpoint"], cfg.eval.serve_dir, ema=cfg.train.ema, overwrite=True
                )
            )
        },
    )
    evaluated = _stage(out, "eval", fresh, lambda: run_eval(cfg, resume=True))
    # the vision control: the same model on the first BLIND_TRIALS episodes, its camera images sent black
    blind_eval = replace(
        cfg.eval, out_dir=str(out / "eval_blind"), blank_images=True, videos=0,
        trials=min(cfg.eval.trials or BLIND_TRIALS, BLIND_TRIALS),
        calibrate_s=0.0 if cfg.eval.pipeline_stages else cfg.eval.calibrate_s,  # its figure is unused
    )  # fmt: skip
    blind_cfg = replace(cfg, eval=blind_eval)
    blind = _stage(out, "eval_blind", fresh, lambda: run_eval(blind_cfg, resume=True))

    def _chance() -> dict[str, Any]:
        from wamkit.demo_report import scene_agnostic_replay

        return scene_agnostic_replay(cfg, blind_eval.trials)

    chance = _stage(out, "chance", fresh, _chance)

    def _report() -> dict[str, Any]:
        from wamkit.demo_report import forward_dynamics, write_report

        fd = forward_dynamics(cfg, Path(cfg.eval.serve_dir), out / "report" / "forward_dynamics.png")
        page = write_report(out, cfg, evaluated, blind, expert_rates(cfg.data.root), fd, chance)
        return {"report": str(page), "forward_dynamics": fd}

    reported = _stage(out, "report", fresh, _report)

    print()
    print(markdown_table(evaluated), end="")
    _print_expert_and_paths(evaluated, cfg)
    b_all = blind["all"]
    c_all = chance["all"]
    print(
        f"\nVision control (cameras blanked, the first {blind_eval.trials} of those episodes per task, "
        f"{b_all['episodes']} in all): {b_all['rate']:.1%}; "
        f"chance there (a training demonstration replayed blind): {c_all['rate']:.1%}"
    )
    fd = reported.get("forward_dynamics")
    if fd:
        print(
            f"Forward dynamics ({fd['predictions']} held-out predictions, {fd['chunk']} steps ahead), pixel error "
            f"in grey levels against copying the current frame: RMS {fd['model_rmse']:.1f} vs "
            f"{fd['copy_rmse']:.1f}, mean absolute {fd['model_error']:.1f} vs {fd['copy_error']:.1f}"
        )
    print(f"\nReport: {reported['report']}  (open it in a browser)")
    return evaluated


def expert_rates(dataset_root: str | Path) -> dict[str, tuple[int, int]]:
    """Per task (successes, attempts) of the scripted expert, from the collect journal."""
    from wamkit.envs.collect_journal import CollectJournal

    rates: dict[str, tuple[int, int]] = {}
    for entry in CollectJournal(dataset_root).entries:
        ok, n = rates.get(entry["task"], (0, 0))
        rates[entry["task"]] = (ok + bool(entry.get("success")), n + 1)
    return rates


def _print_expert_and_paths(evaluated: dict[str, Any], cfg: RunConfig) -> None:
    tasks = evaluated["suites"].get(cfg.env.suite, {}).get("tasks", {})
    print("\nScripted expert (training seeds) beside the trained model (held-out seeds):\n")
    print("| task | expert success | model success | model 95% CI |")
    print("| --- | ---: | ---: | --- |")
    for task, (ok, n) in expert_rates(cfg.data.root).items():
        r = tasks.get(task)
        model = f"{r['rate']:.0%} ({r['success_once']}/{r['episodes']})" if r else "-"
        ci = f"{r['ci95'][0]:.0%}-{r['ci95'][1]:.0%}" if r else "-"
        print(f"| {task} | {ok / n:.0%} ({ok}/{n}) | {model} | {ci} |")
    overall = evaluated["all"]
    print(f"\nModel success over all tasks: {overall['rate']:.1%} of {overall['episodes']} episodes")
    tp = evaluated.get("throughput")
    if tp and "utilisation" in tp:
        from wamkit.eval.report import throughput_line

        print(f"Evaluator: {throughput_line(tp)}")
    elif tp:  # an eval stage finished before the calibrated bound existed
        print(f"Evaluator: {tp['env_steps_per_s']:.0f} env-steps/s")
    print(f"\nTensorBoard: tensorboard --logdir {Path(cfg.train.run_dir) / 'tb'}")
    print(
        f"Reports:     {Path(cfg.eval.out_dir)}/results.md, summary.json, success_per_task.png, timeline.png"
    )
    print(f"Videos:      {Path(cfg.eval.out_dir) / 'videos'}")
    _print_next_steps(cfg)


def _print_next_steps(cfg: RunConfig) -> None:
    """The commands a user types next, with what puts ``wamkit`` on their PATH when it is not."""
    print("\nNext:")
    if shutil.which("wamkit") is None:  # `make demo` ran .venv/bin/wamkit without activating the venv
        activate = Path(sys.prefix) / "bin" / "activate"
        with contextlib.suppress(ValueError):
            activate = activate.relative_to(Path.cwd())
        print(f"  source {activate}   # puts wamkit (and tensorboard) on your PATH in this shell")
    print(f"  wamkit runs {cfg.train.run_dir}")
    print(f"  wamkit serve {cfg.eval.serve_dir} --port 8000")


def main(args: argparse.Namespace) -> int:
    out = Path(args.out)
    config, overrides = args.config, list(args.overrides)
    if config is not None and "=" in config:  # no preset, only overrides: the default preset
        config, overrides = None, [config, *overrides]
    cfg = demo_config(config, overrides, out)
    run_demo(cfg, out, fresh=args.fresh)
    return 0
