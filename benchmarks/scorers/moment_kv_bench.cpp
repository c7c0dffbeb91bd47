// SPDX-License-Identifier: Apache-2.0
// benchmarks/scorers/moment_kv_bench.cpp mirrors include/kvc/scorers/moment_kv.hpp and include/kvc/attention/
// corrected.hpp: MomentKV's three kernels at the shapes, L = 128 ... 1024 retained tokens per KV head,
// d = 128, Hkv = 8, Hq = 32 (g = 4), each next to what bounds it, from the same run:
//  - BM_MomentKV_Attend/<cache dtype>/<plain|corrected|corrected_m16>: one decode query row per query head over the
//    [1, 8, L, 128] cache: kvc::attend, and kvc::attend_corrected with fp32 (`corrected`) or fp16 (`corrected_m16`)
//    moments of a non-empty evicted set. The correction adds O(d²) per query head (C̃q) and reads the moments
//    (65 KiB per KV head in fp32, 33 KiB in fp16) once per KV head; the goal is corrected <= 1.3x plain.
//  - BM_MomentKV_Score/<dtype>/<recompute|cached>: the MI residual over the L slots of every head (fixed base, so
//    only MomentKV's own work is timed): `recompute` is U = K C̃ᵀ, an [L x 128]·[128 x 128] product per head, then
//    ‖V − v̄ − (c/n)U‖ per row; `cached` reads the u_j rows instead (O(L d)).
//    BM_MomentKV_EigenProduct: that product alone in Eigen (fp32, the same shapes): the MI score's compute bound.
//  - BM_MomentKV_Fold/<dtype>/<one|half>: kvc::on_evict folding one token (a decode step) or L/2 tokens (a
//    prefill round) per head into fp32 moments; BM_MomentKV_FoldProduct: the block's [128 x m]·[m x 128] product
//    alone in Eigen.
// Serial kvc::Cpu{} throughout (CPU time).
#include <kvc/backend/cpu/attention/corrected.hpp>
#include <kvc/backend/cpu/scorers/moment_kv.hpp>
#include <kvc/scorers/moments.hpp>

#include "bench_support.hpp"
#include "common/moment_kv.hpp"

#include <Eigen/Core>
#include <benchmark/benchmark.h>

#include <cstddef>
#include <numeric>
#include <vector>

namespace {

using kvc::Index;
constexpr Index heads = kvc::bench::kv_heads, query_heads = kvc::bench::query_heads, dim = kvc::bench::head_dim;

void lengths(benchmark::internal::Benchmark* b) {
  b->ArgName("L")->Arg(128)->Arg(256)->Arg(512)->Arg(1024)->Unit(benchmark::kMicrosecond);
}

/// Moments of a non-empty evicted set (n = 1000, random means and co-moment), stored as M.
template <class M>
kvc::tools::HostMoments<M> moments() {
  kvc::tools::HostMoments<M> m(1, heads, dim, dim);
  kvc::tools::Rng rng(7);
  for (auto& x : m.count)
    x = 1000;
  for (auto& x : m.key_mean)
    x = kvc::from_float<M>(0.3f * rng.normal());
  for (auto& x : m.value_mean)
    x = kvc::from_float<M>(0.1f * rng.normal());
  for (auto& x : m.comoment)
    x = kvc::from_float<M>(30.0f * rng.normal());
  return m;
}

/// One decode query row per query head, [1, 32, 1, 128] fp32.
std::vector<float> const& decode_queries() {
  static std::vector<float> const q = [] {
    std::vector<float> v(static_cast<std::size_t>(query_heads * dim));
    kvc::tools::Rng rng(3);
    for (float& x : v)
      x = rng.normal() * 0.3f;
    return v;
  }();
  return q;
}

template <class T, class M>
void attend_bench(benchmark::State& state, bool corrected) {
  auto const& c = kvc::bench::cache<T>(state.range(0), dim);
  auto const m = moments<M>();
  kvc::AttendQueries<float> const q{
      {decode_queries().data(), kvc::bhtd_layout(kvc::KVExtents{1, query_heads, 1, dim})}};
  std::vector<float> out(static_cast<std::size_t>(query_heads * dim)), lse(query_heads);
  kvc::CorrectedAttention const op{};
  std::vector<std::byte> ws(corrected ? kvc::attend_corrected_workspace_bytes(kvc::Cpu{}, op, q, c.view(), m.view)
                                      : kvc::attend_workspace_bytes(kvc::Cpu{}, op.attention, q, c.view()));
  for (auto _ : state) {
    kvc::Status const st = corrected ? kvc::attend_corrected(kvc::Cpu{}, op, q, c.view(), m.view,
                                                             {out.data(), lse.data()}, {ws.data(), ws.size()})
                                     : kvc::attend(kvc::Cpu{}, op.attention, q, c.view(), {out.data(), lse.data()},
                                                   {ws.data(), ws.size()});
    benchmark::DoNotOptimize(st);
    benchmark::DoNotOptimize(out.data());
  }
  // bytes/s: the kept K and V, read once.
  kvc::bench::report(state, static_cast<double>((c.k.size() + c.v.size()) * sizeof(T)),
                     static_cast<double>(c.ext.rows()));
}

template <class T>
void score_bench(benchmark::State& state, bool cached) {
  auto const& c = kvc::bench::cache<T>(state.range(0), dim);
  auto const m = moments<float>();
  Index const n = c.ext.tokens;
  std::vector<float> base(static_cast<std::size_t>(heads * n), 1.0f), out(base.size());
  std::vector<float> rows(static_cast<std::size_t>(heads * n * dim), 0.01f);
  std::vector<Index> tracked(heads, n), age(heads, 0);
  kvc::MomentKVScorer<> s{m.view};
  s.fixed_base = {base.data(), 1, heads, n};
  if (cached)
    s.residuals = {{rows.data(), kvc::bhtd_layout(kvc::KVExtents{1, heads, n, dim})}, tracked.data(), age.data(), 64};
  // A window of one query row satisfies the scorer's needs; the fixed base means it is not read.
  auto const obs = kvc::observe(
      kvc::WindowQueries<float>{{decode_queries().data(), kvc::bhtd_layout(kvc::KVExtents{1, query_heads, 1, dim})}});
  std::vector<std::byte> ws(kvc::score_workspace_bytes(kvc::Cpu{}, s, c.ext, obs));
  kvc::ScoreSpan<> span{out.data(), 1, heads, n};
  for (auto _ : state) {
    auto const st = kvc::score(kvc::Cpu{}, s, c.view(), obs, span, {ws.data(), ws.size()});
    benchmark::DoNotOptimize(st);
    benchmark::DoNotOptimize(out.data());
  }
  kvc::bench::report(state, static_cast<double>((c.k.size() + c.v.size()) * sizeof(T)), static_cast<double>(n * heads));
  state.counters["FLOP/s"] = benchmark::Counter(cached ? 0.0 : 2.0 * static_cast<double>(heads * n * dim * dim),
                                                benchmark::Counter::kIsIterationInvariantRate);
}

/// The MI score's product alone: per head, U = K C̃ᵀ, [L x 128]·[128 x 128] fp32, in 64-row tiles as the kernel.
void BM_MomentKV_EigenProduct(benchmark::State& state) {
  Index const n = state.range(0);
  using RowMatrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  RowMatrix const k = RowMatrix::Random(n, dim), c = RowMatrix::Random(dim, dim);
  RowMatrix u(64, dim);
  for (auto _ : state) {
    for (Index h = 0; h < heads; ++h)
      for (Index t0 = 0; t0 < n; t0 += 64) {
        u.noalias() = k.middleRows(t0, 64) * c.transpose();
        benchmark::DoNotOptimize(u.data());
      }
  }
  state.counters["FLOP/s"] = benchmark::Counter(2.0 * static_cast<double>(heads * n * dim * dim),
                                                benchmark::Counter::kIsIterationInvariantRate);
}

template <class T>
void fold_bench(benchmark::State& state, bool half) {
  auto const& c = kvc::bench::cache<T>(state.range(0), dim);
  Index const n = c.ext.tokens, evict = half ? n / 2 : 1, keep = n - evict;
  kvc::tools::HostMoments<float> m(1, heads, dim, dim);
  kvc::MomentKVScorer<> s{m.view};
  std::vector<Index> index(static_cast<std::size_t>(heads * n)), count(heads, keep);
  for (Index h = 0; h < heads; ++h)  // keep the first `keep` slots: the fold gathers the rest
    std::iota(index.begin() + h * n, index.begin() + h * n + keep, Index{0});
  kvc::KeepPlan<> const plan{index.data(), count.data(), 1, heads, n};
  std::vector<std::byte> ws(kvc::on_evict_workspace_bytes(kvc::Cpu{}, s, c.ext));
  for (auto _ : state) {
    auto const st = kvc::on_evict(kvc::Cpu{}, s, c.view(), plan, {ws.data(), ws.size()});
    benchmark::DoNotOptimize(st);
    benchmark::DoNotOptimize(m.comoment.data());
  }
  kvc::bench::report(state, static_cast<double>(heads * evict * 2 * dim * sizeof(T)),
                     static_cast<double>(heads * evict));
  state.counters["FLOP/s"] = benchmark::Counter(2.0 * static_cast<double>(heads * evict * dim * dim),
                                                benchmark::Counter::kIsIterationInvariantRate);
}

/// The block fold's product alone: per head, C_B += V_cᵀ K_c over L/2 evicted rows, [128 x m]·[m x 128] fp32.
void BM_MomentKV_FoldProduct(benchmark::State& state) {
  Index const m = state.range(0) / 2;
  using RowMatrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  RowMatrix const k = RowMatrix::Random(m, dim), v = RowMatrix::Random(m, dim);
  RowMatrix cb(dim, dim);
  for (auto _ : state) {
    for (Index h = 0; h < heads; ++h) {
      cb.setZero();
      for (Index t0 = 0; t0 < m; t0 += 64) {
        Index const r = std::min<Index>(64, m - t0);
        cb.noalias() += v.middleRows(t0, r).transpose() * k.middleRows(t0, r);
      }
      benchmark::DoNotOptimize(cb.data());
    }
  }
  state.counters["FLOP/s"] = benchmark::Counter(2.0 * static_cast<double>(heads * m * dim * dim),
                                                benchmark::Counter::kIsIterationInvariantRate);
}

int const registered = [] {
  auto add = [](char const* name, auto fn) { benchmark::RegisterBenchmark(name, fn)->Apply(lengths); };
  using kvc::half;
  add("BM_MomentKV_Attend/fp32/plain", [](benchmark::State& s) { attend_bench<float, float>(s, false); });
  add("BM_MomentKV_Attend/fp32/corrected", [](benchmark::State& s) { attend_bench<float, float>(s, true); });
  add("BM_MomentKV_Attend/fp32/corrected_m16", [](benchmark::State& s) { attend_bench<float, half>(s, true); });
  add("BM_MomentKV_Attend/fp16/plain", [](benchmark::State& s) { attend_bench<half, float>(s, false); });
  add("BM_MomentKV_Attend/fp16/corrected", [](benchmark::State& s) { attend_bench<half, float>(s, true); });
  add("BM_MomentKV_Attend/fp16/corrected_m16", [](benchmark::State& s) { attend_bench<half, half>(s, true); });
  add("BM_MomentKV_Score/fp32/recompute", [](benchmark::State& s) { score_bench<float>(s, false); });
  add("BM_MomentKV_Score/fp32/cached", [](benchmark::State& s) { score_bench<float>(s, true); });
  add("BM_MomentKV_Score/fp16/recompute", [](benchmark::State& s) { score_bench<half>(s, false); });
  add("BM_MomentKV_Score/fp16/cached", [](benchmark::State& s) { score_bench<half>(s, true); });
  add("BM_MomentKV_EigenProduct", BM_MomentKV_EigenProduct);
  add("BM_MomentKV_Fold/fp32/one", [](benchmark::State& s) { fold_bench<float>(s, false); });
  add("BM_MomentKV_Fold/fp32/half", [](benchmark::State& s) { fold_bench<float>(s, true); });
  add("BM_MomentKV_Fold/fp16/one", [](benchmark::State& s) { fold_bench<half>(s, false); });
  add("BM_MomentKV_Fold/fp16/half", [](benchmark::State& s) { fold_bench<half>(s, true); });
  add("BM_MomentKV_FoldProduct", BM_MomentKV_FoldProduct);
  return 0;
}();

}  // namespace
