// Run-time CPU feature checks of the kernels' wider code paths.
//
// The extension is compiled for x86-64-v2 + AVX2/FMA/F16C (setup.py); kernels with an
// AVX-512 path compile it with __attribute__((target(...))) and call it only when the
// CPU has the features. One check for the whole library, read once per process.
#pragma once
#include <cstdlib>

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

}  // namespace specdec
