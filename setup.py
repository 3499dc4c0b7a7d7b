"""Build script: the package list is found, not written by hand (pyproject.toml holds everything else).

The repository root is the package ``geir`` (``package-dir`` maps it to "."), so the packages under it are
found here and named under ``geir``: a new folder ships without editing any list.
``tests`` is not part of the package, nor is this script (``BuildPy``); setuptools runs it as ``__main__``,
so importing it (as ``geir.setup`` in an editable install) does nothing.
"""

from __future__ import annotations

from setuptools import find_namespace_packages, find_packages, setup
from setuptools.command.build_py import build_py


def packages() -> list[str]:
    """Every folder with an ``__init__.py`` under the root, and the data folders inside them (the native C
    source), as packages of ``geir``."""
    found = find_packages(".", exclude=["tests", "tests.*"])
    data = find_namespace_packages(".", include=[f"{p}.*" for p in found], exclude=["*__pycache__*"])
    return ["geir"] + [f"geir.{name}" for name in sorted(set(found) | set(data))]


class BuildPy(build_py):
    """build_py, leaving this script out of the package whose folder it sits in."""

    def find_package_modules(self, package: str, package_dir: str) -> list[tuple[str, str, str]]:
        return [m for m in super().find_package_modules(package, package_dir) if m[:2] != ("geir", "setup")]


if __name__ == "__main__":
    setup(packages=packages(), cmdclass={"build_py": BuildPy})
