// SPDX-License-Identifier: Apache-2.0
// kvc/backend/cpu/detail/for_each_head.hpp: the (batch, KV head) loop every CPU scorer shares.
#pragma once

#include <kvc/core/scores.hpp>
#include <kvc/core/status.hpp>

#include <algorithm>
#include <limits>

namespace kvc::detail {

/// Checks each sequence's valid length, calls `fn(b, h, n, scores_of_head)` to fill scores [0, n) of every head,
/// then writes -inf into the padding [n, tokens). `fn` returns nothing.
template <class Fn>
Status for_each_head(ScoreSpan<HostSpace> out, Fn&& fn) {
  for (Index b = 0; b < out.batch; ++b) {
    Index const n = out.length(b);
    if (n < 0 || n > out.tokens)
      return {Errc::invalid_argument, "kvc::score: `lengths[b]` must be in [0, tokens]"};
    for (Index h = 0; h < out.heads; ++h) {
      float* score = out.row(b, h);
      fn(b, h, n, score);
      std::fill(score + n, score + out.tokens, -std::numeric_limits<float>::infinity());
    }
  }
  return {};
}

}  // namespace kvc::detail
