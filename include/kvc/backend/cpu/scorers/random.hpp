// SPDX-License-Identifier: Apache-2.0
// kvc/backend/cpu/scorers/random.hpp: CPU kernel of RandomScorer.
#pragma once

#include <kvc/backend/cpu/detail/for_each_head.hpp>
#include <kvc/scorers/random.hpp>

#include <cstddef>

namespace kvc {

template <>
struct Kernel<RandomScorer, Cpu> {
  template <class Obs>
  static std::size_t workspace_bytes(Cpu const&, RandomScorer const&, KVExtents const&, Obs const&) {
    return 0;
  }

  template <KVCacheView C, class Obs>
  static Status run(Cpu const& cpu, RandomScorer const& s, C const&, Obs const&, ScoreSpan<HostSpace> out, Workspace) {
    return detail::for_each_head(cpu, out, [&](Index b, Index h, Index n, float* score, Index) {
      for (Index t = 0; t < n; ++t)
        score[t] = s.at(b, h, t);
    });
  }
};

}  // namespace kvc
