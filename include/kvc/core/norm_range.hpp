// SPDX-License-Identifier: Apache-2.0
// kvc/core/norm_range.hpp: the range guards of the fp32 norms (Knorm, KeyDiff) and of softmax logits, one definition
// for every backend.
#pragma once

#include <kvc/config.hpp>

#include <cfloat>
#include <cmath>

namespace kvc::detail {

/// Range guard of the fp32 norms (Knorm, KeyDiff; CPU and CUDA). An fp32 sum of squares in [2^-90, FLT_MAX] is
/// trusted: above, it overflowed (|x| past about 1.8e19 / sqrt(dim)); below (a zero row too), squares that
/// underflowed to subnormals or zero could be a visible share of it (each loses under 2^-126 even with
/// flush-to-zero: at most d * 2^-36 of the sum). Rows outside it, never ordinary keys, take the fp64 path: every
/// finite fp32 square lies within [2^-298, 2^256], so fp64 sums them exactly in range without scaling.
KVC_HOST_DEVICE constexpr bool sum_squares_in_range(float sq) noexcept {
  return sq >= 0x1p-90f && sq <= FLT_MAX;
}

/// The same range for a norm sqrtf(sq): [2^-45, 2^64] (sqrtf(FLT_MAX) is just below 2^64). With a correctly
/// rounded sqrtf (IEEE; CUDA without -use_fast_math), norm_in_range(sqrtf(sq)) == sum_squares_in_range(sq) for
/// every sq >= 0 (checked for every float): for a norm stashed where its sum is gone (KeyDiff's second pass).
KVC_HOST_DEVICE constexpr bool norm_in_range(float norm) noexcept {
  return norm >= 0x1p-45f && norm <= 0x1p64f;
}

/// Whether x is finite: |x| <= FLT_MAX is false for NaN and +-Inf (one compare, and it vectorises). Host and device.
KVC_HOST_DEVICE inline bool is_finite_value(float x) noexcept {
  return fabsf(x) <= FLT_MAX;
}

/// A logit as the softmaxes take it: x when finite, -inf (a masked slot: probability 0) when NaN or +-Inf, i.e. when
/// its key has a NaN or Inf element (docs/api_checks.md, "Non-finite keys"). Host and device (ExpectedAttention,
/// RDKV's derived weights, CUDA's slot_logit).
KVC_HOST_DEVICE inline float finite_logit(float x) noexcept {
  return is_finite_value(x) ? x : -__builtin_huge_valf();
}

}  // namespace kvc::detail
