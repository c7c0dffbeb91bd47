// SPDX-License-Identifier: Apache-2.0
// tests/core/element_test.cpp mirrors include/kvc/core/element.hpp: fp16/bf16/fp8 round-to-nearest-even and exact
// widening.
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

namespace {
/// The OCP formula (docs: ../shared/specs/fp8_kv_cache.md), written independently of element.hpp's bit arithmetic:
/// exponent 0 is m * 2^(1 - bias - M); otherwise (1 + m / 2^M) * 2^(e - bias).
float ocp_value(std::uint32_t b, int exponent_bits, int mantissa_bits) {
  int const bias = (1 << (exponent_bits - 1)) - 1;
  int const e = static_cast<int>((b >> mantissa_bits) & ((1u << exponent_bits) - 1u));
  int const m = static_cast<int>(b & ((1u << mantissa_bits) - 1u));
  double const magnitude =
      e == 0 ? std::ldexp(m, 1 - bias - mantissa_bits) : std::ldexp(1.0 + std::ldexp(m, -mantissa_bits), e - bias);
  return static_cast<float>((b & 0x80u) ? -magnitude : magnitude);
}
float e4m3(std::uint32_t b) {
  return static_cast<float>(kvc::float8_e4m3::from_bits(static_cast<std::uint8_t>(b)));
}
float e5m2(std::uint32_t b) {
  return static_cast<float>(kvc::float8_e5m2::from_bits(static_cast<std::uint8_t>(b)));
}
std::uint8_t q4(float f) {
  return kvc::float8_e4m3(f).bits;
}
std::uint8_t q5(float f) {
  return kvc::float8_e5m2(f).bits;
}
}  // namespace

TEST_CASE("float8_e4m3: every byte widens to the OCP formula's value, NaN at 0x7F and 0xFF only", "[core][element]") {
  for (std::uint32_t b = 0; b < 256; ++b) {
    if ((b & 0x7fu) == 0x7fu) {
      CHECK(std::isnan(e4m3(b)));
      continue;
    }
    REQUIRE(e4m3(b) == ocp_value(b, 4, 3));
    REQUIRE(std::signbit(e4m3(b)) == ((b & 0x80u) != 0));  // -0 keeps its sign
    REQUIRE(q4(e4m3(b)) == b);                             // and encodes back to the same byte
  }
  CHECK(e4m3(0x7e) == 448.0f);                  // largest finite
  CHECK(e4m3(0x01) == std::ldexp(1.0f, -9));    // smallest subnormal
  CHECK(e4m3(0x08) == std::ldexp(1.0f, -6));    // smallest normal
  CHECK(e4m3(0x38) == 1.0f);                    // e = 7, m = 0
  CHECK(e4m3(0xbd) == -std::ldexp(13.0f, -3));  // 1.0111.101: -(1 + 5/8) * 2^0
  CHECK(e4m3(0xb5) == -std::ldexp(13.0f, -4));  // 1.0110.101: -(1 + 5/8) * 2^-1
}

TEST_CASE("float8_e4m3: round to nearest even, saturating, NaN stays NaN", "[core][element]") {
  CHECK(q4(1.0f + 1.0f / 16) == 0x38);          // tie between 1 and 1.125: even (1)
  CHECK(q4(1.125f + 1.0f / 16) == 0x3a);        // tie between 1.125 and 1.25: even (1.25)
  CHECK(q4(1.0f + 1.0f / 16 + 1e-6f) == 0x39);  // above the tie
  CHECK(q4(464.0f) == 0x7e);                    // beyond 448 saturates (no Inf in E4M3FN)
  CHECK(q4(-1e30f) == 0xfe);
  CHECK(q4(std::numeric_limits<float>::infinity()) == 0x7e);
  CHECK(q4(std::ldexp(1.0f, -10)) == 0x00);          // half the smallest subnormal: tie to even 0
  CHECK(q4(std::ldexp(3.0f, -11)) == 0x01);          // 0.75 of it rounds up
  CHECK(q4(std::ldexp(3.0f, -10)) == 0x02);          // 1.5 units: tie to even (2)
  CHECK(q4(std::ldexp(15.0f, -10)) == 0x08);         // 7.5 units: rounds into the smallest normal
  CHECK(q4(std::ldexp(1.0f, -126) * 0.5f) == 0x00);  // a float subnormal
  CHECK((q4(std::numeric_limits<float>::quiet_NaN()) & 0x7f) == 0x7f);
  CHECK(q4(-0.0f) == 0x80);
}

TEST_CASE("float8_e5m2: every byte widens to the OCP formula's value, Inf and NaN as binary16's", "[core][element]") {
  for (std::uint32_t b = 0; b < 256; ++b) {
    std::uint32_t const em = b & 0x7fu;
    if (em > 0x7cu) {
      CHECK(std::isnan(e5m2(b)));
      continue;
    }
    if (em == 0x7cu) {
      CHECK(e5m2(b) ==
            ((b & 0x80u) ? -std::numeric_limits<float>::infinity() : std::numeric_limits<float>::infinity()));
      continue;
    }
    REQUIRE(e5m2(b) == ocp_value(b, 5, 2));
    REQUIRE(q5(e5m2(b)) == b);
  }
  CHECK(e5m2(0x7b) == 57344.0f);
  CHECK(e5m2(0x01) == std::ldexp(1.0f, -16));
}

TEST_CASE("float8_e5m2: round to nearest even, saturating, NaN stays NaN", "[core][element]") {
  CHECK(q5(1.0f + 1.0f / 8) == 0x3c);   // tie between 1 and 1.25: even (1)
  CHECK(q5(1.25f + 1.0f / 8) == 0x3e);  // tie between 1.25 and 1.5: even (1.5)
  CHECK(q5(61440.0f) == 0x7b);          // the midpoint to Inf saturates
  CHECK(q5(std::numeric_limits<float>::infinity()) == 0x7b);
  CHECK(q5(-std::numeric_limits<float>::infinity()) == 0xfb);
  CHECK(q5(std::ldexp(1.0f, -17)) == 0x00);  // tie to even 0
  CHECK(q5(std::ldexp(3.0f, -17)) == 0x02);  // 1.5 units: tie to even (2)
  CHECK((q5(std::numeric_limits<float>::quiet_NaN()) & 0x7f) > 0x7c);
}
