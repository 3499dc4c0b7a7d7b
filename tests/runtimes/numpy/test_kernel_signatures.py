"""A NumPy kernel's signature is its schema's: checked when the kernel registers."""

from __future__ import annotations

import pytest

import geir.runtimes.numpy as numpy_runtime
from geir.runtimes.numpy._kernels import kernel
from geir.ir._registry import all_schemas
from geir.schemas import rotary, sparse_attention


def test_every_registered_kernel_matches_its_declaration():
    assert set(numpy_runtime.KERNELS) == {(s.domain, s.op_type) for s in all_schemas()}


@pytest.mark.parametrize("source, message", [
    ("def k(x, cos, sin, *, rotary_mode=0, out=None): ...", r"no keyword 'partial_slice'"),
    ("def k(x, cos, sin, *, rotary_mode=1, partial_slice=(0, 0), out=None): ...",
     r"'rotary_mode' defaults to 1, the declaration to 0"),
    ("def k(x, cos, sin, *, rotary_mode=0, partial_slice=(0, 0), out=None, scale=1): ...",
     r"keyword 'scale' is not an attribute of the schema"),
    ("def k(x, sin, cos, *, rotary_mode=0, partial_slice=(0, 0), out=None): ...",
     r"inputs \['x', 'sin', 'cos'\], expected \['x', 'cos', 'sin'\]"),
    ("def k(x, cos, sin, *, rotary_mode=0, partial_slice=(0, 0)): ...", r"no keyword 'out'"),
])
def test_a_kernel_that_disagrees_with_its_schema_is_refused_at_registration(source, message):
    namespace: dict = {}
    exec(source, namespace)
    with pytest.raises(TypeError, match=r"NumPy kernel k of InplacePartialRotaryMul: .*" + message):
        kernel(rotary.FORWARD)(namespace["k"])
    assert numpy_runtime.KERNELS[(rotary.FORWARD.domain, rotary.FORWARD.op_type)].__name__ == "rotary_mul"


def test_a_required_attribute_has_no_default_in_its_kernel():
    def k(query, key, value, sparse_indices, block_table=None, actual_seq_lengths_query=None,
          actual_seq_lengths_kv=None, query_rope=None, key_rope=None, sinks=None, *, scale_value=1.0,
          sparse_block_size=1, layout_query="BSND", layout_kv="BSND", sparse_mode=3, pre_tokens=2**63 - 1,
          next_tokens=2**63 - 1, attention_mode=0, return_softmax_lse=False): ...

    with pytest.raises(TypeError, match=r"'scale_value' defaults to 1.0, the declaration to none \(required\)"):
        kernel(sparse_attention.FORWARD)(k)
