// SPDX-License-Identifier: Apache-2.0
// tests/scorers/snap_kv_test.cpp mirrors include/kvc/scorers/snap_kv.hpp (CPU kernel in backend/cpu/scorers).
// Reference values come from hand computation (closed forms below), from the spec's worked example
// (specs/original_baselines.md §2.6, printed to 4 decimals) and from a float64 re-statement of the spec's formulas
// written in this file (no kvc code on the reference side); properties are §2.5's.
#include <kvc/backend/cpu/scorers/snap_kv.hpp>
#include <kvc/backend/cpu/selectors/top_k.hpp>
#include <kvc/backend/cpu/thread_pool.hpp>
#include <kvc/pipeline/press.hpp>

#include "common/synthetic.hpp"
#include "support/catch.hpp"
#include "support/helpers.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <vector>

namespace {

using Catch::Matchers::WithinAbs;
using kvc::GqaReduce;
using kvc::Index;
using kvc::Pooling;
using kvc::Reference;
using kvc::SnapKVScorer;

constexpr float neg_inf = -std::numeric_limits<float>::infinity();

struct Scored {
  kvc::Status status;
  std::vector<float> scores;  ///< [batch, heads, tokens]
};

/// kvc::score with SnapKV on any cache and window queries; the workspace is exactly the public query's size.
template <class Cache, class T>
Scored snap_scores(kvc::Cpu const& cpu, SnapKVScorer const& s, Cache const& cache, kvc::WindowQueries<T> const& wq) {
  auto const obs = kvc::observe(wq);
  kvc::KVExtents const e = cache.keys.extents();
  kvc::test::OwnedScores out(e.batch, e.heads, e.tokens);
  kvc::test::OwnedWorkspace ws(kvc::score_workspace_bytes(cpu, s, e, obs));
  kvc::Status const st = kvc::score(cpu, s, cache, obs, out.span, ws.get());
  return {st, out.data};
}

/// Scores of head (b, h) out of a [batch, heads, tokens] tensor.
std::vector<float> head_of(std::vector<float> const& all, Index heads, Index tokens, Index b, Index h) {
  auto const first = all.begin() + (b * heads + h) * tokens;
  return {first, first + tokens};
}

/// Top-`budget` of one head's scores (ties: lower index), ascending.
std::vector<Index> keep_top(std::vector<float> scores, Index budget) {
  Index const n = static_cast<Index>(scores.size());
  kvc::TopKSelector const sel{kvc::FixedBudget{budget}};
  kvc::test::OwnedPlan plan(1, 1, n);
  kvc::test::OwnedWorkspace ws(kvc::select_workspace_bytes(kvc::Cpu{}, sel, 1, 1, n));
  REQUIRE(kvc::select(kvc::Cpu{}, sel, kvc::ScoreSpan<>{scores.data(), 1, 1, n}, plan.plan, ws.get()).ok());
  return plan.kept(0, 0);
}

// ---- float64 reference of the spec's formulas (original_baselines.md §2.1/§2.3, kvpress_reference.md §2.3) ----

std::vector<double> pool_ref(std::vector<double> const& x, Index m, Index k, Pooling pooling) {
  std::vector<double> out(static_cast<std::size_t>(m));
  Index const r = k / 2;
  for (Index j = 0; j < m; ++j) {
    double acc = pooling == Pooling::max ? -std::numeric_limits<double>::infinity() : 0.0;
    for (Index t = j - r; t <= j + r; ++t) {  // padding: -inf for max, zeros (counted) for avg
      double const v =
          t >= 0 && t < m ? x[t] : (pooling == Pooling::max ? -std::numeric_limits<double>::infinity() : 0.0);
      acc = pooling == Pooling::max ? std::max(acc, v) : acc + v;
    }
    out[j] = pooling == Pooling::max ? acc : acc / static_cast<double>(k);
  }
  return out;
}

/// One KV head: keys [n, d] at `key_pos`, its g query heads' window rows [g, w, d] (post-RoPE) at `q_pos` [w].
std::vector<double> snap_reference(std::vector<double> const& keys, std::vector<Index> const& key_pos, Index d,
                                   std::vector<double> const& q, std::vector<Index> const& q_pos, Index g,
                                   SnapKVScorer const& s) {
  Index const n = static_cast<Index>(key_pos.size()), w = static_cast<Index>(q_pos.size());
  std::vector<double> vote(static_cast<std::size_t>(g * n), 0.0);
  for (Index qh = 0; qh < g; ++qh)
    for (Index i = 0; i < w; ++i) {
      std::vector<double> l(static_cast<std::size_t>(n), -std::numeric_limits<double>::infinity());
      double top = -std::numeric_limits<double>::infinity();
      for (Index j = 0; j < n; ++j)
        if (key_pos[j] <= q_pos[i]) {
          double dot = 0;
          for (Index c = 0; c < d; ++c)
            dot += q[(qh * w + i) * d + c] * keys[j * d + c];
          l[j] = dot / std::sqrt(static_cast<double>(d));
          top = std::max(top, l[j]);
        }
      if (top == -std::numeric_limits<double>::infinity())
        continue;
      double z = 0;
      for (Index j = 0; j < n; ++j)
        z += std::exp(l[j] - top);
      for (Index j = 0; j < n; ++j)
        vote[qh * n + j] +=
            std::exp(l[j] - top) / z / (s.reference == Reference::kvpress ? static_cast<double>(w) : 1.0);
    }
  Index m = 0;
  while (m < n && key_pos[m] < q_pos[0])
    ++m;
  std::vector<double> out(static_cast<std::size_t>(n), 0.0), pooled;
  if (s.reference == Reference::authors) {
    std::vector<double> r(static_cast<std::size_t>(m));
    for (Index j = 0; j < m; ++j) {
      double acc = vote[j];
      for (Index qh = 1; qh < g; ++qh)
        acc = s.gqa == GqaReduce::max ? std::max(acc, vote[qh * n + j]) : acc + vote[qh * n + j];
      r[j] = s.gqa == GqaReduce::mean ? acc / static_cast<double>(g) : acc;
    }
    pooled = pool_ref(r, m, s.kernel_size, s.pooling);
  } else {
    pooled.assign(static_cast<std::size_t>(m), 0.0);
    for (Index qh = 0; qh < g; ++qh) {
      auto const p =
          pool_ref(std::vector<double>(vote.begin() + qh * n, vote.begin() + qh * n + m), m, s.kernel_size, s.pooling);
      for (Index j = 0; j < m; ++j)
        pooled[j] += p[j] / static_cast<double>(g);
    }
  }
  double const top = m > 0 ? *std::max_element(pooled.begin(), pooled.end()) : 0.0;
  for (Index j = 0; j < n; ++j)
    out[j] = j < m ? pooled[j] : top + 1.0;
  return out;
}

/// A random BHTD float cache plus post-RoPE window queries [B, Hq, rows, d].
struct Problem {
  kvc::tools::HostCache<float> cache;
  kvc::test::OwnedQueries<float> queries;
};

Problem random_problem(kvc::KVExtents e, Index hq, Index rows, std::uint64_t seed, float qscale = 2.0f) {
  Problem p{kvc::tools::HostCache<float>::random(e, seed), kvc::test::OwnedQueries<float>({e.batch, hq, rows, e.dim})};
  p.queries.data = kvc::tools::random_values<float>(static_cast<Index>(p.queries.data.size()), seed + 1000, qscale);
  return p;
}

/// The float64 reference for head (b, h) of a problem (positions: the cache's, queries at `q_pos`).
std::vector<double> reference_head(Problem const& p, Index b, Index h, std::vector<Index> const& q_pos,
                                   SnapKVScorer const& s) {
  kvc::KVExtents const e = p.cache.ext;
  auto const view = p.cache.view();
  Index const n = view.length(b, h), g = p.queries.ext.heads / e.heads, rows = p.queries.ext.tokens;
  Index const w = static_cast<Index>(q_pos.size());
  std::vector<double> keys, q;
  std::vector<Index> key_pos;
  for (Index t = 0; t < n; ++t) {
    key_pos.push_back(view.position(b, h, t));
    keys.insert(keys.end(), view.keys.row(b, h, t), view.keys.row(b, h, t) + e.dim);
  }
  for (Index qh = 0; qh < g; ++qh)
    for (Index i = rows - w; i < rows; ++i)
      q.insert(q.end(), p.queries.row(b, h * g + qh, i), p.queries.row(b, h * g + qh, i) + e.dim);
  return snap_reference(keys, key_pos, e.dim, q, q_pos, g, s);
}

/// Checks kvc's scores of every head against the reference (relative 1e-5 on the head's scale), -inf padding.
void check_against_reference(Problem const& p, std::vector<float> const& got, SnapKVScorer const& s,
                             std::vector<std::vector<Index>> const& q_pos_per_batch) {
  kvc::KVExtents const e = p.cache.ext;
  for (Index b = 0; b < e.batch; ++b)
    for (Index h = 0; h < e.heads; ++h) {
      auto const ref = reference_head(p, b, h, q_pos_per_batch[static_cast<std::size_t>(b)], s);
      auto const row = head_of(got, e.heads, e.tokens, b, h);
      Index const n = static_cast<Index>(ref.size());
      double const scale = n > 0 ? std::max(1e-3, *std::max_element(ref.begin(), ref.end())) : 1.0;
      for (Index t = 0; t < n; ++t) {
        INFO("b " << b << " h " << h << " t " << t);
        CHECK_THAT(row[t], WithinAbs(ref[t], 1e-5 * scale));
      }
      for (Index t = n; t < e.tokens; ++t)
        CHECK(row[t] == neg_inf);
    }
}

std::vector<Index> last_positions(Index end, Index w) {
  std::vector<Index> pos(static_cast<std::size_t>(w));
  std::iota(pos.begin(), pos.end(), end - w);
  return pos;
}

// ---- the spec's worked example, built from one-hot keys so that the logits are exactly the printed ones ----

/// N = 10 one-hot keys e_j in d = 16 (sqrt(d) = 4 is exact), and window rows q = 4 * logits, so that
/// q . k_j / sqrt(d) = logits[j] bit for bit. `heads` lists the query heads to include (0, 1 or both).
struct SpecExample {
  kvc::tools::HostCache<float> cache;
  kvc::test::OwnedQueries<float> queries;
};

SpecExample spec_example(std::vector<int> const& heads, Index kv_heads = 1) {
  // original_baselines.md §2.6: row 0 of each head's window is at position 8 (its key-9 entry is masked anyway).
  double const logits[2][2][10] = {{{2, 0, 0, 1, 3, 0, 0, 0, 1, 0}, {2, 0, 0, 0, 3, 1, 0, 0, 1, 1}},
                                   {{1, 0, 0, 0, 0, 0, 3, 2, 0, 0}, {1, 0, 0, 0, 0, 0, 2, 3, 0, 1}}};
  Index const d = 16, hq = static_cast<Index>(heads.size());
  SpecExample ex{kvc::tools::HostCache<float>({1, kv_heads, 10, d}), kvc::test::OwnedQueries<float>({1, hq, 2, d})};
  for (Index h = 0; h < kv_heads; ++h)
    for (Index j = 0; j < 10; ++j)
      ex.cache.key(0, h, j)[j] = 1.0f;
  for (Index qh = 0; qh < hq; ++qh)
    for (Index i = 0; i < 2; ++i)
      for (Index j = 0; j < 10; ++j)
        ex.queries.row(0, qh, i)[j] = static_cast<float>(4.0 * logits[heads[static_cast<std::size_t>(qh)]][i][j]);
  return ex;
}

std::vector<float> spec_scores(SpecExample const& ex, SnapKVScorer const& s) {
  auto const r = snap_scores(kvc::Cpu{}, s, ex.cache.view(), kvc::WindowQueries<float>{ex.queries.rows()});
  REQUIRE(r.status.ok());
  return r.scores;
}

void check_printed(std::vector<float> const& got, std::vector<double> const& printed) {
  for (std::size_t j = 0; j < printed.size(); ++j) {
    INFO("token " << j);
    CHECK_THAT(got[j], WithinAbs(printed[j], 5e-5 + 1e-6));  // printed to 4 decimals
  }
}

SnapKVScorer authors(Index w, Index k, Pooling pooling, GqaReduce gqa = GqaReduce::mean) {
  return {Reference::authors, w, k, pooling, gqa};
}
SnapKVScorer kvpress(Index w, Index k = 5, Pooling pooling = Pooling::avg) {
  return {Reference::kvpress, w, k, pooling, GqaReduce::mean};
}

}  // namespace

TEST_CASE("snap_kv: hand-computed tiny case, 1 head, d = 2, post-RoPE queries", "[scorers][snap_kv]") {
  // Keys at positions 0..4: (1,0) (0,1) (1,1) (0,-1) (1,-1). Window w = 2: q0 = (2,0) at position 3, q1 = (0,2) at
  // position 4, so slots 3 and 4 are the window and the prefix is m = 3. Scale 1/sqrt(2); with r = sqrt(2):
  //   q0 sees slots 0..3, logits (r, 0, r, 0):       P0 = (a, b, a, b), a = e^r / (2e^r + 2), b = 1 / (2e^r + 2)
  //   q1 sees slots 0..4, logits (0, r, r, -r, -r):  P1 = (1, e^r, e^r, e^-r, e^-r) / Z, Z = 1 + 2e^r + 2e^-r
  //   votes (sum, prefix): s0 = a + 1/Z, s1 = b + e^r/Z, s2 = a + e^r/Z.
  kvc::tools::HostCache<float> c({1, 1, 5, 2});
  c.k = {1, 0, 0, 1, 1, 1, 0, -1, 1, -1};
  kvc::test::OwnedQueries<float> q({1, 1, 2, 2});
  q.data = {2, 0, 0, 2};
  kvc::WindowQueries<float> const wq{q.rows()};
  double const r = std::sqrt(2.0), er = std::exp(r);
  double const a = er / (2 * er + 2), b = 1 / (2 * er + 2), z = 1 + 2 * er + 2 / er;
  double const s0 = a + 1 / z, s1 = b + er / z, s2 = a + er / z;

  SECTION("authors, max pooling k = 3") {
    auto const got = snap_scores(kvc::Cpu{}, authors(2, 3, Pooling::max), c.view(), wq);
    REQUIRE(got.status.ok());
    std::vector<double> const expect = {std::max(s0, s1), std::max({s0, s1, s2}), std::max(s1, s2)};
    for (std::size_t j = 0; j < 3; ++j)
      CHECK_THAT(got.scores[j], WithinAbs(expect[j], 1e-6));
    CHECK_THAT(got.scores[3], WithinAbs(s2 + 1, 1e-6));  // window: max(prefix) + 1
    CHECK(got.scores[4] == got.scores[3]);
    CHECK(keep_top(got.scores, 4) == std::vector<Index>{1, 2, 3, 4});
    CHECK(keep_top(got.scores, 3) == std::vector<Index>{1, 3, 4});  // 1 and 2 tie at s2: the lower index wins
  }
  SECTION("authors, avg pooling k = 3 (zero padding counted)") {
    auto const got = snap_scores(kvc::Cpu{}, authors(2, 3, Pooling::avg), c.view(), wq);
    REQUIRE(got.status.ok());
    std::vector<double> const expect = {(s0 + s1) / 3, (s0 + s1 + s2) / 3, (s1 + s2) / 3};
    for (std::size_t j = 0; j < 3; ++j)
      CHECK_THAT(got.scores[j], WithinAbs(expect[j], 1e-6));
    CHECK_THAT(got.scores[3], WithinAbs((s0 + s1 + s2) / 3 + 1, 1e-6));
  }
  SECTION("kvpress: mean over the window, avg pooling k = 3") {
    auto const got = snap_scores(kvc::Cpu{}, kvpress(2, 3), c.view(), wq);
    REQUIRE(got.status.ok());
    std::vector<double> const expect = {(s0 + s1) / 6, (s0 + s1 + s2) / 6, (s1 + s2) / 6};
    for (std::size_t j = 0; j < 3; ++j)
      CHECK_THAT(got.scores[j], WithinAbs(expect[j], 1e-6));
    CHECK_THAT(got.scores[4], WithinAbs((s0 + s1 + s2) / 6 + 1, 1e-6));
  }
  SECTION("kvpress defaults' kernel 5 over a 3-token prefix: every slot averages the whole prefix over 5") {
    auto const got = snap_scores(kvc::Cpu{}, kvpress(2), c.view(), wq);
    REQUIRE(got.status.ok());
    for (std::size_t j = 0; j < 3; ++j)
      CHECK_THAT(got.scores[j], WithinAbs((s0 + s1 + s2) / 10, 1e-6));
  }
}

TEST_CASE("snap_kv: spec §2.6, authors per head (g = 1), avg pooling k = 3", "[scorers][snap_kv]") {
  auto const s = authors(2, 3, Pooling::avg, GqaReduce::per_query_head);
  auto const h0 = spec_scores(spec_example({0}), s);
  check_printed(h0, {0.1426, 0.1596, 0.0661, 0.3905, 0.4046, 0.3895, 0.0651, 0.0340});
  CHECK_THAT(h0[8], WithinAbs(0.4046 + 1, 5e-5 + 1e-6));
  CHECK(h0[9] == h0[8]);
  CHECK(keep_top(h0, 6) == std::vector<Index>{1, 3, 4, 5, 8, 9});  // token 0 is dropped by edge damping
  auto const h1 = spec_scores(spec_example({1}), s);
  check_printed(h1, {0.0661, 0.0839, 0.0533, 0.0533, 0.0533, 0.2838, 0.5062, 0.4884});
  CHECK(keep_top(h1, 6) == std::vector<Index>{1, 5, 6, 7, 8, 9});
  // The same through gqa = mean (g = 1: every reduction is the identity).
  CHECK(spec_scores(spec_example({0}), authors(2, 3, Pooling::avg)) == h0);
}

TEST_CASE("snap_kv: spec §2.6, the authors' expanded storage (one KV head per query head)", "[scorers][snap_kv]") {
  // Two copies of the one KV head, one per query head: each copy keeps its own set (per_query_head).
  auto const ex = spec_example({0, 1}, /*kv_heads=*/2);
  auto const got = spec_scores(ex, authors(2, 3, Pooling::avg, GqaReduce::per_query_head));
  kvc::Press const press{authors(2, 3, Pooling::avg, GqaReduce::per_query_head),
                         kvc::TopKSelector{kvc::FixedBudget{6}}};
  auto const obs = kvc::observe(kvc::WindowQueries<float>{ex.queries.rows()});
  kvc::test::OwnedWorkspace ws(kvc::compress_workspace_bytes(kvc::Cpu{}, press, ex.cache.ext, obs));
  kvc::test::OwnedPlan plan(1, 2, 10);
  REQUIRE(kvc::compress(kvc::Cpu{}, press, ex.cache.view(), obs, plan.plan, ws.get()).ok());
  CHECK(plan.kept(0, 0) == std::vector<Index>{1, 3, 4, 5, 8, 9});
  CHECK(plan.kept(0, 1) == std::vector<Index>{1, 5, 6, 7, 8, 9});
  check_printed(head_of(got, 2, 10, 0, 1), {0.0661, 0.0839, 0.0533, 0.0533, 0.0533, 0.2838, 0.5062, 0.4884});
}

TEST_CASE("snap_kv: spec §2.6, max pooling k = 3 with the lower-index tie rule", "[scorers][snap_kv]") {
  auto const s = authors(2, 3, Pooling::max, GqaReduce::per_query_head);
  auto const h0 = spec_scores(spec_example({0}), s);
  check_printed(h0, {0.3768, 0.3768, 0.0963, 1.0242, 1.0242, 1.0242, 0.0933, 0.0510});
  CHECK(h0[0] == h0[1]);  // a plateau: exactly equal, so the tie rule decides
  CHECK(h0[3] == h0[4]);
  CHECK(h0[4] == h0[5]);
  CHECK(keep_top(h0, 6) == std::vector<Index>{0, 3, 4, 5, 8, 9});
  auto const h1 = spec_scores(spec_example({1}), s);
  check_printed(h1, {0.1450, 0.1450, 0.0533, 0.0533, 0.0533, 0.7449, 0.7449, 0.7449});
  CHECK(keep_top(h1, 6) == std::vector<Index>{0, 5, 6, 7, 8, 9});
}

TEST_CASE("snap_kv: spec §2.6, kvpress with g = 2 keeps one shared set", "[scorers][snap_kv]") {
  auto const ex = spec_example({0, 1});
  auto const got = spec_scores(ex, kvpress(2, 3));
  check_printed(got, {0.0522, 0.0609, 0.0299, 0.1110, 0.1145, 0.1683, 0.1428, 0.1306});
  CHECK_THAT(got[8], WithinAbs(1.1683, 5e-5 + 1e-6));
  // kvpress budget: ratio 0.4 keeps floor(10 * 0.6) = 6, window included.
  kvc::Press const press{kvpress(2, 3), kvc::TopKSelector{kvc::RatioBudget{0.4}}};
  auto const obs = kvc::observe(kvc::WindowQueries<float>{ex.queries.rows()});
  kvc::test::OwnedWorkspace ws(kvc::compress_workspace_bytes(kvc::Cpu{}, press, ex.cache.ext, obs));
  kvc::test::OwnedPlan plan(1, 1, 10);
  REQUIRE(kvc::compress(kvc::Cpu{}, press, ex.cache.view(), obs, plan.plan, ws.get()).ok());
  CHECK(plan.kept(0, 0) == std::vector<Index>{4, 5, 6, 7, 8, 9});
  // The authors' kv-head mode (reduce, then pool) with g = 2 and the float64 reference of the same formula.
  auto const mean = spec_scores(ex, authors(2, 3, Pooling::avg, GqaReduce::mean));
  check_printed(mean, {0.1043, 0.1217, 0.0597, 0.2219, 0.2290, 0.3367, 0.2856, 0.2612});  // = 2 x kvpress (linear)
}

TEST_CASE("snap_kv: the window is always kept, and the kept count is C (or n when n < C)", "[scorers][snap_kv]") {
  auto p = random_problem({2, 2, 120, 16}, 4, 8, 31);
  for (auto const& s : {authors(8, 7, Pooling::max), kvpress(8), authors(8, 5, Pooling::avg, GqaReduce::sum)})
    for (Index budget : {8, 9, 20, 119, 120, 500}) {
      kvc::Press const press{s, kvc::TopKSelector{kvc::FixedBudget{budget}}};
      auto const obs = kvc::observe(kvc::WindowQueries<float>{p.queries.rows()});
      kvc::test::OwnedWorkspace ws(kvc::compress_workspace_bytes(kvc::Cpu{}, press, p.cache.ext, obs));
      kvc::test::OwnedPlan plan(2, 2, 120);
      REQUIRE(kvc::compress(kvc::Cpu{}, press, p.cache.view(), obs, plan.plan, ws.get()).ok());
      for (Index b = 0; b < 2; ++b)
        for (Index h = 0; h < 2; ++h) {
          auto const kept = plan.kept(b, h);
          REQUIRE(static_cast<Index>(kept.size()) == std::min<Index>(budget, 120));
          for (Index t = 112; t < 120; ++t)
            CHECK(std::binary_search(kept.begin(), kept.end(), t));
        }
    }
}

TEST_CASE("snap_kv: scores match the float64 reference (authors mean/max/sum, kvpress, GQA g = 2)",
          "[scorers][snap_kv]") {
  auto const p = random_problem({2, 2, 300, 32}, 4, 12, 7);  // 300 slots: three key tiles
  std::vector<std::vector<Index>> const q_pos = {last_positions(300, 10), last_positions(300, 10)};
  for (auto const& s : {authors(10, 7, Pooling::max), authors(10, 7, Pooling::max, GqaReduce::max),
                        authors(10, 5, Pooling::avg, GqaReduce::sum), authors(10, 1, Pooling::avg), kvpress(10),
                        kvpress(10, 3, Pooling::max)}) {
    auto const got = snap_scores(kvc::Cpu{}, s, p.cache.view(), kvc::WindowQueries<float>{p.queries.rows()});
    REQUIRE(got.status.ok());
    check_against_reference(p, got.scores, s, q_pos);
  }
}

TEST_CASE("snap_kv: sum and mean votes select the same tokens, and scaling the scores changes nothing",
          "[scorers][snap_kv]") {
  auto const p = random_problem({1, 2, 200, 16}, 2, 16, 41);  // g = 1
  kvc::WindowQueries<float> const wq{p.queries.rows()};
  for (Pooling pooling : {Pooling::avg, Pooling::max}) {
    auto const sum = snap_scores(kvc::Cpu{}, authors(16, 5, pooling), p.cache.view(), wq);
    auto const mean = snap_scores(kvc::Cpu{}, kvpress(16, 5, pooling), p.cache.view(), wq);
    REQUIRE(sum.status.ok());
    REQUIRE(mean.status.ok());
    for (Index h = 0; h < 2; ++h) {
      auto const a = head_of(sum.scores, 2, 200, 0, h), b = head_of(mean.scores, 2, 200, 0, h);
      for (Index t = 0; t < 184; ++t)  // prefix: the window sum is w times the window mean
        CHECK_THAT(a[t], WithinAbs(16.0 * b[t], 1e-5 * std::abs(a[t]) + 1e-7));
      for (Index budget : {16, 50, 100, 150})
        CHECK(keep_top(a, budget) == keep_top(b, budget));
      std::vector<float> scaled(a);
      for (float& x : scaled)
        x *= 3.5f;
      CHECK(keep_top(scaled, 77) == keep_top(a, 77));
    }
  }
  // gqa = sum is g x gqa = mean before (positively homogeneous) pooling: same prefix ranking.
  auto const q = random_problem({1, 2, 150, 16}, 6, 8, 43);  // g = 3
  kvc::WindowQueries<float> const wq3{q.queries.rows()};
  auto const s = snap_scores(kvc::Cpu{}, authors(8, 7, Pooling::max, GqaReduce::sum), q.cache.view(), wq3);
  auto const m = snap_scores(kvc::Cpu{}, authors(8, 7, Pooling::max, GqaReduce::mean), q.cache.view(), wq3);
  for (Index t = 0; t < 142; ++t)
    CHECK_THAT(s.scores[t], WithinAbs(3.0 * m.scores[t], 1e-5 * std::abs(s.scores[t])));
  CHECK(keep_top(head_of(s.scores, 2, 150, 0, 1), 40) == keep_top(head_of(m.scores, 2, 150, 0, 1), 40));
}

TEST_CASE("snap_kv: g = 1 per_query_head equals every group reduction", "[scorers][snap_kv]") {
  auto const p = random_problem({2, 3, 90, 8}, 3, 8, 5);
  kvc::WindowQueries<float> const wq{p.queries.rows()};
  auto const pqh = snap_scores(kvc::Cpu{}, authors(8, 7, Pooling::max, GqaReduce::per_query_head), p.cache.view(), wq);
  REQUIRE(pqh.status.ok());
  for (GqaReduce gqa : {GqaReduce::mean, GqaReduce::max, GqaReduce::sum})
    CHECK(snap_scores(kvc::Cpu{}, authors(8, 7, Pooling::max, gqa), p.cache.view(), wq).scores == pqh.scores);
}

TEST_CASE("snap_kv: invalid parameters and shapes are rejected", "[scorers][snap_kv]") {
  auto const p = random_problem({1, 2, 40, 8}, 4, 6, 9);
  kvc::WindowQueries<float> const wq{p.queries.rows()};
  auto code = [&](SnapKVScorer const& s) { return snap_scores(kvc::Cpu{}, s, p.cache.view(), wq).status.code(); };
  CHECK(code(authors(6, 7, Pooling::max)) == kvc::Errc::ok);
  CHECK(code(authors(6, 4, Pooling::max)) == kvc::Errc::invalid_argument);  // even kernel
  CHECK(code(authors(6, 6, Pooling::avg)) == kvc::Errc::invalid_argument);
  CHECK(code(authors(6, 0, Pooling::avg)) == kvc::Errc::invalid_argument);
  CHECK(code(authors(0, 7, Pooling::max)) == kvc::Errc::invalid_argument);  // empty window
  CHECK(code(authors(7, 7, Pooling::max)) == kvc::Errc::invalid_argument);  // more than the 6 query rows
  CHECK(code(authors(6, 7, Pooling::max, GqaReduce::per_query_head)) == kvc::Errc::invalid_argument);  // g = 2
  CHECK(code({Reference::kvpress, 6, 5, Pooling::avg, GqaReduce::max}) == kvc::Errc::invalid_argument);
  CHECK(SnapKVScorer::kvpress().check().ok());
  CHECK(SnapKVScorer{}.check().ok());
  // Query heads not a multiple of KV heads, and a head dim that differs from the keys'.
  kvc::test::OwnedQueries<float> three({1, 3, 6, 8}), wide({1, 4, 6, 16});
  CHECK(snap_scores(kvc::Cpu{}, authors(6, 7, Pooling::max), p.cache.view(), kvc::WindowQueries<float>{three.rows()})
            .status.code() == kvc::Errc::invalid_argument);
  CHECK(snap_scores(kvc::Cpu{}, authors(6, 7, Pooling::max), p.cache.view(), kvc::WindowQueries<float>{wide.rows()})
            .status.code() == kvc::Errc::invalid_argument);
  // A sequence holding fewer tokens than the window has rows: the default positions would be negative.
  auto short_seq = p;
  short_seq.cache.lengths = {5};
  CHECK(snap_scores(kvc::Cpu{}, authors(6, 7, Pooling::max), short_seq.cache.view(), wq).status.code() ==
        kvc::Errc::invalid_argument);
  short_seq.cache.lengths = {6};
  CHECK(snap_scores(kvc::Cpu{}, authors(6, 7, Pooling::max), short_seq.cache.view(), wq).status.ok());
  // A workspace smaller than the query.
  auto const obs = kvc::observe(wq);
  kvc::test::OwnedScores out(1, 2, 40);
  kvc::test::OwnedWorkspace ws(kvc::score_workspace_bytes(kvc::Cpu{}, authors(6, 7, Pooling::max), p.cache.ext, obs) /
                               2);
  CHECK(kvc::score(kvc::Cpu{}, authors(6, 7, Pooling::max), p.cache.view(), obs, out.span, ws.get()).code() ==
        kvc::Errc::out_of_capacity);
}

TEST_CASE("snap_kv: window_size below the query rows uses the last window_size rows", "[scorers][snap_kv]") {
  auto const p = random_problem({1, 2, 64, 8}, 2, 10, 13);
  kvc::test::OwnedQueries<float> last4({1, 2, 4, 8});
  for (Index h = 0; h < 2; ++h)
    std::copy_n(p.queries.row(0, h, 6), 4 * 8, last4.row(0, h, 0));
  for (auto const& s : {authors(4, 7, Pooling::max), kvpress(4)}) {
    auto const all = snap_scores(kvc::Cpu{}, s, p.cache.view(), kvc::WindowQueries<float>{p.queries.rows()});
    auto const cut = snap_scores(kvc::Cpu{}, s, p.cache.view(), kvc::WindowQueries<float>{last4.rows()});
    REQUIRE(all.status.ok());
    CHECK(all.scores == cut.scores);
  }
}

TEST_CASE("snap_kv: pre-RoPE queries with a table equal the same queries rotated by hand", "[scorers][snap_kv]") {
  Index const n = 80, d = 16, w = 6;
  auto const p = random_problem({1, 2, n, d}, 4, w, 17);
  for (kvc::RopeStyle style : {kvc::RopeStyle::neox, kvc::RopeStyle::interleaved}) {
    double const theta = 500.0;  // fast rotations, so a wrong position would show
    kvc::test::OwnedRope const rope({.theta = theta, .style = style}, d, n);
    // Rotate every window row by hand (float64) to its position n - w + i; independent of RopeTable::rotate.
    kvc::test::OwnedQueries<float> post(p.queries.ext);
    for (Index qh = 0; qh < 4; ++qh)
      for (Index i = 0; i < w; ++i) {
        float const* x = p.queries.row(0, qh, i);
        float* y = post.row(0, qh, i);
        double const pos = static_cast<double>(n - w + i);
        for (Index k = 0; k < d / 2; ++k) {
          Index const a = style == kvc::RopeStyle::neox ? k : 2 * k,
                      b = style == kvc::RopeStyle::neox ? k + d / 2 : 2 * k + 1;
          double const ang = pos * std::pow(theta, -2.0 * static_cast<double>(k) / static_cast<double>(d));
          y[a] = static_cast<float>(x[a] * std::cos(ang) - x[b] * std::sin(ang));
          y[b] = static_cast<float>(x[b] * std::cos(ang) + x[a] * std::sin(ang));
        }
      }
    for (auto const& s : {authors(w, 7, Pooling::max), kvpress(w)}) {
      auto const pre =
          snap_scores(kvc::Cpu{}, s, p.cache.view(), kvc::WindowQueries<float>{p.queries.rows(), rope.table});
      auto const hand = snap_scores(kvc::Cpu{}, s, p.cache.view(), kvc::WindowQueries<float>{post.rows()});
      auto const unrotated = snap_scores(kvc::Cpu{}, s, p.cache.view(), kvc::WindowQueries<float>{p.queries.rows()});
      REQUIRE(pre.status.ok());
      REQUIRE(hand.status.ok());
      float worst = 0, moved = 0;
      for (std::size_t i = 0; i < pre.scores.size(); ++i) {
        worst = std::max(worst, std::abs(pre.scores[i] - hand.scores[i]));
        moved = std::max(moved, std::abs(pre.scores[i] - unrotated.scores[i]));
      }
      CHECK(worst <= 1e-5f);
      CHECK(moved > 1e-3f);  // the rotation matters in this case
    }
  }
  // A table that does not reach the last query position is rejected.
  kvc::test::OwnedRope const short_rope({}, d, n - 1);
  CHECK(snap_scores(kvc::Cpu{}, authors(w, 7, Pooling::max), p.cache.view(),
                    kvc::WindowQueries<float>{p.queries.rows(), short_rope.table})
            .status.code() == kvc::Errc::invalid_argument);
}

TEST_CASE("snap_kv: explicit query positions, keys after the window queries are the window", "[scorers][snap_kv]") {
  auto const p = random_problem({2, 2, 60, 8}, 4, 5, 19);
  // Positions equal to the default ones: bit-identical.
  std::vector<Index> const same = {55, 56, 57, 58, 59, 55, 56, 57, 58, 59};
  auto const dflt =
      snap_scores(kvc::Cpu{}, authors(5, 7, Pooling::max), p.cache.view(), kvc::WindowQueries<float>{p.queries.rows()});
  auto const expl = snap_scores(kvc::Cpu{}, authors(5, 7, Pooling::max), p.cache.view(),
                                kvc::WindowQueries<float>{p.queries.rows(), {}, same.data()});
  REQUIRE(expl.status.ok());
  CHECK(expl.scores == dflt.scores);
  // Sequence 0's window sits at 30..34, sequence 1's at 40..44: later keys are invisible to every query and are
  // at or after the first window query, so they are protected like the window.
  std::vector<Index> const early = {30, 31, 32, 33, 34, 40, 41, 42, 43, 44};
  for (auto const& s : {authors(5, 7, Pooling::max), kvpress(5)}) {
    auto const got =
        snap_scores(kvc::Cpu{}, s, p.cache.view(), kvc::WindowQueries<float>{p.queries.rows(), {}, early.data()});
    REQUIRE(got.status.ok());
    check_against_reference(p, got.scores, s, {{30, 31, 32, 33, 34}, {40, 41, 42, 43, 44}});
    CHECK(got.scores[59] == got.scores[30]);
  }
  std::vector<Index> const negative = {-1, 0, 1, 2, 3, 0, 1, 2, 3, 4};
  CHECK(snap_scores(kvc::Cpu{}, kvpress(5), p.cache.view(),
                    kvc::WindowQueries<float>{p.queries.rows(), {}, negative.data()})
            .status.code() == kvc::Errc::invalid_argument);
}

TEST_CASE("snap_kv: padding past per-sequence lengths scores -inf and is never read", "[scorers][snap_kv]") {
  auto p = random_problem({2, 2, 40, 8}, 4, 6, 23);
  p.cache.lengths = {40, 27};
  for (Index h = 0; h < 2; ++h)  // garbage in sequence 1's padding: it must not reach any score
    for (Index t = 27; t < 40; ++t)
      std::fill_n(p.cache.key(1, h, t), 8, std::numeric_limits<float>::quiet_NaN());
  // Sequence 1 alone, as a dense 27-token cache.
  kvc::tools::HostCache<float> alone({1, 2, 27, 8});
  for (Index h = 0; h < 2; ++h)
    std::copy_n(p.cache.key(1, h, 0), 27 * 8, alone.key(0, h, 0));
  kvc::test::OwnedQueries<float> q1({1, 4, 6, 8});
  std::copy_n(p.queries.row(1, 0, 0), 4 * 6 * 8, q1.row(0, 0, 0));
  for (auto const& s : {authors(6, 7, Pooling::max), kvpress(6)}) {
    auto const got = snap_scores(kvc::Cpu{}, s, p.cache.view(), kvc::WindowQueries<float>{p.queries.rows()});
    auto const ref = snap_scores(kvc::Cpu{}, s, alone.view(), kvc::WindowQueries<float>{q1.rows()});
    REQUIRE(got.status.ok());
    REQUIRE(ref.status.ok());
    for (Index h = 0; h < 2; ++h) {
      auto const row = head_of(got.scores, 2, 40, 1, h);
      for (Index t = 0; t < 27; ++t)
        CHECK(row[t] == ref.scores[h * 27 + t]);
      for (Index t = 27; t < 40; ++t)
        CHECK(row[t] == neg_inf);
    }
    check_against_reference(p, got.scores, s, {last_positions(40, 6), last_positions(27, 6)});
  }
  p.cache.lengths = {40, 41};
  CHECK(
      snap_scores(kvc::Cpu{}, kvpress(6), p.cache.view(), kvc::WindowQueries<float>{p.queries.rows()}).status.code() ==
      kvc::Errc::invalid_argument);
}

TEST_CASE("snap_kv: per-head lengths and positions differing within a sequence", "[scorers][snap_kv]") {
  // Head 0 holds positions 0..47; head 1, after an earlier per-head eviction, holds 20 of them (window 44..47
  // included), compacted to slots 0..19, its padding filled with garbage.
  auto p = random_problem({1, 2, 48, 8}, 4, 4, 29);
  p.cache.track(48);
  p.cache.lengths = {48, 20};
  std::vector<Index> const held = {0, 1, 2, 5, 8, 9, 13, 17, 18, 22, 25, 30, 31, 33, 36, 40, 44, 45, 46, 47};
  std::copy(held.begin(), held.end(), p.cache.positions.begin() + 48);
  for (Index t = 20; t < 48; ++t) {
    p.cache.positions[static_cast<std::size_t>(48 + t)] = 1000 + t;  // padding positions are never read either
    std::fill_n(p.cache.key(0, 1, t), 8, std::numeric_limits<float>::quiet_NaN());
  }
  for (auto const& s : {authors(4, 5, Pooling::max), authors(4, 3, Pooling::avg, GqaReduce::sum), kvpress(4)}) {
    auto const got = snap_scores(kvc::Cpu{}, s, p.cache.view(), kvc::WindowQueries<float>{p.queries.rows()});
    REQUIRE(got.status.ok());
    check_against_reference(p, got.scores, s, {last_positions(48, 4)});
    CHECK(got.scores[48 + 16] == got.scores[48 + 19]);  // head 1's window slots 16..19 are protected
    CHECK(got.scores[48 + 16] > *std::max_element(got.scores.begin() + 48, got.scores.begin() + 48 + 16));
  }
}

TEST_CASE("snap_kv: a thread pool gives bit-identical scores", "[scorers][snap_kv]") {
  auto p = random_problem({4, 2, 600, 32}, 4, 16, 37);  // big enough that workers really overlap
  p.cache.lengths = {600, 131, 1, 500, 0, 77, 599, 600};
  p.cache.per_head = true;
  kvc::ThreadPool pool(2);
  for (auto const& s : {authors(16, 7, Pooling::max), kvpress(16), authors(16, 5, Pooling::avg, GqaReduce::max)}) {
    // Sequence 2's first head is empty; its window queries see only head 1's tokens.
    auto const serial = snap_scores(kvc::Cpu{}, s, p.cache.view(), kvc::WindowQueries<float>{p.queries.rows()});
    REQUIRE(serial.status.ok());
    for (int rep = 0; rep < 3; ++rep) {
      auto const parallel = snap_scores(pool.cpu(), s, p.cache.view(), kvc::WindowQueries<float>{p.queries.rows()});
      REQUIRE(parallel.status.ok());
      CHECK(serial.scores == parallel.scores);
    }
  }
}

TEST_CASE("snap_kv: 16-bit keys and queries score exactly as their widened fp32 copies", "[scorers][snap_kv]") {
  auto const p = random_problem({1, 2, 150, 16}, 4, 8, 47);
  auto run = [&](auto tag) {
    using T = decltype(tag);
    kvc::tools::HostCache<T> c(p.cache.ext);
    kvc::tools::HostCache<float> widened(p.cache.ext);
    kvc::test::OwnedQueries<T> q(p.queries.ext);
    kvc::test::OwnedQueries<float> qw(p.queries.ext);
    for (std::size_t i = 0; i < c.k.size(); ++i) {
      c.k[i] = T(p.cache.k[i]);
      widened.k[i] = kvc::to_float(c.k[i]);
    }
    for (std::size_t i = 0; i < q.data.size(); ++i) {
      q.data[i] = T(p.queries.data[i]);
      qw.data[i] = kvc::to_float(q.data[i]);
    }
    for (auto const& s : {authors(8, 7, Pooling::max), kvpress(8)}) {
      auto const narrow = snap_scores(kvc::Cpu{}, s, c.view(), kvc::WindowQueries<T>{q.rows()});
      auto const wide = snap_scores(kvc::Cpu{}, s, widened.view(), kvc::WindowQueries<float>{qw.rows()});
      REQUIRE(narrow.status.ok());
      CHECK(narrow.scores == wide.scores);
    }
  };
  run(kvc::half{});
  run(kvc::bfloat16{});
}

TEST_CASE("snap_kv: paged caches and token-major query rows score like dense BHTD ones", "[scorers][snap_kv]") {
  kvc::KVExtents const e{2, 2, 40, 8};
  auto const p = random_problem(e, 4, 6, 53);
  // Pages of 4 tokens (HND), sequence 0 on even pool pages, sequence 1 on odd ones, in a scrambled order.
  std::vector<std::int32_t> table(2 * 10);
  for (Index b = 0; b < 2; ++b)
    for (Index pg = 0; pg < 10; ++pg)
      table[static_cast<std::size_t>(b * 10 + pg)] = static_cast<std::int32_t>(2 * ((pg * 3) % 10) + b);
  auto const layout = kvc::paged_layout(e, 4, kvc::PageOrder::hnd, table.data(), 10, 20);
  std::vector<float> kpool(static_cast<std::size_t>(20 * layout.stride_page)), vpool(kpool.size());
  for (Index b = 0; b < 2; ++b)
    for (Index h = 0; h < 2; ++h)
      for (Index t = 0; t < 40; ++t)
        std::copy_n(p.cache.k.data() + ((b * 2 + h) * 40 + t) * 8, 8, kpool.data() + layout.offset(b, h, t));
  auto const paged = kvc::make_cache(kvc::TokenRows<float, kvc::PagedLayout>(kpool.data(), layout),
                                     kvc::TokenRows<float, kvc::PagedLayout>(vpool.data(), layout));
  // The same queries stored token-major [B, w, Hq, d].
  kvc::KVExtents const qe = p.queries.ext;
  std::vector<float> bthd(p.queries.data.size());
  auto const tl = kvc::bthd_layout(qe);
  for (Index b = 0; b < qe.batch; ++b)
    for (Index h = 0; h < qe.heads; ++h)
      for (Index i = 0; i < qe.tokens; ++i)
        std::copy_n(p.queries.row(b, h, i), 8, bthd.data() + tl.offset(b, h, i));
  kvc::TokenRows<float const, kvc::StridedLayout> const token_major(bthd.data(), tl);
  for (auto const& s : {authors(6, 7, Pooling::max), kvpress(6)}) {
    auto const dense = snap_scores(kvc::Cpu{}, s, p.cache.view(), kvc::WindowQueries<float>{p.queries.rows()});
    auto const pg = snap_scores(kvc::Cpu{}, s, paged, kvc::WindowQueries<float>{token_major});
    REQUIRE(pg.status.ok());
    CHECK(pg.scores == dense.scores);
  }
}

TEST_CASE("snap_kv: the workspace query stays sane for an invalid window size", "[scorers][snap_kv]") {
  // kvc::score rejects window_size < 1 before touching the workspace, so the query must not ask for absurd
  // amounts (a caller allocates what it returns).
  auto const p = random_problem({1, 2, 40, 8}, 4, 6, 59);
  auto const obs = kvc::observe(kvc::WindowQueries<float>{p.queries.rows()});
  for (Index w : {Index{-1}, Index{-100}, -(Index{1} << 40)}) {
    auto const s = authors(w, 7, Pooling::max);
    std::size_t const bytes = kvc::score_workspace_bytes(kvc::Cpu{}, s, p.cache.ext, obs);
    INFO("window_size " << w << ": " << bytes << " bytes");
    REQUIRE(bytes <= kvc::score_workspace_bytes(kvc::Cpu{}, authors(6, 7, Pooling::max), p.cache.ext, obs));
    kvc::test::OwnedWorkspace ws(bytes);
    kvc::test::OwnedScores out(1, 2, 40);
    CHECK(kvc::score(kvc::Cpu{}, s, p.cache.view(), obs, out.span, ws.get()).code() == kvc::Errc::invalid_argument);
  }
}

TEST_CASE("snap_kv: a NaN or Inf key gets attention 0, the others a softmax over the finite slots",
          "[scorers][snap_kv]") {
  // The shared window kernel (SnapKV, TOVA, H2O, ObservedAttention, UNComp, RDKV, MomentKV's base). Zero queries:
  // every finite key has logit 0, a bad one 0 x bad = NaN. Six slots, window w = 2 at positions 4 and 5, slot 1 bad:
  // row 4 sees slots {0, 2, 3, 4} (1/4 each), row 5 sees {0, 2, 3, 4, 5} (1/5 each). Authors' votes, kernel 1:
  // prefix slots 0, 2, 3 score 1/4 + 1/5 = 0.45, slot 1 scores 0, the window max + 1 = 1.45.
  float const nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  for (float const bad : {nan, inf, -inf}) {
    auto c = kvc::tools::HostCache<float>::random({1, 1, 6, 2}, 91);
    c.k[2] = bad;  // slot 1, first element
    kvc::test::OwnedQueries<float> q({1, 1, 2, 2});
    std::fill(q.data.begin(), q.data.end(), 0.0f);
    auto const got =
        snap_scores(kvc::Cpu{}, authors(2, 1, Pooling::max), c.view(), kvc::WindowQueries<float>{q.rows()});
    REQUIRE(got.status.ok());
    CHECK_THAT(got.scores[0], WithinAbs(0.45, 1e-6));
    CHECK(got.scores[1] == 0.0f);
    CHECK_THAT(got.scores[2], WithinAbs(0.45, 1e-6));
    CHECK_THAT(got.scores[3], WithinAbs(0.45, 1e-6));
    CHECK_THAT(got.scores[4], WithinAbs(1.45, 1e-6));
    CHECK_THAT(got.scores[5], WithinAbs(1.45, 1e-6));
  }
}

TEST_CASE("snap_kv: the formulas both backends call, by hand (pooling, group reduction, slot score, protection)",
          "[scorers][snap_kv]") {
  std::vector<float> const x = {1, 5, 2, 8, 3};
  auto at = [&](Pooling p, Index k, Index j) {
    return kvc::pooled_at(p, k, 5, j, [&](Index t) { return x[static_cast<std::size_t>(t)]; });
  };
  // max, k = 3: windows [0, 2), [1, 4), [3, 5); avg divides by k with the padding counted; chunk_mean, k = 2:
  // chunks {1, 5}, {2, 8}, {3} (the last over its own slot).
  CHECK(at(Pooling::max, 3, 0) == 5.0f);
  CHECK(at(Pooling::max, 3, 2) == 8.0f);
  CHECK(at(Pooling::max, 3, 4) == 8.0f);
  CHECK(at(Pooling::avg, 3, 0) == 2.0f);
  CHECK(at(Pooling::avg, 3, 4) == 11.0f / 3.0f);
  CHECK(at(Pooling::chunk_mean, 2, 1) == 3.0f);
  CHECK(at(Pooling::chunk_mean, 2, 3) == 5.0f);
  CHECK(at(Pooling::chunk_mean, 2, 4) == 3.0f);

  std::vector<float> const votes = {2, 7, 4};
  auto vote = [&](Index q) { return votes[static_cast<std::size_t>(q)]; };
  CHECK(kvc::reduce_group(GqaReduce::mean, 3, vote) == 13.0f / 3.0f);
  CHECK(kvc::reduce_group(GqaReduce::max, 3, vote) == 7.0f);
  CHECK(kvc::reduce_group(GqaReduce::sum, 3, vote) == 13.0f);

  // Two query heads' votes over a prefix of m = 3 slots.
  std::vector<float> const col = {1, 2, 3, /* q1 */ 3, 0, 1};
  auto c = [&](Index q, Index t) { return col[static_cast<std::size_t>(q * 3 + t)]; };
  SnapKVScorer authors{Reference::authors, 2, 3, Pooling::max, GqaReduce::max};
  CHECK(kvc::snap_kv_score(authors, 2, 3, 1, c) == 3.0f);  // reduced {3, 2, 3}, then max-pooled
  authors.gqa = GqaReduce::mean;
  CHECK(kvc::snap_kv_score(authors, 2, 3, 1, c) == 2.0f);  // reduced {2, 1, 2}
  SnapKVScorer const kvpress{Reference::kvpress, 2, 3, Pooling::avg, GqaReduce::mean};
  // Each head avg-pooled at slot 1 (2 and 4/3), times 1 / (w g) = 1/4, summed in head order.
  CHECK_THAT(kvc::snap_kv_score(kvpress, 2, 3, 1, c), WithinAbs(2.0 / 4 + 4.0 / 3 / 4, 1e-7));

  CHECK(kvc::protected_score(4.5f, 3) == 5.5f);
  CHECK(kvc::protected_score(-7.0f, 0) == 1.0f);  // an empty prefix
}
