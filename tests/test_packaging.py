"""A non-editable install carries every package of the source tree (the image installs that way)."""

import os
import tomllib

from setuptools import find_packages

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_package_is_installed():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        include = tomllib.load(f)["tool"]["setuptools"]["packages"]["find"]["include"]
    installed = set(find_packages(ROOT, include=include))
    on_disk = {
        os.path.relpath(d, ROOT).replace(os.sep, ".")
        for top in ("server", "shard_engine", "loaders")
        for d, _, files in os.walk(os.path.join(ROOT, top)) if "__init__.py" in files
    }
    assert on_disk <= installed, f"not installed: {sorted(on_disk - installed)}"
    assert not {p for p in installed if p.startswith("tests")}
