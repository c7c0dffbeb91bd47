// SPDX-License-Identifier: Apache-2.0
// benchmarks/attention/packed_bench.cpp mirrors include/kvc/attention/packed.hpp: one decode query per query head
// (32 query heads over 8 KV heads, g = 4) over the packed store of the same fp16 cache BM_Attend_Cpu/fp16 reads, with
// every token and K channel at `bits` (2, 4, 8; 16: raw FP16 K and V), params groups of `group` tokens (K) and
// channels (V): 0 = whole axis (RDKV's), 32 = KIVI's. The goal: per token at least as fast as
// BM_Attend_Cpu/fp16 at 4 bits, faster at 2 bits. bytes/s counts one read of the arena (codes, params, permutation,
// positions).
#include <kvc/backend/cpu/attention/packed.hpp>
#include <kvc/pipeline/pack.hpp>
#include <kvc/store/packed_kv.hpp>

#include "bench_support.hpp"

#include <benchmark/benchmark.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <tuple>
#include <vector>

namespace {

/// The packed store of bench::cache<half>(tokens, dim) at a uniform `bits`, kept across benchmarks.
kvc::PackedKV const& packed(kvc::Index tokens, kvc::Index dim, int bits, kvc::Index group) {
  static std::unique_ptr<kvc::PackedKV> held;
  static std::tuple<kvc::Index, kvc::Index, int, kvc::Index> key{-1, -1, -1, -1};
  if (!held || key != std::make_tuple(tokens, dim, bits, group)) {
    held.reset();
    auto const& c = kvc::bench::cache<kvc::half>(tokens, dim);
    std::vector<std::int8_t> vb(static_cast<std::size_t>(c.ext.rows()), static_cast<std::int8_t>(bits));
    std::vector<std::int8_t> kb(static_cast<std::size_t>(c.ext.batch * c.ext.heads * dim),
                                static_cast<std::int8_t>(bits));
    kvc::BitPlan<> const plan{vb.data(), kb.data(), c.ext.batch, c.ext.heads, tokens, dim};
    kvc::PackOptions opt;
    opt.k_group = group;
    opt.v_group = group;
    held = std::make_unique<kvc::PackedKV>();
    if (!kvc::pack(c.view(), plan, opt, *held).ok())
      held->reset(0, 0, 0, 0, {}, 0);
    key = {tokens, dim, bits, group};
  }
  return *held;
}

void BM_AttendPacked_Cpu(benchmark::State& state) {
  kvc::Index const tokens = state.range(0), dim = state.range(1);
  int const bits = static_cast<int>(state.range(2));
  kvc::PackedKV const& kv = packed(tokens, dim, bits, state.range(3));
  if (kv.batch() == 0) {
    state.SkipWithError("kvc::pack failed");
    return;
  }
  kvc::KVExtents const qe{1, kvc::bench::query_heads, 1, dim};
  std::vector<float> q(static_cast<std::size_t>(qe.rows() * qe.dim), 0.1f), out(q.size()),
      lse(static_cast<std::size_t>(qe.rows()));
  kvc::AttendQueries<float> const queries{
      kvc::TokenRows<float const, kvc::StridedLayout>(q.data(), kvc::bhtd_layout(qe))};
  kvc::Attention const op{};
  std::vector<std::byte> ws(kvc::attend_packed_workspace_bytes(kvc::Cpu{}, op, queries, kv.view()));
  for (auto _ : state) {
    auto const st = kvc::attend_packed(kvc::Cpu{}, op, queries, kv.view(), kvc::AttendOutput<>{out.data(), lse.data()},
                                       {ws.data(), ws.size()});
    benchmark::DoNotOptimize(st);
    benchmark::DoNotOptimize(out.data());
  }
  kvc::bench::report(state, static_cast<double>(kv.arena_bytes()), static_cast<double>(tokens * kvc::bench::kv_heads));
  state.counters["payload_bits/elem"] =
      static_cast<double>(kv.payload_bits()) / static_cast<double>(2 * tokens * kvc::bench::kv_heads * dim);
  state.counters["overhead_bits/elem"] =
      static_cast<double>(kv.overhead_bits()) / static_cast<double>(2 * tokens * kvc::bench::kv_heads * dim);
}

}  // namespace

BENCHMARK(BM_AttendPacked_Cpu)
    ->ArgNames({"tokens", "dim", "bits", "group"})
    ->ArgsProduct({{4096, 32768, 131072}, {64, 128}, {2, 4, 8, 16}, {0, 32}})
    ->Unit(benchmark::kMillisecond);
