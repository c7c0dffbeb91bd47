// SPDX-License-Identifier: Apache-2.0
// benchmarks/pipeline/rdkv_bench.cpp: one layer's whole RDKV compression, stage by stage, so that the allocation's
// share of it is measured in one run (the issue asks for it at N = 4K and 32K). Shapes: batch 1, Hq = 32 query heads
// over Hkv = 8 KV heads (g = 4), d = 128, an fp16 cache, W = 32 post-RoPE window queries, B = N / 8 FP16-equivalent
// tokens per head (a 1/8 memory budget), the exact solver. Stages, each timed alone over the same inputs:
//   token_weights    kvc::score with RDKVTokenScorer (attn_linear: window attention over the head + pooling)
//   channel_weights  kvc::score_channels with ThinKChannelScorer
//   allocate         kvc::allocate_bits (V then K knapsack of the 8 heads)
//   pack             kvc::pack (quantise, pack, FP16 params) into a PackedKV (the owning host store: allocates)
//   pack_into        kvc::pack_into the same plan into a caller-memory PackedStore (kvc::LayerCompressor's way:
//                    a region of packed_head_bytes_bound per head, nothing allocated)
// The share of the allocation is allocate / (the sum of the first four). bytes/s counts one read of K (and V for the
// two packers).
#include <kvc/backend/cpu/pipeline/pack.hpp>
#include <kvc/backend/cpu/scorers/rdkv.hpp>
#include <kvc/backend/cpu/selectors/rdkv.hpp>
#include <kvc/pipeline/pack.hpp>

#include "bench_support.hpp"

#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace {

using kvc::Index;

enum class Stage : int { token_weights, channel_weights, allocate, pack, pack_into };

void rdkv_stage(benchmark::State& state, Stage stage) {
  Index const tokens = state.range(0), dim = kvc::bench::head_dim, w = 32;
  auto const& c = kvc::bench::cache<kvc::half>(tokens, dim);
  kvc::KVExtents const e = c.ext;
  auto const obs = kvc::observe(
      kvc::WindowQueries<float>{kvc::bench::window_query_rows(kvc::bench::query_heads, w, dim), kvc::RopeTable<>{}});
  kvc::Cpu const cpu{};
  kvc::RDKVTokenScorer const token_scorer{};
  kvc::ThinKChannelScorer const channel_scorer{};
  kvc::RDKVAllocator alloc;
  alloc.budget_tokens = tokens / 8;

  std::vector<float> token_w(static_cast<std::size_t>(e.rows())), channel_w(static_cast<std::size_t>(e.heads * dim));
  std::vector<std::int8_t> v_bits(token_w.size()), k_bits(channel_w.size());
  std::vector<std::byte> ws(std::max({kvc::score_workspace_bytes(cpu, token_scorer, e, obs),
                                      kvc::channel_score_workspace_bytes(cpu, channel_scorer, e, obs),
                                      kvc::allocate_bits_workspace_bytes(cpu, alloc, 1, e.heads, tokens, dim)}));
  kvc::Workspace const space{ws.data(), ws.size()};
  kvc::ScoreSpan<> const span{token_w.data(), e.batch, e.heads, e.tokens};
  kvc::BitPlan<> const plan{v_bits.data(), k_bits.data(), e.batch, e.heads, e.tokens, dim};
  // Inputs of the later stages from the earlier ones (each stage is timed on its own below).
  if (!kvc::score(cpu, token_scorer, c.view(), obs, span, space).ok() ||
      !kvc::score_channels(cpu, channel_scorer, c.view(), obs, channel_w.data(), space).ok() ||
      !kvc::allocate_bits(cpu, alloc, span, channel_w.data(), plan, space).ok()) {
    state.SkipWithError("RDKV setup failed");
    return;
  }
  kvc::PackedKV packed;
  kvc::PackedStore<> store{nullptr, nullptr, e.batch, e.heads, dim, dim, tokens, kvc::PackedQuant{}};
  std::vector<kvc::PackedHead> descriptors(static_cast<std::size_t>(e.batch * e.heads));
  std::vector<std::byte> arena, pack_ws;
  if (stage == Stage::pack_into) {
    arena.resize(static_cast<std::size_t>(store.arena_bytes()) + 16);
    store.arena = arena.data() + (16 - reinterpret_cast<std::uintptr_t>(arena.data()) % 16) % 16;
    store.heads = descriptors.data();
    pack_ws.resize(kvc::pack_workspace_bytes(cpu, c.view()));
  }
  for (auto _ : state) {
    kvc::Status st;
    switch (stage) {
      case Stage::token_weights: st = kvc::score(cpu, token_scorer, c.view(), obs, span, space); break;
      case Stage::channel_weights:
        st = kvc::score_channels(cpu, channel_scorer, c.view(), obs, channel_w.data(), space);
        break;
      case Stage::allocate: st = kvc::allocate_bits(cpu, alloc, span, channel_w.data(), plan, space); break;
      case Stage::pack: st = kvc::pack(c.view(), plan, kvc::PackOptions{}, packed); break;
      case Stage::pack_into:
        st = kvc::pack_into(cpu, c.view(), plan, kvc::PackOptions{}, store, {pack_ws.data(), pack_ws.size()});
        break;
    }
    if (!st.ok()) {
      state.SkipWithError(st.message());
      return;
    }
    benchmark::DoNotOptimize(v_bits.data());
    benchmark::DoNotOptimize(packed.arena_bytes());
    benchmark::DoNotOptimize(descriptors.data());
  }
  double const k_bytes = static_cast<double>(c.k.size() * sizeof(kvc::half));
  bool const packs = stage == Stage::pack || stage == Stage::pack_into;
  kvc::bench::report(state, packs ? 2.0 * k_bytes : k_bytes, static_cast<double>(e.rows()));
}

int const registered = [] {
  struct Named {
    char const* name;
    Stage stage;
  };
  for (Named const s :
       {Named{"token_weights", Stage::token_weights}, Named{"channel_weights", Stage::channel_weights},
        Named{"allocate", Stage::allocate}, Named{"pack", Stage::pack}, Named{"pack_into", Stage::pack_into}})
    benchmark::RegisterBenchmark((std::string("BM_RDKVCompress_Cpu/fp16/") + s.name).c_str(),
                                 [stage = s.stage](benchmark::State& st) { rdkv_stage(st, stage); })
        ->ArgNames({"tokens"})
        ->Arg(4096)
        ->Arg(32768)
        ->Unit(benchmark::kMillisecond);
  return 0;
}();

}  // namespace
