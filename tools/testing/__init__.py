"""``geir.testing``: what CANN's operator tests check, as a library.

``assert_close`` applies CANN's precision standards by their names; ``reference`` computes the
float64 golden of any graph; ``run_all_runtimes`` runs every runtime and asserts they agree. The
pytest plugin (``pytest_geir``, a top-level module registered through ``pytest11``, so that loading it imports
no geir) adds the ``geir_runtime`` parameter and the ``--geir-runtime`` option.
"""

from __future__ import annotations

from ._compare import STANDARDS, assert_close, precision_standard
from ._reference import reference
from ._runtimes import run_all_runtimes

__all__ = ["STANDARDS", "assert_close", "precision_standard", "reference", "run_all_runtimes"]
