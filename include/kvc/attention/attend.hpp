// SPDX-License-Identifier: Apache-2.0
// kvc/attention/attend.hpp: softmax attention over a full or compressed cache, as a backend kernel step.
//
// out[b, q, i] = sum_j softmax_j(scale * <query[b, q, i], key[b, kv(q), j]>) value[b, kv(q), j] over the valid
// slots j of KV head kv(q) = q / (Hq / Hkv) (GQA, consecutive groups as Hugging Face repeat_kv), masked causally by
// the cache's positions: query i sees slot j iff position(b, kv, j) <= its own position. fp32 accumulation; queries
// in fp32, fp16 or bf16; dense, strided and paged caches. Kernels: Kernel<Attention, B> in backend/*/attention/.
#pragma once

#include <kvc/core/backend.hpp>
#include <kvc/core/checks.hpp>
#include <kvc/core/element.hpp>
#include <kvc/core/kernel.hpp>
#include <kvc/core/kv_view.hpp>
#include <kvc/core/layout.hpp>
#include <kvc/core/status.hpp>
#include <kvc/core/workspace.hpp>

#include <cstddef>

namespace kvc {

/// Parameters of the attention step.
struct Attention {
  float scale = 0.0f;  ///< logit scale; 0 = 1 / sqrt(d_k)
  bool causal = true;  ///< mask slots whose position is past the query's
};

/// Queries of kvc::attend: rows [batch, Hq, n, d_k] (post-RoPE) and optional positions [batch, n] for the causal
/// mask (absent: the last n positions of the context, see kvc::context_end).
template <Element T, class Space = HostSpace>
struct AttendQueries {
  using memory_space = Space;
  TokenRows<T const, StridedLayout, Space> rows;
  Index const* positions = nullptr;
};

/// Outputs of kvc::attend: `out` [batch, Hq, n, d_v] fp32 (contiguous) and, when non-null, `lse` [batch, Hq, n]
/// (natural log of the softmax denominator in scaled-logit units). A query that sees no slot gets zeros and
/// lse = -inf.
template <class Space = HostSpace>
struct AttendOutput {
  using memory_space = Space;
  float* out = nullptr;
  float* lse = nullptr;
};

/// Bytes of workspace kvc::attend needs (any alignment; one copy per CPU worker).
template <Backend B, KVCacheView C, Element T>
std::size_t attend_workspace_bytes(B const& backend, Attention const& op,
                                   AttendQueries<T, typename B::memory_space> const& q, C const& cache) {
  static_assert(HasKernel<Attention, B>,
                "kvc::attend: include <kvc/backend/cpu/attention/attend.hpp> (kvc::Cpu) or "
                "<kvc/backend/cuda/attention/attend.cuh> (kvc::Cuda)");
  if constexpr (HasKernel<Attention, B>)
    return bytes_sum(Kernel<Attention, B>::workspace_bytes(backend, op, q, cache), workspace_slack);
  else
    return 0;
}

/// Attention of `queries` over `cache` into `out`. Errors: the cache's checks (detail::check_cache), shapes, a
/// negative or NaN scale, `out` or the workspace overlapping the cache, the queries or each other
/// (invalid_argument), workspace too small (out_of_capacity). A slot whose logit is not finite (a NaN or Inf key)
/// is skipped like a masked one; a query that sees no finite slot gets zeros and lse = -inf (docs/numerics.md).
template <Backend B, KVCacheView C, Element T>
Status attend(B const& backend, Attention const& op, AttendQueries<T, typename B::memory_space> const& queries,
              C const& cache, AttendOutput<typename B::memory_space> out, Workspace ws) {
  static_assert(AccessibleFrom<C, B>, "kvc::attend: the cache lives in a memory space this backend cannot read");
  static_assert(HasKernel<Attention, B>,
                "kvc::attend: include <kvc/backend/cpu/attention/attend.hpp> (kvc::Cpu) or "
                "<kvc/backend/cuda/attention/attend.cuh> (kvc::Cuda)");
  if constexpr (AccessibleFrom<C, B> && HasKernel<Attention, B>) {
    KVExtents const q = queries.rows.extents(), k = cache.keys.extents();
    KVC_RETURN_IF_ERROR(detail::check_cache(cache, KVC_CACHE_MESSAGES("kvc::attend", "the cache")));
    Index outputs = 0;  // out.out's elements, [batch, Hq, n, d_v]
    if (!extents_fit(q) || !checked_product(outputs, q.rows(), cache.values.extents().dim))
      return {Errc::invalid_argument,
              "kvc::attend: the queries' extents must be >= 0 and [batch, Hq, n, max(d_k, d_v)] must fit in 64 bits"};
    if (q.batch != k.batch || q.dim != k.dim)
      return {Errc::invalid_argument, "kvc::attend: queries must have the keys' batch and d_k"};
    if (k.heads <= 0 || q.heads % k.heads != 0)
      return {Errc::invalid_argument, "kvc::attend: query heads must be a multiple of KV heads (GQA)"};
    if (!(op.scale >= 0.0f))
      return {Errc::invalid_argument, "kvc::attend: `op.scale` must be >= 0 (0 = 1 / sqrt(d_k))"};
    if (out.out == nullptr && q.rows() > 0)
      return {Errc::invalid_argument, "kvc::attend: `out.out` is null"};
    if (queries.rows.data() == nullptr && q.rows() > 0)
      return {Errc::invalid_argument, "kvc::attend: the queries' data pointer is null"};
    if (ws.bytes < Kernel<Attention, B>::workspace_bytes(backend, op, queries, cache))
      return {Errc::out_of_capacity, "kvc::attend: workspace smaller than attend_workspace_bytes()"};
    // Outputs are written while K, V and the queries are still read (by other heads, or later tiles).
    detail::ByteRange const o = detail::bytes_of(out.out, outputs), lse = detail::bytes_of(out.lse, q.rows()),
                            read = detail::bytes_of(queries.rows), scratch = detail::bytes_of(ws);
    if (detail::overlaps_cache(o, cache))
      return {Errc::invalid_argument, "kvc::attend: `out.out` overlaps the cache's keys or values"};
    if (detail::overlaps_cache(lse, cache))
      return {Errc::invalid_argument, "kvc::attend: `out.lse` overlaps the cache's keys or values"};
    if (detail::overlap(o, read) || detail::overlap(lse, read) || detail::overlap(o, lse))
      return {Errc::invalid_argument, "kvc::attend: `out.out`, `out.lse` and the queries must not overlap"};
    if (detail::overlaps_cache(scratch, cache) || detail::overlap(scratch, read) || detail::overlap(scratch, o) ||
        detail::overlap(scratch, lse))
      return {Errc::invalid_argument, "kvc::attend: the workspace overlaps the cache, the queries or `out`"};
    return Kernel<Attention, B>::run(backend, op, queries, cache, out, ws);
  } else {
    return {Errc::invalid_argument, "unreachable"};
  }
}

}  // namespace kvc
