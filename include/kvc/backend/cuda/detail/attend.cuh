// SPDX-License-Identifier: Apache-2.0
// kvc/backend/cuda/detail/attend.cuh: CUDA attention kernel (GQA, causal by position, fp32 accumulation).
// Shared: corrected attention builds on it; the public header is kvc/backend/cuda/attention/attend.cuh.
#pragma once

#include <kvc/attention/attend.hpp>
#include <kvc/backend/cuda/config.cuh>
#include <kvc/backend/cuda/detail/logits.cuh>

#include <cstddef>
#include <math_constants.h>

namespace kvc::backend::cuda {

inline constexpr int attend_warps = 4;       // query rows per block
inline constexpr int attend_max_chunks = 8;  // output channels per lane: d_v <= 256

/// One warp per query row (b, q, i), grid (row blocks, Hq, batch). Pass 1: lanes take one slot each, compute its
/// logit against the query (staged in shared memory) and reduce max and sum of exponentials: the log-sum-exp.
/// Pass 2: per chunk of 32 slots, each lane computes its slot's probability, then the warp walks the chunk with
/// shuffles while lanes accumulate output channels, so values are read coalesced.
template <class Q, class C>
__global__ void __launch_bounds__(attend_warps* warp_size)
    attend_kernel(Attention op, Q queries, C cache, AttendOutput<DeviceSpace> out, float scale) {
  float* const q_rows = dynamic_shared<float>();  // [attend_warps, d_k]
  KVExtents const qe = queries.rows.extents(), ke = cache.keys.extents();
  Index const dk = ke.dim, dv = cache.values.extents().dim;
  int const warp = static_cast<int>(threadIdx.x) / warp_size, lane = static_cast<int>(threadIdx.x) % warp_size;
  Index const b = blockIdx.z, hq = blockIdx.y, i = static_cast<Index>(blockIdx.x) * attend_warps + warp;
  if (i >= qe.tokens)
    return;  // whole warp leaves together: no block-level barrier below
  Index const h = hq / (qe.heads / ke.heads), n = cache.clamped_length(b, h);
  float* q = q_rows + warp * dk;
  auto const* src = queries.rows.row(b, hq, i);
  for (Index c = lane; c < dk; c += warp_size)
    q[c] = to_float(src[c]);
  __syncwarp();
  Index const q_pos = queries.positions ? queries.positions[b * qe.tokens + i] : context_end(cache, b) - qe.tokens + i;
  float const lse = warp_lse(cache, b, h, n, q, q_pos, scale, op.causal);
  float acc[attend_max_chunks] = {};
  auto const vs = cache.values.scale(b, h);
  if (lse > -CUDART_INF_F)
    for (Index base = 0; base < n; base += warp_size) {
      Index const j = base + lane;
      float const p = j < n ? expf(slot_logit(cache, b, h, j, q, q_pos, scale, op.causal) - lse) : 0.0f;
      int const chunk = n - base < warp_size ? static_cast<int>(n - base) : warp_size;
      for (int s = 0; s < chunk; ++s) {
        float const w = __shfl_sync(full_mask, p, s);
        if (w == 0.0f)
          continue;
        auto const* v = cache.values.row(b, h, base + s);
        for (int k = 0; k < attend_max_chunks; ++k) {
          Index const c = lane + k * warp_size;
          if (c < dv)
            acc[k] += w * load(v[c], vs);
        }
      }
    }
  float* o = out.out + ((b * qe.heads + hq) * qe.tokens + i) * dv;
  for (int k = 0; k < attend_max_chunks; ++k) {
    Index const c = lane + k * warp_size;
    if (c < dv)
      o[c] = acc[k];
  }
  if (out.lse && lane == 0)
    out.lse[(b * qe.heads + hq) * qe.tokens + i] = lse;
}

}  // namespace kvc::backend::cuda

namespace kvc {

/// Attention on CUDA: no workspace. Limits: d_v <= 256, batch and query heads <= 65535, d_k within shared memory.
template <>
struct Kernel<Attention, Cuda> {
  template <class Q, KVCacheView C>
  static std::size_t workspace_bytes(Cuda const&, Attention const&, Q const&, C const&) {
    return 0;
  }

  template <Element T, KVCacheView C>
  static Status run(Cuda const& cuda, Attention const& op, AttendQueries<T, DeviceSpace> const& queries, C const& cache,
                    AttendOutput<DeviceSpace> out, Workspace) {
    namespace bc = backend::cuda;
    KVExtents const q = queries.rows.extents(), k = cache.keys.extents();
    if (cache.values.extents().dim > bc::attend_max_chunks * bc::warp_size)
      return {Errc::invalid_argument, "kvc::attend(Cuda): d_v must be <= 256"};
    if (q.rows() == 0)
      return {};
    KVC_RETURN_IF_ERROR(bc::head_grid_status(q.batch, q.heads, "kvc::attend(Cuda): batch and heads must be <= 65535"));
    auto const smem = static_cast<std::size_t>(bc::attend_warps * k.dim) * sizeof(float);
    KVC_RETURN_IF_ERROR(bc::shared_memory_status(smem, "kvc::attend(Cuda): d_k too large for shared memory"));
    KVC_RETURN_IF_ERROR(bc::pending_status());
    float const scale = op.scale > 0 ? op.scale : 1.0f / sqrtf(static_cast<float>(k.dim));
    dim3 const grid(bc::grid_dim((q.tokens + bc::attend_warps - 1) / bc::attend_warps, 2147483647),
                    static_cast<unsigned>(q.heads), static_cast<unsigned>(q.batch));
    KVC_RETURN_IF_ERROR(bc::launch(KVC_CUDA_KERNEL("kvc::attend(Cuda)", bc::attend_kernel), grid,
                                   bc::attend_warps * bc::warp_size, smem, cuda.stream, op, queries, cache, out,
                                   scale));
    return {};
  }
};

}  // namespace kvc
