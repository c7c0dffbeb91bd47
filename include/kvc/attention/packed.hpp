// SPDX-License-Identifier: Apache-2.0
// kvc/attention/packed.hpp: attention over the packed store (RDKV / KIVI zones A + B, RDKV's Fig. 3), reading the
// codes directly and dequantising in registers: the point of the packed store is the memory it frees, which an
// unpack to 16 bits before attention would give back (and pay for with a pass over the cache).
//
// out[b, q, i] = Σ_t softmax_t(scale · <query[b, q, i], k̂_t>) v̂_t over the kept tokens t of KV head q / (Hq / Hkv)
// (GQA as kvc::attend), masked causally by the stored positions, where k̂, v̂ are the dequantised K and V
// (store/packed.hpp's dequantized()). It equals kvc::attend over a cache of those dequantised tokens up to fp32
// summation order. Evicted tokens (V bits 0) are not in the softmax (true removal, docs/policies/rdkv.md decision A2);
// a pruned K channel contributes exactly 0 to every logit. The decode tail (zone C: tokens appended after packing, or
// KIVI's FP16 residual window) is an ordinary kvc cache attended with kvc::attend and merged by kvc::merge_attention
// (attention/merge.hpp) through both results' log-sum-exps. Kernels: Kernel<PackedAttention, B> in
// backend/*/attention/packed.hpp.
#pragma once

#include <kvc/attention/attend.hpp>
#include <kvc/core/backend.hpp>
#include <kvc/core/element.hpp>
#include <kvc/core/kernel.hpp>
#include <kvc/core/status.hpp>
#include <kvc/core/workspace.hpp>
#include <kvc/store/packed.hpp>

#include <cstddef>

namespace kvc {

/// The packed-attention step: kvc::Attention's parameters (scale, causal) over a PackedKVView.
struct PackedAttention {
  Attention attention{};
};

/// Bytes of workspace kvc::attend_packed needs (any alignment; one copy per CPU worker).
template <Backend B, Element T>
std::size_t attend_packed_workspace_bytes(B const& backend, Attention const& op,
                                          AttendQueries<T, typename B::memory_space> const& queries,
                                          PackedKVView<typename B::memory_space> const& kv) {
  static_assert(HasKernel<PackedAttention, B>,
                "kvc::attend_packed: include <kvc/backend/cpu/attention/packed.hpp> (kvc::Cpu)");
  if constexpr (HasKernel<PackedAttention, B>)
    return bytes_sum(Kernel<PackedAttention, B>::workspace_bytes(backend, PackedAttention{op}, queries, kv),
                     workspace_slack);
  else
    return 0;
}

/// Attention of `queries` [batch, Hq, n, d_k] (post-RoPE; fp32, fp16 or bf16; positions [batch, n] or, when null,
/// the last n positions before the context end = 1 + the largest stored position of the sequence's heads) over the
/// packed layer `kv`, into out.out [batch, Hq, n, d_v] fp32 and out.lse [batch, Hq, n] (natural log of the softmax
/// denominator in scaled-logit units; may be null). A row that sees no token (an empty head, or the causal mask)
/// gets zeros and lse = -inf. Errors (invalid_argument unless noted): queries' batch or d_k differ from the view's,
/// Hq not a multiple of the KV heads, null pointers, a malformed view, workspace too small (out_of_capacity).
template <Backend B, Element T>
Status attend_packed(B const& backend, Attention const& op, AttendQueries<T, typename B::memory_space> const& queries,
                     PackedKVView<typename B::memory_space> const& kv, AttendOutput<typename B::memory_space> out,
                     Workspace ws) {
  static_assert(HasKernel<PackedAttention, B>,
                "kvc::attend_packed: include <kvc/backend/cpu/attention/packed.hpp> (kvc::Cpu)");
  if constexpr (HasKernel<PackedAttention, B>) {
    KVExtents const q = queries.rows.extents();
    if (!extents_fit(q))
      return {Errc::invalid_argument,
              "kvc::attend_packed: the queries' extents must be >= 0 and their element count fit in 64 bits"};
    KVC_RETURN_IF_ERROR(check_packed_view(kv,
                                          "kvc::attend_packed: malformed PackedKVView (negative sizes or null "
                                          "tables)"));
    if (q.batch != kv.batch || q.dim != kv.dim)
      return {Errc::invalid_argument, "kvc::attend_packed: queries must have the packed layer's batch and d_k"};
    if (kv.kv_heads <= 0 || q.heads % kv.kv_heads != 0)
      return {Errc::invalid_argument, "kvc::attend_packed: query heads must be a multiple of KV heads (GQA)"};
    if (!(op.scale >= 0.0f))
      return {Errc::invalid_argument, "kvc::attend_packed: `op.scale` must be >= 0 (0 = 1 / sqrt(d_k))"};
    if (out.out == nullptr && q.rows() > 0)
      return {Errc::invalid_argument, "kvc::attend_packed: `out.out` is null"};
    if (queries.rows.data() == nullptr && q.rows() > 0)
      return {Errc::invalid_argument, "kvc::attend_packed: the queries' data pointer is null"};
    // The outputs are written while the queries are still read (the packed arena's extent is in its descriptors).
    detail::ByteRange const o = detail::bytes_of(out.out, saturating_product(q.rows(), kv.value_dim)),
                            lse = detail::bytes_of(out.lse, q.rows()), read = detail::bytes_of(queries.rows);
    if (detail::overlap(o, read) || detail::overlap(lse, read) || detail::overlap(o, lse))
      return {Errc::invalid_argument, "kvc::attend_packed: `out.out`, `out.lse` and the queries must not overlap"};
    PackedAttention const pop{op};
    if (ws.bytes < Kernel<PackedAttention, B>::workspace_bytes(backend, pop, queries, kv))
      return {Errc::out_of_capacity, "kvc::attend_packed: workspace smaller than attend_packed_workspace_bytes()"};
    return Kernel<PackedAttention, B>::run(backend, pop, queries, kv, out, ws);
  } else {
    return {Errc::invalid_argument, "unreachable"};
  }
}

}  // namespace kvc
