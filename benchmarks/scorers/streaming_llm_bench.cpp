// SPDX-License-Identifier: Apache-2.0
// benchmarks/scorers/streaming_llm_bench.cpp mirrors include/kvc/scorers/streaming_llm.hpp: CPU scoring throughput.
// StreamingLLM reads no K or V: bytes/s counts the fp32 scores it writes.
#include <kvc/backend/cpu/scorers/streaming_llm.hpp>

#include "bench_support.hpp"

#include <benchmark/benchmark.h>

#include <cstddef>
#include <vector>

template <class T>
static void BM_StreamingLLM_Cpu(benchmark::State& state) {
  auto const& c = kvc::bench::cache<T>(state.range(0), state.range(1));
  std::vector<float> out(static_cast<std::size_t>(c.ext.rows()));
  std::vector<std::byte> ws(kvc::score_workspace_bytes(kvc::Cpu{}, kvc::StreamingLLMScorer{}, c.ext));
  kvc::ScoreSpan<> span{out.data(), c.ext.batch, c.ext.heads, c.ext.tokens};
  for (auto _ : state) {
    auto const st = kvc::score(kvc::Cpu{}, kvc::StreamingLLMScorer{}, c.view(), span, {ws.data(), ws.size()});
    benchmark::DoNotOptimize(st);
    benchmark::DoNotOptimize(out.data());
  }
  kvc::bench::report(state, static_cast<double>(out.size() * sizeof(float)), static_cast<double>(c.ext.rows()));
}
BENCHMARK(BM_StreamingLLM_Cpu<float>)->Apply(kvc::bench::token_dim_grid)->Name("BM_StreamingLLM_Cpu/fp32");
BENCHMARK(BM_StreamingLLM_Cpu<kvc::half>)->Apply(kvc::bench::token_dim_grid)->Name("BM_StreamingLLM_Cpu/fp16");
