"""``wamkit bench NAME``: each benchmark is a module ``wamkit.bench.<name>`` (``-`` in NAME is ``_``)
with ``add_arguments(parser)`` and ``main(args)``."""

from __future__ import annotations

import argparse
import importlib

BENCHES = {
    "data": "dataset reader samples/s against bare PyAV decoding",
    "env": "simulator steps/s, 1 process and all cores",
    "model": "forward+backward samples/s and policy obs/s",
    "train": "training samples/s and MFU",
    "serve": "served obs/s and latency against in-process calls",
    "serve-start": "a server's start to its first answer at every warmed bucket, cold and from the compile cache",
    "eval": "evaluator env-steps/s: serial, lock-step, pipelined, against the bound",
    "realtime": "a policy's success and smoothness when the world does not wait: sync, async switch, RTC, ensembling",
    "gpu-sim": "ManiSkill3 env-steps/s simulated on the GPU (eval.executor=gpu) beside the process executor, at several env counts",
    "lerobot-eval": "one LeRobot checkpoint through lerobot-eval and wamkit eval: wall time, success, per-episode agreement",
    "soak": "a long evaluation: memory, descriptors and threads of every process, start against end",
    "cosmos3": "Cosmos3 policy inference, stock and fast paths side by side (obs/s, s/prediction, memory)",
    "cosmos3-sft": "Cosmos3 SFT samples/s and MFU: transformer alone, VAE on the fly, cached latents",
}


def add_arguments(parser: argparse.ArgumentParser, argv: list[str]) -> None:
    sub = parser.add_subparsers(dest="bench", metavar="BENCH", required=True)
    chosen = next((a for a in argv if a in BENCHES), None)
    for name, help_text in BENCHES.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            importlib.import_module(f"wamkit.bench.{name.replace('-', '_')}").add_arguments(p)


def main(args: argparse.Namespace) -> int:
    return int(importlib.import_module(f"wamkit.bench.{args.bench.replace('-', '_')}").main(args) or 0)
