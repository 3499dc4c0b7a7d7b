"""The one registry: every kind of thing an op has hangs off (domain, op type), and nothing is registered twice."""

from __future__ import annotations

import pytest

import geir  # noqa: F401  (registers the families, their kernels, rules and rows)
from geir.ir._lowering import LOWERINGS, register_lowering
from geir.ir._registry import SCHEMAS, Rows, Slot, entry, register
from geir.runtimes._kernels import register_kernel
from geir.schemas import rotary, sparse_attention
from geir.schemas.patterns import PATTERNS
from geir.schemas.targets import KERNEL_TARGETS
from geir.schemas.vjp import VJP_RULES, register_vjp

ROPE = (rotary.FORWARD.domain, rotary.FORWARD.op_type)


def test_everything_an_op_has_is_found_from_its_key():
    found = entry(*ROPE)
    assert found["declarations"] is rotary.FORWARD
    assert set(found) >= {"declarations", "ONNX lowerings", "VJP rules", "CANN kernel targets",
                          "device restriction rows", "worked examples", "numpy kernels"}
    assert entry(sparse_attention.FORWARD.domain, "SparseFlashAttention")["VJP rewrites of the forward node"]
    assert all(key[0] == "ai.cann" for key in SCHEMAS) and ROPE in LOWERINGS and ROPE in KERNEL_TARGETS
    assert ("", "Add") in VJP_RULES                 # standard ops are keyed the same way, domain first
    assert PATTERNS.of("", "Add")                    # fusion patterns hang off the standard op they end in
    assert entry("ai.cann", "NoSuchOp") == {}


@pytest.mark.parametrize("register_again", [
    lambda: register(rotary.FORWARD),
    lambda: register_lowering(rotary.FORWARD)(lambda body, spec: None),
    lambda: register_vjp(rotary.FORWARD.op_type)(lambda ctx, node, grads: grads),
    lambda: register_kernel("numpy", *ROPE, lambda *a, **k: None),
], ids=["schema", "lowering", "vjp", "kernel"])
def test_registering_a_second_entry_for_an_op_is_an_error_naming_both(register_again):
    with pytest.raises(ValueError, match=r"op ai\.cann::InplacePartialRotaryMul has two .+: .+ and .+"):
        register_again()


def test_a_kind_is_declared_once():
    with pytest.raises(ValueError, match="already has a kind named 'VJP rules'"):
        Slot("VJP rules")
    with pytest.raises(ValueError, match="already has a kind named 'worked examples'"):
        Rows("worked examples")
