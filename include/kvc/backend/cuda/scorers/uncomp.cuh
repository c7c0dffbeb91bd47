// SPDX-License-Identifier: Apache-2.0
// kvc/backend/cuda/scorers/uncomp.cuh: CUDA kernels of UNCompScorer<DeviceSpace> (definition in scorers/uncomp.hpp;
// CPU oracle in backend/cpu/scorers/uncomp.hpp, whose arithmetic this follows in the same fp32 order).
//   score:     uncomp_sum_kernel, one thread per slot: sum[j] = A[0][j] + ... + A[w-1][j] (oldest first) for the
//              tracked slots of the prefix j < m = n - min(w, n), 0 for untracked ones, into the workspace; then
//              uncomp_pool_kernel, one thread per slot: the pooled score of the prefix (max: the first largest, as
//              std::max_element; avg: the in-order sum / k), -inf padding, and one max per block into the workspace;
//              then uncomp_protect_kernel, one block per head: max over its blocks' maxima, window slots [m, n) get
//              max + 1 (1 for an empty prefix): kvc::protected_score.
//   update:    the shared window attention in ColumnSums::per_window_row mode over the newest min(R, w) window rows
//              (colsum [B, Hkv, min(R, w), N], each row summed over the group's query heads in order), then
//              uncomp_rows_kernel, one thread per slot: tracked slots shift their rows by min(R, w) (the oldest fall
//              out), the others start at 0, and the new rows are written; then track_lengths_kernel: tracked = length.
//   on_evict:  one thread per (b, h): tracked = lower_bound(plan row, tracked) (the kept slots below the old count).
// No atomics: every value is written by one thread in a fixed order, so results are deterministic. Kernels never
// allocate. Device tables are not validated on the host: lengths and `tracked` are clamped to [0, capacity], and a
// plan handed to on_evict must come from kvc::select (as for kvc::compact).
#pragma once

#include <kvc/backend/cuda/detail/block_reduce.cuh>
#include <kvc/backend/cuda/detail/tracked.cuh>
#include <kvc/backend/cuda/detail/window_attention.cuh>
#include <kvc/core/keep_plan.hpp>
#include <kvc/core/scores.hpp>
#include <kvc/scorers/uncomp.hpp>

#include <cstddef>
#include <math_constants.h>

namespace kvc::backend::cuda {

inline constexpr int uncomp_threads = 256;

/// Grid (slot blocks, Hkv, B) of the per-slot kernels.
inline dim3 uncomp_slot_grid(KVExtents const& e) {
  return {grid_dim((e.tokens + uncomp_threads - 1) / uncomp_threads, 4096), static_cast<unsigned>(e.heads),
          static_cast<unsigned>(e.batch)};
}

/// Scratch of kvc::score: the window sums [B, Hkv, N] and one maximum per (b, h, slot block).
struct UNCompScoreScratch {
  float* sums = nullptr;
  float* maxima = nullptr;  ///< [B, Hkv, slot blocks]
  static std::size_t bytes(KVExtents const& e) noexcept {
    return bytes_sum(workspace_round(bytes_product(e.batch, e.heads, e.tokens, sizeof(float))),
                     workspace_round(bytes_product(e.batch, e.heads, Index{uncomp_slot_grid(e).x}, sizeof(float))));
  }
  static UNCompScoreScratch carve(WorkspaceCarver& c, KVExtents const& e) {
    UNCompScoreScratch s;
    s.sums = c.take<float>(e.batch * e.heads * e.tokens);
    s.maxima = c.take<float>(e.batch * e.heads * Index{uncomp_slot_grid(e).x});
    return s;
  }
  bool complete() const noexcept { return sums && maxima; }
};

/// Grid (slot blocks, Hkv, B): sums[b, h, j] = the in-order sum of slot j's w rows (0 past `tracked`), j < m.
template <class S>
__global__ void uncomp_sum_kernel(S s, ScoreSpan<DeviceSpace> out, float* sums) {
  Index const b = blockIdx.z, h = blockIdx.y, w = s.window_size, n = clamp_length(out.length(b, h), out.tokens);
  Index const m = n - (w < n ? w : n), t = clamp_length(s.state.tracked[b * out.heads + h], n);
  float* sum = sums + (b * out.heads + h) * out.tokens;
  Index const stride = static_cast<Index>(gridDim.x) * blockDim.x;
  for (Index j = static_cast<Index>(blockIdx.x) * blockDim.x + threadIdx.x; j < m; j += stride) {
    float acc = 0.0f;
    if (j < t) {
      float const* a = s.state.window_rows.row(b, h, j);
      for (Index i = 0; i < w; ++i)  // oldest row first: the CPU's (and the authors') order
        acc += a[i];
    }
    sum[j] = acc;
  }
}

/// Grid (slot blocks, Hkv, B): the pooled prefix scores (kvc::pooled_at), -inf padding, window slots left to
/// uncomp_protect_kernel; each block's maximum of the scores it wrote goes to maxima[b, h, block].
template <class S>
__global__ void __launch_bounds__(uncomp_threads)
    uncomp_pool_kernel(S s, ScoreSpan<DeviceSpace> out, float const* sums, float* maxima) {
  __shared__ float scratch[uncomp_threads / warp_size];
  Index const b = blockIdx.z, h = blockIdx.y, w = s.window_size, n = clamp_length(out.length(b, h), out.tokens);
  Index const m = n - (w < n ? w : n);
  float const* sum = sums + (b * out.heads + h) * out.tokens;
  float* score = out.row(b, h);
  float local_max = -CUDART_INF_F;
  Index const stride = static_cast<Index>(gridDim.x) * blockDim.x;
  for (Index j = static_cast<Index>(blockIdx.x) * blockDim.x + threadIdx.x; j < out.tokens; j += stride) {
    if (j >= n) {
      score[j] = -CUDART_INF_F;
      continue;
    }
    if (j >= m)
      continue;  // window slots: uncomp_protect_kernel
    float const v = pooled_at(s.pooling, s.kernel_size, m, j, [sum](Index t) { return sum[t]; });
    score[j] = v;
    local_max = fmaxf(local_max, v);
  }
  float const top = block_max(local_max, scratch);
  if (threadIdx.x == 0)
    maxima[(b * out.heads + h) * gridDim.x + blockIdx.x] = top;
}

/// Grid (Hkv, B): the head's prefix maximum from its blocks' maxima (`blocks` per head); slots [m, n) get it + 1
/// (1 for an empty prefix): kvc::protected_score.
template <class S>
__global__ void __launch_bounds__(uncomp_threads)
    uncomp_protect_kernel(S s, ScoreSpan<DeviceSpace> out, float const* maxima, Index blocks) {
  __shared__ float scratch[uncomp_threads / warp_size];
  Index const b = blockIdx.y, h = blockIdx.x, w = s.window_size, n = clamp_length(out.length(b, h), out.tokens);
  Index const m = n - (w < n ? w : n);
  float local_max = -CUDART_INF_F;
  for (Index i = threadIdx.x; i < blocks; i += blockDim.x)
    local_max = fmaxf(local_max, maxima[(b * out.heads + h) * blocks + i]);
  float const protect = protected_score(block_max(local_max, scratch), m);
  float* score = out.row(b, h);
  for (Index j = m + threadIdx.x; j < n; j += blockDim.x)
    score[j] = protect;
}

/// Grid (slot blocks, Hkv, B): for every valid slot j, rows [0, w - fresh) = the old rows [fresh, w) when j was
/// tracked, else 0; rows [w - fresh, w) = the new window rows' group sums `colsum` [B, Hkv, fresh, N]. Reads
/// `tracked`; track_lengths_kernel (detail/tracked.cuh), ordered after it, writes it.
template <class C, class S>
__global__ void uncomp_rows_kernel(C cache, S s, Index fresh, float const* colsum) {
  KVExtents const e = cache.keys.extents();
  Index const b = blockIdx.z, h = blockIdx.y, w = s.window_size, keep = w - fresh;
  Index const n = cache.clamped_length(b, h), t = clamp_length(s.state.tracked[b * e.heads + h], n);
  float const* fresh_rows = colsum + (b * e.heads + h) * fresh * e.tokens;
  Index const stride = static_cast<Index>(gridDim.x) * blockDim.x;
  for (Index j = static_cast<Index>(blockIdx.x) * blockDim.x + threadIdx.x; j < n; j += stride) {
    float* a = s.state.window_rows.row(b, h, j);
    bool const tracked = j < t;
    for (Index i = 0; i < keep; ++i)  // old rows move toward the front; new slots read 0 in them
      a[i] = tracked ? a[i + fresh] : 0.0f;
    for (Index i = 0; i < fresh; ++i)
      a[keep + i] = fresh_rows[i * e.tokens + j];
  }
}

/// tracked[b, h] = the number of kept slots below the old tracked count (lower_bound on the ascending plan row,
/// its count clamped to the plan's capacity).
template <class Plan>
__global__ void uncomp_evict_kernel(Plan plan, Index* tracked) {
  Index const i = static_cast<Index>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= plan.batch * plan.heads)
    return;
  Index const* kept = plan.indices(i / plan.heads, i % plan.heads);
  Index const t = tracked[i];
  Index lo = 0, hi = clamp_length(plan.count[i], plan.capacity);
  while (lo < hi) {
    Index const mid = lo + (hi - lo) / 2;
    if (kept[mid] < t)
      lo = mid + 1;
    else
      hi = mid;
  }
  tracked[i] = lo;
}

}  // namespace kvc::backend::cuda

namespace kvc {

/// UNComp on CUDA. score: the window sums and one maximum per slot block (device workspace). update: the window
/// attention's scratch for min(R, w) rows with per-window-row column sums. on_evict: none. The state (window_rows
/// [B, Hkv, >= N, w], tracked [B, Hkv]) lives on the device.
template <>
struct Kernel<UNCompScorer<DeviceSpace>, Cuda> {
  using Scorer = UNCompScorer<DeviceSpace>;

  static Status check_state(Scorer const& s, KVExtents const& e) {
    KVC_RETURN_IF_ERROR(s.check_state(e));
    return backend::cuda::head_grid_status(e.batch, e.heads, "uncomp (Cuda): batch and heads must be <= 65535");
  }

  template <class Obs>
  static std::size_t workspace_bytes(Cuda const&, Scorer const&, KVExtents const& keys, Obs const&) {
    return backend::cuda::UNCompScoreScratch::bytes(keys);
  }

  /// s[j] = pool(sum_i A[i][j]) over the prefix, window slots above it (see scorers/uncomp.hpp).
  template <KVCacheView C, class Obs>
  static Status run(Cuda const& cuda, Scorer const& s, C const& cache, Obs const&, ScoreSpan<DeviceSpace> out,
                    Workspace ws) {
    namespace bc = backend::cuda;
    KVExtents const e = cache.keys.extents();
    KVC_RETURN_IF_ERROR(check_state(s, e));
    WorkspaceCarver carve(ws);
    auto const scratch = bc::UNCompScoreScratch::carve(carve, e);
    if (!scratch.complete() && e.rows() > 0)
      return {Errc::out_of_capacity, "kvc::score(uncomp, Cuda): workspace smaller than score_workspace_bytes()"};
    if (e.batch * e.heads == 0 || e.tokens == 0)
      return {};
    KVC_RETURN_IF_ERROR(bc::pending_status());
    dim3 const grid = bc::uncomp_slot_grid(e);
    KVC_RETURN_IF_ERROR(bc::launch(KVC_CUDA_KERNEL("kvc::score(uncomp, Cuda)", bc::uncomp_sum_kernel), grid,
                                   bc::uncomp_threads, 0, cuda.stream, s, out, scratch.sums));
    KVC_RETURN_IF_ERROR(bc::launch(KVC_CUDA_KERNEL("kvc::score(uncomp, Cuda)", bc::uncomp_pool_kernel<Scorer>), grid,
                                   bc::uncomp_threads, 0, cuda.stream, s, out, scratch.sums, scratch.maxima));
    KVC_RETURN_IF_ERROR(bc::launch(KVC_CUDA_KERNEL("kvc::score(uncomp, Cuda)", bc::uncomp_protect_kernel<Scorer>),
                                   dim3(static_cast<unsigned>(e.heads), static_cast<unsigned>(e.batch)),
                                   bc::uncomp_threads, 0, cuda.stream, s, out, scratch.maxima, Index{grid.x}));
    return {};
  }

  /// The window attention's scratch for min(R, w) rows per query head, column sums [B, Hkv, min(R, w), N].
  template <class Obs>
  static std::size_t update_workspace_bytes(Cuda const&, Scorer const& s, KVExtents const& keys, Obs const& obs) {
    if constexpr (HasWindowQueries<Obs>) {
      Index const fresh = fresh_rows(s, obs.window_queries.window());
      return backend::cuda::WindowScratch::bytes(keys.batch, window_query_heads(obs, keys.heads), fresh, keys.dim,
                                                 keys.tokens, keys.heads * fresh);
    } else {
      return 0;
    }
  }

  /// Shifts every tracked slot's rows by the new rows, zeroes the slots appended since the last update, and writes
  /// the new rows' group-summed attention over the current cache; then every valid slot is tracked.
  template <KVCacheView C, class Obs>
  static Status update(Cuda const& cuda, Scorer const& s, C const& cache, Obs const& obs, Workspace ws) {
    static_assert(HasWindowQueries<Obs>,
                  "kvc::update(uncomp): pass the new queries (kvc::observe(kvc::WindowQueries{...}))");
    namespace bc = backend::cuda;
    KVExtents const e = cache.keys.extents();
    KVC_RETURN_IF_ERROR(check_state(s, e));
    KVC_RETURN_IF_ERROR(
        check_length_table(cache.lengths, e.heads, "kvc::update: per-head lengths must be [batch, KV heads]"));
    auto const& wq = obs.window_queries;
    Index const r = wq.window(), fresh = r < s.window_size ? r : s.window_size, first = r - fresh;
    KVC_RETURN_IF_ERROR(bc::check_window(
        wq, cache, fresh > 0 ? fresh : 1,
        "kvc::update(uncomp, Cuda): window queries must be [batch, Hq, >= 1, d_k] with Hq a multiple of Hkv"));
    Index const hq = wq.rows.extents().heads;
    WorkspaceCarver carve(ws);
    auto const scratch = bc::WindowScratch::carve(carve, e.batch, hq, fresh, e.dim, e.tokens, e.heads * fresh);
    if (!scratch.complete() && e.rows() > 0)
      return {Errc::out_of_capacity, "kvc::update(uncomp, Cuda): workspace smaller than update_workspace_bytes()"};
    if (e.batch * e.heads == 0 || e.tokens == 0)
      return {};
    KVC_RETURN_IF_ERROR(bc::pending_status());
    KVC_RETURN_IF_ERROR(
        bc::window_attention(cuda, wq, cache, first, r, scratch, false, bc::ColumnSums::per_window_row));
    KVC_RETURN_IF_ERROR(bc::launch(KVC_CUDA_KERNEL("kvc::update(uncomp, Cuda)", (bc::uncomp_rows_kernel<C, Scorer>)),
                                   bc::uncomp_slot_grid(e), bc::uncomp_threads, 0, cuda.stream, cache, s, fresh,
                                   scratch.colsum));
    KVC_RETURN_IF_ERROR(bc::launch(KVC_CUDA_KERNEL("kvc::update(uncomp, Cuda)", bc::track_lengths_kernel<C>),
                                   bc::grid_dim((e.batch * e.heads + bc::track_threads - 1) / bc::track_threads),
                                   bc::track_threads, 0, cuda.stream, cache, s.state.tracked));
    return {};
  }

  /// The kept slots that were tracked stay tracked (plans are ascending: those below the old count); their rows
  /// travel with them through kvc::compact (state.window_rows as the extra TokenRows).
  template <KVCacheView C>
  static Status on_evict(Cuda const& cuda, Scorer const& s, C const&, KeepPlan<DeviceSpace> const& plan, Workspace) {
    namespace bc = backend::cuda;
    if (s.state.tracked == nullptr)
      return {Errc::invalid_argument, "kvc::on_evict(uncomp, Cuda): the state's `tracked` is null"};
    KVExtents const r = s.state.window_rows.extents();
    if (plan.batch != r.batch || plan.heads != r.heads ||
        ((plan.count == nullptr || plan.index == nullptr) && plan.batch * plan.heads > 0))
      return {Errc::invalid_argument, "kvc::on_evict(uncomp, Cuda): `plan` must have the state's batch and heads"};
    if (plan.batch * plan.heads == 0)
      return {};
    KVC_RETURN_IF_ERROR(bc::pending_status());
    KVC_RETURN_IF_ERROR(bc::launch(KVC_CUDA_KERNEL("kvc::on_evict(uncomp, Cuda)", bc::uncomp_evict_kernel),
                                   bc::grid_dim((plan.batch * plan.heads + 255) / 256), 256, 0, cuda.stream, plan,
                                   s.state.tracked));
    return {};
  }

 private:
  /// Rows one update writes: min(R, w), at least 1 (R < 1 is rejected by update()).
  static Index fresh_rows(Scorer const& s, Index window) noexcept {
    Index const f = window < s.window_size ? window : s.window_size;
    return f < 1 ? 1 : f;
  }
};

}  // namespace kvc
