// SPDX-License-Identifier: Apache-2.0
// kvc/backend/cuda/scorers/snap_kv.cuh: CUDA kernels of SnapKVScorer over the shared window attention
// (detail/window_attention.cuh).
#pragma once

#include <kvc/backend/cuda/detail/window_attention.cuh>
#include <kvc/core/scores.hpp>
#include <kvc/scorers/snap_kv.hpp>

#include <cstddef>
#include <math_constants.h>

namespace kvc::backend::cuda {

/// One block per (h, b): each prefix slot's kvc::snap_kv_score from the group's column sums (the CPU's formula),
/// window slots at kvc::protected_score, padding at -inf.
template <class C>
__global__ void __launch_bounds__(finish_threads)
    snap_kv_finish_kernel(SnapKVScorer s, C cache, Index query_heads, Index rows, WindowScratch ws,
                          ScoreSpan<DeviceSpace> out) {
  __shared__ float scratch[finish_threads / warp_size];
  __shared__ Index m_shared;
  KVExtents const e = cache.keys.extents();
  Index const b = blockIdx.y, h = blockIdx.x, g = query_heads / e.heads, n = cache.clamped_length(b, h);
  if (threadIdx.x == 0)
    m_shared = slots_before(cache, b, h, ws.q_pos[b * rows]);
  __syncthreads();
  Index const m = m_shared;
  float const* col = ws.colsum + (b * query_heads + h * g) * e.tokens;  // [g, tokens] of this group
  float* score = out.row(b, h);
  float local_max = -CUDART_INF_F;
  for (Index j = threadIdx.x; j < m; j += blockDim.x) {
    float const v = snap_kv_score(s, g, m, j, [&](Index q, Index t) { return col[q * e.tokens + t]; });
    score[j] = v;
    local_max = fmaxf(local_max, v);
  }
  float const protect = protected_score(block_max(local_max, scratch), m);
  for (Index j = m + threadIdx.x; j < e.tokens; j += blockDim.x)
    score[j] = j < n ? protect : -CUDART_INF_F;
}

}  // namespace kvc::backend::cuda

namespace kvc {

/// SnapKV on CUDA. Workspace (device): the window attention's rotated queries, positions, LSEs and column sums.
template <>
struct Kernel<SnapKVScorer, Cuda> {
  template <class Obs>
  static std::size_t workspace_bytes(Cuda const&, SnapKVScorer const& s, KVExtents const& keys, Obs const& obs) {
    Index const query_heads = window_query_heads(obs, keys.heads);
    Index const rows = s.window_size > 0 ? s.window_size : 0;  // w < 1 is rejected by run()
    return backend::cuda::WindowScratch::bytes(keys.batch, query_heads, rows, keys.dim, keys.tokens);
  }

  template <KVCacheView C, class Obs>
  static Status run(Cuda const& cuda, SnapKVScorer const& s, C const& cache, Obs const& obs, ScoreSpan<DeviceSpace> out,
                    Workspace ws) {
    namespace bc = backend::cuda;
    KVC_RETURN_IF_ERROR(s.check());
    auto const& wq = obs.window_queries;
    KVExtents const e = cache.keys.extents();
    KVC_RETURN_IF_ERROR(bc::check_window(
        wq, cache, s.window_size,
        "kvc::score(snap_kv, Cuda): window queries must be [batch, Hq, >= window_size, d_k], Hq a multiple of Hkv"));
    Index const hq = wq.rows.extents().heads;
    if (s.gqa == GqaReduce::per_query_head && hq != e.heads)
      return {Errc::invalid_argument,
              "kvc::score(snap_kv, Cuda): gqa=per_query_head needs one KV head per query head; use gqa=mean|max|sum"};
    WorkspaceCarver carve(ws);
    auto const scratch = bc::WindowScratch::carve(carve, e.batch, hq, s.window_size, e.dim, e.tokens);
    if (!scratch.complete() && e.rows() > 0)
      return {Errc::out_of_capacity, "kvc::score(snap_kv, Cuda): workspace smaller than score_workspace_bytes()"};
    if (e.batch * e.heads == 0 || e.tokens == 0)
      return {};
    KVC_RETURN_IF_ERROR(bc::pending_status());
    KVC_RETURN_IF_ERROR(
        bc::window_attention(cuda, wq, cache, wq.window() - s.window_size, wq.window(), scratch, false));
    KVC_RETURN_IF_ERROR(bc::launch(KVC_CUDA_KERNEL("kvc::score(snap_kv, Cuda)", bc::snap_kv_finish_kernel),
                                   dim3(static_cast<unsigned>(e.heads), static_cast<unsigned>(e.batch)),
                                   bc::finish_threads, 0, cuda.stream, s, cache, hq, s.window_size, scratch, out));
    return {};
  }
};

}  // namespace kvc
