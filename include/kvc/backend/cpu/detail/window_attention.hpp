// SPDX-License-Identifier: Apache-2.0
// kvc/backend/cpu/detail/window_attention.hpp: the shared window-attention kernel (SnapKV, TOVA; H2O and MomentKV
// next): per query head, the column sums over R window queries of the causal softmax attention over a KV head's
// slots, without ever holding more than one [R x tile] block of the [R x N] attention.
//
// Two passes over the keys, FlashAttention-style recomputation: pass 1 streams key tiles and keeps each query
// row's running max and sum of exponentials (its log-sum-exp); pass 2 recomputes each tile's logits and adds
// exp(logit - lse) into the column sums. Logits come from one Eigen product per tile: all g * R query rows of the
// KV head's group against the tile's keys widened to fp32, so 16-bit keys are widened once per tile and the
// product runs at GEMM speed.
// Also the window scorers' shared epilogue steps: 1-D pooling (pool1d) and kvpress's tail protection.
#pragma once

#include <kvc/backend/cpu/detail/rows.hpp>
#include <kvc/core/kv_view.hpp>
#include <kvc/core/observations.hpp>
#include <kvc/core/scores.hpp>
#include <kvc/core/status.hpp>
#include <kvc/core/workspace.hpp>
#include <kvc/scorers/snap_kv.hpp>  // Pooling, pooled_at (pool1d)

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>

namespace kvc::detail {

/// Keys per tile at most: a [g * R x 128] fp32 logit block stays in L2 for the group sizes and windows in use.
inline constexpr Index window_tile = 128;

/// Floats an operand of one Eigen product may hold so that Eigen packs it on the stack (its limit is 128 KiB):
/// the kernel never allocates, whatever the head dim, window and group size.
inline constexpr Index window_pack_floats = 16384;

/// Keys per tile for head dim d: 128, fewer for d > 128 so the packed key block stays under the stack limit.
constexpr Index window_tile_for(Index dim) noexcept {
  Index const t = window_pack_floats / (dim > 0 ? dim : 1) / 8 * 8;
  return t < 8 ? 8 : (t > window_tile ? window_tile : t);
}

/// Scratch of one worker for `rows` query rows (g heads x R queries) of head dim `dim`.
inline std::size_t window_attention_bytes(Index rows, Index dim) noexcept {
  constexpr auto f = sizeof(float);
  std::size_t const row_floats = workspace_round(bytes_product(rows, f));
  return bytes_sum(workspace_round(bytes_product(rows, dim, f)), workspace_round(bytes_product(window_tile, dim, f)),
                   workspace_round(bytes_product(rows, window_tile, f)), row_floats, row_floats,
                   workspace_round(bytes_product(rows, sizeof(Index))));
}

/// Absolute positions of window query rows [first, first + count) of sequence b (rows of a w-row window).
template <Element T>
Index window_query_position(WindowQueries<T, HostSpace> const& wq, Index b, Index end, Index row) noexcept {
  return wq.positions ? wq.given_position(b, row) : end - wq.window() + row;
}

/// Checks the window queries against the cache: shapes, GQA, positions inside the RoPE table.
template <Element T, class C>
Status check_window_queries(WindowQueries<T, HostSpace> const& wq, C const& cache, Index rows_used, char const* what) {
  KVExtents const q = wq.rows.extents(), k = cache.keys.extents();
  if (q.batch != k.batch || q.dim != k.dim || k.heads <= 0 || q.heads < 1 || q.heads % k.heads != 0 ||
      q.tokens < rows_used || rows_used < 1)
    return {Errc::invalid_argument, what};
  if (wq.rows.data() == nullptr && q.rows() > 0)
    return {Errc::invalid_argument, "window queries: `rows` data is null"};
  for (Index b = 0; b < q.batch; ++b) {
    Index const end = context_end(cache, b);
    for (Index i = q.tokens - rows_used; i < q.tokens; ++i) {
      Index const p = window_query_position(wq, b, end, i);
      if (p < 0)
        return {Errc::invalid_argument, "window queries: a query position is negative (fewer tokens than queries?)"};
      KVC_RETURN_IF_ERROR(check_rope_table(wq.rope, q.dim, p));
    }
  }
  return {};
}

/// How window_attention_columns sums the attention rows of a KV head's group.
enum class ColumnSums : std::uint8_t {
  per_query_head,  ///< colsum row q (local query head): summed over the window rows (SnapKV, TOVA, H2O)
  per_window_row,  ///< colsum row i - first (window row): summed over the g query heads (UNComp's stored rows)
};

/// Column sums for KV head (b, h): for each of its g query heads q (local index 0..g-1) and each valid slot j,
///   colsum[q * stride + j] (+)= sum over window rows i in [first, last) of softmax_j(scale * <rope(query_i), key_j>)
/// where query i sees slot j iff position(j) <= its own position; with ColumnSums::per_window_row, row i - first of
/// colsum sums the same probabilities over q instead. Rows with no visible slot contribute nothing.
/// With `accumulate` the sums are added to colsum's slots [0, n) (callers tile long query ranges: ObservedAttention,
/// H2O's prefill), otherwise they overwrite them. `scratch` has window_attention_bytes(g * (last - first), dim) bytes.
template <Element T, KVCacheView C>
void window_attention_columns(WindowQueries<T, HostSpace> const& wq, C const& cache, Index b, Index h, Index first,
                              Index last, float scale, float* colsum, Index stride, std::byte* scratch, bool accumulate,
                              ColumnSums by = ColumnSums::per_query_head) {
  using RowMatrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  KVExtents const k = cache.keys.extents();
  Index const g = wq.rows.extents().heads / k.heads, per_head = last - first, rows = g * per_head;
  Index const n = cache.length(b, h), d = k.dim;
  constexpr float neg_inf = -std::numeric_limits<float>::infinity();
  WorkspaceCarver carve({scratch, window_attention_bytes(rows, d)});
  float* q = carve.take<float>(rows * d);
  float* tile = carve.take<float>(window_tile * d);
  float* logits = carve.take<float>(rows * window_tile);
  float* peak = carve.take<float>(rows);
  float* total = carve.take<float>(rows);
  Index* q_pos = carve.take<Index>(rows);

  // Queries of the group, widened, rotated to their positions and pre-scaled by 1/sqrt(d) (so the products give
  // logits directly): row r = (local head, window row).
  Index const end = wq.positions ? 0 : context_end(cache, b);
  for (Index lq = 0; lq < g; ++lq)
    for (Index i = 0; i < per_head; ++i) {
      Index const r = lq * per_head + i;
      auto const* src = wq.rows.row(b, h * g + lq, first + i);
      for (Index c = 0; c < d; ++c)
        q[r * d + c] = to_float(src[c]);
      q_pos[r] = window_query_position(wq, b, end, first + i);
      if (!wq.rope.empty())
        wq.rope.rotate(q + r * d, q_pos[r]);
      for (Index c = 0; c < d; ++c)
        q[r * d + c] *= scale;
    }
  Index const earliest = rows > 0 ? *std::min_element(q_pos, q_pos + rows) : 0;
  std::fill(peak, peak + rows, neg_inf);
  std::fill(total, total + rows, 0.0f);
  bool const by_row = by == ColumnSums::per_window_row;
  for (Index o = 0; o < (by_row ? per_head : g) && !accumulate; ++o)
    std::fill(colsum + o * stride, colsum + o * stride + n, 0.0f);

  using Row = Eigen::Map<Eigen::ArrayXf>;
  Index const tile_cols = window_tile_for(d);
  Index const row_chunk = std::max<Index>(1, window_pack_floats / std::max<Index>(d, 1));  // query rows per product
  Index pos[window_tile];
  // logits[r, c] for slots t0 + c; returns whether some slot of the tile is masked for some row. Positions ascend,
  // so a tile ending at or before the earliest query is visible to every row and skips the mask entirely. A NaN or
  // Inf logit (a non-finite key) is masked too: the slot gets probability 0 and the row's softmax runs over its
  // finite slots, so one bad token cannot turn every probability of the head into NaN.
  auto tile_logits = [&](Index t0, Index cols) {
    for (Index c = 0; c < cols; ++c) {  // widened copy even for fp32: measured faster than mapping rows in place
      widen(cache.keys.row(b, h, t0 + c), tile + c * d, d, cache.keys.scale(b, h));
    }
    Eigen::Map<RowMatrix const> const km(tile, cols, d);
    for (Index r0 = 0; r0 < rows; r0 += row_chunk) {  // both packed operands fit Eigen's stack buffers
      Index const rc = std::min(row_chunk, rows - r0);
      Eigen::Map<RowMatrix const> const qm(q + r0 * d, rc, d);
      Eigen::Map<RowMatrix, 0, Eigen::OuterStride<>> lm(logits + r0 * window_tile, rc, cols,
                                                        Eigen::OuterStride<>(window_tile));
      lm.noalias() = qm * km.transpose();
    }
    unsigned bad = 0;
    for (Index r = 0; r < rows; ++r)  // |x| <= FLT_MAX is false for NaN and +-Inf; row-major: vectorises
      for (Index c = 0; c < cols; ++c) {
        float& x = logits[r * window_tile + c];
        bool const finite = std::abs(x) <= std::numeric_limits<float>::max();
        bad |= finite ? 0u : 1u;
        x = finite ? x : neg_inf;
      }
    if (cache.position(b, h, t0 + cols - 1) <= earliest)
      return bad != 0;
    for (Index c = 0; c < cols; ++c)
      pos[c] = cache.position(b, h, t0 + c);
    for (Index r = 0; r < rows; ++r)  // row-major: the inner loop vectorises
      for (Index c = 0; c < cols; ++c)
        logits[r * window_tile + c] = pos[c] <= q_pos[r] ? logits[r * window_tile + c] : neg_inf;
    return true;
  };
  // Eigen's vectorised exp gives ~1e-39, not 0, for -inf - m: masked entries are selected to 0 explicitly.
  for (Index t0 = 0; t0 < n; t0 += tile_cols) {  // pass 1: running max and sum of exponentials per row
    Index const cols = std::min(tile_cols, n - t0);
    bool const masked = tile_logits(t0, cols);
    for (Index r = 0; r < rows; ++r) {
      Row const l(logits + r * window_tile, cols);
      float const m = std::max(peak[r], l.maxCoeff());
      if (m == neg_inf)
        continue;
      float const sum = masked ? (l == neg_inf).select(0.0f, (l - m).exp()).sum() : (l - m).exp().sum();
      total[r] = total[r] * std::exp(peak[r] - m) + sum;  // exp(-inf) = 0 on the first visible tile
      peak[r] = m;
    }
  }
  for (Index r = 0; r < rows; ++r)  // lse, or +inf for a row that sees nothing
    peak[r] = peak[r] == neg_inf ? std::numeric_limits<float>::infinity() : peak[r] + std::log(total[r]);
  for (Index t0 = 0; t0 < n; t0 += tile_cols) {  // pass 2: probabilities into the column sums
    Index const cols = std::min(tile_cols, n - t0);
    bool const masked = tile_logits(t0, cols);
    for (Index r = 0; r < rows; ++r) {
      if (peak[r] == std::numeric_limits<float>::infinity())
        continue;  // the row sees nothing
      Row const l(logits + r * window_tile, cols);
      Row out(colsum + (by_row ? r % per_head : r / per_head) * stride + t0, cols);
      if (masked)
        out += (l == neg_inf).select(0.0f, (l - peak[r]).exp());
      else
        out += (l - peak[r]).exp();
    }
  }
}

/// The rows [first, w) of the window, overwriting colsum (SnapKV's and TOVA's use).
template <Element T, KVCacheView C>
void window_attention_columns(WindowQueries<T, HostSpace> const& wq, C const& cache, Index b, Index h, Index first,
                              float scale, float* colsum, Index stride, std::byte* scratch) {
  window_attention_columns(wq, cache, b, h, first, wq.window(), scale, colsum, stride, scratch, false);
}

/// 1-D pooling of x[0, m) into out[0, m) (out != x): kvc::pooled_at of every slot.
inline void pool1d(float const* x, Index m, Index k, Pooling pooling, float* out) noexcept {
  for (Index j = 0; j < m; ++j)
    out[j] = pooled_at(pooling, k, m, j, [x](Index t) { return x[t]; });
}

/// Slots [from, n) of a head get kvc::protected_score over score[0, from).
inline void protect_tail(float* score, Index from, Index n) noexcept {
  float const top = protected_score(from > 0 ? *std::max_element(score, score + from) : 0.0f, from);
  std::fill(score + from, score + n, top);
}

}  // namespace kvc::detail
