"""The main backward kernel: one CTA (or a cluster of two) per query row and head group.

Built from a ``MainConfig`` (config.py): the 16- and 32-head tiles of one
group and the cluster of two 16-head groups (fixed accumulation). The 64-head
wide tile is built by wide.py.
"""

from .config import BLOCK_SLOTS, LOG2E, MainConfig, _tl
from .device_functions import CLUSTER_SOURCE, GATHER_SOURCE, SOFTMAX_SOURCE

#: Words of padding per fp32 row of dKV_s (row stride Dv + 8, 8 mod 32 banks).
#: A warp stores an mma accumulator fragment as float2 per lane: rows
#: lane // 4, columns 2 * (lane % 4). With a stride of 8 mod 32 those 8 rows
#: cover the 32 banks exactly twice (two wavefronts, the minimum); with 4
#: words, neighbouring rows overlapped (2-way conflicts, 4-way in the cluster
#: layout; docs/performance-log.md).
F32_ROW_PAD = 8


def main_bwd_program(config: MainConfig):
    """The main backward for one head group (or a pair of them) as ``config`` says.

    Q, dO, Lse2, Delta, Allowance and dQ hold all HQ heads; the CTA moves the
    tile's head rows [head_base, head_base + config.heads) of each, whatever HQ
    is (the caller keeps that range inside HQ). Lp is a multiple of
    BLOCK_SLOTS, at least one block (the first block's gather is issued before
    the loop; the last block's adds follow it).

    config.accumulate (how the per-slot dKV contributions leave the CTA):
      "fixed"       DKVAcc[kv row] += rint(contribution * RowScale[kv row]) as int64
                    (red.global.add.u64): integer addition is associative, so
                    the sum has the same bits in any order. RowScale is a power
                    of two per kv row chosen by mqa_bwd.fixed_point so that no
                    partial sum can overflow, provided every head's softmax mass
                    sum_j P is <= Allowance[r, h]; the CTA of row r sets
                    Flag[r] = 1 when one of its heads has more, or a NaN
                    mass (the caller then poisons that batch element's dKV:
                    NaN, never wrong).
      "atomic"      DKVAcc[kv row] += contribution, fp32 atomics (the control)

    config.cluster = 2 (fixed, 16-head groups): the launch covers two
    consecutive head groups [head_base + g * tile, ...) as one thread block
    cluster per query row (grid R x 2). CTA g computes P, dS and dQ of its
    group, as alone, and sends its P and dS tiles of each block to the other
    CTA (bulk copies into its inbox, mbarrier handshakes, see the loop). It
    then computes dKV columns [g * Dv / 2, (g + 1) * Dv / 2) of the value part
    (and, for g < (Dk - Dv) / 32, 32 columns of the tail) over every head of
    the cluster, as one GEMM chain in a fixed order, and adds them: each (row,
    slot, column) is added once per cluster, not once per group, and no dKV
    partial leaves the CTA.
    """
    if config.wide:
        raise ValueError(f"config: {config!r} (the wide tile is built by kernels/wide.py)")
    tilelang, T = _tl()
    mode, cluster = config.accumulate, config.cluster
    R = T.dynamic("R")
    HQ = T.dynamic("HQ")  # every head of the call; the group starts at head_base
    NKV = T.dynamic("NKV")
    Lp = T.dynamic("Lp")  # padded slots, a multiple of BLOCK_SLOTS
    Dk, Dv = config.d_k, config.d_v
    Dt = Dk - Dv
    BS = BLOCK_SLOTS
    NB = Lp // BS
    block_H = config.heads
    threads = config.threads
    n_warps = threads // 32
    # dKV of a slot block is produced in DKV_SPLIT column chunks of Dc, so that
    # its accumulator fragment holds at most 32 fp32 per thread: the whole
    # width would keep 64 more registers live and spill at 255
    # (tests/test_kernels_compile).
    # In a cluster: CTA g of the cluster owns dKV columns [g * Cc,
    # (g + 1) * Cc) of the value part, and the first tail_ranks CTAs 32 columns
    # [Dv + g * 32, Dv + (g + 1) * 32) of the tail each (a 16-column tile would
    # not partition over 8 warps), for every slot and every head of the
    # cluster. The CTAs swap their P and dS tiles (a few KB a block) instead of
    # dKV partials.
    colsplit = cluster > 1
    Cc, Ct = (Dv // cluster, 32) if colsplit else (Dv, Dk - Dv)
    tail_ranks = (Dk - Dv) // 32

    def value_col0(rank):
        """The first dKV column of CTA ``rank``'s value-part share."""
        return rank * Cc if colsplit else 0

    def tail_col0(rank):
        """The first dKV column of CTA ``rank``'s tail share."""
        return Dv + rank * Ct if colsplit else Dv

    def owns_tail(rank):
        """Whether CTA ``rank`` has tail columns (a runtime test only where the cluster splits fewer chunks than CTAs)."""
        return (not colsplit) or tail_ranks == cluster or rank < tail_ranks
    per_thread = 32
    split = max(1, BS * Cc // (threads * per_thread))
    while Cc % (split * 16):  # chunks must be whole 16-column GEMM tiles
        split -= 1
    DKV_SPLIT = split
    Dc = Cc // DKV_SPLIT
    if mode == "fixed" and (Dv % 32 or (Dk - Dv) % 32):
        raise ValueError(f"fixed mode needs Dv and Dk - Dv multiples of 32, got Dk={Dk}, Dv={Dv}")
    f32, bf16, i32 = "float32", "bfloat16", "int32"
    dkv_shape = (NKV, Dk)
    # The device functions the kernel calls.
    device_source = GATHER_SOURCE + SOFTMAX_SOURCE + (CLUSTER_SOURCE if cluster > 1 else "")
    # The global adds of slot block t are issued during block t + 1, a quarter
    # at a time (dKV_s is rewritten only at the end of a block), so the
    # load-store queue drains while the tensor cores work instead of stalling
    # every warp in one burst after the dKV GEMMs. The first three quarters go
    # right after the score, dP and dQ GEMMs, not before them: a GEMM's first
    # ldmatrix waited behind the quarter's 64-bit reductions in the memory pipe
    # and on their source registers, which it reuses (docs/performance-log.md
    # has the figures).
    PIECES = 4  # four call sites below
    piece = BS // PIECES
    if piece % n_warps:
        raise ValueError(f"{n_warps} warps must divide the {piece} slots of a piece of global adds")
    if colsplit and (Cc % 32 or (Dk - Dv) % 32 or tail_ranks > cluster):
        raise ValueError(f"cluster {cluster}: each CTA's share of the Dv columns must be whole 32-column adds, "
                         f"and the Dk - Dv tail at most one 32-column chunk per CTA: Dk={Dk}, Dv={Dv}")
    # dKV_s rows: the block's partials (one row per slot), of this CTA's
    # columns (a cluster: Cc of the value part in dKV_s, 32 of the tail in
    # dKVt_s).
    dkv_w, dkvt_w, dkv_rows = Cc, Ct, BS
    peers = cluster - 1
    tile_bytes = block_H * BS * 2  # one bf16 P or dS tile
    inbox_bytes = peers * 2 * tile_bytes  # the cluster's P and dS of a block, from the peer
    if colsplit and 2 * tile_bytes != 16 * threads:
        raise ValueError(f"cluster {cluster}: {threads} threads must stage the P and dS tiles 16 bytes each")
    dkv_dtype = "int64" if mode == "fixed" else "float32"
    grid = R
    has_tail = Dt > 0

    @T.macro
    def gather_async(KV, KV_s, KVt_s, rows, NKV):
        """cp.async of the kv rows named by ``rows`` into KV_s / KVt_s, 16 bytes a copy;
        an invalid slot reads nothing (source size 0) and gets zeros."""
        for j, c in T.Parallel(BS, Dv // 8):
            T.call_extern(
                "handle", "mqa_cp_async16", T.address_of(KV_s[j, c * 8]),
                T.address_of(KV[T.max(T.min(rows[j], NKV - 1), 0), c * 8]), (rows[j] >= 0) and (rows[j] < NKV),
            )
        if has_tail:
            for j, c in T.Parallel(BS, Dt // 8):
                T.call_extern(
                    "handle", "mqa_cp_async16", T.address_of(KVt_s[j, c * 8]),
                    T.address_of(KV[T.max(T.min(rows[j], NKV - 1), 0), Dv + c * 8]), (rows[j] >= 0) and (rows[j] < NKV),
                )
        T.call_extern("handle", "mqa_cp_async_commit")

    @T.macro
    def add_piece(dKV, dKV_s, dKVt_s, slots, scales, k, warp, lane, kv_row, scale_r, NKV, rank):
        """The global adds of slots [k * piece, (k + 1) * piece) of the block held in dKV_s."""
        if mode == "fixed":
            # SIMT: warp w takes slots w, w + n_warps, ... of the piece; its
            # lanes walk the row 32 columns at a time, so every red.u64 is one
            # coalesced 256-byte row segment, and the slot's kv row and scale
            # are loaded once. x * 2^k is exact; __float2ll_rn rounds to
            # nearest even. In a cluster, the CTA adds its column share, whose
            # sum over the cluster's heads its dKV GEMMs formed. (Lanes that
            # add 2 or 4 consecutive columns each, from one vector shared
            # load, were slower: a warp's red.u64 then touches 2x or 4x the
            # 32-byte L2 sectors.)
            for s_i in T.serial(piece // n_warps):
                j = k * piece + warp + s_i * n_warps
                kv_row[0] = slots[j]
                scale_r[0] = scales[j]
                if (kv_row[0] >= 0) and (kv_row[0] < NKV):
                    for c in T.unroll(Cc // 32):
                        T.atomic_add(
                            dKV[kv_row[0], value_col0(rank) + c * 32 + lane],
                            T.call_extern("int64", "__float2ll_rn", dKV_s[j, c * 32 + lane] * scale_r[0]),
                        )
                    if has_tail:
                        if owns_tail(rank):
                            for c in T.unroll(Ct // 32):
                                T.atomic_add(
                                    dKV[kv_row[0], tail_col0(rank) + c * 32 + lane],
                                    T.call_extern("int64", "__float2ll_rn", dKVt_s[j, c * 32 + lane] * scale_r[0]),
                                )
        else:
            for j, d in T.Parallel(piece, Dv):
                if (slots[k * piece + j] >= 0) and (slots[k * piece + j] < NKV):
                    T.atomic_add(dKV[slots[k * piece + j], d], dKV_s[k * piece + j, d])
            if has_tail:
                for j, d in T.Parallel(piece, Dt):
                    if (slots[k * piece + j] >= 0) and (slots[k * piece + j] < NKV):
                        T.atomic_add(dKV[slots[k * piece + j], Dv + d], dKVt_s[k * piece + j, d])

    @T.macro
    def probabilities(acc_s, slot, lse_s, scale_log2, NKV):
        """The scores in acc_s become P = exp2(score * scale * log2e - Lse2), 0 on invalid slots."""
        for h, j in T.Parallel(block_H, BS):
            acc_s[h, j] = T.call_extern(f32, "mqa_masked_exp2", acc_s[h, j] * scale_log2 - lse_s[h],
                                        (slot[j] >= 0) and (slot[j] < NKV))

    @T.prim_func
    def main_bwd(
        Q: T.Tensor((R, HQ, Dk), bf16),
        KV: T.Tensor((NKV, Dk), bf16),
        dO: T.Tensor((R, HQ, Dv), bf16),
        Indices: T.Tensor((R, Lp), i32),
        Lse2: T.Tensor((R, HQ), f32),
        Delta: T.Tensor((R, HQ), f32),
        dQ: T.Tensor((R, HQ, Dk), bf16),
        dKV: T.Tensor(dkv_shape, dkv_dtype),
        RowScale: T.Tensor((NKV,), f32),
        Allowance: T.Tensor((R, HQ), f32),
        Flag: T.Tensor((R,), i32),
        sm_scale: T.float32,
        head_base: T.int32,
        shard_base: T.int32,
        n_shards: T.int32,
    ):
        with T.Kernel(grid, cluster, threads=threads, cluster_dims=(1, cluster, 1) if cluster > 1 else None) as (b, rank):
            scale_log2 = sm_scale * LOG2E
            Q_s = T.alloc_shared((block_H, Dv), bf16)
            dO_s = T.alloc_shared((block_H, Dv), bf16)
            KV_s = T.alloc_shared((BS, Dv), bf16)
            P_s = T.alloc_shared((block_H, BS), bf16)
            dS_s = T.alloc_shared((block_H, BS), bf16)
            dKV_s = T.alloc_shared((dkv_rows, dkv_w + F32_ROW_PAD), f32)
            slot = T.alloc_shared((BS,), i32)
            slot_next = T.alloc_shared((BS,), i32)  # the rows of the block in flight
            lse_s = T.alloc_shared((block_H,), f32)
            delta_s = T.alloc_shared((block_H,), f32)
            tid = T.get_thread_binding()
            # Thread j < BS holds slot j's global loads in flight in registers,
            # so that no warp waits on their latency at a barrier: the next
            # block's index (stored before the gather) and, fixed mode, this
            # block's row scale (stored for its deferred adds). Read into shared
            # memory at the top of each block, the barriers behind these loads
            # held a share of the stalls (ncu).
            idx_next = T.alloc_local((1,), i32)
            if cluster > 1:
                # mbarriers: 0 full (every peer's block is in the inbox), 1 empty
                # (every peer has read ours: cluster - 1 arrivals a phase)
                bars = T.alloc_shared((2,), "uint64")
            if colsplit:
                # The peers' P and dS tiles of the block (bulk-copied into the
                # same offsets as this CTA's P_in and dS_in), this CTA's tiles
                # staged for those copies, and the peers' heads of Q and dO at
                # this CTA's columns. Rows [i * block_H, (i + 1) * block_H) of
                # each hold rank (rank + 1 + i) % cluster's, its P_s and dS_s
                # byte for byte (the same layout: tile_bytes per tile;
                # tests/test_kernels_compile checks the generated indexing).
                P_in = T.alloc_shared((peers * block_H, BS), bf16)
                dS_in = T.alloc_shared((peers * block_H, BS), bf16)
                send_P = T.alloc_shared((block_H, BS), bf16)
                send_dS = T.alloc_shared((block_H, BS), bf16)
                Qp_s = T.alloc_shared((peers * block_H, Cc), bf16)
                dOp_s = T.alloc_shared((peers * block_H, Cc), bf16)
            dKVt_s = dKV_s  # without a tail, add_piece never reads it
            KVt_s = None  # nor gather_async this one
            if has_tail:
                Qt_s = T.alloc_shared((block_H, Dt), bf16)
                KVt_s = T.alloc_shared((BS, Dt), bf16)
                dKVt_s = T.alloc_shared((dkv_rows, dkvt_w + F32_ROW_PAD), f32)
                acc_dqt = T.alloc_fragment((block_H, Dt), f32)
                acc_dkvt = T.alloc_fragment((BS, Ct), f32)
                if colsplit:
                    Qpt_s = T.alloc_shared((peers * block_H, Ct), bf16)

            acc_s = T.alloc_fragment((block_H, BS), f32)
            acc_dp = T.alloc_fragment((block_H, BS), f32)
            acc_dq = T.alloc_fragment((block_H, Dv), f32)
            acc_dkv = T.alloc_fragment((BS, Dc), f32)
            if mode == "fixed":
                mass_row = T.alloc_fragment((block_H,), f32)
                mass = T.alloc_fragment((block_H, BS), f32)  # summed per element, reduced once per row
                scale_next = T.alloc_local((1,), f32)
            slot_prev = T.alloc_shared((BS,), i32)  # the block whose dKV_s awaits its adds
            scale_prev = T.alloc_shared((BS,), f32)
            kv_row = T.alloc_local((1,), i32)
            scale_r = T.alloc_local((1,), f32)
            warp = T.get_thread_binding() // 32
            lane = T.get_thread_binding() % 32

            first_row = b
            row_stride = 1
            rows = 1
            for it in T.serial(rows):
                r = first_row + it * row_stride
                # The tile is block_H head rows, whatever Hg is: the wrapper must hand
                # a group of exactly block_H heads (SPEC, "the kernel's own tile").
                h0 = head_base if cluster == 1 else head_base + rank * block_H
                T.copy(Q[r, h0 : h0 + block_H, 0:Dv], Q_s)
                if has_tail:
                    T.copy(Q[r, h0 : h0 + block_H, Dv:Dk], Qt_s)
                T.copy(dO[r, h0 : h0 + block_H, 0:Dv], dO_s)
                if colsplit:
                    for i in T.unroll(peers):
                        ph0 = head_base + (rank + 1 + i) % cluster * block_H
                        col0 = value_col0(rank)
                        T.copy(Q[r, ph0 : ph0 + block_H, col0 : col0 + Cc], Qp_s[i * block_H : (i + 1) * block_H, 0:Cc])
                        T.copy(dO[r, ph0 : ph0 + block_H, col0 : col0 + Cc], dOp_s[i * block_H : (i + 1) * block_H, 0:Cc])
                        if has_tail:
                            if owns_tail(rank):
                                T.copy(Q[r, ph0 : ph0 + block_H, tail_col0(rank) : tail_col0(rank) + Ct],
                                       Qpt_s[i * block_H : (i + 1) * block_H, 0:Ct])
                # Staged once per row: the slot loop then indexes shared memory,
                # not [R, HQ] tensors (their 64-bit addressing costs registers).
                for h in T.Parallel(block_H):
                    lse_s[h] = Lse2[r, h0 + h]
                    delta_s[h] = Delta[r, h0 + h]
                T.clear(acc_dq)
                if has_tail:
                    T.clear(acc_dqt)
                if mode == "fixed":
                    T.clear(mass)

                # The KV gather of slot block t + 1 is issued asynchronously
                # right after block t's last read of KV_s (the dQ GEMM), so it
                # lands while the dKV GEMMs and adds run rather than at the
                # top of each block (commit 679c2e6). Invalid slots are never
                # read: their rows of KV_s are zero.
                T.import_source(device_source)
                for j in T.Parallel(BS):
                    slot_next[j] = Indices[r, j]
                gather_async(KV, KV_s, KVt_s, slot_next, NKV)
                if cluster > 1:
                    if tid == 0:
                        T.call_extern("handle", "mqa_mbar_init", bars.data, 1, peers)
                    T.call_extern("handle", "mqa_cluster_sync")  # the peer's barriers exist
                    if tid == 0:
                        T.call_extern("handle", "mqa_mbar_expect", bars.data, 0, inbox_bytes)
                for t in T.Pipelined(NB, num_stages=0):
                    # Block t's rows are in flight since block t - 1; the next
                    # block's indices are read now, stored after the dQ GEMM.
                    for j in T.Parallel(BS):
                        slot[j] = slot_next[j]
                    if (tid < BS) and (t + 1 < NB):
                        idx_next[0] = Indices[r, (t + 1) * BS + tid]
                    T.call_extern("handle", "mqa_cp_async_wait_all")
                    T.sync_threads()
                    if mode == "fixed":
                        if tid < BS:
                            scale_next[0] = T.if_then_else(
                                (slot[tid] >= 0) and (slot[tid] < NKV), RowScale[slot[tid]], T.cast(0, f32)
                            )

                    # Scores, then P.
                    T.gemm(Q_s, KV_s, acc_s, transpose_B=True, clear_accum=True)
                    if has_tail:
                        T.gemm(Qt_s, KVt_s, acc_s, transpose_B=True)
                    if t > 0:  # after the GEMM: see PIECES
                        add_piece(dKV, dKV_s, dKVt_s, slot_prev, scale_prev, 0, warp, lane, kv_row, scale_r, NKV, rank)
                    probabilities(acc_s, slot, lse_s, scale_log2, NKV)
                    T.copy(acc_s, P_s)
                    if mode == "fixed":
                        for h, j in T.Parallel(block_H, BS):
                            mass[h, j] += acc_s[h, j]

                    # dP = dO KV_v^T; dS = P * (dP - Delta) * sm_scale.
                    T.gemm(dO_s, KV_s, acc_dp, transpose_B=True, clear_accum=True)
                    if t > 0:
                        add_piece(dKV, dKV_s, dKVt_s, slot_prev, scale_prev, 1, warp, lane, kv_row, scale_r, NKV, rank)
                    for h, j in T.Parallel(block_H, BS):
                        acc_dp[h, j] = acc_s[h, j] * (acc_dp[h, j] - delta_s[h]) * sm_scale
                    T.copy(acc_dp, dS_s)

                    # dQ += dS KV.
                    T.gemm(dS_s, KV_s, acc_dq)
                    if has_tail:
                        T.gemm(dS_s, KVt_s, acc_dqt)
                    if t > 0:
                        add_piece(dKV, dKV_s, dKVt_s, slot_prev, scale_prev, 2, warp, lane, kv_row, scale_r, NKV, rank)
                    if colsplit:
                        # Stage this block's P and dS tiles for the peers (their
                        # stores were ordered by the barrier before this GEMM);
                        # every peer has consumed block t - 1, so the staging and
                        # their inboxes are free. The barrier below orders the
                        # staging before the bulk copies that read it.
                        if t > 0:
                            T.call_extern("handle", "mqa_mbar_wait", bars.data, 1, (t - 1) % 2)
                        if tid < threads // 2:
                            T.call_extern("handle", "mqa_copy16", send_P.data, P_s.data, tid)
                        else:
                            T.call_extern("handle", "mqa_copy16", send_dS.data, dS_s.data, tid - threads // 2)
                        T.call_extern("handle", "mqa_fence_proxy_async")
                    # The next block's indices, for its gather. TileLang's planner does
                    # not see this store: the barrier below also orders it before the
                    # gather's reads.
                    if (tid < BS) and (t + 1 < NB):
                        T.call_extern("handle", "mqa_st_shared_i32", slot_next.data, tid, idx_next[0])
                    T.sync_threads()  # every warp is done with KV_s
                    if t + 1 < NB:
                        gather_async(KV, KV_s, KVt_s, slot_next, NKV)
                    if colsplit:
                        # Send this block's P and dS tiles to every peer: staged
                        # raw above, then one bulk copy each, completing on the
                        # peer's full barrier.
                        if tid == 0:
                            # Peer (rank + 1 + i) % cluster keeps this CTA's tiles in its inbox peers - 1 - i.
                            for i in T.unroll(peers):
                                T.call_extern("handle", "mqa_bulk_ptr_to_peer", P_in.data, (peers - 1 - i) * tile_bytes, send_P.data,
                                              tile_bytes, bars.data, 0, (rank + 1 + i) % cluster)
                                T.call_extern("handle", "mqa_bulk_ptr_to_peer", dS_in.data, (peers - 1 - i) * tile_bytes, send_dS.data,
                                              tile_bytes, bars.data, 0, (rank + 1 + i) % cluster)

                    if t > 0:
                        add_piece(dKV, dKV_s, dKVt_s, slot_prev, scale_prev, 3, warp, lane, kv_row, scale_r, NKV, rank)
                    if colsplit:
                        # This CTA's columns of dKV for the block, over every CTA's
                        # heads: its own tiles, then its inboxes in order.
                        T.call_extern("handle", "mqa_mbar_wait", bars.data, 0, t % 2)
                        if (tid == 0) and (t + 1 < NB):
                            T.call_extern("handle", "mqa_mbar_expect", bars.data, 0, inbox_bytes)
                        for c in T.unroll(DKV_SPLIT):
                            T.gemm(dS_s, Q_s[0:block_H, rank * Cc + c * Dc : rank * Cc + (c + 1) * Dc], acc_dkv,
                                   transpose_A=True, clear_accum=True)
                            T.gemm(P_s, dO_s[0:block_H, rank * Cc + c * Dc : rank * Cc + (c + 1) * Dc], acc_dkv, transpose_A=True)
                            T.gemm(dS_in, Qp_s[0 : peers * block_H, c * Dc : (c + 1) * Dc], acc_dkv, transpose_A=True)
                            T.gemm(P_in, dOp_s[0 : peers * block_H, c * Dc : (c + 1) * Dc], acc_dkv, transpose_A=True)
                            T.copy(acc_dkv, dKV_s[0:BS, c * Dc : (c + 1) * Dc])
                        if has_tail:
                            if owns_tail(rank):
                                T.gemm(dS_s, Qt_s[0:block_H, rank * Ct : rank * Ct + Ct], acc_dkvt, transpose_A=True,
                                       clear_accum=True)
                                T.gemm(dS_in, Qpt_s, acc_dkvt, transpose_A=True)
                                T.copy(acc_dkvt, dKVt_s[0:BS, 0:Ct])
                        T.sync_threads()  # every warp is done with the inboxes
                        if tid == 0:
                            for i in T.unroll(peers):
                                T.call_extern("handle", "mqa_mbar_arrive_peer", bars.data, 1, (rank + 1 + i) % cluster)
                    else:
                        # dKV of this slot block = dS^T Q (all columns) + P^T dO (first Dv).
                        for c in T.unroll(DKV_SPLIT):
                            T.gemm(dS_s, Q_s[0:block_H, c * Dc : (c + 1) * Dc], acc_dkv, transpose_A=True, clear_accum=True)
                            T.gemm(P_s, dO_s[0:block_H, c * Dc : (c + 1) * Dc], acc_dkv, transpose_A=True)
                            T.copy(acc_dkv, dKV_s[0:BS, c * Dc : (c + 1) * Dc])
                        if has_tail:
                            T.gemm(dS_s, Qt_s, acc_dkvt, transpose_A=True, clear_accum=True)
                            T.copy(acc_dkvt, dKVt_s[0:BS, 0:Dt])

                    # This block's adds are issued during the next one.
                    for j in T.Parallel(BS):
                        slot_prev[j] = slot[j]
                    if mode == "fixed":
                        if tid < BS:
                            scale_prev[tid] = scale_next[0]

                # The last block's adds.
                for k in T.unroll(PIECES):
                    add_piece(dKV, dKV_s, dKVt_s, slot_prev, scale_prev, k, warp, lane, kv_row, scale_r, NKV, rank)
                if colsplit:
                    # Every peer's last arrival on this CTA's barrier is in, and
                    # its last bulk copies from this CTA's staging are done.
                    T.call_extern("handle", "mqa_cluster_sync")
                if mode == "fixed":
                    T.reduce_sum(mass, mass_row, dim=1)
                    for h in T.Parallel(block_H):
                        # A NaN mass (a NaN lse or score) flags too: its
                        # contributions would otherwise convert to garbage.
                        if (mass_row[h] > Allowance[r, h0 + h]) or T.isnan(mass_row[h]):
                            Flag[r] = 1
                dQ_s = T.alloc_shared((block_H, Dv), bf16)
                T.copy(acc_dq, dQ_s)
                T.copy(dQ_s, dQ[r, h0 : h0 + block_H, 0:Dv])
                if has_tail:
                    dQt_s = T.alloc_shared((block_H, Dt), bf16)
                    T.copy(acc_dqt, dQt_s)
                    T.copy(dQt_s, dQ[r, h0 : h0 + block_H, Dv:Dk])

    return main_bwd

