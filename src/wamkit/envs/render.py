"""Offscreen camera rendering with an explicit quality setting, shared by the MuJoCo-based suites.

``default`` keeps the model's own look. ``fast`` turns off shadows, reflections and multisample
anti-aliasing (about 10x cheaper on a CPU rasteriser). The GL context is created lazily, on the first
render, so building an env in a parent process never creates one (a forked child of a process holding
a GL context hangs; workers are spawned instead).
"""

from __future__ import annotations

import mujoco
import numpy as np

from wamkit.envs.base import RENDER_QUALITIES


def current_gl_info() -> dict[str, str]:
    """Vendor, renderer and version strings of the GL context current in this thread (e.g. ``NVIDIA
    Corporation`` / ``NVIDIA H200/PCIe/SSE2``, or Mesa's ``llvmpipe``): which device drew the pixels."""
    from OpenGL import GL

    def text(name: int) -> str:
        raw = GL.glGetString(name)
        return raw.decode(errors="replace") if raw else "?"

    return {"vendor": text(GL.GL_VENDOR), "renderer": text(GL.GL_RENDERER), "version": text(GL.GL_VERSION)}


class CameraRenderer:
    """Renders named cameras of one MuJoCo model to uint8 [size, size, 3] upright images.

    A camera whose image-up axis points below the horizon (MetaWorld's ``corner`` cameras,
    robosuite's ``agentview``) renders upside down; ``rotate_180`` says which cameras to turn:
    ``"auto"`` decides per frame from the camera's orientation, a set names them explicitly.
    """

    def __init__(
        self,
        model: mujoco.MjModel,
        cameras: list[str],
        size: int,
        quality: str = "default",
        rotate_180: str | set[str] = "auto",
        aspect: float = 1.0,
    ) -> None:
        if quality not in RENDER_QUALITIES:
            raise ValueError(f"render quality: {quality!r} is not one of {RENDER_QUALITIES}")
        have = [mujoco.mj_id2name(model, mujoco.mjtObj.mjOBJ_CAMERA, i) for i in range(model.ncam)]
        unknown = [c for c in cameras if c not in have]
        if unknown:
            raise ValueError(f"env.cameras: unknown camera(s) {unknown}; this model has {have}")
        self.model, self.cameras, self.size, self.quality = model, list(cameras), size, quality
        self.rotate_180 = rotate_180
        # a camera framed wider than tall (aspect > 1) renders at that width and is squeezed to a square
        # by picking evenly spaced columns, so the image keeps the camera's whole field of view
        self.width = max(size, round(size * aspect))
        self._columns = (
            ((np.arange(size) + 0.5) * self.width / size).astype(np.int64) if self.width > size else None
        )
        self._renderer: mujoco.Renderer | None = None
        self.gl_info: dict[str, str] = {}  # filled on the first render

    def _open(self) -> mujoco.Renderer:
        if self.quality == "fast":
            self.model.vis.quality.offsamples = 0  # MSAA off; read when the GL context is made
        # the offscreen buffer must hold the image; models ship 640x480 by default
        self.model.vis.global_.offwidth = max(self.model.vis.global_.offwidth, self.width)
        self.model.vis.global_.offheight = max(self.model.vis.global_.offheight, self.size)
        r = mujoco.Renderer(self.model, self.size, self.width)  # makes its GL context current
        self.gl_info = current_gl_info()
        if self.quality == "fast":
            r.scene.flags[mujoco.mjtRndFlag.mjRND_SHADOW] = 0
            r.scene.flags[mujoco.mjtRndFlag.mjRND_REFLECTION] = 0
        return r

    def _upside_down(self, data: mujoco.MjData, camera: str) -> bool:
        if self.rotate_180 != "auto":
            return camera in self.rotate_180
        cam_id = mujoco.mj_name2id(self.model, mujoco.mjtObj.mjOBJ_CAMERA, camera)
        up_z = data.cam_xmat[cam_id].reshape(3, 3)[2, 1]  # world z of the camera's image-up axis
        return bool(up_z < 0)

    def render(self, data: mujoco.MjData) -> dict[str, np.ndarray]:
        """``{camera: uint8 [size, size, 3]}`` of the current state of ``data``."""
        if self._renderer is None:
            self._renderer = self._open()
        out = {}
        for cam in self.cameras:
            self._renderer.update_scene(data, camera=cam)
            img = self._renderer.render()
            if self._columns is not None:
                img = np.ascontiguousarray(img[:, self._columns])
            out[cam] = np.ascontiguousarray(img[::-1, ::-1]) if self._upside_down(data, cam) else img
        return out

    def close(self) -> None:
        if self._renderer is not None:
            self._renderer.close()
            self._renderer = None
