// SPDX-License-Identifier: Apache-2.0
// kvc/backend/cuda/pipeline/query_statistics.cuh: CUDA kernel of kvc::query_statistics (mean and population
// covariance of pre-RoPE query rows per (sequence, query head); ExpectedAttention's input).
//
// Centred two-pass, as the CPU kernel, with fp64 where the CPU has it:
//   1. sums, grid (row splits, Hq, B): each warp takes one sample row at a time (lanes read it coalesced) and adds it
//      to its own fp64 row in shared memory; the block's fp64 partial sum and sample count go to the workspace;
//   2. mean, grid (Hq, B): the splits' partials added in split order (fp64), divided by N, rounded to fp32 (the
//      output, and the centre of pass 3);
//   3. Gram, grid (split x upper-triangle tile pairs, Hq, B): a 64 x 64 tile of sum_i (x_i - mu)(x_i - mu)ᵀ per
//      block, 256 threads with 4 x 4 outputs each; 32 centred rows (fp32, x - mu in fp32 as on the CPU) are staged
//      in shared memory, their products summed in fp32, then added to fp64 accumulators (so N = 128K samples lose no
//      more than 32 rows' fp32 rounding); each split's fp64 tile is rounded once to fp32 in the workspace;
//   4. covariance, grid (entry blocks, Hq, B): the splits' tiles added in split order in fp64, divided by N; entry
//      (i, j) and (j, i) are both read from the upper triangle, so the output is exactly symmetric.
// Precision: the mean is the fp64 sum rounded once to fp32 (the CPU's too, in another order: equal but for a rare
// last-bit rounding); covariance entries carry fp32 rounding of at most 32-row partial sums plus one fp32 rounding
// per split, i.e. a few units of 1e-7 relative to sqrt(Sigma_ii Sigma_jj) (the CPU: 64-row Eigen tiles). Centring
// first keeps |mu| >> sigma from cancelling. No atomics, and the row splits are a function of the row count only,
// so results are bit-identical from run to run and across GPUs. Kernels never allocate: the workspace holds the
// partials (query_statistics_workspace_bytes).
#pragma once

#include <kvc/backend/cuda/config.cuh>
#include <kvc/pipeline/query_statistics.hpp>

#include <cstddef>

namespace kvc::backend::cuda {

inline constexpr int stats_warps = 8;      // pass 1: rows in flight per block
inline constexpr int stats_tile = 64;      // pass 3: output tile side (channels)
inline constexpr int stats_rows = 32;      // pass 3: centred rows staged per step (then flushed to fp64)
inline constexpr int stats_threads = 256;  // pass 3: 16 x 16 threads, 4 x 4 outputs each

/// Row splits per head: a pure function of the row count (not of the device), so results are reproducible on
/// every GPU. 4K rows per split; 16 splits at most (128K rows of 32 heads: 512 blocks per pass).
inline Index stats_splits(Index rows) noexcept {
  Index const s = (rows + 4095) / 4096;
  return s < 1 ? 1 : (s > 16 ? 16 : s);
}

/// Output tiles per side of the d x d covariance, and the upper-triangle tile pairs (ti <= tj) pass 3 computes.
__host__ __device__ inline Index stats_tiles(Index dim) noexcept {
  return (dim + stats_tile - 1) / stats_tile;
}
__host__ __device__ inline Index stats_pairs(Index dim) noexcept {
  Index const t = stats_tiles(dim);
  return t * (t + 1) / 2;
}

/// Which rows are samples (StatisticsRows, with positions [batch, R] or row i at position i).
struct SampleRule {
  Index n_sink = 0;
  Index skip_rows = 0;
  Index count = 0;   ///< rows [0, count) are candidates
  Index tokens = 0;  ///< R, the positions' row stride
  Index const* positions = nullptr;

  __device__ bool operator()(Index b, Index i) const {
    return i >= skip_rows && (positions ? positions[b * tokens + i] : i) >= n_sink;
  }
  /// Rows [first, last) of split `split` of `splits`.
  __device__ void range(Index split, Index splits, Index& first, Index& last) const {
    Index const per = (count + splits - 1) / splits;
    first = split * per;
    last = first + per < count ? first + per : count;
    first = first < last ? first : last;
  }
};

/// Device workspace of the statistics (aligned pieces).
struct StatsScratch {
  double* sums = nullptr;   ///< [B, Hq, splits, d] fp64 partial sums
  Index* counts = nullptr;  ///< [B, Hq, splits] samples per split
  Index* n = nullptr;       ///< [B, Hq] samples
  float* gram = nullptr;    ///< [B, Hq, splits, d, d] partial centred Grams (upper-triangle tiles written)

  static std::size_t bytes(KVExtents const& q) noexcept {
    Index const splits = stats_splits(q.tokens);
    return bytes_sum(workspace_round(bytes_product(q.batch, q.heads, splits, q.dim, sizeof(double))),
                     workspace_round(bytes_product(q.batch, q.heads, splits, sizeof(Index))),
                     workspace_round(bytes_product(q.batch, q.heads, sizeof(Index))),
                     workspace_round(bytes_product(q.batch, q.heads, splits, q.dim, q.dim, sizeof(float))));
  }
  static StatsScratch carve(WorkspaceCarver& c, KVExtents const& q) {
    Index const splits = stats_splits(q.tokens);
    StatsScratch s;
    s.sums = c.take<double>(q.batch * q.heads * splits * q.dim);
    s.counts = c.take<Index>(q.batch * q.heads * splits);
    s.n = c.take<Index>(q.batch * q.heads);
    s.gram = c.take<float>(q.batch * q.heads * splits * q.dim * q.dim);
    return s;
  }
  bool complete() const noexcept { return sums && counts && n && gram; }
};

/// Pass 1, grid (splits, Hq, B), stats_warps warps: fp64 partial sums of the sample rows, and their count.
template <class Rows>
__global__ void __launch_bounds__(stats_warps* warp_size)
    stats_sum_kernel(Rows q, SampleRule rule, Index splits, StatsScratch s) {
  double* const warp_rows = dynamic_shared<double>();  // [stats_warps, dim]
  __shared__ Index warp_taken[stats_warps];
  Index const d = q.extents().dim, heads = q.extents().heads;
  Index const b = blockIdx.z, hq = blockIdx.y, split = blockIdx.x;
  int const warp = static_cast<int>(threadIdx.x) / warp_size, lane = static_cast<int>(threadIdx.x) % warp_size;
  for (Index i = threadIdx.x; i < stats_warps * d; i += blockDim.x)
    warp_rows[i] = 0.0;
  __syncthreads();
  Index first = 0, last = 0;
  rule.range(split, splits, first, last);
  double* mine = warp_rows + warp * d;
  Index taken = 0;
  for (Index r = first + warp; r < last; r += stats_warps) {
    if (!rule(b, r))  // warp-uniform
      continue;
    ++taken;
    auto const* x = q.row(b, hq, r);
    for (Index c = lane; c < d; c += warp_size)
      mine[c] += static_cast<double>(to_float(x[c]));
  }
  if (lane == 0)
    warp_taken[warp] = taken;
  __syncthreads();
  Index const item = (b * heads + hq) * splits + split;
  for (Index c = threadIdx.x; c < d; c += blockDim.x) {
    double sum = 0.0;
    for (int w = 0; w < stats_warps; ++w)
      sum += warp_rows[w * d + c];
    s.sums[item * d + c] = sum;
  }
  if (threadIdx.x == 0) {
    Index total = 0;
    for (int w = 0; w < stats_warps; ++w)
      total += warp_taken[w];
    s.counts[item] = total;
  }
}

/// Pass 2, grid (Hq, B): mean = (sum over splits, in order) / N in fp64, rounded to fp32; N kept for pass 4.
template <class Extents>
__global__ void stats_mean_kernel(Extents e, Index splits, StatsScratch s, float* mean) {
  Index const b = blockIdx.y, hq = blockIdx.x, item = b * e.heads + hq, d = e.dim;
  Index n = 0;
  for (Index p = 0; p < splits; ++p)
    n += s.counts[item * splits + p];
  for (Index c = threadIdx.x; c < d; c += blockDim.x) {
    double sum = 0.0;
    for (Index p = 0; p < splits; ++p)
      sum += s.sums[(item * splits + p) * d + c];
    mean[item * d + c] = n > 0 ? static_cast<float>(sum / static_cast<double>(n)) : 0.0f;
  }
  if (threadIdx.x == 0)
    s.n[item] = n;
}

/// Pass 3, grid (splits * pairs, Hq, B), stats_threads threads: the centred Gram tile (ti, tj), ti <= tj, of one
/// split's sample rows, fp32 products over 32 staged rows flushed into fp64.
template <class Rows>
__global__ void __launch_bounds__(stats_threads)
    stats_gram_kernel(Rows q, SampleRule rule, Index splits, float const* mean, StatsScratch s) {
  __shared__ __align__(16) float xa[stats_rows][stats_tile];
  __shared__ __align__(16) float xb[stats_rows][stats_tile];
  __shared__ bool use[stats_rows];
  Index const d = q.extents().dim, heads = q.extents().heads, tiles = stats_tiles(d), pairs = stats_pairs(d);
  Index const b = blockIdx.z, hq = blockIdx.y, split = static_cast<Index>(blockIdx.x) / pairs;
  Index rem = static_cast<Index>(blockIdx.x) % pairs, ti = 0;
  while (rem >= tiles - ti) {  // pair index -> (ti, tj) over the upper triangle, row by row
    rem -= tiles - ti;
    ++ti;
  }
  Index const tj = ti + rem, a0 = ti * stats_tile, b0 = tj * stats_tile;
  float const* mu = mean + (b * heads + hq) * d;
  int const tx = static_cast<int>(threadIdx.x) % 16, ty = static_cast<int>(threadIdx.x) / 16;
  float acc[4][4] = {};
  double total[4][4] = {};
  Index first = 0, last = 0;
  rule.range(split, splits, first, last);
  for (Index base = first; base < last; base += stats_rows) {
    if (threadIdx.x < stats_rows) {
      Index const r = base + threadIdx.x;
      use[threadIdx.x] = r < last && rule(b, r);
    }
    __syncthreads();
    for (int e = static_cast<int>(threadIdx.x); e < stats_rows * stats_tile; e += stats_threads) {
      int const rr = e / stats_tile, cc = e % stats_tile;
      Index const ca = a0 + cc, cb = b0 + cc;
      float va = 0.0f, vb = 0.0f;
      if (use[rr]) {
        auto const* x = q.row(b, hq, base + rr);
        va = ca < d ? to_float(x[ca]) - mu[ca] : 0.0f;
        vb = cb < d ? to_float(x[cb]) - mu[cb] : 0.0f;
      }
      xa[rr][cc] = va;
      xb[rr][cc] = vb;
    }
    __syncthreads();
    for (int rr = 0; rr < stats_rows; ++rr) {
      float4 const va = *reinterpret_cast<float4 const*>(&xa[rr][ty * 4]);
      float4 const vb = *reinterpret_cast<float4 const*>(&xb[rr][tx * 4]);
      float const ra[4] = {va.x, va.y, va.z, va.w}, rb[4] = {vb.x, vb.y, vb.z, vb.w};
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j)
          acc[i][j] += ra[i] * rb[j];
    }
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        total[i][j] += static_cast<double>(acc[i][j]);
        acc[i][j] = 0.0f;
      }
    __syncthreads();  // the staged rows are read before the next step overwrites them
  }
  float* out = s.gram + ((b * heads + hq) * splits + split) * d * d;
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      Index const r = a0 + ty * 4 + i, c = b0 + tx * 4 + j;
      if (r < d && c < d)
        out[r * d + c] = static_cast<float>(total[i][j]);
    }
}

/// Pass 4, grid (entry blocks, Hq, B): covariance = (sum over splits, in order, fp64) / N; (i, j) and (j, i) both
/// from the upper triangle.
template <class Extents>
__global__ void stats_covariance_kernel(Extents e, Index splits, StatsScratch s, float* covariance) {
  Index const b = blockIdx.z, hq = blockIdx.y, item = b * e.heads + hq, d = e.dim, n = s.n[item];
  Index const stride = static_cast<Index>(gridDim.x) * blockDim.x;
  for (Index x = static_cast<Index>(blockIdx.x) * blockDim.x + threadIdx.x; x < d * d; x += stride) {
    Index const i = x / d, j = x % d, lo = i < j ? i : j, hi = i < j ? j : i;
    double sum = 0.0;
    for (Index p = 0; p < splits; ++p)
      sum += static_cast<double>(s.gram[(item * splits + p) * d * d + lo * d + hi]);
    covariance[item * d * d + x] = n > 0 ? static_cast<float>(sum / static_cast<double>(n)) : 0.0f;
  }
}

}  // namespace kvc::backend::cuda

namespace kvc {

/// kvc::query_statistics on CUDA (see the file comment). Workspace (device): fp64 partial sums and counts per row
/// split, and one fp32 partial Gram [d, d] per (sequence, query head, split): 16 splits x 32 heads x 64 KiB = 32 MiB
/// at d = 128 and 64K+ rows. `positions` ([batch, R], optional) is device memory. Limits: batch and query heads
/// <= 65535; 8 fp64 rows of the head dim in shared memory (d <= 768 with the default 48 KiB).
template <>
struct Kernel<QueryStatisticsStep, Cuda> {
  static std::size_t workspace_bytes(Cuda const&, KVExtents const& q) { return backend::cuda::StatsScratch::bytes(q); }

  template <Element T>
  static Status run(Cuda const& cuda, TokenRows<T const, StridedLayout, DeviceSpace> const& queries,
                    Index const* positions, StatisticsRows const& sel, float* mean, float* covariance, Workspace ws) {
    namespace bc = backend::cuda;
    KVExtents const e = queries.extents();
    if (e.batch * e.heads == 0 || e.dim == 0)
      return {};
    KVC_RETURN_IF_ERROR(
        bc::head_grid_status(e.batch, e.heads, "kvc::query_statistics(Cuda): batch and query heads must be <= 65535"));
    WorkspaceCarver carve(ws);
    auto const scratch = bc::StatsScratch::carve(carve, e);
    if (!scratch.complete())
      return {Errc::out_of_capacity,
              "kvc::query_statistics(Cuda): workspace smaller than query_statistics_workspace_bytes()"};
    auto const smem = static_cast<std::size_t>(bc::stats_warps * e.dim) * sizeof(double);
    KVC_RETURN_IF_ERROR(bc::shared_memory_status(
        smem, "kvc::query_statistics(Cuda): head dim too large for the device's shared memory (8 fp64 rows)"));
    Index const splits = bc::stats_splits(e.tokens);
    bc::SampleRule const rule{sel.n_sink, sel.skip_rows, sel.count < 0 ? e.tokens : sel.count, e.tokens, positions};
    KVC_RETURN_IF_ERROR(bc::pending_status());
    dim3 const heads(static_cast<unsigned>(e.heads), static_cast<unsigned>(e.batch));
    KVC_RETURN_IF_ERROR(bc::launch(KVC_CUDA_KERNEL("kvc::query_statistics(Cuda)", bc::stats_sum_kernel),
                                   dim3(static_cast<unsigned>(splits), heads.x, heads.y),
                                   bc::stats_warps * bc::warp_size, smem, cuda.stream, queries, rule, splits, scratch));
    KVC_RETURN_IF_ERROR(bc::launch(KVC_CUDA_KERNEL("kvc::query_statistics(Cuda)", bc::stats_mean_kernel), heads, 128, 0,
                                   cuda.stream, e, splits, scratch, mean));
    if (covariance != nullptr) {
      KVC_RETURN_IF_ERROR(
          bc::launch(KVC_CUDA_KERNEL("kvc::query_statistics(Cuda)",
                                     (bc::stats_gram_kernel<TokenRows<T const, StridedLayout, DeviceSpace>>)),
                     dim3(static_cast<unsigned>(splits * bc::stats_pairs(e.dim)), heads.x, heads.y), bc::stats_threads,
                     0, cuda.stream, queries, rule, splits, mean, scratch));
      KVC_RETURN_IF_ERROR(
          bc::launch(KVC_CUDA_KERNEL("kvc::query_statistics(Cuda)", bc::stats_covariance_kernel<KVExtents>),
                     dim3(bc::grid_dim((e.dim * e.dim + 255) / 256, 1024), heads.x, heads.y), 256, 0, cuda.stream, e,
                     splits, scratch, covariance));
    }
    return {};
  }
};

}  // namespace kvc
