"""Checkpoint conversions: DCP checkpoint -> serving directory (-> adapter formats), and back to DCP."""

from wamkit.export.checkpoint import (
    ConversionError,
    checkpoint_to_serving,
    load_checkpoint_weights,
    serving_to_dcp,
    serving_to_extra,
)

__all__ = [
    "ConversionError",
    "checkpoint_to_serving",
    "load_checkpoint_weights",
    "serving_to_dcp",
    "serving_to_extra",
]
