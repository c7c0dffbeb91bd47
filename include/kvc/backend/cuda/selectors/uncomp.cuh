// SPDX-License-Identifier: Apache-2.0
// kvc/backend/cuda/selectors/uncomp.cuh: CUDA allocation (one thread per (sequence, KV head)) and selection of
// UNCompSelector<DeviceSpace> (definition in selectors/uncomp.hpp; CPU oracle in backend/cpu/selectors/uncomp.hpp).
#pragma once

#include <kvc/backend/cuda/config.cuh>
#include <kvc/backend/cuda/detail/top_k.cuh>
#include <kvc/core/allocator.hpp>
#include <kvc/selectors/uncomp.hpp>

#include <cstddef>

namespace kvc::backend::cuda {

inline constexpr int uncomp_allocate_threads = 256;

/// One thread per (b, h): table[b, h] = min(n_bh, tokens[h]) (detail::uncomp_head_total), the length clamped to
/// [0, tokens]. The scores are not read.
template <class Sel>
__global__ void uncomp_allocate_kernel(Sel sel, ScoreSpan<DeviceSpace> scores, Index* table) {
  Index const i = static_cast<Index>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= scores.batch * scores.heads)
    return;
  Index const b = i / scores.heads, h = i % scores.heads;
  table[i] = kvc::detail::uncomp_head_total(sel, h, clamp_length(scores.length(b, h), scores.tokens));
}

}  // namespace kvc::backend::cuda

namespace kvc {

/// UNComp allocation on CUDA: the per-head budget list [heads] lives on the device (HeadBudgets<DeviceSpace>); no
/// workspace.
template <>
struct Kernel<Allocation<UNCompSelector<DeviceSpace>>, Cuda> {
  using Sel = UNCompSelector<DeviceSpace>;

  static std::size_t workspace_bytes(Cuda const&, Sel const&, Index, Index, Index) { return 0; }

  static Status run(Cuda const& cuda, Sel const& sel, ScoreSpan<DeviceSpace> scores, Index* table, Workspace) {
    namespace bc = backend::cuda;
    if (sel.budget.heads != scores.heads)
      return {Errc::invalid_argument, "kvc::allocate(uncomp, Cuda): the budget list must have one entry per KV head"};
    if (scores.batch * scores.heads == 0)
      return {};
    KVC_RETURN_IF_ERROR(bc::pending_status());
    Index const items = scores.batch * scores.heads;
    KVC_RETURN_IF_ERROR(
        bc::launch(KVC_CUDA_KERNEL("kvc::allocate(uncomp, Cuda)", bc::uncomp_allocate_kernel),
                   bc::grid_dim((items + bc::uncomp_allocate_threads - 1) / bc::uncomp_allocate_threads, 2147483647),
                   bc::uncomp_allocate_threads, 0, cuda.stream, sel, scores, table));
    return {};
  }
};

/// UNComp selection on CUDA: the allocation into a device table, then the CUDA TopKSelector over it.
template <>
struct Kernel<UNCompSelector<DeviceSpace>, Cuda> : detail::AllocatedTopK<UNCompSelector<DeviceSpace>, Cuda> {};

}  // namespace kvc
