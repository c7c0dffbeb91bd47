// SPDX-License-Identifier: Apache-2.0
// kvc/backend/cpu/detail/top_k.hpp: CPU TopKSelector: a radix selection per head, linear time, no sort.
// Shared: AdaKV's and UNComp's selections (selectors/allocated_top_k.hpp) run it after their allocation; the public
// header is kvc/backend/cpu/selectors/top_k.hpp.
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
/// the first `need` keys equal to T (ties keep the lower index). Every loop is branch-free on the data (random
/// keys would mispredict): matches are added, not tested. Scratch (RadixTop::bytes): two 2049-counter histograms
/// (alternate tokens count into alternate copies, so runs of equal digits do not serialise on one counter; the
/// last counter absorbs non-matches), the keys and the bucket's candidates.
struct RadixTop {
  static constexpr std::uint32_t bins = 2048;
  std::uint32_t* hist;  ///< [2, bins + 1]
  std::uint32_t* keys;  ///< [end - begin]
  Index* candidates;    ///< [end - begin], offsets from begin

  static std::size_t bytes(Index tokens) {
    return bytes_sum(workspace_round(2 * (bins + 1) * sizeof(std::uint32_t)),
                     workspace_round(bytes_product(tokens, sizeof(std::uint32_t))),
                     workspace_round(bytes_product(tokens, sizeof(Index))));
  }

  /// Sums the two copies into the first and picks the digit holding the m-th key from the top: `need` becomes how
  /// many to take from it, `in_bucket` how many it holds.
  std::uint32_t pick(std::uint32_t digits, Index& need, Index& in_bucket) const {
    for (std::uint32_t d = 0; d < digits; ++d)
      hist[d] += hist[bins + 1 + d];
    Index above = 0;
    std::uint32_t d = digits - 1;
    for (; d > 0 && above + hist[d] < need; --d)
      above += hist[d];
    need -= above;
    in_bucket = hist[d];
    return d;
  }
  void clear() const { std::fill(hist, hist + 2 * (bins + 1), 0u); }

  Index operator()(float const* s, Index begin, Index end, Index m, Index* out) const {
    Index const n = end - begin;
    Index need = m, in_bucket = 0;
    clear();
    for (Index i = 0; i < n; ++i) {
      std::uint32_t const k = score_order_key(s[begin + i]);
      keys[i] = k;
      ++hist[(i & 1) * (bins + 1) + (k >> 21)];
    }
    std::uint32_t prefix = pick(bins, need, in_bucket);
    int shift = 21;
    if (in_bucket != need) {  // the bucket is split: refine its next 11 bits, keeping its indices
      clear();
      Index c = 0;
      for (Index i = 0; i < n; ++i) {
        std::uint32_t const k = keys[i];
        bool const match = (k >> 21) == prefix;
        candidates[c] = i;
        c += match;
        ++hist[(i & 1) * (bins + 1) + (match ? (k >> 10) & (bins - 1) : bins)];
      }
      prefix = prefix << 11 | pick(bins, need, in_bucket);
      shift = 10;
      if (in_bucket != need) {  // the last 10 bits, over the bucket's indices only
        clear();
        for (Index i = 0; i < c; ++i) {
          std::uint32_t const k = keys[candidates[i]];
          ++hist[(i & 1) * (bins + 1) + ((k >> 10) == prefix ? k & 1023u : bins)];
        }
        prefix = prefix << 10 | pick(1024, need, in_bucket);
        shift = 0;
      }
    }
    // Ordered pass: out[j] is rewritten until a key is kept, and j < m keeps every write inside `out`. When the
    // threshold's bucket is taken whole, a key at or above the prefix is kept; otherwise the first `need` equal.
    Index j = 0;
    if (in_bucket == need) {
      for (Index i = 0; i < n && j < m; ++i) {
        out[j] = begin + i;
        j += (keys[i] >> shift) >= prefix;
      }
    } else {
      Index ties = 0;
      for (Index i = 0; i < n && j < m; ++i) {
        std::uint32_t const p = keys[i] >> shift;
        Index const take_tie = static_cast<Index>(p == prefix) & static_cast<Index>(ties < need);
        ties += take_tie;
        out[j] = begin + i;
        j += static_cast<Index>(p > prefix) | take_tie;
      }
    }
    return j;
  }
};

}  // namespace detail

template <Budget B>
struct Kernel<TopKSelector<B>, Cpu> {
  /// Per worker: the radix selection's scratch (none without tokens).
  static std::size_t worker_bytes(Index tokens) { return tokens > 0 ? detail::RadixTop::bytes(tokens) : 0; }
  static std::size_t workspace_bytes(Cpu const& cpu, TopKSelector<B> const&, Index, Index, Index tokens) {
    return bytes_product(cpu.workers(), worker_bytes(tokens));
  }

  static Status run(Cpu const& cpu, TopKSelector<B> const& sel, ScoreSpan<HostSpace> scores, KeepPlan<HostSpace> plan,
                    Workspace ws) {
    KVC_RETURN_IF_ERROR(sel.check());
    if (scores.tokens > Index{UINT32_MAX})  // the histograms count in 32 bits
      return {Errc::invalid_argument, "kvc::select: heads of more than 2^32 - 1 tokens are not supported on the CPU"};
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
      detail::RadixTop const radix{carve.take<std::uint32_t>(2 * (detail::RadixTop::bins + 1)),
                                   carve.take<std::uint32_t>(scores.tokens), carve.take<Index>(scores.tokens)};
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
        j += radix(scores.row(b, h), c.sink_end, c.recent_begin, m, out + j);
      }
      for (Index t = c.recent_begin; t < n; ++t)
        out[j++] = t;
    });
    return {};
  }
};

}  // namespace kvc
