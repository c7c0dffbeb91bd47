// SPDX-License-Identifier: Apache-2.0
// benchmarks/selectors/top_k_bench.cpp mirrors include/kvc/selectors/top_k.hpp: selection at ratio 0.5.
// bytes/s counts one read of the fp32 scores.
#include <kvc/backend/cpu/selectors/top_k.hpp>
#include <kvc/backend/cpu/thread_pool.hpp>

#include "bench_support.hpp"

#include <benchmark/benchmark.h>

#include <cstddef>
#include <vector>

static void top_k(benchmark::State& state, kvc::Index threads) {
  kvc::Index const tokens = state.range(0), heads = kvc::bench::kv_heads;
  kvc::ThreadPool pool(threads);
  kvc::Cpu const cpu = threads > 0 ? pool.cpu() : kvc::Cpu{};
  std::vector<float> scores(static_cast<std::size_t>(heads * tokens));
  kvc::tools::Rng rng(1);
  for (float& x : scores)
    x = rng.normal();
  std::vector<kvc::Index> index(scores.size()), count(static_cast<std::size_t>(heads));
  kvc::TopKSelector const sel{kvc::RatioBudget{0.5}};
  std::vector<std::byte> ws(kvc::select_workspace_bytes(cpu, sel, 1, heads, tokens));
  for (auto _ : state) {
    auto const st = kvc::select(cpu, sel, kvc::ScoreSpan<>{scores.data(), 1, heads, tokens},
                                kvc::KeepPlan<>{index.data(), count.data(), 1, heads, tokens}, {ws.data(), ws.size()});
    benchmark::DoNotOptimize(st);
    benchmark::DoNotOptimize(index.data());
  }
  kvc::bench::report(state, static_cast<double>(scores.size() * sizeof(float)), static_cast<double>(scores.size()));
}
static void BM_TopK_Cpu(benchmark::State& state) {
  top_k(state, 0);
}
BENCHMARK(BM_TopK_Cpu)->ArgNames({"tokens"})->Arg(4096)->Arg(32768)->Arg(131072)->Unit(benchmark::kMillisecond);
// Scaling over (sequence, head) items on a kvc::ThreadPool of 1 or 2 threads, 8 heads x 32K.
static int const registered_pool = [] {
  for (kvc::Index threads : {kvc::Index{1}, kvc::Index{2}})
    benchmark::RegisterBenchmark("BM_TopK_Cpu/pool", [threads](benchmark::State& st) { top_k(st, threads); })
        ->Unit(benchmark::kMillisecond)
        ->ArgNames({"tokens", "threads"})
        ->Args({32768, threads})
        ->UseRealTime();
  return 0;
}();
