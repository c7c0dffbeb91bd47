// SPDX-License-Identifier: Apache-2.0
// kvc/scorers/streaming_llm.hpp: StreamingLLM (Xiao et al., "Efficient Streaming Language Models with Attention
// Sinks", arXiv 2309.17453): keep the first `n_sink` tokens (attention sinks) and the most recent ones.
//
// As a scorer it ranks by position: s_t = t for t >= n_sink and s_t = tokens (above every position) for the
// sinks. Any top-k selector then keeps the sinks plus the most recent k - n_sink tokens, for any budget:
// TopKSelector{FixedBudget{s + r}} is the paper's start_size s + recent_size r cache, and
// TopKSelector{RatioBudget{r}} is kvpress's StreamingLLMPress. Reads nothing but the lengths.
// Positions are exact in fp32 up to 2^24 tokens per sequence; longer caches are rejected.
#pragma once

#include <kvc/core/params.hpp>
#include <kvc/core/scorer.hpp>

#include <string_view>
#include <tuple>

namespace kvc {

/// StreamingLLM scorer parameters.
struct StreamingLLMScorer {
  static constexpr Needs needs = Needs::none;
  static constexpr std::string_view name = "streaming_llm";

  Index n_sink = 4;  ///< attention-sink tokens at the start, always ranked first (paper and kvpress default: 4)

  /// The parameters the tools expose (core/params.hpp).
  static constexpr auto parameters() noexcept {
    return std::tuple{
        number_param("n_sink", &StreamingLLMScorer::n_sink, 0, max_param_index, "first tokens always kept")};
  }
};

/// Largest token count StreamingLLM ranks exactly (fp32 holds every integer up to 2^24).
inline constexpr Index streaming_llm_max_tokens = Index{1} << 24;

}  // namespace kvc
