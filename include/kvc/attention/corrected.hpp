// SPDX-License-Identifier: Apache-2.0
// kvc/attention/corrected.hpp: MomentKV's normalisation-corrected attention (arXiv 2606.01563, §4.2, Eq. 12).
//
// The retained attention (o_R, lse_R) comes from kvc::attend over the compressed cache. The evicted set of KV head
// g(q) enters as one virtual token with log-weight and query-dependent value
//   lse_E = log n + c qᵀk̄                      (Jensen's lower bound of log Z_E, Eq. 11)
//   f̂_E(q) = v̄ + (c / n) C̃ q                    (first order, Eq. 9; MomentOrder::zeroth: v̄)
// and the two states merge in the log domain as split-KV partial attention does (FlashInfer's merge_state):
//   lse = logaddexp(lse_R, lse_E);  out = e^{lse_R − lse} o_R + e^{lse_E − lse} f̂_E.
// n = 0 leaves o_R unchanged (no 0/0). GQA: query head q reads the moments of KV head q / (Hq / Hkv); its G query
// heads share C̃, so their matvecs are one product. The evicted tokens are past every later query, so no mask
// applies to them. Kernels: Kernel<CorrectedAttention, B>::run merges in place after Kernel<Attention, B>.
#pragma once

#include <kvc/attention/attend.hpp>
#include <kvc/core/checks.hpp>
#include <kvc/scorers/moments.hpp>

#include <cstddef>

namespace kvc {

/// Parameters of the corrected attention step.
struct CorrectedAttention {
  Attention attention{};                   ///< the retained part (its scale is the correction's c)
  float clamp_tau = 1e-6f;                 ///< entries of C with |x| < clamp_tau read as 0 (paper App. C.2)
  MomentOrder order = MomentOrder::first;  ///< first (the paper's) or zeroth (the ablation)

  constexpr Status check() const noexcept {
    if (!(clamp_tau >= 0.0f) || !(attention.scale >= 0.0f))
      return {Errc::invalid_argument, "CorrectedAttention: `clamp_tau` and `attention.scale` must be >= 0"};
    return {};
  }
};

/// Bytes of workspace kvc::attend_corrected needs (any alignment).
template <Backend B, KVCacheView C, Element T, class MT>
std::size_t attend_corrected_workspace_bytes(B const& backend, CorrectedAttention const& op,
                                             AttendQueries<T, typename B::memory_space> const& q, C const& cache,
                                             MomentState<typename B::memory_space, MT> const& moments) {
  static_assert(HasKernel<CorrectedAttention, B>,
                "kvc::attend_corrected: include <kvc/backend/cpu/attention/corrected.hpp> (kvc::Cpu) or "
                "<kvc/backend/cuda/attention/corrected.cuh> (kvc::Cuda)");
  if constexpr (HasKernel<CorrectedAttention, B>) {
    std::size_t const attn = attend_workspace_bytes(backend, op.attention, q, cache);
    std::size_t const merge = Kernel<CorrectedAttention, B>::workspace_bytes(backend, op, q, cache, moments);
    // The lse buffer (carved even when the caller passes one), then the attention's or the merge's scratch.
    std::size_t const lse = workspace_round(bytes_product(q.rows.extents().rows(), sizeof(float)));
    return bytes_sum(lse, attn > merge ? attn : merge, workspace_slack);
  } else {
    return 0;
  }
}

/// Attention of `queries` over the retained `cache`, corrected by the `moments` of each KV head's evicted set, into
/// `out` (out.out [batch, Hq, n, d_v] fp32; out.lse, when non-null, the merged log-sum-exp [batch, Hq, n]).
/// Errors: those of kvc::attend, moments of another shape (invalid_argument), workspace too small.
template <Backend B, KVCacheView C, Element T, class MT>
Status attend_corrected(B const& backend, CorrectedAttention const& op,
                        AttendQueries<T, typename B::memory_space> const& queries, C const& cache,
                        MomentState<typename B::memory_space, MT> const& moments,
                        AttendOutput<typename B::memory_space> out, Workspace ws) {
  static_assert(HasKernel<CorrectedAttention, B>,
                "kvc::attend_corrected: include <kvc/backend/cpu/attention/corrected.hpp> (kvc::Cpu) or "
                "<kvc/backend/cuda/attention/corrected.cuh> (kvc::Cuda)");
  if constexpr (HasKernel<CorrectedAttention, B>) {
    KVC_RETURN_IF_ERROR(op.check());
    KVExtents const k = cache.keys.extents();
    KVC_RETURN_IF_ERROR(detail::check_cache(cache, KVC_CACHE_MESSAGES("kvc::attend_corrected", "the cache")));
    if (!extents_fit(queries.rows.extents()))
      return {Errc::invalid_argument,
              "kvc::attend_corrected: the queries' extents must be >= 0 and their element count fit in 64 bits"};
    KVC_RETURN_IF_ERROR(moments.check(k.batch, k.heads, k.dim, cache.values.extents().dim));
    // The merge reads the moments after the attention wrote `out` (attend checks `out` against the cache).
    Index const heads = saturating_product(k.batch, k.heads), rows = queries.rows.extents().rows();
    detail::ByteRange const moment_ranges[] = {
        detail::bytes_of(moments.count, heads), detail::bytes_of(moments.key_mean, saturating_product(heads, k.dim)),
        detail::bytes_of(moments.value_mean, saturating_product(heads, moments.value_dim)),
        detail::bytes_of(moments.comoment, saturating_product(heads, moments.value_dim, k.dim))};
    detail::ByteRange const o = detail::bytes_of(out.out, saturating_product(rows, moments.value_dim)),
                            l = detail::bytes_of(out.lse, rows);
    for (detail::ByteRange const m : moment_ranges)
      if (detail::overlap(m, o) || detail::overlap(m, l))
        return {Errc::invalid_argument, "kvc::attend_corrected: `out` overlaps the moments"};
    if (ws.bytes < attend_corrected_workspace_bytes(backend, op, queries, cache, moments))
      return {Errc::out_of_capacity,
              "kvc::attend_corrected: workspace smaller than attend_corrected_workspace_bytes()"};
    WorkspaceCarver carve(ws);
    float* own = carve.take<float>(queries.rows.extents().rows());
    float* lse = out.lse ? out.lse : own;
    Workspace const rest = carve.rest();
    KVC_RETURN_IF_ERROR(
        attend(backend, op.attention, queries, cache, AttendOutput<typename B::memory_space>{out.out, lse}, rest));
    return Kernel<CorrectedAttention, B>::run(backend, op, queries, cache, moments, out.out, lse, rest);
  } else {
    return {Errc::invalid_argument, "unreachable"};
  }
}

}  // namespace kvc
