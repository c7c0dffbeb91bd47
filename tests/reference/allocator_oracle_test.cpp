// SPDX-License-Identifier: Apache-2.0
// tests/reference/allocator_oracle_test.cpp: AdaKV's allocation and selection (both behaviours, FixedBudget and
// RatioBudget) and PyramidKV's per-layer schedule (both behaviours) against the independent oracle
// (tools/reference/allocators.py), on the allocator cases of make_vectors.py: random float32 scores with per-head
// lengths and protected tokens, a short prompt, exact ties (both sides rank by score, head, index) and, when shared/
// has the model, SnapKV scores of tinystories-656k. Everything is an integer: compared exactly. Skipped without NumPy.
#include <kvc/backend/cpu/selectors/ada_kv.hpp>
#include <kvc/selectors/pyramid_kv.hpp>

#include "support/catch.hpp"
#include "support/helpers.hpp"
#include "support/vectors.hpp"

#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

using kvc::Index;
using kvc::test::load;

namespace {

struct Meta {
  kvc::Reference reference = kvc::Reference::authors;
  double alpha = -1, ratio = -1;
  std::string budget;
  Index tokens = -1, n_sink = -1, n_recent = -1;
};

Meta read_meta(std::string const& dir) {
  Meta m;
  std::string reference;
  for (auto const& line : kvc::test::lines(dir + "/meta.txt")) {
    std::istringstream in(line);
    std::string key;
    in >> key;
    if (key == "reference")
      in >> reference;
    else if (key == "alpha")
      in >> m.alpha;
    else if (key == "budget")
      in >> m.budget;
    else if (key == "tokens")
      in >> m.tokens;
    else if (key == "ratio")
      in >> m.ratio;
    else if (key == "n_sink")
      in >> m.n_sink;
    else if (key == "n_recent")
      in >> m.n_recent;
  }
  INFO(dir << "/meta.txt");
  REQUIRE((reference == "authors" || reference == "kvpress"));
  REQUIRE((m.budget == "fixed" ? m.tokens >= 0 : (m.budget == "ratio" && m.ratio >= 0)));
  REQUIRE((m.alpha >= 0 && m.n_sink >= 0 && m.n_recent >= 0));
  m.reference = reference == "authors" ? kvc::Reference::authors : kvc::Reference::kvpress;
  return m;
}

std::string show(std::vector<Index> const& v) {
  std::ostringstream out;
  for (std::size_t i = 0; i < v.size(); ++i)
    out << (i ? " " : "") << v[i];
  return out.str();
}

/// kvc::allocate's table and kvc::select's plan for one case against totals.npy and kept.npy.
template <kvc::Budget Bu>
void check_case(std::string const& dir, kvc::AdaKVSelector<Bu> const& sel) {
  auto const scores = load(dir + "/scores.npy"), lengths = load(dir + "/lengths.npy");
  auto const totals = load(dir + "/totals.npy"), kept = load(dir + "/kept.npy");
  REQUIRE((scores.dtype == kvc::NpyDtype::f32 && scores.shape.size() == 3));
  REQUIRE((lengths.dtype == kvc::NpyDtype::i64 && totals.dtype == kvc::NpyDtype::i64));
  REQUIRE(kept.dtype == kvc::NpyDtype::i64);
  Index const batch = scores.shape[0], heads = scores.shape[1], tokens = scores.shape[2];
  REQUIRE((lengths.shape == std::vector<Index>{batch, heads} && totals.shape == lengths.shape));
  REQUIRE(kept.shape == scores.shape);
  std::vector<float> s(scores.as<float>(), scores.as<float>() + scores.size());
  std::vector<Index> len(lengths.as<std::int64_t>(), lengths.as<std::int64_t>() + lengths.size());
  kvc::ScoreSpan<> const span{s.data(), batch, heads, tokens, kvc::head_lengths(len.data(), heads)};

  std::vector<Index> table(static_cast<std::size_t>(batch * heads), -7);
  kvc::test::OwnedWorkspace aws(kvc::allocate_workspace_bytes(kvc::Cpu{}, sel, batch, heads, tokens));
  auto const st = kvc::allocate(kvc::Cpu{}, sel, span, table.data(), aws.get());
  INFO(dir << ": " << st.message());
  REQUIRE(st.ok());
  std::vector<Index> const expect(totals.as<std::int64_t>(), totals.as<std::int64_t>() + totals.size());
  INFO("per-head totals [batch x heads]: kvc " << show(table) << " | oracle " << show(expect) << " | lengths "
                                               << show(len));
  CHECK(table == expect);

  kvc::test::OwnedPlan plan(batch, heads, tokens);
  kvc::test::OwnedWorkspace sws(kvc::select_workspace_bytes(kvc::Cpu{}, sel, batch, heads, tokens));
  auto const ss = kvc::select(kvc::Cpu{}, sel, span, plan.plan, sws.get());
  INFO(ss.message());
  REQUIRE(ss.ok());
  for (Index b = 0; b < batch; ++b)
    for (Index h = 0; h < heads; ++h) {
      std::int64_t const* row = kept.as<std::int64_t>() + (b * heads + h) * tokens;
      std::vector<Index> want;
      for (Index t = 0; t < tokens && row[t] >= 0; ++t)
        want.push_back(row[t]);
      INFO("head (" << b << ", " << h << ") kept: kvc " << show(plan.kept(b, h)) << " | oracle " << show(want));
      CHECK(plan.kept(b, h) == want);
    }
}

}  // namespace

TEST_CASE("reference: AdaKV allocation and selection match the NumPy oracle", "[reference][allocator]") {
  auto const names = kvc::test::lines(kvc::test::vectors_dir + "/allocator_manifest.txt");
  if (names.empty()) {
    WARN("SKIPPED: no allocator reference vectors in " << kvc::test::vectors_dir << " (needs python3-numpy)");
    return;
  }
  bool authors = false, kvpress = false, fixed = false, ratio = false, real = false;
  for (auto const& name : names) {
    std::string const dir = kvc::test::vectors_dir + "/" + name;
    Meta const m = read_meta(dir);
    authors = authors || m.reference == kvc::Reference::authors;
    kvpress = kvpress || m.reference == kvc::Reference::kvpress;
    real = real || name.find("tinystories") != std::string::npos;
    if (m.budget == "fixed") {
      fixed = true;
      check_case(dir, kvc::AdaKVSelector{kvc::FixedBudget{m.tokens}, m.alpha, m.reference, m.n_sink, m.n_recent});
    } else {
      ratio = true;
      check_case(dir, kvc::AdaKVSelector{kvc::RatioBudget{m.ratio}, m.alpha, m.reference, m.n_sink, m.n_recent});
    }
  }
  CHECK((authors && kvpress && fixed && ratio));
  if (!real)
    WARN("note: real-model allocator cases absent (../shared/models/tinystories-656k not found): random cases only");
}

TEST_CASE("reference: PyramidKV schedules match the NumPy oracle", "[reference][allocator]") {
  std::string const dir = kvc::test::vectors_dir + "/pyramid_kv";
  if (!kvc::test::exists(dir + "/params.npy")) {
    WARN("SKIPPED: no PyramidKV reference vectors in " << dir << " (needs python3-numpy)");
    return;
  }
  auto const params = load(dir + "/params.npy"), keep = load(dir + "/keep.npy");
  REQUIRE((params.dtype == kvc::NpyDtype::f64 && keep.dtype == kvc::NpyDtype::i64));
  REQUIRE((params.shape.size() == 2 && params.shape[1] == 7 && keep.shape.size() == 2));
  REQUIRE(keep.shape[0] == params.shape[0]);
  Index const rows = params.shape[0], width = keep.shape[1];
  Index mismatches = 0, kvpress_rows = 0;
  for (Index i = 0; i < rows; ++i) {
    double const* p = params.as<double>() + i * 7;
    auto const reference = p[0] == 0 ? kvc::Reference::authors : kvc::Reference::kvpress;
    auto const n = static_cast<Index>(p[1]), layers = static_cast<Index>(p[6]);
    kvpress_rows += reference == kvc::Reference::kvpress;
    std::vector<Index> got, want;
    for (Index l = 0; l < layers; ++l) {
      kvc::PyramidKVBudget const budget{.layer = l,
                                        .num_layers = layers,
                                        .window_size = static_cast<Index>(p[4]),
                                        .beta = static_cast<Index>(p[5]),
                                        .reference = reference,
                                        .max_capacity_prompt = static_cast<Index>(p[2]),
                                        .compression_ratio = p[3]};
      REQUIRE(budget.check().ok());
      got.push_back(budget.keep(0, 0, n));
      want.push_back(keep.as<std::int64_t>()[i * width + l]);
    }
    if (got != want && ++mismatches <= 20) {  // the first 20 in full; the count below
      INFO((reference == kvc::Reference::authors ? "authors" : "kvpress")
           << " n " << n << " C " << p[2] << " ratio " << p[3] << " w " << p[4] << " beta " << p[5] << " L " << layers
           << ": kvc " << show(got) << " | oracle " << show(want));
      CHECK(got == want);
    }
  }
  INFO(mismatches << " of " << rows << " schedules differ");
  CHECK(mismatches == 0);
  CHECK((kvpress_rows > 0 && kvpress_rows < rows));
}
