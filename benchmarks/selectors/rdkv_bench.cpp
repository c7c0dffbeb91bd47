// SPDX-License-Identifier: Apache-2.0
// benchmarks/rdkv_allocation_bench.cpp mirrors include/kvc/selectors/rdkv.hpp: the cost of RDKV's bit allocation
// (V knapsack over the tokens, then K knapsack over the channels) for one (sequence, KV head), head dim 128,
// B = 128 FP16-equivalent tokens, heavy-tailed token weights (exp of a normal, like attention mass), with the exact
// solver (quickselect + fill) and the authors' Lagrangian bisection. tokens/s counts the V units allocated.
#include <kvc/backend/cpu/selectors/rdkv.hpp>

#include "bench_support.hpp"

#include <benchmark/benchmark.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

static void rdkv_allocate(benchmark::State& state, kvc::BitSolver solver) {
  kvc::Index const tokens = state.range(0), dim = kvc::bench::head_dim;
  kvc::tools::Rng rng(3);
  std::vector<float> w(static_cast<std::size_t>(tokens)), cw(static_cast<std::size_t>(dim));
  for (float& x : w)
    x = std::exp(2.0f * rng.normal());
  for (float& x : cw)
    x = std::exp(rng.normal());
  std::vector<std::int8_t> v(w.size()), k(cw.size());
  kvc::RDKVAllocator a;
  a.budget_tokens = 128;
  a.solver = solver;
  kvc::Cpu const cpu{};
  std::vector<std::byte> ws(kvc::allocate_bits_workspace_bytes(cpu, a, 1, 1, tokens, dim));
  for (auto _ : state) {
    auto const st = kvc::allocate_bits(cpu, a, kvc::ScoreSpan<>{w.data(), 1, 1, tokens}, cw.data(),
                                       kvc::BitPlan<>{v.data(), k.data(), 1, 1, tokens, dim}, {ws.data(), ws.size()});
    benchmark::DoNotOptimize(st);
    benchmark::DoNotOptimize(v.data());
  }
  kvc::bench::report(state, static_cast<double>(w.size() * sizeof(float)), static_cast<double>(tokens));
}

static int const registered_rdkv = [] {
  benchmark::RegisterBenchmark("BM_RDKVAllocate/exact",
                               [](benchmark::State& st) { rdkv_allocate(st, kvc::BitSolver::exact); })
      ->ArgNames({"tokens"})
      ->Arg(4096)
      ->Arg(32768)
      ->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("BM_RDKVAllocate/lagrangian",
                               [](benchmark::State& st) { rdkv_allocate(st, kvc::BitSolver::lagrangian); })
      ->ArgNames({"tokens"})
      ->Arg(4096)
      ->Arg(32768)
      ->Unit(benchmark::kMillisecond);
  return 0;
}();
