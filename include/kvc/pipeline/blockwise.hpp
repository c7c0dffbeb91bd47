// SPDX-License-Identifier: Apache-2.0
// kvc/pipeline/blockwise.hpp: the block-wise driver of KeyDiff's protocol (Park et al., arXiv 2504.15364, Eq. 6):
// the prompt is processed in blocks of B tokens under a fixed budget N, evicting after every block; decoding is
// the same loop with B = 1. The peak cache per head is N + B tokens instead of the prompt length.
//
//   C_0 = {};  for each block i:  C_i = pi_N(C_{i-1} || block_i)   (blocks start at 0, B, 2B, ... as in Eq. 6)
//
// Written against the entry points only (append, compress, compact), so it runs on every backend that has their
// kernels. Generic over scorers that read only keys and values (KeyDiff, Knorm, StreamingLLM); attention-based
// scorers need the block's queries and plug into the engine's own loop (or the decode driver) instead.
#pragma once

#include <kvc/core/checks.hpp>
#include <kvc/pipeline/compact.hpp>
#include <kvc/pipeline/press.hpp>
#include <kvc/selectors/top_k.hpp>

#include <cstddef>
#include <limits>

namespace kvc {

/// Token slots the working cache needs: the budget (or the protected windows, if larger) plus one block.
inline constexpr Index blockwise_capacity(TopKSelector<FixedBudget> const& sel, Index block_size) noexcept {
  Index protect = 0, capacity = 0;  // saturates at the largest Index rather than wrapping
  if (__builtin_add_overflow(sel.n_sink, sel.n_recent, &protect))
    return std::numeric_limits<Index>::max();
  Index const kept = sel.budget.tokens > protect ? sel.budget.tokens : protect;
  return __builtin_add_overflow(kept, block_size, &capacity) ? std::numeric_limits<Index>::max() : capacity;
}

/// Workspace for blockwise_compress over a working cache with extents `work` (tokens = its capacity): the step
/// plan and kvc::compress's scratch.
template <Backend B, Scorer S>
std::size_t blockwise_workspace_bytes(B const& backend, Press<S, TopKSelector<FixedBudget>> const& press,
                                      KVExtents const& work) {
  return bytes_sum(workspace_round(bytes_product(work.batch, work.heads, work.tokens, sizeof(Index))),
                   workspace_round(bytes_product(work.batch, work.heads, sizeof(Index))),
                   compress_workspace_bytes(backend, press, work), workspace_slack);
}

/// Runs Eq. 6 over `src` ([B, H, T, d], lengths per head or per sequence allowed) in blocks of `block_size` tokens.
/// `work` is a caller-owned, **empty** cache (every length 0) with src's batch, heads and dims, at least
/// blockwise_capacity() token slots, a per-head length table, and a positions table. On return, head (b, h) of
/// `work` holds work.length(b, h) tokens in slots [0, length), compacted, and work's positions hold the tokens'
/// positions in `src`, ascending. Workspace: blockwise_workspace_bytes(), in the backend's memory space.
template <Backend Bk, Scorer S, KVCacheView Src, KVCacheView Work>
Status blockwise_compress(Bk const& backend, Press<S, TopKSelector<FixedBudget>> const& press, Src const& src,
                          Index block_size, Work const& work, Workspace ws) {
  static_assert(needs_only_kv(S::needs), "kvc::blockwise_compress: the scorer must read only keys and values");
  static_assert(!StatefulScorer<S>,
                "kvc::blockwise_compress: a stateful scorer (H2O) needs kvc::update after every block: use the decode "
                "driver (kvc::decode_step) instead");
  KVExtents const se = src.keys.extents(), we = work.keys.extents();
  KVC_RETURN_IF_ERROR(detail::check_cache(src, KVC_CACHE_MESSAGES("kvc::blockwise_compress", "`src`")));
  KVC_RETURN_IF_ERROR(detail::check_cache(work, KVC_CACHE_MESSAGES("kvc::blockwise_compress", "`work`")));
  if (block_size < 1)
    return {Errc::invalid_argument, "kvc::blockwise_compress: `block_size` must be >= 1"};
  KVC_RETURN_IF_ERROR(press.selector.check());
  if (we.batch != se.batch || we.heads != se.heads || we.dim != se.dim ||
      work.values.extents().dim != src.values.extents().dim)
    return {Errc::invalid_argument, "kvc::blockwise_compress: `work` must have src's batch, heads and dims"};
  if (we.tokens < blockwise_capacity(press.selector, block_size))
    return {Errc::out_of_capacity, "kvc::blockwise_compress: `work` needs blockwise_capacity() token slots"};
  if (!work.lengths.per_head() || work.positions == nullptr)
    return {Errc::invalid_argument, "kvc::blockwise_compress: `work` needs a per-head length table and positions"};

  WorkspaceCarver carve(ws);
  KeepPlan<typename Bk::memory_space> step{carve.take<Index>(se.batch * se.heads * we.tokens),
                                           carve.take<Index>(se.batch * se.heads), se.batch, se.heads, we.tokens};
  std::size_t const compress_bytes = compress_workspace_bytes(backend, press, we);
  void* compress_ws = carve.take<std::byte>(static_cast<Index>(compress_bytes));
  if ((step.count == nullptr && se.batch * se.heads > 0) || (compress_ws == nullptr && compress_bytes > 0))
    return {Errc::out_of_capacity, "kvc::blockwise_compress: workspace smaller than blockwise_workspace_bytes()"};

  // Blocks past a sequence's end append nothing, and re-compressing a cache within budget keeps it whole, so the
  // loop can run to src's capacity without reading (possibly device-side) lengths on the host.
  for (Index start = 0; start < se.tokens; start += block_size) {
    KVC_RETURN_IF_ERROR(append(backend, work, src, start, block_size));  // C_{i-1} || block_i
    KVC_RETURN_IF_ERROR(compress(backend, press, work, step, Workspace{compress_ws, compress_bytes}));
    KVC_RETURN_IF_ERROR(compact(backend, step, work));  // pi_N: rows, positions and lengths move together
  }
  return {};
}

}  // namespace kvc
