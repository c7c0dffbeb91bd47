// SPDX-License-Identifier: Apache-2.0
// kvc/backend/cpu/attention/attend.hpp: CPU reference attention and the full-vs-compressed error measurement.
#pragma once

#include <kvc/attention/attend.hpp>
#include <kvc/backend/cpu/detail/rows.hpp>
#include <kvc/core/status.hpp>
#include <kvc/core/workspace.hpp>

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <vector>

namespace kvc {

/// Workspace of kvc::attend (any alignment): one logit per cache slot plus one widened row.
inline std::size_t attend_workspace_bytes(KVExtents const& keys, Index dim_v) {
  return workspace_round(static_cast<std::size_t>(keys.tokens) * sizeof(float)) +
         workspace_round(static_cast<std::size_t>(std::max(keys.dim, dim_v)) * sizeof(float)) + workspace_slack;
}

/// Softmax attention of `queries` [B, H, Nq, d_k] over `cache` (GQA: query head q reads KV head q / (H / Hkv),
/// consecutive heads as in HF repeat_kv). Writes `out` [B, H, Nq, d_v] and, if non-null, `lse` [B, H, Nq]
/// (natural log of the softmax denominator, in scaled-logit units). fp32 products, fp64-free max-shifted softmax.
/// A query that sees no key (empty head) gets zeros and lse = -inf.
template <KVCacheView C>
Status attend(Cpu const&, QueryRows const& queries, C const& cache, float* out, float* lse, AttendOptions opts = {},
              AttendKeys kept = nullptr, Workspace ws = {}) {
  static_assert(AccessibleFrom<C, Cpu>, "kvc::attend(Cpu): the cache must live in host memory");
  KVExtents const q = queries.extents(), k = cache.keys.extents();
  Index const dv = cache.values.extents().dim;
  if (q.batch != k.batch || q.dim != k.dim)
    return {Errc::invalid_argument, "kvc::attend: queries must have the keys' batch and d_k"};
  if (k.heads <= 0 || q.heads % k.heads != 0)
    return {Errc::invalid_argument, "kvc::attend: query heads must be a multiple of KV heads (GQA)"};
  if (kept && (kept->batch != k.batch || kept->heads != k.heads))
    return {Errc::invalid_argument, "kvc::attend: `kept` must be [batch, kv heads]"};
  WorkspaceCarver carve(ws);
  float* logits = carve.take<float>(k.tokens);
  float* scratch = carve.take<float>(std::max(k.dim, dv));
  if ((logits == nullptr && k.tokens > 0) || scratch == nullptr)
    return {Errc::out_of_capacity, "kvc::attend: workspace smaller than attend_workspace_bytes()"};
  float const scale = opts.scale > 0 ? opts.scale : 1.0f / std::sqrt(static_cast<float>(k.dim));
  Index const group = q.heads / k.heads;

  for (Index b = 0; b < q.batch; ++b)
    for (Index hq = 0; hq < q.heads; ++hq) {
      Index const h = hq / group;
      Index const slots = kept ? kept->kept(b, h) : cache.length(b);
      Index const* pos = kept ? kept->indices(b, h) : nullptr;
      for (Index i = 0; i < q.tokens; ++i) {
        detail::FloatRow const qi(queries.row(b, hq, i), k.dim);
        Index const limit = opts.causal_offset < 0 ? std::numeric_limits<Index>::max() : opts.causal_offset + i;
        float peak = -std::numeric_limits<float>::infinity();
        for (Index j = 0; j < slots; ++j) {
          bool const visible = (pos ? pos[j] : j) <= limit;
          logits[j] = visible ? scale * qi.dot(detail::float_row(cache.keys.row(b, h, j), k.dim, scratch))
                              : -std::numeric_limits<float>::infinity();
          peak = std::max(peak, logits[j]);
        }
        Eigen::Map<Eigen::VectorXf> o(out + ((b * q.heads + hq) * q.tokens + i) * dv, dv);
        o.setZero();
        float denom = 0.0f;
        if (peak > -std::numeric_limits<float>::infinity()) {
          for (Index j = 0; j < slots; ++j) {
            float const w = std::exp(logits[j] - peak);  // exp(-inf) = 0 for masked slots
            if (w == 0.0f)
              continue;
            denom += w;
            o += w * detail::float_row(cache.values.row(b, h, j), dv, scratch);
          }
          o /= denom;
        }
        if (lse)
          lse[(b * q.heads + hq) * q.tokens + i] =
              denom > 0 ? peak + std::log(denom) : -std::numeric_limits<float>::infinity();
      }
    }
  return {};
}

/// Relative L2 error ||O_compressed - O_full|| / ||O_full|| of attention outputs over all queries and heads,
/// between `full` and `compressed` (a compacted cache with its plan). A measurement helper for tests, tools and
/// the demo: it allocates its buffers, so keep it out of hot paths.
template <KVCacheView Full, KVCacheView Compressed>
Status attention_error(QueryRows const& queries, Full const& full, Compressed const& compressed,
                       KeepPlan<HostSpace> const& kept, double& relative_error, AttendOptions opts = {}) {
  KVExtents const q = queries.extents();
  Index const dv = full.values.extents().dim;
  auto const outputs = static_cast<std::size_t>(q.batch * q.heads * q.tokens * dv);
  std::vector<float> a(outputs), b(outputs);
  std::vector<std::byte> ws(attend_workspace_bytes(full.keys.extents(), dv));
  KVC_RETURN_IF_ERROR(attend(Cpu{}, queries, full, a.data(), nullptr, opts, nullptr, {ws.data(), ws.size()}));
  KVC_RETURN_IF_ERROR(attend(Cpu{}, queries, compressed, b.data(), nullptr, opts, &kept, {ws.data(), ws.size()}));
  double num = 0, den = 0;
  for (std::size_t i = 0; i < outputs; ++i) {
    num += (double{b[i]} - a[i]) * (double{b[i]} - a[i]);
    den += double{a[i]} * a[i];
  }
  relative_error = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
  return {};
}

}  // namespace kvc
