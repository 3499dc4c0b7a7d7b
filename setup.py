"""Build script: the package list is found, not written by hand (pyproject.toml holds everything else).

The repository root is the package ``geir`` (``package-dir`` maps it to "."), so the packages under it are
found here and named under ``geir``: a new folder ships without editing any list.
``tests`` is not part of the package, nor is this script (``BuildPy``); setuptools runs it as ``__main__``,
so importing it (as ``geir.setup`` in an editable install) does nothing. ``pytest_geir.py``, the pytest plugin, sits
at the root too but ships as a top-level module of its own (``TOP_LEVEL``), not as ``geir.pytest_geir``: pytest
imports every installed plugin into every run, and anything under ``geir`` imports all of geir first.

An editable install (``pip install -e .``) is a path, not an import hook (``EditableWheel``): type checkers find
geir whatever the checkout's folder is called.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

from setuptools import find_namespace_packages, find_packages, setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel


def packages() -> list[str]:
    """Every folder with an ``__init__.py`` under the root, and the data folders inside them (the native C
    source), as packages of ``geir``."""
    found = find_packages(".", exclude=["tests", "tests.*"])
    data = find_namespace_packages(".", include=[f"{p}.*" for p in found], exclude=["*__pycache__*"])
    return ["geir"] + [f"geir.{name}" for name in sorted(set(found) | set(data))]


TOP_LEVEL = ["pytest_geir"]
"""Modules at the root that ship outside the geir package (the ``pytest11`` entry point names ``pytest_geir``)."""


class BuildPy(build_py):
    """build_py, leaving this script and the top-level modules out of the package whose folder they sit in."""

    def find_package_modules(self, package: str, package_dir: str) -> list[tuple[str, str, str]]:
        return [m for m in super().find_package_modules(package, package_dir)
                if not (m[0] == "geir" and m[1] in ("setup", *TOP_LEVEL))]


LINK_FOLDER = "__editable__.geir-path"
"""The folder under the checkout's ``build/`` whose one entry, ``geir``, is a link to the checkout."""


class PathEntry:
    """An editable strategy (setuptools' ``EditableStrategy`` protocol): the wheel holds setuptools' own
    (``default``, an import hook) and a ``.pth`` file naming ``folder``, in which ``geir`` links to the checkout.

    Python and type checkers read the ``.pth`` path (mypy does not run import hooks: with the hook alone it cannot
    find geir); the path comes first on ``sys.path``, so Python finds geir through it, and the hook, which
    setuptools appends after the path finders, is what finds geir only if the link is gone (``build/`` removed)."""

    def __init__(self, default: Any, folder: Path) -> None:
        self.default = default
        self.folder = folder

    def __call__(self, wheel: Any, files: list[str], mapping: dict[str, str]) -> None:
        self.default(wheel, files, mapping)
        wheel.writestr("__editable__.geir-path.pth", f"{self.folder}\n".encode())

    def __enter__(self) -> PathEntry:
        self.default.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.default.__exit__(*exc)


class EditableWheel(editable_wheel):
    """setuptools' editable wheel, plus a path entry for geir (``PathEntry``).

    The repository root is the package, so no folder on ``sys.path`` holds a ``geir`` unless the checkout's own
    folder is named so; setuptools therefore installs an import hook, which type checkers do not run. This adds
    ``build/__editable__.geir-path/geir``, a link to the checkout (new files are seen at once, as with the hook), and
    a ``.pth`` file naming its folder. An explicit ``editable_mode`` (strict, compat) is setuptools' alone; where a
    link cannot be made (Windows without the right), the hook alone, with a warning."""

    def _select_strategy(self, *args: Any, **kwargs: Any) -> Any:
        default = super()._select_strategy(*args, **kwargs)
        if self.mode:
            return default
        project = Path(self.project_dir).resolve()
        folder = project / "build" / LINK_FOLDER
        try:
            link_to(folder / "geir", project)
        except OSError as exc:
            warnings.warn(f"geir: no link {folder / 'geir'} -> {project} ({exc}); the editable install is an import "
                          "hook only, which type checkers (mypy) do not follow", stacklevel=1)
            return default
        return PathEntry(default, folder)


def link_to(link: Path, target: Path) -> None:
    """Make ``link`` a symbolic link to the folder ``target``, replacing whatever link was there (atomically)."""
    link.parent.mkdir(parents=True, exist_ok=True)
    if link.is_symlink() and os.readlink(link) == str(target):
        return
    temporary = link.with_name(f".{link.name}.{os.getpid()}")
    if temporary.is_symlink():
        temporary.unlink()
    os.symlink(target, temporary, target_is_directory=True)
    os.replace(temporary, link)


if __name__ == "__main__":
    setup(packages=packages(), py_modules=TOP_LEVEL, cmdclass={"build_py": BuildPy, "editable_wheel": EditableWheel})
