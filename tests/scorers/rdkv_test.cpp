// SPDX-License-Identifier: Apache-2.0
// tests/scorers/rdkv_test.cpp mirrors include/kvc/scorers/rdkv.hpp (CPU kernels in backend/cpu/scorers/rdkv.hpp):
// RDKV's token weights (attn_linear, derived) and ThinK's channel weights, shared/specs/rdkv.md §2.2, §2.3, A1, A12,
// A15, S1, S2. Reference values come from hand computation (closed forms below) and from a float64 restatement of
// the spec's formulas written in this file, einsum-style loops with PyTorch's reflect padding built explicitly
// (no kvc kernel code on the reference side; queries are rotated by hand from theta).
#define EIGEN_RUNTIME_NO_MALLOC  // Eigen asserts on any heap allocation while set_is_malloc_allowed(false)
#include <kvc/backend/cpu/scorers/rdkv.hpp>
#include <kvc/backend/cpu/thread_pool.hpp>

#include "common/synthetic.hpp"
#include "support/catch.hpp"
#include "support/helpers.hpp"

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <vector>

namespace {

using Catch::Matchers::WithinAbs;
using kvc::Index;
using kvc::RDKVTokenScorer;
using kvc::RDKVTokenWeight;
using kvc::ThinKChannelScorer;

constexpr float neg_inf = -std::numeric_limits<float>::infinity();
constexpr double theta = 500.0;  // fast rotations, so a wrong query position shows

RDKVTokenScorer linear(Index w, Index k = 5) {
  return {RDKVTokenWeight::attn_linear, w, k};
}
RDKVTokenScorer derived(Index w, Index k = 5) {
  return {RDKVTokenWeight::derived, w, k};
}

struct Scored {
  kvc::Status status;
  std::vector<float> scores;  ///< [batch, heads, tokens] or [batch, heads, d_k]
};

/// kvc::score with RDKV; the workspace is exactly the public query's size, and Eigen may not allocate.
template <class Cache, class T>
Scored rdkv_scores(kvc::Cpu const& cpu, RDKVTokenScorer const& s, Cache const& cache, kvc::WindowQueries<T> const& wq) {
  auto const obs = kvc::observe(wq);
  kvc::KVExtents const e = cache.keys.extents();
  kvc::test::OwnedScores out(e.batch, e.heads, e.tokens);
  kvc::test::OwnedWorkspace ws(kvc::score_workspace_bytes(cpu, s, e, obs));
  Eigen::internal::set_is_malloc_allowed(false);
  kvc::Status const st = kvc::score(cpu, s, cache, obs, out.span, ws.get());
  Eigen::internal::set_is_malloc_allowed(true);
  return {st, out.data};
}

/// kvc::score_channels with ThinK (both workspace queries must agree).
template <class Cache, class T>
Scored think_scores(kvc::Cpu const& cpu, ThinKChannelScorer const& s, Cache const& cache,
                    kvc::WindowQueries<T> const& wq) {
  auto const obs = kvc::observe(wq);
  kvc::KVExtents const e = cache.keys.extents();
  std::vector<float> out(static_cast<std::size_t>(e.batch * e.heads * e.dim), -7.0f);
  std::size_t const bytes = kvc::channel_score_workspace_bytes(cpu, s, e, obs);
  CHECK(bytes == kvc::channel_score_workspace_bytes(cpu, s, cache, obs));
  kvc::test::OwnedWorkspace ws(bytes);
  kvc::Status const st = kvc::score_channels(cpu, s, cache, obs, out.data(), ws.get());
  return {st, out};
}

// ---- float64 reference of the spec's formulas (rdkv.md §2.2, §2.3; obkv_fast.py _score_one_layer) ----

/// One KV head as plain doubles: keys [n, d], values [n, dv], positions [n]; its group's window rows, post-RoPE,
/// [g, W, d] at positions q_pos [W].
struct HeadData {
  Index n = 0, d = 0, dv = 0, g = 0, w = 0;
  std::vector<double> keys, values, queries;
  std::vector<Index> key_pos, q_pos;
};

/// a[(q * W + i) * n + j]: causal softmax of window row i of query head q over the head's slots (0 where masked or
/// where the row sees nothing).
std::vector<double> probabilities(HeadData const& x) {
  std::vector<double> a(static_cast<std::size_t>(x.g * x.w * x.n), 0.0);
  for (Index q = 0; q < x.g; ++q)
    for (Index i = 0; i < x.w; ++i) {
      std::vector<double> l(static_cast<std::size_t>(x.n), -std::numeric_limits<double>::infinity());
      double top = -std::numeric_limits<double>::infinity();
      for (Index j = 0; j < x.n; ++j)
        if (x.key_pos[j] <= x.q_pos[i]) {
          double dot = 0;
          for (Index c = 0; c < x.d; ++c)
            dot += x.queries[(q * x.w + i) * x.d + c] * x.keys[j * x.d + c];
          l[j] = dot / std::sqrt(static_cast<double>(x.d));
          top = std::max(top, l[j]);
        }
      if (top == -std::numeric_limits<double>::infinity())
        continue;
      double z = 0;
      for (Index j = 0; j < x.n; ++j)
        z += std::exp(l[j] - top);
      for (Index j = 0; j < x.n; ++j)
        a[(q * x.w + i) * x.n + j] = std::exp(l[j] - top) / z;
    }
  return a;
}

/// n_j: window rows whose position is >= the slot's.
std::vector<double> rows_seeing(HeadData const& x) {
  std::vector<double> cnt(static_cast<std::size_t>(x.n), 0.0);
  for (Index j = 0; j < x.n; ++j)
    for (Index i = 0; i < x.w; ++i)
      cnt[j] += x.q_pos[i] >= x.key_pos[j] ? 1.0 : 0.0;
  return cnt;
}

/// F.avg_pool1d(F.pad(x, (r, r), mode="reflect"), k') with k' = min(k, 2n - 1): the padded array built explicitly.
std::vector<double> reflect_pool_ref(std::vector<double> const& x, Index k) {
  Index const n = static_cast<Index>(x.size());
  if (n == 0)
    return {};
  Index const kk = std::min(k, 2 * n - 1), r = kk / 2;
  std::vector<double> padded;
  for (Index o = r; o >= 1; --o)  // left pad: x[r], ..., x[1]
    padded.push_back(x[o]);
  padded.insert(padded.end(), x.begin(), x.end());
  for (Index o = 1; o <= r; ++o)  // right pad: x[n-2], ..., x[n-1-r]
    padded.push_back(x[n - 1 - o]);
  std::vector<double> out(static_cast<std::size_t>(n));
  for (Index j = 0; j < n; ++j) {
    double sum = 0;
    for (Index t = 0; t < kk; ++t)
      sum += padded[j + t];
    out[j] = sum / static_cast<double>(kk);
  }
  return out;
}

/// attn_linear (§2.2) or derived (A1) weights of one head.
std::vector<double> token_reference(HeadData const& x, RDKVTokenScorer const& s) {
  auto const a = probabilities(x);
  auto const cnt = rows_seeing(x);
  std::vector<double> stat(static_cast<std::size_t>(x.n), 0.0);
  for (Index j = 0; j < x.n; ++j) {
    double sum = 0;
    for (Index q = 0; q < x.g; ++q)
      for (Index i = 0; i < x.w; ++i) {
        double const p = a[(q * x.w + i) * x.n + j];
        sum += s.weight == RDKVTokenWeight::derived ? p * p : p;
      }
    stat[j] = cnt[j] > 0 ? sum / cnt[j] : 0.0;
  }
  auto out = reflect_pool_ref(stat, s.kernel_size);
  if (s.weight == RDKVTokenWeight::derived)
    for (Index j = 0; j < x.n; ++j) {
      double mean = 0, var = 0;
      for (Index c = 0; c < x.dv; ++c)
        mean += x.values[j * x.dv + c] / static_cast<double>(x.dv);
      for (Index c = 0; c < x.dv; ++c)
        var += (x.values[j * x.dv + c] - mean) * (x.values[j * x.dv + c] - mean) / static_cast<double>(x.dv);
      out[j] *= static_cast<double>(x.dv) * var;
    }
  return out;
}

/// ThinK (§2.3): mean over the group's window rows of q_c² times mean over the head's tokens of k_c².
std::vector<double> think_reference(HeadData const& x) {
  std::vector<double> out(static_cast<std::size_t>(x.d));
  for (Index c = 0; c < x.d; ++c) {
    double qs = 0, ks = 0;
    for (Index r = 0; r < x.g * x.w; ++r)
      qs += x.queries[r * x.d + c] * x.queries[r * x.d + c];
    for (Index j = 0; j < x.n; ++j)
      ks += x.keys[j * x.d + c] * x.keys[j * x.d + c];
    out[c] = qs / static_cast<double>(x.g * x.w) * (x.n > 0 ? ks / static_cast<double>(x.n) : 0.0);
  }
  return out;
}

/// Neox RoPE of a row to `pos` in float64 from theta (independent of kvc's RopeTable).
void rotate_ref(std::vector<double>& row, Index d, double pos) {
  for (Index k = 0; k < d / 2; ++k) {
    double const ang = pos * std::pow(theta, -2.0 * static_cast<double>(k) / static_cast<double>(d));
    double const xa = row[k], xb = row[k + d / 2];
    row[k] = xa * std::cos(ang) - xb * std::sin(ang);
    row[k + d / 2] = xb * std::cos(ang) + xa * std::sin(ang);
  }
}

/// A random BHTD cache of element T plus window queries [B, Hq, rows, d] of element T.
template <class T>
struct Problem {
  kvc::tools::HostCache<T> cache;
  kvc::test::OwnedQueries<T> queries;
};

template <class T>
Problem<T> random_problem(kvc::KVExtents e, Index hq, Index rows, std::uint64_t seed, float qscale = 2.0f) {
  Problem<T> p{kvc::tools::HostCache<T>::random(e, seed), kvc::test::OwnedQueries<T>({e.batch, hq, rows, e.dim})};
  p.queries.data = kvc::tools::random_values<T>(static_cast<Index>(p.queries.data.size()), seed + 1000, qscale);
  return p;
}

/// Head (b, h) of a problem as doubles; the last `w` window rows, rotated by hand when `pre_rope`; positions
/// `q_pos` (empty: the default, the last rows of the context: one past the largest held position, minus rows).
template <class T>
HeadData head_data(Problem<T> const& p, Index b, Index h, Index w, bool pre_rope, std::vector<Index> q_pos = {}) {
  auto const view = p.cache.view();
  kvc::KVExtents const e = p.cache.ext;
  HeadData x;
  x.n = view.length(b, h);
  x.d = e.dim;
  x.dv = p.cache.dim_v;
  x.g = p.queries.ext.heads / e.heads;
  x.w = w;
  Index const rows = p.queries.ext.tokens;
  for (Index t = 0; t < x.n; ++t) {
    x.key_pos.push_back(view.position(b, h, t));
    for (Index c = 0; c < x.d; ++c)
      x.keys.push_back(static_cast<float>(view.keys.row(b, h, t)[c]));
    for (Index c = 0; c < x.dv; ++c)
      x.values.push_back(static_cast<float>(view.values.row(b, h, t)[c]));
  }
  if (q_pos.empty()) {
    Index end = 0;
    for (Index hh = 0; hh < e.heads; ++hh)
      for (Index t = 0; t < view.length(b, hh); ++t)
        end = std::max(end, view.position(b, hh, t) + 1);
    for (Index i = rows - w; i < rows; ++i)
      q_pos.push_back(end - rows + i);
  }
  x.q_pos = q_pos;
  for (Index q = 0; q < x.g; ++q)
    for (Index i = rows - w; i < rows; ++i) {
      std::vector<double> row(static_cast<std::size_t>(x.d));
      for (Index c = 0; c < x.d; ++c)
        row[c] = static_cast<float>(p.queries.row(b, h * x.g + q, i)[c]);
      if (pre_rope)
        rotate_ref(row, x.d, static_cast<double>(q_pos[i - (rows - w)]));
      x.queries.insert(x.queries.end(), row.begin(), row.end());
    }
  return x;
}

/// Every head of kvc's token weights against the reference (relative 2e-5 on the head's scale), -inf padding.
template <class T>
void check_tokens(Problem<T> const& p, std::vector<float> const& got, RDKVTokenScorer const& s, bool pre_rope,
                  std::vector<std::vector<Index>> const& q_pos = {}) {
  kvc::KVExtents const e = p.cache.ext;
  REQUIRE(got.size() == static_cast<std::size_t>(e.batch * e.heads * e.tokens));
  for (Index b = 0; b < e.batch; ++b)
    for (Index h = 0; h < e.heads; ++h) {
      auto const x = head_data(p, b, h, s.window_size, pre_rope, q_pos.empty() ? std::vector<Index>{} : q_pos[b]);
      auto const ref = token_reference(x, s);
      float const* row = got.data() + (b * e.heads + h) * e.tokens;
      double scale = 1e-12;
      for (double v : ref)
        scale = std::max(scale, std::abs(v));
      for (Index t = 0; t < x.n; ++t) {
        INFO("b " << b << " h " << h << " t " << t << " of " << x.n);
        CHECK_THAT(row[t], WithinAbs(ref[t], 2e-5 * scale));
      }
      for (Index t = x.n; t < e.tokens; ++t)
        CHECK(row[t] == neg_inf);
    }
}

/// Every head of kvc's channel weights against the reference (relative 1e-5 per channel).
template <class T>
void check_channels(Problem<T> const& p, std::vector<float> const& got, Index w, bool pre_rope,
                    std::vector<std::vector<Index>> const& q_pos = {}) {
  kvc::KVExtents const e = p.cache.ext;
  for (Index b = 0; b < e.batch; ++b)
    for (Index h = 0; h < e.heads; ++h) {
      auto const ref =
          think_reference(head_data(p, b, h, w, pre_rope, q_pos.empty() ? std::vector<Index>{} : q_pos[b]));
      for (Index c = 0; c < e.dim; ++c) {
        INFO("b " << b << " h " << h << " c " << c);
        CHECK_THAT(got[static_cast<std::size_t>((b * e.heads + h) * e.dim + c)],
                   WithinAbs(ref[c], 1e-5 * std::abs(ref[c]) + 1e-30));
      }
    }
}

// ---- reflect pooling ----

std::vector<float> pooled(std::vector<float> const& x, Index k) {
  std::vector<float> out(x.size(), -1.0f);
  kvc::detail::reflect_avg_pool(x.data(), static_cast<Index>(x.size()), k, out.data());
  return out;
}

TEST_CASE("rdkv: reflect pooling by hand (identity at n = 1, kernel 3 at n = 2, mirrored edges at n = 5)",
          "[scorers][rdkv]") {
  CHECK(pooled({3.5f}, 5) == std::vector<float>{3.5f});  // k' = min(5, 1) = 1
  CHECK(pooled({3.5f}, 1) == std::vector<float>{3.5f});
  // n = 2, k' = min(5, 3) = 3: padded [x1, x0, x1, x0].
  auto const two = pooled({1.0f, 4.0f}, 5);
  CHECK_THAT(two[0], WithinAbs((4.0 + 1.0 + 4.0) / 3.0, 1e-6));
  CHECK_THAT(two[1], WithinAbs((1.0 + 4.0 + 1.0) / 3.0, 1e-6));
  // n = 5, k = 5: padded [100, 10 | 1, 10, 100, 1000, 10000 | 1000, 100] (edges not repeated: not 'replicate',
  // not 'symmetric', not zeros).
  auto const five = pooled({1.0f, 10.0f, 100.0f, 1000.0f, 10000.0f}, 5);
  std::vector<double> const want = {221.0 / 5, 1121.0 / 5, 11111.0 / 5, 12110.0 / 5, 12200.0 / 5};
  for (std::size_t j = 0; j < 5; ++j)
    CHECK_THAT(five[j], WithinAbs(want[j], 1e-6 * want[j]));
  // n = 3, k = 7 shrinks to 5: padded [x2, x1 | x0, x1, x2 | x1, x0].
  auto const three = pooled({1.0f, 2.0f, 7.0f}, 7);
  CHECK_THAT(three[0], WithinAbs((7.0 + 2.0 + 1.0 + 2.0 + 7.0) / 5.0, 1e-6));
  CHECK_THAT(three[1], WithinAbs((2.0 + 1.0 + 2.0 + 7.0 + 2.0) / 5.0, 1e-6));
  CHECK_THAT(three[2], WithinAbs((1.0 + 2.0 + 7.0 + 2.0 + 1.0) / 5.0, 1e-6));
  // The float64 reference agrees on a longer random row, for kernels 1..9.
  auto const x = kvc::tools::random_values<float>(23, 5);
  for (Index k : {1, 3, 5, 7, 9}) {
    auto const got = pooled(x, k);
    auto const ref = reflect_pool_ref(std::vector<double>(x.begin(), x.end()), k);
    for (std::size_t j = 0; j < x.size(); ++j)
      CHECK_THAT(got[j], WithinAbs(ref[j], 1e-6));
  }
}

// ---- attn_linear ----

TEST_CASE("rdkv: attn_linear hand cases with n_t normalisation (n = 1 identity, n = 2 kernel 3)", "[scorers][rdkv]") {
  // d = 4 (sqrt(d) = 2 exact); one-hot keys e0, e1 at positions 0, 1; window W = 2 at positions 0, 1.
  // Row 0 sees slot 0 only (a = 1); row 1 = 2 (l0, l1, 0, 0) has logits l0, l1 over both.
  double const l0 = 0.5, l1 = -0.25;
  kvc::tools::HostCache<float> c({1, 1, 2, 4});
  std::fill(c.k.begin(), c.k.end(), 0.0f);
  c.k[0] = 1.0f;  // k0 = e0
  c.k[5] = 1.0f;  // k1 = e1
  kvc::test::OwnedQueries<float> q({1, 1, 2, 4});
  std::fill(q.data.begin(), q.data.end(), 0.0f);
  q.data[0] = 3.0f;  // row 0: anything
  q.data[4] = static_cast<float>(2 * l0);
  q.data[5] = static_cast<float>(2 * l1);
  double const p = std::exp(l0) / (std::exp(l0) + std::exp(l1));
  double const s0 = (1.0 + p) / 2.0, s1 = (1.0 - p) / 1.0;  // n_0 = 2, n_1 = 1: the last token is seen once
  kvc::WindowQueries<float> const wq{q.rows()};
  auto const raw = rdkv_scores(kvc::Cpu{}, linear(2, 1), c.view(), wq);
  REQUIRE(raw.status.ok());
  CHECK_THAT(raw.scores[0], WithinAbs(s0, 1e-6));
  CHECK_THAT(raw.scores[1], WithinAbs(s1, 1e-6));  // the window token is scored, not protected (A12)
  auto const pooled5 = rdkv_scores(kvc::Cpu{}, linear(2, 5), c.view(), wq);
  REQUIRE(pooled5.status.ok());
  CHECK_THAT(pooled5.scores[0], WithinAbs((s1 + s0 + s1) / 3.0, 1e-6));
  CHECK_THAT(pooled5.scores[1], WithinAbs((s0 + s1 + s0) / 3.0, 1e-6));
  // W = 1 (the last row only): slot 0 is seen by one row: s = (p, 1 - p).
  auto const last = rdkv_scores(kvc::Cpu{}, linear(1, 1), c.view(), wq);
  REQUIRE(last.status.ok());
  CHECK_THAT(last.scores[0], WithinAbs(p, 1e-6));
  CHECK_THAT(last.scores[1], WithinAbs(1.0 - p, 1e-6));
  // n = 1: one token, one query: a = 1, n_t = 1, pooling with kernel 5 is the identity.
  kvc::tools::HostCache<float> one({1, 1, 1, 4});
  kvc::test::OwnedQueries<float> q1({1, 1, 1, 4});
  q1.data = {1.0f, -2.0f, 0.5f, 3.0f};
  auto const single = rdkv_scores(kvc::Cpu{}, linear(1, 5), one.view(), kvc::WindowQueries<float>{q1.rows()});
  REQUIRE(single.status.ok());
  CHECK(single.scores == std::vector<float>{1.0f});
}

TEST_CASE("rdkv: attn_linear matches the float64 einsum reference (GQA 1 and 4, fp32 and fp16, RoPE)",
          "[scorers][rdkv]") {
  for (Index g : {1, 4})
    for (Index k : {1, 5, 7}) {
      INFO("g " << g << " kernel " << k);
      auto const p = random_problem<float>({2, 2, 90, 16}, 2 * g, 12, 3 + static_cast<std::uint64_t>(g));
      auto const post =
          rdkv_scores(kvc::Cpu{}, linear(10, k), p.cache.view(), kvc::WindowQueries<float>{p.queries.rows()});
      REQUIRE(post.status.ok());
      check_tokens(p, post.scores, linear(10, k), false);
      kvc::test::OwnedRope const rope({.theta = theta}, 16, 90);
      auto const pre = rdkv_scores(kvc::Cpu{}, linear(10, k), p.cache.view(),
                                   kvc::WindowQueries<float>{p.queries.rows(), rope.table});
      REQUIRE(pre.status.ok());
      check_tokens(p, pre.scores, linear(10, k), true);
      CHECK(pre.scores != post.scores);  // the rotation matters
    }
  // fp16 cache and queries (the reference reads the same rounded values), per-sequence lengths.
  auto p = random_problem<kvc::half>({2, 2, 70, 32}, 8, 9, 11);
  p.cache.lengths = {70, 33};
  kvc::test::OwnedRope const rope({.theta = theta}, 32, 70);
  for (auto const& s : {linear(9), linear(4, 3)}) {
    auto const got =
        rdkv_scores(kvc::Cpu{}, s, p.cache.view(), kvc::WindowQueries<kvc::half>{p.queries.rows(), rope.table});
    REQUIRE(got.status.ok());
    check_tokens(p, got.scores, s, true);
  }
}

TEST_CASE("rdkv: attn_linear with per-head lengths, compacted positions and explicit query positions",
          "[scorers][rdkv]") {
  // Head 0 holds positions 0..47; head 1, after an earlier eviction, 20 of them compacted to slots 0..19, its
  // padding full of NaN (never read).
  auto p = random_problem<float>({1, 2, 48, 8}, 8, 6, 29);
  p.cache.track(48);
  p.cache.lengths = {48, 20};
  std::vector<Index> const held = {0, 1, 2, 5, 8, 9, 13, 17, 18, 22, 25, 30, 31, 33, 36, 40, 44, 45, 46, 47};
  std::copy(held.begin(), held.end(), p.cache.positions.begin() + 48);
  for (Index t = 20; t < 48; ++t) {
    p.cache.positions[static_cast<std::size_t>(48 + t)] = 1000 + t;
    std::fill_n(p.cache.key(0, 1, t), 8, std::numeric_limits<float>::quiet_NaN());
    std::fill_n(p.cache.v.data() + (48 + t) * 8, 8, std::numeric_limits<float>::quiet_NaN());
  }
  for (auto const& s : {linear(6), linear(3, 3), derived(6), derived(4, 1)}) {
    auto const got = rdkv_scores(kvc::Cpu{}, s, p.cache.view(), kvc::WindowQueries<float>{p.queries.rows()});
    REQUIRE(got.status.ok());
    check_tokens(p, got.scores, s, false);
  }
  // Explicit positions, the window at 30..35: later slots are seen by no row (n_t = 0, weight 0 before pooling).
  std::vector<Index> const early = {30, 31, 32, 33, 34, 35};
  for (auto const& s : {linear(6), linear(6, 1), derived(5)}) {
    auto const got =
        rdkv_scores(kvc::Cpu{}, s, p.cache.view(), kvc::WindowQueries<float>{p.queries.rows(), {}, early.data()});
    REQUIRE(got.status.ok());
    std::vector<Index> const used(early.end() - s.window_size, early.end());
    check_tokens(p, got.scores, s, false, {used});
    if (s.kernel_size == 1)
      CHECK(got.scores[47] == 0.0f);
  }
}

TEST_CASE("rdkv: attn_linear times n_t sums to the attended rows (probabilities sum to 1)", "[scorers][rdkv]") {
  // Unpooled: sum_j s_j n_j = sum over the group's window rows of sum_j a = g * W.
  Index const g = 4, w = 8, n = 57;
  auto const p = random_problem<float>({1, 1, n, 16}, g, w, 41);
  auto const got = rdkv_scores(kvc::Cpu{}, linear(w, 1), p.cache.view(), kvc::WindowQueries<float>{p.queries.rows()});
  REQUIRE(got.status.ok());
  double total = 0;
  for (Index j = 0; j < n; ++j)
    total += got.scores[static_cast<std::size_t>(j)] * static_cast<double>(j < n - w ? w : n - j);
  CHECK_THAT(total, WithinAbs(static_cast<double>(g * w), 1e-4));
}

// ---- derived ----

TEST_CASE("rdkv: derived weight E[a²]·D·sigma² matches the float64 reference", "[scorers][rdkv]") {
  for (Index g : {1, 4}) {
    INFO("g " << g);
    auto p = random_problem<float>({2, 2, 80, 16}, 2 * g, 10, 51 + static_cast<std::uint64_t>(g), 3.0f);
    for (std::size_t i = 0; i < p.cache.v.size(); ++i)  // token-dependent value scales, so sigma² matters
      p.cache.v[i] = p.cache.v[i] * (1.0f + static_cast<float>((i / 16) % 7)) + 0.5f;
    kvc::test::OwnedRope const rope({.theta = theta}, 16, 80);
    for (auto const& s : {derived(10), derived(10, 1), derived(3, 7)}) {
      auto const got =
          rdkv_scores(kvc::Cpu{}, s, p.cache.view(), kvc::WindowQueries<float>{p.queries.rows(), rope.table});
      REQUIRE(got.status.ok());
      check_tokens(p, got.scores, s, true);
    }
  }
  // fp16 cache with a value dim different from the key dim.
  auto p = kvc::tools::HostCache<kvc::half>::random({1, 2, 40, 8}, 61, 12);
  kvc::test::OwnedQueries<kvc::half> q({1, 4, 5, 8});
  q.data = kvc::tools::random_values<kvc::half>(static_cast<Index>(q.data.size()), 62, 2.0f);
  Problem<kvc::half> const prob{p, q};
  auto const got = rdkv_scores(kvc::Cpu{}, derived(5), prob.cache.view(), kvc::WindowQueries<kvc::half>{q.rows()});
  REQUIRE(got.status.ok());
  check_tokens(prob, got.scores, derived(5), false);
  // A constant value row has sigma² = 0: weight 0 whatever its attention.
  auto flat = random_problem<float>({1, 1, 30, 8}, 1, 4, 63);
  std::fill_n(flat.cache.v.begin() + 10 * 8, 8, 2.5f);
  auto const z = rdkv_scores(kvc::Cpu{}, derived(4), flat.cache.view(), kvc::WindowQueries<float>{flat.queries.rows()});
  REQUIRE(z.status.ok());
  CHECK(z.scores[10] == 0.0f);
  CHECK(z.scores[11] > 0.0f);
}

// ---- ThinK ----

TEST_CASE("rdkv: ThinK channel score equals mean(q²)·mean(k²) (GQA 1 and 4, RoPE, fp16, per-head lengths)",
          "[scorers][rdkv]") {
  for (Index g : {1, 4}) {
    INFO("g " << g);
    auto p = random_problem<float>({2, 3, 64, 16}, 3 * g, 12, 71 + static_cast<std::uint64_t>(g));
    p.cache.lengths = {64, 10, 0, 40, 64, 1};
    p.cache.per_head = true;
    for (std::size_t i = 0; i < p.cache.k.size(); ++i)  // channel-dependent key scales, so channels differ
      p.cache.k[i] *= 1.0f + static_cast<float>(i % 16) / 4.0f;
    auto const post =
        think_scores(kvc::Cpu{}, ThinKChannelScorer{8}, p.cache.view(), kvc::WindowQueries<float>{p.queries.rows()});
    REQUIRE(post.status.ok());
    check_channels(p, post.scores, 8, false);
    kvc::test::OwnedRope const rope({.theta = theta}, 16, 64);
    auto const pre = think_scores(kvc::Cpu{}, ThinKChannelScorer{12}, p.cache.view(),
                                  kvc::WindowQueries<float>{p.queries.rows(), rope.table});
    REQUIRE(pre.status.ok());
    check_channels(p, pre.scores, 12, true);
    // Sequence 0's head 2 is empty: its key mean is 0.
    for (Index c = 0; c < 16; ++c)
      CHECK(pre.scores[static_cast<std::size_t>(2 * 16 + c)] == 0.0f);
  }
  auto const p = random_problem<kvc::half>({1, 2, 50, 32}, 8, 6, 81);
  kvc::test::OwnedRope const rope({.theta = theta}, 32, 50);
  auto const got = think_scores(kvc::Cpu{}, ThinKChannelScorer{6}, p.cache.view(),
                                kvc::WindowQueries<kvc::half>{p.queries.rows(), rope.table});
  REQUIRE(got.status.ok());
  check_channels(p, got.scores, 6, true);
  // Explicit query positions rotate the queries to them.
  std::vector<Index> const at = {20, 21, 22, 23, 24, 25};
  auto const moved = think_scores(kvc::Cpu{}, ThinKChannelScorer{6}, p.cache.view(),
                                  kvc::WindowQueries<kvc::half>{p.queries.rows(), rope.table, at.data()});
  REQUIRE(moved.status.ok());
  check_channels(p, moved.scores, 6, true, {at});
}

// ---- determinism and errors ----

TEST_CASE("rdkv: a thread pool gives bit-identical token and channel weights", "[scorers][rdkv]") {
  auto p = random_problem<float>({4, 2, 400, 32}, 8, 16, 91);
  p.cache.lengths = {400, 131, 1, 300, 0, 77, 399, 400};
  p.cache.per_head = true;
  kvc::ThreadPool pool(3);
  kvc::WindowQueries<float> const wq{p.queries.rows()};
  for (auto const& s : {linear(16), derived(16), linear(8, 7)}) {
    auto const serial = rdkv_scores(kvc::Cpu{}, s, p.cache.view(), wq);
    REQUIRE(serial.status.ok());
    for (int rep = 0; rep < 3; ++rep) {
      auto const parallel = rdkv_scores(pool.cpu(), s, p.cache.view(), wq);
      REQUIRE(parallel.status.ok());
      CHECK(serial.scores == parallel.scores);
    }
  }
  auto const serial = think_scores(kvc::Cpu{}, ThinKChannelScorer{16}, p.cache.view(), wq);
  REQUIRE(serial.status.ok());
  for (int rep = 0; rep < 3; ++rep) {
    auto const parallel = think_scores(pool.cpu(), ThinKChannelScorer{16}, p.cache.view(), wq);
    REQUIRE(parallel.status.ok());
    CHECK(serial.scores == parallel.scores);
  }
}

TEST_CASE("rdkv: invalid parameters and shapes are rejected", "[scorers][rdkv]") {
  auto const p = random_problem<float>({1, 2, 40, 8}, 4, 6, 99);
  kvc::WindowQueries<float> const wq{p.queries.rows()};
  auto code = [&](RDKVTokenScorer const& s) { return rdkv_scores(kvc::Cpu{}, s, p.cache.view(), wq).status.code(); };
  CHECK(RDKVTokenScorer{}.check().ok());
  CHECK(RDKVTokenScorer{}.window_size == 32);
  CHECK(RDKVTokenScorer{}.kernel_size == 5);
  CHECK(RDKVTokenScorer{}.weight == RDKVTokenWeight::attn_linear);
  CHECK(code(linear(6)) == kvc::Errc::ok);
  CHECK(code(derived(6)) == kvc::Errc::ok);
  CHECK(code(linear(0)) == kvc::Errc::invalid_argument);  // empty window
  CHECK(code(derived(-3)) == kvc::Errc::invalid_argument);
  CHECK(code(linear(6, 4)) == kvc::Errc::invalid_argument);  // even kernel
  CHECK(code(linear(6, 0)) == kvc::Errc::invalid_argument);
  CHECK(code(linear(7)) == kvc::Errc::invalid_argument);  // more than the 6 query rows
  CHECK(code(derived(7)) == kvc::Errc::invalid_argument);
  CHECK(code({static_cast<RDKVTokenWeight>(9), 6, 5}) == kvc::Errc::invalid_argument);
  // Query heads not a multiple of KV heads; a head dim that differs from the keys'.
  kvc::test::OwnedQueries<float> three({1, 3, 6, 8}), wide({1, 4, 6, 16});
  CHECK(rdkv_scores(kvc::Cpu{}, linear(6), p.cache.view(), kvc::WindowQueries<float>{three.rows()}).status.code() ==
        kvc::Errc::invalid_argument);
  CHECK(rdkv_scores(kvc::Cpu{}, linear(6), p.cache.view(), kvc::WindowQueries<float>{wide.rows()}).status.code() ==
        kvc::Errc::invalid_argument);
  // A RoPE table that does not reach the last query position.
  kvc::test::OwnedRope const short_rope({}, 8, 39);
  CHECK(
      rdkv_scores(kvc::Cpu{}, linear(6), p.cache.view(), kvc::WindowQueries<float>{p.queries.rows(), short_rope.table})
          .status.code() == kvc::Errc::invalid_argument);
  // A workspace smaller than the query.
  auto const obs = kvc::observe(wq);
  kvc::test::OwnedScores out(1, 2, 40);
  kvc::test::OwnedWorkspace small(kvc::score_workspace_bytes(kvc::Cpu{}, linear(6), p.cache.ext, obs) / 2);
  CHECK(kvc::score(kvc::Cpu{}, linear(6), p.cache.view(), obs, out.span, small.get()).code() ==
        kvc::Errc::out_of_capacity);
  // The workspace query stays sane for invalid windows (kvc::score rejects them before carving).
  for (Index w : {Index{-1}, -(Index{1} << 40)})
    CHECK(kvc::score_workspace_bytes(kvc::Cpu{}, linear(w), p.cache.ext, obs) <=
          kvc::score_workspace_bytes(kvc::Cpu{}, linear(6), p.cache.ext, obs));

  // ThinK.
  auto think_code = [&](ThinKChannelScorer const& s, kvc::WindowQueries<float> const& q) {
    return think_scores(kvc::Cpu{}, s, p.cache.view(), q).status.code();
  };
  CHECK(ThinKChannelScorer{}.check().ok());
  CHECK(ThinKChannelScorer{}.window_size == 32);
  CHECK(think_code(ThinKChannelScorer{6}, wq) == kvc::Errc::ok);
  CHECK(think_code(ThinKChannelScorer{0}, wq) == kvc::Errc::invalid_argument);
  CHECK(think_code(ThinKChannelScorer{7}, wq) == kvc::Errc::invalid_argument);
  CHECK(think_code(ThinKChannelScorer{6}, kvc::WindowQueries<float>{three.rows()}) == kvc::Errc::invalid_argument);
  CHECK(think_code(ThinKChannelScorer{6}, kvc::WindowQueries<float>{p.queries.rows(), short_rope.table}) ==
        kvc::Errc::invalid_argument);
  std::vector<float> channels(2 * 8);
  kvc::test::OwnedWorkspace ws(kvc::channel_score_workspace_bytes(kvc::Cpu{}, ThinKChannelScorer{6}, p.cache.ext, obs));
  CHECK(kvc::score_channels(kvc::Cpu{}, ThinKChannelScorer{6}, p.cache.view(), obs, nullptr, ws.get()).code() ==
        kvc::Errc::invalid_argument);
  CHECK(kvc::score_channels(kvc::Cpu{}, ThinKChannelScorer{6}, p.cache.view(), obs, channels.data(), {}).code() ==
        kvc::Errc::out_of_capacity);
  auto bad = p;
  bad.cache.lengths = {41};
  CHECK(
      kvc::score_channels(kvc::Cpu{}, ThinKChannelScorer{6}, bad.cache.view(), obs, channels.data(), ws.get()).code() ==
      kvc::Errc::invalid_argument);
}

}  // namespace

TEST_CASE("rdkv: a NaN or Inf key gets probability 0 (derived) and stays out of ThinK's channel means",
          "[scorers][rdkv]") {
  float const nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  for (float const bad : {nan, inf}) {
    // derived, kernel 1, one zero query row at the last position: the 3 finite keys get a = 1/3, so a^2 = 1/9,
    // times d_v sigma^2 = 2 for values (1, -1); the bad slot 1 gets 0.
    kvc::tools::HostCache<float> c({1, 1, 4, 2});
    c.k = {1, 2, bad, 0, 3, 4, 0, 1};
    c.v = {1, -1, 1, -1, 1, -1, 1, -1};
    kvc::test::OwnedQueries<float> zero({1, 1, 1, 2});
    std::fill(zero.data.begin(), zero.data.end(), 0.0f);
    auto const got = rdkv_scores(kvc::Cpu{}, derived(1, 1), c.view(), kvc::WindowQueries<float>{zero.rows()});
    REQUIRE(got.status.ok());
    CHECK_THAT(got.scores[0], WithinAbs(2.0 / 9.0, 1e-6));
    CHECK(got.scores[1] == 0.0f);
    CHECK_THAT(got.scores[2], WithinAbs(2.0 / 9.0, 1e-6));
    CHECK_THAT(got.scores[3], WithinAbs(2.0 / 9.0, 1e-6));
    // ThinK: query (1, 1); mean k_c^2 over the finite keys (1, 2), (3, 4), (0, 1): (10/3, 21/3).
    kvc::test::OwnedQueries<float> ones({1, 1, 1, 2});
    std::fill(ones.data.begin(), ones.data.end(), 1.0f);
    auto const channels =
        think_scores(kvc::Cpu{}, ThinKChannelScorer{1}, c.view(), kvc::WindowQueries<float>{ones.rows()});
    REQUIRE(channels.status.ok());
    CHECK_THAT(channels.scores[0], WithinAbs(10.0 / 3.0, 1e-5));
    CHECK_THAT(channels.scores[1], WithinAbs(7.0, 1e-5));
  }
}
