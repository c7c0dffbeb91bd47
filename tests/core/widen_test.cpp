// SPDX-License-Identifier: Apache-2.0
// tests/core/widen_test.cpp: 16-bit -> fp32 widening on the CPU is exact on whichever path this translation unit
// compiled: the portable one (default flags) or the hardware ones (tests/CMakeLists.txt builds this file again as
// kvc.core.widen_f16c with -mf16c -mavx, kvc.core.widen_avx2 with -mavx2 -mfma too, kvc.core.widen_avx512 with
// -mavx512f too and kvc.core.widen_avx512vbmi with -mavx512bw -mavx512vbmi too (E4M3's byte tables), and checks that
// the F16C path, and there VBMI, was really taken).
#include <kvc/backend/cpu/detail/rows.hpp>
#include <kvc/backend/cpu/detail/widen.hpp>

#include "support/catch.hpp"
#include "support/instructions.hpp"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string_view>
#include <vector>

using kvc::Index;

namespace {

std::uint32_t bits_of(float f) {
  std::uint32_t u = 0;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

/// Exact value of a binary16 pattern, computed from its fields (independent of element.hpp).
double half_value(std::uint16_t h) {
  int const exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
  double const sign = (h & 0x8000) ? -1.0 : 1.0;
  if (exponent == 0)
    return sign * std::ldexp(mantissa, -24);
  if (exponent == 31)
    return mantissa ? std::nan("") : sign * INFINITY;
  return sign * std::ldexp(1024 + mantissa, exponent - 25);
}

}  // namespace

// The VBMI build must have compiled E4M3's byte tables (widen.hpp's guard), or it would test the 16-wide path again.
#ifdef KVC_EXPECT_E4M3_TABLES
static_assert(sizeof(kvc::detail::e4m3_fp32_bytes.byte3) == 128,  // defined under e4m3_widen64's guard
              "kvc.core.widen_avx512vbmi: widen.hpp did not compile e4m3_widen64");
#endif

TEST_CASE("widen: every binary16 pattern widens to its exact value", "[core][widen]") {
  KVC_SKIP_WITHOUT_INSTRUCTIONS();
#ifdef KVC_EXPECT_F16_CONVERSION
  REQUIRE(std::string_view(kvc::detail::f16_conversion) == KVC_EXPECT_F16_CONVERSION);
#endif
  std::vector<kvc::half> all(65536 + 5);  // + 5: a tail that is not a multiple of 8
  for (std::uint32_t i = 0; i < all.size(); ++i)
    all[i] = kvc::half::from_bits(static_cast<std::uint16_t>(i & 0xffff));
  std::vector<float> wide(all.size());
  kvc::detail::widen(all.data(), wide.data(), static_cast<Index>(all.size()));
  Index mismatches = 0;
  for (std::uint32_t i = 0; i < all.size(); ++i) {
    double const expected = half_value(static_cast<std::uint16_t>(i & 0xffff));
    bool const ok = std::isnan(expected)
                        ? std::isnan(wide[i])
                        : static_cast<double>(wide[i]) == expected && std::signbit(wide[i]) == std::signbit(expected);
    mismatches += ok ? 0 : 1;
  }
  CHECK(mismatches == 0);
  // Non-NaN patterns give the very bits of the portable conversion.
  for (std::uint32_t i = 0; i < 65536; i += 97)
    if (!std::isnan(wide[i]))
      CHECK(bits_of(wide[i]) == bits_of(kvc::detail::half_bits_to_float(static_cast<std::uint16_t>(i))));
}

TEST_CASE("widen: dot and sum_squares of fp16 rows equal the fp64 sums of the exact values", "[core][widen]") {
  KVC_SKIP_WITHOUT_INSTRUCTIONS();
  std::vector<kvc::half> a(45);
  std::vector<float> b(45);
  for (std::size_t i = 0; i < a.size(); ++i) {
    a[i] = kvc::half(static_cast<float>(i % 7) * 0.25f - 0.75f);  // exact in fp16, small integers times 1/4
    b[i] = static_cast<float>(i % 5) - 2.0f;
  }
  double dot = 0, squares = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    double const x = half_value(a[i].bits);
    dot += x * b[i];
    squares += x * x;
  }
  // Every partial sum is a multiple of 1/16 below 2^10: exact in fp32 in any order.
  CHECK(kvc::detail::dot(a.data(), b.data(), 45) == static_cast<float>(dot));
  CHECK(kvc::detail::sum_squares(a.data(), 45) == static_cast<float>(squares));
}

TEST_CASE("widen: every fp8 byte widens to element.hpp's exact value, and dot and sum_squares read it scaled",
          "[core][widen][fp8]") {
  KVC_SKIP_WITHOUT_INSTRUCTIONS();
  // element_test checks element.hpp's conversions against the OCP formula; here the widening paths (F16C where
  // compiled) must give their bits, NaN for NaN, over every byte and a tail.
  auto check = [](auto tag) {
    using T = decltype(tag);
    std::vector<T> all(256 + 5);
    for (std::uint32_t i = 0; i < all.size(); ++i)
      all[i] = T::from_bits(static_cast<std::uint8_t>(i & 0xff));
    std::vector<float> wide(all.size());
    kvc::detail::widen(all.data(), wide.data(), static_cast<Index>(all.size()));
    Index mismatches = 0;
    for (std::uint32_t i = 0; i < all.size(); ++i) {
      float const expected = kvc::to_float(all[i]);
      mismatches += (std::isnan(expected) ? std::isnan(wide[i]) : bits_of(wide[i]) == bits_of(expected)) ? 0 : 1;
    }
    CHECK(mismatches == 0);
    // dot and sum_squares under a scale: each element is to_float * scale, summed in the lanes' order; with
    // values whose products are exact (small multiples of powers of two) the fp64 sum is the answer.
    // 150: two blocks of 64 (E4M3's VBMI path), one of 16 and a tail.
    std::vector<T> a(150);
    std::vector<float> b(150);
    for (std::size_t i = 0; i < a.size(); ++i) {
      a[i] = T(static_cast<float>(i % 7) * 0.25f - 0.75f);
      b[i] = static_cast<float>(i % 5) - 2.0f;
    }
    float const scale = 0.5f;
    double dot = 0, squares = 0;
    for (std::size_t i = 0; i < a.size(); ++i) {
      double const x = static_cast<double>(kvc::to_float(a[i])) * scale;
      dot += x * b[i];
      squares += x * x;
    }
    CHECK(kvc::detail::dot(a.data(), b.data(), 150, scale) == static_cast<float>(dot));
    CHECK(kvc::detail::sum_squares(a.data(), 150, scale) == static_cast<float>(squares));

    // Every byte through the reductions' lanes: at position byte % n of a row of n = 16 or 85 (a block of 64, one of
    // 16 and a tail), the others zero, against a one-hot row for dot. Unit, then scales that make E4M3's folded 2^8
    // matter: not a power of two, subnormal, and one whose product with 2^8 overflows (the reductions then read the
    // elements one at a time). Each must be load(byte, scale), one rounding of the exact product (== compares values
    // exactly; -0 sums to +0), NaN for NaN.
    auto each_byte = [&all](auto s) {
      for (Index const n : {Index{16}, Index{85}})
        for (std::uint32_t byte = 0; byte < 256; ++byte) {
          INFO("byte " << byte << " row " << n << " scale " << float(1.0f * s));
          auto const at = static_cast<std::size_t>(byte % static_cast<std::uint32_t>(n));
          std::vector<T> row(static_cast<std::size_t>(n), T::from_bits(0));
          row[at] = all[byte];
          std::vector<float> one_hot(row.size(), 0.0f);
          one_hot[at] = 1.0f;
          float const expected = kvc::load(row[at], s);
          float const got = kvc::detail::dot(row.data(), one_hot.data(), n, s);
          float const squared = kvc::detail::sum_squares(row.data(), n, s);
          if (std::isnan(expected)) {
            CHECK(std::isnan(got));
            CHECK(std::isnan(squared));
          } else {
            CHECK(got == expected);
            CHECK(squared == expected * expected);
          }
        }
    };
    each_byte(kvc::Unit{});
    for (float const s : {0.3f, 3e-39f, 0x1p120f}) {
      std::vector<float> scaled(all.size());
      kvc::detail::widen(all.data(), scaled.data(), static_cast<Index>(all.size()), s);
      Index wrong = 0;
      for (std::size_t i = 0; i < all.size(); ++i) {
        float const expected = kvc::load(all[i], s);
        wrong += (std::isnan(expected) ? std::isnan(scaled[i]) : bits_of(scaled[i]) == bits_of(expected)) ? 0 : 1;
      }
      CHECK(wrong == 0);
      each_byte(s);
    }
  };
  check(kvc::float8_e4m3{});
  check(kvc::float8_e5m2{});
}

TEST_CASE("widen: sum_squares_rows gives each row's sum_squares bit for bit (2, 3 and 4 rows, a NaN in one row)",
          "[core][widen]") {
  // Rows of random finite bit patterns (fp16, bf16, E4M3, E5M2; fp32 values) of 16, 45, 128 and 150 elements (whole
  // blocks and tails), unscaled, scaled (0.3: not a power of two) and scaled past E4M3's folding (2^120: the portable
  // loop); then row 1 of each set gets a NaN (the carrying path for every row of the pass, without VBMI).
  std::uint32_t state = 12345u;
  auto next = [&state] {
    state = state * 1664525u + 1013904223u;
    return state >> 8;
  };
  auto check = [&](auto tag, auto make, auto nan) {
    using T = decltype(tag);
    for (Index const n : {Index{16}, Index{45}, Index{128}, Index{150}})
      for (int with_nan = 0; with_nan < 2; ++with_nan) {
        std::vector<T> rows[3];
        for (auto& row : rows)
          for (Index i = 0; i < n; ++i)
            row.push_back(make(next()));
        if (with_nan)
          rows[1][static_cast<std::size_t>(n / 2)] = nan;
        auto same = [&](auto scale) {
          T const* const two[2] = {rows[0].data(), rows[1].data()};
          T const* const three[3] = {rows[0].data(), rows[1].data(), rows[2].data()};
          T const* const four[4] = {rows[2].data(), rows[0].data(), rows[1].data(), rows[2].data()};
          float out2[2], out3[3], out4[4];
          kvc::detail::sum_squares_rows<2>(two, n, scale, out2);
          kvc::detail::sum_squares_rows<3>(three, n, scale, out3);
          kvc::detail::sum_squares_rows<4>(four, n, scale, out4);
          for (int r = 0; r < 3; ++r) {
            INFO("row " << r << " of " << n << " NaN " << with_nan << " scale " << float(1.0f * scale));
            float const alone = kvc::detail::sum_squares(rows[r].data(), n, scale);
            CHECK(std::isnan(alone) == (with_nan && r == 1));
            CHECK(bits_of(out3[r]) == bits_of(alone));
            CHECK(bits_of(out4[r + 1]) == bits_of(alone));
            if (r == 2)
              CHECK(bits_of(out4[0]) == bits_of(alone));  // row 2 twice, first and last
            if (r < 2)
              CHECK(bits_of(out2[r]) == bits_of(alone));
          }
        };
        same(kvc::Unit{});
        same(0.3f);
        same(0x1p120f);
      }
  };
  auto finite16 = [](auto tag, std::uint32_t r, unsigned exponent_mask) {
    auto b = static_cast<std::uint16_t>(r);
    if ((b & exponent_mask) == exponent_mask)
      b = static_cast<std::uint16_t>(b & ~0x4000u);  // an all-ones exponent: one below
    return decltype(tag)::from_bits(b);
  };
  check(
      kvc::half{}, [&](std::uint32_t r) { return finite16(kvc::half{}, r, 0x7c00u); }, kvc::half::from_bits(0x7e00));
  check(
      kvc::bfloat16{}, [&](std::uint32_t r) { return finite16(kvc::bfloat16{}, r & 0xc7ffu, 0x7f80u); },
      kvc::bfloat16::from_bits(0x7fc0));
  check(
      kvc::float8_e4m3{},
      [](std::uint32_t r) {
        return kvc::float8_e4m3::from_bits(static_cast<std::uint8_t>((r & 0x7fu) == 0x7fu ? r - 1 : r));
      },
      kvc::float8_e4m3::from_bits(0x7f));
  check(
      kvc::float8_e5m2{},
      [](std::uint32_t r) {
        return kvc::float8_e5m2::from_bits(static_cast<std::uint8_t>((r & 0x7cu) == 0x7cu ? r & 0xbbu : r));
      },
      kvc::float8_e5m2::from_bits(0x7e));
  check(
      0.0f, [](std::uint32_t r) { return static_cast<float>(r % 4001u) / 1000.0f - 2.0f; },
      std::numeric_limits<float>::quiet_NaN());
}

#if KVC_CPU_F16_CONVERT == 1 && defined(__AVX2__)
TEST_CASE("widen: e4m3_has_nan finds a NaN byte anywhere in a row, and the reductions keep it", "[core][widen]") {
  // Rows of 16, 40, 48 and 80 bytes (blocks of 32, one of 16, single bytes), a NaN (0x7F or 0xFF) at each position
  // among the largest finite magnitudes (0x7E, 0xFE): found wherever it is, and dot then is NaN, which says the
  // reductions took the NaN-carrying path for that row (without VBMI) or the byte tables (with it).
  KVC_SKIP_WITHOUT_INSTRUCTIONS();
  for (Index const n : {Index{16}, Index{40}, Index{48}, Index{80}}) {
    std::vector<kvc::float8_e4m3> row(static_cast<std::size_t>(n));
    for (std::size_t i = 0; i < row.size(); ++i)
      row[i] = kvc::float8_e4m3::from_bits(i % 2 ? 0x7e : 0xfe);
    std::vector<float> const ones(row.size(), 1.0f);
    CHECK_FALSE(kvc::detail::e4m3_has_nan(row.data(), n));
    CHECK(kvc::detail::dot(row.data(), ones.data(), n, 1.0f) == 0.0f);  // each lane holds one sign: -448 k + 448 k
    for (std::size_t at = 0; at < row.size(); ++at)
      for (std::uint8_t const nan : {std::uint8_t{0x7f}, std::uint8_t{0xff}}) {
        INFO("row " << n << " NaN " << int(nan) << " at " << at);
        std::vector<kvc::float8_e4m3> with = row;
        with[at] = kvc::float8_e4m3::from_bits(nan);
        CHECK(kvc::detail::e4m3_has_nan(with.data(), n));
        CHECK(std::isnan(kvc::detail::dot(with.data(), ones.data(), n, 0.5f)));
        CHECK(std::isnan(kvc::detail::sum_squares(with.data(), n, kvc::Unit{})));
      }
  }
  // Every finite byte in one row (no NaN: the scaled widening's 16-byte path without the carry) reads as load().
  std::vector<kvc::float8_e4m3> finite;
  for (unsigned byte = 0; byte < 256; ++byte)
    if ((byte & 0x7fu) != 0x7fu)
      finite.push_back(kvc::float8_e4m3::from_bits(static_cast<std::uint8_t>(byte)));
  CHECK_FALSE(kvc::detail::e4m3_has_nan(finite.data(), static_cast<Index>(finite.size())));
  for (float const s : {0.3f, 3e-39f}) {
    std::vector<float> wide(finite.size());
    kvc::detail::widen(finite.data(), wide.data(), static_cast<Index>(finite.size()), s);
    Index wrong = 0;
    for (std::size_t i = 0; i < finite.size(); ++i)
      wrong += bits_of(wide[i]) == bits_of(kvc::load(finite[i], s)) ? 0 : 1;
    CHECK(wrong == 0);
  }
}
#endif
