"""Triton kernel sources, jitted by `triton_attention` (imported only where Triton is installed). The kernels are
plain functions here, decorated on first use: Triton's interpreter, which the CPU test suite runs them under, needs
`triton.language` among the module's globals, and decides at decoration whether it interprets."""

import triton.language as tl


def paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, slots_ptr, lengths_ptr, first_ptr, row_requests_ptr, sinks_ptr,
    scale, softcap, queries_per_request, slots_per_request,
    q_row_stride, q_head_stride, o_row_stride, o_head_stride, kv_head_stride, kv_slot_stride,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, SOFTCAP: tl.constexpr, IEEE: tl.constexpr, RAGGED: tl.constexpr, SINKS: tl.constexpr,
):
    """`triton_attention.paged_attention` for query row program_id(0) and KV head program_id(1)."""
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    request = tl.load(row_requests_ptr + row) if RAGGED else row // queries_per_request
    begin = tl.load(first_ptr + row)
    end = tl.load(lengths_ptr + row)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + g
    head_mask = (g < GROUP)[:, None] & (d < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + row * q_row_stride + heads[:, None] * q_head_stride + d[None, :], mask=head_mask,
                other=0.0).to(tl.float32)
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_G], tl.float32)
    if SINKS:  # each head's sink logit starts its softmax: in the denominator, with no value
        m = tl.load(sinks_ptr + heads, mask=g < GROUP, other=float("-inf")).to(tl.float32)
        total = tl.where(g < GROUP, 1.0, 0.0)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    slot_base = slots_ptr + request.to(tl.int64) * slots_per_request
    kv_base = kv_head.to(tl.int64) * kv_head_stride
    for start in range(begin, end, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        valid = n < end
        slot = tl.load(slot_base + n, mask=valid, other=0)
        offsets = kv_base + slot[:, None] * kv_slot_stride + d[None, :]
        kv_mask = valid[:, None] & (d < HEAD_DIM)[None, :]
        k = tl.load(k_ptr + offsets, mask=kv_mask, other=0.0).to(tl.float32)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        else:
            s = tl.dot(q, tl.trans(k), input_precision="tf32") * scale
        if SOFTCAP:
            s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        total = total * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + offsets, mask=kv_mask, other=0.0).to(tl.float32)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="tf32")
        m = m_new
    out = acc / tl.where(total > 0.0, total, 1.0)[:, None]
    tl.store(o_ptr + row * o_row_stride + heads[:, None] * o_head_stride + d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=head_mask)

