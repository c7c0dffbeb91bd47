// SPDX-License-Identifier: Apache-2.0
// kvc/pipeline/blockwise.hpp: the block-wise driver of KeyDiff's protocol (Park et al., arXiv 2504.15364, Eq. 6):
// the prompt is processed in blocks of B tokens under a fixed budget N, evicting after every block; decoding is
// the same loop with B = 1. The peak cache per head is N + B tokens instead of the prompt length.
//
//   C_0 = {};  for each block i:  C_i = pi_N(C_{i-1} || block_i)   (blocks start at 0, B, 2B, ...; spec A11)
//
// Generic over scorers that read only keys and values (KeyDiff, Knorm, StreamingLLM); attention-based scorers
// need the block's attention and plug into the engine's own loop instead. CPU only in this release.
#pragma once

#include <kvc/backend/cpu/pipeline/compact.hpp>
#include <kvc/pipeline/press.hpp>
#include <kvc/selectors/top_k.hpp>

#include <cstddef>

namespace kvc {

/// Token slots the working cache needs: the budget (or the protected windows, if larger) plus one block.
inline constexpr Index blockwise_capacity(TopKSelector<FixedBudget> const& sel, Index block_size) noexcept {
  Index const kept = sel.budget.tokens > sel.n_sink + sel.n_recent ? sel.budget.tokens : sel.n_sink + sel.n_recent;
  return kept + block_size;
}

/// Workspace for blockwise_compress over a working cache with extents `work` (tokens = its capacity).
template <Scorer S>
std::size_t blockwise_workspace_bytes(Cpu const& cpu, Press<S, TopKSelector<FixedBudget>> const& press,
                                      KVExtents const& work) {
  auto const heads = static_cast<std::size_t>(work.batch * work.heads);
  return workspace_round(static_cast<std::size_t>(work.batch) * sizeof(Index)) +
         workspace_round(heads * static_cast<std::size_t>(work.tokens) * sizeof(Index)) +
         workspace_round(heads * sizeof(Index)) + compress_workspace_bytes(cpu, press, work) + workspace_slack;
}

/// Runs Eq. 6 over `src` ([B, H, T, d], ragged lengths allowed) in blocks of `block_size` tokens.
/// `work` is a caller-owned cache with src's batch, heads and dims and at least blockwise_capacity() tokens;
/// `plan.capacity` must be at least work's tokens. On return, head (b, h) of `work` holds plan.count[b, h]
/// tokens in slots [0, count), compacted, and plan.index holds their original positions, ascending.
template <Scorer S, KVCacheView Src, KVCacheView Work>
Status blockwise_compress(Cpu const& cpu, Press<S, TopKSelector<FixedBudget>> const& press, Src const& src,
                          Index block_size, Work const& work, KeepPlan<HostSpace> plan, Workspace ws) {
  static_assert(needs_only_kv(S::needs), "kvc::blockwise_compress: the scorer must read only keys and values");
  KVExtents const se = src.keys.extents(), we = work.keys.extents();
  if (block_size < 1)
    return {Errc::invalid_argument, "kvc::blockwise_compress: `block_size` must be >= 1"};
  KVC_RETURN_IF_ERROR(press.selector.check());
  if (we.batch != se.batch || we.heads != se.heads || we.dim != se.dim ||
      work.values.extents().dim != src.values.extents().dim)
    return {Errc::invalid_argument, "kvc::blockwise_compress: `work` must have src's batch, heads and dims"};
  if (we.tokens < blockwise_capacity(press.selector, block_size) || work.values.extents().tokens < we.tokens)
    return {Errc::out_of_capacity, "kvc::blockwise_compress: `work` needs blockwise_capacity() token slots"};
  if (plan.batch != se.batch || plan.heads != se.heads || plan.capacity < we.tokens)
    return {Errc::invalid_argument, "kvc::blockwise_compress: `plan` must be [batch, heads, >= work tokens]"};

  WorkspaceCarver carve(ws);
  Index* lengths = carve.take<Index>(se.batch);
  KeepPlan<HostSpace> step{carve.take<Index>(se.batch * se.heads * we.tokens), carve.take<Index>(se.batch * se.heads),
                           se.batch, se.heads, we.tokens};
  std::size_t const compress_bytes = compress_workspace_bytes(cpu, press, we);
  void* compress_ws = carve.take<std::byte>(static_cast<Index>(compress_bytes));
  if ((lengths == nullptr && se.batch > 0) || (step.count == nullptr && se.batch * se.heads > 0) ||
      (compress_ws == nullptr && compress_bytes > 0))
    return {Errc::out_of_capacity, "kvc::blockwise_compress: workspace smaller than blockwise_workspace_bytes()"};

  Index longest = 0;
  for (Index b = 0; b < se.batch; ++b) {
    lengths[b] = 0;
    longest = src.length(b) > longest ? src.length(b) : longest;
    for (Index h = 0; h < se.heads; ++h)
      plan.kept(b, h) = 0;
  }
  auto const view = make_cache(work.keys, work.values, lengths);
  for (Index start = 0; start < longest; start += block_size) {
    // Append the block: rows go after the kept ones, positions into the plan.
    for (Index b = 0; b < se.batch; ++b) {
      Index const m = src.length(b) - start < block_size ? src.length(b) - start : block_size;
      for (Index h = 0; h < se.heads; ++h)
        for (Index j = 0; j < m; ++j) {
          Index const slot = lengths[b] + j;
          detail::copy_row(work.keys.row(b, h, slot), src.keys.row(b, h, start + j), we.dim);
          detail::copy_row(work.values.row(b, h, slot), src.values.row(b, h, start + j), work.values.extents().dim);
          plan.indices(b, h)[slot] = start + j;
        }
      lengths[b] += m > 0 ? m : 0;
    }
    // Evict back to the budget: score [cache || block], select, compact rows and positions alike.
    KVC_RETURN_IF_ERROR(compress(cpu, press, view, step, Workspace{compress_ws, compress_bytes}));
    KVC_RETURN_IF_ERROR(compact(cpu, step, view));
    for (Index b = 0; b < se.batch; ++b) {
      for (Index h = 0; h < se.heads; ++h) {
        Index* pos = plan.indices(b, h);
        Index const* sel = step.indices(b, h);
        for (Index j = 0; j < step.kept(b, h); ++j)  // sel[j] >= j: in place is safe
          pos[j] = pos[sel[j]];
        plan.kept(b, h) = step.kept(b, h);
        if (step.kept(b, h) != step.kept(b, 0))
          return {Errc::invalid_argument, "kvc::blockwise_compress: heads of one sequence kept different counts"};
      }
      lengths[b] = se.heads > 0 ? step.kept(b, 0) : 0;
    }
  }
  return {};
}

}  // namespace kvc
