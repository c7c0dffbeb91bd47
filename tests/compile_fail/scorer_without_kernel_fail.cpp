// SPDX-License-Identifier: Apache-2.0
// Compile-fail twin: a scorer whose CPU kernel header was not included gets one fix-it diagnostic.
// EXPECT: this scorer has no kernel for this backend; include <kvc/backend/cpu/scorers/NAME.hpp>
#include <kvc/backend/cpu/scorers/knorm.hpp>
#include <kvc/scorers/key_diff.hpp>  // the definition only: no Kernel<KeyDiffScorer, Cpu>

#include <vector>

int main() {
  std::vector<float> k(8), v(8), out(2);
  auto const cache = kvc::dense_cache(k.data(), v.data(), {1, 1, 2, 4});
#if defined(KVC_SHOULD_FAIL)
  kvc::KeyDiffScorer const scorer{};
#else
  kvc::KnormScorer const scorer{};
#endif
  return kvc::score(kvc::Cpu{}, scorer, cache, kvc::ScoreSpan<>{out.data(), 1, 1, 2}, {}).ok() ? 0 : 1;
}
