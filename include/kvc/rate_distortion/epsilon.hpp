// SPDX-License-Identifier: Apache-2.0
// kvc/rate_distortion/epsilon.hpp: RDKV's rate-distortion model, a normalised distortion per bit width (the
// authors' calibrate_epsilon.py and their results/epsilon_calibration_llama31_8b.json, github.com/Junkai1860/RDKV
// @287a4a5; docs/policies/rdkv.md). Host and device, no allocation.
//
// A unit (a V token, a K channel) quantised at b bits costs D_u(b) = w_u · eps(b), with eps(b) = E(x − x̂)² / Var(x)
// measured offline (calibrate_epsilon.py) and two sentinels: eps(0) = 1 (evicted: the whole signal is lost) and
// eps(16) = 0 (kept in FP16). The solvers of rate_distortion/knapsack.hpp only ever pick options on the lower convex
// hull of the points (b, eps(b)): an option above the hull is never the minimum of w·eps(b) + λ·b for any λ,
// and the exact solver's increments are the hull's edges.
#pragma once

#include <kvc/core/status.hpp>

#include <cstdint>

namespace kvc {

/// Bit widths a unit may get, in this order: 0 (evicted / channel pruned), 2, 4, 8, 16 (FP16, lossless).
inline constexpr int kBitOptions = 5;
inline constexpr std::int8_t kBits[kBitOptions] = {0, 2, 4, 8, 16};

/// Index of bit width `b` in kBits, or -1 when b is not one of {0, 2, 4, 8, 16}.
KVC_HOST_DEVICE constexpr int bit_option_index(int b) noexcept {
  switch (b) {
    case 0: return 0;
    case 2: return 1;
    case 4: return 2;
    case 8: return 3;
    case 16: return 4;
    default: return -1;
  }
}

/// Normalised MSE eps(b) = E(x - x̂)² / Var(x) per option [0, 2, 4, 8, 16] (double). Valid: eps[0] = 1, eps[4] = 0,
/// strictly decreasing, finite. `hull` marks the options on the lower convex hull of (b, eps(b)) (0 and 16 always
/// are); a solver never picks an option off the hull. Per-layer tables (eps_mode = per_layer) are one
/// EpsilonTable per layer, chosen by the caller.
struct EpsilonTable {
  double eps[kBitOptions] = {1.0, 0.312, 0.0138, 4.8e-5, 0.0};

  /// Names the first bad entry: eps[0] must be exactly 1, eps[4] exactly 0, every entry finite and each one
  /// strictly below the previous. A non-convex table is valid (its off-hull options are simply never used).
  constexpr Status check() const noexcept {
    if (!(eps[0] == 1.0))
      return {Errc::invalid_argument, "EpsilonTable: `eps[0]` (0 bits, evicted) must be exactly 1"};
    if (!(eps[4] == 0.0))
      return {Errc::invalid_argument, "EpsilonTable: `eps[4]` (16 bits, FP16) must be exactly 0"};
    // NaN fails every comparison, so `!(x < previous)` also rejects it; eps[0] = 1 bounds them above.
    if (!(eps[1] < eps[0]) || !(eps[1] > 0.0))
      return {Errc::invalid_argument, "EpsilonTable: `eps[1]` (2 bits) must be in (0, eps[0])"};
    if (!(eps[2] < eps[1]) || !(eps[2] > 0.0))
      return {Errc::invalid_argument, "EpsilonTable: `eps[2]` (4 bits) must be in (0, eps[1])"};
    if (!(eps[3] < eps[2]) || !(eps[3] > 0.0))
      return {Errc::invalid_argument, "EpsilonTable: `eps[3]` (8 bits) must be in (0, eps[2])"};
    return {};
  }

  /// on_hull[i] = option i lies on the lower convex hull of the points (kBits[i], eps[i]), i in [0, 5). A point on
  /// an edge of the hull (collinear with its neighbours) counts as on it: the Lagrangian's tie rule (fewer bits)
  /// never picks it alone, but the exact solver may stop there. Meaningful for tables that pass check().
  constexpr void hull(bool on_hull[kBitOptions]) const noexcept {
    int stack[kBitOptions] = {};
    int const count = hull_of(0, stack);
    for (int i = 0; i < kBitOptions; ++i)
      on_hull[i] = false;
    for (int i = 0; i < count; ++i)
      on_hull[stack[i]] = true;
  }

  /// The hull over the options [first, 5) (first = 1 drops option 0, BitOptions{.evict = false}): writes the hull's
  /// option indices into `out` in increasing bits and returns their count (>= 1; the last is always 16 bits).
  /// Andrew's monotone chain; a point is dropped only when it lies strictly above the chord of its neighbours.
  constexpr int hull_of(int first, int out[kBitOptions]) const noexcept {
    int count = 0;
    for (int i = first; i < kBitOptions; ++i) {
      while (count >= 2) {
        int const a = out[count - 2], m = out[count - 1];
        double const ba = kBits[a], bm = kBits[m], bi = kBits[i];
        // m strictly above the chord a -> i: (eps_m - eps_a)(b_i - b_a) > (eps_i - eps_a)(b_m - b_a).
        if ((eps[m] - eps[a]) * (bi - ba) > (eps[i] - eps[a]) * (bm - ba))
          --count;
        else
          break;
      }
      out[count++] = i;
    }
    return count;
  }

  /// Built-in DEFAULT_EPSILON_V of knapsack_solver.py {1, .312, .0138, 4.8e-5, 0}.
  static constexpr EpsilonTable default_v() noexcept { return {{1.0, 0.312, 0.0138, 4.8e-5, 0.0}}; }
  /// Built-in DEFAULT_EPSILON_K {1, .277, .011, 6.1e-5, 0}.
  static constexpr EpsilonTable default_k() noexcept { return {{1.0, 0.277, 0.011, 6.1e-5, 0.0}}; }
  /// Llama-3.1-8B-Instruct calibration (results/epsilon_calibration_llama31_8b.json), V_mean.
  static constexpr EpsilonTable llama31_v() noexcept { return {{1.0, 0.31287, 0.013986, 4.8554e-5, 0.0}}; }
  /// Llama-3.1-8B-Instruct calibration, K_per_channel_mean.
  static constexpr EpsilonTable llama31_k() noexcept { return {{1.0, 0.14894, 0.0062426, 2.1757e-5, 0.0}}; }
};

/// Options a solver may use: `evict` false drops option 0 (the quant-only ablation, the authors'
/// `--no-prepend-zero`): every unit then gets at least 2 bits, also a unit of weight 0.
struct BitOptions {
  bool evict = true;
};

}  // namespace kvc
