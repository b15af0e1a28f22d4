"""Image transforms shared by the training dataset and the server: one kernel, one dtype path.

Frames are uint8, channels last (``[..., H, W, 3]``, as stored and as sent on the wire). Resizing is
square (``size x size``; the aspect ratio is not kept) and runs on uint8 in and out through torch's
uint8 kernel, so training and serving give bit-identical model inputs for the same frame.

Resize methods (the preprocessing spec records which one a model was trained with):

- ``bilinear_antialias``: bilinear with antialiasing, ``align_corners=False`` (PIL's and torchvision's
  default for downscaling).
- ``nearest``: nearest neighbour (labels, masks).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

RESIZE_METHODS = {
    "bilinear_antialias": {"mode": "bilinear", "antialias": True, "align_corners": False},
    "nearest": {"mode": "nearest"},
}
DEFAULT_RESIZE = "bilinear_antialias"


def check_resize_method(method: str) -> None:
    if method not in RESIZE_METHODS:
        raise ValueError(f"resize method {method!r} is unknown; expected one of {', '.join(RESIZE_METHODS)}")


def resize_images(img, size: int, method: str = DEFAULT_RESIZE):
    """uint8 ``[..., H, W, 3]`` (NumPy or torch) -> uint8 ``[..., size, size, 3]`` of the same kind.

    Returned unchanged (not copied) when it already has the size.
    """
    check_resize_method(method)
    if tuple(img.shape[-3:-1]) == (size, size):
        return img
    is_np = isinstance(img, np.ndarray)
    x = torch.from_numpy(np.array(img)) if is_np else img  # a copy: wire arrays are read-only
    if x.dtype != torch.uint8:
        raise ValueError(f"resize_images: expected uint8 frames, got {x.dtype}")
    lead = x.shape[:-3]
    x = x.reshape(-1, *x.shape[-3:]).permute(0, 3, 1, 2)
    y = F.interpolate(x, size=(size, size), **RESIZE_METHODS[method])
    y = y.permute(0, 2, 3, 1).reshape(*lead, size, size, 3).contiguous()
    return y.numpy() if is_np else y
