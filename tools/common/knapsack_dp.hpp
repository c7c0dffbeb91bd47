// SPDX-License-Identifier: Apache-2.0
// tools/common/knapsack_dp.hpp: the optimal multiple-choice knapsack DP over RDKV's hull options, a test reference for
// the library's solvers (kvc/rate_distortion/knapsack.hpp: exact_bits, lagrangian_bits). It allocates O(n · budget), so
// it lives with the tools, not in the engine library.
#pragma once

#include <kvc/core/extents.hpp>
#include <kvc/core/status.hpp>
#include <kvc/rate_distortion/knapsack.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

namespace kvc::tools {

/// Exact multiple-choice knapsack DP over the hull options (optimal among allocations on the hull with Σ bits <=
/// budget_bits; for a convex table, every real one, that is optimal over all of {0, 2, 4, 8, 16}). O(n · C)
/// time and memory with C = budget_bits / 2 + 1 capacities (capped at what all-16 needs); refuses (invalid_argument)
/// when n · C > dp_cell_limit. Allocates (std::vector: n · C choices + two rows): a reference for tests and
/// small cases, not for kernels. Ties: options are scanned in increasing bits and only a strict improvement
/// replaces the best, and the choices are read back from the last unit to the first, so among equal optima the
/// last unit takes the fewest bits, then the one before it, and so on. Errors as exact_bits.
inline Status dp_bits(float const* w, Index n, EpsilonTable const& eps, BitOptions opt, std::int64_t budget_bits,
                      std::int8_t* bits, std::int64_t dp_cell_limit = std::int64_t{1} << 26) {
  KVC_RETURN_IF_ERROR(kvc::detail::check_knapsack(w, n, eps, bits,
                                                  "kvc::tools::dp_bits: `w` and `bits` ([n]) must be "
                                                  "non-null and n >= 0",
                                                  "kvc::tools::dp_bits: `w` must be finite and >= 0"));
  if (budget_bits < 0)
    return {Errc::invalid_argument, "kvc::tools::dp_bits: `budget_bits` must be >= 0"};
  kvc::detail::RDHull const h = kvc::detail::rd_hull(eps, opt);
  std::int64_t const floor = h.floor_bits();
  if (floor > 0 && budget_bits / floor < n)
    return {Errc::invalid_argument, "kvc::tools::dp_bits: `budget_bits` must be >= 2 * n when options.evict is false"};
  if (n == 0)
    return {};
  // Capacities in units of 2 bits above the floor (every option is even).
  std::int64_t cap = (budget_bits - floor * n) / 2;
  cap = std::min(cap, (16 - floor) / 2 * n);
  if (cap + 1 > dp_cell_limit / n)
    return {Errc::invalid_argument, "kvc::tools::dp_bits: n * (budget_bits / 2 + 1) exceeds `dp_cell_limit`"};
  auto const cells = static_cast<std::size_t>(cap + 1);
  std::vector<double> prev(cells, 0.0), cur(cells);
  std::vector<std::int8_t> choice(static_cast<std::size_t>(n) * cells);
  for (Index u = 0; u < n; ++u) {
    double const wu = static_cast<double>(w[u]);
    for (std::int64_t c = 0; c <= cap; ++c) {
      double best = std::numeric_limits<double>::infinity();
      int pick = 0;
      for (int k = 0; k < h.count; ++k) {
        std::int64_t const ck = (h.bits[k] - floor) / 2;
        if (ck > c)
          break;
        double const v = prev[static_cast<std::size_t>(c - ck)] + wu * h.eps[k];
        if (v < best) {
          best = v;
          pick = k;
        }
      }
      cur[static_cast<std::size_t>(c)] = best;
      choice[static_cast<std::size_t>(u) * cells + static_cast<std::size_t>(c)] = static_cast<std::int8_t>(pick);
    }
    std::swap(prev, cur);
  }
  std::int64_t c = cap;
  for (Index u = n - 1; u >= 0; --u) {
    int const k = choice[static_cast<std::size_t>(u) * cells + static_cast<std::size_t>(c)];
    bits[u] = h.bits[k];
    c -= (h.bits[k] - floor) / 2;
  }
  return {};
}

}  // namespace kvc::tools
