// SPDX-License-Identifier: Apache-2.0
// tests/reference/uncomp_oracle_test.cpp: UNComp against the independent NumPy oracle (tools/reference/uncomp.py) on
// the cases of uncomp_manifest.txt (tools/reference/make_vectors.py): random GQA queries and keys (d = 16 and 32,
// group counts that do not divide the heads, a head whose budget exceeds the prompt, budgets clamped to the window,
// remainder ties) and, when shared/ has it, tinystories-656k's layers 0 and 1 (real post-RoPE keys and queries).
// The vectors come from the ctest fixture kvc.reference.vectors; without NumPy the test is skipped.
//
// Per case: the truncated matrix entropy of every query head under seven option sets (the authors' row-normalised
// moment, the covariance, the ridge, renormalised top k, k above d, the Gram path n < d) through
// kvc::MatrixEntropySolver; the calibration over the batch's sequences as samples (kvc::EntropyCalibration: mean
// erank, mean and majority-vote groups); balanced group sizes, groups and budgets per query head and per KV head
// (kvc::group_heads, kvc::reduce_to_kv_heads, kvc::head_budgets); the prefill (kvc::update with the last w prompt
// queries, the stored window rows, kvc::score, selection with UNCompSelector, compaction) and T decode steps (one
// appended key and query per step, one eviction per head over budget). Two grids check groups and budgets over
// H ∈ {1, 4, 7, 8, 28, 32}, M ∈ {1, 2, 3, 5, 8}, with exact entropy ties, and the majority vote.
//
// Tolerances: entropies (fp64 on both sides, float32 inputs) within 1e-9 absolute (H, Ĥ) and 1e-9 relative (erank);
// window rows and scores (fp32 against fp64) within 1e-5 relative of max(|oracle|, 1e-2 × the head's largest);
// groups, budgets and kept sets exact (the oracle draws its random cases without near-ties, and records the
// smallest selection gap; a kept set may differ only where that gap is below 1e-5).
#include <kvc/backend/cpu/pipeline/compact.hpp>
#include <kvc/backend/cpu/scorers/uncomp.hpp>
#include <kvc/backend/cpu/selectors/uncomp.hpp>
#include <kvc/calibration/head_budgets.hpp>
#include <kvc/calibration/head_groups.hpp>
#include <kvc/calibration/matrix_entropy.hpp>
#include <kvc/pipeline/press.hpp>

#include "io/npy.hpp"
#include "support/catch.hpp"
#include "support/helpers.hpp"
#include "support/vectors.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <sstream>
#include <string>
#include <vector>

using kvc::Index;
using kvc::test::load;

namespace {

std::string const& vectors = kvc::test::vectors_dir;
constexpr double tie = 1e-5;

/// meta.txt: one `key value` per line.
std::map<std::string, double> read_meta(std::string const& dir) {
  std::map<std::string, double> m;
  for (auto const& line : kvc::test::lines(dir + "/meta.txt")) {
    std::istringstream in(line);
    std::string key;
    double value = 0;
    if (in >> key >> value)
      m[key] = value;
  }
  return m;
}

Index count_of(std::map<std::string, double> const& m, char const* key) {
  INFO("meta.txt: " << key);
  REQUIRE(m.count(key) == 1);
  return static_cast<Index>(m.at(key));
}

std::vector<Index> ints(kvc::NpyArray const& a) {
  REQUIRE(a.dtype == kvc::NpyDtype::i64);
  return {a.as<std::int64_t>(), a.as<std::int64_t>() + a.size()};
}

std::vector<Index> row_of(std::vector<Index> const& all, Index row, Index width) {
  return {all.begin() + row * width, all.begin() + (row + 1) * width};
}

/// Kept positions of a −1-padded row.
std::vector<Index> kept_row(std::vector<Index> const& all, Index row, Index width) {
  std::vector<Index> out;
  for (Index i = 0; i < width; ++i)
    if (all[static_cast<std::size_t>(row * width + i)] >= 0)
      out.push_back(all[static_cast<std::size_t>(row * width + i)]);
  return out;
}

void check_entropies(std::string const& dir, kvc::NpyArray const& queries, Index& checked) {
  Index const B = queries.shape[0], Hq = queries.shape[1], T = queries.shape[2], d = queries.shape[3];
  float const* q = queries.as<float>();
  for (auto const& line : kvc::test::lines(dir + "/entropy.txt")) {
    std::istringstream in(line);
    std::string name;
    Index rows = 0, top_k = 0;
    int normalize = 0, renormalize = 0;
    double ridge = 0;
    REQUIRE(static_cast<bool>(in >> name >> rows >> top_k >> normalize >> renormalize >> ridge));
    kvc::MatrixEntropyOptions options;
    options.top_k = top_k;
    options.normalize_rows = normalize != 0;
    options.renormalize_topk = renormalize != 0;
    options.ridge = ridge;
    auto const ref = load(dir + "/entropy_" + name + ".npy");
    REQUIRE(ref.shape == std::vector<Index>{B, Hq, 4});
    double const* r = ref.as<double>();
    kvc::MatrixEntropySolver solver(d, options);
    for (Index b = 0; b < B; ++b)
      for (Index h = 0; h < Hq; ++h) {
        kvc::MatrixEntropy e;
        REQUIRE(solver.compute(q + (b * Hq + h) * T * d, rows, d, e).ok());
        double const* x = r + (b * Hq + h) * 4;
        INFO(dir << " " << name << " (" << b << ", " << h << ")");
        CHECK(std::abs(e.truncated - x[0]) <= 1e-9);
        CHECK(std::abs(e.full - x[1]) <= 1e-9);
        CHECK(std::abs(e.erank - x[2]) <= 1e-9 * x[2]);
        CHECK(std::abs(e.normalized - x[3]) <= 1e-9);
        ++checked;
      }
  }
}

/// Calibration over the batch's sequences as samples; returns the KV-head budgets.
std::vector<Index> check_calibration(std::string const& dir, kvc::NpyArray const& queries, Index Hkv, Index prompt,
                                     std::map<std::string, double> const& meta) {
  Index const B = queries.shape[0], Hq = queries.shape[1], T = queries.shape[2], d = queries.shape[3];
  Index const mq = count_of(meta, "groups_q"), mkv = count_of(meta, "groups_kv"), w = count_of(meta, "window_size");
  kvc::MatrixEntropyOptions options;
  options.top_k = d / 4;
  kvc::MatrixEntropySolver solver(d, options);
  kvc::EntropyCalibration calib(1, Hq, mq);
  std::vector<kvc::MatrixEntropy> per_head(static_cast<std::size_t>(Hq));
  for (Index b = 0; b < B; ++b) {
    for (Index h = 0; h < Hq; ++h)
      REQUIRE(
          solver.compute(queries.as<float>() + (b * Hq + h) * T * d, prompt, d, per_head[static_cast<std::size_t>(h)])
              .ok());
    REQUIRE(calib.add(0, per_head.data()).ok());
  }
  INFO(dir);
  auto const erank_q = load(dir + "/erank_q.npy");
  std::vector<double> erank(static_cast<std::size_t>(Hq));
  for (Index h = 0; h < Hq; ++h) {
    erank[static_cast<std::size_t>(h)] = calib.mean_erank(0, h);
    CHECK(std::abs(calib.mean_erank(0, h) - erank_q.as<double>()[h]) <= 1e-9 * erank_q.as<double>()[h]);
  }
  std::vector<Index> sizes(static_cast<std::size_t>(mq)), groups(static_cast<std::size_t>(Hq));
  REQUIRE(kvc::balanced_group_sizes(Hq, mq, sizes.data()).ok());
  CHECK(sizes == ints(load(dir + "/group_sizes_q.npy")));
  REQUIRE(calib.groups(0, false, groups.data()).ok());
  CHECK(groups == ints(load(dir + "/groups_q.npy")));
  std::vector<Index> vote(static_cast<std::size_t>(Hq));
  REQUIRE(calib.groups(0, true, vote.data()).ok());
  CHECK(vote == ints(load(dir + "/groups_q_vote.npy")));

  kvc::HeadBudgetSpec spec;
  spec.average = meta.at("average");
  spec.step = meta.at("step");
  spec.groups = mq;
  std::vector<Index> budgets(static_cast<std::size_t>(Hq));
  REQUIRE(kvc::head_budgets(spec, groups.data(), Hq, w, budgets.data()).ok());
  CHECK(budgets == ints(load(dir + "/budgets_q.npy")));

  std::vector<double> erank_kv(static_cast<std::size_t>(Hkv));
  REQUIRE(kvc::reduce_to_kv_heads(erank.data(), Hq, Hkv, erank_kv.data()).ok());
  auto const ref_kv = load(dir + "/erank_kv.npy");
  for (Index h = 0; h < Hkv; ++h)
    CHECK(std::abs(erank_kv[static_cast<std::size_t>(h)] - ref_kv.as<double>()[h]) <= 1e-9 * ref_kv.as<double>()[h]);
  std::vector<Index> kv_sizes(static_cast<std::size_t>(mkv)), kv_groups(static_cast<std::size_t>(Hkv));
  REQUIRE(kvc::balanced_group_sizes(Hkv, mkv, kv_sizes.data()).ok());
  CHECK(kv_sizes == ints(load(dir + "/group_sizes_kv.npy")));
  REQUIRE(kvc::group_heads(erank_kv.data(), Hkv, mkv, kv_groups.data()).ok());
  CHECK(kv_groups == ints(load(dir + "/groups_kv.npy")));
  spec.groups = mkv;
  std::vector<Index> kv_budgets(static_cast<std::size_t>(Hkv));
  REQUIRE(kvc::head_budgets(spec, kv_groups.data(), Hkv, w, kv_budgets.data()).ok());
  auto const ref_budgets = ints(load(dir + "/budgets_kv.npy"));
  CHECK(kv_budgets == ref_budgets);
  return ref_budgets;  // the prefill and decode below use the oracle's budgets, so they are checked independently
}

void check_selection(std::string const& dir, kvc::NpyArray const& keys, kvc::NpyArray const& queries,
                     std::vector<Index> const& budgets, std::map<std::string, double> const& meta) {
  Index const B = keys.shape[0], Hkv = keys.shape[1], total = keys.shape[2], d = keys.shape[3];
  Index const Hq = queries.shape[1], g = Hq / Hkv;
  Index const w = count_of(meta, "window_size"), N = count_of(meta, "prefill_length"),
              T = count_of(meta, "decode_steps");
  REQUIRE(total == N + T);
  kvc::KVExtents const e{B, Hkv, total, d};
  float const* k_src = keys.as<float>();
  float const* q_src = queries.as<float>();
  // A dense cache with capacity N + T, holding the first N keys (values are not read: keys stand in for them).
  std::vector<float> k(static_cast<std::size_t>(e.rows() * d)), v(k.size());
  std::vector<Index> lengths(static_cast<std::size_t>(B * Hkv), N), positions(static_cast<std::size_t>(e.rows()));
  for (Index bh = 0; bh < B * Hkv; ++bh)
    for (Index t = 0; t < N; ++t) {
      std::copy_n(k_src + (bh * total + t) * d, d, k.data() + (bh * total + t) * d);
      positions[static_cast<std::size_t>(bh * total + t)] = t;
    }
  auto const cache =
      kvc::dense_cache(k.data(), v.data(), e, d, kvc::head_lengths(lengths.data(), Hkv), positions.data());
  std::vector<float> rows(static_cast<std::size_t>(e.rows() * w));
  std::vector<Index> tracked(static_cast<std::size_t>(B * Hkv), 0);
  kvc::UNCompScorer<> scorer{{{rows.data(), kvc::uncomp_window_layout(e, w)}, tracked.data()}, w};
  scorer.kernel_size = count_of(meta, "kernel_size");
  kvc::UNCompSelector const sel{kvc::HeadBudgets{budgets.data(), Hkv}, 0, w};
  kvc::Press const press{scorer, sel};

  auto update = [&](Index first, Index count) {  // query rows [first, first + count) at their positions
    std::vector<float> q(static_cast<std::size_t>(B * Hq * count * d));
    std::vector<Index> pos(static_cast<std::size_t>(B * count));
    for (Index b = 0; b < B; ++b) {
      for (Index h = 0; h < Hq; ++h)
        std::copy_n(q_src + ((b * Hq + h) * total + first) * d, count * d, q.data() + (b * Hq + h) * count * d);
      for (Index i = 0; i < count; ++i)
        pos[static_cast<std::size_t>(b * count + i)] = first + i;
    }
    kvc::WindowQueries<float> const wq{{q.data(), kvc::bhtd_layout({B, Hq, count, d})}, {}, pos.data()};
    auto const obs = kvc::observe(wq);
    kvc::test::OwnedWorkspace ws(kvc::update_workspace_bytes(kvc::Cpu{}, scorer, e, obs));
    REQUIRE(kvc::update(kvc::Cpu{}, scorer, cache, obs, ws.get()).ok());
  };
  auto evict = [&]() {
    kvc::test::OwnedPlan plan(B, Hkv, total);
    kvc::test::OwnedWorkspace ws(kvc::compress_workspace_bytes(kvc::Cpu{}, press, e));
    REQUIRE(kvc::compress(kvc::Cpu{}, press, cache, plan.plan, ws.get()).ok());
    REQUIRE(kvc::on_evict(kvc::Cpu{}, scorer, cache, plan.plan, {}).ok());
    REQUIRE(kvc::compact(kvc::Cpu{}, plan.plan, cache, scorer.state.window_rows).ok());
  };
  auto held = [&](Index b, Index h) {
    std::vector<Index> out;
    for (Index t = 0; t < lengths[static_cast<std::size_t>(b * Hkv + h)]; ++t)
      out.push_back(positions[static_cast<std::size_t>((b * Hkv + h) * total + t)]);
    return out;
  };

  // Prefill: the stored rows (oracle [B, Hkv, N, w]) and the pooled scores of the prefix.
  update(N - w, w);
  auto const window = load(dir + "/prefill_window.npy");
  REQUIRE(window.shape == std::vector<Index>{B, Hkv, N, w});
  std::vector<float> mine_rows(static_cast<std::size_t>(B * Hkv * N * w));
  for (Index bh = 0; bh < B * Hkv; ++bh)
    std::copy_n(rows.data() + bh * total * w, N * w, mine_rows.data() + bh * N * w);
  kvc::test::check_scores(mine_rows, window, N * w, 1e-5, dir + " prefill window rows");
  kvc::test::OwnedScores out(B, Hkv, total);
  out.span.lengths = cache.lengths;
  kvc::test::OwnedWorkspace sws(kvc::score_workspace_bytes(kvc::Cpu{}, scorer, e, kvc::NoObservations{}));
  REQUIRE(kvc::score(kvc::Cpu{}, scorer, cache, out.span, sws.get()).ok());
  std::vector<float> prefix(static_cast<std::size_t>(B * Hkv * (N - w)));
  for (Index bh = 0; bh < B * Hkv; ++bh)
    std::copy_n(out.data.data() + bh * total, N - w, prefix.data() + bh * (N - w));
  kvc::test::check_scores(prefix, load(dir + "/prefill_scores.npy"), N - w, 1e-5, dir + " prefill scores");

  evict();
  auto const kept = ints(load(dir + "/prefill_kept.npy"));
  auto const gap = load(dir + "/prefill_gap.npy");
  for (Index b = 0; b < B; ++b)
    for (Index h = 0; h < Hkv; ++h) {
      INFO(dir << " prefill head (" << b << ", " << h << ")");
      if (gap.as<double>()[b * Hkv + h] >= tie)
        CHECK(held(b, h) == kept_row(kept, b * Hkv + h, N));
    }

  // Decode: key N + t and query row N + t, then one eviction per head over budget.
  auto const evicted = ints(load(dir + "/decode_evicted.npy"));
  auto const decode_gap = load(dir + "/decode_gap.npy");
  bool near_tie = false;
  for (Index t = 0; t < T; ++t) {
    std::vector<std::vector<Index>> before(static_cast<std::size_t>(B * Hkv));
    for (Index b = 0; b < B; ++b)
      for (Index h = 0; h < Hkv; ++h) {
        Index& n = lengths[static_cast<std::size_t>(b * Hkv + h)];
        std::copy_n(k_src + ((b * Hkv + h) * total + N + t) * d, d, k.data() + ((b * Hkv + h) * total + n) * d);
        positions[static_cast<std::size_t>((b * Hkv + h) * total + n)] = N + t;
        ++n;
        before[static_cast<std::size_t>(b * Hkv + h)] = held(b, h);
        near_tie = near_tie || decode_gap.as<double>()[(b * Hkv + h) * T + t] < tie;
      }
    update(N + t, 1);
    evict();
    if (near_tie)
      continue;
    for (Index b = 0; b < B; ++b)
      for (Index h = 0; h < Hkv; ++h) {
        auto const& was = before[static_cast<std::size_t>(b * Hkv + h)];
        auto const now = held(b, h);
        std::vector<Index> gone;
        std::set_difference(was.begin(), was.end(), now.begin(), now.end(), std::back_inserter(gone));
        Index const expected = evicted[static_cast<std::size_t>((b * Hkv + h) * T + t)];
        INFO(dir << " decode step " << t << " head (" << b << ", " << h << ")");
        CHECK(gone == (expected < 0 ? std::vector<Index>{} : std::vector<Index>{expected}));
      }
  }
  if (!near_tie) {
    auto const final_kept = ints(load(dir + "/decode_kept.npy"));
    for (Index bh = 0; bh < B * Hkv; ++bh)
      CHECK(held(bh / Hkv, bh % Hkv) == kept_row(final_kept, bh, total));
  }
  (void)g;
}

}  // namespace

TEST_CASE("uncomp oracle: entropies, calibration, budgets, prefill and decode kept sets on every case") {
  std::string const manifest = vectors + "/uncomp_manifest.txt";
  if (!kvc::test::exists(manifest)) {
    WARN("SKIPPED: no UNComp reference vectors in " << vectors << " (needs python3-numpy; see tools/reference)");
    return;
  }
  Index cases = 0, entropies = 0;
  bool real = false;
  for (auto const& name : kvc::test::lines(manifest)) {
    if (name.rfind("uncomp_", 0) != 0 || name == "uncomp_budgets" || name == "uncomp_vote")
      continue;
    std::string const dir = vectors + "/" + name;
    auto const keys = load(dir + "/keys.npy"), queries = load(dir + "/queries.npy");
    REQUIRE(keys.dtype == kvc::NpyDtype::f32);
    REQUIRE(queries.dtype == kvc::NpyDtype::f32);
    auto const meta = read_meta(dir);
    check_entropies(dir, queries, entropies);
    auto const budgets = check_calibration(dir, queries, keys.shape[1], count_of(meta, "prefill_length"), meta);
    check_selection(dir, keys, queries, budgets, meta);
    real = real || name.find("tinystories") != std::string::npos;
    ++cases;
  }
  CHECK(cases >= 4);
  WARN("uncomp oracle: " << cases << " cases, " << entropies << " entropies" << (real ? ", real layers included" : ""));
}

TEST_CASE("uncomp oracle: balanced groups and budgets over the grid, and the majority vote") {
  std::string const dir = vectors + "/uncomp_budgets";
  if (!kvc::test::exists(dir + "/params.npy")) {
    WARN("SKIPPED: no UNComp reference vectors in " << vectors << " (needs python3-numpy; see tools/reference)");
    return;
  }
  auto const params = load(dir + "/params.npy"), entropy = load(dir + "/entropy.npy");
  auto const sizes = ints(load(dir + "/sizes.npy")), groups = ints(load(dir + "/groups.npy")),
             budgets = ints(load(dir + "/budgets.npy"));
  Index const rows = params.shape[0], width = entropy.shape[1];
  for (Index r = 0; r < rows; ++r) {
    double const* p = params.as<double>() + r * 5;
    Index const H = static_cast<Index>(p[0]), M = static_cast<Index>(p[1]), w = static_cast<Index>(p[4]);
    INFO("grid row " << r << ": H " << H << " M " << M << " B " << p[2] << " step " << p[3] << " w " << w);
    std::vector<Index> s(static_cast<std::size_t>(M)), grp(static_cast<std::size_t>(H)),
        bud(static_cast<std::size_t>(H));
    REQUIRE(kvc::balanced_group_sizes(H, M, s.data()).ok());
    CHECK(s == kept_row(sizes, r, width));
    REQUIRE(kvc::group_heads(entropy.as<double>() + r * width, H, M, grp.data()).ok());
    std::vector<Index> expected_groups = row_of(groups, r, width);
    expected_groups.resize(static_cast<std::size_t>(H));
    CHECK(grp == expected_groups);
    kvc::HeadBudgetSpec spec;
    spec.average = p[2];
    spec.groups = M;
    spec.step = p[3];
    REQUIRE(kvc::head_budgets(spec, grp.data(), H, w, bud.data()).ok());
    std::vector<Index> expected_budgets = row_of(budgets, r, width);
    expected_budgets.resize(static_cast<std::size_t>(H));
    CHECK(bud == expected_budgets);
  }

  std::string const vdir = vectors + "/uncomp_vote";
  auto const vparams = load(vdir + "/params.npy"), ventropy = load(vdir + "/entropy.npy");
  auto const labels = ints(load(vdir + "/labels.npy")), vote = ints(load(vdir + "/vote.npy")),
             mean = ints(load(vdir + "/mean.npy"));
  Index const vrows = vparams.shape[0], S = ventropy.shape[1], vw = ventropy.shape[2];
  for (Index r = 0; r < vrows; ++r) {
    auto const* p = vparams.as<std::int64_t>() + r * 3;
    Index const H = p[0], M = p[1];
    REQUIRE(p[2] == S);
    INFO("vote row " << r << ": H " << H << " M " << M);
    std::vector<Index> lab(static_cast<std::size_t>(S * H)), got(static_cast<std::size_t>(H));
    std::vector<double> avg(static_cast<std::size_t>(H), 0.0);
    for (Index s = 0; s < S; ++s)
      for (Index h = 0; h < H; ++h) {
        lab[static_cast<std::size_t>(s * H + h)] = labels[static_cast<std::size_t>((r * S + s) * vw + h)];
        avg[static_cast<std::size_t>(h)] += ventropy.as<double>()[(r * S + s) * vw + h];  // NumPy's order
      }
    for (double& x : avg)
      x /= static_cast<double>(S);
    REQUIRE(kvc::majority_vote_groups(lab.data(), S, H, M, got.data()).ok());
    std::vector<Index> expected = row_of(vote, r, vw);
    expected.resize(static_cast<std::size_t>(H));
    CHECK(got == expected);
    REQUIRE(kvc::group_heads(avg.data(), H, M, got.data()).ok());
    expected = row_of(mean, r, vw);
    expected.resize(static_cast<std::size_t>(H));
    CHECK(got == expected);
  }
}
