// SPDX-License-Identifier: Apache-2.0
// tests/support/moments.hpp: double-precision references for MomentKV's evicted-set moments, shared by
// tests/core/moments_test.cpp, tests/scorers/moment_kv_test.cpp, tests/attention/corrected_test.cpp and
// tests/pipeline/moment_kv_test.cpp (shared/specs/moment_kv.md §2.2–2.3). Everything here is written from the
// spec's definitions in double (two-pass means and centred co-moment over the raw tokens), never from the library's
// own algebra, so a kernel under test does not produce its own expected values.
#pragma once

#include <kvc/core/element.hpp>
#include <kvc/scorers/moments.hpp>

#include "common/synthetic.hpp"
#include "support/helpers.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace kvc::test {

/// The moments of one KV head's evicted set in double, in the library's Welford form: count n, key mean k̄ [dk],
/// value mean v̄ [dv] and centred co-moment C = Σ (v − v̄)(k − k̄)ᵀ [dv][dk] row-major (not divided by n).
/// An aggregate: `Moments{}` is the empty set (n = 0, no entries).
struct Moments {
  Index n = 0;
  std::vector<double> km, vm, C;
  /// n = 0 with zeroed k̄ [dk], v̄ [dv] and C [dv][dk].
  static Moments zeros(Index dk, Index dv) {
    return {0, std::vector<double>(static_cast<std::size_t>(dk)), std::vector<double>(static_cast<std::size_t>(dv)),
            std::vector<double>(static_cast<std::size_t>(dk * dv))};
  }
  Index dk() const { return static_cast<Index>(km.size()); }
  Index dv() const { return static_cast<Index>(vm.size()); }
};

/// The tokens of one KV head in double: keys k [n][dk], values v [n][dv] (token i is k[i], v[i]).
struct HeadTokens {
  Index dk = 0, dv = 0;
  std::vector<std::vector<double>> k, v;
};

/// Tokens 0..n-1 of head (b, h) of a BHTD host cache, each element widened exactly (to_float, then double).
template <class T>
HeadTokens head_of(tools::HostCache<T> const& c, Index b, Index h, Index n) {
  HeadTokens t{c.ext.dim, c.dim_v, {}, {}};
  for (Index j = 0; j < n; ++j) {
    auto const row = static_cast<std::size_t>((b * c.ext.heads + h) * c.ext.tokens + j);
    std::vector<double> k(static_cast<std::size_t>(t.dk)), v(static_cast<std::size_t>(t.dv));
    for (std::size_t x = 0; x < k.size(); ++x)
      k[x] = to_float(c.k[row * k.size() + x]);
    for (std::size_t a = 0; a < v.size(); ++a)
      v[a] = to_float(c.v[row * v.size() + a]);
    t.k.push_back(std::move(k));
    t.v.push_back(std::move(v));
  }
  return t;
}

/// Brute force, in double: the two-pass moments of tokens `idx` of `t` (means by direct summation, then
/// C = Σ (v_i − v̄)(k_i − k̄)ᵀ). An empty `idx` gives Moments::zeros.
inline Moments brute_moments(HeadTokens const& t, std::vector<Index> const& idx) {
  Moments m = Moments::zeros(t.dk, t.dv);
  m.n = static_cast<Index>(idx.size());
  if (m.n == 0)
    return m;
  for (Index i : idx) {
    auto const& k = t.k[static_cast<std::size_t>(i)];
    auto const& v = t.v[static_cast<std::size_t>(i)];
    for (std::size_t x = 0; x < m.km.size(); ++x)
      m.km[x] += k[x];
    for (std::size_t a = 0; a < m.vm.size(); ++a)
      m.vm[a] += v[a];
  }
  for (auto& x : m.km)
    x /= static_cast<double>(m.n);
  for (auto& x : m.vm)
    x /= static_cast<double>(m.n);
  for (Index i : idx) {
    auto const& k = t.k[static_cast<std::size_t>(i)];
    auto const& v = t.v[static_cast<std::size_t>(i)];
    for (std::size_t a = 0; a < m.vm.size(); ++a)
      for (std::size_t x = 0; x < m.km.size(); ++x)
        m.C[a * m.km.size() + x] += (v[a] - m.vm[a]) * (k[x] - m.km[x]);
  }
  return m;
}

/// brute_moments of slots `idx` of head (b, h) of a host cache (its elements widened exactly).
template <class T>
Moments brute_moments(tools::HostCache<T> const& c, Index b, Index h, std::vector<Index> const& idx) {
  return brute_moments(head_of(c, b, h, c.ext.tokens), idx);
}

/// Head bh (= b * heads + h) of a host moment state as stored, widened to double (T -> float -> double: the
/// values a kernel reads, with the state's rounding).
template <class T>
Moments stored_moments(MomentState<HostSpace, T> const& st, Index bh) {
  Index const b = bh / st.heads, h = bh % st.heads;
  Moments m = Moments::zeros(st.key_dim, st.value_dim);
  m.n = st.count[bh];
  for (std::size_t x = 0; x < m.km.size(); ++x)
    m.km[x] = to_float(st.key_mean_of(b, h)[x]);
  for (std::size_t a = 0; a < m.vm.size(); ++a)
    m.vm[a] = to_float(st.value_mean_of(b, h)[a]);
  for (std::size_t i = 0; i < m.C.size(); ++i)
    m.C[i] = to_float(st.comoment_of(b, h)[i]);
  return m;
}

/// An owned, zeroed host moment state of element type T for `b` x `h` heads of dims dk, dv (`state` points into
/// the vectors: count [b, h], km [b, h, dk], vm [b, h, dv], cm [b, h, dv, dk]).
template <class T = float>
struct OwnedMoments {
  using value_type = T;
  std::vector<Index> count;
  std::vector<T> km, vm, cm;
  MomentState<HostSpace, T> state;
  OwnedMoments(Index b, Index h, Index dk, Index dv)
      : count(static_cast<std::size_t>(b * h), 0),
        km(static_cast<std::size_t>(b * h * dk), from_float<T>(0.0f)),
        vm(static_cast<std::size_t>(b * h * dv), from_float<T>(0.0f)),
        cm(static_cast<std::size_t>(b * h * dk * dv), from_float<T>(0.0f)),
        state{count.data(), km.data(), vm.data(), cm.data(), b, h, dk, dv} {}
  OwnedMoments(OwnedMoments const&) = delete;
  /// Stores `m` (shaped dk, dv) as head bh, each entry rounded double -> float -> T.
  void set(Index bh, Moments const& m) {
    count[static_cast<std::size_t>(bh)] = m.n;
    for (std::size_t x = 0; x < m.km.size(); ++x)
      km[static_cast<std::size_t>(bh) * m.km.size() + x] = from_float<T>(static_cast<float>(m.km[x]));
    for (std::size_t a = 0; a < m.vm.size(); ++a)
      vm[static_cast<std::size_t>(bh) * m.vm.size() + a] = from_float<T>(static_cast<float>(m.vm[a]));
    for (std::size_t i = 0; i < m.C.size(); ++i)
      cm[static_cast<std::size_t>(bh) * m.C.size() + i] = from_float<T>(static_cast<float>(m.C[i]));
  }
  /// Head bh as stored, in double (stored_moments).
  Moments get(Index bh) const { return stored_moments(state, bh); }
};

/// Element-wise |a − b| <= tol · max(1, max|b|), the sizes equal (false on any NaN).
inline bool close(std::vector<double> const& a, std::vector<double> const& b, double tol) {
  if (a.size() != b.size())
    return false;
  double s = 1.0;
  for (double y : b)
    s = std::max(s, std::abs(y));
  for (std::size_t i = 0; i < a.size(); ++i)
    if (!(std::abs(a[i] - b[i]) <= tol * s))
      return false;
  return true;
}

/// Equal counts and k̄, v̄, C each close (above) to b's at `tol`, relative to each array's own max(1, max|b|).
inline bool close(Moments const& a, Moments const& b, double tol) {
  return a.n == b.n && close(a.km, b.km, tol) && close(a.vm, b.vm, tol) && close(a.C, b.C, tol);
}

/// ‖r_j‖ in double for token j of `t`: r_j = v_j − v̄ − (c/n) C̃ k_j, where C̃ zeroes the entries with |C| < tau
/// (tau = 0: none); with m.n = 0, r_j = v_j.
inline double residual_norm(HeadTokens const& t, Index j, Moments const& m, double c, double tau = 0.0) {
  auto const& k = t.k[static_cast<std::size_t>(j)];
  auto const& v = t.v[static_cast<std::size_t>(j)];
  double ss = 0.0;
  for (std::size_t a = 0; a < v.size(); ++a) {
    double r = v[a];
    if (m.n > 0) {
      r -= m.vm[a];
      for (std::size_t x = 0; x < k.size(); ++x) {
        double const cx = m.C[a * k.size() + x];
        if (!(std::abs(cx) < tau))
          r -= c / static_cast<double>(m.n) * cx * k[x];
      }
    }
    ss += r * r;
  }
  return std::sqrt(ss);
}

/// residual_norm of slot j of head (b, h) of a host cache (its elements widened exactly).
template <class T>
double residual_norm(tools::HostCache<T> const& cache, Index b, Index h, Index j, Moments const& m, double c,
                     double tau = 0.0) {
  return residual_norm(head_of(cache, b, h, j + 1), j, m, c, tau);
}

/// Shuffles `v` in place, Fisher–Yates from the back with rng.next() % (i + 1): the draw order the moment tests'
/// seeded cases are built with.
inline void shuffle(std::vector<Index>& v, tools::Rng& rng) {
  for (Index i = static_cast<Index>(v.size()) - 1; i > 0; --i)
    std::swap(v[static_cast<std::size_t>(i)], v[static_cast<std::size_t>(rng.next() % (i + 1))]);
}

/// fp32 window queries [B, Hq, w, dk] (e = {B, Hq, w, dk}), each entry scale · N(0, 1) from tools::random_values.
inline OwnedQueries<float> random_queries(KVExtents e, std::uint64_t seed, float scale) {
  OwnedQueries<float> q(e);
  auto const v = tools::random_values<float>(static_cast<Index>(q.data.size()), seed, scale);
  std::copy(v.begin(), v.end(), q.data.begin());
  return q;
}

}  // namespace kvc::test
