"""What the sparse attention family's tests share: the op names, a one-node graph builder and the grad's feeds, a
forward reduced to attention_out (what geir.grad differentiates), ``AttentionCase`` (random valid inputs of any
shape and mode) and ``paged_arrays`` (the same problem in a paged KV cache)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

import geir
from geir.schemas.sparse_attention.selection import query_rows

SFA, SFA_GRAD = "SparseFlashAttention", "SparseFlashAttentionGrad"


def sfa_graph(feeds: dict, op: str = SFA, name: str = "node", value_is_key: bool = False, **attrs):
    """One sparse attention node over the non-None arrays of ``feeds`` (keyed by GE IR input name).

    Returns ``(graph, feeds)`` with the graph inputs named like the op inputs and outputs named
    like the op outputs (absent optional outputs are not graph outputs). ``value_is_key``: the key
    input feeds value too (the grad docs' "value和key完全一致", SG-T13); ``feeds``' value is dropped.
    """
    from geir.schemas import get_schema
    schema = get_schema(op)
    b = geir.GraphBuilder(op.lower())
    if value_is_key:
        feeds = dict(feeds, value=None)
    values = {k: b.input(k, np.asarray(v).dtype, np.shape(v)) for k, v in feeds.items() if v is not None}
    if value_is_key:
        values["value"] = values["key"]
    results = getattr(b, op)(**values, name=name, **attrs)
    for spec, value in zip(schema.outputs, results):
        if value is not None:
            b.output(value, spec.name)
    return b.build(), {k: v for k, v in feeds.items() if v is not None}


def sfa_grad_feeds(arrays: dict, forward_out: dict, d_out: np.ndarray, layout: str, indices=None) -> dict:
    """SparseFlashAttentionGrad feeds from a forward case's arrays and its outputs (out and statistics); TND keeps
    its lengths, BSND drops them (the grad ignores them)."""
    feeds = {"query": arrays["query"], "key": arrays["key"],
             "sparse_indices": arrays["sparse_indices"] if indices is None else indices, "d_out": d_out,
             "out": forward_out["attention_out"], "softmax_max": forward_out["softmax_max"],
             "softmax_sum": forward_out["softmax_sum"], "value": arrays["value"], "query_rope": arrays["query_rope"],
             "key_rope": arrays["key_rope"]}
    if layout == "TND":
        feeds["actual_seq_lengths_query"] = arrays["actual_seq_lengths_query"]
        feeds["actual_seq_lengths_kv"] = arrays["actual_seq_lengths_kv"]
    return feeds


def only_attention_out(graph: geir.Graph) -> geir.Graph:
    """The same graph with attention_out as its only output (the statistics are not differentiated)."""
    keep = [v for v in graph.outputs if v.name == "attention_out"]
    graph.outputs[:] = keep
    graph.invalidate()
    from geir.passes import build_pipeline
    return build_pipeline()(graph)[0]


@dataclass
class AttentionCase:
    """Random inputs of one shape and mode that satisfy every rule of spec 4.3-4.5 (the tests' own; ``geir bench``
    draws its shapes from ``SfaCase`` in schemas/sparse_attention/examples.py).

    Each read row selects a random number of distinct blocks (``full``: exactly K, when there are
    that many) in random order, padded with -1; some rows that are never read (empty threshold)
    keep garbage ids, which the op must ignore. BSND takes per-batch lengths when ``lengths``;
    TND always has cumulative lengths, and one trailing query row outside every batch.
    """

    layout: str = "BSND"
    B: int = 2
    S1: int = 5
    S2: int = 9
    N1: int = 4
    N2: int = 1
    D: int = 8
    D2: int = 8
    Dr: int = 0
    K: int = 4
    bs: int = 1
    mode: int = 3
    kv_merge: bool = False
    sinks: bool = False
    lengths: bool = False          # BSND: per-batch lengths (forward); TND always has them
    dtype: str = "float16"
    seed: int = 0
    tnd_q: list[int] = field(default_factory=lambda: [3, 5])    # TND cumulative lengths
    tnd_kv: list[int] = field(default_factory=lambda: [4, 9])
    scale_value: float | None = None   # default: float32(1 / sqrt(D + Dr))
    full: bool = False

    def arrays(self) -> dict[str, np.ndarray | None]:
        rng = np.random.default_rng(self.seed)
        dt = np.float64 if self.dtype == "float64" else geir.as_dtype(self.dtype).numpy   # float64: kernels' hook
        bsnd = self.layout == "BSND"
        qlead = (self.B, self.S1) if bsnd else (self.tnd_q[-1] + 1,)       # TND: one trailing unbatched row
        kvlead = (self.B, self.S2) if bsnd else (self.tnd_kv[-1] + 2,)

        def normal(*shape: int) -> np.ndarray:
            return rng.standard_normal(shape).astype(dt)

        arrays: dict[str, np.ndarray | None] = {
            "query": normal(*qlead, self.N1, self.D), "key": normal(*kvlead, self.N2, self.D),
            "value": None if self.kv_merge else normal(*kvlead, self.N2, self.D2),
            "query_rope": normal(*qlead, self.N1, self.Dr) if self.Dr else None,
            "key_rope": normal(*kvlead, self.N2, self.Dr) if self.Dr else None,
            "sinks": rng.standard_normal(self.N1).astype(np.float32) if self.sinks else None,
        }
        if bsnd:
            aq = rng.integers(0, self.S1 + 1, self.B).astype(np.int32) if self.lengths else None
            akv = rng.integers(0, self.S2 + 1, self.B).astype(np.int32) if self.lengths else None
        else:
            aq, akv = np.array(self.tnd_q, np.int32), np.array(self.tnd_kv, np.int32)
        arrays["actual_seq_lengths_query"], arrays["actual_seq_lengths_kv"] = aq, akv
        arrays["sparse_indices"] = self._indices(rng, qlead, aq, akv)
        return arrays

    def _indices(self, rng: np.random.Generator, qlead: tuple[int, ...], aq: np.ndarray | None,
                 akv: np.ndarray | None) -> np.ndarray:
        rows = query_rows(self.layout, int(np.prod(qlead)), self.S1, self.S2, aq, akv, self.mode)
        indices = np.full((rows.s1.size, self.N2, self.K), 10**6, np.int32)   # rows never read keep garbage
        for r in np.flatnonzero(rows.active):                                  # test data, not a hot path
            blocks, thr = -(-int(rows.s2_len[r]) // self.bs), int(rows.threshold[r])
            for n2 in range(self.N2):
                row = np.full(self.K, -1, np.int32)
                if thr > 0 and blocks > 0:
                    count = min(self.K, blocks) if self.full else rng.integers(0, min(self.K, blocks) + 1)
                    row[:count] = rng.choice(blocks, count, replace=False)
                if thr > 0 or rng.random() < 0.5:
                    indices[r, n2] = row
        return indices.reshape(qlead + (self.N2, self.K))

    @property
    def scale(self) -> float:
        if self.scale_value is not None:
            return self.scale_value
        return float(np.float32(1 / np.sqrt(self.D + self.Dr)))

    def forward_attrs(self) -> dict:
        return dict(scale_value=self.scale, sparse_block_size=self.bs, layout_query=self.layout,
                    layout_kv=self.layout, sparse_mode=self.mode, return_softmax_lse=True)

    def grad_attrs(self) -> dict:
        return dict(scale_value=self.scale, sparse_block_size=self.bs, layout=self.layout, sparse_mode=self.mode)


def paged_arrays(arrays: dict[str, np.ndarray | None], layout: str, page: int, rng: np.random.Generator,
                 spare_pages: int = 3) -> dict[str, np.ndarray | None]:
    """The same problem with its keys in a paged cache (layout_kv PA_BSND, spec 4.11): every batch's keys are
    scattered into pages whose ids are a random permutation, the table padded with -1, spare pages filled with
    noise, and ``actual_seq_lengths_kv`` per batch. The forward on it must equal the dense forward bit for bit."""
    key = arrays["key"]
    if layout == "BSND":
        batches, seq = key.shape[:2]
        given = arrays.get("actual_seq_lengths_kv")
        counts = np.full(batches, seq, np.int64) if given is None else given.astype(np.int64)
        starts = np.zeros(batches, np.int64)
    else:
        ends = arrays["actual_seq_lengths_kv"].astype(np.int64)
        starts, counts = np.concatenate([[0], ends[:-1]]), ends - np.concatenate([[0], ends[:-1]])
    used = -(-counts // page)
    max_blocks = int(used.max(initial=0)) + 1                  # one trailing -1 column in every row
    total = int(used.sum()) + spare_pages
    page_ids = rng.permutation(total)
    table = np.full((counts.size, max_blocks), -1, np.int32)
    result = dict(arrays)
    for name in ("key", "value", "key_rope"):
        dense = arrays.get(name)
        if dense is None:
            continue
        cache = rng.standard_normal((total, page) + dense.shape[-2:]).astype(dense.dtype)
        taken = 0
        for b in range(counts.size):                            # test data, not a hot path
            source = dense[b, : counts[b]] if layout == "BSND" else dense[starts[b]: starts[b] + counts[b]]
            for column in range(int(used[b])):
                pid = page_ids[taken]
                taken += 1
                table[b, column] = pid
                chunk = source[column * page: (column + 1) * page]
                cache[pid, : chunk.shape[0]] = chunk
        result[name] = cache
    result["block_table"] = table
    result["actual_seq_lengths_kv"] = counts.astype(np.int32)
    return result
