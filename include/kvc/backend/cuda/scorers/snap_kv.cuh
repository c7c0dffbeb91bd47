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

/// One block per (h, b): votes from the column sums, GQA reduction and pooling in the order `reference` asks,
/// window slots at max(prefix) + 1, padding at -inf. Same definition as the CPU kernel.
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
  Index const m = m_shared, r = s.kernel_size / 2;
  float const* col = ws.colsum + (b * query_heads + h * g) * e.tokens;  // [g, tokens] of this group
  auto reduced = [&](Index t) {  // authors: the group's votes combined before pooling
    float acc = col[t];
    for (Index q = 1; q < g; ++q)
      acc = s.gqa == GqaReduce::max ? fmaxf(acc, col[q * e.tokens + t]) : acc + col[q * e.tokens + t];
    return s.gqa == GqaReduce::mean ? acc / static_cast<float>(g) : acc;
  };
  float* score = out.row(b, h);
  float local_max = -CUDART_INF_F;
  for (Index j = threadIdx.x; j < m; j += blockDim.x) {
    // Sliding windows are centred on j (avg divides by the kernel, padding counted); chunk_mean averages the
    // aligned chunk holding j over its own slots (the last chunk may be short).
    bool const chunk = s.pooling == Pooling::chunk_mean;
    Index const c0 = j / s.kernel_size * s.kernel_size, c1 = c0 + s.kernel_size < m ? c0 + s.kernel_size : m;
    Index const lo = chunk ? c0 : (j - r < 0 ? 0 : j - r), hi = chunk ? c1 : (j + r + 1 < m ? j + r + 1 : m);
    float const divisor = static_cast<float>(chunk ? c1 - c0 : s.kernel_size);
    float v = 0.0f;
    if (s.reference == Reference::authors) {
      float pooled = s.pooling == Pooling::max ? -CUDART_INF_F : 0.0f;
      for (Index t = lo; t < hi; ++t)
        pooled = s.pooling == Pooling::max ? fmaxf(pooled, reduced(t)) : pooled + reduced(t);
      v = s.pooling == Pooling::max ? pooled : pooled / divisor;
    } else {  // kvpress: pool each query head's mean vote, then the mean over the group
      for (Index q = 0; q < g; ++q) {
        float pooled = s.pooling == Pooling::max ? -CUDART_INF_F : 0.0f;
        for (Index t = lo; t < hi; ++t)
          pooled = s.pooling == Pooling::max ? fmaxf(pooled, col[q * e.tokens + t]) : pooled + col[q * e.tokens + t];
        v += (s.pooling == Pooling::max ? pooled : pooled / divisor);
      }
      v /= static_cast<float>(s.window_size * g);
    }
    score[j] = v;
    local_max = fmaxf(local_max, v);
  }
  float const top = block_max(local_max, scratch);
  float const protect = m > 0 ? top + 1.0f : 1.0f;
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
