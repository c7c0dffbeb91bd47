// SPDX-License-Identifier: Apache-2.0
// benchmarks/scorers/streaming_llm_bench.cpp mirrors include/kvc/scorers/streaming_llm.hpp: CPU scoring throughput
// (reads no K: bytes/s counts the scores written).
#include <kvc/backend/cpu/scorers/streaming_llm.hpp>

#include "bench_support.hpp"

static int const registered = kvc::bench::register_scorer("BM_StreamingLLM_Cpu", kvc::StreamingLLMScorer{});
