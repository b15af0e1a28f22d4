"""Thousands of malformed messages among valid ones: each bad one gets a text frame naming the problem and
close 1011, clients that vanish are shrugged off, and every valid reply (checked against an in-process
call) is still right."""

from __future__ import annotations

import asyncio
import re
import socket
import urllib.request

import msgpack
import numpy as np
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from wamkit.serve.client import AsyncPolicyClient
from wamkit.serve.codec import packb
from wamkit.serve.loading import random_init
from wamkit.serve.server import start_server_in_thread

N_MALFORMED = 2000
LIMIT_MB = 0.5


IMAGES = np.random.default_rng(0).integers(0, 256, (8, 128, 128, 3), dtype=np.uint8)


def valid(i: int) -> dict:
    return {
        "observation.images.corner": IMAGES[i % len(IMAGES)],
        "observation.state": np.random.default_rng(i).standard_normal(39).astype(np.float32),
        "prompt": f"task {i}",
    }


def _array(fields: dict) -> dict:
    return {b"__ndarray__": True, **fields}


def malformed(i: int) -> tuple[str, bytes | str, str]:
    """(kind, message, regex the error text must match), cycling through every kind of bad input."""
    rng = np.random.default_rng(10_000 + i)
    good = valid(i)
    raw = lambda obj: msgpack.packb(obj, use_bin_type=True)  # noqa: E731
    kinds = [
        ("garbage", bytes([0xC1]) + rng.bytes(int(rng.integers(0, 64))), "not a valid msgpack message"),
        ("text frame", "hello", "expected a binary msgpack frame"),
        ("not a map", raw([1, 2, 3]), "must be a map"),
        ("truncated", packb(good)[: int(rng.integers(1, 1000))], "not a valid msgpack message"),
        (
            "unknown key",
            packb({**good, "observation.images.top": good["observation.images.corner"]}),
            "unknown key",
        ),
        (
            "missing state",
            packb({k: v for k, v in good.items() if k != "observation.state"}),
            "lacks observation.state",
        ),
        (
            "state shape",
            packb({**good, "observation.state": np.zeros(int(rng.integers(1, 38)))}),
            r"expected shape \[39\]",
        ),
        (
            "image dtype",
            packb({**good, "observation.images.corner": np.zeros((128, 128, 3), np.float32)}),
            "dtype uint8",
        ),
        (
            "image rank",
            packb({**good, "observation.images.corner": np.zeros((128, 128), np.uint8)}),
            r"\[H, W, 3\]",
        ),
        ("prompt type", packb({**good, "prompt": 5}), "prompt: expected a string"),
        (
            "batch prompt",
            packb({**good, "observation.state": np.zeros((2, 39)), "prompt": ["a"]}),
            "list of 2 strings",
        ),
        (
            "object array",
            raw({"observation.state": _array({b"data": b"\0" * 8, b"dtype": "|O", b"shape": [1]})}),
            "refused",
        ),
        ("complex", raw({"x": _array({b"data": b"\0" * 8, b"dtype": "<c8", b"shape": [1]})}), "refused"),
        (
            "size lie",
            raw({"x": _array({b"data": b"\0" * 8, b"dtype": "<f4", b"shape": [10**6, 10**6]})}),
            "needs",
        ),
        ("deep nesting", b"\x91" * 5000 + b"\x01", "not a valid msgpack message"),
        ("int keys", raw({1: 2}), "not a valid msgpack message"),
        (
            "oversized",
            packb({**good, "pad": np.zeros(int(LIMIT_MB * 2**20) + 10, np.uint8)}),
            "exceeds serve.max_message_mb",
        ),
        ("nan state", packb({**good, "observation.state": np.full(39, np.inf, np.float32)}), "non-finite"),
        ("bad mode", packb({**good, "mode": ["policy"]}), "mode"),
        ("bad seed", packb({**good, "seed": "zero"}), "seed: expected an integer"),
        ("seed list for one row", packb({**good, "seed": [1, 2]}), "seed: expected an integer, got"),
    ]
    return kinds[i % len(kinds)]


# a reply or a close the server owes: far longer than it takes, so that a missing one is a failure
# rather than a wait without end (a connection left open answers pings, so recv alone never returns)
RECV_S = 60.0


async def recv(ws):
    return await asyncio.wait_for(ws.recv(), RECV_S)


@pytest.fixture(scope="module")
def policy():
    return random_init("delay", "small", {"delay_ms": 1}, device="cpu")


def test_malformed_flood_never_hurts_valid_clients(policy):
    with start_server_in_thread(policy, max_message_mb=LIMIT_MB, max_wait_ms=1.0) as srv:
        expected = {i: policy.infer(valid(i))["actions"] for i in range(40)}

        async def good_client(c: int, stop: asyncio.Event) -> int:
            n = 0
            async with AsyncPolicyClient(srv.url) as cl:
                while not stop.is_set() or n < 5:
                    i = (c * 7 + n) % len(expected)
                    reply = await cl.infer(valid(i))
                    np.testing.assert_allclose(reply["actions"], expected[i], atol=1e-6)
                    n += 1
                    await asyncio.sleep(0.005)  # interleave with the flood without hogging the CPU
            return n

        async def attacker(indices: range) -> list[str]:
            failures = []
            for i in indices:
                kind, message, needle = malformed(i)
                async with connect(srv.url, max_size=None, compression=None) as ws:
                    await recv(ws)  # metadata
                    await ws.send(message)
                    text = await recv(ws)
                    if not isinstance(text, str) or not re.search(needle, text):
                        failures.append(f"{kind}: got {text!r:.200}")
                    try:
                        failures.append(f"{kind}: another frame after the error: {await recv(ws)!r:.200}")
                    except TimeoutError:
                        failures.append(f"{kind}: connection stayed open for {RECV_S:g} s")
                    except ConnectionClosed:
                        if ws.close_code != 1011:
                            failures.append(f"{kind}: close code {ws.close_code}")
            return failures

        async def vanisher(n: int) -> None:
            for i in range(n):  # send a valid request and leave before the reply
                ws = await connect(srv.url, max_size=None, compression=None)
                await recv(ws)
                await ws.send(packb(valid(i)))
                ws.transport.abort()
            for _ in range(n):  # not even a websocket: raw bytes on the port
                _, writer = await asyncio.open_connection("127.0.0.1", srv.port)
                writer.write(b"\x16\x03\x01garbage\r\n\r\n")
                writer.close()

        async def run():
            stop = asyncio.Event()
            goods = [asyncio.create_task(good_client(c, stop)) for c in range(4)]
            step = N_MALFORMED // 8
            attacks = await asyncio.gather(
                *(attacker(range(k * step, (k + 1) * step)) for k in range(8)), vanisher(100)
            )
            stop.set()
            return [f for part in attacks[:-1] for f in part], await asyncio.gather(*goods)

        failures, good_counts = asyncio.run(run())
        assert not failures, failures[:10]
        assert sum(good_counts) >= 20
        assert srv.metrics.errors["decode"] + srv.metrics.errors["request"] == 8 * (N_MALFORMED // 8)
        assert urllib.request.urlopen(f"http://127.0.0.1:{srv.port}/healthz").status == 200

        async def after():  # far beyond the limit, websockets itself refuses the frame (1009)
            async with connect(srv.url, max_size=None, compression=None) as ws:
                await recv(ws)
                await ws.send(b"\0" * (2 * int(LIMIT_MB * 2**20) + 2**20 + 1))
                with pytest.raises(ConnectionClosed):
                    await recv(ws)
                return ws.close_code

        assert asyncio.run(after()) == 1009
        with socket.create_connection(("127.0.0.1", srv.port)):
            pass
        np.testing.assert_allclose(policy.infer(valid(3))["actions"], expected[3])
