// SPDX-License-Identifier: Apache-2.0
// benchmarks/pipeline/compact_bench.cpp mirrors include/kvc/pipeline/compact.hpp: in-place compaction keeping every
// other token. bytes/s counts the K and V bytes moved (read + written).
#include <kvc/backend/cpu/pipeline/compact.hpp>

#include "bench_support.hpp"

#include <benchmark/benchmark.h>

#include <cstddef>
#include <vector>

template <class T>
static void BM_Compact_Cpu(benchmark::State& state) {
  kvc::Index const tokens = state.range(0), dim = state.range(1), heads = kvc::bench::kv_heads;
  auto c = kvc::bench::cache<T>(tokens, dim);  // a private copy: compaction writes
  kvc::Index const kept = tokens / 2;
  std::vector<kvc::Index> index(static_cast<std::size_t>(heads * tokens)), count(static_cast<std::size_t>(heads), kept);
  for (kvc::Index h = 0; h < heads; ++h)
    for (kvc::Index j = 0; j < kept; ++j)
      index[static_cast<std::size_t>(h * tokens + j)] = 2 * j + 1;
  kvc::KeepPlan<> const plan{index.data(), count.data(), 1, heads, tokens};
  for (auto _ : state) {
    auto const st = kvc::compact(kvc::Cpu{}, plan, c.view());  // later iterations move already-moved rows: same cost
    benchmark::DoNotOptimize(st);
    benchmark::ClobberMemory();
  }
  kvc::bench::report(state, 2.0 * 2.0 * static_cast<double>(heads * kept * dim) * sizeof(T),
                     static_cast<double>(heads * kept));
}
BENCHMARK(BM_Compact_Cpu<float>)->Apply(kvc::bench::token_dim_grid)->Name("BM_Compact_Cpu/fp32");
BENCHMARK(BM_Compact_Cpu<kvc::half>)->Apply(kvc::bench::token_dim_grid)->Name("BM_Compact_Cpu/fp16");
