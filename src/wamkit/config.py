"""Typed run configuration: one dataclass per stage, YAML presets, dotted overrides.

A preset (``configs/demo.yaml``) holds only what differs from the defaults below; every default lives
here and nowhere else. ``load_config("configs/demo.yaml", ["train.max_steps=10"])`` returns a validated
:class:`RunConfig`; unknown keys and wrong types raise :class:`ConfigError` naming the dotted key and
the nearest valid one. Each stage section may be extended by its own module's fields only.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

import yaml


class UserError(Exception):
    """A mistake in what the user gave (a key, a file, a server's address), with a message that names it
    and what was expected: the ``wamkit`` command prints that message in one line, with no traceback
    (``--log-level debug`` shows one)."""


class ConfigError(UserError, ValueError):
    """A configuration value or key is invalid. The message names the dotted key."""


def _positive(section: Any, name: str, key: str) -> None:
    value = getattr(section, key)
    if value <= 0:
        raise ConfigError(f"{name}.{key}: expected a positive integer, got {value}")


# --------------------------------------------------------------------------------------------------
# Stage sections
# --------------------------------------------------------------------------------------------------


@dataclass
class EnvConfig:
    """Which simulated tasks, and how they are observed. Shared by collect and eval."""

    suite: str = (
        "metaworld"  # a suite of a registered embodiment (wamkit.embodiments.suites(); `wamkit envs`)
    )
    tasks: list[str] = field(default_factory=lambda: ["reach-v3"])  # task names (metaworld) or ids
    cameras: list[str] = field(default_factory=lambda: ["corner"])
    image_size: int = 128
    # "fast" turns off shadows, reflections and MSAA (about 10x cheaper on CPU). Recorded in datasets
    # and checked at eval: a model trained on one look must be evaluated on the same look.
    # "auto": the suite's protocol look (its embodiment profile: the look of its published data).
    render_quality: Literal["auto", "default", "fast"] = "auto"
    max_steps: int = 0  # 0: the suite's own limit
    # How episode seeds reach the simulator (docs/eval.md). openpi / openvla: the task's env is seeded
    # once (7 / 0) and trial t starts from the random state t earlier resets leave; per_trial: trial t is
    # seeded with eval.seed + t. "auto": the suite's protocol (its embodiment profile).
    seed_rule: Literal["auto", "openpi", "openvla", "per_trial"] = "auto"
    # Suites built on stored initial states: rebuild the simulator at every reset, as openpi's client
    # does (seconds per reset); false reuses it and clears what it keeps (tested identical to a rebuild).
    hard_reset: bool = False
    # Which GPU env workers render on with EGL (MUJOCO_GL=egl): -1 lets EGL choose (its first device;
    # Mesa's software renderer on a machine without a GPU); N renders on EGL device N (on a 2-GPU machine,
    # rendering on one GPU and serving on the other). Recorded in an evaluation's plan.json.
    render_gpu: int = -1
    # What observation.state holds: "full", the suite's whole state (MetaWorld's 39-D: hand, gripper,
    # two objects' pose, the previous step's copy, the goal), or "proprio", the robot's own part of it
    # (the profile's proprio_dims; MetaWorld: hand xyz and gripper opening, 4-D), for
    # a policy that must find objects and goals in its camera frames.
    state: Literal["full", "proprio"] = "full"
    # The controller the actions command, for a suite that offers more than its own ("auto": the suite's,
    # e.g. ManiSkill3's pd_ee_delta_pose); a suite with one refuses any other
    control_mode: str = "auto"


@dataclass
class CollectConfig:
    """Scripted-expert demonstrations written as a LeRobot v3 dataset."""

    out: str = "data/demo"
    episodes: int = 50  # per task
    workers: int = 2
    seed: int = 0  # episode e of a task uses seed + e
    keep_failed: bool = False
    # DART (Laskey et al. 2017): Gaussian noise of this standard deviation (in the env's action units)
    # added to each action the expert's episode executes; the dataset records the expert's own action,
    # so it holds corrections from states a noiseless expert never visits. 0: none
    action_noise: float = 0.0
    # steps each noise draw is held for (1: a new draw every step, which the expert's feedback undoes at
    # once; k: a push that lasts k steps, as a stale chunk's does, and leaves the hand off its path)
    noise_hold: int = 1
    # late actions: each window of noise_hold steps is, with probability lag_prob, executed K steps late
    # (the expert's action of action_lag steps before), as a robot running a stale chunk moves: the hand
    # overshoots where the expert would stop, and the dataset records the expert's way back. 0: none
    action_lag: int = 0
    lag_prob: float = 0.0


@dataclass
class DataConfig:
    """Training data: one LeRobot v3 dataset, or a folder of several (one per suite)."""

    root: str = "data/demo"
    suites: list[str] = field(default_factory=list)  # sub-datasets of root; empty: root is one dataset
    suite_weights: list[float] = field(default_factory=list)  # sampling ratios, same order as suites
    cameras: list[str] = field(default_factory=list)  # empty: the model's cameras
    chunk: int = 16  # action chunk length (frames)
    representation: str = "raw"  # a registered action representation (wamkit.actions.representations)
    stats: str = ""  # stats file; empty: <root>/meta/wamkit_stats.json, computed if missing
    normalization: Literal["quantile", "mean_std", "min_max", "none"] = "quantile"
    clip: bool = False  # clip normalised actions to [-1, 1]
    # the data's gripper convention (env | open_1 | close_1); empty: the stats file's (detected by
    # `wamkit stats`). The model learns the data's values; the served model maps them to env commands.
    gripper: Literal["", "env", "open_1", "close_1"] = ""
    resize: Literal["bilinear_antialias", "nearest"] = "bilinear_antialias"  # image resize kernel
    num_workers: int = 2
    # decode whole video files into memory, up to this many MiB per loader process (each worker holds
    # its own); files past it are decoded as samples need them. 0: none kept
    frame_memory_mb: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.frame_memory_mb < 0:
            raise ConfigError(
                f"data.frame_memory_mb: expected MiB >= 0 (0 keeps none), got {self.frame_memory_mb}"
            )


@dataclass
class ModelConfig:
    """Which model adapter, and its size preset. ``options`` go to the adapter, which validates them."""

    name: str = "tiny"
    preset: str = "small"
    pretrained: str = ""  # a directory the adapter can load from (never downloaded)
    options: dict[str, Any] = field(default_factory=dict)


Reshard = Literal["auto", "always", "never"]
RESHARD_CHOICES: tuple[str, ...] = get_args(Reshard)
Offload = Literal["auto", "none", "ema", "optimizer"]


# train.lora.base: the formats of the adapted layers' frozen weights
LORA_BASES = ("bf16", "int8")


@dataclass
class LoraConfig:
    """``train.lora``: low-rank adapters (peft's LoRA) in place of training the model's linear layers in
    full (:mod:`wamkit.train.lora`). The adapted layers' weights stay frozen (in the compute dtype), the
    model's heads still train in full, and checkpoints hold only what trains."""

    rank: int = 0  # the adapters' rank r; 0: LoRA off (full SFT)
    alpha: float = 0.0  # the update B @ A is scaled by alpha / rank; 0: alpha = rank (a scale of 1)
    dropout: float = 0.0  # dropout on each adapter's input (peft's lora_dropout)
    # the layers to adapt: names of linear layers, whole or their last dotted parts (peft's matching:
    # "mlp_moe_gen.up_proj" is that layer of every block); empty: the model's own list (cosmos3: every
    # linear layer of the generation tower's blocks)
    target_modules: list[str] = field(default_factory=list)
    # the adapted layers' frozen weights: "bf16", as every frozen weight, in the compute dtype (bf16 in
    # a bf16 run); "int8", torchao's weight-only int8 (one byte a weight and a scale per output row:
    # half of bf16's memory; wamkit.train.lora.quantize_base, the wamkit[lora-int8] extra)
    base: str = "bf16"

    def __post_init__(self) -> None:
        if self.base not in LORA_BASES:
            raise ConfigError(
                f"train.lora.base: expected one of {', '.join(LORA_BASES)}, got {self.base!r} (a 4-bit base "
                "is not offered: peft's LoRA over torchao takes int8 weights only; see docs/cosmos3.md, LoRA)"
            )
        if self.rank == 0 and self.base != "bf16":
            raise ConfigError(
                f"train.lora.base={self.base} is set but train.lora.rank=0 (LoRA off: full SFT trains the "
                "weights, which cannot be quantized): set a rank, e.g. train.lora.rank=16, or drop the base"
            )
        if self.rank < 0:
            raise ConfigError(f"train.lora.rank: expected >= 0 (0: LoRA off), got {self.rank}")
        if self.alpha < 0:
            raise ConfigError(f"train.lora.alpha: expected >= 0 (0: alpha = rank), got {self.alpha}")
        if not 0 <= self.dropout < 1:
            raise ConfigError(f"train.lora.dropout: expected a probability in [0, 1), got {self.dropout}")
        bad = [t for t in self.target_modules if not t.strip() or t != t.strip()]
        if bad:
            raise ConfigError(f"train.lora.target_modules: {bad[0]!r} is not a layer name")
        if self.rank == 0 and self.target_modules:
            raise ConfigError(
                "train.lora.target_modules is set but train.lora.rank=0 (LoRA off): set a rank, e.g. "
                "train.lora.rank=16"
            )


@dataclass
class TrainConfig:
    """The SFT loop."""

    run_dir: str = "runs/train"
    max_steps: int = 2000
    micro_batch: int = 32  # per process
    global_batch: int = 32  # micro_batch x processes x accumulation steps
    lr: float = 3e-4
    weight_decay: float = 0.01
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    schedule: Literal["constant", "lambda_linear", "cosine"] = "cosine"
    warmup_steps: int = 100
    min_lr_ratio: float = 0.05
    grad_clip: float = 1.0
    ema: bool = False
    ema_type: Literal["inverse_power", "edm2"] = "inverse_power"  # see wamkit.train.optim.ema_decay
    ema_power: float = 0.75  # inverse_power: decay = 1 - (step + 1) ** -power
    ema_rate: float = 0.1  # edm2: the EMA's relative width sigma_rel (cosmos' "power" EMA rate)
    save_interval: int = 500
    # write checkpoint shards in a background thread while the next micro-batches run; the save is
    # finished (marker, rename) before the next optimizer step (wamkit.train.checkpoint)
    async_save: bool = True
    keep_last: int = 2
    log_interval: int = 10
    seed: int = 0
    precision: Literal["fp32", "bf16"] = "fp32"
    compile: bool = False  # torch.compile each transformer block (GPU: fuses norms, casts and activations)
    # FSDP2 after a block's forward: auto = free the gathered weights with several processes (the
    # backward gathers them again) but not the last block's, keep them with one; always / never for
    # every block. never trades memory (each block's weights stay whole from forward to backward) for
    # one all-gather per block and step fewer (what several GPUs of one host can afford)
    reshard_after_forward: Reshard = "auto"
    # where the optimizer's moments and the EMA rest between optimizer steps (wamkit.train.memory):
    # auto = the memory plan's choice (everything on the device if it fits, else the EMA, then the
    # moments too, in pinned host memory, streamed through the device at each step); none | ema |
    # optimizer (moments and EMA). On a CPU auto is none
    offload: Offload = "auto"
    device: str = "auto"  # auto | cpu | cuda
    resume: str = ""  # "" (fresh), "auto" (newest complete checkpoint) or a checkpoint path
    lora: LoraConfig = field(default_factory=LoraConfig)
    # step distillation (docs/train.md "Step distillation"): the teacher's serving directory; the student
    # starts from its weights and learns to reach its distill_teacher_steps-step result (0: its own
    # sampler's steps) in distill_steps sampler steps
    distill_from: str = ""
    distill_steps: int = 4
    distill_teacher_steps: int = 0

    def __post_init__(self) -> None:
        for key in ("max_steps", "micro_batch", "global_batch", "save_interval", "log_interval"):
            _positive(self, "train", key)
        # the batch's divisibility and bf16's device are checked where the run knows its processes and
        # its device (wamkit.train.memory.accumulation_steps; wamkit.train.loop.train)
        if self.distill_steps < 1:
            raise ConfigError(f"train.distill_steps: expected >= 1 sampler steps, got {self.distill_steps}")
        if self.distill_teacher_steps < 0:
            raise ConfigError(
                f"train.distill_teacher_steps: expected >= 0 (0: the teacher's own), got {self.distill_teacher_steps}"
            )


ServePrecision = Literal["auto", "fp32", "bf16", "fp8"]
ServeWarm = Literal["auto", "all", "none"]
SERVE_WARM: tuple[str, ...] = get_args(ServeWarm)
SERVE_PRECISIONS: tuple[str, ...] = get_args(ServePrecision)
ServeTextTower = Literal["auto", "device", "host"]
SERVE_TEXT_TOWERS: tuple[str, ...] = get_args(ServeTextTower)


@dataclass
class ServeConfig:
    """The inference server."""

    host: str = "127.0.0.1"
    port: int = 8000
    max_batch: int = 32  # observations per model call
    max_wait_ms: float = 2.0  # how long a partial batch waits for more requests
    device: str = "auto"
    raw_actions: bool = False  # True: reply with the model's normalised output, not env-ready actions
    max_message_mb: float = 64.0
    # compute of a model call: auto = bf16 autocast on a CUDA device for a model whose weights are fp32
    # (speed; whatever precision it trained in), the weights' own dtype otherwise; fp32 = no autocast
    # (the reference numerics); bf16 = autocast (CUDA only). The served identity records the result.
    precision: ServePrecision = "auto"
    # run every batch bucket once before answering (``/healthz`` says "warming" meanwhile): auto = when
    # the model captures or compiles its steps (Cosmos3 on CUDA), all, none
    warm: ServeWarm = "auto"
    # where compiled steps are kept between starts (wamkit.models.compile_cache); "" = not kept
    compile_cache: str = "~/.cache/wamkit/compile"
    # where a model's text tower (Cosmos3's understanding tower, which computes a prompt's keys/values
    # once) keeps its weights: device; host (pinned host memory, streamed to the device layer by layer
    # for a new prompt: the generation tower and the text cache alone on the device); auto = the
    # serving memory plan's pick for this device (host where device does not fit; wamkit.serve.plan)
    text_tower: ServeTextTower = "auto"
    # the sampler steps of each request (a flow or diffusion model's: tiny's num_steps, Cosmos3's
    # num_inference_steps), set without retraining; 0 = the model's own. More steps than a step-distilled
    # model was made for are served with a warning (docs/serve.md "Sampler steps")
    sampling_steps: int = 0

    def __post_init__(self) -> None:
        if self.sampling_steps < 0:
            raise ConfigError(
                f"serve.sampling_steps: expected >= 1 sampler steps, or 0 for the model's own, got {self.sampling_steps}"
            )
        for key, choices in (
            ("text_tower", SERVE_TEXT_TOWERS),
            ("precision", SERVE_PRECISIONS),
            ("warm", SERVE_WARM),
        ):
            if getattr(self, key) not in choices:
                raise ConfigError(
                    f"serve.{key}: expected one of {', '.join(choices)}, got {getattr(self, key)!r}"
                )
        if self.precision in ("bf16", "fp8") and self.device == "cpu":
            raise ConfigError(
                f"serve.precision={self.precision} needs a CUDA device; use auto or fp32 on the CPU"
            )


@dataclass
class EvalConfig:
    """Closed-loop evaluation through the server protocol."""

    out_dir: str = "runs/eval"
    # ws://host:port, or several (a list, or comma-separated) serving one model: each serves whole
    # pipeline stages (docs/eval.md); empty: start a local server from serve_dir
    server_url: str | list[str] = ""
    serve_dir: str = ""
    # the engine behind server_url (wamkit.eval.backends; docs/eval.md): wamkit | openpi | sglang |
    # vllm_omni | cosmos_http
    backend: str = "wamkit"
    backend_options: dict[str, Any] = field(default_factory=dict)  # per backend (docs/eval.md)
    trials: int = 0  # per task; 0: the suite's protocol (its embodiment profile)
    seed: int = 1000  # env.seed_rule=per_trial: trial t uses seed + t; keep it apart from collection seeds
    num_envs: int = 4
    pipeline_stages: int = 2  # 0: auto (measured on a warm-up)
    # local: env worker processes, one simulator per env; ray: the same as Ray actors; gpu: one process
    # per stage simulating its envs together on the GPU (ManiSkill3; docs/maniskill.md)
    executor: Literal["local", "ray", "gpu"] = "local"
    workers: int = 2  # env worker processes
    replan_interval: int = 8  # actions applied from each chunk before asking again
    # how the world waits for the policy (docs/eval.md "Real-time execution"): sync = the world stops
    # while the policy thinks; async = an env keeps executing the chunk it has while its next request is
    # in flight, and the new chunk takes over delay_steps later (simulated time: reproducible)
    execution: Literal["sync", "async"] = "sync"
    # async: control steps a request is in flight; auto = the server's measured latency at the run's
    # batch x the embodiment's control rate, rounded up (recorded in plan.json)
    delay_steps: int | str = 0
    # how consecutive chunks meet: switch = the new chunk replaces the old one; rtc = real-time chunking
    # (the request carries the old chunk's unexecuted actions and the server's flow sampler inpaints
    # them; wamkit servers of flow models); ensemble = ACT's temporal ensembling of every chunk covering
    # a step, weights exp(-ensemble_coeff * i), i = 0 the oldest
    chunk_blend: Literal["switch", "rtc", "ensemble"] = "switch"
    ensemble_coeff: float = 0.01
    # rtc: the soft mask over the overlap (exp | linear | ones | zeros) and the guidance-weight clip
    # (beta); the paper's values by default (docs/eval.md cites them)
    rtc_schedule: Literal["exp", "linear", "ones", "zeros"] = "exp"
    rtc_max_guidance: float = 5.0
    videos: int = 2  # episodes recorded as mp4 per task, successes and failures sharing them (eval/video.py)
    # a control: every camera image the policy is sent is black (uint8 zeros of the rendered shape),
    # so the success left is what the policy gets without vision; the videos still show the scene
    blank_images: bool = False
    resume: bool = False
    watchdog_s: float = 300.0
    # seconds spent before the timed part measuring simulation and inference apart (the independent
    # bound); 0 skips it (then only the utilisation figure is reported; auto stages need it)
    calibrate_s: float = 3.0
    env_retries: int = 2  # an episode whose env raises is rerun from the start this often, then recorded
    # a server that answers no request within this many seconds is dropped like a closed one (its
    # stages move to the other servers); 0: wait forever
    server_timeout_s: float = 600.0
    ray_address: str = ""  # executor=ray: the cluster (host:port); empty: RAY_ADDRESS, else a local one

    @property
    def server_urls(self) -> list[str]:
        """``server_url`` as a list (one entry per server)."""
        urls = self.server_url if isinstance(self.server_url, list) else self.server_url.split(",")
        return [u.strip() for u in urls if u.strip()]

    def __post_init__(self) -> None:
        for key in ("num_envs", "workers", "replan_interval"):
            _positive(self, "eval", key)
        self._check_servers()
        if self.calibrate_s < 0:
            raise ConfigError(f"eval.calibrate_s: expected >= 0 seconds (0: skip), got {self.calibrate_s}")
        if self.calibrate_s == 0 and self.pipeline_stages == 0:
            raise ConfigError(
                "eval.pipeline_stages=0 (auto) picks the stage count from the calibration, which "
                "eval.calibrate_s=0 skips: set eval.calibrate_s > 0 or a stage count"
            )
        if self.executor == "gpu" and self.pipeline_stages != self.workers:
            raise ConfigError(
                f"eval.executor=gpu runs one stage per worker process (its envs step together): set "
                f"eval.pipeline_stages={self.workers} to match eval.workers={self.workers}, or both to the "
                f"stage count wanted (got eval.pipeline_stages={self.pipeline_stages})"
            )
        if self.env_retries < 0:
            raise ConfigError(f"eval.env_retries: expected >= 0 reruns, got {self.env_retries}")
        if self.pipeline_stages < 0:
            raise ConfigError(
                f"eval.pipeline_stages: expected >= 1, or 0 for auto, got {self.pipeline_stages}"
            )
        if self.pipeline_stages and self.num_envs % self.pipeline_stages:
            raise ConfigError(
                f"eval.num_envs={self.num_envs} is not divisible by eval.pipeline_stages={self.pipeline_stages}: "
                "every stage needs the same number of envs (no env is silently dropped); "
                f"try eval.num_envs={self.pipeline_stages * max(1, round(self.num_envs / self.pipeline_stages))}"
            )
        if self.watchdog_s <= 0:
            raise ConfigError(
                f"eval.watchdog_s: expected a positive number of seconds, got {self.watchdog_s}"
            )
        if self.videos < 0:
            raise ConfigError(f"eval.videos: expected >= 0 episodes per task, got {self.videos}")
        self._check_execution()

    def _check_execution(self) -> None:
        choices = {
            "execution": ("sync", "async"),
            "chunk_blend": ("switch", "rtc", "ensemble"),
            "rtc_schedule": ("exp", "linear", "ones", "zeros"),
        }
        for key, allowed in choices.items():
            if getattr(self, key) not in allowed:
                raise ConfigError(
                    f"eval.{key}: expected one of {', '.join(allowed)}, got {getattr(self, key)!r}"
                )
        d = self.delay_steps
        if not (d == "auto" or (isinstance(d, int) and not isinstance(d, bool) and d >= 0)):
            raise ConfigError(f"eval.delay_steps: expected a whole number >= 0 or 'auto', got {d!r}")
        if self.execution == "sync" and d not in (0, "auto"):
            raise ConfigError(
                f"eval.delay_steps={d} needs eval.execution=async (sync execution stops the world while "
                "the policy thinks: no step passes)"
            )
        if self.chunk_blend == "rtc" and self.backend != "wamkit":
            raise ConfigError(
                f"eval.chunk_blend=rtc sends the unexecuted actions with each request, which only a wamkit "
                f"server reads; eval.backend is {self.backend!r} (use switch or ensemble)"
            )
        if self.ensemble_coeff < 0:
            raise ConfigError(f"eval.ensemble_coeff: expected >= 0, got {self.ensemble_coeff}")
        if self.rtc_max_guidance <= 0:
            raise ConfigError(f"eval.rtc_max_guidance: expected > 0, got {self.rtc_max_guidance}")

    def _check_servers(self) -> None:
        """Each server serves whole stages (stage i on server i mod S), so there must be a stage for each."""
        urls, s = self.server_urls, len(self.server_urls)
        if len(set(urls)) != s:
            raise ConfigError(f"eval.server_url: a server is listed twice in {urls}")
        if self.backend in ("wamkit", "openpi"):  # the websocket protocol; the others speak HTTP
            for url in urls:
                scheme = url.split("://", 1)[0] if "://" in url else ""
                if scheme and scheme not in ("ws", "wss"):
                    raise ConfigError(
                        f"eval.server_url: {url} is an {scheme}:// address, and eval.backend={self.backend} "
                        f"speaks websocket: give ws://{url.split('://', 1)[1]} (or host:port)"
                    )
        if self.server_timeout_s < 0:
            raise ConfigError(
                f"eval.server_timeout_s: expected >= 0 seconds (0: wait forever), got {self.server_timeout_s}"
            )
        if s > 1 and 0 < self.pipeline_stages < s:
            raise ConfigError(
                f"eval.pipeline_stages={self.pipeline_stages} is fewer than the {s} servers of eval.server_url: "
                f"each server serves whole stages, so {s - self.pipeline_stages} would stand idle; "
                f"set eval.pipeline_stages to a multiple of {s}, or use --pipeline auto"
            )
        if s > 1 and self.pipeline_stages == 0 and self.num_envs % s:
            raise ConfigError(
                f"eval.num_envs={self.num_envs} is not a multiple of the {s} servers of eval.server_url: "
                f"--pipeline auto picks P among multiples of {s} that divide eval.num_envs"
            )


@dataclass
class RunConfig:
    """Everything one run needs; a YAML preset fills in the parts that differ from these defaults."""

    env: EnvConfig = field(default_factory=EnvConfig)
    collect: CollectConfig = field(default_factory=CollectConfig)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)


# --------------------------------------------------------------------------------------------------
# Building a config from plain data, with checks that name the key
# --------------------------------------------------------------------------------------------------


def _suggest(key: str, valid: typing.Iterable[str], prefix: str = "") -> str:
    """ "; did you mean 'X'?" for the valid name closest to ``key`` (none if none is close), named in
    full under ``prefix`` (``train.max_steps``, as it is typed)."""
    close = difflib.get_close_matches(key, list(valid), n=1, cutoff=0.5)
    if not close:
        return ""
    return f"; did you mean '{prefix}.{close[0]}'?" if prefix else f"; did you mean '{close[0]}'?"


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is not None:
        return str(tp).replace("typing.", "")
    return getattr(tp, "__name__", str(tp))


_DECIMAL = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check ``value`` against the annotation ``tp`` and return it (ints widen to float)."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping of {tp.__name__} fields, got {value!r}")
        return from_dict(tp, value, prefix=key)
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise ConfigError(f"{key}: {value!r} is not allowed; expected {_type_name(tp)}")
        return value
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            try:
                return _coerce(value, arg, key)
            except ConfigError:
                continue
        raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")
    if origin is list:
        (item,) = typing.get_args(tp) or (Any,)
        if isinstance(value, str) and item is str:
            value = [v for v in value.split(",") if v]  # tasks=a,b on the command line
        elif item is str and isinstance(value, int) and not isinstance(value, bool):
            value = [str(value)]  # tasks=4 (a task index), which YAML reads as a number
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{key}: expected a list of {_type_name(item)}, got {value!r}")
        return [_coerce(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return dict(value)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str) and _DECIMAL.fullmatch(value.strip()):
            value = float(value)  # YAML 1.1 reads 1e-3 (no dot) as a string, in files and on the command line
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    raise ConfigError(f"{key}: unsupported field type {tp!r}")


def from_dict(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    """Build dataclass ``cls`` from ``data``, checking every key and type."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        dotted = f"{prefix}.{key}" if prefix else key
        if key not in names:
            valid = ", ".join(names)
            raise ConfigError(f"unknown key '{dotted}'{_suggest(key, names, prefix)} (valid here: {valid})")
        kwargs[key] = _coerce(value, hints[key], dotted)
    return cls(**kwargs)


def to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def _set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = data
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override '{dotted}': '{part}' is not a section")
    node[parts[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """``"train.max_steps=10"`` -> ``("train.max_steps", 10)``; values are read as YAML scalars."""
    if "=" not in text:
        raise ConfigError(f"override '{text}' must look like section.key=value")
    key, raw = text.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        value = raw
    return key.strip(), value


# the presets shipped in the package (configs/ in a source checkout links here)
PRESETS_DIR = Path(__file__).resolve().parent / "configs"


def packaged_presets() -> list[str]:
    return sorted(p.stem for p in PRESETS_DIR.glob("*.yaml"))


def preset_path(path: str | Path) -> Path:
    """A YAML preset: the file at ``path`` when there is one; else, for ``NAME``, ``NAME.yaml`` or
    ``configs/NAME.yaml``, the preset of that name shipped in the package (so ``wamkit train NAME`` and the docs' ``configs/demo.yaml`` work outside a source checkout)."""
    p = Path(path)
    if p.is_file():
        return p
    if p.parent in (Path("."), Path("configs")):
        packaged = PRESETS_DIR / f"{p.name.removesuffix('.yaml')}.yaml"
        if packaged.is_file():
            return packaged
    raise ConfigError(
        f"config file {p} does not exist, and '{p.stem}' is not a packaged preset "
        f"(have: {', '.join(packaged_presets())})"
    )


def load_config(path: str | Path | None = None, overrides: typing.Sequence[str] = (), cls: type = RunConfig):
    """Read a YAML preset (optional: a file, or a packaged preset's name), apply dotted overrides,
    validate, and return ``cls``."""
    data: dict[str, Any] = {}
    if path is not None:
        path = preset_path(path)
        try:
            loaded = yaml.safe_load(path.read_text())
        except yaml.YAMLError as err:
            raise ConfigError(f"{path}: not valid YAML: {err}") from err
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{path}: expected a mapping of sections at the top level")
        data = loaded or {}
    merged = copy.deepcopy(data)
    for text in overrides:
        key, value = parse_override(text)
        _set_dotted(merged, key, value)
    try:
        return from_dict(cls, merged)
    except ConfigError as err:
        raise ConfigError(f"{_blame(cls, path, data, bool(overrides), err)}: {err}") from None


def _blame(cls: type, path: Path | None, data: dict[str, Any], overridden: bool, err: ConfigError) -> str:
    """Where a refused value came from: the preset file when the file alone is refused the same way,
    else the command line's overrides."""
    if path is None or not overridden:
        return str(path) if path is not None else "command line"
    try:
        from_dict(cls, data)
    except ConfigError as own:
        if str(own) == str(err):
            return str(path)
    return "command line"


def save_config(cfg: Any, path: str | Path) -> Path:
    """Write the resolved config as YAML (every field, defaults included) next to a run's outputs."""
    from wamkit.files import atomic_write_text

    return atomic_write_text(path, yaml.safe_dump(to_dict(cfg), sort_keys=False))
