// SPDX-License-Identifier: Apache-2.0
// tests/reference/oracle_test.cpp: kvc's scores and kept sets against the independent NumPy oracle
// (tools/reference/oracle.py), on random float32/float16 caches and on real keys from tinystories-656k.
// The vectors come from the ctest fixture kvc.reference.vectors; without NumPy or the model the cases are skipped.
#include <kvc/backend/cpu/scorers/key_diff.hpp>
#include <kvc/backend/cpu/scorers/knorm.hpp>
#include <kvc/backend/cpu/scorers/streaming_llm.hpp>
#include <kvc/backend/cpu/selectors/top_k.hpp>
#include <kvc/pipeline/press.hpp>

#include "io/npy.hpp"
#include "support/catch.hpp"
#include "support/helpers.hpp"
#include "support/vectors.hpp"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <set>
#include <string>
#include <vector>

using kvc::Index;

namespace {

using kvc::test::load;
std::string const& vectors = kvc::test::vectors_dir;

std::vector<std::string> cases() {
  return kvc::test::lines(vectors + "/manifest.txt");
}

/// Scores with the given scorer and checks them and the kept sets at each ratio against the oracle.
template <class Scorer, class T>
void check_case(std::string const& dir, std::string const& policy, Scorer scorer, kvc::NpyArray const& keys,
                bool has_scores) {
  kvc::KVExtents const e{keys.shape[0], keys.shape[1], keys.shape[2], keys.shape[3]};
  auto const cache = kvc::dense_cache(keys.as<T>(), keys.as<T>(), e);
  bool const f16 = std::is_same_v<T, kvc::half>;
  std::vector<double> ref_scores;
  if (has_scores) {
    kvc::test::OwnedScores got(e.batch, e.heads, e.tokens);
    kvc::test::OwnedWorkspace ws(kvc::score_workspace_bytes(kvc::Cpu{}, scorer, e));
    REQUIRE(kvc::score(kvc::Cpu{}, scorer, cache, got.span, ws.get()).ok());
    auto const ref = load(dir + "/scores_" + policy + ".npy");
    auto const* r = reinterpret_cast<double const*>(ref.data.data());
    REQUIRE(ref.data.size() == got.data.size() * sizeof(double));
    ref_scores.assign(r, r + got.data.size());
    double worst = 0;
    for (std::size_t i = 0; i < got.data.size(); ++i)
      worst = std::max(worst, std::abs(got.data[i] - r[i]) / std::max(1.0, std::abs(r[i])));
    INFO(dir << " " << policy << ": worst relative score error " << worst);
    CHECK(worst <= (f16 ? 2e-3 : 1e-5));
  }
  for (double ratio : {0.25, 0.5, 0.75}) {
    kvc::Press const press{scorer, kvc::TopKSelector{kvc::RatioBudget{ratio}}};
    kvc::test::OwnedWorkspace ws(kvc::compress_workspace_bytes(kvc::Cpu{}, press, e));
    kvc::test::OwnedPlan plan(e.batch, e.heads, e.tokens);
    REQUIRE(kvc::compress(kvc::Cpu{}, press, cache, plan.plan, ws.get()).ok());
    char name[64];
    std::snprintf(name, sizeof name, "/kept_%s_%g.npy", policy.c_str(), ratio);
    auto const ref = load(dir + name);
    Index const k = ref.shape[2];
    for (Index b = 0; b < e.batch; ++b)
      for (Index h = 0; h < e.heads; ++h) {
        auto const got = plan.kept(b, h);
        REQUIRE(static_cast<Index>(got.size()) == k);
        std::vector<Index> expect(ref.as<std::int64_t>() + (b * e.heads + h) * k,
                                  ref.as<std::int64_t>() + (b * e.heads + h + 1) * k);
        if (got == expect)
          continue;
        // Only near-ties at the selection boundary may differ between fp32 and the fp64 oracle.
        REQUIRE(!ref_scores.empty());
        double const* s = ref_scores.data() + (b * e.heads + h) * e.tokens;
        std::vector<double> sorted(s, s + e.tokens);
        std::sort(sorted.rbegin(), sorted.rend());
        double const boundary = sorted[static_cast<std::size_t>(k - 1)];
        std::set<Index> diff;
        std::set_symmetric_difference(got.begin(), got.end(), expect.begin(), expect.end(),
                                      std::inserter(diff, diff.end()));
        for (Index t : diff)
          CHECK(std::abs(s[t] - boundary) <= 1e-5);
      }
  }
}

}  // namespace

TEST_CASE("reference: scores and kept sets match the NumPy oracle", "[reference]") {
  auto const names = cases();
  if (names.empty()) {
    WARN("SKIPPED: no reference vectors in " << vectors << " (needs python3-numpy; see tools/reference)");
    return;
  }
  bool real = false;
  for (auto const& name : names) {
    std::string const dir = vectors + "/" + name;
    auto const keys = load(dir + "/keys.npy");
    real = real || name.rfind("tinystories", 0) == 0;
    auto run = [&](auto tag) {
      using T = decltype(tag);
      check_case<kvc::KeyDiffScorer, T>(dir, "key_diff", kvc::KeyDiffScorer{}, keys, true);
      check_case<kvc::KnormScorer, T>(dir, "knorm", kvc::KnormScorer{}, keys, true);
      check_case<kvc::StreamingLLMScorer, T>(dir, "streaming_llm", kvc::StreamingLLMScorer{4}, keys, false);
    };
    if (keys.dtype == kvc::NpyDtype::f16)
      run(kvc::half{});
    else
      run(float{});
  }
  if (!real)
    WARN("note: real-model cases absent (../shared/models/tinystories-656k not found): random cases only");
}
