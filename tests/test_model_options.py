"""Every model's options are one dataclass checked by ``config.from_dict``: the same words for the same
mistake whichever model it is made on, and no stage probes an adapter for an attribute's name."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from wamkit.config import ConfigError, ModelConfig
from wamkit.models.registry import build_model

SRC = Path(__file__).resolve().parents[1] / "src" / "wamkit"


def _options_error(name: str, preset: str, options: dict) -> str:
    if name == "cosmos3":  # checked before anything is built, as a run's config check does
        from wamkit.models.cosmos3.presets import resolve_options

        with pytest.raises(ConfigError) as err:
            resolve_options(options)
        return str(err.value)
    with pytest.raises(ConfigError) as err:
        build_model(ModelConfig(name=name, preset=preset, options=options))
    return str(err.value)


@pytest.mark.parametrize(
    ("name", "preset", "typo", "meant", "number"),
    [
        ("tiny", "small", "widht", "width", "width"),
        ("cosmos3", "tiny", "attenton", "attention", "num_inference_steps"),
        ("delay", "small", "delay", "delay_ms", "host_calls"),
    ],
)
def test_each_model_refuses_a_bad_option_in_the_same_words(name, preset, typo, meant, number):
    err = _options_error(name, preset, {typo: 1})
    assert err.startswith(
        f"unknown key 'model.options.{typo}'; did you mean 'model.options.{meant}'? (valid here: "
    )
    assert _options_error(name, preset, {number: "many"}) == (
        f"model.options.{number}: expected an integer, got 'many'"
    )


def test_a_choice_is_refused_with_its_list():
    err = _options_error("cosmos3", "tiny", {"step_graph": "fast"})
    assert err == (
        "model.options.step_graph: 'fast' is not allowed; expected one of "
        "'auto', 'none', 'cuda_graph', 'compile', 'compile_layers'"
    )


def test_no_stage_probes_an_adapter_for_an_attribute():
    """What a stage uses of a model is the protocol or a named capability (models/base.py), checked
    with isinstance: never getattr/hasattr on an adapter."""
    probe = re.compile(r"\b(?:getattr|hasattr)\(\s*(?:self\.)?(?:adapter|ad|model_adapter)\b")
    found = [
        f"{p.relative_to(SRC)}:{i}"
        for p in SRC.rglob("*.py")
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if probe.search(line)
    ]
    assert not found, found


@pytest.mark.skipif(
    importlib.util.find_spec("lerobot") is not None, reason="LeRobot is installed in this Python"
)
def test_lerobot_in_a_python_without_it_says_how_to_get_it():
    """The project's venv has no LeRobot (it needs Python 3.12 and torch < 2.12): a run naming it is
    refused before anything is built or read, saying where it runs."""
    from wamkit.models.registry import check_model_config

    with pytest.raises(ConfigError) as err:
        check_model_config(ModelConfig(name="lerobot", preset="act"))
    assert "model.name=lerobot needs LeRobot 0.6.1 in this Python" in str(err.value)
    assert "make setup-lerobot" in str(err.value)
