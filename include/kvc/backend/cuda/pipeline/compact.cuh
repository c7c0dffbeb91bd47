// SPDX-License-Identifier: Apache-2.0
// kvc/backend/cuda/pipeline/compact.cuh: CUDA compaction (in place, tile-ordered), gather (out of place) and append.
#pragma once

#include <kvc/backend/cuda/config.cuh>
#include <kvc/pipeline/compact.hpp>

#include <cstddef>
#include <type_traits>

namespace kvc::backend::cuda {

inline constexpr int compact_tile = 32;  // rows staged per step
inline constexpr int token_tile = 256;   // per-token scalars staged per step (one per thread)

/// In place, one block per (h, b). Moves go from row index[j] to row j with index[j] >= j. A tile's rows are all
/// read into shared memory before any of them is written, and tiles run in ascending order, so no write lands on
/// a row a later move still has to read (the ascending-move argument, made safe for parallel threads).
template <class Rows>
__global__ void compact_rows_kernel(KeepPlan<DeviceSpace> plan, Rows rows) {
  using T = typename Rows::value_type;
  unsigned char* const staged_bytes = dynamic_shared<unsigned char>();
  T* staged = reinterpret_cast<T*>(staged_bytes);  // [compact_tile, dim]
  Index const b = blockIdx.y, h = blockIdx.x, dim = rows.extents().dim;
  Index const count = clamp_length(plan.kept(b, h), plan.capacity);
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

/// In place for per-token scalars [batch, heads, tokens] (positions, accumulators): the same tile order, one token
/// per thread, held in a register between the block's reads and its writes.
template <class T>
__global__ void compact_tokens_kernel(KeepPlan<DeviceSpace> plan, TokenArray<T, DeviceSpace> a) {
  Index const b = blockIdx.y, h = blockIdx.x;
  Index const count = clamp_length(plan.kept(b, h), plan.capacity);
  Index const* idx = plan.indices(b, h);
  T* row = a.row(b, h);
  for (Index base = 0; base < count; base += blockDim.x) {
    Index const j = base + threadIdx.x;
    T value{};
    if (j < count)
      value = row[idx[j]];
    __syncthreads();
    if (j < count)
      row[j] = value;
    __syncthreads();
  }
}

/// In place for the cache's positions (wherever its layout keeps them: [batch, heads, tokens] or one per row of a
/// ragged or per-head paged pool), in the same tile order as compact_tokens_kernel.
template <class C>
__global__ void compact_positions_kernel(KeepPlan<DeviceSpace> plan, C cache) {
  Index const b = blockIdx.y, h = blockIdx.x;
  Index const count = clamp_length(plan.kept(b, h), plan.capacity);
  Index const* idx = plan.indices(b, h);
  for (Index base = 0; base < count; base += blockDim.x) {
    Index const j = base + threadIdx.x;
    Index value = 0;
    if (j < count)
      value = cache.position_ref(b, h, idx[j]);
    __syncthreads();
    if (j < count)
      cache.position_ref(b, h, j) = value;
    __syncthreads();
  }
}

/// Writes each head's new length (count[b, h], clamped to [0, capacity] as the row and position kernels clamp it, so
/// the length never claims rows that were not moved) into a per-head table, or head 0's into a per-sequence one.
/// (Every __global__ in a header is a template: a plain one is defined again in each translation unit.)
template <class Plan>
__global__ void plan_lengths_kernel(Plan plan, Lengths lengths) {
  Index const i = static_cast<Index>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= plan.batch * plan.heads)
    return;
  Index const b = i / plan.heads, h = i % plan.heads, kept = clamp_length(plan.count[i], plan.capacity);
  if (lengths.per_head())
    lengths.data[i] = kept;
  else if (h == 0)
    lengths.data[b] = kept;
}

/// Rows head (b, h) of a gather writes: the plan's count, clamped to the plan's and the destination head's capacity
/// (a ragged destination's segment; the device cannot report a short segment, the engine sizes it from the counts).
template <class DstRows>
__device__ Index gathered_rows(KeepPlan<DeviceSpace> const& plan, DstRows const& dst, Index b, Index h) {
  Index const count = clamp_length(plan.kept(b, h), plan.capacity);
  Index const cap = head_capacity(dst.layout(), b, h);
  return count < cap ? count : cap;
}

/// A gather's new lengths: the rows each head received (gathered_rows), like plan_lengths_kernel otherwise.
template <class Dst>
__global__ void gather_lengths_kernel(KeepPlan<DeviceSpace> plan, Dst dst) {
  Index const i = static_cast<Index>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= plan.batch * plan.heads)
    return;
  Index const b = i / plan.heads, h = i % plan.heads;
  if (dst.lengths.per_head())
    dst.lengths.data[i] = gathered_rows(plan, dst.keys, b, h);
  else if (h == 0)
    dst.lengths.data[b] = gathered_rows(plan, dst.keys, b, h);
}

/// Out of place, fully parallel over the rows of every head: grid (row blocks, heads, batch).
template <class SrcRows, class DstRows>
__global__ void gather_rows_kernel(KeepPlan<DeviceSpace> plan, SrcRows src, DstRows dst) {
  Index const b = blockIdx.z, h = blockIdx.y, dim = dst.extents().dim;
  Index const count = gathered_rows(plan, dst, b, h);
  Index const* idx = plan.indices(b, h);
  auto const ss = src.scale(b, h);
  auto const ds = dst.scale(b, h);
  Index const stride = static_cast<Index>(gridDim.x) * blockDim.x;
  for (Index e = static_cast<Index>(blockIdx.x) * blockDim.x + threadIdx.x; e < count * dim; e += stride)
    copy_elements(dst.row(b, h, e / dim) + e % dim, ds, src.row(b, h, idx[e / dim]) + e % dim, ss, 1);
}

/// Out of place per-token values: dst positions (src's, or src slot numbers) and carried arrays.
template <class Src, class Dst, class... Carried>
__global__ void gather_tokens_kernel(KeepPlan<DeviceSpace> plan, Src src, Dst dst, Carried... carried) {
  Index const b = blockIdx.z, h = blockIdx.y;
  Index const count = gathered_rows(plan, dst.keys, b, h);
  Index const* idx = plan.indices(b, h);
  Index const stride = static_cast<Index>(gridDim.x) * blockDim.x;
  for (Index j = static_cast<Index>(blockIdx.x) * blockDim.x + threadIdx.x; j < count; j += stride) {
    if (dst.positions)
      dst.position_ref(b, h, j) = src.position(b, h, idx[j]);
    ((carried.to(b, h, j) = carried.from(b, h, idx[j])), ...);
  }
}

/// Appends src tokens [begin, begin + count) after each head's length (clamped at capacity): grid (row blocks,
/// heads, batch). Reads dst's old lengths; append_lengths_kernel, ordered after it on the stream, writes the new.
template <class Dst, class Src>
__global__ void append_rows_kernel(Dst dst, Src src, Index begin, Index count) {
  Index const b = blockIdx.z, h = blockIdx.y, cap = dst.capacity(b, h);
  Index const dk = dst.keys.extents().dim, dv = dst.values.extents().dim, width = dk > dv ? dk : dv;
  Index const at = dst.clamped_length(b, h);
  Index left = src.clamped_length(b, h) - begin;
  left = left < 0 ? 0 : (left < count ? left : count);
  Index const m = at + left > cap ? cap - at : left;
  auto const sks = src.keys.scale(b, h), svs = src.values.scale(b, h);
  auto const dks = dst.keys.scale(b, h), dvs = dst.values.scale(b, h);
  Index const stride = static_cast<Index>(gridDim.x) * blockDim.x;
  for (Index e = static_cast<Index>(blockIdx.x) * blockDim.x + threadIdx.x; e < m * width; e += stride) {
    Index const j = e / width, c = e % width;  // one element each: copy_elements of one moves its bytes if it can
    if (c < dk)
      copy_elements(dst.keys.row(b, h, at + j) + c, dks, src.keys.row(b, h, begin + j) + c, sks, 1);
    if (c < dv)
      copy_elements(dst.values.row(b, h, at + j) + c, dvs, src.values.row(b, h, begin + j) + c, svs, 1);
    if (c == 0 && dst.positions)
      dst.position_ref(b, h, at + j) = src.position(b, h, begin + j);
  }
}

template <class Dst, class Src>
__global__ void append_lengths_kernel(Dst dst, Src src, Index begin, Index count) {
  Index const heads = dst.keys.extents().heads;
  Index const i = static_cast<Index>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= dst.keys.extents().batch * heads)
    return;
  Index const b = i / heads, h = i % heads, cap = dst.capacity(b, h);
  if (!dst.lengths.per_head() && h != 0)
    return;
  Index const at = dst.clamped_length(b, h);
  Index left = src.clamped_length(b, h) - begin;
  left = left < 0 ? 0 : (left < count ? left : count);
  dst.lengths.data[dst.lengths.per_head() ? i : b] = at + left > cap ? cap : at + left;
}

/// Staged bytes compact_rows_kernel needs for an extra: none for a per-token scalar array or an absent row array.
template <class T>
std::size_t extra_staged_bytes(TokenArray<T, DeviceSpace> const&) noexcept {
  return 0;
}
template <class T, class L>
std::size_t extra_staged_bytes(TokenRows<T, L, DeviceSpace> const& a) noexcept {
  return a.data() ? static_cast<std::size_t>(compact_tile * a.extents().dim) * sizeof(T) : 0;
}

/// Enqueues the in-place compaction of one extra array: per-token scalars (TokenArray) one per thread, per-token
/// rows (TokenRows, e.g. MomentKV's u_j) like K and V; a TokenRows with null data is an absent array and skipped.
template <class T>
Status compact_extra(cudaStream_t stream, dim3 grid, KeepPlan<DeviceSpace> const& plan,
                     TokenArray<T, DeviceSpace> const& a) {
  return launch(KVC_CUDA_KERNEL("kvc::compact(Cuda)", compact_tokens_kernel), grid, token_tile, 0, stream, plan, a);
}
template <class T, class L>
Status compact_extra(cudaStream_t stream, dim3 grid, KeepPlan<DeviceSpace> const& plan,
                     TokenRows<T, L, DeviceSpace> const& a) {
  if (a.data() == nullptr)
    return {};
  return launch(KVC_CUDA_KERNEL("kvc::compact(Cuda)", compact_rows_kernel), grid, 256, extra_staged_bytes(a), stream,
                plan, a);
}

}  // namespace kvc::backend::cuda

namespace kvc {

/// Compaction on CUDA: one block per head for the rows (in place needs the tile order), then positions, extra
/// arrays (per-token scalars, or per-token rows staged like K and V) and lengths. The plan must come from kvc::select
/// (it is not validated on the device; counts are clamped to the plan's capacity). A per-sequence length table receives
/// head 0's count.
template <>
struct Kernel<CompactStep, Cuda> {
  template <KVCacheView C, class... Extra>
  static Status run(Cuda const& cuda, KeepPlan<DeviceSpace> const& plan, C const& cache, Extra const&... extra) {
    namespace bc = backend::cuda;
    if (plan.batch * plan.heads == 0)
      return {};
    KVC_RETURN_IF_ERROR(
        bc::head_grid_status(plan.batch, plan.heads, "kvc::compact(Cuda): batch and heads must be <= 65535"));
    std::size_t const smem_k = static_cast<std::size_t>(bc::compact_tile * cache.keys.extents().dim) *
                               sizeof(typename C::keys_type::value_type);
    std::size_t const smem_v = static_cast<std::size_t>(bc::compact_tile * cache.values.extents().dim) *
                               sizeof(typename C::values_type::value_type);
    std::size_t smem = smem_k > smem_v ? smem_k : smem_v;
    ((smem = bc::extra_staged_bytes(extra) > smem ? bc::extra_staged_bytes(extra) : smem), ...);
    KVC_RETURN_IF_ERROR(bc::shared_memory_status(smem, "kvc::compact(Cuda): head dim too large for 32 staged rows"));
    KVC_RETURN_IF_ERROR(bc::pending_status());
    dim3 const grid(static_cast<unsigned>(plan.heads), static_cast<unsigned>(plan.batch));
    KVC_RETURN_IF_ERROR(bc::launch(KVC_CUDA_KERNEL("kvc::compact(Cuda)", bc::compact_rows_kernel), grid, 256, smem_k,
                                   cuda.stream, plan, cache.keys));
    KVC_RETURN_IF_ERROR(bc::launch(KVC_CUDA_KERNEL("kvc::compact(Cuda)", bc::compact_rows_kernel), grid, 256, smem_v,
                                   cuda.stream, plan, cache.values));
    if (cache.positions)
      KVC_RETURN_IF_ERROR(bc::launch(KVC_CUDA_KERNEL("kvc::compact(Cuda)", bc::compact_positions_kernel), grid,
                                     bc::token_tile, 0, cuda.stream, plan, cache));
    Status carried{};  // the first failure among the carried arrays (the rest are not launched)
    ((carried = carried.ok() ? bc::compact_extra(cuda.stream, grid, plan, extra) : carried), ...);
    KVC_RETURN_IF_ERROR(carried);
    if (cache.lengths.data)
      KVC_RETURN_IF_ERROR(bc::launch(KVC_CUDA_KERNEL("kvc::compact(Cuda)", bc::plan_lengths_kernel),
                                     bc::grid_dim((plan.batch * plan.heads + 255) / 256), 256, 0, cuda.stream, plan,
                                     cache.lengths));
    return {};
  }
};

/// Gather on CUDA: fully parallel over rows of every head.
template <>
struct Kernel<GatherStep, Cuda> {
  template <KVCacheView Src, KVCacheView Dst, class... Carried>
  static Status run(Cuda const& cuda, KeepPlan<DeviceSpace> const& plan, Src const& src, Dst const& dst,
                    Carried const&... carried) {
    namespace bc = backend::cuda;
    // Uniform destinations must hold the plan's capacity; a ragged one is sized per head from the counts (clamped).
    if (!HasHeadCapacity<typename Dst::keys_type::layout_type> && plan.capacity > dst.keys.extents().tokens)
      return {Errc::out_of_capacity, "kvc::gather(Cuda): `dst` needs at least plan.capacity token slots"};
    if (plan.batch * plan.heads == 0)
      return {};
    KVC_RETURN_IF_ERROR(
        bc::head_grid_status(plan.batch, plan.heads, "kvc::gather(Cuda): batch and heads must be <= 65535"));
    KVC_RETURN_IF_ERROR(bc::pending_status());
    Index const width =
        src.keys.extents().dim > src.values.extents().dim ? src.keys.extents().dim : src.values.extents().dim;
    dim3 const grid(bc::grid_dim(plan.capacity * width / 256 + 1, 1024), static_cast<unsigned>(plan.heads),
                    static_cast<unsigned>(plan.batch));
    KVC_RETURN_IF_ERROR(bc::launch(KVC_CUDA_KERNEL("kvc::gather(Cuda)", bc::gather_rows_kernel), grid, 256, 0,
                                   cuda.stream, plan, src.keys, dst.keys));
    KVC_RETURN_IF_ERROR(bc::launch(KVC_CUDA_KERNEL("kvc::gather(Cuda)", bc::gather_rows_kernel), grid, 256, 0,
                                   cuda.stream, plan, src.values, dst.values));
    if (dst.positions || sizeof...(Carried) > 0)
      KVC_RETURN_IF_ERROR(bc::launch(KVC_CUDA_KERNEL("kvc::gather(Cuda)", bc::gather_tokens_kernel),
                                     dim3(bc::grid_dim(plan.capacity / 256 + 1, 1024), grid.y, grid.z), 256, 0,
                                     cuda.stream, plan, src, dst, carried...));
    if (dst.lengths.data)
      KVC_RETURN_IF_ERROR(bc::launch(KVC_CUDA_KERNEL("kvc::gather(Cuda)", bc::gather_lengths_kernel),
                                     bc::grid_dim((plan.batch * plan.heads + 255) / 256), 256, 0, cuda.stream, plan,
                                     dst));
    return {};
  }
};

/// Append on CUDA. A head that would pass dst's capacity is clamped at it (the device cannot report it without a
/// synchronisation): engines know their lengths on the host and size the cache so that it cannot happen.
template <>
struct Kernel<AppendStep, Cuda> {
  template <KVCacheView Dst, KVCacheView Src>
  static Status run(Cuda const& cuda, Dst const& dst, Src const& src, Index begin, Index count) {
    namespace bc = backend::cuda;
    KVExtents const e = dst.keys.extents();
    if (e.batch * e.heads == 0 || count == 0)
      return {};
    KVC_RETURN_IF_ERROR(bc::head_grid_status(e.batch, e.heads, "kvc::append(Cuda): batch and heads must be <= 65535"));
    KVC_RETURN_IF_ERROR(bc::pending_status());
    Index const width = e.dim > dst.values.extents().dim ? e.dim : dst.values.extents().dim;
    Index const most = count < src.keys.extents().tokens ? count : src.keys.extents().tokens;
    dim3 const grid(bc::grid_dim(most * width / 256 + 1, 1024), static_cast<unsigned>(e.heads),
                    static_cast<unsigned>(e.batch));
    KVC_RETURN_IF_ERROR(bc::launch(KVC_CUDA_KERNEL("kvc::append(Cuda)", bc::append_rows_kernel), grid, 256, 0,
                                   cuda.stream, dst, src, begin, count));
    KVC_RETURN_IF_ERROR(bc::launch(KVC_CUDA_KERNEL("kvc::append(Cuda)", bc::append_lengths_kernel),
                                   bc::grid_dim((e.batch * e.heads + 255) / 256), 256, 0, cuda.stream, dst, src, begin,
                                   count));
    return {};
  }
};

}  // namespace kvc
