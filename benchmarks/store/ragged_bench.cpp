// SPDX-License-Identifier: Apache-2.0
// benchmarks/store/ragged_bench.cpp mirrors include/kvc/store/ragged.hpp: decode attention over a ragged per-head
// store (AdaKV-like uneven per-head counts), the same attention over the uniform cache of the same kept tokens, the
// memory-read bound of exactly the bytes they read, and AdaKV's allocation and selection against a top-k pass over
// the same scores.
//
//  - BM_RaggedAttend/<dtype>/<store>: one decode query row per query head, Hq = 32 over Hkv = 8 (g = 4), d = 128,
//    over a store whose heads hold the counts kvc::allocate (AdaKV, authors, ratio 0.5) gives for the layer scores
//    below: uneven, about N/2 on average. `ragged` is the store (kvc::ragged_cache, each head exactly its tokens),
//    `uniform` a BHTD cache of the same kept tokens (capacity = the longest head, per-head lengths). bytes/s counts
//    the kept K+V bytes, each read once.
//  - BM_RaggedRead/<dtype>: the memory-read bound: a byte sum over the store's K and V buffers, the same bytes,
//    split in 256 chunks over the same threads.
//  - BM_AdaKV_Allocate/<reference>, BM_AdaKV_Select/<reference> (allocation + top-k), BM_AdaKV_TopK (TopKSelector,
//    ratio 0.5): [1, 8, N] fp32 scores; `scores/s` and bytes/s of one read of the scores.
// threads:1 is the serial kvc::Cpu{} (CPU time); threads:2 a kvc::ThreadPool of 2 (real time), bound and kernel alike.
#include <kvc/backend/cpu/attention/attend.hpp>
#include <kvc/backend/cpu/selectors/ada_kv.hpp>
#include <kvc/backend/cpu/selectors/top_k.hpp>
#include <kvc/backend/cpu/thread_pool.hpp>
#include <kvc/store/ragged.hpp>

#include "bench_support.hpp"
#include "common/ragged_store.hpp"

#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

namespace {

using kvc::Index;
constexpr Index heads = kvc::bench::kv_heads, query_heads = kvc::bench::query_heads, dim = kvc::bench::head_dim;

/// Layer scores [1, 8, tokens], fp32: head h ~ N(mu_h, 1) with head-dependent means, so a global top-k (AdaKV)
/// gives the heads very different budgets. Cached per token count.
std::vector<float> const& layer_scores(Index tokens) {
  static Index held_tokens = -1;
  static std::vector<float> held;
  if (held_tokens != tokens) {
    static constexpr float mean[heads] = {-1.0f, 0.8f, -0.3f, 0.2f, 1.5f, -0.6f, 0.5f, -1.2f};
    held.resize(static_cast<std::size_t>(heads * tokens));
    kvc::tools::Rng rng(17);
    for (Index h = 0; h < heads; ++h)
      for (Index t = 0; t < tokens; ++t)
        held[static_cast<std::size_t>(h * tokens + t)] = rng.normal() + mean[h];
    held_tokens = tokens;
  }
  return held;
}

/// The per-head counts AdaKV (authors, alpha 0.2, ratio 0.5) allocates for layer_scores(tokens).
std::vector<Index> kept_counts(Index tokens) {
  kvc::AdaKVSelector const sel{kvc::RatioBudget{0.5}};
  std::vector<Index> counts(static_cast<std::size_t>(heads));
  std::vector<std::byte> ws(kvc::allocate_workspace_bytes(kvc::Cpu{}, sel, 1, heads, tokens));
  auto const& scores = layer_scores(tokens);
  auto const st = kvc::allocate(kvc::Cpu{}, sel, kvc::ScoreSpan<>{const_cast<float*>(scores.data()), 1, heads, tokens},
                                counts.data(), {ws.data(), ws.size()});
  if (!st.ok())
    counts.assign(counts.size(), tokens / 2);
  return counts;
}

/// A ragged store and the uniform cache of the same kept tokens: head h keeps counts[h] of N positions, evenly
/// spread (ascending), K ~ N(0.3, 1), V ~ N(0, 1).
template <class T>
struct Stores {
  Index tokens = 0;
  std::vector<Index> counts;
  kvc::tools::HostRaggedStore<T> ragged;
  kvc::tools::HostCache<T> uniform;

  explicit Stores(Index n) : tokens(n), counts(kept_counts(n)), ragged(1, heads, dim, dim, counts.data(), 0) {
    Index const longest = *std::max_element(counts.begin(), counts.end());
    uniform = kvc::tools::HostCache<T>({1, heads, longest, dim});
    uniform.per_head = true;
    uniform.lengths = counts;
    uniform.positions.assign(static_cast<std::size_t>(heads * longest), 0);
    kvc::tools::Rng rng(42);
    auto const store = ragged.view();
    auto const flat = uniform.view();
    for (Index h = 0; h < heads; ++h) {
      Index const count = counts[static_cast<std::size_t>(h)];
      for (Index j = 0; j < count; ++j) {
        T* k = store.keys.row(0, h, j);
        T* v = store.values.row(0, h, j);
        for (Index c = 0; c < dim; ++c) {
          k[c] = kvc::from_float<T>(rng.normal() + 0.3f);
          v[c] = kvc::from_float<T>(rng.normal());
        }
        std::copy(k, k + dim, flat.keys.row(0, h, j));
        std::copy(v, v + dim, flat.values.row(0, h, j));
        store.position_ref(0, h, j) = flat.position_ref(0, h, j) = j * n / count;
      }
      ragged.lengths[static_cast<std::size_t>(h)] = count;
    }
  }
  Index kept() const { return std::accumulate(counts.begin(), counts.end(), Index{0}); }
  double kept_bytes() const { return static_cast<double>(kept() * 2 * dim) * static_cast<double>(sizeof(T)); }
};

/// One set of stores alive at a time, whatever its type (the largest, fp32 at 128K, is 1.4 GiB with its uniform
/// twin): the previous set is freed before the next is built.
std::shared_ptr<void>& held_stores() {
  static std::shared_ptr<void> held;
  return held;
}
template <class T>
Stores<T> const& stores(Index tokens) {
  std::shared_ptr<void>& held = held_stores();
  static Stores<T>* mine = nullptr;  // valid while `held` holds it
  if (mine == nullptr || held.get() != mine || mine->tokens != tokens) {
    held.reset();
    mine = nullptr;
    auto built = std::make_shared<Stores<T>>(tokens);
    mine = built.get();
    held = std::move(built);
  }
  return *mine;
}

/// The serial backend for 1 thread, else a pool's.
struct Threads {
  kvc::ThreadPool pool;
  kvc::Cpu cpu;
  explicit Threads(Index n) : pool(n), cpu(n > 1 ? pool.cpu() : kvc::Cpu{}) {}
};

template <class T>
void attend(benchmark::State& state, bool ragged) {
  Index const tokens = state.range(0);
  Threads threads(state.range(1));
  auto const& s = stores<T>(tokens);
  kvc::KVExtents const qe{1, query_heads, 1, dim};
  auto const q = kvc::tools::random_values<float>(qe.rows() * dim, 7);
  std::vector<float> out(q.size()), lse(static_cast<std::size_t>(qe.rows()));
  // Post-RoPE queries at the context's end (kvc::context_end): every kept slot is visible.
  kvc::AttendQueries<float> const queries{kvc::bhtd_rows(q.data(), qe)};
  kvc::Attention const op{};
  auto run = [&](auto const& cache) {
    std::vector<std::byte> ws(kvc::attend_workspace_bytes(threads.cpu, op, queries, cache));
    for (auto _ : state) {
      auto const st = kvc::attend(threads.cpu, op, queries, cache, kvc::AttendOutput<>{out.data(), lse.data()},
                                  {ws.data(), ws.size()});
      benchmark::DoNotOptimize(st);
      benchmark::DoNotOptimize(out.data());
    }
  };
  if (ragged)
    run(s.ragged.view());
  else
    run(s.uniform.view());
  kvc::bench::report(state, s.kept_bytes(), static_cast<double>(s.kept()));
  auto const [lo, hi] = std::minmax_element(s.counts.begin(), s.counts.end());
  state.counters["kept_min"] = static_cast<double>(*lo) / static_cast<double>(tokens);
  state.counters["kept_max"] = static_cast<double>(*hi) / static_cast<double>(tokens);
  state.counters["kept_mean"] = static_cast<double>(s.kept()) / static_cast<double>(heads * tokens);
}

/// Sums the bytes [first, last) in 64 independent byte lanes (vectorises to one add per 64 bytes: bound by memory).
std::uint8_t byte_sum(unsigned char const* first, unsigned char const* last) {
  std::uint8_t acc[64] = {};
  auto const n = static_cast<std::size_t>(last - first) / 64 * 64;
  for (std::size_t i = 0; i < n; i += 64)
    for (std::size_t j = 0; j < 64; ++j)
      acc[j] = static_cast<std::uint8_t>(acc[j] + first[i + j]);
  std::uint8_t total = 0;
  for (auto a : acc)
    total = static_cast<std::uint8_t>(total + a);
  return total;
}

template <class T>
void read_bound(benchmark::State& state) {
  Index const tokens = state.range(0);
  Threads threads(state.range(1));
  auto const& s = stores<T>(tokens);
  auto const* k = reinterpret_cast<unsigned char const*>(s.ragged.k.data());
  auto const* v = reinterpret_cast<unsigned char const*>(s.ragged.v.data());
  std::size_t const bytes = s.ragged.k.size() * sizeof(T);  // K and V hold the same number of bytes here
  constexpr Index chunks = 256;                             // per buffer
  std::vector<std::uint8_t> sums(2 * chunks);
  for (auto _ : state) {
    kvc::detail::parallel_for(threads.cpu, 2 * chunks, [&](Index item, Index) {
      auto const* base = item < chunks ? k : v;
      auto const c = static_cast<std::size_t>(item % chunks);
      sums[static_cast<std::size_t>(item)] = byte_sum(base + bytes * c / chunks, base + bytes * (c + 1) / chunks);
    });
    benchmark::DoNotOptimize(sums.data());
  }
  kvc::bench::report(state, s.kept_bytes(), static_cast<double>(s.kept()));
}

/// threads:1 runs serially and is timed in CPU time (robust on a shared host); threads:2 in real time.
void one_thread(benchmark::internal::Benchmark* b) {
  b->ArgNames({"tokens", "threads"})->Args({32768, 1})->Args({131072, 1})->Unit(benchmark::kMillisecond);
}
void two_threads(benchmark::internal::Benchmark* b) {
  b->ArgNames({"tokens", "threads"})->Args({32768, 2})->Args({131072, 2})->Unit(benchmark::kMillisecond);
  b->MeasureProcessCPUTime()->UseRealTime();
}

template <class T>
int register_attention(std::string const& dtype) {
  for (auto const apply : {one_thread, two_threads}) {
    benchmark::RegisterBenchmark(("BM_RaggedAttend/" + dtype + "/ragged").c_str(), [](benchmark::State& st) {
      attend<T>(st, true);
    })->Apply(apply);
    benchmark::RegisterBenchmark(("BM_RaggedAttend/" + dtype + "/uniform").c_str(), [](benchmark::State& st) {
      attend<T>(st, false);
    })->Apply(apply);
    benchmark::RegisterBenchmark(("BM_RaggedRead/" + dtype).c_str(), [](benchmark::State& st) {
      read_bound<T>(st);
    })->Apply(apply);
  }
  return 0;
}

int const registered_attention = (register_attention<kvc::half>("fp16"), register_attention<kvc::bfloat16>("bf16"),
                                  register_attention<float>("fp32"));

/// Runs `select_or_allocate` over layer_scores(tokens) and reports scores/s and bytes/s of one read of the scores.
template <class Fn>
void over_scores(benchmark::State& state, Fn&& fn) {
  Index const tokens = state.range(0);
  auto const& scores = layer_scores(tokens);
  kvc::ScoreSpan<> const span{const_cast<float*>(scores.data()), 1, heads, tokens};
  fn(span);
  state.SetBytesProcessed(static_cast<std::int64_t>(scores.size() * sizeof(float)) * state.iterations());
  state.counters["scores/s"] =
      benchmark::Counter(static_cast<double>(scores.size()), benchmark::Counter::kIsIterationInvariantRate);
}

void ada_kv_allocate(benchmark::State& state, kvc::Reference reference) {
  over_scores(state, [&](kvc::ScoreSpan<> const& span) {
    kvc::AdaKVSelector const sel{kvc::RatioBudget{0.5}, 0.2, reference};
    std::vector<Index> table(static_cast<std::size_t>(heads));
    std::vector<std::byte> ws(kvc::allocate_workspace_bytes(kvc::Cpu{}, sel, 1, heads, span.tokens));
    for (auto _ : state) {
      auto const st = kvc::allocate(kvc::Cpu{}, sel, span, table.data(), {ws.data(), ws.size()});
      benchmark::DoNotOptimize(st);
      benchmark::DoNotOptimize(table.data());
    }
  });
}

template <class Sel>
void select(benchmark::State& state, Sel const& sel) {
  over_scores(state, [&](kvc::ScoreSpan<> const& span) {
    std::vector<Index> index(static_cast<std::size_t>(heads * span.tokens)), count(static_cast<std::size_t>(heads));
    std::vector<std::byte> ws(kvc::select_workspace_bytes(kvc::Cpu{}, sel, 1, heads, span.tokens));
    for (auto _ : state) {
      auto const st =
          kvc::select(kvc::Cpu{}, sel, span, kvc::KeepPlan<>{index.data(), count.data(), 1, heads, span.tokens},
                      {ws.data(), ws.size()});
      benchmark::DoNotOptimize(st);
      benchmark::DoNotOptimize(index.data());
    }
  });
}

void score_args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"tokens"})->Arg(32768)->Arg(131072)->Unit(benchmark::kMillisecond);
}

int const registered_ada_kv = [] {
  for (auto const reference : {kvc::Reference::authors, kvc::Reference::kvpress}) {
    std::string const name = reference == kvc::Reference::authors ? "authors" : "kvpress";
    benchmark::RegisterBenchmark(("BM_AdaKV_Allocate/" + name).c_str(), [reference](benchmark::State& st) {
      ada_kv_allocate(st, reference);
    })->Apply(score_args);
    benchmark::RegisterBenchmark(("BM_AdaKV_Select/" + name).c_str(), [reference](benchmark::State& st) {
      select(st, kvc::AdaKVSelector{kvc::RatioBudget{0.5}, 0.2, reference});
    })->Apply(score_args);
  }
  benchmark::RegisterBenchmark("BM_AdaKV_TopK", [](benchmark::State& st) {
    select(st, kvc::TopKSelector{kvc::RatioBudget{0.5}});
  })->Apply(score_args);
  return 0;
}();

}  // namespace
