// SPDX-License-Identifier: Apache-2.0
// tests/core/element_test.cpp mirrors include/kvc/core/element.hpp: fp16/bf16 round-to-nearest-even.
#include <kvc/core/element.hpp>

#include "support/catch.hpp"

#include <cmath>
#include <cstdint>
#include <limits>
#if defined(__SSE2__)
#  include <xmmintrin.h>
#endif

namespace {
std::uint16_t h(float f) {
  return kvc::half(f).bits;
}
std::uint16_t bf(float f) {
  return kvc::bfloat16(f).bits;
}
}  // namespace

TEST_CASE("half: hand-computed encodings", "[core][element]") {
  CHECK(h(1.0f) == 0x3c00);
  CHECK(h(-2.0f) == 0xc000);
  CHECK(h(65504.0f) == 0x7bff);                      // largest half
  CHECK(h(65519.0f) == 0x7bff);                      // below the rounding midpoint
  CHECK(h(65520.0f) == 0x7c00);                      // midpoint rounds to even = Inf
  CHECK(h(std::ldexp(1.0f, -14)) == 0x0400);         // smallest normal
  CHECK(h(std::ldexp(1.0f, -24)) == 0x0001);         // smallest subnormal
  CHECK(h(std::ldexp(1.0f, -25)) == 0x0000);         // tie between 0 and 2^-24: even = 0
  CHECK(h(std::ldexp(3.0f, -26)) == 0x0001);         // 0.75 ulp rounds up
  CHECK(h(std::ldexp(3.0f, -25)) == 0x0002);         // 1.5 ulp ties to even (2)
  CHECK(h(1.0f + std::ldexp(1.0f, -11)) == 0x3c00);  // tie: 1.0 is even
  CHECK(h(1.0f + std::ldexp(3.0f, -11)) == 0x3c02);  // tie: up to the even neighbour
  CHECK(h(std::numeric_limits<float>::infinity()) == 0x7c00);
  CHECK((h(std::numeric_limits<float>::quiet_NaN()) & 0x7fff) > 0x7c00);
  CHECK(h(-0.0f) == 0x8000);
}

TEST_CASE("half: every bit pattern round-trips through float", "[core][element]") {
  for (std::uint32_t b = 0; b < 0x10000; ++b) {
    auto const x = kvc::half::from_bits(static_cast<std::uint16_t>(b));
    float const f = static_cast<float>(x);
    if ((b & 0x7fff) > 0x7c00) {
      CHECK(std::isnan(f));
      continue;
    }
    REQUIRE(kvc::half(f).bits == b);
  }
}

TEST_CASE("half: decoding hand values", "[core][element]") {
  CHECK(static_cast<float>(kvc::half::from_bits(0x3555)) == 0.333251953125f);
  CHECK(static_cast<float>(kvc::half::from_bits(0x0001)) == std::ldexp(1.0f, -24));
  CHECK(static_cast<float>(kvc::half::from_bits(0x83ff)) == -std::ldexp(1023.0f, -24));
  CHECK(std::isinf(static_cast<float>(kvc::half::from_bits(0xfc00))));
}

TEST_CASE("half: subnormals widen exactly with flush-to-zero and denormals-are-zero on (fast-math devices)",
          "[core][element]") {
#if defined(__SSE2__)
  // The CPU's FTZ and DAZ bits reproduce what nvcc's -use_fast_math / --ftz=true does on the device: a float
  // subnormal operand or result becomes 0. The conversion must not depend on them.
  unsigned const saved = _mm_getcsr();
  _mm_setcsr(saved | 0x8040u);  // FTZ (bit 15) | DAZ (bit 6)
  std::uint32_t wrong = 0;
  for (std::uint32_t m = 1; m < 0x400; ++m) {  // every nonzero subnormal, both signs: m * 2^-24 (hand value)
    volatile std::uint16_t const bits = static_cast<std::uint16_t>(m);
    float const pos = static_cast<float>(kvc::half::from_bits(bits));
    float const neg = static_cast<float>(kvc::half::from_bits(static_cast<std::uint16_t>(bits | 0x8000u)));
    // Compared as integers scaled by 2^24 (normal floats): exact, and unaffected by DAZ.
    wrong += pos * 0x1p24f == static_cast<float>(m) && neg * 0x1p24f == -static_cast<float>(m) ? 0u : 1u;
  }
  float const smallest_normal = static_cast<float>(kvc::half::from_bits(0x0400));
  _mm_setcsr(saved);
  CHECK(wrong == 0);
  CHECK(smallest_normal == std::ldexp(1.0f, -14));
#else
  WARN("SKIPPED: no SSE control register to set flush-to-zero on this CPU");
#endif
}

TEST_CASE("bfloat16: round to nearest even, NaN stays NaN", "[core][element]") {
  CHECK(bf(1.0f) == 0x3f80);
  CHECK(bf(1.0f + std::ldexp(1.0f, -8)) == 0x3f80);  // tie -> even
  CHECK(bf(1.0f + std::ldexp(3.0f, -8)) == 0x3f82);  // tie -> even (up)
  CHECK(bf(1.0f + std::ldexp(1.0f, -7)) == 0x3f81);  // exact
  CHECK(bf(3.4028235e38f) == 0x7f80);                // rounds up to Inf
  CHECK((bf(std::numeric_limits<float>::quiet_NaN()) & 0x7fff) > 0x7f80);
  CHECK(static_cast<float>(kvc::bfloat16::from_bits(0xc0a0)) == -5.0f);
}
