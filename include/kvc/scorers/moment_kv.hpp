// SPDX-License-Identifier: Apache-2.0
// kvc/scorers/moment_kv.hpp: MomentKV's moment-informed (MI) eviction score (Li, Li, Lan, "MomentKV: Closing the
// Directional Gap in KV Cache Eviction for Long-Context Inference", arXiv 2606.01563: §4.2,
// Eq. 10, Algorithm 1, the §5.1 prefill protocol; decisions A1–A18: docs/policies/moment_kv.md#decisions).
//
// For retained slot j of KV head (b, h), with the moments (n, k̄, v̄, C) of the head's evicted set (scorers/moments.hpp)
// and the logit scale c:
//   r_j     = v_j − v̄ − (c / n) C̃ k_j          (the evicted-output model f̂_E evaluated at the token's own key;
//                                              n = 0: r_j = v_j; C̃ = C with entries |x| < clamp_tau zeroed)
//   s[j]    = α_j · ‖r_j‖₂                      (low = explained by the summary = evicted first; higher = keep)
// α_j is the base score, SnapKV's window attention (scorers/snap_kv.hpp, its shared kernel):
//   - prefill (paper §5.1): the last w = 32 prompt queries, pooled over aligned chunks of 4 (Pooling::chunk_mean, the
//     paper's "chunks of size 4"; Pooling::max with kernel 7 is Ada-KV's, kernel_size 1 is none), group mean (A3);
//   - decode (Algorithm 1): the current query's softmax over the retained slots, group mean: the same kernel with a
//     one-row window and kernel_size 1 (MomentKVScorer::decode()).
// The score is pure: the moments change only through kvc::on_evict, which folds the plan's complement (the evicted
// slots of each head) into them before kvc::compact moves the cache (one GEMM of the centred evicted rows, then
// Chan's merge). kvc::update is a no-op (the moments hold evicted tokens only).
//
// Protected tokens are the selector's (A5): the sink (n_sink = 1) and the observation window (n_recent = w);
// give the MI score to a TopKSelector or AdaKVSelector with them. Budgets count everything kept, protected included.
// `fixed_base`, when set, replaces the window attention by a frozen per-slot base score (the prefill rounds of
// pipeline/moment_kv.hpp, A1).
#pragma once

#include <kvc/core/budget.hpp>
#include <kvc/core/kv_view.hpp>
#include <kvc/core/scorer.hpp>
#include <kvc/core/status.hpp>
#include <kvc/scorers/moments.hpp>
#include <kvc/scorers/reference.hpp>
#include <kvc/scorers/snap_kv.hpp>

#include <cmath>
#include <string_view>

namespace kvc {

/// The optional cache of u_j = C k_j per retained slot (kvc's extension): with it, an eviction updates every u_j in
/// O(d) (u_j += (n_a / (n_a + 1)) (v* − v̄_a) ((k* − k̄_a)ᵀ k_j), Chan's rank-1 term applied to k_j) and the MI score
/// costs O(L d) instead of O(L d²). Caller-owned, slots as in the cache:
///  - `rows` [batch, heads, tokens, d_v] fp32 (compaction moves them: the decode driver passes them as the scorer's
///    carried state);
///  - `tracked` [batch, heads]: slots [0, tracked) hold valid rows. kvc::update fills [tracked, length) (O(d²) per
///    new slot) and sets tracked = length; kvc::on_evict leaves the kept rows valid (tracked = kept): the O(d)
///    update below for one eviction onto valid rows, else a recompute of the kept rows; a head whose rows are not
///    all valid is scored without them (same result);
///  - `age` [batch, heads]: incremental updates since the last full recompute; after `refresh` of them (or at a
///    block eviction of more than one token) on_evict recomputes every row from the moments, bounding the drift.
/// The clamp τ does not apply to cached rows (C is not re-formed per step): keep clamp_tau = 0 to compare.
template <class Space = HostSpace>
struct MomentResiduals {
  using memory_space = Space;

  TokenRows<float, StridedLayout, Space> rows{};
  Index* tracked = nullptr;
  Index* age = nullptr;
  Index refresh = 64;  ///< incremental updates between full recomputes (>= 1)

  KVC_HOST_DEVICE constexpr bool enabled() const noexcept { return rows.data() != nullptr; }
};

/// MomentKV's MI scorer over caller-owned moments (stateful).
template <class Space = HostSpace, class T = float>
struct MomentKVScorer {
  static constexpr Needs needs = Needs::keys | Needs::values | Needs::window_queries;
  static constexpr std::string_view name = "moment_kv";
  static constexpr bool stateful = true;

  MomentState<Space, T> state{};
  MomentResiduals<Space> residuals{};  ///< optional u_j cache (disabled: every score recomputes C k_j)
  /// The base score α: SnapKV's window attention with the paper's prefill protocol (w = 32, aligned chunks of 4,
  /// window sum per query head then group mean; the sum ranks as the Ada-KV repo's mean).
  SnapKVScorer base{Reference::authors, 32, 4, Pooling::chunk_mean, GqaReduce::mean};
  float scale = 0.0f;       ///< logit scale c of the residual; 0 = 1 / sqrt(d_k) (A7: the model's own)
  float clamp_tau = 1e-6f;  ///< entries of C with |x| < clamp_tau read as 0 (paper App. C.2; 0 disables)
  /// Rounds of the prefill eviction (A1; kvc::moment_kv_prefill): each evicts an even share of what is
  /// left, folds it into the moments and rescores. 1 = one shot (α_j ‖v_j‖); N − L = the exact greedy.
  Index prefill_rounds = 8;
  /// When set ([batch, heads, >= tokens] of the cache): α_j = fixed_base(b, h, j), the window attention is not run.
  TokenArray<float const, Space> fixed_base{};
  /// Moment-informed eviction (the paper's MI score α_j ‖r_j‖). false: the score is α_j alone (the paper's "NC
  /// without MI" ablation: the base selects, the evicted tokens still fold into the moments; kvc::LayerCompressor's
  /// prefill then compresses in one shot, as the base score alone would).
  bool mi = true;

  /// The decode-time scorer of Algorithm 1: α = the current query's softmax (a one-row window, no pooling).
  constexpr MomentKVScorer decode() const noexcept {
    MomentKVScorer s = *this;
    s.base.window_size = 1;
    s.base.kernel_size = 1;
    s.base.pooling = Pooling::max;
    return s;
  }

  constexpr Status check() const noexcept {
    if (residuals.enabled() && (residuals.tracked == nullptr || residuals.age == nullptr || residuals.refresh < 1))
      return {Errc::invalid_argument, "MomentKVScorer: `residuals` needs `tracked`, `age` and `refresh` >= 1"};
    if (prefill_rounds < 1)
      return {Errc::invalid_argument, "MomentKVScorer: `prefill_rounds` must be >= 1"};
    if (!(clamp_tau >= 0.0f) || !(scale >= 0.0f))
      return {Errc::invalid_argument, "MomentKVScorer: `clamp_tau` and `scale` must be >= 0 (scale 0: 1/sqrt(d_k))"};
    return base.check();
  }
};

MomentKVScorer()->MomentKVScorer<HostSpace, float>;

/// The budget of one prefill round (pipeline/moment_kv.hpp): a head with n > L_h slots (L_h from `target`) keeps
/// n − ceil((n − L_h) / rounds_left), so `rounds_left` rounds reach L_h evenly; rounds_left = 1 keeps L_h.
template <class Space = HostSpace>
struct MomentRoundBudget {
  using memory_space = Space;

  PerHeadBudget<Space> target{};
  Index rounds_left = 1;

  KVC_HOST_DEVICE constexpr Index keep(Index b, Index h, Index n) const noexcept {
    Index const goal = target.keep(b, h, n);
    return n <= goal ? n : n - (n - goal + rounds_left - 1) / rounds_left;
  }
  constexpr Status check() const noexcept {
    if (rounds_left < 1)
      return {Errc::invalid_argument, "MomentRoundBudget: `rounds_left` must be >= 1"};
    return target.check();
  }
};

/// One element of the residual r_j (the file comment's formula): the value element v, the evicted set's value mean
/// v̄ and u = (C̃ k_j) at the same index, β = c / n. Host and device: both backends' MI scores sum its squares.
KVC_HOST_DEVICE constexpr float moment_residual(float v, float value_mean, float beta, float u) noexcept {
  return v - value_mean - beta * u;
}

/// The MI score of one slot, s = α · ‖r_j‖ from its base α and ss = ‖r_j‖². A protecting base (+inf) stays +inf and a
/// zero base stays 0 even when ‖r_j‖ is +inf (no NaN from 0 · inf); a NaN ss (a NaN in the slot's key or value, or
/// Infs that cancel) scores -inf, evicted first, unless its base protects it: that slot only. Host and device.
KVC_HOST_DEVICE inline float moment_mi_score(float alpha, float ss) noexcept {
  float const inf = __builtin_huge_valf();
  if (ss != ss)
    return alpha == inf ? inf : -inf;
  return alpha == 0.0f || alpha == inf ? alpha : alpha * sqrtf(ss);
}

}  // namespace kvc
