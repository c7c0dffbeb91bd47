// SPDX-License-Identifier: Apache-2.0
// benchmarks/scorers/uncomp_bench.cpp mirrors include/kvc/scorers/uncomp.hpp: UNComp's kvc::update (the attention of
// R new query rows written into the per-slot window rows: R = 1 per decode step, R = w = 8 at prefill) and kvc::score
// (the pooled sum of the w rows), over the shared window attention of include/kvc/backend/cpu/detail/
// window_attention.hpp. Shapes: batch 1, Hq = 32 query heads over Hkv = 8 KV heads (g = 4), d = 128, w = 8, fp32
// post-RoPE queries, fp32 and fp16 caches.
//
// Bounds, from the same binary: the update's two passes over K are the limit for R = 1 (bytes/s counts both reads,
// as BM_H2O_Update_Cpu does; compare with BM_MemoryRead) and its logits are the product of BM_WindowGemm_Eigen/tiled
// (snap_kv_bench.cpp; FLOP/s counts 4 * Hq * R * N * d, the kernel's two passes); the score reads the window rows
// ([8, N, 8] fp32) once: bytes/s against BM_MemoryRead.
#include <kvc/backend/cpu/scorers/uncomp.hpp>

#include "bench_support.hpp"

#include <benchmark/benchmark.h>

#include <cstddef>
#include <string>
#include <vector>

namespace {

using kvc::Index;
using kvc::bench::head_dim;
using kvc::bench::query_heads;

constexpr Index token_sizes[] = {4096, 32768, 131072};
constexpr Index window = 8;

/// A state tracking every slot of the cached [1, 8, N, 128] cache.
struct State {
  std::vector<float> rows;
  std::vector<Index> tracked;
  kvc::UNCompScorer<> scorer{};
  explicit State(kvc::KVExtents e)
      : rows(static_cast<std::size_t>(e.rows() * window), 0.01f),
        tracked(static_cast<std::size_t>(e.batch * e.heads), e.tokens) {
    scorer.state = {{rows.data(), kvc::uncomp_window_layout(e, window)}, tracked.data()};
    scorer.window_size = window;
  }
};

/// kvc::update(UNCompScorer): R new post-RoPE query rows at the last R positions (args: rows, tokens).
template <class T>
void BM_UNComp_Update_Cpu(benchmark::State& state) {
  Index const rows = state.range(0), tokens = state.range(1);
  auto const& c = kvc::bench::cache<T>(tokens, head_dim);
  State s(c.ext);
  auto const obs = kvc::observe(kvc::WindowQueries<float>{kvc::bench::window_query_rows(query_heads, rows, head_dim)});
  std::vector<std::byte> ws(kvc::update_workspace_bytes(kvc::Cpu{}, s.scorer, c.ext, obs));
  for (auto _ : state) {
    auto const st = kvc::update(kvc::Cpu{}, s.scorer, c.view(), obs, {ws.data(), ws.size()});
    if (!st.ok()) {
      state.SkipWithError(st.message());
      break;
    }
    benchmark::DoNotOptimize(s.rows.data());
  }
  kvc::bench::report_flops(state, kvc::bench::window_attention_flops(query_heads, rows, tokens, head_dim));
  kvc::bench::report(state, 2.0 * static_cast<double>(c.k.size() * sizeof(T)), static_cast<double>(rows));
}

/// kvc::score(UNCompScorer) over a full state (args: tokens): bytes/s counts the window rows read once.
void BM_UNComp_Score_Cpu(benchmark::State& state) {
  Index const tokens = state.range(0);
  auto const& c = kvc::bench::cache<float>(tokens, head_dim);
  State s(c.ext);
  std::vector<float> out(static_cast<std::size_t>(c.ext.rows()));
  kvc::ScoreSpan<> const span{out.data(), c.ext.batch, c.ext.heads, c.ext.tokens};
  std::vector<std::byte> ws(kvc::score_workspace_bytes(kvc::Cpu{}, s.scorer, c.ext, kvc::NoObservations{}));
  for (auto _ : state) {
    auto const st = kvc::score(kvc::Cpu{}, s.scorer, c.view(), span, {ws.data(), ws.size()});
    if (!st.ok()) {
      state.SkipWithError(st.message());
      break;
    }
    benchmark::DoNotOptimize(out.data());
  }
  kvc::bench::report(state, static_cast<double>(s.rows.size() * sizeof(float)), static_cast<double>(tokens));
}

int register_uncomp_benchmarks() {
  for (Index tokens : token_sizes) {
    for (Index rows : {Index{1}, window}) {
      benchmark::RegisterBenchmark("BM_UNComp_Update_Cpu/fp32", BM_UNComp_Update_Cpu<float>)
          ->Unit(benchmark::kMillisecond)
          ->ArgNames({"rows", "tokens"})
          ->Args({rows, tokens});
      benchmark::RegisterBenchmark("BM_UNComp_Update_Cpu/fp16", BM_UNComp_Update_Cpu<kvc::half>)
          ->Unit(benchmark::kMillisecond)
          ->ArgNames({"rows", "tokens"})
          ->Args({rows, tokens});
    }
    // The prefill update's product bound (the decode step's, window:1, is registered by snap_kv_bench.cpp).
    benchmark::RegisterBenchmark("BM_WindowGemm_Eigen/tiled",
                                 [](benchmark::State& st) {
                                   Index const group = query_heads / kvc::bench::kv_heads, rows = group * st.range(0);
                                   kvc::bench::window_gemm(
                                       st, kvc::bench::window_queries(query_heads, st.range(0), head_dim), rows, rows,
                                       kvc::bench::cache<float>(st.range(1), head_dim), true);
                                 })
        ->Unit(benchmark::kMillisecond)
        ->ArgNames({"window", "tokens"})
        ->Args({window, tokens});
    benchmark::RegisterBenchmark("BM_UNComp_Score_Cpu", BM_UNComp_Score_Cpu)
        ->Unit(benchmark::kMillisecond)
        ->ArgNames({"tokens"})
        ->Args({tokens});
  }
  return 0;
}

int const registered = register_uncomp_benchmarks();

}  // namespace
