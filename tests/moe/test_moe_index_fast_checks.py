"""The common-path checks of MU-D1/MG-D1/MPG-D1 (``is_permutation``) and MP-D1 (one unsigned max) against plain
oracles, on the values where a shortcut would go wrong: negatives, the dtype's extremes, values at the bounds,
repeats, empty arrays, non-contiguous views, int32 and int64."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from geir.ir._errors import ExecutionError
from geir.ir._schema import DataContext
from geir.schemas.moe.schema import is_permutation
from geir.schemas.moe_permute.schema import FORWARD as PERMUTE, ID_LIMIT


@st.composite
def _index_arrays(draw):
    dtype = draw(st.sampled_from([np.int32, np.int64]))
    info = np.iinfo(dtype)
    m = draw(st.integers(0, 12))
    if draw(st.booleans()):
        values = list(np.random.default_rng(draw(st.integers(0, 2**32 - 1))).permutation(m))
        if m and draw(st.booleans()):       # one defect in a permutation
            values[draw(st.integers(0, m - 1))] = draw(st.sampled_from([-1, m, m - 1, 0, info.min, info.max]))
    else:
        values = draw(st.lists(st.one_of(st.integers(-2, m + 1), st.sampled_from([info.min, info.max])),
                               min_size=m, max_size=m))
    array = np.array(values, dtype)
    if draw(st.booleans()):                 # the same values as a strided view
        array = np.repeat(array, 2)[::2]
    return array


@settings(max_examples=500, deadline=None)
@given(_index_arrays())
def test_is_permutation_matches_sorting(indices: np.ndarray) -> None:
    assert is_permutation(indices) == np.array_equal(np.sort(indices), np.arange(indices.shape[0]))


def _permute_verdict(ids: np.ndarray) -> bool:
    arrays = [np.zeros((ids.shape[0], 2), np.float32), ids]
    try:
        PERMUTE.validate(DataContext(PERMUTE, "node", arrays, {}))
    except ExecutionError as exc:
        assert exc.rule == "MP-D1"
        return False
    return True


@settings(max_examples=300, deadline=None)
@given(st.sampled_from([np.int32, np.int64]).flatmap(
    lambda dtype: st.lists(st.one_of(st.integers(-3, 3), st.integers(ID_LIMIT - 2, ID_LIMIT + 2),
                                     st.sampled_from([np.iinfo(dtype).min, np.iinfo(dtype).max])),
                           min_size=0, max_size=8).map(lambda values: np.array(values, dtype))))
def test_expert_id_rule_matches_its_statement(ids: np.ndarray) -> None:
    info = np.iinfo(ids.dtype)
    allowed = all(0 <= v < ID_LIMIT or v in (info.min, info.max) for v in ids.tolist())
    assert _permute_verdict(ids[:, None]) == allowed


@pytest.mark.parametrize("values", [[0, 2, 1], [], [5], [0, 0], [1, -1 & 0xFFFFFFFF]])
def test_is_permutation_examples(values: list[int]) -> None:
    array = np.array(values, np.int64)
    assert is_permutation(array) == (sorted(values) == list(range(len(values))))
