// SPDX-License-Identifier: Apache-2.0
// tests/scorers/moments_test.cpp mirrors include/kvc/scorers/moments.hpp: MomentKV's evicted-set moments, their memory
// and the scalar algebra every backend shares (shared/specs/moment_kv.md §2.2–2.6, §8, §10).
// The library's templated algebra (merge_moments, merge_evicted, log_add_exp, clamp_small) runs in double here and
// is compared with brute-force double formulas written from the spec's definitions (sums over the raw tokens,
// two-pass centred co-moments from tests/support/moments.hpp, Z_E, f_E, ρ̄ by direct summation) at ~1e-12. The fp32
// kernels are tested against the same kind of references in tests/scorers/moment_kv_test.cpp and
// tests/attention/corrected_test.cpp.
#include "support/moments.hpp"

#include <kvc/core/element.hpp>
#include <kvc/scorers/moments.hpp>

#include "common/synthetic.hpp"
#include "support/catch.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace {

using kvc::Index;
using Vec = std::vector<double>;

using namespace kvc::test;  // support/moments.hpp: Moments, brute_moments, close, ...

HeadTokens random_tokens(Index n, Index dk, Index dv, std::uint64_t seed, double key_scale = 1.0,
                         double value_scale = 1.0, double key_offset = 0.0) {
  kvc::tools::Rng rng(seed);
  HeadTokens t{dk, dv, {}, {}};
  for (Index i = 0; i < n; ++i) {
    Vec k(static_cast<std::size_t>(dk)), v(static_cast<std::size_t>(dv));
    for (auto& x : k)
      x = key_offset + key_scale * rng.normal();
    for (auto& x : v)
      x = value_scale * rng.normal();
    t.k.push_back(k);
    t.v.push_back(v);
  }
  return t;
}

std::vector<double> random_vec(Index n, std::uint64_t seed, double scale = 1.0) {
  kvc::tools::Rng rng(seed);
  Vec out(static_cast<std::size_t>(n));
  for (auto& x : out)
    x = scale * rng.normal();
  return out;
}

/// Library: Welford's single add (merge_moments<double> with n_b = 1, C_b null).
void add(Moments& m, Vec const& k, Vec const& v) {
  Vec scratch(k.size());
  kvc::detail::merge_moments<double>(m.n, m.km.data(), m.vm.data(), m.C.data(), 1, k.data(), v.data(), nullptr, m.dk(),
                                     m.dv(), scratch.data());
  ++m.n;
}

/// Library: Chan's merge of b into a.
void merge(Moments& a, Moments const& b) {
  Vec scratch(a.km.size());
  kvc::detail::merge_moments<double>(a.n, a.km.data(), a.vm.data(), a.C.data(), b.n, b.km.data(), b.vm.data(),
                                     b.C.data(), a.dk(), a.dv(), scratch.data());
  a.n += b.n;
}

Moments welford(HeadTokens const& t, std::vector<Index> const& idx) {
  Moments m = Moments::zeros(t.dk, t.dv);
  for (Index i : idx)
    add(m, t.k[static_cast<std::size_t>(i)], t.v[static_cast<std::size_t>(i)]);
  return m;
}

std::vector<Index> iota(Index n, Index from = 0) {
  std::vector<Index> v(static_cast<std::size_t>(n));
  std::iota(v.begin(), v.end(), from);
  return v;
}

double max_abs(Vec const& x) {
  double m = 0.0;
  for (double v : x)
    m = std::max(m, std::abs(v));
  return m;
}

double dot(Vec const& a, Vec const& b) {
  double s = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i)
    s += a[i] * b[i];
  return s;
}

double norm(Vec const& a) {
  return std::sqrt(dot(a, a));
}

Vec sub(Vec const& a, Vec const& b) {
  Vec r(a);
  for (std::size_t i = 0; i < r.size(); ++i)
    r[i] -= b[i];
  return r;
}

/// Brute-force decomposition of attention for query q over retained R and evicted E (spec §2.1), plus the
/// evicted-set quantities of §2.5 and §8 (δ_i, ρ̄, Var(δ), σ) from the raw evicted tokens.
struct Split {
  double log_zr = 0, log_ze = 0, wr = 0, we = 0;
  Vec fr, fe, f;
  double rho = 0, var = 0, sigma = 0;  // ρ̄, Var(δ) = mean δ², σ = max |δ|
  double dev_max = 0;                  // max ‖v_i − v̄‖ over E
};

Split brute_split(HeadTokens const& t, std::vector<Index> const& R, std::vector<Index> const& E, Vec const& q,
                  double c) {
  Split s;
  double shift = -std::numeric_limits<double>::infinity();
  for (std::size_t i = 0; i < t.k.size(); ++i)
    shift = std::max(shift, c * dot(q, t.k[i]));
  auto part = [&](std::vector<Index> const& set, double& log_z, Vec& f) {
    double z = 0.0;
    f.assign(static_cast<std::size_t>(t.dv), 0.0);
    for (Index i : set) {
      double const w = std::exp(c * dot(q, t.k[static_cast<std::size_t>(i)]) - shift);
      z += w;
      for (Index a = 0; a < t.dv; ++a)
        f[static_cast<std::size_t>(a)] += w * t.v[static_cast<std::size_t>(i)][static_cast<std::size_t>(a)];
    }
    for (auto& x : f)
      x /= z;
    log_z = std::log(z) + shift;
  };
  part(R, s.log_zr, s.fr);
  part(E, s.log_ze, s.fe);
  s.wr = 1.0 / (1.0 + std::exp(s.log_ze - s.log_zr));
  s.we = 1.0 - s.wr;
  s.f.resize(static_cast<std::size_t>(t.dv));
  for (std::size_t a = 0; a < s.f.size(); ++a)
    s.f[a] = s.wr * s.fr[a] + s.we * s.fe[a];
  Moments const m = brute_moments(t, E);
  double const ne = static_cast<double>(E.size());
  for (Index i : E) {
    double const d = c * dot(q, sub(t.k[static_cast<std::size_t>(i)], m.km));
    s.rho += (std::exp(d) - 1.0 - d) / ne;
    s.var += d * d / ne;
    s.sigma = std::max(s.sigma, std::abs(d));
    s.dev_max = std::max(s.dev_max, norm(sub(t.v[static_cast<std::size_t>(i)], m.vm)));
  }
  return s;
}

/// The corrected output from the library's double algebra: f̂_E = v̄ + (c/n) C q (first order) or v̄ (zeroth), the
/// virtual token's log-weight log n + c qᵀk̄, merged with (f_R, log Z_R) by detail::merge_evicted<double>; ŵ_R by
/// the same merge of a one-channel state (out_r = 1, estimate = 0).
struct Corrected {
  Vec out, est;
  double lse = 0, lse_e = 0, wr_hat = 0;
};

Corrected corrected(Moments const& m, Vec const& fr, double log_zr, Vec const& q, double c,
                    kvc::MomentOrder order = kvc::MomentOrder::first) {
  Corrected r;
  r.est = m.vm;
  if (order == kvc::MomentOrder::first)
    for (Index a = 0; a < m.dv(); ++a)
      for (Index x = 0; x < m.dk(); ++x)
        r.est[static_cast<std::size_t>(a)] +=
            c / static_cast<double>(m.n) *
            kvc::detail::clamp_small(m.C[static_cast<std::size_t>(a * m.dk() + x)], 1e-300) *
            q[static_cast<std::size_t>(x)];
  r.lse_e = std::log(static_cast<double>(m.n)) + c * dot(q, m.km);
  r.out = fr;
  r.lse = kvc::detail::merge_evicted<double>(r.out.data(), log_zr, r.est.data(), r.lse_e, m.dv());
  double one = 1.0, zero = 0.0;
  kvc::detail::merge_evicted<double>(&one, log_zr, &zero, r.lse_e, 1);
  r.wr_hat = one;
  return r;
}

/// A random problem: N tokens, evicted = the first ne of a seeded permutation, retained = the rest.
struct Problem {
  HeadTokens t;
  std::vector<Index> R, E;
  Vec q;
  double c;
};

Problem make_problem(Index N, Index ne, Index dk, Index dv, std::uint64_t seed, double key_scale, double q_scale) {
  Problem p{random_tokens(N, dk, dv, seed, key_scale),
            {},
            {},
            random_vec(dk, seed + 100, q_scale),
            1.0 / std::sqrt(static_cast<double>(dk))};
  std::vector<Index> perm = iota(N);
  kvc::tools::Rng rng(seed + 7);
  kvc::test::shuffle(perm, rng);
  p.E.assign(perm.begin(), perm.begin() + ne);
  p.R.assign(perm.begin() + ne, perm.end());
  std::sort(p.E.begin(), p.E.end());
  std::sort(p.R.begin(), p.R.end());
  return p;
}

}  // namespace

// ---------------------------------------------------------------------------------------------------------------
// Statistics (properties 1–5)

TEST_CASE("moment_kv P1: after k evictions the count is k and the evicted sums plus the retained sums are the totals") {
  HeadTokens const t = random_tokens(23, 5, 3, 11);
  std::vector<Index> const E{0, 3, 4, 9, 10, 17, 22};
  Moments m = Moments::zeros(5, 3);
  Index k = 0;
  for (Index i : E) {
    add(m, t.k[static_cast<std::size_t>(i)], t.v[static_cast<std::size_t>(i)]);
    CHECK(m.n == ++k);
  }
  Index const retained = 23 - static_cast<Index>(E.size());
  CHECK(m.n + retained == 23);
  Vec sk_all(5, 0.0), sv_all(3, 0.0), sk(5, 0.0), sv(3, 0.0);
  for (Index i = 0; i < 23; ++i) {
    bool const evicted = std::find(E.begin(), E.end(), i) != E.end();
    for (std::size_t c = 0; c < 5; ++c) {
      sk_all[c] += t.k[static_cast<std::size_t>(i)][c];
      if (!evicted)
        sk[c] += t.k[static_cast<std::size_t>(i)][c];
    }
    for (std::size_t a = 0; a < 3; ++a) {
      sv_all[a] += t.v[static_cast<std::size_t>(i)][a];
      if (!evicted)
        sv[a] += t.v[static_cast<std::size_t>(i)][a];
    }
  }
  for (std::size_t c = 0; c < 5; ++c)  // s_k = n k̄
    sk[c] += static_cast<double>(m.n) * m.km[c];
  for (std::size_t a = 0; a < 3; ++a)
    sv[a] += static_cast<double>(m.n) * m.vm[a];
  CHECK(close(sk, sk_all, 1e-12));
  CHECK(close(sv, sv_all, 1e-12));
}

TEST_CASE("moment_kv P2: raw-sum co-moment S - s_v s_k^T / n equals Welford's C equals the centred brute force") {
  for (std::uint64_t seed : {1u, 2u, 3u}) {
    // Offsets make the raw form cancel (as real keys with outlier channels do); it still agrees in double.
    HeadTokens const t = random_tokens(40, 6, 4, seed, 1.5, 1.0, 3.0);
    std::vector<Index> const E = iota(40);
    Moments const w = welford(t, E), b = brute_moments(t, E);
    Vec sk(6, 0.0), sv(4, 0.0), S(24, 0.0);
    for (Index i : E)
      for (std::size_t a = 0; a < 4; ++a) {
        sv[a] += t.v[static_cast<std::size_t>(i)][a];
        for (std::size_t c = 0; c < 6; ++c) {
          S[a * 6 + c] += t.v[static_cast<std::size_t>(i)][a] * t.k[static_cast<std::size_t>(i)][c];
          if (a == 0)
            sk[c] += t.k[static_cast<std::size_t>(i)][c];
        }
      }
    Vec raw(24);
    for (std::size_t a = 0; a < 4; ++a)
      for (std::size_t c = 0; c < 6; ++c)
        raw[a * 6 + c] = S[a * 6 + c] - sv[a] * sk[c] / 40.0;
    CHECK(w.n == 40);
    CHECK(close(w.C, b.C, 1e-12));
    CHECK(close(raw, w.C, 1e-11));
    // Conversion (spec §2.3): s_k = n k̄, s_v = n v̄, S = C + n v̄ k̄ᵀ.
    Vec S_back(24);
    for (std::size_t a = 0; a < 4; ++a)
      for (std::size_t c = 0; c < 6; ++c)
        S_back[a * 6 + c] = w.C[a * 6 + c] + 40.0 * w.vm[a] * w.km[c];
    CHECK(close(S_back, S, 1e-12));
    for (std::size_t c = 0; c < 6; ++c)
      CHECK(std::abs(40.0 * w.km[c] - sk[c]) <= 1e-12 * std::max(1.0, std::abs(sk[c])));
  }
}

TEST_CASE("moment_kv P3: any permutation of the eviction order gives the same moments") {
  HeadTokens const t = random_tokens(30, 4, 5, 21);
  std::vector<Index> order = iota(30);
  Moments const ref = welford(t, order);
  CHECK(close(ref, brute_moments(t, order), 1e-12));
  kvc::tools::Rng rng(5);
  for (int trial = 0; trial < 8; ++trial) {
    kvc::test::shuffle(order, rng);
    CHECK(close(welford(t, order), ref, 1e-12));
  }
  std::reverse(order.begin(), order.end());
  CHECK(close(welford(t, order), ref, 1e-12));
}

TEST_CASE(
    "moment_kv P4: Chan's merge equals sequential adds, is associative and commutative, and a block add "
    "equals m single adds") {
  HeadTokens const t = random_tokens(36, 5, 3, 31, 2.0);
  std::vector<Index> const A = iota(10), B = iota(15, 10), Cs = iota(11, 25);
  Moments const a = welford(t, A), b = welford(t, B), c = welford(t, Cs);
  std::vector<Index> ab(A);
  ab.insert(ab.end(), B.begin(), B.end());
  Moments const seq_ab = welford(t, ab);

  Moments m_ab = a;
  merge(m_ab, b);
  CHECK(close(m_ab, seq_ab, 1e-12));
  Moments m_ba = b;  // commutative
  merge(m_ba, a);
  CHECK(close(m_ba, seq_ab, 1e-12));
  Moments left = m_ab;  // (A ⊕ B) ⊕ C
  merge(left, c);
  Moments bc = b;  // A ⊕ (B ⊕ C)
  merge(bc, c);
  Moments right = a;
  merge(right, bc);
  CHECK(close(left, right, 1e-12));
  CHECK(close(left, brute_moments(t, iota(36)), 1e-12));

  // A block of m tokens as one merge of its (brute-force) block moments: the GEMM form.
  Moments block_into_a = a;
  merge(block_into_a, brute_moments(t, B));
  CHECK(close(block_into_a, seq_ab, 1e-12));
  // Into an empty state the merge is exact: the block's own moments.
  Moments empty = Moments::zeros(5, 3);
  Moments const bb = brute_moments(t, B);
  merge(empty, bb);
  CHECK(empty.n == bb.n);
  CHECK(empty.km == bb.km);
  CHECK(empty.vm == bb.vm);
  CHECK(empty.C == bb.C);
  // n_b = 0 changes nothing.
  Moments unchanged = a;
  merge(unchanged, Moments::zeros(5, 3));
  CHECK(unchanged.km == a.km);
  CHECK(unchanged.C == a.C);
}

TEST_CASE("moment_kv P5: the co-moment is invariant to translating all evicted keys or all evicted values") {
  HeadTokens t = random_tokens(25, 4, 4, 41);
  Moments const ref = welford(t, iota(25));
  Vec const dk_shift = {3.0, -7.5, 0.25, 11.0}, dv_shift = {-2.0, 5.0, 0.5, -9.0};
  HeadTokens shifted_k = t, shifted_v = t;
  for (auto& k : shifted_k.k)
    for (std::size_t c = 0; c < 4; ++c)
      k[c] += dk_shift[c];
  for (auto& v : shifted_v.v)
    for (std::size_t a = 0; a < 4; ++a)
      v[a] += dv_shift[a];
  Moments const mk = welford(shifted_k, iota(25)), mv = welford(shifted_v, iota(25));
  CHECK(close(mk.C, ref.C, 1e-12));
  CHECK(close(mv.C, ref.C, 1e-12));
  for (std::size_t c = 0; c < 4; ++c)
    CHECK(std::abs(mk.km[c] - (ref.km[c] + dk_shift[c])) <= 1e-12 * 20);
  for (std::size_t a = 0; a < 4; ++a)
    CHECK(std::abs(mv.vm[a] - (ref.vm[a] + dv_shift[a])) <= 1e-12 * 20);
}

// ---------------------------------------------------------------------------------------------------------------
// Correction (properties 6–20), on the library's double algebra

TEST_CASE("moment_kv P6 (algebra): an empty virtual token (log-weight -inf) leaves the retained state unchanged") {
  Vec out{0.5, -1.25, 3.0};
  Vec const est{7.0, 1.0, 2.0};
  double const lse = kvc::detail::merge_evicted<double>(out.data(), 0.75, est.data(), -INFINITY, 3);
  CHECK(out == Vec{0.5, -1.25, 3.0});
  CHECK(lse == 0.75);
}

TEST_CASE("moment_kv P7 (algebra): one evicted token makes the corrected output the full attention, for any q") {
  for (std::uint64_t seed = 1; seed <= 20; ++seed) {
    Problem const p = make_problem(12, 1, 6, 5, seed, 1.5, 2.0);
    Split const s = brute_split(p.t, p.R, p.E, p.q, p.c);
    Corrected const r = corrected(welford(p.t, p.E), s.fr, s.log_zr, p.q, p.c);
    CHECK(close(r.out, s.f, 1e-12));
    CHECK(std::abs(r.lse - std::log(std::exp(s.log_zr) + std::exp(s.log_ze))) <= 1e-12 * (1 + std::abs(r.lse)));
  }
}

TEST_CASE("moment_kv P8 (algebra): identical evicted keys, q = 0 and q orthogonal to the key deviations are exact") {
  for (std::uint64_t seed = 1; seed <= 10; ++seed) {
    Problem p = make_problem(14, 6, 4, 3, seed, 1.0, 2.0);
    for (Index i : p.E)  // identical evicted keys, any values
      p.t.k[static_cast<std::size_t>(i)] = p.t.k[static_cast<std::size_t>(p.E[0])];
    Split s = brute_split(p.t, p.R, p.E, p.q, p.c);
    CHECK(close(corrected(welford(p.t, p.E), s.fr, s.log_zr, p.q, p.c).out, s.f, 1e-12));

    Problem z = make_problem(14, 6, 4, 3, seed, 1.0, 2.0);  // q = 0
    z.q.assign(4, 0.0);
    s = brute_split(z.t, z.R, z.E, z.q, z.c);
    CHECK(close(corrected(welford(z.t, z.E), s.fr, s.log_zr, z.q, z.c).out, s.f, 1e-12));

    Problem o = make_problem(14, 6, 4, 3, seed, 1.0, 2.0);  // key deviations in span{e0, e1}, q in span{e2, e3}
    for (Index i : o.E) {
      auto& k = o.t.k[static_cast<std::size_t>(i)];
      k[2] = 0.7;
      k[3] = -1.1;
    }
    o.q[0] = o.q[1] = 0.0;
    s = brute_split(o.t, o.R, o.E, o.q, o.c);
    CHECK(s.sigma <= 1e-14);
    CHECK(close(corrected(welford(o.t, o.E), s.fr, s.log_zr, o.q, o.c).out, s.f, 1e-12));
  }
}

TEST_CASE(
    "moment_kv P9 (algebra): identical evicted values give f_E-hat = v and C = 0, and w_R-hat >= w_R with "
    "equality iff sigma = 0") {
  for (std::uint64_t seed = 1; seed <= 10; ++seed) {
    Problem p = make_problem(16, 7, 5, 4, seed, 1.5, 2.0);
    Vec const v{1.0, -2.0, 0.5, 4.0};
    for (Index i : p.E)
      p.t.v[static_cast<std::size_t>(i)] = v;
    Moments const m = welford(p.t, p.E);
    CHECK(max_abs(m.C) <= 1e-14);
    Split const s = brute_split(p.t, p.R, p.E, p.q, p.c);
    Corrected const r = corrected(m, s.fr, s.log_zr, p.q, p.c);
    CHECK(close(r.est, v, 1e-14));
    CHECK(close(s.fe, v, 1e-14));  // f_E = v exactly, so only the weight is off
    REQUIRE(s.sigma > 0.1);
    CHECK(r.wr_hat > s.wr + 1e-6);  // strictly, since σ > 0
    // σ = 0 (identical evicted keys too): equality.
    for (Index i : p.E)
      p.t.k[static_cast<std::size_t>(i)] = p.t.k[static_cast<std::size_t>(p.E[0])];
    Split const s0 = brute_split(p.t, p.R, p.E, p.q, p.c);
    Corrected const r0 = corrected(welford(p.t, p.E), s0.fr, s0.log_zr, p.q, p.c);
    CHECK(std::abs(r0.wr_hat - s0.wr) <= 1e-14);
  }
}

TEST_CASE(
    "moment_kv P10 (algebra): Jensen's bound, Z_E / Z_E-hat = 1 + rho-bar, the two-sided bound and "
    "Var(delta) = c^2 q^T Sigma_k q") {
  int cases = 0;
  for (std::uint64_t seed = 1; seed <= 60; ++seed) {
    double const spread = 0.2 + 0.05 * static_cast<double>(seed % 20);  // narrow to wide key spreads
    Problem const p = make_problem(20, 2 + static_cast<Index>(seed % 12), 6, 3, seed, spread, 2.5);
    Moments const m = welford(p.t, p.E);
    Split const s = brute_split(p.t, p.R, p.E, p.q, p.c);
    double const log_zhat = std::log(static_cast<double>(m.n)) + p.c * dot(p.q, m.km);  // the library's lse_E
    Corrected const r = corrected(m, s.fr, s.log_zr, p.q, p.c);
    CHECK(std::abs(r.lse_e - log_zhat) <= 1e-12);
    CHECK(log_zhat <= s.log_ze + 1e-12);
    CHECK(std::abs(std::exp(s.log_ze - log_zhat) - (1.0 + s.rho)) <= 1e-12 * (1.0 + s.rho));
    CHECK(0.5 * s.var * std::exp(-s.sigma) <= s.rho * (1 + 1e-12) + 1e-300);
    CHECK(s.rho <= 0.5 * s.var * std::exp(s.sigma) * (1 + 1e-12) + 1e-300);
    // Σ_k from the library: the co-moment of the keys with themselves (values := keys) over n.
    HeadTokens kk = p.t;
    kk.dv = kk.dk;
    kk.v = kk.k;
    Moments const mk = welford(kk, p.E);
    double quad = 0.0;
    for (Index a = 0; a < 6; ++a)
      for (Index x = 0; x < 6; ++x)
        quad += p.q[static_cast<std::size_t>(a)] * mk.C[static_cast<std::size_t>(a * 6 + x)] *
                p.q[static_cast<std::size_t>(x)];
    CHECK(std::abs(p.c * p.c * quad / static_cast<double>(m.n) - s.var) <= 1e-12 * std::max(1.0, s.var));
    ++cases;
  }
  CHECK(cases == 60);
}

TEST_CASE(
    "moment_kv P11 (algebra): w_R-hat - w_R = w_R w_E-hat rho-bar = w_R-hat w_E-hat rho-bar / (1 + "
    "rho-bar w_E-hat) >= 0") {
  for (std::uint64_t seed = 1; seed <= 50; ++seed) {
    Problem const p =
        make_problem(18, 3 + static_cast<Index>(seed % 10), 5, 3, seed, 0.3 + 0.04 * static_cast<double>(seed), 2.0);
    Split const s = brute_split(p.t, p.R, p.E, p.q, p.c);
    Corrected const r = corrected(welford(p.t, p.E), s.fr, s.log_zr, p.q, p.c);
    double const we_hat = 1.0 - r.wr_hat;
    CHECK(r.wr_hat - s.wr >= -1e-15);
    CHECK(std::abs((r.wr_hat - s.wr) - s.wr * we_hat * s.rho) <= 1e-12);
    CHECK(std::abs((r.wr_hat - s.wr) - r.wr_hat * we_hat * s.rho / (1.0 + s.rho * we_hat)) <= 1e-12);
    CHECK(r.wr_hat - s.wr <= 0.25 * s.rho + 1e-15);
  }
}

TEST_CASE("moment_kv P12 (algebra): f - f-hat = w_E (f_E - f_R) - w_E-hat (f_E-hat - f_R)") {
  for (std::uint64_t seed = 1; seed <= 40; ++seed) {
    Problem const p =
        make_problem(20, 4 + static_cast<Index>(seed % 9), 6, 4, seed, 0.5 + 0.05 * static_cast<double>(seed), 2.0);
    Split const s = brute_split(p.t, p.R, p.E, p.q, p.c);
    Corrected const r = corrected(welford(p.t, p.E), s.fr, s.log_zr, p.q, p.c);
    double const we_hat = 1.0 - r.wr_hat;
    Vec lhs(4), rhs(4);
    for (std::size_t a = 0; a < 4; ++a) {
      lhs[a] = s.f[a] - r.out[a];
      rhs[a] = s.we * (s.fe[a] - s.fr[a]) - we_hat * (r.est[a] - s.fr[a]);
    }
    CHECK(close(lhs, rhs, 1e-12));
  }
}

TEST_CASE("moment_kv P13 (algebra): the exact error identity and the centred bound on ||f_E - f_E-hat||") {
  for (std::uint64_t seed = 1; seed <= 60; ++seed) {
    Problem p = make_problem(20, 2 + static_cast<Index>(seed % 15), 6, 4, seed,
                             0.2 + 0.05 * static_cast<double>(seed % 25), 2.0);
    if (seed % 10 == 0)  // σ = 0 cases: the bound is 0 up to rounding
      for (Index i : p.E)
        p.t.k[static_cast<std::size_t>(i)] = p.t.k[static_cast<std::size_t>(p.E[0])];
    Moments const m = welford(p.t, p.E);
    Split const s = brute_split(p.t, p.R, p.E, p.q, p.c);
    Corrected const r = corrected(m, s.fr, s.log_zr, p.q, p.c);
    Vec const err = sub(s.fe, r.est);
    Vec sq(4, 0.0);  // (c/n) S̃ q
    for (std::size_t a = 0; a < 4; ++a)
      sq[a] = r.est[a] - m.vm[a];
    double const bound = s.rho / (1.0 + s.rho) * (s.dev_max + norm(sq));
    CHECK(norm(err) <= bound * (1 + 1e-10) + 1e-14);
    // The paper-form bound (σ² e^σ / 2)(V_max + ‖f̂_E‖) is looser still.
    double vmax = 0.0;
    for (Index i : p.E)
      vmax = std::max(vmax, norm(p.t.v[static_cast<std::size_t>(i)]));
    CHECK(norm(err) <= 0.5 * s.sigma * s.sigma * std::exp(s.sigma) * (vmax + norm(r.est)) * (1 + 1e-10) + 1e-14);
    // f_E − f̂_E = (R_num/n − ρ̄ f̂_E) / (1 + ρ̄), R_num = Σ ρ_i v_i.
    Vec rnum(4, 0.0);
    for (Index i : p.E) {
      double const d = p.c * dot(p.q, sub(p.t.k[static_cast<std::size_t>(i)], m.km));
      for (std::size_t a = 0; a < 4; ++a)
        rnum[a] += (std::exp(d) - 1.0 - d) * p.t.v[static_cast<std::size_t>(i)][a];
    }
    Vec ident(4);
    for (std::size_t a = 0; a < 4; ++a)
      ident[a] = (rnum[a] / static_cast<double>(m.n) - s.rho * r.est[a]) / (1.0 + s.rho);
    CHECK(close(err, ident, 1e-12));
  }
}

TEST_CASE("moment_kv P14 (algebra): halving the evicted key spread cuts the f_E error about 4x (O(sigma^2))") {
  for (std::uint64_t seed = 1; seed <= 12; ++seed) {
    HeadTokens base = random_tokens(16, 8, 4, seed);
    Vec const q = random_vec(8, seed + 50, 1.0);
    Vec const center = random_vec(8, seed + 60, 1.0);
    double const c = 1.0 / std::sqrt(8.0);
    std::vector<Index> const E = iota(16);
    auto error_at = [&](double spread, double* sigma) {
      HeadTokens t = base;
      for (auto& k : t.k)
        for (std::size_t x = 0; x < 8; ++x)
          k[x] = center[x] + spread * k[x];
      Split const s = brute_split(t, {}, E, q, c);
      *sigma = s.sigma;
      Moments const m = welford(t, E);
      Corrected const r = corrected(m, Vec(4, 0.0), -INFINITY, q, c);
      return norm(sub(s.fe, r.est));
    };
    double sigma1 = 0.0, sigma = 0.0, sigma_half = 0.0;
    error_at(1.0, &sigma1);
    double const spread = 0.35 / sigma1;  // σ ≈ 0.35
    double const e1 = error_at(spread, &sigma), e2 = error_at(spread / 2, &sigma_half);
    INFO("seed " << seed << " sigma " << sigma << " ratio " << e1 / e2);
    CHECK(std::abs(sigma_half - sigma / 2) <= 1e-12);
    CHECK(e1 / e2 >= 3.5);
    CHECK(e1 / e2 <= 4.5);
  }
}

TEST_CASE("moment_kv P16 (algebra): adding b to all values adds b to f-hat, adding a to all keys changes nothing") {
  for (std::uint64_t seed = 1; seed <= 10; ++seed) {
    Problem const p = make_problem(15, 6, 4, 3, seed, 1.0, 2.0);
    Split const s = brute_split(p.t, p.R, p.E, p.q, p.c);
    Corrected const r = corrected(welford(p.t, p.E), s.fr, s.log_zr, p.q, p.c);
    Vec const b{1.5, -3.0, 0.25};
    Vec const a{2.0, -1.0, 0.5, 4.0};
    Problem pv = p, pk = p;
    for (auto& v : pv.t.v)
      for (std::size_t i = 0; i < 3; ++i)
        v[i] += b[i];
    for (auto& k : pk.t.k)
      for (std::size_t i = 0; i < 4; ++i)
        k[i] += a[i];
    Split const sv = brute_split(pv.t, pv.R, pv.E, pv.q, pv.c);
    Corrected const rv = corrected(welford(pv.t, pv.E), sv.fr, sv.log_zr, pv.q, pv.c);
    Split const sk = brute_split(pk.t, pk.R, pk.E, pk.q, pk.c);
    Corrected const rk = corrected(welford(pk.t, pk.E), sk.fr, sk.log_zr, pk.q, pk.c);
    Vec shifted(r.out);
    for (std::size_t i = 0; i < 3; ++i)
      shifted[i] += b[i];
    CHECK(close(rv.out, shifted, 1e-12));
    CHECK(close(rk.out, r.out, 1e-12));
  }
}

TEST_CASE("moment_kv P17 (algebra): virtual token, log-domain merge and direct Eq. 12 agree") {
  for (std::uint64_t seed = 1; seed <= 20; ++seed) {
    Problem const p = make_problem(18, 7, 5, 4, seed, 1.2, 2.0);
    Split const s = brute_split(p.t, p.R, p.E, p.q, p.c);
    Corrected const r = corrected(welford(p.t, p.E), s.fr, s.log_zr, p.q, p.c);
    // Virtual token from raw sums: numerator Σ_R e^{s_j} v_j + e^{s̄}(s_v + c S̃ q), denominator Z_R + n e^{s̄}.
    double const ne = static_cast<double>(p.E.size());
    Vec sk(5, 0.0), sv(4, 0.0), S(20, 0.0);
    for (Index i : p.E)
      for (std::size_t a = 0; a < 4; ++a) {
        sv[a] += p.t.v[static_cast<std::size_t>(i)][a];
        for (std::size_t x = 0; x < 5; ++x) {
          S[a * 5 + x] += p.t.v[static_cast<std::size_t>(i)][a] * p.t.k[static_cast<std::size_t>(i)][x];
          if (a == 0)
            sk[x] += p.t.k[static_cast<std::size_t>(i)][x];
        }
      }
    double const sbar = p.c * dot(p.q, sk) / ne;
    Vec num(4, 0.0);
    double den = 0.0;
    for (Index j : p.R) {
      double const w = std::exp(p.c * dot(p.q, p.t.k[static_cast<std::size_t>(j)]));
      den += w;
      for (std::size_t a = 0; a < 4; ++a)
        num[a] += w * p.t.v[static_cast<std::size_t>(j)][a];
    }
    den += ne * std::exp(sbar);
    for (std::size_t a = 0; a < 4; ++a) {
      double sq = 0.0;
      for (std::size_t x = 0; x < 5; ++x)
        sq += (S[a * 5 + x] - sv[a] * sk[x] / ne) * p.q[x];
      num[a] += std::exp(sbar) * (sv[a] + p.c * sq);
    }
    Vec virt(4);
    for (std::size_t a = 0; a < 4; ++a)
      virt[a] = num[a] / den;
    // Direct Eq. 12: ŵ_R = Z_R / (Z_R + Ẑ_E).
    double const zr = std::exp(s.log_zr), zhat = ne * std::exp(sbar);
    double const wr = zr / (zr + zhat);
    Vec direct(4);
    for (std::size_t a = 0; a < 4; ++a)
      direct[a] = wr * s.fr[a] + (1 - wr) * r.est[a];
    CHECK(close(r.out, virt, 1e-12));
    CHECK(close(r.out, direct, 1e-12));
    CHECK(std::abs(r.wr_hat - wr) <= 1e-12);
    CHECK(std::abs(r.lse - std::log(zr + zhat)) <= 1e-12 * std::max(1.0, std::abs(r.lse)));
  }
}

TEST_CASE("moment_kv P18 (algebra): log-weights near +-1000 merge without overflow and reach the right limits") {
  using kvc::detail::log_add_exp;
  using kvc::detail::merge_evicted;
  CHECK(log_add_exp(1000.0, -1000.0) == 1000.0);
  CHECK(log_add_exp(-1000.0, 1000.0) == 1000.0);
  CHECK(std::abs(log_add_exp(1000.0, 1000.0) - (1000.0 + std::log(2.0))) <= 1e-12);
  CHECK(std::abs(log_add_exp(-1000.0, -1000.5) - (-1000.0 + std::log1p(std::exp(-0.5)))) <= 1e-12);
  CHECK(log_add_exp(-HUGE_VAL, -HUGE_VAL) == -HUGE_VAL);
  CHECK(log_add_exp(-HUGE_VAL, 3.0) == 3.0);
  CHECK(std::abs(log_add_exp(1000.0f, 1000.0f) - (1000.0f + std::log(2.0f))) <= 1e-3f);

  for (bool as_float : {false, true}) {
    auto run = [&](double lse_r, double lse_e, double& w_r, double& lse) {
      if (as_float) {
        float one = 1.0f, zero = 0.0f;
        lse = kvc::detail::merge_evicted<float>(&one, static_cast<float>(lse_r), &zero, static_cast<float>(lse_e), 1);
        w_r = one;
      } else {
        double one = 1.0, zero = 0.0;
        lse = merge_evicted<double>(&one, lse_r, &zero, lse_e, 1);
        w_r = one;
      }
    };
    double w = 0, lse = 0;
    run(1000.0, -1000.0, w, lse);  // lse_R ≫ lse_E: ŵ_R → 1
    CHECK(w == 1.0);
    CHECK(lse == 1000.0);
    run(-1000.0, 1000.0, w, lse);  // lse_R ≪ lse_E: ŵ_R → 0
    CHECK(w == 0.0);
    CHECK(lse == 1000.0);
    run(1000.5, 1000.0, w, lse);  // analytic: ŵ_R = sigmoid(0.5)
    double const tol = as_float ? 1e-4 : 1e-12;
    CHECK(std::abs(w - 1.0 / (1.0 + std::exp(-0.5))) <= tol);
    CHECK(std::abs(lse - (1000.5 + std::log1p(std::exp(-0.5)))) <= (as_float ? 1e-3 : 1e-12));
    run(-1000.0, -1000.0 + std::log(3.0), w, lse);  // ŵ_R = 1/4
    CHECK(std::abs(w - 0.25) <= tol);
    run(-INFINITY, 5.0, w, lse);  // nothing retained: the estimate alone
    CHECK(w == 0.0);
    CHECK(lse == 5.0);
    CHECK(std::isfinite(w));
  }
}

TEST_CASE("moment_kv P19 (algebra): the zeroth-order estimate is v-bar, still weighted by Z_E-hat") {
  Problem const p = make_problem(15, 6, 4, 3, 3, 1.0, 2.0);
  Moments const m = welford(p.t, p.E);
  Split const s = brute_split(p.t, p.R, p.E, p.q, p.c);
  Corrected const r0 = corrected(m, s.fr, s.log_zr, p.q, p.c, kvc::MomentOrder::zeroth);
  Corrected const r1 = corrected(m, s.fr, s.log_zr, p.q, p.c, kvc::MomentOrder::first);
  CHECK(r0.est == m.vm);
  CHECK(r0.wr_hat == r1.wr_hat);
  CHECK(std::abs(r0.lse - r1.lse) == 0.0);
}

TEST_CASE("moment_kv P20: clamp_small zeroes entries with |x| < tau and leaves the others untouched") {
  using kvc::detail::clamp_small;
  CHECK(clamp_small(5e-7, 1e-6) == 0.0);
  CHECK(clamp_small(-5e-7, 1e-6) == 0.0);
  CHECK(clamp_small(0.0, 1e-6) == 0.0);
  CHECK(clamp_small(2e-6, 1e-6) == 2e-6);
  CHECK(clamp_small(-2e-6, 1e-6) == -2e-6);
  CHECK(clamp_small(1e-6, 1e-6) == 1e-6);  // |x| == tau is not below tau
  CHECK(clamp_small(-3.5, 1e-6) == -3.5);
  CHECK(clamp_small(1e-30, 0.0) == 1e-30);  // tau = 0 disables the clamp
  CHECK(clamp_small(-1e-30, 0.0) == -1e-30);
  CHECK(clamp_small(5e-7f, 1e-6f) == 0.0f);
  CHECK(clamp_small(1.5e-6f, 1e-6f) == 1.5e-6f);
}

// ---------------------------------------------------------------------------------------------------------------
// Memory (property 29) and the state's shape check

TEST_CASE("moment_kv P29: bytes per KV head are (d_v d_k + d_k + d_v) sizeof(T) + sizeof(count)") {
  CHECK(kvc::moment_head_bytes(128, 128, 2) == 33280u + 8u);  // 16,640 numbers in 16 bits, plus the int64 count
  CHECK(kvc::moment_head_bytes(128, 128, 4) == 66560u + 8u);  // fp32 doubles it
  CHECK(kvc::moment_head_bytes(64, 96, 2) == (96u * 64u + 64u + 96u) * 2u + 8u);  // d_k != d_v
  CHECK(kvc::moment_head_bytes(0, 0, 2) == 8u);
  CHECK(kvc::moment_state_bytes<kvc::half>(1, 8, 128, 128) == 8u * 33288u);
  CHECK(kvc::moment_state_bytes<kvc::bfloat16>(2, 8, 128, 128) == 16u * 33288u);
  CHECK(kvc::moment_state_bytes<float>(3, 2, 16, 8) == 6u * ((8u * 16u + 24u) * 4u + 8u));
  CHECK(kvc::moment_state_bytes(3, 2, 16, 8) == kvc::moment_state_bytes<float>(3, 2, 16, 8));
  // Model totals (spec §4, Table 5): layers x 8 KV heads x (d² + 2d) x 2 B = 8.52 MB (LLaMA-3.1-8B, 32 layers) and
  // 9.58 MB (Qwen3-4B, 36 layers); the counts add 8 B per head and do not change the rounding.
  double const llama = 32.0 * static_cast<double>(kvc::moment_state_bytes<kvc::half>(1, 8, 128, 128));
  double const qwen = 36.0 * static_cast<double>(kvc::moment_state_bytes<kvc::half>(1, 8, 128, 128));
  double const llama_moments = llama - 32.0 * 8 * 8, qwen_moments = qwen - 36.0 * 8 * 8;
  CHECK(llama_moments == 8519680.0);
  CHECK(qwen_moments == 9584640.0);
  CHECK(std::round(llama_moments / 1e4) / 100 == Approx(8.52));
  CHECK(std::round(qwen_moments / 1e4) / 100 == Approx(9.58));
  CHECK(std::round(llama / 1e4) / 100 == Approx(8.52));  // with the counts: 8,521,728 B
  // Relative to the retained cache: (d + 2) / (2L) per head (counts aside): 50.8% at 128 ... 6.35% at 1024.
  for (auto [L, pct] : {std::pair<Index, double>{128, 50.8}, {256, 25.4}, {512, 12.7}, {1024, 6.35}}) {
    kvc::MomentMemory const mm = kvc::moment_memory(128, 128, 2, L, 2);
    CHECK(mm.head_bytes == 33288u);
    CHECK(mm.kept_bytes == static_cast<std::size_t>(L) * 256u * 2u);
    double const no_count = 33280.0 / static_cast<double>(mm.kept_bytes);
    CHECK(no_count == Approx(130.0 / (2.0 * static_cast<double>(L))));
    CHECK(no_count * 100 == Approx(pct).margin(0.05));  // the spec's rounded percentages
    CHECK(mm.ratio_to_kept == Approx(33288.0 / static_cast<double>(mm.kept_bytes)));
  }
  CHECK(kvc::moment_memory(128, 128, 2, 0, 2).ratio_to_kept == 0.0);
  static_assert(kvc::moment_head_bytes(128, 128, 2) == 33288u, "constexpr");
}

TEST_CASE("moment_kv: MomentState::check refuses a state of another shape or with null buffers") {
  std::vector<Index> n(6, 0);
  std::vector<float> km(6 * 4), vm(6 * 3), cm(6 * 12);
  kvc::MomentState<> st{n.data(), km.data(), vm.data(), cm.data(), 2, 3, 4, 3};
  CHECK(st.check(2, 3, 4, 3).ok());
  for (auto [b, h, dk, dv] :
       {std::tuple<Index, Index, Index, Index>{1, 3, 4, 3}, {2, 2, 4, 3}, {2, 3, 3, 3}, {2, 3, 4, 4}}) {
    kvc::Status const s = st.check(b, h, dk, dv);
    CHECK(s.code() == kvc::Errc::invalid_argument);
    CHECK(std::string(s.message()).find("MomentState") != std::string::npos);
  }
  kvc::MomentState<> missing = st;
  missing.comoment = nullptr;
  CHECK(missing.check(2, 3, 4, 3).code() == kvc::Errc::invalid_argument);
  CHECK(std::string(missing.check(2, 3, 4, 3).message()).find("comoment") != std::string::npos);
  kvc::MomentState<> empty{};
  CHECK(empty.check(0, 0, 0, 0).ok());  // no heads: nothing to point at
  // Addressing: head (b, h) = b * heads + h, rows of dk / dv / dv*dk.
  CHECK(st.key_mean_of(1, 2) == km.data() + 5 * 4);
  CHECK(st.value_mean_of(1, 0) == vm.data() + 3 * 3);
  CHECK(st.comoment_of(0, 2) == cm.data() + 2 * 12);
}
