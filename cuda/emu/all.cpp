// One translation unit holding every kernel, built for the CPU emulator (emu.h) by
// build.rs. One unit, because the static registrars that name each kernel would be
// dropped by the linker from an archive member nothing references.
#include <cstdio>
#include <iterator>
#include "../kernels/elementwise.cu"
#include "../kernels/norm.cu"
#include "../kernels/attention.cu"
#include "../kernels/image.cu"
#include "../kernels/quant.cu"

// Runs kernel `name` on the CPU. Returns 0, or -1 when no kernel has that name.
extern "C" int denoised_emu_launch(const char* name, const unsigned* grid, const unsigned* block,
                                   unsigned long smem, const void* params) {
    auto& r = emu::registry();
    auto it = r.find(name);
    if (it == r.end()) return -1;
    it->second(name, dim3{grid[0], grid[1], grid[2]}, dim3{block[0], block[1], block[2]}, smem, params);
    return 0;
}

// Turns the shared-memory access log on or off, and clears the counters when on.
extern "C" void denoised_emu_count_shared(int on) {
    std::lock_guard<std::mutex> guard(emu::one_at_a_time);
    emu::counting = on != 0;
    if (on) emu::stats().clear();
}

// The counters of the `i`-th kernel that ran since counting began, by name order:
// returns 0 and fills name (NUL-terminated, at most cap bytes) and out[4] = launches,
// shared-access instructions, wavefronts, bank conflicts; -1 past the last kernel.
extern "C" int denoised_emu_shared_stats(unsigned long i, char* name, unsigned long cap,
                                         unsigned long long* out) {
    std::lock_guard<std::mutex> guard(emu::one_at_a_time);
    auto& s = emu::stats();
    if (i >= s.size()) return -1;
    auto it = s.begin();
    std::advance(it, i);
    std::snprintf(name, cap, "%s", it->first.c_str());
    out[0] = it->second.launches;
    out[1] = it->second.accesses;
    out[2] = it->second.wavefronts;
    out[3] = it->second.conflicts;
    return 0;
}

// sizeof of each parameter struct, in the order of cuda/src/params.rs, so a test can
// check the Rust mirrors byte for byte.
extern "C" void denoised_emu_param_sizes(unsigned long* out) {
    out[0] = sizeof(EwParams);
    out[1] = sizeof(LnModParams);
    out[2] = sizeof(RmsRopeParams);
    out[3] = sizeof(GatherParams);
    out[4] = sizeof(TimestepParams);
    out[5] = sizeof(AttnParams);
    out[6] = sizeof(ImgParams);
    out[7] = sizeof(EpilogueParams);
    out[8] = sizeof(AttnPackParams);
    out[9] = sizeof(TextAttnParams);
}
