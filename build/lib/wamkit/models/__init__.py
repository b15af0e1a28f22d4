"""Model adapters behind one protocol, built by name from a lazy registry."""

from wamkit.models.base import ModelAdapter, ModelIO, ParamGroup
from wamkit.models.registry import build_model, register_model, registered_models

__all__ = ["ModelAdapter", "ModelIO", "ParamGroup", "build_model", "register_model", "registered_models"]
