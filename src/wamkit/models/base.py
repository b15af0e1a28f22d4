"""The model adapter protocol: how every stage talks to a model, whatever its internals.

Batch format (what the data pipeline produces and ``sft_loss`` / ``predict`` consume), B = batch:

- ``observation.images.<cam>``: uint8 tensor [B, H, W, 3] (channels last, as stored), one per camera
  the model declares in ``io.cameras``;
- ``observation.state``: float32 [B, state_dim], already normalised with the stats file;
- ``action``: float32 [B, chunk, action_dim], normalised, in ``io.representation`` (training only);
- ``action_is_pad``: bool [B, chunk], True where the chunk ran past the episode end (training only);
- ``task``: list of B strings;
- optional ``observation.future_images.<cam>``: uint8 [B, K, H, W, 3], the frames at the model's
  ``future_frame_offsets`` after the current one, clamped to the episode's last frame (world-model
  targets; training only, for models that declare offsets).

``predict`` returns model-space action chunks: float32 numpy [B, chunk, action_dim], still normalised;
turning them into env-ready actions is :class:`wamkit.actions.spec.PreprocessSpec`'s job, the same
object the training dataset ran.

``predict``'s ``seed`` is per row: an int ``s`` seeds row i with ``s + i``, a sequence gives each row
its own seed (:func:`row_seeds`), and each row draws its noise from a generator of its own. A row's
answer then depends on its own seed alone, not on what else shares the model call: a server can batch
seeded requests from many clients and answer each as an in-process call would.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np
import torch

from wamkit.constants import ACTION, OBS_STATE, TASK, image_key


def row_seeds(seed: int | Sequence[int] | np.ndarray | None, b: int) -> list[int] | None:
    """The seeds of a batch's ``b`` rows: ``seed + i`` for an int, the sequence itself (one per row),
    None for None (the global generator's draws)."""
    if seed is None:
        return None
    if isinstance(seed, int | np.integer):
        return [int(seed) + i for i in range(b)]
    seeds = [int(s) for s in np.asarray(seed).reshape(-1)]
    if len(seeds) != b:
        raise ValueError(f"seed: expected one seed per row ({b}), got {len(seeds)}")
    return seeds


def seeded_noise(
    seeds: list[int], shapes: Sequence[tuple[int, ...]], device: Any = "cpu"
) -> list[torch.Tensor]:
    """Standard normal tensors [B, *shape] for each of ``shapes``: row i's from a CPU generator seeded
    with ``seeds[i]``, drawn in the order of ``shapes`` (the same numbers on every device)."""
    out = [torch.empty((len(seeds), *shape)) for shape in shapes]
    for i, s in enumerate(seeds):
        g = torch.Generator("cpu").manual_seed(int(s))
        for t in out:
            torch.randn(t[i].shape, generator=g, out=t[i])
    return [t.to(device) for t in out]


def weights_sha256(module: torch.nn.Module | None) -> str:
    """sha256 over a module's state dict (names, dtypes, shapes and bytes, in name order); "" if none.
    Each tensor's own buffer is hashed: no second copy of the weights."""
    if module is None:
        return ""
    h = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        t = tensor.detach().contiguous().reshape(-1)
        h.update(f"{name}|{t.dtype}|{list(tensor.shape)}|".encode())
        h.update(t.view(torch.uint8).cpu().numpy())
    return h.hexdigest()


def weights_digest(module: torch.nn.Module | None, threads: int = 0) -> str:
    """sha256 over each tensor's name, dtype, shape and own sha256, in name order; "" if none. The
    tensors are hashed in ``threads`` threads (0: one per core, at most 16): hashlib and the copy off
    the device release the interpreter lock, so a 15B model's 30 GB hash in seconds where
    :func:`weights_sha256`'s one running hash takes half a minute. The served identity's digest."""
    if module is None:
        return ""
    import concurrent.futures
    import threading

    items = sorted(module.state_dict().items())
    local = threading.local()
    chunk = 64 << 20

    def one(tensor: torch.Tensor) -> str:
        t = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        if t.device.type == "cpu":
            return hashlib.sha256(t.numpy()).hexdigest()
        # off the device through a pinned buffer per thread (a pageable copy runs at a fraction of it)
        if getattr(local, "buf", None) is None:
            local.buf = torch.empty(chunk, dtype=torch.uint8, pin_memory=True)
        h = hashlib.sha256()
        for i in range(0, t.numel(), chunk):
            n = min(chunk, t.numel() - i)
            local.buf[:n].copy_(t[i : i + n])
            h.update(local.buf[:n].numpy())
        return h.hexdigest()

    workers = threads or min(16, os.cpu_count() or 1)
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        digests = list(pool.map(one, [t for _, t in items]))
    h = hashlib.sha256()
    for (name, tensor), d in zip(items, digests):
        h.update(f"{name}|{tensor.dtype}|{list(tensor.shape)}|{d}\n".encode())
    return h.hexdigest()


Mode = Literal["policy", "forward_dynamics", "inverse_dynamics"]
# model.options.<this>: a folder written by `wamkit cache-latents` that a training run reads its targets
# from (models implementing :class:`CachesLatents`; any other model given it is refused)
LATENT_CACHE_OPTION = "latent_cache"


@dataclass(frozen=True)
class ModelIO:
    """What a model takes and gives. The data pipeline and the server check batches against it."""

    cameras: tuple[str, ...] = ("corner",)
    image_size: int = 128  # square H = W
    state_dim: int = 39
    action_dim: int = 4
    chunk: int = 16
    representation: str = "raw"  # a name in wamkit.actions.representations
    # the embodiment profile of the data (wamkit.embodiments; "" where unknown): a model may take
    # conventions from it (Cosmos3: its action-head domain and caption framing)
    embodiment: str = ""

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["cameras"] = list(self.cameras)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelIO:
        return cls(**{**d, "cameras": tuple(d["cameras"])})

    @classmethod
    def of_embodiment(cls, name: str, state: str = "full", image_size: int = 128) -> ModelIO:
        """What a model of embodiment ``name``'s data takes and gives, from its profile: its default
        cameras, the state dims ``env.state`` keeps, its actions in its representation."""
        from wamkit import embodiments
        from wamkit.actions.representations import get_representation

        profile = embodiments.get(name)
        rep = get_representation(profile.representation)
        return cls(
            cameras=tuple(profile.default_cameras),
            image_size=image_size,
            state_dim=len(profile.state_dims(state)),
            action_dim=rep.model_dim(profile.action_dim),
            representation=rep.name,
            embodiment=profile.name,
        )

    def check_batch(self, batch: dict[str, Any], training: bool = False) -> int:
        """Raise ``ValueError`` saying what the model expects if ``batch`` does not fit; return B."""
        missing = [k for k in [image_key(c) for c in self.cameras] + [OBS_STATE, TASK] if k not in batch]
        if missing:
            have = ", ".join(sorted(batch))
            raise ValueError(
                f"batch lacks {', '.join(missing)}; the model expects cameras {list(self.cameras)} (batch has: {have})"
            )
        state = batch[OBS_STATE]
        if state.ndim != 2 or state.shape[-1] != self.state_dim:
            raise ValueError(f"{OBS_STATE}: expected shape [B, {self.state_dim}], got {list(state.shape)}")
        b = state.shape[0]
        for cam in self.cameras:
            img = batch[image_key(cam)]
            want = (b, self.image_size, self.image_size, 3)
            if tuple(img.shape) != want:
                raise ValueError(
                    f"{image_key(cam)}: expected uint8 images of shape {list(want)} (B, H, W, 3), got {list(img.shape)}"
                )
            if img.dtype not in (torch.uint8, np.uint8):
                raise ValueError(f"{image_key(cam)}: expected dtype uint8, got {img.dtype}")
        if len(batch[TASK]) != b:
            raise ValueError(f"{TASK}: expected {b} strings, got {len(batch[TASK])}")
        if training:
            act = batch.get(ACTION)
            want = (b, self.chunk, self.action_dim)
            if act is None or tuple(act.shape) != want:
                got = None if act is None else list(act.shape)
                raise ValueError(f"{ACTION}: expected shape {list(want)} (B, chunk, action_dim), got {got}")
        return b


@dataclass(frozen=True)
class ActivationShape:
    """What sizes a model's activations, for the trainer's memory plan (an adapter's optional
    ``activation_shape()``): per sample ``tokens`` through ``layers`` blocks of width ``hidden``
    (keys/values ``kv_dim`` wide, MLP ``intermediate`` wide), of which ``grad_tokens`` pass through
    trained weights (the rest, a frozen tower's tokens, keep only what attention needs)."""

    tokens: int
    grad_tokens: int
    hidden: int
    kv_dim: int
    intermediate: int
    layers: int


@dataclass
class ParamGroup:
    """Trainable parameters that share a learning-rate multiplier (and weight decay on/off)."""

    name: str
    params: list[torch.nn.Parameter] = field(default_factory=list)
    lr_mult: float = 1.0
    weight_decay: bool = True


@dataclass(frozen=True)
class LoraTargets:
    """Where ``train.lora`` puts its adapters in a model (an adapter's optional ``lora_targets()``):
    ``modules``, the linear layers adapted unless ``train.lora.target_modules`` names others (whole
    module names or their last dotted parts, as peft matches them); ``full_groups``, the names of
    ``param_groups()`` that still train in full beside the adapters (heads the recipe initialises
    afresh). Every other parameter is frozen under LoRA."""

    modules: tuple[str, ...]
    full_groups: tuple[str, ...] = ()


@runtime_checkable
class ModelAdapter(Protocol):
    """What the trainer, the exporter and the server need from every model (what some models can do
    beyond it is the optional capabilities at the end of this module).

    ``module`` is the ``torch.nn.Module`` to train / shard; ``blocks()`` its repeated transformer blocks
    (FSDP2 wraps each one). Only parameters returned by ``param_groups()`` are trained; the rest are
    frozen (``requires_grad=False``) and never enter the optimizer.
    """

    name: str
    io: ModelIO
    module: torch.nn.Module
    # Frame offsets after the current one whose images sft_loss needs as
    # ``observation.future_images.<cam>`` (world loss, dynamics modes); () for none.
    future_frame_offsets: tuple[int, ...]
    # Whether ``predict`` in policy mode takes ``rtc=`` (real-time chunking, wamkit.models.rtc: a flow
    # sampler guided to continue the executing chunk; the server refuses the request fields otherwise).
    supports_rtc: bool

    def param_groups(self) -> list[ParamGroup]: ...

    def blocks(self) -> list[torch.nn.Module]: ...

    def sft_loss(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        """Named scalar losses; the total to back-propagate is under ``"loss"``."""
        ...

    @torch.no_grad()
    def predict(
        self,
        batch: dict[str, Any],
        mode: Mode = "policy",
        seed: int | Sequence[int] | None = None,
        **inputs: Any,
    ) -> dict[str, np.ndarray]:
        """``{"actions": [B, chunk, action_dim]}`` (model space) for ``policy`` and ``inverse_dynamics``
        (``inputs["goal_images"]``), ``{"frames": [B, H, W, 3] uint8}`` for ``forward_dynamics``
        (``inputs["actions"]``). Deterministic for a given ``seed``, row by row (:func:`row_seeds`)."""
        ...

    def config_dict(self) -> dict[str, Any]:
        """Everything ``build_model`` needs to rebuild this model (name, preset, options, io)."""
        ...

    def flops_per_sample(self) -> float:
        """Training FLOPs (forward + backward) of one sample, for MFU."""
        ...


def compile_blocks(adapter: Any) -> None:
    """Regional compilation of ``adapter.blocks()`` (``train.compile``): the blocks share code, so one
    graph serves them all.

    An adapter whose blocks see another sequence length from batch to batch says so with
    ``varying_shapes = True`` (Cosmos3: its packed captions differ in length, and caption dropout
    empties some), and its blocks are compiled for dynamic shapes from the start. Compiled for one
    shape first, such blocks were recompiled for every new length (dynamo's automatic dynamic shapes
    did not take over) until its recompile limit, and a recompile between a checkpointed block's
    forward and its recomputation can pick another graph."""
    dynamic = True if isinstance(adapter, VaryingShapes) and adapter.varying_shapes else None
    for block in adapter.blocks():
        block.compile(dynamic=dynamic)


@runtime_checkable
class CachesLatents(Protocol):
    """Optional, for a model whose training targets are an expensive encoding of the sample's future
    frames (Cosmos3's VAE latents): encoded once by ``wamkit cache-latents``, read by a run given
    ``model.options.latent_cache``. The cache's format and its checks are the model's own; the train
    stage only calls these methods."""

    def encode_clips(self, batch: dict[str, Any], device: torch.device | None = None) -> torch.Tensor:
        """The targets ``sft_loss`` would compute from ``batch`` (with future frames): one row per sample."""
        ...

    def latent_cache_writer(self, dataset: Any, spec: Any, fps: float, *, out: Any, parent: Any,
                            dtype: str, shard_size: int) -> Any:  # fmt: skip
        """The writer of ``dataset``'s cache (``wamkit.data`` TrainDataset with future frames, ``spec``
        its PreprocessSpec) in ``out``, or a folder named by its settings under ``parent``; it has
        ``root``, ``shards()``, ``todo()`` -> ``[(suite, k, rows)]`` and ``write(suite, k, rows)``."""
        ...

    def latent_dataset(self, dataset: Any, folder: Any, spec: Any, fps: float) -> torch.utils.data.Dataset:
        """``dataset`` (built without future frames) with each sample's cached targets from ``folder``;
        refuses a cache built with other settings or from other data, naming what differs."""
        ...


@dataclass(frozen=True)
class ServingFootprint:
    """What serving a model keeps, in bytes (:class:`PlacesTextTower`; the serving memory plan,
    :mod:`wamkit.serve.plan`, places each part): ``weights`` everything but the text tower (on the
    device), ``text_tower`` its weights and ``text_layer`` its largest layer's (two such copies sit on
    the device while it streams), ``vae`` the image encoder, ``text_prompt`` one prompt in the text
    key/value cache, which holds ``text_cache_size`` prompts, ``batch`` one model call at the largest
    batch (its context and working set, an estimate); ``dtype`` the weights' (e.g. "bfloat16")."""

    weights: int
    text_tower: int
    text_layer: int
    vae: int
    text_prompt: int
    text_cache_size: int
    batch: int
    dtype: str


@runtime_checkable
class PlacesTextTower(Protocol):
    """Optional, for a model whose text conditioning is computed once per prompt by a tower of its own
    (Cosmos3's understanding tower): ``serve.text_tower=host`` keeps that tower in host memory and the
    rest on the device."""

    def serving_footprint(self, max_batch: int, device_type: str) -> ServingFootprint:
        """Bytes per part when served at ``max_batch``, the weights built on a ``device_type`` device
        (their dtype may follow it) and computed on a GPU (from shapes: a model on the meta device will
        do)."""
        ...

    def place_text_tower(self, device: torch.device) -> None:
        """Everything but the text tower onto ``device``; the tower stays in host memory and computes a
        new prompt's conditioning from there (called on a model built in host memory)."""
        ...


# --- optional capabilities ----------------------------------------------------------------------------
# What a stage does only for a model that can: each is a named protocol here, checked with isinstance
# where it is used (never a probe for an attribute by name), so this list is the whole contract beyond
# ModelAdapter. The built-in models: tiny plans its activations; cosmos3 has every one.


@runtime_checkable
class PlansActivations(Protocol):
    """The training memory plan (:mod:`wamkit.train.memory`) counts this model's activations."""

    def activation_shape(self) -> ActivationShape: ...


@runtime_checkable
class ChecksActivations(Protocol):
    """Says whether its blocks recompute their activations in the backward pass (the memory plan)."""

    gradient_checkpointing: bool


@runtime_checkable
class NeedsSampleExtras(Protocol):
    """``sft_loss`` needs per-sample values the data stage computes (``wamkit.data.sft_dataset``'s
    ``SAMPLE_EXTRAS``, e.g. ``"idle_frames"``), named here."""

    sample_extras: tuple[str, ...]


@runtime_checkable
class VaryingShapes(Protocol):
    """Its blocks see another sequence length from batch to batch (:func:`compile_blocks` compiles them
    for dynamic shapes when ``varying_shapes`` is true)."""

    varying_shapes: bool


@runtime_checkable
class PredictsFramesAt(Protocol):
    """Its ``forward_dynamics`` frames are predicted at a resolution of their own, ``frame_res`` pixels
    square (returned upsampled to the camera's size): the demo's report compares frames there, where
    the prediction and the copy-the-current-frame baseline hold the same detail."""

    frame_res: int


@runtime_checkable
class SetsSamplingSteps(Protocol):
    """Samples each request in a number of steps a server may set without retraining
    (``serve.sampling_steps``: tiny's Euler steps, Cosmos3's UniPC steps)."""

    sampling_steps: int


@runtime_checkable
class StepDistilled(Protocol):
    """May be the step-distilled student of a teacher (``train.distill_from``): ``distilled`` is
    ``{"steps", "teacher_steps"}`` for one that is, None otherwise; ``start_distillation`` makes a model
    the student of ``teacher`` (its ``sft_loss`` then the distillation loss)."""

    @property
    def distilled(self) -> dict[str, int] | None: ...

    def start_distillation(self, teacher: Any, steps: int, teacher_steps: int = 0) -> None: ...


@runtime_checkable
class ReturnsFrames(Protocol):
    """Its ``predict`` in mode ``policy`` takes ``return_frames=True`` and adds the clip it predicts with
    the actions (``video``): Cosmos3."""

    returns_frames: bool


@runtime_checkable
class HasPretrainedBase(Protocol):
    """Built from pretrained weights on disk: training and export record the base's content hash, so a
    checkpoint is never combined with another base (:mod:`wamkit.train.base_weights`)."""

    def base_reference(self, whole: bool = False) -> dict[str, Any] | None: ...


@runtime_checkable
class LoadsWeights(Protocol):
    """Built on the meta device and filled, once sharded, from its weights' source (the trainer's
    placement); ``wrap`` wraps the LoRA-adapted layers as they load."""

    def load_weights(self, device: torch.device, wrap: Any = None) -> int: ...


@runtime_checkable
class NamesLoraTargets(Protocol):
    """Names the layers LoRA adapts by default and the groups full SFT trains (``train.lora``)."""

    def lora_targets(self) -> LoraTargets: ...


@runtime_checkable
class ExportsFormat(Protocol):
    """``wamkit convert --to extra``: writes (and verifies) the model in its upstream format; ``spec``
    (the serving directory's PreprocessSpec) for a format that carries its normalisation."""

    def export_extra(self, out_dir: Any, spec: Any = None) -> None: ...


@runtime_checkable
class CompilesSteps(Protocol):
    """Serving captures or compiles its steps per batch bucket: ``serve.warm=auto`` runs every bucket
    once when ``warm_wanted()``, with the lighter work of ``warming()``, and the compile cache is keyed
    by ``compile_fields()`` (None: nothing compiled)."""

    def warm_wanted(self) -> bool: ...

    def warming(self) -> Any: ...

    def compile_fields(self) -> dict[str, Any] | None: ...


@runtime_checkable
class ServesFp8(Protocol):
    """``serve.precision=fp8``: its linear layers run in FP8 after ``use_fp8(backend)``."""

    def use_fp8(self, backend: str = "scaled_mm") -> int: ...
