"""The Triton kernels behind mok_nn.triton_ops (imported on first use, where Triton is importable)."""

import triton
import triton.language as tl


@triton.jit
def fake_quantize_kernel(x_ptr, out_ptr, n_blocks, length, inner, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    # block b = (o, lb, i) with i fastest (inner > 1) or (o, lb) (inner == 1); element j of it at
    # o * length * inner + (lb * BLOCK + j) * inner + i
    b = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)
    i = b % inner
    lb = (b // inner) % (length // BLOCK)
    o = b // inner // (length // BLOCK)
    j = tl.arange(0, BLOCK).to(tl.int64)
    offs = (o * length * inner + lb * BLOCK * inner + i)[:, None] + (j * inner)[None, :]
    mask = (b < n_blocks)[:, None]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    bits = x.to(tl.int32, bitcast=True)
    sign = bits & -(2**31)
    mag_bits = bits ^ sign
    # amax over the block as the largest bit pattern (the sign cleared, int order is float order; a NaN's
    # pattern lies above inf's, and both give the biased exponent 255 the NaN rule below keys on)
    amax = tl.max(mag_bits, axis=1)
    biased = (amax >> 23) & 0xFF
    e = biased - (127 + 8) + ((amax & 0x7FFFFF) > 0x600000).to(tl.int32)
    e = tl.where(biased == 0, -127, e)
    e = tl.minimum(tl.maximum(e, -127), 127)
    down = ((127 - e) << 23).to(tl.float32, bitcast=True)  # 2**-e
    up = tl.where(e == -127, 1 << 22, (e + 127) << 23).to(tl.float32, bitcast=True)  # 2**e (2**-127 subnormal)
    up = tl.where(biased == 255, float("nan"), up)
    s = mag_bits.to(tl.float32, bitcast=True) * down[:, None]  # |s| = |x| * 2**-e, exact
    # C = 1.5 * 2**(max(E, -6) + 20) for |s|'s exponent E: (|s| + C) - C rounds |s| to E4M3's grid, ties to even
    c_bits = tl.maximum(s.to(tl.int32, bitcast=True) & 0x7F800000, (127 - 6) << 23) + ((20 << 23) | (1 << 22))
    c = c_bits.to(tl.float32, bitcast=True)
    rounded = (s + c) - c
    res = (rounded.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True) * up[:, None]
    tl.store(out_ptr + offs, res.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def activation_forward_kernel(gu_ptr, h_ptr, inter, limit, HAS_LIMIT: tl.constexpr, OAI: tl.constexpr,
                   ALPHA: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    for start in range(0, inter, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        m = cols < inter
        g = tl.load(gu_ptr + row * 2 * inter + cols, mask=m, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + row * 2 * inter + inter + cols, mask=m, other=0.0).to(tl.float32)
        if HAS_LIMIT:
            g = tl.minimum(g, limit)
            u = tl.minimum(tl.maximum(u, -limit), limit)
        if OAI:  # (u + 1) g sigmoid(alpha g)
            h = (u + 1.0) * g * (1.0 / (1.0 + tl.exp(-(g * ALPHA))))
        else:  # silu(g) u
            h = g / (1.0 + tl.exp(-g)) * u
        tl.store(h_ptr + row * inter + cols, h.to(h_ptr.dtype.element_ty), mask=m)

@triton.jit
def mlp_backward_rows_kernel(gu_ptr, dh_ptr, h_ptr, w_ptr, dw_ptr, wh_ptr, dgu_ptr, inter, limit,
                    HAS_LIMIT: tl.constexpr, OAI: tl.constexpr, ALPHA: tl.constexpr, WRITE_WH: tl.constexpr,
                    BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    w = tl.load(w_ptr + row).to(tl.float32)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, inter, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        m = cols < inter
        dh_raw = tl.load(dh_ptr + row * inter + cols, mask=m, other=0.0).to(tl.float32)
        h = tl.load(h_ptr + row * inter + cols, mask=m, other=0.0).to(tl.float32)
        acc += dh_raw * h
        if WRITE_WH:
            tl.store(wh_ptr + row * inter + cols, (w * h).to(wh_ptr.dtype.element_ty), mask=m)
        dh = dh_raw * w
        g = tl.load(gu_ptr + row * 2 * inter + cols, mask=m, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + row * 2 * inter + inter + cols, mask=m, other=0.0).to(tl.float32)
        if HAS_LIMIT:
            g_ok = g <= limit
            u_ok = (u >= -limit) & (u <= limit)
            g = tl.minimum(g, limit)
            u = tl.minimum(tl.maximum(u, -limit), limit)
        if OAI:
            sig = 1.0 / (1.0 + tl.exp(-(g * ALPHA)))
            d_act = ((g * ALPHA) * (1.0 - sig) + 1.0) * sig  # d/dg of g sigmoid(alpha g)
            d_gate = ((u + 1.0) * dh) * d_act
        else:
            sig = 1.0 / (1.0 + tl.exp(-g))
            d_act = ((1.0 - sig) * g + 1.0) * sig  # silu'(g)
            d_gate = (dh * u) * d_act
        d_up = (g * sig) * dh
        if HAS_LIMIT:  # times the masks, as the reference (a NaN stays NaN)
            d_gate = d_gate * g_ok.to(tl.float32)
            d_up = d_up * u_ok.to(tl.float32)
        tl.store(dgu_ptr + row * 2 * inter + cols, d_gate.to(dgu_ptr.dtype.element_ty), mask=m)
        tl.store(dgu_ptr + row * 2 * inter + inter + cols, d_up.to(dgu_ptr.dtype.element_ty), mask=m)
    tl.store(dw_ptr + row, tl.sum(acc, axis=0))


@triton.jit
def dequantize_kernel(data_ptr, scale_ptr, out_ptr, n_blocks, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    # data: E4M3 bytes, blocks of BLOCK consecutive ones, an E8M0 scale byte each; value * 2**(scale - 127) in fp32
    # (exact: 4 significant bits times a power of two), rounded once to out's dtype
    b = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)
    offs = b[:, None] * BLOCK + tl.arange(0, BLOCK).to(tl.int64)[None, :]
    in_range = b < n_blocks
    q = tl.load(data_ptr + offs, mask=in_range[:, None], other=0).to(tl.int32)
    s = tl.load(scale_ptr + b, mask=in_range, other=127).to(tl.int32)
    exp = (q >> 3) & 0xF
    man = q & 0x7
    normal = (((exp + 120) << 23) | (man << 20)).to(tl.float32, bitcast=True)  # 2**(exp - 7) * (1 + man / 8)
    mag = tl.where(exp == 0, man.to(tl.float32) * 0.001953125, normal)  # subnormals: man * 2**-9
    mag = tl.where((exp == 15) & (man == 7), float("nan"), mag)  # E4M3FN's only NaN (no inf)
    value = tl.where((q & 0x80) != 0, -mag, mag)
    factor = tl.where(s == 0, 1 << 22, s << 23).to(tl.float32, bitcast=True)  # 2**(s - 127); 2**-127 subnormal
    factor = tl.where(s == 255, float("nan"), factor)
    tl.store(out_ptr + offs, (value * factor[:, None]).to(out_ptr.dtype.element_ty), mask=in_range[:, None])


@triton.jit
def topk_kernel(v_ptr, ids_ptr, n_rows, n_cols, K: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    # ROWS rows per program, a whole row (n_cols <= BLOCK) in registers; K rounds of the largest key, the winner
    # then removed
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)
    c = tl.arange(0, BLOCK)
    live = r < n_rows
    mask = live[:, None] & (c < n_cols)[None, :]
    v = tl.load(v_ptr + r[:, None] * n_cols + c[None, :], mask=mask, other=0.0).to(tl.float32)
    bits = v.to(tl.int32, bitcast=True)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # int order = float order (negatives below the positives)
    key = tl.where(v == 0.0, 0, key)  # -0 equals +0
    key = tl.where(v != v, 0x7F800001, key)  # every NaN one key, above +inf's (0x7F800000)
    # unique keys: ties to the lower column by construction (whatever argmax does with equal values)
    key = key.to(tl.int64) * BLOCK + (BLOCK - 1 - c)[None, :]
    gone = -(2**63)  # padding and removed entries: below every value's key
    key = tl.where(mask, key, gone)
    for j in tl.static_range(K):
        best = tl.argmax(key, axis=1)
        tl.store(ids_ptr + r * K + j, best.to(tl.int64), mask=live)
        key = tl.where(c[None, :] == best[:, None], gone, key)


@triton.jit
def route_forward_kernel(logits_ptr, bias_ptr, ids_ptr, w_ptr, scores_ptr, n_rows, n_cols, scale, K: tl.constexpr,
                         KP: tl.constexpr, SOFTMAX: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr,
                         ROWS: tl.constexpr, BLOCK: tl.constexpr):
    # router.route for ROWS rows of fp32 logits: scores (softmax / sigmoid), the top-k of scores (+ bias) as
    # topk_kernel selects it, their scores as weights, renormalised and scaled
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)
    c = tl.arange(0, BLOCK)
    live = r < n_rows
    mask = live[:, None] & (c < n_cols)[None, :]
    x = tl.load(logits_ptr + r[:, None] * n_cols + c[None, :], mask=mask, other=-float("inf"))
    x = tl.where(live[:, None], x, 0.0)  # rows past the end: no NaN from an all -inf row
    if SOFTMAX:
        e = tl.exp(x - tl.max(x, axis=1)[:, None])
        s = e / tl.sum(e, axis=1)[:, None]
    else:
        s = 1.0 / (1.0 + tl.exp(-x))
    tl.store(scores_ptr + r[:, None] * n_cols + c[None, :], s, mask=mask)
    v = s
    if HAS_BIAS:
        v = s + tl.load(bias_ptr + c, mask=c < n_cols, other=0.0)[None, :]
    bits = v.to(tl.int32, bitcast=True)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    key = tl.where(v == 0.0, 0, key)
    key = tl.where(v != v, 0x7F800001, key)
    key = key.to(tl.int64) * BLOCK + (BLOCK - 1 - c)[None, :]
    gone = -(2**63)
    key = tl.where(mask, key, gone)
    j_col = tl.arange(0, KP)
    w = tl.zeros((ROWS, KP), dtype=tl.float32)
    for j in tl.static_range(K):
        best = tl.argmax(key, axis=1)
        tl.store(ids_ptr + r * K + j, best.to(tl.int64), mask=live)
        picked = c[None, :] == best[:, None]
        w = tl.where(j_col[None, :] == j, tl.sum(tl.where(picked, s, 0.0), axis=1)[:, None], w)
        key = tl.where(picked, gone, key)
    if NORM:
        w = w / (tl.sum(w, axis=1)[:, None] + 1e-20)
    w = w * scale
    tl.store(w_ptr + r[:, None] * K + j_col[None, :], w, mask=live[:, None] & (j_col < K)[None, :])


@triton.jit
def route_backward_kernel(scores_ptr, ids_ptr, dw_ptr, ds_ptr, dlogits_ptr, n_rows, n_cols, scale, K: tl.constexpr,
                          KP: tl.constexpr, SOFTMAX: tl.constexpr, HAS_DS: tl.constexpr, NORM: tl.constexpr,
                          ROWS: tl.constexpr, BLOCK: tl.constexpr):
    # d logits of route_forward_kernel from d weights [rows, K] and (HAS_DS) d scores [rows, E]: through the
    # scaling and renormalisation to the selected scores, then through softmax / sigmoid
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)
    c = tl.arange(0, BLOCK)
    live = r < n_rows
    mask = live[:, None] & (c < n_cols)[None, :]
    s = tl.load(scores_ptr + r[:, None] * n_cols + c[None, :], mask=mask, other=0.0)
    ds = tl.zeros((ROWS, BLOCK), dtype=tl.float32)
    if HAS_DS:
        ds = tl.load(ds_ptr + r[:, None] * n_cols + c[None, :], mask=mask, other=0.0)
    j_col = tl.arange(0, KP)
    kmask = live[:, None] & (j_col < K)[None, :]
    ids = tl.load(ids_ptr + r[:, None] * K + j_col[None, :], mask=kmask, other=-1)
    dw = tl.load(dw_ptr + r[:, None] * K + j_col[None, :], mask=kmask, other=0.0) * scale
    sel = tl.zeros((ROWS, KP), dtype=tl.float32)  # the selected scores
    for j in tl.static_range(K):
        id_j = tl.sum(tl.where(j_col[None, :] == j, ids, 0), axis=1)
        sel = tl.where(j_col[None, :] == j, tl.sum(tl.where(c[None, :] == id_j[:, None], s, 0.0), axis=1)[:, None],
                       sel)
    d_sel = dw
    if NORM:  # w = sel / (sum(sel) + eps): d sel_j = (dw_j - sum_k dw_k w_k) / (sum(sel) + eps)
        denom = tl.sum(sel, axis=1) + 1e-20
        d_sel = (dw - (tl.sum(dw * sel, axis=1) / denom)[:, None]) / denom[:, None]
    for j in tl.static_range(K):
        id_j = tl.sum(tl.where(j_col[None, :] == j, ids, 0), axis=1)
        d_j = tl.sum(tl.where(j_col[None, :] == j, d_sel, 0.0), axis=1)
        ds = ds + tl.where(c[None, :] == id_j[:, None], d_j[:, None], 0.0)
    if SOFTMAX:
        dl = s * (ds - tl.sum(ds * s, axis=1)[:, None])
    else:
        dl = ds * s * (1.0 - s)
    tl.store(dlogits_ptr + r[:, None] * n_cols + c[None, :], dl, mask=mask)
