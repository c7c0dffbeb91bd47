// SPDX-License-Identifier: Apache-2.0
// benchmarks/scorers/key_diff_bench.cpp mirrors include/kvc/scorers/key_diff.hpp: CPU scoring throughput (bytes/s
// counts one read of K per call).
#include <kvc/backend/cpu/scorers/key_diff.hpp>
#include <kvc/backend/cpu/thread_pool.hpp>

#include "bench_support.hpp"

static int const registered = kvc::bench::register_scorer("BM_KeyDiff_Cpu", kvc::KeyDiffScorer{}, /*fp8=*/true);

// Scaling over (sequence, head) items: fp16, 8 heads x 32K tokens, d = 128, on a kvc::ThreadPool of 1 or 2 threads.
static int const registered_pool = [] {
  for (kvc::Index threads : {kvc::Index{1}, kvc::Index{2}})
    benchmark::RegisterBenchmark("BM_KeyDiff_Cpu/fp16/pool",
                                 [threads](benchmark::State& st) {
                                   kvc::ThreadPool pool(threads);
                                   kvc::bench::score_cpu<kvc::half>(st, kvc::KeyDiffScorer{}, pool.cpu());
                                 })
        ->Unit(benchmark::kMillisecond)
        ->ArgNames({"tokens", "dim", "threads"})
        ->Args({32768, 128, threads})
        ->UseRealTime();  // the workers' time is not the calling thread's CPU time
  return 0;
}();
