// SPDX-License-Identifier: Apache-2.0
// kvc/pipeline/state.hpp: the small operations drivers run on caller-owned state in the backend's memory, so that
// no driver touches device memory from the host (a CUDA decode step stays capturable into a graph):
//   kvc::zero_state     zero a byte range (a new sequence: accumulators, moments, tracked counts);
//   kvc::copy_indices   copy an Index table (e.g. the per-head lengths before a compression);
//   kvc::decode_budgets each head's budget while decoding from its lengths before and after a prefill compression
//                       (MomentKV with AdaKV: Algorithm 1 returns every head to its own count);
//   kvc::push_queries   append query rows and their positions to a QueryBuffer (the decode driver's window).
// Kernels: Kernel<ZeroStateStep / CopyIndicesStep / DecodeBudgetsStep / PushQueriesStep, B> in
// backend/*/pipeline/state.
#pragma once

#include <kvc/core/backend.hpp>
#include <kvc/core/checks.hpp>
#include <kvc/core/element.hpp>
#include <kvc/core/kernel.hpp>
#include <kvc/core/layout.hpp>
#include <kvc/core/status.hpp>

#include <cstddef>

namespace kvc {

/// Step tags of the kernel pattern (core/kernel.hpp).
struct ZeroStateStep {};
struct CopyIndicesStep {};
struct DecodeBudgetsStep {};
struct PushQueriesStep {};

/// A layer's buffer of the pre-RoPE queries seen since the last compression: rows [batch, Hq, capacity, d] and
/// their absolute positions [batch, capacity], in the backend's memory space, caller-owned. `count` (host) rows are
/// valid; compression empties it. Capacity must hold every row of an interval (compression_interval x rows per
/// forward): kvpress keeps only the last hidden_states_buffer_size rows, so this costs more memory when the interval
/// is longer than the buffer, and in return rows never move.
/// `fill` (optional, one Index in the backend's memory) mirrors `count` where kernels can read it: on CUDA
/// push_queries writes the new rows at *fill and advances it, and a compression zeroes it, so the push of a CUDA graph
/// captured at one step writes at the right rows when replayed at a later one (rows it would write past the capacity
/// are dropped); on the CPU, where nothing is captured, the rows go to `count` and *fill is set to the new count. The
/// host's `count` stays what the checks and the compression's window read; the two agree as long as every push and
/// compression goes through kvc (or a replay of one: LayerCompressor::replayed).
template <Element T, class Space = HostSpace>
struct QueryBuffer {
  using memory_space = Space;

  T* data = nullptr;
  Index* positions = nullptr;
  Index batch = 0;
  Index heads = 0;
  Index capacity = 0;
  Index dim = 0;
  Index count = 0;        ///< valid rows [0, count)
  Index fresh = 0;        ///< rows pushed since the last decode_step (the new queries a stateful scorer folds in)
  Index* fill = nullptr;  ///< optional: `count` in the backend's memory (see above)

  /// Where row i of (b, q) lives (the engine writes new queries at i = count ...).
  KVC_HOST_DEVICE constexpr T* row(Index b, Index q, Index i) const noexcept {
    return data + ((b * heads + q) * capacity + i) * dim;
  }
  /// Rows [first, first + n) as a read-only strided view [batch, Hq, n, d].
  constexpr TokenRows<T const, StridedLayout, Space> rows(Index first, Index n) const noexcept {
    return {data + first * dim, StridedLayout{{batch, heads, n, dim}, heads * capacity * dim, capacity * dim, dim}};
  }
  /// Records `n` rows written at [count, count + n) (queries and positions). Errors when they do not fit.
  constexpr Status push(Index n) noexcept {
    if (n < 0 || n > capacity - count)
      return {Errc::out_of_capacity, "QueryBuffer::push: the buffer holds compression_interval steps of rows"};
    count += n;
    fresh += n;
    return {};
  }
};

namespace detail {
template <class B>
constexpr void require_state_kernels() {
  static_assert(HasKernel<ZeroStateStep, B> && HasKernel<CopyIndicesStep, B> && HasKernel<DecodeBudgetsStep, B> &&
                    HasKernel<PushQueriesStep, B>,
                "kvc: include <kvc/backend/cpu/pipeline/state.hpp> (kvc::Cpu) or <kvc/backend/cuda/pipeline/state.cuh> "
                "(kvc::Cuda)");
}
}  // namespace detail

/// Zeroes `bytes` bytes at `data` (memory in the backend's space; on CUDA enqueued on the backend's stream).
template <Backend B>
Status zero_state(B const& backend, void* data, std::size_t bytes) {
  detail::require_state_kernels<B>();
  if (data == nullptr && bytes > 0)
    return {Errc::invalid_argument, "kvc::zero_state: `data` is null"};
  if (bytes == 0)
    return {};
  return Kernel<ZeroStateStep, B>::run(backend, data, bytes);
}

/// Copies n Index values from `src` to `dst` (both in the backend's space, not overlapping).
template <Backend B>
Status copy_indices(B const& backend, Index* dst, Index const* src, Index n) {
  detail::require_state_kernels<B>();
  if (n < 0 || ((dst == nullptr || src == nullptr) && n > 0))
    return {Errc::invalid_argument, "kvc::copy_indices: need n >= 0 and non-null `dst` and `src`"};
  if (detail::overlap(detail::bytes_of(dst, n), detail::bytes_of(src, n)))
    return {Errc::invalid_argument, "kvc::copy_indices: `dst` and `src` overlap"};
  if (n == 0)
    return {};
  return Kernel<CopyIndicesStep, B>::run(backend, dst, src, n);
}

namespace detail {
/// One sequence's budgets while decoding, in place (both backends): `budgets` [heads] holds each head's length
/// before its prefill compression and receives its budget; `lengths` [heads] the lengths after. A compression that
/// evicted from some head leaves each head at its own length; one that evicted nothing (the prompt fit the
/// allocation) lets each head grow to max(length, target) before the schedule evicts.
KVC_HOST_DEVICE constexpr void decode_budgets_of(Index* budgets, Index const* lengths, Index heads,
                                                 Index target) noexcept {
  bool evicted = false;
  for (Index h = 0; h < heads; ++h)
    evicted = evicted || lengths[h] < budgets[h];
  for (Index h = 0; h < heads; ++h)
    budgets[h] = evicted || lengths[h] >= target ? lengths[h] : target;
}
}  // namespace detail

/// Turns `budgets` [batch, heads] (each head's length before a prefill compression, e.g. by kvc::copy_indices) into
/// each head's budget while decoding, from `lengths` [batch, heads] after it (detail::decode_budgets_of; both in the
/// backend's space, not overlapping): the budgets MomentKV with AdaKV holds while decoding.
template <Backend B>
Status decode_budgets(B const& backend, Index* budgets, Index const* lengths, Index batch, Index heads, Index target) {
  detail::require_state_kernels<B>();
  Index n = 0;
  if (batch < 0 || heads < 0 || target < 0 || !checked_product(n, batch, heads) ||
      ((budgets == nullptr || lengths == nullptr) && n > 0))
    return {Errc::invalid_argument,
            "kvc::decode_budgets: need batch, heads and target >= 0 and non-null `budgets` and `lengths`"};
  if (detail::overlap(detail::bytes_of(budgets, n), detail::bytes_of(lengths, n)))
    return {Errc::invalid_argument, "kvc::decode_budgets: `budgets` and `lengths` overlap"};
  if (n == 0)
    return {};
  return Kernel<DecodeBudgetsStep, B>::run(backend, budgets, lengths, batch, heads, target);
}

/// Appends query rows [batch, Hq, n, d] (the buffer's batch, heads and dim; any strided layout) and their absolute
/// positions [batch, n] (row i of sequence b at positions[b * n + i]) to `buf` at rows [count, count + n) (on the
/// device [*fill, *fill + n) when the buffer has a `fill`, which then advances by n), then records them
/// (QueryBuffer::push). Errors before anything is written: shapes, null pointers, rows overlapping the
/// buffer, n past the buffer's capacity (out_of_capacity).
template <Backend B, Element T>
Status push_queries(B const& backend, QueryBuffer<T, typename B::memory_space>& buf,
                    TokenRows<T const, StridedLayout, typename B::memory_space> const& rows, Index const* positions) {
  detail::require_state_kernels<B>();
  KVExtents const e = rows.extents();
  if (!extents_fit(e) || e.batch != buf.batch || e.heads != buf.heads || e.dim != buf.dim)
    return {Errc::invalid_argument, "kvc::push_queries: rows must be [batch, Hq, n, d] of the query buffer"};
  if (e.tokens > buf.capacity - buf.count)
    return {Errc::out_of_capacity,
            "kvc::push_queries: the rows do not fit the buffer (it holds compression_interval steps of rows)"};
  if (e.rows() == 0)
    return buf.push(e.tokens);
  if (rows.data() == nullptr || positions == nullptr || buf.data == nullptr || buf.positions == nullptr)
    return {Errc::invalid_argument, "kvc::push_queries: rows, positions and the buffer must be non-null"};
  Index const buffered = buf.batch * buf.heads * buf.capacity * buf.dim;
  if (detail::overlap(detail::bytes_of(rows), detail::bytes_of(buf.data, buffered)) ||
      detail::overlap(detail::bytes_of(positions, e.batch * e.tokens),
                      detail::bytes_of(buf.positions, buf.batch * buf.capacity)))
    return {Errc::invalid_argument, "kvc::push_queries: the rows or positions overlap the buffer"};
  auto const fill = detail::bytes_of(buf.fill, buf.fill ? 1 : 0);
  if (detail::overlap(fill, detail::bytes_of(buf.data, buffered)) ||
      detail::overlap(fill, detail::bytes_of(buf.positions, buf.batch * buf.capacity)) ||
      detail::overlap(fill, detail::bytes_of(rows)) ||
      detail::overlap(fill, detail::bytes_of(positions, e.batch * e.tokens)))
    return {Errc::invalid_argument, "kvc::push_queries: the buffer's `fill` overlaps its rows, positions or the input"};
  using K = Kernel<PushQueriesStep, B>;
  KVC_RETURN_IF_ERROR(K::run(backend, buf, rows, positions));
  return buf.push(e.tokens);
}

}  // namespace kvc
