// SPDX-License-Identifier: Apache-2.0
// benchmarks/selectors/top_k_bench.cpp mirrors include/kvc/selectors/top_k.hpp: selection at ratio 0.5.
// bytes/s counts one read of the fp32 scores.
#include <kvc/backend/cpu/selectors/top_k.hpp>

#include "bench_support.hpp"

#include <benchmark/benchmark.h>

#include <cstddef>
#include <vector>

static void BM_TopK_Cpu(benchmark::State& state) {
  kvc::Index const tokens = state.range(0), heads = kvc::bench::kv_heads;
  std::vector<float> scores(static_cast<std::size_t>(heads * tokens));
  kvc::tools::Rng rng(1);
  for (float& x : scores)
    x = rng.normal();
  std::vector<kvc::Index> index(scores.size()), count(static_cast<std::size_t>(heads));
  kvc::TopKSelector const sel{kvc::RatioBudget{0.5}};
  std::vector<std::byte> ws(kvc::select_workspace_bytes(kvc::Cpu{}, sel, 1, heads, tokens));
  for (auto _ : state) {
    auto const st = kvc::select(kvc::Cpu{}, sel, kvc::ScoreSpan<>{scores.data(), 1, heads, tokens},
                                kvc::KeepPlan<>{index.data(), count.data(), 1, heads, tokens}, {ws.data(), ws.size()});
    benchmark::DoNotOptimize(st);
    benchmark::DoNotOptimize(index.data());
  }
  kvc::bench::report(state, static_cast<double>(scores.size() * sizeof(float)), static_cast<double>(scores.size()));
}
BENCHMARK(BM_TopK_Cpu)->ArgNames({"tokens"})->Arg(4096)->Arg(32768)->Arg(131072)->Unit(benchmark::kMillisecond);
