// SPDX-License-Identifier: Apache-2.0
// benchmarks/bench_support.hpp: shared inputs for the benchmarks. One cache is kept alive between benchmarks with
// the same shape and type, so 512 MiB inputs are generated once per shape, not once per benchmark. Also the pieces
// the window-attention benchmarks share (SnapKV, TOVA, H2O, ObservedAttention): their queries, RoPE table, FLOP
// counts and the Eigen product they are compared with.
#pragma once

#include <kvc/backend/cpu/detail/window_attention.hpp>
#include <kvc/core/element.hpp>
#include <kvc/core/kv_view.hpp>
#include <kvc/core/rope.hpp>
#include <kvc/core/scorer.hpp>

#include "common/synthetic.hpp"

#include <Eigen/Core>
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

namespace kvc::bench {

inline constexpr Index kv_heads = 8;
/// The query side of the shapes: Hq = 32 query heads over the 8 KV heads (g = 4), head dim 128.
inline constexpr Index query_heads = 32, head_dim = 128;

/// The tokens x head_dim grid of the issue: 4K / 32K / 128K tokens, head_dim 64 / 128.
inline void token_dim_grid(benchmark::internal::Benchmark* b) {
  b->ArgNames({"tokens", "dim"})->ArgsProduct({{4096, 32768, 131072}, {64, 128}})->Unit(benchmark::kMillisecond);
}

/// A [1, 8, tokens, dim] host cache of T with N(0.3, 1) keys and N(0, 1) values, cached across benchmarks. fp8
/// caches hold them under one scale of 1 per tensor: every element is still multiplied by it (the scale is a runtime
/// value), so the timing is that of any calibrated scale.
template <class T>
tools::HostCache<T> const& cache(Index tokens, Index dim) {
  static std::unique_ptr<tools::HostCache<T>> held;
  KVExtents const e{1, kv_heads, tokens, dim};
  if (!held || held->ext != e) {
    held.reset();  // free the previous shape first: the largest is 512 MiB per tensor
    held = std::make_unique<tools::HostCache<T>>(e);
    tools::Rng rng(42);
    for (T& x : held->k)
      x = from_float<T>(rng.normal() + 0.3f);
    for (T& x : held->v)
      x = from_float<T>(rng.normal());
  }
  return *held;
}

/// Reports bytes/s (of `bytes` read per iteration) and tokens/s.
inline void report(benchmark::State& state, double bytes, double tokens) {
  state.SetBytesProcessed(static_cast<std::int64_t>(bytes) * state.iterations());
  state.counters["tokens/s"] = benchmark::Counter(tokens, benchmark::Counter::kIsIterationInvariantRate);
}

/// Scores the cached [1, 8, tokens, dim] cache of T with `scorer` on the CPU (args: tokens, dim). bytes/s counts
/// one read of K when the scorer reads keys (what it must at least read: compare with BM_MemoryRead), else the
/// fp32 scores it writes. `cpu` is serial by default, or a kvc::ThreadPool's.
template <class T, class S>
void score_cpu(benchmark::State& state, S scorer, Cpu const& cpu = Cpu{}) {
  auto const& c = cache<T>(state.range(0), state.range(1));
  std::vector<float> out(static_cast<std::size_t>(c.ext.rows()));
  std::vector<std::byte> ws(score_workspace_bytes(cpu, scorer, c.ext));
  ScoreSpan<> span{out.data(), c.ext.batch, c.ext.heads, c.ext.tokens};
  for (auto _ : state) {
    auto const st = score(cpu, scorer, c.view(), span, {ws.data(), ws.size()});
    benchmark::DoNotOptimize(st);
    benchmark::DoNotOptimize(out.data());
  }
  bool const reads_keys = has_need(S::needs, Needs::keys);
  report(state, static_cast<double>(reads_keys ? c.k.size() * sizeof(T) : out.size() * sizeof(float)),
         static_cast<double>(c.ext.rows()));
}

/// Registers `<name>/fp32`, `<name>/fp16` and, with `fp8`, `<name>/fp8_e4m3` and `<name>/fp8_e5m2` scoring benchmarks
/// over the token x dim grid.
template <class S>
int register_scorer(std::string const& name, S scorer, bool fp8 = false) {
  benchmark::RegisterBenchmark((name + "/fp32").c_str(), [scorer](benchmark::State& st) {
    score_cpu<float>(st, scorer);
  })->Apply(token_dim_grid);
  benchmark::RegisterBenchmark((name + "/fp16").c_str(), [scorer](benchmark::State& st) {
    score_cpu<half>(st, scorer);
  })->Apply(token_dim_grid);
  if (fp8) {
    benchmark::RegisterBenchmark((name + "/fp8_e4m3").c_str(), [scorer](benchmark::State& st) {
      score_cpu<float8_e4m3>(st, scorer);
    })->Apply(token_dim_grid);
    benchmark::RegisterBenchmark((name + "/fp8_e5m2").c_str(), [scorer](benchmark::State& st) {
      score_cpu<float8_e5m2>(st, scorer);
    })->Apply(token_dim_grid);
  }
  return 0;
}

/// Reports `flops` per iteration as the `FLOP/s` counter.
inline void report_flops(benchmark::State& state, double flops) {
  state.counters["FLOP/s"] = benchmark::Counter(flops, benchmark::Counter::kIsIterationInvariantRate);
}

/// FLOPs of window attention's two passes over the [g*R x N] logit product of every KV head: R query rows per
/// query head over `tokens` slots, 4 * Hq * R * N * d (exponentials, mask and epilogue not counted).
constexpr double window_attention_flops(Index heads, Index rows, Index tokens, Index dim) {
  return 4.0 * static_cast<double>(heads) * static_cast<double>(rows) * static_cast<double>(tokens) *
         static_cast<double>(dim);
}

/// Window queries [1, heads, rows, dim] fp32, N(0, 1) (seed 7), cached per shape for the life of the binary
/// (the g query heads of KV head h are contiguous: rows [h*g*R, (h+1)*g*R) of d floats).
inline std::vector<float> const& window_queries(Index heads, Index rows, Index dim) {
  static std::map<std::tuple<Index, Index, Index>, std::vector<float>> held;
  auto& q = held[{heads, rows, dim}];
  if (q.empty()) {
    q.resize(static_cast<std::size_t>(heads * rows * dim));
    tools::Rng rng(7);
    for (float& x : q)
      x = rng.normal();
  }
  return q;
}

/// The same queries as a [1, heads, rows, dim] row view (kvc::WindowQueries' `rows`).
inline TokenRows<float const, StridedLayout> window_query_rows(Index heads, Index rows, Index dim) {
  return {window_queries(heads, rows, dim).data(), bhtd_layout(KVExtents{1, heads, rows, dim})};
}

/// A host RoPE table for positions [0, positions) (Llama 3's theta, 500000) with its storage.
struct OwnedRope {
  std::vector<float> storage;
  RopeTable<> table{};

  OwnedRope(Index dim, Index positions) : storage(static_cast<std::size_t>(rope_table_floats(positions, dim))) {
    if (!fill_rope_table(RopeSpec{500000.0}, dim, positions, storage.data(), table).ok())
      table = {};
  }
};

/// Times one fp32 Eigen product per KV head of window attention's logit shape: the `group_rows` (g*R) queries of
/// the head's group in `queries` ([Hkv, g*R, d], contiguous) times the head's keys^T [d x N], straight from the
/// fp32 cache `c` (contiguous BHTD rows, no copy). Tiled: [row_block x 128] products over blocks of `row_block`
/// query rows and the kernel's 128-key tiles (row_block = g*R for SnapKV and TOVA, the scorer's query tile for
/// H2O's and ObservedAttention's long windows); untiled: one [g*R x N] product. Reports 2 * Hkv * g*R * N * d FLOPs.
inline void window_gemm(benchmark::State& state, std::vector<float> const& queries, Index group_rows, Index row_block,
                        tools::HostCache<float> const& c, bool tiled) {
  using RowMatrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  constexpr Index tile = detail::window_tile;
  Index const tokens = c.ext.tokens, dim = c.ext.dim, heads = c.ext.heads;
  std::vector<float> logits(static_cast<std::size_t>(tiled ? row_block * tile : group_rows * tokens));
  for (auto _ : state) {
    for (Index h = 0; h < heads; ++h) {
      float const* keys = c.k.data() + h * tokens * dim;
      if (tiled) {
        for (Index r0 = 0; r0 < group_rows; r0 += row_block) {
          Index const rows = std::min(row_block, group_rows - r0);
          Eigen::Map<RowMatrix const> const qm(queries.data() + (h * group_rows + r0) * dim, rows, dim);
          for (Index t0 = 0; t0 < tokens; t0 += tile) {
            Index const cols = std::min(tile, tokens - t0);
            Eigen::Map<RowMatrix const> const km(keys + t0 * dim, cols, dim);
            Eigen::Map<RowMatrix, 0, Eigen::OuterStride<>> lm(logits.data(), rows, cols, Eigen::OuterStride<>(tile));
            lm.noalias() = qm * km.transpose();
            benchmark::ClobberMemory();
          }
        }
      } else {
        Eigen::Map<RowMatrix const> const qm(queries.data() + h * group_rows * dim, group_rows, dim);
        Eigen::Map<RowMatrix const> const km(keys, tokens, dim);
        Eigen::Map<RowMatrix> lm(logits.data(), group_rows, tokens);
        lm.noalias() = qm * km.transpose();
        benchmark::ClobberMemory();
      }
    }
    benchmark::DoNotOptimize(logits.data());
  }
  report_flops(state, window_attention_flops(heads, group_rows, tokens, dim) / 2);
}

}  // namespace kvc::bench
