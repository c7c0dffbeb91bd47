// SPDX-License-Identifier: Apache-2.0
// benchmarks/scorers/snap_kv_bench.cpp mirrors include/kvc/scorers/snap_kv.hpp and tova.hpp, whose CPU kernels
// share the window attention of include/kvc/backend/cpu/detail/window_attention.hpp. Shapes: batch 1, Hq = 32 query
// heads over Hkv = 8 KV heads (g = 4), d = 128, fp32 post-RoPE queries (one pre-RoPE case with a RoPE table).
//
// FLOP/s counts the multiply-adds the kernel performs: two passes of the [g*R x N] logit product per KV head,
// 2 * g*R * N * d each, so 4 * Hq * R * N * d in all (R = w window rows for SnapKV, R = 1 for TOVA, which reads
// only the newest query); the exponentials, the mask and the scorer's epilogue are not counted. Next to each
// kernel, BM_WindowGemm_Eigen runs one Eigen product of the same shape ([g*R x d] x [d x N] fp32 per KV head,
// 2 * Hq * R * N * d FLOPs), tiled over N in the kernel's 128-column blocks and untiled: the project's goal is the
// kernel's FLOP/s at >= half of the tiled product's on one thread (docs/benchmarks.md).
#include <kvc/backend/cpu/scorers/snap_kv.hpp>
#include <kvc/backend/cpu/scorers/tova.hpp>
#include <kvc/backend/cpu/thread_pool.hpp>

#include "bench_support.hpp"

#include <benchmark/benchmark.h>

#include <cstddef>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

namespace {

using kvc::Index;
using kvc::bench::head_dim;
using kvc::bench::query_heads;

constexpr Index group = query_heads / kvc::bench::kv_heads;
constexpr Index token_sizes[] = {4096, 32768, 131072};

/// FLOPs of the kernel's two logit products (R query rows per query head over `tokens` slots).
double kernel_flops(Index rows, Index tokens) {
  return kvc::bench::window_attention_flops(query_heads, rows, tokens, head_dim);
}

/// SnapKV (authors' reference, window w, max pooling 7) or TOVA on the cached [1, 8, N, 128] cache of T. `threads`
/// 0 runs on kvc::Cpu{} (serial); >= 1 on a kvc::ThreadPool of that many threads. `pre_rope` hands the queries
/// over with a RoPE table (Llama 3's theta), so the kernel rotates them.
template <class T, class S>
void window_score(benchmark::State& state, S scorer, Index rows, Index tokens, Index threads, bool pre_rope) {
  auto const& c = kvc::bench::cache<T>(tokens, head_dim);
  kvc::RopeTable<> table{};
  std::unique_ptr<kvc::bench::OwnedRope> rope;
  if (pre_rope) {
    rope = std::make_unique<kvc::bench::OwnedRope>(head_dim, tokens);
    if (rope->table.empty()) {
      state.SkipWithError("fill_rope_table failed");
      return;
    }
    table = rope->table;
  }
  auto const obs =
      kvc::observe(kvc::WindowQueries<float>{kvc::bench::window_query_rows(query_heads, rows, head_dim), table});
  kvc::ThreadPool pool(threads);
  kvc::Cpu const cpu = threads > 0 ? pool.cpu() : kvc::Cpu{};
  std::vector<float> out(static_cast<std::size_t>(c.ext.rows()));
  std::vector<std::byte> ws(kvc::score_workspace_bytes(cpu, scorer, c.ext, obs));
  kvc::ScoreSpan<> const span{out.data(), c.ext.batch, c.ext.heads, c.ext.tokens};
  if (auto const st = kvc::score(cpu, scorer, c.view(), obs, span, {ws.data(), ws.size()}); !st.ok()) {
    state.SkipWithError(st.message());
    return;
  }
  for (auto _ : state) {
    auto const st = kvc::score(cpu, scorer, c.view(), obs, span, {ws.data(), ws.size()});
    benchmark::DoNotOptimize(st);
    benchmark::DoNotOptimize(out.data());
  }
  Index const used_rows = std::is_same_v<S, kvc::TOVAScorer> ? 1 : rows;
  kvc::bench::report_flops(state, kernel_flops(used_rows, tokens));
}

template <class T>
void BM_SnapKV_Cpu(benchmark::State& state, Index threads, bool pre_rope) {
  Index const w = state.range(0), tokens = state.range(threads > 0 ? 2 : 1);  // args: window[, threads], tokens
  kvc::SnapKVScorer scorer{};
  scorer.window_size = w;
  window_score<T>(state, scorer, w, tokens, threads, pre_rope);
}

template <class T>
void BM_TOVA_Cpu(benchmark::State& state) {  // args: window (rows given; the kernel reads the newest), tokens
  window_score<T>(state, kvc::TOVAScorer{}, state.range(0), state.range(1), 0, false);
}

/// One fp32 Eigen product per KV head, queries [g*R x d] times keys^T [d x N], straight from the cache (contiguous
/// BHTD rows, no copy): tiled into [g*R x 128] blocks as the kernel does, or one [g*R x N] product.
void BM_WindowGemm_Eigen(benchmark::State& state, bool tiled) {
  Index const r = state.range(0), tokens = state.range(1), rows = group * r;
  kvc::bench::window_gemm(state, kvc::bench::window_queries(query_heads, r, head_dim), rows, rows,
                          kvc::bench::cache<float>(tokens, head_dim), tiled);
}

// ---- Registration: grouped by token count, so each cache is generated once per size ------------------------------

template <class Fn>
benchmark::internal::Benchmark* add(std::string const& name, Fn fn, Index window, Index tokens) {
  return benchmark::RegisterBenchmark(name.c_str(), fn)
      ->Unit(benchmark::kMillisecond)
      ->ArgNames({"window", "tokens"})
      ->Args({window, tokens});
}

int register_window_benchmarks() {
  for (Index tokens : token_sizes) {
    for (Index w : {Index{32}, Index{64}}) {
      add(
          "BM_SnapKV_Cpu/fp32", [](benchmark::State& st) { BM_SnapKV_Cpu<float>(st, 0, false); }, w, tokens);
      add(
          "BM_SnapKV_Cpu/fp16", [](benchmark::State& st) { BM_SnapKV_Cpu<kvc::half>(st, 0, false); }, w, tokens);
      add(
          "BM_WindowGemm_Eigen/tiled", [](benchmark::State& st) { BM_WindowGemm_Eigen(st, true); }, w, tokens);
      add(
          "BM_WindowGemm_Eigen/untiled", [](benchmark::State& st) { BM_WindowGemm_Eigen(st, false); }, w, tokens);
    }
    add("BM_TOVA_Cpu/fp32", BM_TOVA_Cpu<float>, 32, tokens);
    add("BM_TOVA_Cpu/fp16", BM_TOVA_Cpu<kvc::half>, 32, tokens);
    add(
        "BM_WindowGemm_Eigen/tiled", [](benchmark::State& st) { BM_WindowGemm_Eigen(st, true); }, 1, tokens);
  }
  // The cost of rotating pre-RoPE queries and the thread pool: w = 32, at 4K (smoke) and 32K tokens.
  for (Index tokens : {Index{4096}, Index{32768}}) {
    add(
        "BM_SnapKV_Cpu/fp32_prerope", [](benchmark::State& st) { BM_SnapKV_Cpu<float>(st, 0, true); }, 32, tokens);
    for (Index threads : {Index{1}, Index{2}})
      benchmark::RegisterBenchmark("BM_SnapKV_Cpu/fp32/pool",
                                   [threads](benchmark::State& st) { BM_SnapKV_Cpu<float>(st, threads, false); })
          ->Unit(benchmark::kMillisecond)
          ->ArgNames({"window", "threads", "tokens"})
          ->Args({32, threads, tokens})
          ->UseRealTime();  // the workers' time is not the calling thread's CPU time
  }
  return 0;
}

int const registered = register_window_benchmarks();

}  // namespace
