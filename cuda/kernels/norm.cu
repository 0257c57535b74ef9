// Normalisation kernels, one warp per row (LayerNorm) or per (row, head) (RMSNorm):
// a row of 3072 is 96 elements per lane, read through L1 twice, so a warp-per-row
// layout with shuffles beats a block reduction and needs no shared memory.
#include "common.cuh"

// One row of LayerNorm + modulation in runs of V values (see load_run), one warp:
// `x` is the input row, rewritten first as x + gate * y when RESID (the adaLN-Zero
// residual the LayerNorm follows; its statistics are of the stored, rounded values,
// as an unfused pass reading x back would see). The row is read from memory on each
// pass (L1 holds it), so registers do not grow with the width.
template <int V, bool RESID, class T>
DEV void ln_row(T* x, T* out, const T* shift, const T* scale, const T* y, const T* gate, int width,
                float eps, int lane) {
    float v[V], a[V], b[V];
    float sum = 0.f;
    for (int c = lane * V; c < width; c += 32 * V) {
        load_run<V>(x + c, v);
        if constexpr (RESID) {
            load_run<V>(y + c, a);
            load_run<V>(gate + c, b);
#pragma unroll
            for (int i = 0; i < V; i++) v[i] = rounded<T>(v[i] + b[i] * a[i]);
            store_run<V>(x + c, v);
        }
#pragma unroll
        for (int i = 0; i < V; i++) sum += v[i];
    }
    float mean = warp_sum(sum) / width;
    float sq = 0.f;
    for (int c = lane * V; c < width; c += 32 * V) {
        load_run<V>(x + c, v);  // this lane's own stores when RESID
#pragma unroll
        for (int i = 0; i < V; i++) sq += (v[i] - mean) * (v[i] - mean);
    }
    float rstd = rsqrtf(warp_sum(sq) / width + eps);
    for (int c = lane * V; c < width; c += 32 * V) {
        load_run<V>(x + c, v);
        load_run<V>(shift + c, a);
        load_run<V>(scale + c, b);
#pragma unroll
        for (int i = 0; i < V; i++) v[i] = (v[i] - mean) * rstd * (1.0f + b[i]) + a[i];
        store_run<V>(out + c, v);
    }
}

// out[o(r)] = LN(x[i(r)]) * (1 + scale[seg[r]]) + shift[seg[r]], where i/o are the
// optional fused gather/scatter indices (identity when absent). With RESID, first
// x[r] += gate[seg[r]] * y[r] in place (no gather/scatter then: the backend checks).
template <class T, bool RESID>
DEV void ln_modulate(const LnModParams& p) {
    int warps = blockDim.x / 32;
    int r = blockIdx.x * warps + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (r >= p.rows) return;  // whole warp leaves together; no block barrier follows
    const u32* in_index = (const u32*)p.in_index;
    const u32* out_index = (const u32*)p.out_index;
    long long ir = in_index ? in_index[r] : r;
    long long orow = out_index ? out_index[r] : r;
    T* x = (T*)p.x + ir * p.width;
    T* out = (T*)p.out + orow * p.width;
    long long s = ((const u32*)p.seg)[r];
    const T* shift = (const T*)p.shift + s * p.table_cols;
    const T* scale = (const T*)p.scale + s * p.table_cols;
    const T* y = RESID ? (const T*)p.y + (long long)r * p.width : nullptr;
    const T* gate = RESID ? (const T*)p.gate + s * p.table_cols : nullptr;
    bool vec = p.width % 8 == 0 && aligned16((u64)x | (u64)out | (u64)shift | (u64)scale) &&
               (!RESID || aligned16((u64)y | (u64)gate));
    if (vec)
        ln_row<8, RESID>(x, out, shift, scale, y, gate, p.width, p.eps, lane);
    else
        ln_row<1, RESID>(x, out, shift, scale, y, gate, p.width, p.eps, lane);
}
extern "C" __global__ void ln_modulate_f32(const LnModParams p) { ln_modulate<float, false>(p); }
EMU_EXPORT(ln_modulate_f32, LnModParams)
extern "C" __global__ void ln_modulate_bf16(const LnModParams p) { ln_modulate<bf16, false>(p); }
EMU_EXPORT(ln_modulate_bf16, LnModParams)
extern "C" __global__ void residual_ln_modulate_f32(const LnModParams p) { ln_modulate<float, true>(p); }
EMU_EXPORT(residual_ln_modulate_f32, LnModParams)
extern "C" __global__ void residual_ln_modulate_bf16(const LnModParams p) { ln_modulate<bf16, true>(p); }
EMU_EXPORT(residual_ln_modulate_bf16, LnModParams)

// One head: RMSNorm with weight w, then the interleaved RoPE of pairs (2i, 2i+1) with
// the row's cos/sin (when cs is not null), in place, in runs of V values (V even, so
// a lane owns whole pairs and the rotation needs no exchange between lanes).
template <int V, class T>
DEV void rms_rope_head(T* x, const T* w, const T* cs, const T* sn, int hd, float eps, int lane) {
    float v[V], a[V], b[V];
    float ss = 0.f;
    for (int c = lane * V; c < hd; c += 32 * V) {
        load_run<V>(x + c, v);
#pragma unroll
        for (int i = 0; i < V; i++) ss += v[i] * v[i];
    }
    float rr = rsqrtf(warp_sum(ss) / hd + eps);
    for (int c = lane * V; c < hd; c += 32 * V) {
        load_run<V>(x + c, v);
        load_run<V>(w + c, a);
#pragma unroll
        for (int i = 0; i < V; i++) v[i] = v[i] * rr * a[i];
        if (cs) {
            load_run<V>(cs + c, a);
            load_run<V>(sn + c, b);
#pragma unroll
            for (int i = 0; i < V; i += 2) {
                float na = v[i] * a[i] - v[i + 1] * b[i];
                float nb = v[i + 1] * a[i + 1] + v[i] * b[i + 1];
                v[i] = na;
                v[i + 1] = nb;
            }
        }
        store_run<V>(x + c, v);
    }
}

// Per-head RMSNorm + RoPE of up to two column ranges of x (q and k of a fused
// projection, each with its own weight), one warp per (row, head): one launch for
// both. Units of a row are its part-0 heads, then its part-1 heads.
template <class T>
DEV void rms_rope(const RmsRopeParams& p) {
    int warps = blockDim.x / 32;
    int unit = blockIdx.x * warps + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    int per_row = p.heads[0] + p.heads[1];
    if (unit >= p.rows * per_row) return;
    int r = unit / per_row, h = unit % per_row;  // 32-bit, once per warp
    int part = h < p.heads[0] ? 0 : 1;
    h -= part ? p.heads[0] : 0;
    T* x = (T*)p.x + (long long)r * p.stride + p.c0[part] + h * p.head_dim;
    const T* w = (const T*)p.weight[part];
    const T* cs = p.cos ? (const T*)p.cos + (long long)r * p.head_dim : nullptr;
    const T* sn = p.cos ? (const T*)p.sin + (long long)r * p.head_dim : nullptr;
    bool vec = p.head_dim % 8 == 0 && aligned16((u64)x | (u64)w | (u64)cs | (u64)sn);
    if (vec)
        rms_rope_head<8>(x, w, cs, sn, p.head_dim, p.eps, lane);
    else
        rms_rope_head<2>(x, w, cs, sn, p.head_dim, p.eps, lane);
}
extern "C" __global__ void rms_rope_f32(const RmsRopeParams p) { rms_rope<float>(p); }
EMU_EXPORT(rms_rope_f32, RmsRopeParams)
extern "C" __global__ void rms_rope_bf16(const RmsRopeParams p) { rms_rope<bf16>(p); }
EMU_EXPORT(rms_rope_bf16, RmsRopeParams)

// Row gather from any number of sources (up to 8 in the parameters, more in a table),
// or a column block of source 0 when index is 0.
template <class T>
DEV void gather(const GatherParams& p) {
    const u32* index = (const u32*)p.index;
    T* out = (T*)p.out;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < (long long)p.rows * p.cols;
         i += (long long)gridDim.x * blockDim.x) {
        long long r = i / p.cols, c = i % p.cols;
        int src = index ? index[2 * r] : 0;
        long long row = index ? index[2 * r + 1] : p.r0 + r;
        const T* s;
        long long stride;
        if (p.src_table) {
            const u64* t = (const u64*)p.src_table;
            s = (const T*)t[2 * src];
            stride = (long long)t[2 * src + 1];
        } else {
            s = (const T*)p.srcs[src];
            stride = p.src_stride[src];
        }
        out[i] = s[row * stride + p.c0 + c];
    }
}
extern "C" __global__ void gather_f32(const GatherParams p) { gather<float>(p); }
EMU_EXPORT(gather_f32, GatherParams)
extern "C" __global__ void gather_bf16(const GatherParams p) { gather<bf16>(p); }
EMU_EXPORT(gather_bf16, GatherParams)

// The text encoders' row norms, one warp per row, f32 math, LnModParams with `scale`
// and `shift` as [width] vectors (no segments): LayerNorm with affine weight and bias
// (CLIP), and RMSNorm with weight, `w * x / sqrt(mean(x^2) + eps)` (T5).
template <class T, bool RMS>
DEV void row_norm(const LnModParams& p) {
    int warps = blockDim.x / 32;
    int r = blockIdx.x * warps + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (r >= p.rows) return;
    const T* x = (const T*)p.x + (long long)r * p.width;
    T* out = (T*)p.out + (long long)r * p.width;
    const T* w = (const T*)p.scale;
    const T* b = (const T*)p.shift;
    float mean = 0.f;
    if (!RMS) {
        float sum = 0.f;
        for (int c = lane; c < p.width; c += 32) sum += to_f32(x[c]);
        mean = warp_sum(sum) / p.width;
    }
    float sq = 0.f;
    for (int c = lane; c < p.width; c += 32) {
        float d = to_f32(x[c]) - mean;
        sq += d * d;
    }
    float rstd = rsqrtf(warp_sum(sq) / p.width + p.eps);
    for (int c = lane; c < p.width; c += 32) {
        float v = (to_f32(x[c]) - mean) * rstd * to_f32(w[c]);
        out[c] = from_f32<T>(RMS ? v : v + to_f32(b[c]));
    }
}
extern "C" __global__ void ln_affine_f32(const LnModParams p) { row_norm<float, false>(p); }
EMU_EXPORT(ln_affine_f32, LnModParams)
extern "C" __global__ void ln_affine_bf16(const LnModParams p) { row_norm<bf16, false>(p); }
EMU_EXPORT(ln_affine_bf16, LnModParams)
extern "C" __global__ void rms_norm_f32(const LnModParams p) { row_norm<float, true>(p); }
EMU_EXPORT(rms_norm_f32, LnModParams)
extern "C" __global__ void rms_norm_bf16(const LnModParams p) { row_norm<bf16, true>(p); }
EMU_EXPORT(rms_norm_bf16, LnModParams)
