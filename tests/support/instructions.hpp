// SPDX-License-Identifier: Apache-2.0
// tests/support/instructions.hpp: tests built a second time for x86 instruction sets (tests/CMakeLists.txt, "The
// hardware paths") skip themselves on a CPU without those instructions instead of dying of SIGILL.
#pragma once

#include "support/catch.hpp"

#include <string_view>
#if defined(KVC_EXPECT_F16_CONVERSION)
#  include <cpuid.h>
#endif

namespace kvc::test {

/// Why this CPU cannot run the instructions this translation unit was built for ("" when it can). Every test case
/// asks first: the hardware builds (-mf16c, -mavx2, -mavx512f, -mavx512vbmi) may use those instructions anywhere in a
/// test's body.
inline std::string_view missing_instructions() {
#if defined(KVC_EXPECT_F16_CONVERSION)
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;  // CPUID leaf 1: ECX bit 28 AVX, bit 29 F16C
  if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx) || !(ecx & (1u << 28)) || !(ecx & (1u << 29)))
    return "SKIPPED: this CPU has no F16C";
#  if defined(__FMA__)  // CPUID leaf 1: ECX bit 12
  if (!(ecx & (1u << 12)))
    return "SKIPPED: this CPU has no FMA";
#  endif
#  if defined(__AVX2__)  // CPUID leaf 7: EBX bit 5
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) || !(ebx & (1u << 5)))
    return "SKIPPED: this CPU has no AVX2";
#  endif
#  if defined(__AVX512F__)  // CPUID leaf 7: EBX bit 16
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) || !(ebx & (1u << 16)))
    return "SKIPPED: this CPU has no AVX-512";
#  endif
#  if defined(__AVX512VBMI__)  // CPUID leaf 7: EBX bit 30 AVX512BW, ECX bit 1 AVX512_VBMI
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) || !(ebx & (1u << 30)) || !(ecx & (1u << 1)))
    return "SKIPPED: this CPU has no AVX-512 VBMI";
#  endif
#endif
  return {};
}

}  // namespace kvc::test

#define KVC_SKIP_WITHOUT_INSTRUCTIONS()                                       \
  do {                                                                        \
    if (auto const why = ::kvc::test::missing_instructions(); !why.empty()) { \
      WARN(why);                                                              \
      return;                                                                 \
    }                                                                         \
  } while (false)
