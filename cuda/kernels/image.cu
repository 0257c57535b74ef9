// Image kernels: the VAE's convolutions, GroupNorm and mid-block attention on NHWC
// activations (see ImgParams in common.cuh), and the row softmax and block copies of
// the dense attentions (the VAE's, and the text encoders'). With pixels as rows, a convolution is
// one GEMM over a patch matrix and a 1x1 convolution is a Linear; these kernels build
// the patch matrices, normalise, and do the attention's softmax and transposes. The
// GEMMs are the executor's (cuBLASLt on a GPU). CPU references:
// denoised_runtime::cpu::conv (conv2d, group_norm) and cpu::image_attention.
#include "common.cuh"

#define IMG_STRIDE(i, n) \
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (long long)gridDim.x * blockDim.x)


// Sum of v over the block (blockDim.x a multiple of 32, at most 1024), in every thread.
DEV float block_sum(float v, float* scratch) {
    int lane = threadIdx.x % 32, w = threadIdx.x / 32, warps = blockDim.x / 32;
    v = warp_sum(v);
    if (lane == 0) scratch[w] = v;
    __syncthreads();
    float t = 0.f;
    for (int i = 0; i < warps; i++) t += scratch[i];
    __syncthreads();  // scratch is reused by the next call
    return t;
}

// GroupNorm statistics, part 1: block (g, b, s) takes split s of image b's pixels in
// group g's channels and writes (count, mean, M2) to y[((b*groups + g)*splits + s)*3],
// the mean and squared deviations taken in two passes over its slice (no
// E[x^2] - E[x]^2 cancellation).
template <class T>
DEV void gn_stats(const ImgParams& p) {
    __shared__ float scratch[32];
    const int g = blockIdx.x, b = blockIdx.y, s = blockIdx.z;
    const int cpg = p.c / p.groups;
    const long long hw = (long long)p.h * p.w;
    const long long per = (hw + p.splits - 1) / p.splits;
    const long long q0 = s * per, q1 = q0 + per < hw ? q0 + per : hw;
    const T* x = (const T*)p.x + (long long)b * hw * p.c + g * cpg;
    const long long n = q1 > q0 ? (q1 - q0) * cpg : 0;
    float sum = 0.f;
    for (long long i = threadIdx.x; i < n; i += blockDim.x)
        sum += to_f32(x[(q0 + i / cpg) * p.c + i % cpg]);
    const float mean = n ? block_sum(sum, scratch) / (float)n : 0.f;
    float sq = 0.f;
    for (long long i = threadIdx.x; i < n; i += blockDim.x) {
        float d = to_f32(x[(q0 + i / cpg) * p.c + i % cpg]) - mean;
        sq += d * d;
    }
    const float m2 = n ? block_sum(sq, scratch) : 0.f;
    if (threadIdx.x == 0) {
        float* out = (float*)p.y + (((long long)b * p.groups + g) * p.splits + s) * 3;
        out[0] = (float)n;
        out[1] = mean;
        out[2] = m2;
    }
}
extern "C" __global__ void gn_stats_f32(const ImgParams p) { gn_stats<float>(p); }
EMU_EXPORT(gn_stats_f32, ImgParams)
extern "C" __global__ void gn_stats_bf16(const ImgParams p) { gn_stats<bf16>(p); }
EMU_EXPORT(gn_stats_bf16, ImgParams)

// Part 2, a thread per (image, group): combines the splits' partials (Chan et al.,
// in double) into z[2*(b*groups + g)] = (mean, 1/sqrt(var + eps)), the biased
// variance PyTorch normalises with.
extern "C" __global__ void gn_finalize(const ImgParams p) {
    IMG_STRIDE(i, (long long)p.batch * p.groups) {
        const float* part = (const float*)p.y + i * p.splits * 3;
        double n = 0, mean = 0, m2 = 0;
        for (int s = 0; s < p.splits; s++) {
            double nb = part[3 * s], mb = part[3 * s + 1], m2b = part[3 * s + 2];
            if (nb == 0) continue;
            double nn = n + nb, d = mb - mean;
            mean += d * nb / nn;
            m2 += m2b + d * d * n * nb / nn;
            n = nn;
        }
        float* out = (float*)p.z + 2 * i;
        out[0] = (float)mean;
        out[1] = rsqrtf((float)(m2 / (n > 0 ? n : 1)) + p.eps);
    }
}
EMU_EXPORT(gn_finalize, ImgParams)

// Part 3, elementwise: y = x * a + b per channel, a = rstd * weight, b = bias - mean
// * a (the CPU reference's order of operations), then SiLU when p.silu.
template <class T>
DEV void gn_apply(const ImgParams& p) {
    const T* x = (const T*)p.x;
    T* y = (T*)p.y;
    const float* stats = (const float*)p.z;
    const T* wt = (const T*)p.wt;
    const T* bias = (const T*)p.bias;
    const int cpg = p.c / p.groups;
    const long long img = (long long)p.h * p.w * p.c;
    IMG_STRIDE(i, (long long)p.batch * img) {
        int ch = (int)(i % p.c);
        long long b = i / img;
        const float* st = stats + 2 * (b * p.groups + ch / cpg);
        float a = st[1] * to_f32(wt[ch]);
        float sh = to_f32(bias[ch]) - st[0] * a;
        float v = to_f32(x[i]) * a + sh;
        if (p.silu) v = v / (1.0f + __expf(-v));
        y[i] = from_f32<T>(v);
    }
}
extern "C" __global__ void gn_apply_f32(const ImgParams p) { gn_apply<float>(p); }
EMU_EXPORT(gn_apply_f32, ImgParams)
extern "C" __global__ void gn_apply_bf16(const ImgParams p) { gn_apply<bf16>(p); }
EMU_EXPORT(gn_apply_bf16, ImgParams)

// Softmax of each of `rows` rows of x [rows, cols] in place, in f32, of the scores
// times p.scale plus, when p.bias is set, an additive bias of the same shape
// (T5's position bias, in the tensor dtype). With p.causal, row r sees columns 0 ..=
// p0 + r only (CLIP) and the rest become 0. One warp per row (a query's scores).
template <class T>
DEV void softmax_rows(const ImgParams& p) {
    int warps = blockDim.x / 32;
    long long r = (long long)blockIdx.x * warps + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (r >= p.rows) return;  // whole warp; only warp reductions follow
    T* x = (T*)p.x + r * p.cols;
    const T* bias = p.bias ? (const T*)p.bias + r * p.cols : (const T*)0;
    const int n = p.causal ? (int)(p.p0 + r + 1 < p.cols ? p.p0 + r + 1 : p.cols) : p.cols;
    float m = -3.4e38f;
    for (int c = lane; c < n; c += 32) m = fmaxf(m, to_f32(x[c]) * p.scale + (bias ? to_f32(bias[c]) : 0.f));
    m = warp_max(m);
    float sum = 0.f;
    for (int c = lane; c < n; c += 32) sum += __expf(to_f32(x[c]) * p.scale + (bias ? to_f32(bias[c]) : 0.f) - m);
    const float inv = 1.0f / warp_sum(sum);
    for (int c = lane; c < p.cols; c += 32) {
        float v = c < n ? __expf(to_f32(x[c]) * p.scale + (bias ? to_f32(bias[c]) : 0.f) - m) * inv : 0.f;
        x[c] = from_f32<T>(v);
    }
}
extern "C" __global__ void softmax_rows_f32(const ImgParams p) { softmax_rows<float>(p); }
EMU_EXPORT(softmax_rows_f32, ImgParams)
extern "C" __global__ void softmax_rows_bf16(const ImgParams p) { softmax_rows<bf16>(p); }
EMU_EXPORT(softmax_rows_bf16, ImgParams)

// y[c, r] = x[r * ld + c] for r < rows, c < cols: a column block of a row-major
// matrix, transposed (the attention's V as the second GEMM's [C, N] operand).
template <class T>
DEV void transpose(const ImgParams& p) {
    const T* x = (const T*)p.x;
    T* y = (T*)p.y;
    IMG_STRIDE(i, (long long)p.rows * p.cols) {
        long long c = i / p.rows, r = i % p.rows;
        y[i] = x[r * p.ld + c];
    }
}
extern "C" __global__ void transpose_f32(const ImgParams p) { transpose<float>(p); }
EMU_EXPORT(transpose_f32, ImgParams)
extern "C" __global__ void transpose_bf16(const ImgParams p) { transpose<bf16>(p); }
EMU_EXPORT(transpose_bf16, ImgParams)

// y[r * ldy + c] = x[r * ld + c] for r < rows, c < cols: a column block of one
// row-major matrix into another's (addresses already offset to the blocks).
template <class T>
DEV void copy2d(const ImgParams& p) {
    const T* x = (const T*)p.x;
    T* y = (T*)p.y;
    IMG_STRIDE(i, (long long)p.rows * p.cols) {
        long long r = i / p.cols, c = i % p.cols;
        y[r * p.ldy + c] = x[r * p.ld + c];
    }
}
extern "C" __global__ void copy2d_f32(const ImgParams p) { copy2d<float>(p); }
EMU_EXPORT(copy2d_f32, ImgParams)
extern "C" __global__ void copy2d_bf16(const ImgParams p) { copy2d<bf16>(p); }
EMU_EXPORT(copy2d_bf16, ImgParams)

// The spatially sparse VAE (SIGE) on a device: an edit recomputes a layer only at the
// pixels its region lists (z, u32 indices into the batch-1 output plane) and takes the
// template's value everywhere else. Three kernels around the executor's GEMM; CPU
// reference: denoised_runtime::cpu::sparse_conv (the same gather, convolution and
// scatter, tile by tile).

// Gather: the patch-matrix rows of output pixels: y[r, (ky*kw + kx)*c + ch] is the
// input under tap (ky, kx) of the r-th pixel, zero in the padding. The pixels are the
// listed z[p0 .. p0+rows] of one image (a sparse layer's), or with z == 0 the pixels
// p0 .. p0+rows of the batch in order (im2col, the dense convolution's). With up == 2
// the input is first upsampled 2x (nearest), folded into the read: padded coordinate u
// reads input row u / 2. Padding is (pad_t, pad_l) before and whatever remains after
// (FLUX's downsampler pads only bottom and right). The preceding GroupNorm is applied
// on the way as x * wt[ch] + bias[ch] (f32 per-channel scale and shift, when wt != 0),
// then SiLU when p.silu; the zero padding stays zero, as the dense layer pads its
// already normalised input.
template <class T>
DEV void sige_gather(const ImgParams& p) {
    const T* x = (const T*)p.x;
    T* y = (T*)p.y;
    const unsigned* pixels = (const unsigned*)p.z;
    const float* scale = (const float*)p.wt;
    const float* shift = (const float*)p.bias;
    const int taps_c = p.kh * p.kw * p.c;
    const int hu = p.h * p.up, wu = p.w * p.up;
    IMG_STRIDE(i, (long long)p.rows * taps_c) {
        long long r = i / taps_c;
        int col = (int)(i % taps_c);
        int ch = col % p.c, tap = col / p.c;
        int ky = tap / p.kw, kx = tap % p.kw;
        long long pix = pixels ? (long long)pixels[p.p0 + r] : p.p0 + r;
        int ox = (int)(pix % p.ow);
        long long t = pix / p.ow;
        int oy = (int)(t % p.oh);
        int b = (int)(t / p.oh);
        int uy = oy * p.stride + ky - p.pad_t, ux = ox * p.stride + kx - p.pad_l;
        float v = 0.f;
        if (uy >= 0 && uy < hu && ux >= 0 && ux < wu) {
            v = to_f32(x[(((long long)b * p.h + uy / p.up) * p.w + ux / p.up) * p.c + ch]);
            if (scale) v = v * scale[ch] + shift[ch];
            if (p.silu) v = v / (1.0f + __expf(-v));
        }
        y[i] = from_f32<T>(v);
    }
}
extern "C" __global__ void sige_gather_f32(const ImgParams p) { sige_gather<float>(p); }
EMU_EXPORT(sige_gather_f32, ImgParams)
extern "C" __global__ void sige_gather_bf16(const ImgParams p) { sige_gather<bf16>(p); }
EMU_EXPORT(sige_gather_bf16, ImgParams)
extern "C" __global__ void im2col_f32(const ImgParams p) { sige_gather<float>(p); }
EMU_EXPORT(im2col_f32, ImgParams)
extern "C" __global__ void im2col_bf16(const ImgParams p) { sige_gather<bf16>(p); }
EMU_EXPORT(im2col_bf16, ImgParams)

// Scatter: row r of x ([rows, c], the GEMM's output with its bias) into pixel z[r] of
// y ([pixels, c], already holding the template's value), plus the residual wt at that
// pixel when wt != 0.
template <class T>
DEV void sige_scatter(const ImgParams& p) {
    const T* x = (const T*)p.x;
    T* y = (T*)p.y;
    const unsigned* pixels = (const unsigned*)p.z;
    const T* residual = (const T*)p.wt;
    IMG_STRIDE(i, (long long)p.rows * p.c) {
        long long r = i / p.c;
        int ch = (int)(i % p.c);
        long long at = (long long)pixels[r] * p.c + ch;
        float v = to_f32(x[i]);
        if (residual) v += to_f32(residual[at]);
        y[at] = from_f32<T>(v);
    }
}
extern "C" __global__ void sige_scatter_f32(const ImgParams p) { sige_scatter<float>(p); }
EMU_EXPORT(sige_scatter_f32, ImgParams)
extern "C" __global__ void sige_scatter_bf16(const ImgParams p) { sige_scatter<bf16>(p); }
EMU_EXPORT(sige_scatter_bf16, ImgParams)

// How a GroupNorm's sums move when the listed pixels change from y (the template's
// value) to x (the edit's): block (g, s) takes split s of the p.rows pixels of z in
// group g's channels and writes (sum(x - y), sum(x^2 - y^2)) to wt[(g*splits + s)*2],
// the host adding the splits in double (cpu::sparse_conv::GroupSums::update's deltas).
template <class T>
DEV void sige_group_delta(const ImgParams& p) {
    __shared__ float scratch[32];
    const int g = blockIdx.x, s = blockIdx.y;
    const int cpg = p.c / p.groups;
    const long long per = ((long long)p.rows + p.splits - 1) / p.splits;
    const long long q0 = s * per, q1 = q0 + per < p.rows ? q0 + per : p.rows;
    const long long n = q1 > q0 ? (q1 - q0) * cpg : 0;
    const unsigned* pixels = (const unsigned*)p.z;
    float ds = 0.f, dq = 0.f;
    for (long long i = threadIdx.x; i < n; i += blockDim.x) {
        long long at = (long long)pixels[q0 + i / cpg] * p.c + g * cpg + i % cpg;
        float nv = to_f32(((const T*)p.x)[at]), ov = to_f32(((const T*)p.y)[at]);
        ds += nv - ov;
        dq += nv * nv - ov * ov;
    }
    ds = block_sum(ds, scratch);
    dq = block_sum(dq, scratch);
    if (threadIdx.x == 0) {
        float* out = (float*)p.wt + ((long long)g * p.splits + s) * 2;
        out[0] = ds;
        out[1] = dq;
    }
}
extern "C" __global__ void sige_group_delta_f32(const ImgParams p) { sige_group_delta<float>(p); }
EMU_EXPORT(sige_group_delta_f32, ImgParams)
extern "C" __global__ void sige_group_delta_bf16(const ImgParams p) { sige_group_delta<bf16>(p); }
EMU_EXPORT(sige_group_delta_bf16, ImgParams)
