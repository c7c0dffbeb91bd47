// SPDX-License-Identifier: Apache-2.0
// kvc/core/rope.hpp: rotary position embedding (RoPE): the model's parameters and a precomputed cos/sin table.
//
// RoPE rotates pairs of channels of a query or key by angle p * inv_freq[i] at position p. Two pairings exist:
//   neox        (rotate-half; Hugging Face Llama/Qwen/Mistral): pair (i, i + r/2)
//   interleaved (GPT-J; llama.cpp "normal", llama2.c):          pair (2i, 2i + 1)
// with r = rotary_dim (channels past it are not rotated) and inv_freq[i] = theta^(-2i / r) unless a table of
// scaled frequencies (Llama 3, linear, YaRN) is supplied. Kernels never call pow/cos/sin: they read a RopeTable,
// filled once per (position, pair) on the host (fill_rope_table) and copied wherever the kernels run.
#pragma once

#include <kvc/core/backend.hpp>
#include <kvc/core/extents.hpp>
#include <kvc/core/status.hpp>

#include <cmath>
#include <cstdint>
#include <numbers>

namespace kvc {

enum class RopeStyle : std::uint8_t { neox, interleaved };

/// RoPE parameters of one model (host-side description; kernels read a RopeTable built from it).
struct RopeSpec {
  double theta = 10000.0;
  RopeStyle style = RopeStyle::neox;
  Index rotary_dim = 0;             ///< rotated channels (even); 0 = the whole head dim
  float const* inv_freq = nullptr;  ///< optional host [rotary_dim / 2] table overriding theta (scaled RoPE)
  double scaling = 1.0;             ///< multiplies cos and sin (YaRN's attention_scaling); 1 for Llama

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
    if (!(scaling > 0.0))
      return {Errc::invalid_argument, "RopeSpec: `scaling` must be > 0"};
    return {};
  }
};

/// Llama 3's scaled inverse frequencies (Hugging Face rope_type "llama3"): wavelengths longer than
/// original_max_position / low_freq_factor are divided by `factor`, shorter than .../high_freq_factor kept, and
/// those between interpolated. Writes [rotary_dim / 2] floats into `out` (host).
inline void llama3_inv_freq(double theta, Index rotary_dim, double factor, double low_freq_factor,
                            double high_freq_factor, double original_max_position, float* out) noexcept {
  double const low_wavelen = original_max_position / low_freq_factor;
  double const high_wavelen = original_max_position / high_freq_factor;
  for (Index i = 0; i < rotary_dim / 2; ++i) {
    double const f = std::pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(rotary_dim));
    double const wavelen = 2.0 * std::numbers::pi / f;
    double scaled = f;
    if (wavelen > low_wavelen) {
      scaled = f / factor;
    } else if (wavelen >= high_wavelen) {
      double const smooth = (original_max_position / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
      scaled = (1.0 - smooth) * f / factor + smooth * f;
    }
    out[i] = static_cast<float>(scaled);
  }
}

/// Precomputed RoPE for positions [0, positions): cos and sin are [positions, rotary_dim / 2] fp32 in memory space
/// `Space` (a host table handed to the CUDA backend is a compile-time error). Usable on host and device.
/// An empty table (cos == nullptr) means "no rotation": the rows it would apply to are already post-RoPE.
template <class Space = HostSpace>
struct RopeTable {
  using memory_space = Space;

  float const* cos = nullptr;
  float const* sin = nullptr;
  Index positions = 0;   ///< rows in the table
  Index rotary_dim = 0;  ///< rotated channels (even, <= head dim)
  RopeStyle style = RopeStyle::neox;

  KVC_HOST_DEVICE constexpr bool empty() const noexcept { return cos == nullptr; }

  /// Rotates `x` ([dim >= rotary_dim] floats, in place) by the angles of position `p` (0 <= p < positions): a
  /// pre-RoPE row becomes the row at position p. With `inverse`, undoes that rotation.
  KVC_HOST_DEVICE void rotate(float* x, Index p, bool inverse = false) const noexcept {
    Index const half = rotary_dim / 2;
    float const* c = cos + p * half;
    float const* s = sin + p * half;
    float const sign = inverse ? -1.0f : 1.0f;
    for (Index i = 0; i < half; ++i) {
      Index const a = style == RopeStyle::neox ? i : 2 * i;
      Index const b = style == RopeStyle::neox ? i + half : 2 * i + 1;
      float const xa = x[a], xb = x[b], si = sign * s[i];
      x[a] = xa * c[i] - xb * si;
      x[b] = xb * c[i] + xa * si;
    }
  }
};

/// Bytes of fp32 storage a table for `positions` positions needs (cos and sin, back to back).
constexpr Index rope_table_floats(Index positions, Index rotary_dim) noexcept {
  Index floats = 0;  // saturates rather than wrapping, so a hostile position count cannot size a small buffer
  return __builtin_mul_overflow(positions, 2 * (rotary_dim / 2), &floats) ? INT64_MAX : floats;
}

/// Fills a host table for positions [0, positions) from `spec`: angles p * inv_freq[i] in double, one cos and one
/// sin per (position, pair), times spec.scaling. `storage` holds rope_table_floats(positions, rotated) floats.
inline Status fill_rope_table(RopeSpec const& spec, Index dim, Index positions, float* storage,
                              RopeTable<HostSpace>& table) noexcept {
  KVC_RETURN_IF_ERROR(spec.check(dim));
  if (positions < 0 || (storage == nullptr && positions > 0))
    return {Errc::invalid_argument, "fill_rope_table: `positions` must be >= 0 and `storage` non-null"};
  Index const r = spec.rotated(dim), half = r / 2;
  float* c = storage;
  float* s = storage + positions * half;
  for (Index i = 0; i < half; ++i) {
    double const f = spec.frequency(i, dim);
    for (Index p = 0; p < positions; ++p) {
      double const angle = static_cast<double>(p) * f;
      c[p * half + i] = static_cast<float>(spec.scaling * std::cos(angle));
      s[p * half + i] = static_cast<float>(spec.scaling * std::sin(angle));
    }
  }
  table = {c, s, positions, r, spec.style};
  return {};
}

/// Checks a table against the rows it will rotate (head dim `dim`) and the largest position it must cover.
template <class Space>
Status check_rope_table(RopeTable<Space> const& t, Index dim, Index max_position) noexcept {
  if (t.empty())
    return {};
  if (t.sin == nullptr || t.rotary_dim <= 0 || t.rotary_dim % 2 != 0 || t.rotary_dim > dim)
    return {Errc::invalid_argument, "RopeTable: needs cos and sin, and an even `rotary_dim` in (0, head dim]"};
  if (max_position >= t.positions)
    return {Errc::invalid_argument, "RopeTable: a position to rotate is past the table's `positions` rows"};
  return {};
}

}  // namespace kvc
