// Shared by every kernel: element types, conversions, warp reductions, the tensor-core
// MMA, and the parameter structs (mirrored field for field in cuda/src/params.rs).
//
// The same sources compile two ways:
// - by NVRTC for the GPU (the production path, cuda/src/compile.rs), and
// - by the host C++ compiler with DENOISED_EMU defined, through cuda/emu/emu.h, which
//   runs each thread block on CPU threads. That lets CI, which has no GPU, execute the
//   real kernel code against the CPU backend (cuda/tests/kernels.rs).
// So kernels use only what is defined here or in emu.h: no raw intrinsics elsewhere.
#pragma once

#ifdef DENOISED_EMU
#include "emu.h"
#else
#define DEV __device__ __forceinline__
#define DYN_SMEM(T, name) \
    extern __shared__ __align__(16) unsigned char name##_raw[]; \
    T* name = reinterpret_cast<T*>(name##_raw)
#define EMU_EXPORT(name, P)
#endif

typedef unsigned int u32;
typedef unsigned long long u64;

// bf16 is our own 2-byte struct on both paths, so kernels need no toolkit header
// (NVRTC ships none, and the GPU machine may have only the driver and libnvrtc).
#ifdef DENOISED_EMU
typedef emu::bf16 bf16;
#else
struct bf16 {
    unsigned short bits;
};
#endif

// ---- conversions (bf16 storage, f32 arithmetic) ----
DEV float to_f32(float x) { return x; }
DEV float to_f32(bf16 x) {
#ifdef DENOISED_EMU
    return emu::bf16_to_f32(x);
#else
    return __uint_as_float((u32)x.bits << 16);
#endif
}
template <class T> DEV T from_f32(float x);
template <> DEV float from_f32<float>(float x) { return x; }
template <> DEV bf16 from_f32<bf16>(float x) {
#ifdef DENOISED_EMU
    return emu::f32_to_bf16(x);
#else
    bf16 r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r.bits) : "f"(x));
    return r;
#endif
}
// Two bf16 in one 32-bit register, `lo` in the low half: the operand format of mma.
DEV u32 pack_bf16x2(float lo, float hi) {
#ifdef DENOISED_EMU
    return (u32)from_f32<bf16>(lo).bits | ((u32)from_f32<bf16>(hi).bits << 16);
#else
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));  // first source -> high half
    return r;
#endif
}
// f32 product and difference, each rounded on its own: never contracted into a fused
// multiply-add (NVRTC contracts `a * b - c` by default), for results that must match
// the host bit for bit (the dequantisers). The emulator's host compiler does not
// contract (ISO C++ mode, and no FMA in baseline x86-64).
#ifdef DENOISED_EMU
DEV float mul_rn(float a, float b) { return a * b; }
DEV float sub_rn(float a, float b) { return a - b; }
#else
DEV float mul_rn(float a, float b) { return __fmul_rn(a, b); }
DEV float sub_rn(float a, float b) { return __fsub_rn(a, b); }
#endif
// ---- runs of values: 16-byte accesses on the memory-bound passes ----
// A pass reads and writes its rows in runs of V values converted to f32: V = 8 is one
// 16-byte access for bf16 (two for f32), taken where every pointer is 16-byte aligned
// and every row a multiple of 8 wide; V = 1 (or 2, for RoPE's pairs) is the scalar
// fallback for the rest. Kernels write one body templated on V and pick V at run time.
DEV bool aligned16(u64 a) { return (a & 15) == 0; }
template <int V, class T>
DEV void load_run(const T* p, float* v) {
    if constexpr (V == 8 && sizeof(T) == 2) {
        uint4 u = *reinterpret_cast<const uint4*>(p);
        const u32 w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
        for (int i = 0; i < 4; i++) {
            v[2 * i] = __uint_as_float(w[i] << 16);
            v[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
        }
    } else if constexpr (V == 8) {
        float4 a = reinterpret_cast<const float4*>(p)[0], b = reinterpret_cast<const float4*>(p)[1];
        v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w;
        v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
    } else {
#pragma unroll
        for (int i = 0; i < V; i++) v[i] = to_f32(p[i]);
    }
}
template <int V, class T>
DEV void store_run(T* p, const float* v) {
    if constexpr (V == 8 && sizeof(T) == 2) {
        uint4 u = {pack_bf16x2(v[0], v[1]), pack_bf16x2(v[2], v[3]), pack_bf16x2(v[4], v[5]),
                   pack_bf16x2(v[6], v[7])};
        *reinterpret_cast<uint4*>(p) = u;
    } else if constexpr (V == 8) {
        reinterpret_cast<float4*>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
        reinterpret_cast<float4*>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
    } else {
#pragma unroll
        for (int i = 0; i < V; i++) p[i] = from_f32<T>(v[i]);
    }
}
// The value a store of type T keeps: what a later pass reading it back sees.
template <class T>
DEV float rounded(float x) { return to_f32(from_f32<T>(x)); }
// The run length as a type, so that one generic lambda serves both paths.
template <int N>
struct Run {
    static constexpr int n = N;
};
// Grid-stride over n flat elements in 32-bit indices: runs of 8 where `vec`, then the
// rest one at a time; f(first element, Run<V>).
template <class F>
DEV void for_runs(u32 n, bool vec, F f) {
    const u32 tid = blockIdx.x * blockDim.x + threadIdx.x, step = gridDim.x * blockDim.x;
    u32 done = 0;
    if (vec) {
        done = n / 8 * 8;
        for (u32 i = tid; i < n / 8; i += step) f(i * 8, Run<8>());
    }
    for (u32 i = done + tid; i < n; i += step) f(i, Run<1>());
}

// 2^x for softmax: the hardware's ex2.approx (2 ulp; 2^-inf = +0) on the GPU, where
// NVRTC has no fast-math flag and exp2f would be the precise, slower sequence; exp2f
// on the emulator.
#ifdef DENOISED_EMU
DEV float fast_exp2(float x) { return exp2f(x); }
#else
DEV float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
#endif

// ---- warp reductions (all 32 lanes must take part) ----
DEV float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
DEV float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
// Reduction over the 4 lanes of a quad (lanes sharing lane>>2): one row of an mma
// accumulator fragment.
DEV float quad_sum(float v) {
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    v += __shfl_xor_sync(0xffffffffu, v, 2);
    return v;
}
DEV float quad_max(float v) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
    return v;
}

// d += a * b for one m16n8k16 bf16 tile with f32 accumulation (warp-wide). Fragment
// layout per the PTX ISA ("mma.m16n8k16", .bf16): with g = lane>>2, t = lane&3,
//   a[0] = A[g][2t..2t+1]   a[1] = A[g+8][2t..]   a[2] = A[g][2t+8..]   a[3] = A[g+8][2t+8..]
//   b[0] = B[2t..2t+1][g]   b[1] = B[2t+8..2t+9][g]
//   d[0..1] = D[g][2t..2t+1]   d[2..3] = D[g+8][2t..2t+1]
// emu.h implements exactly this layout, so kernel code written against it is tested.
DEV void mma_16816(float d[4], const u32 a[4], const u32 b[2]) {
#ifdef DENOISED_EMU
    emu::mma_16816(d, a, b);
#else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}

// ---- shared memory: ldmatrix, cp.async, and plain shared loads/stores ----
// Kernels that care about shared-memory speed go through these, so that the emulator
// sees every access and counts bank conflicts the way the hardware serialises them
// (emu.h, "bank conflicts"). On the GPU they are the plain PTX instructions.
#ifndef DENOISED_EMU
DEV u32 smem_addr(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}
#endif
// Four 8x8 b16 matrices; lanes 8i..8i+7 give the row addresses of matrix i (16 bytes
// each), and r[i] receives this lane's two elements of matrix i: row lane/4, columns
// 2(lane%4) and 2(lane%4)+1 (the mma A/B fragment layout).
DEV void ldmatrix_x4(u32 r[4], const void* row) {
#ifdef DENOISED_EMU
    emu::ldmatrix_x4(r, row, false);
#else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(row)));
#endif
}
// The same, transposed: r[i] holds elements (2(lane%4), lane/4) and (2(lane%4)+1,
// lane/4) of matrix i, so a row-major [k][n] tile gives the B fragment of mma.
DEV void ldmatrix_x4_trans(u32 r[4], const void* row) {
#ifdef DENOISED_EMU
    emu::ldmatrix_x4(r, row, true);
#else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(row)));
#endif
}
// 16 bytes global -> shared without passing through registers; zeros when !valid (the
// source is then not read). Completes at cp_async_wait.
DEV void cp_async16(void* dst, const void* src, bool valid) {
#ifdef DENOISED_EMU
    emu::async_copy16(dst, src, valid);
#else
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                 :: "r"(smem_addr(dst)), "l"(src), "r"(valid ? 16 : 0));
#endif
}
DEV void cp_async_commit() {
#ifdef DENOISED_EMU
    emu::cp_async_commit();
#else
    asm volatile("cp.async.commit_group;\n" ::);
#endif
}
// Waits until at most N committed groups are still in flight.
template <int N>
DEV void cp_async_wait() {
#ifdef DENOISED_EMU
    emu::cp_async_wait(N);
#else
    asm volatile("cp.async.wait_group %0;\n" :: "n"(N));
#endif
}
template <class T>
DEV T ld_shared(const T* p) {
#ifdef DENOISED_EMU
    emu::record_shared(p, sizeof(T));
#endif
    return *p;
}
template <class T>
DEV void st_shared(T* p, T v) {
#ifdef DENOISED_EMU
    emu::record_shared(p, sizeof(T));
#endif
    *p = v;
}

// ---- parameter structs: every kernel takes exactly one, by value ----
// Pointers are u64 device addresses so the layout is identical in Rust (#[repr(C)]).

// Elementwise over a column range of a row-major matrix, or over `n` flat elements.
struct EwParams {
    u64 x;      // in/out
    u64 y;      // second operand (add, gated residual) or output (silu, convert)
    u64 table;  // gated residual: modulation table, already offset to its chunk; bias_rows: the bias
    u64 seg;    // gated residual: const u32* segment per row
    int rows, cols;         // matrix shape of x (and y)
    int c0, c1;             // column range
    int table_cols;         // row stride of table
    int n;                  // flat element count (silu, add, convert)
    float alpha;            // axpy_cols: the scale of y
};

// LayerNorm (no affine) + adaLN modulation per row segment, with optional fused
// gather of input rows and scatter of output rows; residual_ln_modulate first adds
// the gated residual `x += gate[seg] * y` in place.
struct LnModParams {
    u64 x, out;
    u64 shift, scale;       // tables offset to their chunk
    u64 seg;                // const u32* per output row
    u64 in_index;           // optional const u32*: out row r reads x row in_index[r]
    u64 out_index;          // optional const u32*: out row r is written to out_index[r]
    u64 y, gate;            // residual_ln_modulate: y [rows, width], gate table at its chunk
    int rows, width, table_cols;
    float eps;
};

// Per-head RMSNorm with weight, then optional interleaved RoPE (cos/sin [rows, hd]),
// over up to two column ranges (q and k), each with its weight: range i is heads[i]
// heads from column c0[i] (heads[1] = 0 for one range).
struct RmsRopeParams {
    u64 x, weight[2], cos, sin;  // cos == 0: no RoPE
    int rows, stride, c0[2], heads[2], head_dim;
    float eps;
};

// Row gather: out row i = row index[i].row of source index[i].src (up to 8 sources);
// or a column block of one source when `index` is 0 (rows r0.., columns c0..c0+cols).
struct GatherParams {
    u64 srcs[8];
    int src_stride[8];
    u64 src_table;  // when set, sources are (u64 address, u64 stride) pairs here
    u64 index;  // const u32 pairs (src, row)
    u64 out;
    int rows, cols, r0, c0;
};

// A GEMM's epilogue as its own pass: dst[r, c] = act(src[r, c] * xs[r] * ws[c] + bias[c])
// over rows x cols; xs, ws (f32) and bias (T) left out where 0.
struct EpilogueParams {
    u64 src, dst, xs, ws, bias;
    int rows, cols, ld_src, ld_dst, gelu;
    int scalar;  // xs and ws are one value each (per-tensor fp8 scales)
};

// Sinusoidal embedding: out[b] = [cos(x_b * f_i)..., sin(x_b * f_i)...].
struct TimestepParams {
    u64 xs, freqs, out;  // f32, f32, T
    int n, half;
};

// Masked-query attention. A row reference packs (slot << 29 | row); slot picks a base
// pointer: for queries `k` is the query base (and where the output goes), for keys and
// values `k`/`v` point at column 0 of the head-0 keys/values of that buffer.
struct AttnSlot {
    u64 k, v;
    long long stride;     // elements between rows
    u64 k_scales, v_scales;  // fp8 K/V: f32 scale per head of K and of V; else 0
};

// FP8 E4M3 (OCP e4m3fn) to float. Template slabs hold finite values only (quantised
// with saturation), so the NaN code is not handled.
DEV float fp8_to_f32(u32 b) {
    u32 e = (b >> 3) & 0xF, m = b & 7;
    float v = e == 0 ? (float)m * (1.f / 512.f) : __int_as_float(((e + 120) << 23) | (m << 20));
    return (b & 0x80) ? -v : v;
}
struct AttnSeq {
    int q_off, q_len, kv_off, kv_len;  // into q_rows / kv_rows
};
struct AttnParams {
    AttnSlot slots[8];
    u64 q_rows, kv_rows;  // const u32*
    u64 seqs;             // const AttnSeq*
    u64 tiles;            // const int2* (seq, first query) per block of queries
    int n_tiles, heads, head_dim;
    float scale_log2;     // log2(e) / sqrt(head_dim)
};

// The gather into, and scatter out of, the contiguous scratch that attention through a
// library reads and writes (cuda/src/sdpa.rs): row r of the dense side, `ld` elements
// apart, is the row `refs[r]` references (zeros for r in [rows, padded)).
struct AttnPackParams {
    AttnSlot slots[8];
    u64 refs;   // const u32*
    u64 dense;  // T*
    int rows, padded, ld, width, head_dim;
    int values;  // 1: the V columns (slot.v, v_scales); 0: K, or queries
};

// The text encoders' attention (CLIP, T5), one launch per layer: q | k | v rows of
// `3 * heads * head_dim`, the output `heads * head_dim` wide.
struct TextAttnParams {
    u64 qkv, out;
    u64 bias;    // T5's position bias [heads * len, len] (T), or 0
    int len, heads, head_dim;
    int causal;  // CLIP: row i sees keys 0..=i
    float scale;
    int pad;
};

// Image kernels (cuda/kernels/image.cu), on NHWC activations: element (b, y, x, c) of a
// [B, H, W, C] image is at ((b*H + y)*W + x)*C + c. Which fields a kernel reads is
// said at the kernel.
struct ImgParams {
    u64 x, y, z, wt, bias;
    int batch, h, w, c;                          // the input image
    int oh, ow, kh, kw, stride, pad_t, pad_l, up;  // convolution geometry
    int p0, rows, cols, ld;                      // a block of rows (pixels, scores)
    int groups, splits, silu;
    int causal, ldy;                             // softmax_rows, copy2d
    float eps, scale;
};

#define ROW_SLOT(r) ((r) >> 29)
#define ROW_IDX(r) ((r) & 0x1fffffffu)
