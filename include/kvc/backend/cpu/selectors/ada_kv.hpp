// SPDX-License-Identifier: Apache-2.0
// kvc/backend/cpu/selectors/ada_kv.hpp: CPU AdaKV allocation (per sequence, over all its heads) and selection.
#pragma once

#include <kvc/backend/cpu/detail/for_each_head.hpp>
#include <kvc/backend/cpu/detail/top_k.hpp>
#include <kvc/selectors/ada_kv.hpp>

#include <algorithm>
#include <cstdint>
#include <functional>

namespace kvc {

/// One sequence per worker. Keys are unique (detail::ada_kv_key), so the k-th largest (nth_element) is an exact
/// threshold: a head's winners are its keys at or above it. Scratch per worker: one 64-bit key per slot of the
/// sequence ([heads, tokens]) and, for kvpress, each head's pinning threshold.
template <Budget Bu>
struct Kernel<Allocation<AdaKVSelector<Bu>>, Cpu> {
  using Sel = AdaKVSelector<Bu>;

  static std::size_t worker_bytes(Index heads, Index tokens) {
    return bytes_sum(workspace_round(bytes_product(heads, tokens, sizeof(std::uint64_t))),
                     workspace_round(bytes_product(heads, sizeof(std::uint64_t))));
  }
  static std::size_t workspace_bytes(Cpu const& cpu, Sel const&, Index, Index heads, Index tokens) {
    return bytes_product(cpu.workers(), worker_bytes(heads, tokens));
  }

  static Status run(Cpu const& cpu, Sel const& sel, ScoreSpan<HostSpace> scores, Index* table, Workspace ws) {
    if (scores.heads * scores.tokens > Index{UINT32_MAX})
      return {Errc::invalid_argument, "kvc::allocate: heads * tokens of one sequence must be below 2^32"};
    KVC_RETURN_IF_ERROR(detail::check_lengths(scores.lengths, scores.batch, scores.heads, scores.tokens,
                                              "kvc::allocate: every valid length must be in [0, tokens]"));
    std::size_t const per_worker = worker_bytes(scores.heads, scores.tokens);
    auto* base = WorkspaceCarver(ws).take<std::byte>(static_cast<Index>(per_worker * cpu.workers()));
    if (base == nullptr && per_worker > 0)
      return {Errc::out_of_capacity, "kvc::allocate: workspace smaller than allocate_workspace_bytes()"};
    detail::parallel_for(cpu, scores.batch, [&](Index b, Index worker) {
      WorkspaceCarver carve({base + static_cast<std::size_t>(worker) * per_worker, per_worker});
      std::uint64_t* keys = carve.take<std::uint64_t>(scores.heads * scores.tokens);
      std::uint64_t* pinned = carve.take<std::uint64_t>(scores.heads);
      allocate_sequence(sel, scores, b, keys, pinned, table + b * scores.heads);
    });
    return {};
  }

 private:
  /// The k-th largest of keys[0, m) (k in [1, m]); reorders the keys.
  static std::uint64_t kth_largest(std::uint64_t* keys, Index m, Index k) {
    std::nth_element(keys, keys + (k - 1), keys + m, std::greater<>{});
    return keys[k - 1];
  }

  static void allocate_sequence(Sel const& sel, ScoreSpan<HostSpace> const& scores, Index b, std::uint64_t* keys,
                                std::uint64_t* pinned, Index* out) {
    Index const heads = scores.heads, tokens = scores.tokens;
    bool const kvpress = sel.reference == Reference::kvpress;
    auto head = [&](Index h) { return detail::ada_kv_head(sel, b, h, scores.length(b, h)); };
    auto key = [&](detail::AdaKVHead const& a, Index h, Index t) {
      return detail::ada_kv_key(scores(b, h, t), detail::ada_kv_protected(a, t), h * tokens + t);
    };
    // Candidates: the authors' unprotected tokens; kvpress's every token (protected ranked first).
    auto first = [&](detail::AdaKVHead const& a) { return kvpress ? Index{0} : a.sink_end; };
    auto last = [&](detail::AdaKVHead const& a) { return kvpress ? a.n : a.recent_begin; };
    auto is_pinned = [&](detail::AdaKVHead const& a, Index h, std::uint64_t k) { return a.safe > 0 && k >= pinned[h]; };

    // kvpress: each head's top `safe` keys are pinned (its safe-th largest key is the threshold).
    Index total = 0;
    for (Index h = 0; h < heads; ++h) {
      detail::AdaKVHead const a = head(h);
      total += a.share - a.safe;
      if (a.safe > 0) {
        for (Index t = 0; t < a.n; ++t)
          keys[t] = key(a, h, t);
        pinned[h] = kth_largest(keys, a.n, a.safe);
      }
    }
    // The global pool: every candidate that is not pinned; its `total` best win.
    Index m = 0;
    for (Index h = 0; h < heads; ++h) {
      detail::AdaKVHead const a = head(h);
      for (Index t = first(a); t < last(a); ++t) {
        std::uint64_t const k = key(a, h, t);
        keys[m] = k;
        m += !is_pinned(a, h, k);
      }
    }
    std::uint64_t const threshold = total <= 0 || total >= m ? 0 : kth_largest(keys, m, total);
    for (Index h = 0; h < heads; ++h) {
      detail::AdaKVHead const a = head(h);
      Index winners = 0;
      if (total > 0)
        for (Index t = first(a); t < last(a); ++t) {
          std::uint64_t const k = key(a, h, t);
          winners += !is_pinned(a, h, k) && k >= threshold;
        }
      out[h] = kvpress ? a.safe + winners : detail::ada_kv_authors_total(a, sel.alpha_safeguard, winners);
    }
  }
};

/// AdaKV selection on the CPU: the allocation above, then TopKSelector over the table.
template <Budget Bu>
struct Kernel<AdaKVSelector<Bu>, Cpu> : detail::AllocatedTopK<AdaKVSelector<Bu>, Cpu> {};

}  // namespace kvc
