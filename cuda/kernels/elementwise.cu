// Elementwise kernels: GELU (tanh), SiLU, add, the adaLN-Zero gated residual, and
// dtype conversions. Memory-bound; one thread per element, grid-stride loops.
#include "common.cuh"

DEV float gelu_tanh_f(float x) {
    const float k0 = 0.7978845608028654f;  // sqrt(2/pi)
    return 0.5f * x * (1.0f + tanhf(k0 * (x + 0.044715f * x * x * x)));
}
DEV float silu_f(float x) { return x / (1.0f + __expf(-x)); }

#define GRID_STRIDE(i, n) \
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (long long)gridDim.x * blockDim.x)

// The memory-bound passes below go in runs of 8 values (16-byte accesses, see
// load_run) where their pointers are 16-byte aligned and their rows a multiple of 8
// wide, else one value at a time; indices are 32-bit (`n` is an int), one division
// per run at most.

// x[r, c0..c1] = gelu(x[r, c0..c1])
template <class T>
DEV void gelu_cols(const EwParams& p) {
    T* x = (T*)p.x;
    const u32 w = p.c1 - p.c0;
    bool vec = w % 8 == 0 && p.c0 % 8 == 0 && p.cols % 8 == 0 && aligned16(p.x);
    for_runs((u32)p.rows * w, vec, [&](u32 i, auto run) {
        constexpr int V = decltype(run)::n;
        u32 r = i / w;
        T* at = x + r * (u32)p.cols + p.c0 + (i - r * w);
        float v[V];
        load_run<V>(at, v);
#pragma unroll
        for (int j = 0; j < V; j++) v[j] = gelu_tanh_f(v[j]);
        store_run<V>(at, v);
    });
}
// y = silu(x), n elements
template <class T>
DEV void silu_n(const EwParams& p) {
    const T* x = (const T*)p.x;
    T* y = (T*)p.y;
    for_runs(p.n, aligned16(p.x | p.y), [&](u32 i, auto run) {
        constexpr int V = decltype(run)::n;
        float v[V];
        load_run<V>(x + i, v);
#pragma unroll
        for (int j = 0; j < V; j++) v[j] = silu_f(v[j]);
        store_run<V>(y + i, v);
    });
}
// x += y, n elements
template <class T>
DEV void add_n(const EwParams& p) {
    T* x = (T*)p.x;
    const T* y = (const T*)p.y;
    for_runs(p.n, aligned16(p.x | p.y), [&](u32 i, auto run) {
        constexpr int V = decltype(run)::n;
        float a[V], b[V];
        load_run<V>(x + i, a);
        load_run<V>(y + i, b);
#pragma unroll
        for (int j = 0; j < V; j++) a[j] += b[j];
        store_run<V>(x + i, a);
    });
}
// x[r, c] += bias[c] (+ y[r, c] when y is given) over a [rows, cols] matrix: the
// epilogue of a library convolution (cuDNN writes the bare convolution), one rounding.
template <class T>
DEV void bias_rows_k(const EwParams& p) {
    T* x = (T*)p.x;
    const T* bias = (const T*)p.table;
    const T* y = (const T*)p.y;
    GRID_STRIDE(i, (long long)p.rows * p.cols) {
        float v = to_f32(x[i]) + to_f32(bias[i % p.cols]);
        if (y) v += to_f32(y[i]);
        x[i] = from_f32<T>(v);
    }
}
// x[r, c] += table[seg[r], c] * y[r, c] over a [rows, cols] matrix
template <class T>
DEV void gated_residual_rows(const EwParams& p) {
    T* x = (T*)p.x;
    const T* y = (const T*)p.y;
    const T* table = (const T*)p.table;
    const u32* seg = (const u32*)p.seg;
    const u32 w = p.cols;
    bool vec = w % 8 == 0 && p.table_cols % 8 == 0 && aligned16(p.x | p.y | p.table);
    for_runs((u32)p.rows * w, vec, [&](u32 i, auto run) {
        constexpr int V = decltype(run)::n;
        u32 r = i / w;
        const T* g = table + (long long)seg[r] * p.table_cols + (i - r * w);
        float a[V], b[V], c[V];
        load_run<V>(x + i, a);
        load_run<V>(y + i, b);
        load_run<V>(g, c);
#pragma unroll
        for (int j = 0; j < V; j++) a[j] += c[j] * b[j];
        store_run<V>(x + i, a);
    });
}
// x[r, c0 + c] += alpha * y[r, c] over [rows, c1 - c0], y dense: a request's Euler
// update (y is its window of the batch's packed velocity), f32 arithmetic.
template <class T>
DEV void axpy_cols_k(const EwParams& p) {
    T* x = (T*)p.x;
    const T* y = (const T*)p.y;
    int w = p.c1 - p.c0;
    GRID_STRIDE(i, (long long)p.rows * w) {
        long long r = i / w, c = i % w;
        T* d = x + r * p.cols + p.c0 + c;
        *d = from_f32<T>(to_f32(*d) + p.alpha * to_f32(y[i]));
    }
}
template <class S, class D>
DEV void convert_n(const EwParams& p) {
    const S* x = (const S*)p.x;
    D* y = (D*)p.y;
    for_runs(p.n, aligned16(p.x | p.y), [&](u32 i, auto run) {
        constexpr int V = decltype(run)::n;
        float v[V];
        load_run<V>(x + i, v);
        store_run<V>(y + i, v);
    });
}

// T5's gated-GELU: y[r, c] = gelu_tanh(x[r, c]) * x[r, cols + c] over [rows, cols],
// x being [rows, 2*cols] (`wi_0 | wi_1`, fused).
template <class T>
DEV void gated_gelu_rows(const EwParams& p) {
    const T* x = (const T*)p.x;
    T* y = (T*)p.y;
    GRID_STRIDE(i, (long long)p.rows * p.cols) {
        long long r = i / p.cols, c = i % p.cols;
        const T* xr = x + r * 2 * p.cols;
        y[i] = from_f32<T>(gelu_tanh_f(to_f32(xr[c])) * to_f32(xr[p.cols + c]));
    }
}
// CLIP's quick_gelu in place: x * sigmoid(1.702 x), n elements.
template <class T>
DEV void quick_gelu_n(const EwParams& p) {
    T* x = (T*)p.x;
    GRID_STRIDE(i, p.n) {
        float v = to_f32(x[i]);
        x[i] = from_f32<T>(v * (1.0f / (1.0f + __expf(-1.702f * v))));
    }
}

#define EW_KERNEL(name, impl, T)                                   \
    extern "C" __global__ void name(const EwParams p) { impl<T>(p); } \
    EMU_EXPORT(name, EwParams)

EW_KERNEL(gelu_tanh_f32, gelu_cols, float)
EW_KERNEL(gelu_tanh_bf16, gelu_cols, bf16)
EW_KERNEL(silu_f32, silu_n, float)
EW_KERNEL(silu_bf16, silu_n, bf16)
EW_KERNEL(add_f32, add_n, float)
EW_KERNEL(add_bf16, add_n, bf16)
EW_KERNEL(bias_rows_f32, bias_rows_k, float)
EW_KERNEL(bias_rows_bf16, bias_rows_k, bf16)
EW_KERNEL(gated_residual_f32, gated_residual_rows, float)
EW_KERNEL(gated_residual_bf16, gated_residual_rows, bf16)
EW_KERNEL(axpy_cols_f32, axpy_cols_k, float)
EW_KERNEL(axpy_cols_bf16, axpy_cols_k, bf16)
EW_KERNEL(gated_gelu_f32, gated_gelu_rows, float)
EW_KERNEL(gated_gelu_bf16, gated_gelu_rows, bf16)
EW_KERNEL(quick_gelu_f32, quick_gelu_n, float)
EW_KERNEL(quick_gelu_bf16, quick_gelu_n, bf16)

extern "C" __global__ void convert_f32_bf16(const EwParams p) { convert_n<float, bf16>(p); }
EMU_EXPORT(convert_f32_bf16, EwParams)
extern "C" __global__ void convert_bf16_f32(const EwParams p) { convert_n<bf16, float>(p); }
EMU_EXPORT(convert_bf16_f32, EwParams)

// FP8 E4M3 quantisation of a template slab, as `denoised_runtime::fp8::quantize` does it
// on the host (bit for bit on the bytes when the device divides exactly): a scale per
// column group, `amax / 448` (1 for a group of zeros), then each value over its
// group's scale to the nearest E4M3 value, ties to even, saturating at 448.
// EwParams: x = the slab [rows, cols], y = its bytes, table = the scales,
// c0 = the group count.

DEV u32 f32_to_fp8(float x) {
    u32 bits = __float_as_uint(x), sign = (bits >> 24) & 0x80, a = bits & 0x7fffffffu;
    if (a > 0x7f800000u) return 0x7f;  // NaN
    float af = __uint_as_float(a);
    if (af < 1.f / 64.f) {  // multiples of 2^-9, ties to even; 8 is the smallest normal
        float q = af * 512.f, f = floorf(q), r = q - f;
        u32 n = (u32)f;
        if (r > 0.5f || (r == 0.5f && (n & 1))) n++;
        return sign | n;
    }
    int ex = (int)((a >> 23) & 0xff) - 127;
    u32 keep = (a & 0x7fffffu) >> 20, rem = a & 0xfffffu;
    if (rem > 0x80000u || (rem == 0x80000u && (keep & 1))) {
        if (++keep == 8) {
            keep = 0;
            ex++;
        }
    }
    int e = ex + 7;
    if (e > 15 || (e == 15 && keep == 7)) return sign | 0x7e;  // 448
    return sign | ((u32)e << 3) | keep;
}

// One block per column group: the group's largest magnitude over every row.
template <class T>
DEV void fp8_scales_k(const EwParams& p) {
    __shared__ float red[32];
    const T* x = (const T*)p.x;
    const int g = blockIdx.x, w = p.cols / p.c0;
    float m = 0.f;
    for (long long i = threadIdx.x; i < (long long)p.rows * w; i += blockDim.x)
        m = fmaxf(m, fabsf(to_f32(x[(i / w) * p.cols + g * w + i % w])));
    m = warp_max(m);
    if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = m;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int i = 1; i < (int)(blockDim.x / 32); i++) m = fmaxf(m, red[i]);
        ((float*)p.table)[g] = m > 0.f ? m / 448.f : 1.f;
    }
}

template <class T>
DEV void fp8_quantize_k(const EwParams& p) {
    const T* x = (const T*)p.x;
    unsigned char* y = (unsigned char*)p.y;
    const float* scales = (const float*)p.table;
    const int w = p.cols / p.c0;
    GRID_STRIDE(i, (long long)p.rows * p.cols) {
        float inv = 1.f / scales[(i % p.cols) / w];
        y[i] = (unsigned char)f32_to_fp8(to_f32(x[i]) * inv);
    }
}

EW_KERNEL(fp8_scales_f32, fp8_scales_k, float)
EW_KERNEL(fp8_scales_bf16, fp8_scales_k, bf16)
EW_KERNEL(fp8_quantize_f32, fp8_quantize_k, float)
EW_KERNEL(fp8_quantize_bf16, fp8_quantize_k, bf16)

// FP8 E4M3 activations of an fp8 GEMM, as `denoised_runtime::fp8::quantize_rows` does
// on the host: one block per row of x (rows `cols` elements apart), its columns
// c0..c1; the row's scale `amax / 448` (1 for a row of zeros) to table[row], then
// each value over it into y's row (c1 - c0 bytes, packed: the GEMM's k-major operand).
template <class T>
DEV void fp8_rows_k(const EwParams& p) {
    __shared__ float red[32];
    __shared__ float inv;
    const int w = p.c1 - p.c0;
    const T* x = (const T*)p.x + (long long)blockIdx.x * p.cols + p.c0;
    float m = 0.f;
    for (int i = threadIdx.x; i < w; i += blockDim.x) m = fmaxf(m, fabsf(to_f32(x[i])));
    m = warp_max(m);
    if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = m;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int i = 1; i < (int)(blockDim.x / 32); i++) m = fmaxf(m, red[i]);
        const float s = m > 0.f ? m / 448.f : 1.f;
        ((float*)p.table)[blockIdx.x] = s;
        inv = 1.f / s;
    }
    __syncthreads();
    unsigned char* y = (unsigned char*)p.y + (long long)blockIdx.x * w;
    for (int i = threadIdx.x; i < w; i += blockDim.x) y[i] = (unsigned char)f32_to_fp8(to_f32(x[i]) * inv);
}

EW_KERNEL(fp8_rows_f32, fp8_rows_k, float)
EW_KERNEL(fp8_rows_bf16, fp8_rows_k, bf16)

// Per-tensor FP8 E4M3 activations (`[device] fp8_scaling = "tensor"`), as
// `denoised_runtime::fp8::quantize_tensor` does on the host: one scale for the block
// x[rows, c0..c1] (rows `cols` apart), `amax / 448` (1 for zeros or a non-finite
// amax), which cuBLASLt applies inside the GEMM. Two launches and no atomics:
// fp8_amax_* (exactly FP8_AMAX_BLOCKS blocks) writes each block's maximum to
// table[block]; fp8_tensor_* has every block fold those into the amax, writes the
// bytes packed (c1 - c0 a row) to y, and block 0 the scale to seg (one f32).
#define FP8_AMAX_BLOCKS 256
template <class T>
DEV float block_max(float m) {
    __shared__ float red[32];
    m = warp_max(m);
    if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = m;
    __syncthreads();
    if (threadIdx.x == 0)
        for (int i = 1; i < (int)(blockDim.x / 32); i++) m = fmaxf(m, red[i]);
    return m;  // thread 0's
}
template <class T>
DEV void fp8_amax_k(const EwParams& p) {
    const long long w = p.c1 - p.c0;
    const T* x = (const T*)p.x;
    float m = 0.f;
    GRID_STRIDE(i, (long long)p.rows * w) m = fmaxf(m, fabsf(to_f32(x[(i / w) * p.cols + p.c0 + i % w])));
    m = block_max<T>(m);
    if (threadIdx.x == 0) ((float*)p.table)[blockIdx.x] = m;
}
template <class T>
DEV void fp8_tensor_k(const EwParams& p) {
    __shared__ float inv;
    const float* maxima = (const float*)p.table;
    float m = 0.f;
    for (int i = threadIdx.x; i < FP8_AMAX_BLOCKS; i += blockDim.x) m = fmaxf(m, maxima[i]);
    m = block_max<T>(m);
    if (threadIdx.x == 0) {
        const float s = m > 0.f && m <= 3.4028235e38f ? m / 448.f : 1.f;
        inv = 1.f / s;
        if (blockIdx.x == 0) *(float*)p.seg = s;
    }
    __syncthreads();
    const long long w = p.c1 - p.c0;
    const T* x = (const T*)p.x;
    unsigned char* y = (unsigned char*)p.y;
    GRID_STRIDE(i, (long long)p.rows * w) y[i] = (unsigned char)f32_to_fp8(to_f32(x[(i / w) * p.cols + p.c0 + i % w]) * inv);
}

EW_KERNEL(fp8_amax_f32, fp8_amax_k, float)
EW_KERNEL(fp8_amax_bf16, fp8_amax_k, bf16)
EW_KERNEL(fp8_tensor_f32, fp8_tensor_k, float)
EW_KERNEL(fp8_tensor_bf16, fp8_tensor_k, bf16)

// A GEMM's scales, bias and GELU after a bare GEMM into `src` (see EpilogueParams):
// the operations of cuBLASLt's epilogue in its order (the emulator's GEMM), GELU on
// the value rounded to T as a separate pass sees it.
template <class T>
DEV void linear_epilogue(const EpilogueParams& p) {
    const T* src = (const T*)p.src;
    T* dst = (T*)p.dst;
    const float* xs = (const float*)p.xs;
    const float* ws = (const float*)p.ws;
    const T* b = (const T*)p.bias;
    GRID_STRIDE(i, (long long)p.rows * p.cols) {
        const long long r = i / p.cols, c = i - r * p.cols;
        float v = to_f32(src[r * p.ld_src + c]);
        if (xs) v = p.scalar ? v * xs[0] * ws[0] : v * xs[r] * ws[c];
        if (b) v += to_f32(b[c]);
        if (p.gelu) v = gelu_tanh_f(to_f32(from_f32<T>(v)));
        dst[r * p.ld_dst + c] = from_f32<T>(v);
    }
}
extern "C" __global__ void linear_epilogue_f32(const EpilogueParams p) { linear_epilogue<float>(p); }
EMU_EXPORT(linear_epilogue_f32, EpilogueParams)
extern "C" __global__ void linear_epilogue_bf16(const EpilogueParams p) { linear_epilogue<bf16>(p); }
EMU_EXPORT(linear_epilogue_bf16, EpilogueParams)

// Sinusoidal timestep/guidance embedding, `cat(cos, sin)` (flip_sin_to_cos as in Flux).
template <class T>
DEV void timestep_embed(const TimestepParams& p) {
    const float* xs = (const float*)p.xs;
    const float* freqs = (const float*)p.freqs;
    T* out = (T*)p.out;
    GRID_STRIDE(i, (long long)p.n * p.half) {
        long long b = i / p.half, j = i % p.half;
        float a = xs[b] * freqs[j];
        out[b * 2 * p.half + j] = from_f32<T>(cosf(a));
        out[b * 2 * p.half + p.half + j] = from_f32<T>(sinf(a));
    }
}
extern "C" __global__ void timestep_embed_f32(const TimestepParams p) { timestep_embed<float>(p); }
EMU_EXPORT(timestep_embed_f32, TimestepParams)
extern "C" __global__ void timestep_embed_bf16(const TimestepParams p) { timestep_embed<bf16>(p); }
EMU_EXPORT(timestep_embed_bf16, TimestepParams)
