"""msgpack-numpy codec: byte-compatible with openpi-client's, refuses what could hide code or lie about sizes."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
from openpi_client import msgpack_numpy as openpi

from wamkit.serve.codec import CodecError, packb, unpackb


def _sample():
    rng = np.random.default_rng(0)
    return {
        "observation/image": rng.integers(0, 256, (8, 6, 3), dtype=np.uint8),
        "observation/state": rng.standard_normal(8),
        "flags": np.array([True, False]),
        "ints": np.arange(5, dtype=">i2"),  # big-endian survives
        "strided": np.arange(12.0, dtype=np.float32).reshape(3, 4)[:, ::2],  # non-contiguous
        "scalar": np.float32(2.5),
        "prompt": "pick up the bowl",
        "nested": {"list": [1, 2.0, "x", np.int64(7)], "empty": np.zeros((0, 3))},
    }


def _assert_same(a, b):
    assert type(a) is type(b) or (isinstance(a, np.generic) and isinstance(b, np.generic))
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same(x, y)
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a, b)
    else:
        assert a == b and getattr(a, "dtype", None) == getattr(b, "dtype", None)


@pytest.mark.parametrize("direction", ["ours->openpi", "openpi->ours", "ours->ours"])
def test_round_trip_with_openpi_client(direction):
    obj = _sample()
    pack, unpack = {
        "ours->openpi": (packb, openpi.unpackb),
        "openpi->ours": (openpi.packb, unpackb),
        "ours->ours": (packb, unpackb),
    }[direction]
    _assert_same(obj, unpack(pack(obj)))


def test_same_bytes_as_openpi():
    obj = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.int32(3), "c": "x"}
    assert packb(obj) == openpi.packb(obj)


@pytest.mark.parametrize(
    "bad", [np.array([1, "a"], dtype=object), np.zeros(2, dtype="V4"), np.zeros(2, np.complex64)]
)
def test_refuses_unsafe_dtypes_when_packing(bad):
    with pytest.raises(CodecError, match="refused"):
        packb({"x": bad})


def _raw(fields: dict) -> bytes:
    return msgpack.packb({"x": {b"__ndarray__": True, **fields}}, use_bin_type=True)


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({b"data": b"\0" * 8, b"dtype": "|O", b"shape": [1]}, "refused"),
        ({b"data": b"\0" * 8, b"dtype": "<c8", b"shape": [1]}, "refused"),
        ({b"data": b"\0" * 4, b"dtype": "|V4", b"shape": [1]}, "refused"),
        ({b"data": b"\0" * 8, b"dtype": "[('a', '<f4')]", b"shape": [1]}, "dtype"),
        ({b"data": b"\0" * 8, b"dtype": "<f4", b"shape": [3]}, "needs 12 bytes"),
        ({b"data": b"\0" * 8, b"dtype": "<f4", b"shape": [-2, -1]}, "non-negative"),
        ({b"data": b"\0" * 8, b"dtype": "nope", b"shape": [2]}, "unknown dtype"),
        ({b"data": "text", b"dtype": "<f4", b"shape": [1]}, "must be bytes"),
        ({b"dtype": "<f4", b"shape": [1]}, "lacks 'data'"),
    ],
)
def test_refuses_malformed_arrays(fields, needle):
    with pytest.raises(CodecError, match=needle):
        unpackb(_raw(fields))


def test_refuses_scalar_of_object_dtype():
    msg = msgpack.packb({"x": {b"__npgeneric__": True, b"data": 1, b"dtype": "|O"}}, use_bin_type=True)
    with pytest.raises(CodecError, match="refused"):
        unpackb(msg)


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xc1",
        b"\x93\x01",
        packb({"a": 1}) + b"junk",
        msgpack.packb({1: 2}),
        b"\xdd\xff\xff\xff\xff",
        "text",
    ],
)
def test_garbage_raises_codec_error_only(data):
    with pytest.raises(CodecError):
        unpackb(data)


def test_decoded_arrays_are_read_only_views():
    arr = unpackb(packb({"a": np.arange(4.0)}))["a"]
    assert not arr.flags.writeable
