// SPDX-License-Identifier: Apache-2.0
// benchmarks/attention/attend_bench.cpp mirrors include/kvc/attention/attend.hpp: one decode query per KV head over
// the whole cache (a FlashAttention-style kernel: one pass over each KV head for its whole GQA group). bytes/s
// counts one read of K and V.
#include <kvc/backend/cpu/attention/attend.hpp>

#include "bench_support.hpp"

#include <benchmark/benchmark.h>

#include <cstddef>
#include <vector>

template <class T>
static void BM_Attend_Cpu(benchmark::State& state) {
  auto const& c = kvc::bench::cache<T>(state.range(0), state.range(1));
  kvc::KVExtents const qe{1, kvc::bench::kv_heads, 1, c.ext.dim};
  std::vector<float> q(static_cast<std::size_t>(qe.rows() * qe.dim), 0.1f), out(q.size()),
      lse(static_cast<std::size_t>(qe.rows()));
  // Post-RoPE queries at the context's last position (no positions given: kvc::context_end), so every slot is seen.
  kvc::AttendQueries<float> const queries{
      kvc::TokenRows<float const, kvc::StridedLayout>(q.data(), kvc::bhtd_layout(qe))};
  kvc::Attention const op{};
  std::vector<std::byte> ws(kvc::attend_workspace_bytes(kvc::Cpu{}, op, queries, c.view()));
  for (auto _ : state) {
    auto const st = kvc::attend(kvc::Cpu{}, op, queries, c.view(), kvc::AttendOutput<>{out.data(), lse.data()},
                                {ws.data(), ws.size()});
    benchmark::DoNotOptimize(st);
    benchmark::DoNotOptimize(out.data());
  }
  kvc::bench::report(state, 2.0 * static_cast<double>(c.k.size() * sizeof(T)), static_cast<double>(c.ext.rows()));
}
BENCHMARK(BM_Attend_Cpu<float>)->Apply(kvc::bench::token_dim_grid)->Name("BM_Attend_Cpu/fp32");
BENCHMARK(BM_Attend_Cpu<kvc::half>)->Apply(kvc::bench::token_dim_grid)->Name("BM_Attend_Cpu/fp16");
BENCHMARK(BM_Attend_Cpu<kvc::float8_e4m3>)->Apply(kvc::bench::token_dim_grid)->Name("BM_Attend_Cpu/fp8_e4m3");
BENCHMARK(BM_Attend_Cpu<kvc::float8_e5m2>)->Apply(kvc::bench::token_dim_grid)->Name("BM_Attend_Cpu/fp8_e5m2");
