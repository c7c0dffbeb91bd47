// SPDX-License-Identifier: Apache-2.0
// tests/reference/stateful_oracle_test.cpp: ExpectedAttention and H2O (both behaviours) against the independent
// NumPy oracle (tools/reference/expected_attention.py, h2o.py) on the stateful cases of make_vectors.py: a random
// GQA float32 cache, a random float16 MHA cache with interleaved RoPE and, when shared/ has it, every layer of
// tinystories-656k (real keys, values and pre-RoPE queries). Skipped without NumPy.
//
// Tolerances: scores within 1e-4 relative for float32 inputs and 1e-3 for float16 (fp32 compute against fp64 on the
// same rounded inputs), relative to max(|oracle|, 1e-2 * the head's largest score); kept sets exact except
// near-ties (tests/support/vectors.hpp). The decode-time H2O simulation must keep exactly the oracle's positions.
#include <kvc/backend/cpu/pipeline/compact.hpp>
#include <kvc/backend/cpu/pipeline/query_statistics.hpp>
#include <kvc/backend/cpu/pipeline/rerotate.hpp>
#include <kvc/backend/cpu/scorers/expected_attention.hpp>
#include <kvc/backend/cpu/scorers/h2o.hpp>
#include <kvc/backend/cpu/selectors/top_k.hpp>
#include <kvc/pipeline/decode.hpp>
#include <kvc/pipeline/press.hpp>

#include "common/synthetic.hpp"
#include "support/catch.hpp"
#include "support/helpers.hpp"
#include "support/vectors.hpp"

#include <cstdio>
#include <map>
#include <sstream>
#include <string>
#include <vector>

using kvc::Index;
using kvc::test::load;

namespace {

struct Meta {
  double theta = 0;
  kvc::RopeStyle style = kvc::RopeStyle::neox;
  Index n_future = 0, n_sink = 0, buffer = 0, hh = 0, recent = 0, n_prefill = 0;
};

Meta read_meta(std::string const& dir) {
  Meta m;
  std::string style;
  std::map<std::string, Index*> const counts{{"n_future_positions", &m.n_future},
                                             {"n_sink", &m.n_sink},
                                             {"buffer", &m.buffer},
                                             {"hh", &m.hh},
                                             {"recent", &m.recent},
                                             {"n_prefill", &m.n_prefill}};
  for (auto const& line : kvc::test::lines(dir + "/meta.txt")) {
    std::istringstream in(line);
    std::string key;
    in >> key;
    if (key == "theta")
      in >> m.theta;
    else if (key == "style")
      in >> style;
    else if (counts.count(key))
      in >> *counts.at(key);
  }
  INFO(dir << "/meta.txt");
  REQUIRE(m.theta > 1.0);
  REQUIRE((style == "neox" || style == "interleaved"));
  REQUIRE((m.n_future > 0 && m.buffer > 0 && m.hh > 0 && m.recent > 0 && m.n_prefill > 0));
  m.style = style == "neox" ? kvc::RopeStyle::neox : kvc::RopeStyle::interleaved;
  return m;
}

template <class T>
struct Case {
  std::string dir;
  kvc::NpyArray keys, values, queries;
  Meta meta;
  kvc::KVExtents e, qe;
  kvc::test::OwnedRope rope;
  double rtol;

  Case(std::string d, kvc::NpyArray k, kvc::NpyArray v, kvc::NpyArray q, Meta m)
      : dir(std::move(d)),
        keys(std::move(k)),
        values(std::move(v)),
        queries(std::move(q)),
        meta(m),
        e{keys.shape[0], keys.shape[1], keys.shape[2], keys.shape[3]},
        qe{queries.shape[0], queries.shape[1], queries.shape[2], queries.shape[3]},
        rope({.theta = m.theta, .style = m.style}, keys.shape[3], keys.shape[2] + m.n_future + 1),
        rtol(std::is_same_v<T, float> ? 1e-4 : 1e-3) {}

  auto cache() const { return kvc::dense_cache(keys.as<T>(), values.as<T>(), e); }
  /// Query rows [first, first + count) as a view ([batch, Hq, count, d]).
  kvc::TokenRows<T const, kvc::StridedLayout> rows(Index first, Index count) const {
    kvc::StridedLayout const all = kvc::bhtd_layout(qe);
    return {queries.as<T>() + first * qe.dim,
            {{qe.batch, qe.heads, count, qe.dim}, all.stride_b, all.stride_h, all.stride_t}};
  }

  /// Scores and kept sets of one variant: `score` fills a [B, Hkv, S] span, `press_obs` is what compress reads.
  template <class Scorer, class Obs>
  void check(std::string const& variant, Scorer const& scorer, Obs const& obs) const {
    std::string const where = dir + " " + variant;
    auto const c = cache();
    kvc::test::OwnedScores got(e.batch, e.heads, e.tokens);
    kvc::test::OwnedWorkspace ws(kvc::score_workspace_bytes(kvc::Cpu{}, scorer, e, obs));
    auto const st = kvc::score(kvc::Cpu{}, scorer, c, obs, got.span, ws.get());
    INFO(where << ": " << st.message());
    REQUIRE(st.ok());
    auto const ref = load(dir + "/scores_" + variant + ".npy");
    kvc::test::check_scores(got.data, ref, e.tokens, rtol, where);
    for (double ratio : {0.25, 0.5, 0.75}) {
      kvc::Press const press{scorer, kvc::TopKSelector{kvc::RatioBudget{ratio}}};
      kvc::test::OwnedWorkspace cws(kvc::compress_workspace_bytes(kvc::Cpu{}, press, e, obs));
      kvc::test::OwnedPlan plan(e.batch, e.heads, e.tokens);
      REQUIRE(kvc::compress(kvc::Cpu{}, press, c, obs, plan.plan, cws.get()).ok());
      char name[96];
      std::snprintf(name, sizeof name, "/kept_%s_%g.npy", variant.c_str(), ratio);
      kvc::test::check_kept(plan.plan, load(dir + name), ref, e.tokens, where + " ratio " + std::to_string(ratio));
    }
  }
};

/// Statistics of query rows [first, first + count) at positions first.., with the given sample rule.
struct Stats {
  std::vector<float> mean, cov;
  std::vector<Index> positions;
  kvc::QueryStatistics<> view;
};

template <class T>
Stats statistics(Case<T> const& c, Index first, Index count, kvc::StatisticsRows rule) {
  Stats s{std::vector<float>(static_cast<std::size_t>(c.qe.batch * c.qe.heads * c.qe.dim)),
          std::vector<float>(static_cast<std::size_t>(c.qe.batch * c.qe.heads * c.qe.dim * c.qe.dim)),
          {},
          {}};
  for (Index b = 0; b < c.qe.batch; ++b)
    for (Index i = 0; i < count; ++i)
      s.positions.push_back(first + i);
  auto const rows = c.rows(first, count);
  kvc::test::OwnedWorkspace ws(kvc::query_statistics_workspace_bytes(kvc::Cpu{}, rows.extents()));
  REQUIRE(
      kvc::query_statistics(kvc::Cpu{}, rows, s.positions.data(), rule, s.mean.data(), s.cov.data(), ws.get()).ok());
  s.view = {s.mean.data(), s.cov.data(), c.qe.batch, c.qe.heads, c.qe.dim, c.rope.table};
  return s;
}

/// A decode driver's query buffer over `capacity` rows, filled from the case's queries.
template <class T>
struct Buffer {
  std::vector<T> rows;
  std::vector<Index> positions;
  kvc::QueryBuffer<T> view;
  Buffer(Case<T> const& c, Index capacity)
      : rows(static_cast<std::size_t>(c.qe.batch * c.qe.heads * capacity * c.qe.dim)),
        positions(static_cast<std::size_t>(c.qe.batch * capacity)) {
    view = {rows.data(), positions.data(), c.qe.batch, c.qe.heads, capacity, c.qe.dim};
  }
  /// Pushes the queries of tokens [first, first + count) (their positions are the token indices).
  void fill(Case<T> const& c, Index first, Index count) {
    for (Index b = 0; b < c.qe.batch; ++b)
      for (Index i = 0; i < count; ++i) {
        for (Index q = 0; q < c.qe.heads; ++q)
          std::copy_n(c.rows(first + i, 1).row(b, q, 0), c.qe.dim, view.row(b, q, view.count + i));
        positions[static_cast<std::size_t>(b * view.capacity + view.count + i)] = first + i;
      }
    REQUIRE(view.push(count).ok());
  }
};

/// The decode driver compressing the whole prompt once, from the last `buffer` queries (interval 1): its kept sets
/// must be the oracle's decode-mode ExpectedAttention sets (statistics and t0 as each reference defines them).
template <class T>
void check_decode_driver(Case<T> const& c, kvc::ExpectedAttentionScorer const& scorer, std::string const& variant) {
  Meta const& m = c.meta;
  for (double ratio : {0.25, 0.5, 0.75}) {
    kvc::tools::HostCache<T> work(c.e);
    std::copy_n(c.keys.template as<T>(), c.e.rows() * c.e.dim, work.k.data());
    std::copy_n(c.values.template as<T>(), c.e.rows() * c.e.dim, work.v.data());
    work.track(c.e.tokens);
    Buffer<T> buf(c, m.buffer);
    buf.fill(c, c.e.tokens - m.buffer, m.buffer);
    kvc::DecodeSchedule sch;
    sch.compression_interval = 1;
    sch.target_size = static_cast<Index>(static_cast<double>(c.e.tokens) * (1.0 - ratio));
    sch.hidden_states_buffer_size = m.buffer;
    kvc::DecodeCounter counter;
    kvc::test::OwnedWorkspace ws(kvc::decode_workspace_bytes(kvc::Cpu{}, scorer, sch, work.ext, buf.view));
    REQUIRE(kvc::decode_step(kvc::Cpu{}, scorer, sch, work.view(), buf.view, counter, c.rope.table, ws.get()).ok());
    // The kept positions as a plan over the prompt, compared like any kept set (near-ties may swap).
    kvc::test::OwnedPlan plan(c.e.batch, c.e.heads, c.e.tokens);
    for (Index b = 0; b < c.e.batch; ++b)
      for (Index h = 0; h < c.e.heads; ++h) {
        auto const pos = work.head_positions(b, h);
        plan.count[static_cast<std::size_t>(b * c.e.heads + h)] = static_cast<Index>(pos.size());
        std::copy(pos.begin(), pos.end(), plan.plan.indices(b, h));
      }
    char name[96];
    std::snprintf(name, sizeof name, "/kept_%s_%g.npy", variant.c_str(), ratio);
    kvc::test::check_kept(plan.plan, load(c.dir + name), load(c.dir + "/scores_" + variant + ".npy"), c.e.tokens,
                          c.dir + " decode driver " + variant);
  }
}

template <class T>
void check_expected_attention(Case<T> const& c) {
  Meta const& m = c.meta;
  Stats const prefill = statistics(c, 0, c.e.tokens, {.n_sink = m.n_sink});
  auto const obs = kvc::observe(prefill.view);
  kvc::ExpectedAttentionScorer base;
  base.n_future_positions = m.n_future;
  base.n_sink = m.n_sink;
  auto with = [&](auto&& edit) {
    kvc::ExpectedAttentionScorer s = base;
    edit(s);
    return s;
  };
  c.check("ea_default", base, obs);
  c.check("ea_eps0", with([](auto& s) { s.epsilon = 0.0f; }), obs);
  c.check("ea_nocov", with([](auto& s) { s.use_covariance = false; }), obs);
  c.check("ea_novnorm", with([](auto& s) { s.use_vnorm = false; }), obs);
  c.check("ea_gqa_max", with([](auto& s) { s.gqa = kvc::GqaReduce::max; }), obs);
  c.check("ea_sinks_normalized", with([](auto& s) { s.normalize_sinks = true; }), obs);
  // Decoding: the buffer holds the last `buffer` queries. Authors: samples at positions >= n_sink, t0 = S (the
  // next absolute position); kvpress: the buffer without its first n_sink rows, t0 = the buffer's length.
  Index const first = c.e.tokens - m.buffer;
  Stats const authors = statistics(c, first, m.buffer, {.n_sink = m.n_sink});
  c.check("ea_decode_authors", base, kvc::observe(authors.view));
  Stats kv = statistics(c, first, m.buffer, {.skip_rows = m.n_sink});
  kv.view.observed = m.buffer;
  c.check("ea_decode_kvpress", with([](auto& s) { s.reference = kvc::Reference::kvpress; }), kvc::observe(kv.view));
  check_decode_driver(c, base, "ea_decode_authors");
  check_decode_driver(c, with([](auto& s) { s.reference = kvc::Reference::kvpress; }), "ea_decode_kvpress");
}

/// H2O's caller-owned state for a cache of `capacity` slots.
struct State {
  std::vector<float> acc;
  std::vector<Index> tracked;
  kvc::H2OScorer<> scorer;
  State(kvc::KVExtents e, Index capacity)
      : acc(static_cast<std::size_t>(e.batch * e.heads * capacity)),
        tracked(static_cast<std::size_t>(e.batch * e.heads), 0) {
    scorer.state = {{acc.data(), e.batch, e.heads, capacity}, tracked.data()};
  }
};

/// kvc::update with the queries at rows [first, first + count) (their absolute positions).
template <class T, class C>
void observe_queries(Case<T> const& c, State const& st, C const& cache, Index first, Index count) {
  std::vector<Index> pos;
  for (Index b = 0; b < c.qe.batch; ++b)
    for (Index i = 0; i < count; ++i)
      pos.push_back(first + i);
  auto const obs = kvc::observe(kvc::WindowQueries<T>{c.rows(first, count), c.rope.table, pos.data()});
  kvc::test::OwnedWorkspace ws(kvc::update_workspace_bytes(kvc::Cpu{}, st.scorer, cache.keys.extents(), obs));
  auto const s = kvc::update(kvc::Cpu{}, st.scorer, cache, obs, ws.get());
  INFO(c.dir << ": " << s.message());
  REQUIRE(s.ok());
}

template <class T>
void check_h2o(Case<T> const& c) {
  Meta const& m = c.meta;
  auto const all = kvc::observe(kvc::WindowQueries<T>{c.rows(0, c.e.tokens), c.rope.table});
  kvc::ObservedAttentionScorer observed;
  observed.query_tile = 37;  // tiles that do not divide the prompt
  c.check("h2o_kvpress", observed, all);

  // The authors' accumulator after the prompt: every query's attention, summed (group mean).
  State st(c.e, c.e.tokens);
  observe_queries(c, st, c.cache(), 0, c.e.tokens);
  c.check("h2o_accumulated", st.scorer, kvc::NoObservations{});
  {  // one-shot prefill eviction: top-hh of [0, S - recent) plus the last `recent`
    std::vector<T> k(c.keys.template as<T>(), c.keys.template as<T>() + c.e.rows() * c.e.dim);
    std::vector<T> v(c.values.template as<T>(), c.values.template as<T>() + c.e.rows() * c.e.dim);
    std::vector<Index> lengths(static_cast<std::size_t>(c.e.batch * c.e.heads), c.e.tokens);
    auto const cache = kvc::dense_cache(k.data(), v.data(), c.e, kvc::head_lengths(lengths.data(), c.e.heads));
    kvc::Press const press{st.scorer, kvc::TopKSelector{kvc::FixedBudget{m.hh + m.recent}, 0, m.recent}};
    kvc::test::OwnedPlan plan(c.e.batch, c.e.heads, c.e.tokens);
    kvc::test::OwnedWorkspace ws(kvc::compress_workspace_bytes(kvc::Cpu{}, press, c.e));
    REQUIRE(kvc::compress(kvc::Cpu{}, press, cache, plan.plan, ws.get()).ok());
    kvc::test::check_kept(plan.plan, load(c.dir + "/h2o_kept.npy"), load(c.dir + "/scores_h2o_accumulated.npy"),
                          c.e.tokens, c.dir + " h2o prefill");
  }

  // Decoding (variant (a)) through the decode driver: the first n_prefill tokens in one forward, then one token per
  // forward; interval 1, target hh + recent with the last `recent` protected: the authors' per-step eviction.
  Index const capacity = std::max(m.n_prefill, m.hh + m.recent + 1);
  kvc::tools::HostCache<T> work(kvc::KVExtents{c.e.batch, c.e.heads, capacity, c.e.dim});
  work.track(0);
  State dec(c.e, capacity);
  kvc::DecodeSchedule sch;
  sch.compression_interval = 1;
  sch.target_size = m.hh + m.recent;
  sch.n_recent = m.recent;
  Buffer<T> buf(c, m.n_prefill);
  kvc::DecodeCounter counter;
  kvc::test::OwnedWorkspace ws(kvc::decode_workspace_bytes(kvc::Cpu{}, dec.scorer, sch, work.ext, buf.view));
  auto const src = c.cache();
  auto step = [&](Index first, Index count) {
    REQUIRE(kvc::append(kvc::Cpu{}, work.view(), src, first, count).ok());
    buf.fill(c, first, count);
    auto const status =
        kvc::decode_step(kvc::Cpu{}, dec.scorer, sch, work.view(), buf.view, counter, c.rope.table, ws.get());
    INFO(status.message());
    REQUIRE(status.ok());
  };
  step(0, m.n_prefill);
  for (Index t = m.n_prefill; t < c.e.tokens; ++t)
    step(t, 1);
  auto const kept = load(c.dir + "/h2o_decode_kept.npy");
  auto const scores = load(c.dir + "/h2o_decode_scores.npy");
  Index const k = kept.shape[2];
  for (Index b = 0; b < c.e.batch; ++b)
    for (Index h = 0; h < c.e.heads; ++h) {
      INFO(c.dir << " h2o decode head (" << b << ", " << h << ")");
      std::int64_t const* want = kept.template as<std::int64_t>() + (b * c.e.heads + h) * k;
      CHECK(work.head_positions(b, h) == std::vector<Index>(want, want + k));
      double const* want_acc = scores.template as<double>() + (b * c.e.heads + h) * k;
      for (Index j = 0; j < k; ++j)
        CHECK(std::abs(dec.acc[static_cast<std::size_t>((b * c.e.heads + h) * capacity + j)] - want_acc[j]) <=
              c.rtol * std::max(1.0, std::abs(want_acc[j])));
    }
}

}  // namespace

TEST_CASE("reference: ExpectedAttention and H2O match the NumPy oracle", "[reference][stateful]") {
  auto const names = kvc::test::lines(kvc::test::vectors_dir + "/stateful_manifest.txt");
  if (names.empty()) {
    WARN("SKIPPED: no stateful reference vectors in " << kvc::test::vectors_dir << " (needs python3-numpy)");
    return;
  }
  bool f16 = false, interleaved = false, real = false;
  for (auto const& name : names) {
    std::string const dir = kvc::test::vectors_dir + "/" + name;
    auto k = load(dir + "/keys.npy"), v = load(dir + "/values.npy"), q = load(dir + "/queries.npy");
    Meta const m = read_meta(dir);
    INFO(dir);
    REQUIRE((k.shape.size() == 4 && q.shape.size() == 4 && v.shape == k.shape && q.dtype == k.dtype));
    REQUIRE((q.shape[0] == k.shape[0] && q.shape[2] == k.shape[2] && q.shape[3] == k.shape[3]));
    f16 = f16 || k.dtype == kvc::NpyDtype::f16;
    interleaved = interleaved || m.style == kvc::RopeStyle::interleaved;
    real = real || name.find("tinystories") != std::string::npos;
    if (k.dtype == kvc::NpyDtype::f16) {
      Case<kvc::half> const c(dir, std::move(k), std::move(v), std::move(q), m);
      check_expected_attention(c);
      check_h2o(c);
    } else {
      Case<float> const c(dir, std::move(k), std::move(v), std::move(q), m);
      check_expected_attention(c);
      check_h2o(c);
    }
  }
  CHECK(f16);
  CHECK(interleaved);
  if (!real)
    WARN("note: real-model stateful cases absent (../shared/models/tinystories-656k not found): random cases only");
}
