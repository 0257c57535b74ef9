// Normalisation kernels, one warp per row (LayerNorm) or per (row, head) (RMSNorm):
// a row of 3072 is 96 elements per lane, read through L1 twice, so a warp-per-row
// layout with shuffles beats a block reduction and needs no shared memory.
#include "common.cuh"

// out[o(r)] = LN(x[i(r)]) * (1 + scale[seg[r]]) + shift[seg[r]], where i/o are the
// optional fused gather/scatter indices (identity when absent).
template <class T>
DEV void ln_modulate(const LnModParams& p) {
    int warps = blockDim.x / 32;
    int r = blockIdx.x * warps + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (r >= p.rows) return;  // whole warp leaves together; no block barrier follows
    const u32* in_index = (const u32*)p.in_index;
    const u32* out_index = (const u32*)p.out_index;
    long long ir = in_index ? in_index[r] : r;
    long long orow = out_index ? out_index[r] : r;
    const T* x = (const T*)p.x + ir * p.width;
    T* out = (T*)p.out + orow * p.width;
    long long s = ((const u32*)p.seg)[r];
    const T* shift = (const T*)p.shift + s * p.table_cols;
    const T* scale = (const T*)p.scale + s * p.table_cols;

    float sum = 0.f;
    for (int c = lane; c < p.width; c += 32) sum += to_f32(x[c]);
    float mean = warp_sum(sum) / p.width;
    float sq = 0.f;
    for (int c = lane; c < p.width; c += 32) {
        float d = to_f32(x[c]) - mean;
        sq += d * d;
    }
    float rstd = rsqrtf(warp_sum(sq) / p.width + p.eps);
    for (int c = lane; c < p.width; c += 32) {
        float v = (to_f32(x[c]) - mean) * rstd;
        out[c] = from_f32<T>(v * (1.0f + to_f32(scale[c])) + to_f32(shift[c]));
    }
}
extern "C" __global__ void ln_modulate_f32(const LnModParams p) { ln_modulate<float>(p); }
EMU_EXPORT(ln_modulate_f32, LnModParams)
extern "C" __global__ void ln_modulate_bf16(const LnModParams p) { ln_modulate<bf16>(p); }
EMU_EXPORT(ln_modulate_bf16, LnModParams)

// Per-head RMSNorm of x[r, c0 + h*hd .. +hd] with weight[hd], in place, then the
// interleaved RoPE of pairs (2i, 2i+1) with the row's cos/sin tables. Each lane owns
// whole pairs, so the rotation needs no exchange between lanes.
template <class T>
DEV void rms_rope(const RmsRopeParams& p) {
    int warps = blockDim.x / 32;
    int unit = blockIdx.x * warps + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (unit >= p.rows * p.heads) return;
    int r = unit / p.heads, h = unit % p.heads;
    T* x = (T*)p.x + (long long)r * p.stride + p.c0 + h * p.head_dim;
    const T* w = (const T*)p.weight;
    float ss = 0.f;
    for (int c = lane; c < p.head_dim; c += 32) {
        float v = to_f32(x[c]);
        ss += v * v;
    }
    float rr = rsqrtf(warp_sum(ss) / p.head_dim + p.eps);
    const T* cs = (const T*)p.cos + (long long)r * p.head_dim;
    const T* sn = (const T*)p.sin + (long long)r * p.head_dim;
    for (int c = 2 * lane; c < p.head_dim; c += 64) {
        float a = to_f32(x[c]) * rr * to_f32(w[c]);
        float b = to_f32(x[c + 1]) * rr * to_f32(w[c + 1]);
        if (p.cos) {
            float na = a * to_f32(cs[c]) - b * to_f32(sn[c]);
            float nb = b * to_f32(cs[c + 1]) + a * to_f32(sn[c + 1]);
            a = na;
            b = nb;
        }
        x[c] = from_f32<T>(a);
        x[c + 1] = from_f32<T>(b);
    }
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
