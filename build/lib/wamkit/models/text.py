"""An offline byte-level tokenizer: task text -> fixed-length id tensors, no vocabulary files.

Ids are the UTF-8 bytes shifted by one (1..256); 0 is padding. Texts longer than ``length`` bytes are
cut (the leading bytes carry the task name). Fixed length keeps every batch the same shape, so the
model needs no attention mask and the padding positions are ordinary, learned tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

PAD_ID = 0
VOCAB_SIZE = 257  # 256 byte values + padding


def encode_texts(texts: Sequence[str], length: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``texts`` (B strings) -> int64 ids [B, length]; byte b becomes id b + 1, padding is ``PAD_ID``."""
    if length < 1:
        raise ValueError(f"text length must be >= 1, got {length}")
    ids = torch.full((len(texts), length), PAD_ID, dtype=torch.long)
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise ValueError(f"task text {i}: expected a string, got {type(text).__name__}")
        data = text.encode("utf-8")[:length]
        if data:
            ids[i, : len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).long() + 1
    return ids.to(device)


def decode_ids(ids: torch.Tensor) -> list[str]:
    """The inverse of :func:`encode_texts` (up to truncation): int ids [B, L] -> B strings."""
    out = []
    for row in ids.tolist():
        out.append(bytes(i - 1 for i in row if i != PAD_ID).decode("utf-8", errors="replace"))
    return out
