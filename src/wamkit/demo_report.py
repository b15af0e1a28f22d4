"""The demo's report: ``<out>/report/report.html``, one page with pictures, readable with no server.

- the training loss curve (``train/losses.jsonl``: the action loss and, with a world model, the
  future-frame loss);
- success per task on held-out seeds with Wilson 95% intervals (the evaluation's ``summary.json``),
  beside the scripted expert's rate on the training seeds;
- the vision control: the same model evaluated on the first held-out episodes of each task with its
  camera images sent black (``eval.blank_images``): what is left without vision; beside it the chance
  level on those episodes, a scene-agnostic policy (training demonstrations replayed open loop);
- a grid of held-out rollouts as GIFs (made from the evaluation's videos), successes and failures;
- forward dynamics: for a few held-out episodes, the frame ``chunk`` steps ahead that the model
  predicts from the current frame and the scripted expert's next ``chunk`` actions, beside the real
  one (one row per episode, labelled with its task and seed), with two pixel errors against a
  copy-the-current-frame baseline and what each measures.

Every number on the page is read from the files the stages wrote (``report.json`` holds them too),
so the page and the run's summaries cannot disagree.
"""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

import numpy as np

from wamkit.config import RunConfig
from wamkit.constants import OBS_STATE, TASK, image_key
from wamkit.files import atomic_write_json, atomic_write_text
from wamkit.models.base import PredictsFramesAt

REPORT = "report.html"
FIGURES = "report.json"


def loss_curve(losses: Path, png: Path) -> dict[str, float]:
    """Plot ``losses.jsonl`` (step, action_loss, world_loss, loss) to ``png``; the first and last
    values of each curve."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in losses.read_text().splitlines() if line.strip()]
    if not rows:
        raise ValueError(f"{losses}: no loss rows")
    steps = np.array([r["step"] for r in rows])
    fig, ax = plt.subplots(figsize=(6, 3.2), dpi=100)
    out: dict[str, float] = {}
    for key, label in (("action_loss", "action loss"), ("world_loss", "future-frame loss")):
        if key not in rows[0]:
            continue
        y = np.array([r[key] for r in rows], np.float64)
        k = max(1, len(y) // 50)  # a running mean over 2% of the run, for a readable curve
        smooth = np.convolve(y, np.ones(k) / k, mode="valid")
        ax.plot(steps[k - 1 :], smooth, label=label)
        out[f"{key}_first"], out[f"{key}_last"] = float(y[:k].mean()), float(y[-k:].mean())
    ax.set_yscale("log")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png)
    plt.close(fig)
    return out


def mp4_to_gif(mp4: Path, gif: Path, every: int = 4, fps: int = 20) -> Path:
    """Every ``every``-th frame of ``mp4`` as an animated GIF (browsers play GIFs without codecs)."""
    import av
    from PIL import Image

    with av.open(str(mp4)) as container:
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    if not frames:
        raise ValueError(f"{mp4}: no frames")
    images = [Image.fromarray(f) for f in frames[::every]]
    gif.parent.mkdir(parents=True, exist_ok=True)
    images[0].save(gif, save_all=True, append_images=images[1:], duration=int(1000 / fps), loop=0)
    return gif


def rollout_grid(eval_dir: Path, report_dir: Path, per_outcome: int = 3) -> list[dict[str, Any]]:
    """Up to ``per_outcome`` filmed successes and failures per task, as GIFs under ``report_dir``."""
    from wamkit.eval.journal import read_journal

    picked: list[dict[str, Any]] = []
    counts: dict[tuple[str, bool], int] = {}
    for r in read_journal(eval_dir / "episodes.jsonl").values():
        video = r.get("video")
        if not video or not (eval_dir / video).is_file():
            continue
        key = (str(r["task"]), bool(r["success_once"]))
        if counts.get(key, 0) >= per_outcome:
            continue
        counts[key] = counts.get(key, 0) + 1
        gif = mp4_to_gif(eval_dir / video, report_dir / "rollouts" / Path(video).with_suffix(".gif"))
        picked.append(
            {
                "task": key[0],
                "trial": int(r["trial"]),
                "seed": int(r["seed"]),
                "success": key[1],
                "length": int(r["length"]),
                "gif": str(gif.relative_to(report_dir)),
            }
        )
    return sorted(picked, key=lambda p: (p["task"], not p["success"], p["trial"]))


def _resize_area(img: np.ndarray, size: int) -> np.ndarray:
    """uint8 [H, W, 3] -> float [size, size, 3] by area averaging (PIL's box filter: any H, W)."""
    from PIL import Image

    if img.shape[0] == img.shape[1] == size:
        return img.astype(np.float64)
    box = Image.fromarray(np.asarray(img, np.uint8)).resize((size, size), Image.Resampling.BOX)
    return np.asarray(box, np.float64)


def forward_dynamics(
    cfg: RunConfig, serve_dir: Path, png: Path, per_task: int = 2, starts: tuple[int, ...] = (0, 16, 32, 48)
) -> dict[str, Any] | None:
    """The model's predicted frame ``chunk`` steps ahead against the real one, on held-out seeds.

    For ``per_task`` held-out episodes of each task (the evaluation's first seeds) the scripted expert
    runs; at each step in ``starts`` the model gets the current observation and the expert's next
    ``chunk`` actions (``mode=forward_dynamics``) and predicts the first camera's frame after them.
    Errors are in grey levels (0-255) at the model's frame resolution (all three frames area-averaged
    to it), against the copy-the-current-frame baseline: the root mean square (``*_rmse``, the error
    video prediction reports as PSNR, and what a regressed frame minimises) and the mean absolute
    difference (``*_error``). None for a model without frame tokens."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from wamkit.envs import expand_tasks
    from wamkit.serve.loading import load_served
    from wamkit.serve.policy import FD_ACTIONS

    policy = load_served(serve_dir, device="cpu")
    if not policy.adapter.future_frame_offsets:
        return None
    chunk, cam = policy.io.chunk, policy.io.cameras[0]
    ad = policy.adapter
    size = ad.frame_res if isinstance(ad, PredictsFramesAt) else policy.io.image_size
    tasks = expand_tasks(cfg.env.suite, list(cfg.env.tasks))
    specs = [(task, trial, cfg.eval.seed + trial) for trial in range(per_task) for task in tasks]
    # rendering needs a GL context made in a process that chose its GL platform first: a spawned one
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        played = pool.submit(_expert_rollouts, cfg.env, specs, max(starts) + chunk).result()
    rows, pred_err, copy_err, pred_sq, copy_sq = [], [], [], [], []
    for (task, _, seed), (frames, actions) in zip(specs, played, strict=True):
        for t in starts:
            if t + chunk >= len(frames):
                continue
            now, later = frames[t], frames[t + chunk]
            request = {image_key(c): now[image_key(c)] for c in policy.io.cameras}
            request |= {OBS_STATE: now[OBS_STATE], TASK: now[TASK], "mode": "forward_dynamics", "seed": 0}
            request[FD_ACTIONS] = np.stack(actions[t : t + chunk])
            predicted = _resize_area(policy.infer(request)["frames"], size)
            real = _resize_area(later[image_key(cam)], size)
            current = _resize_area(now[image_key(cam)], size)
            pred_err.append(float(np.abs(predicted - real).mean()))
            copy_err.append(float(np.abs(current - real).mean()))
            pred_sq.append(float(np.square(predicted - real).mean()))
            copy_sq.append(float(np.square(current - real).mean()))
            rows.append((task, seed, t, *(np.round(x).astype(np.uint8) for x in (current, predicted, real))))
    if not rows:
        return None
    _fd_picture(rows, chunk, png)
    return {
        "episodes": [{"task": task, "seed": seed, "label": f"{task} seed {seed}"} for task, _, seed in specs],
        "chunk": chunk,
        "predictions": len(rows),
        "model_rmse": float(np.sqrt(np.mean(pred_sq))),
        "copy_rmse": float(np.sqrt(np.mean(copy_sq))),
        "model_error": float(np.mean(pred_err)),
        "copy_error": float(np.mean(copy_err)),
        "per_prediction": [
            {
                "task": r[0],
                "seed": r[1],
                "step": r[2],
                "model_error": p,
                "copy_error": c,
                "model_mse": ps,
                "copy_mse": cs,
            }
            for r, p, c, ps, cs in zip(rows, pred_err, copy_err, pred_sq, copy_sq, strict=True)
        ],
    }


def _expert_rollouts(env_cfg: Any, specs: list[tuple[str, int, int]], steps: int) -> list[tuple[list, list]]:
    """In a spawned process: each ``(task, trial, seed)`` played by the scripted expert for up to
    ``steps`` steps; its observations and env actions."""
    from wamkit.envs.base import use_headless_gl

    use_headless_gl()
    from wamkit.envs import EpisodeSpec, make_env

    out = []
    env = make_env(env_cfg)
    try:
        for task, trial, seed in specs:
            obs = env.reset(EpisodeSpec(env_cfg.suite, task, trial, seed))
            frames, actions = [obs], []
            for _ in range(steps):
                a = np.asarray(env.expert_action(obs), np.float32)
                obs, _, terminated, truncated, _ = env.step(a)
                frames.append(obs)
                actions.append(a)
                if terminated or truncated:
                    break
            out.append((frames, actions))
    finally:
        env.close()
    return out


def scene_agnostic_replay(cfg: RunConfig, trials: int) -> dict[str, Any]:
    """The chance level of the vision control: a policy that ignores the scene.

    On the blind control's held-out episodes (``trials`` per task, seeds from ``eval.seed``), trial ``t``
    replays the actions of the ``t``-th kept training demonstration of its task by trial number
    (another placement), open loop, then stops the arm (the gripper keeps its last command) until the
    step limit. What it solves, it solves without looking. Returns per task and over all: successes,
    episodes and the Wilson 95% interval.
    """
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    from dataclasses import replace

    from wamkit.constants import ACTION
    from wamkit.data import LeRobotDataset
    from wamkit.envs import expand_tasks
    from wamkit.envs.collect_journal import CollectJournal
    from wamkit.eval.success import wilson_interval

    ds = LeRobotDataset(cfg.data.root)
    actions, episode = ds.numeric(ACTION), ds.numeric("episode_index").reshape(-1)
    kept: dict[str, list[tuple[int, int]]] = {}
    for entry in CollectJournal(cfg.data.root).entries:
        if entry.get("kept") and entry.get("episode_index") is not None:
            kept.setdefault(entry["task"], []).append((int(entry["trial"]), int(entry["episode_index"])))
    # by trial, not by episode_index: parallel collect workers write episodes in the order they finish
    kept = {task: [ep for _, ep in sorted(eps)] for task, eps in kept.items()}
    jobs = []
    for task in expand_tasks(cfg.env.suite, list(cfg.env.tasks)):
        demos = kept.get(task, [])
        if len(demos) < trials:
            raise ValueError(f"{cfg.data.root}: {len(demos)} demonstrations of {task}, {trials} needed")
        for t in range(trials):
            jobs.append((task, t, cfg.eval.seed + t, actions[episode == demos[t]]))
    env_cfg = replace(cfg.env, image_size=8)  # the replay looks at nothing: the cheapest render
    workers = max(1, min(cfg.eval.workers, len(jobs)))
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        parts = [pool.submit(_replays, env_cfg, jobs[i::workers]) for i in range(workers)]
        done = [p.result() for p in parts]
    solved = [done[i % workers][i // workers] for i in range(len(jobs))]
    out: dict[str, Any] = {"trials": trials, "tasks": {}}
    for (task, *_), ok in zip(jobs, solved, strict=True):
        r = out["tasks"].setdefault(task, {"successes": 0, "episodes": 0})
        r["successes"] += ok
        r["episodes"] += 1
    total = {"successes": sum(r["successes"] for r in out["tasks"].values()), "episodes": len(jobs)}
    for r in [*out["tasks"].values(), total]:
        r["rate"] = r["successes"] / r["episodes"]
        r["ci95"] = list(wilson_interval(r["successes"], r["episodes"]))
    out["all"] = total
    return out


def _replays(env_cfg: Any, jobs: list[tuple[str, int, int, np.ndarray]]) -> list[bool]:
    """In a spawned process: each job's actions played open loop, then held still; solved or not."""
    from wamkit.envs.base import use_headless_gl

    use_headless_gl()
    from wamkit.envs import EpisodeSpec, make_env

    solved = []
    env = make_env(env_cfg)
    try:
        for task, trial, seed, acts in jobs:
            spec = EpisodeSpec(env_cfg.suite, task, trial, seed)
            env.reset(spec)
            still = np.zeros_like(acts[-1])
            still[-1] = acts[-1][-1]  # the arm stops; the gripper keeps its last command
            ok = False
            for i in range(env.max_steps(spec)):
                _, _, terminated, truncated, _ = env.step(acts[i] if i < len(acts) else still)
                if terminated or truncated:
                    ok = bool(terminated)
                    break
            solved.append(ok)
    finally:
        env.close()
    return solved


# the forward-dynamics picture's panel size (inches at 100 dpi): 6 episodes of 4 starts take
# 1,200 x 750 px, a screen
FD_PANEL_IN = 1.0


def _fd_picture(rows: list, chunk: int, png: Path) -> None:
    """One row per episode (its task and seed written at the left), one (now, predicted, real)
    triple per start step across it: the grid a screen holds, not one column per prediction."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    episodes = list(dict.fromkeys((task, seed) for task, seed, *_ in rows))
    starts = sorted({t for _, _, t, *_ in rows})
    cols = 3 * len(starts)
    size = (FD_PANEL_IN * cols + 1.6, (FD_PANEL_IN + 0.25) * len(episodes))
    fig, axes = plt.subplots(len(episodes), cols, figsize=size, dpi=100, squeeze=False)
    for ax in axes.flat:
        ax.set_axis_off()
    for task, seed, t, *images in rows:
        r, c = episodes.index((task, seed)), 3 * starts.index(t)
        for ax, img, title in zip(
            axes[r, c : c + 3], images, (f"t={t} now", f"predicted +{chunk}", f"real +{chunk}"), strict=True
        ):
            ax.imshow(img, interpolation="nearest")
            ax.set_title(title, fontsize=6)
    for r, (task, seed) in enumerate(episodes):
        fig.text(0.005, 1 - (r + 0.5) / len(episodes), f"{task}\nseed {seed}", fontsize=7, va="center")
    fig.subplots_adjust(left=1.6 / size[0], right=0.995, top=0.95, bottom=0.01, wspace=0.08, hspace=0.35)
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png)
    plt.close(fig)


def _fd_meaning(fd: dict[str, Any]) -> str:
    """What the two errors measure, and what the model's standing against the copy says."""

    def verdict(model: float, copy: float) -> str:
        return "the model is closer than the copy" if model < copy else "the copy is closer than the model"

    return (
        '<ul id="fd-meaning">'
        "<li><b>Copy</b>: the current frame given as the prediction. Most of a frame (table, walls, the "
        "robot's base) does not move in the next steps, so copying is exact there and wrong only where the "
        "arm and the objects moved: a strong baseline, and the one a model that ignores the actions "
        "would match.</li>"
        "<li><b>Root mean square</b> weighs large errors most: a moved arm or object drawn where it was. It "
        f"is what the model's frame loss (squared error) minimises. Here {verdict(fd['model_rmse'], fd['copy_rmse'])}."
        "</li><li><b>Mean absolute</b> counts every pixel's error alike. A regressed frame is the mean of "
        "the futures the model cannot tell apart, slightly blurred and off by a few grey levels everywhere, "
        "over the static pixels the copy gets exactly right; so the model can lose to the copy on this "
        "figure while it wins on the root mean square, where the moved parts count. Here "
        f"{verdict(fd['model_error'], fd['copy_error'])}.</li></ul>"
    )


def _rate(r: dict[str, Any]) -> str:
    lo, hi = r["ci95"]
    return (
        f"{100 * r['rate']:.1f}% ({r['success_once']}/{r['episodes']}; 95% CI {100 * lo:.1f}–{100 * hi:.1f})"
    )


def _chance_rate(r: dict[str, Any]) -> str:
    return _rate(
        {"rate": r["rate"], "ci95": r["ci95"], "success_once": r["successes"], "episodes": r["episodes"]}
    )


def write_report(
    out: Path,
    cfg: RunConfig,
    evaluated: dict[str, Any],
    blind: dict[str, Any] | None,
    expert: dict[str, tuple[int, int]],
    fd: dict[str, Any] | None,
    chance: dict[str, Any] | None = None,
) -> Path:
    """``<out>/report/report.html`` and ``report.json`` from the run's files (see the module doc)."""
    report_dir = out / "report"
    report_dir.mkdir(parents=True, exist_ok=True)
    losses = loss_curve(Path(cfg.train.run_dir) / "losses.jsonl", report_dir / "loss.png")
    rollouts = rollout_grid(Path(cfg.eval.out_dir), report_dir)
    suite = cfg.env.suite
    tasks = evaluated["suites"][suite]["tasks"]
    blind_tasks = blind["suites"][suite]["tasks"] if blind else {}
    figures = {
        "overall": evaluated["all"],
        "tasks": tasks,
        "blind_overall": blind["all"] if blind else None,
        "blind_tasks": blind_tasks,
        "expert": {t: {"successes": ok, "episodes": n} for t, (ok, n) in expert.items()},
        "losses": losses,
        "forward_dynamics": fd,
        "chance": chance,
        "rollouts": rollouts,
        "state": cfg.env.state,
        "cameras": list(cfg.env.cameras),
    }
    atomic_write_json(report_dir / FIGURES, figures)

    e = html.escape
    rows = []
    for task, r in tasks.items():
        ok, n = expert.get(task, (0, 0))
        b = blind_tasks.get(task)
        c = (chance or {}).get("tasks", {}).get(task)
        expert_cell = f"{100 * ok / n:.0f}% ({ok}/{n})" if n else "-"
        rows.append(
            f"<tr><td>{e(task)}</td><td>{_rate(r)}</td><td>{_rate(b) if b else '-'}</td>"
            f"<td>{_chance_rate(c) if c else '-'}</td><td>{expert_cell}</td></tr>"
        )
    overall_blind = _rate(blind["all"]) if blind else "not run"
    overall_chance = _chance_rate(chance["all"]) if chance else "not run"
    grid = "".join(
        f'<figure class="{"ok" if p["success"] else "fail"}"><img src="{e(p["gif"])}" alt="rollout">'
        f"<figcaption>{e(p['task'])} seed {p['seed']}: {'success' if p['success'] else 'failure'}"
        f" ({p['length']} steps)</figcaption></figure>"
        for p in rollouts
    )
    if fd:
        fd_html = (
            f"<p>Pixel error of the frame {fd['chunk']} steps ahead over {fd['predictions']} predictions "
            f"on held-out seeds, in grey levels (0-255), against copying the current frame: root mean "
            f'square <b id="fd-rmse">model {fd["model_rmse"]:.1f}</b>, copy {fd["copy_rmse"]:.1f}; '
            f'mean absolute <b id="fd-mae">model {fd["model_error"]:.1f}</b>, copy {fd["copy_error"]:.1f}.</p>'
            f"{_fd_meaning(fd)}"
            '<img src="forward_dynamics.png" alt="forward dynamics" style="max-width: 100%">'
        )
    else:
        fd_html = "<p>This model has no frame tokens (model.options.world_weight is 0): no predictions.</p>"
    won = sum(p["success"] for p in rollouts)
    filmed = (
        f"{won} success(es) and {len(rollouts) - won} failure(s) filmed: each task keeps up to "
        f"eval.videos={cfg.eval.videos} videos, successes and failures sharing them"
    )
    loss_text = ", ".join(f"{k.replace('_', ' ')} {v:.4f}" for k, v in losses.items())
    page = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>wamkit demo report</title>
<style>
body {{ font-family: sans-serif; max-width: 60em; margin: 2em auto; color: #222; }}
table {{ border-collapse: collapse; }} td, th {{ border: 1px solid #ccc; padding: 0.3em 0.6em; }}
.grid {{ display: flex; flex-wrap: wrap; gap: 0.6em; }}
figure {{ margin: 0; padding: 0.3em; border: 3px solid #ccc; }} figure.ok {{ border-color: #3a3; }}
figure.fail {{ border-color: #c33; }} figcaption {{ font-size: 0.75em; max-width: 12em; }}
figure img {{ width: 128px; image-rendering: pixelated; }}
</style></head><body>
<h1>wamkit demo: {e(suite)}, {e(cfg.model.name)}/{e(cfg.model.preset)}</h1>
<p>State given to the policy: <code>{e(cfg.env.state)}</code>; cameras: {e(", ".join(cfg.env.cameras))}
at {cfg.env.image_size} px. Held-out seeds from {cfg.eval.seed}.</p>
<h2>Success on held-out seeds</h2>
<p>Overall: <b id="overall">{_rate(evaluated["all"])}</b>. With the cameras blanked (the first
episodes of each task): <b id="blind">{overall_blind}</b>. Chance on those episodes, a policy that ignores
the scene (each replays a training demonstration of its task, from another placement, open loop):
<b id="chance">{overall_chance}</b>.</p>
<table><tr><th>task</th><th>model</th><th>model, cameras blanked</th><th>chance (a demonstration replayed)</th>
<th>scripted expert (training seeds)</th></tr>
{"".join(rows)}</table>
<h2>Training loss</h2><p>{e(loss_text)}</p><img src="loss.png" alt="loss curve">
<h2>Forward dynamics</h2>{fd_html}
<h2>Held-out rollouts</h2><p id="filmed">{e(filmed)}.</p><div class="grid">{grid}</div>
</body></html>
"""
    return atomic_write_text(report_dir / REPORT, page)
