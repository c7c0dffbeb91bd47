// SPDX-License-Identifier: Apache-2.0
// benchmarks/scorers/key_diff_bench.cpp mirrors include/kvc/scorers/key_diff.hpp: CPU scoring throughput.
// bytes/s counts one read of K per call (what the scorer must at least read); compare with BM_MemoryRead.
#include <kvc/backend/cpu/scorers/key_diff.hpp>

#include "bench_support.hpp"

#include <benchmark/benchmark.h>

#include <cstddef>
#include <vector>

template <class T>
static void BM_KeyDiff_Cpu(benchmark::State& state) {
  auto const& c = kvc::bench::cache<T>(state.range(0), state.range(1));
  std::vector<float> out(static_cast<std::size_t>(c.ext.rows()));
  std::vector<std::byte> ws(kvc::score_workspace_bytes(kvc::Cpu{}, kvc::KeyDiffScorer{}, c.ext));
  kvc::ScoreSpan<> span{out.data(), c.ext.batch, c.ext.heads, c.ext.tokens};
  for (auto _ : state) {
    auto const st = kvc::score(kvc::Cpu{}, kvc::KeyDiffScorer{}, c.view(), span, {ws.data(), ws.size()});
    benchmark::DoNotOptimize(st);
    benchmark::DoNotOptimize(out.data());
  }
  kvc::bench::report(state, static_cast<double>(c.k.size() * sizeof(T)), static_cast<double>(c.ext.rows()));
}
BENCHMARK(BM_KeyDiff_Cpu<float>)->Apply(kvc::bench::token_dim_grid)->Name("BM_KeyDiff_Cpu/fp32");
BENCHMARK(BM_KeyDiff_Cpu<kvc::half>)->Apply(kvc::bench::token_dim_grid)->Name("BM_KeyDiff_Cpu/fp16");
