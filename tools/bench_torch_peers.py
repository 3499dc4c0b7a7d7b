"""The PyTorch eager peers of the benchmarks: each op's math written the way a PyTorch user would (``torch`` is
passed in, so importing this module never imports PyTorch). Shared by ``geir bench``'s suites and by
``geir.torch.benchmark``, which compares geir.torch's calls with them."""

from __future__ import annotations

__all__ = ["torch_moe_grad", "torch_rotary_grad", "torch_sfa_grad"]


def torch_rotary_grad(torch, dy, cos, sin, start: int, end: int):
    """The interleave rotary grad on ``dy[..., start:end]`` in PyTorch eager (float32 inside, strided halves)."""
    out = dy.clone()
    g, c, n = dy[..., start:end].float(), cos.float(), sin.float()
    y = torch.empty_like(g)
    y[..., 0::2] = c[..., 0::2] * g[..., 0::2] + n[..., 1::2] * g[..., 1::2]
    y[..., 1::2] = c[..., 1::2] * g[..., 1::2] - n[..., 0::2] * g[..., 0::2]
    out[..., start:end] = y.to(dy.dtype)
    return out


def torch_moe_grad(torch, tokens, grad, indices, probs):
    """MoeTokenUnpermuteGrad's math in PyTorch eager (a scatter of weighted rows, a gathered dot for probs)."""
    n, topk = probs.shape
    rows = indices.long()
    out = torch.empty(indices.numel(), grad.shape[1], dtype=grad.dtype)
    out[rows] = (grad.float()[:, None, :] * probs.float()[:, :, None]).reshape(indices.numel(), -1).to(grad.dtype)
    pg = (tokens.float()[rows.view(n, topk)] * grad.float()[:, None, :]).sum(-1)
    return out, pg.to(probs.dtype)


def torch_sfa_grad(torch, f: dict, scale: float):
    """The grad's math for B=1, N2=1, block 1, sparse_mode 0 in PyTorch eager (gather, bmm, index_add)."""
    q = torch.cat([f["query"], f["query_rope"]], -1).float()[0]                  # (S1, N1, Dq)
    k = torch.cat([f["key"], f["key_rope"]], -1).float()[0, :, 0]                # (S2, Dq)
    v = f["value"].float()[0, :, 0]
    rows = f["sparse_indices"][0, :, 0].long()                                  # (S1, K)
    kg, vg = k[rows], v[rows]
    scores = torch.bmm(q, kg.transpose(1, 2)) * scale
    m, l = f["softmax_max"][0, 0][..., None], f["softmax_sum"][0, 0][..., None]  # (S1, N1, 1)
    p = torch.exp(scores - m) / l
    d_o, o = f["d_out"].float()[0], f["out"].float()[0]
    dt = f["query"].dtype
    d_v = torch.bmm(p.to(dt).float().transpose(1, 2), d_o)
    d_s = p * (torch.bmm(d_o, vg.transpose(1, 2)) - (d_o * o).sum(-1, keepdim=True))
    d_s = d_s.to(dt).float()
    d_q = scale * torch.bmm(d_s, kg)
    d_k = torch.zeros_like(k).index_add_(0, rows.reshape(-1), (scale * torch.bmm(d_s.transpose(1, 2), q)).reshape(
        -1, k.shape[1]))
    d_vv = torch.zeros_like(v).index_add_(0, rows.reshape(-1), d_v.reshape(-1, v.shape[1]))
    return d_q.to(dt), d_k.to(dt), d_vv.to(dt)
