// SPDX-License-Identifier: Apache-2.0
// tests/backend/cuda/parity_test.cpp: CUDA kernels against the CPU reference (the oracle). Tolerances are in
// docs/numerics.md. Without a CUDA device every case prints "SKIPPED: no CUDA device" and ctest reports it skipped.
#include <kvc/backend/cpu/pipeline/compact.hpp>
#include <kvc/backend/cpu/scorers/key_diff.hpp>
#include <kvc/backend/cpu/scorers/knorm.hpp>
#include <kvc/backend/cpu/selectors/top_k.hpp>

#include "backend/cuda/cuda_kernels.hpp"
#include "common/synthetic.hpp"
#include "support/catch.hpp"
#include "support/helpers.hpp"

#include <cmath>
#include <limits>
#include <vector>

using kvc::Index;

#define KVC_REQUIRE_DEVICE()                               \
  do {                                                     \
    if (!kvc::test::cuda::device_available()) {            \
      WARN("SKIPPED: no CUDA device: parity not checked"); \
      return;                                              \
    }                                                      \
  } while (0)

namespace {

template <class T, class Scorer>
std::vector<float> cpu_scores(Scorer s, kvc::tools::HostCache<T> const& c) {
  kvc::test::OwnedScores out(c.ext.batch, c.ext.heads, c.ext.tokens);
  kvc::test::OwnedWorkspace ws(kvc::score_workspace_bytes(kvc::Cpu{}, s, c.ext));
  REQUIRE(kvc::score(kvc::Cpu{}, s, c.view(), out.span, ws.get()).ok());
  return out.data;
}

}  // namespace

TEST_CASE("cuda: KeyDiff and Knorm scores match the CPU (fp32 1e-5, fp16 1e-4 absolute)", "[cuda][scorers]") {
  KVC_REQUIRE_DEVICE();
  for (Index tokens : {1, 37, 4096, 9000}) {
    kvc::KVExtents const e{2, 3, tokens, 64};
    auto c32 = kvc::tools::HostCache<float>::random(e, 5);
    for (float& x : c32.k)
      x += 0.3f;
    c32.lengths = {tokens, tokens / 2};
    kvc::tools::HostCache<kvc::half> c16(e);
    for (std::size_t i = 0; i < c32.k.size(); ++i)
      c16.k[i] = kvc::half(c32.k[i]);
    c16.lengths = c32.lengths;
    std::vector<float> gpu;
    REQUIRE(kvc::test::cuda::key_diff_scores(e, c32.k, c32.lengths, gpu) == "");
    auto const cpu = cpu_scores(kvc::KeyDiffScorer{}, c32);
    for (std::size_t i = 0; i < cpu.size(); ++i)
      REQUIRE((std::isinf(cpu[i]) ? gpu[i] == cpu[i] : std::abs(gpu[i] - cpu[i]) <= 1e-5f));
    REQUIRE(kvc::test::cuda::key_diff_scores(e, c16.k, c16.lengths, gpu) == "");
    auto const cpu16 = cpu_scores(kvc::KeyDiffScorer{}, c16);
    for (std::size_t i = 0; i < cpu16.size(); ++i)
      REQUIRE((std::isinf(cpu16[i]) ? gpu[i] == cpu16[i] : std::abs(gpu[i] - cpu16[i]) <= 1e-4f));
    REQUIRE(kvc::test::cuda::knorm_scores(e, c32.k, c32.lengths, gpu) == "");
    auto const kn = cpu_scores(kvc::KnormScorer{}, c32);
    for (std::size_t i = 0; i < kn.size(); ++i)
      REQUIRE(
          (std::isinf(kn[i]) ? gpu[i] == kn[i] : std::abs(gpu[i] - kn[i]) <= 1e-5f * std::max(1.0f, std::abs(kn[i]))));
  }
}

TEST_CASE("cuda: top-k keeps exactly the CPU's set for identical scores (ties, NaN, protection, ragged)",
          "[cuda][selectors]") {
  KVC_REQUIRE_DEVICE();
  kvc::tools::Rng rng(9);
  for (int trial = 0; trial < 40; ++trial) {
    Index const batch = 2, heads = 3, tokens = 1 + static_cast<Index>(rng.next() % 3000);
    std::vector<float> scores(static_cast<std::size_t>(batch * heads * tokens));
    for (float& x : scores) {
      auto const r = rng.next() % 100;
      x = r < 3 ? std::numeric_limits<float>::quiet_NaN() : (r < 6 ? -0.0f : static_cast<float>(rng.next() % 50));
    }
    std::vector<Index> lengths = {tokens, static_cast<Index>(rng.next() % static_cast<std::uint64_t>(tokens + 1))};
    kvc::TopKSelector<kvc::FixedBudget> const sel{
        {static_cast<Index>(rng.next() % static_cast<std::uint64_t>(tokens + 5))},
        static_cast<Index>(rng.next() % 5),
        static_cast<Index>(rng.next() % 9)};
    kvc::test::OwnedPlan cpu(batch, heads, tokens);
    kvc::test::OwnedWorkspace ws(kvc::select_workspace_bytes(kvc::Cpu{}, sel, batch, heads, tokens));
    REQUIRE(kvc::select(kvc::Cpu{}, sel, kvc::ScoreSpan<>{scores.data(), batch, heads, tokens, lengths.data()},
                        cpu.plan, ws.get())
                .ok());
    std::vector<Index> index, count;
    REQUIRE(kvc::test::cuda::top_k(sel, batch, heads, tokens, scores, lengths, tokens, index, count) == "");
    for (Index bh = 0; bh < batch * heads; ++bh) {
      REQUIRE(count[static_cast<std::size_t>(bh)] == cpu.count[static_cast<std::size_t>(bh)]);
      for (Index j = 0; j < count[static_cast<std::size_t>(bh)]; ++j)
        REQUIRE(index[static_cast<std::size_t>(bh * tokens + j)] ==
                cpu.index[static_cast<std::size_t>(bh * tokens + j)]);
    }
  }
}

TEST_CASE("cuda: in-place compaction produces the CPU's bytes", "[cuda][pipeline]") {
  KVC_REQUIRE_DEVICE();
  kvc::KVExtents const e{2, 4, 300, 64};
  auto c = kvc::tools::HostCache<float>::random(e, 3);
  auto gpu = c;
  kvc::tools::Rng rng(4);
  kvc::test::OwnedPlan plan(2, 4, 300);
  for (Index bh = 0; bh < 8; ++bh) {
    Index j = 0;
    for (Index t = 0; t < 300; ++t)
      if (rng.next() % 3 == 0)
        plan.index[static_cast<std::size_t>(bh * 300 + j++)] = t;
    plan.count[static_cast<std::size_t>(bh)] = j;
  }
  REQUIRE(kvc::compact(kvc::Cpu{}, plan.plan, c.view()).ok());
  REQUIRE(kvc::test::cuda::compact(e, gpu.k, gpu.v, plan.index, plan.count, 300) == "");
  CHECK(gpu.k == c.k);
  CHECK(gpu.v == c.v);
}
