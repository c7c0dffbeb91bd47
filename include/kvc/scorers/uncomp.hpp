// SPDX-License-Identifier: Apache-2.0
// kvc/scorers/uncomp.hpp: UNComp's per-head token scorer (Xiong et al., "UNComp: Can Matrix Entropy Uncover
// Sparsity? A Compressor Design from an Uncertainty-Aware Perspective", arXiv 2410.03090, §3.3.3;
// the authors' uncomp/uncomp_utils.py, github.com/menik1126/UNComp): a SnapKV-style observation-window score that keeps
// sliding while decoding.
//
// The state holds, for every slot j of KV head (b, h), the attention the last w query rows paid it:
//   A[i][j] = sum_{q in group(h)} softmax_j(<rope(query_{q,i}), key_j> / sqrt(d))     (i = 0 oldest .. w − 1 newest)
// (the GQA group's sum, docs/policies/uncomp.md decision A15; a cache expanded to one KV head per query head is the
// authors' per-query-head mode). Slots appended after a row was computed read 0 in it: the authors' zero column for a
// new key in old rows.
//   kvc::update(queries of R new rows): every tracked slot's rows shift by min(R, w) (the oldest fall out), slots
//     appended since the last update start at 0, then the newest min(R, w) rows are the new queries' attention over
//     the current cache (the shared window-attention kernel, ColumnSums::per_window_row).
//   kvc::score:  s[j] = pool_k( sum_i A[i][j] )  over the prefix j < m = n − min(w, n) (pooling restricted to the
//     prefix, max pads with −inf); window slots j >= m get max_{j' < m} s[j'] + 1, so any top-k keeps them.
//   kvc::on_evict: tracked = kept (the kept slots' rows travel with them through kvc::compact: the decode driver
//     passes state.window_rows as the scorer's carried state).
// Prefill of a layer (the authors' update_kv): update with the last w prompt queries, then score: equal to
// SnapKVScorer{authors, w, k, pooling, GqaReduce::sum} on every slot. Decode (their update_head_kv_generate):
// kvc::decode_step with interval 1 and TopKSelector<PerHeadBudget>{budgets, 0, w}: every step recomputes the score from
// the last w attention rows and evicts one token per head over budget. Compaction keeps slots ascending, so the cache
// stays in position order (decision A18; the authors' decode path leaves it in score order after the first step).
// Budgets per head come from the entropy calibration (selectors/uncomp.hpp, calibration/).
#pragma once

#include <kvc/core/kv_view.hpp>
#include <kvc/core/layout.hpp>
#include <kvc/core/scorer.hpp>
#include <kvc/core/status.hpp>
#include <kvc/scorers/snap_kv.hpp>

#include <string_view>

namespace kvc {

/// UNComp's caller-owned state for one layer:
///  - `window_rows` [batch, Hkv, tokens (>= the cache's capacity), w] fp32: row j holds A[0..w)[j] (oldest first);
///  - `tracked` [batch, Hkv]: slots [0, tracked) hold rows; zero it to start.
template <class Space = HostSpace>
struct UNCompState {
  using memory_space = Space;

  TokenRows<float, StridedLayout, Space> window_rows{};
  Index* tracked = nullptr;
};

/// Contiguous window rows for `keys` extents and window w: [batch, heads, tokens, w].
constexpr StridedLayout uncomp_window_layout(KVExtents keys, Index window) noexcept {
  return bhtd_layout({keys.batch, keys.heads, keys.tokens, window});
}

/// UNComp's sliding observation-window scorer (stateful; see the file comment).
template <class Space = HostSpace>
struct UNCompScorer {
  static constexpr Needs needs = Needs::keys;  ///< score reads the state; update reads window queries
  static constexpr std::string_view name = "uncomp";
  static constexpr bool stateful = true;

  UNCompState<Space> state{};
  Index window_size = 8;           ///< w, the observation window (the paper's l = 8); also the state's row width
  Index kernel_size = 7;           ///< pooling kernel (the authors' run scripts: max pooling, kernel 7)
  Pooling pooling = Pooling::max;  ///< max (authors' runs) or avg (the code's fallback, kernel 5)

  constexpr Status check() const noexcept {
    if (window_size < 1)
      return {Errc::invalid_argument, "UNCompScorer: `window_size` must be >= 1"};
    if (kernel_size < 1 || kernel_size % 2 == 0 || pooling == Pooling::chunk_mean)
      return {Errc::invalid_argument, "UNCompScorer: `kernel_size` must be odd and >= 1, pooling max or avg"};
    return {};
  }
  /// Checks the state against key extents (the row width is the window).
  constexpr Status check_state(KVExtents const& keys) const noexcept {
    KVC_RETURN_IF_ERROR(check());
    KVExtents const r = state.window_rows.extents();
    if (state.window_rows.data() == nullptr || state.tracked == nullptr || r.batch != keys.batch ||
        r.heads != keys.heads || r.tokens < keys.tokens || r.dim != window_size)
      return {Errc::invalid_argument,
              "uncomp: the state needs `window_rows` [batch, KV heads, >= tokens, window_size] and `tracked` "
              "[batch, KV heads]"};
    return {};
  }
};

UNCompScorer()->UNCompScorer<HostSpace>;

}  // namespace kvc
