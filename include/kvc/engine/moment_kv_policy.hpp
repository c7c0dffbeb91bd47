// SPDX-License-Identifier: Apache-2.0
// kvc/engine/moment_kv_policy.hpp: MomentKV (Li, Li, Lan, arXiv 2606.01563; docs/policies/moment_kv.md) as one
// policy object: its MI scorer (the SnapKV-style base, prefill rounds, clamp, MI), the correction's order, how the
// engine runs it (correction, eviction while decoding, the moments' storage, the u_j cache) and the tokens the
// selection protects, each parameter declared once (core/params.hpp). The tools build their scorer, corrected
// attention and selection from it; a Python press will take the same names.
#pragma once

#include <kvc/attention/corrected.hpp>
#include <kvc/core/extents.hpp>
#include <kvc/core/params.hpp>
#include <kvc/core/status.hpp>
#include <kvc/scorers/moment_kv.hpp>
#include <kvc/scorers/moments.hpp>
#include <kvc/scorers/snap_kv.hpp>

#include <cstdint>
#include <string_view>
#include <tuple>

namespace kvc {

/// The element type the moments are stored in: fp32, or the paper's 16-bit setting (fp16, bf16).
enum class MomentStorage : std::uint8_t { fp32, fp16, bf16 };

/// MomentKV as one policy. `scorer` holds the base score and the eviction's options (its moments, residual cache and
/// fixed base are per layer: the engine points them at its own); the corrected attention is attention().
struct MomentKVPolicy {
  static constexpr std::string_view name = "moment_kv";

  MomentKVScorer<> scorer{};               ///< base (window_size, kernel_size, pooling), prefill_rounds, clamp_tau, mi
  MomentOrder order = MomentOrder::first;  ///< the correction's estimate: first (the paper's) or zeroth (ablation)
  bool correction = true;                  ///< attend with the correction (false: plain attention)
  bool decode_evict = true;                ///< Algorithm 1 while decoding: one eviction per step per head over budget
  MomentStorage storage = MomentStorage::fp32;
  Index residual_refresh = 0;  ///< 0: C k_j recomputed every score; k > 0: u_j = C k_j cached, redone every k evictions
  Index n_sink = 1;            ///< first tokens the selection always keeps (the sink)
  Index n_recent = 32;         ///< last tokens the selection always keeps (the observation window)

  /// The corrected attention: the scorer's clamp and `order` (its scale is the model's).
  constexpr CorrectedAttention attention() const noexcept { return {{}, scorer.clamp_tau, order}; }

  /// The parameters the tools expose (core/params.hpp). pooling=none (the tools' spelling of kernel_size=1) is
  /// theirs: a kernel of one pools nothing whatever the pooling.
  static constexpr auto parameters() noexcept {
    using P = MomentKVPolicy;
    using S = MomentKVScorer<>;
    constexpr auto base = [](auto const& p) { return nested(&P::scorer, nested(&S::base, p)); };
    return std::tuple{
        base(number_param("window_size", &SnapKVScorer::window_size, 1, max_param_index,
                          "w: the last w rows of --queries give the base score; the window is protected")),
        base(number_param("kernel_size", &SnapKVScorer::kernel_size, 1, max_param_index,
                          "pooling size of the base score (chunk_mean: the paper's chunks of 4)")),
        base(named_param("pooling", &SnapKVScorer::pooling,
                         {{"chunk_mean", Pooling::chunk_mean}, {"max", Pooling::max}},
                         "chunk_mean (aligned chunks), max (Ada-KV: use kernel_size=7) or none (kernel_size=1)")),
        nested(&P::scorer, number_param("prefill_rounds", &S::prefill_rounds, 1, max_param_index,
                                        "rounds of the prefill eviction: 1 = one shot, N - L = exact greedy")),
        nested(&P::scorer, number_param("clamp_tau", &S::clamp_tau, 0, 1e30,
                                        "entries of the co-moment below tau in magnitude read as 0 (paper App. C.2)")),
        named_param("order", &P::order, {{"first", MomentOrder::first}, {"zeroth", MomentOrder::zeroth}},
                    "first (f_E = v_mean + c/n C q) or zeroth (f_E = v_mean; the ablation)"),
        nested(&P::scorer,
               flag_param("mi", &S::mi,
                          "true: moment-informed eviction; false: the base score alone (the NC-only ablation)")),
        flag_param("correction", &P::correction,
                   "true: attention corrected by the moments (kvc-eval, kvc attend); false: plain"),
        named_param("storage", &P::storage,
                    {{"fp32", MomentStorage::fp32}, {"fp16", MomentStorage::fp16}, {"bf16", MomentStorage::bf16}},
                    "moments stored as fp32, fp16 or bf16 (the paper's 16-bit setting)"),
        flag_param("decode_evict", &P::decode_evict,
                   "true: Algorithm 1 while decoding (one eviction per step per head over budget)"),
        number_param("residual_refresh", &P::residual_refresh, 0, max_param_index,
                     "0: recompute C k_j every score; k > 0: cache u_j = C k_j, recomputed every k evictions"),
        number_param("n_sink", &P::n_sink, 0, max_param_index, "first tokens always kept (the sink)"),
        number_param("n_recent", &P::n_recent, 0, max_param_index, "last tokens always kept (the observation window)")};
  }

  constexpr Status check() const noexcept {
    if (scorer.base.pooling == Pooling::max && scorer.base.kernel_size % 2 == 0)
      return {Errc::invalid_argument, "MomentKVPolicy: pooling=max needs an odd kernel_size (chunk_mean takes any)"};
    if (residual_refresh < 0 || n_sink < 0 || n_recent < 0)
      return {Errc::invalid_argument, "MomentKVPolicy: `residual_refresh`, `n_sink` and `n_recent` must be >= 0"};
    return scorer.check();
  }
};

}  // namespace kvc
