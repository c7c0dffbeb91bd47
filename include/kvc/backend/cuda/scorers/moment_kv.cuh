// SPDX-License-Identifier: Apache-2.0
// kvc/backend/cuda/scorers/moment_kv.cuh: CUDA kernels of MomentKVScorer<DeviceSpace, T> (definitions in
// scorers/moment_kv.hpp; CPU oracle in backend/cpu/scorers/moment_kv.hpp, whose arithmetic this follows in fp32).
//   score:     the base α (SnapKV's window attention through Kernel<SnapKVScorer, Cuda>, or a copy of `fixed_base`),
//              then moment_prep_kernel writes C̃ᵀ [d_k, d_v] and v̄ in fp32 per head, and moment_residual_kernel takes
//              one warp per slot: r = v − v̄ − (c/n) C̃ k (or the cached u_j row when every row is tracked),
//              score = kvc::moment_mi_score(α, ‖r‖²) (+inf stays; 0 stays unless ‖r‖² is NaN: then -inf, as any
//              NaN residual not protected). n = 0: ‖v‖.
//   update:    with the u_j cache, moment_fill_kernel writes u_j = C k_j (unclamped) for the new slots
//              [tracked, length), then tracked = length; a no-op otherwise.
//   on_evict:  the plan's complement per head less its rows with a NaN or Inf (moment_slots_kernel), fp64 partial
//              sums of the evicted rows over `splits` row ranges (moment_sums_kernel), the centred block co-moment per
//              range from staged tiles (moment_comoment_kernel), then one block per head sums the ranges in order and
//              applies Chan's merge
//              (moment_merge_kernel, count += m); with the u_j cache, moment_rows_kernel updates the kept rows.
// No atomics: every value is written by one thread in a fixed order, so results are deterministic. Kernels never
// allocate. Device tables are not validated: lengths are clamped to [0, capacity], slot indices read back are
// clamped to the head's length, and the plan must come from kvc::select (as for kvc::compact).
#pragma once

#include <kvc/backend/cuda/detail/tracked.cuh>
#include <kvc/backend/cuda/scorers/snap_kv.cuh>
#include <kvc/core/keep_plan.hpp>
#include <kvc/core/norm_range.hpp>
#include <kvc/core/scores.hpp>
#include <kvc/scorers/moment_kv.hpp>
#include <kvc/scorers/moments.hpp>

#include <cmath>
#include <cstddef>
#include <math_constants.h>

namespace kvc::backend::cuda {

inline constexpr int moment_threads = 256;
inline constexpr int moment_warps = moment_threads / warp_size;  // slots per block per step (one warp each)
inline constexpr int moment_fold_tile = 16;                      // evicted rows staged per co-moment step
inline constexpr int moment_acc = 16;                            // co-moment entries per thread per pass

/// Grid (slot blocks, Hkv, B) of the per-slot kernels.
inline dim3 moment_slot_grid(KVExtents const& e) {
  return {grid_dim((e.tokens + moment_warps - 1) / moment_warps, 1024), static_cast<unsigned>(e.heads),
          static_cast<unsigned>(e.batch)};
}

/// Row ranges of the fold per head: enough blocks to fill the device (about 256 in all) but at most one per 256
/// slots; the partial co-moments cost splits · d_v · d_k floats per head.
inline Index moment_fold_splits(KVExtents const& e) noexcept {
  Index const heads = e.batch * e.heads > 0 ? e.batch * e.heads : 1;
  Index const by_rows = (e.tokens + 255) / 256, by_device = 256 / heads;
  Index s = by_rows < by_device ? by_rows : by_device;
  return s < 1 ? 1 : (s > 64 ? 64 : s);
}

/// Per-head fp32 copies the score and update kernels read: C̃ᵀ [heads, d_k, d_v] (transposed so that the lanes of
/// a warp, one per value index, read consecutive addresses) and v̄ [heads, d_v].
struct MomentPrep {
  float* ct = nullptr;
  float* vbar = nullptr;
  static std::size_t bytes(Index heads, Index dk, Index dv) noexcept {
    return bytes_sum(workspace_round(bytes_product(heads, dk, dv, sizeof(float))),
                     workspace_round(bytes_product(heads, dv, sizeof(float))));
  }
  static MomentPrep carve(WorkspaceCarver& c, Index heads, Index dk, Index dv) {
    MomentPrep p;
    p.ct = c.take<float>(heads * dk * dv);
    p.vbar = c.take<float>(heads * dv);
    return p;
  }
  bool complete() const noexcept { return ct && vbar; }
};

/// The fold's scratch, per head (`splits` row ranges):
struct MomentFold {
  Index* slots = nullptr;    ///< [heads, tokens] the evicted slots with finite rows, ascending (the first m)
  Index* info = nullptr;     ///< [heads, 4] m (finite evicted rows, the ones folded), n_a (count before), u-row action
                             ///< (0 none, 1 rank-1, 2 all), every evicted slot (finite or not)
  double* sums = nullptr;    ///< [heads, splits, d_k + d_v] fp64 sums of the evicted rows per range
  float* means = nullptr;    ///< [heads, 2 (d_k + d_v)] block k̄, v̄; the state's k̄, v̄ before the merge
  float* partial = nullptr;  ///< [heads, splits, d_v, d_k] centred co-moment per range
  float* ct = nullptr;       ///< [heads, d_k, d_v] merged C' transposed (u_j cache only)
  static std::size_t bytes(KVExtents const& e, Index dv, Index splits, bool rows) noexcept {
    Index const heads = e.batch * e.heads, dk = e.dim;
    return bytes_sum(workspace_round(bytes_product(heads, e.tokens, sizeof(Index))),
                     workspace_round(bytes_product(heads, 4, sizeof(Index))),
                     workspace_round(bytes_product(heads, splits, dk + dv, sizeof(double))),
                     workspace_round(bytes_product(heads, 2, dk + dv, sizeof(float))),
                     workspace_round(bytes_product(heads, splits, dv, dk, sizeof(float))),
                     rows ? workspace_round(bytes_product(heads, dk, dv, sizeof(float))) : std::size_t{0});
  }
  static MomentFold carve(WorkspaceCarver& c, KVExtents const& e, Index dv, Index splits, bool rows) {
    Index const heads = e.batch * e.heads, dk = e.dim;
    MomentFold f;
    f.slots = c.take<Index>(heads * e.tokens);
    f.info = c.take<Index>(heads * 4);
    f.sums = c.take<double>(heads * splits * (dk + dv));
    f.means = c.take<float>(heads * 2 * (dk + dv));
    f.partial = c.take<float>(heads * splits * dv * dk);
    f.ct = rows ? c.take<float>(heads * dk * dv) : nullptr;
    return f;
  }
  bool complete(bool rows) const noexcept { return slots && info && sums && means && partial && (ct || !rows); }
};

/// Grid (Hkv, B): C̃ᵀ = clamp(C, tau)ᵀ and v̄ of each head in fp32 (tau = 0: C itself, for the u_j rows). Written
/// for every head, n = 0 included (its C is zero), so the fill never reads stale rows.
template <class T>
__global__ void moment_prep_kernel(MomentState<DeviceSpace, T> st, float tau, MomentPrep prep) {
  Index const b = blockIdx.y, h = blockIdx.x, head = st.head(b, h), dk = st.key_dim, dv = st.value_dim;
  T const* cm = st.comoment_of(b, h);
  float* ct = prep.ct + head * dk * dv;
  for (Index e = threadIdx.x; e < dk * dv; e += blockDim.x)  // coalesced reads of C [dv, dk]
    ct[(e % dk) * dv + e / dk] = detail::clamp_small(to_float(cm[e]), tau);
  for (Index a = threadIdx.x; a < dv; a += blockDim.x)
    prep.vbar[head * dv + a] = to_float(st.value_mean_of(b, h)[a]);
}

/// One warp's row of C k (or C̃ k): u[a] = Σ_c ct[c, a] k[c] for the lane's value indices, k staged fp32.
__device__ inline float moment_matvec(float const* ct, float const* k, Index dk, Index dv, Index a) {
  float u = 0.0f;
  for (Index c = 0; c < dk; ++c)
    u += ct[c * dv + a] * k[c];
  return u;
}

/// Grid (slot blocks, Hkv, B), one warp per slot j < n: score[j] = kvc::moment_mi_score(α_j, ‖r_j‖²) (the CPU's
/// epilogue) with α_j the base already in `out` (or `fixed`'s, when set: then padding gets -inf here); α_j alone
/// without `mi`.
/// A head whose u_j rows are all tracked reads them (C unclamped), else C̃ k_j from `prep`.
template <class C, class T>
__global__ void __launch_bounds__(moment_threads)
    moment_residual_kernel(C cache, MomentState<DeviceSpace, T> st, MomentResiduals<DeviceSpace> res,
                           TokenArray<float const, DeviceSpace> fixed, float scale, bool mi, MomentPrep prep,
                           ScoreSpan<DeviceSpace> out) {
  float* const k_rows = dynamic_shared<float>();  // [moment_warps, d_k]
  KVExtents const e = cache.keys.extents();
  Index const dk = e.dim, dv = cache.values.extents().dim;
  int const warp = static_cast<int>(threadIdx.x) / warp_size, lane = static_cast<int>(threadIdx.x) % warp_size;
  Index const b = blockIdx.z, h = blockIdx.y, head = st.head(b, h), n = cache.clamped_length(b, h);
  Index const ne = st.count[head];
  bool const cached = res.enabled() && res.tracked[head] == n;
  float const beta = ne > 0 ? scale / static_cast<float>(ne) : 0.0f;
  float const* ct = prep.ct + head * dk * dv;
  float const* vbar = prep.vbar + head * dv;
  float* k = k_rows + warp * dk;
  float* score = out.row(b, h);
  auto const ks = cache.keys.scale(b, h);
  auto const vs = cache.values.scale(b, h);
  Index const stride = static_cast<Index>(gridDim.x) * moment_warps;
  for (Index j = static_cast<Index>(blockIdx.x) * moment_warps + warp; j < e.tokens; j += stride) {
    if (j >= n) {  // padding: the base wrote -inf; a fixed base is copied for [0, n) only
      if (fixed.data && lane == 0)
        score[j] = -CUDART_INF_F;
      continue;
    }
    float const alpha = fixed.data ? fixed.row(b, h)[j] : score[j];
    if (!mi || alpha == CUDART_INF_F) {  // warp-uniform: every lane read the same α (+inf protects whatever ‖r_j‖)
      if (fixed.data && lane == 0)
        score[j] = alpha;
      continue;
    }
    auto const* v = cache.values.row(b, h, j);
    float ss = 0.0f;
    if (ne > 0 && !cached) {
      auto const* src = cache.keys.row(b, h, j);
      for (Index c = lane; c < dk; c += warp_size)
        k[c] = load(src[c], ks);
      __syncwarp();
      for (Index a = lane; a < dv; a += warp_size) {
        float const r = moment_residual(load(v[a], vs), vbar[a], beta, moment_matvec(ct, k, dk, dv, a));
        ss += r * r;
      }
      __syncwarp();  // k is rewritten for the next slot
    } else if (ne > 0) {
      float const* u = res.rows.row(b, h, j);
      for (Index a = lane; a < dv; a += warp_size) {
        float const r = moment_residual(load(v[a], vs), vbar[a], beta, u[a]);
        ss += r * r;
      }
    } else {
      for (Index a = lane; a < dv; a += warp_size)
        ss += load(v[a], vs) * load(v[a], vs);
    }
    ss = warp_sum(ss);
    if (lane == 0)
      score[j] = moment_mi_score(alpha, ss);
  }
}

/// Grid (slot blocks, Hkv, B), one warp per new slot j in [tracked, n) (all of [0, n) when tracked is outside it):
/// u_j = C k_j from `prep` (tau = 0). Reads `tracked`; track_lengths_kernel (detail/tracked.cuh), ordered after it,
/// writes it.
template <class C>
__global__ void __launch_bounds__(moment_threads)
    moment_fill_kernel(C cache, MomentResiduals<DeviceSpace> res, MomentPrep prep) {
  float* const k_rows = dynamic_shared<float>();  // [moment_warps, d_k]
  KVExtents const e = cache.keys.extents();
  Index const dk = e.dim, dv = cache.values.extents().dim;
  int const warp = static_cast<int>(threadIdx.x) / warp_size, lane = static_cast<int>(threadIdx.x) % warp_size;
  Index const b = blockIdx.z, h = blockIdx.y, head = b * e.heads + h, n = cache.clamped_length(b, h);
  Index const t = res.tracked[head], from = t >= 0 && t <= n ? t : 0;
  float const* ct = prep.ct + head * dk * dv;
  float* k = k_rows + warp * dk;
  auto const ks = cache.keys.scale(b, h);
  Index const stride = static_cast<Index>(gridDim.x) * moment_warps;
  for (Index j = from + static_cast<Index>(blockIdx.x) * moment_warps + warp; j < n; j += stride) {
    auto const* src = cache.keys.row(b, h, j);
    for (Index c = lane; c < dk; c += warp_size)
      k[c] = load(src[c], ks);
    __syncwarp();
    float* u = res.rows.row(b, h, j);
    for (Index a = lane; a < dv; a += warp_size)
      u[a] = moment_matvec(ct, k, dk, dv, a);
    __syncwarp();
  }
}

/// Evicted slot i of a head, clamped to [0, n) (the list comes from a plan the device cannot validate).
__device__ inline Index moment_slot(Index const* slots, Index i, Index n) {
  Index const t = slots[i];
  return t < 0 ? 0 : (t >= n ? (n > 0 ? n - 1 : 0) : t);
}

/// The first index i of the ascending list keep[0, kept) with keep[i] >= t (kept when there is none).
__device__ inline Index moment_lower_bound(Index const* keep, Index kept, Index t) {
  Index lo = 0, hi = kept;
  while (lo < hi) {
    Index const mid = (lo + hi) / 2;
    if (keep[mid] < t)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}

/// Whether every element of row t of head (b, h) is finite under the view's scale (the CPU's detail::all_finite).
template <class Rows>
__device__ inline bool moment_row_finite(Rows const& rows, Index b, Index h, Index t, Index dim) {
  auto const* x = rows.row(b, h, t);
  auto const scale = rows.scale(b, h);
  bool finite = true;
  for (Index i = 0; i < dim; ++i)
    finite = finite && detail::is_finite_value(load(x[i], scale));
  return finite;
}

/// Grid (Hkv, B), exactly moment_threads threads (warp_counts has a slot per warp): the slots of [0, n) the plan does
/// not keep whose K and V rows are finite, ascending, and m = their count; info[3] = every evicted slot. As on the CPU,
/// a row with a NaN or Inf element is dropped, not folded (it would make the head's moments, and every later score,
/// NaN). Slot t is evicted iff it is not in the ascending kept list; its place in the evicted list is t minus the kept
/// slots below it (a binary search), so every thread works alone; then the block drops the non-finite ones in place,
/// 256 at a time (each thread's row checked alone, places from a ballot per warp). With the u_j cache, a head whose
/// evicted rows are all non-finite merges nothing, and its tracked count becomes the kept slots below it (the CPU's m =
/// 0 case).
template <class C>
__global__ void __launch_bounds__(moment_threads)
    moment_slots_kernel(C cache, KeepPlan<DeviceSpace> plan, MomentResiduals<DeviceSpace> res, MomentFold fold) {
  __shared__ Index warp_counts[moment_warps];
  __shared__ Index finite_total;
  KVExtents const e = cache.keys.extents();
  Index const b = blockIdx.y, h = blockIdx.x, head = b * e.heads + h, n = cache.clamped_length(b, h);
  Index const dk = e.dim, dv = cache.values.extents().dim;
  Index const kept = clamp_length(plan.kept(b, h), plan.capacity < n ? plan.capacity : n);
  Index const* keep = plan.indices(b, h);
  Index* slots = fold.slots + head * e.tokens;
  int const warp = static_cast<int>(threadIdx.x) / warp_size, lane = static_cast<int>(threadIdx.x) % warp_size;
  for (Index t = threadIdx.x; t < n; t += blockDim.x) {
    Index const lo = moment_lower_bound(keep, kept, t);
    if (lo == kept || keep[lo] != t)
      slots[t - lo] = t;
  }
  if (threadIdx.x == 0)
    finite_total = 0;
  __syncthreads();  // the whole list is written
  Index const evicted = n - kept;
  for (Index i0 = 0; i0 < evicted; i0 += blockDim.x) {  // block-uniform
    Index const i = i0 + threadIdx.x;
    Index const t = i < evicted ? moment_slot(slots, i, n) : 0;
    bool const finite =
        i < evicted && moment_row_finite(cache.keys, b, h, t, dk) && moment_row_finite(cache.values, b, h, t, dv);
    unsigned const votes = __ballot_sync(full_mask, finite);
    if (lane == 0)
      warp_counts[warp] = __popc(votes);
    __syncthreads();  // the counts are in, and every slot of this chunk has been read
    Index place = finite_total + __popc(votes & ((1u << lane) - 1u));
    for (int w = 0; w < warp; ++w)
      place += warp_counts[w];
    if (finite)  // place <= i: in place, never past a slot still to be read
      slots[place] = t;
    __syncthreads();  // finite_total and warp_counts were read
    if (threadIdx.x == 0)
      for (int w = 0; w < moment_warps; ++w)
        finite_total += warp_counts[w];
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    fold.info[head * 4] = finite_total;
    fold.info[head * 4 + 3] = evicted;
    if (finite_total == 0 && evicted > 0 && res.enabled())
      res.tracked[head] = moment_lower_bound(keep, kept, res.tracked[head]);
  }
}

/// Rows [begin, end) of split `s` of m evicted rows (even shares, the first ones one longer).
__device__ inline void moment_split_range(Index m, Index splits, Index s, Index& begin, Index& end) {
  Index const share = m / splits, extra = m % splits;
  begin = s * share + (s < extra ? s : extra);
  end = begin + share + (s < extra ? 1 : 0);
}

/// Grid (splits, Hkv, B): fp64 sums of the split's evicted rows, one column of [k | v] per thread, rows in order.
template <class C>
__global__ void moment_sums_kernel(C cache, Index splits, MomentFold fold) {
  KVExtents const e = cache.keys.extents();
  Index const dk = e.dim, dv = cache.values.extents().dim, width = dk + dv;
  Index const b = blockIdx.z, h = blockIdx.y, s = blockIdx.x, head = b * e.heads + h, n = cache.clamped_length(b, h);
  Index const m = fold.info[head * 4];
  Index begin = 0, end = 0;
  moment_split_range(m, splits, s, begin, end);
  Index const* slots = fold.slots + head * e.tokens;
  double* sums = fold.sums + (head * splits + s) * width;
  auto const ks = cache.keys.scale(b, h);
  auto const vs = cache.values.scale(b, h);
  for (Index x = threadIdx.x; x < width; x += blockDim.x) {
    double acc = 0.0;
    for (Index i = begin; i < end; ++i) {
      Index const t = moment_slot(slots, i, n);
      acc += x < dk ? load(cache.keys.row(b, h, t)[x], ks) : load(cache.values.row(b, h, t)[x - dk], vs);
    }
    sums[x] = acc;
  }
}

/// The block means [k̄ | v̄] in fp32 (the ranges' fp64 sums added in order, divided by m), into `mean`.
__device__ inline void moment_block_means(MomentFold const& fold, Index head, Index splits, Index width, Index m,
                                          float* mean) {
  for (Index x = threadIdx.x; x < width; x += blockDim.x) {
    double acc = 0.0;
    for (Index s = 0; s < splits; ++s)
      acc += fold.sums[(head * splits + s) * width + x];
    mean[x] = static_cast<float>(acc / static_cast<double>(m));
  }
}

/// Grid (splits, Hkv, B): the centred co-moment Σ (v − v̄)(k − k̄)ᵀ of the split's rows. Tiles of moment_fold_tile
/// centred rows are staged in shared memory; each thread accumulates moment_acc entries of C_B in registers per
/// pass over the rows (passes cover the d_v · d_k entries). Split 0 also stores the block means for the merge.
template <class C>
__global__ void __launch_bounds__(moment_threads) moment_comoment_kernel(C cache, Index splits, MomentFold fold) {
  float* const fold_smem = dynamic_shared<float>();  // mean [dk + dv], K tile [tile, dk], V tile [tile, dv]
  KVExtents const e = cache.keys.extents();
  Index const dk = e.dim, dv = cache.values.extents().dim, width = dk + dv, entries = dk * dv;
  Index const b = blockIdx.z, h = blockIdx.y, s = blockIdx.x, head = b * e.heads + h, n = cache.clamped_length(b, h);
  Index const m = fold.info[head * 4];
  float* partial = fold.partial + (head * splits + s) * entries;
  Index begin = 0, end = 0;
  moment_split_range(m, splits, s, begin, end);
  if (m <= 0)
    return;  // block-uniform: nothing evicted, the merge skips the head
  float* mean = fold_smem;
  float* kt = mean + width;
  float* vt = kt + moment_fold_tile * dk;
  moment_block_means(fold, head, splits, width, m, mean);
  __syncthreads();
  if (s == 0)
    for (Index x = threadIdx.x; x < width; x += blockDim.x)
      fold.means[head * 2 * width + x] = mean[x];
  Index const* slots = fold.slots + head * e.tokens;
  auto const ks = cache.keys.scale(b, h);
  auto const vs = cache.values.scale(b, h);
  Index const per_pass = static_cast<Index>(blockDim.x) * moment_acc;
  for (Index e0 = 0; e0 < entries; e0 += per_pass) {
    float acc[moment_acc] = {};
    for (Index r0 = begin; r0 < end; r0 += moment_fold_tile) {
      Index const rows = end - r0 < moment_fold_tile ? end - r0 : moment_fold_tile;
      for (Index x = threadIdx.x; x < rows * width; x += blockDim.x) {  // centred in fp32, as the CPU's tiles
        Index const i = x / width, col = x % width, t = moment_slot(slots, r0 + i, n);
        if (col < dk)
          kt[i * dk + col] = load(cache.keys.row(b, h, t)[col], ks) - mean[col];
        else
          vt[i * dv + col - dk] = load(cache.values.row(b, h, t)[col - dk], vs) - mean[col];
      }
      __syncthreads();
      for (int q = 0; q < moment_acc; ++q) {
        Index const x = e0 + threadIdx.x + static_cast<Index>(q) * blockDim.x;
        if (x >= entries)
          break;
        Index const a = x / dk, c = x % dk;
        float sum = acc[q];
        for (Index i = 0; i < rows; ++i)
          sum += vt[i * dv + a] * kt[i * dk + c];
        acc[q] = sum;
      }
      __syncthreads();  // the tile is restaged next
    }
    for (int q = 0; q < moment_acc; ++q) {
      Index const x = e0 + threadIdx.x + static_cast<Index>(q) * blockDim.x;
      if (x < entries)
        partial[x] = acc[q];
    }
  }
}

/// Grid (Hkv, B): Chan's merge of the block (m, k̄_B, v̄_B, Σ partial co-moments in split order) into the state, in
/// fp32 with the CPU's expressions (detail::merge_moments), stored as T; count += m. With the u_j cache it also
/// decides the rows' update (rank-1 for one folded row onto fully tracked rows before `refresh`, else all rows from
/// C'), keeps C'ᵀ (fp32, before narrowing) and the old means for moment_rows_kernel, and sets tracked and age.
template <class C, class T>
__global__ void __launch_bounds__(moment_threads)
    moment_merge_kernel(C cache, MomentState<DeviceSpace, T> st, MomentResiduals<DeviceSpace> res, Index splits,
                        MomentFold fold) {
  float* const delta = dynamic_shared<float>();  // Δk [dk], Δv [dv]
  KVExtents const e = cache.keys.extents();
  Index const dk = e.dim, dv = cache.values.extents().dim, width = dk + dv, entries = dk * dv;
  Index const b = blockIdx.y, h = blockIdx.x, head = st.head(b, h), n = cache.clamped_length(b, h);
  Index const m = fold.info[head * 4];
  if (m <= 0)
    return;  // block-uniform; like the CPU, age stays (tracked: moment_slots_kernel)
  Index const n_a = st.count[head];
  Index action = 0;
  if (res.enabled())
    action = m == 1 && res.tracked[head] == n && res.age[head] + 1 < res.refresh ? 1 : 2;
  float const wb = static_cast<float>(m) / static_cast<float>(n_a + m);
  float const cross = static_cast<float>(n_a) * wb;    // n_a m / n
  float const* mean = fold.means + head * 2 * width;   // [k̄_B | v̄_B]
  float* old = fold.means + head * 2 * width + width;  // [k̄_A | v̄_A]
  T* km = st.key_mean_of(b, h);
  T* vm = st.value_mean_of(b, h);
  for (Index x = threadIdx.x; x < width; x += blockDim.x) {
    float const a_old = to_float(x < dk ? km[x] : vm[x - dk]);
    old[x] = a_old;
    delta[x] = mean[x] - a_old;
  }
  __syncthreads();  // every Δ is read by many threads below; count is read above
  T* cm = st.comoment_of(b, h);
  float* ct = fold.ct ? fold.ct + head * dk * dv : nullptr;
  for (Index x = threadIdx.x; x < entries; x += blockDim.x) {
    Index const a = x / dk, c = x % dk;
    float cb = 0.0f;
    for (Index s = 0; s < splits; ++s)
      cb += fold.partial[(head * splits + s) * entries + x];
    float const updated = to_float(cm[x]) + (cb + (cross * delta[dk + a]) * delta[c]);
    cm[x] = from_float<T>(updated);
    if (action == 2)
      ct[c * dv + a] = updated;
  }
  for (Index x = threadIdx.x; x < width; x += blockDim.x) {
    float const updated = old[x] + wb * delta[x];
    if (x < dk)
      km[x] = from_float<T>(updated);
    else
      vm[x - dk] = from_float<T>(updated);
  }
  __syncthreads();  // n_a and tracked were read by every thread
  if (threadIdx.x == 0) {
    st.count[head] = n_a + m;
    fold.info[head * 4 + 1] = n_a;
    fold.info[head * 4 + 2] = action;
    if (action != 0) {
      res.age[head] = action == 1 ? res.age[head] + 1 : 0;
      res.tracked[head] = n - fold.info[head * 4 + 3];  // the kept count: compaction moves their rows to [0, kept)
    }
  }
}

/// Grid (slot blocks, Hkv, B), one warp per kept slot keep[j]: action 1 adds Chan's rank-1 term
/// (n_a / (n_a + 1)) (v* − v̄_a) ((k* − k̄_a)ᵀ k_j) to u; action 2 recomputes u = C' k from the merged fp32 C'ᵀ.
template <class C>
__global__ void __launch_bounds__(moment_threads)
    moment_rows_kernel(C cache, KeepPlan<DeviceSpace> plan, MomentResiduals<DeviceSpace> res, MomentFold fold) {
  float* const k_rows = dynamic_shared<float>();  // [moment_warps, d_k]
  KVExtents const e = cache.keys.extents();
  Index const dk = e.dim, dv = cache.values.extents().dim, width = dk + dv;
  int const warp = static_cast<int>(threadIdx.x) / warp_size, lane = static_cast<int>(threadIdx.x) % warp_size;
  Index const b = blockIdx.z, h = blockIdx.y, head = b * e.heads + h, n = cache.clamped_length(b, h);
  Index const action = fold.info[head * 4] > 0 ? fold.info[head * 4 + 2] : 0;
  if (action == 0)
    return;
  Index const kept = clamp_length(plan.kept(b, h), plan.capacity < n ? plan.capacity : n);
  Index const* keep = plan.indices(b, h);
  float const* star = fold.means + head * 2 * width;  // the evicted row (m = 1): [k* | v*]
  float const* old = star + width;                    // [k̄_a | v̄_a]
  float const* ct = fold.ct + head * dk * dv;
  float const w = static_cast<float>(fold.info[head * 4 + 1]) / static_cast<float>(fold.info[head * 4 + 1] + 1);
  float* k = k_rows + warp * dk;
  auto const ks = cache.keys.scale(b, h);
  Index const stride = static_cast<Index>(gridDim.x) * moment_warps;
  for (Index j = static_cast<Index>(blockIdx.x) * moment_warps + warp; j < kept; j += stride) {
    Index const t = keep[j] < 0 ? 0 : (keep[j] >= n ? n - 1 : keep[j]);
    auto const* src = cache.keys.row(b, h, t);
    float* u = res.rows.row(b, h, t);
    if (action == 1) {
      float dot = 0.0f;  // (k* − k̄_a)ᵀ k_j
      for (Index c = lane; c < dk; c += warp_size)
        dot += (star[c] - old[c]) * load(src[c], ks);
      float const coef = w * warp_sum(dot);
      for (Index a = lane; a < dv; a += warp_size)
        u[a] += coef * (star[dk + a] - old[dk + a]);
    } else {
      for (Index c = lane; c < dk; c += warp_size)
        k[c] = load(src[c], ks);
      __syncwarp();
      for (Index a = lane; a < dv; a += warp_size)
        u[a] = moment_matvec(ct, k, dk, dv, a);
      __syncwarp();
    }
  }
}

}  // namespace kvc::backend::cuda

namespace kvc {

/// MomentKV's MI scorer on CUDA. Score workspace (device): the base's window scratch, then (reusing it: the stream
/// orders them) C̃ᵀ and v̄ per head in fp32. on_evict workspace: the fold's scratch (MomentFold). update workspace:
/// C ᵀ and v̄ per head with the u_j cache, none without.
template <class T>
struct Kernel<MomentKVScorer<DeviceSpace, T>, Cuda> {
  using Scorer = MomentKVScorer<DeviceSpace, T>;
  using Base = Kernel<SnapKVScorer, Cuda>;

  template <class Obs>
  static std::size_t workspace_bytes(Cuda const& cuda, Scorer const& s, KVExtents const& keys, Obs const& obs) {
    std::size_t const base = s.fixed_base.data ? 0 : Base::workspace_bytes(cuda, s.base, keys, obs);
    // d_v is not in the key extents: size it for the state's value dim (run() checks they agree).
    std::size_t const mine = backend::cuda::MomentPrep::bytes(keys.batch * keys.heads, keys.dim, s.state.value_dim);
    return base > mine ? base : mine;
  }

  /// Checks every call shares: the scorer, the moments' shape, the u_j rows' shape, and the device's limits.
  template <KVCacheView C>
  static Status check(Scorer const& s, C const& cache, char const* what) {
    KVExtents const e = cache.keys.extents();
    Index const dv = cache.values.extents().dim;
    KVC_RETURN_IF_ERROR(s.check());
    KVC_RETURN_IF_ERROR(s.state.check(e.batch, e.heads, e.dim, dv));
    if (s.residuals.enabled()) {
      KVExtents const x = s.residuals.rows.extents();
      if (x.batch != e.batch || x.heads != e.heads || x.tokens < e.tokens || x.dim != dv)
        return {Errc::invalid_argument, "MomentKVScorer: `residuals.rows` must be [batch, heads, >= tokens, d_v]"};
    }
    KVC_RETURN_IF_ERROR(backend::cuda::head_grid_status(e.batch, e.heads, what));
    return {};
  }

  template <KVCacheView C, class Obs>
  static Status run(Cuda const& cuda, Scorer const& s, C const& cache, Obs const& obs, ScoreSpan<DeviceSpace> out,
                    Workspace ws) {
    namespace bc = backend::cuda;
    KVExtents const e = cache.keys.extents();
    Index const dk = e.dim, dv = cache.values.extents().dim;
    KVC_RETURN_IF_ERROR(check(s, cache, "kvc::score(moment_kv, Cuda): batch and heads must be <= 65535"));
    if (s.fixed_base.data) {
      if (s.fixed_base.batch != e.batch || s.fixed_base.heads != e.heads || s.fixed_base.tokens < e.tokens)
        return {Errc::invalid_argument, "kvc::score(moment_kv): `fixed_base` must be [batch, heads, >= tokens]"};
    } else {
      KVC_RETURN_IF_ERROR(Base::run(cuda, s.base, cache, obs, out, ws));  // α into `out`, then ws is free again
    }
    WorkspaceCarver carve(ws);
    auto const prep = bc::MomentPrep::carve(carve, e.batch * e.heads, dk, dv);
    if (!prep.complete() && e.batch * e.heads > 0 && dk * dv > 0)
      return {Errc::out_of_capacity, "kvc::score(moment_kv, Cuda): workspace smaller than score_workspace_bytes()"};
    if (e.batch * e.heads == 0 || e.tokens == 0)
      return {};
    std::size_t const smem = static_cast<std::size_t>(bc::moment_warps * dk) * sizeof(float);
    KVC_RETURN_IF_ERROR(bc::shared_memory_status(smem, "kvc::score(moment_kv, Cuda): d_k too large"));
    KVC_RETURN_IF_ERROR(bc::pending_status());
    float const c = s.scale > 0.0f ? s.scale : 1.0f / std::sqrt(static_cast<float>(dk));
    dim3 const heads(static_cast<unsigned>(e.heads), static_cast<unsigned>(e.batch));
    if (s.mi)  // without it the residual kernel only copies a fixed base
      KVC_RETURN_IF_ERROR(bc::launch(KVC_CUDA_KERNEL("kvc::score(moment_kv, Cuda)", bc::moment_prep_kernel), heads,
                                     bc::moment_threads, 0, cuda.stream, s.state, s.clamp_tau, prep));
    KVC_RETURN_IF_ERROR(bc::launch(KVC_CUDA_KERNEL("kvc::score(moment_kv, Cuda)", bc::moment_residual_kernel),
                                   bc::moment_slot_grid(e), bc::moment_threads, smem, cuda.stream, cache, s.state,
                                   s.residuals, s.fixed_base, c, s.mi, prep, out));
    return {};
  }

  template <class Obs>
  static std::size_t update_workspace_bytes(Cuda const&, Scorer const& s, KVExtents const& keys, Obs const&) {
    return s.residuals.enabled()
               ? backend::cuda::MomentPrep::bytes(keys.batch * keys.heads, keys.dim, s.state.value_dim)
               : 0;
  }

  /// Without the u_j cache the moments hold evicted tokens only: nothing to do. With it, the rows of the new slots
  /// [tracked, length) are computed (u_j = C k_j, the stored C widened, unclamped) and tracked = length.
  template <KVCacheView C, class Obs>
  static Status update(Cuda const& cuda, Scorer const& s, C const& cache, Obs const&, Workspace ws) {
    namespace bc = backend::cuda;
    if (!s.residuals.enabled())
      return {};
    KVExtents const e = cache.keys.extents();
    Index const dk = e.dim, dv = cache.values.extents().dim;
    KVC_RETURN_IF_ERROR(check(s, cache, "kvc::update(moment_kv, Cuda): batch and heads must be <= 65535"));
    WorkspaceCarver carve(ws);
    auto const prep = bc::MomentPrep::carve(carve, e.batch * e.heads, dk, dv);
    if (!prep.complete() && e.batch * e.heads > 0 && dk * dv > 0)
      return {Errc::out_of_capacity, "kvc::update(moment_kv, Cuda): workspace smaller than update_workspace_bytes()"};
    if (e.batch * e.heads == 0)
      return {};
    std::size_t const smem = static_cast<std::size_t>(bc::moment_warps * dk) * sizeof(float);
    KVC_RETURN_IF_ERROR(bc::shared_memory_status(smem, "kvc::update(moment_kv, Cuda): d_k too large"));
    KVC_RETURN_IF_ERROR(bc::pending_status());
    dim3 const heads(static_cast<unsigned>(e.heads), static_cast<unsigned>(e.batch));
    KVC_RETURN_IF_ERROR(bc::launch(KVC_CUDA_KERNEL("kvc::update(moment_kv, Cuda)", bc::moment_prep_kernel), heads,
                                   bc::moment_threads, 0, cuda.stream, s.state, 0.0f, prep));
    KVC_RETURN_IF_ERROR(bc::launch(KVC_CUDA_KERNEL("kvc::update(moment_kv, Cuda)", bc::moment_fill_kernel),
                                   bc::moment_slot_grid(e), bc::moment_threads, smem, cuda.stream, cache, s.residuals,
                                   prep));
    KVC_RETURN_IF_ERROR(bc::launch(KVC_CUDA_KERNEL("kvc::update(moment_kv, Cuda)", bc::track_lengths_kernel<C>),
                                   bc::grid_dim((e.batch * e.heads + bc::track_threads - 1) / bc::track_threads),
                                   bc::track_threads, 0, cuda.stream, cache, s.residuals.tracked));
    return {};
  }

  static std::size_t on_evict_workspace_bytes(Cuda const&, Scorer const& s, KVExtents const& keys) {
    return backend::cuda::MomentFold::bytes(keys, s.state.value_dim, backend::cuda::moment_fold_splits(keys),
                                            s.residuals.enabled());
  }

  /// Folds the slots of [0, length) that `plan` does not keep into each head's moments (block mean and centred
  /// co-moment, then Chan's merge; count += m), before kvc::compact moves the cache; with the u_j cache, keeps
  /// the kept slots' rows equal to C' k_j (see moment_merge_kernel).
  template <KVCacheView C>
  static Status on_evict(Cuda const& cuda, Scorer const& s, C const& cache, KeepPlan<DeviceSpace> const& plan,
                         Workspace ws) {
    namespace bc = backend::cuda;
    KVExtents const e = cache.keys.extents();
    Index const dk = e.dim, dv = cache.values.extents().dim;
    KVC_RETURN_IF_ERROR(check(s, cache, "kvc::on_evict(moment_kv, Cuda): batch and heads must be <= 65535"));
    if (plan.batch != e.batch || plan.heads != e.heads ||
        ((plan.count == nullptr || plan.index == nullptr) && plan.batch * plan.heads > 0))
      return {Errc::invalid_argument, "kvc::on_evict(moment_kv, Cuda): `plan` must have the cache's batch and heads"};
    bool const rows = s.residuals.enabled();
    Index const splits = bc::moment_fold_splits(e);
    WorkspaceCarver carve(ws);
    auto const fold = bc::MomentFold::carve(carve, e, dv, splits, rows);
    if (!fold.complete(rows) && e.batch * e.heads > 0)
      return {Errc::out_of_capacity,
              "kvc::on_evict(moment_kv, Cuda): workspace smaller than on_evict_workspace_bytes()"};
    if (e.batch * e.heads == 0 || e.tokens == 0)
      return {};
    std::size_t const smem_fold =
        static_cast<std::size_t>((dk + dv) + bc::moment_fold_tile * (dk + dv)) * sizeof(float);
    std::size_t const smem_rows = static_cast<std::size_t>(bc::moment_warps * dk) * sizeof(float);
    KVC_RETURN_IF_ERROR(bc::shared_memory_status(smem_fold, "kvc::on_evict(moment_kv, Cuda): head dims too large"));
    KVC_RETURN_IF_ERROR(bc::pending_status());
    dim3 const heads(static_cast<unsigned>(e.heads), static_cast<unsigned>(e.batch));
    dim3 const ranges(static_cast<unsigned>(splits), static_cast<unsigned>(e.heads), static_cast<unsigned>(e.batch));
    KVC_RETURN_IF_ERROR(bc::launch(KVC_CUDA_KERNEL("kvc::on_evict(moment_kv, Cuda)", bc::moment_slots_kernel), heads,
                                   bc::moment_threads, 0, cuda.stream, cache, plan, s.residuals, fold));
    KVC_RETURN_IF_ERROR(bc::launch(KVC_CUDA_KERNEL("kvc::on_evict(moment_kv, Cuda)", bc::moment_sums_kernel), ranges,
                                   bc::moment_threads, 0, cuda.stream, cache, splits, fold));
    KVC_RETURN_IF_ERROR(bc::launch(KVC_CUDA_KERNEL("kvc::on_evict(moment_kv, Cuda)", bc::moment_comoment_kernel),
                                   ranges, bc::moment_threads, smem_fold, cuda.stream, cache, splits, fold));
    KVC_RETURN_IF_ERROR(bc::launch(KVC_CUDA_KERNEL("kvc::on_evict(moment_kv, Cuda)", bc::moment_merge_kernel), heads,
                                   bc::moment_threads, static_cast<std::size_t>(dk + dv) * sizeof(float), cuda.stream,
                                   cache, s.state, s.residuals, splits, fold));
    if (rows)
      KVC_RETURN_IF_ERROR(bc::launch(KVC_CUDA_KERNEL("kvc::on_evict(moment_kv, Cuda)", bc::moment_rows_kernel),
                                     bc::moment_slot_grid(e), bc::moment_threads, smem_rows, cuda.stream, cache, plan,
                                     s.residuals, fold));
    return {};
  }
};

}  // namespace kvc
