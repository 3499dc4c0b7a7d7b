"""The array protocol: what the runtime core asks of the arrays a runtime computes on, and of their library.

The interpreter core, the feed and output-buffer checks and the plumbing of the data rules are written
against ``Array`` and ``ArrayBackend``, never against an array library: each runtime hands the core its
backend, one object answering the few questions the core has (is this one of your arrays, its geir dtype,
does it share memory with another, copy it into a buffer, ...). NumPy arrays, PyTorch tensors (CPU and
CUDA) and CuPy arrays all have the three attributes ``Array`` asks for; everything else goes through the
backend. The NumPy backend is ``runtimes.numpy._arrays.NUMPY``; a backend for another library is one
small class of the same shape (see ``ArrayBackend``).

Data rules (a schema's ``validate``) read index values on the host: the core hands them the backend's
``host_view`` of a node's inputs, for the nodes that have a data rule only (a device backend copies
those few inputs to the host; the rest of the run never leaves the device).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Protocol, TypeVar, runtime_checkable

from ..ir._dtypes import DType

__all__ = ["Array", "ArrayBackend", "HostArray", "host_backend"]


@runtime_checkable
class Array(Protocol):
    """What the core reads of an array directly: ``numpy.ndarray``, ``torch.Tensor`` and ``cupy.ndarray`` have it.

    ``shape`` is compared with ``==`` to tuples of ints (``torch.Size`` is a tuple); ``dtype`` is only handed
    back to the backend (``dtype_of``, ``dtype_name``), never interpreted by the core.
    """

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def ndim(self) -> int: ...

    @property
    def dtype(self) -> Any: ...


HostArray = Any
"""A ``numpy.ndarray`` in host memory: what the graph holds (constants, input defaults) and what data rules
read (``schemas``' ``DataContext``). Spelled ``Any`` so that the core need not import NumPy to name it."""


A = TypeVar("A")
"""A backend's array type (``numpy.ndarray``, ``torch.Tensor``); an ``Array``."""


class ArrayBackend(Protocol[A]):
    """One array library as the runtime core sees it (``ArrayBackend[numpy.ndarray]``; the core holds an
    ``ArrayBackend[Any]``). Every method takes and returns the backend's arrays (``A``) unless it says otherwise;
    none of them may be slow on small arrays (each run asks a few per node)."""

    @property
    def name(self) -> str:
        """Short name; the key of the backend's kernels in ``runtimes._kernels`` ("numpy", "torch", "cupy")."""
        ...

    @property
    def array_type(self) -> type:
        """The exact type of a plain array of the library (``numpy.ndarray``, ``torch.Tensor``): a feed of exactly
        this type, dtype and shape is taken as it is, without ``as_array``."""
        ...

    @property
    def kind(self) -> str:
        """How an error names the arrays wanted: "a NumPy array", "a torch tensor on cuda:0"."""
        ...

    @property
    def empty_example(self) -> str:
        """How a caller makes a fitting output buffer, for the errors refusing one: "np.empty(shape, dtype)"."""
        ...

    def is_array(self, obj: object) -> bool:
        """Whether ``obj`` is an array of this backend as it stands (a caller's output buffer must be one)."""
        ...

    def as_array(self, feed: object, where: str) -> A:
        """The backend array of a value fed to a graph, converted where that is exact (a NumPy array or a
        PyTorch tensor's values, say); ``ExecutionError`` naming ``where`` otherwise. May return ``feed``."""
        ...

    def from_host(self, array: HostArray) -> A:
        """A graph constant or input default (a NumPy array) as a backend array, for reading only; the NumPy
        backend returns it as it is (no copy), a device backend copies it to the device."""
        ...

    def host_view(self, array: A, values: bool = True) -> HostArray:
        """``array`` as a NumPy array in host memory, for a data rule; never written. With ``values`` its values (a
        view where possible, else a copy); without, the rule reads only its shape and dtype: any host array of
        that shape and dtype will do (a device backend returns a zero-strided stand-in instead of copying)."""
        ...

    def dtype_of(self, array: A) -> DType | None:
        """The geir dtype of ``array``; None when it has none (float64, say)."""
        ...

    def dtype_name(self, array: A) -> str:
        """``array``'s dtype as an error names it ("float64")."""
        ...

    def may_share_memory(self, a: A, b: A | HostArray) -> bool:
        """Whether ``a`` and ``b`` may overlap in memory (False when they cannot: different devices); ``b`` may be
        a host NumPy array (a graph constant). A conservative True is allowed, a wrong False never."""
        ...

    def is_writeable_contiguous(self, array: A) -> bool:
        """Whether a kernel may write ``array`` as a dense C-ordered buffer (a caller's output buffer)."""
        ...

    def copy(self, array: A) -> A:
        """A new array of this backend with ``array``'s values (an output the run does not own)."""
        ...

    def copy_into(self, buffer: A, array: A) -> None:
        """Write ``array``'s values into ``buffer`` (same shape and dtype, both of this backend)."""
        ...

    def kernel_errstate(self) -> AbstractContextManager[Any]:
        """The context kernels run in: inf and NaN are IEEE results, as ONNX Runtime gives them, neither warnings
        nor errors (``numpy.errstate(all="ignore")``; a library that never warns: ``contextlib.nullcontext()``)."""
        ...


_host: ArrayBackend[Any] | None = None


def host_backend() -> ArrayBackend[Any]:
    """The NumPy backend: what the checks use when a caller names no backend (the ONNX Runtime session and the
    float64 reference hold NumPy arrays). Imported on first use: the core itself imports no array library."""
    global _host
    host = _host
    if host is None:
        from .numpy._arrays import NUMPY

        host = _host = NUMPY
    return host
