// SPDX-License-Identifier: Apache-2.0
// tests/scorers/moment_kv_test.cpp mirrors include/kvc/scorers/moment_kv.hpp (CPU kernels in
// backend/cpu/scorers/moment_kv.hpp): MomentKV's moment-informed eviction score and the moment fold on eviction
// (shared/specs/moment_kv.md §2.3, §2.7, §9, §10 properties 1–5, 20–22, 28–30).
// References are double brute force in the test: r_j = v_j − v̄ − (c/n) C̃ k_j from two-pass moments of the raw
// evicted tokens (both from tests/support/moments.hpp), the base α from its definition (softmax of the window queries,
// group mean, chunk mean), and the folded moments from the raw evicted rows. The fp32 kernels are compared at ~1e-5
// relative.
#include <kvc/backend/cpu/pipeline/compact.hpp>
#include <kvc/backend/cpu/scorers/moment_kv.hpp>
#include <kvc/backend/cpu/selectors/top_k.hpp>
#include <kvc/backend/cpu/thread_pool.hpp>
#include <kvc/pipeline/moment_kv.hpp>

#include "common/synthetic.hpp"
#include "support/catch.hpp"
#include "support/helpers.hpp"
#include "support/moments.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

namespace {

using kvc::Index;

using namespace kvc::test;  // support/moments.hpp: Moments, brute_moments, close, ...

/// Runs kvc::score with `s` on `cache`, returning the [B, H, N] scores.
template <class S, class Cache>
std::vector<float> score_of(S const& s, Cache const& cache, kvc::test::OwnedQueries<float> const& q,
                            kvc::Cpu const& cpu = {}) {
  kvc::KVExtents const e = cache.keys.extents();
  kvc::test::OwnedScores out(e.batch, e.heads, e.tokens);
  auto const obs = kvc::observe(kvc::WindowQueries<float>{q.rows()});
  kvc::test::OwnedWorkspace ws(kvc::score_workspace_bytes(cpu, s, e, obs));
  kvc::Status const st = kvc::score(cpu, s, cache, obs, out.span, ws.get());
  INFO(st.message());
  REQUIRE(st.ok());
  return out.data;
}

/// Runs kvc::on_evict with the plan that keeps `keep[bh]` of each head.
template <class S, class Cache>
void evict(S const& s, Cache const& cache, std::vector<std::vector<Index>> const& keep, bool then_compact,
           kvc::Cpu const& cpu = {}) {
  kvc::KVExtents const e = cache.keys.extents();
  auto const plan = kvc::test::plan_of(e.batch, e.heads, e.tokens, keep);
  kvc::test::OwnedWorkspace ws(kvc::on_evict_workspace_bytes(cpu, s, e));
  kvc::Status const st = kvc::on_evict(cpu, s, cache, plan.plan, ws.get());
  INFO(st.message());
  REQUIRE(st.ok());
  if (then_compact)
    REQUIRE(kvc::compact(cpu, plan.plan, cache).ok());
}

std::vector<Index> complement(Index n, std::vector<Index> const& keep) {
  std::vector<Index> out;
  for (Index t = 0; t < n; ++t)
    if (!std::binary_search(keep.begin(), keep.end(), t))
      out.push_back(t);
  return out;
}

std::vector<float> random_base(Index n, std::uint64_t seed) {
  kvc::tools::Rng rng(seed);
  std::vector<float> b(static_cast<std::size_t>(n));
  for (auto& x : b)
    x = static_cast<float>(0.05 + rng.uniform());
  return b;
}

bool rel_close(double got, double want, double tol) {
  return std::abs(got - want) <= tol * std::max(1e-3, std::abs(want));
}

}  // namespace

// ---------------------------------------------------------------------------------------------------------------
// The MI score

TEST_CASE("moment_kv P21: with nothing evicted the score is alpha_j ||v_j|| (fixed base)") {
  kvc::KVExtents const e{2, 2, 11, 6};
  auto const cache = kvc::tools::HostCache<float>::random(e, 3, 4);
  OwnedMoments<> mom(2, 2, 6, 4);
  auto base = random_base(e.rows(), 4);
  kvc::MomentKVScorer<> s{mom.state};
  s.fixed_base = {base.data(), 2, 2, 11};
  auto const q = random_queries({2, 4, 2, 6}, 5, 1.0f);
  auto const out = score_of(s, cache.view(), q);
  for (Index bh = 0; bh < 4; ++bh)
    for (Index j = 0; j < 11; ++j) {
      double const want =
          base[static_cast<std::size_t>(bh * 11 + j)] * residual_norm(cache, bh / 2, bh % 2, j, Moments{}, 1.0, 0.0);
      CHECK(rel_close(out[static_cast<std::size_t>(bh * 11 + j)], want, 1e-5));
    }
}

TEST_CASE(
    "moment_kv P21: the decode base is the current query's softmax (group mean), the prefill base SnapKV's "
    "chunk-pooled window attention") {
  kvc::KVExtents const e{1, 2, 13, 8};
  auto cache = kvc::tools::HostCache<float>::random(e, 7);
  cache.track(13);
  OwnedMoments<> mom(1, 2, 8, 8);
  kvc::MomentKVScorer<> const prefill{mom.state};
  double const c = 1.0 / std::sqrt(8.0);
  // Causal softmax of query row (b, hq, i) at position p over slots 0..p of KV head hq / 2, in double.
  auto const q = random_queries({1, 4, 4, 8}, 9, 1.0f);
  auto prob = [&](Index hq, Index i, Index p, Index j) {
    double mx = -1e300, z = 0.0;
    std::vector<double> s(static_cast<std::size_t>(p + 1));
    for (Index t = 0; t <= p; ++t) {
      double d = 0.0;
      for (Index x = 0; x < 8; ++x)
        d += static_cast<double>(q.row(0, hq, i)[x]) * cache.k[static_cast<std::size_t>(((hq / 2) * 13 + t) * 8 + x)];
      s[static_cast<std::size_t>(t)] = c * d;
      mx = std::max(mx, c * d);
    }
    for (double v : s)
      z += std::exp(v - mx);
    return std::exp(s[static_cast<std::size_t>(j)] - mx) / z;
  };
  SECTION("decode: one window row, no pooling") {
    auto const s = prefill.decode();
    CHECK(s.base.window_size == 1);
    CHECK(s.base.kernel_size == 1);
    auto const out = score_of(s, cache.view(), q);  // the last row (i = 3) at position 12: slots 0..11 are scored
    for (Index h = 0; h < 2; ++h)
      for (Index j = 0; j < 12; ++j) {
        double const alpha = 0.5 * (prob(2 * h, 3, 12, j) + prob(2 * h + 1, 3, 12, j));
        CHECK(rel_close(out[static_cast<std::size_t>(h * 13 + j)],
                        alpha * residual_norm(cache, 0, h, j, Moments{}, c, 0), 1e-5));
      }
  }
  SECTION("prefill: window w = 4, aligned chunks of 4, group mean") {
    auto s = prefill;
    CHECK(s.base.kernel_size == 4);
    CHECK(s.base.pooling == kvc::Pooling::chunk_mean);
    s.base.window_size = 4;  // rows 0..3 at positions 9..12; prefix slots 0..8
    auto const out = score_of(s, cache.view(), q);
    for (Index h = 0; h < 2; ++h) {
      std::vector<double> raw(9, 0.0);
      for (Index j = 0; j < 9; ++j)
        for (Index i = 0; i < 4; ++i)
          raw[static_cast<std::size_t>(j)] += 0.5 * (prob(2 * h, i, 9 + i, j) + prob(2 * h + 1, i, 9 + i, j));
      for (Index j = 0; j < 9; ++j) {
        Index const c0 = j / 4 * 4, c1 = std::min<Index>(9, c0 + 4);
        double alpha = 0.0;
        for (Index t = c0; t < c1; ++t)
          alpha += raw[static_cast<std::size_t>(t)] / static_cast<double>(c1 - c0);
        CHECK(rel_close(out[static_cast<std::size_t>(h * 13 + j)],
                        alpha * residual_norm(cache, 0, h, j, Moments{}, c, 0), 1e-5));
      }
      for (Index j = 9; j < 13; ++j)  // the window's own slots outrank every prefix slot
        CHECK(out[static_cast<std::size_t>(h * 13 + j)] > 0.0f);
    }
  }
}

TEST_CASE(
    "moment_kv score: r_j = v_j - v-bar - (c/n) C k_j with the moments of an evicted set (GQA, d_k != d_v, "
    "fp32 and 16-bit states)") {
  kvc::KVExtents const e{2, 2, 14, 6};
  auto const cache = kvc::tools::HostCache<float>::random(e, 11, 5);
  auto const evicted = kvc::tools::HostCache<float>::random({2, 2, 9, 6}, 12, 5);  // the tokens already gone
  auto const q = random_queries({2, 4, 1, 6}, 13, 1.0f);
  auto base = random_base(e.rows(), 14);
  for (float scale : {0.0f, 0.7f}) {
    double const c = scale > 0 ? scale : 1.0 / std::sqrt(6.0);
    std::vector<Moments> truth;
    for (Index bh = 0; bh < 4; ++bh)
      truth.push_back(brute_moments(evicted, bh / 2, bh % 2,
                                    bh == 1 ? std::vector<Index>{} : std::vector<Index>{0, 2, 3, 5, 6, 8}));
    auto check_with = [&](auto& mom, double tol) {
      for (Index bh = 0; bh < 4; ++bh)
        mom.set(bh, truth[static_cast<std::size_t>(bh)]);
      auto s =
          kvc::MomentKVScorer<kvc::HostSpace, typename std::remove_reference_t<decltype(mom)>::value_type>{mom.state};
      s.scale = scale;
      s.fixed_base = {base.data(), 2, 2, 14};
      auto const out = score_of(s, cache.view(), q);
      for (Index bh = 0; bh < 4; ++bh) {
        Moments const stored = mom.get(bh);  // what the kernel reads (rounded to its type)
        for (Index j = 0; j < 14; ++j) {
          double const want =
              base[static_cast<std::size_t>(bh * 14 + j)] * residual_norm(cache, bh / 2, bh % 2, j, stored, c, 1e-6);
          CHECK(rel_close(out[static_cast<std::size_t>(bh * 14 + j)], want, tol));
        }
      }
    };
    OwnedMoments<float> f(2, 2, 6, 5);
    check_with(f, 2e-5);
    OwnedMoments<kvc::half> hm(2, 2, 6, 5);
    check_with(hm, 2e-5);
    OwnedMoments<kvc::bfloat16> bm(2, 2, 6, 5);
    check_with(bm, 2e-5);
  }
}

TEST_CASE("moment_kv P20: the score reads C with entries below clamp_tau as zero") {
  // One slot, d = 2: k = (1, 1), v = (0, 0); n = 1, k̄ = v̄ = 0, C = [[4e-7, 0.5], [-3e-7, 2e-6]], c = 1.
  std::vector<float> k{1.0f, 1.0f}, v{0.0f, 0.0f};
  auto const cache = kvc::dense_cache(k.data(), v.data(), {1, 1, 1, 2});
  std::vector<Index> n{1};
  std::vector<float> km{0, 0}, vm{0, 0}, cm{4e-7f, 0.5f, -3e-7f, 2e-6f};
  std::vector<float> base{1.0f};
  kvc::test::OwnedQueries<float> q({1, 1, 1, 2});
  for (float tau : {1e-6f, 0.0f}) {
    kvc::MomentKVScorer<> s{{n.data(), km.data(), vm.data(), cm.data(), 1, 1, 2, 2}};
    s.scale = 1.0f;
    s.clamp_tau = tau;
    s.fixed_base = {base.data(), 1, 1, 1};
    auto const out = score_of(s, cache, q);
    double const r0 = tau > 0 ? 0.5 : 0.5 + 4e-7, r1 = tau > 0 ? 2e-6 : 2e-6 - 3e-7;  // r = −C̃ k
    CHECK(rel_close(out[0], std::sqrt(r0 * r0 + r1 * r1), 1e-6));
  }
}

TEST_CASE(
    "moment_kv P22: a token the affine model explains (r_j = 0) scores 0 and is evicted first unless "
    "protected") {
  kvc::KVExtents const e{1, 1, 10, 4};
  auto cache = kvc::tools::HostCache<float>::random(e, 21);
  auto const gone = kvc::tools::HostCache<float>::random(e, 22);
  Moments const m = brute_moments(gone, 0, 0, {0, 1, 2, 3, 4, 5, 6});
  double const c = 0.5;  // 1 / sqrt(4)
  Index const j = 6;
  for (Index a = 0; a < 4; ++a) {  // v_j := v̄ + (c/n) C k_j
    double pred = m.vm[static_cast<std::size_t>(a)];
    for (Index x = 0; x < 4; ++x)
      pred += c / 7.0 * m.C[static_cast<std::size_t>(a * 4 + x)] * cache.k[static_cast<std::size_t>(j * 4 + x)];
    cache.v[static_cast<std::size_t>(j * 4 + a)] = static_cast<float>(pred);
  }
  OwnedMoments<> mom(1, 1, 4, 4);
  mom.set(0, m);
  std::vector<float> base(10, 1.0f);
  base[static_cast<std::size_t>(j)] = 5.0f;  // even with the largest attention weight
  kvc::MomentKVScorer<> s{mom.state};
  s.clamp_tau = 0.0f;
  s.fixed_base = {base.data(), 1, 1, 10};
  auto const q = random_queries({1, 1, 1, 4}, 23, 1.0f);
  kvc::test::OwnedScores out(1, 1, 10);
  out.data = score_of(s, cache.view(), q);
  out.span.data = out.data.data();
  CHECK(std::abs(out.data[static_cast<std::size_t>(j)]) <= 1e-5f);
  for (Index t = 0; t < 10; ++t)
    if (t != j)
      CHECK(out.data[static_cast<std::size_t>(t)] > 1e-2f);
  auto select = [&](Index n_recent) {
    kvc::TopKSelector<kvc::FixedBudget> const sel{{9}, 0, n_recent};
    kvc::test::OwnedPlan plan(1, 1, 10);
    kvc::test::OwnedWorkspace ws(kvc::select_workspace_bytes(kvc::Cpu{}, sel, 1, 1, 10));
    REQUIRE(kvc::select(kvc::Cpu{}, sel, out.span, plan.plan, ws.get()).ok());
    return complement(10, plan.kept(0, 0));
  };
  CHECK(select(0) == std::vector<Index>{j});
  std::vector<Index> const protected_out = select(4);  // slots 6..9 protected: the next lowest goes instead
  REQUIRE(protected_out.size() == 1);
  CHECK(protected_out[0] != j);
  Index lowest = 0;
  for (Index t = 1; t < 6; ++t)
    if (out.data[static_cast<std::size_t>(t)] < out.data[static_cast<std::size_t>(lowest)])
      lowest = t;
  CHECK(protected_out[0] == lowest);
}

// ---------------------------------------------------------------------------------------------------------------
// The moment fold on eviction

TEST_CASE(
    "moment_kv P1 P4: on_evict folds the plan's complement: count, means and co-moment equal the brute force "
    "of the evicted rows (one block, then more blocks, then single tokens)") {
  kvc::KVExtents const e{2, 2, 150, 6};  // > 64 evicted rows: more than one tile of the block product
  auto cache = kvc::tools::HostCache<float>::random(e, 31, 5);
  for (std::size_t i = 0; i < cache.k.size(); i += 6)
    cache.k[i] += 4.0f;  // an offset channel, as real keys have
  cache.track(150);
  auto const original = cache;
  OwnedMoments<> mom(2, 2, 6, 5);
  kvc::MomentKVScorer<> const s{mom.state};
  // Head i keeps every (i + 2)-th slot: evicted counts differ per head.
  std::vector<std::vector<Index>> keep(4);
  std::vector<std::vector<Index>> positions_gone(4);  // original slots evicted so far
  for (Index bh = 0; bh < 4; ++bh) {
    for (Index t = 0; t < 150; t += bh + 2)
      keep[static_cast<std::size_t>(bh)].push_back(t);
    positions_gone[static_cast<std::size_t>(bh)] = complement(150, keep[static_cast<std::size_t>(bh)]);
  }
  evict(s, cache.view(), keep, true);
  for (Index bh = 0; bh < 4; ++bh) {
    Moments const want = brute_moments(original, bh / 2, bh % 2, positions_gone[static_cast<std::size_t>(bh)]);
    CHECK(close(mom.get(bh), want, 1e-5));
    CHECK(mom.count[static_cast<std::size_t>(bh)] + cache.lengths[static_cast<std::size_t>(bh)] == 150);
  }
  // A second block merges into the first (Chan): evict the first half of what is left.
  for (int round = 0; round < 2; ++round) {
    std::vector<std::vector<Index>> keep2(4);
    for (Index bh = 0; bh < 4; ++bh) {
      auto const pos = cache.head_positions(bh / 2, bh % 2);
      Index const n = static_cast<Index>(pos.size());
      for (Index t = round == 0 ? n / 2 : 1; t < n; ++t)  // round 1: evict exactly one token
        keep2[static_cast<std::size_t>(bh)].push_back(t);
      for (Index t = 0; t < (round == 0 ? n / 2 : 1); ++t)
        positions_gone[static_cast<std::size_t>(bh)].push_back(pos[static_cast<std::size_t>(t)]);
    }
    evict(s, cache.view(), keep2, true);
    for (Index bh = 0; bh < 4; ++bh) {
      Moments const want = brute_moments(original, bh / 2, bh % 2, positions_gone[static_cast<std::size_t>(bh)]);
      CHECK(close(mom.get(bh), want, 1e-5));
      CHECK(mom.count[static_cast<std::size_t>(bh)] + cache.lengths[static_cast<std::size_t>(bh)] == 150);
    }
  }
  // The sums: n k̄ + Σ_R k = Σ_all k (and for v), in fp32 tolerance.
  for (Index bh = 0; bh < 4; ++bh) {
    auto const pos = cache.head_positions(bh / 2, bh % 2);
    Moments const all = brute_moments(original, bh / 2, bh % 2, complement(150, {}));
    Moments const kept = brute_moments(original, bh / 2, bh % 2, pos);
    Moments const got = mom.get(bh);
    for (Index x = 0; x < 6; ++x) {
      double const total = 150.0 * all.km[static_cast<std::size_t>(x)];
      double const sum = static_cast<double>(got.n) * got.km[static_cast<std::size_t>(x)] +
                         static_cast<double>(kept.n) * kept.km[static_cast<std::size_t>(x)];
      CHECK(std::abs(sum - total) <= 1e-5 * std::max(1.0, std::abs(total)) * 150);
    }
  }
}

TEST_CASE("moment_kv P3: the order and grouping of evictions do not change the folded moments") {
  kvc::KVExtents const e{1, 1, 40, 4};
  auto const src = kvc::tools::HostCache<float>::random(e, 41, 3);
  std::vector<Index> const gone{1, 4, 5, 9, 13, 14, 20, 22, 23, 30, 31, 35, 39};
  Moments const want = brute_moments(src, 0, 0, gone);
  // (a) one block; (b) one token at a time, highest slot first; (c) blocks of 3 from the lowest.
  for (int how = 0; how < 3; ++how) {
    auto cache = src;
    cache.track(40);
    OwnedMoments<> mom(1, 1, 4, 3);
    kvc::MomentKVScorer<> const s{mom.state};
    std::vector<Index> left = gone;
    if (how == 1)
      std::reverse(left.begin(), left.end());
    while (!left.empty()) {
      Index const take = how == 0   ? static_cast<Index>(left.size())
                         : how == 1 ? 1
                                    : std::min<Index>(3, static_cast<Index>(left.size()));
      std::vector<Index> now(left.begin(), left.begin() + take);
      left.erase(left.begin(), left.begin() + take);
      auto const pos = cache.head_positions(0, 0);
      std::vector<Index> keep;
      for (std::size_t t = 0; t < pos.size(); ++t)
        if (std::find(now.begin(), now.end(), pos[t]) == now.end())
          keep.push_back(static_cast<Index>(t));
      evict(s, cache.view(), {keep}, true);
    }
    CHECK(close(mom.get(0), want, 1e-5));
  }
}

TEST_CASE("moment_kv on_evict: 16-bit states round the fp32 fold once per update") {
  kvc::KVExtents const e{1, 2, 30, 8};
  auto cache = kvc::tools::HostCache<float>::random(e, 51);
  cache.track(30);
  std::vector<std::vector<Index>> const keep{{0, 3, 7, 8, 20, 29}, {1, 2, 3, 4, 5, 6, 7, 8, 9, 10}};
  OwnedMoments<kvc::half> mh(1, 2, 8, 8);
  OwnedMoments<kvc::bfloat16> mb(1, 2, 8, 8);
  auto c1 = cache;
  auto c2 = cache;
  evict(kvc::MomentKVScorer<kvc::HostSpace, kvc::half>{mh.state}, c1.view(), keep, false);
  evict(kvc::MomentKVScorer<kvc::HostSpace, kvc::bfloat16>{mb.state}, c2.view(), keep, false);
  for (Index h = 0; h < 2; ++h) {
    Moments const want = brute_moments(cache, 0, h, complement(30, keep[static_cast<std::size_t>(h)]));
    CHECK(close(mh.get(h), want, 2e-3));    // half: 11-bit mantissa
    CHECK(close(mb.get(h), want, 1.6e-2));  // bfloat16: 8-bit mantissa
    CHECK(mh.count[static_cast<std::size_t>(h)] == want.n);
    CHECK(mb.count[static_cast<std::size_t>(h)] == want.n);
  }
}

TEST_CASE("moment_kv P28: padding never enters the moments or the scores, and sequences are independent") {
  kvc::KVExtents const e{2, 2, 12, 4};
  auto cache = kvc::tools::HostCache<float>::random(e, 61);
  cache.track(12);
  cache.lengths = {9, 12, 7, 10};
  for (Index bh = 0; bh < 4; ++bh)  // NaN padding
    for (Index t = cache.lengths[static_cast<std::size_t>(bh)]; t < 12; ++t)
      for (Index x = 0; x < 4; ++x) {
        cache.k[static_cast<std::size_t>((bh * 12 + t) * 4 + x)] = std::nanf("");
        cache.v[static_cast<std::size_t>((bh * 12 + t) * 4 + x)] = std::nanf("");
      }
  auto const original = cache;
  std::vector<std::vector<Index>> const keep{{0, 1, 2, 3}, {0, 5, 11}, {6}, {2, 3, 4, 5, 6, 7, 8, 9}};
  OwnedMoments<> mom(2, 2, 4, 4);
  kvc::MomentKVScorer<> s{mom.state};
  evict(s, cache.view(), keep, false);
  for (Index bh = 0; bh < 4; ++bh) {
    auto gone = complement(cache.lengths[static_cast<std::size_t>(bh)], keep[static_cast<std::size_t>(bh)]);
    CHECK(close(mom.get(bh), brute_moments(original, bh / 2, bh % 2, gone), 1e-5));
  }
  auto base = random_base(e.rows(), 62);
  s.fixed_base = {base.data(), 2, 2, 12};
  auto const q = random_queries({2, 2, 1, 4}, 63, 1.0f);
  auto const scores = score_of(s, cache.view(), q);
  for (Index bh = 0; bh < 4; ++bh)
    for (Index t = 0; t < 12; ++t) {
      float const x = scores[static_cast<std::size_t>(bh * 12 + t)];
      if (t < cache.lengths[static_cast<std::size_t>(bh)])
        CHECK(std::isfinite(x));
      else
        CHECK(x == -std::numeric_limits<float>::infinity());
    }
  // Sequence 1 changed (cache, moments, base): sequence 0's stats and scores stay bit-identical.
  auto other = kvc::tools::HostCache<float>::random(e, 64);
  other.track(12);
  other.lengths = {9, 12, 12, 3};
  std::copy(original.k.begin(), original.k.begin() + 2 * 12 * 4, other.k.begin());
  std::copy(original.v.begin(), original.v.begin() + 2 * 12 * 4, other.v.begin());
  OwnedMoments<> mom2(2, 2, 4, 4);
  kvc::MomentKVScorer<> s2{mom2.state};
  evict(s2, other.view(), {keep[0], keep[1], {0, 1}, {2}}, false);
  CHECK(std::equal(mom2.km.begin(), mom2.km.begin() + 8, mom.km.begin()));
  CHECK(std::equal(mom2.vm.begin(), mom2.vm.begin() + 8, mom.vm.begin()));
  CHECK(std::equal(mom2.cm.begin(), mom2.cm.begin() + 32, mom.cm.begin()));
  auto base2 = random_base(e.rows(), 65);
  std::copy(base.begin(), base.begin() + 24, base2.begin());
  s2.fixed_base = {base2.data(), 2, 2, 12};
  auto const scores2 = score_of(s2, other.view(), q);
  CHECK(std::equal(scores.begin(), scores.begin() + 24, scores2.begin()));
}

TEST_CASE("moment_kv P30 (CPU stand-in): scores and the fold are the same on a thread pool as serially") {
  // No CUDA kernel for MomentKV exists yet: parity is checked between the CPU's serial and parallel paths.
  kvc::KVExtents const e{2, 3, 90, 8};
  auto cache = kvc::tools::HostCache<float>::random(e, 71, 6);
  cache.track(90);
  std::vector<std::vector<Index>> keep(6);
  for (Index bh = 0; bh < 6; ++bh)
    for (Index t = bh; t < 90; t += 3)
      keep[static_cast<std::size_t>(bh)].push_back(t);
  OwnedMoments<> serial(2, 3, 8, 6), parallel(2, 3, 8, 6);
  kvc::ThreadPool pool(3);
  evict(kvc::MomentKVScorer<>{serial.state}, cache.view(), keep, false);
  evict(kvc::MomentKVScorer<>{parallel.state}, cache.view(), keep, false, pool.cpu());
  CHECK(serial.km == parallel.km);
  CHECK(serial.vm == parallel.vm);
  CHECK(serial.cm == parallel.cm);
  CHECK(serial.count == parallel.count);
  auto const q = random_queries({2, 6, 32, 8}, 72, 1.0f);
  kvc::MomentKVScorer<> const s{serial.state};  // the default SnapKV base, w = 32
  CHECK(score_of(s, cache.view(), q) == score_of(s, cache.view(), q, pool.cpu()));
}

// ---------------------------------------------------------------------------------------------------------------
// Parameters and errors

TEST_CASE("moment_kv: MomentRoundBudget spreads the evictions evenly over the rounds left") {
  std::vector<Index> const target{10, 4};
  kvc::MomentRoundBudget<> r{{target.data(), 2}, 3};
  CHECK(r.keep(0, 0, 25) == 20);  // 25 − ceil(15 / 3)
  CHECK(r.keep(0, 1, 25) == 18);  // 25 − ceil(21 / 3)
  CHECK(r.keep(0, 0, 10) == 10);
  CHECK(r.keep(0, 0, 7) == 7);
  r.rounds_left = 2;
  CHECK(r.keep(0, 0, 13) == 11);  // 13 − ceil(3 / 2)
  r.rounds_left = 1;
  CHECK(r.keep(0, 0, 25) == 10);
  CHECK(r.keep(0, 1, 25) == 4);
  CHECK(r.check().ok());
  r.rounds_left = 0;
  CHECK(r.check().code() == kvc::Errc::invalid_argument);
  CHECK(std::string(r.check().message()).find("rounds_left") != std::string::npos);
}

TEST_CASE("moment_kv: bad parameters, states of another shape and short workspaces are refused") {
  kvc::KVExtents const e{1, 2, 8, 4};
  auto cache = kvc::tools::HostCache<float>::random(e, 81);
  cache.track(8);
  OwnedMoments<> mom(1, 2, 4, 4);
  kvc::MomentKVScorer<> s{mom.state};
  CHECK(s.check().ok());
  CHECK(s.prefill_rounds == 8);
  CHECK(s.clamp_tau == 1e-6f);
  CHECK(s.base.window_size == 32);
  auto bad = s;
  bad.prefill_rounds = 0;
  CHECK(bad.check().code() == kvc::Errc::invalid_argument);
  CHECK(std::string(bad.check().message()).find("prefill_rounds") != std::string::npos);
  bad = s;
  bad.clamp_tau = -1.0f;
  CHECK(bad.check().code() == kvc::Errc::invalid_argument);
  bad = s;
  bad.scale = std::nanf("");
  CHECK(bad.check().code() == kvc::Errc::invalid_argument);
  bad = s;
  std::vector<float> rows(2 * 8 * 4);
  bad.residuals.rows = {rows.data(), kvc::bhtd_layout({1, 2, 8, 4})};
  CHECK(bad.check().code() == kvc::Errc::invalid_argument);  // rows without `tracked` and `age`

  auto const q = random_queries({1, 2, 4, 4}, 82, 1.0f);
  auto const obs = kvc::observe(kvc::WindowQueries<float>{q.rows()});
  kvc::test::OwnedScores out(1, 2, 8);
  std::vector<float> base(16, 1.0f);
  s.fixed_base = {base.data(), 1, 2, 8};
  kvc::test::OwnedWorkspace ws(kvc::score_workspace_bytes(kvc::Cpu{}, s, e, obs));
  CHECK(kvc::score(kvc::Cpu{}, s, cache.view(), obs, out.span, ws.get()).ok());
  // State of another shape.
  auto wrong = s;
  wrong.state.heads = 1;
  kvc::Status st = kvc::score(kvc::Cpu{}, wrong, cache.view(), obs, out.span, ws.get());
  CHECK(st.code() == kvc::Errc::invalid_argument);
  CHECK(std::string(st.message()).find("MomentState") != std::string::npos);
  wrong = s;
  wrong.state.value_dim = 5;  // (the workspace query sizes for the state's d_v)
  kvc::test::OwnedWorkspace wide(kvc::score_workspace_bytes(kvc::Cpu{}, wrong, e, obs));
  CHECK(kvc::score(kvc::Cpu{}, wrong, cache.view(), obs, out.span, wide.get()).code() == kvc::Errc::invalid_argument);
  // A fixed base of another shape.
  wrong = s;
  wrong.fixed_base.tokens = 7;
  st = kvc::score(kvc::Cpu{}, wrong, cache.view(), obs, out.span, ws.get());
  CHECK(st.code() == kvc::Errc::invalid_argument);
  CHECK(std::string(st.message()).find("fixed_base") != std::string::npos);
  // Short workspaces.
  st = kvc::score(kvc::Cpu{}, s, cache.view(), obs, out.span, kvc::Workspace{ws.bytes.data(), 16});
  CHECK(st.code() == kvc::Errc::out_of_capacity);
  CHECK(std::string(st.message()).find("workspace") != std::string::npos);
  auto const plan = kvc::test::plan_of(1, 2, 8, {{0, 1}, {2}});
  kvc::test::OwnedWorkspace ews(kvc::on_evict_workspace_bytes(kvc::Cpu{}, s, e));
  st = kvc::on_evict(kvc::Cpu{}, s, cache.view(), plan.plan, kvc::Workspace{ews.bytes.data(), 8});
  CHECK(st.code() == kvc::Errc::out_of_capacity);
  CHECK(std::string(st.message()).find("workspace") != std::string::npos);
  wrong = s;
  wrong.state.key_dim = 3;
  st = kvc::on_evict(kvc::Cpu{}, wrong, cache.view(), plan.plan, ews.get());
  CHECK(st.code() == kvc::Errc::invalid_argument);
  CHECK(std::string(st.message()).find("MomentState") != std::string::npos);
  CHECK(mom.count == std::vector<Index>{0, 0});  // nothing folded by the refused calls
  CHECK(kvc::on_evict(kvc::Cpu{}, s, cache.view(), plan.plan, ews.get()).ok());
  CHECK(mom.count == std::vector<Index>{6, 7});
}

TEST_CASE("moment_kv: the per-slot formulas both backends share (residual element, MI score and its edge cases)") {
  constexpr float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  CHECK(kvc::moment_residual(5.0f, 1.0f, 0.5f, 2.0f) == 3.0f);  // 5 - 1 - 0.5 * 2
  CHECK(kvc::moment_mi_score(2.0f, 9.0f) == 6.0f);              // alpha * sqrt(ss)
  CHECK(kvc::moment_mi_score(0.0f, 4.0f) == 0.0f);              // a zero base stays 0 ...
  CHECK(kvc::moment_mi_score(0.0f, inf) == 0.0f);               // ... even for an infinite residual (no 0 * inf)
  CHECK(kvc::moment_mi_score(inf, 4.0f) == inf);                // a protecting base stays +inf ...
  CHECK(kvc::moment_mi_score(inf, nan) == inf);                 // ... even for a NaN residual
  CHECK(kvc::moment_mi_score(3.0f, inf) == inf);                // an Inf value: an infinite residual
  CHECK(kvc::moment_mi_score(3.0f, nan) == -inf);               // a NaN residual: evicted first ...
  CHECK(kvc::moment_mi_score(0.0f, nan) == -inf);               // ... a zero base included
}

TEST_CASE("moment_kv: an evicted row with a NaN or Inf is dropped from the fold, a NaN residual scores -inf") {
  // One head of 6 slots: slot 2's key is NaN, slot 3's value holds an Inf. Evicting slots 1, 2, 3 folds slot 1 only
  // (folding the others would make the head's moments, and so all its later scores, NaN): the moments equal the
  // brute-force moments of {1}.
  float const nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  kvc::KVExtents const e{1, 1, 6, 4};
  auto cache = kvc::tools::HostCache<float>::random(e, 71);
  cache.track(6);
  std::fill_n(cache.k.begin() + 2 * 4, 4, nan);
  cache.v[3 * 4 + 1] = inf;
  auto const original = cache;
  OwnedMoments<> mom(1, 1, 4, 4);
  kvc::MomentKVScorer<> s{mom.state};
  evict(s, cache.view(), {{0, 4, 5}}, false);
  CHECK(mom.count[0] == 1);
  CHECK(close(mom.get(0), brute_moments(original, 0, 0, {1}), 1e-5));
  // Nothing finite to fold: the moments stay as they are.
  evict(s, cache.view(), {{0, 1, 4, 5}}, false);
  CHECK(mom.count[0] == 1);
  CHECK(close(mom.get(0), brute_moments(original, 0, 0, {1}), 1e-5));
  // Scores with those moments: slot 2's residual C k_2 is NaN, so it scores -inf; every other slot is finite.
  auto base = random_base(e.rows(), 72);
  s.fixed_base = {base.data(), 1, 1, 6};
  auto const scores = score_of(s, cache.view(), random_queries({1, 1, 1, 4}, 73, 1.0f));
  CHECK(scores[2] == -inf);
  for (Index t : {0, 1, 4, 5})
    CHECK(std::isfinite(scores[static_cast<std::size_t>(t)]));
}
