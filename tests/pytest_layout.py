"""A pytest plugin (loaded with -p from pyproject): the repository root is the geir package, not a
test package, so pytest must not import its __init__.py as one (it would, under a second name)."""

from __future__ import annotations

import pytest


@pytest.hookimpl(tryfirst=True)
def pytest_collect_directory(path, parent):
    if path == parent.config.rootpath:
        return pytest.Dir.from_parent(parent, path=path)
    return None
