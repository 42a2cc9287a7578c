"""Triton kernels for bitfield attention.

Never import this module directly: ``kernel_loader.kernels(interpret)`` loads a
private copy of it with Triton's interpreter switched on or off, because
``@triton.jit`` decides between compiled and interpreted code when the
decorator runs, not when the kernel is launched.

Layouts: q/k/v/o/do/dq/dk/dv are [b, s, heads, d] with arbitrary strides
(last dim contiguous); masks, positions and document ids are contiguous
[b, s] int64; lse and delta are contiguous [b, hq, s_q] fp32. Tiles are
(BLOCK_M queries) x (BLOCK_N keys); the block plan lists, per query block, its
non-empty key blocks, the partial ones (per-element mask needed) before the full
ones, and how many are partial; and the transposed lists for the dK/dV kernel.

Specialisation at compile time (each is a `tl.constexpr`, so a kernel compiles
once per combination actually used):
* full and partial tiles run in two loops of one inlined tile function, with
  `MASKED` True or False: a full tile loads no mask bits, builds no mask and
  guards no empty row;
* `HEAD_DIM` is a constant, and `D_EVEN` (head_dim equals the padded BLOCK_D),
  `M_EVEN` / `N_EVEN` (the sequence lengths are multiples of the tiles) drop
  the bounds masks of loads and stores where they hold. A full tile's keys and
  queries are all in range (FULL means every pair is in range and allowed), so
  its loads never need row masks.
The dK/dV kernel works in the transposed orientation (S^T = K Q^T), so P^T and
dS^T come out of the MMAs in the shape the next MMA consumes: no transposes of
computed tiles inside its loop (only of loaded tiles, which the compiler folds
into how it stages them).
The backward's programs are `_dkdv_program` and `_dq_program`, launched either
by their own kernels (two launches) or together by `bwd_kernel` (one launch);
`bwd_delta_kernel` computes the delta both read.
"""

import triton
import triton.language as tl

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@triton.jit
def _dot(a, b, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    # UPCAST is set under Triton's CPU interpreter, whose tl.dot returns garbage for
    # bfloat16 operands (triton 3.7); operands are already rounded to their dtype, so
    # an fp32 product matches what the GPU's bf16 MMA with fp32 accumulation computes.
    if UPCAST:
        r = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif IEEE:
        r = tl.dot(a, b, input_precision="ieee")
    else:
        r = tl.dot(a, b)
    return r


@triton.jit
def _allowed(qm, qp, qd, km, kp, kd, HAS_DOC: tl.constexpr):
    # qm/qp/qd: [M, 1]; km/kp/kd: [1, N]. The mask contract (docs/attention.md), bit for bit.
    q_low = qm & 0x3FFFFFFFFFFFFFFF
    k_low = km & 0x3FFFFFFFFFFFFFFF
    causal_ok = (kp <= qp) & ((q_low & k_low) != 0)
    bidir_ok = (q_low == k_low) & (q_low != 0)
    ok = tl.where((qm >> 62) != 0, causal_ok, bidir_ok)
    if HAS_DOC:
        ok = ok & (qd == kd)
    return ok


@triton.jit
def _load(ptr, rows_in, d_in, ROWS_EVEN: tl.constexpr, D_EVEN: tl.constexpr):
    """A [rows, BLOCK_D] tile; bounds masks only where the sizes do not divide."""
    if ROWS_EVEN:
        if D_EVEN:
            t = tl.load(ptr)
        else:
            t = tl.load(ptr, mask=d_in[None, :], other=0.0)
    else:
        if D_EVEN:
            t = tl.load(ptr, mask=rows_in[:, None], other=0.0)
        else:
            t = tl.load(ptr, mask=rows_in[:, None] & d_in[None, :], other=0.0)
    return t


@triton.jit
def _load_t(ptr, rows_in, d_in, ROWS_EVEN: tl.constexpr, D_EVEN: tl.constexpr):
    """A [BLOCK_D, rows] tile (a transposed view of the rows)."""
    if ROWS_EVEN:
        if D_EVEN:
            t = tl.load(ptr)
        else:
            t = tl.load(ptr, mask=d_in[:, None], other=0.0)
    else:
        if D_EVEN:
            t = tl.load(ptr, mask=rows_in[None, :], other=0.0)
        else:
            t = tl.load(ptr, mask=d_in[:, None] & rows_in[None, :], other=0.0)
    return t


@triton.jit
def _store(ptr, value, rows_in, d_in, ROWS_EVEN: tl.constexpr, D_EVEN: tl.constexpr):
    if ROWS_EVEN:
        if D_EVEN:
            tl.store(ptr, value)
        else:
            tl.store(ptr, value, mask=d_in[None, :])
    else:
        if D_EVEN:
            tl.store(ptr, value, mask=rows_in[:, None])
        else:
            tl.store(ptr, value, mask=rows_in[:, None] & d_in[None, :])


@triton.jit
def _load_vec(ptr, rows_in, ROWS_EVEN: tl.constexpr, other):
    if ROWS_EVEN:
        x = tl.load(ptr)
    else:
        x = tl.load(ptr, mask=rows_in, other=other)
    return x


@triton.jit
def _mask_vecs(M, P, D, base, offs, rows_in, ROWS_EVEN: tl.constexpr, HAS_DOC: tl.constexpr):
    """Mask bits, positions and document ids of a run of tokens. Without document ids the positions
    stand in for them (`_allowed` does not read them then)."""
    m = _load_vec(M + base + offs, rows_in, ROWS_EVEN, 0)
    p = _load_vec(P + base + offs, rows_in, ROWS_EVEN, 0)
    if HAS_DOC:
        d = _load_vec(D + base + offs, rows_in, ROWS_EVEN, 0)
    else:
        d = p
    return m, p, d


@triton.jit
def _work_and_head(n_heads, HEADS_FASTEST: tl.constexpr):
    """This program's work index (into the launch's list of items, columns or rows, longest first)
    and head. HEADS_FASTEST: a 1-D grid in which the heads of one work index are neighbours, so the
    launch order is longest first over every head at once; else a 2-D grid (work, head), so each
    head's work runs longest first in turn."""
    if HEADS_FASTEST:
        w = tl.program_id(0) // n_heads
        h = tl.program_id(0) % n_heads
    else:
        w = tl.program_id(0)
        h = tl.program_id(1)
    return w, h


@triton.jit
def classify_kernel(
    QM, QP, QD, KM, KP, KD, STATUS, s_q, s_k, n_qb, n_kb,
    HAS_DOC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """STATUS[b, qb, kb] = 0 empty, 1 partial, 2 full (every pair in range and allowed). Grid (n_qb * n_kb, b):
    the tile pairs on axis 0, whose limit is 2**31 - 1 (axes 1 and 2 allow 65535 programs)."""
    qb = tl.program_id(0) // n_kb
    kb = tl.program_id(0) % n_kb
    bi = tl.program_id(1).to(tl.int64)
    offs_m = qb * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = kb * BLOCK_N + tl.arange(0, BLOCK_N)
    m_in = offs_m < s_q
    n_in = offs_n < s_k
    qm, qp, qd = _mask_vecs(QM, QP, QD, bi * s_q, offs_m, m_in, False, HAS_DOC)
    km, kp, kd = _mask_vecs(KM, KP, KD, bi * s_k, offs_n, n_in, False, HAS_DOC)
    ok = _allowed(qm[:, None], qp[:, None], qd[:, None], km[None, :], kp[None, :], kd[None, :], HAS_DOC)
    ok = ok & m_in[:, None] & n_in[None, :]
    n_ok = tl.sum(ok.to(tl.int32), axis=1)
    n_ok = tl.sum(n_ok, axis=0)
    status = tl.where(n_ok == 0, 0, tl.where(n_ok == BLOCK_M * BLOCK_N, 2, 1))
    tl.store(STATUS + (bi * n_qb + qb) * n_kb + kb, status.to(tl.int8))


@triton.jit
def _key_tile(q, qm, qp, qd, m_in, K, V, KM, KP, KD, kb, bi, hk, s_k, skb, sks, skh, svb, svs, svh, scale_log2,
              offs_d, d_in, MASKED: tl.constexpr, HAS_DOC: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
              BLOCK_N: tl.constexpr, D_EVEN: tl.constexpr, N_EVEN: tl.constexpr):
    """Key block kb of head hk against one query block: its K and V tiles and the scores in base 2,
    -inf where the mask forbids a pair (partial tiles only: a full tile allows every pair)."""
    offs_n = kb * BLOCK_N + tl.arange(0, BLOCK_N)
    n_in = offs_n < s_k
    k = _load(K + bi * skb + hk * skh + offs_n.to(tl.int64)[:, None] * sks + offs_d[None, :], n_in, d_in,
              N_EVEN, D_EVEN)
    v = _load(V + bi * svb + hk * svh + offs_n.to(tl.int64)[:, None] * svs + offs_d[None, :], n_in, d_in,
              N_EVEN, D_EVEN)
    s = _dot(q, tl.trans(k), IEEE, UPCAST) * scale_log2
    if MASKED:
        km, kp, kd = _mask_vecs(KM, KP, KD, bi * s_k, offs_n, n_in, N_EVEN, HAS_DOC)
        ok = _allowed(qm[:, None], qp[:, None], qd[:, None], km[None, :], kp[None, :], kd[None, :], HAS_DOC)
        ok = ok & m_in[:, None] & n_in[None, :]
        s = tl.where(ok, s, float("-inf"))
    return k, v, s


@triton.jit
def _fwd_tiles(acc, m_i, l_i, q, qm, qp, qd, m_in, K, V, KM, KP, KD, KV_IDX, list_base, t0, t1,
               bi, hk, s_k, skb, sks, skh, svb, svs, svh, scale_log2, offs_d, d_in,
               MASKED: tl.constexpr, HAS_DOC: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
               BLOCK_N: tl.constexpr, D_EVEN: tl.constexpr, N_EVEN: tl.constexpr):
    """Online softmax over the listed key tiles t0..t1-1 of one query block (all partial, or all full)."""
    for t in range(t0, t1):
        kb = tl.load(KV_IDX + list_base + t)
        k, v, s = _key_tile(q, qm, qp, qd, m_in, K, V, KM, KP, KD, kb, bi, hk, s_k, skb, sks, skh, svb, svs, svh,
                            scale_log2, offs_d, d_in, MASKED, HAS_DOC, IEEE, UPCAST, BLOCK_N, D_EVEN, N_EVEN)
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        if MASKED:
            # Rows that have seen no allowed key yet keep m = -inf; shift by 0 so exp2 gives 0, not NaN.
            m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_shift = m_new  # a full tile gives every row an allowed key: m_new is finite
        p = tl.math.exp2(s - m_shift[:, None])
        alpha = tl.math.exp2(m_i - m_shift)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        pv = _dot(p.to(v.dtype), v, IEEE, UPCAST)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def fwd_kernel(
    Q, K, V, O, LSE, PART_O, PART_LSE,
    QM, QP, QD, KM, KP, KD,
    ITEM_ROW, ITEM_START, ITEM_LEN, ITEM_SLOT, KV_IDX, KV_NPART,
    scale_log2, s_q, s_k, n_qb, n_kb, hq, group,
    sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sob, sos, soh,
    HAS_DOC: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
    D_EVEN: tl.constexpr, M_EVEN: tl.constexpr, N_EVEN: tl.constexpr, HEADS_FASTEST: tl.constexpr,
):
    """One work item = one query block x a run of its non-empty key blocks (list positions
    ITEM_START .. + ITEM_LEN; the row's first KV_NPART are partial).

    Items covering a whole row write O and LSE directly; split rows write a
    normalised partial output and its lse into slot ITEM_SLOT for merge_kernel.
    """
    item, h = _work_and_head(hq, HEADS_FASTEST)
    row = tl.load(ITEM_ROW + item)
    start = tl.load(ITEM_START + item)
    end = start + tl.load(ITEM_LEN + item)
    npart = tl.load(KV_NPART + row)
    slot = tl.load(ITEM_SLOT + item)
    bi = (row // n_qb).to(tl.int64)
    qb = row % n_qb
    hk = h // group

    offs_m = qb * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_in = offs_m < s_q
    d_in = offs_d < HEAD_DIM
    q = _load(Q + bi * sqb + h * sqh + offs_m.to(tl.int64)[:, None] * sqs + offs_d[None, :], m_in, d_in,
              M_EVEN, D_EVEN)
    qm, qp, qd = _mask_vecs(QM, QP, QD, bi * s_q, offs_m, m_in, M_EVEN, HAS_DOC)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    list_base = row.to(tl.int64) * n_kb
    acc, m_i, l_i = _fwd_tiles(acc, m_i, l_i, q, qm, qp, qd, m_in, K, V, KM, KP, KD, KV_IDX, list_base,
                               start, tl.minimum(end, npart), bi, hk, s_k, skb, sks, skh, svb, svs, svh,
                               scale_log2, offs_d, d_in, True, HAS_DOC, IEEE, UPCAST, BLOCK_N, D_EVEN, N_EVEN)
    acc, m_i, l_i = _fwd_tiles(acc, m_i, l_i, q, qm, qp, qd, m_in, K, V, KM, KP, KD, KV_IDX, list_base,
                               tl.maximum(start, npart), end, bi, hk, s_k, skb, sks, skh, svb, svs, svh,
                               scale_log2, offs_d, d_in, False, HAS_DOC, IEEE, UPCAST, BLOCK_N, D_EVEN, True)

    has_key = l_i > 0.0
    l_safe = tl.where(has_key, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(has_key, (m_i + tl.math.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    if slot < 0:
        _store(O + bi * sob + h * soh + offs_m.to(tl.int64)[:, None] * sos + offs_d[None, :],
               out.to(O.dtype.element_ty), m_in, d_in, M_EVEN, D_EVEN)
        if M_EVEN:
            tl.store(LSE + (bi * hq + h) * s_q + offs_m, lse)
        else:
            tl.store(LSE + (bi * hq + h) * s_q + offs_m, lse, mask=m_in)
    else:
        part = slot.to(tl.int64) * hq + h
        tl.store(PART_O + part * BLOCK_M * BLOCK_D + tl.arange(0, BLOCK_M)[:, None] * BLOCK_D + offs_d[None, :], out)
        tl.store(PART_LSE + part * BLOCK_M + tl.arange(0, BLOCK_M), lse)


@triton.jit
def merge_kernel(
    O, LSE, PART_O, PART_LSE, AGG_ROW, AGG_SLOT, AGG_LEN,
    s_q, n_qb, hq, sob, sos, soh,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    """Merge the partial outputs of one split query block (one program per row and head)."""
    agg = tl.program_id(0)
    h = tl.program_id(1)
    row = tl.load(AGG_ROW + agg)
    first = tl.load(AGG_SLOT + agg)
    n_parts = tl.load(AGG_LEN + agg)
    bi = (row // n_qb).to(tl.int64)
    qb = row % n_qb
    r = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)

    lse_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for c in range(0, n_parts):
        part = (first + c).to(tl.int64) * hq + h
        lse_max = tl.maximum(lse_max, tl.load(PART_LSE + part * BLOCK_M + r))
    shift = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    wsum = tl.zeros([BLOCK_M], tl.float32)
    for c in range(0, n_parts):
        part = (first + c).to(tl.int64) * hq + h
        w = tl.exp(tl.load(PART_LSE + part * BLOCK_M + r) - shift)
        o = tl.load(PART_O + part * BLOCK_M * BLOCK_D + r[:, None] * BLOCK_D + offs_d[None, :])
        acc += w[:, None] * o
        wsum += w
    has_key = wsum > 0.0
    w_safe = tl.where(has_key, wsum, 1.0)
    out = acc / w_safe[:, None]
    lse = tl.where(has_key, shift + tl.log(w_safe), float("-inf"))
    offs_m = qb * BLOCK_M + r
    m_in = offs_m < s_q
    o_ptr = O + bi * sob + h * soh + offs_m.to(tl.int64)[:, None] * sos + offs_d[None, :]
    tl.store(o_ptr, out.to(O.dtype.element_ty), mask=m_in[:, None] & (offs_d < HEAD_DIM)[None, :])
    tl.store(LSE + (bi * hq + h) * s_q + offs_m, lse, mask=m_in)


@triton.jit
def _dkdv_tiles(dk, dv, k, v, km, kp, kd, n_in, Q, DO, LSE, DELTA, QM, QP, QD, Q_IDX, list_base, t0, t1,
                bi, h, hq, s_q, sqb, sqs, sqh, sdob, sdos, sdoh, scale_log2, offs_d, d_in,
                MASKED: tl.constexpr, HAS_DOC: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
                BLOCK_M: tl.constexpr, D_EVEN: tl.constexpr, M_EVEN: tl.constexpr):
    """dK, dV contributions of query head h over the listed query tiles t0..t1-1 of one key block,
    in the transposed orientation: S^T = K Q^T [N, M]."""
    for t in range(t0, t1):
        qb = tl.load(Q_IDX + list_base + t)
        offs_m = qb * BLOCK_M + tl.arange(0, BLOCK_M)
        m_in = offs_m < s_q
        q_t = _load_t(Q + bi * sqb + h * sqh + offs_m.to(tl.int64)[None, :] * sqs + offs_d[:, None],
                      m_in, d_in, M_EVEN, D_EVEN)                                        # [D, M]
        do = _load(DO + bi * sdob + h * sdoh + offs_m.to(tl.int64)[:, None] * sdos + offs_d[None, :],
                   m_in, d_in, M_EVEN, D_EVEN)                                           # [M, D]
        lse = _load_vec(LSE + (bi * hq + h) * s_q + offs_m, m_in, M_EVEN, 0.0)
        delta = _load_vec(DELTA + (bi * hq + h) * s_q + offs_m, m_in, M_EVEN, 0.0)
        s_t = _dot(k, q_t, IEEE, UPCAST)                                                  # [N, M]
        s_t = s_t * scale_log2
        if MASKED:
            # Rows with no allowed key have lse = -inf; every entry of theirs is masked,
            # so any finite shift keeps p at exactly 0.
            lse = tl.where(lse == float("-inf"), 0.0, lse)
            qm, qp, qd = _mask_vecs(QM, QP, QD, bi * s_q, offs_m, m_in, M_EVEN, HAS_DOC)
            ok = _allowed(qm[None, :], qp[None, :], qd[None, :], km[:, None], kp[:, None], kd[:, None], HAS_DOC)
            ok = ok & m_in[None, :] & n_in[:, None]
            s_t = tl.where(ok, s_t, float("-inf"))
        p_t = tl.math.exp2(s_t - (lse * 1.4426950408889634)[None, :])                    # [N, M]
        dv += _dot(p_t.to(do.dtype), do, IEEE, UPCAST)
        dp_t = _dot(v, tl.trans(do), IEEE, UPCAST)                                       # [N, M]
        ds_t = p_t * (dp_t - delta[None, :])
        dk += _dot(ds_t.to(q_t.dtype), tl.trans(q_t), IEEE, UPCAST)
    return dk, dv


@triton.jit
def _dkdv_program(
    col, hk, Q, K, V, DO, DK, DV, LSE, DELTA, QM, QP, QD, KM, KP, KD, Q_IDX, Q_NPART, Q_CNT,
    scale, scale_log2, s_q, s_k, n_qb, n_kb, hq, group,
    sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sdob, sdos, sdoh, sdkb, sdks, sdkh, sdvb, sdvs, sdvh,
    HAS_DOC: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
    D_EVEN: tl.constexpr, M_EVEN: tl.constexpr, N_EVEN: tl.constexpr,
):
    """dK, dV of key block `col` (flattened batch, key block) and kv head hk, summed over its query
    heads and non-empty query blocks inside the program: no atomics, so deterministic."""
    bi = (col // n_kb).to(tl.int64)
    kb = col % n_kb
    n_tiles = tl.load(Q_CNT + col)
    npart = tl.load(Q_NPART + col)

    offs_n = kb * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    n_in = offs_n < s_k
    d_in = offs_d < HEAD_DIM
    k = _load(K + bi * skb + hk * skh + offs_n.to(tl.int64)[:, None] * sks + offs_d[None, :], n_in, d_in,
              N_EVEN, D_EVEN)
    v = _load(V + bi * svb + hk * svh + offs_n.to(tl.int64)[:, None] * svs + offs_d[None, :], n_in, d_in,
              N_EVEN, D_EVEN)
    km, kp, kd = _mask_vecs(KM, KP, KD, bi * s_k, offs_n, n_in, N_EVEN, HAS_DOC)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    list_base = col.to(tl.int64) * n_qb
    for g in range(0, group):
        h = hk * group + g
        dk, dv = _dkdv_tiles(dk, dv, k, v, km, kp, kd, n_in, Q, DO, LSE, DELTA, QM, QP, QD, Q_IDX, list_base,
                             0, npart, bi, h, hq, s_q, sqb, sqs, sqh, sdob, sdos, sdoh, scale_log2, offs_d, d_in,
                             True, HAS_DOC, IEEE, UPCAST, BLOCK_M, D_EVEN, M_EVEN)
        dk, dv = _dkdv_tiles(dk, dv, k, v, km, kp, kd, n_in, Q, DO, LSE, DELTA, QM, QP, QD, Q_IDX, list_base,
                             npart, n_tiles, bi, h, hq, s_q, sqb, sqs, sqh, sdob, sdos, sdoh, scale_log2, offs_d,
                             d_in, False, HAS_DOC, IEEE, UPCAST, BLOCK_M, D_EVEN, True)
    dk = dk * scale
    _store(DK + bi * sdkb + hk * sdkh + offs_n.to(tl.int64)[:, None] * sdks + offs_d[None, :],
           dk.to(DK.dtype.element_ty), n_in, d_in, N_EVEN, D_EVEN)
    _store(DV + bi * sdvb + hk * sdvh + offs_n.to(tl.int64)[:, None] * sdvs + offs_d[None, :],
           dv.to(DV.dtype.element_ty), n_in, d_in, N_EVEN, D_EVEN)


@triton.jit
def bwd_dkdv_kernel(
    Q, K, V, DO, DK, DV, LSE, DELTA,
    QM, QP, QD, KM, KP, KD,
    COLS, Q_IDX, Q_NPART, Q_CNT,
    scale, scale_log2, s_q, s_k, n_qb, n_kb, hq, group,
    sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sdob, sdos, sdoh,
    sdkb, sdks, sdkh, sdvb, sdvs, sdvh,
    HAS_DOC: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
    D_EVEN: tl.constexpr, M_EVEN: tl.constexpr, N_EVEN: tl.constexpr, HEADS_FASTEST: tl.constexpr,
):
    """dK, dV: one program per listed key block (COLS) and kv head."""
    c, hk = _work_and_head(hq // group, HEADS_FASTEST)
    _dkdv_program(tl.load(COLS + c), hk, Q, K, V, DO, DK, DV, LSE, DELTA,
                  QM, QP, QD, KM, KP, KD, Q_IDX, Q_NPART, Q_CNT, scale, scale_log2, s_q, s_k, n_qb, n_kb, hq, group,
                  sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sdob, sdos, sdoh, sdkb, sdks, sdkh, sdvb, sdvs, sdvh,
                  HAS_DOC, IEEE, UPCAST, BLOCK_M, BLOCK_N, BLOCK_D, HEAD_DIM, D_EVEN, M_EVEN, N_EVEN)


@triton.jit
def _dq_tiles(dq, q, do, lse, delta, qm, qp, qd, m_in, K, V, KM, KP, KD, KV_IDX, list_base, t0, t1,
              bi, hk, s_k, skb, sks, skh, svb, svs, svh, scale_log2, offs_d, d_in,
              MASKED: tl.constexpr, HAS_DOC: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
              BLOCK_N: tl.constexpr, D_EVEN: tl.constexpr, N_EVEN: tl.constexpr):
    """dQ contributions of the listed key tiles t0..t1-1 of one query block."""
    for t in range(t0, t1):
        kb = tl.load(KV_IDX + list_base + t)
        k, v, s = _key_tile(q, qm, qp, qd, m_in, K, V, KM, KP, KD, kb, bi, hk, s_k, skb, sks, skh, svb, svs, svh,
                            scale_log2, offs_d, d_in, MASKED, HAS_DOC, IEEE, UPCAST, BLOCK_N, D_EVEN, N_EVEN)
        dp = _dot(do, tl.trans(v), IEEE, UPCAST)
        p = tl.math.exp2(s - lse[:, None])
        ds = p * (dp - delta[:, None])
        dq += _dot(ds.to(k.dtype), k, IEEE, UPCAST)
    return dq


@triton.jit
def _dq_program(
    row, h, Q, K, V, DO, DQ, LSE, DELTA, QM, QP, QD, KM, KP, KD, KV_IDX, KV_NPART, KV_CNT,
    scale, scale_log2, s_q, s_k, n_qb, n_kb, hq, group,
    sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sdob, sdos, sdoh, sdqb, sdqs, sdqh,
    HAS_DOC: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
    D_EVEN: tl.constexpr, M_EVEN: tl.constexpr, N_EVEN: tl.constexpr,
):
    """dQ of query block `row` (flattened batch, query block) and query head h over its non-empty
    key blocks."""
    hk = h // group
    bi = (row // n_qb).to(tl.int64)
    qb = row % n_qb
    n_tiles = tl.load(KV_CNT + row)
    npart = tl.load(KV_NPART + row)

    offs_m = qb * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_in = offs_m < s_q
    d_in = offs_d < HEAD_DIM
    q = _load(Q + bi * sqb + h * sqh + offs_m.to(tl.int64)[:, None] * sqs + offs_d[None, :], m_in, d_in,
              M_EVEN, D_EVEN)
    do = _load(DO + bi * sdob + h * sdoh + offs_m.to(tl.int64)[:, None] * sdos + offs_d[None, :], m_in, d_in,
               M_EVEN, D_EVEN)
    lse = _load_vec(LSE + (bi * hq + h) * s_q + offs_m, m_in, M_EVEN, 0.0)
    # Rows with no allowed key have lse = -inf; every entry of theirs is masked (they have only
    # partial tiles), so any finite shift keeps p at exactly 0.
    lse = tl.where(lse == float("-inf"), 0.0, lse) * 1.4426950408889634
    delta = _load_vec(DELTA + (bi * hq + h) * s_q + offs_m, m_in, M_EVEN, 0.0)
    qm, qp, qd = _mask_vecs(QM, QP, QD, bi * s_q, offs_m, m_in, M_EVEN, HAS_DOC)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    list_base = row.to(tl.int64) * n_kb
    dq = _dq_tiles(dq, q, do, lse, delta, qm, qp, qd, m_in, K, V, KM, KP, KD, KV_IDX, list_base, 0, npart,
                   bi, hk, s_k, skb, sks, skh, svb, svs, svh, scale_log2, offs_d, d_in,
                   True, HAS_DOC, IEEE, UPCAST, BLOCK_N, D_EVEN, N_EVEN)
    dq = _dq_tiles(dq, q, do, lse, delta, qm, qp, qd, m_in, K, V, KM, KP, KD, KV_IDX, list_base, npart, n_tiles,
                   bi, hk, s_k, skb, sks, skh, svb, svs, svh, scale_log2, offs_d, d_in,
                   False, HAS_DOC, IEEE, UPCAST, BLOCK_N, D_EVEN, True)
    dq = dq * scale
    _store(DQ + bi * sdqb + h * sdqh + offs_m.to(tl.int64)[:, None] * sdqs + offs_d[None, :],
           dq.to(DQ.dtype.element_ty), m_in, d_in, M_EVEN, D_EVEN)


@triton.jit
def bwd_dq_kernel(
    Q, K, V, DO, DQ, LSE, DELTA,
    QM, QP, QD, KM, KP, KD,
    ROWS, KV_IDX, KV_NPART, KV_CNT,
    scale, scale_log2, s_q, s_k, n_qb, n_kb, hq, group,
    sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sdob, sdos, sdoh, sdqb, sdqs, sdqh,
    HAS_DOC: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
    D_EVEN: tl.constexpr, M_EVEN: tl.constexpr, N_EVEN: tl.constexpr, HEADS_FASTEST: tl.constexpr,
):
    """dQ: one program per listed query block (ROWS) and query head."""
    r, h = _work_and_head(hq, HEADS_FASTEST)
    _dq_program(tl.load(ROWS + r), h, Q, K, V, DO, DQ, LSE, DELTA,
                QM, QP, QD, KM, KP, KD, KV_IDX, KV_NPART, KV_CNT, scale, scale_log2, s_q, s_k, n_qb, n_kb, hq, group,
                sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sdob, sdos, sdoh, sdqb, sdqs, sdqh,
                HAS_DOC, IEEE, UPCAST, BLOCK_M, BLOCK_N, BLOCK_D, HEAD_DIM, D_EVEN, M_EVEN, N_EVEN)


@triton.jit
def bwd_kernel(
    Q, K, V, DO, DQ, DK, DV, LSE, DELTA,
    QM, QP, QD, KM, KP, KD,
    COLS, Q_IDX, Q_NPART, Q_CNT, ROWS, KV_IDX, KV_NPART, KV_CNT,
    n_cols, scale, scale_log2, s_q, s_k, n_qb, n_kb, dq_n_qb, dq_n_kb, hq, group,
    sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sdob, sdos, sdoh,
    sdqb, sdqs, sdqh, sdkb, sdks, sdkh, sdvb, sdvs, sdvh,
    HAS_DOC: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr, BLOCK_D: tl.constexpr,
    HEAD_DIM: tl.constexpr, D_EVEN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, M_EVEN: tl.constexpr, N_EVEN: tl.constexpr,
    DQ_BLOCK_M: tl.constexpr, DQ_BLOCK_N: tl.constexpr, DQ_M_EVEN: tl.constexpr, DQ_N_EVEN: tl.constexpr,
    HEADS_FASTEST: tl.constexpr,
):
    """The whole backward in one launch (KernelConfig.fused_backward): the dK/dV kernel's programs
    (its plan's tiles BLOCK_M x BLOCK_N), then the dQ kernel's (DQ_BLOCK_M x DQ_BLOCK_N). On a 2-D
    grid, per kv head (axis 1): its n_cols dK/dV programs, then the dQ programs of its group's query
    heads, side by side. On a 1-D grid (HEADS_FASTEST): the n_cols x kv heads dK/dV programs, then
    the query blocks x query heads dQ programs, heads fastest in each. The dQ programs fill the GPU
    while the last dK/dV programs finish, instead of starting after a second launch's drain; each
    program computes exactly what the two-kernel backward's does."""
    pid = tl.program_id(0)
    if HEADS_FASTEST:
        n_dkdv = n_cols * (hq // group)
    else:
        n_dkdv = n_cols
    if pid < n_dkdv:
        if HEADS_FASTEST:
            col, hk = pid // (hq // group), pid % (hq // group)
        else:
            col, hk = pid, tl.program_id(1)
        _dkdv_program(tl.load(COLS + col), hk, Q, K, V, DO, DK, DV, LSE, DELTA,
                      QM, QP, QD, KM, KP, KD, Q_IDX, Q_NPART, Q_CNT, scale, scale_log2, s_q, s_k, n_qb, n_kb, hq,
                      group, sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sdob, sdos, sdoh,
                      sdkb, sdks, sdkh, sdvb, sdvs, sdvh,
                      HAS_DOC, IEEE, UPCAST, BLOCK_M, BLOCK_N, BLOCK_D, HEAD_DIM, D_EVEN, M_EVEN, N_EVEN)
    else:
        j = pid - n_dkdv  # the dQ programs' own index
        if HEADS_FASTEST:
            row, h = j // hq, j % hq
        else:
            row, h = j // group, tl.program_id(1) * group + j % group
        _dq_program(tl.load(ROWS + row), h, Q, K, V, DO, DQ, LSE, DELTA,
                    QM, QP, QD, KM, KP, KD, KV_IDX, KV_NPART, KV_CNT, scale, scale_log2, s_q, s_k, dq_n_qb, dq_n_kb,
                    hq, group, sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sdob, sdos, sdoh, sdqb, sdqs, sdqh,
                    HAS_DOC, IEEE, UPCAST, DQ_BLOCK_M, DQ_BLOCK_N, BLOCK_D, HEAD_DIM, D_EVEN, DQ_M_EVEN, DQ_N_EVEN)


@triton.jit
def bwd_delta_kernel(
    O, DO, DLSE, DELTA, s_q, hq, sob, sos, soh, sdob, sdos, sdoh,
    HAS_DLSE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
    D_EVEN: tl.constexpr, M_EVEN: tl.constexpr,
):
    """delta[b, h, i] = sum_d dO * O (fp32) of BLOCK_M rows of one head, less dlse[b, h, i] when the
    lse output has a gradient: one read of O and dO, no fp32 copies of them. A 1-D grid over (batch,
    head, row block), row blocks fastest: no grid axis limits the batch."""
    n_mb = tl.cdiv(s_q, BLOCK_M)
    pid = tl.program_id(0)
    offs_m = (pid % n_mb) * BLOCK_M + tl.arange(0, BLOCK_M)
    h = (pid // n_mb) % hq
    bi = (pid // n_mb // hq).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    m_in = offs_m < s_q
    d_in = offs_d < HEAD_DIM
    o = _load(O + bi * sob + h * soh + offs_m.to(tl.int64)[:, None] * sos + offs_d[None, :], m_in, d_in,
              M_EVEN, D_EVEN)
    do = _load(DO + bi * sdob + h * sdoh + offs_m.to(tl.int64)[:, None] * sdos + offs_d[None, :], m_in, d_in,
               M_EVEN, D_EVEN)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    at = (bi * hq + h) * s_q + offs_m
    if HAS_DLSE:
        delta = delta - _load_vec(DLSE + at, m_in, M_EVEN, 0.0)
    if M_EVEN:
        tl.store(DELTA + at, delta)
    else:
        tl.store(DELTA + at, delta, mask=m_in)
