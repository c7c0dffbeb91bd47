// SPDX-License-Identifier: Apache-2.0
// kvc/backend/cpu/scorers/streaming_llm.hpp: CPU kernel for StreamingLLMScorer (positions only; reads no K/V).
#pragma once

#include <kvc/backend/cpu/detail/for_each_head.hpp>
#include <kvc/scorers/streaming_llm.hpp>

#include <cstddef>

namespace kvc {

template <>
struct Kernel<StreamingLLMScorer, Cpu> {
  template <class Obs>
  static std::size_t workspace_bytes(Cpu const&, StreamingLLMScorer const&, KVExtents const&, Obs const&) {
    return 0;
  }

  template <KVCacheView C, class Obs>
  static Status run(Cpu const& cpu, StreamingLLMScorer const& s, C const&, Obs const&, ScoreSpan<HostSpace> out,
                    Workspace) {
    if (s.n_sink < 0)
      return {Errc::invalid_argument, "StreamingLLMScorer: `n_sink` must be >= 0"};
    if (out.tokens > streaming_llm_max_tokens)
      return {Errc::invalid_argument, "StreamingLLMScorer: more than 2^24 tokens cannot be ranked exactly in fp32"};
    auto const top = static_cast<float>(out.tokens);  // above every position: sinks rank first
    return detail::for_each_head(cpu, out, [&](Index, Index, Index n, float* score, Index) {
      for (Index t = 0; t < n; ++t)
        score[t] = t < s.n_sink ? top : static_cast<float>(t);
    });
  }
};

}  // namespace kvc
