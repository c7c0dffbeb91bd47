// SPDX-License-Identifier: Apache-2.0
// kvc/core/element.hpp: 16-bit storage types kvc::half (IEEE binary16) and kvc::bfloat16, host and device.
//
// They are storage types only: arithmetic happens in float after `to_float`. Conversion from float rounds to
// nearest, ties to even; NaN stays NaN (quiet), overflow becomes Inf. Bit layouts equal CUDA's __half and
// __nv_bfloat16, so CUDA kernels may reinterpret them.
#pragma once

#include <kvc/config.hpp>

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace kvc {

namespace detail {

KVC_HOST_DEVICE inline std::uint32_t float_bits(float f) noexcept {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

KVC_HOST_DEVICE inline float bits_float(std::uint32_t u) noexcept {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

/// float -> binary16 bits, round to nearest even.
KVC_HOST_DEVICE inline std::uint16_t float_to_half_bits(float f) noexcept {
  std::uint32_t const x = float_bits(f);
  auto const sign = static_cast<std::uint16_t>((x >> 16) & 0x8000u);
  std::uint32_t const mag = x & 0x7fffffffu;
  if (mag >= 0x7f800000u)  // Inf or NaN: keep NaN quiet
    return static_cast<std::uint16_t>(sign | 0x7c00u | (mag > 0x7f800000u ? 0x0200u : 0u));
  if (mag >= 0x477ff000u)  // >= 65520 rounds past the largest half (65504)
    return static_cast<std::uint16_t>(sign | 0x7c00u);
  if (mag >= 0x38800000u) {  // normal half: rebias the exponent, drop 13 mantissa bits with RNE
    std::uint32_t const r = mag - (112u << 23);
    return static_cast<std::uint16_t>(sign | ((r + 0x0fffu + ((r >> 13) & 1u)) >> 13));
  }
  // Subnormal half: value in units of 2^-24, rounded to nearest even. A carry into 0x400 is the smallest normal.
  std::uint32_t const e = mag >> 23;
  if (e < 102u)  // below 2^-25: rounds to zero
    return sign;
  std::uint32_t const m = (mag & 0x7fffffu) | 0x800000u;
  std::uint32_t const shift = 126u - e;  // in [14, 24]
  std::uint32_t q = m >> shift;
  std::uint32_t const rem = m & ((1u << shift) - 1u);
  std::uint32_t const half_ulp = 1u << (shift - 1u);
  if (rem > half_ulp || (rem == half_ulp && (q & 1u)))
    ++q;
  return static_cast<std::uint16_t>(sign | q);
}

/// binary16 bits -> float (exact). Integer operations only, so flush-to-zero and denormals-are-zero modes (nvcc's
/// -use_fast_math and --ftz=true, x86's FTZ/DAZ) cannot turn fp16 subnormals into 0: no subnormal float is ever an
/// operand. Normals rebias the exponent by adding 112 << 23; a subnormal m * 2^-24 is float(m) (exact, m < 2^10)
/// with 24 taken off its exponent (the result is a normal float). Branch-free selects, so loops over fp16 rows
/// vectorise.
KVC_HOST_DEVICE inline float half_bits_to_float(std::uint16_t h) noexcept {
  std::uint32_t const sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  std::uint32_t const em = h & 0x7fffu;
  std::uint32_t const normal = (em << 13) + (112u << 23);
  std::uint32_t const subnormal = float_bits(static_cast<float>(static_cast<std::int32_t>(em))) - (24u << 23);
  std::uint32_t const special = 0x7f800000u | ((em & 0x3ffu) << 13);  // Inf or NaN keeps its payload
  // All ones or zero: no branch.
  std::uint32_t const is_special = 0u - static_cast<std::uint32_t>(em >= 0x7c00u);
  std::uint32_t const is_subnormal = 0u - static_cast<std::uint32_t>(em < 0x400u);
  std::uint32_t const is_zero = 0u - static_cast<std::uint32_t>(em == 0u);
  std::uint32_t const finite = (subnormal & is_subnormal & ~is_zero) | (normal & ~is_subnormal);
  return bits_float(sign | (special & is_special) | (finite & ~is_special));
}

/// float -> bfloat16 bits, round to nearest even; NaN stays a quiet NaN.
KVC_HOST_DEVICE inline std::uint16_t float_to_bfloat16_bits(float f) noexcept {
  std::uint32_t const x = float_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u)
    return static_cast<std::uint16_t>((x >> 16) | 0x0040u);
  return static_cast<std::uint16_t>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

}  // namespace detail

/// IEEE 754 binary16 storage type. 2 bytes, trivially copyable.
struct half {
  std::uint16_t bits = 0;

  half() = default;
  KVC_HOST_DEVICE explicit half(float f) noexcept : bits(detail::float_to_half_bits(f)) {}
  KVC_HOST_DEVICE explicit operator float() const noexcept { return detail::half_bits_to_float(bits); }
  /// Builds a value from raw bits (e.g. read from a file).
  KVC_HOST_DEVICE static half from_bits(std::uint16_t b) noexcept {
    half h;
    h.bits = b;
    return h;
  }
};

/// bfloat16 storage type (the top 16 bits of a float). 2 bytes, trivially copyable.
struct bfloat16 {
  std::uint16_t bits = 0;

  bfloat16() = default;
  KVC_HOST_DEVICE explicit bfloat16(float f) noexcept : bits(detail::float_to_bfloat16_bits(f)) {}
  KVC_HOST_DEVICE explicit operator float() const noexcept {
    return detail::bits_float(static_cast<std::uint32_t>(bits) << 16);
  }
  KVC_HOST_DEVICE static bfloat16 from_bits(std::uint16_t b) noexcept {
    bfloat16 h;
    h.bits = b;
    return h;
  }
};

static_assert(sizeof(half) == 2 && std::is_trivially_copyable_v<half>);
static_assert(sizeof(bfloat16) == 2 && std::is_trivially_copyable_v<bfloat16>);

/// Element types a view may hold (const-qualified for read-only views).
template <class T>
concept Element = std::is_same_v < std::remove_const_t<T>,
float > || std::is_same_v<std::remove_const_t<T>, half> || std::is_same_v<std::remove_const_t<T>, bfloat16>;

/// Widens any element to float (exact for all three types).
KVC_HOST_DEVICE inline float to_float(float x) noexcept {
  return x;
}
KVC_HOST_DEVICE inline float to_float(half x) noexcept {
  return static_cast<float>(x);
}
KVC_HOST_DEVICE inline float to_float(bfloat16 x) noexcept {
  return static_cast<float>(x);
}

/// Narrows a float to element type T with round-to-nearest-even.
template <class T>
KVC_HOST_DEVICE inline T from_float(float x) noexcept {
  if constexpr (std::is_same_v<T, float>)
    return x;
  else
    return T(x);
}

}  // namespace kvc
