// SPDX-License-Identifier: Apache-2.0
// kvc/backend/cuda/scorers/tova.cuh: CUDA kernels of TOVAScorer over the shared window attention
// (detail/window_attention.cuh).
#pragma once

#include <kvc/backend/cuda/detail/block_reduce.cuh>
#include <kvc/backend/cuda/detail/window_attention.cuh>
#include <kvc/core/scores.hpp>
#include <kvc/scorers/tova.hpp>

#include <cstddef>
#include <math_constants.h>

namespace kvc::backend::cuda {

/// One block per sequence: kvc::tova_add_group over every query head, then kvc::tova_mean (the CPU's formula), for
/// every slot, the newest slots protected in kvpress mode, copied to every KV head. Every KV head of the sequence must
/// hold the same slots (head 0's length and positions are used).
template <class C>
__global__ void __launch_bounds__(finish_threads)
    tova_finish_kernel(TOVAScorer s, C cache, Index query_heads, WindowScratch ws, ScoreSpan<DeviceSpace> out) {
  __shared__ float scratch[finish_threads / warp_size];
  __shared__ Index m_shared;
  KVExtents const e = cache.keys.extents();
  Index const b = blockIdx.x, n = e.heads > 0 ? cache.clamped_length(b, 0) : 0;
  if (threadIdx.x == 0)
    m_shared = s.reference == Reference::kvpress ? slots_before(cache, b, 0, ws.q_pos[b]) : n;
  __syncthreads();
  Index const m = m_shared;
  float* score = out.row(b, 0);
  float local_max = -CUDART_INF_F;
  float const* col = ws.colsum + b * query_heads * e.tokens;
  for (Index j = threadIdx.x; j < n; j += blockDim.x) {
    score[j] =
        tova_mean(tova_add_group(0.0f, query_heads, [&](Index q) { return col[q * e.tokens + j]; }), query_heads);
    if (j < m)
      local_max = fmaxf(local_max, score[j]);
  }
  float const protect = protected_score(block_max(local_max, scratch), m);
  for (Index j = m + threadIdx.x; j < n; j += blockDim.x)
    score[j] = protect;
  for (Index j = n + threadIdx.x; j < e.tokens; j += blockDim.x)
    score[j] = -CUDART_INF_F;
  __syncthreads();
  for (Index h = 1; h < e.heads; ++h)
    for (Index j = threadIdx.x; j < e.tokens; j += blockDim.x)
      out.row(b, h)[j] = score[j];
}

}  // namespace kvc::backend::cuda

namespace kvc {

/// TOVA on CUDA: the window attention for the last query row, then one block per sequence.
template <>
struct Kernel<TOVAScorer, Cuda> {
  template <class Obs>
  static std::size_t workspace_bytes(Cuda const&, TOVAScorer const&, KVExtents const& keys, Obs const& obs) {
    Index const query_heads = window_query_heads(obs, keys.heads);
    return backend::cuda::WindowScratch::bytes(keys.batch, query_heads, 1, keys.dim, keys.tokens);
  }

  template <KVCacheView C, class Obs>
  static Status run(Cuda const& cuda, TOVAScorer const& s, C const& cache, Obs const& obs, ScoreSpan<DeviceSpace> out,
                    Workspace ws) {
    namespace bc = backend::cuda;
    auto const& wq = obs.window_queries;
    KVExtents const e = cache.keys.extents();
    KVC_RETURN_IF_ERROR(bc::check_window(
        wq, cache, 1, "kvc::score(tova, Cuda): window queries must be [batch, Hq, >= 1, d_k], Hq a multiple of Hkv"));
    Index const hq = wq.rows.extents().heads;
    WorkspaceCarver carve(ws);
    auto const scratch = bc::WindowScratch::carve(carve, e.batch, hq, 1, e.dim, e.tokens);
    if (!scratch.complete() && e.rows() > 0)
      return {Errc::out_of_capacity, "kvc::score(tova, Cuda): workspace smaller than score_workspace_bytes()"};
    if (e.batch * e.heads == 0 || e.tokens == 0)
      return {};
    KVC_RETURN_IF_ERROR(bc::pending_status());
    KVC_RETURN_IF_ERROR(bc::window_attention(cuda, wq, cache, wq.window() - 1, wq.window(), scratch, false));
    KVC_RETURN_IF_ERROR(bc::launch(KVC_CUDA_KERNEL("kvc::score(tova, Cuda)", bc::tova_finish_kernel),
                                   static_cast<unsigned>(e.batch), bc::finish_threads, 0, cuda.stream, s, cache, hq,
                                   scratch, out));
    return {};
  }
};

}  // namespace kvc
