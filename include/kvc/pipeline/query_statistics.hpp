// SPDX-License-Identifier: Apache-2.0
// kvc/pipeline/query_statistics.hpp: mean and covariance of pre-RoPE query samples per query head, the input of
// ExpectedAttention (kvc::QueryStatistics). Kernel: Kernel<QueryStatisticsStep, B> in backend/*/pipeline/.
//
// For sequence b and query head q, over the sample rows i of `queries` ([batch, Hq, R, d]) that pass `rows`:
//   mu    = (1/N) sum_i x_i                       (fp32 out; accumulated in fp64 on the CPU)
//   Sigma = (1/N) sum_i (x_i - mu)(x_i - mu)ᵀ     (population covariance, as kvpress; never inverted)
// N = 0 gives mu = 0 and Sigma = 0 (ExpectedAttention then ranks by ||v||: docs/policies/expected_attention.md, A3).
// Row order does not matter, so a ring buffer of decode queries can be passed as it lies.
#pragma once

#include <kvc/core/backend.hpp>
#include <kvc/core/checks.hpp>
#include <kvc/core/kernel.hpp>
#include <kvc/core/kv_view.hpp>
#include <kvc/core/layout.hpp>
#include <kvc/core/status.hpp>
#include <kvc/core/workspace.hpp>

#include <cstddef>

namespace kvc {

/// Step tag of kvc::query_statistics.
struct QueryStatisticsStep {};

/// Which sample rows count. Prefill: every context query but the sinks (`n_sink`). Decoding, authors (decision A2):
/// the buffer's rows whose absolute position is >= n_sink. Decoding, kvpress: the buffer without its first
/// `skip_rows` rows, whatever their positions.
struct StatisticsRows {
  Index n_sink = 0;     ///< rows whose absolute position is below this are left out
  Index skip_rows = 0;  ///< the first rows of the buffer are left out
  Index count = -1;     ///< rows [0, count) are valid (-1: all R rows), e.g. a part-filled buffer
};

/// Workspace kvc::query_statistics needs for queries of extents `q` ([batch, Hq, R, d]); any alignment.
template <Backend B>
std::size_t query_statistics_workspace_bytes(B const& backend, KVExtents const& q) {
  static_assert(HasKernel<QueryStatisticsStep, B>,
                "kvc::query_statistics: include <kvc/backend/cpu/pipeline/query_statistics.hpp> (kvc::Cpu) or "
                "<kvc/backend/cuda/pipeline/query_statistics.cuh> (kvc::Cuda)");
  return bytes_sum(Kernel<QueryStatisticsStep, B>::workspace_bytes(backend, q), workspace_slack);
}

/// Writes mean [batch, Hq, d] and, when non-null, covariance [batch, Hq, d, d] (row-major) of the sample rows of
/// `queries` (pre-RoPE, fp32/fp16/bf16, any strided layout). `positions` ([batch, R], optional): each row's absolute
/// position; absent, row i sits at position i (a prefilled context). All pointers in the backend's memory space.
/// Errors: null outputs, negative counts, a count past R (invalid_argument), workspace too small.
template <Backend B, Element T, class Space>
Status query_statistics(B const& backend, TokenRows<T const, StridedLayout, Space> const& queries,
                        Index const* positions, StatisticsRows const& rows, float* mean, float* covariance,
                        Workspace ws) {
  static_assert(std::is_same_v<Space, typename B::memory_space>,
                "kvc::query_statistics: the queries live in a memory space this backend cannot read");
  static_assert(HasKernel<QueryStatisticsStep, B>,
                "kvc::query_statistics: include <kvc/backend/cpu/pipeline/query_statistics.hpp> (kvc::Cpu) or "
                "<kvc/backend/cuda/pipeline/query_statistics.cuh> (kvc::Cuda)");
  KVExtents const e = queries.extents();
  if (!extents_fit(e))
    return {Errc::invalid_argument,
            "kvc::query_statistics: the queries' extents must be >= 0 and their element count fit in 64 bits"};
  if (mean == nullptr && e.batch * e.heads * e.dim > 0)
    return {Errc::invalid_argument, "kvc::query_statistics: `mean` is null"};
  // The outputs are written while the rows are read.
  detail::ByteRange const read = detail::bytes_of(queries),
                          m = detail::bytes_of(mean, saturating_product(e.batch, e.heads, e.dim)),
                          c = detail::bytes_of(covariance, saturating_product(e.batch, e.heads, e.dim, e.dim));
  if (detail::overlap(m, read) || detail::overlap(c, read) || detail::overlap(m, c))
    return {Errc::invalid_argument, "kvc::query_statistics: `mean`, `covariance` and the queries must not overlap"};
  if (queries.data() == nullptr && e.rows() > 0)
    return {Errc::invalid_argument, "kvc::query_statistics: `queries` data is null"};
  if (rows.n_sink < 0 || rows.skip_rows < 0 || rows.count < -1 || rows.count > e.tokens)
    return {Errc::invalid_argument,
            "kvc::query_statistics: `n_sink` and `skip_rows` must be >= 0 and `count` in [-1, rows]"};
  if (ws.bytes < Kernel<QueryStatisticsStep, B>::workspace_bytes(backend, e))
    return {Errc::out_of_capacity, "kvc::query_statistics: workspace smaller than query_statistics_workspace_bytes()"};
  return Kernel<QueryStatisticsStep, B>::run(backend, queries, positions, rows, mean, covariance, ws);
}

}  // namespace kvc
