// Masked-query attention: the heart of the mask-aware edit on the GPU.
//
// Each sequence (one request, or one request's stream) has its own query rows (text
// plus active image tokens) and its own key/value rows: fresh rows computed this step
// and cached rows of the template's inactive tokens. Rows are addressed through
// packed references (slot, row), so cached K/V are read where they lie, with no
// gather into a contiguous buffer first. The output overwrites the queries in place
// (the Backend contract).
//
// Two kernels share that addressing:
// - attn_mma_bf16_d{64,128}: FlashAttention-2 style. A block of 4 warps takes 64 query
//   rows of one (sequence, head); K and V^T tiles of 64 rows go through shared memory;
//   S = QK^T and O += PV run on tensor cores (mma.m16n8k16, bf16 in, f32 accumulate);
//   the softmax is online, in registers, with row statistics reduced over each quad.
// - attn_simt_{f32,bf16}: one warp per query row, lanes scoring 32 keys at a time;
//   any even head dim up to 256, f32 math.
//   The f32 reference path (fixtures) and the fallback for odd shapes or alignment.
//
// A K/V slot may be an fp8 template slab (E4M3 bytes, a scale per head of K and of V):
// the tile loads decode it (to bf16 for the tensor cores, scale applied; to f32 in the
// SIMT kernel, the scale folded into the score and the probability), so the slab is
// never expanded in memory.
#include "common.cuh"

#define NEG_INF __int_as_float(0xff800000)

DEV const AttnSlot& slot_of(const AttnParams& p, u32 ref) { return p.slots[ROW_SLOT(ref)]; }

template <class T>
DEV void attn_simt(const AttnParams& p) {
    constexpr int WARPS = 4, MAXJ = 8;  // head_dim <= 256
    __shared__ float qs[WARPS][256];    // this warp's query row, pre-scaled
    __shared__ float ps[WARPS][32];     // probabilities of the current 32 keys
    int2 tile = ((const int2*)p.tiles)[blockIdx.x];
    AttnSeq sq = ((const AttnSeq*)p.seqs)[tile.x];
    const int h = blockIdx.y, w = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int qi = tile.y + w;
    if (qi >= sq.q_len) return;  // whole warp; this kernel has only warp barriers
    const int hd = p.head_dim;
    u32 qref = ((const u32*)p.q_rows)[sq.q_off + qi];
    const AttnSlot& qslot = slot_of(p, qref);
    T* q = (T*)qslot.k + ROW_IDX(qref) * qslot.stride + h * hd;
    for (int c = lane; c < hd; c += 32) qs[w][c] = to_f32(q[c]) * p.scale_log2;
    __syncwarp();
    float o[MAXJ];
#pragma unroll
    for (int j = 0; j < MAXJ; j++) o[j] = 0.f;
    float m = NEG_INF, l = 0.f;
    const u32* kv = (const u32*)p.kv_rows + sq.kv_off;
    // 32 keys at a time: each lane scores one key (a full dot product), the warp
    // reduces max and sum once per chunk, then every lane accumulates its own
    // output dimensions over the chunk's values.
    for (int r0 = 0; r0 < sq.kv_len; r0 += 32) {
        const int r = r0 + lane, nr = min(32, sq.kv_len - r0);
        float sc = NEG_INF;
        if (r < sq.kv_len) {
            u32 ref = kv[r];
            const AttnSlot& s = slot_of(p, ref);
            float dot = 0.f;
            if (s.k_scales) {
                const unsigned char* k = (const unsigned char*)s.k + ROW_IDX(ref) * s.stride + h * hd;
                for (int c = 0; c < hd; c++) dot += qs[w][c] * fp8_to_f32(k[c]);
                dot *= ((const float*)s.k_scales)[h];
            } else {
                const T* k = (const T*)s.k + ROW_IDX(ref) * s.stride + h * hd;
                for (int c = 0; c < hd; c++) dot += qs[w][c] * to_f32(k[c]);
            }
            sc = dot;
        }
        const float mn = fmaxf(m, warp_max(sc));  // finite: key r0 exists
        const float pr = r < sq.kv_len ? fast_exp2(sc - mn) : 0.f;
        const float alpha = fast_exp2(m - mn);
        l = l * alpha + warp_sum(pr);
        m = mn;
        ps[w][lane] = pr;
        __syncwarp();
#pragma unroll
        for (int j = 0; j < MAXJ; j++) o[j] *= alpha;
        for (int jr = 0; jr < nr; jr++) {
            u32 ref = kv[r0 + jr];
            const AttnSlot& s = slot_of(p, ref);
            if (s.v_scales) {
                const unsigned char* v = (const unsigned char*)s.v + ROW_IDX(ref) * s.stride + h * hd;
                const float pv = ps[w][jr] * ((const float*)s.v_scales)[h];
#pragma unroll
                for (int j = 0; j < MAXJ; j++) {
                    int c = lane + 32 * j;
                    if (c < hd) o[j] += pv * fp8_to_f32(v[c]);
                }
            } else {
                const T* v = (const T*)s.v + ROW_IDX(ref) * s.stride + h * hd;
                const float pv = ps[w][jr];
#pragma unroll
                for (int j = 0; j < MAXJ; j++) {
                    int c = lane + 32 * j;
                    if (c < hd) o[j] += pv * to_f32(v[c]);
                }
            }
        }
        __syncwarp();
    }
    const float inv = l > 0.f ? 1.f / l : 0.f;
#pragma unroll
    for (int j = 0; j < MAXJ; j++) {
        int c = lane + 32 * j;
        if (c < hd) q[c] = from_f32<T>(o[j] * inv);
    }
}
extern "C" __global__ void attn_simt_f32(const AttnParams p) { attn_simt<float>(p); }
EMU_EXPORT(attn_simt_f32, AttnParams)
extern "C" __global__ void attn_simt_bf16(const AttnParams p) { attn_simt<bf16>(p); }
EMU_EXPORT(attn_simt_bf16, AttnParams)

DEV u32 ld32(const unsigned short* p) { return ld_shared(reinterpret_cast<const u32*>(p)); }

// Eight fp8 values (bytes 0..7 of `r`), times `s`, as eight bf16 (the layout of one
// 16-byte bf16 load).
DEV uint4 fp8x8_to_bf16(uint2 r, float s) {
    u32 out[4];
#pragma unroll
    for (int i = 0; i < 4; i++) {
        u32 w = i < 2 ? r.x : r.y, sh = 16 * (i & 1);
        out[i] = pack_bf16x2(fp8_to_f32((w >> sh) & 0xff) * s, fp8_to_f32((w >> (sh + 8)) & 0xff) * s);
    }
    uint4 o = {out[0], out[1], out[2], out[3]};
    return o;
}

// Rows of the shared tiles are padded by 8 elements (16 bytes) so that the 8 rows a
// quad-group reads in one fragment load fall in different banks.
template <int D>
DEV void attn_mma(const AttnParams& p) {
    constexpr int BR = 64, BC = 64, KP = D + 8, VP = BC + 8, CH = D / 8, NT = 128;
    __shared__ __align__(16) unsigned short Ks[BC * KP];  // K tile; first the Q tile
    __shared__ __align__(16) unsigned short Vt[D * VP];   // V tile, transposed
    int2 tile = ((const int2*)p.tiles)[blockIdx.x];
    AttnSeq sq = ((const AttnSeq*)p.seqs)[tile.x];
    const int h = blockIdx.y, q0 = tile.y;
    const u32* qrows = (const u32*)p.q_rows + sq.q_off;
    const u32* kvrows = (const u32*)p.kv_rows + sq.kv_off;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane >> 2, t = lane & 3;

    // Q tile -> shared (zeros past the end) -> registers as A fragments.
    for (int i = tid; i < BR * CH; i += NT) {
        int rr = i / CH, ch = i % CH;
        uint4 v = {0, 0, 0, 0};
        if (q0 + rr < sq.q_len) {
            u32 ref = qrows[q0 + rr];
            const AttnSlot& s = slot_of(p, ref);
            v = *reinterpret_cast<const uint4*>((const bf16*)s.k + ROW_IDX(ref) * s.stride + h * D + ch * 8);
        }
        st_shared(reinterpret_cast<uint4*>(&Ks[rr * KP + ch * 8]), v);
    }
    __syncthreads();
    u32 qf[D / 16][4];
    const int qr = warp * 16 + g;
#pragma unroll
    for (int ks = 0; ks < D / 16; ks++) {
        qf[ks][0] = ld32(&Ks[qr * KP + ks * 16 + 2 * t]);
        qf[ks][1] = ld32(&Ks[(qr + 8) * KP + ks * 16 + 2 * t]);
        qf[ks][2] = ld32(&Ks[qr * KP + ks * 16 + 8 + 2 * t]);
        qf[ks][3] = ld32(&Ks[(qr + 8) * KP + ks * 16 + 8 + 2 * t]);
    }
    __syncthreads();

    float o[D / 8][4];
#pragma unroll
    for (int nd = 0; nd < D / 8; nd++) o[nd][0] = o[nd][1] = o[nd][2] = o[nd][3] = 0.f;
    // Row statistics for this thread's two rows (g and g+8), in log2 units.
    float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.f, l1 = 0.f;

    for (int j0 = 0; j0 < sq.kv_len; j0 += BC) {
        for (int i = tid; i < BC * CH; i += NT) {
            int jj = i / CH, ch = i % CH;
            uint4 kv = {0, 0, 0, 0}, vv = {0, 0, 0, 0};
            if (j0 + jj < sq.kv_len) {
                u32 ref = kvrows[j0 + jj];
                const AttnSlot& s = slot_of(p, ref);
                long long off = ROW_IDX(ref) * s.stride + h * D + ch * 8;
                if (s.k_scales) {
                    kv = fp8x8_to_bf16(*reinterpret_cast<const uint2*>((const unsigned char*)s.k + off),
                                       ((const float*)s.k_scales)[h]);
                    vv = fp8x8_to_bf16(*reinterpret_cast<const uint2*>((const unsigned char*)s.v + off),
                                       ((const float*)s.v_scales)[h]);
                } else {
                    kv = *reinterpret_cast<const uint4*>((const bf16*)s.k + off);
                    vv = *reinterpret_cast<const uint4*>((const bf16*)s.v + off);
                }
            }
            st_shared(reinterpret_cast<uint4*>(&Ks[jj * KP + ch * 8]), kv);
            const unsigned short* ve = reinterpret_cast<const unsigned short*>(&vv);
#pragma unroll
            for (int e = 0; e < 8; e++) st_shared(&Vt[(ch * 8 + e) * VP + jj], ve[e]);
        }
        __syncthreads();

        float s[BC / 8][4];
#pragma unroll
        for (int nt = 0; nt < BC / 8; nt++) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
#pragma unroll
        for (int ks = 0; ks < D / 16; ks++) {
#pragma unroll
            for (int nt = 0; nt < BC / 8; nt++) {
                u32 b[2] = {ld32(&Ks[(nt * 8 + g) * KP + ks * 16 + 2 * t]),
                            ld32(&Ks[(nt * 8 + g) * KP + ks * 16 + 8 + 2 * t])};
                mma_16816(s[nt], qf[ks], b);
            }
        }
        float mx0 = m0, mx1 = m1;
#pragma unroll
        for (int nt = 0; nt < BC / 8; nt++) {
#pragma unroll
            for (int i = 0; i < 4; i++) {
                int col = j0 + nt * 8 + 2 * t + (i & 1);
                s[nt][i] = col < sq.kv_len ? s[nt][i] * p.scale_log2 : NEG_INF;
            }
            mx0 = fmaxf(mx0, fmaxf(s[nt][0], s[nt][1]));
            mx1 = fmaxf(mx1, fmaxf(s[nt][2], s[nt][3]));
        }
        mx0 = quad_max(mx0);  // finite: column j0 of every tile is a real key
        mx1 = quad_max(mx1);
        float a0 = fast_exp2(m0 - mx0), a1 = fast_exp2(m1 - mx1);
        m0 = mx0;
        m1 = mx1;
        float rs0 = 0.f, rs1 = 0.f;
#pragma unroll
        for (int nt = 0; nt < BC / 8; nt++) {
            s[nt][0] = fast_exp2(s[nt][0] - m0);
            s[nt][1] = fast_exp2(s[nt][1] - m0);
            s[nt][2] = fast_exp2(s[nt][2] - m1);
            s[nt][3] = fast_exp2(s[nt][3] - m1);
            rs0 += s[nt][0] + s[nt][1];
            rs1 += s[nt][2] + s[nt][3];
        }
        // Partial row sums per thread: alpha is the same across the quad, so the
        // quad reduction can wait until the end.
        l0 = l0 * a0 + rs0;
        l1 = l1 * a1 + rs1;
#pragma unroll
        for (int nd = 0; nd < D / 8; nd++) {
            o[nd][0] *= a0;
            o[nd][1] *= a0;
            o[nd][2] *= a1;
            o[nd][3] *= a1;
        }
        // P (accumulator layout) is already the A-fragment layout of the next MMA.
#pragma unroll
        for (int kk = 0; kk < BC / 16; kk++) {
            u32 a[4] = {pack_bf16x2(s[2 * kk][0], s[2 * kk][1]), pack_bf16x2(s[2 * kk][2], s[2 * kk][3]),
                        pack_bf16x2(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                        pack_bf16x2(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
            for (int nd = 0; nd < D / 8; nd++) {
                u32 b[2] = {ld32(&Vt[(nd * 8 + g) * VP + kk * 16 + 2 * t]),
                            ld32(&Vt[(nd * 8 + g) * VP + kk * 16 + 8 + 2 * t])};
                mma_16816(o[nd], a, b);
            }
        }
        __syncthreads();
    }
    l0 = quad_sum(l0);
    l1 = quad_sum(l1);
#pragma unroll
    for (int half = 0; half < 2; half++) {
        int row = q0 + qr + 8 * half;
        float l = half ? l1 : l0, inv = l > 0.f ? 1.f / l : 0.f;
        if (row < sq.q_len) {
            u32 ref = qrows[row];
            const AttnSlot& s = slot_of(p, ref);
            bf16* dst = (bf16*)s.k + ROW_IDX(ref) * s.stride + h * D;
#pragma unroll
            for (int nd = 0; nd < D / 8; nd++)
                *reinterpret_cast<u32*>(dst + nd * 8 + 2 * t) =
                    pack_bf16x2(o[nd][2 * half] * inv, o[nd][2 * half + 1] * inv);
        }
    }
}
extern "C" __global__ void __launch_bounds__(128) attn_mma_bf16_d64(const AttnParams p) { attn_mma<64>(p); }
EMU_EXPORT(attn_mma_bf16_d64, AttnParams)
extern "C" __global__ void __launch_bounds__(128) attn_mma_bf16_d128(const AttnParams p) { attn_mma<128>(p); }
EMU_EXPORT(attn_mma_bf16_d128, AttnParams)

// ---- attn_fa2_bf16_d{64,128}: the tensor-core kernel, FlashAttention-2 shaped ----
//
// A block of 4 warps takes BR = 64 query rows of one (sequence, head), 16 per warp, and
// walks the keys in tiles of BC = 64. Shared memory (dynamic, 4 tiles of 64 x D bf16:
// 64 KB at D = 128) holds K and V double-buffered: while the tensor cores work on tile
// j, cp.async copies tile j+1 into the other buffers, so global loads hide behind
// compute. The Q tile is staged once in the second V buffer and kept in registers.
//
// Rows are stored whole (D bf16 each) with their 16-byte chunks XOR-swizzled by the
// row's low three bits: chunk c of row r sits at chunk c ^ (r & 7). The 8 row
// addresses of one ldmatrix phase (8 consecutive rows, one logical chunk) and the 8
// lanes of one cp.async phase (one row, 8 consecutive chunks) then cover all 32 banks
// exactly once: no bank conflicts anywhere (the emulator counts them: docs/gpu.md).
// Fragments come from ldmatrix (x4): Q as the A operand, K as the B operand of
// S = QK^T, and V with .trans as the B operand of O += PV, so V is never transposed in
// memory. The softmax is online in registers (as attn_mma above).
//
// K/V rows come through the packed references like every other attention kernel, so
// the gathered problem (a template's cached rows beside the fresh ones) runs the same
// asynchronous copies at the same speed per FLOP as the full one. An fp8 row (a
// template slab) cannot be copied as it is: its 8-byte groups are loaded, decoded to
// bf16 with the head's scale in registers, and stored to the same swizzled place.
DEV int swz(int row, int chunk, int d) { return row * d + ((chunk ^ (row & 7)) << 3); }

// Copies rows [r0, r0 + R) of a K/V tile (or the Q tile: `v` null) into shared
// memory. Thread tid handles rows tid / CH + 128 / CH * i, chunk tid % CH.
template <int D, int R = 64>
DEV void fa2_load_tile(const AttnParams& p, const u32* rows, int r0, int n, int h,
                       unsigned short* ks, unsigned short* vs, bool kv) {
    constexpr int CH = D / 8, RPI = 128 / CH;  // chunks per row, rows per pass
    const int tid = threadIdx.x, ch = tid % CH;
#pragma unroll
    for (int i = 0; i < R / RPI; i++) {
        const int rr = tid / CH + RPI * i, at = swz(rr, ch, D);
        const bool valid = r0 + rr < n;
        const u32 ref = valid ? rows[r0 + rr] : 0u;
        const AttnSlot& s = slot_of(p, ref);
        const long long off = ROW_IDX(ref) * s.stride + h * D + ch * 8;
        if (kv && valid && s.k_scales) {
            st_shared(reinterpret_cast<uint4*>(ks + at),
                      fp8x8_to_bf16(*reinterpret_cast<const uint2*>((const unsigned char*)s.k + off),
                                    ((const float*)s.k_scales)[h]));
            st_shared(reinterpret_cast<uint4*>(vs + at),
                      fp8x8_to_bf16(*reinterpret_cast<const uint2*>((const unsigned char*)s.v + off),
                                    ((const float*)s.v_scales)[h]));
        } else {
            cp_async16(ks + at, (const bf16*)s.k + off, valid);
            if (kv) cp_async16(vs + at, (const bf16*)s.v + off, valid);
        }
    }
}

// One tile of keys for one 16-row m-tile: the raw scores `s` (masked past the
// sequence's keys on the last tile only: MASK) become probabilities, the running max
// (of raw scores: the scale is positive, so the max commutes with it) and sum of rows
// g and g + 8 move, and the accumulator `o` is rescaled to the new max. Each
// probability is one FMA and one exp2: 2^(s * scale - max * scale), the softmax scale
// (log2(e) / sqrt(d)) folded in, as FlashAttention-2 does. The probabilities stay in `s`.
template <int D, int BC, bool MASK>
DEV void fa2_softmax(float (&s)[BC / 8][4], float (&o)[D / 8][4], float (&m)[2], float (&l)[2],
                     int j0, int kv_len, float scale_log2, int t) {
    float mx0 = m[0], mx1 = m[1];
#pragma unroll
    for (int nt = 0; nt < BC / 8; nt++) {
        if (MASK) {
#pragma unroll
            for (int i = 0; i < 4; i++) {
                int col = j0 + nt * 8 + 2 * t + (i & 1);
                if (col >= kv_len) s[nt][i] = NEG_INF;
            }
        }
        mx0 = fmaxf(mx0, fmaxf(s[nt][0], s[nt][1]));
        mx1 = fmaxf(mx1, fmaxf(s[nt][2], s[nt][3]));
    }
    mx0 = quad_max(mx0);  // finite: column j0 of every tile is a real key
    mx1 = quad_max(mx1);
    // m is -inf before the first tile: the old sum and accumulator scale by 2^-inf = 0.
    const float a0 = fast_exp2((m[0] - mx0) * scale_log2), a1 = fast_exp2((m[1] - mx1) * scale_log2);
    m[0] = mx0;
    m[1] = mx1;
    const float ms0 = mx0 * scale_log2, ms1 = mx1 * scale_log2;
    float rs0 = 0.f, rs1 = 0.f;
#pragma unroll
    for (int nt = 0; nt < BC / 8; nt++) {
        s[nt][0] = fast_exp2(fmaf(s[nt][0], scale_log2, -ms0));
        s[nt][1] = fast_exp2(fmaf(s[nt][1], scale_log2, -ms0));
        s[nt][2] = fast_exp2(fmaf(s[nt][2], scale_log2, -ms1));
        s[nt][3] = fast_exp2(fmaf(s[nt][3], scale_log2, -ms1));
        rs0 += s[nt][0] + s[nt][1];
        rs1 += s[nt][2] + s[nt][3];
    }
    l[0] = l[0] * a0 + rs0;
    l[1] = l[1] * a1 + rs1;
#pragma unroll
    for (int nd = 0; nd < D / 8; nd++) {
        o[nd][0] *= a0;
        o[nd][1] *= a0;
        o[nd][2] *= a1;
        o[nd][3] *= a1;
    }
}

// WM m-tiles of 16 query rows per warp, so a block takes 64 * WM rows, against key
// tiles of BC rows. With WM = 1 the warp's Q fragments live in registers for the whole
// kernel; with WM = 2 (the `fa2w` kernels, FlashAttention-2's own shape: 128-row
// blocks, 32 rows a warp) they are re-read from shared memory per tile, which the
// registers of two accumulators need, and every K and V fragment feeds two m-tiles:
// half the shared-memory reads per FLOP of K and V. Its key tiles are 32 rows at
// D = 128, as FlashAttention-2 takes them, to keep the scores in registers (64-row
// tiles spill).
template <int D, int WM, int BC>
DEV void attn_fa2(const AttnParams& p) {
    constexpr int T = BC * D;
    static_assert(WM == 1 || WM == 2, "one or two m-tiles a warp");
    static_assert(BC == 32 || BC == 64, "key tiles of 32 or 64 rows");
    static_assert(WM == 2 || BC == 64, "Q is staged in V1: 64 rows");
    // K0 | K1 | V0 | V1, each BC x D; with WM = 2 then Q, 128 x D. With WM = 1, Q is
    // staged in V1 and moved to registers before tile 1 needs V1.
    DYN_SMEM(unsigned short, sm);
    unsigned short* qs = WM == 1 ? sm + 3 * T : sm + 4 * T;
    int2 tile = ((const int2*)p.tiles)[blockIdx.x];
    AttnSeq sq = ((const AttnSeq*)p.seqs)[tile.x];
    const int h = blockIdx.y, q0 = tile.y;
    const u32* qrows = (const u32*)p.q_rows + sq.q_off;
    const u32* kvrows = (const u32*)p.kv_rows + sq.kv_off;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
    const int n_tiles = (sq.kv_len + BC - 1) / BC;
    const int wr = warp * 16 * WM;  // the warp's first row in the block

    // Q, then tile 0 into K0/V0: one group.
#pragma unroll
    for (int half = 0; half < WM; half++)
        fa2_load_tile<D>(p, qrows + q0 + 64 * half, 0, sq.q_len - q0 - 64 * half, h,
                         qs + half * 64 * D, nullptr, false);
    fa2_load_tile<D, BC>(p, kvrows, 0, sq.kv_len, h, sm, sm + 2 * T, true);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    u32 qf[WM == 1 ? D / 16 : 1][4];
    if (WM == 1) {
#pragma unroll
        for (int ks = 0; ks < D / 16; ks++)
            ldmatrix_x4(qf[ks], qs + swz(wr + (lane & 15), 2 * ks + (lane >> 4), D));
        __syncthreads();  // V1 is tile 1's from here on
    }

    float o[WM][D / 8][4];
    float m[WM][2], l[WM][2];
#pragma unroll
    for (int mt = 0; mt < WM; mt++) {
#pragma unroll
        for (int nd = 0; nd < D / 8; nd++) o[mt][nd][0] = o[mt][nd][1] = o[mt][nd][2] = o[mt][nd][3] = 0.f;
        m[mt][0] = m[mt][1] = NEG_INF;
        l[mt][0] = l[mt][1] = 0.f;
    }

    for (int j = 0; j < n_tiles; j++) {
        const unsigned short* Kt = sm + (j & 1) * T;
        const unsigned short* Vt = sm + (2 + (j & 1)) * T;
        // Prefetch tile j+1 into the buffers tile j-1 used (everyone left them at the
        // barrier that ended the last iteration), then wait for tile j only.
        if (j + 1 < n_tiles)
            fa2_load_tile<D, BC>(p, kvrows, (j + 1) * BC, sq.kv_len, h, sm + ((j + 1) & 1) * T,
                                 sm + (2 + ((j + 1) & 1)) * T, true);
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();

        float s[WM][BC / 8][4];
#pragma unroll
        for (int mt = 0; mt < WM; mt++)
#pragma unroll
            for (int nt = 0; nt < BC / 8; nt++) s[mt][nt][0] = s[mt][nt][1] = s[mt][nt][2] = s[mt][nt][3] = 0.f;
#pragma unroll
        for (int ks = 0; ks < D / 16; ks++) {
            u32 qa[WM][4];
#pragma unroll
            for (int mt = 0; mt < WM; mt++) {
                if (WM == 1) {
#pragma unroll
                    for (int i = 0; i < 4; i++) qa[mt][i] = qf[WM == 1 ? ks : 0][i];
                } else {
                    ldmatrix_x4(qa[mt], qs + swz(wr + 16 * mt + (lane & 15), 2 * ks + (lane >> 4), D));
                }
            }
#pragma unroll
            for (int nt = 0; nt < BC / 8; nt += 2) {
                u32 b[4];
                ldmatrix_x4(b, Kt + swz(nt * 8 + (lane & 7) + ((lane >> 4) << 3), 2 * ks + ((lane >> 3) & 1), D));
#pragma unroll
                for (int mt = 0; mt < WM; mt++) {
                    mma_16816(s[mt][nt], qa[mt], b);
                    mma_16816(s[mt][nt + 1], qa[mt], b + 2);
                }
            }
        }
        // Only the last tile can run past the sequence's keys: the others skip the mask.
        if ((j + 1) * BC > sq.kv_len) {
#pragma unroll
            for (int mt = 0; mt < WM; mt++)
                fa2_softmax<D, BC, true>(s[mt], o[mt], m[mt], l[mt], j * BC, sq.kv_len, p.scale_log2, t);
        } else {
#pragma unroll
            for (int mt = 0; mt < WM; mt++)
                fa2_softmax<D, BC, false>(s[mt], o[mt], m[mt], l[mt], j * BC, sq.kv_len, p.scale_log2, t);
        }
#pragma unroll
        for (int kk = 0; kk < BC / 16; kk++) {
            u32 a[WM][4];
#pragma unroll
            for (int mt = 0; mt < WM; mt++) {
                a[mt][0] = pack_bf16x2(s[mt][2 * kk][0], s[mt][2 * kk][1]);
                a[mt][1] = pack_bf16x2(s[mt][2 * kk][2], s[mt][2 * kk][3]);
                a[mt][2] = pack_bf16x2(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
                a[mt][3] = pack_bf16x2(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
            }
#pragma unroll
            for (int nd = 0; nd < D / 8; nd += 2) {
                u32 b[4];
                ldmatrix_x4_trans(b, Vt + swz(kk * 16 + (lane & 7) + (((lane >> 3) & 1) << 3), nd + (lane >> 4), D));
#pragma unroll
                for (int mt = 0; mt < WM; mt++) {
                    mma_16816(o[mt][nd], a[mt], b);
                    mma_16816(o[mt][nd + 1], a[mt], b + 2);
                }
            }
        }
        __syncthreads();
    }
    cp_async_wait<0>();
#pragma unroll
    for (int mt = 0; mt < WM; mt++) {
#pragma unroll
        for (int half = 0; half < 2; half++) {
            const float lh = quad_sum(l[mt][half]), inv = lh > 0.f ? 1.f / lh : 0.f;
            const int row = q0 + wr + 16 * mt + g + 8 * half;
            if (row < sq.q_len) {
                u32 ref = qrows[row];
                const AttnSlot& s = slot_of(p, ref);
                bf16* dst = (bf16*)s.k + ROW_IDX(ref) * s.stride + h * D;
#pragma unroll
                for (int nd = 0; nd < D / 8; nd++)
                    *reinterpret_cast<u32*>(dst + nd * 8 + 2 * t) =
                        pack_bf16x2(o[mt][nd][2 * half] * inv, o[mt][nd][2 * half + 1] * inv);
            }
        }
    }
}
// 64 KB of dynamic shared memory at D = 128 (the launch raises the 48 KB default);
// ptxas (sm_90a, NVRTC 13.5): 203 registers at D = 128 and 160 at D = 64, no spills
// (cuda/tests/nvrtc.rs prints and checks it): 2 blocks (8 warps) an SM at D = 128. A
// cap of 168 registers for 3 blocks spills 8 bytes on sm_80 (188 before the softmax
// took one FMA per score), so 2 it is until a GPU says otherwise.
extern "C" __global__ void __launch_bounds__(128, 2) attn_fa2_bf16_d64(const AttnParams p) { attn_fa2<64, 1, 64>(p); }
EMU_EXPORT(attn_fa2_bf16_d64, AttnParams)
extern "C" __global__ void __launch_bounds__(128, 2) attn_fa2_bf16_d128(const AttnParams p) { attn_fa2<128, 1, 64>(p); }
EMU_EXPORT(attn_fa2_bf16_d128, AttnParams)
// 128-row blocks, 32 rows a warp, with Q in shared memory beside K and V double-
// buffered: 64 KB at D = 128 (32-row key tiles) and 48 KB at D = 64 (64-row ones).
// ptxas (sm_90a): 242 registers at D = 128, 230 at D = 64, no spills; 64-row key
// tiles at D = 128 spill 12 bytes on sm_80 (255 registers).
extern "C" __global__ void __launch_bounds__(128, 2) attn_fa2w_bf16_d64(const AttnParams p) { attn_fa2<64, 2, 64>(p); }
EMU_EXPORT(attn_fa2w_bf16_d64, AttnParams)
extern "C" __global__ void __launch_bounds__(128, 2) attn_fa2w_bf16_d128(const AttnParams p) { attn_fa2<128, 2, 32>(p); }
EMU_EXPORT(attn_fa2w_bf16_d128, AttnParams)

// ---- the scratch of attention through a library (cuda/src/sdpa.rs) ----
// A sequence the library cannot read in place has its query and K/V rows gathered into
// contiguous buffers (fp8 template rows decoded with their head's scale, as the tile
// loads above decode them), and the output scattered back over the queries. Runs of 8
// values (16-byte accesses) where the width allows; a run never straddles a row or,
// head dims being multiples of 8, a head.
template <class T>
DEV void attn_pack(const AttnPackParams& p) {
    const u32 w = p.width;
    for_runs((u32)p.padded * w, w % 8 == 0, [&](u32 i, auto run) {
        constexpr int V = decltype(run)::n;
        const u32 r = i / w, c = i % w;
        float v[V];
        if (r >= (u32)p.rows) {
#pragma unroll
            for (int j = 0; j < V; j++) v[j] = 0.f;
        } else {
            const u32 ref = ((const u32*)p.refs)[r];
            const AttnSlot& s = p.slots[ROW_SLOT(ref)];
            const u64 base = p.values ? s.v : s.k, scales = p.values ? s.v_scales : s.k_scales;
            const long long at = (long long)ROW_IDX(ref) * s.stride + c;
            if (scales) {
                const float sc = ((const float*)scales)[c / p.head_dim];
                const unsigned char* b = (const unsigned char*)base + at;
#pragma unroll
                for (int j = 0; j < V; j++) v[j] = fp8_to_f32(b[j]) * sc;
            } else {
                const T* src = (const T*)base + at;
                if (V == 8 && aligned16((u64)src)) {
                    load_run<V>(src, v);
                } else {
#pragma unroll
                    for (int j = 0; j < V; j++) v[j] = to_f32(src[j]);
                }
            }
        }
        store_run<V>((T*)p.dense + (long long)r * p.ld + c, v);
    });
}
template <class T>
DEV void attn_unpack(const AttnPackParams& p) {
    const u32 w = p.width;
    for_runs((u32)p.rows * w, w % 8 == 0, [&](u32 i, auto run) {
        constexpr int V = decltype(run)::n;
        const u32 r = i / w, c = i % w;
        float v[V];
        load_run<V>((const T*)p.dense + (long long)r * p.ld + c, v);
        const u32 ref = ((const u32*)p.refs)[r];
        const AttnSlot& s = p.slots[ROW_SLOT(ref)];
        T* dst = (T*)s.k + (long long)ROW_IDX(ref) * s.stride + c;
        if (V == 8 && aligned16((u64)dst)) {
            store_run<V>(dst, v);
        } else {
#pragma unroll
            for (int j = 0; j < V; j++) dst[j] = from_f32<T>(v[j]);
        }
    });
}
extern "C" __global__ void attn_pack_bf16(const AttnPackParams p) { attn_pack<bf16>(p); }
EMU_EXPORT(attn_pack_bf16, AttnPackParams)
extern "C" __global__ void attn_unpack_bf16(const AttnPackParams p) { attn_unpack<bf16>(p); }
EMU_EXPORT(attn_unpack_bf16, AttnPackParams)

// ---- the text encoders' attention (cuda/src/text.rs) ----
// Every head and query row of a prompt (at most 512 tokens) in one launch per layer,
// with T5's additive position bias or CLIP's causal mask, the scores scaled by `scale`
// (T5: 1) before the bias: one warp per (query row, head), four a block, lanes scoring
// 32 keys at a time with an online softmax in f32 (as attn_simt), the output written to
// the head's columns. Head dims up to 128 (CLIP and T5 have 64).
template <class T>
DEV void text_attn(const TextAttnParams& p) {
    constexpr int WARPS = 4, MAXJ = 4;  // head_dim <= 128
    __shared__ float qs[WARPS][128];    // this warp's query row, pre-scaled
    __shared__ float ps[WARPS][32];     // probabilities of the current 32 keys
    const int h = blockIdx.y, w = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int i = blockIdx.x * WARPS + w;
    if (i >= p.len) return;  // whole warp; this kernel has only warp barriers
    const int hd = p.head_dim, inner = p.heads * hd;
    const long long ld = 3LL * inner;
    const T* qkv = (const T*)p.qkv;
    const T* q = qkv + i * ld + h * hd;
    for (int c = lane; c < hd; c += 32) qs[w][c] = to_f32(q[c]) * p.scale;
    __syncwarp();
    float o[MAXJ];
#pragma unroll
    for (int jj = 0; jj < MAXJ; jj++) o[jj] = 0.f;
    float m = NEG_INF, l = 0.f;
    const int n = p.causal ? i + 1 : p.len;
    const T* bias = p.bias ? (const T*)p.bias + ((long long)h * p.len + i) * p.len : nullptr;
    for (int j0 = 0; j0 < n; j0 += 32) {
        const int j = j0 + lane, nj = min(32, n - j0);
        float sc = NEG_INF;
        if (j < n) {
            const T* k = qkv + j * ld + inner + h * hd;
            float dot = 0.f;
            for (int c = 0; c < hd; c++) dot += qs[w][c] * to_f32(k[c]);
            sc = dot + (bias ? to_f32(bias[j]) : 0.f);
        }
        const float mn = fmaxf(m, warp_max(sc));  // finite: key j0 exists
        const float pr = j < n ? expf(sc - mn) : 0.f;
        const float alpha = expf(m - mn);
        l = l * alpha + warp_sum(pr);
        m = mn;
        ps[w][lane] = pr;
        __syncwarp();
#pragma unroll
        for (int jj = 0; jj < MAXJ; jj++) o[jj] *= alpha;
        for (int r = 0; r < nj; r++) {
            const T* v = qkv + (j0 + r) * ld + 2 * inner + h * hd;
            const float pv = ps[w][r];
#pragma unroll
            for (int jj = 0; jj < MAXJ; jj++) {
                const int c = lane + 32 * jj;
                if (c < hd) o[jj] += pv * to_f32(v[c]);
            }
        }
        __syncwarp();
    }
    T* out = (T*)p.out + (long long)i * inner + h * hd;
#pragma unroll
    for (int jj = 0; jj < MAXJ; jj++) {
        const int c = lane + 32 * jj;
        if (c < hd) out[c] = from_f32<T>(o[jj] / l);
    }
}
extern "C" __global__ void text_attn_f32(const TextAttnParams p) { text_attn<float>(p); }
EMU_EXPORT(text_attn_f32, TextAttnParams)
extern "C" __global__ void text_attn_bf16(const TextAttnParams p) { text_attn<bf16>(p); }
EMU_EXPORT(text_attn_bf16, TextAttnParams)
