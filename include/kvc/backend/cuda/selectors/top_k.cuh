// SPDX-License-Identifier: Apache-2.0
// kvc/backend/cuda/selectors/top_k.cuh: CUDA TopKSelector: radix select + ordered compaction, one block per head.
//
// Same contract and total order as the CPU kernel, so CPU and CUDA keep identical sets for identical scores:
// higher score first, ties to the lower index, NaN as -inf, -0 == +0, protected windows always kept.
#pragma once

#include <kvc/backend/cuda/config.cuh>
#include <kvc/selectors/top_k.hpp>

#include <cub/block/block_scan.cuh>

#include <cstddef>
#include <cstdint>

namespace kvc::backend::cuda {

inline constexpr int top_k_threads = 512;

/// Maps a score to an unsigned key with the same order (NaN -> the key of -inf; -0 -> the key of +0).
__device__ inline std::uint32_t order_key(float s) {
  std::uint32_t u = isnan(s) ? 0xff800000u : __float_as_uint(s);
  if (u == 0x80000000u)
    u = 0;
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

/// One block per (h, b). Phase 1 finds the m-th largest key of the unprotected middle by four 8-bit radix
/// passes over shared histograms. Phase 2 walks the middle in ascending order, one tile of threads at a time,
/// and writes every key above the threshold plus the first `need_eq` keys equal to it: ascending output without
/// a sort, and ties resolved to the lower index.
template <class Sel>
__global__ void __launch_bounds__(top_k_threads)
    top_k_kernel(Sel sel, ScoreSpan<DeviceSpace> scores, KeepPlan<DeviceSpace> plan) {
  using Scan = cub::BlockScan<int, top_k_threads>;
  __shared__ typename Scan::TempStorage scan_storage;
  __shared__ unsigned hist[256];
  __shared__ std::uint32_t s_prefix;
  __shared__ Index s_remaining;
  __shared__ Index s_running[2];  // selected so far, equal-to-threshold seen so far

  Index const b = blockIdx.y, h = blockIdx.x;
  Index const n = clamp_length(scores.length(b, h), scores.tokens);
  auto const c = detail::top_k_counts(sel, b, h, n);
  // The host checked plan.capacity >= top_k_capacity_bound(); the clamp only guards memory against a device-side
  // per-head budget table that promises more than the bound allowed for.
  Index const keep = c.keep < plan.capacity ? c.keep : plan.capacity;
  Index* out = plan.indices(b, h);
  float const* s = scores.row(b, h);
  if (threadIdx.x == 0)
    plan.kept(b, h) = keep;
  if (c.keep == n) {
    for (Index t = threadIdx.x; t < keep; t += blockDim.x)
      out[t] = t;
    return;
  }
  for (Index t = threadIdx.x; t < c.sink_end && t < keep; t += blockDim.x)
    out[t] = t;
  Index const m = c.keep - c.sink_end - (n - c.recent_begin);  // from the middle [sink_end, recent_begin)

  std::uint32_t prefix = 0, mask = 0;
  if (threadIdx.x == 0)
    s_remaining = m;
  __syncthreads();  // every thread reads s_remaining below, also when no radix pass runs (m == 0)
  for (int shift = 24; shift >= 0 && m > 0; shift -= 8) {
    for (int i = threadIdx.x; i < 256; i += blockDim.x)
      hist[i] = 0;
    __syncthreads();
    for (Index t = c.sink_end + threadIdx.x; t < c.recent_begin; t += blockDim.x) {
      std::uint32_t const k = order_key(s[t]);
      if ((k & mask) == prefix)
        atomicAdd(&hist[(k >> shift) & 0xffu], 1u);
    }
    __syncthreads();
    if (threadIdx.x == 0) {  // walk digits from the top until the m-th largest is inside one bucket
      Index above = 0;
      int d = 255;
      for (; d > 0 && above + hist[d] < s_remaining; --d)
        above += hist[d];
      s_remaining -= above;
      s_prefix = prefix | (static_cast<std::uint32_t>(d) << shift);
    }
    __syncthreads();
    prefix = s_prefix;
    mask |= 0xffu << shift;
  }
  Index const need_eq = s_remaining;  // how many keys equal to the threshold are taken (lowest indices)
  if (threadIdx.x == 0) {
    s_running[0] = 0;
    s_running[1] = 0;
  }
  __syncthreads();
  for (Index base = c.sink_end; base < c.recent_begin && m > 0; base += blockDim.x) {
    Index const t = base + threadIdx.x;
    std::uint32_t const k = t < c.recent_begin ? order_key(s[t]) : 0u;
    bool const valid = t < c.recent_begin;
    int const is_eq = valid && k == prefix ? 1 : 0;
    int eq_rank = 0, eq_total = 0;
    Scan(scan_storage).ExclusiveSum(is_eq, eq_rank, eq_total);
    __syncthreads();
    int const take = valid && (k > prefix || (is_eq && s_running[1] + eq_rank < need_eq)) ? 1 : 0;
    int pos = 0, taken = 0;
    Scan(scan_storage).ExclusiveSum(take, pos, taken);
    Index const j = c.sink_end + s_running[0] + pos;
    if (take && j < keep)
      out[j] = t;
    __syncthreads();
    if (threadIdx.x == 0) {
      s_running[0] += taken;
      s_running[1] += eq_total;
    }
    __syncthreads();
  }
  Index const first_recent = c.sink_end + (m > 0 ? m : 0);
  for (Index t = c.recent_begin + threadIdx.x; t < n; t += blockDim.x)
    if (first_recent + (t - c.recent_begin) < keep)
      out[first_recent + (t - c.recent_begin)] = t;
}

}  // namespace kvc::backend::cuda

namespace kvc {

/// TopKSelector on CUDA. No workspace. A plan whose capacity is below detail::top_k_capacity_bound() (the most any
/// head can keep, known on the host) is rejected with out_of_capacity before launching: stricter than the CPU,
/// which checks the real counts, because the device cannot report a short plan without a synchronisation.
template <Budget B>
struct Kernel<TopKSelector<B>, Cuda> {
  static std::size_t workspace_bytes(Cuda const&, TopKSelector<B> const&, Index, Index, Index) { return 0; }

  static Status run(Cuda const& cuda, TopKSelector<B> const& sel, ScoreSpan<DeviceSpace> scores,
                    KeepPlan<DeviceSpace> plan, Workspace) {
    KVC_RETURN_IF_ERROR(sel.check());
    if (plan.capacity < detail::top_k_capacity_bound(sel, scores.tokens))
      return {
          Errc::out_of_capacity,
          "kvc::select(Cuda): `plan.capacity` is below the most a head can keep (size plans with capacity = tokens)"};
    if (scores.batch * scores.heads == 0)
      return {};
    KVC_RETURN_IF_ERROR(backend::cuda::head_grid_status(scores.batch, scores.heads,
                                                        "kvc::select(Cuda): batch and heads must be <= 65535"));
    KVC_RETURN_IF_ERROR(backend::cuda::pending_status());
    dim3 const grid(static_cast<unsigned>(scores.heads), static_cast<unsigned>(scores.batch));
    backend::cuda::top_k_kernel<<<grid, backend::cuda::top_k_threads, 0, cuda.stream>>>(sel, scores, plan);
    return backend::cuda::launch_status("kvc::select(top_k, Cuda): kernel launch failed");
  }
};

}  // namespace kvc
