// A CPU emulator for the subset of CUDA C the kernels in cuda/kernels use.
//
// Why: CI and most development machines have no GPU, yet the kernels are the product.
// With this header the host compiler builds the *same* kernel sources, and a launch
// runs every thread of a block as a fiber (a user-space context on the caller's OS
// thread): __syncthreads is a block barrier, warp shuffles and mma exchange values
// through per-warp scratch with a warp barrier, and __shared__ variables are function
// statics (blocks run one after another, so one copy is one block's shared memory).
// Fibers switch only at barriers, so a run is deterministic. Tests then compare kernel
// output with the CPU backend.
//
// What it cannot show: speed, memory-model races that a barrier happens to hide,
// and anything architecture-specific. Those need a GPU (the `gpu_*` tests run on one
// when present).
#pragma once
#include <algorithm>
#include <array>
#include <cmath>
#include <math.h>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};

#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __shared__ static
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
#define DEV inline

namespace emu {

struct bf16 {
    unsigned short bits;
};
inline float bf16_to_f32(bf16 x) {
    uint32_t u = (uint32_t)x.bits << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
// Round to nearest even, as __float2bfloat16_rn (NaN stays NaN).
inline bf16 f32_to_bf16(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return bf16{(unsigned short)((u >> 16) | 0x40)};
    u += 0x7fffu + ((u >> 16) & 1);
    return bf16{(unsigned short)(u >> 16)};
}

// ---- fibers: every GPU thread of a block is a fiber on the calling OS thread ----
// A barrier is "yield until everybody arrived", so a block of 128 threads costs 128
// small stacks and cheap user-space switches, not 128 OS threads fighting over two
// cores in futexes (which made the first version of this emulator ~100x slower).
struct Bar {
    int expected = 0, count = 0;
    unsigned gen = 0;
};

#if defined(__x86_64__)
// Saves the callee-saved registers on the current stack, stores the stack pointer in
// *save, and resumes the context whose stack pointer is `to`.
extern "C" void denoised_emu_switch(void** save, void* to);
asm(R"(
.text
.globl denoised_emu_switch
.type denoised_emu_switch,@function
denoised_emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
.size denoised_emu_switch, .-denoised_emu_switch
)");
#else
#error "the CUDA emulator's fiber switch is written for x86-64"
#endif

// A cp.async copy, done when its group is waited for (not at issue, so a kernel that
// reads a tile before waiting for it reads stale data here too).
struct AsyncCopy {
    void* dst;
    const void* src;
    bool valid;
};

struct Fiber {
    void* sp = nullptr;
    bool done = false;
    dim3 tid;
    int lane = 0, warp = 0;
    std::vector<AsyncCopy> open;                  // issued since the last commit
    std::vector<std::vector<AsyncCopy>> groups;   // committed, oldest first
    uint64_t shared_seq = 0;                      // this thread's shared accesses so far
};

// ---- bank conflicts ----
// Every shared access made through ld_shared/st_shared/ldmatrix/cp_async16 is logged
// with the thread's running access number. The k-th access of each lane of a warp is
// one instruction of that warp (the kernels' shared accesses are not divergent), which
// the hardware serves in phases (a 16-byte access: 8 lanes a phase, 8-byte: 16, else
// the whole warp); a phase takes as many wavefronts as the most distinct 4-byte words
// any one of the 32 banks holds. Extra wavefronts are the bank conflicts.
struct SharedAccess {
    uintptr_t addr;
    int lane, bytes;
};
struct KernelStats {
    uint64_t launches = 0, accesses = 0, wavefronts = 0, conflicts = 0;
};
inline bool counting = false;
inline std::map<std::string, KernelStats>& stats() {
    static std::map<std::string, KernelStats> s;
    return s;
}

// Per-launch state shared by the block's threads.
struct Launch {
    dim3 grid, block;
    Bar block_bar;
    std::vector<Bar> warp_bars;
    std::vector<std::array<uint64_t, 32>> scratch;          // shuffles
    std::vector<std::array<uint32_t, 32 * 6>> mma_scratch;  // mma fragments
    std::vector<unsigned char> dyn_smem;
    std::vector<Fiber> fibers;
    std::vector<std::unique_ptr<char[]>> stacks;
    void* sched_sp = nullptr;
    int current = 0;
    std::function<void()> body;  // the kernel call for the current block
    std::string name;            // of the kernel
    std::vector<std::vector<std::vector<SharedAccess>>> shared_log;  // [warp][k]
};
inline Launch* cur = nullptr;
// One launch at a time in the process: `cur`, blockDim/gridDim and the kernels'
// static "shared memory" are all global.
inline std::mutex one_at_a_time;
inline int lane = 0, warp = 0;

inline void yield_fiber() {
    Fiber& f = cur->fibers[cur->current];
    denoised_emu_switch(&f.sp, cur->sched_sp);
}
inline void bar_wait(Bar& b) {
    unsigned g = b.gen;
    if (++b.count >= b.expected) {
        b.count = 0;
        b.gen++;
        return;
    }
    while (b.gen == g) yield_fiber();
}
// A thread that exits no longer takes part in barriers (as on the GPU).
inline void bar_leave(Bar& b) {
    if (--b.expected > 0 && b.count >= b.expected) {
        b.count = 0;
        b.gen++;
    }
}
inline void warp_sync() { bar_wait(cur->warp_bars[warp]); }

template <class T>
T shfl(T v, int src) {
    static_assert(sizeof(T) <= 8);
    auto& s = cur->scratch[warp];
    uint64_t w = 0;
    std::memcpy(&w, &v, sizeof(T));
    s[lane] = w;
    warp_sync();
    T r;
    std::memcpy(&r, &s[src & 31], sizeof(T));
    warp_sync();
    return r;
}

inline void record_shared(const void* p, int bytes) {
    if (!counting) return;
    Fiber& f = cur->fibers[cur->current];
    auto& log = cur->shared_log[warp];
    if (log.size() <= f.shared_seq) log.resize(f.shared_seq + 1);
    log[f.shared_seq++].push_back(SharedAccess{reinterpret_cast<uintptr_t>(p), lane, bytes});
}

// Folds one block's log into the kernel's counters.
inline void count_block(Launch& l) {
    KernelStats& st = stats()[l.name];
    for (auto& warp_log : l.shared_log) {
        for (auto& ins : warp_log) {
            if (ins.empty()) continue;
            st.accesses++;
            int bytes = ins[0].bytes, per_phase = bytes >= 16 ? 8 : bytes == 8 ? 16 : 32;
            for (int ph = 0; ph < 32 / per_phase; ph++) {
                std::array<std::vector<uintptr_t>, 32> words;
                for (auto& a : ins) {
                    if (a.lane / per_phase != ph) continue;
                    for (uintptr_t w = a.addr >> 2; w <= (a.addr + a.bytes - 1) >> 2; w++) {
                        auto& b = words[w % 32];
                        if (std::find(b.begin(), b.end(), w) == b.end()) b.push_back(w);
                    }
                }
                size_t wf = 0;
                for (auto& b : words) wf = std::max(wf, b.size());
                if (wf == 0) continue;
                st.wavefronts += wf;
                st.conflicts += wf - 1;
            }
        }
        warp_log.clear();
    }
}

// ldmatrix .x4 (and .trans) for the warp: lanes 8i..8i+7 give the rows of matrix i.
inline void ldmatrix_x4(uint32_t r[4], const void* row, bool trans) {
    record_shared(row, 16);
    auto& s = cur->scratch[warp];
    s[lane] = reinterpret_cast<uint64_t>(row);
    warp_sync();
    auto elem = [&](int m, int rr, int c) {
        const unsigned short* p = reinterpret_cast<const unsigned short*>(s[8 * m + rr]);
        return (uint32_t)p[c];
    };
    for (int m = 0; m < 4; m++) {
        if (!trans)
            r[m] = elem(m, lane / 4, 2 * (lane % 4)) | (elem(m, lane / 4, 2 * (lane % 4) + 1) << 16);
        else
            r[m] = elem(m, 2 * (lane % 4), lane / 4) | (elem(m, 2 * (lane % 4) + 1, lane / 4) << 16);
    }
    warp_sync();
}

inline void async_copy16(void* dst, const void* src, bool valid) {
    record_shared(dst, 16);
    cur->fibers[cur->current].open.push_back(AsyncCopy{dst, src, valid});
}
inline void cp_async_commit() {
    Fiber& f = cur->fibers[cur->current];
    f.groups.push_back(std::move(f.open));
    f.open.clear();
}
inline void cp_async_wait(int n) {
    Fiber& f = cur->fibers[cur->current];
    while ((int)f.groups.size() > n) {
        for (auto& c : f.groups.front()) {
            if (c.valid) std::memcpy(c.dst, c.src, 16);
            else std::memset(c.dst, 0, 16);
        }
        f.groups.erase(f.groups.begin());
    }
}

// One m16n8k16 bf16 MMA for the whole warp, from the documented fragment layout.
inline void mma_16816(float d[4], const uint32_t a[4], const uint32_t b[2]) {
    auto& s = cur->mma_scratch[warp];
    for (int i = 0; i < 4; i++) s[lane * 6 + i] = a[i];
    for (int i = 0; i < 2; i++) s[lane * 6 + 4 + i] = b[i];
    warp_sync();
    auto half_of = [](uint32_t reg, int hi) { return bf16_to_f32(bf16{(unsigned short)(hi ? reg >> 16 : reg & 0xffff)}); };
    auto A = [&](int r, int k) {
        int reg = (r >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0);
        int l = (r % 8) * 4 + (k % 8) / 2;
        return half_of(s[l * 6 + reg], k & 1);
    };
    auto B = [&](int k, int n) {
        int l = n * 4 + (k % 8) / 2;
        return half_of(s[l * 6 + 4 + (k >= 8 ? 1 : 0)], k & 1);
    };
    int g = lane >> 2, t = lane & 3;
    float out[4];
    for (int i = 0; i < 4; i++) {
        int r = g + (i >= 2 ? 8 : 0), c = 2 * t + (i & 1);
        float acc = d[i];
        for (int k = 0; k < 16; k++) acc += A(r, k) * B(k, c);
        out[i] = acc;
    }
    warp_sync();
    for (int i = 0; i < 4; i++) d[i] = out[i];
}

// Runs kernel `k` over the grid: one fiber per thread of a block, blocks in order.
template <class P>
void launch(const char* name, void (*k)(P), dim3 grid, dim3 block, size_t smem, const P& p);

// Name -> launcher, filled by EMU_EXPORT at static-initialisation time.
using Launcher = std::function<void(const char*, dim3, dim3, size_t, const void*)>;
inline std::map<std::string, Launcher>& registry() {
    static std::map<std::string, Launcher> r;
    return r;
}
struct Registrar {
    Registrar(const char* name, Launcher f) { registry()[name] = std::move(f); }
};

}  // namespace emu

inline dim3 threadIdx, blockIdx;
inline dim3 blockDim, gridDim;

inline void __syncthreads() { emu::bar_wait(emu::cur->block_bar); }
inline void __syncwarp(unsigned = 0xffffffffu) { emu::warp_sync(); }
template <class T>
T __shfl_xor_sync(unsigned, T v, int m) { return emu::shfl(v, emu::lane ^ m); }
template <class T>
T __shfl_sync(unsigned, T v, int src) { return emu::shfl(v, src); }
inline float __expf(float x) { return std::exp(x); }
inline int min(int a, int b) { return a < b ? a : b; }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline float __uint_as_float(unsigned i) { float f; std::memcpy(&f, &i, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned i; std::memcpy(&i, &f, 4); return i; }
struct int2 { int x, y; };
struct alignas(8) uint2 { unsigned x, y; };
struct alignas(16) uint4 { unsigned x, y, z, w; };
struct alignas(16) float4 { float x, y, z, w; };
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }

#define DYN_SMEM(T, name) T* name = reinterpret_cast<T*>(emu::cur->dyn_smem.data())
#define EMU_EXPORT(name, P)                                                            \
    static emu::Registrar emu_reg_##name(#name, [](const char* n, dim3 g, dim3 b, size_t s, const void* p) { \
        emu::launch<P>(n, name, g, b, s, *static_cast<const P*>(p));                      \
    });

namespace emu {
// Where every fiber starts: run the block's kernel body, leave the barriers, switch
// back to the scheduler for good.
inline void fiber_main() {
    cur->body();
    Fiber& f = cur->fibers[cur->current];
    f.done = true;
    bar_leave(cur->block_bar);
    bar_leave(cur->warp_bars[f.warp]);
    denoised_emu_switch(&f.sp, cur->sched_sp);
    __builtin_unreachable();
}

constexpr size_t STACK_BYTES = 256 << 10;

template <class P>
void launch(const char* name, void (*k)(P), dim3 grid, dim3 block, size_t smem, const P& p) {
    std::lock_guard<std::mutex> guard(one_at_a_time);
    int nthreads = block.x * block.y * block.z;
    int nwarps = (nthreads + 31) / 32;
    Launch l;
    l.grid = grid;
    l.block = block;
    l.warp_bars.resize(nwarps);
    l.scratch.resize(nwarps);
    l.mma_scratch.resize(nwarps);
    l.dyn_smem.assign(smem + 16, 0);
    l.fibers.resize(nthreads);
    for (int t = 0; t < nthreads; t++) l.stacks.emplace_back(new char[STACK_BYTES]);
    l.body = [&] { k(p); };
    l.name = name;
    l.shared_log.resize(nwarps);
    if (counting) stats()[name].launches++;
    cur = &l;
    blockDim = block;
    gridDim = grid;
    for (unsigned z = 0; z < grid.z; z++)
        for (unsigned y = 0; y < grid.y; y++)
            for (unsigned x = 0; x < grid.x; x++) {
                blockIdx = dim3{x, y, z};
                l.block_bar = Bar{nthreads};
                for (int w = 0; w < nwarps; w++) l.warp_bars[w] = Bar{std::min(32, nthreads - 32 * w)};
                for (int t = 0; t < nthreads; t++) {
                    Fiber& f = l.fibers[t];
                    f.done = false;
                    f.open.clear();
                    f.groups.clear();
                    f.shared_seq = 0;
                    f.tid = dim3{t % block.x, (t / block.x) % block.y, t / (block.x * block.y)};
                    f.lane = t % 32;
                    f.warp = t / 32;
                    // Initial frame: six zeroed callee-saved registers, then the
                    // address `ret` jumps to, placed so that fiber_main starts with
                    // the stack aligned as after a call.
                    uintptr_t top = (reinterpret_cast<uintptr_t>(l.stacks[t].get()) + STACK_BYTES) & ~uintptr_t(15);
                    void** sp = reinterpret_cast<void**>(top);
                    *--sp = nullptr;
                    *--sp = reinterpret_cast<void*>(&fiber_main);
                    for (int r = 0; r < 6; r++) *--sp = nullptr;
                    f.sp = sp;
                }
                int alive = nthreads;
                while (alive > 0) {
                    for (int t = 0; t < nthreads; t++) {
                        Fiber& f = l.fibers[t];
                        if (f.done) continue;
                        l.current = t;
                        threadIdx = f.tid;
                        lane = f.lane;
                        warp = f.warp;
                        denoised_emu_switch(&l.sched_sp, f.sp);
                        if (f.done) alive--;
                    }
                }
                if (counting) count_block(l);
            }
    cur = nullptr;
}
}  // namespace emu
