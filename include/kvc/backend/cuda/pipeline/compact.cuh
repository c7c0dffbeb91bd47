// SPDX-License-Identifier: Apache-2.0
// kvc/backend/cuda/pipeline/compact.cuh: CUDA compaction (in place, tile-ordered) and gather (out of place).
#pragma once

#include <kvc/backend/cuda/config.cuh>
#include <kvc/pipeline/compact.hpp>

#include <type_traits>

namespace kvc::backend::cuda {

inline constexpr int compact_tile = 32;  // rows staged per step

/// In place, one block per (h, b). Moves go from row index[j] to row j with index[j] >= j. A tile's rows are all
/// read into shared memory before any of them is written, and tiles run in ascending order, so no write lands on
/// a row a later move still has to read (the ascending-move argument, made safe for parallel threads).
template <class Rows>
__global__ void compact_rows_kernel(KeepPlan<DeviceSpace> plan, Rows rows) {
  using T = typename Rows::value_type;
  extern __shared__ unsigned char staged_bytes[];
  T* staged = reinterpret_cast<T*>(staged_bytes);  // [compact_tile, dim]
  Index const b = blockIdx.y, h = blockIdx.x, dim = rows.extents().dim;
  Index const count = plan.kept(b, h);
  Index const* idx = plan.indices(b, h);
  for (Index base = 0; base < count; base += compact_tile) {
    Index const rows_here = count - base < compact_tile ? count - base : compact_tile;
    for (Index e = threadIdx.x; e < rows_here * dim; e += blockDim.x)
      staged[e] = rows.row(b, h, idx[base + e / dim])[e % dim];
    __syncthreads();
    for (Index e = threadIdx.x; e < rows_here * dim; e += blockDim.x)
      rows.row(b, h, base + e / dim)[e % dim] = staged[e];
    __syncthreads();
  }
}

/// Out of place, fully parallel: grid (row blocks, heads, batch).
template <class Src, class Dst>
__global__ void gather_rows_kernel(KeepPlan<DeviceSpace> plan, Src src, Dst dst) {
  using T = typename Dst::value_type;
  Index const b = blockIdx.z, h = blockIdx.y, dim = dst.extents().dim;
  Index const count = plan.kept(b, h);
  Index const* idx = plan.indices(b, h);
  Index const stride = static_cast<Index>(gridDim.x) * blockDim.x;
  for (Index e = static_cast<Index>(blockIdx.x) * blockDim.x + threadIdx.x; e < count * dim; e += stride)
    dst.row(b, h, e / dim)[e % dim] = from_float<T>(to_float(src.row(b, h, idx[e / dim])[e % dim]));
}

}  // namespace kvc::backend::cuda

namespace kvc {

/// Compacts a device cache in place. The plan must come from kvc::select (it is not validated on the device).
template <KVCacheView C>
Status compact(Cuda const& cuda, KeepPlan<DeviceSpace> const& plan, C const& cache) {
  static_assert(AccessibleFrom<C, Cuda>, "kvc::compact(Cuda): the cache must live in device memory");
  namespace bc = backend::cuda;
  if (plan.batch * plan.heads == 0)
    return {};
  KVC_RETURN_IF_ERROR(
      bc::head_grid_status(plan.batch, plan.heads, "kvc::compact/gather(Cuda): batch and heads must be <= 65535"));
  dim3 const grid(static_cast<unsigned>(plan.heads), static_cast<unsigned>(plan.batch));
  auto launch = [&](auto const& rows) {
    using T = typename std::remove_cvref_t<decltype(rows)>::value_type;
    auto const smem = static_cast<std::size_t>(bc::compact_tile * rows.extents().dim) * sizeof(T);
    bc::compact_rows_kernel<<<grid, 256, smem, cuda.stream>>>(plan, rows);
  };
  launch(cache.keys);
  launch(cache.values);
  return bc::launch_status("kvc::compact(Cuda): kernel launch failed");
}

/// Copies the kept rows of `src` into slots [0, count) of `dst` (device caches; element types may differ).
template <KVCacheView Src, KVCacheView Dst>
Status gather(Cuda const& cuda, KeepPlan<DeviceSpace> const& plan, Src const& src, Dst const& dst) {
  static_assert(AccessibleFrom<Src, Cuda> && AccessibleFrom<Dst, Cuda>,
                "kvc::gather(Cuda): caches must be in device memory");
  namespace bc = backend::cuda;
  if (dst.keys.extents().dim != src.keys.extents().dim || dst.values.extents().dim != src.values.extents().dim)
    return {Errc::invalid_argument, "kvc::gather(Cuda): `dst` must have the dims of `src`"};
  if (plan.batch * plan.heads == 0)
    return {};
  KVC_RETURN_IF_ERROR(
      bc::head_grid_status(plan.batch, plan.heads, "kvc::compact/gather(Cuda): batch and heads must be <= 65535"));
  dim3 const grid(bc::grid_dim(plan.capacity * src.keys.extents().dim / 256 + 1, 1024),
                  static_cast<unsigned>(plan.heads), static_cast<unsigned>(plan.batch));
  bc::gather_rows_kernel<<<grid, 256, 0, cuda.stream>>>(plan, src.keys, dst.keys);
  bc::gather_rows_kernel<<<grid, 256, 0, cuda.stream>>>(plan, src.values, dst.values);
  return bc::launch_status("kvc::gather(Cuda): kernel launch failed");
}

}  // namespace kvc
