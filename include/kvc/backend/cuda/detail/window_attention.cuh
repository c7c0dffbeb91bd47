// SPDX-License-Identifier: Apache-2.0
// kvc/backend/cuda/detail/window_attention.cuh: the shared window-attention kernels on CUDA (SnapKV, TOVA, H2O and
// ObservedAttention; MomentKV next): per query head, the column sums over window query rows [first, last) of the
// causal softmax attention over each KV head's slots. Three launches, never more than one logit per thread in
// flight:
//   1. prepare: each window query widened to fp32 and rotated to its position (RoPE table lookups), positions;
//   2. lse: one warp per query row, lanes over slots: the row's log-sum-exp;
//   3. columns: one thread per slot of a KV head, looping over the g * R rows of its group: sum of exp(l - lse),
//      written or (`accumulate`) added to the column sums, so long query ranges run in tiles of rows. The sums are
//      per query head (over the R rows: SnapKV, TOVA, H2O) or, with ColumnSums::per_window_row, per window row (over
//      the g query heads of the group: UNComp's stored rows), as the CPU kernel's two modes.
// Same definition as the CPU kernel (backend/cpu/detail/window_attention.hpp, window_attention_columns with its row
// range and `accumulate` flag); parity is tested within fp32 rounding (different summation order). No atomics:
// every column sum is written by one thread, in a fixed row order, so results are deterministic.
#pragma once

#include <kvc/backend/cuda/config.cuh>
#include <kvc/backend/cuda/detail/block_reduce.cuh>  // block_max (used by the window scorers' finish kernels)
#include <kvc/backend/cuda/detail/logits.cuh>
#include <kvc/core/observations.hpp>
#include <kvc/core/workspace.hpp>

#include <cstddef>
#include <cstdint>
#include <math_constants.h>

namespace kvc::backend::cuda {

/// Threads of the window scorers' finish kernels (one block per head or per sequence).
inline constexpr int finish_threads = 1024;

inline constexpr int window_threads = 256;
inline constexpr int window_lse_warps = 8;

/// How window_columns_kernel sums the attention rows of a KV head's group (the CPU's detail::ColumnSums).
enum class ColumnSums : std::uint8_t {
  per_query_head,  ///< colsum [B, Hq, N]: row q summed over the window rows (SnapKV, TOVA, H2O)
  per_window_row,  ///< colsum [B, Hkv, R, N]: row (h, i) summed over h's g query heads (UNComp's stored rows)
};

/// Device workspace of the window attention for R rows per query head (aligned pieces, see WindowScratch::carve). A
/// pass over fewer rows (the last tile of a range) uses a prefix of `q`, `q_pos` and `lse`, indexed with its own count.
/// `colsum_rows` is the column sums' rows per sequence: 0 (the default) for Hq (ColumnSums::per_query_head), Hkv * R
/// for ColumnSums::per_window_row.
struct WindowScratch {
  float* q = nullptr;       ///< [B, Hq, R, d] rotated fp32 queries
  Index* q_pos = nullptr;   ///< [B, R] query positions
  float* lse = nullptr;     ///< [B, Hq, R]
  float* colsum = nullptr;  ///< [B, Hq, N] (per query head) or [B, Hkv, R, N] (per window row)

  static std::size_t bytes(Index batch, Index query_heads, Index rows, Index dim, Index tokens,
                           Index colsum_rows = 0) noexcept {
    return bytes_sum(
        workspace_round(bytes_product(batch, query_heads, rows, dim, sizeof(float))),
        workspace_round(bytes_product(batch, rows, sizeof(Index))),
        workspace_round(bytes_product(batch, query_heads, rows, sizeof(float))),
        workspace_round(bytes_product(batch, colsum_rows > 0 ? colsum_rows : query_heads, tokens, sizeof(float))));
  }
  static WindowScratch carve(WorkspaceCarver& c, Index batch, Index query_heads, Index rows, Index dim, Index tokens,
                             Index colsum_rows = 0) {
    WindowScratch s;
    s.q = c.take<float>(batch * query_heads * rows * dim);
    s.q_pos = c.take<Index>(batch * rows);
    s.lse = c.take<float>(batch * query_heads * rows);
    s.colsum = c.take<float>(batch * (colsum_rows > 0 ? colsum_rows : query_heads) * tokens);
    return s;
  }
  bool complete() const noexcept { return q && q_pos && lse && colsum; }
};

/// Grid (Hq, B): rows [first, first + R) of the window, widened, rotated (pairs from the table), positioned.
template <class WQ, class C>
__global__ void window_prepare_kernel(WQ wq, C cache, Index first, Index rows, WindowScratch s) {
  Index const b = blockIdx.y, hq = blockIdx.x, w = wq.window(), d = wq.rows.extents().dim,
              heads = wq.rows.extents().heads;
  __shared__ Index end;
  if (threadIdx.x == 0)
    end = wq.positions ? 0 : context_end(cache, b);
  __syncthreads();
  for (Index r = 0; r < rows; ++r) {
    Index pos = wq.positions ? wq.given_position(b, first + r) : end - w + first + r;
    if (hq == 0 && threadIdx.x == 0)
      s.q_pos[b * rows + r] = pos;
    auto const* src = wq.rows.row(b, hq, first + r);
    float* dst = s.q + ((b * heads + hq) * rows + r) * d;
    Index const half = wq.rope.empty() ? 0 : wq.rope.rotary_dim / 2;
    pos = pos < 0 ? 0
                  : (pos >= wq.rope.positions ? wq.rope.positions - 1 : pos);  // the host cannot check device positions
    for (Index c = threadIdx.x; c < d; c += blockDim.x) {
      bool const neox = wq.rope.style == RopeStyle::neox;
      Index const pair = neox ? (c < half ? c : c - half) : c / 2;
      if (c >= 2 * half) {  // past rotary_dim (or no table): not rotated
        dst[c] = to_float(src[c]);
        continue;
      }
      Index const a = neox ? pair : 2 * pair, bb = neox ? pair + half : 2 * pair + 1;
      float const xa = to_float(src[a]), xb = to_float(src[bb]);
      float const cs = wq.rope.cos[pos * half + pair], sn = wq.rope.sin[pos * half + pair];
      dst[c] = c == a ? xa * cs - xb * sn : xb * cs + xa * sn;
    }
  }
}

/// Grid (row blocks, Hq, B): one warp per (query head, row): the row's log-sum-exp over the visible slots.
template <class C>
__global__ void window_lse_kernel(C cache, Index query_heads, Index rows, float scale, WindowScratch s) {
  Index const b = blockIdx.z, hq = blockIdx.y, d = cache.keys.extents().dim;
  int const warp = static_cast<int>(threadIdx.x) / warp_size, lane = static_cast<int>(threadIdx.x) % warp_size;
  Index const r = static_cast<Index>(blockIdx.x) * window_lse_warps + warp;
  if (r >= rows)
    return;
  Index const h = hq / (query_heads / cache.keys.extents().heads);
  Index const n = cache.clamped_length(b, h), pos = s.q_pos[b * rows + r];
  float const lse = warp_lse(cache, b, h, n, s.q + ((b * query_heads + hq) * rows + r) * d, pos, scale, true);
  if (lane == 0)  // +inf for a row that sees nothing: its exps are then all 0
    s.lse[(b * query_heads + hq) * rows + r] = lse == -CUDART_INF_F ? CUDART_INF_F : lse;
}

/// Grid (slot blocks, Hkv, B): one thread per slot j of KV head h; colsum[b, q, j] for each query head q of h's
/// group, summed over the R rows, written (or added to what is there, with `accumulate`). Padding slots get 0.
/// With ColumnSums::per_window_row: colsum[b, h, i, j] for each window row i, summed over the g query heads in order
/// (the CPU's order: 0 + head 0 + head 1 + ...).
template <class C>
__global__ void window_columns_kernel(C cache, Index query_heads, Index rows, float scale, WindowScratch s,
                                      bool accumulate, ColumnSums by = ColumnSums::per_query_head) {
  KVExtents const e = cache.keys.extents();
  Index const b = blockIdx.z, h = blockIdx.y, g = query_heads / e.heads, d = e.dim;
  Index const n = cache.clamped_length(b, h);
  Index const stride = static_cast<Index>(gridDim.x) * blockDim.x;
  if (by == ColumnSums::per_window_row) {
    float* const head_sums = s.colsum + (b * e.heads + h) * rows * e.tokens;  // [R, N] of this KV head
    for (Index j = static_cast<Index>(blockIdx.x) * blockDim.x + threadIdx.x; j < e.tokens; j += stride) {
      if (j >= n) {
        for (Index r = 0; r < rows; ++r)
          head_sums[r * e.tokens + j] = 0.0f;
        continue;
      }
      Index const pos = cache.position(b, h, j);
      for (Index r = 0; r < rows; ++r) {
        float sum = 0.0f;
        if (pos <= s.q_pos[b * rows + r])
          for (Index lq = 0; lq < g; ++lq) {
            Index const hq = h * g + lq;
            float const* q = s.q + ((b * query_heads + hq) * rows + r) * d;
            sum += expf(slot_logit(cache, b, h, j, q, pos, scale, false) - s.lse[(b * query_heads + hq) * rows + r]);
          }
        float& out = head_sums[r * e.tokens + j];
        out = accumulate ? out + sum : sum;
      }
    }
    return;
  }
  for (Index j = static_cast<Index>(blockIdx.x) * blockDim.x + threadIdx.x; j < e.tokens; j += stride) {
    if (j >= n) {  // padding: zeros, so readers that sum over a longer head (TOVA) stay deterministic
      for (Index lq = 0; lq < g; ++lq)
        s.colsum[(b * query_heads + h * g + lq) * e.tokens + j] = 0.0f;
      continue;
    }
    Index const pos = cache.position(b, h, j);
    for (Index lq = 0; lq < g; ++lq) {
      Index const hq = h * g + lq;
      float sum = 0.0f;
      for (Index r = 0; r < rows; ++r) {
        if (pos > s.q_pos[b * rows + r])
          continue;
        float const* q = s.q + ((b * query_heads + hq) * rows + r) * d;
        sum += expf(slot_logit(cache, b, h, j, q, pos, scale, false) - s.lse[(b * query_heads + hq) * rows + r]);
      }
      float& out = s.colsum[(b * query_heads + hq) * e.tokens + j];
      out = accumulate ? out + sum : sum;
    }
  }
}

/// Enqueues the three kernels for window query rows [first, last) (the scratch holds at least last - first rows):
/// the column sums overwrite `s.colsum`, or are added to it with `accumulate` (callers tile a long query range:
/// H2O's update, ObservedAttention), as the CPU's window_attention_columns; `by` picks their layout (ColumnSums).
template <class WQ, class C>
Status window_attention(Cuda const& cuda, WQ const& wq, C const& cache, Index first, Index last, WindowScratch s,
                        bool accumulate, ColumnSums by = ColumnSums::per_query_head) {
  KVExtents const q = wq.rows.extents(), e = cache.keys.extents();
  Index const rows = last - first;
  if (rows <= 0)
    return {};
  float const scale = 1.0f / sqrtf(static_cast<float>(e.dim));
  KVC_RETURN_IF_ERROR(launch(KVC_CUDA_KERNEL("kvc::score(window attention, Cuda)", window_prepare_kernel),
                             dim3(static_cast<unsigned>(q.heads), static_cast<unsigned>(q.batch)), 128, 0, cuda.stream,
                             wq, cache, first, rows, s));
  KVC_RETURN_IF_ERROR(launch(KVC_CUDA_KERNEL("kvc::score(window attention, Cuda)", window_lse_kernel),
                             dim3(grid_dim((rows + window_lse_warps - 1) / window_lse_warps, 2147483647),
                                  static_cast<unsigned>(q.heads), static_cast<unsigned>(q.batch)),
                             window_lse_warps * warp_size, 0, cuda.stream, cache, q.heads, rows, scale, s));
  KVC_RETURN_IF_ERROR(launch(KVC_CUDA_KERNEL("kvc::score(window attention, Cuda)", window_columns_kernel),
                             dim3(grid_dim((e.tokens + window_threads - 1) / window_threads, 4096),
                                  static_cast<unsigned>(e.heads), static_cast<unsigned>(e.batch)),
                             window_threads, 0, cuda.stream, cache, q.heads, rows, scale, s, accumulate, by));
  return {};
}

/// Host-side checks shared by the window scorers (shapes; positions live on the device and are clamped there).
template <class WQ, class C>
Status check_window(WQ const& wq, C const& cache, Index rows_used, char const* what) {
  KVExtents const q = wq.rows.extents(), k = cache.keys.extents();
  if (q.batch != k.batch || q.dim != k.dim || k.heads <= 0 || q.heads < 1 || q.heads % k.heads != 0 ||
      q.tokens < rows_used || rows_used < 1)
    return {Errc::invalid_argument, what};
  KVC_RETURN_IF_ERROR(
      check_length_table(cache.lengths, k.heads, "kvc::score: per-head lengths must be [batch, KV heads]"));
  if (!wq.rope.empty() && (wq.rope.rotary_dim <= 0 || wq.rope.rotary_dim % 2 != 0 || wq.rope.rotary_dim > q.dim ||
                           wq.rope.positions <= 0 || wq.rope.sin == nullptr))
    return {Errc::invalid_argument, "RopeTable: needs cos, sin, positions > 0 and an even rotary_dim <= head dim"};
  KVC_RETURN_IF_ERROR(head_grid_status(q.batch, q.heads, "kvc::score(Cuda): batch and query heads must be <= 65535"));
  return {};
}

}  // namespace kvc::backend::cuda
