// SPDX-License-Identifier: Apache-2.0
// tests/scorers/uncomp_test.cpp mirrors include/kvc/scorers/uncomp.hpp and include/kvc/selectors/uncomp.hpp (CPU
// kernels in backend/cpu/). Reference values: a float64 re-statement of spec uncomp.md §2.7-2.8 written in this file
// (softmax rows, window sums, −inf-padded max pooling, top-k with ties to the lower index, the A' recursion of the
// decode path), hand cases, and spec §8 properties 19-23. NumPy oracle vectors are compared in tests/reference/.
#include <kvc/attention/attend.hpp>
#include <kvc/backend/cpu/attention/attend.hpp>
#include <kvc/backend/cpu/pipeline/compact.hpp>
#include <kvc/backend/cpu/scorers/snap_kv.hpp>
#include <kvc/backend/cpu/scorers/uncomp.hpp>
#include <kvc/backend/cpu/selectors/top_k.hpp>
#include <kvc/backend/cpu/selectors/uncomp.hpp>
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
using kvc::Index;

/// One layer's UNComp state, owned (rows start as garbage to show that update and tracking overwrite them).
struct OwnedState {
  std::vector<float> rows;
  std::vector<Index> tracked;
  kvc::UNCompState<> view;
  OwnedState(kvc::KVExtents e, Index w)
      : rows(static_cast<std::size_t>(e.batch * e.heads * e.tokens * w), 9.0f),
        tracked(static_cast<std::size_t>(e.batch * e.heads), 0) {
    view = {{rows.data(), kvc::uncomp_window_layout(e, w)}, tracked.data()};
  }
};

/// Queries [batch, Hq, rows, d] with standard normal entries (scaled so attention is peaked but not one-hot).
kvc::test::OwnedQueries<float> random_queries(kvc::KVExtents e, std::uint64_t seed, float scale = 1.5f) {
  kvc::test::OwnedQueries<float> q(e);
  kvc::tools::Rng rng(seed);
  for (float& x : q.data)
    x = scale * rng.normal();
  return q;
}

template <class Cache>
void update(kvc::UNCompScorer<> const& s, Cache const& cache, kvc::test::OwnedQueries<float> const& q) {
  auto const obs = kvc::observe(kvc::WindowQueries<float>{q.rows()});
  kvc::test::OwnedWorkspace ws(kvc::update_workspace_bytes(kvc::Cpu{}, s, cache.keys.extents(), obs));
  kvc::Status const st = kvc::update(kvc::Cpu{}, s, cache, obs, ws.get());
  INFO(st.message());
  REQUIRE(st.ok());
}

template <class Cache>
std::vector<float> scores_of(kvc::UNCompScorer<> const& s, Cache const& cache) {
  kvc::KVExtents const e = cache.keys.extents();
  kvc::test::OwnedScores out(e.batch, e.heads, e.tokens);
  out.span.lengths = cache.lengths;
  kvc::test::OwnedWorkspace ws(kvc::score_workspace_bytes(kvc::Cpu{}, s, e, kvc::NoObservations{}));
  REQUIRE(kvc::score(kvc::Cpu{}, s, cache, out.span, ws.get()).ok());
  return out.data;
}

/// Prefill or decode eviction: select with UNCompSelector over the head budgets, on_evict, compact the rows.
template <class Cache>
kvc::test::OwnedPlan evict(kvc::UNCompScorer<> const& s, Cache const& cache, std::vector<Index> const& budgets) {
  kvc::KVExtents const e = cache.keys.extents();
  kvc::Press const press{s, kvc::UNCompSelector{kvc::HeadBudgets{budgets.data(), e.heads}, 0, s.window_size}};
  kvc::test::OwnedPlan plan(e.batch, e.heads, e.tokens);
  kvc::test::OwnedWorkspace ws(kvc::compress_workspace_bytes(kvc::Cpu{}, press, e));
  kvc::Status const st = kvc::compress(kvc::Cpu{}, press, cache, plan.plan, ws.get());
  INFO(st.message());
  REQUIRE(st.ok());
  REQUIRE(kvc::on_evict(kvc::Cpu{}, s, cache, plan.plan, {}).ok());
  REQUIRE(kvc::compact(kvc::Cpu{}, plan.plan, cache, s.state.window_rows).ok());
  return plan;
}

// ---- float64 reference of the spec (no kvc code) --------------------------------------------------------------

/// softmax over the keys a query at position qp sees, of <q, k_j> / sqrt(d): [n] (0 for unseen keys).
std::vector<double> softmax_row(float const* q, std::vector<float const*> const& keys,
                                std::vector<Index> const& key_pos, Index qp, Index d) {
  std::vector<double> l(keys.size(), -std::numeric_limits<double>::infinity());
  double peak = -std::numeric_limits<double>::infinity();
  for (std::size_t j = 0; j < keys.size(); ++j) {
    if (key_pos[j] > qp)
      continue;
    double dot = 0.0;
    for (Index c = 0; c < d; ++c)
      dot += static_cast<double>(q[c]) * static_cast<double>(keys[j][c]);
    l[j] = dot / std::sqrt(static_cast<double>(d));
    peak = std::max(peak, l[j]);
  }
  double total = 0.0;
  for (double& x : l) {
    x = std::isinf(x) ? 0.0 : std::exp(x - peak);
    total += x;
  }
  for (double& x : l)
    x /= total;
  return l;
}

/// −inf-padded max pooling (kernel k, stride 1) of x[0, m).
std::vector<double> max_pool(std::vector<double> const& x, Index m, Index k) {
  std::vector<double> out(static_cast<std::size_t>(m));
  for (Index j = 0; j < m; ++j) {
    double best = -std::numeric_limits<double>::infinity();
    for (Index t = std::max<Index>(0, j - k / 2); t <= std::min(m - 1, j + k / 2); ++t)
      best = std::max(best, x[static_cast<std::size_t>(t)]);
    out[static_cast<std::size_t>(j)] = best;
  }
  return out;
}

/// keep = TopK(pooled prefix, budget − w) ∪ last w, ascending; ties to the lower index; everything when n <= budget.
std::vector<Index> keep_set(std::vector<double> const& pooled, Index n, Index w, Index budget) {
  if (n <= budget) {
    std::vector<Index> all(static_cast<std::size_t>(n));
    std::iota(all.begin(), all.end(), Index{0});
    return all;
  }
  Index const m = n - std::min(w, n);
  std::vector<Index> order(static_cast<std::size_t>(m));
  std::iota(order.begin(), order.end(), Index{0});
  std::stable_sort(order.begin(), order.end(), [&](Index a, Index b) {
    return pooled[static_cast<std::size_t>(a)] > pooled[static_cast<std::size_t>(b)];
  });
  order.resize(static_cast<std::size_t>(std::clamp<Index>(budget - (n - m), 0, m)));
  for (Index j = m; j < n; ++j)
    order.push_back(j);
  std::sort(order.begin(), order.end());
  return order;
}

/// The spec's per-head state: A (rows oldest first, over the kept slots) and the kept slots' positions and keys.
struct RefHead {
  std::vector<std::vector<double>> a;  ///< [w][slots]
  std::vector<Index> pos;
  std::vector<float const*> keys;
};

/// Group-summed attention of query rows (one per query head of the group) at position qp over the head's slots.
std::vector<double> group_row(std::vector<float const*> const& queries, RefHead const& r, Index qp, Index d) {
  std::vector<double> p(r.keys.size(), 0.0);
  for (float const* q : queries) {
    auto const row = softmax_row(q, r.keys, r.pos, qp, d);
    for (std::size_t j = 0; j < p.size(); ++j)
      p[j] += row[j];
  }
  return p;
}

std::vector<double> window_sums(RefHead const& r, Index w) {
  Index const n = static_cast<Index>(r.pos.size()), m = n - std::min(w, n);
  std::vector<double> s(static_cast<std::size_t>(m), 0.0);
  for (auto const& row : r.a)
    for (Index j = 0; j < m; ++j)
      s[static_cast<std::size_t>(j)] += row[static_cast<std::size_t>(j)];
  return s;
}

void keep_columns(RefHead& r, std::vector<Index> const& keep) {
  RefHead next;
  for (Index j : keep) {
    next.pos.push_back(r.pos[static_cast<std::size_t>(j)]);
    next.keys.push_back(r.keys[static_cast<std::size_t>(j)]);
  }
  for (auto const& row : r.a) {
    std::vector<double> kept;
    for (Index j : keep)
      kept.push_back(row[static_cast<std::size_t>(j)]);
    next.a.push_back(std::move(kept));
  }
  r = std::move(next);
}

}  // namespace

TEST_CASE("uncomp: prefill scores equal SnapKV's window sum reduced by the group sum, max pooled (kernel 7)") {
  kvc::KVExtents const e{2, 2, 40, 8};
  Index const hq = 8, w = 8;
  auto cache = kvc::tools::HostCache<float>::random(e, 11).track(37);
  auto const q = random_queries({e.batch, hq, w, e.dim}, 12);
  OwnedState state(e, w);
  kvc::UNCompScorer<> const s{state.view, w, 7, kvc::Pooling::max};
  update(s, cache.view(), q);
  auto const mine = scores_of(s, cache.view());

  kvc::SnapKVScorer const snap{kvc::Reference::authors, w, 7, kvc::Pooling::max, kvc::GqaReduce::sum};
  auto const obs = kvc::observe(kvc::WindowQueries<float>{q.rows()});
  kvc::test::OwnedScores out(e.batch, e.heads, e.tokens);
  out.span.lengths = cache.view().lengths;
  kvc::test::OwnedWorkspace ws(kvc::score_workspace_bytes(kvc::Cpu{}, snap, e, obs));
  REQUIRE(kvc::score(kvc::Cpu{}, snap, cache.view(), obs, out.span, ws.get()).ok());
  for (Index b = 0; b < e.batch; ++b)
    for (Index h = 0; h < e.heads; ++h)
      for (Index j = 0; j < 37; ++j) {
        std::size_t const i = static_cast<std::size_t>((b * e.heads + h) * e.tokens + j);
        CHECK_THAT(mine[i], WithinAbs(out.data[i], 1e-6));
      }
}

TEST_CASE("uncomp: prefill keeps min(N, N_g) ascending slots, the window included, as the float64 reference (P19)") {
  kvc::KVExtents const e{2, 2, 64, 16};
  Index const g = 4, w = 8, n = 60;
  auto cache = kvc::tools::HostCache<float>::random(e, 21).track(n);
  auto const q = random_queries({e.batch, g * e.heads, w, e.dim}, 22);
  std::vector<Index> const budgets{20, 33};
  OwnedState state(e, w);
  kvc::UNCompScorer<> const s{state.view, w};
  auto const original = cache;  // keys before compaction, for the reference
  update(s, cache.view(), q);
  auto const plan = evict(s, cache.view(), budgets);
  for (Index b = 0; b < e.batch; ++b)
    for (Index h = 0; h < e.heads; ++h) {
      RefHead r;
      for (Index j = 0; j < n; ++j) {
        r.pos.push_back(j);
        r.keys.push_back(original.k.data() + ((b * e.heads + h) * e.tokens + j) * e.dim);
      }
      for (Index i = 0; i < w; ++i) {
        std::vector<float const*> group;
        for (Index lq = 0; lq < g; ++lq)
          group.push_back(q.row(b, h * g + lq, i));
        r.a.push_back(group_row(group, r, n - w + i, e.dim));
      }
      auto const expected = keep_set(max_pool(window_sums(r, w), n - w, 7), n, w, budgets[static_cast<std::size_t>(h)]);
      CHECK(plan.kept(b, h) == expected);
      CHECK(plan.kept(b, h).size() == static_cast<std::size_t>(budgets[static_cast<std::size_t>(h)]));
      CHECK(cache.lengths[static_cast<std::size_t>(b * e.heads + h)] == budgets[static_cast<std::size_t>(h)]);
      // the kept slots' rows moved with them
      for (std::size_t t = 0; t < expected.size(); ++t)
        for (Index i = 0; i < w; ++i)
          CHECK_THAT(state.view.window_rows.row(b, h, static_cast<Index>(t))[i],
                     WithinAbs(r.a[static_cast<std::size_t>(i)][static_cast<std::size_t>(expected[t])], 1e-5));
    }
}

TEST_CASE("uncomp: kept sets are nested across budgets, and budgets >= N keep everything (P20, P15)") {
  kvc::KVExtents const e{1, 1, 50, 8};
  Index const w = 8;
  auto const q = random_queries({1, 2, w, e.dim}, 32);
  std::vector<Index> previous;
  for (Index budget : {8, 9, 15, 30, 49, 50, 80}) {
    auto cache = kvc::tools::HostCache<float>::random(e, 31).track(50);
    OwnedState state(e, w);
    kvc::UNCompScorer<> const s{state.view, w};
    update(s, cache.view(), q);
    auto const kept = evict(s, cache.view(), {budget}).kept(0, 0);
    CHECK(kept.size() == static_cast<std::size_t>(std::min<Index>(budget, 50)));
    CHECK(std::includes(kept.begin(), kept.end(), previous.begin(), previous.end()));
    for (Index j = 50 - w; j < 50; ++j)
      CHECK(std::binary_search(kept.begin(), kept.end(), j));
    previous = kept;
  }
  // A budget below the window keeps the window (the clamp to [w, N])
  auto cache = kvc::tools::HostCache<float>::random(e, 31).track(50);
  OwnedState state(e, w);
  kvc::UNCompScorer<> const s{state.view, w};
  update(s, cache.view(), q);
  auto const kept = evict(s, cache.view(), {3}).kept(0, 0);
  CHECK(kept == std::vector<Index>{42, 43, 44, 45, 46, 47, 48, 49});
}

TEST_CASE("uncomp: decode steps evict exactly one token, the reference's, and keep the newest w (P22)") {
  kvc::KVExtents const e{1, 2, 48, 8};
  Index const g = 2, w = 4, prompt = 30, steps = 12;
  std::vector<Index> const budgets{12, 17};
  auto cache = kvc::tools::HostCache<float>::random(e, 41).track(prompt);
  auto const keys = kvc::tools::HostCache<float>::random(e, 42);  // the decode tokens' keys (rows [0, steps))
  auto const prefill_q = random_queries({1, g * e.heads, w, e.dim}, 43);
  OwnedState state(e, w);
  kvc::UNCompScorer<> const s{state.view, w, 7};
  std::vector<RefHead> ref(2);
  for (Index h = 0; h < e.heads; ++h) {
    for (Index j = 0; j < prompt; ++j) {
      ref[static_cast<std::size_t>(h)].pos.push_back(j);
      ref[static_cast<std::size_t>(h)].keys.push_back(cache.k.data() + (h * e.tokens + j) * e.dim);
    }
  }
  // keys move in the cache: the reference keeps copies of every key it will read
  std::vector<std::vector<float>> key_copies;
  key_copies.reserve(static_cast<std::size_t>(e.heads * (prompt + steps)));
  auto copy_key = [&](float const* k) {
    key_copies.emplace_back(k, k + e.dim);
    return static_cast<float const*>(key_copies.back().data());
  };
  for (auto& r : ref)
    for (auto& k : r.keys)
      k = copy_key(k);

  update(s, cache.view(), prefill_q);
  for (Index h = 0; h < e.heads; ++h) {
    RefHead& r = ref[static_cast<std::size_t>(h)];
    for (Index i = 0; i < w; ++i) {
      std::vector<float const*> group;
      for (Index lq = 0; lq < g; ++lq)
        group.push_back(prefill_q.row(0, h * g + lq, i));
      r.a.push_back(group_row(group, r, prompt - w + i, e.dim));
    }
  }
  auto prefill_plan = evict(s, cache.view(), budgets);
  for (Index h = 0; h < e.heads; ++h) {
    RefHead& r = ref[static_cast<std::size_t>(h)];
    Index const n = static_cast<Index>(r.pos.size());
    auto const keep = keep_set(max_pool(window_sums(r, w), n - w, 7), n, w, budgets[static_cast<std::size_t>(h)]);
    CHECK(prefill_plan.kept(0, h) == keep);
    keep_columns(r, keep);
  }

  for (Index step = 0; step < steps; ++step) {
    Index const position = prompt + step;
    auto const q = random_queries({1, g * e.heads, 1, e.dim}, 100 + static_cast<std::uint64_t>(step));
    for (Index h = 0; h < e.heads; ++h) {  // append the token to the cache and to the reference
      Index& n = cache.lengths[static_cast<std::size_t>(h)];
      std::copy_n(keys.k.data() + (h * e.tokens + step) * e.dim, e.dim, cache.key(0, h, n));
      cache.positions[static_cast<std::size_t>(h * e.tokens + n)] = position;
      ++n;
      RefHead& r = ref[static_cast<std::size_t>(h)];
      r.pos.push_back(position);
      r.keys.push_back(copy_key(keys.k.data() + (h * e.tokens + step) * e.dim));
      for (auto& row : r.a)
        row.push_back(0.0);  // A' = [[A, 0]; [p]]
      std::vector<float const*> group;
      for (Index lq = 0; lq < g; ++lq)
        group.push_back(q.row(0, h * g + lq, 0));
      r.a.push_back(group_row(group, r, position, e.dim));
      r.a.erase(r.a.begin());  // the last w rows
    }
    update(s, cache.view(), q);
    auto const before = cache.lengths;
    auto const plan = evict(s, cache.view(), budgets);
    for (Index h = 0; h < e.heads; ++h) {
      RefHead& r = ref[static_cast<std::size_t>(h)];
      Index const n = static_cast<Index>(r.pos.size());
      auto const keep = keep_set(max_pool(window_sums(r, w), n - w, 7), n, w, budgets[static_cast<std::size_t>(h)]);
      INFO("step " << step << " head " << h);
      REQUIRE(plan.kept(0, h) == keep);
      CHECK(before[static_cast<std::size_t>(h)] == budgets[static_cast<std::size_t>(h)] + 1);
      CHECK(cache.lengths[static_cast<std::size_t>(h)] == budgets[static_cast<std::size_t>(h)]);  // one evicted
      keep_columns(r, keep);
      CHECK(cache.head_positions(0, h) == r.pos);  // position order, the newest w included
      for (Index t = 0; t < static_cast<Index>(r.pos.size()); ++t)
        for (Index i = 0; i < w; ++i)
          CHECK_THAT(state.view.window_rows.row(0, h, t)[i],
                     WithinAbs(r.a[static_cast<std::size_t>(i)][static_cast<std::size_t>(t)], 1e-5));
    }
  }
}

TEST_CASE("uncomp: budgets covering every head give full attention, bit for bit (P23)") {
  kvc::KVExtents const e{1, 2, 32, 8};
  Index const w = 8;
  auto cache = kvc::tools::HostCache<float>::random(e, 51).track(32);
  auto const full = cache;
  auto const q = random_queries({1, 4, w, e.dim}, 52);
  OwnedState state(e, w);
  kvc::UNCompScorer<> const s{state.view, w};
  update(s, cache.view(), q);
  auto const plan = evict(s, cache.view(), {32, 64});
  CHECK(cache.k == full.k);
  CHECK(cache.v == full.v);
  CHECK(cache.positions == full.positions);
  CHECK(cache.lengths == full.lengths);
}

TEST_CASE("uncomp: the allocator writes min(n, budget) per sequence and head, and rejects bad lists") {
  std::vector<Index> const budgets{5, 40, 0};
  std::vector<Index> lengths{10, 10, 10, 3, 50, 2};
  kvc::ScoreSpan<> const scores{nullptr, 2, 3, 64, kvc::head_lengths(lengths.data(), 3)};
  kvc::UNCompSelector const sel{kvc::HeadBudgets{budgets.data(), 3}, 0, 2};
  std::vector<Index> table(6, -1);
  kvc::test::OwnedWorkspace ws(kvc::allocate_workspace_bytes(kvc::Cpu{}, sel, 2, 3, 64));
  REQUIRE(kvc::allocate(kvc::Cpu{}, sel, scores, table.data(), ws.get()).ok());
  CHECK(table == std::vector<Index>{5, 10, 0, 3, 40, 0});

  kvc::UNCompSelector const wrong{kvc::HeadBudgets{budgets.data(), 2}, 0, 2};
  kvc::Status const st = kvc::allocate(kvc::Cpu{}, wrong, scores, table.data(), ws.get());
  CHECK(st.code() == kvc::Errc::invalid_argument);
  kvc::UNCompSelector const null_list{kvc::HeadBudgets<>{nullptr, 3}, 0, 2};
  CHECK(kvc::allocate(kvc::Cpu{}, null_list, scores, table.data(), ws.get()).code() == kvc::Errc::invalid_argument);
}

TEST_CASE("uncomp: a state of the wrong shape and bad parameters are errors naming the argument") {
  kvc::KVExtents const e{1, 2, 16, 8};
  auto cache = kvc::tools::HostCache<float>::random(e, 61).track(16);
  OwnedState state(e, 4);
  kvc::UNCompScorer<> const wrong_width{state.view, 8};  // rows are 4 wide
  kvc::test::OwnedScores out(1, 2, 16);
  kvc::test::OwnedWorkspace ws(1 << 16);
  kvc::Status st = kvc::score(kvc::Cpu{}, wrong_width, cache.view(), out.span, ws.get());
  CHECK(st.code() == kvc::Errc::invalid_argument);
  CHECK(std::string(st.message()).find("window_rows") != std::string::npos);
  kvc::UNCompScorer<> even{state.view, 4, 6};
  CHECK(kvc::score(kvc::Cpu{}, even, cache.view(), out.span, ws.get()).code() == kvc::Errc::invalid_argument);
  kvc::UNCompScorer<> const no_state{};
  CHECK(kvc::score(kvc::Cpu{}, no_state, cache.view(), out.span, ws.get()).code() == kvc::Errc::invalid_argument);
}

TEST_CASE("uncomp: scores are identical with 1 and 3 workers, and for avg pooling match the zero-padded mean") {
  kvc::KVExtents const e{2, 2, 40, 8};
  Index const w = 6;
  auto cache = kvc::tools::HostCache<float>::random(e, 71).track(40);
  auto const q = random_queries({2, 4, w, e.dim}, 72);
  OwnedState a(e, w), b(e, w);
  kvc::UNCompScorer<> const sa{a.view, w, 5, kvc::Pooling::avg};
  kvc::UNCompScorer<> const sb{b.view, w, 5, kvc::Pooling::avg};
  update(sa, cache.view(), q);
  kvc::ThreadPool pool(3);
  {
    auto const obs = kvc::observe(kvc::WindowQueries<float>{q.rows()});
    kvc::Cpu const cpu = pool.cpu();
    kvc::test::OwnedWorkspace ws(kvc::update_workspace_bytes(cpu, sb, e, obs));
    REQUIRE(kvc::update(cpu, sb, cache.view(), obs, ws.get()).ok());
  }
  CHECK(a.rows == b.rows);
  auto const scores = scores_of(sa, cache.view());
  Index const m = 40 - w;
  for (Index bh = 0; bh < 4; ++bh) {
    std::vector<double> sums(static_cast<std::size_t>(m));
    for (Index j = 0; j < m; ++j)
      for (Index i = 0; i < w; ++i)
        sums[static_cast<std::size_t>(j)] += a.rows[static_cast<std::size_t>((bh * 40 + j) * w + i)];
    for (Index j = 0; j < m; ++j) {
      double acc = 0.0;
      for (Index t = j - 2; t <= j + 2; ++t)
        acc += (t >= 0 && t < m) ? sums[static_cast<std::size_t>(t)] : 0.0;
      CHECK_THAT(scores[static_cast<std::size_t>(bh * 40 + j)], WithinAbs(acc / 5.0, 1e-6));
    }
  }
}
