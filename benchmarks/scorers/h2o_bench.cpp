// SPDX-License-Identifier: Apache-2.0
// benchmarks/scorers/h2o_bench.cpp mirrors include/kvc/scorers/h2o.hpp: H2O's kvc::update (R new query rows folded
// into the accumulated attention: R = 1 per decode step, R = N for a prefill) and kvpress's ObservedAttention (one
// shot over all N prompt queries, in tiles of query_tile = 256 rows), both over the shared window attention of
// include/kvc/backend/cpu/detail/window_attention.hpp. Shapes: batch 1, Hq = 32 query heads over Hkv = 8 KV heads
// (g = 4), d = 128, fp32 post-RoPE queries, fp32 and fp16 caches.
//
// FLOP/s counts the kernel's two passes of the [g*R x N] logit product per KV head, 4 * Hq * R * N * d (the causal
// mask does not shrink it: the kernel computes every key tile and masks the ones past a query's position). The
// bound is the tiled Eigen product of the same shape, 2 * Hq * R * N * d FLOPs: BM_WindowGemm_Eigen/tiled/window:1
// (snap_kv_bench.cpp) for R = 1, and here BM_WindowGemm_Eigen/tiled for R = N = 4K, in [g*256 x 128] blocks (the
// scorer's query tile times the kernel's key tile). R = N costs 4 * Hq * N² * d: 275 GFLOP at 4K, 17.6 TFLOP at 32K,
// so R = N is registered at 4K only, and those cases run once (benchmark::Iterations(1), which also keeps them out
// of the ctest smoke filter). One more case is about memory, not speed: ObservedAttention at N = 32K with Hq = 4,
// Hkv = 1 (a 2.2 TFLOP call, ~20 s) reports the scorer's workspace (score_workspace_bytes), the peak resident memory
// the call added (VmHWM - VmRSS, with VmHWM reset through /proc/self/clear_refs just before, and the workspace in
// untouched mmap'd pages; absent where clear_refs is not writable), and the fp32 N x N attention matrix of one query
// head that the tiling avoids.
#include <kvc/backend/cpu/scorers/h2o.hpp>

#include "bench_support.hpp"

#include <benchmark/benchmark.h>

#include <cstddef>
#include <fstream>
#include <string>
#include <sys/mman.h>
#include <vector>

namespace {

using kvc::Index;
using kvc::bench::head_dim;
using kvc::bench::query_heads;

constexpr Index token_sizes[] = {4096, 32768, 131072};
constexpr Index query_tile = kvc::ObservedAttentionScorer{}.query_tile;  // H2OScorer's default is the same 256

/// kvc::update(H2OScorer): R new post-RoPE query rows (at the last R positions) over the cached [1, 8, N, 128] cache
/// of T, added into an fp32 accumulator [1, 8, N] that already tracks every slot (args: rows, tokens). bytes/s counts
/// the two reads of K (one per pass), the limit for R = 1; tokens/s the query rows folded in.
template <class T>
void BM_H2O_Update_Cpu(benchmark::State& state) {
  Index const rows = state.range(0), tokens = state.range(1);
  auto const& c = kvc::bench::cache<T>(tokens, head_dim);
  std::vector<float> acc(static_cast<std::size_t>(c.ext.rows()), 0.0f);
  std::vector<Index> tracked(static_cast<std::size_t>(c.ext.batch * c.ext.heads), tokens);
  kvc::H2OScorer<> scorer{};
  scorer.state = {{acc.data(), c.ext.batch, c.ext.heads, tokens}, tracked.data()};
  auto const obs = kvc::observe(kvc::WindowQueries<float>{kvc::bench::window_query_rows(query_heads, rows, head_dim)});
  std::vector<std::byte> ws(kvc::update_workspace_bytes(kvc::Cpu{}, scorer, c.ext, obs));
  for (auto _ : state) {
    auto const st = kvc::update(kvc::Cpu{}, scorer, c.view(), obs, {ws.data(), ws.size()});
    if (!st.ok()) {
      state.SkipWithError(st.message());
      break;
    }
    benchmark::DoNotOptimize(acc.data());
  }
  kvc::bench::report_flops(state, kvc::bench::window_attention_flops(query_heads, rows, tokens, head_dim));
  kvc::bench::report(state, 2.0 * static_cast<double>(c.k.size() * sizeof(T)), static_cast<double>(rows));
}

/// VmHWM or VmRSS of this process in bytes (/proc/self/status), -1 when unreadable.
double status_bytes(std::string const& key) {
  std::ifstream in("/proc/self/status");
  std::string word;
  while (in >> word)
    if (word == key + ":") {
      double kib = -1;
      in >> kib;
      return kib * 1024.0;
    }
  return -1;
}

/// Resets VmHWM to the current resident size (Linux: 5 > /proc/PID/clear_refs); false where not allowed.
bool reset_peak_rss() {
  std::ofstream out("/proc/self/clear_refs");
  out << "5";
  out.flush();
  return static_cast<bool>(out);
}

/// Untouched pages from the kernel (anonymous mmap), so that the resident memory grows by exactly the pages a kernel
/// writes or reads in them: unlike a std::vector, which zero-fills (touches) them, or may reuse resident heap memory.
class FreshPages {
 public:
  explicit FreshPages(std::size_t bytes) : bytes_(bytes > 0 ? bytes : 1) {
    void* p = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    data_ = p == MAP_FAILED ? nullptr : static_cast<std::byte*>(p);
  }
  FreshPages(FreshPages const&) = delete;
  FreshPages& operator=(FreshPages const&) = delete;
  ~FreshPages() {
    if (data_)
      munmap(data_, bytes_);
  }
  std::byte* data() const { return data_; }

 private:
  std::size_t bytes_;
  std::byte* data_ = nullptr;
};

/// ObservedAttention over the first `kv_heads` KV heads of the cached [1, 8, N, 128] cache of T, with `heads` query
/// heads of R = N window queries (every prompt query, positions 0 .. N-1; args: rows, tokens).
template <class T>
void BM_ObservedAttention_Cpu(benchmark::State& state, Index heads, Index kv_heads) {
  Index const rows = state.range(0), tokens = state.range(1);
  auto const& full = kvc::bench::cache<T>(tokens, head_dim);
  kvc::KVExtents const e{1, kv_heads, tokens, head_dim};  // the first heads of the BHTD buffers: no copy
  auto const cache = kvc::make_cache(kvc::bhtd_rows(full.k.data(), e), kvc::bhtd_rows(full.v.data(), e));
  auto const obs = kvc::observe(kvc::WindowQueries<float>{kvc::bench::window_query_rows(heads, rows, head_dim)});
  kvc::ObservedAttentionScorer const scorer{};
  std::vector<float> out(static_cast<std::size_t>(e.rows()));
  kvc::ScoreSpan<> const span{out.data(), e.batch, e.heads, e.tokens};
  // The peak memory the calls add: the workspace pages they touch, and whatever else they would allocate (heap
  // beyond what is resident already) or use on the stack.
  std::size_t const ws_bytes = kvc::score_workspace_bytes(kvc::Cpu{}, scorer, e, obs);
  FreshPages const ws(ws_bytes);
  if (ws.data() == nullptr) {
    state.SkipWithError("mmap failed");
    return;
  }
  bool const peak_known = reset_peak_rss();
  double const rss_before = status_bytes("VmRSS");
  for (auto _ : state) {
    auto const st = kvc::score(kvc::Cpu{}, scorer, cache, obs, span, {ws.data(), ws_bytes});
    if (!st.ok()) {
      state.SkipWithError(st.message());
      break;
    }
    benchmark::DoNotOptimize(out.data());
  }
  double const peak_after = status_bytes("VmHWM");
  using Counter = benchmark::Counter;
  auto bytes = [](double v) { return Counter(v, Counter::kDefaults, Counter::OneK::kIs1024); };
  double const matrix = 4.0 * static_cast<double>(tokens) * static_cast<double>(tokens);  // fp32 N x N, one head
  state.counters["workspace"] = bytes(static_cast<double>(ws_bytes));
  state.counters["attn_matrix_per_head"] = bytes(matrix);
  state.counters["matrix_over_workspace"] = matrix / static_cast<double>(ws_bytes);
  if (peak_known && rss_before >= 0 && peak_after >= 0)
    state.counters["peak_rss_added"] = bytes(peak_after - rss_before);
  kvc::bench::report_flops(state, kvc::bench::window_attention_flops(heads, rows, tokens, head_dim));
}

// ---- Registration: grouped by token count, so each cache is generated once per size ------------------------------

benchmark::internal::Benchmark* add(std::string const& name, benchmark::internal::Function* fn, Index rows,
                                    Index tokens) {
  return benchmark::RegisterBenchmark(name.c_str(), fn)
      ->Unit(benchmark::kMillisecond)
      ->ArgNames({"rows", "tokens"})
      ->Args({rows, tokens});
}

template <class T>
void observed_attention(benchmark::State& st) {
  BM_ObservedAttention_Cpu<T>(st, query_heads, kvc::bench::kv_heads);
}

int register_h2o_benchmarks() {
  for (Index tokens : token_sizes) {  // a decode step: one new query row per query head
    add("BM_H2O_Update_Cpu/fp32", BM_H2O_Update_Cpu<float>, 1, tokens);
    add("BM_H2O_Update_Cpu/fp16", BM_H2O_Update_Cpu<kvc::half>, 1, tokens);
    if (tokens == 32768)  // memory: ObservedAttention over 32K prompt queries, Hq = 4 over the cache's first head
      add(
          "BM_ObservedAttention_Cpu/fp32/memory_hq4_hkv1",
          [](benchmark::State& st) { BM_ObservedAttention_Cpu<float>(st, 4, 1); }, tokens, tokens)
          ->Iterations(1);
    if (tokens != 4096)
      continue;
    // Prefill, 4K only (275 GFLOP per call): H2O's update with every prompt row, ObservedAttention, and the product.
    add("BM_H2O_Update_Cpu/fp32", BM_H2O_Update_Cpu<float>, tokens, tokens)->Iterations(1);
    add("BM_H2O_Update_Cpu/fp16", BM_H2O_Update_Cpu<kvc::half>, tokens, tokens)->Iterations(1);
    add("BM_ObservedAttention_Cpu/fp32", observed_attention<float>, tokens, tokens)->Iterations(1);
    add("BM_ObservedAttention_Cpu/fp16", observed_attention<kvc::half>, tokens, tokens)->Iterations(1);
    benchmark::RegisterBenchmark("BM_WindowGemm_Eigen/tiled",
                                 [](benchmark::State& st) {
                                   Index const rows = st.range(0), group = query_heads / kvc::bench::kv_heads;
                                   kvc::bench::window_gemm(st, kvc::bench::window_queries(query_heads, rows, head_dim),
                                                           group * rows, group * st.range(2),
                                                           kvc::bench::cache<float>(st.range(1), head_dim), true);
                                 })
        ->Unit(benchmark::kMillisecond)
        ->ArgNames({"window", "tokens", "query_tile"})
        ->Args({tokens, tokens, query_tile})
        ->Iterations(1);
  }
  return 0;
}

int const registered = register_h2o_benchmarks();

}  // namespace
