// SPDX-License-Identifier: Apache-2.0
// tests/support/vectors.hpp: reading the NumPy oracle's vectors (tools/reference/make_vectors.py, written by the
// ctest fixture kvc.reference.vectors) and comparing scores and kept sets with them, with one rule for near-ties.
#pragma once

#include <kvc/core/keep_plan.hpp>

#include "io/npy.hpp"
#include "support/catch.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <iterator>
#include <set>
#include <string>
#include <vector>

namespace kvc::test {

inline std::string const vectors_dir = KVC_VECTORS_DIR;

inline NpyArray load(std::string const& path) {
  NpyArray a;
  std::string error;
  bool const ok = read_npy(path, a, error);
  INFO(path << ": " << error);
  REQUIRE(ok);
  return a;
}

inline bool exists(std::string const& path) {
  return std::ifstream(path).good();
}

/// The non-empty lines of a text file (a manifest, a meta.txt).
inline std::vector<std::string> lines(std::string const& path) {
  std::ifstream f(path);
  std::vector<std::string> out;
  for (std::string line; std::getline(f, line);)
    if (!line.empty())
      out.push_back(line);
  return out;
}

/// Largest error of `got` ([heads_total, tokens] fp32) against the oracle's fp64 scores, each relative to
/// max(|oracle|, 1e-2 * that head's largest oracle score); checks it is within `rtol` and returns it.
inline double check_scores(std::vector<float> const& got, NpyArray const& ref, Index tokens, double rtol,
                           std::string const& where) {
  REQUIRE(ref.dtype == NpyDtype::f64);
  REQUIRE(static_cast<std::size_t>(ref.size()) == got.size());
  double const* r = ref.as<double>();
  double worst = 0;
  for (Index row = 0; row * tokens < ref.size(); ++row) {
    double const* rs = r + row * tokens;
    double const top = *std::max_element(rs, rs + tokens);
    for (Index t = 0; t < tokens; ++t)
      worst = std::max(worst, std::abs(got[static_cast<std::size_t>(row * tokens + t)] - rs[t]) /
                                  std::max(std::abs(rs[t]), 1e-2 * top));
  }
  INFO(where << ": worst relative score error " << worst << " (tolerance " << rtol << ")");
  CHECK(worst <= rtol);
  return worst;
}

/// Checks each head's kept indices against the oracle's kept set `kept` ([B, H, k] int64). Only near-ties may
/// differ: tokens whose oracle scores (`ref`, [B, H, tokens] fp64) lie within `tie` x the head's largest score of
/// the selection boundary.
inline void check_kept(KeepPlan<> const& plan, NpyArray const& kept, NpyArray const& ref, Index tokens,
                       std::string const& where, double tie = 1e-4) {
  REQUIRE(kept.dtype == NpyDtype::i64);
  Index const k = kept.shape[2];
  for (Index b = 0; b < plan.batch; ++b)
    for (Index h = 0; h < plan.heads; ++h) {
      Index const* p = plan.indices(b, h);
      std::vector<Index> const mine(p, p + plan.kept(b, h));
      INFO(where << " head (" << b << ", " << h << ")");
      REQUIRE(static_cast<Index>(mine.size()) == k);
      std::int64_t const* first = kept.as<std::int64_t>() + (b * plan.heads + h) * k;
      std::vector<Index> const expect(first, first + k);
      if (mine == expect)
        continue;
      double const* s = ref.as<double>() + (b * plan.heads + h) * tokens;
      std::vector<double> sorted(s, s + tokens);
      std::sort(sorted.rbegin(), sorted.rend());
      double const boundary = sorted[static_cast<std::size_t>(k - 1)];
      std::set<Index> diff;
      std::set_symmetric_difference(mine.begin(), mine.end(), expect.begin(), expect.end(),
                                    std::inserter(diff, diff.end()));
      for (Index t : diff) {
        INFO("token " << t << " oracle score " << s[t] << " boundary " << boundary);
        CHECK(std::abs(s[t] - boundary) <= tie * sorted[0]);
      }
    }
}

}  // namespace kvc::test
