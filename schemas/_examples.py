"""Worked examples of the contract as data: one node of a schema on named inputs, with the expected
outputs. Each family declares its own (``schemas/<family>/examples.py``); ``geir demo`` and the tests
consume them instead of keeping their own lists."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from ..ir._registry import Rows
from ..ir._schema import OpSchema

__all__ = ["BenchCase", "Example", "all_examples", "register_examples"]


@dataclass(frozen=True)
class Example:
    """Inputs and outputs by their GE IR names. Floating inputs are given in float64 with values exact
    in every dtype of ``dtypes`` and are cast to the dtype of the run; integer inputs keep theirs.
    ``dtype_overrides[dtype]`` gives inputs that take another dtype in that run (a float32 probs
    beside bfloat16 tokens, say). ``warning`` names a contract warning the example triggers on purpose."""

    name: str
    schema: OpSchema
    inputs: Mapping[str, np.ndarray]
    attributes: Mapping[str, Any]
    expected: Mapping[str, np.ndarray]
    dtypes: tuple[str, ...] = ("float32",)
    dtype_overrides: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    warning: str | None = None

    def input_dtype(self, name: str, dtype: str) -> str:
        """The dtype input ``name`` takes in a run of ``dtype``."""
        array = self.inputs[name]
        if array.dtype.kind != "f":
            return str(array.dtype)
        return self.dtype_overrides.get(dtype, {}).get(name, dtype)


EXAMPLES: Rows[Example] = Rows("worked examples")


def register_examples(*examples: Example) -> None:
    for example in examples:
        EXAMPLES.add(example.schema.domain, example.schema.op_type, example)


def all_examples(schema: OpSchema | None = None) -> list[Example]:
    """Every registered example (of ``schema`` only, when given), in registration order."""
    return EXAMPLES.all() if schema is None else EXAMPLES.of(schema.domain, schema.op_type)


class BenchCase(Protocol):
    """What ``geir bench`` measures of a family that has no suite of its own: the family's ``examples.BENCH``
    maps "bench" and "quick" to tuples of cases, each one node of ``op`` (its type) on random ``arrays()`` (the
    inputs by their GE IR names) with ``attributes()``; ``label`` is the table's case column."""

    @property
    def op(self) -> str: ...
    @property
    def label(self) -> str: ...
    def arrays(self) -> dict[str, np.ndarray]: ...
    def attributes(self) -> dict[str, Any]: ...
