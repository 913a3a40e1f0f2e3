"""The config argument of the training CLIs: a YAML path, or the name of a config shipped with k3jax.

The example configs (``configs/*.yaml`` in the repository) are installed with the package beside
``k3jax/train``, so in both layouts they sit in the ``configs`` folder next to this package's folder.
``tiny``, ``tiny.yaml`` and ``configs/tiny.yaml`` (from a directory without that file) all name
the shipped ``tiny.yaml``; an existing path always wins.
"""
from __future__ import annotations

import pathlib

from k3jax.config import ConfigError

PACKAGED_CONFIGS = pathlib.Path(__file__).resolve().parent.parent / "configs"


def packaged_config_names() -> list[str]:
    """The shipped configs' names (file names without ``.yaml``), sorted."""
    return sorted(path.stem for path in PACKAGED_CONFIGS.glob("*.yaml"))


def resolve_config(argument: str) -> pathlib.Path:
    """``argument`` when that file exists, else the shipped config of that name (``.yaml`` optional)."""
    path = pathlib.Path(argument).expanduser()
    if path.is_file():
        return path
    name = path.name[:-len(".yaml")] if path.name.endswith(".yaml") else path.name
    if name in packaged_config_names():
        return PACKAGED_CONFIGS / f"{name}.yaml"
    raise ConfigError("", f"config {argument!r}: no such file, and not a packaged config "
                          f"(packaged: {', '.join(packaged_config_names()) or 'none'})")
