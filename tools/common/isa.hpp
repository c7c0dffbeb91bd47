// SPDX-License-Identifier: Apache-2.0
// tools/common/isa.hpp: the instruction set the including translation unit was compiled for, as the tools report it
// (`kvc ... --time`: "isa"). kvc's CPU kernels pick their paths at compile time (F16C/NEON widening, AVX2 and AVX-512
// lanes), so this string says which paths a tool's timings measured.
#pragma once

#include <string>

namespace kvc::tools {

/// The vector extensions enabled for this translation unit (f16c and neon only when kvc's fp16 conversion uses them,
/// i.e. without KVC_PORTABLE_F16), joined with '+' in a fixed order, e.g.
/// "avx512f+avx512bw+avx512vbmi+avx2+fma+f16c", "avx2+fma+f16c", "neon", or "baseline" (none of them: plain x86-64's
/// SSE2 or a scalar build).
inline std::string compiled_isa() {
  std::string isa;
  [[maybe_unused]] auto add = [&isa](char const* name) {
    if (!isa.empty())
      isa += '+';
    isa += name;
  };
#if defined(__AVX512F__)
  add("avx512f");
#endif
#if defined(__AVX512BW__)
  add("avx512bw");
#endif
#if defined(__AVX512VBMI__)
  add("avx512vbmi");
#endif
#if defined(__AVX512FP16__)
  add("avx512fp16");
#endif
#if defined(__AVX2__)
  add("avx2");
#endif
#if defined(__FMA__)
  add("fma");
#endif
#if defined(__F16C__) && !defined(KVC_PORTABLE_F16)
  add("f16c");
#endif
#if defined(__aarch64__) && defined(__ARM_NEON) && !defined(KVC_PORTABLE_F16)
  add("neon");
#endif
  return isa.empty() ? "baseline" : isa;
}

}  // namespace kvc::tools
