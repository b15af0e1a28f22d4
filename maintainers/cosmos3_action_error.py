"""Open-loop action error of a Cosmos3 serving directory on its own training data (maintainers' check).

    python maintainers/cosmos3_action_error.py RUN_DIR SERVE_DIR [--samples 48]

On ``--samples`` training samples (the run's dataset and preprocessing, model space: normalised
actions) it prints the mean absolute error against the recorded chunk of
- the served sampler's chunk (``predict``, the path ``wamkit serve`` runs);
- the model's one-step estimate of the clean chunk at noise level 0.9, ``x - sigma * v`` (close to
  its conditional mean: what it has learned of the observation, without the sampler's draw);
- two baselines: the dataset's mean chunk (a policy that ignores the observation) and the chunk of
  the sample with the nearest state (a lookup that reads the state alone).
A model whose one-step estimate sits near the mean-chunk baseline has not learned the observation;
one near the nearest-state baseline reads the state as well as a lookup does. Time-free: it judges
what training taught, before a closed-loop run does.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from wamkit.actions.spec import PreprocessSpec
from wamkit.config import load_config
from wamkit.constants import ACTION, OBS_STATE, TASK
from wamkit.data import collate, make_train_dataset
from wamkit.models.cosmos3.adapter import _per_token
from wamkit.models.pretrained import load_pretrained


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir")
    ap.add_argument("serve_dir")
    ap.add_argument("--samples", type=int, default=48)
    ap.add_argument("--sigma", type=float, default=0.9)
    args = ap.parse_args()
    cfg = load_config(f"{args.run_dir}/config.yaml")
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    ad = load_pretrained(args.serve_dir, device=dev)
    spec = PreprocessSpec.load(f"{args.serve_dir}/preprocess.json")
    ds = make_train_dataset(cfg.data, spec, ())
    n, s = args.samples, args.sigma
    batch = collate([ds[int(i)] for i in np.random.default_rng(1).choice(len(ds), n, replace=False)])
    x0_a = batch[ACTION].float()
    with torch.no_grad():
        sampled = torch.as_tensor(ad.predict(batch, mode="policy", seed=list(range(n)))["actions"])
        views = ad._views(batch)
        x0_v = ad._encode([[v] for v in views]).cpu()  # the current frame; the later ones are noise here
        x0_v = x0_v.expand(-1, -1, ad._latent_frames(), -1, -1).clone()
        held = ad._state_tokens(batch, torch.device("cpu"))
        hw = ad._canvas_hw(views[0])
        texts = [ad.prompt(t, hw, None) for t in batch[TASK]]
        g = torch.Generator().manual_seed(1)
        eps_v, eps_a = torch.randn(x0_v.shape, generator=g), torch.randn(x0_a.shape, generator=g)
        x_v = (1 - s) * x0_v + s * eps_v
        x_v[:, :, 0] = x0_v[:, :, 0]
        x_a = torch.cat([held, (1 - s) * x0_a + s * eps_a], 1)
        lay = ad._layout(texts, hw, tuple(x0_v.shape[1:]), (0,), tuple(range(held.shape[1])))
        t = torch.full((n,), s * 1000, device=dev)
        t_v, t_a = _per_token(t, lay.num_noisy_vision_tokens), _per_token(t, lay.num_noisy_action_tokens)
        _, v_a = ad._run(lay, x_v.to(dev), t_v, x_a.to(dev), t_a)
        x0_hat = x_a[:, held.shape[1] :] - s * v_a[:, held.shape[1] :].cpu()
    pool = collate(
        [ds[int(i)] for i in np.random.default_rng(0).choice(len(ds), min(600, len(ds)), replace=False)]
    )
    acts, states = pool[ACTION].float(), pool[OBS_STATE].float()
    nearest = torch.cdist(batch[OBS_STATE].float(), states).argmin(1)

    def mae(x: torch.Tensor) -> float:
        return float((x - x0_a).abs().mean())

    print(
        f"open-loop action error (model space, {n} training samples; mean |action| {float(x0_a.abs().mean()):.3f})"
    )
    print(f"  served sampler             {mae(sampled):.4f}")
    print(f"  one-step estimate at {s:<4}  {mae(x0_hat):.4f}")
    print(f"  mean chunk (blind)         {mae(acts.mean(0)):.4f}")
    print(f"  nearest state (lookup)     {mae(acts[nearest]):.4f}")


if __name__ == "__main__":
    main()
