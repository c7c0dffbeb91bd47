// SPDX-License-Identifier: Apache-2.0
// benchmarks/scorers/key_diff_bench.cpp mirrors include/kvc/scorers/key_diff.hpp: CPU scoring throughput (bytes/s
// counts one read of K per call).
#include <kvc/backend/cpu/scorers/key_diff.hpp>

#include "bench_support.hpp"

static int const registered = kvc::bench::register_scorer("BM_KeyDiff_Cpu", kvc::KeyDiffScorer{});
