// SPDX-License-Identifier: Apache-2.0
// kvc/selectors/pyramid_kv.hpp: PyramidKV's per-layer budget schedule (Cai et al., arXiv 2406.02069) as a Budget,
// so TopKSelector (uniform heads) and AdaKVSelector (adaptive heads inside each layer) both take it unchanged.
// Code: Zefan-Cai/PyramidKV pyramidkv/pyramidkv_utils.py (PyramidKVCluster: the authors' integer schedule and three
// branches) and NVIDIA/kvpress kvpress/presses/pyramidkv_press.py; docs/policies/pyramid_kv.md.
#pragma once

#include <kvc/core/allocator.hpp>
#include <kvc/core/budget.hpp>
#include <kvc/core/params.hpp>
#include <kvc/core/scorer.hpp>
#include <kvc/scorers/reference.hpp>

#include <tuple>

namespace kvc {

/// Tokens layer `layer` of `num_layers` keeps per head (window included), from the head's valid length n.
///  - authors: C = max_capacity_prompt (or floor(n·(1 − compression_ratio)) when it is 0), B = C − w;
///    n < C: keep n; C ≤ n < 2B: keep C (uniform); otherwise min = B // β, max = 2B − min (clamped to n − w, with
///    min = 2B − max), steps = (max − min) // (L − 1), keep max − layer·steps + w. Lower layers keep more; the mean
///    over layers is ≥ C by less than (L − 1)/2.
///  - kvpress: cap = w + n(1 − r), min = (cap − w)/β, max = 2(cap − w) − min in floating point, the same clamp;
///    unless n ≥ max ≥ min ≥ w every layer keeps round(n(1 − r)); otherwise round(max − layer·(max − min)/(L − 1))
///    (window included, round half to even). The mean over layers is n(1 − r).
struct PyramidKVBudget {
  Index layer = 0;                           ///< this layer, in [0, num_layers)
  Index num_layers = 1;                      ///< L
  Index window_size = 8;                     ///< w (authors' scripts 8; kvpress 64)
  Index beta = 20;                           ///< β
  Reference reference = Reference::authors;  ///< authors: integer schedule; kvpress: float schedule
  Index max_capacity_prompt = 0;             ///< authors' C (window included); 0: from compression_ratio
  double compression_ratio = 0.0;            ///< fraction removed (kvpress; authors when C = 0)

  KVC_HOST_DEVICE constexpr Index keep(Index, Index, Index n) const noexcept {
    Index const w = window_size, steps_den = num_layers > 1 ? num_layers - 1 : 1;
    if (reference == Reference::kvpress) {
      double const kept = static_cast<double>(n) * (1.0 - compression_ratio);
      double const span = kept;  // cap − w
      double lo = span / static_cast<double>(beta), hi = 2.0 * span - lo;
      if (hi >= static_cast<double>(n - w)) {
        hi = static_cast<double>(n - w);
        lo = 2.0 * span - hi;
      }
      if (!(static_cast<double>(n) >= hi && hi >= lo && lo >= static_cast<double>(w)))
        return detail::round_half_even(kept);
      double const step = (hi - lo) / static_cast<double>(steps_den);
      double const k = hi - static_cast<double>(layer) * step;
      return detail::round_half_even(k < 0.0 ? 0.0 : k);
    }
    Index const c = max_capacity_prompt > 0 ? max_capacity_prompt
                                            : static_cast<Index>(static_cast<double>(n) * (1.0 - compression_ratio));
    Index const b = c - w;
    if (n < c)
      return n;
    if (n < 2 * b || b <= 0)
      return c;
    Index lo = b / beta, hi = 2 * b - lo;
    if (hi >= n - w) {
      hi = n - w;
      lo = 2 * b - hi;
    }
    Index const steps = (hi - lo) / steps_den;
    return hi - layer * steps + w;
  }
  /// The budget of a decode-time compression to `target` tokens per head (kvc::LayerCompressor's decode): the
  /// authors' schedule with C = target (kvpress's schedule reads a ratio, which a decode target does not give).
  constexpr PyramidKVBudget decode_budget(Index target) const noexcept {
    PyramidKVBudget b = *this;
    b.reference = Reference::authors;
    b.max_capacity_prompt = target;
    b.compression_ratio = 0.0;
    return b;
  }
  constexpr Status check() const noexcept {
    if (num_layers < 1 || layer < 0 || layer >= num_layers)
      return {Errc::invalid_argument, "PyramidKVBudget: need num_layers >= 1 and layer in [0, num_layers)"};
    if (window_size < 0 || beta < 1 || max_capacity_prompt < 0)
      return {Errc::invalid_argument,
              "PyramidKVBudget: `window_size` and `max_capacity_prompt` must be >= 0, `beta` >= 1"};
    if (!(compression_ratio >= 0.0 && compression_ratio <= 1.0))
      return {Errc::invalid_argument, "PyramidKVBudget: `compression_ratio` (fraction removed) must be in [0, 1]"};
    if (reference == Reference::kvpress && max_capacity_prompt > 0)
      return {Errc::invalid_argument, "PyramidKVBudget: kvpress's schedule reads `compression_ratio`, not a capacity"};
    return {};
  }

  /// kvpress's PyramidKVPress: its float schedule, a window of 64.
  static constexpr PyramidKVBudget kvpress() noexcept {
    PyramidKVBudget b;
    b.reference = Reference::kvpress;
    b.window_size = 64;
    return b;
  }

  /// The parameters the tools expose (core/params.hpp); the budget itself (capacity or ratio) is the caller's.
  static constexpr auto parameters() noexcept {
    using P = PyramidKVBudget;
    return std::tuple{
        named_param("reference", &P::reference, reference_names,
                    "authors (integer schedule from the capacity C, no compression below C, uniform below 2(C - w)) "
                    "or kvpress (PyramidKVPress: float schedule from the ratio, uniform fallback)"),
        number_param("window_size", &P::window_size, 0, max_param_index,
                     "w: the window kept on top of each layer's prefix budget (shared with snap_kv's)"),
        number_param("beta", &P::beta, 1, max_param_index,
                     "beta: the last layer keeps about 1/beta of the mean prefix budget"),
        number_param("layer", &P::layer, 0, max_param_index,
                     "this layer's index (set per layer by --dump and kvc-eval)"),
        number_param("num_layers", &P::num_layers, 1, max_param_index,
                     "the model's layer count (set by --dump and kvc-eval)")};
  }
};

}  // namespace kvc
