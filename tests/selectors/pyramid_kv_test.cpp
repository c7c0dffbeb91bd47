// SPDX-License-Identifier: Apache-2.0
// tests/selectors/pyramid_kv_test.cpp mirrors include/kvc/selectors/pyramid_kv.hpp: the per-layer schedules of
// original_baselines.md §6.6 (worked examples) and the properties of §6.5.
#include <kvc/backend/cpu/selectors/ada_kv.hpp>
#include <kvc/backend/cpu/selectors/top_k.hpp>
#include <kvc/selectors/pyramid_kv.hpp>

#include "support/catch.hpp"
#include "support/helpers.hpp"

#include <numeric>
#include <random>
#include <vector>

namespace {

using kvc::Index;
using kvc::Reference;

std::vector<Index> schedule(Reference ref, Index n, Index c, double ratio, Index w, Index beta, Index layers) {
  std::vector<Index> out;
  for (Index l = 0; l < layers; ++l) {
    kvc::PyramidKVBudget const b{l, layers, w, beta, ref, c, ratio};
    REQUIRE(b.check().ok());
    out.push_back(b.keep(0, 0, n));
  }
  return out;
}

double mean(std::vector<Index> const& v) {
  double s = 0;
  for (Index x : v)
    s += static_cast<double>(x);
  return s / static_cast<double>(v.size());
}

}  // namespace

TEST_CASE("PyramidKV authors: the small worked examples of §6.6") {
  CHECK(schedule(Reference::authors, 100, 30, 0, 4, 5, 4) == std::vector<Index>{51, 37, 23, 9});
  CHECK(schedule(Reference::authors, 50, 30, 0, 4, 5, 4) == std::vector<Index>(4, 30));  // N < 2B: uniform
}

TEST_CASE("PyramidKV authors: the 32-layer worked examples of §6.6") {
  auto const a = schedule(Reference::authors, 8000, 2048, 0, 8, 20, 32);
  CHECK(a.front() == 3986);
  CHECK(a[1] == 3861);
  CHECK(a.back() == 111);
  CHECK(mean(a) == 2048.5);
  auto const b = schedule(Reference::authors, 8000, 2048, 0, 64, 20, 32);
  CHECK(b.front() == 3933);
  CHECK(b.back() == 182);
  CHECK(mean(b) == 2057.5);
  CHECK(schedule(Reference::authors, 3000, 2048, 0, 8, 20, 32) == std::vector<Index>(32, 2048));
  CHECK(schedule(Reference::authors, 1500, 2048, 0, 8, 20, 32) == std::vector<Index>(32, 1500));
  auto const c = schedule(Reference::authors, 4096, 128, 0, 8, 20, 32);
  CHECK(c.front() == 242);
  CHECK(c[1] == 235);
  CHECK(c.back() == 25);
  CHECK(mean(c) == 133.5);
}

TEST_CASE("PyramidKV kvpress: the worked examples of §6.6 and §2.9") {
  CHECK(schedule(Reference::kvpress, 100, 0, 0.7, 4, 5, 4) == std::vector<Index>{54, 38, 22, 6});
  CHECK(schedule(Reference::kvpress, 50, 0, 0.4, 4, 5, 4) == std::vector<Index>{46, 35, 25, 14});
  CHECK(schedule(Reference::kvpress, 4096, 0, 1.0 - 128.0 / 4096.0, 64, 20, 32) == std::vector<Index>(32, 128));
  auto const a = schedule(Reference::kvpress, 4096, 0, 0.5, 64, 20, 32);
  CHECK(a.front() == 3994);
  CHECK(a.back() == 102);
  CHECK(mean(a) == Approx(2048).epsilon(1e-3));
}

TEST_CASE("PyramidKV properties of §6.5") {
  for (Index n : {1024, 2787, 4096, 6591, 8192})
    for (Index layers : {32, 64})
      for (double r : {0.1, 0.3, 0.5, 0.8}) {
        auto const kv = schedule(Reference::kvpress, n, 0, r, 64, 20, layers);
        CHECK(mean(kv) == Approx(static_cast<double>(n) * (1 - r)).epsilon(1e-3));
        Index const c = static_cast<Index>(static_cast<double>(n) * (1 - r));
        auto const au = schedule(Reference::authors, n, c, 0, 8, 20, layers);
        for (std::size_t l = 1; l < au.size(); ++l)
          CHECK(au[l] <= au[l - 1]);
        if (n >= 2 * (c - 8)) {
          CHECK(mean(au) - static_cast<double>(c) >= 0);
          CHECK(mean(au) - static_cast<double>(c) < static_cast<double>(layers - 1) / 2);
        }
      }
  // The branch boundaries sit at N = C and N = 2B.
  CHECK(schedule(Reference::authors, 29, 30, 0, 4, 5, 4) == std::vector<Index>(4, 29));
  CHECK(schedule(Reference::authors, 30, 30, 0, 4, 5, 4) == std::vector<Index>(4, 30));
  CHECK(schedule(Reference::authors, 51, 30, 0, 4, 5, 4) == std::vector<Index>(4, 30));
  CHECK(schedule(Reference::authors, 52, 30, 0, 4, 5, 4).front() > 30);
}

TEST_CASE("PyramidKV: bad schedules are refused with the parameter's name") {
  auto message = [](kvc::PyramidKVBudget const& b) { return std::string(b.check().message()); };
  CHECK(message({4, 4}).find("layer") != std::string::npos);
  CHECK(message({0, 0}).find("num_layers") != std::string::npos);
  CHECK(message({0, 4, 8, 0}).find("beta") != std::string::npos);
  CHECK(message({0, 4, 8, 20, Reference::authors, 0, 1.5}).find("compression_ratio") != std::string::npos);
  CHECK(message({0, 4, 8, 20, Reference::kvpress, 128, 0.5}).find("capacity") != std::string::npos);
  CHECK(kvc::PyramidKVBudget{0, 4, 8, 20, Reference::kvpress, 0, 0.5}.check().ok());
}

TEST_CASE("PyramidKV composes with both selectors: each layer's budget, uniform or spread by AdaKV") {
  Index const heads = 4, n = 100, layers = 4;
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  std::vector<float> s(static_cast<std::size_t>(heads * n));
  for (float& x : s)
    x = u(rng) * u(rng);
  kvc::ScoreSpan<> const span{s.data(), 1, heads, n};
  std::vector<Index> const layer_keep{54, 38, 22, 6};  // §6.6: kvpress, N = 100, r = 0.7, w = 4, beta = 5, L = 4
  for (Index l = 0; l < layers; ++l) {
    kvc::PyramidKVBudget const b{l, layers, 4, 5, Reference::kvpress, 0, 0.7};
    kvc::test::OwnedPlan plan(1, heads, n);
    kvc::TopKSelector const top{b, 0, 4};
    kvc::test::OwnedWorkspace ws(kvc::select_workspace_bytes(kvc::Cpu{}, top, 1, heads, n));
    REQUIRE(kvc::select(kvc::Cpu{}, top, span, plan.plan, ws.get()).ok());
    CHECK(plan.count == std::vector<Index>(heads, layer_keep[static_cast<std::size_t>(l)]));
    // AdaKV inside the layer (kvpress: exactly heads x the layer's budget, spread unevenly).
    kvc::AdaKVSelector const ada{b, 0.2, Reference::kvpress};
    std::vector<Index> table(heads);
    kvc::test::OwnedWorkspace aws(kvc::select_workspace_bytes(kvc::Cpu{}, ada, 1, heads, n));
    REQUIRE(kvc::allocate(kvc::Cpu{}, ada, span, table.data(), aws.get()).ok());
    CHECK(std::accumulate(table.begin(), table.end(), Index{0}) == heads * layer_keep[static_cast<std::size_t>(l)]);
  }
}
