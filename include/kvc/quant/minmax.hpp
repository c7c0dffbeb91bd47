// SPDX-License-Identifier: Apache-2.0
// kvc/quant/minmax.hpp: uniform asymmetric min-max quantisation of one group of values at 2, 4 or 8 bits
// (docs/policies/rdkv.md): the KIVI float-min offset (default; github.com/jy-yuan/KIVI, quant/new_pack.py) and the
// RDKV reference's integer zero-point (github.com/Junkai1860/RDKV, obkv_accel/packing.py).
//
// Host and device (no Eigen, no exceptions, no allocation). Parameters are stored as FP16 and rounded to half
// *before* any code is computed, so quantize() and dequantize() use exactly the stored scale and offset: a value
// dequantised on the CPU and on a CUDA device is bit-identical, and the round trip is bounded by the stored
// parameters alone.
//
// Rounding of codes is round-half-to-even (torch.round, Python round), computed by hand so that it does not depend
// on the floating-point environment. Codes come from one IEEE division (never a reciprocal multiply), so the
// host and nvcc (without --use_fast_math) agree code for code.
//
// Dequantisation is reproducible under FMA contraction too: code * scale has at most 8 + 11 significant bits,
// so the product is exact in float and `code * a + c` rounds once whether or not it is fused.
//
// Round-trip bound (tested), with s = the float scale before rounding, s_h = half(s), and for float_min
// mn = the group minimum, o_h = half(mn):
//   float_min:                        |x - x̂| <= max(s, s_h) / 2 + |mn - o_h| + (2^b - 1) |s - s_h|
//   integer, zero-straddling groups:  |x - x̂| <= max(s, s_h) / 2 + (2^b - 1) |s - s_h|
// i.e. s/2 plus the FP16 rounding of the offset and of the scale times the largest code (plus float rounding).
// Groups that exclude 0 break the integer mode (the reference's clipping quirk): zp is clamped to
// [0, 2^b - 1] before use, so a 2-bit group in [10, 11] reconstructs as ~1.
//
// Values must fit FP16 (|x| <= 65504 and range / (2^b - 1) <= 65504); NaN/Inf input is the caller's problem
// (the packer validates): it never causes undefined behaviour here, a NaN quantises to code 0.
#pragma once

#include <kvc/config.hpp>
#include <kvc/core/access.hpp>
#include <kvc/core/element.hpp>
#include <kvc/core/extents.hpp>

#include <cstdint>

namespace kvc {

/// How the offset of a group is stored.
///   float_min (KIVI, the default arithmetic): x̂ = q * scale + offset, offset = half(min).
///   integer (RDKV reference, `reference=authors`): x̂ = (q - offset) * scale with an integer zero-point
///   offset in [0, 2^b - 1] (clamped, hence the clipping quirk on groups that exclude 0).
enum class ZeroPoint : std::uint8_t { float_min, integer };

/// One group's parameters, stored as FP16. float_min: x̂ = q * scale + offset; integer: x̂ = (q - offset) * scale
/// (offset holds the integer zero-point exactly). Zero-initialised params (scale = offset = 0) dequantise every
/// code to 0 in both modes: that is how pad columns are stored.
struct QuantParams {
  half scale;
  half offset;
};

namespace detail {

/// Largest code at `bits` bits, as float (2^b - 1).
KVC_HOST_DEVICE inline float quant_max_code(int bits) noexcept {
  return static_cast<float>((1u << static_cast<unsigned>(bits)) - 1u);
}

/// Clamp to [0, qmax] then round half to even, as a code. NaN clamps to 0 (no undefined conversion).
KVC_HOST_DEVICE inline std::uint8_t quant_round_code(float v, float qmax) noexcept {
  v = v > 0.0f ? v : 0.0f;  // NaN fails the comparison: 0
  v = v < qmax ? v : qmax;
  auto const f = static_cast<std::uint32_t>(v);  // v >= 0: truncation is floor
  float const r = v - static_cast<float>(f);     // exact: Sterbenz for v >= 1, r = v below 1
  // Branch-free (random data mispredicts a branch on r half the time): +1 above the half, +1 at it when f is odd.
  std::uint32_t const q = f + static_cast<std::uint32_t>(r > 0.5f) + (static_cast<std::uint32_t>(r == 0.5f) & f);
  return static_cast<std::uint8_t>(q);  // q <= qmax <= 255: qmax is an integer, rounding never passes it
}

/// quantize() with the parameters already widened to float (s = scale, o = offset) and qmax = 2^b - 1: loops over
/// many values of one group widen the FP16 parameters once.
KVC_HOST_DEVICE inline std::uint8_t quantize_widened(float x, float s, float o, float qmax,
                                                     ZeroPoint zero_point) noexcept {
  if (zero_point == ZeroPoint::float_min)
    return s == 0.0f ? std::uint8_t{0} : quant_round_code((x - o) / s, qmax);
  return s == 0.0f ? quant_round_code(o, qmax) : quant_round_code(x / s + o, qmax);
}

/// Codes of x[0, n) with per-value widened parameters s[i], o[i] (what quantize_widened computes for each), written
/// to out[0, n). The zero-point branch is hoisted and the body is branch-free (a zero scale divides by 1 and is then
/// selected away), so the loop vectorises: the packer quantises whole rows with it.
KVC_HOST_DEVICE inline void quantize_row(float const* x, float const* s, float const* o, Index n, float qmax,
                                         ZeroPoint zero_point, std::uint8_t* out) noexcept {
  if (zero_point == ZeroPoint::float_min) {
    for (Index i = 0; i < n; ++i) {
      float const si = s[i] != 0.0f ? s[i] : 1.0f;
      float const v = s[i] != 0.0f ? (x[i] - o[i]) / si : 0.0f;
      out[i] = quant_round_code(v, qmax);
    }
  } else {
    for (Index i = 0; i < n; ++i) {
      float const si = s[i] != 0.0f ? s[i] : 1.0f;
      float const v = s[i] != 0.0f ? x[i] / si + o[i] : o[i];
      out[i] = quant_round_code(v, qmax);
    }
  }
}

}  // namespace detail

/// Parameters of a group whose smallest and largest values are `mn` <= `mx`, by the rules of minmax_params below
/// (which scans the values, then calls this; a caller that has the range already, e.g. per channel over many rows
/// at once, calls it directly).
KVC_HOST_DEVICE inline QuantParams range_params(float mn, float mx, int bits, ZeroPoint zero_point) noexcept {
  QuantParams p{};
  float const qmax = detail::quant_max_code(bits);
  float const s = (mx - mn) / qmax;
  if (zero_point == ZeroPoint::float_min) {
    p.scale = half(s);
    p.offset = half(mn);
  } else {
    float const si = s > 1e-8f ? s : 1e-8f;
    p.scale = half(si);
    p.offset = half(static_cast<float>(detail::quant_round_code(-mn / si, qmax)));
  }
  return p;
}

/// Parameters of one group: `count` values load(x[0], scale), load(x[stride], scale), ... (T = float, half, bfloat16
/// or fp8 under its view's scale, core/access.hpp; stride in elements, may be any non-zero value), bits in {2, 4, 8}.
///   float_min: scale = half((max - min) / (2^b - 1)), offset = half(min). max == min gives scale 0 and x̂ = offset
///              = half(min): exact when min is representable in FP16.
///   integer:   s = max((max - min) / (2^b - 1), 1e-8), scale = half(s), offset = zp =
///              round_half_even(clamp(-min / s, 0, 2^b - 1)) (computed from the float s, as the reference does).
///              1e-8 rounds to 0 in FP16, so a constant group gets scale 0 and dequantises to 0 (the reference
///              reconstructs it as 3e-8 * ... ~ 0 too).
/// count <= 0 gives zero params (dequantise to 0).
template <class T, class S = Unit>
KVC_HOST_DEVICE inline QuantParams minmax_params(T const* x, Index count, Index stride, int bits, ZeroPoint zero_point,
                                                 S scale = {}) noexcept {
  if (count <= 0)
    return QuantParams{};
  float mn = load(x[0], scale);
  float mx = mn;
  for (Index i = 1; i < count; ++i) {
    float const v = load(x[i * stride], scale);
    mn = v < mn ? v : mn;
    mx = v > mx ? v : mx;
  }
  return range_params(mn, mx, bits, zero_point);
}

/// Code of x in [0, 2^b - 1] with the stored (FP16) parameters, bits in {2, 4, 8}.
///   float_min: q = round(clamp((x - offset) / scale, 0, 2^b - 1)); scale 0 gives q = 0 (x̂ = offset).
///   integer:   q = round(clamp(x / scale + zp, 0, 2^b - 1)); scale 0 gives q = zp (x̂ = 0).
/// round = half to even.
KVC_HOST_DEVICE inline std::uint8_t quantize(float x, QuantParams p, int bits, ZeroPoint zero_point) noexcept {
  return detail::quantize_widened(x, static_cast<float>(p.scale), static_cast<float>(p.offset),
                                  detail::quant_max_code(bits), zero_point);
}

/// Value of a code: float_min q * scale + offset; integer (q - zp) * scale. Exact products (see the file comment),
/// so it equals affine(p, zero_point) applied to the code bit for bit.
KVC_HOST_DEVICE inline float dequantize(std::uint8_t code, QuantParams p, ZeroPoint zero_point) noexcept {
  float const s = static_cast<float>(p.scale);
  float const o = static_cast<float>(p.offset);
  float const q = static_cast<float>(code);
  return zero_point == ZeroPoint::float_min ? q * s + o : (q - o) * s;
}

/// Affine form of dequantisation for fused kernels: x̂ = code * a + c. float_min: a = scale, c = offset;
/// integer: a = scale, c = -zp * scale. `code * a + c` equals dequantize(code) exactly in float, fused or not:
/// code * a and zp * scale are exact (<= 19 significant bits) and so is (code - zp) * scale.
struct Affine {
  float a;
  float c;
};

KVC_HOST_DEVICE inline Affine affine(QuantParams p, ZeroPoint zero_point) noexcept {
  float const s = static_cast<float>(p.scale);
  float const o = static_cast<float>(p.offset);
  return zero_point == ZeroPoint::float_min ? Affine{s, o} : Affine{s, -(o * s)};
}

}  // namespace kvc
