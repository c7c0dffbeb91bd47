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
#include <kvc/backend/cpu/thread_pool.hpp>

#include "bench_support.hpp"

#include <Eigen/Core>
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <map>
#include <string>
#include <type_traits>
#include <vector>

namespace {

using kvc::Index;
using RowMatrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

constexpr Index query_heads = 32, head_dim = 128, group = query_heads / kvc::bench::kv_heads;
constexpr Index tile = kvc::detail::window_tile;
constexpr Index token_sizes[] = {4096, 32768, 131072};

/// Window queries [1, Hq, rows, d] fp32, N(0, 1), cached per row count.
std::vector<float> const& window_queries(Index rows) {
  static std::map<Index, std::vector<float>> held;
  auto& q = held[rows];
  if (q.empty()) {
    q.resize(static_cast<std::size_t>(query_heads * rows * head_dim));
    kvc::tools::Rng rng(7);
    for (float& x : q)
      x = rng.normal();
  }
  return q;
}

kvc::KVExtents query_extents(Index rows) {
  return {1, query_heads, rows, head_dim};
}

kvc::TokenRows<float const, kvc::StridedLayout> query_rows(Index rows) {
  return {window_queries(rows).data(), kvc::bhtd_layout(query_extents(rows))};
}

/// FLOPs of the kernel's two logit products (R query rows per query head over `tokens` slots).
double kernel_flops(Index rows, Index tokens) {
  return 4.0 * static_cast<double>(query_heads * rows * tokens * head_dim);
}

void report_flops(benchmark::State& state, double flops) {
  state.counters["FLOP/s"] = benchmark::Counter(flops, benchmark::Counter::kIsIterationInvariantRate);
}

/// SnapKV (authors' reference, window w, max pooling 7) or TOVA on the cached [1, 8, N, 128] cache of T. `threads`
/// 0 runs on kvc::Cpu{} (serial); >= 1 on a kvc::ThreadPool of that many threads. `pre_rope` hands the queries
/// over with a RoPE table (Llama 3's theta), so the kernel rotates them.
template <class T, class S>
void window_score(benchmark::State& state, S scorer, Index rows, Index tokens, Index threads, bool pre_rope) {
  auto const& c = kvc::bench::cache<T>(tokens, head_dim);
  kvc::RopeTable<> table{};
  std::vector<float> storage;
  if (pre_rope) {
    storage.resize(static_cast<std::size_t>(kvc::rope_table_floats(tokens, head_dim)));
    if (!kvc::fill_rope_table(kvc::RopeSpec{500000.0}, head_dim, tokens, storage.data(), table).ok()) {
      state.SkipWithError("fill_rope_table failed");
      return;
    }
  }
  auto const obs = kvc::observe(kvc::WindowQueries<float>{query_rows(rows), table});
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
  report_flops(state, kernel_flops(used_rows, tokens));
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
  auto const& c = kvc::bench::cache<float>(tokens, head_dim);
  auto const& q = window_queries(r);  // the g heads of KV head h are contiguous: rows [h*g*R, (h+1)*g*R)
  std::vector<float> logits(static_cast<std::size_t>(rows * (tiled ? tile : tokens)));
  for (auto _ : state) {
    for (Index h = 0; h < kvc::bench::kv_heads; ++h) {
      Eigen::Map<RowMatrix const> const qm(q.data() + h * rows * head_dim, rows, head_dim);
      float const* keys = c.k.data() + h * tokens * head_dim;
      if (tiled) {
        for (Index t0 = 0; t0 < tokens; t0 += tile) {
          Index const cols = std::min(tile, tokens - t0);
          Eigen::Map<RowMatrix const> const km(keys + t0 * head_dim, cols, head_dim);
          Eigen::Map<RowMatrix, 0, Eigen::OuterStride<>> lm(logits.data(), rows, cols, Eigen::OuterStride<>(tile));
          lm.noalias() = qm * km.transpose();
          benchmark::ClobberMemory();
        }
      } else {
        Eigen::Map<RowMatrix const> const km(keys, tokens, head_dim);
        Eigen::Map<RowMatrix> lm(logits.data(), rows, tokens);
        lm.noalias() = qm * km.transpose();
        benchmark::ClobberMemory();
      }
    }
    benchmark::DoNotOptimize(logits.data());
  }
  report_flops(state, kernel_flops(r, tokens) / 2);
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
