// SPDX-License-Identifier: Apache-2.0
// kvc/pipeline/decode.hpp: the decode driver: compression while generating, on a schedule, for any scorer.
//
// Semantics of kvpress's DecodingPress (NVIDIA/kvpress, kvpress/presses/decoding_press.py), per layer:
//   every decode forward:  steps += 1; the new pre-RoPE queries are in the layer's QueryBuffer; a stateful scorer
//                          folds them in (kvc::update: H2O's accumulated attention);
//   when steps >= compression_interval:
//     every head longer than target_size keeps exactly target_size tokens (kept = target; shorter heads keep all),
//     chosen by the scorer from the last min(buffered, hidden_states_buffer_size) queries (window queries, or their
//     statistics for ExpectedAttention), then on_evict, compaction (with the scorer's per-token state), optional
//     key re-rotation to cache-relative positions (StreamingLLM / H2O variant (b)); steps and the buffer reset.
// So a layer's length stays within [target, target + interval - 1] once it has reached target. One driver serves
// sequences of different lengths (the budget is per head). Written against the entry points only (update,
// query_statistics, compress, on_evict, compact, rerotate_keys), so it runs on every backend that has their kernels.
//
// The engine's step, per layer: append the new tokens' K and V (kvc::append), push their pre-RoPE queries and
// positions into the QueryBuffer (kvc::push_queries, pipeline/state.hpp), attend, then kvc::decode_step. The per-layer
// compressor (engine/layer_compressor.hpp) does all of this behind one call.
// Key re-rotation needs the backend's re-rotation kernel (the CPU's; CUDA has none yet): without it, a schedule
// that asks for it is refused before anything changes.
#pragma once

#include <kvc/core/checks.hpp>
#include <kvc/core/observations.hpp>
#include <kvc/pipeline/compact.hpp>
#include <kvc/pipeline/press.hpp>
#include <kvc/pipeline/query_statistics.hpp>
#include <kvc/pipeline/rerotate.hpp>
#include <kvc/pipeline/state.hpp>
#include <kvc/scorers/reference.hpp>
#include <kvc/selectors/top_k.hpp>

#include <cstddef>
#include <type_traits>

namespace kvc {

/// When and how far to compress while decoding (kvpress's DecodingPress field names).
struct DecodeSchedule {
  Index compression_interval = 512;       ///< decode forwards between compressions
  Index target_size = 2048;               ///< tokens each head keeps at a compression (FixedBudget)
  Index hidden_states_buffer_size = 256;  ///< the scorer sees the last this-many buffered queries
  Index n_sink = 0;                       ///< first tokens always kept (selection)
  Index n_recent = 0;                     ///< last tokens always kept (selection; H2O's recent window)
  bool rerotate_keys = false;             ///< after compaction, re-rotate keys to positions 0..length-1

  constexpr Status check() const noexcept {
    if (compression_interval < 1 || target_size < 0 || hidden_states_buffer_size < 1 || n_sink < 0 || n_recent < 0)
      return {Errc::invalid_argument,
              "DecodeSchedule: `compression_interval` and `hidden_states_buffer_size` must be >= 1, the rest >= 0"};
    return {};
  }
  /// The selection a compression runs.
  constexpr TopKSelector<FixedBudget> selector() const noexcept { return {{target_size}, n_sink, n_recent}; }
};

/// A scorer's per-token state that compaction must carry (H2O's accumulator, MomentKV's u_j rows), when it has one.
template <Scorer S>
constexpr auto carried_state(S const& s) noexcept {
  if constexpr (requires { s.state.accumulated; })
    return s.state.accumulated;  // H2O's accumulator
  else if constexpr (requires { s.residuals.rows; })
    return s.residuals.rows;  // MomentKV's u_j rows (compaction skips them when disabled)
  else if constexpr (requires { s.state.window_rows; })
    return s.state.window_rows;  // UNComp's last w attention rows per slot
  else
    return nullptr;
}

/// The driver's per-layer state besides the buffer: decode forwards since the last compression.
struct DecodeCounter {
  Index steps = 0;
  Index compressions = 0;  ///< compressions run so far (a statistic for the engine)
};

/// Whether the next kvc::decode_step compresses (host only): an engine that replays captured CUDA graphs launches
/// the compressing step's graph then.
constexpr bool compresses_next(DecodeCounter const& counter, DecodeSchedule const& schedule) noexcept {
  return counter.steps + 1 >= schedule.compression_interval;
}

namespace detail {
/// Counts a decode step that ran (host only): a compression restarts the interval and empties the buffer.
template <Element T, class Space>
constexpr void count_decode_step(DecodeCounter& counter, QueryBuffer<T, Space>& buf, bool compressed) noexcept {
  if (!compressed) {
    ++counter.steps;
    return;
  }
  counter.steps = 0;
  ++counter.compressions;
  buf.count = 0;
}

/// kvc::compact of `cache` by `plan`, carrying the scorer's per-token state when it has one (carried_state).
template <Backend B, Scorer S, KVCacheView C>
Status compact_carrying(B const& backend, KeepPlan<typename B::memory_space> const& plan, C const& cache,
                        S const& scorer) {
  if constexpr (std::is_same_v<decltype(carried_state(scorer)), std::nullptr_t>)
    return compact(backend, plan, cache);
  else
    return compact(backend, plan, cache, carried_state(scorer));
}

/// Buffered rows [first, first + n) as window queries (pre-RoPE, rotated by `rope` at their positions).
template <Element T, class Space>
constexpr auto decode_window(QueryBuffer<T, Space> const& buf, Index first, Index n, RopeTable<Space> const& rope) {
  return WindowQueries<T, Space>{buf.rows(first, n), rope, buf.positions + first, buf.capacity};
}

}  // namespace detail

/// Workspace kvc::decode_step needs (any alignment), for a cache with key extents `keys` and buffer `buf`: the plan,
/// statistics when the scorer reads them, and the largest of update's and compress's scratch. `selector` is the
/// selection compressions run (the overload without it: schedule.selector()).
template <Backend B, Scorer S, Selector Sel, Element T, class Space>
std::size_t decode_workspace_bytes(B const& backend, S const& scorer, Sel const& selector,
                                   DecodeSchedule const& schedule, KVExtents const& keys,
                                   QueryBuffer<T, Space> const& buf) {
  Index const rows =
      buf.capacity < schedule.hidden_states_buffer_size ? buf.capacity : schedule.hidden_states_buffer_size;
  auto const wq = observe(WindowQueries<T, Space>{buf.rows(0, rows), {}, buf.positions});
  Press const press{scorer, selector};
  std::size_t compress_bytes = 0;
  if constexpr (has_need(S::needs, Needs::query_statistics)) {
    auto const stats = observe(QueryStatistics<Space>{nullptr, nullptr, keys.batch, buf.heads, keys.dim});
    compress_bytes =
        bytes_sum(compress_workspace_bytes(backend, press, keys, stats),
                  workspace_round(bytes_product(keys.batch, buf.heads, keys.dim, sizeof(float))),
                  workspace_round(bytes_product(keys.batch, buf.heads, keys.dim * keys.dim, sizeof(float))),
                  query_statistics_workspace_bytes(backend, buf.rows(0, buf.capacity).extents()));
  } else if constexpr (has_need(S::needs, Needs::window_queries)) {
    compress_bytes = compress_workspace_bytes(backend, press, keys, wq);
  } else {
    compress_bytes = compress_workspace_bytes(backend, press, keys);
  }
  std::size_t update_bytes =
      update_workspace_bytes(backend, scorer, keys, observe(WindowQueries<T, Space>{buf.rows(0, buf.capacity)}));
  std::size_t const evict_bytes = on_evict_workspace_bytes(backend, scorer, keys);
  update_bytes = update_bytes > evict_bytes ? update_bytes : evict_bytes;
  std::size_t const plan_bytes = bytes_sum(workspace_round(bytes_product(keys.rows(), sizeof(Index))),
                                           workspace_round(bytes_product(keys.batch, keys.heads, sizeof(Index))));
  return bytes_sum(plan_bytes, compress_bytes > update_bytes ? compress_bytes : update_bytes, workspace_slack);
}

template <Backend B, Scorer S, Element T, class Space>
std::size_t decode_workspace_bytes(B const& backend, S const& scorer, DecodeSchedule const& schedule,
                                   KVExtents const& keys, QueryBuffer<T, Space> const& buf) {
  return decode_workspace_bytes(backend, scorer, schedule.selector(), schedule, keys, buf);
}

/// One decode forward of one layer (after the engine appended the new tokens and pushed their queries): folds the
/// fresh queries into a stateful scorer, counts the step, and at the interval compresses `cache` in place (see the
/// file comment). `rope` rotates the buffered pre-RoPE queries (and re-rotates keys when asked). `compressed`
/// (optional) reports whether this step compressed. Workspace: decode_workspace_bytes(). The cache needs a per-head
/// length table (compaction writes it) and, for re-rotation, a positions table. `selector` is the selection each
/// compression runs, in place of schedule.selector() (whose target_size, n_sink and n_recent it then replaces): e.g.
/// AdaKVSelector<FixedBudget>{{target}, alpha} for per-head budgets, on a ragged store (store/ragged.hpp) so that the
/// memory is freed. A selector must never keep more than a head holds, so the cache's segments always suffice.
template <Backend Bk, Scorer S, Selector Sel, KVCacheView C, Element T>
Status decode_step(Bk const& backend, S const& scorer, Sel const& selector, DecodeSchedule const& schedule,
                   C const& cache, QueryBuffer<T, typename Bk::memory_space>& buf, DecodeCounter& counter,
                   RopeTable<typename Bk::memory_space> const& rope, Workspace ws, bool* compressed = nullptr) {
  using Space = typename Bk::memory_space;
  KVC_RETURN_IF_ERROR(schedule.check());
  if (schedule.rerotate_keys && !HasKernel<RerotateStep, Bk>)
    return {Errc::invalid_argument,
            "kvc::decode_step: rerotate_keys needs the backend's re-rotation kernel (include "
            "<kvc/backend/cpu/pipeline/rerotate.hpp>; the CUDA backend has none yet)"};
  KVExtents const e = cache.keys.extents();
  KVC_RETURN_IF_ERROR(detail::check_cache(cache, KVC_CACHE_MESSAGES("kvc::decode_step", "the cache")));
  KVC_RETURN_IF_ERROR(detail::check_compactable_lengths(
      cache.lengths, e.heads,
      "kvc::decode_step: the cache needs a per-head length table (compaction writes each head's kept count)"));
  Index buffered = 0;  // elements of the buffer's rows
  if (buf.batch != e.batch || buf.dim != e.dim || e.heads < 1 || buf.heads < 1 || buf.heads % e.heads != 0 ||
      buf.capacity < 0 || !checked_product(buffered, buf.batch, buf.heads, buf.capacity, buf.dim) || buf.count < 0 ||
      buf.count > buf.capacity || buf.fresh < 0 || buf.fresh > buf.count)
    return {Errc::invalid_argument,
            "kvc::decode_step: the query buffer must be [batch, Hq, capacity, d_k] of the cache"};
  // Rows are read at data + offsets and positions at positions + first: null pointers would be offset (undefined).
  if (buf.data == nullptr && buffered > 0)
    return {Errc::invalid_argument, "kvc::decode_step: the query buffer's `data` ([batch, Hq, capacity, d_k]) is null"};
  if (buf.positions == nullptr && buf.batch * buf.capacity > 0)
    return {Errc::invalid_argument, "kvc::decode_step: the query buffer's `positions` ([batch, capacity]) are null"};
  if (detail::overlaps_cache(detail::bytes_of(buf.data, buffered), cache) ||
      detail::overlaps_cache(detail::bytes_of(buf.positions, buf.batch * buf.capacity), cache) ||
      detail::overlaps_cache(detail::bytes_of(buf.fill, buf.fill ? 1 : 0), cache))
    return {Errc::invalid_argument, "kvc::decode_step: the query buffer overlaps the cache's keys or values"};
  if (detail::overlaps_cache(detail::bytes_of(ws), cache))
    return {Errc::invalid_argument, "kvc::decode_step: the workspace overlaps the cache's keys or values"};
  if (buf.fill != nullptr && !HasKernel<ZeroStateStep, Bk>)
    return {Errc::invalid_argument,
            "kvc::decode_step: a query buffer with a `fill` needs the state kernels (include "
            "<kvc/backend/cpu/pipeline/state.hpp> or <kvc/backend/cuda/pipeline/state.cuh>)"};
  if (compressed)
    *compressed = false;
  WorkspaceCarver carve(ws);
  KeepPlan<Space> plan{carve.take<Index>(e.rows()), carve.take<Index>(e.batch * e.heads), e.batch, e.heads, e.tokens};
  Workspace const free = carve.rest();
  if ((plan.count == nullptr && e.batch * e.heads > 0) ||
      ws.bytes < decode_workspace_bytes(backend, scorer, selector, schedule, e, buf))
    return {Errc::out_of_capacity, "kvc::decode_step: workspace smaller than decode_workspace_bytes()"};

  if constexpr (StatefulScorer<S>) {  // H2O: the fresh queries' attention joins the accumulator
    if (buf.fresh > 0)
      KVC_RETURN_IF_ERROR(update(backend, scorer, cache,
                                 observe(detail::decode_window(buf, buf.count - buf.fresh, buf.fresh, rope)), free));
  }
  buf.fresh = 0;
  if (!compresses_next(counter, schedule)) {
    detail::count_decode_step(counter, buf, false);
    return {};
  }

  Index const n = buf.count < schedule.hidden_states_buffer_size ? buf.count : schedule.hidden_states_buffer_size;
  Press const press{scorer, selector};
  if constexpr (has_need(S::needs, Needs::query_statistics)) {
    WorkspaceCarver sc(free);
    float* mean = sc.take<float>(e.batch * buf.heads * e.dim);
    float* cov = sc.take<float>(e.batch * buf.heads * e.dim * e.dim);
    Workspace const after = sc.rest();
    // Authors: samples at absolute positions >= n_sink, t0 the next position; kvpress: the buffer without its first
    // n_sink rows, t0 its length (docs/policies/expected_attention.md, decisions A1 and A2).
    bool const kvpress = scorer.reference == Reference::kvpress;
    // Rows [count - n, count) of the whole buffer (its positions are [batch, capacity]).
    StatisticsRows const sample{kvpress ? 0 : scorer.n_sink, buf.count - n + (kvpress ? scorer.n_sink : 0), buf.count};
    KVC_RETURN_IF_ERROR(query_statistics(backend, buf.rows(0, buf.capacity), buf.positions, sample, mean,
                                         scorer.use_covariance ? cov : nullptr, after));
    QueryStatistics<Space> const stats{mean, cov, e.batch, buf.heads, e.dim, rope, nullptr, n};
    KVC_RETURN_IF_ERROR(compress(backend, press, cache, observe(stats), plan, after));
  } else if constexpr (has_need(S::needs, Needs::window_queries)) {
    KVC_RETURN_IF_ERROR(
        compress(backend, press, cache, observe(detail::decode_window(buf, buf.count - n, n, rope)), plan, free));
  } else {
    KVC_RETURN_IF_ERROR(compress(backend, press, cache, plan, free));
  }
  KVC_RETURN_IF_ERROR(on_evict(backend, scorer, cache, plan, free));
  KVC_RETURN_IF_ERROR(detail::compact_carrying(backend, plan, cache, scorer));
  if constexpr (HasKernel<RerotateStep, Bk>) {
    if (schedule.rerotate_keys)
      KVC_RETURN_IF_ERROR(rerotate_keys(backend, rope, cache));
  }
  if constexpr (HasKernel<ZeroStateStep, Bk>) {
    if (buf.fill)  // the backend's copy of the fill empties with the buffer
      KVC_RETURN_IF_ERROR(zero_state(backend, buf.fill, sizeof(Index)));
  }
  detail::count_decode_step(counter, buf, true);
  if (compressed)
    *compressed = true;
  return {};
}

/// kvc::decode_step with the schedule's own selection (TopKSelector<FixedBudget>{target_size, n_sink, n_recent}).
template <Backend Bk, Scorer S, KVCacheView C, Element T>
Status decode_step(Bk const& backend, S const& scorer, DecodeSchedule const& schedule, C const& cache,
                   QueryBuffer<T, typename Bk::memory_space>& buf, DecodeCounter& counter,
                   RopeTable<typename Bk::memory_space> const& rope, Workspace ws, bool* compressed = nullptr) {
  return decode_step(backend, scorer, schedule.selector(), schedule, cache, buf, counter, rope, ws, compressed);
}

}  // namespace kvc
