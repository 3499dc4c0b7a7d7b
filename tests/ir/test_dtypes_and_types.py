from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from onnx import TensorProto

import geir
from geir import DType, SymbolTable, TensorType, as_dtype
from geir.ir._types import BroadcastError


@pytest.mark.parametrize("name, np_dtype, onnx_code", [
    ("float32", np.float32, TensorProto.FLOAT),
    ("float16", np.float16, TensorProto.FLOAT16),
    ("bfloat16", ml_dtypes.bfloat16, TensorProto.BFLOAT16),
    ("int32", np.int32, TensorProto.INT32),
    ("int64", np.int64, TensorProto.INT64),
    ("bool", np.bool_, TensorProto.BOOL),
])
def test_dtype_mappings_round_trip(name, np_dtype, onnx_code):
    d = as_dtype(name)
    assert d.value == name and str(d) == name
    assert d.numpy == np.dtype(np_dtype)
    assert d.onnx == onnx_code
    assert as_dtype(np.dtype(np_dtype)) is d
    assert as_dtype(np_dtype) is d
    assert as_dtype(onnx_code) is d
    assert as_dtype(d) is d


def test_public_dtype_constants():
    assert geir.bfloat16 is DType.BFLOAT16 and geir.float16.itemsize == 2 and geir.float32.is_floating
    assert not geir.int32.is_floating


@pytest.mark.parametrize("bad", ["float128", "fp16", np.longdouble, True, 999, None])
def test_unknown_dtype_lists_the_accepted_names(bad):
    with pytest.raises(TypeError, match="unsupported dtype.*float32, float16, bfloat16, int32, int64, bool"):
        as_dtype(bad)


def test_tensor_type_shape_validation_and_text():
    t = TensorType("float16", (2, "S", np.int64(8)))
    assert t.shape == (2, "S", 8) and t.rank == 3 and not t.is_static and str(t) == "float16[2,S,8]"
    assert TensorType(geir.float32, ()).is_static
    assert t == TensorType(DType.FLOAT16, [2, "S", 8])
    with pytest.raises(ValueError, match=r"expected 0 to 9223372036854775807 \(int64\), got -1"):
        TensorType("float32", (2, -1))
    with pytest.raises(TypeError, match="dim 1 .* expected an int or a symbol name, got 2.5"):
        TensorType("float32", (2, 2.5))
    with pytest.raises(TypeError, match="got True"):
        TensorType("float32", (True,))
    with pytest.raises(ValueError, match="not an identifier"):
        TensorType("float32", ("a b",))


def test_symbol_table_is_three_valued():
    s = SymbolTable()
    assert s.equal(3, 3) is True and s.equal(3, 4) is False
    assert s.equal("S", "S") is True and s.equal("S", "T") is False
    assert s.equal("S", 4) is None
    s.declare_equal("S", "T")
    s.declare_equal("T", "U")
    assert s.equal("S", "U") is True and s.canonical("U") == s.canonical("S")
    assert {"S", "T", "U"} in s.groups()
    copy = s.copy()
    copy.declare_equal("S", "V")
    assert s.equal("S", "V") is False and copy.equal("U", "V") is True


def test_broadcast_over_symbolic_dims():
    s = SymbolTable()
    assert s.broadcast((1, "S", 1, 4), ("B", "S", 8, 4)) == ("B", "S", 8, 4)
    assert s.broadcast((3,), (2, 1)) == (2, 3)
    assert s.broadcast(("S",), (5,)) == (5,)  # the symbol must be 5 at run time
    with pytest.raises(BroadcastError, match="dim 1: 3 and 4") as err:
        s.broadcast((2, 3), (2, 4))
    assert err.value.axis == 1
    with pytest.raises(BroadcastError, match="S and T"):
        s.broadcast(("S",), ("T",))
    s.declare_equal("S", "T")
    assert s.broadcast(("S",), ("T",)) in (("S",), ("T",))


def test_every_onnx_element_type_is_a_dtype_with_its_numpy_and_onnx_codes():
    """Issue 25: standard ops take every element type ONNX has (onnx's own table is the oracle)."""
    from onnx import TensorProto, helper

    for name, code in TensorProto.DataType.items():
        if code == TensorProto.UNDEFINED:
            continue
        dtype = as_dtype(code)
        assert dtype.onnx == code
        assert dtype.name == {"FLOAT": "FLOAT32", "DOUBLE": "FLOAT64"}.get(name, name)
        assert dtype.numpy == helper.tensor_dtype_to_np_dtype(code)
        assert as_dtype(dtype.value) is dtype and as_dtype(dtype.numpy) is dtype
    assert as_dtype(np.array(["ab"]).dtype) is DType.STRING and DType.STRING.numpy == np.dtype(object)
    assert DType.FLOAT64.is_floating and DType.FLOAT8E4M3FN.is_floating and not DType.INT4.is_floating
    assert not DType.COMPLEX64.is_floating and not DType.STRING.is_floating
