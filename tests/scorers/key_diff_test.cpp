// SPDX-License-Identifier: Apache-2.0
// tests/scorers/key_diff_test.cpp mirrors include/kvc/scorers/key_diff.hpp. Cases are the spec's worked examples
// and properties (specs/key_diff.md §9), hand-computed values, and brute-force checks of the paper's theorem.
#include <kvc/backend/cpu/scorers/key_diff.hpp>
#include <kvc/backend/cpu/selectors/top_k.hpp>
#include <kvc/pipeline/press.hpp>

#include "common/synthetic.hpp"
#include "support/catch.hpp"
#include "support/helpers.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

namespace {

using Catch::Matchers::WithinAbs;
using kvc::Index;

/// Scores one head of keys given row by row.
template <class T = float>
std::vector<float> key_diff_scores(std::vector<T> keys, Index dim, kvc::KeyDiffScorer s = {}) {
  Index const n = static_cast<Index>(keys.size()) / dim;
  kvc::KVExtents const e{1, 1, n, dim};
  auto const cache = kvc::dense_cache(keys.data(), keys.data(), e);
  kvc::test::OwnedScores out(1, 1, n);
  kvc::test::OwnedWorkspace ws(kvc::score_workspace_bytes(kvc::Cpu{}, s, e));
  REQUIRE(kvc::score(kvc::Cpu{}, s, cache, out.span, ws.get()).ok());
  return out.data;
}

/// Indices of the N highest scores (ties -> lower index), ascending.
std::vector<Index> keep_top(std::vector<float> scores, Index budget) {
  Index const n = static_cast<Index>(scores.size());
  kvc::test::OwnedPlan plan(1, 1, n);
  kvc::test::OwnedWorkspace ws(
      kvc::select_workspace_bytes(kvc::Cpu{}, kvc::TopKSelector{kvc::FixedBudget{budget}}, 1, 1, n));
  REQUIRE(kvc::select(kvc::Cpu{}, kvc::TopKSelector{kvc::FixedBudget{budget}}, kvc::ScoreSpan<>{scores.data(), 1, 1, n},
                      plan.plan, ws.get())
              .ok());
  return plan.kept(0, 0);
}

/// fp64 oracle of Eq. 8 for one head (independent of the kernel: no blocks, no Eigen, no scaling: every finite
/// fp32 key squares and sums within fp64's range). `s` gives the anchor and the eps floors.
std::vector<double> oracle(std::vector<double> const& k, Index dim, kvc::KeyDiffScorer s = {}) {
  Index const n = static_cast<Index>(k.size()) / dim;
  bool const unit = s.anchor == kvc::KeyDiffAnchor::normalized_mean;
  std::vector<double> mu(static_cast<std::size_t>(dim), 0.0);
  std::vector<double> norm(static_cast<std::size_t>(n));
  for (Index t = 0; t < n; ++t) {
    double sq = 0;
    for (Index i = 0; i < dim; ++i)
      sq += k[t * dim + i] * k[t * dim + i];
    norm[t] = std::sqrt(sq);
    double const w = unit ? 1.0 / std::max(norm[t], double{s.unit_eps}) : 1.0;
    for (Index i = 0; i < dim; ++i)
      mu[i] += k[t * dim + i] * w / static_cast<double>(n);
  }
  double mn = 0;
  for (double x : mu)
    mn += x * x;
  mn = std::sqrt(mn);
  std::vector<double> out(static_cast<std::size_t>(n));
  for (Index t = 0; t < n; ++t) {
    double dot = 0;
    for (Index i = 0; i < dim; ++i)
      dot += mu[i] * k[t * dim + i];
    out[t] = -dot / (std::max(mn, double{s.cosine_eps}) * std::max(norm[t], double{s.cosine_eps}));
  }
  return out;
}

/// One head of n keys whose token t has magnitude scales[t % scales.size()]: scale * u with u_i = 0.3 + 0.5 z
/// (z standard normal) clamped to [-1.1, 1.1], so the keys share a direction (a clear anchor), every element is
/// finite even at 3e38 while the norms of those rows exceed FLT_MAX.
template <class T>
std::vector<T> range_keys(Index n, Index dim, std::vector<double> const& scales, std::uint64_t seed) {
  kvc::tools::Rng rng(seed);
  std::vector<T> k;
  for (Index t = 0; t < n; ++t)
    for (Index i = 0; i < dim; ++i) {
      double const u = std::clamp(0.3 + 0.5 * rng.normal(), -1.1, 1.1);
      k.push_back(kvc::from_float<T>(static_cast<float>(u * scales[static_cast<std::size_t>(t) % scales.size()])));
    }
  return k;
}

/// The stored keys widened to fp64 (what the oracle sees).
template <class T>
std::vector<double> widen(std::vector<T> const& k) {
  std::vector<double> out;
  for (T x : k)
    out.push_back(kvc::to_float(x));
  return out;
}

/// Scores within 1e-6 of the fp64 oracle (they lie in [-1, 1]), and every budget keeps the set the oracle keeps
/// (REQUIREd to have a clear gap at its boundary, so the expected set does not hinge on rounding).
void check_against_oracle(std::vector<float> const& s, std::vector<double> const& ref,
                          std::vector<Index> const& budgets) {
  for (std::size_t t = 0; t < ref.size(); ++t) {
    INFO("token " << t << ": kvc " << s[t] << ", oracle " << ref[t]);
    CHECK_THAT(s[t], WithinAbs(ref[t], 1e-6));
  }
  for (Index budget : budgets) {
    std::vector<Index> order(ref.size());
    std::iota(order.begin(), order.end(), Index{0});
    std::stable_sort(order.begin(), order.end(), [&](Index a, Index b) { return ref[a] > ref[b]; });
    REQUIRE(ref[order[budget - 1]] - ref[order[budget]] > 1e-5);
    std::vector<Index> expected(order.begin(), order.begin() + budget);
    std::sort(expected.begin(), expected.end());
    INFO("budget " << budget);
    CHECK(keep_top(s, budget) == expected);
  }
}

std::vector<float> random_keys(Index n, Index dim, std::uint64_t seed, float offset = 0.0f) {
  kvc::tools::Rng rng(seed);
  std::vector<float> k(static_cast<std::size_t>(n * dim));
  for (float& x : k)
    x = rng.normal() + offset;
  return k;
}

}  // namespace

TEST_CASE("key_diff: the anchor weight and the cosine both backends share (hand values, eps floors, fp32 and fp64)",
          "[scorers][key_diff]") {
  kvc::KeyDiffScorer const unit{};
  kvc::KeyDiffScorer const raw{.anchor = kvc::KeyDiffAnchor::raw_mean};
  CHECK(kvc::key_diff_anchor_weight(unit, 4.0f) == 0.25f);                           // 1 / ||k||
  CHECK(kvc::key_diff_anchor_weight(unit, 0.0f) == 1.0f / 1e-12f);                   // 1 / unit_eps for a zero key
  CHECK(kvc::key_diff_anchor_weight(raw, 4.0f) == 1.0f);                             // the raw mean weighs every key 1
  CHECK(kvc::key_diff_anchor_weight(unit, 4.0) == 0.25);                             // fp64 (the range path)
  CHECK(kvc::key_diff_cosine(unit, 2.0f, 1.0f, 4.0f) == -0.5f);                      // -(mu . k) / (||mu|| ||k||)
  CHECK(kvc::key_diff_cosine(unit, -3.0, 2.0, 0.0) == 3.0 / (2.0 * double{1e-8f}));  // ||k|| floored at cosine_eps
}

TEST_CASE("key_diff: spec case 1, K = [(1,0),(0,1),(1,1)]", "[scorers][key_diff]") {
  auto const s = key_diff_scores<float>({1, 0, 0, 1, 1, 1}, 2);
  CHECK_THAT(s[0], WithinAbs(-1.0 / std::sqrt(2.0), 1e-6));
  CHECK_THAT(s[1], WithinAbs(-1.0 / std::sqrt(2.0), 1e-6));
  CHECK_THAT(s[2], WithinAbs(-1.0, 1e-6));
  CHECK(keep_top(s, 2) == std::vector<Index>{0, 1});
  CHECK(keep_top(s, 1) == std::vector<Index>{0});  // a tie: the lower index wins
}

TEST_CASE("key_diff: spec case 2 evicts the unique direction", "[scorers][key_diff]") {
  auto const s = key_diff_scores<float>({2, 0, 0, 3, -1, 0}, 2);  // unit keys of 0 and 2 cancel: mu = (0, 1/3)
  CHECK_THAT(s[0], WithinAbs(0.0, 1e-6));
  CHECK_THAT(s[1], WithinAbs(-1.0, 1e-6));
  CHECK_THAT(s[2], WithinAbs(0.0, 1e-6));
  CHECK(keep_top(s, 2) == std::vector<Index>{0, 2});
}

TEST_CASE("key_diff: antipodal keys give mu = 0 and all-zero scores, no NaN", "[scorers][key_diff]") {
  auto const s = key_diff_scores<float>({1, 0, -1, 0}, 2);
  CHECK(s[0] == 0.0f);
  CHECK(s[1] == 0.0f);
  CHECK(keep_top(s, 1) == std::vector<Index>{0});
}

TEST_CASE("key_diff: a zero key scores 0, counts in n and adds nothing to mu", "[scorers][key_diff]") {
  auto const with_zero = key_diff_scores<float>({1, 0, 0, 0, 1, 1}, 2);
  CHECK(with_zero[1] == 0.0f);
  // mu = ((1 + 1/sqrt2)/3, (1/sqrt2)/3): n = 3 even though one key is zero. Hand value for key 0:
  double const a = (1 + 1 / std::sqrt(2.0)) / 3, b = (1 / std::sqrt(2.0)) / 3;
  CHECK_THAT(with_zero[0], WithinAbs(-a / std::sqrt(a * a + b * b), 1e-6));
}

TEST_CASE("key_diff: parallel key scores -1, anti-parallel +1, all within [-1, 1]", "[scorers][key_diff]") {
  auto k = random_keys(40, 8, 11, 0.7f);
  auto s = key_diff_scores(k, 8);
  for (float x : s) {
    CHECK(x >= -1.0f - 1e-6f);
    CHECK(x <= 1.0f + 1e-6f);
  }
  // Append mu's direction and its opposite: they are the first and last evicted.
  std::vector<double> kd(k.begin(), k.end());
  auto const base = oracle(kd, 8);
  std::vector<double> mu(8, 0.0);
  for (Index t = 0; t < 40; ++t) {
    double nrm = 0;
    for (Index i = 0; i < 8; ++i)
      nrm += kd[t * 8 + i] * kd[t * 8 + i];
    for (Index i = 0; i < 8; ++i)
      mu[i] += kd[t * 8 + i] / std::sqrt(nrm);
  }
  for (Index i = 0; i < 8; ++i)
    k.push_back(static_cast<float>(mu[i]));
  for (Index i = 0; i < 8; ++i)
    k.push_back(static_cast<float>(-mu[i]));
  s = key_diff_scores(k, 8);  // appending +mu and -mu leaves the mean direction unchanged
  CHECK_THAT(s[40], WithinAbs(-1.0, 1e-5));
  CHECK_THAT(s[41], WithinAbs(1.0, 1e-5));
  (void)base;
}

TEST_CASE("key_diff: matches an fp64 oracle (fp32 within 1e-6, fp16 and bf16 within 1e-3)", "[scorers][key_diff]") {
  Index const n = 700, dim = 64;  // more than two 256-token accumulation blocks
  auto const k = random_keys(n, dim, 5, 0.3f);
  auto const ref = oracle(std::vector<double>(k.begin(), k.end()), dim);
  auto const s32 = key_diff_scores(k, dim);
  std::vector<kvc::half> k16;
  std::vector<kvc::bfloat16> kb16;
  for (float x : k) {
    k16.emplace_back(x);
    kb16.emplace_back(x);
  }
  // The 16-bit oracle sees the rounded keys.
  std::vector<double> r16, rb16;
  for (auto x : k16)
    r16.push_back(kvc::to_float(x));
  for (auto x : kb16)
    rb16.push_back(kvc::to_float(x));
  auto const ref16 = oracle(r16, dim), refb16 = oracle(rb16, dim);
  auto const s16 = key_diff_scores(k16, dim), sb16 = key_diff_scores(kb16, dim);
  for (Index t = 0; t < n; ++t) {
    CHECK_THAT(s32[t], WithinAbs(ref[t], 1e-6));
    CHECK_THAT(s16[t], WithinAbs(ref16[t], 1e-3));
    CHECK_THAT(sb16[t], WithinAbs(refb16[t], 1e-3));
  }
}

TEST_CASE("key_diff: per-key positive scaling leaves scores unchanged", "[scorers][key_diff]") {
  auto k = random_keys(50, 16, 3);
  auto const before = key_diff_scores(k, 16);
  kvc::tools::Rng rng(99);
  for (Index t = 0; t < 50; ++t) {
    auto const c = static_cast<float>(0.1 + 10 * rng.uniform());
    for (Index i = 0; i < 16; ++i)
      k[t * 16 + i] *= c;
  }
  auto const after = key_diff_scores(k, 16);
  for (Index t = 0; t < 50; ++t)
    CHECK_THAT(after[t], WithinAbs(before[t], 1e-5));
}

TEST_CASE("key_diff: the raw-mean anchor differs, and equals the default when norms are equal", "[scorers][key_diff]") {
  kvc::KeyDiffScorer raw;
  raw.anchor = kvc::KeyDiffAnchor::raw_mean;
  // Unequal norms: raw mean (2,0)+(0,1) -> (1, 0.5); unit mean -> (0.5, 0.5).
  auto const a = key_diff_scores<float>({2, 0, 0, 1}, 2, raw), b = key_diff_scores<float>({2, 0, 0, 1}, 2);
  CHECK_THAT(a[0], WithinAbs(-2.0 / std::sqrt(5.0), 1e-6));
  CHECK_THAT(b[0], WithinAbs(-1.0 / std::sqrt(2.0), 1e-6));
  // Equal norms: identical.
  auto k = random_keys(30, 8, 21);
  for (Index t = 0; t < 30; ++t) {
    float n2 = 0;
    for (Index i = 0; i < 8; ++i)
      n2 += k[t * 8 + i] * k[t * 8 + i];
    for (Index i = 0; i < 8; ++i)
      k[t * 8 + i] /= std::sqrt(n2);
  }
  auto const x = key_diff_scores(k, 8, raw), y = key_diff_scores(k, 8);
  for (Index t = 0; t < 30; ++t)
    CHECK_THAT(x[t], WithinAbs(y[t], 1e-6));
}

TEST_CASE("key_diff: a common orthogonal rotation leaves scores unchanged, RoPE-like rotation does not",
          "[scorers][key_diff]") {
  auto const k = random_keys(20, 2, 8, 1.0f);
  double const th = 0.9;
  auto rotate = [&](float x, float y, double a) {
    return std::pair{static_cast<float>(std::cos(a) * x - std::sin(a) * y),
                     static_cast<float>(std::sin(a) * x + std::cos(a) * y)};
  };
  std::vector<float> common, per_position;
  for (Index t = 0; t < 20; ++t) {
    auto [x, y] = rotate(k[2 * t], k[2 * t + 1], th);
    common.insert(common.end(), {x, y});
    auto [u, v] = rotate(k[2 * t], k[2 * t + 1], 0.5 * static_cast<double>(t));
    per_position.insert(per_position.end(), {u, v});
  }
  auto const s0 = key_diff_scores(k, 2), s1 = key_diff_scores(common, 2), s2 = key_diff_scores(per_position, 2);
  double max_diff = 0;
  for (Index t = 0; t < 20; ++t) {
    CHECK_THAT(s1[t], WithinAbs(s0[t], 1e-5));
    max_diff = std::max(max_diff, std::abs(double{s2[t]} - s0[t]));
  }
  CHECK(max_diff > 0.1);
}

TEST_CASE("key_diff: permuting tokens permutes the scores", "[scorers][key_diff]") {
  Index const n = 25, dim = 6;
  auto const k = random_keys(n, dim, 4);
  std::vector<Index> perm(n);
  std::iota(perm.begin(), perm.end(), 0);
  std::reverse(perm.begin(), perm.end());
  std::rotate(perm.begin(), perm.begin() + 7, perm.end());
  std::vector<float> kp(k.size());
  for (Index t = 0; t < n; ++t)
    std::copy_n(k.begin() + perm[t] * dim, dim, kp.begin() + t * dim);
  auto const s = key_diff_scores(k, dim), sp = key_diff_scores(kp, dim);
  for (Index t = 0; t < n; ++t)
    CHECK_THAT(sp[t], WithinAbs(s[perm[t]], 1e-6));
}

TEST_CASE("key_diff: the kept set attains the Eq. 10 optimum (brute force)", "[scorers][key_diff]") {
  for (std::uint64_t seed = 1; seed <= 20; ++seed) {
    Index const n = 9, dim = 3, budget = 4;
    auto const k = random_keys(n, dim, seed, 0.2f);
    std::vector<double> kd(k.begin(), k.end());
    // u_i = k^_i . mu(K^): Eq. 10 minimises the sum of u over the kept set.
    auto const cosine = oracle(kd, dim);  // -cos = -u / ||mu|| with the same positive ||mu|| for every i
    auto const kept = keep_top(key_diff_scores(k, dim), budget);
    double kept_value = 0;
    for (Index i : kept)
      kept_value += -cosine[i];
    double best = 1e300;
    for (unsigned mask = 0; mask < (1u << n); ++mask) {
      if (std::popcount(mask) != budget)
        continue;
      double v = 0;
      for (Index i = 0; i < n; ++i)
        if (mask & (1u << i))
          v += -cosine[i];
      best = std::min(best, v);
    }
    CHECK_THAT(kept_value, WithinAbs(best, 1e-9));
  }
}

TEST_CASE("key_diff: not optimal for Eq. 9 (the spec's counterexample)", "[scorers][key_diff]") {
  std::vector<float> k = {1, 0, 1, 0, 0, 1, 0, 1, 0, 1};
  auto const kept = keep_top(key_diff_scores(k, 2), 2);
  CHECK(kept == std::vector<Index>{0, 1});
  auto eq9 = [&](Index a, Index b) {  // sum over i, j in S of k^_i . k^_j
    double const dot = k[2 * a] * k[2 * b] + k[2 * a + 1] * k[2 * b + 1];
    return 2.0 + 2.0 * dot;
  };
  CHECK(eq9(0, 1) == 4.0);
  CHECK(eq9(0, 2) == 2.0);  // the Eq. 9 optimum, which KeyDiff does not pick
}

TEST_CASE("key_diff: the pairwise form (Eq. 7) ranks like Eq. 8", "[scorers][key_diff]") {
  Index const n = 30, dim = 5;
  auto const k = random_keys(n, dim, 17, 0.5f);
  auto const s = key_diff_scores(k, dim);
  std::vector<double> unit(k.begin(), k.end());
  for (Index t = 0; t < n; ++t) {
    double nrm = 0;
    for (Index i = 0; i < dim; ++i)
      nrm += unit[t * dim + i] * unit[t * dim + i];
    for (Index i = 0; i < dim; ++i)
      unit[t * dim + i] /= std::sqrt(nrm);
  }
  std::vector<float> pairwise(static_cast<std::size_t>(n));
  for (Index a = 0; a < n; ++a) {
    double sum = 0;
    for (Index b = 0; b < n; ++b)
      for (Index i = 0; i < dim; ++i)
        sum += unit[a * dim + i] * unit[b * dim + i];
    pairwise[a] = static_cast<float>(-sum);
  }
  for (Index budget : {1, 5, 12, 29})
    CHECK(keep_top(s, budget) == keep_top(pairwise, budget));
}

TEST_CASE("key_diff: heads and batch rows are independent, padding scores -inf and leaves mu alone",
          "[scorers][key_diff]") {
  kvc::KVExtents const e{2, 3, 12, 4};
  auto cache = kvc::tools::HostCache<float>::random(e, 7);
  kvc::KeyDiffScorer const s;
  kvc::test::OwnedWorkspace ws(kvc::score_workspace_bytes(kvc::Cpu{}, s, e));
  kvc::test::OwnedScores a(2, 3, 12), b(2, 3, 12), c(2, 3, 12);
  REQUIRE(kvc::score(kvc::Cpu{}, s, cache.view(), a.span, ws.get()).ok());
  for (Index t = 0; t < 12; ++t)  // change head (0, 1) only
    cache.key(0, 1, t)[0] += 3.0f;
  REQUIRE(kvc::score(kvc::Cpu{}, s, cache.view(), b.span, ws.get()).ok());
  for (Index bh = 0; bh < 6; ++bh)
    for (Index t = 0; t < 12; ++t)
      if (bh != 1)
        CHECK(a.data[bh * 12 + t] == b.data[bh * 12 + t]);
  // Ragged: row 1 has 7 valid tokens; its scores equal scoring the 7-token prefix alone, the rest are -inf.
  cache.lengths = {12, 7};
  REQUIRE(kvc::score(kvc::Cpu{}, s, cache.view(), c.span, ws.get()).ok());
  for (Index h = 0; h < 3; ++h) {
    std::vector<float> prefix(cache.key(1, h, 0), cache.key(1, h, 0) + 7 * 4);
    auto const ref = key_diff_scores(prefix, 4);
    for (Index t = 0; t < 7; ++t)
      CHECK(c.span(1, h, t) == ref[t]);
    for (Index t = 7; t < 12; ++t)
      CHECK(c.span(1, h, t) == -std::numeric_limits<float>::infinity());
  }
}

TEST_CASE("key_diff: empty heads, bad shapes and small workspaces are errors or no-ops", "[scorers][key_diff]") {
  kvc::KVExtents const e{1, 2, 0, 4};
  std::vector<float> none;
  auto const cache = kvc::dense_cache(none.data(), none.data(), e);
  kvc::test::OwnedWorkspace ws(kvc::score_workspace_bytes(kvc::Cpu{}, kvc::KeyDiffScorer{}, e));
  CHECK(kvc::score(kvc::Cpu{}, kvc::KeyDiffScorer{}, cache, kvc::ScoreSpan<>{nullptr, 1, 2, 0}, ws.get()).ok());

  auto c = kvc::tools::HostCache<float>::random({1, 2, 5, 4}, 1);
  kvc::test::OwnedScores out(1, 2, 4);  // wrong token count
  auto const st = kvc::score(kvc::Cpu{}, kvc::KeyDiffScorer{}, c.view(), out.span, ws.get());
  CHECK(st.code() == kvc::Errc::invalid_argument);
  kvc::test::OwnedScores ok(1, 2, 5);
  CHECK(kvc::score(kvc::Cpu{}, kvc::KeyDiffScorer{}, c.view(), ok.span, {}).code() == kvc::Errc::out_of_capacity);
  c.lengths = {9};  // beyond capacity
  CHECK(kvc::score(kvc::Cpu{}, kvc::KeyDiffScorer{}, c.view(), ok.span, ws.get()).code() ==
        kvc::Errc::invalid_argument);
}

TEST_CASE("key_diff: selection depends only on keys, never on values", "[scorers][key_diff]") {
  kvc::KVExtents const e{1, 2, 40, 8};
  auto a = kvc::tools::HostCache<float>::random(e, 3), b = a;
  for (float& x : b.v)
    x = -3.0f * x + 1.0f;
  kvc::Press const press{kvc::KeyDiffScorer{}, kvc::TopKSelector{kvc::RatioBudget{0.5}}};
  kvc::test::OwnedWorkspace ws(kvc::compress_workspace_bytes(kvc::Cpu{}, press, e));
  kvc::test::OwnedPlan pa(1, 2, 40), pb(1, 2, 40);
  REQUIRE(kvc::compress(kvc::Cpu{}, press, a.view(), pa.plan, ws.get()).ok());
  REQUIRE(kvc::compress(kvc::Cpu{}, press, b.view(), pb.plan, ws.get()).ok());
  CHECK(pa.kept(0, 0) == pb.kept(0, 0));
  CHECK(pa.kept(0, 1) == pb.kept(0, 1));
  CHECK(pa.kept(0, 0).size() == 20);
}

TEST_CASE("key_diff: fp32 keys at 1e20, 3e38 and 1e-25 match the fp64 oracle and keep its set",
          "[scorers][key_diff][range]") {
  // The 1e20 and 3e38 rows overflow an fp32 sum of squares (the 3e38 norms exceed FLT_MAX itself); the 1e-25 rows
  // underflow it. With the default eps the 1e-25 keys score about 0 (their norm is under cosine_eps), above every
  // other key: the budgets cut among the other 60.
  Index const n = 80, dim = 40;
  auto const k = range_keys<float>(n, dim, {1.0, 1e20, 3e38, 1e-25}, 41);
  check_against_oracle(key_diff_scores(k, dim), oracle(widen(k), dim), {25, 40, 60});
}

TEST_CASE("key_diff: 1e-25 keys are normalised exactly when the eps floors are zero", "[scorers][key_diff][range]") {
  kvc::KeyDiffScorer s;
  s.unit_eps = 0.0f;
  s.cosine_eps = 0.0f;
  Index const n = 60, dim = 24;
  auto const k = range_keys<float>(n, dim, {1e-25, 1.0, 1e-30}, 42);
  check_against_oracle(key_diff_scores(k, dim, s), oracle(widen(k), dim, s), {10, 30, 50});
}

TEST_CASE("key_diff: the raw-mean anchor of keys at 1e20, 3e38 and 1e-25 matches the fp64 oracle",
          "[scorers][key_diff][range]") {
  // The raw mean is dominated by the 3e38 keys: its fp32 block sum and its norm would overflow.
  kvc::KeyDiffScorer s;
  s.anchor = kvc::KeyDiffAnchor::raw_mean;
  Index const n = 80, dim = 40;
  auto const k = range_keys<float>(n, dim, {1.0, 1e20, 3e38, 1e-25}, 43);
  check_against_oracle(key_diff_scores(k, dim, s), oracle(widen(k), dim, s), {25, 40, 60});
  // Only tiny keys, no eps floor: the raw mean (about 1e-25) takes the anchor's power-of-two rescaling.
  s.cosine_eps = 0.0f;
  auto const tiny = range_keys<float>(40, dim, {1e-25, 3e-26}, 44);
  check_against_oracle(key_diff_scores(tiny, dim, s), oracle(widen(tiny), dim, s), {10, 20, 30});
}

TEST_CASE("key_diff: bf16 keys at 1e30 match the fp64 oracle on the rounded keys", "[scorers][key_diff][range]") {
  Index const n = 60, dim = 24;
  auto const k = range_keys<kvc::bfloat16>(n, dim, {1e30, 1.0, 3e38}, 45);
  check_against_oracle(key_diff_scores(k, dim), oracle(widen(k), dim), {10, 30, 50});
  kvc::KeyDiffScorer raw;
  raw.anchor = kvc::KeyDiffAnchor::raw_mean;
  check_against_oracle(key_diff_scores(k, dim, raw), oracle(widen(k), dim, raw), {10, 30, 50});
}

TEST_CASE("key_diff: a NaN or Inf key scores -inf and leaves the anchor to the finite keys", "[scorers][key_diff]") {
  // Spec case 1 with a bad key inserted at slot 2: the anchor is still the mean of (1,0), (0,1), (1,1)/sqrt2, so the
  // finite keys score -1/sqrt2, -1/sqrt2, -1 as without it (hand values), and the bad key -inf (evicted first).
  float const nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  for (float const bad : {nan, inf, -inf}) {
    auto const s = key_diff_scores<float>({1, 0, 0, 1, bad, 0, 1, 1}, 2);
    CHECK_THAT(s[0], WithinAbs(-1.0 / std::sqrt(2.0), 1e-6));
    CHECK_THAT(s[1], WithinAbs(-1.0 / std::sqrt(2.0), 1e-6));
    CHECK(s[2] == -inf);
    CHECK_THAT(s[3], WithinAbs(-1.0, 1e-6));
    CHECK(keep_top(s, 3) == std::vector<Index>{0, 1, 3});
  }
  // The raw-mean anchor too: mu = mean of (2, 0) and (0, 2) = (1, 1), so (2, 0) scores -1/sqrt2.
  auto const raw = key_diff_scores<float>({2, 0, nan, nan, 0, 2}, 2, {kvc::KeyDiffAnchor::raw_mean});
  CHECK_THAT(raw[0], WithinAbs(-1.0 / std::sqrt(2.0), 1e-6));
  CHECK(raw[1] == -inf);
  CHECK_THAT(raw[2], WithinAbs(-1.0 / std::sqrt(2.0), 1e-6));
  // fp16 keys: an Inf element (65504 * 2 rounds to Inf) likewise.
  auto const h = key_diff_scores<kvc::half>(
      {kvc::half(1.0f), kvc::half(0.0f), kvc::half(inf), kvc::half(0.0f), kvc::half(0.0f), kvc::half(1.0f)}, 2);
  CHECK_THAT(h[0], WithinAbs(-1.0 / std::sqrt(2.0), 1e-3));
  CHECK(h[1] == -inf);
  CHECK_THAT(h[2], WithinAbs(-1.0 / std::sqrt(2.0), 1e-3));
}

TEST_CASE("key_diff: score refuses an output buffer over the cache's keys or values", "[scorers][key_diff]") {
  // K rows (1,0), (0,1), (1,1) in one buffer with V; scores [1, 1, 3] written over K would change the keys the
  // second pass reads. Refused before anything is written.
  std::vector<float> kv = {1, 0, 0, 1, 1, 1, 7, 7, 7, 7, 7, 7};
  kvc::KVExtents const e{1, 1, 3, 2};
  auto const cache = kvc::dense_cache(kv.data(), kv.data() + 6, e);
  kvc::test::OwnedWorkspace ws(kvc::score_workspace_bytes(kvc::Cpu{}, kvc::KeyDiffScorer{}, e));
  std::vector<float> const before = kv;
  for (Index at : {Index{0}, Index{3}, Index{5}, Index{8}}) {  // over K, across K and V, over V
    kvc::Status const st =
        kvc::score(kvc::Cpu{}, kvc::KeyDiffScorer{}, cache, kvc::ScoreSpan<>{kv.data() + at, 1, 1, 3}, ws.get());
    CHECK(st.code() == kvc::Errc::invalid_argument);
    CHECK(std::string(st.message()) == "kvc::score: `out` overlaps the cache's keys or values");
  }
  CHECK(kv == before);
  // A workspace large enough but over K is refused as well.
  std::vector<float> out(3), big(kv.size() + ws.bytes.size() / sizeof(float) + 16);
  std::copy(kv.begin(), kv.end(), big.begin());
  auto const in_big = kvc::dense_cache(big.data(), big.data() + 6, e);
  CHECK(kvc::score(kvc::Cpu{}, kvc::KeyDiffScorer{}, in_big, kvc::ScoreSpan<>{out.data(), 1, 1, 3},
                   kvc::Workspace{big.data(), big.size() * sizeof(float)})
            .code() == kvc::Errc::invalid_argument);
  REQUIRE(kvc::score(kvc::Cpu{}, kvc::KeyDiffScorer{}, cache, kvc::ScoreSpan<>{out.data(), 1, 1, 3}, ws.get()).ok());
  CHECK_THAT(out[2], WithinAbs(-1.0, 1e-6));
}
