// SPDX-License-Identifier: Apache-2.0
// benchmarks/scorers/expected_attention_bench.cpp mirrors include/kvc/scorers/expected_attention.hpp and its input,
// include/kvc/pipeline/query_statistics.hpp (CPU kernels). Shapes: batch 1, Hq = 32 query heads over Hkv = 8 KV heads
// (g = 4), d = 128, N = 4K / 32K / 128K, fp32 and fp16; plus d = 64 at 4K, the ctest smoke case (its filter matches
// tokens:4096/dim:64, not tokens:4096/dim:128: 4.3 GFLOP take ~1.5 s under ASan at -O1). Both kernels are GEMM-bound;
// FLOP/s counts only their d² products, and next to each an Eigen product of that shape (fp32, one thread) gives the
// bound:
//  - kvc::query_statistics (N pre-RoPE query rows per query head, mean and covariance): the Gram products XᵀX,
//    2 * N * Hq * d² FLOPs. Bound: BM_QueryStatisticsGemm_Eigen, [d x N] x [N x d] per query head, as one product
//    (`untiled`) or in the kernel's 64-row tiles (`tiled`). Plus the decode driver's shape: 256 buffered rows.
//  - ExpectedAttentionScorer (closed-form expected attention of a Gaussian query per query head): the products
//    K Σ̄, 2 * Hq * N * d² FLOPs counted (the row-wise dot with K, K mūᵀ and the softmax, ~2% more, are not).
//    Bound: BM_ExpectedAttentionGemm_Eigen, [N x d] x [d x d] per query head, in the kernel's 128-key tiles
//    (`tiled`) or as one product (`untiled`). bytes/s counts one read of K and V (the memory-bound limit for fp16
//    keys: compare with BM_MemoryRead).
#include <kvc/backend/cpu/pipeline/query_statistics.hpp>
#include <kvc/backend/cpu/scorers/expected_attention.hpp>

#include "bench_support.hpp"

#include <Eigen/Core>
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstddef>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace {

using kvc::Index;
using kvc::bench::query_heads;
using RowMatrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

constexpr Index group = query_heads / kvc::bench::kv_heads;
constexpr Index token_sizes[] = {4096, 32768, 131072};

/// FLOPs of the d² products of either kernel: 2 * Hq * N * d².
double gram_flops(Index tokens, Index dim) {
  return 2.0 * static_cast<double>(query_heads * tokens) * static_cast<double>(dim * dim);
}

/// Pre-RoPE query samples [1, Hq, rows, dim] of T, N(0.3, 1) (seed 11); one shape per type is held (128K rows of
/// fp32 are 2 GiB), as kvc::bench::cache does.
template <class T>
std::vector<T> const& sample_queries(Index rows, Index dim) {
  static std::unique_ptr<std::vector<T>> held;
  static Index held_rows = -1, held_dim = -1;
  if (!held || held_rows != rows || held_dim != dim) {
    held.reset();
    held = std::make_unique<std::vector<T>>(static_cast<std::size_t>(query_heads * rows * dim));
    kvc::tools::Rng rng(11);
    for (T& x : *held)
      x = kvc::from_float<T>(rng.normal() + 0.3f);
    held_rows = rows;
    held_dim = dim;
  }
  return *held;
}

/// kvc::query_statistics over N sample rows per query head (every row but the 4 sinks), mean and covariance
/// (args: tokens = N, dim).
template <class T>
void BM_QueryStatistics_Cpu(benchmark::State& state) {
  Index const rows = state.range(0), head_dim = state.range(1);
  kvc::KVExtents const e{1, query_heads, rows, head_dim};
  kvc::TokenRows<T const, kvc::StridedLayout> const q{sample_queries<T>(rows, head_dim).data(), kvc::bhtd_layout(e)};
  std::vector<float> mean(static_cast<std::size_t>(query_heads * head_dim));
  std::vector<float> cov(static_cast<std::size_t>(query_heads * head_dim * head_dim));
  std::vector<std::byte> ws(kvc::query_statistics_workspace_bytes(kvc::Cpu{}, e));
  kvc::StatisticsRows const sel{4};
  for (auto _ : state) {
    auto const st = kvc::query_statistics(kvc::Cpu{}, q, nullptr, sel, mean.data(), cov.data(), {ws.data(), ws.size()});
    if (!st.ok()) {
      state.SkipWithError(st.message());
      break;
    }
    benchmark::DoNotOptimize(cov.data());
  }
  kvc::bench::report_flops(state, gram_flops(rows, head_dim));
  kvc::bench::report(state, static_cast<double>(e.rows() * head_dim) * sizeof(T), static_cast<double>(rows));
}

/// The Gram products alone: per query head XᵀX of the fp32 samples, [d x N] x [N x d]: one product, or one per
/// 64-row tile added into the result (the kernel's tile, without its centring and fp64 accumulation).
void BM_QueryStatisticsGemm_Eigen(benchmark::State& state, bool tiled) {
  Index const rows = state.range(0), head_dim = state.range(1);
  constexpr Index tile = kvc::Kernel<kvc::QueryStatisticsStep, kvc::Cpu>::tile;
  auto const& x = sample_queries<float>(rows, head_dim);
  RowMatrix gram(head_dim, head_dim);
  for (auto _ : state) {
    for (Index q = 0; q < query_heads; ++q) {
      float const* xq = x.data() + q * rows * head_dim;
      if (tiled) {
        gram.setZero();
        for (Index r0 = 0; r0 < rows; r0 += tile) {
          Eigen::Map<RowMatrix const> const xm(xq + r0 * head_dim, std::min(tile, rows - r0), head_dim);
          gram.noalias() += xm.transpose() * xm;
        }
      } else {
        Eigen::Map<RowMatrix const> const xm(xq, rows, head_dim);
        gram.noalias() = xm.transpose() * xm;
      }
      benchmark::ClobberMemory();
    }
    benchmark::DoNotOptimize(gram.data());
  }
  kvc::bench::report_flops(state, gram_flops(rows, head_dim));
}

/// Statistics of the 32 query heads: mean N(0, 0.3²) per channel, covariance A Aᵀ / d with A N(0, 1) (positive
/// semi-definite, unit-scale diagonal), fp32, generated once per head dim.
struct Statistics {
  std::vector<float> mean, cov;

  explicit Statistics(Index dim)
      : mean(kvc::tools::random_values<float>(query_heads * dim, 12, 0.3f)),
        cov(static_cast<std::size_t>(query_heads * dim * dim)) {
    auto const a = kvc::tools::random_values<float>(dim * dim, 13);
    Eigen::Map<RowMatrix const> const am(a.data(), dim, dim);
    for (Index q = 0; q < query_heads; ++q) {
      Eigen::Map<RowMatrix> cm(cov.data() + q * dim * dim, dim, dim);
      cm.noalias() = am * am.transpose() / static_cast<float>(dim);
    }
  }
  static Statistics const& get(Index dim) {
    static std::map<Index, Statistics> held;
    return held.try_emplace(dim, dim).first->second;
  }
};

/// ExpectedAttention (the paper's defaults: covariance, ||v|| weighting, T = 512 future positions averaged from a
/// Llama 3 RoPE table, 4 sinks) on the cached [1, 8, N, 128] cache of T.
template <class T>
void BM_ExpectedAttention_Cpu(benchmark::State& state) {
  Index const tokens = state.range(0), head_dim = state.range(1);
  auto const& c = kvc::bench::cache<T>(tokens, head_dim);
  auto const& s = Statistics::get(head_dim);
  kvc::ExpectedAttentionScorer const scorer{};
  kvc::bench::OwnedRope const rope(head_dim, tokens + scorer.n_future_positions);  // t0 = N (the next position)
  auto const obs = kvc::observe(
      kvc::QueryStatistics<>{s.mean.data(), s.cov.data(), 1, query_heads, head_dim, rope.table, nullptr, 0});
  std::vector<float> out(static_cast<std::size_t>(c.ext.rows()));
  std::vector<std::byte> ws(kvc::score_workspace_bytes(kvc::Cpu{}, scorer, c.ext, obs));
  kvc::ScoreSpan<> const span{out.data(), c.ext.batch, c.ext.heads, c.ext.tokens};
  for (auto _ : state) {
    auto const st = kvc::score(kvc::Cpu{}, scorer, c.view(), obs, span, {ws.data(), ws.size()});
    if (!st.ok()) {
      state.SkipWithError(st.message());
      break;
    }
    benchmark::DoNotOptimize(out.data());
  }
  kvc::bench::report_flops(state, gram_flops(tokens, head_dim));
  kvc::bench::report(state, 2.0 * static_cast<double>(c.k.size()) * sizeof(T), static_cast<double>(c.ext.rows()));
  state.counters["workspace_bytes"] = static_cast<double>(ws.size());
}

/// K Σ̄ alone: per KV head and each of its g query heads, keys [N x d] (fp32, straight from the cache) times a
/// [d x d] matrix: in the kernel's 128-key tiles, the g products of a tile in turn (`tiled`), or one [N x d] product
/// per query head (`untiled`).
void BM_ExpectedAttentionGemm_Eigen(benchmark::State& state, bool tiled) {
  Index const tokens = state.range(0), head_dim = state.range(1);
  Index const tile = kvc::Kernel<kvc::ExpectedAttentionScorer, kvc::Cpu>::tile_for(head_dim);
  auto const& c = kvc::bench::cache<float>(tokens, head_dim);
  auto const& s = Statistics::get(head_dim);
  std::vector<float> product(static_cast<std::size_t>((tiled ? tile : tokens) * head_dim));
  for (auto _ : state) {
    for (Index h = 0; h < kvc::bench::kv_heads; ++h) {
      float const* keys = c.k.data() + h * tokens * head_dim;
      if (tiled) {
        for (Index t0 = 0; t0 < tokens; t0 += tile) {
          Eigen::Map<RowMatrix const> const km(keys + t0 * head_dim, std::min(tile, tokens - t0), head_dim);
          for (Index lq = 0; lq < group; ++lq) {
            Eigen::Map<RowMatrix const> const sm(s.cov.data() + (h * group + lq) * head_dim * head_dim, head_dim,
                                                 head_dim);
            Eigen::Map<RowMatrix> pm(product.data(), km.rows(), head_dim);
            pm.noalias() = km * sm;
            benchmark::ClobberMemory();
          }
        }
      } else {
        Eigen::Map<RowMatrix const> const km(keys, tokens, head_dim);
        for (Index lq = 0; lq < group; ++lq) {
          Eigen::Map<RowMatrix const> const sm(s.cov.data() + (h * group + lq) * head_dim * head_dim, head_dim,
                                               head_dim);
          Eigen::Map<RowMatrix> pm(product.data(), tokens, head_dim);
          pm.noalias() = km * sm;
          benchmark::ClobberMemory();
        }
      }
    }
    benchmark::DoNotOptimize(product.data());
  }
  kvc::bench::report_flops(state, gram_flops(tokens, head_dim));
}

// ---- Registration: grouped by token count, so each cache is generated once per size ------------------------------

template <class Fn>
void add(std::string const& name, Fn fn, Index tokens, Index dim) {
  benchmark::RegisterBenchmark(name.c_str(), fn)
      ->Unit(benchmark::kMillisecond)
      ->ArgNames({"tokens", "dim"})
      ->Args({tokens, dim});
}

/// The kernels and their products at (tokens, dim): `untiled` products too unless `smoke` (the ctest smoke cases,
/// ~0.5 s each under ASan), the tiled query-statistics product unless `decode_buffer` (256 rows: one tile set).
void add_shape(Index tokens, Index dim, bool smoke, bool decode_buffer) {
  add("BM_QueryStatistics_Cpu/fp32", BM_QueryStatistics_Cpu<float>, tokens, dim);
  add("BM_QueryStatistics_Cpu/fp16", BM_QueryStatistics_Cpu<kvc::half>, tokens, dim);
  if (!smoke)
    add(
        "BM_QueryStatisticsGemm_Eigen/untiled", [](benchmark::State& st) { BM_QueryStatisticsGemm_Eigen(st, false); },
        tokens, dim);
  if (decode_buffer)
    return;
  add(
      "BM_QueryStatisticsGemm_Eigen/tiled", [](benchmark::State& st) { BM_QueryStatisticsGemm_Eigen(st, true); },
      tokens, dim);
  add("BM_ExpectedAttention_Cpu/fp32", BM_ExpectedAttention_Cpu<float>, tokens, dim);
  add("BM_ExpectedAttention_Cpu/fp16", BM_ExpectedAttention_Cpu<kvc::half>, tokens, dim);
  add(
      "BM_ExpectedAttentionGemm_Eigen/tiled", [](benchmark::State& st) { BM_ExpectedAttentionGemm_Eigen(st, true); },
      tokens, dim);
  if (!smoke)
    add(
        "BM_ExpectedAttentionGemm_Eigen/untiled",
        [](benchmark::State& st) { BM_ExpectedAttentionGemm_Eigen(st, false); }, tokens, dim);
}

int register_expected_attention_benchmarks() {
  add_shape(256, kvc::bench::head_dim, false, true);  // the decode driver's buffer (hidden_states_buffer_size)
  add_shape(4096, 64, true, false);                   // the smoke cases
  for (Index tokens : token_sizes)
    add_shape(tokens, kvc::bench::head_dim, false, false);
  return 0;
}

int const registered = register_expected_attention_benchmarks();

}  // namespace
