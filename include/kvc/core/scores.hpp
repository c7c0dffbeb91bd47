// SPDX-License-Identifier: Apache-2.0
// kvc/core/scores.hpp: the score tensor that scorers write and selectors read.
#pragma once

#include <kvc/core/backend.hpp>
#include <kvc/core/extents.hpp>
#include <kvc/core/kv_view.hpp>

namespace kvc {

/// Scores [batch, heads, tokens], fp32, contiguous, **higher = keep**. One score per KV head and token.
/// `lengths` (the cache's: per head or per sequence, optional, same memory space) are the valid lengths: entries at
/// or beyond them are padding, written as -inf by scorers and never kept by selectors. NaN scores rank as -inf.
template <class Space = HostSpace>
struct ScoreSpan {
  using memory_space = Space;

  float* data = nullptr;
  Index batch = 0;
  Index heads = 0;
  Index tokens = 0;
  Lengths lengths{};

  KVC_HOST_DEVICE constexpr float& operator()(Index b, Index h, Index t) const noexcept {
    return data[(b * heads + h) * tokens + t];
  }
  /// The `tokens` scores of head (b, h) (pointer arithmetic only: valid for empty spans too).
  KVC_HOST_DEVICE constexpr float* row(Index b, Index h) const noexcept { return data + (b * heads + h) * tokens; }
  KVC_HOST_DEVICE constexpr Index length(Index b, Index h) const noexcept { return lengths.at(b, h, tokens); }
  KVC_HOST_DEVICE constexpr Index size() const noexcept { return batch * heads * tokens; }
};

/// The score of a head's protected slots (kvpress's protection padding, e.g. SnapKV's window): above every one of the
/// m scores before them (`prefix_max` their largest), 1 when there are none. Host and device.
KVC_HOST_DEVICE constexpr float protected_score(float prefix_max, Index m) noexcept {
  return m > 0 ? prefix_max + 1.0f : 1.0f;
}

}  // namespace kvc
