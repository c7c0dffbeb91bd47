// SPDX-License-Identifier: Apache-2.0
// kvc/backend/cpu/selectors/top_k.hpp: CPU TopKSelector: a radix selection per head, linear time, no sort.
#pragma once

#include <kvc/backend/cpu/detail/for_each_head.hpp>
#include <kvc/selectors/top_k.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>

namespace kvc {

namespace detail {

/// Radix selection on the CPU: the best `m` of scores[begin, end) (0 < m < end - begin) under the selection's total
/// order, written to `out` in ascending index order; returns how many were written (m). Linear time, no sort:
/// histograms of the order keys (detail::score_order_key: 11, 11 and 10 bits, most significant first) narrow the
/// threshold key T, stopping as soon as the bucket that holds the m-th key is taken whole; the second pass keeps
/// the indices of that bucket, so the third reads only those. One ordered pass then writes every key above T and
/// the first `need` keys equal to T (ties keep the lower index). `hist`: 2048 counters; `candidates`: end - begin.
struct RadixTop {
  std::uint32_t* hist;
  Index* candidates;

  /// Picks the digit holding the m-th key from the top; `need` becomes how many to take from it.
  static std::uint32_t pick(std::uint32_t const* hist, std::uint32_t digits, Index& need, Index& in_bucket) {
    Index above = 0;
    std::uint32_t d = digits - 1;
    for (;; --d) {
      if (above + hist[d] >= need || d == 0)
        break;
      above += hist[d];
    }
    need -= above;
    in_bucket = hist[d];
    return d;
  }

  Index operator()(float const* s, Index begin, Index end, Index m, Index* out) const {
    Index need = m, in_bucket = 0;
    std::fill(hist, hist + 2048, 0u);
    for (Index t = begin; t < end; ++t)
      ++hist[score_order_key(s[t]) >> 21];
    std::uint32_t prefix = pick(hist, 2048, need, in_bucket);
    int shift = 21;
    if (in_bucket != need) {  // the bucket is split: refine its next 11 bits, keeping its indices
      std::fill(hist, hist + 2048, 0u);
      Index c = 0;
      for (Index t = begin; t < end; ++t) {
        std::uint32_t const k = score_order_key(s[t]);
        if ((k >> 21) == prefix) {
          candidates[c++] = t;
          ++hist[(k >> 10) & 2047u];
        }
      }
      prefix = prefix << 11 | pick(hist, 2048, need, in_bucket);
      shift = 10;
      if (in_bucket != need) {  // the last 10 bits, over the bucket's indices only
        std::fill(hist, hist + 1024, 0u);
        for (Index i = 0; i < c; ++i) {
          std::uint32_t const k = score_order_key(s[candidates[i]]);
          if ((k >> 10) == prefix)
            ++hist[k & 1023u];
        }
        prefix = prefix << 10 | pick(hist, 1024, need, in_bucket);
        shift = 0;
      }
    }
    // Ordered pass, branch-free (bitwise, not ||: random keys would mispredict every branch): out[j] is rewritten
    // until a key is kept, and j < m keeps every write inside `out`. When the threshold's bucket is taken whole,
    // a key at or above the prefix is kept; otherwise the first `need` keys equal to it.
    Index j = 0;
    if (in_bucket == need) {
      for (Index t = begin; t < end && j < m; ++t) {
        out[j] = t;
        j += (score_order_key(s[t]) >> shift) >= prefix;
      }
    } else {
      Index ties = 0;
      for (Index t = begin; t < end && j < m; ++t) {
        std::uint32_t const p = score_order_key(s[t]) >> shift;
        Index const take_tie = static_cast<Index>(p == prefix) & static_cast<Index>(ties < need);
        ties += take_tie;
        out[j] = t;
        j += static_cast<Index>(p > prefix) | take_tie;
      }
    }
    return j;
  }
};

}  // namespace detail

template <Budget B>
struct Kernel<TopKSelector<B>, Cpu> {
  static constexpr std::size_t histogram_bytes = 2048 * sizeof(std::uint32_t);

  /// Per worker: the radix histogram and one candidate index per token.
  static std::size_t worker_bytes(Index tokens) {
    return bytes_sum(histogram_bytes, workspace_round(bytes_product(tokens, sizeof(Index))));
  }
  static std::size_t workspace_bytes(Cpu const& cpu, TopKSelector<B> const&, Index, Index, Index tokens) {
    return bytes_product(cpu.workers(), worker_bytes(tokens));
  }

  static Status run(Cpu const& cpu, TopKSelector<B> const& sel, ScoreSpan<HostSpace> scores, KeepPlan<HostSpace> plan,
                    Workspace ws) {
    KVC_RETURN_IF_ERROR(sel.check());
    std::size_t const per_worker = worker_bytes(scores.tokens);
    auto* base =
        WorkspaceCarver(ws).take<std::byte>(static_cast<Index>(workspace_bytes(cpu, sel, 0, 0, scores.tokens)));
    if (base == nullptr && scores.tokens > 0)
      return {Errc::out_of_capacity, "kvc::select: workspace smaller than select_workspace_bytes()"};
    KVC_RETURN_IF_ERROR(detail::check_lengths(scores.lengths, scores.batch, scores.heads, scores.tokens,
                                              "kvc::select: every valid length must be in [0, tokens]"));
    for (Index b = 0; b < scores.batch; ++b)  // capacity first, so a failing call leaves the plan untouched
      for (Index h = 0; h < scores.heads; ++h)
        if (detail::top_k_counts(sel, b, h, scores.length(b, h)).keep > plan.capacity)
          return {Errc::out_of_capacity, "kvc::select: a head keeps more tokens than `plan.capacity`"};
    detail::parallel_for(cpu, scores.batch * scores.heads, [&](Index item, Index worker) {
      Index const b = item / scores.heads, h = item % scores.heads;
      WorkspaceCarver carve({base + static_cast<std::size_t>(worker) * per_worker, per_worker});
      auto* hist = carve.take<std::uint32_t>(2048);
      Index* candidates = carve.take<Index>(scores.tokens);
      Index const n = scores.length(b, h);
      auto const c = detail::top_k_counts(sel, b, h, n);
      Index* out = plan.indices(b, h);
      plan.kept(b, h) = c.keep;
      // Protected tokens around the best m of the unprotected middle [sink_end, recent_begin).
      Index const m = c.keep - c.sink_end - (n - c.recent_begin);
      Index const pool = c.recent_begin - c.sink_end;
      Index j = 0;
      for (Index t = 0; t < c.sink_end; ++t)
        out[j++] = t;
      if (m >= pool) {  // within budget: the whole middle
        for (Index t = c.sink_end; t < c.recent_begin; ++t)
          out[j++] = t;
      } else if (m > 0) {
        j += detail::RadixTop{hist, candidates}(scores.row(b, h), c.sink_end, c.recent_begin, m, out + j);
      }
      for (Index t = c.recent_begin; t < n; ++t)
        out[j++] = t;
    });
    return {};
  }
};

}  // namespace kvc
