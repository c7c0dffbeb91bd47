// SPDX-License-Identifier: Apache-2.0
// benchmarks/bench_support.hpp: shared inputs for the benchmarks. One cache is kept alive between benchmarks with
// the same shape and type, so 512 MiB inputs are generated once per shape, not once per benchmark.
#pragma once

#include <kvc/core/element.hpp>
#include <kvc/core/kv_view.hpp>
#include <kvc/core/scorer.hpp>

#include "common/synthetic.hpp"

#include <benchmark/benchmark.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace kvc::bench {

inline constexpr Index kv_heads = 8;

/// The tokens x head_dim grid of the issue: 4K / 32K / 128K tokens, head_dim 64 / 128.
inline void token_dim_grid(benchmark::internal::Benchmark* b) {
  b->ArgNames({"tokens", "dim"})->ArgsProduct({{4096, 32768, 131072}, {64, 128}})->Unit(benchmark::kMillisecond);
}

/// A [1, 8, tokens, dim] host cache of T with N(0.3, 1) keys and N(0, 1) values, cached across benchmarks.
template <class T>
tools::HostCache<T> const& cache(Index tokens, Index dim) {
  static std::unique_ptr<tools::HostCache<T>> held;
  KVExtents const e{1, kv_heads, tokens, dim};
  if (!held || held->ext != e) {
    held.reset();  // free the previous shape first: the largest is 512 MiB per tensor
    held = std::make_unique<tools::HostCache<T>>(e);
    tools::Rng rng(42);
    for (T& x : held->k)
      x = from_float<T>(rng.normal() + 0.3f);
    for (T& x : held->v)
      x = from_float<T>(rng.normal());
  }
  return *held;
}

/// Reports bytes/s (of `bytes` read per iteration) and tokens/s.
inline void report(benchmark::State& state, double bytes, double tokens) {
  state.SetBytesProcessed(static_cast<std::int64_t>(bytes) * state.iterations());
  state.counters["tokens/s"] = benchmark::Counter(tokens, benchmark::Counter::kIsIterationInvariantRate);
}

/// Scores the cached [1, 8, tokens, dim] cache of T with `scorer` on the CPU (args: tokens, dim). bytes/s counts
/// one read of K when the scorer reads keys (what it must at least read: compare with BM_MemoryRead), else the
/// fp32 scores it writes. `cpu` is serial by default, or a kvc::ThreadPool's.
template <class T, class S>
void score_cpu(benchmark::State& state, S scorer, Cpu const& cpu = Cpu{}) {
  auto const& c = cache<T>(state.range(0), state.range(1));
  std::vector<float> out(static_cast<std::size_t>(c.ext.rows()));
  std::vector<std::byte> ws(score_workspace_bytes(cpu, scorer, c.ext));
  ScoreSpan<> span{out.data(), c.ext.batch, c.ext.heads, c.ext.tokens};
  for (auto _ : state) {
    auto const st = score(cpu, scorer, c.view(), span, {ws.data(), ws.size()});
    benchmark::DoNotOptimize(st);
    benchmark::DoNotOptimize(out.data());
  }
  bool const reads_keys = has_need(S::needs, Needs::keys);
  report(state, static_cast<double>(reads_keys ? c.k.size() * sizeof(T) : out.size() * sizeof(float)),
         static_cast<double>(c.ext.rows()));
}

/// Registers `<name>/fp32` and `<name>/fp16` scoring benchmarks over the token x dim grid.
template <class S>
int register_scorer(std::string const& name, S scorer) {
  benchmark::RegisterBenchmark((name + "/fp32").c_str(), [scorer](benchmark::State& st) {
    score_cpu<float>(st, scorer);
  })->Apply(token_dim_grid);
  benchmark::RegisterBenchmark((name + "/fp16").c_str(), [scorer](benchmark::State& st) {
    score_cpu<half>(st, scorer);
  })->Apply(token_dim_grid);
  return 0;
}

}  // namespace kvc::bench
