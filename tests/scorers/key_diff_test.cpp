// SPDX-License-Identifier: Apache-2.0
// tests/scorers/key_diff_test.cpp mirrors include/kvc/scorers/key_diff.hpp (CPU kernel = the executable spec).
#include <kvc/backend/cpu/scorers/key_diff.hpp>
#include <kvc/backend/cpu/selectors/top_k.hpp>

#include "common/synthetic.hpp"
#include "support/catch.hpp"

#include <cmath>
#include <vector>

namespace {

using kvc::Index;

/// Scores one head of 2-D keys given as a flat list.
std::vector<float> key_diff_scores(std::vector<float> keys, Index dim, kvc::KeyDiffScorer s = {}) {
  Index const n = static_cast<Index>(keys.size()) / dim;
  kvc::KVExtents const e{1, 1, n, dim};
  auto const cache = kvc::dense_cache(keys.data(), keys.data(), e);
  std::vector<float> out(static_cast<std::size_t>(n));
  std::vector<std::byte> ws(kvc::score_workspace_bytes(kvc::Cpu{}, s, e) + kvc::workspace_alignment);
  REQUIRE(kvc::score(kvc::Cpu{}, s, cache, kvc::ScoreSpan<>{out.data(), 1, 1, n}, {ws.data(), ws.size()}).ok());
  return out;
}

}  // namespace

TEST_CASE("key_diff: spec closed form 1, K = [(1,0),(0,1),(1,1)]", "[scorers][key_diff]") {
  auto const s = key_diff_scores({1, 0, 0, 1, 1, 1}, 2);
  CHECK_THAT(s[0], Catch::Matchers::WithinAbs(-1.0 / std::sqrt(2.0), 1e-6));
  CHECK_THAT(s[1], Catch::Matchers::WithinAbs(-1.0 / std::sqrt(2.0), 1e-6));
  CHECK_THAT(s[2], Catch::Matchers::WithinAbs(-1.0, 1e-6));
}
