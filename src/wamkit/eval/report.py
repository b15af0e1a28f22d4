"""Reports people read: ``summary.json``, ``results.md`` and two plots, all from the journal.

- ``summary.json``: per suite and task success (``success_once``) with Wilson 95% intervals,
  ``success_at_end``, mean length/return, failure reasons, the run's throughput against the bound
  ``max(total sim time / workers, total inference time)``, the plan (seed rule, render look, ...) and
  ``stack``: the simulator stack's versions (mujoco, robosuite, libero, metaworld).
- ``results.md``: the same as a markdown table (success in percent, interval in points).
- ``success_per_task.png``: one bar per task with its interval.
- ``timeline.png``: for each pipeline stage, when it simulated and when it waited for inference; with
  P > 1 the bars of different stages overlap, which is the point of pipelining.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from wamkit.envs.base import stack_versions
from wamkit.eval.metrics import failure_reasons, summarize
from wamkit.files import atomic_write_json, atomic_write_text

SUMMARY = "summary.json"
TABLE = "results.md"
PLOT_SUCCESS = "success_per_task.png"
PLOT_TIMELINE = "timeline.png"


def throughput(timing: dict[str, Any]) -> dict[str, Any]:
    """Achieved wall time against the bound, from the scheduler's totals (seconds).

    ``timing`` holds ``wall`` (the run), ``sim`` (summed busy time of all env workers), ``infer``
    (summed time the server spent on requests as seen by the client, one request at a time would
    give this wall), ``workers`` and ``env_steps``. ``efficiency = bound / wall`` (1.0 = at the bound).
    """
    wall = float(timing["wall"])
    workers = max(1, int(timing["workers"]))
    sim, infer = float(timing["sim"]), float(timing["infer"])
    bound = max(sim / workers, infer)
    return {
        **timing,
        "bound": bound,
        "bound_side": "simulation" if sim / workers >= infer else "inference",
        "efficiency": bound / wall if wall > 0 else 0.0,
        "env_steps_per_s": timing["env_steps"] / wall if wall > 0 else 0.0,
    }


def build_summary(records: list[dict[str, Any]], timing: dict[str, Any] | None, plan: dict[str, Any]):
    summary = summarize(records)
    summary["failures"] = failure_reasons(records)
    summary["plan"] = plan
    # the stack that wrote this report; plan["stack"] is the one the episodes ran on
    summary["stack"] = stack_versions()
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
        lines.append(row(suite, "all", s["all"], bold=True))
    tp = summary.get("throughput")
    if tp:
        lines += [
            "",
            f"{tp.get('num_envs', '?')} envs in {tp.get('stages', '?')} stages: "
            f"wall {tp['wall']:.1f} s for {tp['env_steps']} env steps ({tp['env_steps_per_s']:.1f} steps/s); "
            f"bound {tp['bound']:.1f} s ({tp['bound_side']}: sim {tp['sim']:.1f} s over {tp['workers']} "
            f"workers, inference {tp['infer']:.1f} s); efficiency {100 * tp['efficiency']:.0f}%.",
        ]
    return "\n".join(lines) + "\n"


def plot_success(summary: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, rates, lows, highs = [], [], [], []
    for suite, s in summary["suites"].items():
        for task, r in s["tasks"].items():
            label = task if len(summary["suites"]) == 1 else f"{suite}/{task}"
            labels.append(label if len(label) <= 32 else label[:31] + "…")  # LIBERO names are sentences
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
