// SPDX-License-Identifier: Apache-2.0
// benchmarks/scorers/knorm_bench.cpp mirrors include/kvc/scorers/knorm.hpp: CPU scoring throughput (bytes/s counts one
// read of K per call).
#include <kvc/backend/cpu/scorers/knorm.hpp>

#include "bench_support.hpp"

static int const registered = kvc::bench::register_scorer("BM_Knorm_Cpu", kvc::KnormScorer{}, /*fp8=*/true);
