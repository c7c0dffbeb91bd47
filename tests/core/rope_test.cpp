// SPDX-License-Identifier: Apache-2.0
// tests/core/rope_test.cpp mirrors include/kvc/core/rope.hpp and include/kvc/pipeline/rerotate.hpp.
#include <kvc/backend/cpu/pipeline/compact.hpp>
#include <kvc/backend/cpu/pipeline/rerotate.hpp>
#include <kvc/core/rope.hpp>

#include "common/synthetic.hpp"
#include "support/catch.hpp"
#include "support/helpers.hpp"

#include <cmath>
#include <vector>

using Catch::Matchers::WithinAbs;
using kvc::Index;

TEST_CASE("rope: neox pairs (i, i + d/2), interleaved pairs (2i, 2i + 1) (hand values)", "[core][rope]") {
  kvc::test::OwnedRope const neox({.theta = 100.0}, 4, 3);  // d = 4: frequencies 1 and 1/10
  std::vector<float> x = {1, 2, 3, 4};
  neox.table.rotate(x.data(), 2);
  CHECK_THAT(x[0], WithinAbs(1 * std::cos(2.0) - 3 * std::sin(2.0), 1e-6));
  CHECK_THAT(x[2], WithinAbs(3 * std::cos(2.0) + 1 * std::sin(2.0), 1e-6));
  CHECK_THAT(x[1], WithinAbs(2 * std::cos(0.2) - 4 * std::sin(0.2), 1e-6));
  neox.table.rotate(x.data(), 2, /*inverse=*/true);
  CHECK_THAT(x[0], WithinAbs(1.0, 1e-6));
  CHECK_THAT(x[3], WithinAbs(4.0, 1e-6));
  kvc::test::OwnedRope const gptj({.theta = 100.0, .style = kvc::RopeStyle::interleaved}, 4, 3);
  std::vector<float> y = {1, 2, 3, 4};
  gptj.table.rotate(y.data(), 2);
  CHECK_THAT(y[0], WithinAbs(1 * std::cos(2.0) - 2 * std::sin(2.0), 1e-6));
  CHECK_THAT(y[1], WithinAbs(2 * std::cos(2.0) + 1 * std::sin(2.0), 1e-6));
  CHECK_THAT(y[3], WithinAbs(4 * std::cos(0.2) + 3 * std::sin(0.2), 1e-6));
  CHECK(kvc::RopeSpec{.rotary_dim = 3}.check(4).ok() == false);
  CHECK(kvc::check_rope_table(neox.table, 4, 3).code() == kvc::Errc::invalid_argument);  // position 3 not in table
}

TEST_CASE("rope: llama3 scaling divides long wavelengths by the factor and keeps short ones (hand values)",
          "[core][rope]") {
  // theta 500000, r = 128, factor 8, low 1, high 4, original 8192: pair 0 (wavelength 2 pi) is kept; the last pair
  // (wavelength 2 pi * 500000^(126/128) > 8192) is divided by 8.
  std::vector<float> f(64);
  kvc::llama3_inv_freq(500000.0, 128, 8.0, 1.0, 4.0, 8192.0, f.data());
  CHECK_THAT(f[0], WithinAbs(1.0, 1e-7));
  CHECK_THAT(f[63], WithinAbs(std::pow(500000.0, -126.0 / 128.0) / 8.0, 1e-12));
  // A medium wavelength interpolates: smooth = (8192 / wavelen - 1) / 3, between f / 8 and f.
  for (Index i = 0; i < 64; ++i) {
    double const base = std::pow(500000.0, -2.0 * static_cast<double>(i) / 128.0);
    CHECK(f[static_cast<std::size_t>(i)] <= base * (1 + 1e-6));
    CHECK(f[static_cast<std::size_t>(i)] >= base / 8.0 * (1 - 1e-6));
  }
}

TEST_CASE("rope: the logit depends only on the position difference", "[core][rope]") {
  kvc::test::OwnedRope const rope({}, 16, 200);
  kvc::tools::Rng rng(1);
  std::vector<float> q(16), k(16);
  for (Index i = 0; i < 16; ++i) {
    q[static_cast<std::size_t>(i)] = rng.normal();
    k[static_cast<std::size_t>(i)] = rng.normal();
  }
  auto logit = [&](Index pq, Index pk) {
    auto a = q, b = k;
    rope.table.rotate(a.data(), pq);
    rope.table.rotate(b.data(), pk);
    double s = 0;
    for (Index i = 0; i < 16; ++i)
      s += double{a[static_cast<std::size_t>(i)]} * b[static_cast<std::size_t>(i)];
    return s;
  };
  CHECK_THAT(logit(10, 4), WithinAbs(logit(106, 100), 1e-4));
}

TEST_CASE("rerotate: kept keys equal pre-RoPE keys rotated at their new slots (kvpress rerotation test)",
          "[pipeline][rerotate]") {
  for (auto style : {kvc::RopeStyle::neox, kvc::RopeStyle::interleaved}) {
    kvc::test::OwnedRope const rope({.theta = 10000.0, .style = style}, 8, 10);
    auto pre = kvc::tools::HostCache<float>::random({1, 1, 10, 8}, 2);
    auto cache = pre;  // post-RoPE: each key rotated at its position, positions tracked by the cache
    cache.track(10);
    for (Index t = 0; t < 10; ++t)
      rope.table.rotate(cache.key(0, 0, t), t);
    // Keep {0, 1, 6, 7, 8, 9} (StreamingLLM, 2 sinks): compaction moves positions too, then re-rotate.
    std::vector<Index> idx = {0, 1, 6, 7, 8, 9};
    kvc::test::OwnedPlan plan(1, 1, 10);
    plan.count[0] = 6;
    std::copy(idx.begin(), idx.end(), plan.index.begin());
    REQUIRE(kvc::compact(kvc::Cpu{}, plan.plan, cache.view()).ok());
    CHECK(cache.lengths[0] == 6);
    CHECK(std::vector<Index>(cache.positions.begin(), cache.positions.begin() + 6) == idx);
    REQUIRE(kvc::rerotate_keys(kvc::Cpu{}, rope.table, cache.view()).ok());
    for (Index j = 0; j < 6; ++j) {
      CHECK(cache.positions[static_cast<std::size_t>(j)] == j);
      std::vector<float> expect(pre.key(0, 0, idx[static_cast<std::size_t>(j)]),
                                pre.key(0, 0, idx[static_cast<std::size_t>(j)]) + 8);
      rope.table.rotate(expect.data(), j);
      for (Index i = 0; i < 8; ++i)
        CHECK_THAT(cache.key(0, 0, j)[i], WithinAbs(expect[static_cast<std::size_t>(i)], 1e-5));
    }
  }
}
