// SPDX-License-Identifier: Apache-2.0
// kvc/core/rope.hpp: rotary position embedding (RoPE) description and application to one row.
//
// RoPE rotates pairs of channels of a query or key by angle p * inv_freq[i] at position p. Two pairings exist:
//   neox        (rotate-half; Hugging Face Llama/Qwen/Mistral): pair (i, i + r/2)
//   interleaved (GPT-J; llama.cpp "normal", llama2.c):          pair (2i, 2i + 1)
// with r = rotary_dim (channels past it are not rotated) and inv_freq[i] = theta^(-2i / r) unless a table of
// scaled frequencies (YaRN, llama3, linear) is supplied. Used to rotate window queries, average RoPE over future
// positions (ExpectedAttention) and re-rotate kept keys onto cache positions (StreamingLLM paper mode).
#pragma once

#include <kvc/core/extents.hpp>
#include <kvc/core/status.hpp>

#include <cmath>
#include <cstdint>

namespace kvc {

enum class RopeStyle : std::uint8_t { neox, interleaved };

/// RoPE parameters of one model.
struct RopeSpec {
  double theta = 10000.0;
  RopeStyle style = RopeStyle::neox;
  Index rotary_dim = 0;             ///< rotated channels (even); 0 = the whole head dim
  float const* inv_freq = nullptr;  ///< optional [rotary_dim / 2] table overriding theta (scaled RoPE)

  constexpr Index rotated(Index dim) const noexcept { return rotary_dim > 0 ? rotary_dim : dim; }
  /// Frequency of pair i (radians per position), in double.
  double frequency(Index i, Index dim) const noexcept {
    return inv_freq ? double{inv_freq[i]}
                    : std::pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(rotated(dim)));
  }
  Status check(Index dim) const noexcept {
    Index const r = rotated(dim);
    if (r <= 0 || r > dim || r % 2 != 0)
      return {Errc::invalid_argument, "RopeSpec: `rotary_dim` must be even and in (0, head dim]"};
    if (!inv_freq && !(theta > 1.0))
      return {Errc::invalid_argument, "RopeSpec: `theta` must be > 1"};
    return {};
  }
};

/// Rotates `x` ([dim] floats, in place) by `delta` positions: applying it with delta = p to a pre-RoPE row
/// gives the row at position p; with delta = new - old it moves an already rotated row (rotations of one pair
/// commute, so R_new R_old^-1 = R_(new-old)). Angles are computed in double, then applied in fp32.
inline void rope_rotate(RopeSpec const& spec, float* x, Index dim, double delta) noexcept {
  Index const half = spec.rotated(dim) / 2;
  for (Index i = 0; i < half; ++i) {
    double const angle = delta * spec.frequency(i, dim);
    auto const c = static_cast<float>(std::cos(angle)), s = static_cast<float>(std::sin(angle));
    Index const a = spec.style == RopeStyle::neox ? i : 2 * i;
    Index const b = spec.style == RopeStyle::neox ? i + half : 2 * i + 1;
    float const xa = x[a], xb = x[b];
    x[a] = xa * c - xb * s;
    x[b] = xb * c + xa * s;
  }
}

}  // namespace kvc
