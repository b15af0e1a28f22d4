"""``wamkit convert-dataset SRC DST [--to v3.0|v2.1]``: LeRobot v2.1 <-> v3.0, video streams copied,
resumable, verified frame by frame (see :mod:`wamkit.data.convert_dataset`)."""

from __future__ import annotations

import argparse
import sys

from wamkit.data.convert_dataset import DATA_MB, VIDEO_MB, convert_dataset
from wamkit.data.meta import V21, VERSIONS, DatasetError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", help="a LeRobot v2.1 or v3.0 dataset folder")
    parser.add_argument("dst", help="the new dataset folder (must not exist; DST.tmp holds the work)")
    parser.add_argument(
        "--to", choices=VERSIONS, default=None, help="target version (default: the other one)"
    )
    parser.add_argument("--data-mb", type=float, default=DATA_MB,
                        help=f"v3 data file size limit in MB (default: {DATA_MB})")  # fmt: skip
    parser.add_argument("--video-mb", type=float, default=VIDEO_MB,
                        help=f"v3 video file size limit in MB (default: {VIDEO_MB})")  # fmt: skip


def main(args: argparse.Namespace) -> int:
    try:
        report = convert_dataset(args.src, args.dst, args.to, args.data_mb, args.video_mb)
    except (DatasetError, OSError) as err:
        print(f"wamkit convert-dataset: {err}", file=sys.stderr)
        return 1
    check = report["verify"]
    print(
        f"wrote {args.dst}: {report['from']} -> {report['to']}, {report['episodes']} episodes, {report['frames']} frames"
    )
    print(f"  videos: {report['copied_videos']} stream-copied, {report['reencoded_videos']} re-encoded"
          + ("" if report["to"] == V21 else " (joined into v3 files)"))  # fmt: skip
    print(f"  verified frame by frame: states, actions, indices, tasks identical; "
          f"{check['identical_camera_frames']} camera frames identical")  # fmt: skip
    if check["reencoded_camera_frames"]:
        print(f"  re-encoded camera frames: {check['reencoded_camera_frames']}, PSNR min "
              f"{check['psnr_min_db']:.1f} dB, mean {check['psnr_mean_db']:.1f} dB")  # fmt: skip
    return 0
