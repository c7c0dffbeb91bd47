// SPDX-License-Identifier: Apache-2.0
// tests/install_consumer/main.cpp: compiled against the installed headers only.
#include <kvc/kvc.hpp>

#include <cstdio>
#include <vector>

int main() {
  std::vector<float> k = {1, 0, 0, 1, 1, 1}, v(6), scores(3);
  auto const cache = kvc::dense_cache(k.data(), v.data(), {1, 1, 3, 2});
  kvc::Status const st =
      kvc::score(kvc::Cpu{}, kvc::KnormScorer{}, cache, kvc::ScoreSpan<>{scores.data(), 1, 1, 3}, {});
  std::printf("consumer: %s %.3f\n", st.message(), static_cast<double>(scores[2]));
  return st.ok() && scores[0] == -1.0f ? 0 : 1;
}
