"""Reports people read: ``summary.json``, ``results.md`` and two plots, all from the journal.

- ``summary.json``: per suite and task success (and per category, where the suite's metadata groups
  its tasks: a robustness suite's perturbations) (``success_once``) with Wilson 95% intervals,
  ``success_at_end``, mean length/return, failure reasons, ``env_errors`` (the episodes recorded as
  ``env_error`` failures, with their message), the run's throughput (see :func:`throughput`: the
  efficiency against the calibrated, independent bound and the utilisation against the run's own busy
  times), the plan (seed rule, render look, server identity, ...) and ``stack``: the simulator stack's
  versions (the profiles' ``packages``: mujoco, metaworld, ...).
- ``results.md``: the same as a markdown table (success in percent, interval in points).
- ``success_per_task.png``: one bar per task with its interval.
- ``timeline.png``: for each pipeline stage, when it simulated and when it waited for inference; with
  P > 1 the bars of different stages overlap, which is the point of pipelining.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from wamkit.envs.base import stack_versions
from wamkit.envs.suites import task_categories
from wamkit.eval.execution import pooled_smoothness
from wamkit.eval.success import env_error_episodes, failure_reasons, summarize
from wamkit.files import atomic_write_json, atomic_write_text

SUMMARY = "summary.json"
TABLE = "results.md"
PLOT_SUCCESS = "success_per_task.png"
PLOT_TIMELINE = "timeline.png"


def throughput(timing: dict[str, Any]) -> dict[str, Any]:
    """Achieved wall time against two bounds, from the scheduler's totals (seconds).

    ``timing`` holds ``wall`` (the timed run), ``sim`` (summed busy time of all env workers),
    ``infer`` (the length of the union of the server's busy intervals: each request's
    ``[reply - server seconds, reply]``, so a model call that served several stages counts once),
    ``workers``, ``env_steps`` and, when the run was calibrated, ``bound_sim`` and ``bound_infer``
    (:func:`wamkit.eval.calibrate.independent_bound`).

    - ``efficiency = bound / wall`` with ``bound = max(bound_sim, bound_infer)``, measured apart from
      the run: a schedule that makes simulation or inference slower loses efficiency. None when the
      run was not calibrated (``eval.calibrate_s=0``). Over 100% means the run beat its bound, so the
      calibration overestimated a cost (a GPU model's latency can vary between calibrations);
      ``bound_above_run`` then names the side, its calibrated seconds and the run's busy seconds.
    - ``utilisation = busy_bound / wall`` with ``busy_bound = max(sim / workers, infer)``, the run's
      own busy times: how well the schedule kept the slower side busy (never over 100%).
    """
    wall = float(timing["wall"])
    workers = max(1, int(timing["workers"]))
    sim, infer = float(timing["sim"]), float(timing["infer"])
    busy_bound = max(sim / workers, infer)
    out = {
        **timing,
        "busy_bound": busy_bound,
        "utilisation": busy_bound / wall if wall > 0 else 0.0,
        "bound": None,
        "bound_side": None,
        "efficiency": None,
        "env_steps_per_s": timing["env_steps"] / wall if wall > 0 else 0.0,
    }
    if "bound_sim" in timing:
        b_sim, b_infer = float(timing["bound_sim"]), float(timing["bound_infer"])
        out["bound"] = max(b_sim, b_infer)
        out["bound_side"] = "simulation" if b_sim >= b_infer else "inference"
        out["efficiency"] = out["bound"] / wall if wall > 0 else 0.0
        if out["efficiency"] > 1.0:
            run_busy = sim / workers if out["bound_side"] == "simulation" else infer
            out["bound_above_run"] = {
                "side": out["bound_side"],
                "calibrated": out["bound"],
                "run_busy": run_busy,
            }
    return out


def build_summary(records: list[dict[str, Any]], timing: dict[str, Any] | None, plan: dict[str, Any]):
    suites = dict.fromkeys(r["suite"] for r in records)
    summary = summarize(records, {s: task_categories(s) for s in suites})
    summary["failures"] = failure_reasons(records)
    summary["env_errors"] = env_error_episodes(records)
    summary["plan"] = plan
    # the stack that wrote this report; plan["stack"] is the one the episodes ran on
    summary["stack"] = stack_versions()
    smooth = pooled_smoothness(records)  # mean action jerk at chunk boundaries and within chunks
    if smooth is not None:
        summary["smoothness"] = smooth
    if timing is not None:
        summary["throughput"] = throughput(timing)
    return summary


def markdown_table(summary: dict[str, Any]) -> str:
    """One row per task and a bold row per suite: episodes, success (once / at end), 95% interval."""
    lines = [
        "| suite | task | episodes | success % | 95% CI | at end % | mean length |",
        "| --- | --- | ---: | ---: | --- | ---: | ---: |",
    ]

    def row(suite: str, task: str, r: dict[str, Any], bold: bool = False) -> str:
        lo, hi = r["ci95"]
        cells = [
            suite,
            task,
            str(r["episodes"]),
            f"{100 * r['rate']:.1f}",
            f"{100 * lo:.1f}–{100 * hi:.1f}",
            f"{100 * r['rate_at_end']:.1f}",
            f"{r['mean_length']:.1f}",
        ]
        if bold:
            cells = [f"**{c}**" for c in cells]
        return "| " + " | ".join(cells) + " |"

    for suite, s in summary["suites"].items():
        for task, r in s["tasks"].items():
            lines.append(row(suite, task, r))
        for category, r in s.get("categories", {}).items():
            lines.append(row(suite, f"category: {category}", r))
        lines.append(row(suite, "all", s["all"], bold=True))
    for e in summary.get("env_errors", []):
        lines.append(f"\nenv error, counted as a failure: {e['episode']} ({e['error']})")
    execution = (summary.get("plan") or {}).get("execution") or {}
    said = execution_line(execution)
    if said:
        lines += ["", said]
    tp = summary.get("throughput")
    if tp:
        lines += ["", throughput_line(tp, rtc=execution.get("chunk_blend") == "rtc")]
    server = (summary.get("plan") or {}).get("server") or {}
    if server.get("unidentified"):  # a foreign server that names nothing: say so beside the numbers
        lines += ["", f"server: {server['unidentified']}"]
    return "\n".join(lines) + "\n"


def execution_line(execution: dict[str, Any]) -> str | None:
    """How the actions were executed (plan.json's ``execution``), in one sentence; None for the default
    (synchronous, each chunk replacing the last), which the table's readers assume."""
    mode, blend = execution.get("mode", "sync"), execution.get("chunk_blend", "switch")
    if mode == "sync" and blend == "switch":
        return None
    head = (
        f"execution: async, the env acting on for {execution.get('delay_steps', 0)} steps while a request "
        "is in flight"
        if mode == "async"
        else "execution: sync"
    )
    blends = {
        "switch": "each new chunk replacing the last",
        "ensemble": f"chunks blended by temporal ensembling (m = {execution.get('ensemble_coeff')})",
        "rtc": (
            f"chunks continued by real-time chunking (schedule {execution.get('rtc_schedule')}, max guidance "
            f"{execution.get('rtc_max_guidance')})"
        ),
    }
    return f"{head}; {blends.get(blend, blend)}."


def throughput_line(tp: dict[str, Any], rtc: bool = False) -> str:
    """One sentence: wall, steps/s, efficiency against the calibrated bound, utilisation. ``rtc``: the
    run's requests were RTC's guided ones, which the calibration's plain requests do not measure."""
    head = (
        f"{tp.get('num_envs', '?')} envs in {tp.get('stages', '?')} stages: wall {tp['wall']:.1f} s for "
        f"{tp['env_steps']} env steps ({tp['env_steps_per_s']:.1f} env-steps/s); "
    )
    busy = (
        f"utilisation {100 * tp['utilisation']:.0f}% (busy: sim {tp['sim']:.1f} s over {tp['workers']} "
        f"workers, inference {tp['infer']:.1f} s)."
    )
    if tp.get("efficiency") is None:
        return head + "not calibrated (no independent bound); " + busy
    line = head + (
        f"efficiency {100 * tp['efficiency']:.0f}% against the calibrated bound {tp['bound']:.1f} s "
        f"({tp['bound_side']}: sim {tp['bound_sim']:.1f} s, inference {tp['bound_infer']:.1f} s); " + busy
    )
    if rtc:
        line += (
            " Under real-time chunking each request also runs the guidance's backward passes, which the "
            "calibration's plain requests do not: the bound is too low and the efficiency means little; "
            "compare wall times and utilisation instead."
        )
    over = tp.get("bound_above_run")
    if over:
        line += (
            f" The run beat its bound: the calibration overestimated {over['side']} ({over['calibrated']:.2f} s "
            f"calibrated, {over['run_busy']:.2f} s busy in the run), so this efficiency is not reliable."
        )
    return line


def plot_success(summary: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, rates, lows, highs = [], [], [], []
    for suite, s in summary["suites"].items():
        for task, r in s["tasks"].items():
            label = task if len(summary["suites"]) == 1 else f"{suite}/{task}"
            labels.append(
                label if len(label) <= 32 else label[:31] + "…"
            )  # some suites name tasks by sentences
            rates.append(100 * r["rate"])
            lows.append(max(0.0, 100 * (r["rate"] - r["ci95"][0])))  # >= 0 despite rounding
            highs.append(max(0.0, 100 * (r["ci95"][1] - r["rate"])))
    fig, ax = plt.subplots(figsize=(max(4.0, 0.6 * len(labels) + 1.5), 3.5))
    ax.bar(range(len(labels)), rates, yerr=[lows, highs], capsize=3, color="tab:blue")
    ax.set_xticks(range(len(labels)), labels, rotation=45, ha="right", fontsize=8)
    ax.set_ylim(0, 105)
    ax.set_ylabel("success % (Wilson 95% CI)")
    ax.set_title("success per task")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_timeline(events: list[tuple[int, str, float, float]], stages: int, path: Path) -> Path:
    """``events``: ``(stage, "sim" | "infer", start_s, end_s)`` on the run's clock."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 0.6 * stages + 1.4))
    colors = {"sim": "tab:green", "infer": "tab:orange"}
    for kind, color in colors.items():
        for s in range(stages):
            spans = [(t0, t1 - t0) for st, k, t0, t1 in events if st == s and k == kind]
            ax.broken_barh(spans, (s - 0.35, 0.7), color=color, label=kind if s == 0 else None)
    ax.set_yticks(range(stages), [f"stage {s}" for s in range(stages)])
    ax.set_xlabel("seconds since start")
    ax.set_title("simulation (green) and inference (orange) per pipeline stage")
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_reports(
    out_dir: str | Path,
    records: list[dict[str, Any]],
    plan: dict[str, Any],
    timing: dict[str, Any] | None = None,
    events: list[tuple[int, str, float, float]] | None = None,
    stages: int = 1,
) -> dict[str, Any]:
    """Write summary.json, results.md and the plots into ``out_dir``; return the summary."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary = build_summary(records, timing, plan)
    atomic_write_json(out / SUMMARY, summary)
    atomic_write_text(out / TABLE, markdown_table(summary))
    if records:
        plot_success(summary, out / PLOT_SUCCESS)
    if events:
        plot_timeline(events, stages, out / PLOT_TIMELINE)
    return summary
