// SPDX-License-Identifier: Apache-2.0
// kvc/attention/merge.hpp: the merge of two attention results over disjoint token sets by their log-sum-exps
// (split-KV / FlashInfer's merge_state): the packed zones (kvc::attend_packed) and the FP16 decode tail
// (kvc::attend over an ordinary cache), or any other split of a head's tokens.
//
// For a row with (o_a, lse_a) over set A and (o_b, lse_b) over set B, attention over A ∪ B is
//   lse = logaddexp(lse_a, lse_b);  o = e^{lse_a − lse} o_a + e^{lse_b − lse} o_b
// exactly (both lse in the same scaled-logit units, i.e. the same Attention::scale). It is MomentKV's merge of the
// retained and evicted states (scorers/moments.hpp, detail::merge_evicted: the weights from one e^{−|lse_a − lse_b|},
// stable for any magnitude), reused here as it is. An empty side (lse = -inf: no token visible) leaves the other.
#pragma once

#include <kvc/core/backend.hpp>
#include <kvc/core/extents.hpp>
#include <kvc/core/kernel.hpp>
#include <kvc/core/status.hpp>
#include <kvc/scorers/moments.hpp>

namespace kvc {

/// One row: out_a [dim] and *lse_a become the merge of (out_a, *lse_a) and (out_b, lse_b). Host and device.
KVC_HOST_DEVICE inline void merge_attention_row(float* out_a, float* lse_a, float const* out_b, float lse_b,
                                                Index dim) noexcept {
  *lse_a = detail::merge_evicted(out_a, *lse_a, out_b, lse_b, dim);
}

/// Merges `rows` rows in place into (out_a [rows, dim], lse_a [rows]) from (out_b [rows, dim], lse_b [rows]), all
/// fp32 host memory (e.g. AttendOutput of kvc::attend_packed and of kvc::attend over the tail, [batch, Hq, n] rows).
/// Errors: negative sizes or null pointers with rows > 0 (invalid_argument).
inline Status merge_attention(float* out_a, float* lse_a, float const* out_b, float const* lse_b, Index rows,
                              Index dim) noexcept {
  if (rows < 0 || dim < 0)
    return {Errc::invalid_argument, "kvc::merge_attention: `rows` and `dim` must be >= 0"};
  if (rows > 0 && (out_a == nullptr || lse_a == nullptr || out_b == nullptr || lse_b == nullptr))
    return {Errc::invalid_argument, "kvc::merge_attention: `out_a`, `lse_a`, `out_b` and `lse_b` must be non-null"};
  for (Index r = 0; r < rows; ++r)
    merge_attention_row(out_a + r * dim, lse_a + r, out_b + r * dim, lse_b[r], dim);
  return {};
}

/// Step tag of the backend merge (core/kernel.hpp): Kernel<MergeStep, B> in backend/*/attention/merge.
struct MergeStep {};

/// merge_attention on a backend: the same rows in the backend's memory space (on CUDA enqueued on its stream).
template <Backend B>
Status merge_attention(B const& backend, float* out_a, float* lse_a, float const* out_b, float const* lse_b, Index rows,
                       Index dim) {
  static_assert(HasKernel<MergeStep, B>,
                "kvc::merge_attention: include <kvc/backend/cpu/attention/merge.hpp> (kvc::Cpu) or "
                "<kvc/backend/cuda/attention/merge.cuh> (kvc::Cuda)");
  if (rows < 0 || dim < 0)
    return {Errc::invalid_argument, "kvc::merge_attention: `rows` and `dim` must be >= 0"};
  if (rows > 0 && (out_a == nullptr || lse_a == nullptr || out_b == nullptr || lse_b == nullptr))
    return {Errc::invalid_argument, "kvc::merge_attention: `out_a`, `lse_a`, `out_b` and `lse_b` must be non-null"};
  if (rows == 0)
    return {};
  return Kernel<MergeStep, B>::run(backend, out_a, lse_a, out_b, lse_b, rows, dim);
}

}  // namespace kvc
