// SPDX-License-Identifier: Apache-2.0
// kvc/backend/cuda/pipeline/state.cuh: CUDA kernels of kvc::zero_state, kvc::copy_indices, kvc::decode_budgets and
// kvc::push_queries. Stream operations and small kernels only: no synchronisation, so a decode step can be captured
// into a graph.
#pragma once

#include <kvc/backend/cuda/config.cuh>
#include <kvc/pipeline/state.hpp>

namespace kvc::backend::cuda {

/// One thread per element of the new rows (a row of d elements is contiguous in both views), then the positions.
/// The first row goes to *buf.fill when the buffer has one (a replayed graph's push lands after the rows pushed
/// since), else to buf.count; rows that would pass the capacity (a fill out of step with the host) are dropped.
template <class T>
__global__ void push_queries_kernel(QueryBuffer<T, DeviceSpace> buf,
                                    TokenRows<T const, StridedLayout, DeviceSpace> rows, Index const* positions) {
  KVExtents const e = rows.extents();
  Index const first = buf.fill ? *buf.fill : buf.count;
  if (first < 0)
    return;
  Index const stride = static_cast<Index>(gridDim.x) * blockDim.x;
  for (Index x = static_cast<Index>(blockIdx.x) * blockDim.x + threadIdx.x; x < e.rows() * e.dim; x += stride) {
    Index const c = x % e.dim, r = x / e.dim, i = r % e.tokens, q = (r / e.tokens) % e.heads,
                b = r / e.tokens / e.heads;
    if (first + i < buf.capacity)
      buf.row(b, q, first + i)[c] = rows.row(b, q, i)[c];
  }
  for (Index x = static_cast<Index>(blockIdx.x) * blockDim.x + threadIdx.x; x < e.batch * e.tokens; x += stride)
    if (first + x % e.tokens < buf.capacity)
      buf.positions[(x / e.tokens) * buf.capacity + first + x % e.tokens] = positions[x];
}

/// Advances the buffer's device fill by the n rows just pushed: a kernel of its own, launched after the push, since
/// every thread of the push reads the fill. A template: kernels defined in headers must be.
template <int>
__global__ void advance_fill_kernel(Index* fill, Index n) {
  if (blockIdx.x == 0 && threadIdx.x == 0)
    *fill += n;
}

/// One thread per sequence (it reads all of its heads' lengths before writing). A template: kernels defined in
/// headers must be, so that every translation unit may include them.
template <int>
__global__ void decode_budgets_kernel(Index* budgets, Index const* lengths, Index batch, Index heads, Index target) {
  Index const stride = static_cast<Index>(gridDim.x) * blockDim.x;
  for (Index b = static_cast<Index>(blockIdx.x) * blockDim.x + threadIdx.x; b < batch; b += stride)
    kvc::detail::decode_budgets_of(budgets + b * heads, lengths + b * heads, heads, target);
}

}  // namespace kvc::backend::cuda

namespace kvc {

template <>
struct Kernel<ZeroStateStep, Cuda> {
  static Status run(Cuda const& cuda, void* data, std::size_t bytes) {
    KVC_RETURN_IF_ERROR(backend::cuda::pending_status());
    if (cudaMemsetAsync(data, 0, bytes, cuda.stream) != cudaSuccess)
      return {Errc::backend_error, "kvc::zero_state(Cuda): cudaMemsetAsync failed"};
    return {};
  }
};

template <>
struct Kernel<CopyIndicesStep, Cuda> {
  static Status run(Cuda const& cuda, Index* dst, Index const* src, Index n) {
    KVC_RETURN_IF_ERROR(backend::cuda::pending_status());
    if (cudaMemcpyAsync(dst, src, static_cast<std::size_t>(n) * sizeof(Index), cudaMemcpyDeviceToDevice, cuda.stream) !=
        cudaSuccess)
      return {Errc::backend_error, "kvc::copy_indices(Cuda): cudaMemcpyAsync failed"};
    return {};
  }
};

template <>
struct Kernel<DecodeBudgetsStep, Cuda> {
  static Status run(Cuda const& cuda, Index* budgets, Index const* lengths, Index batch, Index heads, Index target) {
    KVC_RETURN_IF_ERROR(backend::cuda::pending_status());
    dim3 const grid(backend::cuda::grid_dim((batch + 127) / 128, 1024));
    return backend::cuda::launch(KVC_CUDA_KERNEL("kvc::decode_budgets(Cuda)", backend::cuda::decode_budgets_kernel<0>),
                                 grid, 128, 0, cuda.stream, budgets, lengths, batch, heads, target);
  }
};

template <>
struct Kernel<PushQueriesStep, Cuda> {
  template <Element T>
  static Status run(Cuda const& cuda, QueryBuffer<T, DeviceSpace> const& buf,
                    TokenRows<T const, StridedLayout, DeviceSpace> const& rows, Index const* positions) {
    KVC_RETURN_IF_ERROR(backend::cuda::pending_status());
    Index const elements = rows.extents().rows() * rows.extents().dim;
    dim3 const grid(backend::cuda::grid_dim((elements + 255) / 256, 1024));
    KVC_RETURN_IF_ERROR(
        backend::cuda::launch(KVC_CUDA_KERNEL("kvc::push_queries(Cuda)", backend::cuda::push_queries_kernel<T>), grid,
                              256, 0, cuda.stream, buf, rows, positions));
    if (buf.fill == nullptr)
      return {};
    return backend::cuda::launch(KVC_CUDA_KERNEL("kvc::push_queries(Cuda)", backend::cuda::advance_fill_kernel<0>), 1,
                                 1, 0, cuda.stream, buf.fill, rows.extents().tokens);
  }
};

}  // namespace kvc
