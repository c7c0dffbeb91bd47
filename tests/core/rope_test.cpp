// SPDX-License-Identifier: Apache-2.0
// tests/core/rope_test.cpp mirrors include/kvc/core/rope.hpp and include/kvc/pipeline/rerotate.hpp.
#include <kvc/core/rope.hpp>
#include <kvc/pipeline/rerotate.hpp>

#include "common/synthetic.hpp"
#include "support/catch.hpp"
#include "support/helpers.hpp"

#include <cmath>
#include <vector>

using Catch::Matchers::WithinAbs;
using kvc::Index;

TEST_CASE("rope: neox pairs (i, i + d/2), interleaved pairs (2i, 2i + 1) (hand values)", "[core][rope]") {
  kvc::RopeSpec neox{.theta = 100.0};
  std::vector<float> x = {1, 2, 3, 4};  // d = 4: frequencies 1 and 1/10
  kvc::rope_rotate(neox, x.data(), 4, 2.0);
  CHECK_THAT(x[0], WithinAbs(1 * std::cos(2.0) - 3 * std::sin(2.0), 1e-6));
  CHECK_THAT(x[2], WithinAbs(3 * std::cos(2.0) + 1 * std::sin(2.0), 1e-6));
  CHECK_THAT(x[1], WithinAbs(2 * std::cos(0.2) - 4 * std::sin(0.2), 1e-6));
  kvc::RopeSpec gptj{.theta = 100.0, .style = kvc::RopeStyle::interleaved};
  std::vector<float> y = {1, 2, 3, 4};
  kvc::rope_rotate(gptj, y.data(), 4, 2.0);
  CHECK_THAT(y[0], WithinAbs(1 * std::cos(2.0) - 2 * std::sin(2.0), 1e-6));
  CHECK_THAT(y[1], WithinAbs(2 * std::cos(2.0) + 1 * std::sin(2.0), 1e-6));
  CHECK_THAT(y[3], WithinAbs(4 * std::cos(0.2) + 3 * std::sin(0.2), 1e-6));
  CHECK(kvc::RopeSpec{.rotary_dim = 3}.check(4).ok() == false);
}

TEST_CASE("rope: the logit depends only on the position difference", "[core][rope]") {
  kvc::RopeSpec const spec{};
  kvc::tools::Rng rng(1);
  std::vector<float> q(16), k(16);
  for (Index i = 0; i < 16; ++i) {
    q[static_cast<std::size_t>(i)] = rng.normal();
    k[static_cast<std::size_t>(i)] = rng.normal();
  }
  auto logit = [&](double pq, double pk) {
    auto a = q, b = k;
    kvc::rope_rotate(spec, a.data(), 16, pq);
    kvc::rope_rotate(spec, b.data(), 16, pk);
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
    kvc::RopeSpec const spec{.theta = 10000.0, .style = style};
    auto pre = kvc::tools::HostCache<float>::random({1, 1, 10, 8}, 2);
    auto cache = pre;  // post-RoPE: each key rotated at its position
    for (Index t = 0; t < 10; ++t)
      kvc::rope_rotate(spec, cache.key(0, 0, t), 8, static_cast<double>(t));
    // Keep {0, 1, 6, 7, 8, 9} (StreamingLLM, 2 sinks), compact by hand, then re-rotate.
    std::vector<Index> idx = {0, 1, 6, 7, 8, 9};
    for (Index j = 0; j < 6; ++j)
      std::copy_n(cache.key(0, 0, idx[static_cast<std::size_t>(j)]), 8, cache.key(0, 0, j));
    kvc::test::OwnedPlan plan(1, 1, 10);
    plan.count[0] = 6;
    std::copy(idx.begin(), idx.end(), plan.index.begin());
    kvc::test::OwnedWorkspace ws(kvc::rerotate_workspace_bytes(8));
    REQUIRE(kvc::rerotate_keys(spec, plan.plan, cache.view().keys, ws.get()).ok());
    for (Index j = 0; j < 6; ++j) {
      std::vector<float> expect(pre.key(0, 0, idx[static_cast<std::size_t>(j)]),
                                pre.key(0, 0, idx[static_cast<std::size_t>(j)]) + 8);
      kvc::rope_rotate(spec, expect.data(), 8, static_cast<double>(j));
      for (Index i = 0; i < 8; ++i)
        CHECK_THAT(cache.key(0, 0, j)[i], WithinAbs(expect[static_cast<std::size_t>(i)], 1e-5));
    }
  }
}
