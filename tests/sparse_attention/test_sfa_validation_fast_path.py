"""SA-D3's whole-array check (``_uniform_ids_clean``) against the per-row check it shortcuts.

When no lengths are given, every query row of a BSND call may name the same block ids, so validation first asks
whether the whole ``sparse_indices`` array is clean and skips the per-row selection when it is. That shortcut may
only ever say "clean" where the per-row path passes; it may say "not proven" more often (then the per-row path
decides and names the offender). Hypothesis draws near-valid arrays (ids around the edges, padding in and out of
place, repeats) and both answers are compared, with the forward's and the grad's attributes.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from geir.ir._errors import ExecutionError
from geir.ir._schema import DataContext
from geir.schemas import sparse_attention
from geir.schemas.sparse_attention import validation


def _context(schema, indices: np.ndarray, seq_kv: int, mode: int, block: int) -> DataContext:
    b, s1, n2, _ = indices.shape
    shapes = {"query": (b, s1, n2, 4), "key": (b, seq_kv, n2, 4), "value": (b, seq_kv, n2, 4),
              "d_out": (b, s1, n2, 4), "out": (b, s1, n2, 4), "softmax_max": (b, n2, s1, 1),
              "softmax_sum": (b, n2, s1, 1)}
    arrays = [indices if spec.name == "sparse_indices"
              else np.zeros(shapes[spec.name], np.float16) if spec.name in shapes else None
              for spec in schema.inputs]
    layout = {"layout": "BSND"} if schema is sparse_attention.GRAD else {"layout_query": "BSND", "layout_kv": "BSND"}
    return DataContext(schema, "node", arrays, {**layout, "sparse_mode": mode, "sparse_block_size": block})


def _passes(ctx: DataContext) -> bool:
    try:
        validation.validate(ctx)
    except ExecutionError as exc:
        assert exc.rule == "SA-D3", exc
        return False
    return True


@st.composite
def _cases(draw):
    b, s1, n2 = draw(st.integers(1, 2)), draw(st.integers(1, 4)), draw(st.integers(1, 2))
    seq_kv, block, k = draw(st.integers(0, 9)), draw(st.integers(1, 4)), draw(st.integers(0, 5))
    blocks = -(-seq_kv // block)
    values = st.one_of(st.integers(-1, max(blocks, 0)), st.sampled_from([-2, -1, -1, blocks, 2**31 - 1, -2**31]))
    flat = draw(st.lists(values, min_size=b * s1 * n2 * k, max_size=b * s1 * n2 * k))
    indices = np.array(flat, np.int32).reshape(b, s1, n2, k)
    if draw(st.booleans()):     # mostly valid rows: distinct ids, padding at the end, then maybe one defect
        rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
        for row in np.ndindex(b, s1, n2):
            valid = rng.permutation(max(blocks, 0))[:k]
            indices[row] = np.concatenate([valid, -np.ones(k - valid.size, np.int32)])[:k]
    return indices, seq_kv, draw(st.sampled_from([0, 3])), block, draw(st.sampled_from(["forward", "grad"]))


@settings(max_examples=400, deadline=None)
@given(_cases())
def test_the_whole_array_check_never_passes_what_the_rows_refuse(case) -> None:
    indices, seq_kv, mode, block, which = case
    schema = sparse_attention.GRAD if which == "grad" else sparse_attention.FORWARD
    seq_q = indices.shape[1]
    fast = validation._uniform_ids_clean(indices, seq_q, seq_kv, mode, block)
    with pytest.MonkeyPatch.context() as patch:     # the per-row path alone: the oracle
        patch.setattr(validation, "_uniform_ids_clean", lambda *args: False)
        per_row = _passes(_context(schema, indices, seq_kv, mode, block))
    assert _passes(_context(schema, indices, seq_kv, mode, block)) == per_row   # same verdict through validate
    if fast:
        assert per_row, (indices.tolist(), seq_kv, mode, block)
    elif per_row and seq_kv > 0 and (mode == 0 or seq_kv >= seq_q):
        pytest.fail(f"a clean array whose every row reads was not recognised: {indices.tolist()}, S2={seq_kv}, "
                    f"mode {mode}, block {block}")


@pytest.mark.parametrize("value, fact", [(2**31 - 1, "block id in [0, 2)"), (-2**31, "block id in [0, 2)"),
                                         (-2, "block id in [0, 2)")])
def test_extreme_ids_still_name_the_entry(value: int, fact: str) -> None:
    indices = np.array([[[[0, value]]]], np.int32)
    ctx = _context(sparse_attention.FORWARD, indices, 2, 0, 1)
    with pytest.raises(ExecutionError) as err:
        validation.validate(ctx)
    assert err.value.rule == "SA-D3" and "row (b=0, s1=0, n2=0) entry 1" in str(err.value) and fact in str(err.value)
