"""Which version of a Python distribution is installed: what a run records about the software it ran on
(the simulator stack, the compile cache's key). Imports only the standard library, so every stage may
use it."""

from __future__ import annotations


def installed_versions(names, paths: list[str] | None = None) -> dict[str, str | None]:
    """The installed version of each distribution in ``names`` (None: not installed); ``paths``: more
    folders to look in, after ``sys.path``."""
    from importlib import metadata

    out: dict[str, str | None] = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found = next(iter(metadata.distributions(name=name, path=paths)), None) if paths else None
            out[name] = found.version if found is not None else None
    return out
