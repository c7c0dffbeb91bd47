// SPDX-License-Identifier: Apache-2.0
// tests/scorers/expected_attention_test.cpp mirrors include/kvc/scorers/expected_attention.hpp and
// include/kvc/pipeline/query_statistics.hpp (CPU kernels). Reference values: the spec's golden example and its
// exactness check (shared/specs/expected_attention.md §2.12, computed there in fp64), hand-derived identities, and
// the unit-testable properties of §10. Oracle vectors (NumPy, fp64) are compared in tests/reference/.
#include <kvc/backend/cpu/pipeline/query_statistics.hpp>
#include <kvc/backend/cpu/scorers/expected_attention.hpp>
#include <kvc/backend/cpu/selectors/top_k.hpp>
#include <kvc/backend/cpu/thread_pool.hpp>
#include <kvc/pipeline/press.hpp>

#include "common/synthetic.hpp"
#include "support/catch.hpp"
#include "support/helpers.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

namespace {

using Catch::Matchers::WithinAbs;
using kvc::ExpectedAttentionScorer;
using kvc::Index;
using kvc::Reference;

/// Query statistics owned by a test: mean [B, Hq, d], covariance [B, Hq, d, d].
struct OwnedStatistics {
  std::vector<float> mean, cov;
  kvc::QueryStatistics<> view;
};

/// kvc::query_statistics over pre-RoPE rows [B, Hq, R, d] (positions [B, R] or empty: row i at i).
OwnedStatistics statistics(kvc::test::OwnedQueries<float> const& q, kvc::StatisticsRows rows,
                           std::vector<Index> const& positions = {}, kvc::Cpu const& cpu = {}) {
  kvc::KVExtents const e = q.ext;
  OwnedStatistics s{std::vector<float>(static_cast<std::size_t>(e.batch * e.heads * e.dim), -9.0f),
                    std::vector<float>(static_cast<std::size_t>(e.batch * e.heads * e.dim * e.dim), -9.0f),
                    {}};
  kvc::test::OwnedWorkspace ws(kvc::query_statistics_workspace_bytes(cpu, e));
  kvc::Status const st = kvc::query_statistics(cpu, q.rows(), positions.empty() ? nullptr : positions.data(), rows,
                                               s.mean.data(), s.cov.data(), ws.get());
  REQUIRE(st.ok());
  s.view = {s.mean.data(), s.cov.data(), e.batch, e.heads, e.dim};
  return s;
}

template <class Cache>
std::vector<float> ea_scores(ExpectedAttentionScorer const& s, Cache const& cache, kvc::QueryStatistics<> const& st,
                             kvc::Status* status = nullptr, kvc::Cpu const& cpu = {}) {
  auto const obs = kvc::observe(st);
  kvc::KVExtents const e = cache.keys.extents();
  kvc::test::OwnedScores out(e.batch, e.heads, e.tokens);
  kvc::test::OwnedWorkspace ws(kvc::score_workspace_bytes(cpu, s, e, obs));
  kvc::Status const r = kvc::score(cpu, s, cache, obs, out.span, ws.get());
  if (status)
    *status = r;
  else
    REQUIRE(r.ok());
  return out.data;
}

std::vector<Index> keep_top(std::vector<float> const& scores, double ratio) {
  Index const n = static_cast<Index>(scores.size());
  kvc::TopKSelector const sel{kvc::RatioBudget{ratio}};
  kvc::test::OwnedScores sc(1, 1, n);
  sc.data = scores;
  sc.span.data = sc.data.data();
  kvc::test::OwnedPlan plan(1, 1, n);
  kvc::test::OwnedWorkspace ws(kvc::select_workspace_bytes(kvc::Cpu{}, sel, 1, 1, n));
  REQUIRE(kvc::select(kvc::Cpu{}, sel, sc.span, plan.plan, ws.get()).ok());
  return plan.kept(0, 0);
}

void require_close(std::vector<float> const& got, std::vector<double> const& want, double tol) {
  REQUIRE(got.size() == want.size());
  for (std::size_t i = 0; i < got.size(); ++i) {
    INFO("index " << i << ": " << got[i] << " vs " << want[i]);
    CHECK_THAT(got[i], WithinAbs(want[i], tol));
  }
}

// The golden example of spec §2.12: d = 4, theta 10000, Hq = 2, Hkv = 1, S = 6, n_sink = 2, T = 3.
struct Golden {
  std::vector<std::vector<float>> qpre0{{-0.8f, -0.2f, 0.4f, 1.0f}, {0.2f, 0.8f, -0.8f, -0.2f},
                                        {-1.0f, -0.4f, 0.2f, 0.8f}, {0.0f, 0.6f, -1.0f, -0.4f},
                                        {1.0f, -0.6f, 0.0f, 0.6f},  {-0.2f, 0.4f, 1.0f, -0.6f}};
  std::vector<std::vector<float>> qpre1{{0.6f, -1.0f, -0.4f, 0.2f}, {-0.6f, 0.0f, 0.6f, -1.0f},
                                        {0.4f, 1.0f, -0.6f, 0.0f},  {-0.8f, -0.2f, 0.4f, 1.0f},
                                        {0.2f, 0.8f, -0.8f, -0.2f}, {-1.0f, -0.4f, 0.2f, 0.8f}};
  std::vector<std::vector<float>> v{{0.0f, 0.6f, -1.0f, -0.4f}, {1.0f, -0.6f, 0.0f, 0.6f},  {-0.2f, 0.4f, 1.0f, -0.6f},
                                    {0.8f, -0.8f, -0.2f, 0.4f}, {-0.4f, 0.2f, 0.8f, -0.8f}, {0.6f, -1.0f, -0.4f, 0.2f}};
  kvc::test::OwnedRope rope{kvc::RopeSpec{}, 4, 16};
  kvc::tools::HostCache<float> cache{kvc::KVExtents{1, 1, 6, 4}};
  kvc::test::OwnedQueries<float> q{kvc::KVExtents{1, 2, 6, 4}};

  Golden() {
    for (Index i = 0; i < 6; ++i) {
      std::copy_n(qpre0[i].data(), 4, cache.key(0, 0, i));  // keys: qpre head 0 rotated at positions 0..5
      rope.table.rotate(cache.key(0, 0, i), i);
      std::copy_n(v[i].data(), 4, cache.v.data() + i * 4);
      std::copy_n(qpre0[i].data(), 4, q.row(0, 0, i));
      std::copy_n(qpre1[i].data(), 4, q.row(0, 1, i));
    }
  }
  ExpectedAttentionScorer scorer() const {
    ExpectedAttentionScorer s;
    s.n_future_positions = 3;
    s.n_sink = 2;
    return s;
  }
};

}  // namespace

TEST_CASE("query statistics: the golden example's mean and population covariance (spec 2.12)") {
  Golden g;
  OwnedStatistics const st = statistics(g.q, {.n_sink = 2});
  require_close({st.mean.begin(), st.mean.begin() + 4}, {-0.05, 0.0, 0.05, 0.1}, 1e-7);
  std::vector<double> const sigma0{.5075,  -.07, -.0975, -.015, -.07,  .26,  -.07,  -.29,
                                   -.0975, -.07, .5075,  -.015, -.015, -.29, -.015, .37};
  require_close({st.cov.begin(), st.cov.begin() + 16}, sigma0, 1e-6);
}

TEST_CASE("expected_attention: the golden example's four score rows and kept sets (spec 2.12)") {
  Golden g;
  OwnedStatistics st = statistics(g.q, {.n_sink = 2});
  st.view.rope = g.rope.table;  // t0 = 6 (the context's end), future positions 6, 7, 8
  auto const view = g.cache.view();
  ExpectedAttentionScorer s = g.scorer();

  std::vector<float> const def = ea_scores(s, view, st.view);
  require_close(def, {1.352937, 1.352937, 0.352937, 0.283509, 0.349680, 0.295945}, 2e-6);
  CHECK(keep_top(def, 0.5) == std::vector<Index>{0, 1, 2});
  CHECK(keep_top(def, 0.25) == std::vector<Index>{0, 1, 2, 4});

  s.epsilon = 0.0f;
  require_close(ea_scores(s, view, st.view), {1.340447, 1.340447, 0.340447, 0.271343, 0.337515, 0.283455}, 2e-6);
  s.use_vnorm = false;
  std::vector<float> const novnorm = ea_scores(s, view, st.view);
  require_close(novnorm, {1.277435, 1.277435, 0.272576, 0.223043, 0.277435, 0.226946}, 2e-6);
  CHECK(keep_top(novnorm, 0.5) == std::vector<Index>{0, 1, 4});  // the value norm flips the decision
  s.use_covariance = false;
  std::vector<float> const mean_only = ea_scores(s, view, st.view);
  require_close(mean_only, {1.279237, 1.279237, 0.279237, 0.228511, 0.270249, 0.222003}, 2e-6);
  CHECK(keep_top(mean_only, 0.5) == std::vector<Index>{0, 1, 2});  // and the covariance flips it back

  s.epsilon = 0.01f;  // eps is ignored without the value norm (property 12)
  CHECK(ea_scores(s, view, st.view) == mean_only);
}

TEST_CASE("expected_attention: one sample, T = 1 and no sinks is exact softmax attention (spec 2.12, property 3)") {
  Golden g;
  kvc::test::OwnedQueries<float> one{kvc::KVExtents{1, 1, 1, 4}};
  std::vector<float> const q{0.3f, -0.2f, 0.5f, 0.1f};
  std::copy(q.begin(), q.end(), one.row(0, 0, 0));
  OwnedStatistics st = statistics(one, {});
  for (float c : st.cov)
    CHECK(c == 0.0f);  // one sample: Sigma = 0 exactly
  st.view.rope = g.rope.table;
  ExpectedAttentionScorer s;
  s.n_future_positions = 1;
  s.n_sink = 0;
  s.use_vnorm = false;
  require_close(ea_scores(s, g.cache.view(), st.view),
                {0.15821192, 0.16653692, 0.15176084, 0.18828855, 0.1330793, 0.20212246}, 1e-6);
}

namespace {

/// A random GQA case: keys rotated at positions 0..n-1, pre-RoPE queries [B, Hq, n, d].
struct RandomCase {
  kvc::KVExtents e;
  Index hq;
  kvc::test::OwnedRope rope;
  kvc::tools::HostCache<float> cache;
  kvc::test::OwnedQueries<float> q;

  RandomCase(kvc::KVExtents ext, Index query_heads, std::uint64_t seed, kvc::RopeStyle style = kvc::RopeStyle::neox)
      : e(ext),
        hq(query_heads),
        rope(kvc::RopeSpec{10000.0, style}, ext.dim, ext.tokens + 1024),
        cache(kvc::tools::HostCache<float>::random(ext, seed)),
        q(kvc::KVExtents{ext.batch, query_heads, ext.tokens, ext.dim}) {
    auto const vals = kvc::tools::random_values<float>(static_cast<Index>(q.data.size()), seed + 1, 1.5f);
    std::copy(vals.begin(), vals.end(), q.data.begin());
    for (Index b = 0; b < e.batch; ++b)
      for (Index h = 0; h < e.heads; ++h)
        for (Index t = 0; t < e.tokens; ++t)
          rope.table.rotate(cache.key(b, h, t), t);
  }
  OwnedStatistics stats(Index n_sink = 4) const {
    OwnedStatistics s = statistics(q, {.n_sink = n_sink});
    s.view.rope = rope.table;
    return s;
  }
};

}  // namespace

TEST_CASE("expected_attention: probabilities sum to 1 over the non-sink slots, per head and after GQA (property 10)") {
  RandomCase c({2, 2, 50, 16}, 8, 11);
  OwnedStatistics const st = c.stats();
  ExpectedAttentionScorer s;
  s.use_vnorm = false;
  std::vector<float> const sc = ea_scores(s, c.cache.view(), st.view);
  float top = -1.0f;
  for (Index bh = 0; bh < 4; ++bh) {
    double sum = 0.0;
    for (Index j = 4; j < 50; ++j) {
      sum += sc[bh * 50 + j];
      top = std::max(top, sc[bh * 50 + j]);
    }
    CHECK_THAT(sum, WithinAbs(1.0, 1e-5));
  }
  for (Index bh = 0; bh < 4; ++bh)  // sinks: the global max + 1, in every head
    for (Index j = 0; j < 4; ++j)
      CHECK(sc[bh * 50 + j] == top + 1.0f);
}

TEST_CASE("expected_attention: value scaling, permutation and batch independence (properties 12-14)") {
  RandomCase c({2, 2, 40, 8}, 4, 5);
  OwnedStatistics const st = c.stats();
  ExpectedAttentionScorer const s;
  std::vector<float> const base = ea_scores(s, c.cache.view(), st.view);

  kvc::tools::HostCache<float> scaled = c.cache;  // V * 3 scales every non-sink score by 3
  for (float& x : scaled.v)
    x *= 3.0f;
  std::vector<float> const three = ea_scores(s, scaled.view(), st.view);
  for (Index bh = 0; bh < 4; ++bh)
    for (Index j = 4; j < 40; ++j)
      CHECK_THAT(three[bh * 40 + j], WithinAbs(3.0 * base[bh * 40 + j], 1e-5 * (1 + std::abs(three[bh * 40 + j]))));

  kvc::tools::HostCache<float> swapped = c.cache;  // swapping two non-sink (key, value) slots swaps their scores
  for (Index b = 0; b < 2; ++b)
    for (Index h = 0; h < 2; ++h) {
      std::swap_ranges(swapped.key(b, h, 7), swapped.key(b, h, 8), swapped.key(b, h, 30));
      auto* v = swapped.v.data() + ((b * 2 + h) * 40) * 8;
      std::swap_ranges(v + 7 * 8, v + 8 * 8, v + 30 * 8);
    }
  std::vector<float> const perm = ea_scores(s, swapped.view(), st.view);
  for (Index bh = 0; bh < 4; ++bh) {
    CHECK_THAT(perm[bh * 40 + 7], WithinAbs(base[bh * 40 + 30], 1e-6));
    CHECK_THAT(perm[bh * 40 + 30], WithinAbs(base[bh * 40 + 7], 1e-6));
  }

  kvc::tools::HostCache<float> other = c.cache;  // changing sequence 1 leaves sequence 0's non-sink scores alone
  for (std::size_t i = other.k.size() / 2; i < other.k.size(); ++i)
    other.k[i] *= -0.5f;
  std::vector<float> const changed = ea_scores(s, other.view(), st.view);
  for (Index h = 0; h < 2; ++h)
    for (Index j = 4; j < 40; ++j)
      CHECK(changed[h * 40 + j] == base[h * 40 + j]);
}

TEST_CASE("expected_attention: NeoX and interleaved RoPE give the same scores on consistently permuted channels") {
  // Channel c of the NeoX layout (pair (i, i + d/2)) is channel perm[c] of the interleaved one (pair (2i, 2i + 1)).
  Index const d = 8;
  RandomCase neox({1, 2, 30, d}, 4, 21, kvc::RopeStyle::neox);
  RandomCase inter({1, 2, 30, d}, 4, 21, kvc::RopeStyle::interleaved);
  auto perm = [&](Index c) { return c < d / 2 ? 2 * c : 2 * (c - d / 2) + 1; };
  for (Index h = 0; h < 2; ++h)
    for (Index t = 0; t < 30; ++t) {
      std::vector<float> pre(d);  // undo the NeoX rotation to recover the random pre-RoPE key, then permute
      std::copy_n(neox.cache.key(0, h, t), d, pre.data());
      neox.rope.table.rotate(pre.data(), t, /*inverse=*/true);
      for (Index c = 0; c < d; ++c)
        inter.cache.key(0, h, t)[perm(c)] = pre[c];
      inter.rope.table.rotate(inter.cache.key(0, h, t), t);
    }
  inter.cache.v = neox.cache.v;
  for (Index q = 0; q < 4; ++q)
    for (Index t = 0; t < 30; ++t)
      for (Index c = 0; c < d; ++c)
        inter.q.row(0, q, t)[perm(c)] = neox.q.row(0, q, t)[c];
  std::vector<float> const a = ea_scores(ExpectedAttentionScorer{}, neox.cache.view(), neox.stats().view);
  std::vector<float> const b = ea_scores(ExpectedAttentionScorer{}, inter.cache.view(), inter.stats().view);
  for (std::size_t i = 0; i < a.size(); ++i)
    CHECK_THAT(b[i], WithinAbs(a[i], 1e-5 * (1 + std::abs(a[i]))));
}

TEST_CASE("expected_attention: shifting every position and t0 by the same amount leaves the scores (property 6)") {
  RandomCase c({1, 2, 32, 16}, 4, 31);
  OwnedStatistics st = c.stats();
  std::vector<float> const base = ea_scores(ExpectedAttentionScorer{}, c.cache.view(), st.view);
  Index const shift = 100;
  kvc::tools::HostCache<float> moved = c.cache;
  moved.track(32);
  for (Index h = 0; h < 2; ++h)
    for (Index t = 0; t < 32; ++t) {
      c.rope.table.rotate(moved.key(0, h, t), shift);  // R_shift R_t = R_{t + shift}
      moved.positions[h * 32 + t] = t + shift;
    }
  std::vector<float> const shifted = ea_scores(ExpectedAttentionScorer{}, moved.view(), st.view);  // t0 = 132
  for (std::size_t i = 0; i < base.size(); ++i)
    CHECK_THAT(shifted[i], WithinAbs(base[i], 1e-5 * (1 + std::abs(base[i]))));
  Index const next = 132;  // the explicit next position gives the same t0
  st.view.next_position = &next;
  CHECK(ea_scores(ExpectedAttentionScorer{}, moved.view(), st.view) == shifted);
}

TEST_CASE("expected_attention: reference=kvpress takes t0 from the observed row count (ambiguity A1)") {
  RandomCase c({1, 1, 40, 8}, 2, 41);
  OwnedStatistics st = c.stats();
  Index const at24 = 24;
  st.view.next_position = &at24;
  std::vector<float> const authors24 = ea_scores(ExpectedAttentionScorer{}, c.cache.view(), st.view);
  st.view.next_position = nullptr;
  st.view.observed = 24;  // kvpress: t0 = the buffer's length, whatever the absolute position
  ExpectedAttentionScorer kv;
  kv.reference = Reference::kvpress;
  CHECK(ea_scores(kv, c.cache.view(), st.view) == authors24);
  CHECK(ea_scores(ExpectedAttentionScorer{}, c.cache.view(), st.view) != authors24);  // authors: t0 = 40
}

TEST_CASE("expected_attention: sinks, short heads and huge logits") {
  RandomCase c({1, 2, 12, 8}, 2, 51);
  c.cache.lengths = {3, 12};
  c.cache.per_head = true;
  OwnedStatistics const st = c.stats();
  std::vector<float> const sc = ea_scores(ExpectedAttentionScorer{}, c.cache.view(), st.view);
  float const top = *std::max_element(sc.begin() + 12 + 4, sc.begin() + 24);
  for (Index j = 0; j < 3; ++j)  // a head shorter than n_sink holds only sinks
    CHECK(sc[j] == top + 1.0f);
  CHECK(std::isinf(sc[3]));  // padding is -inf

  kvc::tools::HostCache<float> big = c.cache;  // logits around 1e4: finite scores, no NaN (property 9)
  for (float& x : big.k)
    x *= 3000.0f;
  for (float const x : ea_scores(ExpectedAttentionScorer{}, big.view(), st.view))
    CHECK(!std::isnan(x));
}

TEST_CASE("query statistics: decode buffers, sample rules and thread count") {
  kvc::test::OwnedQueries<float> q{kvc::KVExtents{1, 2, 10, 4}};
  auto const vals = kvc::tools::random_values<float>(static_cast<Index>(q.data.size()), 61);
  std::copy(vals.begin(), vals.end(), q.data.begin());
  // A ring buffer whose rows sit at positions 12, 13, 2, 3, ... : authors exclude positions < n_sink only.
  std::vector<Index> const pos{12, 13, 2, 3, 4, 5, 6, 7, 8, 9};
  OwnedStatistics const ring = statistics(q, {.n_sink = 4}, pos);
  kvc::test::OwnedQueries<float> kept{kvc::KVExtents{1, 2, 8, 4}};  // the same samples, in another order
  for (Index h = 0; h < 2; ++h) {
    Index r = 0;
    for (Index i : {0, 1, 4, 5, 6, 7, 8, 9})
      std::copy_n(q.row(0, h, i), 4, kept.row(0, h, r++));
  }
  OwnedStatistics const batch = statistics(kept, {});
  for (std::size_t i = 0; i < batch.cov.size(); ++i)
    CHECK_THAT(ring.cov[i], WithinAbs(batch.cov[i], 1e-6));
  for (std::size_t i = 0; i < batch.mean.size(); ++i)
    CHECK_THAT(ring.mean[i], WithinAbs(batch.mean[i], 1e-7));
  // kvpress drops the first n_sink BUFFER rows instead (ambiguity A2).
  OwnedStatistics const skip = statistics(q, {.skip_rows = 2}, pos);
  kvc::test::OwnedQueries<float> tail{kvc::KVExtents{1, 2, 8, 4}};
  for (Index h = 0; h < 2; ++h)
    for (Index i = 2; i < 10; ++i)
      std::copy_n(q.row(0, h, i), 4, tail.row(0, h, i - 2));
  OwnedStatistics const tail_stats = statistics(tail, {});
  for (std::size_t i = 0; i < tail_stats.cov.size(); ++i)
    CHECK_THAT(skip.cov[i], WithinAbs(tail_stats.cov[i], 1e-6));
  // No sample: mean and covariance 0 (A3). More workers: the same bits.
  OwnedStatistics const none = statistics(q, {.n_sink = 100}, pos);
  CHECK(std::all_of(none.mean.begin(), none.mean.end(), [](float x) { return x == 0.0f; }));
  CHECK(std::all_of(none.cov.begin(), none.cov.end(), [](float x) { return x == 0.0f; }));
  kvc::ThreadPool pool(3);
  OwnedStatistics const par = statistics(q, {.n_sink = 4}, pos, pool.cpu());
  CHECK(par.cov == ring.cov);
  CHECK(par.mean == ring.mean);
}

TEST_CASE("expected_attention: clear errors for bad statistics, tables and parameters") {
  RandomCase c({1, 2, 20, 8}, 4, 71);
  OwnedStatistics st = c.stats();
  kvc::Status status;
  auto bad = st.view;
  bad.heads = 3;  // not a multiple of Hkv
  ea_scores(ExpectedAttentionScorer{}, c.cache.view(), bad, &status);
  CHECK(status.code() == kvc::Errc::invalid_argument);
  bad = st.view;
  bad.covariance = nullptr;
  ea_scores(ExpectedAttentionScorer{}, c.cache.view(), bad, &status);
  CHECK(std::string(status.message()).find("covariance") != std::string::npos);
  ExpectedAttentionScorer no_cov;
  no_cov.use_covariance = false;
  ea_scores(no_cov, c.cache.view(), bad, &status);
  CHECK(status.ok());
  bad = st.view;
  bad.rope.positions = 20 + 511;  // t0 + T - 1 = 531 is past the table
  ea_scores(ExpectedAttentionScorer{}, c.cache.view(), bad, &status);
  CHECK(std::string(status.message()).find("past the table") != std::string::npos);
  ExpectedAttentionScorer s;
  s.n_future_positions = 0;
  ea_scores(s, c.cache.view(), st.view, &status);
  CHECK(std::string(status.message()).find("n_future_positions") != std::string::npos);
  s = {};
  s.gqa = kvc::GqaReduce::sum;
  ea_scores(s, c.cache.view(), st.view, &status);
  CHECK(status.code() == kvc::Errc::invalid_argument);
}

TEST_CASE("expected_attention: the thread count does not change the scores") {
  RandomCase c({2, 4, 300, 32}, 8, 81);
  OwnedStatistics const st = c.stats();
  kvc::ThreadPool pool(3);
  CHECK(ea_scores(ExpectedAttentionScorer{}, c.cache.view(), st.view) ==
        ea_scores(ExpectedAttentionScorer{}, c.cache.view(), st.view, nullptr, pool.cpu()));
}

TEST_CASE("expected_attention: a NaN or Inf key gets probability 0, the others a softmax over the finite slots") {
  // Mean query 0, no covariance, no sinks, no value norms: every finite key has logit 0, so probability 1/4 over the
  // four finite slots; the bad slot (logit 0 x bad = NaN) gets 0.
  float const nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  ExpectedAttentionScorer s;
  s.n_sink = 0;
  s.use_covariance = false;
  s.use_vnorm = false;
  std::vector<float> mean(2, 0.0f), cov(4, 0.0f);
  kvc::QueryStatistics<> const st{mean.data(), cov.data(), 1, 1, 2};
  for (float const bad : {nan, inf}) {
    auto c = kvc::tools::HostCache<float>::random({1, 1, 5, 2}, 17);
    c.k[4] = bad;  // slot 2
    CHECK(ea_scores(s, c.view(), st) == std::vector<float>{0.25f, 0.25f, 0.0f, 0.25f, 0.25f});
  }
}

TEST_CASE("expected_attention: the slot and sink formulas both backends call, by hand",
          "[scorers][expected_attention]") {
  ExpectedAttentionScorer s;
  s.epsilon = 0.01f;
  s.use_vnorm = true;
  s.gqa = kvc::GqaReduce::mean;
  // Two query heads' probabilities 0.2 and 0.3 (summed by gqa_combine), ||v|| = 2: (0.25 + 0.01) * 2.
  float const sum = kvc::gqa_combine(s.gqa, 1, kvc::gqa_combine(s.gqa, 0, 123.0f, 0.2f), 0.3f);
  CHECK(sum == 0.2f + 0.3f);
  CHECK_THAT(kvc::expected_attention_score(s, 2, sum, 2.0f), WithinAbs(0.52, 1e-6));
  s.gqa = kvc::GqaReduce::max;
  float const top = kvc::gqa_combine(s.gqa, 1, kvc::gqa_combine(s.gqa, 0, 0.0f, 0.2f), 0.3f);
  CHECK(top == 0.3f);
  CHECK_THAT(kvc::expected_attention_score(s, 2, top, 2.0f), WithinAbs(0.62, 1e-6));
  s.use_vnorm = false;
  CHECK(kvc::expected_attention_score(s, 2, top, 2.0f) == 0.3f);  // the norm is not read
  CHECK(kvc::expected_attention_sink_score(2.5f) == 3.5f);
  CHECK(kvc::expected_attention_sink_score(-std::numeric_limits<float>::infinity()) == 1.0f);  // nothing else scored
}
