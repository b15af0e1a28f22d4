# Source on the GPU machine, in the checkout's root: installs the carried wheels (maintainers/gpu_carry.sh)
# into /tmp/site, unpacks the GL loaders when carried, and puts src/ first on PYTHONPATH.
#   source maintainers/gpu_env.sh
for d in .whl/*/; do
  [ -d "$d" ] && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$d"*.whl
done
if [ -d .gl ]; then
  for f in .gl/*.deb; do dpkg -x "$f" /; done
  ldconfig
  export MUJOCO_GL=egl PYOPENGL_PLATFORM=egl
fi
export PYTHONPATH="$PWD/src:/tmp/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 -c "import wamkit, torch; print('wamkit', wamkit.__version__, 'torch', torch.__version__, 'cuda', torch.cuda.is_available())"
