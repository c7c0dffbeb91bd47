// SPDX-License-Identifier: Apache-2.0
// kvc/backend/cuda/detail/top_k.cuh: CUDA TopKSelector: radix select + ordered compaction, one block per head.
//
// Same contract and total order as the CPU kernel, so CPU and CUDA keep identical sets for identical scores:
// higher score first, ties to the lower index, NaN as -inf, -0 == +0, protected windows always kept.
// Shared: AdaKV's and UNComp's selections (selectors/allocated_top_k.hpp) run it after their allocation; the public
// header is kvc/backend/cuda/selectors/top_k.cuh.
#pragma once

#include <kvc/backend/cuda/config.cuh>
#include <kvc/backend/cuda/detail/block_reduce.cuh>
#include <kvc/selectors/top_k.hpp>

#include <cstddef>
#include <cstdint>

namespace kvc::backend::cuda {

inline constexpr int top_k_threads = 512;

/// The selection's order key (kvc::detail::score_order_key, shared with the CPU).
__device__ inline std::uint32_t order_key(float s) {
  return kvc::detail::score_order_key(s);
}

/// Block-wide: writes the kept slots of [t0, t1) in ascending order, one tile of threads at a time: every key above
/// `threshold`, and keys equal to it while their rank among equal keys (running[1] + rank in the tile) is below
/// `need_eq`, so ties go to the lower index. Slot number i of the output goes to out[first + running[0] + i] (below
/// `keep`). `running` (shared: {written, equal keys seen}) holds the counts before t0 and is advanced; `scratch` is
/// block_exclusive_sum's (32 shared ints).
__device__ inline void take_in_order(float const* s, Index t0, Index t1, std::uint32_t threshold, Index need_eq,
                                     Index first, Index keep, Index* out, Index* running, int* scratch) {
  for (Index base = t0; base < t1; base += blockDim.x) {
    Index const t = base + threadIdx.x;
    bool const valid = t < t1;
    std::uint32_t const k = valid ? order_key(s[t]) : 0u;
    int const is_eq = valid && k == threshold ? 1 : 0;
    int eq_total = 0, taken = 0;
    int const eq_rank = block_exclusive_sum(is_eq, eq_total, scratch);
    int const take = valid && (k > threshold || (is_eq && running[1] + eq_rank < need_eq)) ? 1 : 0;
    int const pos = block_exclusive_sum(take, taken, scratch);
    Index const j = first + running[0] + pos;
    if (take && j < keep)
      out[j] = t;
    __syncthreads();
    if (threadIdx.x == 0) {
      running[0] += taken;
      running[1] += eq_total;
    }
    __syncthreads();
  }
}

/// One block per (h, b). Phase 1 finds the m-th largest key of the unprotected middle by four 8-bit radix
/// passes over shared histograms. Phase 2 walks the middle in ascending order, one tile of threads at a time,
/// and writes every key above the threshold plus the first `need_eq` keys equal to it: ascending output without
/// a sort, and ties resolved to the lower index.
template <class Sel>
__global__ void __launch_bounds__(top_k_threads)
    top_k_kernel(Sel sel, ScoreSpan<DeviceSpace> scores, KeepPlan<DeviceSpace> plan) {
  __shared__ int scan_scratch[32];
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
  if (m > 0)
    take_in_order(s, c.sink_end, c.recent_begin, prefix, need_eq, c.sink_end, keep, out, s_running, scan_scratch);
  Index const first_recent = c.sink_end + (m > 0 ? m : 0);
  for (Index t = c.recent_begin + threadIdx.x; t < n; t += blockDim.x)
    if (first_recent + (t - c.recent_begin) < keep)
      out[first_recent + (t - c.recent_begin)] = t;
}

// ---- Multi-block path for long heads ---------------------------------------------------------------------------
// One block per head leaves most of a GPU idle at batch 1 (8 KV heads, 132 SMs). Heads longer than
// top_k_split_tokens spread each pass over chunks of top_k_chunk slots of the unprotected middle: the same radix
// select (per-chunk shared histograms added into a global one, then one block per head picks the digit), then a
// count per chunk, one exclusive scan per head over its chunks, and the ordered write of each chunk at its offset.
// The output is the single-block kernel's, slot for slot (same keys, same threshold, same tie rule).

inline constexpr Index top_k_split_tokens = 16384;
inline constexpr Index top_k_chunk = 4096;

/// Per-head state of the multi-block select, in the workspace.
struct TopKState {
  std::uint32_t prefix;  ///< the threshold's key bits found so far
  Index remaining;       ///< how many keys at or above the current prefix bucket still have to be taken
  Index m;               ///< keys taken from the middle (0: nothing to rank)
};

/// Chunks of the middle a head of `tokens` slots can have.
inline Index top_k_chunks(Index tokens) noexcept {
  return (tokens + top_k_chunk - 1) / top_k_chunk;
}

/// One block per (h, b): counts, protected slots, the state, and everything when the head is within budget.
template <class Sel>
__global__ void __launch_bounds__(top_k_threads)
    top_k_init_kernel(Sel sel, ScoreSpan<DeviceSpace> scores, KeepPlan<DeviceSpace> plan, TopKState* state,
                      unsigned* hist) {
  Index const b = blockIdx.y, h = blockIdx.x, head = b * scores.heads + h;
  Index const n = clamp_length(scores.length(b, h), scores.tokens);
  auto const c = detail::top_k_counts(sel, b, h, n);
  Index const keep = c.keep < plan.capacity ? c.keep : plan.capacity;
  Index* out = plan.indices(b, h);
  for (int i = threadIdx.x; i < 256; i += blockDim.x)
    hist[head * 256 + i] = 0;
  bool const all = c.keep == n;
  Index const m = all ? 0 : c.keep - c.sink_end - (n - c.recent_begin);
  if (threadIdx.x == 0) {
    plan.kept(b, h) = keep;
    state[head] = TopKState{0u, m, m};
  }
  if (all) {
    for (Index t = threadIdx.x; t < keep; t += blockDim.x)
      out[t] = t;
    return;
  }
  for (Index t = threadIdx.x; t < c.sink_end && t < keep; t += blockDim.x)
    out[t] = t;
  Index const first_recent = c.sink_end + m;
  for (Index t = c.recent_begin + threadIdx.x; t < n; t += blockDim.x)
    if (first_recent + (t - c.recent_begin) < keep)
      out[first_recent + (t - c.recent_begin)] = t;
}

/// What a chunk kernel (grid (chunks, heads, batch)) works on: its head, the head's state and counts, and the
/// chunk's slots [t0, t1) of the unprotected middle (empty past the middle's end).
struct HeadChunk {
  Index b, h, head;
  TopKState st;
  detail::TopKCounts c;
  Index t0, t1;
};

template <class Sel>
__device__ inline HeadChunk head_chunk(Sel const& sel, ScoreSpan<DeviceSpace> const& scores, TopKState const* state) {
  HeadChunk k;
  k.b = blockIdx.z;
  k.h = blockIdx.y;
  k.head = k.b * scores.heads + k.h;
  k.st = state[k.head];
  k.c = detail::top_k_counts(sel, k.b, k.h, clamp_length(scores.length(k.b, k.h), scores.tokens));
  k.t0 = k.c.sink_end + static_cast<Index>(blockIdx.x) * top_k_chunk;
  k.t1 = k.t0 + top_k_chunk < k.c.recent_begin ? k.t0 + top_k_chunk : k.c.recent_begin;
  return k;
}

/// Grid (chunks, heads, batch): this chunk's histogram of digit `shift` among keys matching the prefix so far.
template <class Sel>
__global__ void top_k_hist_kernel(Sel sel, ScoreSpan<DeviceSpace> scores, TopKState const* state, unsigned* hist,
                                  int shift) {
  __shared__ unsigned local[256];
  HeadChunk const k = head_chunk(sel, scores, state);
  if (k.st.m <= 0 || k.t0 >= k.t1)
    return;  // whole block: nothing to rank in this chunk
  std::uint32_t const mask = shift == 24 ? 0u : (0xffffffffu << (shift + 8));
  for (int i = threadIdx.x; i < 256; i += blockDim.x)
    local[i] = 0;
  __syncthreads();
  float const* s = scores.row(k.b, k.h);
  for (Index t = k.t0 + threadIdx.x; t < k.t1; t += blockDim.x) {
    std::uint32_t const key = order_key(s[t]);
    if ((key & mask) == k.st.prefix)
      atomicAdd(&local[(key >> shift) & 0xffu], 1u);
  }
  __syncthreads();
  for (int i = threadIdx.x; i < 256; i += blockDim.x)
    if (local[i])
      atomicAdd(&hist[k.head * 256 + i], local[i]);
}

/// One block per (h, b): picks digit `shift` of the threshold from the head's histogram, then clears it.
/// (A template, as every __global__ in a header: see tests/link.)
template <class State>
__global__ void top_k_digit_kernel(Index heads, State* state, unsigned* hist, int shift) {
  Index const head = static_cast<Index>(blockIdx.y) * heads + blockIdx.x;
  if (threadIdx.x == 0 && state[head].m > 0) {
    TopKState st = state[head];
    Index above = 0;
    int d = 255;
    for (; d > 0 && above + hist[head * 256 + d] < st.remaining; --d)
      above += hist[head * 256 + d];
    st.remaining -= above;
    st.prefix |= static_cast<std::uint32_t>(d) << shift;
    state[head] = st;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < 256; i += blockDim.x)
    hist[head * 256 + i] = 0;
}

/// Grid (chunks, heads, batch): keys above the threshold and keys equal to it in this chunk.
template <class Sel>
__global__ void __launch_bounds__(top_k_threads)
    top_k_count_kernel(Sel sel, ScoreSpan<DeviceSpace> scores, TopKState const* state, Index chunks, Index* counts) {
  __shared__ Index sum_scratch[32];
  HeadChunk const k = head_chunk(sel, scores, state);
  if (k.st.m <= 0)
    return;
  float const* s = scores.row(k.b, k.h);
  Index gt = 0, eq = 0;
  for (Index t = k.t0 + threadIdx.x; t < k.t1; t += blockDim.x) {
    std::uint32_t const key = order_key(s[t]);
    gt += key > k.st.prefix ? 1 : 0;
    eq += key == k.st.prefix ? 1 : 0;
  }
  gt = block_sum(gt, sum_scratch);
  eq = block_sum(eq, sum_scratch);
  if (threadIdx.x == 0) {
    counts[(k.head * chunks + blockIdx.x) * 2] = gt;
    counts[(k.head * chunks + blockIdx.x) * 2 + 1] = eq;
  }
}

/// One thread per (h, b), grid (head blocks, batch): exclusive offsets over the head's chunks of the output position
/// and of the equal keys seen before each chunk (equal keys are taken while their rank is below remaining: the lower
/// indices win).
template <class State>
__global__ void top_k_scan_kernel(Index heads, Index chunks, State const* state, Index* counts) {
  Index const h = static_cast<Index>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (h >= heads)
    return;
  Index const head = static_cast<Index>(blockIdx.y) * heads + h;
  if (state[head].m <= 0)
    return;
  Index const need_eq = state[head].remaining;
  Index out = 0, eq_before = 0;
  for (Index k = 0; k < chunks; ++k) {
    Index* cnt = counts + (head * chunks + k) * 2;
    Index const gt = cnt[0], eq = cnt[1];
    Index const eq_taken = need_eq - eq_before <= 0 ? 0 : (need_eq - eq_before < eq ? need_eq - eq_before : eq);
    cnt[0] = out;
    cnt[1] = eq_before;
    out += gt + eq_taken;
    eq_before += eq;
  }
}

/// Grid (chunks, heads, batch): writes the chunk's kept slots in ascending order at its offset (block scans).
template <class Sel>
__global__ void __launch_bounds__(top_k_threads)
    top_k_write_kernel(Sel sel, ScoreSpan<DeviceSpace> scores, KeepPlan<DeviceSpace> plan, TopKState const* state,
                       Index chunks, Index const* counts) {
  __shared__ int scan_scratch[32];
  __shared__ Index s_running[2];
  HeadChunk const k = head_chunk(sel, scores, state);
  if (k.st.m <= 0)
    return;
  Index const keep = k.c.keep < plan.capacity ? k.c.keep : plan.capacity;
  if (threadIdx.x == 0) {
    s_running[0] = counts[(k.head * chunks + blockIdx.x) * 2];
    s_running[1] = counts[(k.head * chunks + blockIdx.x) * 2 + 1];
  }
  __syncthreads();
  take_in_order(scores.row(k.b, k.h), k.t0, k.t1, k.st.prefix, k.st.remaining, k.c.sink_end, keep,
                plan.indices(k.b, k.h), s_running, scan_scratch);
}

}  // namespace kvc::backend::cuda

namespace kvc {

/// TopKSelector on CUDA: one block per head up to backend::cuda::top_k_split_tokens slots, the multi-block path
/// beyond (workspace: per-head state, histograms and per-chunk counts; none for short heads). A plan whose capacity
/// is below detail::top_k_capacity_bound() (the most any head can keep, known on the host) is rejected with
/// out_of_capacity before launching: stricter than the CPU, which checks the real counts, because the device cannot
/// report a short plan without a synchronisation.
template <Budget B>
struct Kernel<TopKSelector<B>, Cuda> {
  static std::size_t workspace_bytes(Cuda const&, TopKSelector<B> const&, Index batch, Index heads, Index tokens) {
    namespace bc = backend::cuda;
    if (tokens <= bc::top_k_split_tokens)
      return 0;
    return bytes_sum(workspace_round(bytes_product(batch, heads, sizeof(bc::TopKState))),
                     workspace_round(bytes_product(batch, heads, 256, sizeof(unsigned))),
                     workspace_round(bytes_product(batch, heads, bc::top_k_chunks(tokens), 2, sizeof(Index))));
  }

  static Status run(Cuda const& cuda, TopKSelector<B> const& sel, ScoreSpan<DeviceSpace> scores,
                    KeepPlan<DeviceSpace> plan, Workspace ws) {
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
    namespace bc = backend::cuda;
    dim3 const grid(static_cast<unsigned>(scores.heads), static_cast<unsigned>(scores.batch));
    if (scores.tokens <= bc::top_k_split_tokens) {
      KVC_RETURN_IF_ERROR(bc::launch(KVC_CUDA_KERNEL("kvc::select(top_k, Cuda)", bc::top_k_kernel), grid,
                                     bc::top_k_threads, 0, cuda.stream, sel, scores, plan));
      return {};
    }
    Index const chunks = bc::top_k_chunks(scores.tokens), heads = scores.batch * scores.heads;
    WorkspaceCarver carve(ws);
    auto* state = carve.take<bc::TopKState>(heads);
    auto* hist = carve.take<unsigned>(heads * 256);
    auto* counts = carve.take<Index>(heads * chunks * 2);
    if (state == nullptr || hist == nullptr || counts == nullptr)
      return {Errc::out_of_capacity, "kvc::select(Cuda): workspace smaller than select_workspace_bytes()"};
    dim3 const chunk_grid(static_cast<unsigned>(chunks), static_cast<unsigned>(scores.heads),
                          static_cast<unsigned>(scores.batch));
    KVC_RETURN_IF_ERROR(bc::launch(KVC_CUDA_KERNEL("kvc::select(top_k, Cuda)", bc::top_k_init_kernel), grid,
                                   bc::top_k_threads, 0, cuda.stream, sel, scores, plan, state, hist));
    for (int shift = 24; shift >= 0; shift -= 8) {
      KVC_RETURN_IF_ERROR(
          bc::launch(KVC_CUDA_KERNEL("kvc::select(top_k, Cuda)", bc::top_k_hist_kernel<TopKSelector<B>>), chunk_grid,
                     256, 0, cuda.stream, sel, scores, state, hist, shift));
      KVC_RETURN_IF_ERROR(bc::launch(KVC_CUDA_KERNEL("kvc::select(top_k, Cuda)", bc::top_k_digit_kernel<bc::TopKState>),
                                     grid, 256, 0, cuda.stream, scores.heads, state, hist, shift));
    }
    KVC_RETURN_IF_ERROR(bc::launch(KVC_CUDA_KERNEL("kvc::select(top_k, Cuda)", bc::top_k_count_kernel<TopKSelector<B>>),
                                   chunk_grid, bc::top_k_threads, 0, cuda.stream, sel, scores, state, chunks, counts));
    KVC_RETURN_IF_ERROR(
        bc::launch(KVC_CUDA_KERNEL("kvc::select(top_k, Cuda)", bc::top_k_scan_kernel<bc::TopKState>),
                   dim3(static_cast<unsigned>((scores.heads + 127) / 128), static_cast<unsigned>(scores.batch)), 128, 0,
                   cuda.stream, scores.heads, chunks, state, counts));
    KVC_RETURN_IF_ERROR(bc::launch(KVC_CUDA_KERNEL("kvc::select(top_k, Cuda)", bc::top_k_write_kernel<TopKSelector<B>>),
                                   chunk_grid, bc::top_k_threads, 0, cuda.stream, sel, scores, plan, state, chunks,
                                   counts));
    return {};
  }
};

}  // namespace kvc
