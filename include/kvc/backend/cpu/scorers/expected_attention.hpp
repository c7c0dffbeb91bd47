// SPDX-License-Identifier: Apache-2.0
// kvc/backend/cpu/scorers/expected_attention.hpp: CPU kernel of ExpectedAttentionScorer.
#pragma once

#include <kvc/backend/cpu/detail/for_each_head.hpp>
#include <kvc/backend/cpu/detail/rows.hpp>
#include <kvc/backend/cpu/detail/widen.hpp>
#include <kvc/core/norm_range.hpp>
#include <kvc/scorers/expected_attention.hpp>

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>

namespace kvc {

namespace detail {

/// R̄ = (1/T) sum_{p in [t0, t0 + T)} R_p as one scaled rotation per RoPE pair: c̄[i] = mean cos, s̄[i] = mean sin
/// of the table's rows (summed in fp64), so any variant the table holds (NeoX or interleaved pairs, scaled
/// frequencies, attention scaling) is averaged as it is applied. Channels past rotary_dim are left as they are.
struct FutureRope {
  float const* c = nullptr;  ///< [rotary_dim / 2]
  float const* s = nullptr;  ///< [rotary_dim / 2]
  Index half = 0;            ///< 0: no RoPE, R̄ = I
  RopeStyle style = RopeStyle::neox;

  static void average(RopeTable<HostSpace> const& t, Index t0, Index count, float* c, float* s) noexcept {
    Index const half = t.rotary_dim / 2;
    for (Index i = 0; i < half; ++i) {
      double sc = 0.0, ss = 0.0;
      for (Index p = t0; p < t0 + count; ++p) {
        sc += double{t.cos[p * half + i]};
        ss += double{t.sin[p * half + i]};
      }
      c[i] = static_cast<float>(sc / static_cast<double>(count));
      s[i] = static_cast<float>(ss / static_cast<double>(count));
    }
  }
  /// x <- R̄ x for the d-vector x[0], x[stride], ... (a row of a matrix, or a column with stride d).
  void apply(float* x, Index stride) const noexcept {
    for (Index i = 0; i < half; ++i) {
      Index const a = (style == RopeStyle::neox ? i : 2 * i) * stride;
      Index const b = (style == RopeStyle::neox ? i + half : 2 * i + 1) * stride;
      float const xa = x[a], xb = x[b];
      x[a] = c[i] * xa - s[i] * xb;
      x[b] = s[i] * xa + c[i] * xb;
    }
  }
};

}  // namespace detail

/// Per KV head: the group's mū and Σ̄ (R̄ applied to mu, and to Sigma's columns then rows), then one streaming pass
/// over the keys in tiles: λ for all g query heads from Eigen products (K mūᵀ, and K Σ̄ in column blocks whose
/// row-wise dot with K gives kᵀΣ̄k, so the d² work runs at GEMM speed), stored per slot; then the softmax over
/// the non-sink slots, the group reduction and the value-norm weighting. Sinks get the global max + 1 at the end.
/// fp32 throughout (the logits are formed in fp32 from fp32 statistics; docs/policies/expected_attention.md, A13).
template <>
struct Kernel<ExpectedAttentionScorer, Cpu> {
  static constexpr Index pack_floats = 16384;  ///< operands of one Eigen product stay on its stack (see window)

  static constexpr Index tile_for(Index d) noexcept {
    Index const t = pack_floats / (d > 0 ? d : 1) / 8 * 8;
    return t < 8 ? 8 : (t > 128 ? 128 : t);
  }
  static std::size_t worker_bytes(KVExtents const& keys, Index query_heads) {
    Index const g = keys.heads > 0 ? std::max<Index>(1, query_heads / keys.heads) : 1, d = keys.dim;
    Index const t = tile_for(d), cc = std::max<Index>(1, std::min(d, pack_floats / std::max<Index>(d, 1)));
    auto f = [](auto... n) { return workspace_round(bytes_product(n..., sizeof(float))); };
    return bytes_sum(f(2, d), f(g, d), f(g, d, d), f(t, d), f(t, cc), f(t, g), f(g, keys.tokens));
  }
  template <class Obs>
  static std::size_t workspace_bytes(Cpu const& cpu, ExpectedAttentionScorer const&, KVExtents const& keys,
                                     Obs const& obs) {
    Index query_heads = keys.heads;
    if constexpr (HasQueryStatistics<Obs>)
      query_heads = obs.query_statistics.heads;
    return bytes_product(cpu.workers(), worker_bytes(keys, query_heads));
  }

  template <KVCacheView C, class Obs>
  static Status run(Cpu const& cpu, ExpectedAttentionScorer const& s, C const& cache, Obs const& obs,
                    ScoreSpan<HostSpace> out, Workspace ws) {
    using RowMatrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
    using Strided = Eigen::Map<RowMatrix const, 0, Eigen::OuterStride<>>;
    KVC_RETURN_IF_ERROR(s.check());
    auto const& st = obs.query_statistics;
    KVExtents const e = cache.keys.extents();
    Index const d = e.dim, dv = cache.values.extents().dim;
    if (st.batch != e.batch || st.dim != d || e.heads <= 0 || st.heads < 1 || st.heads % e.heads != 0)
      return {Errc::invalid_argument,
              "kvc::score(expected_attention): query statistics must be [batch, Hq, d_k] with Hq a multiple of Hkv"};
    if (st.mean == nullptr || (s.use_covariance && st.covariance == nullptr))
      return {Errc::invalid_argument,
              "kvc::score(expected_attention): statistics need `mean`, and `covariance` unless use_covariance=false"};
    KVC_RETURN_IF_ERROR(detail::check_lengths(cache.lengths, e.batch, e.heads, e.tokens,
                                              "kvc::score: every valid length must be in [0, tokens]"));
    // t0 per sequence, and the table must hold positions [t0, t0 + T).
    auto first_future = [&](Index b) {
      if (s.reference == Reference::kvpress && st.observed > 0)
        return st.observed;
      return st.next_position ? st.next_position[b] : context_end(cache, b);
    };
    if (!st.rope.empty())
      for (Index b = 0; b < e.batch; ++b) {
        Index const t0 = first_future(b);
        if (t0 < 0)
          return {Errc::invalid_argument, "kvc::score(expected_attention): the next position must be >= 0"};
        Index last = 0;
        if (__builtin_add_overflow(t0, s.n_future_positions - 1, &last))
          return {Errc::invalid_argument, "kvc::score(expected_attention): t0 + n_future_positions overflows"};
        KVC_RETURN_IF_ERROR(check_rope_table(st.rope, d, last));
      }
    Index const g = st.heads / e.heads, t = tile_for(d);
    Index const cc = std::max<Index>(1, std::min(d, pack_floats / std::max<Index>(d, 1)));
    std::size_t const per_worker = worker_bytes(e, st.heads);
    auto* base = WorkspaceCarver(ws).take<std::byte>(static_cast<Index>(workspace_bytes(cpu, s, e, obs)));
    if (base == nullptr)
      return {Errc::out_of_capacity, "kvc::score(expected_attention): workspace smaller than score_workspace_bytes()"};
    float const scale = s.scale > 0.0f ? s.scale : 1.0f / std::sqrt(static_cast<float>(d));
    float const half_scale_sq = 0.5f * scale * scale;
    constexpr float neg_inf = -std::numeric_limits<float>::infinity();

    KVC_RETURN_IF_ERROR(detail::for_each_head(cpu, out, [&](Index b, Index h, Index n, float* score, Index worker) {
      WorkspaceCarver carve({base + static_cast<std::size_t>(worker) * per_worker, per_worker});
      float* rope_c = carve.take<float>(d);
      float* rope_s = rope_c + d / 2;
      float* mu = carve.take<float>(g * d);
      float* sig = carve.take<float>(g * d * d);
      float* ktile = carve.take<float>(t * d);
      float* ptile = carve.take<float>(t * cc);
      float* lin = carve.take<float>(t * g);
      float* logits = carve.take<float>(g * e.tokens);

      detail::FutureRope rbar{rope_c, rope_s, 0, st.rope.style};
      if (!st.rope.empty()) {
        rbar.half = st.rope.rotary_dim / 2;
        detail::FutureRope::average(st.rope, first_future(b), s.n_future_positions, rope_c, rope_s);
      }
      for (Index lq = 0; lq < g; ++lq) {  // mū = R̄ mu; Σ̄ = R̄ Sigma R̄ᵀ (columns, then rows)
        Index const q = h * g + lq;
        std::copy_n(st.mean + (b * st.heads + q) * d, d, mu + lq * d);
        rbar.apply(mu + lq * d, 1);
        if (!s.use_covariance)
          continue;
        float* sg = sig + lq * d * d;
        std::copy_n(st.covariance + (b * st.heads + q) * d * d, d * d, sg);
        for (Index c = 0; c < d; ++c)
          rbar.apply(sg + c, d);
        for (Index r = 0; r < d; ++r)
          rbar.apply(sg + r * d, 1);
      }

      Eigen::Map<RowMatrix const> const mum(mu, g, d);
      for (Index t0 = 0; t0 < n; t0 += t) {  // λ[lq, j] for the tile's keys
        Index const cols = std::min(t, n - t0);
        for (Index c = 0; c < cols; ++c)
          detail::widen(cache.keys.row(b, h, t0 + c), ktile + c * d, d, cache.keys.scale(b, h));
        Eigen::Map<RowMatrix const> const km(ktile, cols, d);
        Eigen::Map<RowMatrix> lm(lin, cols, g);
        lm.noalias() = km * mum.transpose();
        for (Index lq = 0; lq < g; ++lq) {
          float* lg = logits + lq * e.tokens + t0;
          for (Index c = 0; c < cols; ++c)
            lg[c] = scale * lin[c * g + lq];
          if (!s.use_covariance)
            continue;
          for (Index c0 = 0; c0 < d; c0 += cc) {  // kᵀΣ̄k = rowsum((K Σ̄) ⊙ K), Σ̄ in column blocks
            Index const w = std::min(cc, d - c0);
            Strided const sm(sig + lq * d * d + c0, d, w, Eigen::OuterStride<>(d));
            Eigen::Map<RowMatrix> pm(ptile, cols, w);
            pm.noalias() = km * sm;
            for (Index c = 0; c < cols; ++c) {
              float quad = 0.0f;
              for (Index k = 0; k < w; ++k)
                quad += ptile[c * w + k] * ktile[c * d + c0 + k];
              lg[c] += half_scale_sq * quad;
            }
          }
        }
      }

      Index const sink_end = std::min(s.n_sink, n), from = s.normalize_sinks ? 0 : sink_end;
      std::fill(score, score + n, 0.0f);
      for (Index lq = 0; lq < g; ++lq) {  // softmax over slots [from, n), then the group reduction
        float* lg = logits + lq * e.tokens;
        float peak = neg_inf;
        for (Index j = from; j < n; ++j) {  // a NaN or Inf logit (a non-finite key) gets probability 0
          lg[j] = detail::finite_logit(lg[j]);
          peak = std::max(peak, lg[j]);
        }
        float total = 0.0f;
        for (Index j = from; j < n; ++j) {
          lg[j] = lg[j] == neg_inf ? 0.0f : std::exp(lg[j] - peak);
          total += lg[j];
        }
        float const inv = total > 0.0f ? 1.0f / total : 0.0f;
        for (Index j = sink_end; j < n; ++j) {
          float const p = lg[j] * inv;
          score[j] = gqa_combine(s.gqa, lq, score[j], p);
        }
      }
      for (Index j = sink_end; j < n; ++j)  // the formula both backends share (scorers/expected_attention.hpp)
        score[j] = expected_attention_score(
            s, g, score[j],
            s.use_vnorm ? std::sqrt(detail::sum_squares(cache.values.row(b, h, j), dv, cache.values.scale(b, h)))
                        : 0.0f);
      std::fill(score, score + sink_end, neg_inf);  // set below, once every head is scored
    }));

    // Sinks: the global max over (b, h) and non-sink slots, plus 1 (kvpress; 0 + 1 when nothing else is scored).
    float top = neg_inf;
    for (Index b = 0; b < e.batch; ++b)
      for (Index h = 0; h < e.heads; ++h) {
        Index const n = cache.length(b, h);
        float const* row = out.row(b, h);
        for (Index j = std::min(s.n_sink, n); j < n; ++j)
          top = row[j] > top ? row[j] : top;  // NaN never wins
      }
    float const sink_score = expected_attention_sink_score(top);
    for (Index b = 0; b < e.batch; ++b)
      for (Index h = 0; h < e.heads; ++h)
        std::fill(out.row(b, h), out.row(b, h) + std::min(s.n_sink, cache.length(b, h)), sink_score);
    return {};
  }
};

}  // namespace kvc
