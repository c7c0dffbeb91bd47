// SPDX-License-Identifier: Apache-2.0
// kvc/core/element.hpp: storage types of K/V elements, host and device: kvc::half (IEEE binary16), kvc::bfloat16, and
// the 8-bit floats kvc::float8_e4m3 and kvc::float8_e5m2 (OCP OFP8: E4M3FN and E5M2, as Hopper, vLLM and safetensors'
// F8_E4M3 / F8_E5M2 store them).
//
// They are storage types only: arithmetic happens in float after `to_float`, which is exact for every type.
// Conversion from float rounds to nearest, ties to even; NaN stays NaN (quiet). Overflow: 16-bit types become Inf;
// the 8-bit types saturate to their largest finite value (Inf too), as CUDA's __NV_SATFINITE conversion that vLLM
// quantises its cache with (E4M3FN has no Inf). Bit layouts equal CUDA's __half, __nv_bfloat16, __nv_fp8_e4m3 and
// __nv_fp8_e5m2, so CUDA kernels may reinterpret them.
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

/// The magnitude bits of float magnitude `mag` (finite, below the format's overflow) rounded to nearest even into a
/// float format of E exponent and M mantissa bits (bias 2^(E-1) - 1): a normal rebiases its exponent and drops 23 - M
/// mantissa bits; a subnormal is the value in units of 2^(1 - bias - M) (0 below half a unit). A carry out of the
/// mantissa is the encoding of the next binade (or of the smallest normal). Integer operations only: no dependence on
/// the rounding mode or on flush-to-zero.
template <int E, int M>
KVC_HOST_DEVICE inline std::uint32_t rounded_magnitude(std::uint32_t mag) noexcept {
  constexpr std::uint32_t bias = (1u << (E - 1)) - 1u;
  std::uint32_t const e = mag >> 23;
  std::uint32_t value = mag - ((127u - bias) << 23), shift = 23u - M;
  if (e < 128u - bias) {
    shift = 151u - bias - M - e;  // > 23 - M here
    if (shift > 24u)
      return 0u;
    value = (mag & 0x7fffffu) | 0x800000u;
  }
  std::uint32_t q = value >> shift;
  std::uint32_t const rem = value & ((1u << shift) - 1u);
  std::uint32_t const half_unit = 1u << (shift - 1u);
  if (rem > half_unit || (rem == half_unit && (q & 1u)))
    ++q;
  return q;
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
  return static_cast<std::uint16_t>(sign | rounded_magnitude<5, 10>(mag));
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

/// E4M3FN bits -> float (exact): s.eeee.mmm, bias 7, no Inf, NaN only at 0x7F / 0xFF. Branch-free like
/// half_bits_to_float: a normal rebiases its exponent (adding 120 << 23); a subnormal m * 2^-9 is float(m) with 9 taken
/// off its exponent.
KVC_HOST_DEVICE inline float e4m3_bits_to_float(std::uint8_t b) noexcept {
  std::uint32_t const sign = static_cast<std::uint32_t>(b & 0x80u) << 24;
  std::uint32_t const em = b & 0x7fu;
  std::uint32_t const normal = (em << 20) + (120u << 23);
  std::uint32_t const subnormal = float_bits(static_cast<float>(static_cast<std::int32_t>(em))) - (9u << 23);
  std::uint32_t const is_nan = 0u - static_cast<std::uint32_t>(em == 0x7fu);
  std::uint32_t const is_subnormal = 0u - static_cast<std::uint32_t>(em < 0x08u);
  std::uint32_t const is_zero = 0u - static_cast<std::uint32_t>(em == 0u);
  std::uint32_t const finite = (subnormal & is_subnormal & ~is_zero) | (normal & ~is_subnormal);
  return bits_float(sign | (0x7fc00000u & is_nan) | (finite & ~is_nan));
}

/// E5M2 bits -> float (exact): the upper byte of an IEEE binary16, widened as one.
KVC_HOST_DEVICE inline float e5m2_bits_to_float(std::uint8_t b) noexcept {
  return half_bits_to_float(static_cast<std::uint16_t>(static_cast<std::uint32_t>(b) << 8));
}

/// float -> 8-bit float bits with `E` exponent and `M` mantissa bits, round to nearest even, saturating to the largest
/// finite value `max_bits` (also for +-Inf); NaN becomes `nan_bits` (with the sign).
/// E4M3 (E = 4, M = 3) and E5M2 (E = 5, M = 2) only: the bound reads max_bits back with their decoders.
template <int E, int M>
KVC_HOST_DEVICE inline std::uint8_t float_to_fp8_bits(float f, std::uint8_t max_bits, std::uint8_t nan_bits) noexcept {
  static_assert((E == 4 && M == 3) || (E == 5 && M == 2), "kvc: float_to_fp8_bits encodes E4M3 and E5M2");
  std::uint32_t const x = float_bits(f);
  auto const sign = static_cast<std::uint8_t>((x >> 24) & 0x80u);
  std::uint32_t const mag = x & 0x7fffffffu;
  if (mag > 0x7f800000u)
    return static_cast<std::uint8_t>(sign | nan_bits);
  // What rounds to a larger magnitude than max_bits lies at or above max_bits' own value (its float bits compare
  // as magnitudes do).
  if (mag >= float_bits(E == 4 ? e4m3_bits_to_float(max_bits) : e5m2_bits_to_float(max_bits)))
    return static_cast<std::uint8_t>(sign | max_bits);
  return static_cast<std::uint8_t>(sign | rounded_magnitude<E, M>(mag));
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

/// OCP 8-bit float E4M3FN storage type (sign, 4 exponent bits with bias 7, 3 mantissa bits): largest finite 448,
/// subnormals m * 2^-9, no Inf, NaN 0x7F / 0xFF. 1 byte, trivially copyable.
struct float8_e4m3 {
  std::uint8_t bits = 0;

  float8_e4m3() = default;
  /// Rounds to nearest even, saturating to +-448 (also +-Inf); NaN becomes 0x7F (with the sign).
  KVC_HOST_DEVICE explicit float8_e4m3(float f) noexcept : bits(detail::float_to_fp8_bits<4, 3>(f, 0x7eu, 0x7fu)) {}
  KVC_HOST_DEVICE explicit operator float() const noexcept { return detail::e4m3_bits_to_float(bits); }
  KVC_HOST_DEVICE static float8_e4m3 from_bits(std::uint8_t b) noexcept {
    float8_e4m3 x;
    x.bits = b;
    return x;
  }
};

/// OCP 8-bit float E5M2 storage type (sign, 5 exponent bits with bias 15, 2 mantissa bits; the upper byte of a
/// binary16): largest finite 57344, subnormals m * 2^-16, Inf 0x7C / 0xFC, NaN where the exponent is 31 and m != 0.
struct float8_e5m2 {
  std::uint8_t bits = 0;

  float8_e5m2() = default;
  /// Rounds to nearest even, saturating to +-57344 (also +-Inf); NaN becomes 0x7E (quiet, with the sign).
  KVC_HOST_DEVICE explicit float8_e5m2(float f) noexcept : bits(detail::float_to_fp8_bits<5, 2>(f, 0x7bu, 0x7eu)) {}
  KVC_HOST_DEVICE explicit operator float() const noexcept { return detail::e5m2_bits_to_float(bits); }
  KVC_HOST_DEVICE static float8_e5m2 from_bits(std::uint8_t b) noexcept {
    float8_e5m2 x;
    x.bits = b;
    return x;
  }
};

static_assert(sizeof(half) == 2 && std::is_trivially_copyable_v<half>);
static_assert(sizeof(bfloat16) == 2 && std::is_trivially_copyable_v<bfloat16>);
static_assert(sizeof(float8_e4m3) == 1 && std::is_trivially_copyable_v<float8_e4m3>);
static_assert(sizeof(float8_e5m2) == 1 && std::is_trivially_copyable_v<float8_e5m2>);

/// Element types of queries and of unscaled caches (const-qualified for read-only views).
template <class T>
concept Element = std::is_same_v < std::remove_const_t<T>,
float > || std::is_same_v<std::remove_const_t<T>, half> || std::is_same_v<std::remove_const_t<T>, bfloat16>;

/// Whether T is one of the 8-bit floats (whose caches carry a scale: core/access.hpp).
template <class T>
inline constexpr bool is_fp8 =
    std::is_same_v<std::remove_const_t<T>, float8_e4m3> || std::is_same_v<std::remove_const_t<T>, float8_e5m2>;

/// Element types a cache's K or V view may hold: an Element, or an 8-bit float.
template <class T>
concept CacheElement = Element<T> || is_fp8<T>;

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
KVC_HOST_DEVICE inline float to_float(float8_e4m3 x) noexcept {
  return static_cast<float>(x);
}
KVC_HOST_DEVICE inline float to_float(float8_e5m2 x) noexcept {
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
