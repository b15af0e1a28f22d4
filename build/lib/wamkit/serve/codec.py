"""msgpack-numpy, the encoding of the OpenPI websocket protocol. No pickle, ever.

An array travels as ``{"__ndarray__": True, "data": <raw bytes, C order>, "dtype": dtype.str,
"shape": [...]}`` and a NumPy scalar as ``{"__npgeneric__": True, "data": item, "dtype": dtype.str}``.
The marker keys are written as msgpack *bin* (``b"__ndarray__"``), exactly as openpi-client does, and
both bin and str spellings are read. Object, void (structured) and complex dtypes are refused both
ways, as are datetimes; on decoding, a dtype, shape or byte count that does not add up raises
:class:`CodecError` naming the problem. Decoded arrays are read-only views of the message buffer.
"""

from __future__ import annotations

import math
from typing import Any

import msgpack
import numpy as np

ALLOWED_KINDS = "biufUS"  # bool, ints, floats, unicode and byte strings: nothing that can hide code
_ND, _NG = "__ndarray__", "__npgeneric__"


class CodecError(ValueError):
    """A message is not valid msgpack-numpy (or holds a type the protocol refuses)."""


def _check_dtype(dtype: np.dtype, where: str) -> None:
    if dtype.kind not in ALLOWED_KINDS or dtype.fields is not None or dtype.subdtype is not None:
        raise CodecError(
            f"{where}: dtype {dtype.str!r} is refused (allowed kinds: bool, int, uint, float, str)"
        )


def _encode(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        _check_dtype(obj.dtype, "array")
        return {b"__ndarray__": True, b"data": obj.tobytes(), b"dtype": obj.dtype.str, b"shape": obj.shape}
    if isinstance(obj, np.generic):
        _check_dtype(obj.dtype, "numpy scalar")
        return {b"__npgeneric__": True, b"data": obj.item(), b"dtype": obj.dtype.str}
    raise TypeError(f"cannot encode {type(obj).__name__} as msgpack-numpy")


def packb(obj: Any) -> bytes:
    """Encode a structure of dicts, lists, str, numbers, bytes and NumPy arrays/scalars."""
    try:
        return msgpack.packb(obj, default=_encode, use_bin_type=True)
    except CodecError:
        raise
    except (TypeError, ValueError, OverflowError) as err:
        raise CodecError(f"cannot encode: {err}") from None


def _get(d: dict, key: str) -> Any:
    if key in d:
        return d[key]
    b = key.encode()
    if b in d:
        return d[b]
    raise CodecError(f"encoded array lacks '{key}'")


def _dtype(raw: Any) -> np.dtype:
    if isinstance(raw, bytes):
        raw = raw.decode("ascii", "replace")
    if not isinstance(raw, str) or len(raw) > 16:
        raise CodecError(f"encoded array: 'dtype' must be a short dtype string like '<f4', got {raw!r}")
    try:
        dtype = np.dtype(raw)
    except (TypeError, ValueError):
        raise CodecError(f"encoded array: unknown dtype {raw!r}") from None
    _check_dtype(dtype, "encoded array")
    return dtype


def _decode(d: dict) -> Any:
    if d.get(_ND) is True or d.get(_ND.encode()) is True:
        data, shape, dtype = _get(d, "data"), _get(d, "shape"), _dtype(_get(d, "dtype"))
        if not isinstance(data, bytes):
            raise CodecError(f"encoded array: 'data' must be bytes, got {type(data).__name__}")
        if not isinstance(shape, list | tuple) or not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape
        ):
            raise CodecError(f"encoded array: 'shape' must be a list of non-negative integers, got {shape!r}")
        if len(shape) > 32:
            raise CodecError(f"encoded array: {len(shape)} dimensions (at most 32)")
        want = math.prod(shape) * dtype.itemsize
        if want != len(data):
            raise CodecError(
                f"encoded array: shape {list(shape)} of {dtype.str} needs {want} bytes, 'data' has {len(data)}"
            )
        return np.frombuffer(data, dtype=dtype).reshape(shape)
    if d.get(_NG) is True or d.get(_NG.encode()) is True:
        dtype, item = _dtype(_get(d, "dtype")), _get(d, "data")
        try:
            return dtype.type(item)
        except (TypeError, ValueError, OverflowError):
            raise CodecError(f"encoded scalar: {item!r} is not a {dtype.str}") from None
    return d


def unpackb(data: bytes | bytearray | memoryview) -> Any:
    """Decode one message; anything malformed raises :class:`CodecError` (never anything else)."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise CodecError(f"expected a binary msgpack message, got {type(data).__name__}")
    try:
        return msgpack.unpackb(data, object_hook=_decode, raw=False)
    except CodecError:
        raise
    except (ValueError, TypeError, msgpack.UnpackException, RecursionError, MemoryError) as err:
        # ExtraData, FormatError, StackError, invalid UTF-8, non-string map keys, ...
        raise CodecError(f"not a valid msgpack message ({type(err).__name__}: {err})") from None
