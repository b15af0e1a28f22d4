"""An endless, seeded, exactly resumable training loader on top of ``torch.utils.data.DataLoader``.

The sample order is a pure function of ``(seed, epoch, window)``: epoch ``e`` is a seeded windowed
permutation of the dataset (or, with several suites, a seeded draw of each slot's suite by the suite
weights, each suite walking its own seeded windowed permutation). A windowed permutation cuts the
indices into windows of ``window`` consecutive samples (consecutive frames of one episode, so of one
video file, except where a window straddles two episodes), visits the windows in a shuffled order and
shuffles the samples within each: the reader then decodes nearby frames of few files at a time and
reuses its open decoders and cached frames (:mod:`wamkit.data.video`). ``window=1`` is a plain
permutation. The price is batch diversity: a batch of ``B`` holds about ``B / window`` stretches of
``window`` consecutive frames. All ranks compute the same global stream; global batch ``b``
is samples ``[b * B * W, (b + 1) * B * W)`` of it and rank ``r`` takes its ``r``-th slice of ``B``,
which it reads and stacks in index order (the samples of a batch are exchangeable; sorted, a
window's frames decode forward, each once, instead of seeking back and forth).
The position is the number of global samples consumed, so ``state_dict()`` / ``load_state_dict()``
resume exactly: the resumed run sees the very batches the uninterrupted run would have seen.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from wamkit.config import ConfigError


def collate(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-sample dicts -> a batch: tensors stacked on a new axis 0, strings (``task``) as a list."""
    out: dict[str, Any] = {}
    for key, first in samples[0].items():
        values = [s[key] for s in samples]
        if isinstance(first, torch.Tensor):
            out[key] = torch.stack(values)
        elif isinstance(first, np.ndarray):
            out[key] = torch.from_numpy(np.stack(values))
        elif isinstance(first, str):
            out[key] = values
        elif isinstance(first, bool | int | float | np.number):
            out[key] = torch.tensor(values)
        else:
            raise TypeError(f"collate: cannot batch '{key}' of type {type(first).__name__}")
    return out


DEFAULT_WINDOW = 8  # samples per file-local window of the training order


def windowed_permutation(rng: np.random.Generator, n: int, window: int) -> np.ndarray:
    """``range(n)`` as a shuffled order of windows ``[k * window, (k + 1) * window)``, each shuffled."""
    if window <= 1:
        return rng.permutation(n)
    win = np.arange(n) // window
    rank = rng.permutation(int(win[-1]) + 1 if n else 0)  # where each window goes in the order
    return np.argsort(rank[win] + rng.random(n), kind="stable")  # window rank, then random within


class SampleStream:
    """The global sample order: ``indices(start, n)`` gives samples ``start .. start + n - 1``."""

    def __init__(self, sizes: list[int], weights: list[float], seed: int, window: int = DEFAULT_WINDOW):
        if window < 1:
            raise ValueError(f"sampler window: expected a positive number of samples, got {window}")
        self.sizes, self.seed, self.window = list(sizes), seed, window
        self.offsets = np.cumsum([0, *sizes])
        self.epoch_len = int(self.offsets[-1])
        if self.epoch_len == 0:
            raise ValueError("the training dataset is empty")
        w = np.asarray(weights, np.float64)
        self.probs = w / w.sum()
        self._cache: dict[int, np.ndarray] = {}

    def epoch(self, e: int) -> np.ndarray:
        if e not in self._cache:
            rng = np.random.default_rng([self.seed, e])
            if len(self.sizes) == 1:
                order = windowed_permutation(rng, self.epoch_len, self.window)
            else:
                order = np.empty(self.epoch_len, np.int64)
                suite = rng.choice(len(self.sizes), size=self.epoch_len, p=self.probs)
                for s, size in enumerate(self.sizes):
                    slots = np.flatnonzero(suite == s)
                    if len(slots) == 0 or size == 0:
                        continue
                    reps = -(-len(slots) // size)
                    perm = np.concatenate(
                        [windowed_permutation(rng, size, self.window) for _ in range(reps)]
                    )[: len(slots)]
                    order[slots] = self.offsets[s] + perm
            self._cache = {e: order}  # keep one epoch: a stream only moves forward
        return self._cache[e]

    def indices(self, start: int, n: int) -> list[int]:
        out: list[int] = []
        while len(out) < n:
            e, off = divmod(start + len(out), self.epoch_len)
            out.extend(self.epoch(e)[off : off + n - len(out)].tolist())
        return out


class _BatchSampler:
    def __init__(self, loader: TrainLoader, start: int):
        self.loader, self.start = loader, start

    def __iter__(self) -> Iterator[list[int]]:
        ld, pos = self.loader, self.start
        global_batch = ld.batch_size * ld.world_size
        stream = SampleStream(ld.stream.sizes, list(ld.stream.probs), ld.seed, ld.stream.window)  # own copy
        while True:
            # read (and stacked) in index order: a window's frames then decode forward, each once
            yield sorted(stream.indices(pos + ld.rank * ld.batch_size, ld.batch_size))
            pos += global_batch


class TrainLoader:
    """Iterates batches forever. ``state_dict()`` is the exact position (global samples consumed)."""

    def __init__(self, dataset, batch_size: int, seed: int, num_workers: int, rank: int = 0,
                 world_size: int = 1, window: int = DEFAULT_WINDOW, pin_memory: bool = False):  # fmt: skip
        if batch_size < 1 or world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(
                f"bad loader shape: batch_size={batch_size}, rank={rank}, world_size={world_size}"
            )
        self.dataset = dataset
        self.batch_size, self.seed, self.num_workers = batch_size, seed, num_workers
        self.rank, self.world_size = rank, world_size
        # page-locked batches: a copy to the GPU from pageable memory first waits for every kernel
        # queued before it, so the host could not queue the next step while the GPU runs this one
        self.pin_memory = pin_memory
        sizes = list(getattr(dataset, "suite_sizes", [len(dataset)]))
        weights = list(getattr(dataset, "weights", [1.0] * len(sizes)))
        self.stream = SampleStream(sizes, weights, seed, window)
        self.samples_seen = 0
        self._it: Iterator | None = None

    def _start(self) -> Iterator:
        loader = torch.utils.data.DataLoader(
            self.dataset,
            batch_sampler=_BatchSampler(self, self.samples_seen),
            num_workers=self.num_workers,
            collate_fn=collate,
            persistent_workers=False,
            prefetch_factor=2 if self.num_workers > 0 else None,
            pin_memory=self.pin_memory,
        )
        return iter(loader)

    def __iter__(self) -> TrainLoader:
        return self

    def __next__(self) -> dict[str, Any]:
        if self._it is None:
            self._it = self._start()
        batch = next(self._it)
        self.samples_seen += self.batch_size * self.world_size
        return batch

    @property
    def epoch(self) -> float:
        return self.samples_seen / self.stream.epoch_len

    def state_dict(self) -> dict[str, Any]:
        return {
            "samples_seen": self.samples_seen,
            "seed": self.seed,
            "global_batch": self.batch_size * self.world_size,
            "epoch_len": self.stream.epoch_len,
            "window": self.stream.window,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at ``state["samples_seen"]``; the seed, dataset size and window must match (a state
        saved before windows existed has ``window`` 1, the plain permutation)."""
        have = {"seed": self.seed, "epoch_len": self.stream.epoch_len, "window": self.stream.window}
        for key, value in have.items():
            got = state.get(key, 1 if key == "window" else None)
            if got != value:  # the checkpoint's data is not this run's: no exact resume is possible
                what = {"seed": "data.seed", "epoch_len": "the dataset's size (data.root, data.suites)"}
                raise ConfigError(
                    f"resume: the checkpoint's data loader had {key}={got!r}, this run's has {value!r}; "
                    f"{what.get(key, 'the loader')} changed since it was saved: resume with the same data, "
                    "or start a new run"
                )
        self.close()
        self.samples_seen = int(state["samples_seen"])

    def close(self) -> None:
        """Stop the worker processes (a later ``next`` starts them again at the current position)."""
        self._it = None


def make_train_loader(dataset, batch_size: int, seed: int, num_workers: int, rank: int = 0,
                      world_size: int = 1, window: int = DEFAULT_WINDOW,
                      pin_memory: bool = False) -> TrainLoader:  # fmt: skip
    """An endless loader over ``dataset`` (see the module docstring); per-rank batches of ``batch_size``,
    samples in file-local windows of ``window`` (1: a plain permutation); ``pin_memory`` for a GPU."""
    return TrainLoader(dataset, batch_size, seed, num_workers, rank, world_size, window, pin_memory)
