// SPDX-License-Identifier: Apache-2.0
// tests/calibration/matrix_entropy_test.cpp mirrors include/kvc/calibration/matrix_entropy.hpp: UNComp's truncated
// matrix entropy (shared/specs/uncomp.md §2.2-2.4, §7.1-7.4, §7.19, §9 and §8 properties 1-9).
// Expected values come from the spec's closed forms (isotropic: H_32 = 1.2130076, erank_32 = 3.3635857; two equal
// directions: ln 2), from hand cases (a 2-d covariance with λ = (0.9, 0.1); the 1e-10 ridge written out), or from an
// independent reference here: the spectrum as squared singular values of Z / √n (Eigen's BDCSVD on the rows centred
// and normalised in double), where the library builds a SYRK and calls the symmetric eigensolver.
#include <kvc/calibration/head_groups.hpp>
#include <kvc/calibration/matrix_entropy.hpp>
#include <kvc/core/element.hpp>
#include <kvc/core/rope.hpp>

#include "common/synthetic.hpp"
#include "support/catch.hpp"
#include "support/helpers.hpp"

#include <Eigen/Dense>
#include <Eigen/SVD>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <vector>

namespace {

using Catch::Matchers::WithinAbs;
using Catch::Matchers::WithinRel;
using kvc::Index;
using kvc::MatrixEntropy;
using kvc::MatrixEntropyOptions;
using kvc::MatrixEntropySolver;

std::size_t at(Index i) {
  return static_cast<std::size_t>(i);
}

template <class T>
MatrixEntropy entropy(std::vector<T> const& rows, Index n, Index d, MatrixEntropyOptions o = {}) {
  MatrixEntropySolver s(d, o);
  MatrixEntropy e;
  kvc::Status const st = s.compute(rows.data(), n, d, e);
  INFO(st.message());
  REQUIRE(st.ok());
  return e;
}

/// Random rows [n, d] whose column c has scale 1 + c (an anisotropic cloud, so the spectrum is not flat) plus `offset`.
std::vector<float> cloud(Index n, Index d, std::uint64_t seed, float offset = 0.0f) {
  kvc::tools::Rng rng(seed);
  std::vector<float> x(at(n * d));
  for (Index r = 0; r < n; ++r)
    for (Index c = 0; c < d; ++c)
      x[at(r * d + c)] = offset + static_cast<float>(1 + c) * rng.normal();
  return x;
}

/// The reference spectrum: σ_i(Z / √n)², Z the centred (and, when `normalize`, unit) rows in double, trace-normalised,
/// descending, padded with zeros to d. Independent of the library (SVD instead of SYRK + symmetric eigensolver).
std::vector<double> svd_spectrum(std::vector<float> const& rows, Index n, Index d, bool normalize) {
  Eigen::MatrixXd z(n, d);
  for (Index r = 0; r < n; ++r)
    for (Index c = 0; c < d; ++c)
      z(r, c) = rows[at(r * d + c)];
  Eigen::RowVectorXd const mean = z.colwise().mean();
  z.rowwise() -= mean;
  if (normalize)
    for (Index r = 0; r < n; ++r)
      z.row(r) /= z.row(r).norm();
  Eigen::BDCSVD<Eigen::MatrixXd> svd(z / std::sqrt(static_cast<double>(n)));
  Eigen::VectorXd const sv = svd.singularValues();
  std::vector<double> lambda(at(d), 0.0);
  double sum = 0.0;
  for (Index i = 0; i < sv.size(); ++i)
    sum += sv[i] * sv[i];
  for (Index i = 0; i < sv.size() && i < d; ++i)
    lambda[at(i)] = sv[i] * sv[i] / sum;
  return lambda;
}

/// H_k = −Σ_{i<k} λ_i ln λ_i (0 ln 0 = 0), the spec's Eq. 5 on a given spectrum.
double h_k(std::vector<double> const& lambda, Index k) {
  double h = 0.0;
  for (Index i = 0; i < k && i < static_cast<Index>(lambda.size()); ++i)
    if (lambda[at(i)] > 0.0)
      h -= lambda[at(i)] * std::log(lambda[at(i)]);
  return h;
}

/// X = [I_d; −I_d] (n = 2d): every eigenvalue 1/d.
std::vector<float> isotropic(Index d) {
  std::vector<float> x(at(2 * d * d), 0.0f);
  for (Index i = 0; i < d; ++i) {
    x[at(i * d + i)] = 1.0f;
    x[at((d + i) * d + i)] = -1.0f;
  }
  return x;
}

/// Rows ±a·e1, ±b·e2 in d dims (n = 4).
std::vector<float> two_directions(Index d, float a = 1.0f, float b = 1.0f) {
  std::vector<float> x(at(4 * d), 0.0f);
  x[at(0 * d + 0)] = a;
  x[at(1 * d + 0)] = -a;
  x[at(2 * d + 1)] = b;
  x[at(3 * d + 1)] = -b;
  return x;
}

}  // namespace

TEST_CASE("matrix entropy: rank 1 (collinear centred rows) gives H_k = H = 0 and erank 1", "[calibration][entropy]") {
  Index const n = 50, d = 16;
  kvc::tools::Rng rng(11);
  std::vector<double> v(at(d)), b(at(d));
  for (auto& x : v)
    x = rng.normal();
  for (auto& x : b)
    x = 3.0 * rng.normal();
  std::vector<float> rows(at(n * d));
  for (Index r = 0; r < n; ++r) {
    double const a = rng.normal();  // non-constant coefficient
    for (Index c = 0; c < d; ++c)
      rows[at(r * d + c)] = static_cast<float>(a * v[at(c)] + b[at(c)]);
  }
  for (bool normalize : {true, false}) {
    MatrixEntropy const e = entropy(rows, n, d, {.top_k = 8, .normalize_rows = normalize});
    CHECK_THAT(e.truncated, WithinAbs(0.0, 1e-5));  // fp32 rows: collinear up to the rounding of a·v + b
    CHECK_THAT(e.full, WithinAbs(0.0, 1e-5));
    CHECK_THAT(e.erank, WithinAbs(1.0, 1e-5));
  }
  // Exactly collinear in fp32: a·v with v = (1, 2, ..., d) scaled by small integers.
  std::vector<float> exact(at(n * d));
  for (Index r = 0; r < n; ++r)
    for (Index c = 0; c < d; ++c)
      exact[at(r * d + c)] = static_cast<float>((r % 7 - 3) * (c + 1));
  MatrixEntropySolver s(d, {.top_k = 8});
  MatrixEntropy e;
  REQUIRE(s.compute(exact.data(), n, d, e).ok());
  CHECK_THAT(e.truncated, WithinAbs(0.0, 1e-8));
  CHECK_THAT(e.full, WithinAbs(0.0, 1e-8));
  CHECK_THAT(e.erank, WithinAbs(1.0, 1e-8));
  CHECK_THAT(s.spectrum()[0], WithinAbs(1.0, 1e-12));
  CHECK(e.k == 8);
}

TEST_CASE("matrix entropy: isotropic rows ±e_i at D = 128, k = 32 (spec property 2)", "[calibration][entropy]") {
  Index const d = 128;
  std::vector<float> const x = isotropic(d);
  for (kvc::Gram g : {kvc::Gram::automatic, kvc::Gram::features, kvc::Gram::tokens}) {
    MatrixEntropy const e = entropy(x, 2 * d, d, {.top_k = 32, .gram = g});
    CHECK_THAT(e.truncated, WithinAbs(1.2130076, 1e-7));  // (32/128) ln 128
    CHECK_THAT(e.normalized, WithinAbs(0.25, 1e-12));
    CHECK_THAT(e.erank, WithinAbs(3.3635857, 1e-7));
    CHECK_THAT(e.full, WithinAbs(std::log(128.0), 1e-12));
    CHECK_THAT(std::exp(e.full), WithinAbs(128.0, 1e-9));
    CHECK(e.k == 32);
  }
  MatrixEntropy const r = entropy(x, 2 * d, d, {.top_k = 32, .renormalize_topk = true});
  CHECK_THAT(r.truncated, WithinAbs(std::log(32.0), 1e-12));  // 3.4657359
  CHECK_THAT(r.erank, WithinAbs(32.0, 1e-9));
  CHECK_THAT(r.full, WithinAbs(std::log(128.0), 1e-12));  // the full entropy is never renormalised
}

TEST_CASE("matrix entropy: two equal directions give ln 2 for every k >= 2 (spec property 3)",
          "[calibration][entropy]") {
  Index const d = 8;
  for (float scale : {1.0f, 5.0f}) {
    std::vector<float> const x = two_directions(d, scale, scale);
    for (Index k = 1; k <= d; ++k) {
      for (kvc::Gram g : {kvc::Gram::features, kvc::Gram::tokens}) {
        MatrixEntropy const e = entropy(x, 4, d, {.top_k = k, .gram = g});
        CHECK_THAT(e.full, WithinAbs(std::log(2.0), 1e-12));
        // k = 1: only λ_1 = 1/2 counts, H_1 = (1/2) ln 2.
        CHECK_THAT(e.truncated, WithinAbs(k >= 2 ? std::log(2.0) : 0.5 * std::log(2.0), 1e-12));
        CHECK(e.k == std::min<Index>(k, 4));
      }
    }
  }
  // Row normalisation makes unequal lengths equal directions: ±3 e1, ±1 e2 still gives ln 2.
  CHECK_THAT(entropy(two_directions(d, 3.0f, 1.0f), 4, d).full, WithinAbs(std::log(2.0), 1e-12));
}

TEST_CASE("matrix entropy: covariance mode (normalize_rows = false) on a 2-d hand case", "[calibration][entropy]") {
  // Rows (3, 0), (−3, 0), (0, 1), (0, −1) plus an offset: RᵀR = diag(18, 2), λ = (0.9, 0.1).
  std::vector<float> x = two_directions(2, 3.0f, 1.0f);
  for (Index r = 0; r < 4; ++r) {
    x[at(2 * r)] += 10.0f;
    x[at(2 * r + 1)] -= 4.0f;
  }
  double const h1 = -0.9 * std::log(0.9), h2 = h1 - 0.1 * std::log(0.1);  // 0.0948244641, 0.3250829734
  MatrixEntropySolver s(2, {.top_k = 1, .normalize_rows = false});
  MatrixEntropy e;
  REQUIRE(s.compute(x.data(), 4, 2, e).ok());
  CHECK_THAT(e.truncated, WithinAbs(h1, 1e-12));
  CHECK_THAT(e.full, WithinAbs(h2, 1e-12));
  CHECK_THAT(e.full, WithinAbs(0.3250829734, 1e-9));
  CHECK_THAT(e.normalized, WithinAbs(h1 / std::log(2.0), 1e-12));
  CHECK_THAT(s.spectrum()[0], WithinAbs(0.9, 1e-14));
  CHECK_THAT(s.spectrum()[1], WithinAbs(0.1, 1e-14));
  // The default (row-normalised) mode sees two equal directions instead.
  CHECK_THAT(entropy(x, 4, 2).full, WithinAbs(std::log(2.0), 1e-12));
}

TEST_CASE("matrix entropy: the 1e-10 ridge of the authors' code, written out on a hand case",
          "[calibration][entropy]") {
  double const eps = 1e-10;
  auto f = [](double l) { return -l * std::log(l); };
  for (Index d : {4, 8}) {  // d = 4: the d x d path (n = 4 >= d); d = 8: the n x n Gram path
    std::vector<float> const x = two_directions(d);
    MatrixEntropySolver s(d, {.top_k = 2, .ridge = eps});
    MatrixEntropy e;
    REQUIRE(s.compute(x.data(), 4, d, e).ok());
    // λ = (1/2 + ε, 1/2 + ε, ε, …, ε) over all d eigenvalues (Â = A / Tr A + ε I).
    double const full = 2.0 * f(0.5 + eps) + static_cast<double>(d - 2) * f(eps);
    CHECK_THAT(e.truncated, WithinAbs(2.0 * f(0.5 + eps), 1e-15));
    CHECK_THAT(e.full, WithinAbs(full, 1e-15));
    CHECK(e.full - std::log(2.0) > 4e-9);  // the ridge's ε ln ε terms are visible
    CHECK_THAT(s.spectrum().sum(), WithinAbs(1.0 + static_cast<double>(d) * eps, 1e-15));
    CHECK_THAT(s.spectrum()[static_cast<Eigen::Index>(d - 1)], WithinAbs(eps, 1e-20));
  }
}

TEST_CASE("matrix entropy: matches an SVD reference spectrum on random rows (both modes, both paths)",
          "[calibration][entropy]") {
  for (auto [n, d] : {std::pair<Index, Index>{300, 32}, {20, 64}, {64, 64}}) {
    std::vector<float> const x = cloud(n, d, 5 + static_cast<std::uint64_t>(n), 0.5f);
    for (bool normalize : {true, false}) {
      std::vector<double> const ref = svd_spectrum(x, n, d, normalize);
      for (kvc::Gram g : {kvc::Gram::features, kvc::Gram::tokens}) {
        MatrixEntropySolver s(d, {.top_k = 8, .normalize_rows = normalize, .gram = g});
        MatrixEntropy e;
        REQUIRE(s.compute(x.data(), n, d, e).ok());
        for (Index i = 0; i < d; ++i)
          CHECK_THAT(s.spectrum()[static_cast<Eigen::Index>(i)], WithinAbs(ref[at(i)], 1e-12));
        CHECK_THAT(e.truncated, WithinRel(h_k(ref, 8), 1e-10));
        CHECK_THAT(e.full, WithinRel(h_k(ref, d), 1e-10));
        CHECK_THAT(e.erank, WithinRel(std::exp(h_k(ref, 8)), 1e-10));
        CHECK_THAT(e.normalized, WithinRel(h_k(ref, 8) / std::log(static_cast<double>(d)), 1e-10));
      }
    }
  }
}

TEST_CASE("matrix entropy: the n x n Gram path equals the d x d path for n < d at 1e-10 (spec property 6)",
          "[calibration][entropy]") {
  Index const d = 128;
  for (Index n : {2, 17, 100}) {
    std::vector<float> const x = cloud(n, d, 100 + static_cast<std::uint64_t>(n));
    for (bool normalize : {true, false}) {
      MatrixEntropySolver a(d, {.normalize_rows = normalize, .gram = kvc::Gram::tokens});
      MatrixEntropySolver b(d, {.normalize_rows = normalize, .gram = kvc::Gram::features});
      MatrixEntropySolver c(d, {.normalize_rows = normalize});  // automatic: the Gram path here
      MatrixEntropy ea, eb, ec;
      REQUIRE(a.compute(x.data(), n, d, ea).ok());
      REQUIRE(b.compute(x.data(), n, d, eb).ok());
      REQUIRE(c.compute(x.data(), n, d, ec).ok());
      // n = 2 is rank 1 (H = 0): there the d x d path's round-off eigenvalues (~1e-16) leave ~1e-14 absolute.
      CHECK_THAT(ea.truncated, WithinRel(eb.truncated, 1e-10) || WithinAbs(eb.truncated, 1e-13));
      CHECK_THAT(ea.full, WithinRel(eb.full, 1e-10) || WithinAbs(eb.full, 1e-13));
      CHECK(ec.truncated == ea.truncated);
      CHECK(ea.k == std::min<Index>(32, n));
      for (Index i = 0; i < n; ++i)
        CHECK_THAT(a.spectrum()[static_cast<Eigen::Index>(i)],
                   WithinAbs(b.spectrum()[static_cast<Eigen::Index>(i)], 1e-13));
    }
  }
}

TEST_CASE("matrix entropy: the spectrum is normalised, non-negative and descending (spec property 7)",
          "[calibration][entropy]") {
  for (auto [n, d] : {std::pair<Index, Index>{500, 64}, {10, 64}, {64, 8}}) {
    std::vector<float> const x = cloud(n, d, 77);
    for (kvc::Gram g : {kvc::Gram::features, kvc::Gram::tokens}) {
      MatrixEntropySolver s(d, {.gram = g});
      MatrixEntropy e;
      REQUIRE(s.compute(x.data(), n, d, e).ok());
      auto const& l = s.spectrum();
      REQUIRE(l.size() == d);
      CHECK_THAT(l.sum(), WithinAbs(1.0, 1e-12));
      for (Index i = 0; i < d; ++i) {
        CHECK(l[static_cast<Eigen::Index>(i)] >= 0.0);
        if (i > 0)
          CHECK(l[static_cast<Eigen::Index>(i)] <= l[static_cast<Eigen::Index>(i - 1)]);
      }
    }
  }
}

TEST_CASE("matrix entropy: bounds 0 <= H_k <= H <= ln rank <= ln D, monotone in k (spec property 4)",
          "[calibration][entropy]") {
  Index const n = 200, d = 32, rank = 5;
  kvc::tools::Rng rng(3);
  std::vector<double> basis(at(rank * d));
  for (auto& x : basis)
    x = rng.normal();
  std::vector<float> x(at(n * d));
  for (Index r = 0; r < n; ++r) {
    double coef[rank];
    for (double& c : coef)
      c = rng.normal();
    for (Index c = 0; c < d; ++c) {
      double v = 0.0;
      for (Index j = 0; j < rank; ++j)
        v += coef[j] * basis[at(j * d + c)];
      x[at(r * d + c)] = static_cast<float>(v);
    }
  }
  double previous = 0.0;
  double full = 0.0;
  for (Index k = 1; k <= d; ++k) {
    MatrixEntropy const e = entropy(x, n, d, {.top_k = k});
    full = e.full;
    CHECK(e.truncated >= 0.0);
    CHECK(e.truncated <= e.full + 1e-12);
    CHECK(e.truncated >= previous - 1e-15);
    CHECK(e.erank >= 1.0);
    CHECK(e.erank <= std::exp(e.full) + 1e-12);
    if (k >= 3)
      CHECK(e.truncated <= std::log(static_cast<double>(k)) + 1e-12);  // Eq. 47, true for k >= 3
    if (k >= rank)  // only rank eigenvalues are nonzero (fp32 rows: the rest are round-off)
      CHECK_THAT(e.truncated, WithinAbs(e.full, 1e-6));
    previous = e.truncated;
  }
  CHECK(full <= std::log(static_cast<double>(rank)) + 1e-6);
  CHECK(full > 1.0);  // a genuinely 5-dimensional cloud
  CHECK(full <= std::log(static_cast<double>(d)));
}

TEST_CASE("matrix entropy: invariant to scaling, translation, rotation and row order (spec property 5)",
          "[calibration][entropy]") {
  Index const n = 300, d = 16;
  std::vector<float> const x = cloud(n, d, 9);
  for (bool normalize : {true, false}) {
    MatrixEntropyOptions const o{.top_k = 4, .normalize_rows = normalize};
    MatrixEntropy const base = entropy(x, n, d, o);
    REQUIRE(base.truncated > 0.5);

    std::vector<float> scaled = x, scaled_exact = x, shifted = x, rotated(x.size()), permuted(x.size());
    for (float& v : scaled)
      v *= 3.7f;
    for (float& v : scaled_exact)
      v *= 4.0f;  // exact in fp32
    kvc::tools::Rng rng(21);
    std::vector<float> b(at(d));
    for (float& v : b)
      v = 5.0f * rng.normal();
    for (Index r = 0; r < n; ++r)
      for (Index c = 0; c < d; ++c)
        shifted[at(r * d + c)] += b[at(c)];
    Eigen::MatrixXd g(d, d);
    for (Index i = 0; i < d * d; ++i)
      g(i / d, i % d) = rng.normal();
    Eigen::MatrixXd const q = Eigen::HouseholderQR<Eigen::MatrixXd>(g).householderQ();
    REQUIRE((q.transpose() * q - Eigen::MatrixXd::Identity(d, d)).norm() < 1e-12);
    for (Index r = 0; r < n; ++r)
      for (Index c = 0; c < d; ++c) {
        double v = 0.0;
        for (Index j = 0; j < d; ++j)
          v += static_cast<double>(x[at(r * d + j)]) * q(j, c);
        rotated[at(r * d + c)] = static_cast<float>(v);
      }
    for (Index r = 0; r < n; ++r) {
      Index const from = (r * 37 + 11) % n;  // 37 is coprime with 300: a permutation
      std::copy_n(x.begin() + from * d, d, permuted.begin() + r * d);
    }
    auto same = [&](std::vector<float> const& y, double tol) {
      MatrixEntropy const e = entropy(y, n, d, o);
      CHECK_THAT(e.truncated, WithinRel(base.truncated, tol));
      CHECK_THAT(e.full, WithinRel(base.full, tol));
    };
    same(scaled_exact, 1e-12);
    same(permuted, 1e-12);
    same(scaled, 1e-6);  // fp32 rounding of the inputs
    same(shifted, 1e-5);
    same(rotated, 1e-5);
    CHECK(std::abs(entropy(rotated, n, d, {.top_k = 4, .normalize_rows = normalize, .tile_rows = 7}).truncated -
                   base.truncated) < 1e-5 * base.truncated);
  }
}

TEST_CASE("matrix entropy: degenerate input (n = 1, constant rows, n = 0) gives H = 0, erank 1, no NaN",
          "[calibration][entropy]") {
  Index const d = 16;
  std::vector<float> one = cloud(1, d, 4);
  std::vector<float> constant(at(10 * d));
  for (Index r = 0; r < 10; ++r)
    std::copy(one.begin(), one.end(), constant.begin() + r * d);
  for (bool normalize : {true, false}) {
    for (auto [rows, n] : {std::pair<std::vector<float> const*, Index>{&one, 1}, {&constant, 10}, {&one, 0}}) {
      MatrixEntropySolver s(d, {.normalize_rows = normalize});
      MatrixEntropy e;
      REQUIRE(s.compute(rows->data(), n, d, e).ok());
      CHECK(e.truncated == 0.0);
      CHECK(e.full == 0.0);
      CHECK(e.erank == 1.0);
      CHECK(e.normalized == 0.0);
      CHECK(e.k == std::min<Index>(d / 4, n));  // top_k 0: d / 4
      CHECK(s.spectrum().allFinite());
      CHECK(s.spectrum().sum() == 0.0);
    }
  }
  // Zero rows after centring are skipped when normalising: ±2 e1, ±e2 and two rows at the mean (0) give ln 2.
  std::vector<float> x = two_directions(8, 2.0f, 1.0f);
  x.resize(x.size() + 16, 0.0f);
  CHECK_THAT(entropy(x, 6, 8).full, WithinAbs(std::log(2.0), 1e-12));
}

TEST_CASE("matrix entropy: tiles of any size give the same matrix", "[calibration][entropy]") {
  Index const n = 1000, d = 32;
  std::vector<float> const x = cloud(n, d, 8);
  MatrixEntropy const base = entropy(x, n, d);
  for (Index tile : {1, 7, 256, 999, 1000, 4096}) {
    MatrixEntropy const e = entropy(x, n, d, {.tile_rows = tile});
    CHECK_THAT(e.truncated, WithinRel(base.truncated, 1e-12));
    CHECK_THAT(e.full, WithinRel(base.full, 1e-12));
  }
}

TEST_CASE("matrix entropy: fp16 and bf16 rows equal fp32 rows holding the same values", "[calibration][entropy]") {
  Index const n = 96, d = 32;
  std::vector<float> const x = cloud(n, d, 12);
  std::vector<kvc::half> h(x.size());
  std::vector<kvc::bfloat16> b(x.size());
  std::vector<float> hf(x.size()), bf(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) {
    h[i] = kvc::from_float<kvc::half>(x[i]);
    b[i] = kvc::from_float<kvc::bfloat16>(x[i]);
    hf[i] = kvc::to_float(h[i]);
    bf[i] = kvc::to_float(b[i]);
  }
  MatrixEntropy const eh = entropy(h, n, d), ehf = entropy(hf, n, d);
  MatrixEntropy const eb = entropy(b, n, d), ebf = entropy(bf, n, d);
  CHECK(eh.truncated == ehf.truncated);
  CHECK(eh.full == ehf.full);
  CHECK(eb.truncated == ebf.truncated);
  CHECK(eb.full == ebf.full);
  // And the rounding moves the entropy only a little (a guard that the 16-bit rows were read as such).
  MatrixEntropy const ex = entropy(x, n, d);
  CHECK_THAT(eh.truncated, WithinRel(ex.truncated, 1e-3));
  CHECK_THAT(eb.truncated, WithinRel(ex.truncated, 2e-2));
  CHECK(eh.truncated != ex.truncated);
}

TEST_CASE("matrix entropy: a row stride above dim reads only dim columns", "[calibration][entropy]") {
  Index const n = 40, d = 16, stride = 21;
  std::vector<float> const x = cloud(n, d, 13);
  std::vector<float> padded(at(n * stride), std::numeric_limits<float>::quiet_NaN());
  for (Index r = 0; r < n; ++r)
    std::copy_n(x.begin() + r * d, d, padded.begin() + r * stride);
  MatrixEntropySolver s(d);
  MatrixEntropy e;
  REQUIRE(s.compute(padded.data(), n, stride, e).ok());
  CHECK(e.truncated == entropy(x, n, d).truncated);
}

TEST_CASE("matrix entropy: a RoPE table rotates the rows first (equals pre-rotated rows)", "[calibration][entropy]") {
  Index const n = 64, d = 16;
  double const theta = 100.0;
  std::vector<float> const x = cloud(n, d, 14);
  std::vector<Index> positions(at(n));
  for (Index r = 0; r < n; ++r)
    positions[at(r)] = 3 * r + 5;
  kvc::test::OwnedRope const rope({.theta = theta}, d, 3 * n + 5);
  // Rotated by hand (neox pairs (i, i + d/2), angle p · θ^(−2i/d)), in double.
  auto rotate = [&](bool use_positions) {
    std::vector<float> y(x.size());
    for (Index r = 0; r < n; ++r) {
      double const p = static_cast<double>(use_positions ? positions[at(r)] : r);
      for (Index i = 0; i < d / 2; ++i) {
        double const angle = p * std::pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(d));
        double const a = x[at(r * d + i)], b = x[at(r * d + i + d / 2)];
        y[at(r * d + i)] = static_cast<float>(a * std::cos(angle) - b * std::sin(angle));
        y[at(r * d + i + d / 2)] = static_cast<float>(b * std::cos(angle) + a * std::sin(angle));
      }
    }
    return y;
  };
  MatrixEntropy const plain = entropy(x, n, d, {.top_k = 4});
  for (bool use_positions : {false, true}) {
    MatrixEntropySolver s(d, {.top_k = 4});
    MatrixEntropy e;
    REQUIRE(s.compute(x.data(), n, d, e, rope.table, use_positions ? positions.data() : nullptr).ok());
    MatrixEntropy const want = entropy(rotate(use_positions), n, d, {.top_k = 4});
    CHECK_THAT(e.truncated, WithinRel(want.truncated, 1e-5));
    CHECK_THAT(e.full, WithinRel(want.full, 1e-5));
    CHECK(std::abs(e.truncated - plain.truncated) > 1e-3);  // the rotation matters for these rows
  }
  // Rows identical before RoPE have no variation; after RoPE they do.
  std::vector<float> same(at(n * d));
  for (Index r = 0; r < n; ++r)
    std::copy_n(x.begin(), d, same.begin() + r * d);
  MatrixEntropySolver s(d);
  MatrixEntropy e;
  REQUIRE(s.compute(same.data(), n, d, e).ok());
  CHECK(e.full == 0.0);
  REQUIRE(s.compute(same.data(), n, d, e, rope.table).ok());
  CHECK(e.full > 0.1);
  // Positions past the table, or negative, are errors.
  std::vector<Index> bad = positions;
  bad[3] = 3 * n + 5;
  CHECK(s.compute(x.data(), n, d, e, rope.table, bad.data()).code() == kvc::Errc::invalid_argument);
  bad[3] = -1;
  CHECK(s.compute(x.data(), n, d, e, rope.table, bad.data()).code() == kvc::Errc::invalid_argument);
  kvc::test::OwnedRope const short_rope({.theta = theta}, d, n - 1);
  CHECK(s.compute(x.data(), n, d, e, short_rope.table).code() == kvc::Errc::invalid_argument);
}

TEST_CASE("matrix entropy: NaN or Inf rows are errors in both modes", "[calibration][entropy]") {
  Index const n = 20, d = 8;
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
    std::vector<float> x = cloud(n, d, 15);
    x[at(7 * d + 3)] = bad;
    for (bool normalize : {true, false})
      for (kvc::Gram g : {kvc::Gram::features, kvc::Gram::tokens}) {
        MatrixEntropySolver s(d, {.normalize_rows = normalize, .gram = g});
        MatrixEntropy e;
        CHECK(s.compute(x.data(), n, d, e).code() == kvc::Errc::non_finite);
      }
  }
}

TEST_CASE("matrix entropy: top_k 0 is the head dim / 4 (spec 7.4: 32 at d = 128)", "[calibration][entropy]") {
  for (Index d : {4, 8, 16, 128}) {
    std::vector<float> const x = cloud(2 * d + 3, d, 21);
    MatrixEntropy automatic, explicit_k;
    MatrixEntropySolver a(d, {.top_k = 0}), b(d, {.top_k = std::max<Index>(1, d / 4)});
    REQUIRE(a.compute(x.data(), 2 * d + 3, d, automatic).ok());
    REQUIRE(b.compute(x.data(), 2 * d + 3, d, explicit_k).ok());
    CHECK(automatic.k == std::max<Index>(1, d / 4));
    CHECK(automatic.truncated == explicit_k.truncated);
  }
  CHECK(kvc::resolved_top_k({}, 128) == 32);
  CHECK(kvc::resolved_top_k({}, 2) == 1);
  CHECK(kvc::resolved_top_k({.top_k = 7}, 128) == 7);
}

TEST_CASE("matrix entropy: bad arguments are errors naming them", "[calibration][entropy]") {
  Index const n = 20, d = 8;
  std::vector<float> const x = cloud(n, d, 16);
  MatrixEntropy e;
  auto code = [&](MatrixEntropyOptions o, Index dim = 8) {
    MatrixEntropySolver s(dim, o);
    return s.compute(x.data(), n, d, e).code();
  };
  CHECK(code({.top_k = -1}) == kvc::Errc::invalid_argument);
  CHECK(code({.ridge = -1e-10}) == kvc::Errc::invalid_argument);
  CHECK(code({.ridge = 1.0}) == kvc::Errc::invalid_argument);
  CHECK(code({.ridge = std::numeric_limits<double>::quiet_NaN()}) == kvc::Errc::invalid_argument);
  CHECK(code({.tile_rows = 0}) == kvc::Errc::invalid_argument);
  CHECK(code({.tile_rows = -5}) == kvc::Errc::invalid_argument);  // constructing must not crash either
  CHECK(code({}, 0) == kvc::Errc::invalid_argument);
  CHECK(code({}, -3) == kvc::Errc::invalid_argument);
  MatrixEntropySolver s(d);
  CHECK(s.compute(x.data(), -1, d, e).code() == kvc::Errc::invalid_argument);
  CHECK(s.compute(static_cast<float const*>(nullptr), n, d, e).code() == kvc::Errc::invalid_argument);
  CHECK(s.compute(x.data(), n, d - 1, e).code() == kvc::Errc::invalid_argument);
  kvc::Status const st = s.compute(x.data(), n, d - 1, e);
  CHECK(std::string(st.message()).find("stride") != std::string::npos);
  CHECK(std::string(kvc::MatrixEntropyOptions{.top_k = -1}.check().message()).find("top_k") != std::string::npos);
  CHECK(s.compute(x.data(), n, d, e).ok());  // the solver still works after errors
}

TEST_CASE("matrix entropy: calibration means over samples (spec property 9)", "[calibration][entropy]") {
  Index const heads = 4, d = 16, n = 64, samples = 5;
  // per[s][h]: sample s, head h, from the solver on distinct random rows.
  std::vector<std::vector<MatrixEntropy>> per(at(samples), std::vector<MatrixEntropy>(at(heads)));
  for (Index smp = 0; smp < samples; ++smp)
    for (Index h = 0; h < heads; ++h)
      per[at(smp)][at(h)] = entropy(cloud(n, d, 1000 + static_cast<std::uint64_t>(smp * heads + h)), n, d);
  // d identical samples: the mean is the single value.
  kvc::EntropyCalibration same(1, heads, 2);
  for (Index smp = 0; smp < samples; ++smp)
    REQUIRE(same.add(0, per[0].data()).ok());
  CHECK(same.samples(0) == samples);
  for (Index h = 0; h < heads; ++h) {
    CHECK_THAT(same.mean_truncated(0, h), WithinRel(per[0][at(h)].truncated, 1e-15));
    CHECK_THAT(same.mean_erank(0, h), WithinRel(per[0][at(h)].erank, 1e-15));
    CHECK_THAT(same.mean_normalized(0, h), WithinRel(per[0][at(h)].normalized, 1e-15));
  }
  // Forward and reverse sample order: the same means (to round-off) and the same groups; means by hand.
  kvc::EntropyCalibration fwd(2, heads, 2), rev(2, heads, 2);
  for (Index smp = 0; smp < samples; ++smp) {
    REQUIRE(fwd.add(1, per[at(smp)].data()).ok());
    REQUIRE(rev.add(1, per[at(samples - 1 - smp)].data()).ok());
  }
  CHECK(fwd.samples(0) == 0);
  CHECK(std::isnan(fwd.mean_erank(0, 0)));
  for (Index h = 0; h < heads; ++h) {
    double erank = 0.0, truncated = 0.0;
    for (Index smp = 0; smp < samples; ++smp) {
      erank += per[at(smp)][at(h)].erank;
      truncated += per[at(smp)][at(h)].truncated;
    }
    CHECK_THAT(fwd.mean_erank(1, h), WithinRel(erank / samples, 1e-14));
    CHECK_THAT(fwd.mean_truncated(1, h), WithinRel(truncated / samples, 1e-14));
    CHECK_THAT(rev.mean_erank(1, h), WithinRel(fwd.mean_erank(1, h), 1e-14));
  }
  std::vector<Index> gf(at(heads)), gr(at(heads));
  for (bool vote : {false, true}) {
    REQUIRE(fwd.groups(1, vote, gf.data()).ok());
    REQUIRE(rev.groups(1, vote, gr.data()).ok());
    CHECK(gf == gr);
  }
}
