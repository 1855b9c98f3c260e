// Run-time CPU feature checks of the kernels' wider code paths.
//
// The extension is compiled for x86-64-v2 + AVX2/FMA/F16C (setup.py); kernels with an
// AVX-512 path compile it with __attribute__((target(...))) and call it only when the
// CPU has the features. One check for the whole library, read once per process.
#pragma once
#include <atomic>
#include <cstdlib>

#if defined(__GNUC__) && defined(__x86_64__) && defined(__linux__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace specdec {

#if defined(__GNUC__) && defined(__x86_64__)
// AVX-512 F/VL/DQ/BW (Skylake-X and later Intel, AMD Zen 4 and later).
// SPECDEC_DISABLE_AVX512=1 (read once) forces the AVX2 kernels, e.g. to test them.
inline bool cpu_has_avx512() {
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
                          __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512bw") &&
                          !(std::getenv("SPECDEC_DISABLE_AVX512") && std::getenv("SPECDEC_DISABLE_AVX512")[0] == '1');
  return has;
}
// AVX-512 VNNI (Ice Lake / Cascade Lake and later Intel, AMD Zen 4 and later) on top of the
// above; off too when SPECDEC_DISABLE_AVX512=1.
inline bool cpu_has_avx512_vnni() {
  static const bool has = cpu_has_avx512() && __builtin_cpu_supports("avx512vnni");
  return has;
}
#else
inline bool cpu_has_avx512() { return false; }
inline bool cpu_has_avx512_vnni() { return false; }
#endif

#if defined(__GNUC__) && defined(__x86_64__) && defined(__linux__)
// AMX tiles with int8 products (Sapphire Rapids and later Intel) on top of AVX-512 VNNI, usable
// here: the CPU has them (CPUID 7.0 EDX bits 24, 25), the OS saves their state (XCR0 bits 17,
// 18), and Linux granted this process the tile data (arch_prctl ARCH_REQ_XCOMP_PERM, which a
// process must ask for once before its first tile instruction; refused under some sandboxes).
// Off when SPECDEC_DISABLE_AMX=1 or SPECDEC_DISABLE_AVX512=1 (read once), e.g. to test the
// VNNI path on an AMX CPU.
inline bool cpu_has_amx_int8() {
  static const bool has = [] {
    if (!cpu_has_avx512_vnni()) return false;
    if (std::getenv("SPECDEC_DISABLE_AMX") && std::getenv("SPECDEC_DISABLE_AMX")[0] == '1') return false;
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || !(d & (1u << 25))) return false;
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if ((lo & (3u << 17)) != (3u << 17)) return false;
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return has;
}
#else
inline bool cpu_has_amx_int8() { return false; }
#endif

// Whether the kernels take the AMX path where it exists: a switch benchmarks flip to time both
// paths in one process (specdec_kernels._C.set_amx_enabled); on unless turned off.
inline std::atomic<bool>& amx_enabled() {
  static std::atomic<bool> on{true};
  return on;
}
inline bool use_amx_int8() { return cpu_has_amx_int8() && amx_enabled().load(std::memory_order_relaxed); }

}  // namespace specdec
