// GGUF (ggml) block dequantisation: a quantised Linear weight stays in its blocks on
// the device, and a GEMM with it first expands the rows it needs into a scratch
// matrix of the device dtype (`dequant_<type>_<dt>`), then runs the usual GEMM.
//
// Each value is computed exactly as `denoised_runtime::quant::dequantize` (and
// gguf-py) does: f16 scales widened to f32, and the same f32 operations in the same
// order, never contracted to a fused multiply-add (mul_rn/sub_rn), so the f32 kernel
// matches the host bit for bit and the bf16 one is its round to nearest even.
//
// EwParams: x = the first row's blocks, y = the [rows, cols] output, rows, cols (a
// multiple of the block size). One thread per output value.
#include "common.cuh"

#define QUANT_GRID_STRIDE(i, n) \
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (long long)gridDim.x * blockDim.x)

// IEEE half bits to f32 (exact: every f16 is an f32).
DEV float f16_bits_to_f32(u32 h) {
    const u32 sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    if (exp == 0x1fu) return __uint_as_float(sign | 0x7f800000u | (man << 13));
    if (exp == 0) {
        // Zero or subnormal: man * 2^-24, exact.
        const float v = mul_rn((float)man, 5.9604644775390625e-8f);
        return sign ? -v : v;
    }
    return __uint_as_float(sign | ((exp + 112u) << 23) | (man << 13));
}
DEV float f16_at(const unsigned char* b, int i) { return f16_bits_to_f32((u32)b[i] | ((u32)b[i + 1] << 8)); }

// The 6-bit scale and min of sub-block s of a Q4_K/Q5_K super-block (`get_scale_min`).
DEV void scale_min_k4(const unsigned char* s, int j, u32& sc, u32& m) {
    if (j < 4) {
        sc = s[j] & 63u;
        m = s[4 + j] & 63u;
    } else {
        sc = (s[4 + j] & 0x0fu) | ((s[j - 4] >> 2) & 0x30u);
        m = (s[4 + j] >> 4) | ((s[j] >> 2) & 0x30u);
    }
}

// Value e of the block at b.
template <int TY>
DEV float dequant_one(const unsigned char* b, int e);

// Q8_0: d, 32 x i8.
template <>
DEV float dequant_one<8>(const unsigned char* b, int e) {
    return mul_rn((float)(signed char)b[2 + e], f16_at(b, 0));
}
// Q4_0: d, 16 bytes of two nibbles (value j low nibble, j + 16 high).
template <>
DEV float dequant_one<2>(const unsigned char* b, int e) {
    const u32 q = e < 16 ? (b[2 + e] & 0x0fu) : (b[2 + e - 16] >> 4);
    return mul_rn(f16_at(b, 0), (float)((int)q - 8));
}
// Q5_0: d, 32 high bits (u32), 16 bytes of low nibbles.
template <>
DEV float dequant_one<6>(const unsigned char* b, int e) {
    const u32 qh = (u32)b[2] | ((u32)b[3] << 8) | ((u32)b[4] << 16) | ((u32)b[5] << 24);
    const u32 ql = e < 16 ? (b[6 + e] & 0x0fu) : (b[6 + e - 16] >> 4);
    const u32 q = ql | (((qh >> e) & 1u) << 4);
    return mul_rn(f16_at(b, 0), (float)((int)q - 16));
}
// Q4_K: d, dmin, 12 bytes of scales/mins, 128 bytes of nibbles: sub-block s (32
// values) is nibble s % 2 of bytes 32 * (s / 2)...
template <>
DEV float dequant_one<12>(const unsigned char* b, int e) {
    const int s = e / 32, l = e % 32;
    u32 sc, m;
    scale_min_k4(b + 4, s, sc, m);
    const float dl = mul_rn(f16_at(b, 0), (float)sc), ml = mul_rn(f16_at(b, 2), (float)m);
    const u32 q = (b[16 + 32 * (s / 2) + l] >> (4 * (s % 2))) & 0x0fu;
    return sub_rn(mul_rn(dl, (float)q), ml);
}
// Q5_K: as Q4_K, with a fifth bit per value: bit s of qh[l] (32 bytes after the scales).
template <>
DEV float dequant_one<13>(const unsigned char* b, int e) {
    const int s = e / 32, l = e % 32;
    u32 sc, m;
    scale_min_k4(b + 4, s, sc, m);
    const float dl = mul_rn(f16_at(b, 0), (float)sc), ml = mul_rn(f16_at(b, 2), (float)m);
    const u32 ql = (b[48 + 32 * (s / 2) + l] >> (4 * (s % 2))) & 0x0fu;
    const u32 h = (b[16 + l] >> s) & 1u;
    return sub_rn(mul_rn(dl, (float)(ql | (h << 4))), ml);
}
// Q6_K: 128 bytes of low nibbles, 64 of 2-bit highs, 16 i8 scales, d.
template <>
DEV float dequant_one<14>(const unsigned char* b, int e) {
    const int a = e / 128, r = e % 128;
    const u32 low = (b[64 * a + r % 64] >> (4 * (r / 64))) & 0x0fu;
    const u32 high = (b[128 + 32 * a + r % 32] >> (2 * (r / 32))) & 3u;
    const int q = (int)(low | (high << 4)) - 32;
    const float dl = mul_rn(f16_at(b, 208), (float)(signed char)b[192 + e / 16]);
    return mul_rn(dl, (float)q);
}

template <int TY, int BE, int BB, class T>
DEV void dequant_k(const EwParams& p) {
    const unsigned char* x = (const unsigned char*)p.x;
    T* y = (T*)p.y;
    const long long per_row = p.cols / BE;
    QUANT_GRID_STRIDE(i, (long long)p.rows * p.cols) {
        const long long r = i / p.cols, c = i % p.cols;
        const unsigned char* b = x + (r * per_row + c / BE) * BB;
        y[i] = from_f32<T>(dequant_one<TY>(b, (int)(c % BE)));
    }
}

#define DEQUANT(name, ty, be, bb)                                                                          \
    extern "C" __global__ void dequant_##name##_f32(const EwParams p) { dequant_k<ty, be, bb, float>(p); } \
    EMU_EXPORT(dequant_##name##_f32, EwParams)                                                             \
    extern "C" __global__ void dequant_##name##_bf16(const EwParams p) { dequant_k<ty, be, bb, bf16>(p); } \
    EMU_EXPORT(dequant_##name##_bf16, EwParams)

DEQUANT(q8_0, 8, 32, 34)
DEQUANT(q4_0, 2, 32, 18)
DEQUANT(q5_0, 6, 32, 22)
DEQUANT(q4_k, 12, 256, 144)
DEQUANT(q5_k, 13, 256, 176)
DEQUANT(q6_k, 14, 256, 210)
