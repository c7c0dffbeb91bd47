// SPDX-License-Identifier: Apache-2.0
// tests/scorers/tova_test.cpp mirrors include/kvc/scorers/tova.hpp (CPU kernel in backend/cpu/scorers/snap_kv.hpp).
// Reference values: the spec's worked example (specs/original_baselines.md §3.5, printed to 4 decimals), built from
// one-hot keys so the logits are exactly the printed ones, and a float64 re-statement of §3.1 in this file.
#include <kvc/backend/cpu/pipeline/compact.hpp>
#include <kvc/backend/cpu/scorers/tova.hpp>
#include <kvc/backend/cpu/selectors/top_k.hpp>
#include <kvc/backend/cpu/thread_pool.hpp>
#include <kvc/pipeline/press.hpp>

#include "common/synthetic.hpp"
#include "support/catch.hpp"
#include "support/helpers.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

using Catch::Matchers::WithinAbs;
using kvc::Index;
using kvc::Reference;
using kvc::TOVAScorer;

struct Scored {
  kvc::Status status;
  std::vector<float> scores;
};

template <class Cache, class T>
Scored tova_scores(kvc::Cpu const& cpu, TOVAScorer const& s, Cache const& cache, kvc::WindowQueries<T> const& wq) {
  auto const obs = kvc::observe(wq);
  kvc::KVExtents const e = cache.keys.extents();
  kvc::test::OwnedScores out(e.batch, e.heads, e.tokens);
  kvc::test::OwnedWorkspace ws(kvc::score_workspace_bytes(cpu, s, e, obs));
  kvc::Status const st = kvc::score(cpu, s, cache, obs, out.span, ws.get());
  return {st, out.data};
}

/// One-hot keys e_j (d = 16, sqrt(d) = 4 exact) and one window row per query head q = 4 * logits, so that every
/// logit q . k_j / sqrt(d) is the given one. `logits[h]` has one entry per slot.
struct OneHot {
  kvc::tools::HostCache<float> cache;
  kvc::test::OwnedQueries<float> queries;
};

OneHot one_hot(std::vector<std::vector<double>> const& logits) {
  Index const n = static_cast<Index>(logits[0].size()), hq = static_cast<Index>(logits.size()), d = 16;
  OneHot o{kvc::tools::HostCache<float>({1, 1, n, d}), kvc::test::OwnedQueries<float>({1, hq, 1, d})};
  for (Index j = 0; j < n; ++j)
    o.cache.key(0, 0, j)[j] = 1.0f;
  for (Index h = 0; h < hq; ++h)
    for (Index j = 0; j < n; ++j)
      o.queries.row(0, h, 0)[j] =
          static_cast<float>(4.0 * logits[static_cast<std::size_t>(h)][static_cast<std::size_t>(j)]);
  return o;
}

void check_printed(std::vector<float> const& got, std::vector<double> const& printed) {
  for (std::size_t j = 0; j < printed.size(); ++j) {
    INFO("slot " << j);
    CHECK_THAT(got[j], WithinAbs(printed[j], 5e-5 + 1e-6));  // printed to 4 decimals
  }
}

template <class Sel>
std::vector<Index> compress_kept(TOVAScorer const& s, Sel const& sel, OneHot const& o, Index b = 0, Index h = 0) {
  kvc::Press const press{s, sel};
  auto const obs = kvc::observe(kvc::WindowQueries<float>{o.queries.rows()});
  kvc::test::OwnedWorkspace ws(kvc::compress_workspace_bytes(kvc::Cpu{}, press, o.cache.ext, obs));
  kvc::test::OwnedPlan plan(o.cache.ext.batch, o.cache.ext.heads, o.cache.ext.tokens);
  REQUIRE(kvc::compress(kvc::Cpu{}, press, o.cache.view(), obs, plan.plan, ws.get()).ok());
  return plan.kept(b, h);
}

/// float64 TOVA for sequence b: the last window row of every query head (post-RoPE) at position `q_pos` over the
/// n slots of KV head (q / g) at `positions`; mean over all query heads.
std::vector<double> tova_reference(kvc::tools::HostCache<float> const& c, kvc::test::OwnedQueries<float> const& q,
                                   Index b, Index q_pos, Reference ref) {
  auto const view = c.view();
  Index const d = c.ext.dim, hq = q.ext.heads, g = hq / c.ext.heads, n = view.length(b, 0);
  std::vector<double> s(static_cast<std::size_t>(n), 0.0);
  for (Index qh = 0; qh < hq; ++qh) {
    Index const h = qh / g;
    float const* x = q.row(b, qh, q.ext.tokens - 1);
    std::vector<double> l(static_cast<std::size_t>(n), -std::numeric_limits<double>::infinity());
    double top = -std::numeric_limits<double>::infinity();
    for (Index j = 0; j < n; ++j)
      if (view.position(b, h, j) <= q_pos) {
        double dot = 0;
        for (Index i = 0; i < d; ++i)
          dot += double{x[i]} * view.keys.row(b, h, j)[i];
        l[j] = dot / std::sqrt(static_cast<double>(d));
        top = std::max(top, l[j]);
      }
    double z = 0;
    for (double v : l)
      z += std::exp(v - top);
    for (Index j = 0; j < n; ++j)
      s[j] += std::exp(l[j] - top) / z / static_cast<double>(hq);
  }
  if (ref == Reference::kvpress) {
    Index m = 0;
    while (m < n && view.position(b, 0, m) < q_pos)
      ++m;
    double const top = m > 0 ? *std::max_element(s.begin(), s.begin() + m) : 0.0;
    std::fill(s.begin() + m, s.end(), top + 1.0);
  }
  return s;
}

}  // namespace

TEST_CASE("tova: spec §3.5, the head mean of the last query's attention", "[scorers][tova]") {
  // N = 8, 2 query heads on 1 KV head; the last prompt token (position 7) attends to keys 0..7, itself included.
  auto const o = one_hot({{3, 0, 1, 0, 2, 0, 0, 0.5}, {2, 1, 0, 0, 0, 2, 0.8, 0}});
  auto const a = tova_scores(kvc::Cpu{}, TOVAScorer{}, o.cache.view(), kvc::WindowQueries<float>{o.queries.rows()});
  REQUIRE(a.status.ok());
  check_printed(a.scores, {0.4359, 0.0712, 0.0590, 0.0350, 0.1242, 0.1697, 0.0609, 0.0441});
  // Hand: head 0's probability of key 0 is e^3 / (e^3 + e^2 + e + e^0.5 + 4).
  double const e = std::exp(1.0);
  double const p00 = std::exp(3.0) / (std::exp(3.0) + std::exp(2.0) + e + std::exp(0.5) + 4);
  double const p10 = std::exp(2.0) / (2 * std::exp(2.0) + e + std::exp(0.8) + 4 * 1.0);
  CHECK_THAT(a.scores[0], WithinAbs((p00 + p10) / 2, 1e-6));

  // Authors: M = 5 absolute, nothing protected: the last prompt token 7 is evicted.
  CHECK(compress_kept(TOVAScorer{}, kvc::TopKSelector{kvc::FixedBudget{5}}, o) == std::vector<Index>{0, 1, 4, 5, 6});
  // kvpress: r = 3/8 keeps floor(8 * 5/8) = 5: the top 4 of tokens 0..6, plus the last token at max + 1.
  TOVAScorer const kvp{Reference::kvpress};
  auto const k = tova_scores(kvc::Cpu{}, kvp, o.cache.view(), kvc::WindowQueries<float>{o.queries.rows()});
  REQUIRE(k.status.ok());
  check_printed(k.scores, {0.4359, 0.0712, 0.0590, 0.0350, 0.1242, 0.1697, 0.0609, 1.4359});
  CHECK(compress_kept(kvp, kvc::TopKSelector{kvc::RatioBudget{0.375}}, o) == std::vector<Index>{0, 1, 4, 5, 7});
}

TEST_CASE("tova: spec §3.5 decode step, token 8 evicts itself", "[scorers][tova]") {
  // Cache slots hold positions [0, 1, 4, 5, 6] plus the new token 8; the query at position 8 (the default: the last
  // position of the context) attends to all 6.
  auto o = one_hot({{2, 1, 0, 1, 0.5, -1}, {1, 2, 0, 0, 1, -1}});
  o.cache.track(6);
  std::vector<Index> const held = {0, 1, 4, 5, 6, 8};
  std::copy(held.begin(), held.end(), o.cache.positions.begin());
  auto const a = tova_scores(kvc::Cpu{}, TOVAScorer{}, o.cache.view(), kvc::WindowQueries<float>{o.queries.rows()});
  REQUIRE(a.status.ok());
  check_printed(a.scores, {0.3227, 0.3290, 0.0645, 0.1187, 0.1415, 0.0237});
  // Authors, FixedBudget{5} over the 6-slot cache: slot 5 (token 8) is the one evicted.
  kvc::Press const press{TOVAScorer{}, kvc::TopKSelector{kvc::FixedBudget{5}}};
  auto const obs = kvc::observe(kvc::WindowQueries<float>{o.queries.rows()});
  kvc::test::OwnedWorkspace ws(kvc::compress_workspace_bytes(kvc::Cpu{}, press, o.cache.ext, obs));
  kvc::test::OwnedPlan plan(1, 1, 6);
  REQUIRE(kvc::compress(kvc::Cpu{}, press, o.cache.view(), obs, plan.plan, ws.get()).ok());
  CHECK(plan.kept(0, 0) == std::vector<Index>{0, 1, 2, 3, 4});
  REQUIRE(kvc::compact(kvc::Cpu{}, plan.plan, o.cache.view()).ok());
  CHECK(o.cache.head_positions(0, 0) == std::vector<Index>{0, 1, 4, 5, 6});  // the cache stays [0, 1, 4, 5, 6]
  CHECK(o.cache.lengths == std::vector<Index>{5});
}

TEST_CASE("tova: kvpress protects exactly the newest slot (position-based)", "[scorers][tova]") {
  auto o = one_hot({{2, 1, 0, 1, 0.5, -1}, {1, 2, 0, 0, 1, -1}});
  o.cache.track(6);
  std::vector<Index> const held = {0, 1, 4, 5, 6, 8};
  std::copy(held.begin(), held.end(), o.cache.positions.begin());
  auto const k = tova_scores(kvc::Cpu{}, TOVAScorer{Reference::kvpress}, o.cache.view(),
                             kvc::WindowQueries<float>{o.queries.rows()});
  REQUIRE(k.status.ok());
  check_printed(k.scores, {0.3227, 0.3290, 0.0645, 0.1187, 0.1415, 1.3290});
}

TEST_CASE("tova: scores match the float64 reference and every KV head gets the same scores", "[scorers][tova]") {
  kvc::KVExtents const e{2, 2, 170, 16};  // two key tiles
  auto c = kvc::tools::HostCache<float>::random(e, 3);
  c.lengths = {170, 99};
  kvc::test::OwnedQueries<float> q({2, 6, 4, 16});  // g = 3
  q.data = kvc::tools::random_values<float>(static_cast<Index>(q.data.size()), 4, 2.0f);
  for (Reference ref : {Reference::authors, Reference::kvpress}) {
    auto const got = tova_scores(kvc::Cpu{}, TOVAScorer{ref}, c.view(), kvc::WindowQueries<float>{q.rows()});
    REQUIRE(got.status.ok());
    for (Index b = 0; b < 2; ++b) {
      Index const n = b == 0 ? 170 : 99;
      auto const expect = tova_reference(c, q, b, n - 1, ref);
      for (Index h = 0; h < 2; ++h) {
        float const* row = got.scores.data() + (b * 2 + h) * 170;
        for (Index t = 0; t < n; ++t)
          CHECK_THAT(row[t], WithinAbs(expect[static_cast<std::size_t>(t)], 1e-6));
        for (Index t = n; t < 170; ++t)
          CHECK(row[t] == -std::numeric_limits<float>::infinity());
        CHECK(std::equal(row, row + 170, got.scores.data() + b * 2 * 170));  // identical for every KV head
      }
      double sum = 0;  // authors: a probability distribution (mean of softmaxes)
      for (Index t = 0; t < n; ++t)
        sum += got.scores[static_cast<std::size_t>(b * 2 * 170 + t)];
      if (ref == Reference::authors)
        CHECK_THAT(sum, WithinAbs(1.0, 1e-5));
    }
  }
}

TEST_CASE("tova: permuting the query heads changes nothing", "[scorers][tova]") {
  kvc::KVExtents const e{3, 2, 90, 8};
  auto const c = kvc::tools::HostCache<float>::random(e, 8);
  kvc::test::OwnedQueries<float> q({3, 4, 2, 8}), perm({3, 4, 2, 8});
  q.data = kvc::tools::random_values<float>(static_cast<Index>(q.data.size()), 9, 2.5f);
  // Swap query heads across groups (0 <-> 3) and within a group (1 <-> 2): each head moves with its own queries,
  // so head 3's rows now read KV head 0's keys. Only a permutation that keeps every query head on its KV head is
  // a symmetry, so give both KV heads the same keys.
  auto same = c;
  for (Index b = 0; b < 3; ++b)
    std::copy_n(same.key(b, 0, 0), 90 * 8, same.key(b, 1, 0));
  Index const to[4] = {3, 2, 1, 0};
  for (Index b = 0; b < 3; ++b)
    for (Index h = 0; h < 4; ++h)
      std::copy_n(q.row(b, h, 0), 2 * 8, perm.row(b, to[h], 0));
  auto const a = tova_scores(kvc::Cpu{}, TOVAScorer{}, same.view(), kvc::WindowQueries<float>{q.rows()});
  auto const p = tova_scores(kvc::Cpu{}, TOVAScorer{}, same.view(), kvc::WindowQueries<float>{perm.rows()});
  REQUIRE(a.status.ok());
  REQUIRE(p.status.ok());
  for (std::size_t i = 0; i < a.scores.size(); ++i)
    CHECK_THAT(p.scores[i], WithinAbs(a.scores[i], 1e-6));
  // Within-group permutation (0 <-> 1, 2 <-> 3) on distinct KV heads.
  Index const within[4] = {1, 0, 3, 2};
  for (Index b = 0; b < 3; ++b)
    for (Index h = 0; h < 4; ++h)
      std::copy_n(q.row(b, h, 0), 2 * 8, perm.row(b, within[h], 0));
  auto const x = tova_scores(kvc::Cpu{}, TOVAScorer{}, c.view(), kvc::WindowQueries<float>{q.rows()});
  auto const y = tova_scores(kvc::Cpu{}, TOVAScorer{}, c.view(), kvc::WindowQueries<float>{perm.rows()});
  for (std::size_t i = 0; i < x.scores.size(); ++i)
    CHECK_THAT(y.scores[i], WithinAbs(x.scores[i], 1e-6));
}

TEST_CASE("tova: a thread pool gives bit-identical scores", "[scorers][tova]") {
  kvc::KVExtents const e{6, 2, 700, 32};  // big enough that workers really overlap
  auto c = kvc::tools::HostCache<float>::random(e, 81);
  c.lengths = {700, 1, 3, 699, 350, 128};  // per sequence; a sequence needs >= 3 tokens for its 3 query rows
  kvc::test::OwnedQueries<float> q({6, 8, 3, 32});
  q.data = kvc::tools::random_values<float>(static_cast<Index>(q.data.size()), 82, 2.0f);
  kvc::ThreadPool pool(2);
  for (Reference ref : {Reference::authors, Reference::kvpress}) {
    auto const serial = tova_scores(kvc::Cpu{}, TOVAScorer{ref}, c.view(), kvc::WindowQueries<float>{q.rows()});
    REQUIRE(serial.status.ok());
    for (int rep = 0; rep < 3; ++rep) {
      auto const parallel = tova_scores(pool.cpu(), TOVAScorer{ref}, c.view(), kvc::WindowQueries<float>{q.rows()});
      REQUIRE(parallel.status.ok());
      CHECK(serial.scores == parallel.scores);
    }
  }
}

TEST_CASE("tova: regrouping KV heads without changing the query rows gives the same scores", "[scorers][tova]") {
  // MHA (4 KV heads, g = 1) versus GQA (2 KV heads, g = 2) where each pair of MHA heads holds the same keys.
  kvc::KVExtents const mha{1, 4, 50, 8}, gqa{1, 2, 50, 8};
  auto const g = kvc::tools::HostCache<float>::random(gqa, 12);
  kvc::tools::HostCache<float> m(mha);
  for (Index h = 0; h < 4; ++h)
    std::copy_n(g.k.data() + (h / 2) * 50 * 8, 50 * 8, m.key(0, h, 0));
  kvc::test::OwnedQueries<float> q({1, 4, 3, 8});
  q.data = kvc::tools::random_values<float>(static_cast<Index>(q.data.size()), 13, 2.0f);
  auto const a = tova_scores(kvc::Cpu{}, TOVAScorer{}, m.view(), kvc::WindowQueries<float>{q.rows()});
  auto const b = tova_scores(kvc::Cpu{}, TOVAScorer{}, g.view(), kvc::WindowQueries<float>{q.rows()});
  for (Index t = 0; t < 50; ++t)
    CHECK_THAT(a.scores[static_cast<std::size_t>(t)], WithinAbs(b.scores[static_cast<std::size_t>(t)], 1e-6));
}

TEST_CASE("tova: heads of one sequence with unequal lengths are rejected", "[scorers][tova]") {
  kvc::KVExtents const e{2, 2, 20, 8};
  auto c = kvc::tools::HostCache<float>::random(e, 1);
  c.lengths = {20, 20, 15, 14};
  c.per_head = true;
  kvc::test::OwnedQueries<float> q({2, 2, 1, 8});
  auto const r = tova_scores(kvc::Cpu{}, TOVAScorer{}, c.view(), kvc::WindowQueries<float>{q.rows()});
  CHECK(r.status.code() == kvc::Errc::invalid_argument);
  c.lengths = {20, 20, 15, 15};  // equal within each sequence: fine
  CHECK(tova_scores(kvc::Cpu{}, TOVAScorer{}, c.view(), kvc::WindowQueries<float>{q.rows()}).status.ok());
  // Shapes: query heads not a multiple of the KV heads; no query row at all.
  kvc::test::OwnedQueries<float> three({2, 3, 1, 8}), none({2, 2, 0, 8});
  CHECK(tova_scores(kvc::Cpu{}, TOVAScorer{}, c.view(), kvc::WindowQueries<float>{three.rows()}).status.code() ==
        kvc::Errc::invalid_argument);
  CHECK(tova_scores(kvc::Cpu{}, TOVAScorer{}, c.view(), kvc::WindowQueries<float>{none.rows()}).status.code() ==
        kvc::Errc::invalid_argument);
}
