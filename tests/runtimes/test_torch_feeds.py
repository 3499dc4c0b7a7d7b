"""PyTorch tensors as feeds: converted where the meaning is exact, refused naming the feed otherwise (issue 23,
item 20: sparse, meta and negative-bit tensors raised torch's own exceptions)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import geir

torch = pytest.importorskip("torch")

RUNTIMES = ("numpy", "onnxruntime")


def _plus_one() -> geir.Graph:
    b = geir.GraphBuilder("plus_one")
    x = b.input("x", "float32", (2, 3))
    b.output(b.op("Add", x, b.constant("one", np.ones((2, 3), np.float32))), "y")
    return b.build()


def _values() -> torch.Tensor:
    return torch.arange(6, dtype=torch.float32).reshape(2, 3) - 2.5


def _quiet(make):
    """``make()`` without torch's UserWarnings (CSR "in beta state", quantized tensors "deprecated")."""
    def made() -> torch.Tensor:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return make()
    return made


REFUSED = [
    (lambda: _values().to_sparse(), "a torch tensor of layout torch.sparse_coo is not a dense array; convert it with "
                                    r"\.to_dense\(\) first"),
    (_quiet(lambda: _values().to_sparse_csr()), "a torch tensor of layout torch.sparse_csr is not a dense array"),
    (lambda: torch.empty((2, 3), device="meta"), "a torch tensor on the meta device has no data to run on"),
    (_quiet(lambda: torch.quantize_per_tensor(_values(), 0.5, 0, torch.qint8)),
     r"cannot be read as an array \(a torch tensor of dtype torch\.qint8: "),
]


@pytest.mark.parametrize("runtime", RUNTIMES)
@pytest.mark.parametrize("make, message", REFUSED, ids=["sparse_coo", "sparse_csr", "meta", "quantized"])
def test_tensors_without_plain_data_are_refused_naming_the_feed(runtime, make, message):
    with pytest.raises(geir.ExecutionError, match=f"graph 'plus_one': input 'x': {message}"):
        geir.run(_plus_one(), {"x": make()}, runtime=runtime)


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_a_negative_view_is_fed_as_the_values_it_means(runtime):
    values = _values()
    negative = torch._neg_view(values)
    assert negative.is_neg()
    got = geir.run(_plus_one(), {"x": negative}, runtime=runtime)["y"]
    np.testing.assert_array_equal(got, 1 - values.numpy())
    assert not values.is_neg() and torch.equal(values, _values())      # the caller's tensor is not touched
