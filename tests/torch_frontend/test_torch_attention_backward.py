"""geir.torch's sparse attention backward for the forms SparseFlashAttentionGrad has no direct call for (issue 28):
sinks with their gradient, BSND with actual_seq_lengths, paged KV (PA_BSND, a page named twice). Each is checked
by gradcheck in float64 and against a float64 PyTorch reference of the forward written here from spec 4.5/4.6/4.11
(float16/bfloat16 within the ops' tolerances); the forms still refused raise with their reason."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import geir.torch as gt  # noqa: E402
from geir.tools.torch import attention_backward  # noqa: E402

NAMES = ("query", "key", "value", "query_rope", "key_rope", "sinks")


def _select(row: np.ndarray, thr: int, bs: int) -> list[int]:
    """Spec 4.5's ``select``, literally: the key positions one row of block ids reads below ``thr``."""
    if thr <= 0:
        return []
    pos: list[int] = []
    for i in range(min(row.size, -(-thr // bs))):
        if row[i] == -1:
            break
        beg = int(row[i]) * bs
        if beg < thr:
            pos += range(beg, min(beg + bs, thr))
    return pos


@dataclass
class Problem:
    """One forward's non-differentiable arguments and the rows its batches hold.

    ``kv_base[b]`` is batch b's first row among the reference's dense keys: BSND ``b * S2``, TND the cumulative
    start, paged ``b * max_blocks * page`` (the reference gathers the pages into (B, max_blocks * page) keys)."""

    layout: str
    paged: bool
    S1: int
    q_rows: int
    kv_rows: int
    N1: int
    N2: int
    K: int
    bs: int
    mode: int
    q_len: list[int]          # per batch
    kv_len: list[int]         # per batch
    q_base: list[int]
    kv_base: list[int]
    lengths_q: torch.Tensor | None
    lengths_kv: torch.Tensor | None
    table: torch.Tensor | None = None
    page: int = 0
    scale: float = float(np.float32(0.4))
    indices: torch.Tensor = field(default=None)  # type: ignore[assignment]

    def rows(self):
        """(query row, batch, s1, S1b, S2b) of every query row inside a batch."""
        for b, (s1b, s2b) in enumerate(zip(self.q_len, self.kv_len)):
            for s1 in range(s1b):
                yield self.q_base[b] + s1, b, s1, s1b, s2b

    def threshold(self, s1: int, s1b: int, s2b: int) -> int:
        return s2b if self.mode == 0 else s2b - s1b + s1 + 1

    def draw_indices(self, rng: np.random.Generator) -> None:
        """Random valid block ids: each read row lists 0..K distinct ids of its batch (future blocks included),
        -1 padded; rows never read keep garbage."""
        flat = np.full((self.q_rows, self.N2, self.K), 10**6, np.int32)
        for q, _, s1, s1b, s2b in self.rows():
            blocks = -(-s2b // self.bs)
            for n2 in range(self.N2):
                if self.threshold(s1, s1b, s2b) <= 0 or blocks == 0:
                    continue
                count = int(rng.integers(0, min(self.K, blocks) + 1))
                flat[q, n2] = -1
                flat[q, n2, :count] = rng.choice(blocks, count, replace=False)
        shape = (len(self.q_len), self.S1) if self.layout == "BSND" else (self.q_rows,)
        self.indices = torch.from_numpy(flat.reshape(shape + (self.N2, self.K)))

    def mask(self) -> torch.Tensor:
        """(query rows, N2, dense key rows): which keys each row and KV head sees."""
        flat = self.indices.reshape(self.q_rows, self.N2, self.K).numpy()
        visible = np.zeros((self.q_rows, self.N2, self.kv_rows), bool)
        for q, b, s1, s1b, s2b in self.rows():
            for n2 in range(self.N2):
                pos = _select(flat[q, n2], self.threshold(s1, s1b, s2b), self.bs)
                visible[q, n2, [self.kv_base[b] + j for j in pos]] = True
        return torch.from_numpy(visible)


def _bsnd(B, S1, S2, q_len, kv_len, **kw) -> Problem:
    lq = None if q_len is None else torch.tensor(q_len, dtype=torch.int32)
    lkv = None if kv_len is None else torch.tensor(kv_len, dtype=torch.int32)
    return Problem("BSND", False, S1, B * S1, B * S2, q_len=q_len or [S1] * B, kv_len=kv_len or [S2] * B,
                   q_base=[b * S1 for b in range(B)], kv_base=[b * S2 for b in range(B)], lengths_q=lq,
                   lengths_kv=lkv, **kw)


def _tnd(aq: list[int], akv: list[int], **kw) -> Problem:
    q0, k0 = [0] + aq[:-1], [0] + akv[:-1]
    return Problem("TND", False, 0, aq[-1] + 1, akv[-1] + 2, q_len=[e - s for s, e in zip(q0, aq)],
                   kv_len=[e - s for s, e in zip(k0, akv)], q_base=q0, kv_base=k0,
                   lengths_q=torch.tensor(aq, dtype=torch.int32), lengths_kv=torch.tensor(akv, dtype=torch.int32), **kw)


def _paged(layout: str, table: list[list[int]], page: int, kv_len: list[int], S1: int = 0, q_len=None,
           aq: list[int] | None = None, **kw) -> Problem:
    cap = len(table[0]) * page
    base = _bsnd(len(table), S1, cap, q_len, kv_len, **kw) if layout == "BSND" else _tnd(aq, list(np.cumsum(kv_len)),
                                                                                          **kw)
    base.paged, base.table, base.page = True, torch.tensor(table, dtype=torch.int32), page
    base.kv_len, base.kv_base, base.kv_rows = kv_len, [b * cap for b in range(len(table))], len(table) * cap
    base.lengths_kv = torch.tensor(kv_len, dtype=torch.int32)
    return base


def _inputs(p: Problem, dtype: torch.dtype, D: int, D2: int, Dr: int, sinks: bool, seed: int,
            block_num: int = 0) -> dict[str, torch.Tensor | None]:
    gen = torch.Generator().manual_seed(seed)
    q_lead = (len(p.q_len), p.S1) if p.layout == "BSND" else (p.q_rows,)
    kv_lead = (block_num, p.page) if p.paged else ((len(p.kv_len), p.kv_rows // len(p.kv_len)) if
                                                   p.layout == "BSND" else (p.kv_rows,))

    def normal(*shape: int, dt: torch.dtype = dtype) -> torch.Tensor:
        return torch.randn(shape, generator=gen, dtype=torch.float64).to(dt)

    return {"query": normal(*q_lead, p.N1, D), "key": normal(*kv_lead, p.N2, D), "value": normal(*kv_lead, p.N2, D2),
            "query_rope": normal(*q_lead, p.N1, Dr) if Dr else None,
            "key_rope": normal(*kv_lead, p.N2, Dr) if Dr else None,
            "sinks": normal(p.N1, dt=torch.float64 if dtype == torch.float64 else torch.float32) if sinks else None}


def _geir(p: Problem, query, key, value, query_rope, key_rope, sinks) -> torch.Tensor:
    return gt.npu_sparse_flash_attention(
        query, key, value, p.indices, p.scale, block_table=p.table, actual_seq_lengths_query=p.lengths_q,
        actual_seq_lengths_kv=p.lengths_kv, query_rope=query_rope, key_rope=key_rope, sparse_block_size=p.bs,
        layout_query=p.layout, layout_kv="PA_BSND" if p.paged else p.layout, sparse_mode=p.mode,
        return_softmax_lse=not p.paged, sinks=sinks)[0]


def _reference(p: Problem, mask: torch.Tensor, query, key, value, query_rope, key_rope, sinks) -> torch.Tensor:
    """Spec 4.6 in float64 with autograd: softmax over the visible keys and the sink, out 0 for a row with no key;
    a paged cache read through its table (4.11), entries past the keys clamped (those keys are never visible)."""
    f64 = (lambda t: None if t is None else t.to(torch.float64))  # noqa: E731
    query, key, value, query_rope, key_rope, sinks = map(f64, (query, key, value, query_rope, key_rope, sinks))
    if query_rope is not None:
        query, key = torch.cat([query, query_rope], -1), torch.cat([key, key_rope], -1)
    if p.paged:
        j = torch.arange(p.table.shape[1] * p.page)
        rows = (p.table.long().clamp(0, key.shape[0] - 1)[:, j // p.page] * p.page + j % p.page).reshape(-1)
        key, value = key.flatten(0, 1)[rows], value.flatten(0, 1)[rows]
    q = query.reshape(p.q_rows, p.N1, -1)
    k, v = key.reshape(p.kv_rows, p.N2, -1), value.reshape(p.kv_rows, p.N2, -1)
    g = p.N1 // p.N2
    seen = mask.repeat_interleave(g, dim=1)                                         # (Q, N1, T)
    scores = torch.einsum("qhd,thd->qht", q, k.repeat_interleave(g, dim=1)) * p.scale
    scores = scores.masked_fill(~seen, -torch.inf)
    if sinks is not None:
        scores = torch.cat([scores, sinks[None, :, None].expand(p.q_rows, p.N1, 1)], -1)
    any_key = seen.any(-1, keepdim=True)
    probs = torch.softmax(torch.where(any_key, scores, 0), -1)[..., :p.kv_rows] * seen
    out = torch.einsum("qht,thd->qhd", probs, v.repeat_interleave(g, dim=1)) * any_key
    return out.reshape(query.shape[:-1] + (value.shape[-1],))


def _leaves(t: dict, keep: tuple[str, ...] = NAMES) -> dict:
    return {k: (v.clone().requires_grad_() if v is not None and k in keep else v) for k, v in t.items()}


def _grads(fn, p: Problem, t: dict, d_out: torch.Tensor) -> dict[str, torch.Tensor]:
    leaves = _leaves(t)
    fn(p, **leaves).backward(d_out)
    return {k: v.grad for k, v in leaves.items() if v is not None}


CASES = {   # name: (problem, D, D2, Dr, sinks, block_num)
    "sinks-bsnd": (lambda: _bsnd(2, 3, 5, None, None, N1=4, N2=2, K=3, bs=2, mode=3), 3, 2, 2, True, 0),
    "sinks-tnd-mode0": (lambda: _tnd([2, 5], [3, 7], N1=2, N2=1, K=3, bs=1, mode=0), 3, 3, 0, True, 0),
    "lengths-bsnd-mode3": (lambda: _bsnd(3, 4, 6, [4, 2, 0], [6, 3, 5], N1=2, N2=1, K=3, bs=2, mode=3), 3, 2, 2,
                           True, 0),
    "lengths-bsnd-mode0": (lambda: _bsnd(3, 3, 5, [3, 0, 2], [0, 5, 2], N1=4, N2=2, K=4, bs=1, mode=0), 2, 2, 0,
                           False, 0),
    "lengths-bsnd-kv-only": (lambda: _bsnd(2, 3, 5, None, [4, 1], N1=2, N2=1, K=3, bs=1, mode=3), 2, 2, 0, True, 0),
    # pages: block 1 in both batches (a shared prefix), block 2 twice in batch 1, -1 and garbage past the keys
    "paged-bsnd": (lambda: _paged("BSND", [[0, 1, -1], [1, 2, 2]], 16, [20, 40], S1=3, q_len=[3, 2], N1=2, N2=1,
                                  K=4, bs=4, mode=3), 2, 2, 2, True, 4),
    "paged-tnd": (lambda: _paged("TND", [[2, 0, 7], [2, 1, -1]], 16, [17, 30], aq=[2, 5], N1=2, N2=1, K=5, bs=2,
                                 mode=0), 2, 2, 0, True, 4),
}


def _case(name: str, dtype: torch.dtype, seed: int = 0):
    make, d, d2, dr, sinks, block_num = CASES[name]
    p = make()
    p.draw_indices(np.random.default_rng(seed))
    return p, _inputs(p, dtype, d, d2, dr, sinks, seed, block_num)


@pytest.mark.parametrize("name", list(CASES))
def test_gradcheck_in_float64(name):
    p, t = _case(name, torch.float64)
    present = [k for k in NAMES if t[k] is not None]

    def attention(*xs):
        return _geir(p, **{**t, **dict(zip(present, xs))})

    assert torch.autograd.gradcheck(attention, tuple(t[k].clone().requires_grad_() for k in present))


@pytest.mark.parametrize("name", list(CASES))
def test_float64_gradients_equal_the_reference(name):
    p, t = _case(name, torch.float64, seed=1)
    mask = p.mask()
    assert mask.any() and not mask.all(-1).all()          # some keys seen, not all: the selection matters
    d_out = torch.randn(_geir(p, **t).shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    got = _grads(_geir, p, t, d_out)
    want = _grads(lambda p_, **kw: _reference(p_, mask, **kw), p, t, d_out)
    torch.testing.assert_close(_geir(p, **t), _reference(p, mask, **t), rtol=1e-12, atol=1e-12)
    assert sorted(got) == sorted(want)
    for k in got:
        torch.testing.assert_close(got[k], want[k], rtol=1e-10, atol=1e-12, msg=k)
    if p.paged:   # pages the table never names within the keys get nothing; a page named twice gets both sums
        named = set(p.table[p.table >= 0].tolist())
        for block in range(t["key"].shape[0]):
            if block not in named:
                assert not got["key"][block].any() and not got["value"][block].any()


TOLERANCE = {torch.float16: 2.0 ** -8, torch.bfloat16: 2.0 ** -6}
"""Largest error allowed against the float64 reference, relative to the largest reference gradient of the tensor
(at least 1): P and dS are rounded to the input dtype before their matmuls (spec 4.7). About 4 float16 and 2 bfloat16
ulps at 1; measured at most 7.3e-4 (float16) and 7.8e-3 (bfloat16, the paged case with a page named twice)."""


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(CASES))
def test_low_precision_gradients_match_the_float64_reference(name, dtype):
    p, t = _case(name, dtype, seed=3)
    mask = p.mask()
    d_out = torch.randn(_geir(p, **t).shape, generator=torch.Generator().manual_seed(4)).to(dtype)
    got = _grads(_geir, p, t, d_out)
    want = _grads(lambda p_, **kw: _reference(p_, mask, **kw), p, t, d_out)
    for k, g in got.items():
        assert g.dtype == t[k].dtype and g.shape == t[k].shape, k
        error = (g.double() - want[k]).abs().max() / want[k].abs().max().clamp_min(1.0)
        assert error <= TOLERANCE[dtype], (k, float(error))


def test_a_row_without_keys_gives_its_sink_no_gradient():
    p = _bsnd(1, 2, 4, None, [0], N1=2, N2=1, K=2, bs=1, mode=0)        # no key at all: out 0 whatever the sink
    p.draw_indices(np.random.default_rng(0))
    t = _leaves(_inputs(p, torch.float64, 2, 2, 0, True, 0), ("query", "sinks"))
    out = _geir(p, **t)
    out.backward(torch.ones_like(out))
    assert not out.any() and torch.equal(t["sinks"].grad, torch.zeros(2, dtype=torch.float64))
    assert not t["query"].grad.any()


@pytest.mark.models
def test_the_restated_backwards_trace_with_fake_tensors():
    """torch.compile (AOTAutograd traces the backward with FakeTensors) gives eager's gradients: no shape in the
    restatements depends on the lengths' or the table's values."""
    for name in ("lengths-bsnd-mode3", "paged-tnd"):
        p, t = _case(name, torch.float64)
        present = [k for k in NAMES if t[k] is not None]

        def step(*xs):
            out = _geir(p, **{**t, **dict(zip(present, xs))})
            return (out * out).sum()

        eager = [t[k].clone().requires_grad_() for k in present]
        compiled = [t[k].clone().requires_grad_() for k in present]
        step(*eager).backward()
        torch.compile(step, fullgraph=True, backend="aot_eager")(*compiled).backward()
        assert all(torch.equal(a.grad, b.grad) for a, b in zip(compiled, eager)), name


def test_what_stays_refused_says_why():
    p, t = _case("sinks-bsnd", torch.float16)
    leaves = _leaves(t, ("query",))
    out = gt.npu_sparse_flash_attention(leaves["query"], t["key"], t["value"], p.indices, p.scale,
                                        sparse_block_size=p.bs)[0]           # no return_softmax_lse
    with pytest.raises(RuntimeError, match="without return_softmax_lse=True.*pass return_softmax_lse=True"):
        out.sum().backward()
    attributes = attention_backward.Attributes(0.5, 1, "BSND", "TND", 3, 2**63 - 1, 2**63 - 1, 0, True)
    reason = attention_backward.refusal(attributes, has_block_table=False)
    assert reason is not None and "layout_query 'BSND' differs from layout_kv 'TND'" in reason
    paged = attention_backward.Attributes(0.5, 1, "BSND", "PA_BSND", 3, 2**63 - 1, 2**63 - 1, 0, False)
    assert attention_backward.refusal(paged, has_block_table=True) is None   # recomputes its statistics
