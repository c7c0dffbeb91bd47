// SPDX-License-Identifier: Apache-2.0
// tests/selectors/rdkv_test.cpp mirrors include/kvc/selectors/rdkv.hpp (and its CPU kernel): RDKV's budget arithmetic
// per (sequence, KV head), spec rdkv.md §2.6 and §8 P7, P12, on hand cases worked out in the comments. The
// knapsack solvers themselves are tested in tests/rate_distortion/knapsack_test.cpp.
//
// Hand cases use two weight levels, "big" (1) and "tiny" (1e-6), with the Llama tables. Gain rates per bit of the
// hull edges (eps_k − eps_k+1) / (b_k+1 − b_k) for w = 1:
//   V (llama31_v): 0->2 0.343565, 2->4 0.149442, 4->8 (cost 4) 0.00348436, 8->16 (cost 8) 6.07e-6;
//   K (llama31_k): 0->2 0.42553,  2->4 0.0713487, 4->8 (cost 4) 0.00155521, 8->16 (cost 8) 2.72e-6.
// A tiny unit's best rate is 4.3e-7, below every big edge, so the exact solver serves big units first.
#include <kvc/backend/cpu/selectors/rdkv.hpp>
#include <kvc/backend/cpu/thread_pool.hpp>
#include <kvc/rate_distortion/knapsack.hpp>

#include "support/catch.hpp"
#include "support/helpers.hpp"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

namespace {

using kvc::BitSolver;
using kvc::Index;
using kvc::RDKVAllocator;
using kvc::RDKVBudgetScope;
using Bits = std::vector<std::int8_t>;
using Weights = std::vector<float>;

struct Plan {
  kvc::Status status;
  Bits v, k;
  Bits v_row(Index b, Index h, Index heads, Index tokens) const {
    auto const first = v.begin() + (b * heads + h) * tokens;
    return {first, first + tokens};
  }
  Bits k_row(Index b, Index h, Index heads, Index dim) const {
    auto const first = k.begin() + (b * heads + h) * dim;
    return {first, first + dim};
  }
};

/// kvc::allocate_bits on host buffers; `lengths` per (sequence, head) when given.
Plan run(RDKVAllocator const& a, Index batch, Index heads, Index tokens, Index dim, Weights tw, Weights const& cw,
         std::vector<Index> lengths = {}, kvc::Cpu const& cpu = {}) {
  Plan p{{},
         Bits(static_cast<std::size_t>(batch * heads * tokens), -7),
         Bits(static_cast<std::size_t>(batch * heads * dim), -7)};
  kvc::Lengths const len = lengths.empty() ? kvc::Lengths{} : kvc::head_lengths(lengths.data(), heads);
  kvc::ScoreSpan<> const s{tw.data(), batch, heads, tokens, len};
  kvc::test::OwnedWorkspace ws(kvc::allocate_bits_workspace_bytes(cpu, a, batch, heads, tokens, dim));
  p.status = kvc::allocate_bits(cpu, a, s, cw.data(), kvc::BitPlan<>{p.v.data(), p.k.data(), batch, heads, tokens, dim},
                                ws.get());
  return p;
}

Plan run_ok(RDKVAllocator const& a, Index batch, Index heads, Index tokens, Index dim, Weights const& tw,
            Weights const& cw, std::vector<Index> lengths = {}) {
  Plan p = run(a, batch, heads, tokens, dim, tw, cw, std::move(lengths));
  INFO(p.status.message());
  REQUIRE(p.status.ok());
  return p;
}

RDKVAllocator with_budget(Index budget, BitSolver solver = BitSolver::exact) {
  RDKVAllocator a;
  a.budget_tokens = budget;
  a.solver = solver;
  return a;
}

std::int64_t total(Bits const& b) {
  return std::accumulate(b.begin(), b.end(), std::int64_t{0}, [](std::int64_t s, std::int8_t x) { return s + x; });
}

/// 16 token weights with big (1) tokens at `big`, tiny (1e-6) elsewhere.
Weights tokens_with_big(Index n, std::vector<Index> const& big) {
  Weights w(static_cast<std::size_t>(n), 1e-6f);
  for (Index t : big)
    w[static_cast<std::size_t>(t)] = 1.0f;
  return w;
}

std::vector<Index> const big_tokens = {0, 2, 3, 7, 9, 10, 12, 15};
Weights const big_channels = {1e-6f, 1.0f, 1e-6f, 1e-6f, 1e-6f, 1.0f, 1e-6f, 1e-6f};  // channels 1 and 5

}  // namespace

TEST_CASE("P7 short context: T <= B keeps every token and channel at 16 bits") {
  // n = 100 <= B = 128: V budget 16 B = 2048 >= 16 n; K budget floor(0.5 · 2·128·8·16 / 100) = 163 >= 16 · 8.
  std::mt19937 rng(1);
  Weights tw(100), cw(8);
  for (float& x : tw)
    x = float(rng() % 4) * 0.25f;  // includes weight 0: kept at 16 too
  for (float& x : cw)
    x = float(rng() % 4);
  for (BitSolver s : {BitSolver::exact, BitSolver::lagrangian}) {
    Plan const p = run_ok(with_budget(128, s), 1, 1, 100, 8, tw, cw);
    CHECK(p.v == Bits(100, 16));
    CHECK(p.k == Bits(8, 16));
  }
}

TEST_CASE("P7 budget 0 evicts every token without crashing, and an empty head stores no K") {
  Weights tw(2 * 40, 0.5f), cw(2 * 8, 1.0f);
  for (BitSolver s : {BitSolver::exact, BitSolver::lagrangian}) {
    Plan const p = run_ok(with_budget(0, s), 1, 2, 40, 8, tw, cw);
    CHECK(p.v == Bits(80, 0));
    CHECK(p.k == Bits(16, 0));
    RDKVAllocator r = with_budget(128, s);
    r.ratio = 1.0;  // B = floor(n · 0) = 0
    Plan const q = run_ok(r, 1, 2, 40, 8, tw, cw);
    CHECK(q.v == Bits(80, 0));
    CHECK(q.k == Bits(16, 0));
  }
  // Zero-length heads and an empty batch.
  Plan const p = run_ok(with_budget(8), 1, 2, 40, 8, tw, cw, {0, 0});
  CHECK(p.v == Bits(80, 0));
  CHECK(p.k == Bits(16, 0));
  CHECK(run(with_budget(8), 0, 2, 40, 8, {}, {}).status.ok());
}

TEST_CASE("rho split, exact: B = 4, dim 8, rho = 0.5 on a hand case") {
  // V: Σ b_t <= floor(0.5 · 2 · 4 · 16) = 64. The 8 big tokens take 0->2 (16 bits), 2->4 (16), 4->8 (32): 64, all
  // at 8 bits; tiny tokens 0. T_eff = 8. K: Σ b_c <= floor(0.5 · 2·4·8·16 / 8) = 64: big channels 1 and 5 climb to
  // 16 (32 bits), then the six tiny channels 0->2 (12), 2->4 (12), and 4->8 (cost 4, equal rates: lower channel
  // first) for channels 0 and 2: 8 bits. K = [8, 16, 8, 4, 4, 16, 4, 4], Σ = 64.
  Plan const p = run_ok(with_budget(4), 1, 1, 16, 8, tokens_with_big(16, big_tokens), big_channels);
  Bits expect_v(16, 0);
  for (Index t : big_tokens)
    expect_v[static_cast<std::size_t>(t)] = 8;
  CHECK(p.v == expect_v);
  CHECK(p.k == Bits{8, 16, 8, 4, 4, 16, 4, 4});
}

TEST_CASE("rho split, exact: rho = 0.25 gives V three quarters") {
  // V: floor(0.75 · 128) = 96: big tokens at 8 (64 bits), then 8->16 (cost 8, rate 6.07e-6 > any tiny rate) for
  // the first four big tokens in slot order (0, 2, 3, 7): 96. T_eff = 8. K: floor(0.25 · 2·4·8·16 / 8) = 32: the
  // two big channels reach 16 (2 + 2 + 4 + 8 bits each), nothing is left: the tiny channels are pruned.
  RDKVAllocator a = with_budget(4);
  a.k_budget_ratio = 0.25;
  Plan const p = run_ok(a, 1, 1, 16, 8, tokens_with_big(16, big_tokens), big_channels);
  Bits expect_v(16, 0);
  for (std::size_t i = 0; i < big_tokens.size(); ++i)
    expect_v[static_cast<std::size_t>(big_tokens[i])] = i < 4 ? 16 : 8;
  CHECK(p.v == expect_v);
  CHECK(p.k == Bits{0, 16, 0, 0, 0, 16, 0, 0});
}

TEST_CASE("lagrangian mode uses the authors' targets v_avg and k_avg") {
  // Hand case: v_avg = 0.5 · (2·4·8·16) / (16 · 8) = 4. The bisection from λ_hi = 0.375 halves until λ =
  // 0.375 / 128 = 0.0029296875 (< 0.00348436, > 6.07e-6): big tokens at 8, average exactly 4: converged.
  Plan const p =
      run_ok(with_budget(4, BitSolver::lagrangian), 1, 1, 16, 8, tokens_with_big(16, big_tokens), big_channels);
  Bits expect_v(16, 0);
  for (Index t : big_tokens)
    expect_v[static_cast<std::size_t>(t)] = 8;
  CHECK(p.v == expect_v);
  // k_avg = 0.5 · 2·4·8·16 / (8 · 8) = 8 (no Everett point reaches it exactly: the solver's own result).
  Bits k(8);
  REQUIRE(kvc::lagrangian_bits(big_channels.data(), 8, kvc::EpsilonTable::llama31_k(), {}, 8.0, {}, k.data()).ok());
  CHECK(p.k == k);

  // Random case: n = 200, B = 20, dim 16: v_avg = 0.5 · 2·20·16·16 / (200 · 16) = 1.6, k_avg = 320 / T_eff.
  std::mt19937 rng(2);
  std::uniform_real_distribution<float> d(0.0f, 1.0f);
  Weights tw(200), cw(16);
  for (float& x : tw)
    x = d(rng) * d(rng);
  for (float& x : cw)
    x = d(rng);
  Plan const q = run_ok(with_budget(20, BitSolver::lagrangian), 1, 1, 200, 16, tw, cw);
  Bits v(200), kk(16);
  REQUIRE(kvc::lagrangian_bits(tw.data(), 200, kvc::EpsilonTable::llama31_v(), {}, 1.6, {}, v.data()).ok());
  CHECK(q.v == v);
  Index const t_eff = std::count_if(v.begin(), v.end(), [](std::int8_t b) { return b > 0; });
  REQUIRE(t_eff > 0);
  double const k_avg = 320.0 / double(t_eff);
  if (k_avg >= 16.0) {
    CHECK(q.k == Bits(16, 16));
  } else {
    REQUIRE(kvc::lagrangian_bits(cw.data(), 16, kvc::EpsilonTable::llama31_k(), {}, k_avg, {}, kk.data()).ok());
    CHECK(q.k == kk);
  }
}

TEST_CASE("exact mode spends at most the V and K budgets on random heads") {
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> d(0.0f, 1.0f);
  for (int trial = 0; trial < 30; ++trial) {
    Index const n = 1 + Index(rng() % 400), dim = 4 + Index(rng() % 60), budget = Index(rng() % 200);
    Weights tw(static_cast<std::size_t>(n)), cw(static_cast<std::size_t>(dim));
    for (float& x : tw)
      x = d(rng);
    for (float& x : cw)
      x = d(rng);
    RDKVAllocator a = with_budget(budget);
    a.k_budget_ratio = double(rng() % 11) / 10.0;
    Plan const p = run_ok(a, 1, 1, n, dim, tw, cw);
    double const total_bits = 2.0 * double(budget) * double(dim) * 16.0;
    INFO("n " << n << " dim " << dim << " B " << budget << " rho " << a.k_budget_ratio);
    bool const v_fits = total(p.v) <= std::int64_t(std::floor((1 - a.k_budget_ratio) * 2.0 * double(budget) * 16.0));
    CHECK((v_fits || total(p.v) == 16 * n));
    Index const t_eff = std::count_if(p.v.begin(), p.v.end(), [](std::int8_t b) { return b > 0; });
    if (t_eff > 0)
      CHECK(total(p.k) <= std::int64_t(std::floor(a.k_budget_ratio * total_bits / double(t_eff))));
  }
}

TEST_CASE("residual: the last R valid slots get 16 bits outside both knapsacks") {
  // 16 slots, R = 4: the knapsack covers slots 0..11 with big tokens at 0, 2, 3, 5, 7, 8, 9, 10 and the same budget
  // as the hand case (B = 4: V 64 bits -> big at 8). T_eff = 8 (the residual is not counted): K budget
  // floor(512 / 8) = 64 -> K = [8, 16, 8, 4, 4, 16, 4, 4] (counting the residual, floor(512 / 12) = 42, would differ).
  RDKVAllocator a = with_budget(4);
  a.residual = 4;
  std::vector<Index> const big = {0, 2, 3, 5, 7, 8, 9, 10};
  Plan const p = run_ok(a, 1, 1, 16, 8, tokens_with_big(16, big), big_channels);
  Bits expect_v(16, 0);
  for (Index t : big)
    expect_v[static_cast<std::size_t>(t)] = 8;
  std::fill(expect_v.begin() + 12, expect_v.end(), std::int8_t{16});
  CHECK(p.v == expect_v);
  CHECK(p.k == Bits{8, 16, 8, 4, 4, 16, 4, 4});
  // With per-head lengths the residual is the last R *valid* slots; padding stays 0; R > n keeps the whole head.
  a.residual = 3;
  Plan const q = run_ok(a, 1, 2, 16, 8, Weights(32, 0.5f), Weights(16, 1.0f), {10, 2});
  Bits const h0 = q.v_row(0, 0, 2, 16), h1 = q.v_row(0, 1, 2, 16);
  CHECK(Bits(h0.begin() + 7, h0.begin() + 10) == Bits(3, 16));
  CHECK(Bits(h0.begin() + 10, h0.end()) == Bits(6, 0));
  CHECK(h1 == Bits{16, 16, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0});
  CHECK(q.k_row(0, 1, 2, 8) == Bits(8, 0));  // no knapsack token kept: no K stored
}

TEST_CASE("padding slots get 0 bits and -inf padding weights are fine") {
  float const inf = std::numeric_limits<float>::infinity();
  Weights tw(2 * 8, 1.0f);
  std::fill(tw.begin() + 5, tw.begin() + 8, -inf);  // head 0: 5 valid
  std::fill(tw.begin() + 8 + 3, tw.end(), -inf);    // head 1: 3 valid
  Plan const p = run_ok(with_budget(2), 1, 2, 8, 4, tw, Weights(8, 1.0f), {5, 3});
  // Head 0: V budget 16 · 2 = 32 bits over 5 equal tokens: 0->2 for all (10), 2->4 for all (10), 4->8 (cost 4) for
  // tokens 0, 1, 2 (12): [8, 8, 8, 4, 4]. Head 1: 32 bits over 3 tokens: 0->2, 2->4 (12), 4->8 (12), then 8->16
  // (cost 8) for token 0: [16, 8, 8].
  CHECK(p.v_row(0, 0, 2, 8) == Bits{8, 8, 8, 4, 4, 0, 0, 0});
  CHECK(p.v_row(0, 1, 2, 8) == Bits{16, 8, 8, 0, 0, 0, 0, 0});
}

TEST_CASE("scope layer: one V knapsack over the heads of a sequence, K per head") {
  // Head 0: 16 big tokens, head 1: 16 tiny tokens, B = 4 (V 64 bits per head), dim 8, equal channel weights.
  // scope = head: each head spends 64 bits on 16 equal tokens: 0->2, 2->4 for all: all at 4. T_eff = 16 each:
  // K budget floor(512 / 16) = 32 over 8 equal channels: all at 4.
  // scope = layer: 128 bits, big tokens first: 0->2, 2->4, 4->8 (16 + 32 + 64 = ... 32 + 32 + 64 = 128): head 0 at 8,
  // head 1 evicted (T_eff 0: no K). Head 0's K budget is still its own: 32 -> all at 4.
  Weights tw(32, 1.0f);
  std::fill(tw.begin() + 16, tw.end(), 1e-6f);
  Weights const cw(16, 1.0f);
  RDKVAllocator a = with_budget(4);
  Plan const head = run_ok(a, 1, 2, 16, 8, tw, cw);
  CHECK(head.v == Bits(32, 4));
  CHECK(head.k == Bits(16, 4));
  a.scope = RDKVBudgetScope::layer;
  Plan const layer = run_ok(a, 1, 2, 16, 8, tw, cw);
  CHECK(layer.v_row(0, 0, 2, 16) == Bits(16, 8));
  CHECK(layer.v_row(0, 1, 2, 16) == Bits(16, 0));
  CHECK(layer.k_row(0, 0, 2, 8) == Bits(8, 4));
  CHECK(layer.k_row(0, 1, 2, 8) == Bits(8, 0));
  // Lagrangian, layer scope: target Σ_h 0.5 · 2·4·8·16 / (32 · 8) = 4 bits/token over the 32 tokens: the bisection
  // reaches λ = 0.375 / 128 as in the single-head case: big at 8, tiny at 0, average exactly 4.
  a.solver = BitSolver::lagrangian;
  Plan const lag = run_ok(a, 1, 2, 16, 8, tw, cw);
  CHECK(lag.v_row(0, 0, 2, 16) == Bits(16, 8));
  CHECK(lag.v_row(0, 1, 2, 16) == Bits(16, 0));
}

TEST_CASE("ratio: each head's budget is floor(n (1 - ratio))") {
  // ratio 0.75: head 0 n = 32 -> B = 8 -> V 128 bits over 32 equal tokens: all at 4. Head 1 n = 30 -> B =
  // floor(7.5) = 7 -> 112 bits: 0->2 for 30 (60), 2->4 for the first 26 (52): 26 at 4, then 4 at 2.
  RDKVAllocator a = with_budget(128);
  a.ratio = 0.75;
  Plan const p = run_ok(a, 1, 2, 32, 8, Weights(64, 1.0f), Weights(16, 1.0f), {32, 30});
  CHECK(p.v_row(0, 0, 2, 32) == Bits(32, 4));
  Bits expect(32, 0);
  std::fill(expect.begin(), expect.begin() + 26, std::int8_t{4});
  std::fill(expect.begin() + 26, expect.begin() + 30, std::int8_t{2});
  CHECK(p.v_row(0, 1, 2, 32) == expect);
  // K, head 0: floor(0.5 · 2·8·8·16 / 32) = 32 over 8 equal channels: all at 4. Head 1: floor(0.5 · 2·7·8·16 / 30)
  // = floor(29.87) = 29: 0->2 for 8 (16), 2->4 for the first 6 (12), 1 bit left: [4, 4, 4, 4, 4, 4, 2, 2].
  CHECK(p.k_row(0, 0, 2, 8) == Bits(8, 4));
  CHECK(p.k_row(0, 1, 2, 8) == Bits{4, 4, 4, 4, 4, 4, 2, 2});
}

TEST_CASE("without eviction every token and channel keeps at least 2 bits, and too small a budget is an error") {
  RDKVAllocator a = with_budget(4);
  a.options.evict = false;
  // B = 4: V 64 bits over 16 tokens: the floor takes 32, then the big tokens 2->4 (16) and 4->8 (cost 4) for the
  // first four big tokens (16): big 0, 2, 3, 7 at 8, big 9, 10, 12, 15 at 4, tiny at 2.
  // K: T_eff = 16, floor(512 / 16) = 32 >= 2 · 8.
  Plan const p = run_ok(a, 1, 1, 16, 8, tokens_with_big(16, big_tokens), big_channels);
  Bits expect(16, 2);
  for (std::size_t i = 0; i < big_tokens.size(); ++i)
    expect[static_cast<std::size_t>(big_tokens[i])] = i < 4 ? 8 : 4;
  CHECK(p.v == expect);
  CHECK(std::all_of(p.k.begin(), p.k.end(), [](std::int8_t b) { return b >= 2; }));
  // 17 tokens need 34 bits at the floor; B = 1 gives V 16.
  Plan const q = run(with_budget(1), 1, 1, 17, 8, Weights(17, 1.0f), Weights(8, 1.0f));
  CHECK(q.status.ok());  // with eviction fine
  a.budget_tokens = 1;
  Plan const r = run(a, 1, 1, 17, 8, Weights(17, 1.0f), Weights(8, 1.0f));
  CHECK(r.status.code() == kvc::Errc::invalid_argument);
  CHECK(std::string(r.status.message()).find("evict") != std::string::npos);
  // The Lagrangian never fails: a target below 2 gives every token 2 bits.
  a.solver = BitSolver::lagrangian;
  Plan const s = run(a, 1, 1, 17, 8, Weights(17, 1.0f), Weights(8, 1.0f));
  REQUIRE(s.status.ok());
  CHECK(s.v == Bits(17, 2));
}

TEST_CASE("P12 determinism: identical plans for any thread count, both scopes and solvers") {
  std::mt19937 rng(4);
  std::uniform_real_distribution<float> d(0.0f, 1.0f);
  Index const batch = 3, heads = 4, tokens = 300, dim = 32;
  Weights tw(static_cast<std::size_t>(batch * heads * tokens)), cw(static_cast<std::size_t>(batch * heads * dim));
  for (float& x : tw)
    x = d(rng) * d(rng) * d(rng);
  for (float& x : cw)
    x = d(rng);
  std::vector<Index> lengths(static_cast<std::size_t>(batch * heads));
  for (Index& n : lengths)
    n = 1 + Index(rng() % tokens);
  kvc::ThreadPool pool(3);
  for (BitSolver s : {BitSolver::exact, BitSolver::lagrangian})
    for (RDKVBudgetScope scope : {RDKVBudgetScope::head, RDKVBudgetScope::layer}) {
      RDKVAllocator a = with_budget(24, s);
      a.scope = scope;
      a.residual = 5;
      Plan const serial = run(a, batch, heads, tokens, dim, tw, cw, lengths);
      Plan const parallel = run(a, batch, heads, tokens, dim, tw, cw, lengths, pool.cpu());
      Plan const again = run(a, batch, heads, tokens, dim, tw, cw, lengths, pool.cpu());
      REQUIRE(serial.status.ok());
      REQUIRE(parallel.status.ok());
      CHECK(serial.v == parallel.v);
      CHECK(serial.k == parallel.k);
      CHECK(again.v == parallel.v);
      CHECK(again.k == parallel.k);
      CHECK(std::none_of(serial.v.begin(), serial.v.end(), [](std::int8_t b) { return b == -7; }));
    }
}

TEST_CASE("allocate_bits errors name their argument") {
  Weights tw(16, 1.0f), cw(8, 1.0f);
  auto message_has = [](kvc::Status const& st, char const* what) {
    return std::string(st.message()).find(what) != std::string::npos;
  };
  Weights nan_w = tw;
  nan_w[3] = std::numeric_limits<float>::quiet_NaN();
  Plan p = run(with_budget(4), 1, 1, 16, 8, nan_w, cw);
  CHECK(p.status.code() == kvc::Errc::non_finite);
  CHECK(message_has(p.status, "token_weights"));
  Weights neg = tw;
  neg[0] = -1.0f;
  CHECK(message_has(run(with_budget(4), 1, 1, 16, 8, neg, cw).status, "token_weights"));
  Weights bad_c = cw;
  bad_c[7] = std::numeric_limits<float>::infinity();
  CHECK(message_has(run(with_budget(4), 1, 1, 16, 8, tw, bad_c).status, "channel_weights"));
  RDKVAllocator a = with_budget(4);
  a.solver = static_cast<BitSolver>(7);
  CHECK(message_has(run(a, 1, 1, 16, 8, tw, cw).status, "solver"));
  a = with_budget(4);
  a.ratio = 1.5;
  CHECK(message_has(run(a, 1, 1, 16, 8, tw, cw).status, "ratio"));
  a = with_budget(4);
  a.k_budget_ratio = -0.1;
  CHECK(message_has(run(a, 1, 1, 16, 8, tw, cw).status, "k_budget_ratio"));
  a = with_budget(-1);
  CHECK(message_has(run(a, 1, 1, 16, 8, tw, cw).status, "budget_tokens"));
  a = with_budget(4);
  a.eps_v.eps[2] = 0.5;
  CHECK(message_has(run(a, 1, 1, 16, 8, tw, cw).status, "eps_v"));
  a = with_budget(4);
  a.residual = -1;
  CHECK(message_has(run(a, 1, 1, 16, 8, tw, cw).status, "residual"));

  Bits v(16), k(8);
  kvc::ScoreSpan<> const s{tw.data(), 1, 1, 16};
  std::vector<std::byte> ws(kvc::allocate_bits_workspace_bytes(kvc::Cpu{}, with_budget(4), 1, 1, 16, 8));
  kvc::Status st = kvc::allocate_bits(kvc::Cpu{}, with_budget(4), s, nullptr,
                                      kvc::BitPlan<>{v.data(), k.data(), 1, 1, 16, 8}, {ws.data(), ws.size()});
  CHECK(message_has(st, "channel_weights"));
  st = kvc::allocate_bits(kvc::Cpu{}, with_budget(4), s, cw.data(), kvc::BitPlan<>{v.data(), k.data(), 1, 1, 15, 8},
                          {ws.data(), ws.size()});
  CHECK(message_has(st, "plan"));
  st = kvc::allocate_bits(kvc::Cpu{}, with_budget(4), s, cw.data(), kvc::BitPlan<>{v.data(), nullptr, 1, 1, 16, 8},
                          {ws.data(), ws.size()});
  CHECK(message_has(st, "k_bits"));
  st = kvc::allocate_bits(kvc::Cpu{}, with_budget(4), s, cw.data(), kvc::BitPlan<>{v.data(), k.data(), 1, 1, 16, 8},
                          {ws.data(), 8});
  CHECK(st.code() == kvc::Errc::out_of_capacity);
  std::vector<Index> bad_len = {17};
  kvc::ScoreSpan<> const long_head{tw.data(), 1, 1, 16, kvc::head_lengths(bad_len.data(), 1)};
  st = kvc::allocate_bits(kvc::Cpu{}, with_budget(4), long_head, cw.data(),
                          kvc::BitPlan<>{v.data(), k.data(), 1, 1, 16, 8}, {ws.data(), ws.size()});
  CHECK(message_has(st, "length"));
}
