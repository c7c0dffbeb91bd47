// SPDX-License-Identifier: Apache-2.0
// tests/reference/window_oracle_test.cpp: SnapKV and TOVA scores and kept sets against the independent NumPy oracle
// (tools/reference/baselines.py), on the window-attention cases of tools/reference/make_vectors.py: random GQA and
// MHA caches (float32, float16; neox and interleaved RoPE) and, when shared/ has it, real keys and pre-RoPE queries
// from tinystories-656k. The vectors come from the ctest fixture kvc.reference.vectors; without NumPy the test is
// skipped.
//
// Tolerances (stated once): scores within 1e-4 relative for float32 inputs and 1e-3 for float16 inputs (the oracle
// sees the same rounded float16 values, so the difference is fp32 compute -- a float16 query RoPE'd in fp32 and
// the softmax of larger logits -- against fp64), measured against max(|oracle|, 1e-2 * the head's largest
// score). Kept sets must be exact, except that tokens whose oracle scores lie within 1e-4 (relative to the head's
// largest score) of the selection boundary may swap, as tools/reference/check_cli.py allows.
#include <kvc/backend/cpu/scorers/snap_kv.hpp>
#include <kvc/backend/cpu/scorers/tova.hpp>
#include <kvc/backend/cpu/selectors/top_k.hpp>
#include <kvc/pipeline/press.hpp>

#include "io/npy.hpp"
#include "support/catch.hpp"
#include "support/helpers.hpp"
#include "support/vectors.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

using kvc::Index;

namespace {

using kvc::test::exists;
using kvc::test::lines;
using kvc::test::load;
std::string const& vectors = kvc::test::vectors_dir;

/// meta.txt: "window_size W", "theta T", "style neox|interleaved".
struct Meta {
  Index window_size = 0;
  double theta = 0;
  kvc::RopeStyle style = kvc::RopeStyle::neox;
};

Meta read_meta(std::string const& dir) {
  Meta m;
  std::string style;
  for (auto const& line : lines(dir + "/meta.txt")) {
    std::istringstream in(line);
    std::string key;
    in >> key;
    if (key == "window_size")
      in >> m.window_size;
    else if (key == "theta")
      in >> m.theta;
    else if (key == "style")
      in >> style;
  }
  INFO(dir << "/meta.txt");
  REQUIRE(m.window_size > 0);
  REQUIRE(m.theta > 1.0);
  REQUIRE((style == "neox" || style == "interleaved"));
  m.style = style == "neox" ? kvc::RopeStyle::neox : kvc::RopeStyle::interleaved;
  return m;
}

struct Case {
  std::string dir;
  kvc::NpyArray keys, values, queries;
  Meta meta;
  bool f16 = false;
};

/// Scores `scorer` on the case and checks them, then the kept sets at every ratio, against the oracle's.
template <class T, class Scorer>
void check_variant(Case const& c, std::string const& variant, Scorer const& scorer, int& checked) {
  kvc::KVExtents const e{c.keys.shape[0], c.keys.shape[1], c.keys.shape[2], c.keys.shape[3]};
  kvc::KVExtents const qe{c.queries.shape[0], c.queries.shape[1], c.queries.shape[2], c.queries.shape[3]};
  auto const cache = kvc::dense_cache(c.keys.as<T>(), c.values.as<T>(), e);
  // The queries are pre-RoPE at positions N - w + i: a table covering [0, N) rotates them.
  kvc::test::OwnedRope const rope({.theta = c.meta.theta, .style = c.meta.style}, e.dim, e.tokens);
  kvc::TokenRows<T const, kvc::StridedLayout> const rows(c.queries.as<T>(), kvc::bhtd_layout(qe));
  auto const obs = kvc::observe(kvc::WindowQueries<T>{rows, rope.table});
  std::string const where = c.dir + " " + variant;

  kvc::test::OwnedScores got(e.batch, e.heads, e.tokens);
  kvc::test::OwnedWorkspace ws(kvc::score_workspace_bytes(kvc::Cpu{}, scorer, e, obs));
  {
    auto const st = kvc::score(kvc::Cpu{}, scorer, cache, obs, got.span, ws.get());
    INFO(where << ": " << st.message());
    REQUIRE(st.ok());
  }
  auto const ref = load(c.dir + "/scores_" + variant + ".npy");
  kvc::test::check_scores(got.data, ref, e.tokens, c.f16 ? 1e-3 : 1e-4, where);

  for (double ratio : {0.25, 0.5, 0.75}) {
    kvc::Press const press{scorer, kvc::TopKSelector{kvc::RatioBudget{ratio}}};
    kvc::test::OwnedWorkspace cws(kvc::compress_workspace_bytes(kvc::Cpu{}, press, e, obs));
    kvc::test::OwnedPlan plan(e.batch, e.heads, e.tokens);
    REQUIRE(kvc::compress(kvc::Cpu{}, press, cache, obs, plan.plan, cws.get()).ok());
    char name[96];
    std::snprintf(name, sizeof name, "/kept_%s_%g.npy", variant.c_str(), ratio);
    kvc::test::check_kept(plan.plan, load(c.dir + name), ref, e.tokens, where + " ratio " + std::to_string(ratio));
  }
  ++checked;
}

template <class T>
void check_case(Case const& c, int& checked) {
  Index const w = c.meta.window_size;
  bool const mha = c.keys.shape[1] == c.queries.shape[1];
  std::map<std::string, kvc::SnapKVScorer> snap = {
      {"snap_kv_authors", {kvc::Reference::authors, w, 7, kvc::Pooling::max, kvc::GqaReduce::mean}},
      {"snap_kv_authors_avg_sum", {kvc::Reference::authors, w, 5, kvc::Pooling::avg, kvc::GqaReduce::sum}},
  };
  auto kvpress = kvc::SnapKVScorer::kvpress();
  kvpress.window_size = w;
  snap.emplace("snap_kv_kvpress", kvpress);
  if (mha)
    snap.emplace("snap_kv_authors_pqh",
                 kvc::SnapKVScorer{kvc::Reference::authors, w, 7, kvc::Pooling::max, kvc::GqaReduce::per_query_head});
  for (auto const& [variant, scorer] : snap) {
    bool const present = exists(c.dir + "/scores_" + variant + ".npy");
    if (variant == "snap_kv_authors_pqh" && !present)
      continue;  // written only for the MHA cases that ask for it
    INFO(c.dir << ": oracle vectors for " << variant);
    REQUIRE(present);
    check_variant<T>(c, variant, scorer, checked);
  }
  check_variant<T>(c, "tova_authors", kvc::TOVAScorer{kvc::Reference::authors}, checked);
  check_variant<T>(c, "tova_kvpress", kvc::TOVAScorer{kvc::Reference::kvpress}, checked);
}

}  // namespace

TEST_CASE("reference: SnapKV and TOVA scores and kept sets match the NumPy oracle", "[reference][window]") {
  auto const names = lines(vectors + "/window_manifest.txt");
  if (names.empty()) {
    WARN("SKIPPED: no window reference vectors in " << vectors << " (needs python3-numpy; see tools/reference)");
    return;
  }
  int checked = 0, pqh = 0;
  bool real = false, f16 = false, interleaved = false;
  for (auto const& name : names) {
    Case c;
    c.dir = vectors + "/" + name;
    c.keys = load(c.dir + "/keys.npy");
    c.values = load(c.dir + "/values.npy");
    c.queries = load(c.dir + "/queries.npy");
    c.meta = read_meta(c.dir);
    INFO(c.dir);
    REQUIRE(c.keys.shape.size() == 4);
    REQUIRE(c.queries.shape.size() == 4);
    REQUIRE(c.values.shape == c.keys.shape);
    REQUIRE(c.queries.dtype == c.keys.dtype);
    REQUIRE(c.queries.shape[0] == c.keys.shape[0]);
    REQUIRE(c.queries.shape[3] == c.keys.shape[3]);
    REQUIRE(c.queries.shape[2] == c.meta.window_size);
    c.f16 = c.keys.dtype == kvc::NpyDtype::f16;
    real = real || name.rfind("tinystories", 0) == 0;
    f16 = f16 || c.f16;
    interleaved = interleaved || c.meta.style == kvc::RopeStyle::interleaved;
    pqh += exists(c.dir + "/scores_snap_kv_authors_pqh.npy") ? 1 : 0;
    if (c.f16)
      check_case<kvc::half>(c, checked);
    else
      check_case<float>(c, checked);
  }
  // The generator's fixed cases must all have been seen (a silently shrunk manifest would pass otherwise).
  CHECK(f16);
  CHECK(interleaved);
  CHECK(pqh >= 1);
  CHECK(checked >= static_cast<int>(names.size()) * 5);
  if (!real)
    WARN("note: real-model window cases absent (../shared/models/tinystories-656k not found): random cases only");
}
