// SPDX-License-Identifier: Apache-2.0
// tests/reference/rdkv_oracle_test.cpp: RDKV against the independent NumPy oracle (tools/reference/rdkv.py) on the
// cases of rdkv_manifest.txt (tools/reference/make_vectors.py): random caches (GQA 4 and MHA, d = 16 and 32, N = 40
// to 300, per-head lengths that differ, a head shorter than the window's context) and, when shared/ has it,
// tinystories-656k's layers 0 and 1 (real post-RoPE keys, values and queries). The vectors come from the ctest
// fixture kvc.reference.vectors; without NumPy the test is skipped.
//
// Per case: the attn_linear token weights (kvc::score with RDKVTokenScorer) and ThinK channel weights
// (kvc::score_channels); per plan (exact, lagrangian and dp at two budgets, rho 0.5 and 0.25, a ratio budget, and
// exact and lagrangian without eviction, the quant-only ablation) the bit plan of kvc::allocate_bits on the oracle's
// weights rounded to fp32, each head's V and K knapsack through kvc::exact_bits / kvc::lagrangian_bits /
// kvc::tools::dp_bits directly, and the plan of allocate_bits on kvc's own weights; per pack (KIVI float-min, the
// authors' integer zero point with K16 clamped to 8, grouped float-min with V groups of d/2 channels and K groups of 16
// tokens) kvc::pack of the oracle's plan, kvc::dequantized (positions, K̂ in original channel order, V̂, packed order)
// and kvc::attend_packed of a few queries.
//
// Tolerances: weights (fp32 against fp64) within 1e-5 of the head's largest weight; bit plans exact where the
// oracle's plan is stable (gaps_<plan>.npy: the plan survives relative perturbations of its weights of 1e-12 — a
// plan of the same fp32 weights must match — or, for kvc's own weights, of more than their observed error); a head
// whose plan is an exact tie (a Lagrangian bisection that never converges ends at a threshold λ) may differ in one
// unit; dp is compared by its distortion (1e-12 relative). Dequantised tensors within FP16 rounding (2^-11
// relative; both sides use float32 parameter and code arithmetic), except a code whose pre-rounding value lies
// within 1e-4 of a rounding boundary (kmargin/vmargin), which may round the other way; attention within 1e-5 of the
// row's largest output (lse within 1e-5 of max(1, |lse|)), on heads without such a flip.
#include <kvc/attention/packed.hpp>
#include <kvc/backend/cpu/attention/packed.hpp>
#include <kvc/backend/cpu/scorers/rdkv.hpp>
#include <kvc/backend/cpu/selectors/rdkv.hpp>
#include <kvc/pipeline/pack.hpp>
#include <kvc/rate_distortion/epsilon.hpp>
#include <kvc/rate_distortion/knapsack.hpp>
#include <kvc/scorers/rdkv.hpp>
#include <kvc/selectors/rdkv.hpp>
#include <kvc/store/packed_kv.hpp>

#include "common/knapsack_dp.hpp"
#include "io/npy.hpp"
#include "support/catch.hpp"
#include "support/helpers.hpp"
#include "support/vectors.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <sstream>
#include <string>
#include <vector>

using kvc::Index;
using kvc::test::load;

namespace {

std::string const& vectors = kvc::test::vectors_dir;

/// meta.txt, plans.txt, packs.txt: whitespace-separated words per line.
std::vector<std::vector<std::string>> words(std::string const& path) {
  std::vector<std::vector<std::string>> out;
  for (auto const& line : kvc::test::lines(path)) {
    std::istringstream in(line);
    std::vector<std::string> w;
    for (std::string x; in >> x;)
      w.push_back(x);
    if (!w.empty())
      out.push_back(w);
  }
  return out;
}

kvc::EpsilonTable eps_named(std::string const& name) {
  INFO("epsilon table " << name);
  if (name == "llama31_v")
    return kvc::EpsilonTable::llama31_v();
  if (name == "llama31_k")
    return kvc::EpsilonTable::llama31_k();
  if (name == "default_v")
    return kvc::EpsilonTable::default_v();
  REQUIRE(name == "default_k");
  return kvc::EpsilonTable::default_k();
}

std::vector<float> floats(kvc::NpyArray const& a) {
  REQUIRE(a.dtype == kvc::NpyDtype::f32);
  return {a.as<float>(), a.as<float>() + a.size()};
}

std::vector<double> doubles(kvc::NpyArray const& a) {
  REQUIRE(a.dtype == kvc::NpyDtype::f64);
  return {a.as<double>(), a.as<double>() + a.size()};
}

std::vector<Index> ints(kvc::NpyArray const& a) {
  REQUIRE(a.dtype == kvc::NpyDtype::i64);
  return {a.as<std::int64_t>(), a.as<std::int64_t>() + a.size()};
}

std::vector<float> kvmargins(kvc::NpyArray const& a) {
  return floats(a);
}

/// One case's inputs and the views over them.
struct Case {
  std::string dir;
  Index B = 0, H = 0, Hq = 0, N = 0, d = 0, W = 0, kernel = 0, nq = 0;
  std::vector<float> keys, values, queries, attn_queries;
  std::vector<Index> lengths, positions, query_positions, attn_positions;
  kvc::EpsilonTable eps_v, eps_k;

  explicit Case(std::string const& name) : dir(vectors + "/" + name) {
    auto const k = load(dir + "/keys.npy"), q = load(dir + "/queries.npy"), aq = load(dir + "/attn_queries.npy");
    REQUIRE(k.shape.size() == 4);
    B = k.shape[0], H = k.shape[1], N = k.shape[2], d = k.shape[3];
    Hq = q.shape[1], W = q.shape[2], nq = aq.shape[2];
    keys = floats(k), values = floats(load(dir + "/values.npy")), queries = floats(q), attn_queries = floats(aq);
    lengths = ints(load(dir + "/lengths.npy"));
    query_positions = ints(load(dir + "/query_positions.npy"));
    attn_positions = ints(load(dir + "/attn_positions.npy"));
    REQUIRE(static_cast<Index>(lengths.size()) == B * H);
    positions.resize(static_cast<std::size_t>(B * H * N));
    for (Index i = 0; i < B * H * N; ++i)
      positions[static_cast<std::size_t>(i)] = i % N;  // key j of a head at position j
    std::map<std::string, std::string> meta;
    for (auto const& w : words(dir + "/meta.txt"))
      if (w.size() == 2)
        meta[w[0]] = w[1];
    REQUIRE(meta.count("window_size") == 1);
    REQUIRE(std::stol(meta["window_size"]) == W);
    kernel = std::stol(meta.at("kernel_size"));
    eps_v = eps_named(meta.at("eps_v"));
    eps_k = eps_named(meta.at("eps_k"));
  }
  Index n(Index b, Index h) const { return lengths[static_cast<std::size_t>(b * H + h)]; }
  kvc::KVExtents extents() const { return {B, H, N, d}; }
  auto cache() {
    return kvc::dense_cache(keys.data(), values.data(), extents(), kvc::head_lengths(lengths.data(), H),
                            positions.data());
  }
  kvc::WindowQueries<float> window_queries() const {
    return {kvc::TokenRows<float const, kvc::StridedLayout>(queries.data(), kvc::bhtd_layout({B, Hq, W, d})),
            {},
            query_positions.data()};
  }
};

/// Largest |got - ref| over a head's valid entries, relative to the head's largest |ref|; checks it is <= tol.
double check_rows(std::vector<float> const& got, std::vector<double> const& ref, Case const& c, Index width,
                  bool per_token, double tol, std::string const& what) {
  double worst = 0;
  for (Index b = 0; b < c.B; ++b)
    for (Index h = 0; h < c.H; ++h) {
      Index const n = per_token ? c.n(b, h) : width;
      std::size_t const at = static_cast<std::size_t>((b * c.H + h) * width);
      double top = 0;
      for (Index j = 0; j < n; ++j)
        top = std::max(top, std::abs(ref[at + static_cast<std::size_t>(j)]));
      for (Index j = 0; j < n; ++j)
        worst = std::max(worst, std::abs(static_cast<double>(got[at + static_cast<std::size_t>(j)]) -
                                         ref[at + static_cast<std::size_t>(j)]) /
                                    std::max(top, 1e-300));
    }
  INFO(c.dir << ": " << what << ": worst error relative to the head's max " << worst << " (tolerance " << tol << ")");
  CHECK(worst <= tol);
  return worst;
}

/// kvc's own weights of a case: token weights [B, H, N] and channel weights [B, H, d].
struct Weights {
  std::vector<float> token, channel;
};

Weights kvc_weights(Case& c) {
  auto cache = c.cache();
  auto const obs = kvc::observe(c.window_queries());
  kvc::RDKVTokenScorer ts;
  ts.window_size = c.W;
  ts.kernel_size = c.kernel;
  kvc::test::OwnedScores out(c.B, c.H, c.N);
  out.span.lengths = cache.lengths;
  kvc::test::OwnedWorkspace ws(kvc::score_workspace_bytes(kvc::Cpu{}, ts, c.extents(), obs));
  auto st = kvc::score(kvc::Cpu{}, ts, cache, obs, out.span, ws.get());
  INFO(c.dir << ": kvc::score(rdkv): " << st.message());
  REQUIRE(st.ok());
  kvc::ThinKChannelScorer cs;
  cs.window_size = c.W;
  std::vector<float> ch(static_cast<std::size_t>(c.B * c.H * c.d), -7.0f);
  kvc::test::OwnedWorkspace cws(kvc::channel_score_workspace_bytes(kvc::Cpu{}, cs, c.extents(), obs));
  st = kvc::score_channels(kvc::Cpu{}, cs, cache, obs, ch.data(), cws.get());
  INFO(c.dir << ": kvc::score_channels: " << st.message());
  REQUIRE(st.ok());
  return {out.data, ch};
}

/// A bit plan's owned tables.
struct Plan {
  std::vector<std::int8_t> v, k;
};

Plan plan_of_oracle(Case const& c, std::string const& name) {
  auto const v = ints(load(c.dir + "/v_bits_" + name + ".npy")), k = ints(load(c.dir + "/k_bits_" + name + ".npy"));
  REQUIRE(static_cast<Index>(v.size()) == c.B * c.H * c.N);
  REQUIRE(static_cast<Index>(k.size()) == c.B * c.H * c.d);
  Plan p;
  for (Index x : v)
    p.v.push_back(static_cast<std::int8_t>(x));
  for (Index x : k)
    p.k.push_back(static_cast<std::int8_t>(x));
  return p;
}

Plan allocate(Case& c, kvc::RDKVAllocator const& a, std::vector<float> const& token,
              std::vector<float> const& channel) {
  Plan p{std::vector<std::int8_t>(static_cast<std::size_t>(c.B * c.H * c.N), -1),
         std::vector<std::int8_t>(static_cast<std::size_t>(c.B * c.H * c.d), -1)};
  std::vector<float> tw = token;
  kvc::ScoreSpan<> const span{tw.data(), c.B, c.H, c.N, kvc::head_lengths(c.lengths.data(), c.H)};
  kvc::test::OwnedWorkspace ws(kvc::allocate_bits_workspace_bytes(kvc::Cpu{}, a, c.B, c.H, c.N, c.d));
  auto const st = kvc::allocate_bits(kvc::Cpu{}, a, span, channel.data(),
                                     kvc::BitPlan<>{p.v.data(), p.k.data(), c.B, c.H, c.N, c.d}, ws.get());
  INFO(c.dir << ": kvc::allocate_bits: " << st.message());
  REQUIRE(st.ok());
  return p;
}

Index differing(std::int8_t const* a, std::int8_t const* b, Index n) {
  Index diff = 0;
  for (Index i = 0; i < n; ++i)
    diff += a[i] != b[i];
  return diff;
}

/// Compares a head's V (valid slots) and K bits with the oracle's: equal when `stable`, else at most one unit of
/// V may differ (a tie at the final λ), and K is compared only when V agrees (T_eff sets K's budget).
/// Returns whether the head matched exactly.
bool compare_head(Case const& c, Plan const& got, Plan const& ref, Index b, Index h, bool stable_v, bool stable_k,
                  std::string const& what) {
  std::size_t const v0 = static_cast<std::size_t>((b * c.H + h) * c.N),
                    k0 = static_cast<std::size_t>((b * c.H + h) * c.d);
  Index const n = c.n(b, h);
  Index const dv = differing(got.v.data() + v0, ref.v.data() + v0, n);
  Index const dk = differing(got.k.data() + k0, ref.k.data() + k0, c.d);
  std::ostringstream msg;
  for (Index t = 0; t < n; ++t)
    if (got.v[v0 + static_cast<std::size_t>(t)] != ref.v[v0 + static_cast<std::size_t>(t)])
      msg << " v[" << t << "] " << int{got.v[v0 + static_cast<std::size_t>(t)]} << " (oracle "
          << int{ref.v[v0 + static_cast<std::size_t>(t)]} << ")";
  for (Index j = 0; j < c.d; ++j)
    if (got.k[k0 + static_cast<std::size_t>(j)] != ref.k[k0 + static_cast<std::size_t>(j)])
      msg << " k[" << j << "] " << int{got.k[k0 + static_cast<std::size_t>(j)]} << " (oracle "
          << int{ref.k[k0 + static_cast<std::size_t>(j)]} << ")";
  INFO(c.dir << " " << what << " head (" << b << ", " << h << "):" << msg.str());
  if (stable_v)
    CHECK(dv == 0);
  else
    CHECK(dv <= 1);
  if (dv == 0) {
    if (stable_k)
      CHECK(dk == 0);
    else
      CHECK(dk <= 1);
  }
  // padding slots are 0
  for (Index t = n; t < c.N; ++t)
    CHECK(got.v[v0 + static_cast<std::size_t>(t)] == 0);
  return dv == 0 && dk == 0;
}

/// The library solver of an oracle solver name (dp is the tools' reference, not a library solver: exact stands in).
kvc::BitSolver solver_named(std::string const& s) {
  if (s == "lagrangian")
    return kvc::BitSolver::lagrangian;
  REQUIRE((s == "exact" || s == "dp"));
  return kvc::BitSolver::exact;
}

/// The knapsacks of one head straight through kvc::exact_bits / lagrangian_bits / kvc::tools::dp_bits on the oracle's
/// fp32 weights and the oracle's budgets: V over the head's n tokens, K over the d channels.
void check_knapsacks(Case const& c, std::string const& solver, kvc::BitOptions opt, std::vector<float> const& tw,
                     std::vector<float> const& cw, std::vector<double> const& budgets, std::vector<double> const& gaps,
                     Plan const& ref, Index b, Index h, std::string const& plan) {
  Index const n = c.n(b, h);
  std::size_t const bh = static_cast<std::size_t>(b * c.H + h);
  float const* w[2] = {tw.data() + bh * static_cast<std::size_t>(c.N), cw.data() + bh * static_cast<std::size_t>(c.d)};
  Index const units[2] = {n, c.d};
  std::int8_t const* expect[2] = {ref.v.data() + bh * static_cast<std::size_t>(c.N),
                                  ref.k.data() + bh * static_cast<std::size_t>(c.d)};
  kvc::EpsilonTable const* eps[2] = {&c.eps_v, &c.eps_k};
  for (int side = 0; side < 2; ++side) {
    Index const m = units[side];
    double const budget = budgets[bh * 2 + static_cast<std::size_t>(side)];
    INFO(c.dir << " " << plan << " head (" << b << ", " << h << ") " << (side == 0 ? "V" : "K") << " knapsack, budget "
               << budget);
    if (m == 0 || budget / static_cast<double>(m) >= 16.0)
      continue;  // the allocator's shortcut (every unit at 16), not a knapsack
    std::vector<std::int8_t> bits(static_cast<std::size_t>(m), -1);
    if (solver == "exact") {
      std::vector<std::byte> scratch(kvc::exact_bits_scratch_bytes(m));
      REQUIRE(kvc::exact_bits(w[side], m, *eps[side], opt, static_cast<std::int64_t>(budget), bits.data(),
                              scratch.data(), scratch.size())
                  .ok());
      CHECK(differing(bits.data(), expect[side], m) == 0);
    } else if (solver == "lagrangian") {
      REQUIRE(kvc::lagrangian_bits(w[side], m, *eps[side], opt, budget / static_cast<double>(m), {}, bits.data()).ok());
      Index const diff = differing(bits.data(), expect[side], m);
      if (gaps[bh * 2 + static_cast<std::size_t>(side)] > 0)
        CHECK(diff == 0);
      else
        CHECK(diff <= 1);
    } else {
      REQUIRE(kvc::tools::dp_bits(w[side], m, *eps[side], opt, static_cast<std::int64_t>(budget), bits.data()).ok());
      std::int64_t sum = 0;
      for (std::int8_t x : bits)
        sum += x;
      CHECK(sum <= static_cast<std::int64_t>(budget));
      double const mine = kvc::distortion(w[side], m, *eps[side], bits.data());
      double const oracle = kvc::distortion(w[side], m, *eps[side], expect[side]);
      INFO("dp distortion " << mine << ", oracle " << oracle);
      CHECK(std::abs(mine - oracle) <= 1e-12 * std::max(oracle, 1e-300));
    }
  }
}

std::vector<std::string> manifest_cases() {
  std::vector<std::string> out;
  for (auto const& name : kvc::test::lines(vectors + "/rdkv_manifest.txt"))
    if (name.rfind("rdkv_", 0) == 0)
      out.push_back(name);
  return out;
}

bool have_vectors() {
  if (kvc::test::exists(vectors + "/rdkv_manifest.txt"))
    return true;
  WARN("SKIPPED: no RDKV reference vectors in " << vectors << " (needs python3-numpy; see tools/reference)");
  return false;
}

}  // namespace

TEST_CASE("rdkv oracle: attn_linear token weights and ThinK channel weights on every case") {
  if (!have_vectors())
    return;
  Index cases = 0;
  double worst_t = 0, worst_c = 0;
  for (auto const& name : manifest_cases()) {
    Case c(name);
    Weights const w = kvc_weights(c);
    worst_t = std::max(
        worst_t, check_rows(w.token, doubles(load(c.dir + "/token_weights.npy")), c, c.N, true, 1e-5, "token weights"));
    worst_c = std::max(worst_c, check_rows(w.channel, doubles(load(c.dir + "/channel_weights.npy")), c, c.d, false,
                                           1e-5, "channel weights"));
    for (Index b = 0; b < c.B; ++b)  // padding slots are -inf (the scorer convention)
      for (Index h = 0; h < c.H; ++h)
        for (Index t = c.n(b, h); t < c.N; ++t)
          CHECK(w.token[static_cast<std::size_t>((b * c.H + h) * c.N + t)] == -std::numeric_limits<float>::infinity());
    ++cases;
  }
  CHECK(cases >= 4);
  WARN("rdkv oracle: " << cases << " cases; worst token weight error " << worst_t << ", channel " << worst_c
                       << " (relative to the head's max)");
}

TEST_CASE("rdkv oracle: bit plans of allocate_bits and of the knapsack solvers on every case") {
  if (!have_vectors())
    return;
  Index plans = 0, heads = 0, tied = 0, tie_diff = 0, own_compared = 0, own_skipped = 0, own_mismatch = 0;
  for (auto const& name : manifest_cases()) {
    Case c(name);
    auto const tw64 = doubles(load(c.dir + "/token_weights.npy")), cw64 = doubles(load(c.dir + "/channel_weights.npy"));
    std::vector<float> tw(tw64.size()), cw(cw64.size());
    for (std::size_t i = 0; i < tw.size(); ++i)
      tw[i] = static_cast<float>(tw64[i]);
    for (std::size_t i = 0; i < cw.size(); ++i)
      cw[i] = static_cast<float>(cw64[i]);
    for (Index b = 0; b < c.B; ++b)
      for (Index h = 0; h < c.H; ++h)
        for (Index t = c.n(b, h); t < c.N; ++t)
          tw[static_cast<std::size_t>((b * c.H + h) * c.N + t)] = -std::numeric_limits<float>::infinity();
    Weights const own = kvc_weights(c);
    // each head's largest relative weight error of kvc's own weights (token, channel)
    std::vector<double> err_t(static_cast<std::size_t>(c.B * c.H), 0.0), err_c(err_t.size(), 0.0);
    for (Index bh = 0; bh < c.B * c.H; ++bh) {
      for (Index t = 0; t < c.lengths[static_cast<std::size_t>(bh)]; ++t) {
        std::size_t const i = static_cast<std::size_t>(bh * c.N + t);
        err_t[static_cast<std::size_t>(bh)] =
            std::max(err_t[static_cast<std::size_t>(bh)], std::abs(own.token[i] - tw64[i]) / tw64[i]);
      }
      for (Index j = 0; j < c.d; ++j) {
        std::size_t const i = static_cast<std::size_t>(bh * c.d + j);
        err_c[static_cast<std::size_t>(bh)] =
            std::max(err_c[static_cast<std::size_t>(bh)], std::abs(own.channel[i] - cw64[i]) / cw64[i]);
      }
    }
    for (auto const& line : words(c.dir + "/plans.txt")) {
      REQUIRE(line.size() == 6);
      std::string const& plan = line[0];
      std::string const& solver = line[1];
      kvc::RDKVAllocator a;
      a.budget_tokens = std::stol(line[2]);
      a.ratio = std::stod(line[3]);
      a.k_budget_ratio = std::stod(line[4]);
      a.solver = solver_named(solver);
      a.eps_v = c.eps_v;
      a.eps_k = c.eps_k;
      a.options.evict = line[5] == "1";
      Plan const ref = plan_of_oracle(c, plan);
      auto const gaps = doubles(load(c.dir + "/gaps_" + plan + ".npy"));
      auto const budgets = doubles(load(c.dir + "/budgets_" + plan + ".npy"));
      for (Index b = 0; b < c.B; ++b)
        for (Index h = 0; h < c.H; ++h)
          check_knapsacks(c, solver, a.options, tw, cw, budgets, gaps, ref, b, h, plan);
      if (solver == "dp")  // a tools reference, not a library solver: the knapsacks above cover it
        continue;
      Plan const got = allocate(c, a, tw, cw);
      Plan const mine = allocate(c, a, own.token, own.channel);
      for (Index b = 0; b < c.B; ++b)
        for (Index h = 0; h < c.H; ++h) {
          std::size_t const bh = static_cast<std::size_t>(b * c.H + h);
          bool const sv = gaps[bh * 2] > 0, sk = gaps[bh * 2 + 1] > 0;
          tied += !(sv && sk);
          tie_diff += !compare_head(c, got, ref, b, h, sv, sk, plan + " (oracle weights)");
          ++heads;
          // kvc's own weights: the plan must match where it is stable beyond their error
          if (err_t[bh] < gaps[bh * 2] && err_c[bh] < gaps[bh * 2 + 1]) {
            ++own_compared;
            own_mismatch += !compare_head(c, mine, ref, b, h, true, true, plan + " (kvc's weights)");
          } else {
            ++own_skipped;
          }
        }
      ++plans;
    }
  }
  CHECK(plans >= 20);
  CHECK(own_compared > 0);
  WARN("rdkv oracle: " << plans << " plans, " << heads << " head plans on the oracle's weights (" << tied
                       << " with an exact tie: one unit may differ, " << tie_diff << " differed); on kvc's own weights "
                       << own_compared << " compared (" << own_mismatch << " differed), " << own_skipped
                       << " skipped (less stable than the weights' error)");
}

TEST_CASE("rdkv oracle: pack, dequantized and attend_packed against the dequantised kept set") {
  if (!have_vectors())
    return;
  Index packs = 0, heads = 0, flips = 0, attn_rows = 0;
  double worst_kv = 0, worst_out = 0;
  for (auto const& name : manifest_cases()) {
    Case c(name);
    auto cache = c.cache();
    for (auto const& line : words(c.dir + "/packs.txt")) {
      REQUIRE(line.size() == 6);
      std::string const& pack = line[0];
      Plan plan = plan_of_oracle(c, line[1]);
      kvc::PackOptions opt;
      REQUIRE((line[2] == "float_min" || line[2] == "integer"));
      opt.zero_point = line[2] == "integer" ? kvc::ZeroPoint::integer : kvc::ZeroPoint::float_min;
      opt.v_group = std::stol(line[3]);
      opt.k_group = std::stol(line[4]);
      opt.clamp_k16_to_8 = line[5] == "1";
      kvc::PackedKV kv;
      auto const st = kvc::pack(cache, kvc::BitPlan<>{plan.v.data(), plan.k.data(), c.B, c.H, c.N, c.d}, opt, kv);
      INFO(c.dir << " pack " << pack << ": " << st.message());
      REQUIRE(st.ok());
      auto const pos = ints(load(c.dir + "/positions_" + pack + ".npy"));
      auto const khat = doubles(load(c.dir + "/khat_" + pack + ".npy"));
      auto const vhat = doubles(load(c.dir + "/vhat_" + pack + ".npy"));
      auto const kmar = kvmargins(load(c.dir + "/kmargin_" + pack + ".npy"));
      auto const vmar = kvmargins(load(c.dir + "/vmargin_" + pack + ".npy"));
      std::vector<bool> flipped(static_cast<std::size_t>(c.B * c.H), false);
      for (Index b = 0; b < c.B; ++b)
        for (Index h = 0; h < c.H; ++h) {
          std::size_t const bh = static_cast<std::size_t>(b * c.H + h);
          Index T = 0;
          while (T < c.N && pos[bh * static_cast<std::size_t>(c.N) + static_cast<std::size_t>(T)] >= 0)
            ++T;
          INFO(c.dir << " pack " << pack << " head (" << b << ", " << h << ")");
          REQUIRE(kv.tokens(b, h) == T);
          std::vector<float> k(static_cast<std::size_t>(T * c.d)), v(k.size());
          std::vector<Index> p(static_cast<std::size_t>(T));
          kvc::dequantized(kv, b, h, k.data(), v.data(), p.data());
          std::vector<Index> const expect(pos.begin() + static_cast<std::ptrdiff_t>(bh) * c.N,
                                          pos.begin() + static_cast<std::ptrdiff_t>(bh) * c.N + T);
          CHECK(p == expect);
          for (int side = 0; side < 2; ++side) {
            auto const& got = side == 0 ? k : v;
            auto const& ref = side == 0 ? khat : vhat;
            auto const& mar = side == 0 ? kmar : vmar;
            for (Index i = 0; i < T * c.d; ++i) {
              std::size_t const at = bh * static_cast<std::size_t>(c.N * c.d) + static_cast<std::size_t>(i);
              double const r = ref[at], e = std::abs(static_cast<double>(got[static_cast<std::size_t>(i)]) - r);
              if (e <= std::ldexp(std::abs(r), -11) + 1e-7) {
                worst_kv = std::max(worst_kv, e / std::max(std::abs(r), 1e-7));
                continue;
              }
              INFO((side == 0 ? "K^" : "V^")
                   << " token " << i / c.d << " channel " << i % c.d << ": " << got[static_cast<std::size_t>(i)]
                   << " vs oracle " << r << " (code margin " << mar[at] << ")");
              CHECK(mar[at] < 1e-4f);  // only a code at a rounding boundary may round the other way
              flipped[bh] = true;
              ++flips;
            }
          }
          ++heads;
        }
      // attention over the packed layer
      kvc::AttendQueries<float> const q{kvc::TokenRows<float const, kvc::StridedLayout>(
                                            c.attn_queries.data(), kvc::bhtd_layout({c.B, c.Hq, c.nq, c.d})),
                                        c.attn_positions.data()};
      std::vector<float> out(static_cast<std::size_t>(c.B * c.Hq * c.nq * c.d), -7.0f),
          lse(static_cast<std::size_t>(c.B * c.Hq * c.nq), -7.0f);
      kvc::test::OwnedWorkspace ws(kvc::attend_packed_workspace_bytes(kvc::Cpu{}, kvc::Attention{}, q, kv.view()));
      auto const ast =
          kvc::attend_packed(kvc::Cpu{}, kvc::Attention{}, q, kv.view(), {out.data(), lse.data()}, ws.get());
      INFO(c.dir << " pack " << pack << ": attend_packed: " << ast.message());
      REQUIRE(ast.ok());
      auto const ref_out = doubles(load(c.dir + "/out_" + pack + ".npy"));
      auto const ref_lse = doubles(load(c.dir + "/lse_" + pack + ".npy"));
      Index const g = c.Hq / c.H;
      for (Index b = 0; b < c.B; ++b)
        for (Index qh = 0; qh < c.Hq; ++qh) {
          if (flipped[static_cast<std::size_t>(b * c.H + qh / g)])
            continue;
          for (Index i = 0; i < c.nq; ++i) {
            std::size_t const row = static_cast<std::size_t>((b * c.Hq + qh) * c.nq + i);
            INFO(c.dir << " pack " << pack << " attention row (" << b << ", " << qh << ", " << i << ")");
            double top = 0, e = 0;
            for (Index j = 0; j < c.d; ++j)
              top = std::max(top, std::abs(ref_out[row * static_cast<std::size_t>(c.d) + static_cast<std::size_t>(j)]));
            for (Index j = 0; j < c.d; ++j) {
              std::size_t const at = row * static_cast<std::size_t>(c.d) + static_cast<std::size_t>(j);
              e = std::max(e, std::abs(out[at] - ref_out[at]));
            }
            CHECK(e <= 1e-5 * std::max(top, 1e-30));
            worst_out = std::max(worst_out, e / std::max(top, 1e-30));
            if (std::isinf(ref_lse[row]))
              CHECK(lse[row] == -std::numeric_limits<float>::infinity());
            else
              CHECK(std::abs(lse[row] - ref_lse[row]) <= 1e-5 * std::max(1.0, std::abs(ref_lse[row])));
            ++attn_rows;
          }
        }
      ++packs;
    }
  }
  CHECK(packs >= 12);
  WARN("rdkv oracle: " << packs << " packs, " << heads << " heads; worst K^/V^ error " << worst_kv << " (relative), "
                       << flips << " codes rounded the other way at a boundary; " << attn_rows
                       << " attention rows, worst error " << worst_out << " (relative to the row's max)");
}
