// SPDX-License-Identifier: Apache-2.0
// kvc/backend/cuda/scorers/key_diff.cuh: CUDA kernels for KeyDiffScorer (tested for parity with the CPU oracle).
#pragma once

#include <kvc/backend/cuda/config.cuh>
#include <kvc/backend/cuda/detail/norms.cuh>  // warp_sum_squares_fp64: the fp64 rare path, shared with Knorm
#include <kvc/core/norm_range.hpp>            // the norms' range guard, shared with Knorm and the CPU
#include <kvc/scorers/key_diff.hpp>

#include <climits>
#include <cstddef>
#include <math_constants.h>

namespace kvc::backend::cuda {

/// Token splits per head: a pure function of the token count (not of the device), so results are reproducible
/// across GPUs. About 2K tokens per block gives 512 blocks for 8 heads x 128K tokens.
inline Index key_diff_splits(Index tokens) noexcept {
  Index const s = (tokens + 2047) / 2048;
  return s < 1 ? 1 : (s > 64 ? 64 : s);
}

inline constexpr int key_diff_warps = 8;

/// Pass 1, grid (splits, heads, batch): each warp takes one token at a time (lanes read the row coalesced), sums
/// unit keys (kvc::key_diff_anchor_weight) into its own shared-memory row in fp64 (no atomics, and long caches keep
/// the anchor's direction), and stashes ||k|| in the score output. The block's sum goes to partial[b, h, split, :dim]
/// and its count of non-finite rows to partial[b, h, split, dim] (rows of dim + 1). A row whose fp32 sum of squares is
/// out of range (detail::sum_squares_in_range) takes a warp-uniform fp64 branch and stashes its fp64 norm; a row with
/// a NaN or Inf element (a non-finite fp64 norm) is left out of the anchor and stashes NaN, as on the CPU.
template <class Keys>
__global__ void key_diff_anchor_kernel(Keys keys, KeyDiffScorer s, ScoreSpan<DeviceSpace> out, double* partial,
                                       Index splits) {
  double* const warp_rows = dynamic_shared<double>();  // [key_diff_warps, dim]
  __shared__ Index warp_skipped[key_diff_warps];       // non-finite rows per warp
  Index const dim = keys.extents().dim;
  Index const b = blockIdx.z, h = blockIdx.y, split = blockIdx.x;
  int const warp = static_cast<int>(threadIdx.x) / warp_size, lane = static_cast<int>(threadIdx.x) % warp_size;
  for (Index i = threadIdx.x; i < key_diff_warps * dim; i += blockDim.x)
    warp_rows[i] = 0.0;
  __syncthreads();
  Index const n = clamp_length(out.length(b, h), head_capacity(keys.layout(), b, h)), per = (n + splits - 1) / splits;
  Index const t0 = split * per, t1 = t0 + per < n ? t0 + per : n;
  double* mine = warp_rows + warp * dim;
  Index skipped = 0;  // warp-uniform
  auto const ks = keys.scale(b, h);
  for (Index t = t0 + warp; t < t1; t += key_diff_warps) {
    auto const* k = keys.row(b, h, t);
    float sq = 0.0f;
    for (Index i = lane; i < dim; i += warp_size) {
      float const x = load(k[i], ks);
      sq += x * x;
    }
    sq = warp_sum(sq);
    if (detail::sum_squares_in_range(sq)) [[likely]] {
      float const norm = sqrtf(sq);
      float const inv = key_diff_anchor_weight(s, norm);
      for (Index i = lane; i < dim; i += warp_size)
        mine[i] += static_cast<double>(load(k[i], ks) * inv);
      if (lane == 0)
        out(b, h, t) = norm;
    } else {
      double const norm = sqrt(warp_sum_squares_fp64(k, ks, dim, lane));
      bool const finite = isfinite(norm);  // warp-uniform: every lane holds the warp's sum
      if (finite) {
        double const inv = key_diff_anchor_weight(s, norm);
        for (Index i = lane; i < dim; i += warp_size)
          mine[i] += static_cast<double>(load(k[i], ks)) * inv;
      }
      skipped += finite ? 0 : 1;
      if (lane == 0)  // +inf above FLT_MAX (pass 2 recomputes it), NaN for a row left out
        out(b, h, t) = finite ? static_cast<float>(norm) : CUDART_NAN_F;
    }
  }
  if (lane == 0)
    warp_skipped[warp] = skipped;
  __syncthreads();
  double* row = partial + ((b * out.heads + h) * splits + split) * (dim + 1);
  for (Index i = threadIdx.x; i < dim; i += blockDim.x) {
    double sum = 0.0;
    for (int w = 0; w < key_diff_warps; ++w)
      sum += warp_rows[w * dim + i];
    row[i] = sum;
  }
  if (threadIdx.x == 0) {
    Index total = 0;
    for (int w = 0; w < key_diff_warps; ++w)
      total += warp_skipped[w];
    row[dim] = static_cast<double>(total);
  }
}

/// Sum over the block of one float per thread, through one float per warp in shared memory (fixed order); every
/// thread gets it. Call it block-uniformly.
__device__ inline float key_diff_block_sum(float x, float* parts, int warp, int lane) {
  x = warp_sum(x);
  if (lane == 0)
    parts[warp] = x;
  __syncthreads();
  float sum = 0.0f;
  for (int w = 0; w < key_diff_warps; ++w)
    sum += parts[w];
  return sum;
}

/// The anchor's rare path (the CPU's scale_anchor), for ||mu||^2 outside [2^-64, 2^64]: rewrites anchor[] as
/// mean(i) * 2^e with the largest element in [1, 2) and returns max(||mu||, eps) * 2^e. Block-uniform.
template <class Mean>
__device__ float key_diff_scale_anchor(Mean const& mean, Index dim, float eps, float* anchor, float* parts, int warp,
                                       int lane) {
  __shared__ int top;  // the largest exponent of a nonzero mean(i): atomicMax, so the order does not matter
  if (threadIdx.x == 0)
    top = INT_MIN;
  __syncthreads();  // also: every thread has read parts[]
  for (Index i = threadIdx.x; i < dim; i += blockDim.x) {
    double const m = mean(i);
    if (m != 0.0)
      atomicMax(&top, ilogb(m));
  }
  __syncthreads();
  int const e = top == INT_MIN ? 0 : -top;
  float sq = 0.0f;
  for (Index i = threadIdx.x; i < dim; i += blockDim.x) {
    float const mu = static_cast<float>(ldexp(mean(i), e));
    anchor[i] = mu;
    sq += mu * mu;
  }
  return fmaxf(sqrtf(key_diff_block_sum(sq, parts, warp, lane)),
               static_cast<float>(ldexp(static_cast<double>(eps), e)));
}

/// Pass 2, same grid: every block rebuilds its head's anchor from the split partials (splits x (dim + 1) reads,
/// cheap: the mean is over the finite rows), then each warp turns a stashed norm into kvc::key_diff_cosine. Padding
/// gets -inf. As on the CPU, an anchor out of range is scaled by a power of two, and a row whose stashed norm is out
/// of range (detail::norm_in_range) takes its cosine in fp64, or -inf when it has a NaN or Inf element (both block-
/// or warp-uniform branches).
template <class Keys>
__global__ void key_diff_score_kernel(Keys keys, KeyDiffScorer s, ScoreSpan<DeviceSpace> out, double const* partial,
                                      Index splits) {
  float* const anchor = dynamic_shared<float>();  // [dim], then one float per warp for the norm reduction
  Index const dim = keys.extents().dim;
  Index const b = blockIdx.z, h = blockIdx.y, split = blockIdx.x;
  int const warp = static_cast<int>(threadIdx.x) / warp_size, lane = static_cast<int>(threadIdx.x) % warp_size;
  Index const n = clamp_length(out.length(b, h), head_capacity(keys.layout(), b, h));
  float* norm_parts = anchor + dim;
  double const* rows = partial + (b * out.heads + h) * splits * (dim + 1);
  double skipped = 0.0;
  for (Index p = 0; p < splits; ++p)
    skipped += rows[p * (dim + 1) + dim];
  double const count = static_cast<double>(n) - skipped;
  double const divisor = count > 1.0 ? count : 1.0;  // the CPU's max(n - skipped, 1)
  auto const mean = [&](Index i) {
    double sum = 0.0;
    for (Index p = 0; p < splits; ++p)
      sum += rows[p * (dim + 1) + i];
    return sum / divisor;
  };
  float sq = 0.0f;
  for (Index i = threadIdx.x; i < dim; i += blockDim.x) {
    float const mu = static_cast<float>(mean(i));
    anchor[i] = mu;
    sq += mu * mu;
  }
  float const mu_sq = key_diff_block_sum(sq, norm_parts, warp, lane);
  float mu_norm = fmaxf(sqrtf(mu_sq), s.cosine_eps);
  if (!(mu_sq >= 0x1p-64f && mu_sq <= 0x1p64f)) [[unlikely]]
    mu_norm = key_diff_scale_anchor(mean, dim, s.cosine_eps, anchor, norm_parts, warp, lane);

  Index const per = (out.tokens + splits - 1) / splits;
  Index const t0 = split * per, t1 = t0 + per < out.tokens ? t0 + per : out.tokens;
  auto const ks = keys.scale(b, h);
  for (Index t = t0 + warp; t < t1; t += key_diff_warps) {
    if (t >= n) {
      if (lane == 0)
        out(b, h, t) = -CUDART_INF_F;
      continue;
    }
    auto const* k = keys.row(b, h, t);
    float const stashed = lane == 0 ? out(b, h, t) : 0.0f;  // lane 0 reads ||k|| (and later overwrites it)
    float dot = 0.0f;
    for (Index i = lane; i < dim; i += warp_size)
      dot += load(k[i], ks) * anchor[i];
    dot = warp_sum(dot);
    float const norm = __shfl_sync(full_mask, stashed, 0);  // every lane: the rare branch below is warp-uniform
    float score = key_diff_cosine(s, dot, mu_norm, norm);
    if (!detail::norm_in_range(norm)) [[unlikely]] {
      double dot64 = 0.0, sq_k = 0.0;
      for (Index i = lane; i < dim; i += warp_size) {
        double const x = load(k[i], ks);
        dot64 += x * anchor[i];
        sq_k += x * x;
      }
      dot64 = warp_sum(dot64);
      sq_k = warp_sum(sq_k);
      score = isfinite(sq_k) ? static_cast<float>(key_diff_cosine(s, dot64, static_cast<double>(mu_norm), sqrt(sq_k)))
                             : -CUDART_INF_F;  // a NaN or Inf key has no direction: evicted first
    }
    if (lane == 0)
      out(b, h, t) = score;
  }
}

}  // namespace kvc::backend::cuda

namespace kvc {

/// KeyDiff on CUDA: two kernels, each reading K once (the anchor needs every key before any score).
/// Workspace (device memory): fp64 partial anchors and non-finite row counts [batch, heads, splits, dim + 1].
template <>
struct Kernel<KeyDiffScorer, Cuda> {
  template <class Obs>
  static std::size_t workspace_bytes(Cuda const&, KeyDiffScorer const&, KVExtents const& keys, Obs const&) {
    return static_cast<std::size_t>(keys.batch * keys.heads * backend::cuda::key_diff_splits(keys.tokens) *
                                    (keys.dim + 1)) *
           sizeof(double);
  }

  template <KVCacheView C, class Obs>
  static Status run(Cuda const& cuda, KeyDiffScorer const& s, C const& cache, Obs const&, ScoreSpan<DeviceSpace> out,
                    Workspace ws) {
    namespace bc = backend::cuda;
    KVExtents const e = cache.keys.extents();
    if (e.batch * e.heads == 0 || e.tokens == 0)
      return {};
    KVC_RETURN_IF_ERROR(
        bc::head_grid_status(e.batch, e.heads, "kvc::score(key_diff, Cuda): batch and heads must be <= 65535"));
    auto* partial =
        WorkspaceCarver(ws).take<double>(static_cast<Index>(workspace_bytes(cuda, s, e, 0) / sizeof(double)));
    if (partial == nullptr)
      return {Errc::out_of_capacity, "kvc::score(key_diff, Cuda): workspace smaller than score_workspace_bytes()"};
    Index const splits = bc::key_diff_splits(e.tokens);
    dim3 const grid(static_cast<unsigned>(splits), static_cast<unsigned>(e.heads), static_cast<unsigned>(e.batch));
    unsigned const threads = bc::key_diff_warps * bc::warp_size;
    auto const smem1 = static_cast<std::size_t>(bc::key_diff_warps * e.dim) * sizeof(double);
    auto const smem2 = static_cast<std::size_t>(e.dim + bc::key_diff_warps) * sizeof(float);
    KVC_RETURN_IF_ERROR(bc::shared_memory_status(
        smem1, "kvc::score(key_diff, Cuda): head dim too large for the device's shared memory (8 fp64 rows)"));
    KVC_RETURN_IF_ERROR(bc::pending_status());
    KVC_RETURN_IF_ERROR(bc::launch(KVC_CUDA_KERNEL("kvc::score(key_diff, Cuda)", bc::key_diff_anchor_kernel), grid,
                                   threads, smem1, cuda.stream, cache.keys, s, out, partial, splits));
    KVC_RETURN_IF_ERROR(
        bc::launch(KVC_CUDA_KERNEL("kvc::score(key_diff, Cuda)", bc::key_diff_score_kernel<typename C::keys_type>),
                   grid, threads, smem2, cuda.stream, cache.keys, s, out, partial, splits));
    return {};
  }
};

}  // namespace kvc
