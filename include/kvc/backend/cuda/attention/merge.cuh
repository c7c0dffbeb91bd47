// SPDX-License-Identifier: Apache-2.0
// kvc/backend/cuda/attention/merge.cuh: the CUDA kernel of kvc::merge_attention(backend, ...): one thread per row,
// merge_attention_row (the host loop's function).
#pragma once

#include <kvc/attention/merge.hpp>
#include <kvc/backend/cuda/config.cuh>

namespace kvc::backend::cuda {

template <class F>  // a template: a kernel defined in a header must not be one symbol per translation unit
__global__ void merge_attention_kernel(F* out_a, F* lse_a, F const* out_b, F const* lse_b, Index rows, Index dim) {
  Index const stride = static_cast<Index>(gridDim.x) * blockDim.x;
  for (Index r = static_cast<Index>(blockIdx.x) * blockDim.x + threadIdx.x; r < rows; r += stride)
    merge_attention_row(out_a + r * dim, lse_a + r, out_b + r * dim, lse_b[r], dim);
}

}  // namespace kvc::backend::cuda

namespace kvc {

template <>
struct Kernel<MergeStep, Cuda> {
  static Status run(Cuda const& cuda, float* out_a, float* lse_a, float const* out_b, float const* lse_b, Index rows,
                    Index dim) {
    KVC_RETURN_IF_ERROR(backend::cuda::pending_status());
    dim3 const grid(backend::cuda::grid_dim((rows + 127) / 128, 1024));
    return backend::cuda::launch(
        KVC_CUDA_KERNEL("kvc::merge_attention(Cuda)", backend::cuda::merge_attention_kernel<float>), grid, 128, 0,
        cuda.stream, out_a, lse_a, out_b, lse_b, rows, dim);
  }
};

}  // namespace kvc
