// SPDX-License-Identifier: Apache-2.0
// benchmarks/memory_bandwidth_bench.cpp: single-thread memory-read bandwidth (sum of a 512 MiB buffer), so policy
// throughputs in the same binary can be stated as a fraction of what one read of K can possibly cost.
#include "bench_support.hpp"

#include <benchmark/benchmark.h>

#include <cstddef>
#include <vector>

static void BM_MemoryRead(benchmark::State& state) {
  std::size_t const n = std::size_t{128} << 20;  // floats: 512 MiB, far beyond any cache
  std::vector<float> buf(n, 1.0f);
  for (auto _ : state) {
    float acc[16] = {};
    for (std::size_t i = 0; i < n; i += 16)
      for (int j = 0; j < 16; ++j)  // 16 independent accumulators: the loop vectorises without -ffast-math
        acc[j] += buf[i + static_cast<std::size_t>(j)];
    float total = 0;
    for (float a : acc)
      total += a;
    benchmark::DoNotOptimize(total);
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(n * sizeof(float)) * state.iterations());
}
BENCHMARK(BM_MemoryRead)->Unit(benchmark::kMillisecond)->Name("BM_MemoryRead/512MiB");
