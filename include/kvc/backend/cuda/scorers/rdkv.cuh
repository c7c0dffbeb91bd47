// SPDX-License-Identifier: Apache-2.0
// kvc/backend/cuda/scorers/rdkv.cuh: CUDA kernels of RDKVTokenScorer (attn_linear) and ThinKChannelScorer
// (formulas: kvc/scorers/rdkv.hpp).
//  - attn_linear: the shared window attention (detail/window_attention.cuh) gives each query head's column sums over
//    the last W window rows; one block per (sequence, KV head) then sums the group's heads (in head order), divides
//    by n_j (the window rows whose position is >= slot j's), and reflect-avg-pools with kernel min(k, 2n − 1), as
//    the CPU kernel. Parity within fp32 rounding (the column sums are reduced in another order).
//  - derived (E[a²]·d_v·σ²) has no CUDA kernel: kvc::score reports invalid_argument.
//  - ThinK: the window rows rotated to their positions (the shared prepare kernel), then one block per (sequence, KV
//    head), one thread per channel: the mean of q_c² over the group's W rows and the mean of k_c² over the head's
//    valid tokens with finite keys (a key with a NaN or Inf element is left out, as on the CPU), summed in fp64 in
//    the CPU's order (squares of floats are exact in fp64, so a fused multiply-add
//    rounds as the CPU's separate ones). The key term is then bit-identical to the CPU's; the query term is within an
//    ulp or two (the rotation rounds on its own).
#pragma once

#include <kvc/backend/cuda/detail/window_attention.cuh>
#include <kvc/core/norm_range.hpp>
#include <kvc/core/scores.hpp>
#include <kvc/scorers/rdkv.hpp>

#include <cstddef>
#include <math_constants.h>

namespace kvc::backend::cuda {

inline constexpr int rdkv_finish_threads = 1024;

/// One block per (h, b): s_j = (Σ_q colsum[q, j]) / n_j, then the reflect-avg pool into out; padding -inf.
template <class C>
__global__ void __launch_bounds__(rdkv_finish_threads)
    rdkv_token_finish_kernel(RDKVTokenScorer s, C cache, Index query_heads, Index rows, WindowScratch ws,
                             ScoreSpan<DeviceSpace> out) {
  KVExtents const e = cache.keys.extents();
  Index const b = blockIdx.y, h = blockIdx.x, g = query_heads / e.heads, n = cache.clamped_length(b, h);
  float* col = ws.colsum + (b * query_heads + h * g) * e.tokens;  // [g, tokens] of this group
  for (Index j = threadIdx.x; j < n; j += blockDim.x) {
    Index const pos = cache.position(b, h, j);
    Index seen = 0;
    for (Index r = 0; r < rows; ++r)
      seen += ws.q_pos[b * rows + r] >= pos ? 1 : 0;
    float acc = col[j];
    for (Index q = 1; q < g; ++q)
      acc += col[q * e.tokens + j];
    col[j] = seen > 0 ? acc / static_cast<float>(seen) : 0.0f;  // in place: query head h * g's row
  }
  __syncthreads();
  float* score = out.row(b, h);
  for (Index j = threadIdx.x; j < n; j += blockDim.x)
    score[j] = reflect_avg_pooled_at(n, s.kernel_size, j, [col](Index t) { return col[t]; });
  for (Index j = n + threadIdx.x; j < e.tokens; j += blockDim.x)
    score[j] = -CUDART_INF_F;
}

inline constexpr int thinK_threads = 128;

/// One block per (h, b), thinK_threads threads, one thread per channel (chunks of thinK_threads channels): ThinK's
/// weight, the CPU's fp64 sums in its order. Keys are read in tiles of thinK_threads rows: each thread first checks
/// one row of the tile for a NaN or Inf element (such a key is left out of the mean, as on the CPU: one bad key would
/// make every channel's weight NaN or Inf), then every thread adds the tile's finite rows to its channel.
template <class C>
__global__ void __launch_bounds__(thinK_threads)
    thinK_channel_kernel(C cache, Index query_heads, Index rows, float const* q, float* out) {
  __shared__ bool finite_row[thinK_threads];
  KVExtents const e = cache.keys.extents();
  Index const b = blockIdx.y, h = blockIdx.x, g = query_heads / e.heads, d = e.dim, n = cache.clamped_length(b, h);
  auto const ks = cache.keys.scale(b, h);
  for (Index c0 = 0; c0 < d; c0 += blockDim.x) {  // block-uniform: every thread takes part in the row checks
    Index const c = c0 + threadIdx.x;
    double qsq = 0.0, ksq = 0.0;
    for (Index lq = 0; lq < g && c < d; ++lq)
      for (Index r = 0; r < rows; ++r) {
        double const x = static_cast<double>(q[((b * query_heads + h * g + lq) * rows + r) * d + c]);
        qsq += x * x;
      }
    Index finite = 0;
    for (Index j0 = 0; j0 < n; j0 += blockDim.x) {
      Index const j = j0 + threadIdx.x;
      bool ok = j < n;
      for (Index i = 0; i < d && ok; ++i)
        ok = detail::is_finite_value(load(cache.keys.row(b, h, j)[i], ks));
      finite_row[threadIdx.x] = ok;
      __syncthreads();
      Index const tile = n - j0 < blockDim.x ? n - j0 : blockDim.x;
      for (Index t = 0; t < tile; ++t) {
        if (!finite_row[t])
          continue;
        ++finite;
        if (c < d) {
          double const x = static_cast<double>(load(cache.keys.row(b, h, j0 + t)[c], ks));
          ksq += x * x;
        }
      }
      __syncthreads();  // finite_row is rewritten by the next tile
    }
    double const q_rows = static_cast<double>(g * rows), k_rows = finite > 0 ? static_cast<double>(finite) : 1.0;
    if (c < d)
      out[(b * e.heads + h) * d + c] = static_cast<float>(__dmul_rn(__ddiv_rn(qsq, q_rows), __ddiv_rn(ksq, k_rows)));
  }
}

}  // namespace kvc::backend::cuda

namespace kvc {

/// RDKV's V-token weights on CUDA (attn_linear). Workspace (device): the window attention's rotated queries,
/// positions, LSEs and column sums for the last W rows.
template <>
struct Kernel<RDKVTokenScorer, Cuda> {
  template <class Obs>
  static std::size_t workspace_bytes(Cuda const&, RDKVTokenScorer const& s, KVExtents const& keys, Obs const& obs) {
    Index const query_heads = window_query_heads(obs, keys.heads);
    Index const rows = s.window_size > 0 ? s.window_size : 0;  // w < 1 is rejected by run()
    return backend::cuda::WindowScratch::bytes(keys.batch, query_heads, rows, keys.dim, keys.tokens);
  }

  template <KVCacheView C, class Obs>
  static Status run(Cuda const& cuda, RDKVTokenScorer const& s, C const& cache, Obs const& obs,
                    ScoreSpan<DeviceSpace> out, Workspace ws) {
    namespace bc = backend::cuda;
    KVC_RETURN_IF_ERROR(s.check());
    if (s.weight != RDKVTokenWeight::attn_linear)
      return {Errc::invalid_argument, "kvc::score(rdkv, Cuda): only weight = attn_linear has a CUDA kernel"};
    auto const& wq = obs.window_queries;
    KVExtents const e = cache.keys.extents();
    KVC_RETURN_IF_ERROR(bc::check_window(
        wq, cache, s.window_size,
        "kvc::score(rdkv, Cuda): window queries must be [batch, Hq, >= window_size, d_k], Hq a multiple of Hkv"));
    Index const hq = wq.rows.extents().heads;
    WorkspaceCarver carve(ws);
    auto const scratch = bc::WindowScratch::carve(carve, e.batch, hq, s.window_size, e.dim, e.tokens);
    if (!scratch.complete() && e.rows() > 0)
      return {Errc::out_of_capacity, "kvc::score(rdkv, Cuda): workspace smaller than score_workspace_bytes()"};
    if (e.batch * e.heads == 0 || e.tokens == 0)
      return {};
    KVC_RETURN_IF_ERROR(bc::pending_status());
    KVC_RETURN_IF_ERROR(
        bc::window_attention(cuda, wq, cache, wq.window() - s.window_size, wq.window(), scratch, false));
    KVC_RETURN_IF_ERROR(bc::launch(KVC_CUDA_KERNEL("kvc::score(rdkv, Cuda)", bc::rdkv_token_finish_kernel),
                                   dim3(static_cast<unsigned>(e.heads), static_cast<unsigned>(e.batch)),
                                   bc::rdkv_finish_threads, 0, cuda.stream, s, cache, hq, s.window_size, scratch, out));
    return {};
  }
};

/// ThinK's channel weights on CUDA. Workspace (device): the window rows rotated to their positions and the
/// positions (the window attention's scratch layout; its LSEs and column sums are not used).
template <>
struct Kernel<ThinKChannelScorer, Cuda> {
  template <class Obs>
  static std::size_t workspace_bytes(Cuda const&, ThinKChannelScorer const& s, KVExtents const& keys, Obs const& obs) {
    Index const query_heads = window_query_heads(obs, keys.heads);
    Index const rows = s.window_size > 0 ? s.window_size : 0;
    return bytes_sum(workspace_round(bytes_product(keys.batch, query_heads, rows, keys.dim, sizeof(float))),
                     workspace_round(bytes_product(keys.batch, rows, sizeof(Index))));
  }

  template <KVCacheView C, class Obs>
  static Status run(Cuda const& cuda, ThinKChannelScorer const& s, C const& cache, Obs const& obs, float* out,
                    Workspace ws) {
    namespace bc = backend::cuda;
    KVC_RETURN_IF_ERROR(s.check());
    auto const& wq = obs.window_queries;
    KVExtents const e = cache.keys.extents();
    KVC_RETURN_IF_ERROR(bc::check_window(wq, cache, s.window_size,
                                         "kvc::score_channels(think, Cuda): window queries must be [batch, Hq, >= "
                                         "window_size, d_k], Hq a multiple of Hkv"));
    Index const hq = wq.rows.extents().heads;
    WorkspaceCarver carve(ws);
    bc::WindowScratch scratch;
    scratch.q = carve.take<float>(e.batch * hq * s.window_size * e.dim);
    scratch.q_pos = carve.take<Index>(e.batch * s.window_size);
    if ((scratch.q == nullptr || scratch.q_pos == nullptr) && e.batch * e.dim > 0)
      return {Errc::out_of_capacity,
              "kvc::score_channels(Cuda): workspace smaller than channel_score_workspace_bytes()"};
    if (e.batch * e.heads == 0 || e.dim == 0)
      return {};
    KVC_RETURN_IF_ERROR(bc::pending_status());
    KVC_RETURN_IF_ERROR(bc::launch(KVC_CUDA_KERNEL("kvc::score_channels(think, Cuda)", bc::window_prepare_kernel),
                                   dim3(static_cast<unsigned>(hq), static_cast<unsigned>(e.batch)), 128, 0, cuda.stream,
                                   wq, cache, wq.window() - s.window_size, s.window_size, scratch));
    KVC_RETURN_IF_ERROR(bc::launch(KVC_CUDA_KERNEL("kvc::score_channels(think, Cuda)", bc::thinK_channel_kernel<C>),
                                   dim3(static_cast<unsigned>(e.heads), static_cast<unsigned>(e.batch)),
                                   bc::thinK_threads, 0, cuda.stream, cache, hq, s.window_size, scratch.q, out));
    return {};
  }
};

}  // namespace kvc
