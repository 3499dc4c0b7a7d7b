"""A test's random cases follow from the test alone, not from what ran before it in the same process (the whole
suite, one file, or a pytest-xdist worker that got some other share of the tests): the same examples either way."""

from __future__ import annotations

import importlib
import sys

from hypothesis import given, settings
from hypothesis import strategies as st

UNUSUAL = """A = 777777
B = 123456789
C = 31415926
D = 0.7182818
E = "geir-unusual-constant"
"""


def _draws() -> list[tuple[int, float, str]]:
    """The examples a derandomised test (the suite's profile) draws, in order."""
    seen: list[tuple[int, float, str]] = []

    @settings(max_examples=300)
    @given(st.integers(0, 10**9), st.floats(0, 1), st.text(max_size=30))
    def record(i: int, f: float, s: str) -> None:
        seen.append((i, f, s))

    record()
    return seen


def test_hypothesis_draws_do_not_depend_on_the_modules_loaded_before(tmp_path, monkeypatch):
    """Hypothesis mixes in constants from the source of every local module loaded so far (tests/conftest.py turns
    that off): loading a module full of unusual constants must not change a single example."""
    before = _draws()
    (tmp_path / "geir_unusual_constants.py").write_text(UNUSUAL)   # a local module, as geir's own are
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("geir_unusual_constants")
    try:
        after = _draws()
    finally:
        del sys.modules[module.__name__]
    assert len(before) == 300 and after == before
    assert not any(i in (777777, 123456789, 31415926) or s == "geir-unusual-constant" for i, _, s in after)
