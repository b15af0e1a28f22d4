"""Preprocessing as a pipeline of registered steps: the files written before (format 1, kept as
fixtures with their outputs) load and give identical outputs; a new step is a class and a registry
line, run unchanged by the data stage and by the server; bad step lists are refused by name."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest
import torch

from wamkit.actions import steps as steps_mod
from wamkit.actions.spec import FORMAT, PreprocessSpec, SpecError
from wamkit.actions.steps import IMAGES, Step, register_step
from wamkit.config import DataConfig
from wamkit.constants import OBS_STATE, image_key
from wamkit.data import LeRobotDataset, compute_stats, make_train_dataset
from wamkit.data.synthetic import write_pattern_dataset
from wamkit.models.base import ModelIO
from wamkit.serve.policy import ServedPolicy

FIXTURES = Path(__file__).parent / "fixtures" / "preprocess"
NAMES = sorted(p.name.removesuffix(".preprocess.json") for p in FIXTURES.glob("*.preprocess.json"))


def _outputs(spec: PreprocessSpec, x) -> dict[str, np.ndarray]:
    return {
        "encode_state": spec.encode_state(x["in_state"]),
        "encode_actions": spec.encode_actions(x["in_stored"]),
        "decode_actions": spec.decode_actions(x["in_model"]),
        "decode_unnormalized": spec.decode_actions(x["in_model"], normalized=False),
        "env_to_stored": spec.env_to_stored(x["in_env"]),
        "resize_images": spec.resize_images(x["in_images"]),
    }


def test_the_fixtures_cover_every_step_and_are_format_1():
    assert len(NAMES) == 6
    kinds = set()
    for name in NAMES:
        data = json.loads((FIXTURES / f"{name}.preprocess.json").read_text())
        assert data["format"] == "wamkit-preprocess/1" and "steps" not in data
        kinds |= {(data["normalization"], data["clip"], data["gripper"], data["resize"])}
    assert {k[0] for k in kinds} == {"quantile", "min_max", "mean_std", "none"}
    assert {k[2] for k in kinds} == {"env", "open_1", "close_1"} and {k[1] for k in kinds} == {True, False}


@pytest.mark.numerics
@pytest.mark.parametrize("name", NAMES)
def test_a_format_1_file_loads_and_gives_identical_outputs(name, tmp_path):
    """The same float64 operations in the same order as format 1's fixed code, so bit-equal: affine
    maps, sign mappings and clips are exact IEEE arithmetic on every CPU; the rot6d conversion's
    sin/cos/arctan2 may differ by one float64 ulp where NumPy dispatches them to other SIMD code, which
    the float32 outputs round away (passes with NPY_DISABLE_CPU_FEATURES="AVX2 FMA3 AVX512F AVX512_SKX"
    and under ATEN_CPU_CAPABILITY=default, which changes the uint8 resize kernel)."""
    spec = PreprocessSpec.load(FIXTURES / f"{name}.preprocess.json")
    want = np.load(FIXTURES / f"{name}.expected.npz")
    for key, got in _outputs(spec, want).items():
        assert got.dtype == want[key].dtype, key
        np.testing.assert_array_equal(got, want[key], err_msg=f"{name}: {key}")
    summary = json.loads((FIXTURES / f"{name}.summary.json").read_text())
    now = spec.summary()
    assert [s["step"] for s in now.pop("steps")][:2] == ["gripper", "representation"]
    assert now == summary  # metadata, plans and the served identity read the same fields and hash

    # written again, it is format 2 (steps listed), and reads back to the same transforms
    again = PreprocessSpec.load(spec.save(tmp_path))
    assert json.loads((tmp_path / "preprocess.json").read_text())["format"] == FORMAT == "wamkit-preprocess/2"
    assert again == spec and again.stats_hash() == spec.stats_hash()
    for key, got in _outputs(again, want).items():
        np.testing.assert_array_equal(got, want[key], err_msg=f"{name} (format 2): {key}")


@register_step
@dataclass(frozen=True)
class _Invert(Step):
    """A transform wamkit does not have: frames inverted (255 - x), as a user would add one."""

    name: ClassVar[str] = "test_invert"
    features: ClassVar[tuple[str, ...]] = (IMAGES,)
    feature: str = IMAGES

    def forward(self, x):
        return 255 - x

    @classmethod
    def build(cls, params, stats, where):
        return cls()


IO = ModelIO(cameras=("image", "wrist_image"), image_size=24, state_dim=8, action_dim=7, chunk=4)


def test_a_registered_step_runs_unchanged_in_the_data_stage_and_the_server(tmp_path):
    root = tmp_path / "data"
    write_pattern_dataset(root, [10, 8], size=(64, 48))
    base = PreprocessSpec.create(compute_stats(root, "raw", chunk=4), normalization="mean_std", clip=False,
                                 image_size=24, resize="bilinear_antialias", cameras=IO.cameras, chunk=4)  # fmt: skip
    listed = base.to_json()
    listed["steps"].append({"step": "test_invert"})  # after the resize
    (tmp_path / "preprocess.json").write_text(json.dumps(listed))
    spec = PreprocessSpec.load(tmp_path)
    assert [s.params()["step"] for s in spec.steps][-2:] == ["resize", "test_invert"]

    item = make_train_dataset(DataConfig(root=str(root), chunk=4), spec)[3]
    plain = make_train_dataset(DataConfig(root=str(root), chunk=4), base)[3]
    raw = LeRobotDataset(root)[3]

    class _NoModel:
        name, io, supports_rtc, module = "none", IO, False, torch.nn.Module()

    request = {image_key(c): raw[image_key(c)].numpy() for c in IO.cameras}
    served = ServedPolicy(_NoModel(), spec).prepare(
        {**request, OBS_STATE: raw[OBS_STATE].numpy(), "prompt": "x"}
    )
    for cam in IO.cameras:
        got = item[image_key(cam)].numpy()
        np.testing.assert_array_equal(got, 255 - plain[image_key(cam)].numpy())  # the step ran in training
        np.testing.assert_array_equal(served.batch[image_key(cam)][0], got)  # and the same in serving


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda s: s.append({"step": "sharpen"}), "steps[5]: unknown step 'sharpen'; registered: gripper, "),
        (lambda s: s.append({"kind": "quantile"}), "steps[5]: expected an object with a 'step' name"),
        (lambda s: s[2].pop("kind"), "steps[2] (normalize): missing 'kind'"),
        (lambda s: s[2].update(kind="zscore"), "steps[2] (normalize): kind 'zscore' is not one of quantile"),
        (
            lambda s: s[2].update(feature="images"),
            "steps[2] (normalize): feature 'images'; step 'normalize' acts on",
        ),
        (lambda s: s[4].update(size="big"), "steps[4] (resize): 'size' is 'big', expected int"),
        (lambda s: s[4].update(sharpness=2), "steps[4] (resize): unknown key(s) sharpness"),
        (
            lambda s: s.append({"step": "representation", "name": "raw"}),
            "expected one 'representation' step, found 2",
        ),
        (
            lambda s: s.insert(2, s.pop(0)),
            "the gripper mapping (between env commands and stored actions) must come before",
        ),
        (lambda s: s.clear(), "'steps' must be a non-empty list"),
    ],
)
def test_a_bad_step_list_is_refused_naming_the_file_and_the_entry(tmp_path, edit, message):
    data = PreprocessSpec.load(FIXTURES / "libero_rot6d_quantile.preprocess.json").to_json()
    assert [s["step"] for s in data["steps"]] == [
        "gripper",
        "representation",
        "normalize",
        "normalize",
        "resize",
    ]
    edit(data["steps"])
    path = tmp_path / "preprocess.json"
    path.write_text(json.dumps(data))
    with pytest.raises(SpecError) as err:
        PreprocessSpec.load(path)
    assert str(path) in str(err.value) and message in str(err.value), str(err.value)


def test_every_registered_step_can_be_listed():
    assert {"gripper", "representation", "normalize", "clip", "resize"} <= set(steps_mod.step_names())
