// SPDX-License-Identifier: Apache-2.0
// tests/attention/corrected_test.cpp mirrors include/kvc/attention/corrected.hpp (CPU epilogue in
// backend/cpu/attention/corrected.hpp): MomentKV's normalisation-corrected attention (shared/specs/moment_kv.md
// §2.4–2.6, §10 properties 6–20, 27, 28, 30).
// References are double brute force in the test: full attention over R ∪ E from the raw tokens, f_E and Z_E by direct
// summation, and the corrected output by the spec's direct Eq. 12 from moments computed by a two-pass brute force
// in tests/support/moments.hpp (so the kernel under test never produces its own expected values). fp32 kernel vs
// double: ~1e-5 relative.
#include <kvc/backend/cpu/attention/corrected.hpp>
#include <kvc/backend/cpu/pipeline/compact.hpp>
#include <kvc/backend/cpu/thread_pool.hpp>

#include "common/synthetic.hpp"
#include "support/catch.hpp"
#include "support/helpers.hpp"
#include "support/moments.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

namespace {

using kvc::Index;
using Vec = std::vector<double>;

using namespace kvc::test;  // support/moments.hpp: Moments, brute_moments, close, ...

/// A problem: the full token set of every (b, KV head), the evicted subset of each head, and the queries.
struct Case {
  Index B = 1, H = 1, Hq = 1, nq = 1, N = 1, dk = 4, dv = 4;
  std::vector<float> K, V, Q;         // [B,H,N,dk], [B,H,N,dv], [B,Hq,nq,dk]
  std::vector<std::vector<Index>> E;  // per head (b * H + h), ascending
  float scale = 0.0f;                 // 0 = 1/sqrt(dk)
  double c() const { return scale > 0 ? scale : 1.0 / std::sqrt(static_cast<double>(dk)); }
  float const* k(Index b, Index h, Index t) const { return K.data() + ((b * H + h) * N + t) * dk; }
  float const* v(Index b, Index h, Index t) const { return V.data() + ((b * H + h) * N + t) * dv; }
  float const* q(Index b, Index hq, Index i) const { return Q.data() + ((b * Hq + hq) * nq + i) * dk; }
  float* kw(Index b, Index h, Index t) { return K.data() + ((b * H + h) * N + t) * dk; }
  float* vw(Index b, Index h, Index t) { return V.data() + ((b * H + h) * N + t) * dv; }
  float* qw(Index b, Index hq, Index i) { return Q.data() + ((b * Hq + hq) * nq + i) * dk; }
  std::vector<Index> retained(Index bh) const {
    std::vector<Index> r;
    for (Index t = 0; t < N; ++t)
      if (!std::binary_search(E[static_cast<std::size_t>(bh)].begin(), E[static_cast<std::size_t>(bh)].end(), t))
        r.push_back(t);
    return r;
  }
};

/// Random K, V, Q; head i evicts evict_counts[i % size] tokens chosen by a seeded shuffle.
Case random_case(Index B, Index H, Index Hq, Index nq, Index N, Index dk, Index dv, std::vector<Index> const& counts,
                 std::uint64_t seed, float key_scale = 1.0f, float q_scale = 1.5f) {
  Case cs;
  cs.B = B, cs.H = H, cs.Hq = Hq, cs.nq = nq, cs.N = N, cs.dk = dk, cs.dv = dv;
  kvc::tools::Rng rng(seed);
  cs.K.resize(static_cast<std::size_t>(B * H * N * dk));
  cs.V.resize(static_cast<std::size_t>(B * H * N * dv));
  cs.Q.resize(static_cast<std::size_t>(B * Hq * nq * dk));
  for (auto& x : cs.K)
    x = key_scale * rng.normal();
  for (auto& x : cs.V)
    x = rng.normal();
  for (auto& x : cs.Q)
    x = q_scale * rng.normal();
  for (Index bh = 0; bh < B * H; ++bh) {
    std::vector<Index> perm(static_cast<std::size_t>(N));
    for (Index t = 0; t < N; ++t)
      perm[static_cast<std::size_t>(t)] = t;
    kvc::test::shuffle(perm, rng);
    Index const ne = counts[static_cast<std::size_t>(bh) % counts.size()];
    std::vector<Index> e(perm.begin(), perm.begin() + ne);
    std::sort(e.begin(), e.end());
    cs.E.push_back(e);
  }
  return cs;
}

/// Two-pass brute-force moments of the evicted set of head bh, in double (from the fp32 tokens, widened exactly).
Moments brute_moments(Case const& cs, Index bh) {
  Index const b = bh / cs.H, h = bh % cs.H;
  kvc::test::HeadTokens t{cs.dk, cs.dv, {}, {}};
  for (Index i = 0; i < cs.N; ++i) {
    t.k.emplace_back(cs.k(b, h, i), cs.k(b, h, i) + cs.dk);
    t.v.emplace_back(cs.v(b, h, i), cs.v(b, h, i) + cs.dv);
  }
  return kvc::test::brute_moments(t, cs.E[static_cast<std::size_t>(bh)]);
}

/// The retained cache (slots 0..|R|-1 of each head, capacity N, per-head lengths) and a moment state of type T.
template <class T, class CT = float>
struct Built : kvc::test::OwnedMoments<T> {
  kvc::tools::HostCache<CT> cache;

  explicit Built(Case const& cs)
      : kvc::test::OwnedMoments<T>(cs.B, cs.H, cs.dk, cs.dv), cache(kvc::KVExtents{cs.B, cs.H, cs.N, cs.dk}, cs.dv) {
    cache.track(cs.N);
    for (Index bh = 0; bh < cs.B * cs.H; ++bh) {
      Index const b = bh / cs.H, h = bh % cs.H;
      auto const R = cs.retained(bh);
      cache.lengths[static_cast<std::size_t>(bh)] = static_cast<Index>(R.size());
      for (std::size_t j = 0; j < R.size(); ++j) {
        for (Index x = 0; x < cs.dk; ++x)
          cache.k[static_cast<std::size_t>(((bh * cs.N) + static_cast<Index>(j)) * cs.dk + x)] =
              kvc::from_float<CT>(cs.k(b, h, R[j])[x]);
        for (Index a = 0; a < cs.dv; ++a)
          cache.v[static_cast<std::size_t>(((bh * cs.N) + static_cast<Index>(j)) * cs.dv + a)] =
              kvc::from_float<CT>(cs.v(b, h, R[j])[a]);
      }
      this->set(bh, brute_moments(cs, bh));
    }
  }
  Built(Built const&) = delete;
};

struct Result {
  std::vector<float> out, lse;
};

kvc::AttendQueries<float> queries_of(Case const& cs) {
  return {kvc::TokenRows<float const, kvc::StridedLayout>(cs.Q.data(), kvc::bhtd_layout({cs.B, cs.Hq, cs.nq, cs.dk}))};
}

kvc::CorrectedAttention op_of(Case const& cs, float tau = 1e-6f, kvc::MomentOrder order = kvc::MomentOrder::first) {
  kvc::CorrectedAttention op{};
  op.attention.scale = cs.scale;
  op.attention.causal = false;
  op.clamp_tau = tau;
  op.order = order;
  return op;
}

template <class Cache, class T>
Result run(Case const& cs, Cache const& cache, kvc::MomentState<kvc::HostSpace, T> const& st,
           kvc::CorrectedAttention const& op, kvc::Cpu const& cpu = {}) {
  auto const q = queries_of(cs);
  Result r{std::vector<float>(static_cast<std::size_t>(cs.B * cs.Hq * cs.nq * cs.dv), -99.0f),
           std::vector<float>(static_cast<std::size_t>(cs.B * cs.Hq * cs.nq), -99.0f)};
  kvc::test::OwnedWorkspace ws(kvc::attend_corrected_workspace_bytes(cpu, op, q, cache, st));
  kvc::Status const s = kvc::attend_corrected(cpu, op, q, cache, st, {r.out.data(), r.lse.data()}, ws.get());
  INFO(s.message());
  REQUIRE(s.ok());
  return r;
}

double dotf(float const* q, double const* k, Index d) {
  double s = 0.0;
  for (Index i = 0; i < d; ++i)
    s += static_cast<double>(q[i]) * k[i];
  return s;
}
double dotf(float const* q, float const* k, Index d) {
  double s = 0.0;
  for (Index i = 0; i < d; ++i)
    s += static_cast<double>(q[i]) * static_cast<double>(k[i]);
  return s;
}

/// Softmax attention of query q over token list `set` of head (b, h) in double: output and log Z (-inf if empty).
void attention(Case const& cs, Index b, Index h, float const* q, std::vector<Index> const& set, Vec& f, double& lz) {
  f.assign(static_cast<std::size_t>(cs.dv), 0.0);
  if (set.empty()) {
    lz = -std::numeric_limits<double>::infinity();
    return;
  }
  double mx = -std::numeric_limits<double>::infinity();
  for (Index j : set)
    mx = std::max(mx, cs.c() * dotf(q, cs.k(b, h, j), cs.dk));
  double z = 0.0;
  for (Index j : set) {
    double const w = std::exp(cs.c() * dotf(q, cs.k(b, h, j), cs.dk) - mx);
    z += w;
    for (Index a = 0; a < cs.dv; ++a)
      f[static_cast<std::size_t>(a)] += w * cs.v(b, h, j)[a];
  }
  for (auto& x : f)
    x /= z;
  lz = std::log(z) + mx;
}

std::vector<Index> all_tokens(Case const& cs) {
  std::vector<Index> v(static_cast<std::size_t>(cs.N));
  for (Index t = 0; t < cs.N; ++t)
    v[static_cast<std::size_t>(t)] = t;
  return v;
}

/// The spec's direct Eq. 12 in double, with moments `m` (as given; the clamp applied with tau).
void corrected_reference(Case const& cs, Index b, Index hq, Index i, Moments const& m, double tau,
                         kvc::MomentOrder order, Vec& out, double& lse) {
  Index const h = hq / (cs.Hq / cs.H);
  float const* q = cs.q(b, hq, i);
  double lzr = 0.0;
  attention(cs, b, h, q, cs.retained(b * cs.H + h), out, lzr);
  lse = lzr;
  if (m.n == 0)
    return;
  double const c = cs.c();
  Vec est(m.vm);
  if (order == kvc::MomentOrder::first)
    for (Index a = 0; a < cs.dv; ++a)
      for (Index x = 0; x < cs.dk; ++x) {
        double const cx = m.C[static_cast<std::size_t>(a * cs.dk + x)];
        est[static_cast<std::size_t>(a)] += std::abs(cx) < tau ? 0.0 : c / static_cast<double>(m.n) * cx * q[x];
      }
  double const lze = std::log(static_cast<double>(m.n)) + c * dotf(q, m.km.data(), cs.dk);
  double const top = std::max(lzr, lze);
  double const zr = std::exp(lzr - top), ze = std::exp(lze - top);
  double const wr = zr / (zr + ze);
  for (Index a = 0; a < cs.dv; ++a)
    out[static_cast<std::size_t>(a)] =
        wr * out[static_cast<std::size_t>(a)] + (1 - wr) * est[static_cast<std::size_t>(a)];
  lse = top + std::log(zr + ze);
}

/// Kernel output vs the direct-Eq.-12 reference on the stored moments: relative to max(1, |ref|).
template <class T>
void check_against_reference(Case const& cs, Result const& r, kvc::MomentState<kvc::HostSpace, T> const& st, double tau,
                             kvc::MomentOrder order, double tol = 2e-5) {
  for (Index b = 0; b < cs.B; ++b)
    for (Index hq = 0; hq < cs.Hq; ++hq)
      for (Index i = 0; i < cs.nq; ++i) {
        Vec ref;
        double lse = 0.0;
        corrected_reference(cs, b, hq, i, stored_moments(st, b * cs.H + hq / (cs.Hq / cs.H)), tau, order, ref, lse);
        Index const row = (b * cs.Hq + hq) * cs.nq + i;
        for (Index a = 0; a < cs.dv; ++a) {
          INFO("b " << b << " hq " << hq << " i " << i << " a " << a);
          CHECK(std::abs(r.out[static_cast<std::size_t>(row * cs.dv + a)] - ref[static_cast<std::size_t>(a)]) <=
                tol * std::max(1.0, std::abs(ref[static_cast<std::size_t>(a)])));
        }
        CHECK(std::abs(r.lse[static_cast<std::size_t>(row)] - lse) <= tol * std::max(1.0, std::abs(lse)));
      }
}

/// Compares the kernel's output with the full attention over R ∪ E of each query row.
void check_full_attention(Case const& cs, Result const& r, double tol = 2e-5) {
  for (Index b = 0; b < cs.B; ++b)
    for (Index hq = 0; hq < cs.Hq; ++hq)
      for (Index i = 0; i < cs.nq; ++i) {
        Vec f;
        double lz = 0.0;
        attention(cs, b, hq / (cs.Hq / cs.H), cs.q(b, hq, i), all_tokens(cs), f, lz);
        Index const row = (b * cs.Hq + hq) * cs.nq + i;
        for (Index a = 0; a < cs.dv; ++a)
          CHECK(std::abs(r.out[static_cast<std::size_t>(row * cs.dv + a)] - f[static_cast<std::size_t>(a)]) <=
                tol * std::max(1.0, std::abs(f[static_cast<std::size_t>(a)])));
        CHECK(std::abs(r.lse[static_cast<std::size_t>(row)] - lz) <= tol * std::max(1.0, std::abs(lz)));
      }
}

double norm(Vec const& x) {
  double s = 0.0;
  for (double v : x)
    s += v * v;
  return std::sqrt(s);
}

}  // namespace

TEST_CASE("moment_kv corrected: GQA, d_k != d_v, per-head evicted counts: the kernel equals Eq. 12 in double") {
  Case const cs = random_case(2, 2, 6, 3, 21, 6, 4, {5, 0, 1, 13}, 17);
  Built<float> built(cs);
  Result const r = run(cs, built.cache.view(), built.state, op_of(cs));
  check_against_reference(cs, r, built.state, 1e-6, kvc::MomentOrder::first);
  for (float x : r.out)
    CHECK(std::isfinite(x));
  // An explicit scale (the model's own c, spec §9.7) is the correction's c too.
  Case scaled = cs;
  scaled.scale = 0.3f;
  Result const rs = run(scaled, built.cache.view(), built.state, op_of(scaled));
  check_against_reference(scaled, rs, built.state, 1e-6, kvc::MomentOrder::first);
  // Without an lse buffer the output is the same.
  auto const q = queries_of(cs);
  std::vector<float> out(r.out.size());
  auto const op = op_of(cs);
  kvc::test::OwnedWorkspace ws(
      kvc::attend_corrected_workspace_bytes(kvc::Cpu{}, op, q, built.cache.view(), built.state));
  REQUIRE(
      kvc::attend_corrected(kvc::Cpu{}, op, q, built.cache.view(), built.state, {out.data(), nullptr}, ws.get()).ok());
  CHECK(out == r.out);
}

TEST_CASE("moment_kv P6: n_e = 0 returns the retained attention exactly, whatever the moment buffers hold") {
  Case const cs = random_case(1, 2, 4, 2, 12, 4, 4, {0, 3}, 5);
  Built<float> built(cs);
  // Head 0 evicted nothing: its buffers hold NaN (never read) and the output must be kvc::attend's, bit for bit.
  std::fill(built.km.begin(), built.km.begin() + 4, std::nanf(""));
  std::fill(built.vm.begin(), built.vm.begin() + 4, std::nanf(""));
  std::fill(built.cm.begin(), built.cm.begin() + 16, std::nanf(""));
  Result const r = run(cs, built.cache.view(), built.state, op_of(cs));
  auto const q = queries_of(cs);
  std::vector<float> plain(r.out.size()), plain_lse(r.lse.size());
  kvc::Attention const att{0.0f, false};
  kvc::test::OwnedWorkspace ws(kvc::attend_workspace_bytes(kvc::Cpu{}, att, q, built.cache.view()));
  REQUIRE(kvc::attend(kvc::Cpu{}, att, q, built.cache.view(), {plain.data(), plain_lse.data()}, ws.get()).ok());
  for (std::size_t i = 0; i < 2 * 2 * 4; ++i)  // query heads 0, 1 read KV head 0
    CHECK(r.out[i] == plain[i]);
  for (std::size_t i = 0; i < 4; ++i)
    CHECK(r.lse[i] == plain_lse[i]);
  for (float x : r.out)
    CHECK(!std::isnan(x));
  // Every head at n_e = 0: the whole output is the plain attention.
  Case const none = random_case(2, 2, 2, 3, 9, 4, 3, {0}, 6);
  Built<float> b0(none);
  Result const r0 = run(none, b0.cache.view(), b0.state, op_of(none));
  check_full_attention(none, r0, 1e-6);
}

TEST_CASE("moment_kv P7: n_e = 1 makes the corrected output the full attention over R and E, for any q") {
  for (std::uint64_t seed = 1; seed <= 6; ++seed) {
    Case const cs = random_case(2, 2, 4, 4, 11, 8, 5, {1}, seed, 1.5f, 2.5f);
    Built<float> built(cs);
    check_full_attention(cs, run(cs, built.cache.view(), built.state, op_of(cs, 0.0f)));
  }
}

TEST_CASE(
    "moment_kv P8: identical evicted keys, q = 0 and q orthogonal to the key deviations give the full "
    "attention") {
  Case same_keys = random_case(1, 2, 2, 3, 12, 4, 4, {5, 7}, 8);
  for (Index bh = 0; bh < 2; ++bh)
    for (Index i : same_keys.E[static_cast<std::size_t>(bh)])
      std::copy_n(same_keys.k(0, bh, same_keys.E[static_cast<std::size_t>(bh)][0]), 4, same_keys.kw(0, bh, i));
  Built<float> b1(same_keys);
  check_full_attention(same_keys, run(same_keys, b1.cache.view(), b1.state, op_of(same_keys)));

  Case zero_q = random_case(1, 2, 4, 2, 12, 4, 3, {6}, 9);
  std::fill(zero_q.Q.begin(), zero_q.Q.end(), 0.0f);
  Built<float> b2(zero_q);
  check_full_attention(zero_q, run(zero_q, b2.cache.view(), b2.state, op_of(zero_q)));

  Case ortho = random_case(1, 1, 2, 3, 12, 4, 4, {6}, 10);  // deviations in span{e0, e1}, q in span{e2, e3}
  for (Index i : ortho.E[0]) {
    ortho.kw(0, 0, i)[2] = 0.75f;
    ortho.kw(0, 0, i)[3] = -1.25f;
  }
  for (Index hq = 0; hq < 2; ++hq)
    for (Index i = 0; i < 3; ++i)
      ortho.qw(0, hq, i)[0] = ortho.qw(0, hq, i)[1] = 0.0f;
  Built<float> b3(ortho);
  check_full_attention(ortho, run(ortho, b3.cache.view(), b3.state, op_of(ortho)));
}

namespace {
/// One-channel problem whose corrected output is ŵ_R itself: retained values 1, evicted values 0 (identical, P9).
Case weight_case(std::uint64_t seed, float spread, bool same_keys) {
  Case cs = random_case(1, 1, 1, 4, 14, 4, 1, {8}, seed, 1.0f, 2.0f);
  for (Index t = 0; t < cs.N; ++t) {
    bool const evicted = std::binary_search(cs.E[0].begin(), cs.E[0].end(), t);
    cs.vw(0, 0, t)[0] = evicted ? 0.0f : 1.0f;
    if (evicted)
      for (Index x = 0; x < 4; ++x)
        cs.kw(0, 0, t)[x] = same_keys ? 0.5f : spread * cs.k(0, 0, t)[x];
  }
  return cs;
}

struct Evicted {
  double wr = 0, rho = 0, log_ze = 0, sigma = 0;
};
Evicted evicted_stats(Case const& cs, Index i) {
  Evicted s;
  float const* q = cs.q(0, 0, i);
  Moments const m = brute_moments(cs, 0);
  Vec f;
  double lzr = 0, lze = 0;
  attention(cs, 0, 0, q, cs.retained(0), f, lzr);
  attention(cs, 0, 0, q, cs.E[0], f, lze);
  s.wr = 1.0 / (1.0 + std::exp(lze - lzr));
  s.log_ze = lze;
  for (Index t : cs.E[0]) {
    double d = 0.0;
    for (Index x = 0; x < cs.dk; ++x)
      d += cs.c() * cs.q(0, 0, i)[x] * (cs.k(0, 0, t)[x] - m.km[static_cast<std::size_t>(x)]);
    s.rho += (std::exp(d) - 1 - d) / static_cast<double>(m.n);
    s.sigma = std::max(s.sigma, std::abs(d));
  }
  return s;
}
}  // namespace

TEST_CASE(
    "moment_kv P9: identical evicted values: f_E-hat = v, C = 0, and w_R-hat >= w_R with equality iff "
    "sigma = 0") {
  // f̂_E alone: nothing retained (attend gives lse = -inf), so the output is the estimate.
  Case cs = random_case(1, 1, 2, 3, 9, 5, 3, {9}, 12);
  for (Index t = 0; t < 9; ++t) {
    cs.vw(0, 0, t)[0] = 1.5f;
    cs.vw(0, 0, t)[1] = -2.0f;
    cs.vw(0, 0, t)[2] = 0.25f;
  }
  Built<float> b(cs);
  for (float x : b.cm)
    CHECK(x == 0.0f);
  Result const r = run(cs, b.cache.view(), b.state, op_of(cs, 0.0f));
  for (std::size_t row = 0; row < 6; ++row) {
    CHECK(r.out[row * 3 + 0] == 1.5f);
    CHECK(r.out[row * 3 + 1] == -2.0f);
    CHECK(r.out[row * 3 + 2] == 0.25f);
  }
  for (std::uint64_t seed = 1; seed <= 4; ++seed) {
    Case const spread = weight_case(seed, 1.5f, false), flat = weight_case(seed, 0.0f, true);
    Built<float> bs(spread), bf(flat);
    Result const rs = run(spread, bs.cache.view(), bs.state, op_of(spread)),
                 rf = run(flat, bf.cache.view(), bf.state, op_of(flat));
    for (Index i = 0; i < 4; ++i) {
      Evicted const es = evicted_stats(spread, i), ef = evicted_stats(flat, i);
      REQUIRE(es.sigma > 0.3);
      CHECK(rs.out[static_cast<std::size_t>(i)] > es.wr + 1e-4);  // strict: σ > 0
      CHECK(ef.sigma == 0.0);
      CHECK(std::abs(rf.out[static_cast<std::size_t>(i)] - ef.wr) <= 2e-6);  // equality: σ = 0
    }
  }
}

TEST_CASE("moment_kv P10: the kernel's log Z_E-hat is Jensen's lower bound and Z_E / Z_E-hat = 1 + rho-bar") {
  // Nothing retained: the merged lse is lse_E = log n + c qᵀk̄ itself.
  for (std::uint64_t seed = 1; seed <= 5; ++seed) {
    Case cs = random_case(1, 1, 1, 6, 10, 6, 2, {10}, seed, 0.3f * static_cast<float>(seed), 2.0f);
    Built<float> b(cs);
    Result const r = run(cs, b.cache.view(), b.state, op_of(cs));
    for (Index i = 0; i < 6; ++i) {
      Evicted const s = evicted_stats(cs, i);
      double const log_zhat = r.lse[static_cast<std::size_t>(i)];
      CHECK(log_zhat <= s.log_ze + 1e-5);
      CHECK(std::abs(std::exp(s.log_ze - log_zhat) - (1.0 + s.rho)) <= 2e-5 * (1.0 + s.rho));
    }
  }
}

TEST_CASE("moment_kv P11: the kernel's w_R-hat - w_R = w_R w_E-hat rho-bar >= 0") {
  for (std::uint64_t seed = 1; seed <= 5; ++seed) {
    Case const cs = weight_case(seed, 0.4f * static_cast<float>(seed), false);
    Built<float> b(cs);
    Result const r = run(cs, b.cache.view(), b.state, op_of(cs));
    for (Index i = 0; i < 4; ++i) {
      Evicted const s = evicted_stats(cs, i);
      double const wr_hat = r.out[static_cast<std::size_t>(i)];
      CHECK(wr_hat - s.wr >= -2e-6);
      CHECK(std::abs((wr_hat - s.wr) - s.wr * (1 - wr_hat) * s.rho) <= 2e-6 * (1.0 + s.rho));  // fp32 w, times rho
    }
  }
}

TEST_CASE("moment_kv P12: the kernel's error f - f-hat = w_E (f_E - f_R) - w_E-hat (f_E-hat - f_R)") {
  Case const cs = random_case(1, 2, 2, 4, 16, 6, 4, {6, 9}, 23, 1.2f, 2.0f);
  Built<float> b(cs);
  Result const r = run(cs, b.cache.view(), b.state, op_of(cs, 0.0f));
  // f̂_E(q) from the kernel too: the same moments with nothing retained; ŵ_R from the merged lse and log Z_R.
  std::vector<Index> const lengths = b.cache.lengths;
  std::fill(b.cache.lengths.begin(), b.cache.lengths.end(), 0);
  Result const only_e = run(cs, b.cache.view(), b.state, op_of(cs, 0.0f));
  b.cache.lengths = lengths;
  for (Index h = 0; h < 2; ++h)
    for (Index i = 0; i < 4; ++i) {
      float const* q = cs.q(0, h, i);
      Vec fr, fe, f;
      double lzr = 0, lze = 0, lz = 0;
      attention(cs, 0, h, q, cs.retained(h), fr, lzr);
      attention(cs, 0, h, q, cs.E[static_cast<std::size_t>(h)], fe, lze);
      attention(cs, 0, h, q, all_tokens(cs), f, lz);
      Index const row = h * 4 + i;
      double const wr_hat = std::exp(lzr - r.lse[static_cast<std::size_t>(row)]);
      double const we = 1.0 - 1.0 / (1.0 + std::exp(lze - lzr)), we_hat = 1.0 - wr_hat;
      for (Index a = 0; a < 4; ++a) {
        double const out = r.out[static_cast<std::size_t>(row * 4 + a)];
        double const est = only_e.out[static_cast<std::size_t>(row * 4 + a)];
        CHECK(std::abs(out - (wr_hat * fr[static_cast<std::size_t>(a)] + we_hat * est)) <= 1e-5);
        double const lhs = f[static_cast<std::size_t>(a)] - out;
        double const rhs = we * (fe[static_cast<std::size_t>(a)] - fr[static_cast<std::size_t>(a)]) -
                           we_hat * (est - fr[static_cast<std::size_t>(a)]);
        CHECK(std::abs(lhs - rhs) <= 1e-5);
      }
    }
}

TEST_CASE("moment_kv P13 P14: the kernel's f_E-hat obeys the centred error bound and its error is O(sigma^2)") {
  for (std::uint64_t seed = 1; seed <= 6; ++seed) {
    Case base = random_case(1, 1, 1, 1, 16, 8, 4, {16}, seed, 1.0f, 1.0f);
    // σ ≈ 0.35 at spread s, about half that at s / 2 (keys = center + s · noise).
    Vec center(8);
    kvc::tools::Rng rng(seed + 40);
    for (auto& x : center)
      x = rng.normal();
    auto with_spread = [&](double s) {
      Case cs = base;
      for (Index t = 0; t < 16; ++t)
        for (Index x = 0; x < 8; ++x)
          cs.kw(0, 0, t)[x] = static_cast<float>(center[static_cast<std::size_t>(x)] + s * base.k(0, 0, t)[x]);
      return cs;
    };
    double const sigma1 = evicted_stats(with_spread(1.0), 0).sigma;
    double const s = 0.35 / sigma1;
    double err[2] = {0, 0};
    for (int half = 0; half < 2; ++half) {
      Case const cs = with_spread(half ? s / 2 : s);
      Built<float> b(cs);
      Result const r = run(cs, b.cache.view(), b.state, op_of(cs, 0.0f));
      Vec fe;
      double lze = 0;
      attention(cs, 0, 0, cs.q(0, 0, 0), cs.E[0], fe, lze);
      Moments const m = brute_moments(cs, 0);
      Evicted const st = evicted_stats(cs, 0);
      Vec diff(4), sq(4);
      double dev_max = 0.0;
      for (Index t : cs.E[0]) {
        Vec d(4);
        for (Index a = 0; a < 4; ++a)
          d[static_cast<std::size_t>(a)] = cs.v(0, 0, t)[a] - m.vm[static_cast<std::size_t>(a)];
        dev_max = std::max(dev_max, norm(d));
      }
      for (std::size_t a = 0; a < 4; ++a) {
        diff[a] = fe[a] - r.out[a];
        sq[a] = r.out[a] - m.vm[a];  // (c/n) S̃ q
      }
      err[half] = norm(diff);
      CHECK(err[half] <= st.rho / (1 + st.rho) * (dev_max + norm(sq)) + 1e-6);
    }
    INFO("seed " << seed << " ratio " << err[0] / err[1]);
    CHECK(err[0] / err[1] >= 3.5);
    CHECK(err[0] / err[1] <= 4.5);
  }
}

TEST_CASE("moment_kv P15: the kernel's f_E-hat is affine in q") {
  Case cs = random_case(1, 1, 1, 3, 10, 6, 5, {10}, 31, 1.0f, 1.5f);
  float const a = 0.3f;
  for (Index x = 0; x < 6; ++x)
    cs.qw(0, 0, 2)[x] = a * cs.q(0, 0, 0)[x] + (1 - a) * cs.q(0, 0, 1)[x];
  Built<float> b(cs);
  Result const r = run(cs, b.cache.view(), b.state, op_of(cs, 0.0f));
  for (std::size_t c = 0; c < 5; ++c)
    CHECK(std::abs(r.out[10 + c] - (a * r.out[c] + (1 - a) * r.out[5 + c])) <= 1e-5);
  // and f̂_E(0) = v̄.
  Case z = cs;
  std::fill(z.Q.begin(), z.Q.end(), 0.0f);
  Result const r0 = run(z, b.cache.view(), b.state, op_of(z, 0.0f));
  for (std::size_t c = 0; c < 5; ++c)
    CHECK(r0.out[c] == b.vm[c]);
}

TEST_CASE("moment_kv P16: adding b to every value adds b to f-hat, adding a to every key changes nothing") {
  Case const cs = random_case(1, 2, 4, 3, 14, 5, 3, {4, 8}, 41);
  Built<float> b0(cs);
  Result const r = run(cs, b0.cache.view(), b0.state, op_of(cs, 0.0f));
  float const shift_v[3] = {2.0f, -1.5f, 0.5f}, shift_k[5] = {1.0f, -2.0f, 0.5f, 3.0f, -0.25f};
  Case cv = cs, ck = cs;
  for (Index t = 0; t < 2 * 14; ++t) {
    for (Index a = 0; a < 3; ++a)
      cv.V[static_cast<std::size_t>(t * 3 + a)] += shift_v[a];
    for (Index x = 0; x < 5; ++x)
      ck.K[static_cast<std::size_t>(t * 5 + x)] += shift_k[x];
  }
  Built<float> bv(cv), bk(ck);
  Result const rv = run(cv, bv.cache.view(), bv.state, op_of(cv, 0.0f));
  Result const rk = run(ck, bk.cache.view(), bk.state, op_of(ck, 0.0f));
  for (std::size_t i = 0; i < r.out.size(); ++i) {
    CHECK(std::abs(rv.out[i] - (r.out[i] + shift_v[i % 3])) <= 2e-5);
    CHECK(std::abs(rk.out[i] - r.out[i]) <= 2e-5);
  }
}

TEST_CASE("moment_kv P17: virtual token (through kvc::attend), log-domain kernel and direct Eq. 12 agree") {
  Case const cs = random_case(1, 2, 2, 1, 12, 4, 3, {5, 7}, 51, 1.0f, 1.5f);
  Built<float> b(cs);
  Result const r = run(cs, b.cache.view(), b.state, op_of(cs, 0.0f));
  check_against_reference(cs, r, b.state, 0.0, kvc::MomentOrder::first);  // direct Eq. 12
  double const c = cs.c();
  for (Index h = 0; h < 2; ++h) {
    // The evicted set as one more cache token: key k* with c qᵀk* = c qᵀk̄ + log n, value f̂_E(q) (double moments).
    Moments const m = brute_moments(cs, h);
    float const* q = cs.q(0, h, 0);
    double qq = 0.0;
    for (Index x = 0; x < 4; ++x)
      qq += static_cast<double>(q[x]) * q[x];
    auto const R = cs.retained(h);
    Index const n = static_cast<Index>(R.size()) + 1;
    std::vector<float> k(static_cast<std::size_t>(n * 4)), v(static_cast<std::size_t>(n * 3));
    for (std::size_t j = 0; j < R.size(); ++j) {
      std::copy_n(cs.k(0, h, R[j]), 4, k.begin() + static_cast<std::ptrdiff_t>(j * 4));
      std::copy_n(cs.v(0, h, R[j]), 3, v.begin() + static_cast<std::ptrdiff_t>(j * 3));
    }
    double const t = std::log(static_cast<double>(m.n)) / (c * qq);
    for (Index x = 0; x < 4; ++x)
      k[static_cast<std::size_t>((n - 1) * 4 + x)] = static_cast<float>(m.km[static_cast<std::size_t>(x)] + t * q[x]);
    for (Index a = 0; a < 3; ++a) {
      double e = m.vm[static_cast<std::size_t>(a)];
      for (Index x = 0; x < 4; ++x)
        e += c / static_cast<double>(m.n) * m.C[static_cast<std::size_t>(a * 4 + x)] * q[x];
      v[static_cast<std::size_t>((n - 1) * 3 + a)] = static_cast<float>(e);
    }
    auto const virt = kvc::dense_cache(k.data(), v.data(), {1, 1, n, 4}, 3);
    std::vector<float> qrow(q, q + 4), out(3), lse(1);
    kvc::AttendQueries<float> const aq{
        kvc::TokenRows<float const, kvc::StridedLayout>(qrow.data(), kvc::bhtd_layout({1, 1, 1, 4}))};
    kvc::Attention const att{0.0f, false};
    kvc::test::OwnedWorkspace ws(kvc::attend_workspace_bytes(kvc::Cpu{}, att, aq, virt));
    REQUIRE(kvc::attend(kvc::Cpu{}, att, aq, virt, {out.data(), lse.data()}, ws.get()).ok());
    for (Index a = 0; a < 3; ++a)
      CHECK(std::abs(out[static_cast<std::size_t>(a)] - r.out[static_cast<std::size_t>(h * 3 + a)]) <= 2e-5);
    CHECK(std::abs(lse[0] - r.lse[static_cast<std::size_t>(h)]) <= 2e-5);
  }
}

TEST_CASE("moment_kv P18: logits near +-1000 give finite outputs and the analytic limits") {
  // d = 2, c = 1: one retained key with logit s_r, two identical evicted keys with logit s_e (f̂_E = v̄ exactly).
  auto solve = [](float s_r, float s_e, float& out0, float& lse) {
    Case cs;
    cs.B = cs.H = cs.Hq = cs.nq = 1;
    cs.N = 3, cs.dk = 2, cs.dv = 2, cs.scale = 1.0f;
    cs.Q = {1000.0f, 0.0f};
    cs.K = {s_r / 1000.0f, 0.3f, s_e / 1000.0f, 0.7f, s_e / 1000.0f, -0.7f};  // second channel: q ignores it
    cs.V = {1.0f, 0.0f, 0.0f, 2.0f, 0.0f, 2.0f};
    cs.E = {{1, 2}};
    Built<float> b(cs);
    Result const r = run(cs, b.cache.view(), b.state, op_of(cs));
    for (float x : r.out)
      CHECK(std::isfinite(x));
    CHECK(std::isfinite(r.lse[0]));
    // C = Σ (v − v̄)(k − k̄)ᵀ = 0 here (identical values), so f̂_E = v̄ = (0, 2).
    // ŵ_R + ŵ_E = 1 up to the fp32 rounding of lse near 1000 (ulp 6e-5: the two weights are exponentiated apart)
    CHECK(std::abs(r.out[0] + r.out[1] / 2 - 1.0f) <= 2e-4f);
    out0 = r.out[0];
    lse = r.lse[0];
  };
  float w = 0, lse = 0;
  solve(1000.0f, -1000.0f, w, lse);  // lse_R ≫ lse_E: ŵ_R → 1
  CHECK(w == 1.0f);
  CHECK(std::abs(lse - 1000.0f) <= 1e-3f);
  solve(-1000.0f, 1000.0f, w, lse);  // lse_R ≪ lse_E: ŵ_R → 0
  CHECK(w == 0.0f);
  CHECK(std::abs(lse - (1000.0f + std::log(2.0f))) <= 1e-3f);
  solve(1000.5f, 1000.0f, w, lse);  // ŵ_R = sigmoid(0.5 − log 2), lse = logaddexp(1000.5, 1000 + log 2)
  double const x = 0.5 - std::log(2.0);
  CHECK(std::abs(w - 1.0 / (1.0 + std::exp(-x))) <= 2e-4);
  CHECK(std::abs(lse - (1000.5 + std::log1p(std::exp(-x)))) <= 1e-3);
  // Random data with huge queries: finite everywhere.
  Case big = random_case(1, 2, 2, 3, 12, 8, 4, {5, 6}, 61, 3.0f, 150.0f);
  Built<float> bb(big);
  Result const rb = run(big, bb.cache.view(), bb.state, op_of(big));
  for (float v : rb.out)
    CHECK(std::isfinite(v));
  for (float v : rb.lse)
    CHECK(std::isfinite(v));
}

TEST_CASE("moment_kv P19: the zeroth-order flag gives f_E-hat = v-bar, still weighted by Z_E-hat") {
  Case const cs = random_case(1, 2, 4, 2, 12, 5, 4, {5, 7}, 71, 1.0f, 2.0f);
  Built<float> b(cs);
  Result const r = run(cs, b.cache.view(), b.state, op_of(cs, 1e-6f, kvc::MomentOrder::zeroth));
  check_against_reference(cs, r, b.state, 0.0, kvc::MomentOrder::zeroth);
  Case only = cs;  // nothing retained: the output is v̄ itself
  for (Index h = 0; h < 2; ++h)
    only.E[static_cast<std::size_t>(h)] = all_tokens(cs);
  Built<float> bo(only);
  Result const ro = run(only, bo.cache.view(), bo.state, op_of(only, 1e-6f, kvc::MomentOrder::zeroth));
  for (Index hq = 0; hq < 4; ++hq)
    for (Index i = 0; i < 2; ++i)
      for (Index a = 0; a < 4; ++a)
        CHECK(ro.out[static_cast<std::size_t>((hq * 2 + i) * 4 + a)] ==
              bo.vm[static_cast<std::size_t>((hq / 2) * 4 + a)]);
}

TEST_CASE("moment_kv P20: entries of C below tau read as zero in the correction, larger ones are untouched") {
  // Hand-set state: n = 2, k̄ = v̄ = 0, C = [[5e-7, 0.5], [-3e-7, -2e-6]], c = 1, q = (1, 1), nothing retained:
  // f̂_E = (1/2) C̃ q.
  std::vector<float> k(2 * 2), v(2 * 2);
  std::vector<Index> len{0};
  auto const empty = kvc::dense_cache(k.data(), v.data(), {1, 1, 2, 2}, kvc::head_lengths(len.data(), 1));
  std::vector<Index> n{2};
  std::vector<float> km{0, 0}, vm{0, 0}, cm{5e-7f, 0.5f, -3e-7f, -2e-6f};
  kvc::MomentState<> const st{n.data(), km.data(), vm.data(), cm.data(), 1, 1, 2, 2};
  std::vector<float> q{1.0f, 1.0f}, out(2), lse(1);
  kvc::AttendQueries<float> const aq{
      kvc::TokenRows<float const, kvc::StridedLayout>(q.data(), kvc::bhtd_layout({1, 1, 1, 2}))};
  for (float tau : {1e-6f, 0.0f}) {
    kvc::CorrectedAttention op{};
    op.attention = {1.0f, false};
    op.clamp_tau = tau;
    kvc::test::OwnedWorkspace ws(kvc::attend_corrected_workspace_bytes(kvc::Cpu{}, op, aq, empty, st));
    REQUIRE(kvc::attend_corrected(kvc::Cpu{}, op, aq, empty, st, {out.data(), lse.data()}, ws.get()).ok());
    if (tau > 0) {
      CHECK(std::abs(out[0] - 0.25f) <= 1e-9f);   // (0 + 0.5) / 2
      CHECK(std::abs(out[1] + 1e-6f) <= 1e-12f);  // (0 − 2e-6) / 2
    } else {
      CHECK(std::abs(out[0] - 0.5f * (5e-7f + 0.5f)) <= 1e-9f);
      CHECK(std::abs(out[1] - 0.5f * (-3e-7f - 2e-6f)) <= 1e-12f);
    }
    CHECK(std::abs(lse[0] - std::log(2.0f)) <= 1e-6f);
  }
}

TEST_CASE("moment_kv P27: GQA equals MHA with the KV heads and their moments repeated, G = 1 is MHA") {
  Case const gqa = random_case(1, 2, 6, 2, 13, 4, 5, {3, 6}, 81);
  Case mha = gqa;  // 6 KV heads, head h a copy of GQA head h / 3 with the same evicted set
  mha.H = 6;
  mha.K.clear();
  mha.V.clear();
  mha.E.clear();
  for (Index h = 0; h < 6; ++h) {
    mha.K.insert(mha.K.end(), gqa.k(0, h / 3, 0), gqa.k(0, h / 3, 0) + 13 * 4);
    mha.V.insert(mha.V.end(), gqa.v(0, h / 3, 0), gqa.v(0, h / 3, 0) + 13 * 5);
    mha.E.push_back(gqa.E[static_cast<std::size_t>(h / 3)]);
  }
  Built<float> bg(gqa), bm(mha);
  Result const rg = run(gqa, bg.cache.view(), bg.state, op_of(gqa));
  Result const rm = run(mha, bm.cache.view(), bm.state, op_of(mha));
  for (std::size_t i = 0; i < rg.out.size(); ++i)
    CHECK(std::abs(rg.out[i] - rm.out[i]) <= 1e-6f * std::max(1.0f, std::abs(rm.out[i])));
  for (std::size_t i = 0; i < rg.lse.size(); ++i)
    CHECK(std::abs(rg.lse[i] - rm.lse[i]) <= 1e-6f * std::max(1.0f, std::abs(rm.lse[i])));
  check_against_reference(mha, rm, bm.state, 1e-6, kvc::MomentOrder::first);
}

TEST_CASE("moment_kv P28: sequences are independent and padding slots never enter the output") {
  Case const cs = random_case(2, 2, 4, 2, 12, 4, 3, {3, 5, 2, 7}, 91);
  Built<float> b(cs);
  Result const r = run(cs, b.cache.view(), b.state, op_of(cs));
  // Padding (slots past each head's length) holds NaN: nothing changes.
  for (Index bh = 0; bh < 4; ++bh)
    for (Index t = b.cache.lengths[static_cast<std::size_t>(bh)]; t < 12; ++t) {
      std::fill_n(b.cache.k.begin() + (bh * 12 + t) * 4, 4, std::nanf(""));
      std::fill_n(b.cache.v.begin() + (bh * 12 + t) * 3, 3, std::nanf(""));
    }
  Result const rp = run(cs, b.cache.view(), b.state, op_of(cs));
  CHECK(rp.out == r.out);
  CHECK(rp.lse == r.lse);
  // Changing sequence 1 (its cache, queries and moments) leaves sequence 0's rows bit-identical.
  Case other = random_case(2, 2, 4, 2, 12, 4, 3, {6, 1, 9, 4}, 92);
  Case mixed = other;
  std::copy(cs.K.begin(), cs.K.begin() + 2 * 12 * 4, mixed.K.begin());
  std::copy(cs.V.begin(), cs.V.begin() + 2 * 12 * 3, mixed.V.begin());
  std::copy(cs.Q.begin(), cs.Q.begin() + 4 * 2 * 4, mixed.Q.begin());
  mixed.E[0] = cs.E[0];
  mixed.E[1] = cs.E[1];
  Built<float> bm(mixed);
  Result const rm = run(mixed, bm.cache.view(), bm.state, op_of(mixed));
  CHECK(std::equal(r.out.begin(), r.out.begin() + 4 * 2 * 3, rm.out.begin()));
  CHECK(std::equal(r.lse.begin(), r.lse.begin() + 8, rm.lse.begin()));
  check_against_reference(mixed, rm, bm.state, 1e-6, kvc::MomentOrder::first);
}

TEST_CASE("moment_kv P30 (CPU stand-in): a thread pool gives the serial kernel's output bit for bit") {
  // No CUDA kernel for MomentKV exists yet: backend parity is checked between the CPU's serial and parallel paths.
  Case const cs = random_case(3, 2, 4, 70, 40, 8, 6, {10, 25, 0, 39, 1, 17}, 101);
  Built<float> b(cs);
  Result const serial = run(cs, b.cache.view(), b.state, op_of(cs));
  kvc::ThreadPool pool(3);
  Result const parallel = run(cs, b.cache.view(), b.state, op_of(cs), pool.cpu());
  CHECK(serial.out == parallel.out);
  CHECK(serial.lse == parallel.lse);
  check_against_reference(cs, serial, b.state, 1e-6, kvc::MomentOrder::first);  // 70 rows: more than one tile
}

TEST_CASE("moment_kv corrected: 16-bit moment states (half, bfloat16) and 16-bit caches") {
  Case const cs = random_case(1, 2, 4, 3, 14, 6, 4, {4, 9}, 111);
  Built<kvc::half> bh(cs);
  check_against_reference(cs, run(cs, bh.cache.view(), bh.state, op_of(cs)), bh.state, 1e-6, kvc::MomentOrder::first);
  Built<kvc::bfloat16> bb(cs);
  check_against_reference(cs, run(cs, bb.cache.view(), bb.state, op_of(cs)), bb.state, 1e-6, kvc::MomentOrder::first);
  // The 16-bit state is a rounding of the fp32 one: outputs close to the fp32 state's.
  Built<float> bf(cs);
  Result const rf = run(cs, bf.cache.view(), bf.state, op_of(cs));
  Result const rb = run(cs, bb.cache.view(), bb.state, op_of(cs));
  for (std::size_t i = 0; i < rf.out.size(); ++i)
    CHECK(std::abs(rf.out[i] - rb.out[i]) <= 0.05f);
  // A half cache: the reference reads the rounded values.
  Case rounded = cs;
  for (auto& x : rounded.K)
    x = kvc::to_float(kvc::from_float<kvc::half>(x));
  for (auto& x : rounded.V)
    x = kvc::to_float(kvc::from_float<kvc::half>(x));
  Built<float, kvc::half> hc(rounded);
  check_against_reference(rounded, run(rounded, hc.cache.view(), hc.state, op_of(rounded)), hc.state, 1e-6,
                          kvc::MomentOrder::first);
}

TEST_CASE("moment_kv corrected: a token-major (BTHD strided) cache gives the same output") {
  Case const cs = random_case(2, 2, 4, 2, 10, 4, 4, {3, 6, 0, 2}, 121);
  Built<float> b(cs);
  Result const r = run(cs, b.cache.view(), b.state, op_of(cs));
  kvc::KVExtents const e{2, 2, 10, 4};
  std::vector<float> kt(b.cache.k.size()), vt(b.cache.v.size());
  auto const src_k = kvc::bhtd_rows(b.cache.k.data(), e), src_v = kvc::bhtd_rows(b.cache.v.data(), e);
  kvc::TokenRows<float, kvc::StridedLayout> const dk(kt.data(), kvc::bthd_layout(e)),
      dv(vt.data(), kvc::bthd_layout(e));
  for (Index bb = 0; bb < 2; ++bb)
    for (Index h = 0; h < 2; ++h)
      for (Index t = 0; t < 10; ++t) {
        std::copy_n(src_k.row(bb, h, t), 4, dk.row(bb, h, t));
        std::copy_n(src_v.row(bb, h, t), 4, dv.row(bb, h, t));
      }
  auto const strided = kvc::make_cache(dk, dv, b.cache.length_table());
  Result const rs = run(cs, strided, b.state, op_of(cs));
  CHECK(rs.out == r.out);
  CHECK(rs.lse == r.lse);
}

TEST_CASE("moment_kv corrected: a state of another shape, bad parameters and a short workspace are refused") {
  Case const cs = random_case(1, 2, 4, 2, 8, 4, 3, {2, 3}, 131);
  Built<float> b(cs);
  auto const q = queries_of(cs);
  auto const op = op_of(cs);
  std::vector<float> out(static_cast<std::size_t>(4 * 2 * 3)), lse(8);
  kvc::test::OwnedWorkspace ws(kvc::attend_corrected_workspace_bytes(kvc::Cpu{}, op, q, b.cache.view(), b.state));
  auto const call = [&](kvc::CorrectedAttention const& o, kvc::MomentState<> const& st, kvc::Workspace w) {
    return kvc::attend_corrected(kvc::Cpu{}, o, q, b.cache.view(), st, {out.data(), lse.data()}, w);
  };
  for (int which = 0; which < 4; ++which) {
    kvc::MomentState<> bad = b.state;
    (which == 0 ? bad.heads : which == 1 ? bad.key_dim : which == 2 ? bad.value_dim : bad.batch) += 1;
    kvc::Status const s = call(op, bad, ws.get());
    CHECK(s.code() == kvc::Errc::invalid_argument);
    CHECK(std::string(s.message()).find("MomentState") != std::string::npos);
  }
  kvc::MomentState<> null_c = b.state;
  null_c.comoment = nullptr;
  CHECK(call(op, null_c, ws.get()).code() == kvc::Errc::invalid_argument);
  kvc::CorrectedAttention neg = op;
  neg.clamp_tau = -1.0f;
  CHECK(call(neg, b.state, ws.get()).code() == kvc::Errc::invalid_argument);
  neg = op;
  neg.attention.scale = -0.5f;
  CHECK(call(neg, b.state, ws.get()).code() == kvc::Errc::invalid_argument);
  kvc::Status const small = call(op, b.state, kvc::Workspace{ws.bytes.data(), ws.bytes.size() - 1});
  CHECK(small.code() == kvc::Errc::out_of_capacity);
  CHECK(std::string(small.message()).find("workspace") != std::string::npos);
  CHECK(call(op, b.state, ws.get()).ok());
}
