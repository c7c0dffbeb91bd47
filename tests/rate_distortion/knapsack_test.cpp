// SPDX-License-Identifier: Apache-2.0
// tests/rate_distortion/knapsack_test.cpp mirrors include/kvc/rate_distortion/knapsack.hpp: the solvers of one
// knapsack against spec rdkv.md §8 P1–P12. References are restated here independently of the code under test:
// the hull by brute force over chords, b(λ) as a direct argmin, optima by brute force over |S|^n (n <= 6), the
// exact greedy with a full sort, and hand-computed closed forms (worked out in the comments).
#include <kvc/rate_distortion/knapsack.hpp>

#include "common/knapsack_dp.hpp"
#include "support/catch.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

namespace {

using kvc::BitOptions;
using kvc::EpsilonTable;
using kvc::Index;
using Bits = std::vector<std::int8_t>;
using Weights = std::vector<float>;

constexpr int kS[5] = {0, 2, 4, 8, 16};

EpsilonTable const llama_v = EpsilonTable::llama31_v();
EpsilonTable const nonconvex{{1, 0.9, 0.01, 1e-4, 0}};   // 2 bits above the chord 0 -> 4 (P11)
EpsilonTable const collinear{{1, 0.875, 0.75, 0.5, 0}};  // every option on the line 1 - b/16
EpsilonTable const tables[] = {EpsilonTable::llama31_v(), EpsilonTable::llama31_k(), EpsilonTable::default_k(),
                               nonconvex, collinear};

std::size_t at(Index i) {
  return static_cast<std::size_t>(i);
}
Index size(Weights const& w) {
  return static_cast<Index>(w.size());
}

/// Option indices (into kS) a solver may use: allowed (0 only with eviction) and not strictly above any chord of two
/// other allowed options around it.
std::vector<int> hull_options(EpsilonTable const& t, bool evict) {
  std::vector<int> allowed, hull;
  for (int i = evict ? 0 : 1; i < 5; ++i)
    allowed.push_back(i);
  for (int o : allowed) {
    bool above = false;
    for (int i : allowed)
      for (int j : allowed)
        if (kS[i] < kS[o] && kS[o] < kS[j]) {
          double const chord = t.eps[i] + (t.eps[j] - t.eps[i]) * (kS[o] - kS[i]) / double(kS[j] - kS[i]);
          above = above || t.eps[o] > chord;
        }
    if (!above)
      hull.push_back(o);
  }
  return hull;
}

double eps_of(EpsilonTable const& t, int bits) {
  for (int i = 0; i < 5; ++i)
    if (kS[i] == bits)
      return t.eps[i];
  FAIL("bit width outside {0, 2, 4, 8, 16}: " << bits);
  return 0;
}

double dist(Weights const& w, EpsilonTable const& t, Bits const& b) {
  double d = 0;
  for (std::size_t u = 0; u < w.size(); ++u)
    d += double(w[u]) * eps_of(t, b[u]);
  return d;
}

std::int64_t total(Bits const& b) {
  return std::accumulate(b.begin(), b.end(), std::int64_t{0}, [](std::int64_t s, std::int8_t x) { return s + x; });
}

/// min ΔD over all assignments of `options` (indices into kS) to the units with Σ bits <= budget (brute force).
double brute_force(Weights const& w, EpsilonTable const& t, std::vector<int> const& options, std::int64_t budget) {
  std::size_t const n = w.size(), k = options.size();
  std::size_t combos = 1;
  for (std::size_t u = 0; u < n; ++u)
    combos *= k;
  double best = std::numeric_limits<double>::infinity();
  for (std::size_t c = 0; c < combos; ++c) {
    std::size_t r = c;
    std::int64_t bits = 0;
    double d = 0;
    for (std::size_t u = 0; u < n; ++u) {
      int const o = options[r % k];
      r /= k;
      bits += kS[o];
      d += double(w[u]) * t.eps[o];
    }
    if (bits <= budget)
      best = std::min(best, d);
  }
  return best;
}

/// b(λ) restated as a direct argmin over the hull options of w eps(b) + λ b (first minimum = fewer bits).
Bits argmin_bits(Weights const& w, EpsilonTable const& t, bool evict, double lambda) {
  std::vector<int> const hull = hull_options(t, evict);
  Bits b(w.size());
  for (std::size_t u = 0; u < w.size(); ++u) {
    double best = std::numeric_limits<double>::infinity();
    for (int o : hull) {
      double const c = double(w[u]) * t.eps[o] + lambda * kS[o];
      if (c < best) {
        best = c;
        b[u] = static_cast<std::int8_t>(kS[o]);
      }
    }
  }
  return b;
}

/// The exact greedy restated with a full sort: hull edges by gain rate w (eps_k - eps_k+1) / (b_k+1 - b_k), ties
/// lower unit then lower edge; an edge that does not fit is skipped and blocks its unit; zero-gain edges never.
Bits greedy_reference(Weights const& w, EpsilonTable const& t, bool evict, std::int64_t budget) {
  std::vector<int> const hull = hull_options(t, evict);
  struct Edge {
    double gain;
    std::size_t unit;
    int k;
  };
  std::vector<Edge> edges;
  for (std::size_t u = 0; u < w.size(); ++u)
    for (std::size_t k = 0; k + 1 < hull.size(); ++k) {
      double const rate = (t.eps[hull[k]] - t.eps[hull[k + 1]]) / double(kS[hull[k + 1]] - kS[hull[k]]);
      double const g = double(w[u]) * rate;
      if (g > 0)
        edges.push_back({g, u, static_cast<int>(k)});
    }
  std::sort(edges.begin(), edges.end(), [](Edge const& a, Edge const& b) {
    return a.gain > b.gain || (a.gain == b.gain && (a.unit < b.unit || (a.unit == b.unit && a.k < b.k)));
  });
  std::vector<int> level(w.size(), 0);
  std::vector<bool> blocked(w.size(), false);
  std::int64_t left = budget - std::int64_t{kS[hull[0]]} * static_cast<std::int64_t>(w.size());
  for (Edge const& e : edges) {
    if (blocked[e.unit])
      continue;
    REQUIRE(level[e.unit] == e.k);  // a unit's edges come in order
    int const c = kS[hull[at(e.k) + 1]] - kS[hull[at(e.k)]];
    if (c <= left) {
      left -= c;
      ++level[e.unit];
    } else {
      blocked[e.unit] = true;
    }
  }
  Bits b(w.size());
  for (std::size_t u = 0; u < w.size(); ++u)
    b[u] = static_cast<std::int8_t>(kS[hull[at(level[u])]]);
  return b;
}

struct Scratch {
  std::vector<std::byte> bytes;
  explicit Scratch(Index n, std::byte fill = std::byte{0}) : bytes(kvc::exact_bits_scratch_bytes(n), fill) {}
};

Bits exact(Weights const& w, EpsilonTable const& t, bool evict, std::int64_t budget, std::byte fill = std::byte{0}) {
  Bits b(w.size(), -1);
  Scratch s(size(w), fill);
  kvc::Status const st =
      kvc::exact_bits(w.data(), size(w), t, BitOptions{evict}, budget, b.data(), s.bytes.data(), s.bytes.size());
  INFO(st.message());
  REQUIRE(st.ok());
  return b;
}

Bits lagrangian(Weights const& w, EpsilonTable const& t, bool evict, double target, double* lambda = nullptr) {
  Bits b(w.size(), -1);
  kvc::Status const st = kvc::lagrangian_bits(w.data(), size(w), t, BitOptions{evict}, target, {}, b.data(), lambda);
  INFO(st.message());
  REQUIRE(st.ok());
  return b;
}

Bits dp(Weights const& w, EpsilonTable const& t, bool evict, std::int64_t budget) {
  Bits b(w.size(), -1);
  kvc::Status const st = kvc::tools::dp_bits(w.data(), size(w), t, BitOptions{evict}, budget, b.data());
  INFO(st.message());
  REQUIRE(st.ok());
  return b;
}

Bits at_lambda(Weights const& w, EpsilonTable const& t, bool evict, double lambda) {
  Bits b(w.size(), -1);
  kvc::bits_at_lambda(w.data(), size(w), t, BitOptions{evict}, lambda, b.data());
  return b;
}

/// Random weights: log-uniform over 6 decades, with some zeros and some repeated values (ties).
Weights random_weights(std::mt19937& rng, std::size_t n, bool zeros = true) {
  std::uniform_real_distribution<double> e(-6.0, 0.0);
  std::uniform_int_distribution<int> kind(0, 9);
  Weights w(n);
  for (std::size_t u = 0; u < n; ++u) {
    int const k = kind(rng);
    if (zeros && k == 0)
      w[u] = 0.0f;
    else if (k == 1 && u > 0)
      w[u] = w[u - 1];
    else
      w[u] = static_cast<float>(std::pow(10.0, e(rng)));
  }
  return w;
}

bool in_options(Bits const& b, bool evict) {
  return std::all_of(b.begin(), b.end(),
                     [&](std::int8_t x) { return (x == 0 && evict) || x == 2 || x == 4 || x == 8 || x == 16; });
}

}  // namespace

TEST_CASE("exact_bits equals the greedy restated with a full sort") {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 400; ++trial) {
    std::size_t const n = trial < 300 ? 1 + rng() % 60 : 500 + rng() % 3000;  // long ones run the quickselect
    Weights const w = random_weights(rng, n);
    EpsilonTable const& t = tables[rng() % 5];
    bool const evict = rng() % 4 != 0;
    std::int64_t const floor = evict ? 0 : 2 * static_cast<std::int64_t>(n);
    std::int64_t const budget = floor + static_cast<std::int64_t>(rng() % (16 * n + 8));
    INFO("trial " << trial << " n " << n << " budget " << budget << " evict " << evict);
    CHECK(exact(w, t, evict, budget) == greedy_reference(w, t, evict, budget));
  }
}

TEST_CASE("exact_bits on many equal weights (every gain tied) equals the reference") {
  for (std::size_t n : {std::size_t{1000}, std::size_t{4099}}) {
    Weights const w(n, 0.5f);
    for (std::int64_t budget : {std::int64_t{0}, std::int64_t{1}, std::int64_t{2001}, static_cast<std::int64_t>(5 * n),
                                static_cast<std::int64_t>(9 * n + 3)})
      CHECK(exact(w, llama_v, true, budget) == greedy_reference(w, llama_v, true, budget));
  }
}

TEST_CASE("P1 budget feasibility: exact_bits never exceeds the budget") {
  std::mt19937 rng(11);
  for (int trial = 0; trial < 300; ++trial) {
    std::size_t const n = 1 + rng() % 200;
    Weights const w = random_weights(rng, n);
    bool const evict = rng() % 3 != 0;
    std::int64_t const budget = (evict ? 0 : 2 * std::int64_t(n)) + static_cast<std::int64_t>(rng() % (17 * n));
    Bits const b = exact(w, tables[trial % 5], evict, budget);
    CHECK(total(b) <= budget);
  }
}

TEST_CASE("P1 Lagrangian mode converges within tol of the target and may exceed the budget") {
  std::mt19937 rng(12);
  bool exceeded = false;
  for (int trial = 0; trial < 60; ++trial) {
    Weights const w = random_weights(rng, 1000, false);
    double const target = 0.5 + 14.0 * double(rng() % 1000) / 1000.0;
    Bits const b = lagrangian(w, llama_v, true, target);
    double const avg = double(total(b)) / 1000.0;
    INFO("target " << target << " avg " << avg);
    CHECK(std::fabs(avg - target) / target < 0.01);
    exceeded = exceeded || avg > target;
  }
  CHECK(exceeded);  // documented: the authors' tolerance lets the average overshoot
}

TEST_CASE("P2 maximality: no single upgrade to the next hull option fits the slack and lowers the distortion") {
  std::mt19937 rng(13);
  for (int trial = 0; trial < 300; ++trial) {
    std::size_t const n = 1 + rng() % 100;
    Weights const w = random_weights(rng, n);
    EpsilonTable const& t = tables[trial % 5];
    bool const evict = trial % 4 != 0;
    std::int64_t const budget = (evict ? 0 : 2 * std::int64_t(n)) + static_cast<std::int64_t>(rng() % (17 * n));
    Bits const b = exact(w, t, evict, budget);
    std::int64_t const slack = budget - total(b);
    std::vector<int> const hull = hull_options(t, evict);
    for (std::size_t u = 0; u < n; ++u) {
      auto const pos = std::find_if(hull.begin(), hull.end(), [&](int o) { return kS[o] == b[u]; });
      REQUIRE(pos != hull.end());
      if (pos + 1 == hull.end())
        continue;
      int const up = kS[*(pos + 1)] - b[u];
      bool const lowers = double(w[u]) * t.eps[*(pos + 1)] < double(w[u]) * t.eps[*pos];
      INFO("unit " << u << " at " << int(b[u]) << " slack " << slack);
      CHECK_FALSE((up <= slack && lowers));
    }
  }
}

TEST_CASE("P3 domain: bits in S, at least 2 without eviction") {
  std::mt19937 rng(14);
  for (int trial = 0; trial < 100; ++trial) {
    std::size_t const n = 1 + rng() % 50;
    Weights const w = random_weights(rng, n);
    bool const evict = trial % 2 == 0;
    std::int64_t const budget = 2 * std::int64_t(n) + static_cast<std::int64_t>(rng() % (15 * n));
    CHECK(in_options(exact(w, llama_v, evict, budget), evict));
    CHECK(in_options(lagrangian(w, llama_v, evict, double(budget) / double(n)), evict));
    if (n <= 20)
      CHECK(in_options(dp(w, llama_v, evict, budget), evict));
    CHECK(in_options(at_lambda(w, llama_v, evict, 1e-3), evict));
  }
  // Without eviction a weight-0 unit sits at the floor, 2 bits.
  CHECK(lagrangian({0.0f, 1.0f}, llama_v, false, 16.0) == Bits{2, 16});
  CHECK(exact({0.0f, 1.0f}, llama_v, false, 32) == Bits{2, 16});
}

TEST_CASE("P3 a budget below the floor without eviction is invalid_argument naming the budget") {
  Weights const w = {1, 2, 3};
  Bits b(3);
  Scratch s(3);
  kvc::Status const st =
      kvc::exact_bits(w.data(), 3, llama_v, BitOptions{false}, 5, b.data(), s.bytes.data(), s.bytes.size());
  CHECK(st.code() == kvc::Errc::invalid_argument);
  CHECK(std::string(st.message()).find("budget_bits") != std::string::npos);
  CHECK(kvc::tools::dp_bits(w.data(), 3, llama_v, BitOptions{false}, 5, b.data()).code() ==
        kvc::Errc::invalid_argument);
  // 6 = 2 * 3 is enough: all at 2 bits.
  CHECK(exact(w, llama_v, false, 6) == Bits{2, 2, 2});
  // The Lagrangian never fails on the floor: a target below 2 gives everything 2 (it may exceed the budget).
  CHECK(lagrangian(w, llama_v, false, 1.0) == Bits{2, 2, 2});
}

TEST_CASE("P4 monotone in weight: a heavier unit never gets fewer bits (Lagrangian)") {
  std::mt19937 rng(15);
  for (int trial = 0; trial < 100; ++trial) {
    std::size_t const n = 2 + rng() % 300;
    Weights const w = random_weights(rng, n);
    Bits const b = trial % 2
                       ? lagrangian(w, tables[trial % 5], true, 0.3 + double(rng() % 150) / 10.0)
                       : at_lambda(w, tables[trial % 5], trial % 3 != 0, std::pow(10.0, -double(rng() % 70) / 10.0));
    for (std::size_t u = 0; u < n; ++u)
      for (std::size_t v = 0; v < n; ++v)
        if (w[u] > w[v])
          CHECK(b[u] >= b[v]);
  }
}

TEST_CASE("P5 monotone in budget: a bigger budget never lowers a unit's bits (Lagrangian)") {
  std::mt19937 rng(16);
  for (int trial = 0; trial < 40; ++trial) {
    Weights const w = random_weights(rng, 400);
    Bits prev(400, 0);
    for (double lambda = 1.0; lambda > 1e-9; lambda /= 1.7) {  // smaller λ = bigger budget
      Bits const b = at_lambda(w, tables[trial % 5], true, lambda);
      for (std::size_t u = 0; u < b.size(); ++u)
        CHECK(b[u] >= prev[u]);
      prev = b;
    }
    prev.assign(400, 0);
    for (double target : {0.5, 1.0, 2.0, 3.0, 4.5, 6.0, 8.0, 11.0, 15.0}) {  // converged targets > 2 tol apart
      Bits const b = lagrangian(w, llama_v, true, target);
      for (std::size_t u = 0; u < b.size(); ++u)
        CHECK(b[u] >= prev[u]);
      prev = b;
    }
  }
}

TEST_CASE("P5 distortion is non-increasing in the budget in every mode") {
  std::mt19937 rng(17);
  for (int trial = 0; trial < 40; ++trial) {
    std::size_t const n = 1 + rng() % 12;
    Weights const w = random_weights(rng, n);
    EpsilonTable const& t = tables[trial % 5];
    double prev_exact = std::numeric_limits<double>::infinity(), prev_dp = prev_exact, prev_lb = prev_exact;
    for (std::int64_t budget = 0; budget <= 16 * std::int64_t(n); ++budget) {
      double const de = dist(w, t, exact(w, t, true, budget)), dd = dist(w, t, dp(w, t, true, budget));
      double const lb = kvc::hull_lower_bound(w.data(), size(w), t, {}, double(budget));
      INFO("budget " << budget);
      CHECK(de <= prev_exact * (1 + 1e-12));
      CHECK(dd <= prev_dp * (1 + 1e-12));
      CHECK(lb <= prev_lb * (1 + 1e-12) + 1e-300);
      prev_exact = de;
      prev_dp = dd;
      prev_lb = lb;
    }
  }
}

TEST_CASE("P6 scale and permutation invariance") {
  std::mt19937 rng(18);
  for (int trial = 0; trial < 60; ++trial) {
    std::size_t const n = 2 + rng() % 200;
    Weights w(n);
    std::uniform_real_distribution<float> d(0.001f, 1.0f);
    for (float& x : w)
      x = d(rng);  // distinct in practice: no ties for the permutation
    std::int64_t const budget = static_cast<std::int64_t>(rng() % (16 * n));
    double const target = double(budget) / double(n) + 0.1;
    Bits const e = exact(w, llama_v, true, budget), l = lagrangian(w, llama_v, true, target);
    for (float alpha : {0.25f, 8.0f, 1024.0f}) {  // powers of two: every product scales exactly
      Weights s = w;
      for (float& x : s)
        x *= alpha;
      CHECK(exact(s, llama_v, true, budget) == e);
      CHECK(lagrangian(s, llama_v, true, target) == l);
    }
    std::vector<std::size_t> perm(n);
    std::iota(perm.begin(), perm.end(), std::size_t{0});
    std::shuffle(perm.begin(), perm.end(), rng);
    Weights p(n);
    for (std::size_t i = 0; i < n; ++i)
      p[i] = w[perm[i]];
    Bits const pe = exact(p, llama_v, true, budget), pl = lagrangian(p, llama_v, true, target);
    for (std::size_t i = 0; i < n; ++i) {
      CHECK(pe[i] == e[perm[i]]);
      CHECK(pl[i] == l[perm[i]]);
    }
  }
}

TEST_CASE("P7 endpoints: budget 0 evicts everything, 16 bits per unit keeps every weighted unit lossless") {
  Weights const w = {0.5f, 0.0f, 3.0f, 1e-5f, 0.0f, 2.0f};
  Bits const zero(6, 0), full = {16, 0, 16, 16, 0, 16};  // A14: weight 0 -> 0 bits even with budget to spare
  CHECK(exact(w, llama_v, true, 0) == zero);
  CHECK(dp(w, llama_v, true, 0) == zero);
  CHECK(lagrangian(w, llama_v, true, 0.0) == zero);
  CHECK(exact(w, llama_v, true, 1) == zero);  // 1 bit fits no option
  CHECK(exact(w, llama_v, true, 96) == full);
  CHECK(exact(w, llama_v, true, 1000) == full);
  CHECK(dp(w, llama_v, true, 96) == full);
  double lambda = -1;
  CHECK(lagrangian(w, llama_v, true, 16.0, &lambda) == full);
  CHECK(lambda == 0.0);                               // the authors' λ = 0 early return
  CHECK(lagrangian(w, llama_v, true, 11.0) == full);  // 4 * 16 / 6 = 10.67 <= 11: λ = 0 meets the target
  CHECK(at_lambda(w, llama_v, true, 0.0) == full);
  CHECK(exact({}, llama_v, true, 5).empty());
  CHECK(lagrangian({}, llama_v, true, 5.0).empty());
}

TEST_CASE("P8 Everett optimality: b(lambda) is optimal for the bits it spends (brute force over 5^n)") {
  std::mt19937 rng(19);
  int checked = 0;
  for (int trial = 0; trial < 300; ++trial) {
    std::size_t const n = 1 + rng() % 6;
    Weights const w = random_weights(rng, n);
    EpsilonTable const& t = tables[trial % 5];
    double const lambda = std::pow(10.0, -7.0 * double(rng() % 1000) / 1000.0);
    Bits const b = at_lambda(w, t, true, lambda);
    CHECK(b == argmin_bits(w, t, true, lambda));  // the direct argmin restated
    double const best = brute_force(w, t, {0, 1, 2, 3, 4}, total(b));
    CHECK(dist(w, t, b) <= best * (1 + 1e-12) + 1e-300);
    ++checked;
  }
  CHECK(checked == 300);
}

TEST_CASE("P9 the DP equals brute force over the hull options") {
  std::mt19937 rng(20);
  for (int trial = 0; trial < 300; ++trial) {
    std::size_t const n = 1 + rng() % 6;
    Weights const w = random_weights(rng, n);
    EpsilonTable const& t = tables[trial % 5];
    bool const evict = trial % 5 != 0;
    std::int64_t const budget = (evict ? 0 : 2 * std::int64_t(n)) + static_cast<std::int64_t>(rng() % (16 * n + 4));
    Bits const b = dp(w, t, evict, budget);
    double const best = brute_force(w, t, hull_options(t, evict), budget);
    INFO("trial " << trial << " budget " << budget);
    CHECK(total(b) <= budget);
    CHECK(std::fabs(dist(w, t, b) - best) <= 1e-12 * std::max(1.0, best));
    CHECK(dist(w, t, exact(w, t, evict, budget)) >= best * (1 - 1e-12));  // the greedy is never better
  }
}

TEST_CASE("P9 lower bound <= DP <= best Lagrangian point under the budget") {
  std::mt19937 rng(21);
  for (int trial = 0; trial < 200; ++trial) {
    std::size_t const n = 1 + rng() % 8;
    Weights const w = random_weights(rng, n);
    EpsilonTable const& t = tables[trial % 5];
    std::int64_t const budget = static_cast<std::int64_t>(rng() % (16 * n + 4));
    // The best Everett point within the budget: the smallest λ among the breakpoints w_u (slope) and 0 whose b(λ)
    // fits (b(λ) only changes at breakpoints).
    std::vector<int> const hull = hull_options(t, true);
    std::vector<double> lambdas = {0.0};
    for (float x : w)
      for (std::size_t k = 0; k + 1 < hull.size(); ++k)
        lambdas.push_back(double(x) * (t.eps[hull[k]] - t.eps[hull[k + 1]]) / double(kS[hull[k + 1]] - kS[hull[k]]));
    double everett = std::numeric_limits<double>::infinity();
    for (double l : lambdas) {
      Bits const b = at_lambda(w, t, true, l);
      if (total(b) <= budget)
        everett = std::min(everett, dist(w, t, b));
    }
    double const d = dist(w, t, dp(w, t, true, budget));
    double const lb = kvc::hull_lower_bound(w.data(), size(w), t, {}, double(budget));
    CHECK(lb <= d * (1 + 1e-12) + 1e-300);
    CHECK(d <= everett * (1 + 1e-12) + 1e-300);
  }
}

TEST_CASE("P9 strict case: the DP beats every Lagrangian point and the lower bound is below the DP") {
  // Llama V table, w = {1, 0.005}, budget 6 bits. Gain rates: unit 0: 0.343565 (0->2), 0.149442 (2->4), 0.0034839
  // (4->8, cost 4), 6.07e-6 (8->16); unit 1: 0.0017178 (0->2), 0.000747 (2->4). Everett points within 6 bits: the
  // best is unit 0 at 4 bits, unit 1 at 0 (the next, unit 0 at 8, costs 8): ΔD = 0.013986 + 0.005 = 0.018986.
  // DP: unit 0 at 4, unit 1 at 2: ΔD = 0.013986 + 0.005 * 0.31287 = 0.01555035.
  // Lower bound: 4 bits as above, then 2 more bits at rate 0.0034839 of the 4->8 edge:
  // 0.013986 + 0.005 - (... unit 1 untouched) -> 0.018986 - 2 * 0.00348436 = 0.01201728.
  Weights const w = {1.0f, 0.005f};
  Bits const d = dp(w, llama_v, true, 6);
  CHECK(d == Bits{4, 2});
  CHECK(exact(w, llama_v, true, 6) == Bits{4, 2});  // the fill step finds it too
  double const rate = (0.013986 - 4.8554e-5) / 4;
  double const everett = 0.013986 + double(0.005f);
  double const lb = kvc::hull_lower_bound(w.data(), 2, llama_v, {}, 6.0);
  CHECK(std::fabs(dist(w, llama_v, d) - (0.013986 + double(0.005f) * 0.31287)) < 1e-12);
  CHECK(std::fabs(lb - (everett - 2 * rate)) < 1e-12);
  CHECK(lb < dist(w, llama_v, d));
  CHECK(dist(w, llama_v, d) < everett);
  // The Lagrangian solver with the exact target 3 bits/unit: it cannot reach 6 bits with one λ.
  Bits const l = lagrangian(w, llama_v, true, 3.0);
  CHECK(total(l) != 6);
}

TEST_CASE("P10 water-filling KKT closed forms on 2 and 3 Gaussian units") {
  std::vector<double> bits(3);
  SECTION("equal costs, w sigma^2 = 16, 4, 1, R = 3: theta = 1, b = 2, 1, 0") {
    // Interior units: ½ (log2 16 + log2 4 + log2 1 − 3 log2 θ) = 3 -> log2 θ = 0; D_u = min(θ, x_u) = 1 each.
    std::vector<double> const x = {16, 4, 1}, c = {1, 1, 1};
    double const theta = kvc::water_filling(x.data(), c.data(), 3, 3.0, 16.0, bits.data());
    CHECK(std::fabs(theta - 1.0) < 1e-12);
    CHECK(std::fabs(bits[0] - 2.0) < 1e-12);
    CHECK(std::fabs(bits[1] - 1.0) < 1e-12);
    CHECK(std::fabs(bits[2]) < 1e-12);
  }
  SECTION("R = 1: only the largest unit is above the water, theta = 4") {
    // ½ (log2 16 − log2 θ) = 1 -> θ = 4; unit 2 has x = 4 <= θ: 0 bits.
    std::vector<double> const x = {16, 4, 1}, c = {1, 1, 1};
    double const theta = kvc::water_filling(x.data(), c.data(), 3, 1.0, 16.0, bits.data());
    CHECK(std::fabs(theta - 4.0) < 1e-12);
    CHECK(std::fabs(bits[0] - 1.0) < 1e-12);
    CHECK(bits[1] == 0.0);
    CHECK(bits[2] == 0.0);
  }
  SECTION("unequal costs c = 1, 2, w sigma^2 = 8, 8, R = 4: log2 theta = -1/3, b = 5/3, 7/6") {
    // x = w σ² / c = 8, 4: ½ (3 − L) + 2 · ½ (2 − L) = 3.5 − 1.5 L = 4 -> L = −1/3.
    std::vector<double> const x = {8, 8}, c = {1, 2};
    double const theta = kvc::water_filling(x.data(), c.data(), 2, 4.0, 16.0, bits.data());
    CHECK(std::fabs(theta - std::exp2(-1.0 / 3)) < 1e-12);
    CHECK(std::fabs(bits[0] - 5.0 / 3) < 1e-12);
    CHECK(std::fabs(bits[1] - 7.0 / 6) < 1e-12);
    // KKT: log2(w σ² / c) − 2 b is the same for interior units (= log2 θ).
    CHECK(std::fabs((std::log2(8.0) - 2 * bits[0]) - (std::log2(4.0) - 2 * bits[1])) < 1e-12);
  }
  SECTION("b_max clips: x = 16, 4, b_max = 1, R = 1.5: theta = 2, b = 1, 0.5") {
    std::vector<double> const x = {16, 4}, c = {1, 1};
    double const theta = kvc::water_filling(x.data(), c.data(), 2, 1.5, 1.0, bits.data());
    CHECK(std::fabs(theta - 2.0) < 1e-12);
    CHECK(bits[0] == 1.0);
    CHECK(std::fabs(bits[1] - 0.5) < 1e-12);
  }
  SECTION("endpoints and a zero unit") {
    std::vector<double> const x = {16, 0, 4}, c = {1, 1, 1};
    CHECK(kvc::water_filling(x.data(), c.data(), 3, 0.0, 8.0, bits.data()) == 16.0);  // θ = max x
    CHECK(bits == std::vector<double>{0, 0, 0});
    double const theta = kvc::water_filling(x.data(), c.data(), 3, 100.0, 8.0, bits.data());
    CHECK(bits == std::vector<double>{8, 0, 8});
    CHECK(std::fabs(theta - 4.0 / 65536) < 1e-18);  // min x / 4^b_max
    std::vector<double> const bad = {1, -1, 1};
    CHECK(std::isnan(kvc::water_filling(bad.data(), c.data(), 3, 1.0, 8.0, bits.data())));
  }
  SECTION("random instances meet the budget and the KKT conditions") {
    std::mt19937 rng(22);
    std::uniform_real_distribution<double> d(0.01, 100.0);
    for (int trial = 0; trial < 50; ++trial) {
      std::vector<double> x(12), c(12), b(12);
      for (std::size_t u = 0; u < 12; ++u) {
        x[u] = d(rng);
        c[u] = 1 + double(rng() % 4);
      }
      double const budget = d(rng) / 2;
      double const theta = kvc::water_filling(x.data(), c.data(), 12, budget, 6.0, b.data());
      double sum = 0;
      for (std::size_t u = 0; u < 12; ++u) {
        sum += c[u] * b[u];
        double const ratio = x[u] / c[u];
        if (b[u] == 0.0)
          CHECK(ratio <= theta * (1 + 1e-9));
        else if (b[u] < 6.0)
          CHECK(std::fabs(std::log2(ratio) - 2 * b[u] - std::log2(theta)) < 1e-9);
        else
          CHECK(ratio >= theta * std::exp2(12.0) * (1 - 1e-9));
      }
      CHECK(std::fabs(sum - budget) < 1e-9 * std::max(1.0, budget));
    }
  }
}

TEST_CASE("P11 an option above the hull is never chosen (non-convex table)") {
  // nonconvex = {1, 0.9, 0.01, 1e-4, 0}: 2 bits lies above the chord 0 -> 4.
  std::mt19937 rng(23);
  for (int trial = 0; trial < 150; ++trial) {
    std::size_t const n = 1 + rng() % 40;
    Weights const w = random_weights(rng, n);
    std::int64_t const budget = static_cast<std::int64_t>(rng() % (16 * n + 1));
    auto no_two = [](Bits const& b) { return std::count(b.begin(), b.end(), std::int8_t{2}) == 0; };
    CHECK(no_two(exact(w, nonconvex, true, budget)));
    CHECK(no_two(lagrangian(w, nonconvex, true, double(budget) / double(n) + 0.01)));
    CHECK(no_two(at_lambda(w, nonconvex, true, std::pow(10.0, -6.0 * double(rng() % 100) / 100.0))));
    if (n <= 12)
      CHECK(no_two(dp(w, nonconvex, true, budget)));
  }
  // The direct argmin over all five options agrees: 2 bits never wins for any λ (it would need
  // 0.9 w + 2 λ < min(w + 0, 0.01 w + 4 λ), i.e. λ < 0.05 w and λ > 0.445 w).
  Weights const w = {1.0f};
  for (double l = 1e-6; l < 10; l *= 1.1) {
    double const c2 = 0.9 + 2 * l, c0 = 1.0, c4 = 0.01 + 4 * l;
    CHECK(c2 >= std::min(c0, c4));
  }
}

TEST_CASE("P12 determinism: the same input gives identical bits whatever the scratch held") {
  std::mt19937 rng(24);
  for (int trial = 0; trial < 20; ++trial) {
    Weights const w = random_weights(rng, 5000);
    std::int64_t const budget = static_cast<std::int64_t>(rng() % 80000);
    Bits const a = exact(w, llama_v, true, budget, std::byte{0});
    CHECK(exact(w, llama_v, true, budget, std::byte{0xff}) == a);
    CHECK(exact(w, llama_v, true, budget, std::byte{0x5a}) == a);
    CHECK(lagrangian(w, llama_v, true, 3.0) == lagrangian(w, llama_v, true, 3.0));
  }
}

TEST_CASE("distortion sums w eps(b) and rejects bit widths outside S") {
  Weights const w = {2.0f, 0.5f, 1.0f};
  Bits const b = {0, 4, 16};
  CHECK(kvc::distortion(w.data(), 3, llama_v, b.data()) == 2.0 + 0.5 * 0.013986);
  Bits const bad = {0, 3, 16};
  CHECK(std::isnan(kvc::distortion(w.data(), 3, llama_v, bad.data())));
}

TEST_CASE("hull lower bound on a hand case and at the endpoints") {
  // One unit of weight 1, budget 3 bits: 0 -> 2 (ΔD 1 -> 0.31287) then half of the 2 -> 4 edge:
  // 0.31287 - (0.31287 - 0.013986) / 2 = 0.163428.
  Weights const w = {1.0f};
  CHECK(std::fabs(kvc::hull_lower_bound(w.data(), 1, llama_v, {}, 3.0) - 0.163428) < 1e-12);
  CHECK(kvc::hull_lower_bound(w.data(), 1, llama_v, {}, 0.0) == 1.0);
  CHECK(kvc::hull_lower_bound(w.data(), 1, llama_v, {}, 16.0) == 0.0);
  CHECK(kvc::hull_lower_bound(w.data(), 1, llama_v, {false}, 1.0) == std::numeric_limits<double>::infinity());
  // Without eviction the floor is 2 bits: budget 3 -> the same half edge above 2 bits.
  CHECK(std::fabs(kvc::hull_lower_bound(w.data(), 1, llama_v, {false}, 3.0) - 0.163428) < 1e-12);
}

TEST_CASE("Lagrangian bisection on a hand case") {
  // Two units w = 1, 1 with the Llama V table and target 4 bits/unit: λ = 0 gives 16 > 4, λ_hi = 0.375 gives
  // 0 bits (0.375 > 0.343565, the 0 -> 2 rate) <= 4. Midpoints: 0.1875 -> both at 2 bits (0.149442 < 0.1875 <
  // 0.343565): avg 2, too low, hi = 0.1875; 0.09375 -> both at 4 (0.0034839 < 0.09375 < 0.149442): avg 4, exact.
  Weights const w = {1.0f, 1.0f};
  double lambda = 0;
  CHECK(lagrangian(w, llama_v, true, 4.0, &lambda) == Bits{4, 4});
  CHECK(lambda == 0.09375);
}

TEST_CASE("solver errors name their argument") {
  Weights w = {1.0f, std::numeric_limits<float>::quiet_NaN()};
  Bits b(2);
  Scratch s(2);
  kvc::Status st = kvc::exact_bits(w.data(), 2, llama_v, {}, 8, b.data(), s.bytes.data(), s.bytes.size());
  CHECK(st.code() == kvc::Errc::non_finite);
  CHECK(std::string(st.message()).find("`w`") != std::string::npos);
  CHECK(kvc::lagrangian_bits(w.data(), 2, llama_v, {}, 4.0, {}, b.data()).code() == kvc::Errc::non_finite);
  CHECK(kvc::tools::dp_bits(w.data(), 2, llama_v, {}, 8, b.data()).code() == kvc::Errc::non_finite);
  CHECK(std::isnan(kvc::hull_lower_bound(w.data(), 2, llama_v, {}, 8.0)));
  w[1] = -1.0f;
  CHECK(kvc::exact_bits(w.data(), 2, llama_v, {}, 8, b.data(), s.bytes.data(), s.bytes.size()).code() ==
        kvc::Errc::invalid_argument);
  w[1] = 1.0f;
  st = kvc::exact_bits(w.data(), 2, llama_v, {}, -1, b.data(), s.bytes.data(), s.bytes.size());
  CHECK(std::string(st.message()).find("budget_bits") != std::string::npos);
  st = kvc::exact_bits(w.data(), 2, llama_v, {}, 8, b.data(), s.bytes.data(), 16);
  CHECK(st.code() == kvc::Errc::out_of_capacity);
  CHECK(std::string(st.message()).find("scratch") != std::string::npos);
  st = kvc::lagrangian_bits(w.data(), 2, llama_v, {}, std::numeric_limits<double>::quiet_NaN(), {}, b.data());
  CHECK(std::string(st.message()).find("target_avg") != std::string::npos);
  st = kvc::lagrangian_bits(w.data(), 2, llama_v, {}, 4.0, kvc::LagrangianOptions{0.0, 64, 40}, b.data());
  CHECK(std::string(st.message()).find("tol") != std::string::npos);
  st = kvc::exact_bits(w.data(), 2, EpsilonTable{{1, 0.5, 0.6, 0.1, 0}}, {}, 8, b.data(), s.bytes.data(),
                       s.bytes.size());
  CHECK(std::string(st.message()).find("eps[2]") != std::string::npos);
  st = kvc::tools::dp_bits(w.data(), 2, llama_v, {}, 1000, b.data(), 10);
  CHECK(st.code() == kvc::Errc::invalid_argument);
  CHECK(std::string(st.message()).find("dp_cell_limit") != std::string::npos);
  CHECK(kvc::exact_bits_scratch_bytes(1000) >= 1000 * 4 * 16);
}
