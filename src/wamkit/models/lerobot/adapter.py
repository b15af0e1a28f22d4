"""``LeRobotAdapter``: a LeRobot policy (its own class and code) behind wamkit's adapter protocol.

What the adapter does, and nothing more:

- **Config.** ``model.preset`` names the policy type (``act``, ``diffusion``) and ``model.options``
  are fields of its LeRobot config class, checked by name and type. wamkit sets the fields that
  describe the data: ``input_features`` / ``output_features`` from the model's inputs (each camera
  ``observation.images.<cam>`` as (3, S, S), ``observation.state``, ``action``), ``device``, and the
  action horizon (ACT's ``chunk_size``, Diffusion's ``horizon``) from ``data.chunk``; a different
  horizon in the options is refused, naming both. ``pretrained_backbone_weights`` defaults to none
  (LeRobot's default downloads ImageNet weights through torchvision; set it to have them).
- **Batches.** wamkit's batch (uint8 [B, H, W, 3] images, normalised state and actions) becomes
  LeRobot's: images float32 [B, 3, H, W] in [0, 1], converted as LeRobot's own
  ``lerobot.envs.utils.preprocess_observation`` converts an env's frames; for Diffusion Policy the
  observation gets its history axis (``n_obs_steps`` = 1). ``sft_loss`` is the policy's ``forward``
  loss (ACT also reports ``l1_loss`` and ``kld_loss``).
- **Normalisation once.** wamkit's preprocessing spec normalises state and actions before the policy
  sees them, as LeRobot's preprocessor would; the adapter normalises the images as lerobot-train's
  preprocessor does by default (MEAN_STD on ImageNet's statistics, its ``dataset.use_imagenet_stats``).
  ``export_extra`` writes a LeRobot pretrained folder whose processors do all three instead
  (:mod:`wamkit.models.lerobot.export`); a folder served as it is (:meth:`LeRobotAdapter.from_folder`)
  runs its own processors, and wamkit's spec is the identity.
- **Sampling.** ACT's chunk is deterministic (its latent is zero at inference). Diffusion Policy
  samples the whole horizon with LeRobot's own ``conditional_sample``; with seeds, each row draws its
  initial noise and (DDPM) its step noise from CPU generators seeded with its own seed.
- **Refused options.** What wamkit's settings replace: LeRobot's optimizer and scheduler presets
  (``train.*`` set them), ``use_amp``, ``drop_n_last_frames``, ACT's temporal ensembling (the
  evaluator's ``eval.chunk_blend=ensemble``).

Observation history beyond the current frame (Diffusion's ``n_obs_steps`` > 1) is refused for now: the
data stage and the evaluator supply one frame.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from wamkit.config import ConfigError, _coerce, _suggest
from wamkit.constants import ACTION, ACTION_IS_PAD, OBS_STATE, image_key
from wamkit.models.base import Mode, ModelIO, ParamGroup, row_seeds, seeded_noise

LEROBOT_VERSION = "0.6.1"  # what make setup-lerobot installs and the tests run against
# the policy types this adapter runs, and the config field that holds each one's action horizon
HORIZON_FIELD = {"act": "chunk_size", "diffusion": "horizon"}
# config fields wamkit's own settings replace (an option naming one is refused, saying which)
REPLACED = {
    "optimizer_": "the optimizer is wamkit's: train.lr, train.weight_decay, train.grad_clip and the schedule",
    "scheduler_": "the learning-rate schedule is wamkit's: train.warmup_steps, train.max_steps",
    "use_amp": "precision is wamkit's: train.precision, serve.precision",
    "drop_n_last_frames": "sampling is wamkit's data stage's (its action padding)",
    "temporal_ensemble_coeff": "ensembling is the evaluator's: eval.chunk_blend=ensemble (docs/eval.md)",
}
# config fields wamkit sets from the data and the run (an option naming one is refused)
MANAGED = ("input_features", "output_features", "device", "normalization_mapping", "pretrained_path",
           "pretrained_revision", "push_to_hub", "repo_id", "private", "tags", "license", "type")  # fmt: skip


def require_lerobot() -> Any:
    """The ``lerobot`` package, or a :class:`ConfigError` saying how to get it."""
    try:
        import lerobot
    except ImportError as err:
        raise ConfigError(
            f"model.name=lerobot needs LeRobot {LEROBOT_VERSION} in this Python ({err}); it needs Python 3.12 "
            "and torch < 2.12: `make setup-lerobot` builds .venv-lerobot with both (docs/lerobot.md)"
        ) from err
    return lerobot


def config_class(policy_type: str) -> type:
    """LeRobot's config class of ``policy_type`` (``act``, ``diffusion``)."""
    require_lerobot()
    if policy_type not in HORIZON_FIELD:
        have = ", ".join(HORIZON_FIELD)
        raise ConfigError(
            f"model.preset: '{policy_type}' is not a LeRobot policy this adapter runs{_suggest(policy_type, HORIZON_FIELD)} "
            f"(have: {have})"
        )
    from lerobot.policies.factory import make_policy_config

    return type(make_policy_config(policy_type, device="cpu", pretrained_backbone_weights=None))


def _plain(tp: Any) -> bool:
    """Whether wamkit's config checker knows every type in ``tp`` (no tuple, enum, mapping or class)."""
    args = typing.get_args(tp)
    if args:
        return typing.get_origin(tp) not in (tuple, dict) and all(_plain(a) for a in args)
    return tp in (int, float, bool, str, type(None), Any) or typing.get_origin(tp) is typing.Literal


def resolve_options(policy_type: str, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` checked against the config class's fields (names, then types where wamkit's config
    checker knows the type; draccus decodes the rest when the policy is built)."""
    cls = config_class(policy_type)
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.name not in MANAGED]
    out = {}
    for key, value in options.items():
        dotted = f"model.options.{key}"
        if key in MANAGED:
            raise ConfigError(f"{dotted}: set by wamkit from the data and the run; leave it out")
        for prefix, why in REPLACED.items():
            if key.startswith(prefix):
                raise ConfigError(f"{dotted}: {why}; leave it out")
        if key not in names:
            raise ConfigError(
                f"unknown key '{dotted}'{_suggest(key, names, 'model.options')} (valid here: {', '.join(names)})"
            )
        # wamkit's checker for the plain types; a tuple, an enum or a mapping is draccus's to decode
        out[key] = _coerce(value, hints[key], dotted) if _plain(hints[key]) else value
    if policy_type == "diffusion" and out.get("n_obs_steps", 1) != 1:
        raise ConfigError(
            f"model.options.n_obs_steps: {out['n_obs_steps']}; wamkit's data stage and evaluator supply "
            "the current observation only, so expected 1"
        )
    return out


def build_config(policy_type: str, opts: dict[str, Any], io: ModelIO, device: Any) -> Any:
    """The LeRobot config of a policy for inputs ``io``: ``opts`` (checked by :func:`resolve_options`)
    over LeRobot's defaults, the data's features, horizon and device set by wamkit (see the module
    docstring)."""
    import draccus
    from lerobot.configs.types import FeatureType, NormalizationMode, PolicyFeature

    horizon = HORIZON_FIELD[policy_type]
    if horizon in opts and opts[horizon] != io.chunk:
        raise ConfigError(
            f"model.options.{horizon}: {opts[horizon]}, but the data's action chunk (data.chunk) is {io.chunk}; "
            f"the policy's horizon is the chunk: set data.chunk={opts[horizon]} or leave {horizon} out"
        )
    cls = config_class(policy_type)
    defaults = draccus.encode(cls(device="cpu", pretrained_backbone_weights=None))
    fields = {k: v for k, v in defaults.items() if k not in MANAGED}
    fields.update({"pretrained_backbone_weights": None, horizon: io.chunk})
    fields["n_action_steps"] = min(int(fields["n_action_steps"]), io.chunk)
    if policy_type == "diffusion":
        fields["n_obs_steps"] = 1
        # a backbone trained from scratch gets GroupNorm, as Diffusion Policy's own from-scratch encoder
        # (LeRobot keeps BatchNorm for its ImageNet default, which GroupNorm would spoil); it also keeps
        # FSDP2's ranks from each holding running statistics of their own
        fields["use_group_norm"] = opts.get("pretrained_backbone_weights") is None
    fields.update(opts)
    try:
        config = draccus.decode(cls, fields)
    except Exception as err:  # draccus names the field it could not decode
        raise ConfigError(f"model.options: {err}") from err
    size = io.image_size
    config.input_features = {
        OBS_STATE: PolicyFeature(FeatureType.STATE, (io.state_dim,)),
        **{image_key(c): PolicyFeature(FeatureType.VISUAL, (3, size, size)) for c in io.cameras},
    }
    config.output_features = {ACTION: PolicyFeature(FeatureType.ACTION, (io.action_dim,))}
    config.normalization_mapping = {**config.normalization_mapping, "VISUAL": NormalizationMode.MEAN_STD}
    config.device = str(torch.device(device))
    try:
        config.validate_features()
    except (ValueError, AssertionError) as err:
        raise ConfigError(
            f"model.options: LeRobot's {policy_type} config refuses these inputs: {err}"
        ) from err
    return config


def is_lerobot_folder(path: str | Path) -> bool:
    """A LeRobot pretrained folder: LeRobot's ``config.json`` (with its policy ``type``) and its
    processors, and no wamkit ``model.json``."""
    root = Path(path)
    if not (root / "config.json").is_file() or (root / "model.json").is_file():
        return False
    try:
        meta = json.loads((root / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return isinstance(meta, dict) and "type" in meta and (root / "policy_preprocessor.json").is_file()


def folder_io(folder: Path) -> tuple[str, ModelIO]:
    """The policy type and the inputs of a LeRobot folder's ``config.json``; what wamkit cannot supply is
    refused, naming the field."""
    where = folder / "config.json"
    meta = json.loads(where.read_text())
    policy_type = meta["type"]
    if policy_type not in HORIZON_FIELD:
        raise ConfigError(
            f"{where}: type '{policy_type}' is not a policy this adapter runs (have: {', '.join(HORIZON_FIELD)})"
        )
    if meta.get("temporal_ensemble_coeff") is not None:
        raise ConfigError(
            f"{where}: temporal_ensemble_coeff {meta['temporal_ensemble_coeff']}; ensembling is the evaluator's "
            "(eval.chunk_blend=ensemble): set it to null in a copy of the folder"
        )
    if int(meta.get("n_obs_steps", 1)) != 1:
        raise ConfigError(
            f"{where}: n_obs_steps {meta['n_obs_steps']}; wamkit supplies the current observation only (1)"
        )
    feats = meta.get("input_features") or {}
    cams, size, state_dim = [], None, None
    prefix = image_key("")
    for key, f in feats.items():
        shape = list(f.get("shape", []))
        if f.get("type") == "VISUAL" and key.startswith(prefix):
            if len(shape) != 3 or shape[0] != 3 or shape[1] != shape[2] or size not in (None, shape[1]):
                raise ConfigError(
                    f"{where}: input_features.{key}: shape {shape}; wamkit serves square images of one size, channels first (3, S, S)"
                )
            cams.append(key[len(prefix) :])
            size = shape[1]
        elif key == OBS_STATE and f.get("type") == "STATE":
            state_dim = shape[0]
        else:
            raise ConfigError(
                f"{where}: input_features.{key} ({f.get('type')}): not a feature wamkit supplies (cameras and observation.state)"
            )
    action = (meta.get("output_features") or {}).get(ACTION)
    if not cams or state_dim is None or action is None:
        raise ConfigError(f"{where}: expected cameras, observation.state and action features")
    io = ModelIO(cameras=tuple(cams), image_size=int(size), state_dim=int(state_dim),
                 action_dim=int(action["shape"][0]), chunk=int(meta[HORIZON_FIELD[policy_type]]))  # fmt: skip
    return policy_type, io


class LeRobotAdapter:
    """A LeRobot policy as a wamkit model (see the module docstring)."""

    name = "lerobot"
    supports_rtc = False  # neither policy is a flow sampler wamkit can guide
    future_frame_offsets: tuple[int, ...] = ()

    def __init__(self, policy_type: str, options: dict[str, Any], io: ModelIO, device: Any = "cpu"):
        require_lerobot()
        from lerobot.policies.factory import get_policy_class

        self.policy_type, self.io = policy_type, io
        self.options = resolve_options(policy_type, options)
        self.config = build_config(policy_type, self.options, io, device)
        try:
            self.module = get_policy_class(policy_type)(self.config)
        except (ValueError, AssertionError, NotImplementedError) as err:  # an option its parts refuse
            raise ConfigError(
                f"model.options: LeRobot's {policy_type} policy cannot be built: {type(err).__name__}: {err} "
                f"(its options: {self.options})"
            ) from err
        self.module.to(device)
        self._flops: float | None = None
        self.processors: tuple[Any, Any] | None = None  # a LeRobot folder's (pre, post), from_folder
        self.source = ""

    @classmethod
    def from_folder(cls, folder: str | Path, device: Any = "cpu") -> LeRobotAdapter:
        """A LeRobot pretrained folder (``lerobot-train``'s ``pretrained_model``, or one wamkit exported)
        as it is: LeRobot's ``from_pretrained`` builds the policy and ``make_pre_post_processors`` its
        processors, as ``lerobot-eval`` loads them. Its preprocessor normalises raw state and its
        postprocessor returns raw actions, so the folder is served with the identity spec
        (:func:`folder_io`): normalisation happens once, LeRobot's."""
        require_lerobot()
        from lerobot.policies.factory import get_policy_class, make_pre_post_processors

        folder = Path(folder)
        policy_type, io = folder_io(folder)
        dev = str(torch.device(device))
        self = cls.__new__(cls)
        self.policy_type, self.io, self.options, self._flops = policy_type, io, {}, None
        self.module = get_policy_class(policy_type).from_pretrained(str(folder))
        self.module.to(dev)
        self.config = self.module.config
        self.processors = make_pre_post_processors(
            self.config,
            pretrained_path=str(folder),
            preprocessor_overrides={"device_processor": {"device": dev}},
        )
        self.source = str(folder)
        return self

    @property
    def device(self) -> torch.device:
        return next(self.module.parameters()).device

    # --- protocol -----------------------------------------------------------------------------------

    def param_groups(self) -> list[ParamGroup]:
        """LeRobot's own parameter groups (``get_optim_params``): ACT's backbone is a group of its own,
        at LeRobot's ratio of ``optimizer_lr_backbone`` to ``optimizer_lr`` (1 by default). The
        optimizer, its rate and decay are wamkit's (``train.*``): LeRobot's presets are not used."""
        params = self.module.get_optim_params()  # ACT: a list of groups; Diffusion: its parameters
        if not isinstance(params, list):
            params = [{"params": list(params)}]
        groups = []
        base_lr = float(self.config.optimizer_lr)
        for i, g in enumerate(params):
            trained = [p for p in g["params"] if p.requires_grad]
            if not trained:
                continue
            mult = float(g["lr"]) / base_lr if "lr" in g else 1.0
            name = "policy" if i == 0 else "backbone" if self.policy_type == "act" else f"policy.{i}"
            groups.append(ParamGroup(name, trained, lr_mult=mult))
        return groups

    def blocks(self) -> list[torch.nn.Module]:
        """ACT's transformer layers (FSDP2 shards each); Diffusion Policy's U-Net is sharded whole."""
        if self.policy_type == "act":
            model = self.module.model
            layers = list(model.encoder.layers) + list(model.decoder.layers)
            if self.config.use_vae:
                layers = list(model.vae_encoder.layers) + layers
            return layers
        return []

    def _observation(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        """wamkit's observation -> LeRobot's (see the module docstring)."""
        dev = self.device
        obs = {OBS_STATE: torch.as_tensor(batch[OBS_STATE]).to(dev, torch.float32)}
        for cam in self.io.cameras:
            img = torch.as_tensor(batch[image_key(cam)])
            # as lerobot.envs.utils.preprocess_observation: channels first, float32, divided by 255
            obs[image_key(cam)] = img.to(dev).permute(0, 3, 1, 2).contiguous().to(torch.float32) / 255
        if self.processors is None:  # then ImageNet's statistics, as lerobot-train's preprocessor does
            mean, denom = self._imagenet(dev)
            for cam in self.io.cameras:
                obs[image_key(cam)] = (obs[image_key(cam)] - mean) / denom
        return obs

    def _imagenet(self, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """ImageNet's mean and LeRobot's MEAN_STD divisor (std + 1e-8), [3, 1, 1] float32: what
        lerobot-train normalises every camera with (its ``dataset.use_imagenet_stats``, on by default)."""
        from lerobot.utils.constants import IMAGENET_STATS

        mean = torch.tensor(IMAGENET_STATS["mean"], dtype=torch.float32, device=dev)
        std = torch.tensor(IMAGENET_STATS["std"], dtype=torch.float32, device=dev)
        return mean, std + 1e-8

    def _history(self, obs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Diffusion Policy's observations with their history axis, one step long."""
        if self.policy_type != "diffusion":
            return obs
        return {
            k: v.unsqueeze(1) if k == OBS_STATE or k in self.config.image_features else v
            for k, v in obs.items()
        }

    def lerobot_batch(self, batch: dict[str, Any], training: bool = False) -> dict[str, torch.Tensor]:
        """The batch LeRobot's policy is given (actions and their padding too when ``training``)."""
        b = self.io.check_batch(batch, training=training)
        if self.processors is not None:
            raise ValueError(
                f"model lerobot/{self.policy_type} from {self.source}: a LeRobot folder is served as it is "
                "(its processors run); training starts from a wamkit model (model.preset and options)"
            )
        out = self._history(self._observation(batch))
        if training:
            act = batch[ACTION]
            out[ACTION] = torch.as_tensor(act).to(self.device, torch.float32)
            pad = batch.get(ACTION_IS_PAD)
            pad = torch.zeros(b, self.io.chunk, dtype=torch.bool) if pad is None else torch.as_tensor(pad)
            out[ACTION_IS_PAD] = pad.to(self.device, torch.bool)
        return out

    def sft_loss(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        """The policy's ``forward`` loss under ``"loss"``; ACT's terms beside it (detached)."""
        loss, info = self.module(self.lerobot_batch(batch, training=True))
        out = {"loss": loss}
        for key, value in (info or {}).items():
            if isinstance(value, int | float):
                out[key] = torch.tensor(float(value), device=loss.device)  # the loop stacks it with loss
        return out

    @torch.no_grad()
    def predict(
        self,
        batch: dict[str, Any],
        mode: Mode = "policy",
        seed: int | Sequence[int] | None = None,
        **inputs: Any,
    ) -> dict[str, np.ndarray]:
        """``{"actions": [B, chunk, action_dim]}`` (normalised): ACT's chunk from
        ``predict_action_chunk``; Diffusion Policy's whole horizon from ``conditional_sample`` (its
        first ``n_action_steps`` are what LeRobot's ``predict_action_chunk`` returns)."""
        if mode != "policy":
            raise ValueError(
                f"model lerobot/{self.policy_type}: mode {mode!r} is not available; LeRobot's policies "
                "predict actions from observations (mode 'policy')"
            )
        if inputs:
            raise ValueError(f"model lerobot/{self.policy_type}: unexpected inputs {sorted(inputs)}")
        b = self.io.check_batch(batch)
        was_training = self.module.training
        self.module.eval()
        try:
            obs = self._observation(batch)
            if self.processors is not None:  # a LeRobot folder: its preprocessor normalises (from_folder)
                done = self.processors[0](obs)  # (it adds keys of its own: the policy's inputs are kept)
                obs = {k: done[k] for k in obs}
            obs = self._history(obs)
            if self.policy_type == "act":
                actions = self.module.predict_action_chunk(obs)
            else:
                actions = self._diffusion_sample(obs, row_seeds(seed, b))
            if self.processors is not None:
                actions = self.processors[1](actions)
        finally:
            self.module.train(was_training)
        return {"actions": actions.float().cpu().numpy().astype(np.float32)}

    def _diffusion_sample(self, obs: dict[str, torch.Tensor], seeds: list[int] | None) -> torch.Tensor:
        """The whole horizon by LeRobot's ``conditional_sample`` (see :meth:`predict`)."""
        from lerobot.utils.constants import OBS_IMAGES

        diffusion = self.module.diffusion
        obs = dict(obs)
        obs[OBS_IMAGES] = torch.stack([obs[k] for k in self.config.image_features], dim=-4)
        cond = diffusion._prepare_global_conditioning(obs)
        if seeds is None:
            return diffusion.conditional_sample(cond.shape[0], global_cond=cond)
        # row i: its initial noise from seeded_noise, its step noise (DDPM) from a CPU generator of its
        # own (diffusers' randn_tensor draws row i from generator i): the same numbers on every device,
        # whatever else shares the call
        (noise,) = seeded_noise(seeds, [(self.io.chunk, self.io.action_dim)], self.device)
        gens = [torch.Generator("cpu").manual_seed(int(s) + 1) for s in seeds]
        return diffusion.conditional_sample(len(seeds), global_cond=cond, generator=gens, noise=noise)

    def config_dict(self) -> dict[str, Any]:
        """The policy type, the options as given (checked), and the inputs: ``build`` rebuilds the same
        config from them (LeRobot's defaults are pinned by its version)."""
        if self.processors is not None:  # rebuilt from its folder (build's model.pretrained)
            return {"name": self.name, "preset": self.policy_type, "options": {}, "io": self.io.to_dict(),
                    "lerobot_folder": self.source}  # fmt: skip
        return {
            "name": self.name,
            "preset": self.policy_type,
            "options": {k: list(v) if isinstance(v, tuple) else v for k, v in self.options.items()},
            "io": self.io.to_dict(),
        }

    def flops_per_sample(self) -> float:
        """Training FLOPs of one sample, counted by torch's ``FlopCounterMode`` over a forward and a
        backward of a one-sample batch (torch's RNG state is left as it was)."""
        if self._flops is None:
            from torch.utils.flop_counter import FlopCounterMode

            io, dev = self.io, self.device
            batch = {
                OBS_STATE: torch.zeros(1, io.state_dim),
                ACTION: torch.zeros(1, io.chunk, io.action_dim),
                "task": [""],
                **{
                    image_key(c): torch.zeros(1, io.image_size, io.image_size, 3, dtype=torch.uint8)
                    for c in io.cameras
                },
            }
            was_training = self.module.training
            buffers = {k: v.detach().clone() for k, v in self.module.named_buffers()}  # BatchNorm's stats
            with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
                self.module.train()
                counter = FlopCounterMode(display=False)
                with counter:
                    loss = self.sft_loss(batch)["loss"]
                    params = [p for p in self.module.parameters() if p.requires_grad]
                    torch.autograd.grad(loss, params, allow_unused=True)
            self.module.train(was_training)
            with torch.no_grad():
                for k, v in self.module.named_buffers():
                    v.copy_(buffers[k])
            self._flops = float(counter.get_total_flops())
        return self._flops

    def export_extra(self, out_dir: Any, spec: Any = None) -> None:
        """``wamkit convert --to extra``: a LeRobot pretrained folder (config, weights and the
        processors that carry ``spec``'s normalisation), verified by LeRobot's loader."""
        from wamkit.models.lerobot.export import write_pretrained

        write_pretrained(self, spec, out_dir)
