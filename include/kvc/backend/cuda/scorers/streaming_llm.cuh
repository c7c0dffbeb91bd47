// SPDX-License-Identifier: Apache-2.0
// kvc/backend/cuda/scorers/streaming_llm.cuh: CUDA kernel for StreamingLLMScorer (positions only; reads no K/V).
#pragma once

#include <kvc/backend/cuda/config.cuh>
#include <kvc/scorers/streaming_llm.hpp>

#include <cstddef>
#include <math_constants.h>

namespace kvc::backend::cuda {

/// A template (instantiated once per program by the linker's COMDAT rules): a non-template __global__ defined in a
/// header is a multiple definition as soon as two translation units include it.
template <class Scorer>
__global__ void streaming_llm_kernel(Scorer s, ScoreSpan<DeviceSpace> out) {
  Index const b = blockIdx.z, h = blockIdx.y, n = clamp_length(out.length(b, h), out.tokens);
  auto const top = static_cast<float>(out.tokens);
  for (Index t = static_cast<Index>(blockIdx.x) * blockDim.x + threadIdx.x; t < out.tokens;
       t += static_cast<Index>(gridDim.x) * blockDim.x)
    out(b, h, t) = t >= n ? -CUDART_INF_F : (t < s.n_sink ? top : static_cast<float>(t));
}

}  // namespace kvc::backend::cuda

namespace kvc {

template <>
struct Kernel<StreamingLLMScorer, Cuda> {
  template <class Obs>
  static std::size_t workspace_bytes(Cuda const&, StreamingLLMScorer const&, KVExtents const&, Obs const&) {
    return 0;
  }

  template <KVCacheView C, class Obs>
  static Status run(Cuda const& cuda, StreamingLLMScorer const& s, C const&, Obs const&, ScoreSpan<DeviceSpace> out,
                    Workspace) {
    if (s.n_sink < 0)
      return {Errc::invalid_argument, "StreamingLLMScorer: `n_sink` must be >= 0"};
    if (out.tokens > streaming_llm_max_tokens)
      return {Errc::invalid_argument, "StreamingLLMScorer: more than 2^24 tokens cannot be ranked exactly in fp32"};
    if (out.batch * out.heads == 0 || out.tokens == 0)
      return {};
    KVC_RETURN_IF_ERROR(backend::cuda::head_grid_status(
        out.batch, out.heads, "kvc::score(streaming_llm, Cuda): batch and heads must be <= 65535"));
    KVC_RETURN_IF_ERROR(backend::cuda::pending_status());
    dim3 const grid(backend::cuda::grid_dim((out.tokens + 255) / 256, 1024), static_cast<unsigned>(out.heads),
                    static_cast<unsigned>(out.batch));
    KVC_RETURN_IF_ERROR(
        backend::cuda::launch(KVC_CUDA_KERNEL("kvc::score(streaming_llm, Cuda)", backend::cuda::streaming_llm_kernel),
                              grid, 256, 0, cuda.stream, s, out));
    return {};
  }
};

}  // namespace kvc
