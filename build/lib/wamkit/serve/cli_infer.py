"""``wamkit infer -i "samples/*.json" -o OUT --model ...``: the command line of
:mod:`wamkit.serve.infer` (one sub-folder of outputs per sample file; invalid files are listed, the
others still run)."""

from __future__ import annotations

import argparse
import glob
from pathlib import Path

from wamkit.serve.cli_serve import add_model_arguments, build_policy, resolve_config
from wamkit.serve.infer import run_sample
from wamkit.serve.samples import SampleError, resolve_sample


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-i", "--input", required=True, help='sample files, a glob in quotes: "samples/*.json"'
    )
    parser.add_argument("-o", "--output", required=True, help="output folder (one sub-folder per sample)")
    add_model_arguments(parser)


def main(args: argparse.Namespace) -> int:
    files = sorted(Path(p) for p in glob.glob(args.input))
    if not files:
        print(f"wamkit infer: no files match {args.input!r}")
        return 2
    cfg = resolve_config(args)
    policy = build_policy(args, cfg)
    # a compiled step (Cosmos3 on CUDA) comes from the compile cache when a start before made it, and
    # what this run compiles is kept for the next (docs/serve.md, "Warm start")
    cache = policy.compile_cache(cfg.serve.compile_cache)
    if cache is not None:
        cache.load()
    out, failed, done, names = Path(args.output), [], 0, {}
    for path in files:
        try:
            sample = resolve_sample(path, policy)
            if sample["name"] in names:
                raise SampleError(
                    f"{path}: field 'name': {sample['name']!r} is already used by {names[sample['name']]}"
                )
            names[sample["name"]] = path
            run_sample(policy, sample, out / sample["name"])
            done += 1
            if sample["unused"]:
                print(f"  {path.name}: fields recorded but not used: {', '.join(sample['unused'])}")
        except SampleError as err:
            failed.append(str(err))
    if cache is not None and done:
        cache.save()
    print(f"wamkit infer: {done} sample(s) written to {out}, {len(failed)} invalid")
    for line in failed:
        print(f"  invalid: {line}")
    return 1 if failed else 0
