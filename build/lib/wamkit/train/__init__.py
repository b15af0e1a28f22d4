"""Supervised fine-tuning on FSDP2 with exact resume: see :func:`wamkit.train.loop.train`."""

from wamkit.train.loop import NonFiniteLoss, train

__all__ = ["NonFiniteLoss", "train"]
