// SPDX-License-Identifier: Apache-2.0
// kvc/backend/cuda/selectors/ada_kv.cuh: CUDA AdaKV allocation (one block per sequence) and selection.
#pragma once

#include <kvc/backend/cuda/config.cuh>
#include <kvc/backend/cuda/detail/top_k.cuh>
#include <kvc/selectors/ada_kv.hpp>

#include <cstddef>
#include <cstdint>

namespace kvc::backend::cuda {

inline constexpr int ada_kv_threads = 512;

/// Per-head state of one sequence's allocation, in dynamic shared memory.
struct AdaKVShared {
  detail::AdaKVHead head;
  std::uint64_t pinned;        ///< kvpress: the head's safe-th largest key (valid when head.safe > 0)
  unsigned long long winners;  ///< the head's keys in the global pool's top `total`
};

/// The k-th largest (1 <= k <= live keys) of the keys `visit` hands this thread (visit(fn) calls fn(key) for each
/// of the thread's keys; the block's keys are distinct). Eight passes of 8-bit digits, most significant first,
/// each a 256-bin shared histogram of the keys that still match the chosen prefix: linear time, no sort, and exact
/// because the keys are unique (detail::ada_kv_key), so no tie is left to break.
template <class Visit>
__device__ std::uint64_t block_kth_largest(Visit visit, Index k, unsigned* hist, std::uint64_t& shared_prefix,
                                           Index& shared_need) {
  std::uint64_t prefix = 0, mask = 0;
  Index need = k;
  for (int shift = 56; shift >= 0; shift -= 8) {
    for (int i = threadIdx.x; i < 256; i += blockDim.x)
      hist[i] = 0;
    __syncthreads();
    visit([&](std::uint64_t key) {
      if ((key & mask) == prefix)
        atomicAdd(&hist[(key >> shift) & 255u], 1u);
    });
    __syncthreads();
    if (threadIdx.x == 0) {  // the digit holding the need-th key from the top
      Index above = 0;
      unsigned d = 255;
      for (; d > 0 && above + hist[d] < need; --d)
        above += hist[d];
      shared_prefix = prefix | (std::uint64_t{d} << shift);
      shared_need = need - above;
    }
    __syncthreads();
    prefix = shared_prefix;
    need = shared_need;
    mask |= std::uint64_t{255} << shift;
    __syncthreads();  // every thread has read the shared values before the next pass overwrites them
  }
  return prefix;
}

/// One block per sequence: the same allocation as the CPU's (backend/cpu/selectors/ada_kv.hpp), bit for bit: the
/// kvpress pins per head, then the `total`-th largest key of the pool of unpinned candidates, then each head's
/// winners counted with shared atomics (integers: the order of the additions does not matter).
template <class Sel>
__global__ void __launch_bounds__(ada_kv_threads)
    ada_kv_allocate_kernel(Sel sel, ScoreSpan<DeviceSpace> scores, Index* table) {
  unsigned char* const ada_shared_bytes = dynamic_shared<unsigned char>();
  auto* heads_state = reinterpret_cast<AdaKVShared*>(ada_shared_bytes);
  __shared__ unsigned hist[256];
  __shared__ std::uint64_t shared_prefix;
  __shared__ Index shared_need;
  Index const b = blockIdx.x, heads = scores.heads, tokens = scores.tokens;
  bool const kvpress = sel.reference == Reference::kvpress;
  for (Index h = threadIdx.x; h < heads; h += blockDim.x) {
    heads_state[h].head = detail::ada_kv_head(sel, b, h, clamp_length(scores.length(b, h), tokens));
    heads_state[h].winners = 0;
  }
  __syncthreads();
  auto key = [&](detail::AdaKVHead const& a, Index h, Index t) {
    return detail::ada_kv_key(scores(b, h, t), detail::ada_kv_protected(a, t), h * tokens + t);
  };
  // Candidates: the authors' unprotected tokens; kvpress's every token (protected ranked first).
  auto first = [&](detail::AdaKVHead const& a) { return kvpress ? Index{0} : a.sink_end; };
  auto last = [&](detail::AdaKVHead const& a) { return kvpress ? a.n : a.recent_begin; };
  Index total = 0, pool = 0;  // the same in every thread
  for (Index h = 0; h < heads; ++h) {
    detail::AdaKVHead const a = heads_state[h].head;
    total += a.share - a.safe;
    pool += last(a) - first(a) - a.safe;  // keys are unique: exactly `safe` of a head's candidates are pinned
    if (a.safe > 0) {
      std::uint64_t const pinned = block_kth_largest(
          [&](auto&& fn) {
            for (Index t = threadIdx.x; t < a.n; t += blockDim.x)
              fn(key(a, h, t));
          },
          a.safe, hist, shared_prefix, shared_need);
      if (threadIdx.x == 0)
        heads_state[h].pinned = pinned;
    }
  }
  __syncthreads();
  auto unpinned = [&](Index h, std::uint64_t k) { return heads_state[h].head.safe == 0 || k < heads_state[h].pinned; };
  auto visit_pool = [&](auto&& fn) {
    for (Index h = 0; h < heads; ++h) {
      detail::AdaKVHead const a = heads_state[h].head;
      for (Index t = first(a) + threadIdx.x; t < last(a); t += blockDim.x) {
        std::uint64_t const k = key(a, h, t);
        if (unpinned(h, k))
          fn(h, k);
      }
    }
  };
  if (total > 0) {
    std::uint64_t const threshold =
        total >= pool ? 0
                      : block_kth_largest([&](auto&& fn) { visit_pool([&](Index, std::uint64_t k) { fn(k); }); }, total,
                                          hist, shared_prefix, shared_need);
    visit_pool([&](Index h, std::uint64_t k) {
      if (k >= threshold)
        atomicAdd(&heads_state[h].winners, 1ull);
    });
  }
  __syncthreads();
  for (Index h = threadIdx.x; h < heads; h += blockDim.x) {
    detail::AdaKVHead const a = heads_state[h].head;
    auto const winners = static_cast<Index>(heads_state[h].winners);
    table[b * heads + h] = kvpress ? a.safe + winners : detail::ada_kv_authors_total(a, sel.alpha_safeguard, winners);
  }
}

}  // namespace kvc::backend::cuda

namespace kvc {

/// AdaKV allocation on CUDA: one block per sequence over all its heads (no workspace). A whole layer's scores are
/// read 8 times per radix selection (one more selection per head with kvpress's pinning): at 8 heads x 128K tokens,
/// a few megabytes per pass on one SM per sequence.
template <Budget Bu>
struct Kernel<Allocation<AdaKVSelector<Bu>>, Cuda> {
  using Sel = AdaKVSelector<Bu>;

  static std::size_t workspace_bytes(Cuda const&, Sel const&, Index, Index, Index) { return 0; }

  static Status run(Cuda const& cuda, Sel const& sel, ScoreSpan<DeviceSpace> scores, Index* table, Workspace) {
    namespace bc = backend::cuda;
    if (scores.heads * scores.tokens > Index{UINT32_MAX})
      return {Errc::invalid_argument, "kvc::allocate(Cuda): heads * tokens of one sequence must be below 2^32"};
    if (scores.batch * scores.heads == 0)
      return {};
    if (scores.batch > Index{INT32_MAX})
      return {Errc::invalid_argument, "kvc::allocate(Cuda): batch must be below 2^31"};
    std::size_t const smem = static_cast<std::size_t>(scores.heads) * sizeof(bc::AdaKVShared);
    KVC_RETURN_IF_ERROR(bc::shared_memory_status(smem, "kvc::allocate(Cuda): too many heads for shared memory"));
    KVC_RETURN_IF_ERROR(bc::pending_status());
    KVC_RETURN_IF_ERROR(bc::launch(KVC_CUDA_KERNEL("kvc::allocate(ada_kv, Cuda)", bc::ada_kv_allocate_kernel),
                                   static_cast<unsigned>(scores.batch), bc::ada_kv_threads, smem, cuda.stream, sel,
                                   scores, table));
    return {};
  }
};

/// AdaKV selection on CUDA: the allocation into a device table, then the CUDA TopKSelector over it.
template <Budget Bu>
struct Kernel<AdaKVSelector<Bu>, Cuda> : detail::AllocatedTopK<AdaKVSelector<Bu>, Cuda> {};

}  // namespace kvc
