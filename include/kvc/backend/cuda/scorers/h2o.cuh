// SPDX-License-Identifier: Apache-2.0
// kvc/backend/cuda/scorers/h2o.cuh: CUDA kernels of H2OScorer<DeviceSpace> (score, update, on_evict) and
// ObservedAttentionScorer (definitions in scorers/h2o.hpp; CPU oracle in backend/cpu/scorers/h2o.hpp), over the
// shared window attention (detail/window_attention.cuh) in tiles of `query_tile` query rows: the first tile writes
// the column sums [B, Hq, N], later tiles add to them, so the scratch holds one tile whatever the window.
//   H2O score:     grid (slot blocks, Hkv, B): acc[j] for tracked slots, 0 for the rest, -inf padding.
//   H2O update:    the column sums (window attention, or the engine's AttentionColumnSums), then one thread per slot
//                  adds the group's sums / g in query-head order to acc[j] (taken as 0 past `tracked`: newly
//                  appended slots), exactly the CPU's arithmetic; then `tracked` = the head's length.
//   H2O on_evict:  tracked = plan.count (the accumulators travel through kvc::compact as an extra TokenArray).
//   Observed:      one thread per slot: (sum over the group of the column sums) / g / (window queries at or after
//                  the slot's position), counted from the query positions (closed form when they are the context's
//                  last).
// No atomics; every value is written by one thread in a fixed order, so results are deterministic. Kernels never
// allocate. Device tables are not validated on the host: lengths and `tracked` are clamped to [0, capacity], and a
// plan handed to on_evict must come from kvc::select (as for kvc::compact).
#pragma once

#include <kvc/backend/cuda/detail/tracked.cuh>
#include <kvc/backend/cuda/detail/window_attention.cuh>
#include <kvc/core/keep_plan.hpp>
#include <kvc/core/scores.hpp>
#include <kvc/scorers/h2o.hpp>

#include <cstddef>
#include <math_constants.h>

namespace kvc::backend::cuda {

inline constexpr int h2o_threads = 256;

/// Query rows per window-attention pass: the tile, or the whole window when it is shorter (>= 1).
inline Index h2o_tile_rows(Index tile, Index window) noexcept {
  Index const t = tile < window ? tile : window;
  return t < 1 ? 1 : t;
}

inline dim3 h2o_slot_grid(KVExtents const& e) {
  return {grid_dim((e.tokens + h2o_threads - 1) / h2o_threads, 4096), static_cast<unsigned>(e.heads),
          static_cast<unsigned>(e.batch)};
}

/// Grid (slot blocks, Hkv, B): s[j] = acc[j] for j < tracked, 0 for tracked <= j < n, -inf padding.
template <class Acc>
__global__ void h2o_score_kernel(Acc acc, Index const* tracked, ScoreSpan<DeviceSpace> out) {
  Index const b = blockIdx.z, h = blockIdx.y, n = clamp_length(out.length(b, h), out.tokens);
  Index const t = clamp_length(tracked[b * out.heads + h], n);
  Index const stride = static_cast<Index>(gridDim.x) * blockDim.x;
  for (Index j = static_cast<Index>(blockIdx.x) * blockDim.x + threadIdx.x; j < out.tokens; j += stride)
    out(b, h, j) = j >= n ? -CUDART_INF_F : (j < t ? acc(b, h, j) : 0.0f);
}

/// Grid (slot blocks, Hkv, B): acc[j] = (j < tracked ? acc[j] : 0) + cols[q0][j] / g + ... + cols[q0 + g - 1][j] / g
/// for every valid slot, the query heads of h's group in order (the CPU's zeroing, then its adds). `cols` is
/// [B, col_heads, col_tokens]. Reads `tracked`; track_lengths_kernel (detail/tracked.cuh), ordered after it, writes it.
template <class C, class Acc>
__global__ void h2o_add_kernel(C cache, Acc acc, Index const* tracked, float const* cols, Index col_heads,
                               Index col_tokens) {
  KVExtents const e = cache.keys.extents();
  Index const b = blockIdx.z, h = blockIdx.y, g = col_heads / e.heads;
  Index const n = cache.clamped_length(b, h), t = clamp_length(tracked[b * e.heads + h], n);
  Index const stride = static_cast<Index>(gridDim.x) * blockDim.x;
  float const* col = cols + (b * col_heads + h * g) * col_tokens;
  for (Index j = static_cast<Index>(blockIdx.x) * blockDim.x + threadIdx.x; j < n; j += stride)
    acc(b, h, j) = h2o_accumulate(j < t ? acc(b, h, j) : 0.0f, g, [&](Index lq) { return col[lq * col_tokens + j]; });
}

/// tracked[b, h] = plan.count[b, h] (clamped to the plan's capacity, as kvc::compact clamps it).
template <class Plan>
__global__ void h2o_evict_kernel(Plan plan, Index* tracked) {
  Index const i = static_cast<Index>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < plan.batch * plan.heads)
    tracked[i] = clamp_length(plan.count[i], plan.capacity);
}

/// Grid (slot blocks, Hkv, B): ObservedAttention's scores from the column sums of every window query.
template <class WQ, class C>
__global__ void observed_finish_kernel(WQ wq, C cache, Index query_heads, WindowScratch ws,
                                       ScoreSpan<DeviceSpace> out) {
  __shared__ Index end_shared;
  KVExtents const e = cache.keys.extents();
  Index const b = blockIdx.z, h = blockIdx.y, g = query_heads / e.heads, w = wq.window();
  Index const n = cache.clamped_length(b, h);
  if (threadIdx.x == 0)
    end_shared = wq.positions ? 0 : context_end(cache, b);
  __syncthreads();
  Index const end = end_shared;
  Index const stride = static_cast<Index>(gridDim.x) * blockDim.x;
  for (Index j = static_cast<Index>(blockIdx.x) * blockDim.x + threadIdx.x; j < e.tokens; j += stride) {
    if (j >= n) {
      out(b, h, j) = -CUDART_INF_F;
      continue;
    }
    Index const p = cache.position(b, h, j);
    Index seen = 0;  // window queries whose position is >= p
    if (wq.positions) {
      for (Index i = 0; i < w; ++i)
        seen += wq.given_position(b, i) >= p ? 1 : 0;
    } else {  // query i sits at end - w + i: those with i >= p - end + w
      Index const lo = p - end + w;
      seen = lo <= 0 ? w : (lo >= w ? 0 : w - lo);
    }
    float const* col = ws.colsum + (b * query_heads + h * g) * e.tokens;
    out(b, h, j) = observed_attention_score(g, seen, [&](Index lq) { return col[lq * e.tokens + j]; });
  }
}

/// Column sums of window rows [0, w) into ws.colsum, `tile` rows per pass (the first pass writes, the rest add).
template <class WQ, class C>
Status tiled_window_attention(Cuda const& cuda, WQ const& wq, C const& cache, Index tile, WindowScratch ws) {
  Index const w = wq.window();
  for (Index r0 = 0; r0 < w; r0 += tile)
    KVC_RETURN_IF_ERROR(window_attention(cuda, wq, cache, r0, r0 + tile < w ? r0 + tile : w, ws, r0 > 0));
  return {};
}

}  // namespace kvc::backend::cuda

namespace kvc {

/// H2O (authors' accumulator) on CUDA. score: no workspace. update: the window attention's scratch for one tile of
/// query rows (none when the engine passes column sums). The state (accumulator [B, Hkv, >= N], tracked [B, Hkv])
/// lives on the device.
template <>
struct Kernel<H2OScorer<DeviceSpace>, Cuda> {
  using Scorer = H2OScorer<DeviceSpace>;

  static Status check_state(Scorer const& s, KVExtents const& e) {
    KVC_RETURN_IF_ERROR(s.check());
    auto const& a = s.state.accumulated;
    if (a.data == nullptr || s.state.tracked == nullptr || a.batch != e.batch || a.heads != e.heads ||
        a.tokens < e.tokens)
      return {Errc::invalid_argument,
              "h2o (Cuda): the state needs `accumulated` [batch, KV heads, >= tokens] and `tracked` [batch, KV heads]"};
    return backend::cuda::head_grid_status(e.batch, e.heads, "h2o (Cuda): batch and heads must be <= 65535");
  }

  template <class Obs>
  static std::size_t workspace_bytes(Cuda const&, Scorer const&, KVExtents const&, Obs const&) {
    return 0;
  }

  template <KVCacheView C, class Obs>
  static Status run(Cuda const& cuda, Scorer const& s, C const& cache, Obs const&, ScoreSpan<DeviceSpace> out,
                    Workspace) {
    namespace bc = backend::cuda;
    KVExtents const e = cache.keys.extents();
    KVC_RETURN_IF_ERROR(check_state(s, e));
    if (e.batch * e.heads == 0 || e.tokens == 0)
      return {};
    KVC_RETURN_IF_ERROR(bc::pending_status());
    KVC_RETURN_IF_ERROR(
        bc::launch(KVC_CUDA_KERNEL("kvc::score(h2o, Cuda)", bc::h2o_score_kernel<decltype(s.state.accumulated)>),
                   bc::h2o_slot_grid(e), bc::h2o_threads, 0, cuda.stream, s.state.accumulated, s.state.tracked, out));
    return {};
  }

  template <class Obs>
  static std::size_t update_workspace_bytes(Cuda const&, Scorer const& s, KVExtents const& keys, Obs const& obs) {
    if constexpr (HasWindowQueries<Obs> && !HasAttention<Obs>) {
      Index const rows = backend::cuda::h2o_tile_rows(s.query_tile, obs.window_queries.window());
      return backend::cuda::WindowScratch::bytes(keys.batch, window_query_heads(obs, keys.heads), rows, keys.dim,
                                                 keys.tokens);
    } else {
      return 0;
    }
  }

  /// Adds the attention the observed queries (or the engine's column sums) paid every slot to its accumulator,
  /// after zeroing the slots appended since the last update; then every valid slot is tracked.
  template <KVCacheView C, class Obs>
  static Status update(Cuda const& cuda, Scorer const& s, C const& cache, Obs const& obs, Workspace ws) {
    static_assert(HasWindowQueries<Obs> || HasAttention<Obs>,
                  "kvc::update(h2o): pass the new queries (kvc::observe(kvc::WindowQueries{...})) or the engine's "
                  "attention column sums (Observations::attention)");
    namespace bc = backend::cuda;
    KVExtents const e = cache.keys.extents();
    KVC_RETURN_IF_ERROR(check_state(s, e));
    KVC_RETURN_IF_ERROR(
        check_length_table(cache.lengths, e.heads, "kvc::update: per-head lengths must be [batch, KV heads]"));
    auto add = [&](float const* cols, Index col_heads,
                   Index col_tokens) -> Status {  // after the column sums, in stream order
      KVC_RETURN_IF_ERROR(
          bc::launch(KVC_CUDA_KERNEL("kvc::update(h2o, Cuda)", (bc::h2o_add_kernel<C, decltype(s.state.accumulated)>)),
                     bc::h2o_slot_grid(e), bc::h2o_threads, 0, cuda.stream, cache, s.state.accumulated, s.state.tracked,
                     cols, col_heads, col_tokens));
      KVC_RETURN_IF_ERROR(bc::launch(KVC_CUDA_KERNEL("kvc::update(h2o, Cuda)", bc::track_lengths_kernel<C>),
                                     bc::grid_dim((e.batch * e.heads + bc::track_threads - 1) / bc::track_threads),
                                     bc::track_threads, 0, cuda.stream, cache, s.state.tracked));
      return {};
    };
    if constexpr (HasAttention<Obs>) {
      auto const& at = obs.attention;
      if (at.data == nullptr || at.batch != e.batch || at.heads < 1 || at.heads % e.heads != 0 || at.tokens < e.tokens)
        return {Errc::invalid_argument,
                "kvc::update(h2o, Cuda): attention column sums must be [batch, Hq, >= tokens] with Hq a multiple of "
                "Hkv"};
      if (e.batch * e.heads == 0 || e.tokens == 0)
        return {};
      KVC_RETURN_IF_ERROR(bc::pending_status());
      return add(at.data, at.heads, at.tokens);
    } else {
      auto const& wq = obs.window_queries;
      KVC_RETURN_IF_ERROR(bc::check_window(
          wq, cache, wq.window() > 0 ? wq.window() : 1,
          "kvc::update(h2o, Cuda): window queries must be [batch, Hq, >= 1, d_k] with Hq a multiple of Hkv"));
      Index const hq = wq.rows.extents().heads;
      WorkspaceCarver carve(ws);
      auto const scratch =
          bc::WindowScratch::carve(carve, e.batch, hq, bc::h2o_tile_rows(s.query_tile, wq.window()), e.dim, e.tokens);
      if (!scratch.complete() && e.rows() > 0)
        return {Errc::out_of_capacity, "kvc::update(h2o, Cuda): workspace smaller than update_workspace_bytes()"};
      if (e.batch * e.heads == 0 || e.tokens == 0)
        return {};
      KVC_RETURN_IF_ERROR(bc::pending_status());
      KVC_RETURN_IF_ERROR(bc::tiled_window_attention(cuda, wq, cache, s.query_tile, scratch));
      return add(scratch.colsum, hq, e.tokens);
    }
  }

  /// Compaction keeps plan.count slots per head, and their accumulators travel with them (kvc::compact's extra
  /// array), so exactly those stay tracked.
  template <KVCacheView C>
  static Status on_evict(Cuda const& cuda, Scorer const& s, C const&, KeepPlan<DeviceSpace> const& plan, Workspace) {
    namespace bc = backend::cuda;
    if (s.state.tracked == nullptr)
      return {Errc::invalid_argument, "kvc::on_evict(h2o, Cuda): the state's `tracked` is null"};
    auto const& a = s.state.accumulated;
    if (plan.batch != a.batch || plan.heads != a.heads || (plan.count == nullptr && plan.batch * plan.heads > 0))
      return {Errc::invalid_argument, "kvc::on_evict(h2o, Cuda): `plan` must have the state's batch and heads"};
    if (plan.batch * plan.heads == 0)
      return {};
    KVC_RETURN_IF_ERROR(bc::pending_status());
    KVC_RETURN_IF_ERROR(bc::launch(KVC_CUDA_KERNEL("kvc::on_evict(h2o, Cuda)", bc::h2o_evict_kernel),
                                   bc::grid_dim((plan.batch * plan.heads + 255) / 256), 256, 0, cuda.stream, plan,
                                   s.state.tracked));
    return {};
  }
};

/// kvpress's ObservedAttention on CUDA: the window attention over every window query in tiles of `query_tile` rows,
/// then one thread per slot. Workspace (device): the window attention's scratch for one tile.
template <>
struct Kernel<ObservedAttentionScorer, Cuda> {
  template <class Obs>
  static std::size_t workspace_bytes(Cuda const&, ObservedAttentionScorer const& s, KVExtents const& keys,
                                     Obs const& obs) {
    Index window = 1;
    if constexpr (HasWindowQueries<Obs>)
      window = obs.window_queries.window();
    return backend::cuda::WindowScratch::bytes(keys.batch, window_query_heads(obs, keys.heads),
                                               backend::cuda::h2o_tile_rows(s.query_tile, window), keys.dim,
                                               keys.tokens);
  }

  template <KVCacheView C, class Obs>
  static Status run(Cuda const& cuda, ObservedAttentionScorer const& s, C const& cache, Obs const& obs,
                    ScoreSpan<DeviceSpace> out, Workspace ws) {
    namespace bc = backend::cuda;
    KVC_RETURN_IF_ERROR(s.check());
    auto const& wq = obs.window_queries;
    KVExtents const e = cache.keys.extents();
    Index const w = wq.window();
    KVC_RETURN_IF_ERROR(bc::check_window(
        wq, cache, w > 0 ? w : 1,
        "kvc::score(h2o, reference=kvpress, Cuda): window queries must be [batch, Hq, >= 1, d_k] (every prompt "
        "query) with Hq a multiple of Hkv"));
    Index const hq = wq.rows.extents().heads;
    WorkspaceCarver carve(ws);
    auto const scratch =
        bc::WindowScratch::carve(carve, e.batch, hq, bc::h2o_tile_rows(s.query_tile, w), e.dim, e.tokens);
    if (!scratch.complete() && e.rows() > 0)
      return {Errc::out_of_capacity, "kvc::score(h2o, Cuda): workspace smaller than score_workspace_bytes()"};
    if (e.batch * e.heads == 0 || e.tokens == 0)
      return {};
    KVC_RETURN_IF_ERROR(bc::pending_status());
    KVC_RETURN_IF_ERROR(bc::tiled_window_attention(cuda, wq, cache, s.query_tile, scratch));
    KVC_RETURN_IF_ERROR(
        bc::launch(KVC_CUDA_KERNEL("kvc::score(h2o, reference=kvpress, Cuda)", bc::observed_finish_kernel),
                   bc::h2o_slot_grid(e), bc::h2o_threads, 0, cuda.stream, wq, cache, hq, scratch, out));
    return {};
  }
};

}  // namespace kvc
