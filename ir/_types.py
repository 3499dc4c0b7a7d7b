"""Tensor types with symbolic dimensions, declared dimension equalities and broadcasting."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ._dtypes import DType, DTypeLike, as_dtype
from ._errors import GraphError

__all__ = ["BroadcastError", "Dim", "SymbolTable", "TensorType", "UnknownRankError", "as_shape", "refine",
           "refine_all"]

INT64_MAX = 2**63 - 1

Dim = int | str
"""A dimension: a non-negative int, or a symbol (a non-empty str) whose value is bound at run time."""


def as_shape(shape: Iterable[object]) -> tuple[Dim, ...]:
    """Validate a shape given as a sequence of ints and symbol names (a str is one symbol, not a shape)."""
    if isinstance(shape, (str, bytes)):
        raise TypeError(f"shape {shape!r}: expected a sequence of dims (ints or symbol names), got a string; "
                        f"write ({shape!r},) for one symbolic dim")
    dims: list[Dim] = []
    for k, d in enumerate(shape):
        if isinstance(d, bool) or not isinstance(d, (int, str)) and not hasattr(d, "__index__"):
            raise TypeError(f"dim {k} of shape {tuple(shape)!r}: expected an int or a symbol name, got {d!r}")
        if isinstance(d, str):
            if not d.isidentifier():
                raise ValueError(f"dim {k}: symbol {d!r} is not an identifier")
            dims.append(d)
            continue
        d = int(d)
        if not 0 <= d <= INT64_MAX:
            raise ValueError(f"dim {k} of shape {tuple(shape)!r}: expected 0 to {INT64_MAX} (int64), got {d}")
        dims.append(d)
    return tuple(dims)


KINDS = ("tensor", "sequence", "optional", "optional_sequence")
"""What a value may hold: a tensor; a sequence of tensors, an optional tensor, an optional sequence (ONNX's
sequence and optional types, of standard ops only)."""


class UnknownRankError(GraphError):
    """A shape was asked of a type whose rank is unknown (``TensorType.has_rank`` is False): the graph asks
    something of a value that only its data can answer."""


@dataclass(frozen=True, slots=True)
class TensorType:
    """The static type of a value: element dtype and shape (ints and symbols).

    The shape may be unknown altogether (``shape=None``): a standard ONNX op whose output rank depends on data
    (Unsqueeze or Reshape of fed values, say) has one until it runs. Such a type answers ``has_rank`` False, and
    asking for its ``shape`` or ``rank`` raises UnknownRankError, so code that needs a shape never reads a wrong
    one; ``dims`` is the shape or None.

    ``kind`` says what the value holds: a tensor, or (standard ops only) a sequence of tensors, an optional
    tensor or an optional sequence, of element type ``dtype``; those have no shape (``has_rank`` is False)."""

    dtype: DType
    dims: tuple[Dim, ...] | None
    kind: str

    def __init__(self, dtype: DTypeLike, shape: Iterable[object] | None, kind: str = "tensor") -> None:
        if kind not in KINDS:
            raise ValueError(f"tensor type kind {kind!r}: expected one of {', '.join(KINDS)}")
        object.__setattr__(self, "dtype", as_dtype(dtype))
        object.__setattr__(self, "dims", None if shape is None or kind != "tensor" else as_shape(shape))
        object.__setattr__(self, "kind", kind)

    @property
    def shape(self) -> tuple[Dim, ...]:
        if self.kind != "tensor":
            raise UnknownRankError(f"a value of type {self} has no shape; only standard ops take such values")
        if self.dims is None:
            raise UnknownRankError(f"a {self.dtype} value of unknown rank has no shape until it runs (ONNX infers "
                                   f"its rank from data); geir's ops and passes need it")
        return self.dims

    @property
    def is_tensor(self) -> bool:
        """A tensor (not a sequence or an optional value)."""
        return self.kind == "tensor"

    @property
    def has_rank(self) -> bool:
        return self.dims is not None

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def is_static(self) -> bool:
        """True when every dimension is a concrete int (never for an unknown rank)."""
        return self.dims is not None and all(isinstance(d, int) for d in self.dims)

    def with_shape(self, shape: Iterable[object] | None) -> TensorType:
        return TensorType(self.dtype, shape, self.kind)

    def with_dtype(self, dtype: DTypeLike) -> TensorType:
        return TensorType(dtype, self.dims, self.kind)

    def __str__(self) -> str:
        if self.kind != "tensor":
            return {"sequence": "seq({})", "optional": "optional({})", "optional_sequence": "optional(seq({}))"}[
                self.kind].format(self.dtype)
        if self.dims is None:
            return f"{self.dtype}[?]"
        return f"{self.dtype}[{','.join(str(d) for d in self.dims)}]"


def refine(inferred: TensorType, declared: TensorType | None) -> TensorType:
    """``inferred`` with the gaps a file's declared type fills: an unknown rank becomes the declared shape, a symbolic
    dim the declared size or symbol. Where the two disagree (dtype, rank or a known size), the inferred type stands:
    it follows from the op's definition, while a file's value_info is only its writer's claim. What a declared size
    claims is checked on the fed shapes when the graph runs (the rules run again on them)."""
    if declared is None or declared.dims is None or declared.dtype is not inferred.dtype or not inferred.is_tensor:
        return inferred
    if inferred.dims is None:
        return declared
    if len(inferred.dims) != len(declared.dims):
        return inferred
    dims = tuple(d if isinstance(d, int) else claimed for d, claimed in zip(inferred.dims, declared.dims))
    return inferred if dims == inferred.dims else TensorType(inferred.dtype, dims)


def refine_all(inferred: Sequence[TensorType | None], declared: Sequence[TensorType | None] | None
               ) -> tuple[TensorType | None, ...]:
    """``refine`` per output (an absent output stays absent)."""
    if declared is None:
        return tuple(inferred)
    return tuple(t if t is None or k >= len(declared) else refine(t, declared[k]) for k, t in enumerate(inferred))


class BroadcastError(ValueError):
    """Two dimensions that must broadcast do not; ``axis`` counts from the left of the result."""

    def __init__(self, axis: int, left: Dim, right: Dim) -> None:
        self.axis, self.left, self.right = axis, left, right
        super().__init__(f"dim {axis}: {left} and {right} do not broadcast")


class SymbolTable:
    """Symbols declared equal (a union-find); the basis of every dimension comparison.

    Comparisons are three-valued: True (provably equal), False (provably different: two
    different ints, or two symbols never declared equal) and None (an int against a symbol:
    undecidable until the symbol is bound at run time).
    """

    def __init__(self) -> None:
        self._parent: dict[str, str] = {}

    def declare_equal(self, a: str, b: str) -> None:
        ra, rb = self.canonical(a), self.canonical(b)
        if ra != rb:
            self._parent[max(ra, rb)] = min(ra, rb)

    def canonical(self, symbol: str) -> str:
        while symbol in self._parent:
            symbol = self._parent[symbol]
        return symbol

    def groups(self) -> list[set[str]]:
        """The declared equivalence classes with more than one symbol."""
        classes: dict[str, set[str]] = {}
        for s in self._parent:
            classes.setdefault(self.canonical(s), {self.canonical(s)}).add(s)
        return list(classes.values())

    def copy(self) -> SymbolTable:
        other = SymbolTable()
        other._parent = dict(self._parent)
        return other

    def equal(self, a: Dim, b: Dim) -> bool | None:
        if isinstance(a, int) and isinstance(b, int):
            return a == b
        if isinstance(a, str) and isinstance(b, str):
            return self.canonical(a) == self.canonical(b)
        return None

    def broadcast(self, left: Sequence[Dim], right: Sequence[Dim]) -> tuple[Dim, ...]:
        """NumPy broadcasting over symbolic shapes (right-aligned).

        ``1`` against anything gives the other dim; an int against a symbol gives the int
        (the symbol must take that value at run time); a mismatch raises BroadcastError.
        """
        rank = max(len(left), len(right))
        lpad = (1,) * (rank - len(left)) + tuple(left)
        rpad = (1,) * (rank - len(right)) + tuple(right)
        out: list[Dim] = []
        for axis, (x, y) in enumerate(zip(lpad, rpad)):
            if x == 1:
                out.append(y)
            elif y == 1:
                out.append(x)
            else:
                same = self.equal(x, y)
                if same is False:
                    raise BroadcastError(axis, x, y)
                out.append(y if isinstance(y, int) else x)
        return tuple(out)
