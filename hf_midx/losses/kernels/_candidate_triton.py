"""Triton kernels of the fused candidate loss (see :mod:`hf_midx.losses.kernels.candidate` for the math).

Plain ``@triton.jit`` functions over pointers, imported only when the fused path runs (Triton decides
at decoration time whether it interprets, so this module is imported after ``TRITON_INTERPRET`` is
set). Shapes: T tokens, D dims, V classes, M negatives per token, R = 1 + M candidate rows (the
label first), H exact-head classes, B + 1 rows of the tail's bucket table. Every kernel accumulates in
float32 and multiplies elementwise: gathered rows are not tiles a ``tl.dot`` could use, and the weight
gradient's segmented sum walks each class's sorted pairs (a one-hot ``tl.dot`` would spend a
BLOCK_V-wide product on each pair).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _tanh(x):
    # exp of a non-positive argument only: no overflow at any |x|.
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _finish_logits(x, scale, softcap, SOFTCAP: tl.constexpr):
    """Raw logits x (float32) -> (o, do/dx): o = scale * x, then softcap * tanh(o / softcap)."""
    o = x * scale
    do_dx = x * 0.0 + scale
    if SOFTCAP:
        t = _tanh(o / softcap)
        o = softcap * t
        do_dx = scale * (1.0 - t * t)
    return o, do_dx


@triton.jit
def _lse_start(terms):
    """(max, sum of exp(terms - max)) over axis 1 of (BLOCK_T, N) terms; max 0 for an all -inf row (past T)."""
    m = tl.max(terms, axis=1)
    m = tl.where(m == float("-inf"), 0.0, m)
    return m, tl.sum(tl.exp(terms - m[:, None]), axis=1)


@triton.jit
def _lse_add(m, s, terms):
    """The running (max, sum) after one more (BLOCK_T, N) tile of terms."""
    m_new = tl.maximum(m, tl.max(terms, axis=1))
    return m_new, s * tl.exp(m - m_new) + tl.sum(tl.exp(terms - m_new[:, None]), axis=1)


@triton.jit
def _head_tile(
    head_raw_ptr, head_ids_ptr, bias_ptr, t64, t_ok, c0, H, stride_head_raw, scale, softcap,
    HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """Columns c0 .. c0 + BLOCK_H of the exact head for the block's tokens: (c, in-range mask, o, do/dx)."""
    c = c0 + tl.arange(0, BLOCK_H)
    c_ok = c < H
    ok = t_ok[:, None] & c_ok[None, :]
    xh = tl.load(head_raw_ptr + t64[:, None] * stride_head_raw + c[None, :], mask=ok, other=0.0).to(tl.float32)
    if HAS_BIAS:
        hid = tl.load(head_ids_ptr + c, mask=c_ok, other=0)
        xh += tl.load(bias_ptr + hid, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    oh, doh = _finish_logits(xh, scale, softcap, SOFTCAP)
    return c, ok, oh, doh


@triton.jit
def _dot_rows(
    hidden_ptr, weight_ptr, t64, t_ok, row, cand_ok, D, stride_hidden, stride_weight,
    BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """x[t, r] = hidden[t] . weight[row[t, r]] in float32, over D in blocks: (BLOCK_T, BLOCK_R). A weight wider
    than the hidden states (float32 under bf16 autocast) is rounded to their dtype in registers, tile by tile: the
    products are the mixed-precision step's, with no (V, D) copy of the weight."""
    x = tl.zeros((BLOCK_T, BLOCK_R), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        d_ok = d < D
        h = tl.load(
            hidden_ptr + t64[:, None] * stride_hidden + d[None, :], mask=t_ok[:, None] & d_ok[None, :], other=0.0
        ).to(tl.float32)
        w = tl.load(
            weight_ptr + row[:, :, None] * stride_weight + d[None, None, :],
            mask=cand_ok[:, :, None] & d_ok[None, None, :],
            other=0.0,
        ).to(hidden_ptr.dtype.element_ty).to(tl.float32)
        x += tl.sum(w * h[:, None, :], axis=2)
    return x


@triton.jit
def _in_sorted(head_ids_ptr, y, t_ok, H, SEARCH_STEPS: tl.constexpr, BLOCK_T: tl.constexpr):
    """((BLOCK_T,) bool, (BLOCK_T,) int32): y is one of the sorted (H,) ids (a lower-bound search; False past T or
    without ids), and its position among them (where it is one)."""
    lo = tl.zeros((BLOCK_T,), dtype=tl.int32)
    hi = tl.zeros((BLOCK_T,), dtype=tl.int32) + H
    for _step in tl.static_range(SEARCH_STEPS):
        active = lo < hi
        mid = (lo + hi) // 2
        v = tl.load(head_ids_ptr + mid, mask=active & t_ok, other=0)
        right = active & (v < y)
        lo = tl.where(right, mid + 1, lo)
        hi = tl.where(active & (v >= y), mid, hi)
    last = tl.minimum(lo, H - 1)  # -1 without a head: masked
    found = tl.load(head_ids_ptr + last, mask=t_ok & (last >= 0), other=-1)
    return t_ok & (found == y), lo


@triton.jit
def _log_n(in_head, M, CORRECTED: tl.constexpr, BLOCK_T: tl.constexpr):
    """(BLOCK_T,) float32 log n: n = M, plus 1 for a corrected positive outside the exact head."""
    if CORRECTED:
        n = M + tl.where(in_head, 0.0, 1.0)
    else:
        n = M + tl.zeros((BLOCK_T,), dtype=tl.float32)
    return tl.log(n)


@triton.jit
def _positive_correction(log_q_pos_ptr, t, t_ok, in_head, log_n, CORRECTED: tl.constexpr, BLOCK_T: tl.constexpr):
    """(BLOCK_T,) float32: what the label's logit loses in the objective, log n + log q(label) for a corrected
    positive outside the head, else 0."""
    if CORRECTED:
        lq_pos = tl.load(log_q_pos_ptr + t, mask=t_ok, other=0.0).to(tl.float32)
        # A label the proposal cannot draw (log q = -inf) keeps its exact logit.
        finite = (lq_pos == lq_pos) & (tl.abs(lq_pos) < float("inf"))
        pos_corr = tl.where(in_head | ~finite, 0.0, log_n + lq_pos)
    else:
        pos_corr = tl.zeros((BLOCK_T,), dtype=tl.float32)
    return pos_corr


@triton.jit
def _head_lse(
    term, vterm, head_raw_ptr, head_ids_ptr, bias_ptr, t64, t_ok, H, stride_head_raw, scale, softcap,
    HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr, EXACT_VALUE: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """The running (max, sum) of the objective's terms and of the value's terms (``vterm``, with EXACT_VALUE)
    over the candidates, then over the exact head's logits: (m, s, mv, sv)."""
    m, s = _lse_start(term)
    mv, sv = _lse_start(vterm)
    for c0 in range(0, H, BLOCK_H):
        c, ok, oh, doh = _head_tile(
            head_raw_ptr, head_ids_ptr, bias_ptr, t64, t_ok, c0, H, stride_head_raw, scale, softcap,
            HAS_BIAS, SOFTCAP, BLOCK_H,
        )
        oh = tl.where(ok, oh, float("-inf"))
        m, s = _lse_add(m, s, oh)
        if EXACT_VALUE:
            mv, sv = _lse_add(mv, sv, oh)
    return m, s, mv, sv


@triton.jit
def candidate_forward_kernel(
    hidden_ptr, weight_ptr, bias_ptr, labels_ptr, ids_ptr, log_q_ptr, log_q_pos_ptr,
    head_ids_ptr, head_raw_ptr,
    loss_ptr, stats_ptr, rows_ptr, g_cand_ptr, g_head_ptr, share_ptr,
    T, D, M, H, V,
    stride_hidden, stride_weight, stride_head_raw,
    ignore_index, scale, softcap,
    HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr, CORRECTED: tl.constexpr, DROP_HITS: tl.constexpr,
    EXACT_VALUE: tl.constexpr, TAIL_CONTROL: tl.constexpr, SEARCH_STEPS: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """One program per BLOCK_T tokens: the candidates' logits, the logsumexp with the exact head, the
    per-token loss (the objective's, or with EXACT_VALUE the exact-loss estimate), and the objective's
    d loss_t / d x for every candidate and head logit (x before scale and cap).

    Writes loss (T,) f32 (0 at ignored tokens), stats (programs, 2) f32 (this block's loss sum and
    number of valid tokens, for the reduction), rows (T, R) int32 (the label, then the negatives; V for a
    pair of zero gradient),
    g_cand (T, R) f32 and g_head (T, H) in its own dtype (it aliases head_raw, of the weight's dtype: each element
    is read before this program writes it); a label in the head has its gradient in g_head, 0 in g_cand. With TAIL_CONTROL, share (T,) f32: the draws' share of the softmax
    (0 at ignored tokens), and each draw's gradient less share / M (the expected tail gradient's sampled part).
    """
    pid = tl.program_id(0)
    t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < T
    t64 = t.to(tl.int64)
    label = tl.load(labels_ptr + t, mask=t_ok, other=ignore_index).to(tl.int64)
    valid = t_ok & (label != ignore_index)
    y = tl.where(valid, label, 0)  # ignored tokens are scored as class 0, then masked

    r = tl.arange(0, BLOCK_R)
    R = M + 1
    is_pos = (r == 0)[None, :]
    is_neg = ((r >= 1) & (r < R))[None, :] & t_ok[:, None]
    cand_ok = (r < R)[None, :] & t_ok[:, None]
    neg_off = t64[:, None] * M + (r[None, :] - 1)
    neg_id = tl.load(ids_ptr + neg_off, mask=is_neg, other=0).to(tl.int64)
    row = tl.where(is_pos, y[:, None], neg_id)  # (BLOCK_T, BLOCK_R)

    x = _dot_rows(hidden_ptr, weight_ptr, t64, t_ok, row, cand_ok, D, stride_hidden, stride_weight,
                  BLOCK_T, BLOCK_R, BLOCK_D)
    if HAS_BIAS:
        x += tl.load(bias_ptr + row, mask=cand_ok, other=0.0).to(tl.float32)
    o, do_dx = _finish_logits(x, scale, softcap, SOFTCAP)

    in_head, head_pos = _in_sorted(head_ids_ptr, y, t_ok, H, SEARCH_STEPS, BLOCK_T)  # the label in the exact head

    # The corrections: n = M (+1 for a corrected positive outside the head), log n + log q.
    log_n = _log_n(in_head, M, CORRECTED, BLOCK_T)
    log_q = tl.load(log_q_ptr + neg_off, mask=is_neg, other=0.0).to(tl.float32)
    pos_corr = _positive_correction(log_q_pos_ptr, t, t_ok, in_head, log_n, CORRECTED, BLOCK_T)
    term = o - tl.where(is_pos, pos_corr[:, None], log_n[:, None] + log_q)
    drop = is_pos & in_head[:, None]  # the head already holds the label's term
    if DROP_HITS:
        drop = drop | (is_neg & (neg_id == y[:, None]))
    term = tl.where(drop | ~cand_ok, float("-inf"), term)

    pos = tl.sum(tl.where(is_pos, o, 0.0), axis=1)
    target = pos - pos_corr
    # The value, when asked: an estimate of the exact cross-entropy from the same logits, Z estimated without
    # bias (the label exactly, M draws each corrected by log M + log q, hits dropped); no gradient of its own.
    vterm = tl.where(is_pos, o, o - (tl.log(M + 0.0) + log_q))
    vterm = tl.where((is_pos & in_head[:, None]) | (is_neg & (neg_id == y[:, None])) | ~cand_ok, float("-inf"), vterm)

    # Online logsumexps over the candidates and the exact head.
    m, s, mv, sv = _head_lse(
        term, vterm, head_raw_ptr, head_ids_ptr, bias_ptr, t64, t_ok, H, stride_head_raw, scale, softcap,
        HAS_BIAS, SOFTCAP, EXACT_VALUE, BLOCK_H,
    )
    lse = m + tl.log(tl.where(t_ok, s, 1.0))  # rows past T: 0, not log(0)
    if EXACT_VALUE:
        loss = tl.where(valid, mv + tl.log(tl.where(t_ok, sv, 1.0)) - pos, 0.0)
    else:
        loss = tl.where(valid, lse - target, 0.0)
    tl.store(loss_ptr + t, loss, mask=t_ok)
    two = tl.arange(0, 2)
    tl.store(stats_ptr + pid * 2 + two, tl.where(two == 0, tl.sum(loss, axis=0), tl.sum(valid.to(tl.float32), axis=0)))

    # d loss_t / d term = softmax(term) - [term is the target]; the target is always column 0's logit.
    keep = valid[:, None]
    g = tl.exp(term - lse[:, None]) - tl.where(is_pos, 1.0, 0.0)
    if TAIL_CONTROL:
        share = tl.sum(tl.where(is_neg & keep, g, 0.0), axis=1)
        g = g - tl.where(is_neg, share[:, None] / M, 0.0)
        tl.store(share_ptr + t, share, mask=t_ok)
    # A label in the head gives its -1 to the head's column (below): the head's GEMMs carry it, and the weight
    # gradient's walk skips the pair (a frequent label's class would otherwise be one program's long run).
    g = tl.where(keep & cand_ok & ~(is_pos & in_head[:, None]), g * do_dx, 0.0)
    # A pair of zero gradient is stored as class V: the backward's walks skip it.
    tl.store(rows_ptr + t64[:, None] * R + r[None, :], tl.where(g != 0.0, row, V).to(tl.int32), mask=cand_ok)
    tl.store(g_cand_ptr + t64[:, None] * R + r[None, :], g, mask=cand_ok)
    for c0 in range(0, H, BLOCK_H):
        c, ok, oh, doh = _head_tile(
            head_raw_ptr, head_ids_ptr, bias_ptr, t64, t_ok, c0, H, stride_head_raw, scale, softcap,
            HAS_BIAS, SOFTCAP, BLOCK_H,
        )
        at_label = tl.where((c[None, :] == head_pos[:, None]) & in_head[:, None], 1.0, 0.0)
        gh = tl.where(keep & ok, (tl.exp(oh - lse[:, None]) - at_label) * doh, 0.0)
        tl.store(g_head_ptr + t64[:, None] * H + c[None, :], gh, mask=ok)


@triton.jit
def candidate_grad_hidden_kernel(
    weight_ptr, rows_ptr, g_cand_ptr, gscale_ptr, base_ptr, out_ptr,
    T, D, R, V,
    stride_weight, stride_gscale, stride_base, stride_out,
    HAS_BASE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """out[t] = gscale[t] * (sum_r g_cand[t, r] weight[rows[t, r]] (+ base[t])); grid (T / BLOCK_T, D / BLOCK_D).

    ``gscale`` is the upstream gradient per token (stride 0 for a scalar); ``base`` (T, D), not scaled, is the
    exact head's part (one GEMM outside, of the head's unscaled logit gradient: the scale is applied here, to a
    (T, D) tile in registers, instead of to the (T, H) gradient in memory). Each output element is written once.
    A weight wider than ``out`` (float32 under bf16 autocast) is rounded to out's dtype in registers, as the forward
    rounds it.
    """
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    r = tl.arange(0, BLOCK_R)
    t_ok = t < T
    d_ok = d < D
    t64 = t.to(tl.int64)
    ok = t_ok[:, None] & (r < R)[None, :]
    row = tl.load(rows_ptr + t64[:, None] * R + r[None, :], mask=ok, other=0).to(tl.int64)
    ok = ok & (row < V)  # class V: a pair of zero gradient
    g = tl.load(g_cand_ptr + t64[:, None] * R + r[None, :], mask=ok, other=0.0)
    w = tl.load(
        weight_ptr + row[:, :, None] * stride_weight + d[None, None, :],
        mask=ok[:, :, None] & d_ok[None, None, :],
        other=0.0,
    ).to(out_ptr.dtype.element_ty).to(tl.float32)
    acc = tl.sum(w * g[:, :, None], axis=1)
    out_ok = t_ok[:, None] & d_ok[None, :]
    if HAS_BASE:
        acc += tl.load(base_ptr + t64[:, None] * stride_base + d[None, :], mask=out_ok, other=0.0).to(tl.float32)
    acc *= tl.load(gscale_ptr + t64 * stride_gscale, mask=t_ok, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptr + t64[:, None] * stride_out + d[None, :], acc.to(out_ptr.dtype.element_ty), mask=out_ok)


@triton.jit
def candidate_long_runs_kernel(
    hidden_ptr, order_ptr, keys_ptr, starts_ptr, g_cand_ptr, gscale_ptr, partial_ptr, partial_bias_ptr,
    P, D, R, V,
    stride_hidden, stride_gscale,
    HAS_BIAS: tl.constexpr, RUN: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """The long runs' overflow, before :func:`candidate_grad_weight_kernel`: chunk c = pid(0) of the P sorted pairs
    (positions c * RUN ..) sums gscale[t] g_cand[t, r] hidden[t] over its pairs that lie RUN or more pairs into their
    class's run into partial[c] (D,) float32, and with HAS_BIAS gscale g into partial_bias[c]. Such pairs belong to
    one class at most (a run's overflow starts RUN pairs after the run: two classes' overflows are more than RUN
    apart), so the weight-gradient kernel adds a long class's chunk rows in order: deterministic, no atomics, and
    a class drawn n times walks RUN pairs and n / RUN rows instead of n pairs. A chunk without overflow writes
    nothing (no class reads it). ``keys`` (P,) int32 are the pairs' sorted classes (V: a pair of zero gradient)."""
    c = tl.program_id(0)
    first = c * RUN  # int32: P < 2^31, checked at the launch
    k = tl.arange(0, BLOCK_K)
    over = tl.zeros((BLOCK_K,), dtype=tl.int32)
    for k0 in range(0, RUN, BLOCK_K):
        pos = first + k0 + k
        key = tl.load(keys_ptr + pos, mask=pos < P, other=V)
        start = tl.load(starts_ptr + key, mask=key < V, other=0)
        over = tl.maximum(over, ((key < V) & (pos - start >= RUN)).to(tl.int32))
    if tl.max(over, axis=0) > 0:
        j = tl.arange(0, BLOCK_P)
        acc_b = tl.zeros((BLOCK_P,), dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            d = d0 + tl.arange(0, BLOCK_D)
            d_ok = d < D
            acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
            for k0 in range(0, RUN, BLOCK_P):
                pos = first + k0 + j
                key = tl.load(keys_ptr + pos, mask=pos < P, other=V)
                ok = key < V
                ok = ok & (pos - tl.load(starts_ptr + key, mask=ok, other=0) >= RUN)
                src = tl.load(order_ptr + pos, mask=ok, other=0).to(tl.int32)
                tok = src // R
                g = tl.load(g_cand_ptr + src, mask=ok, other=0.0)
                g *= tl.load(gscale_ptr + tok * stride_gscale, mask=ok, other=0.0).to(tl.float32)
                h = tl.load(hidden_ptr + tok[:, None] * stride_hidden + d[None, :], mask=ok[:, None] & d_ok[None, :],
                            other=0.0).to(tl.float32)
                acc += tl.sum(g[:, None] * h, axis=0)
                if d0 == 0:
                    acc_b += g
            tl.store(partial_ptr + c.to(tl.int64) * D + d, acc, mask=d_ok)
        if HAS_BIAS:
            tl.store(partial_bias_ptr + c, tl.sum(acc_b, axis=0))


@triton.jit
def candidate_grad_weight_kernel(
    hidden_ptr, order_ptr, starts_ptr, g_cand_ptr, gscale_ptr, grad_table_ptr, grad_static_ptr, bucket_ptr,
    member_ptr, static_ptr, partial_ptr, partial_bias_ptr, grad_weight_ptr, grad_bias_ptr,
    V, D, R,
    stride_hidden, stride_gscale, stride_grad_table, stride_grad_weight,
    HAS_BIAS: tl.constexpr, HAS_TABLE: tl.constexpr, HAS_STATIC: tl.constexpr, LONG_RUNS: tl.constexpr,
    RUN: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """grad_weight[v] = member[v] G[bucket[v]] + static[v] G[B] + sum over the (t, r) pairs of class v of
    gscale[t] g_cand[t, r] hidden[t]; one program per BLOCK_V classes, over all of D.

    The T R pairs come sorted by class: ``order`` (T R,) their flat t * R + r, ``starts`` (V + 1,) int32 where
    each class's run begins (found once, outside). The pairs' offsets are int32 (T R and T D below 2^31, checked
    at the launch): at the sm_90 tile that took the kernel from 255 registers and a spill to ~120 (cuobjdump). With HAS_TABLE the tail's spread starts each row: G the
    (B + 1, D) float32 gradient of the weight's bucket table (``grad_static`` its row B), ``bucket`` (V,) int64,
    ``member`` and ``static``
    (V,) float32 (static only with HAS_STATIC). For each D tile the program walks its classes' runs side by
    side, BLOCK_P pairs of each class a step (as many steps as its longest run), and adds g * hidden row into
    a float32 accumulator: every row of grad_weight (zeros included) is written exactly once, no atomics, no
    search. grad_bias (the candidates' part only: the table's stays outside) from one more walk of g.

    With LONG_RUNS a class walks at most RUN pairs of its run; the rest comes as the rows of ``partial`` (and
    ``partial_bias``) that :func:`candidate_long_runs_kernel` wrote for its chunks of RUN sorted pairs: a tail
    class drawn thousands of times (a popular bucket) is not one program's serial walk. The table's static row
    comes as its own pointer: B * stride in int32 passed 2^31 at K^2 = B = 262,144 buckets of D = 8,192.
    """
    v = tl.program_id(0) * BLOCK_V + tl.arange(0, BLOCK_V)
    v_ok = v < V
    v64 = v.to(tl.int64)
    start = tl.load(starts_ptr + v, mask=v_ok, other=0)
    count = tl.load(starts_ptr + v + 1, mask=v_ok, other=0) - start  # 0 past V
    if LONG_RUNS:
        # The chunk rows c0 .. of a long run's overflow: positions start + RUN .. start + count - 1.
        chunk0 = (start + RUN) // RUN
        chunks = tl.where(count > RUN, (start + count - 1) // RUN - chunk0 + 1, 0)
        chunk_steps = tl.max(chunks, axis=0)
        count = tl.minimum(count, RUN)
    steps = tl.max(count, axis=0)
    j = tl.arange(0, BLOCK_P)
    if HAS_TABLE:
        row = tl.load(bucket_ptr + v64, mask=v_ok, other=0)
        member = tl.load(member_ptr + v64, mask=v_ok, other=0.0)
        if HAS_STATIC:
            static = tl.load(static_ptr + v64, mask=v_ok, other=0.0)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        d_ok = d < D
        out_ok = v_ok[:, None] & d_ok[None, :]
        if HAS_TABLE:
            acc = member[:, None] * tl.load(
                grad_table_ptr + row[:, None] * stride_grad_table + d[None, :], mask=out_ok, other=0.0
            )
            if HAS_STATIC:
                acc += static[:, None] * tl.load(grad_static_ptr + d, mask=d_ok, other=0.0)[None, :]
        else:
            acc = tl.zeros((BLOCK_V, BLOCK_D), dtype=tl.float32)
        for k0 in range(0, steps, BLOCK_P):
            ok = (k0 + j)[None, :] < count[:, None]  # (BLOCK_V, BLOCK_P)
            src = tl.load(order_ptr + start[:, None] + k0 + j[None, :], mask=ok, other=0).to(tl.int32)
            tok = src // R
            g = tl.load(g_cand_ptr + src, mask=ok, other=0.0)
            g *= tl.load(gscale_ptr + tok * stride_gscale, mask=ok, other=0.0).to(tl.float32)
            h = tl.load(
                hidden_ptr + tok[:, :, None] * stride_hidden + d[None, None, :],
                mask=ok[:, :, None] & d_ok[None, None, :],
                other=0.0,
            ).to(tl.float32)
            acc += tl.sum(g[:, :, None] * h, axis=1)
        if LONG_RUNS:
            for c in range(0, chunk_steps):
                c_ok = c < chunks
                acc += tl.load(partial_ptr + (chunk0 + c).to(tl.int64)[:, None] * D + d[None, :],
                               mask=c_ok[:, None] & d_ok[None, :], other=0.0)
        tl.store(
            grad_weight_ptr + v64[:, None] * stride_grad_weight + d[None, :],
            acc.to(grad_weight_ptr.dtype.element_ty),
            mask=out_ok,
        )
    if HAS_BIAS:
        acc_b = tl.zeros((BLOCK_V,), dtype=tl.float32)
        for k0 in range(0, steps, BLOCK_P):
            ok = (k0 + j)[None, :] < count[:, None]
            src = tl.load(order_ptr + start[:, None] + k0 + j[None, :], mask=ok, other=0).to(tl.int32)
            g = tl.load(g_cand_ptr + src, mask=ok, other=0.0)
            g *= tl.load(gscale_ptr + (src // R) * stride_gscale, mask=ok, other=0.0).to(tl.float32)
            acc_b += tl.sum(g, axis=1)
        if LONG_RUNS:
            for c in range(0, chunk_steps):
                acc_b += tl.load(partial_bias_ptr + chunk0 + c, mask=c < chunks, other=0.0)
        tl.store(grad_bias_ptr + v64, acc_b.to(grad_bias_ptr.dtype.element_ty), mask=v_ok)
