// SPDX-License-Identifier: Apache-2.0
// benchmarks/pipeline/decode_bench.cpp mirrors include/kvc/pipeline/decode.hpp: one kvc::decode_step of one layer,
// batch 1, Hkv = 8 KV heads holding N = 4K / 32K / 128K tokens, d = 128, Hq = 32 buffered pre-RoPE queries (of the
// cache's type), kvpress's DecodingPress defaults (compression_interval 512, hidden_states_buffer_size 256) and
// target_size = N - 512, i.e. the steady state in which every compression drops the 512 tokens decoded since the
// last one; plus d = 64 at 4K, the ctest smoke case (its filter matches tokens:4096/dim:64). Two steps:
//  - `count`: a step that does not compress (the common case, 511 of 512 steps): the driver's checks and counter,
//    plus, for H2O, kvc::update with the step's new query row (window attention, R = 1; FLOP/s as in h2o_bench.cpp);
//  - `compress`: the step that reaches the interval: scoring (ExpectedAttention first builds its statistics from
//    the last 256 buffered rows), top-k selection of N - 512 tokens per head, on_evict and in-place compaction.
//    Each iteration restores the cache (K, V, lengths, positions) outside the timed region.
// Compare `compress` with scoring alone: BM_KeyDiff_Cpu/<type>/tokens:N/dim:128, BM_ExpectedAttention_Cpu/<type>/
// tokens:N/dim:128 plus BM_QueryStatistics_Cpu/<type>/tokens:256/dim:128 (the statistics of the buffer), and
// `count` for H2O with BM_H2O_Update_Cpu/<type>/rows:1/tokens:N.
#include <kvc/backend/cpu/pipeline/compact.hpp>
#include <kvc/backend/cpu/pipeline/query_statistics.hpp>
#include <kvc/backend/cpu/pipeline/rerotate.hpp>
#include <kvc/backend/cpu/scorers/expected_attention.hpp>
#include <kvc/backend/cpu/scorers/h2o.hpp>
#include <kvc/backend/cpu/scorers/key_diff.hpp>
#include <kvc/backend/cpu/selectors/top_k.hpp>
#include <kvc/pipeline/decode.hpp>

#include "bench_support.hpp"

#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstddef>
#include <string>
#include <vector>

namespace {

using kvc::Index;
using kvc::bench::query_heads;

constexpr Index token_sizes[] = {4096, 32768, 131072};

/// One decode_step of `scorer` on a working copy of the cached [1, 8, N, d] cache of T (args: tokens, dim).
template <class T, class S>
void BM_DecodeStep_Cpu(benchmark::State& state, S scorer, bool compressing) {
  Index const tokens = state.range(0), head_dim = state.range(1);
  auto const& src = kvc::bench::cache<T>(tokens, head_dim);
  kvc::tools::HostCache<T> work = src;  // compression writes
  work.track(tokens);
  std::vector<float> acc(static_cast<std::size_t>(work.ext.rows()), 0.0f);  // H2O's state: every slot tracked
  std::vector<Index> tracked(static_cast<std::size_t>(work.ext.batch * work.ext.heads), tokens);
  if constexpr (kvc::StatefulScorer<S>)
    scorer.state = {{acc.data(), work.ext.batch, work.ext.heads, tokens}, tracked.data()};

  kvc::DecodeSchedule schedule{};
  Index const interval = schedule.compression_interval;
  schedule.target_size = tokens - interval;
  // The buffer holds the interval's rows (the queries of positions N - 512 .. N - 1); the newest is the step's.
  auto const& q = kvc::bench::window_queries(query_heads, interval, head_dim);
  std::vector<T> rows(q.size());
  std::transform(q.begin(), q.end(), rows.begin(), [](float x) { return kvc::from_float<T>(x); });
  std::vector<Index> positions(static_cast<std::size_t>(interval));
  for (Index i = 0; i < interval; ++i)
    positions[static_cast<std::size_t>(i)] = tokens - interval + i;
  kvc::QueryBuffer<T> buf{rows.data(), positions.data(), 1, query_heads, interval, head_dim, interval, 1};
  kvc::bench::OwnedRope const rope(head_dim, tokens + interval);  // ExpectedAttention averages [N, N + 512)
  kvc::DecodeCounter counter;
  std::vector<std::byte> ws(kvc::decode_workspace_bytes(kvc::Cpu{}, scorer, schedule, work.ext, buf));

  auto restore = [&] {  // the step before this one: a full buffer with one fresh row, the cache as it was
    counter.steps = compressing ? interval - 1 : 0;
    buf.count = interval;
    buf.fresh = 1;
    if (compressing) {
      std::copy(src.k.begin(), src.k.end(), work.k.begin());
      std::copy(src.v.begin(), src.v.end(), work.v.begin());
      work.track(tokens);
      std::fill(tracked.begin(), tracked.end(), tokens);
    }
  };
  for (auto _ : state) {
    if (compressing) {
      state.PauseTiming();
      restore();
      state.ResumeTiming();
    } else {
      restore();  // three stores
    }
    bool compressed = false;
    auto const st = kvc::decode_step(kvc::Cpu{}, scorer, schedule, work.view(), buf, counter, rope.table,
                                     {ws.data(), ws.size()}, &compressed);
    if (!st.ok() || compressed != compressing) {
      state.SkipWithError(st.ok() ? "decode_step: unexpected schedule" : st.message());
      break;
    }
    benchmark::ClobberMemory();
  }
  if (compressing &&
      std::any_of(work.lengths.begin(), work.lengths.end(), [&](Index n) { return n != tokens - interval; }))
    state.SkipWithError("decode_step: a head did not keep target_size tokens");
  if (kvc::StatefulScorer<S> && !compressing)
    kvc::bench::report_flops(state, kvc::bench::window_attention_flops(query_heads, 1, tokens, head_dim));
}

template <class S>
void add(std::string const& name, S scorer, Index tokens, Index dim) {
  for (bool compressing : {false, true}) {
    std::string const step = compressing ? "/compress" : "/count";
    benchmark::RegisterBenchmark(
        (name + "/fp32" + step).c_str(),
        [scorer, compressing](benchmark::State& st) { BM_DecodeStep_Cpu<float>(st, scorer, compressing); })
        ->Unit(compressing ? benchmark::kMillisecond : benchmark::kMicrosecond)
        ->ArgNames({"tokens", "dim"})
        ->Args({tokens, dim});
    benchmark::RegisterBenchmark(
        (name + "/fp16" + step).c_str(),
        [scorer, compressing](benchmark::State& st) { BM_DecodeStep_Cpu<kvc::half>(st, scorer, compressing); })
        ->Unit(compressing ? benchmark::kMillisecond : benchmark::kMicrosecond)
        ->ArgNames({"tokens", "dim"})
        ->Args({tokens, dim});
  }
}

int register_decode_benchmarks() {
  auto add_all = [](Index tokens, Index dim) {
    add("BM_DecodeStep_Cpu/key_diff", kvc::KeyDiffScorer{}, tokens, dim);
    add("BM_DecodeStep_Cpu/expected_attention", kvc::ExpectedAttentionScorer{}, tokens, dim);
    add("BM_DecodeStep_Cpu/h2o", kvc::H2OScorer<>{}, tokens, dim);
  };
  add_all(4096, 64);                // the smoke cases
  for (Index tokens : token_sizes)  // grouped by token count, so each cache is generated once per size
    add_all(tokens, kvc::bench::head_dim);
  return 0;
}

int const registered = register_decode_benchmarks();

}  // namespace
