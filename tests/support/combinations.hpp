// SPDX-License-Identifier: Apache-2.0
// tests/support/combinations.hpp: the combinations of factor values a parametrised test case runs (every one, or a
// pairwise covering where the full product is too slow, as under the CUDA emulator).
#pragma once

#include <cstddef>
#include <vector>

namespace kvc::test {

/// One combination: the index of a value of each factor.
using Combination = std::vector<std::size_t>;

/// Every combination of factors with sizes[f] values each (every size >= 1), in row-major order (the last factor
/// varies fastest).
inline std::vector<Combination> all_combinations(std::vector<std::size_t> const& sizes) {
  std::vector<Combination> out;
  Combination c(sizes.size(), 0);
  for (;;) {
    out.push_back(c);
    std::size_t f = sizes.size();
    while (f > 0 && ++c[f - 1] == sizes[f - 1])
      c[--f] = 0;
    if (f == 0)
      return out;
  }
}

/// A pairwise covering of factors with sizes[f] values each: for any two factors, every pair of their values is in at
/// least one combination. Greedy: each step takes the first combination (row-major order) that covers the most pairs
/// not yet covered, so the result is deterministic; for small factors it is at or near the minimum, the product of
/// the two largest sizes.
inline std::vector<Combination> pairwise_combinations(std::vector<std::size_t> const& sizes) {
  std::size_t const n = sizes.size();
  if (n < 2)
    return all_combinations(sizes);
  // covered[f][g][a * sizes[g] + b], f < g: the pair (value a of factor f, value b of factor g) is in the result.
  std::vector<std::vector<std::vector<char>>> covered(n, std::vector<std::vector<char>>(n));
  std::size_t uncovered = 0;
  for (std::size_t f = 0; f < n; ++f)
    for (std::size_t g = f + 1; g < n; ++g) {
      covered[f][g].assign(sizes[f] * sizes[g], 0);
      uncovered += sizes[f] * sizes[g];
    }
  auto const gain = [&](Combination const& c) {
    std::size_t k = 0;
    for (std::size_t f = 0; f < n; ++f)
      for (std::size_t g = f + 1; g < n; ++g)
        k += covered[f][g][c[f] * sizes[g] + c[g]] == 0;
    return k;
  };
  std::vector<Combination> const candidates = all_combinations(sizes);
  std::vector<Combination> out;
  while (uncovered > 0) {
    std::size_t best = 0, best_gain = 0;
    for (std::size_t i = 0; i < candidates.size(); ++i)
      if (std::size_t const k = gain(candidates[i]); k > best_gain) {
        best = i;
        best_gain = k;
      }
    Combination const& c = candidates[best];
    for (std::size_t f = 0; f < n; ++f)
      for (std::size_t g = f + 1; g < n; ++g)
        covered[f][g][c[f] * sizes[g] + c[g]] = 1;
    uncovered -= best_gain;
    out.push_back(c);
  }
  return out;
}

/// The combinations a CUDA parity case runs: every one on a device; under the CUDA emulator, which runs every thread
/// of every block on a CPU core (minutes per case under the sanitizers), a pairwise covering. The emulator is there
/// to catch barriers, warps, races and out-of-bounds accesses on every commit; the whole product runs on a GPU
/// (tools/gpu_check.sh).
inline std::vector<Combination> parity_combinations(std::vector<std::size_t> const& sizes) {
#if defined(KVC_CUDA_EMULATION) && KVC_CUDA_EMULATION
  return pairwise_combinations(sizes);
#else
  return all_combinations(sizes);
#endif
}

}  // namespace kvc::test
