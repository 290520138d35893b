"""The QKV projection GEMM whose epilogue rotates: out = rope(norm(x @ W^T)) in one launch.

    x    (T, K)                 the hidden states, any strides
    W    (N, K)                 torch.nn.Linear's weight layout, N = (Hq + 2 * Hk) * D, any strides
    out  (T, Hq + 2 * Hk, D)    q heads, then k heads, then v heads; q and k rotated, v as projected
    pre  (T, Hq + Hk, D)        optional (PRE): the q and k heads before norm and rotation (what a
                                normed backward needs; written only when autograd asks for it)

With CACHE (the paged-cache write, inference only), out is (T, Hq, D), q heads only: the k and v
heads go to the rows of k_cache / v_cache that slot_mapping names, (block, offset) = divmod(slot,
block_size) (a flat (num_slots, H, D) cache is block_size 1). A slot < 0 stores nothing (padding);
a slot >= num_slots stores nothing and makes that token's rotated q dims NaN (apply_rope_and_store's
rule: the mistake shows in the attention output, never in another token's row).

A program computes BLOCK_M rows x G whole heads (G * D output columns). The accumulator of those
columns is kept as up to three tiles whose columns are gathered from W's rows:

    a1    (BLOCK_M, G * HALF_PAD)   first member of every rotated pair: head column i (half-split)
                                    or 2i (interleaved), i < HALF
    a2    (BLOCK_M, G * HALF_PAD)   its partner: column HALF + i (half-split) or 2i + 1 (interleaved)
    tail  (BLOCK_M, G * TAIL_PAD)   the columns [2 * HALF, D) past the rotary dims (TAIL_PAD > 0)

so that the rotation is elementwise on registers (out1 = a1 cos - a2 sin, out2 = a2 cos + a1 sin,
float32), with no shuffle between lanes. Column c of a1 / a2 is pair i = c % HALF_PAD of head
c // HALF_PAD of the block; padded columns (i >= HALF, a rotary half that is not a power of two)
read nothing and store nothing. v heads go through the same tiles (any split of a head's columns
is a split), unrotated. G divides Hq and Hk, so a block is all q, all k or all v heads.

Angles: rows of a [cos | sin] table (max_position, 2 * HALF) picked by the row's position, read in
float32. A position outside [0, max_position) reads nothing and gives NaN in the rotated columns
(ropekit's rule). Optional per-head RMSNorm (NORM_Q / NORM_K, weight (D,)) over the whole head
(a1, a2 and the tail) before the rotation, in float32.

Addressing: rows, heads and W's rows are widened to int64 before they scale a stride (the rule of
every ropekit kernel file; `python -m ropekit.audit` checks it). float32 accumulation; fp32 inputs
multiply in IEEE float32 (PRECISION), never TF32. In the interpreter (CPU tensors) bf16 tiles are
upcast to float32 before the dot (UPCAST: its bf16 dot is wrong); compiled, they never are.

Three ways to read the operands, one epilogue: the pointer path (any strides, any GPU, G heads per
program, cp.async pipelining), the TMA path (TMA=True: tensor descriptors of x and W, one head per
program; Hopper and later, half-split pairs, 16-bit dtypes, unit last strides, 16-byte aligned rows;
`tma_ok`) and the packed path (PACKED=True: a descriptor of W's pair-ordered copy, `packed_weight`;
one (G * D, BLOCK_K) box and one dot per k step into one (BLOCK_M, G * D) accumulator, whose
adjacent column pairs are split into a1 and a2 in registers; heads without a tail and of a
power-of-two size, `packed_ok`). The TMA paths read whole boxes, zero-filled past the tensors' ends,
so they need no masks.

The launcher (`qkv_rope_gemm`) picks fixed tile sizes by shape (`tile_config`; no autotuning) and the
path (`chosen_path`: packed on a GPU where the shape allows it, else the pointer path's tiles,
unless PATH, ROPEKIT_QKV_PATH or PREFER_TMA says otherwise); ROPEKIT_QKV_* knobs (`KNOBS`) override
the tile sizes for a sweep. PERSISTENT (a knob, any path, off: measured slower): one program an SM
striding over the tiles.
"""

import os

import triton
import triton.language as tl

from ..language import rotate, table_angles


@triton.jit
def _dot_tile(
    acc,
    x,
    w_ptrs,
    k_ok,
    col_ok,
    EVEN_K: tl.constexpr,
    ALL_COLS: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """acc += x @ W[cols, k-block]^T for one gathered column tile (w_ptrs: (BLOCK_K, C) pointers).
    Masks only where a lane can be out of bounds (EVEN_K: every k block is whole; ALL_COLS: no
    padded column), so that the common shapes load unmasked 16-byte vectors."""
    if EVEN_K:
        if ALL_COLS:
            w = tl.load(w_ptrs)
        else:
            w = tl.load(w_ptrs, mask=col_ok[None, :], other=0.0)
    else:
        w = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
    if UPCAST:  # x arrives upcast already
        w = w.to(tl.float32)
    return tl.dot(x, w, acc, input_precision=PRECISION)


@triton.jit
def _packed_step(acc, x_desc, w_desc, m0, n0, k0, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """acc += x[m0:, k0:] @ Wp[n0:, k0:]^T for one k block: two TMA boxes, one dot."""
    x = x_desc.load([m0, k0])
    w = w_desc.load([n0, k0])
    if UPCAST:
        x = x.to(tl.float32)
        w = w.to(tl.float32)
    return tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)


@triton.jit
def _head_sumsq(a, G: tl.constexpr, BLOCK_M: tl.constexpr, C: tl.constexpr):
    """Per-row, per-head sum of squares of a (BLOCK_M, G * C) tile: (BLOCK_M, G)."""
    return tl.sum(tl.reshape(a * a, (BLOCK_M, G, C)), axis=2)


@triton.jit
def _scale_heads(a, s, G: tl.constexpr, BLOCK_M: tl.constexpr, C: tl.constexpr):
    """a (BLOCK_M, G * C) times s (BLOCK_M, G), each head's columns by its own factor."""
    return tl.reshape(tl.reshape(a, (BLOCK_M, G, C)) * s[:, :, None], (BLOCK_M, G * C))


@triton.jit
def qkv_rope_gemm_kernel(
    x_ptr,
    w_ptr,
    x_desc,
    w_desc,
    wt_desc,
    out_ptr,
    pre_ptr,
    pos_ptr,
    cache_ptr,
    wq_ptr,
    wk_ptr,
    kc_ptr,
    vc_ptr,
    slot_ptr,
    T,
    K,
    n_q_heads,
    n_k_heads,
    max_position,
    eps,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_om,
    stride_oh,
    stride_pm,
    stride_ph,
    stride_pos,
    stride_cache,
    num_slots,
    block_size,
    stride_slot,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    D: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    TAIL_PAD: tl.constexpr,
    G: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    NORM_Q: tl.constexpr,
    NORM_K: tl.constexpr,
    PRE: tl.constexpr,
    EVEN_K: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    TMA: tl.constexpr,
    CACHE: tl.constexpr,
    PACKED: tl.constexpr,
    WARP_SPEC: tl.constexpr,
    PERSISTENT: tl.constexpr,
):
    # PERSISTENT: a grid of about one program an SM walks the tiles (stride the grid); otherwise
    # one program a tile. The tile loop is not flattened into the k loop (`flatten=True`): Triton
    # 3.6's loop fusion fails to compile it
    if PERSISTENT:
        n_tiles = tl.cdiv(T, BLOCK_M) * ((n_q_heads + 2 * n_k_heads) // G)
        for tile in tl.range(tl.program_id(0), n_tiles, tl.num_programs(0)):  # int32-ok: widened in _qkv_tile
            _qkv_tile(
                tile, x_ptr, w_ptr, x_desc, w_desc, wt_desc, out_ptr, pre_ptr, pos_ptr, cache_ptr, wq_ptr, wk_ptr,
                kc_ptr, vc_ptr, slot_ptr, T, K, n_q_heads, n_k_heads, max_position, eps, stride_xm, stride_xk,
                stride_wn, stride_wk, stride_om, stride_oh, stride_pm, stride_ph, stride_pos, stride_cache,
                num_slots, block_size, stride_slot, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs,
                stride_vh, D, HALF, HALF_PAD, TAIL_PAD, G, INTERLEAVED, NORM_Q, NORM_K, PRE, EVEN_K, PRECISION,
                UPCAST, BLOCK_M, BLOCK_K, GROUP_M, TMA, CACHE, PACKED, WARP_SPEC,
            )  # fmt: skip
    else:
        _qkv_tile(
            tl.program_id(0), x_ptr, w_ptr, x_desc, w_desc, wt_desc, out_ptr, pre_ptr, pos_ptr, cache_ptr, wq_ptr,  # int32-ok: the tile index, widened in _qkv_tile
            wk_ptr, kc_ptr, vc_ptr, slot_ptr, T, K, n_q_heads, n_k_heads, max_position, eps, stride_xm, stride_xk,
            stride_wn, stride_wk, stride_om, stride_oh, stride_pm, stride_ph, stride_pos, stride_cache, num_slots,
            block_size, stride_slot, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, D, HALF,
            HALF_PAD, TAIL_PAD, G, INTERLEAVED, NORM_Q, NORM_K, PRE, EVEN_K, PRECISION, UPCAST, BLOCK_M, BLOCK_K,
            GROUP_M, TMA, CACHE, PACKED, WARP_SPEC,
        )  # fmt: skip


@triton.jit
def _qkv_tile(
    pid, x_ptr, w_ptr, x_desc, w_desc, wt_desc, out_ptr, pre_ptr, pos_ptr, cache_ptr, wq_ptr, wk_ptr, kc_ptr,
    vc_ptr, slot_ptr, T, K, n_q_heads, n_k_heads, max_position, eps, stride_xm, stride_xk, stride_wn, stride_wk,
    stride_om, stride_oh, stride_pm, stride_ph, stride_pos, stride_cache, num_slots, block_size, stride_slot,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, D: tl.constexpr, HALF: tl.constexpr,
    HALF_PAD: tl.constexpr, TAIL_PAD: tl.constexpr, G: tl.constexpr, INTERLEAVED: tl.constexpr,
    NORM_Q: tl.constexpr, NORM_K: tl.constexpr, PRE: tl.constexpr, EVEN_K: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, TMA: tl.constexpr, CACHE: tl.constexpr, PACKED: tl.constexpr,
    WARP_SPEC: tl.constexpr,
):  # fmt: skip
    """One (BLOCK_M rows, G heads) tile of the output: the main loop, then the epilogue."""
    # grouped order of the (row block, head block) tiles: GROUP_M row blocks share W's column
    # blocks while they are in L2 (pid: the tile's index, int32-ok: < 2^31; pid_m and pid_h are
    # widened before any offset)
    n_m = tl.cdiv(T, BLOCK_M)
    n_h = (n_q_heads + 2 * n_k_heads) // G
    per_group = GROUP_M * n_h
    group = pid // per_group
    first_m = group * GROUP_M
    size_m = tl.minimum(n_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size_m
    pid_h = (pid % per_group) // size_m

    rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < T
    head0 = pid_h.to(tl.int64) * G  # first head of the block

    # gathered columns: c -> (head of the block, pair index)
    c = tl.arange(0, G * HALF_PAD)
    c_head = head0 + c // HALF_PAD
    c_pair = c % HALF_PAD
    pair_ok = c_pair < HALF
    if INTERLEAVED:
        col1 = 2 * c_pair
        col2 = 2 * c_pair + 1
    else:
        col1 = c_pair
        col2 = HALF + c_pair
    n1 = c_head * D + col1  # rows of W (int64: c_head is)
    n2 = c_head * D + col2
    tail_len = D - 2 * HALF
    if TAIL_PAD > 0:
        t = tl.arange(0, G * TAIL_PAD)
        t_head = head0 + t // TAIL_PAD
        t_j = t % TAIL_PAD
        tail_ok = t_j < tail_len
        col_t = 2 * HALF + t_j
        nt = t_head * D + col_t

    if not PACKED:  # gathered column tiles (the packed path splits its one accumulator instead)
        a1 = tl.zeros((BLOCK_M, G * HALF_PAD), dtype=tl.float32)
        a2 = tl.zeros((BLOCK_M, G * HALF_PAD), dtype=tl.float32)
        if TAIL_PAD > 0:
            at = tl.zeros((BLOCK_M, G * TAIL_PAD), dtype=tl.float32)
    if PACKED:
        # one box of G * D rows of the packed weight per k step (w_desc: the (N, K) copy whose head
        # rows are ordered first member, partner, first member, ...; `packed_weight`), one
        # (BLOCK_M, G * D) accumulator: the wide dot is Hopper's m64n256 wgmma at G * D = 256.
        # Pair members sit in adjacent accumulator columns (2c, 2c + 1), which the mma layout keeps
        # in one thread's adjacent registers, so the split below is a relabeling of registers.
        m0 = pid_m * BLOCK_M
        n0 = pid_h * (G * D)  # int32-ok: a TMA coordinate (int32 in the descriptor), < N
        acc = tl.zeros((BLOCK_M, G * D), dtype=tl.float32)
        if WARP_SPEC:  # producer / consumer warps for the loads and the dots (Triton's, sm_90+)
            for k0 in tl.range(0, K, BLOCK_K, warp_specialize=True):
                acc = _packed_step(acc, x_desc, w_desc, m0, n0, k0, PRECISION, UPCAST)
        else:
            for k0 in range(0, K, BLOCK_K):
                acc = _packed_step(acc, x_desc, w_desc, m0, n0, k0, PRECISION, UPCAST)
        a1, a2 = tl.split(tl.reshape(acc, (BLOCK_M, G * HALF_PAD, 2)))
    elif TMA:
        # tensor-memory-accelerator tiles (Hopper and later; G == 1, half-split): x rows
        # [m0, m0 + BLOCK_M), W rows [n0, n0 + HALF_PAD) and [n0 + HALF, n0 + HALF + HALF_PAD) (and the
        # tail's), zero-filled past the tensors' ends; lanes of a padded half read the next columns
        # of W and are zeroed below
        m0 = pid_m * BLOCK_M
        n0 = pid_h * D
        for k0 in range(0, K, BLOCK_K):
            x = x_desc.load([m0, k0])
            w1 = w_desc.load([n0, k0])
            w2 = w_desc.load([n0 + HALF, k0])
            if UPCAST:
                x = x.to(tl.float32)
                w1 = w1.to(tl.float32)
                w2 = w2.to(tl.float32)
            a1 = tl.dot(x, tl.trans(w1), a1, input_precision=PRECISION)
            a2 = tl.dot(x, tl.trans(w2), a2, input_precision=PRECISION)
            if TAIL_PAD > 0:
                wt = wt_desc.load([n0 + 2 * HALF, k0])
                if UPCAST:
                    wt = wt.to(tl.float32)
                at = tl.dot(x, tl.trans(wt), at, input_precision=PRECISION)
        if HALF != HALF_PAD:
            a1 = tl.where(pair_ok[None, :], a1, 0.0)
            a2 = tl.where(pair_ok[None, :], a2, 0.0)
        if TAIL_PAD > 0:
            if D - 2 * HALF != TAIL_PAD:
                at = tl.where(tail_ok[None, :], at, 0.0)
    else:
        ks = tl.arange(0, BLOCK_K)
        # rows past T read row T - 1 (in bounds, never stored): the x loads need no row mask
        x_ptrs = x_ptr + tl.minimum(rows, T - 1)[:, None] * stride_xm + ks.to(tl.int64)[None, :] * stride_xk
        w1_ptrs = w_ptr + n1[None, :] * stride_wn + ks.to(tl.int64)[:, None] * stride_wk
        w2_ptrs = w_ptr + n2[None, :] * stride_wn + ks.to(tl.int64)[:, None] * stride_wk
        if TAIL_PAD > 0:
            wt_ptrs = w_ptr + nt[None, :] * stride_wn + ks.to(tl.int64)[:, None] * stride_wk
        step_x = BLOCK_K * stride_xk
        step_w = BLOCK_K * stride_wk

        for k0 in range(0, K, BLOCK_K):
            k_ok = ks < K - k0
            if EVEN_K:
                x = tl.load(x_ptrs)
            else:
                x = tl.load(x_ptrs, mask=k_ok[None, :], other=0.0)
            if UPCAST:
                x = x.to(tl.float32)
            a1 = _dot_tile(a1, x, w1_ptrs, k_ok, pair_ok, EVEN_K, HALF == HALF_PAD, PRECISION, UPCAST)
            a2 = _dot_tile(a2, x, w2_ptrs, k_ok, pair_ok, EVEN_K, HALF == HALF_PAD, PRECISION, UPCAST)
            if TAIL_PAD > 0:
                at = _dot_tile(at, x, wt_ptrs, k_ok, tail_ok, EVEN_K, D - 2 * HALF == TAIL_PAD, PRECISION, UPCAST)
                wt_ptrs += step_w
            x_ptrs += step_x
            w1_ptrs += step_w
            w2_ptrs += step_w

    # the epilogue: which kind of head this block holds (q, k or v), decided once per program
    is_q = head0 < n_q_heads
    is_v = head0 >= n_q_heads + n_k_heads
    out_rows = out_ptr + rows[:, None] * stride_om
    if CACHE:
        # each row's cache slot: (block, offset), int64; padding (< 0) and past-the-cache slots store nothing
        slot = tl.load(slot_ptr + rows * stride_slot, mask=row_ok, other=-1).to(tl.int64)
        slot_ok = row_ok & (slot >= 0) & (slot < num_slots)
        s = tl.where(slot_ok, slot, 0)
        blk = s // block_size
        off = s % block_size
    if is_v:
        if CACHE:
            v_rows = vc_ptr + (blk * stride_vb + off * stride_vs)[:, None]
            v_head = head0 - n_q_heads - n_k_heads
            _store_pairs(v_rows, stride_vh, v_head, slot_ok, a1, a2, HALF, HALF_PAD, G, INTERLEAVED, BLOCK_M, PACKED)
            if TAIL_PAD > 0:
                _store_tail(v_rows, stride_vh, v_head, slot_ok, at, D, HALF, TAIL_PAD, G)
        else:
            _store_pairs(out_rows, stride_oh, head0, row_ok, a1, a2, HALF, HALF_PAD, G, INTERLEAVED, BLOCK_M, PACKED)
            if TAIL_PAD > 0:
                _store_tail(out_rows, stride_oh, head0, row_ok, at, D, HALF, TAIL_PAD, G)
    else:
        if PRE:
            # the projection before norm and rotation, rounded as an unfused projection would be
            pre_rows = pre_ptr + rows[:, None] * stride_pm
            _store_pairs(pre_rows, stride_ph, head0, row_ok, a1, a2, HALF, HALF_PAD, G, INTERLEAVED, BLOCK_M, PACKED)
            if TAIL_PAD > 0:
                _store_tail(pre_rows, stride_ph, head0, row_ok, at, D, HALF, TAIL_PAD, G)
        if NORM_Q or NORM_K:
            # q and k blocks share this code: a scalar select of the flag and the weight
            normed = tl.where(is_q, NORM_Q, NORM_K) != 0
            if normed:
                nw_ptr = tl.where(is_q, wq_ptr, wk_ptr)
                ss = _head_sumsq(a1, G, BLOCK_M, HALF_PAD) + _head_sumsq(a2, G, BLOCK_M, HALF_PAD)
                if TAIL_PAD > 0:
                    ss += _head_sumsq(at, G, BLOCK_M, TAIL_PAD)
                inv = 1.0 / tl.sqrt(ss / D + eps)
                w1 = tl.load(nw_ptr + col1, mask=pair_ok, other=0.0).to(tl.float32)
                w2 = tl.load(nw_ptr + col2, mask=pair_ok, other=0.0).to(tl.float32)
                a1 = _scale_heads(a1, inv, G, BLOCK_M, HALF_PAD) * w1[None, :]
                a2 = _scale_heads(a2, inv, G, BLOCK_M, HALF_PAD) * w2[None, :]
                if TAIL_PAD > 0:
                    wt = tl.load(nw_ptr + col_t, mask=tail_ok, other=0.0).to(tl.float32)
                    at = _scale_heads(at, inv, G, BLOCK_M, TAIL_PAD) * wt[None, :]
        # angles of the rows' positions; out of the table -> NaN, never an out-of-bounds read
        pos = tl.load(pos_ptr + rows * stride_pos, mask=row_ok, other=0).to(tl.int64)
        pos_ok = (pos >= 0) & (pos < max_position)
        if CACHE:
            pos_ok = pos_ok & (slot < num_slots)  # a slot past the cache: NaN in the rotated q (and k) dims
        if PACKED:
            # one head's angles (BLOCK_M, HALF_PAD), broadcast to the G heads: the compiler then
            # moves these into the accumulator's layout (2 float32 tiles of one head) instead of
            # moving a1 and a2 (2 tiles of G heads) into the loads' layout
            ang_col = tl.arange(0, HALF_PAD)
            ang_ok = ang_col < HALF
        else:  # the gathered columns' angles (the layouts the pointer and TMA paths were measured with)
            ang_col = c_pair
            ang_ok = pair_ok
        m_ang = (row_ok & pos_ok)[:, None] & ang_ok[None, :]
        cos, sin = table_angles(
            cache_ptr, cache_ptr + HALF, pos[:, None] * stride_cache, ang_col[None, :], m_ang, float("nan")
        )
        if PACKED and G > 1:
            cos = tl.reshape(tl.broadcast_to(cos[:, None, :], (BLOCK_M, G, HALF_PAD)), (BLOCK_M, G * HALF_PAD))
            sin = tl.reshape(tl.broadcast_to(sin[:, None, :], (BLOCK_M, G, HALF_PAD)), (BLOCK_M, G * HALF_PAD))
        r1, r2 = rotate(a1, a2, cos, sin, False)
        if CACHE and not is_q:
            # k heads into their cache rows (a branch, not a select of the row pointers: a select
            # between two pointer tensors hides their alignment from the compiler, whose stores
            # then go one element at a time, a pointer each, and spill)
            k_rows = kc_ptr + (blk * stride_kb + off * stride_ks)[:, None]
            _store_pairs(
                k_rows, stride_kh, head0 - n_q_heads, slot_ok, r1, r2, HALF, HALF_PAD, G, INTERLEAVED, BLOCK_M, PACKED
            )
            if TAIL_PAD > 0:
                _store_tail(k_rows, stride_kh, head0 - n_q_heads, slot_ok, at, D, HALF, TAIL_PAD, G)
        else:
            _store_pairs(out_rows, stride_oh, head0, row_ok, r1, r2, HALF, HALF_PAD, G, INTERLEAVED, BLOCK_M, PACKED)
            if TAIL_PAD > 0:
                _store_tail(out_rows, stride_oh, head0, row_ok, at, D, HALF, TAIL_PAD, G)


@triton.jit
def _store_pairs(
    row_ptrs,
    stride_h,
    head0,
    row_ok,
    r1,
    r2,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    G: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    APART: tl.constexpr,
):
    """Store the pair tiles of G heads (row_ptrs: (BLOCK_M, 1) row pointers). Half-split: r1 to
    columns [0, HALF), r2 to [HALF, 2 HALF) of each head, two runs of contiguous columns: with
    APART as two stores (each tile's own layout change on the way, half the registers at a time:
    what the packed path's one wide accumulator needs), else joined into one tile first.
    Interleaved: r1 and r2 joined lane by lane into one tile (pair i at columns 2i, 2i + 1), so the
    store is contiguous too (no stride-2 stores)."""
    dtype = row_ptrs.dtype.element_ty
    if APART and not INTERLEAVED:
        c = tl.arange(0, G * HALF_PAD)
        j = c % HALF_PAD
        heads = row_ptrs + ((head0 + c // HALF_PAD) * stride_h)[None, :]
        ok = row_ok[:, None] & (j < HALF)[None, :]
        tl.store(heads + j[None, :], r1.to(dtype), mask=ok)
        tl.store(heads + (HALF + j)[None, :], r2.to(dtype), mask=ok)
        return
    if INTERLEAVED:
        r = tl.reshape(tl.join(r1, r2), (BLOCK_M, G * 2 * HALF_PAD))
    else:
        r = tl.join(tl.reshape(r1, (BLOCK_M, G, HALF_PAD)), tl.reshape(r2, (BLOCK_M, G, HALF_PAD)))
        r = tl.reshape(tl.permute(r, (0, 1, 3, 2)), (BLOCK_M, G * 2 * HALF_PAD))
    c = tl.arange(0, G * 2 * HALF_PAD)
    within = c % (2 * HALF_PAD)  # lane within the head's [r1 | r2] or (r1, r2) pairs
    if INTERLEAVED:
        col = within
        ok = within < 2 * HALF
    else:
        col = tl.where(within < HALF_PAD, within, within - HALF_PAD + HALF)
        ok = (within % HALF_PAD) < HALF
    ptrs = row_ptrs + (head0 + c // (2 * HALF_PAD))[None, :] * stride_h + col[None, :]
    tl.store(ptrs, r.to(dtype), mask=row_ok[:, None] & ok[None, :])


@triton.jit
def _store_tail(
    row_ptrs, stride_h, head0, row_ok, at, D: tl.constexpr, HALF: tl.constexpr, TAIL_PAD: tl.constexpr, G: tl.constexpr
):
    """Store the tail tile of G heads: columns [2 HALF, D) of each head."""
    t = tl.arange(0, G * TAIL_PAD)
    j = t % TAIL_PAD
    ptrs = row_ptrs + (head0 + t // TAIL_PAD)[None, :] * stride_h + (2 * HALF + j)[None, :]
    tl.store(ptrs, at.to(row_ptrs.dtype.element_ty), mask=row_ok[:, None] & (j < D - 2 * HALF)[None, :])


# The TMA path (tensor descriptors, one head per program) instead of the pointer path where it can
# run (`tma_ok`): ROPEKIT_QKV_TMA=1, or set by the benchmark, which times both. Off until measured.
PREFER_TMA = os.environ.get("ROPEKIT_QKV_TMA", "0") == "1"

# The path on a GPU: "pointer", "tma" or "packed" ("" leaves it to ROPEKIT_QKV_PATH, then
# PREFER_TMA, then the pointer path). The benchmark sets it per timed variant.
PATH = ""

PATHS = ("pointer", "tma", "packed")

# tile_config's knobs for a sweep: environment variable -> config key (an int each; WARP_SPEC and PERSISTENT 0 or 1)
KNOBS = {
    "ROPEKIT_QKV_G": "G",
    "ROPEKIT_QKV_BLOCK_M": "BLOCK_M",
    "ROPEKIT_QKV_BLOCK_K": "BLOCK_K",
    "ROPEKIT_QKV_GROUP_M": "GROUP_M",
    "ROPEKIT_QKV_STAGES": "num_stages",
    "ROPEKIT_QKV_WARPS": "num_warps",
    "ROPEKIT_QKV_WARP_SPEC": "WARP_SPEC",
    "ROPEKIT_QKV_PERSISTENT": "PERSISTENT",
}


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def chosen_path(on_gpu: bool = True) -> str:
    """The path tile_config aims for: PATH, else ROPEKIT_QKV_PATH, else "tma" with PREFER_TMA,
    else "packed" on a GPU (the fastest path where it applies: about 1.0x cuBLAS + ropekit at the
    long preset on an H100, the pointer path 0.70-0.74x; benchmarks/RESULTS.md) and "pointer" in
    the interpreter. Each call reads them (a sweep changes them between calls)."""
    default = "packed" if on_gpu else "pointer"
    path = PATH or os.environ.get("ROPEKIT_QKV_PATH", "") or ("tma" if PREFER_TMA else default)
    if path not in PATHS:
        raise ValueError(f"ROPEKIT_QKV_PATH: expected one of {', '.join(PATHS)}, got {path!r}")
    return path


def packed_shape_ok(D: int, rot: int, G: int = 1) -> bool:
    """Can the packed path hold G heads of this shape? Every dim rotated (no tail), a head size that
    is a power of two of at least 32 (a rotary half of at least 16 columns: no padded pair), and
    G * D rows in one TMA box (at most 256)."""
    return rot == D and D >= 32 and D == _pow2(D) and G * D <= 256


def _knobs(cfg: dict) -> dict:
    for env, key in KNOBS.items():
        raw = os.environ.get(env)
        if raw:
            try:
                cfg[key] = int(raw)
            except ValueError:
                raise ValueError(f"{env}: expected an int, got {raw!r}") from None
    for flag in ("WARP_SPEC", "PERSISTENT"):
        if flag in cfg:
            cfg[flag] = bool(cfg[flag])
    return cfg


def tile_config(
    T: int, K: int, D: int, rot: int, n_q_heads: int, n_k_heads: int, on_gpu: bool, itemsize: int = 2
) -> dict:
    """Fixed tile sizes by shape (no autotuning): G heads per program, BLOCK_M rows, BLOCK_K of the
    reduction, warps and pipeline stages, and the path (TMA=True, PACKED=True, or neither: the
    pointer path). Every tile dimension of a dot is at least 16.

    The pointer path: G = 2 (a 128 x 256 tile at head size 128, two 64 x 128 wgmma accumulators
    per warpgroup) for heads without a tail whose rotary half is at most 64 columns, when both
    head counts are even; G = 1 otherwise (a tail is a third accumulator: two heads of them would
    spill registers). fp32 inputs (itemsize 4): G = 1 and half the k block (registers and shared
    memory). The TMA path (`chosen_path()` "tma", 16-bit inputs): one head per program, 8 warps,
    4 stages. The packed path ("packed", 16-bit inputs, heads `packed_shape_ok`: no tail, a
    power-of-two head size): G = 2 where G * D <= 256 and both head counts are even (one 128 x 256
    wgmma accumulator at head size 128), 8 warps, 3 stages, k block 64, 32 row blocks a group;
    other shapes fall back to the pointer path's choice. The ROPEKIT_QKV_* knobs (`KNOBS`) then override any entry."""
    half_pad = max(16, _pow2(rot // 2))
    tail_pad = 0 if D == rot else max(16, _pow2(D - rot))
    path = chosen_path(on_gpu)
    even = n_q_heads % 2 == 0 and n_k_heads % 2 == 0
    block_m = 128 if T >= 128 else 64
    block_k = 64 if itemsize <= 2 else 32
    if path == "packed" and itemsize == 2 and packed_shape_ok(D, rot):
        g = 2 if even and packed_shape_ok(D, rot, 2) else 1
        if not on_gpu:
            block_m, block_k = 16, 32
        # GROUP_M 32: 32 row blocks share W's head blocks in L2 (an H100 sweep at Llama-3-8B's
        # shape: 654 against 633 TFLOP/s at 8192 tokens, 665 against 662 at 32768; h100_qkv_sweep_*)
        cfg = dict(G=g, BLOCK_M=block_m, BLOCK_K=block_k, GROUP_M=32, num_warps=8, num_stages=3, PACKED=True)
    elif not on_gpu:  # the interpreter: small tiles, fewer wasted lanes
        cfg = dict(G=1, BLOCK_M=16, BLOCK_K=32, GROUP_M=4, num_warps=4, num_stages=1)
    elif path == "tma" and itemsize == 2:  # tma_ok decides per call (interleaved pairs take the pointer path)
        cfg = dict(G=1, BLOCK_M=block_m, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=4, TMA=True)
    elif tail_pad == 0 and half_pad <= 64 and itemsize <= 2 and even:
        cfg = dict(G=2, BLOCK_M=block_m, BLOCK_K=block_k, GROUP_M=8, num_warps=8, num_stages=3)
    else:
        cols = 2 * half_pad + tail_pad
        cfg = dict(G=1, BLOCK_M=block_m, BLOCK_K=block_k, GROUP_M=8, num_warps=8 if cols >= 128 else 4, num_stages=4)
    return _knobs(cfg)


def _tma_readable(t) -> bool:
    """A 2-D tensor a TMA descriptor can read: unit last stride, 16-byte aligned base and rows."""
    return t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0


def _tma_target(x) -> bool:
    if x.is_cuda:
        target = triton.runtime.driver.active.get_current_target()
        return target.backend == "cuda" and target.arch >= 90
    return True


def tma_ok(x, weight, interleaved: bool) -> bool:
    """Can the TMA path read x and weight? Half-split pairs (W's rows of a half are contiguous),
    16-bit dtypes, unit last strides, 16-byte aligned bases and row strides, and on a GPU a card of
    compute capability 9 or later (or the interpreter, on CPU tensors)."""
    if interleaved or x.element_size() != 2:
        return False
    return _tma_readable(x) and _tma_readable(weight) and _tma_target(x)


def packed_ok(x, D: int, rot: int, G: int) -> bool:
    """Can the packed path run this call? 16-bit x that TMA can read (the packed weight always
    can: a contiguous copy), heads `packed_shape_ok`, and a card of compute capability 9 or later
    (or the interpreter). Interleaved and half-split pairs alike."""
    rows_ok = (x.shape[1] * x.element_size()) % 16 == 0  # the packed copy's row stride is K
    return x.element_size() == 2 and rows_ok and packed_shape_ok(D, rot, G) and _tma_readable(x) and _tma_target(x)


# the packed weights: id(weight) -> (weakref to it, its _version, its layout, the packed copy)
_PACKED: dict = {}


def packed_weight(weight, head_dim: int, interleaved: bool):
    """W's rows regrouped for the packed path: (N, K), contiguous, each head's rows in pair order
    (first member of pair 0, its partner, first member of pair 1, ...): half-split heads row i then
    row HALF + i, interleaved heads as they are (rows 2i, 2i + 1). So a head's accumulator holds
    each pair in adjacent columns, whatever G.

    Example: ``wp = packed_weight(qkv.weight, 128, False)`` for a (6144, 4096) bf16 weight of 48
    half-split heads of 128: wp (6144, 4096) bf16, wp[128 h + 2 i] = W[128 h + i] and
    wp[128 h + 2 i + 1] = W[128 h + 64 + i].

    Cached per weight tensor: reused while the tensor lives and its version counter (bumped by every
    in-place write autograd sees: optimizer steps, copy_ under no_grad) and its layout are
    unchanged, rebuilt otherwise. A write through `.data` (which has its own counter) is not
    seen: call `clear_packed_weights()` after one. Inference tensors have no counter and are packed
    on every call. The copy costs the weight's memory once more (an 8B model's QKV projections:
    about 1.6 GB in bf16)."""
    import weakref

    inference = weight.is_inference()
    key = (weight.data_ptr(), tuple(weight.shape), tuple(weight.stride()), weight.dtype, head_dim, bool(interleaved))
    hit = _PACKED.get(id(weight))
    if hit is not None and not inference:
        ref, version, layout, packed = hit
        if ref() is weight and version == weight._version and layout == key:
            return packed
    w = weight.detach()
    if interleaved:  # pairs already adjacent: a contiguous, aligned copy (none when the weight is one)
        packed = w.contiguous()
        if not _tma_readable(packed):  # a misaligned view: a fresh (aligned) allocation
            packed = packed.clone()
    else:
        n, k = w.shape
        packed = w.unflatten(0, (n // head_dim, 2, head_dim // 2)).transpose(1, 2).reshape(n, k)
    if not inference:
        wid = id(weight)
        _PACKED[wid] = (weakref.ref(weight, lambda _, wid=wid: _PACKED.pop(wid, None)), weight._version, key, packed)
    return packed


def clear_packed_weights() -> None:
    """Forget every packed weight (the next call of each weight packs it again)."""
    _PACKED.clear()


def _resident_programs(x) -> int:
    """The persistent grid: one program an SM (a program's pipeline buffers take most of an SM's
    shared memory); in the interpreter, 3 (so that programs stride over several tiles)."""
    if not x.is_cuda:
        return 3
    props = triton.runtime.driver.active.utils.get_device_properties(x.device.index)
    return props["multiprocessor_count"]


def qkv_rope_gemm(
    x,
    weight,
    positions,
    cache,
    out,
    pre,
    *,
    n_q_heads: int,
    n_k_heads: int,
    head_dim: int,
    rotary_dim: int,
    interleaved: bool,
    q_norm_weight=None,
    k_norm_weight=None,
    eps: float = 1e-6,
    config: dict = None,
    k_cache=None,
    v_cache=None,
    slot_mapping=None,
) -> None:
    """Launch qkv_rope_gemm_kernel: out (T, Hq + 2 Hk, D) <- rotated (normed) x @ weight^T; pre
    (T, Hq + Hk, D) or None <- the q and k heads before norm and rotation. Arguments validated by
    the caller (ropekit.api.qkv): same device and dtype for x, weight, out and pre; last strides 1
    for out, pre, the table and the norm weights; positions (T,) int32/int64.

    With k_cache, v_cache ((num_blocks, block_size, Hk, D) or (num_slots, Hk, D), x's dtype, last
    stride 1) and slot_mapping ((T,) int32/int64): out is (T, Hq, D), the k and v heads go to the
    caches' slot rows, pre must be None."""
    T, K = x.shape
    if T == 0:
        return
    half = rotary_dim // 2
    cfg = dict(config or tile_config(T, K, head_dim, rotary_dim, n_q_heads, n_k_heads, x.is_cuda, x.element_size()))
    g = cfg.pop("G")
    if n_q_heads % g or n_k_heads % g:  # a block holds heads of one kind only
        g = 1
    warp_spec = bool(cfg.pop("WARP_SPEC", False))
    persistent = bool(cfg.pop("PERSISTENT", False))
    packed = bool(cfg.pop("PACKED", False)) and packed_ok(x, head_dim, rotary_dim, g)
    tma = bool(cfg.pop("TMA", False)) and not packed and tma_ok(x, weight, interleaved)
    if tma:
        g = 1
    half_pad = max(16, _pow2(half))
    tail = head_dim - rotary_dim
    tail_pad = 0 if tail == 0 else max(16, _pow2(tail))
    n_heads = n_q_heads + 2 * n_k_heads
    n_tiles = triton.cdiv(T, cfg["BLOCK_M"]) * (n_heads // g)
    grid = (min(n_tiles, _resident_programs(x)) if persistent else n_tiles,)
    wq = q_norm_weight if q_norm_weight is not None else cache
    wk = k_norm_weight if k_norm_weight is not None else cache
    pre_t = pre if pre is not None else out
    cache_on = k_cache is not None
    kc, vc = (k_cache, v_cache) if cache_on else (out, out)
    slots = slot_mapping if cache_on else positions
    num_slots, block_size, ks, vs = 0, 1, (0, 0, 0), (0, 0, 0)
    if cache_on:  # a flat (num_slots, H, D) cache: blocks of one slot
        paged = k_cache.dim() == 4
        num_slots = k_cache.shape[0] * (k_cache.shape[1] if paged else 1)
        block_size = k_cache.shape[1] if paged else 1
        ks = (k_cache.stride(0), k_cache.stride(1) if paged else 0, k_cache.stride(-2))
        vs = (v_cache.stride(0), v_cache.stride(1) if paged else 0, v_cache.stride(-2))
    x_desc = w_desc = wt_desc = None
    if tma or packed:
        from triton.tools.tensor_descriptor import TensorDescriptor

        x_desc = TensorDescriptor(x, list(x.shape), [x.stride(0), 1], [cfg["BLOCK_M"], cfg["BLOCK_K"]])
    if packed:
        wp = packed_weight(weight, head_dim, interleaved)
        w_desc = TensorDescriptor(wp, list(wp.shape), [wp.stride(0), 1], [g * head_dim, cfg["BLOCK_K"]])
    elif tma:
        w_desc = TensorDescriptor(weight, list(weight.shape), [weight.stride(0), 1], [half_pad, cfg["BLOCK_K"]])
        if tail_pad:
            wt_desc = TensorDescriptor(weight, list(weight.shape), [weight.stride(0), 1], [tail_pad, cfg["BLOCK_K"]])
    qkv_rope_gemm_kernel[grid](
        x,
        weight,
        x_desc,
        w_desc,
        wt_desc,
        out,
        pre_t,
        positions,
        cache,
        wq,
        wk,
        kc,
        vc,
        slots,
        T,
        K,
        n_q_heads,
        n_k_heads,
        cache.shape[0],
        float(eps),
        x.stride(0),
        x.stride(1),
        weight.stride(0),
        weight.stride(1),
        out.stride(0),
        out.stride(1),
        pre_t.stride(0),
        pre_t.stride(1),
        positions.stride(0),
        cache.stride(0),
        num_slots,
        block_size,
        slots.stride(0),
        *ks,
        *vs,
        D=head_dim,
        HALF=half,
        HALF_PAD=half_pad,
        TAIL_PAD=tail_pad,
        G=g,
        INTERLEAVED=bool(interleaved),
        NORM_Q=int(q_norm_weight is not None),
        NORM_K=int(k_norm_weight is not None),
        PRE=pre is not None,
        EVEN_K=K % cfg["BLOCK_K"] == 0,
        PRECISION="ieee" if x.dtype.itemsize == 4 else "tf32",
        # the interpreter multiplies bf16 tiles wrongly: there they are upcast to float32 first
        UPCAST=(not x.is_cuda) and str(x.dtype) == "torch.bfloat16",
        TMA=tma,
        CACHE=cache_on,
        PACKED=packed,
        WARP_SPEC=warp_spec and packed,
        PERSISTENT=persistent,
        **cfg,
    )
