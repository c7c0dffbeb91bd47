// SPDX-License-Identifier: Apache-2.0
// tests/engine/packed_compressor_test.cpp mirrors include/kvc/engine/packed_compressor.hpp (and
// pipeline/packed_press.hpp): RDKV and KIVI through the per-layer compressor. The packed store and the fp16 tail it
// leaves equal the tools' own sequence of entry points (kvc-eval's compress_packed: the bit plan, the tail split,
// kvc::pack, kvc::compact); its attention equals kvc::attend over a dense cache of the dequantised packed tokens and
// the tail (spec rdkv S4: an oracle that reads neither the packed kernel nor the merge); hand values of the KIVI plan
// and of scores_as_weights; and the errors.
#include <kvc/kvc.hpp>  // every CPU kernel: the scenario's driver instantiates every policy

#include "common/observations.hpp"
#include "common/synthetic.hpp"
#include "support/catch.hpp"
#include "support/compressor_scenario.hpp"
#include "support/helpers.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

using kvc::Index;

namespace {

constexpr Index kB = 2, kH = 2, kN = 40, kD = 16, kHq = 4, kW = 8;

/// The layer of every case: per-head lengths 40, 33, 27, 40 with identity positions, and the prompt's last kW query
/// rows of each sequence (positions n - kW .. n - 1 of the longest head).
struct Layer {
  kvc::tools::HostCache<float> cache = kvc::tools::HostCache<float>::random({kB, kH, kN, kD}, 11);
  std::vector<float> q = kvc::tools::random_values(kB * kHq * kW * kD, 12);
  std::vector<Index> qpos;
  Layer() {
    cache.track(kN);
    cache.lengths = {40, 33, 27, 40};
    for (Index b = 0; b < kB; ++b)
      for (Index i = 0; i < kW; ++i)
        qpos.push_back(kN - kW + i);
  }
  kvc::TokenRows<float const, kvc::StridedLayout> rows() const {
    return {q.data(), kvc::bhtd_layout({kB, kHq, kW, kD})};
  }
  Index length(Index b, Index h) const { return cache.lengths[static_cast<std::size_t>(b * kH + h)]; }
};

/// A compressor of `policy`, planned, bound and reset over its own state and workspace.
template <class P>
struct Session {
  kvc::LayerCompressor<P, kvc::Cpu> c;
  std::vector<std::byte> state, ws;
  Session(P policy, Layer& layer, kvc::CompressorOptions<kvc::HostSpace> options = {})
      : c{kvc::Cpu{}, policy, options} {
    REQUIRE(c.plan(layer.cache.view(), kvc::QueryShape{kHq, kW, 1, 3}).ok());
    state.resize(c.state_bytes());
    ws.resize(c.workspace_bytes());
    REQUIRE(c.bind(state.data(), state.size()).ok());
    REQUIRE(c.reset().ok());
  }
  kvc::Workspace workspace() { return {ws.data(), ws.size()}; }
  kvc::Status prefill(Layer& layer) {
    return c.prefill(layer.cache.view(), {layer.rows(), layer.qpos.data()}, workspace());
  }
};

/// The tools' sequence (tools/eval/engine_impl.hpp, compress_packed) on a copy of the layer: `plan_of` writes the bit
/// plan, the newest `residual` tokens of each head are taken out of it and compacted to the cache's front, the rest
/// packed by kvc::pack.
struct ByHand {
  kvc::tools::HostCache<float> cache;
  kvc::PackedKV packed;
  std::vector<std::int8_t> v_bits, k_bits;  ///< the plan packed by (the tail's slots at 0)
  template <class PlanOf>
  ByHand(Layer const& layer, Index residual, kvc::PackOptions const& opt, PlanOf plan_of) : cache(layer.cache) {
    std::vector<std::int8_t> v(static_cast<std::size_t>(kB * kH * kN)), k(static_cast<std::size_t>(kB * kH * kD));
    kvc::BitPlan<> const plan{v.data(), k.data(), kB, kH, kN, kD};
    plan_of(cache, plan);
    std::vector<Index> index(static_cast<std::size_t>(kB * kH * kN)), count(static_cast<std::size_t>(kB * kH));
    for (Index bh = 0; bh < kB * kH; ++bh) {
      Index const n = cache.lengths[static_cast<std::size_t>(bh)], tail = n < residual ? n : residual;
      for (Index i = 0; i < tail; ++i) {
        v[static_cast<std::size_t>(bh * kN + n - tail + i)] = 0;
        index[static_cast<std::size_t>(bh * kN + i)] = n - tail + i;
      }
      count[static_cast<std::size_t>(bh)] = tail;
    }
    v_bits = v;
    k_bits = k;
    REQUIRE(kvc::pack(cache.view(), plan, opt, packed).ok());
    REQUIRE(kvc::compact(kvc::Cpu{}, kvc::KeepPlan<>{index.data(), count.data(), kB, kH, kN}, cache.view()).ok());
  }
};

/// The compressor's packed store and tail equal the tools' (dequantised contents, accounting, the tail's rows).
void check_same(kvc::PackedKVView<> const& got, ByHand const& want, Layer const& layer) {
  for (Index b = 0; b < kB; ++b)
    for (Index h = 0; h < kH; ++h) {
      INFO("head " << b << "," << h);
      kvc::PackedHead const &g = got.head(b, h), &w = want.packed.head(b, h);
      REQUIRE(g.tokens == w.tokens);
      CHECK(g.payload_bits == w.payload_bits);
      CHECK(g.overhead_bits == w.overhead_bits);
      auto const n = static_cast<std::size_t>(g.tokens);
      std::vector<float> k1(n * kD), v1(n * kD), k2(n * kD), v2(n * kD);
      std::vector<Index> p1(n), p2(n);
      kvc::dequantized(got, b, h, k1.data(), v1.data(), p1.data());
      kvc::dequantized(want.packed, b, h, k2.data(), v2.data(), p2.data());
      CHECK(k1 == k2);
      CHECK(v1 == v2);
      CHECK(p1 == p2);
      Index const tail = want.cache.lengths[static_cast<std::size_t>(b * kH + h)];
      CHECK(layer.length(b, h) == tail);
      for (Index t = 0; t < tail; ++t) {
        std::size_t const row = static_cast<std::size_t>((b * kH + h) * kN + t);
        CHECK(std::memcmp(&layer.cache.k[row * kD], &want.cache.k[row * kD], kD * sizeof(float)) == 0);
        CHECK(std::memcmp(&layer.cache.v[row * kD], &want.cache.v[row * kD], kD * sizeof(float)) == 0);
        CHECK(layer.cache.positions[row] == want.cache.positions[row]);
      }
    }
}

/// bit_plan() reads back, from the workspace prefill was given, the plan the tools' sequence packs by.
template <class P>
void check_plan(Session<P>& s, ByHand const& want) {
  kvc::BitPlan<> const got = s.c.bit_plan(s.workspace());
  REQUIRE((got.v_bits != nullptr && got.k_bits != nullptr));
  CHECK((got.batch == kB && got.heads == kH && got.tokens == kN && got.dim == kD));
  CHECK(std::vector<std::int8_t>(got.v_bits, got.v_bits + kB * kH * kN) == want.v_bits);
  CHECK(std::vector<std::int8_t>(got.k_bits, got.k_bits + kB * kH * kD) == want.k_bits);
  CHECK(s.c.bit_plan({s.ws.data(), s.ws.size() - 1}).v_bits == nullptr);  // not the workspace prefill was given
}

/// Appends one decoded token at position kN to every head's tail (what an engine's kvc::append does).
void append_token(Layer& layer, std::uint64_t seed) {
  std::vector<float> const x = kvc::tools::random_values(2 * kD, seed);
  for (Index bh = 0; bh < kB * kH; ++bh) {
    Index& n = layer.cache.lengths[static_cast<std::size_t>(bh)];
    std::size_t const row = static_cast<std::size_t>(bh * kN + n);
    std::copy_n(x.begin(), kD, layer.cache.k.begin() + static_cast<std::ptrdiff_t>(row * kD));
    std::copy_n(x.begin() + kD, kD, layer.cache.v.begin() + static_cast<std::ptrdiff_t>(row * kD));
    layer.cache.positions[row] = kN;
    ++n;
  }
}

/// The compressor's attention of 3 rows at positions 38, 39, 40 against kvc::attend over a dense cache holding, per
/// head, the dequantised packed tokens and then the tail (spec S4).
template <class P>
void check_attention(Session<P>& s, Layer& layer) {
  Index const rows = 3;
  std::vector<float> q = kvc::tools::random_values(kB * kHq * rows * kD, 13);
  std::vector<Index> pos;
  for (Index b = 0; b < kB; ++b)
    for (Index i = 0; i < rows; ++i)
      pos.push_back(kN - 2 + i);
  kvc::AttendQueries<float> const queries{{q.data(), kvc::bhtd_layout({kB, kHq, rows, kD})}, pos.data()};
  std::vector<float> out(static_cast<std::size_t>(kB * kHq * rows * kD)),
      lse(static_cast<std::size_t>(kB * kHq * rows));
  REQUIRE(s.c.attend(queries, layer.cache.view(), {out.data(), lse.data()}, s.workspace()).ok());

  Index const cap = 2 * kN;
  kvc::tools::HostCache<float> all({kB, kH, cap, kD});
  all.track(cap);
  kvc::PackedKVView<> const packed = s.c.packed();
  for (Index b = 0; b < kB; ++b)
    for (Index h = 0; h < kH; ++h) {
      Index const bh = b * kH + h, np = packed.head(b, h).tokens, nt = layer.length(b, h);
      std::size_t const base = static_cast<std::size_t>(bh * cap);
      kvc::dequantized(packed, b, h, &all.k[base * kD], &all.v[base * kD], &all.positions[base]);
      for (Index t = 0; t < nt; ++t) {
        std::size_t const src = static_cast<std::size_t>(bh * kN + t), dst = base + static_cast<std::size_t>(np + t);
        std::copy_n(&layer.cache.k[src * kD], kD, &all.k[dst * kD]);
        std::copy_n(&layer.cache.v[src * kD], kD, &all.v[dst * kD]);
        all.positions[dst] = layer.cache.positions[src];
      }
      all.lengths[static_cast<std::size_t>(bh)] = np + nt;
    }
  std::vector<float> want(out.size()), want_lse(lse.size());
  std::vector<std::byte> ws(kvc::attend_workspace_bytes(kvc::Cpu{}, kvc::Attention{}, queries, all.view()));
  REQUIRE(kvc::attend(kvc::Cpu{}, kvc::Attention{}, queries, all.view(), {want.data(), want_lse.data()},
                      {ws.data(), ws.size()})
              .ok());
  for (std::size_t i = 0; i < out.size(); ++i)
    REQUIRE(std::fabs(out[i] - want[i]) <= 1e-5f * (1.0f + std::fabs(want[i])));
  for (std::size_t i = 0; i < lse.size(); ++i)
    REQUIRE(std::fabs(lse[i] - want_lse[i]) <= 1e-5f * (1.0f + std::fabs(want_lse[i])));
}

}  // namespace

TEST_CASE("kivi_plan and scores_as_weights by hand", "[engine]") {
  std::int8_t v[6], k[3];
  kvc::kivi_plan(kvc::KIVIPress{4, 32, 2}, 5, 6, 3, v, k);
  CHECK(std::vector<int>(v, v + 6) == std::vector<int>{4, 4, 4, 16, 16, 0});
  CHECK(std::vector<int>(k, k + 3) == std::vector<int>{4, 4, 4});
  kvc::kivi_plan(kvc::KIVIPress{2, 32, 8}, 3, 4, 1, v, k);  // a head shorter than the residual: all fp16
  CHECK(std::vector<int>(v, v + 4) == std::vector<int>{16, 16, 16, 0});

  float const inf = std::numeric_limits<float>::infinity();
  float s[6] = {-inf, 1.0f, 3.0f, std::nanf(""), inf, 2.0f};
  kvc::scores_as_weights(s, 6);
  CHECK(std::vector<float>(s, s + 6) == std::vector<float>{0.0f, 0.0f, 2.0f, 0.0f, 2.0f, 1.0f});
  float none[2] = {-inf, std::nanf("")};
  kvc::scores_as_weights(none, 2);
  CHECK((none[0] == 1.0f && none[1] == 1.0f));
}

TEST_CASE("compressor: KIVI packs what the tools' sequence packs, keeps the fp16 tail, and attends exactly",
          "[engine]") {
  for (Index residual : {Index{0}, Index{8}, Index{30}}) {
    INFO("residual " << residual);
    Layer layer;
    kvc::KIVIPress const kivi{2, 4, residual};
    ByHand const want(layer, residual, kivi.pack_options(), [&](auto const& cache, kvc::BitPlan<> const& plan) {
      for (Index b = 0; b < kB; ++b)
        for (Index h = 0; h < kH; ++h)
          kvc::kivi_plan(kivi, cache.lengths[static_cast<std::size_t>(b * kH + h)], kN, kD, plan.v_row(b, h),
                         plan.k_row(b, h));
    });
    Session<kvc::KIVIPress> s(kivi, layer);
    CHECK(s.c.bit_plan(s.workspace()).v_bits == nullptr);  // before prefill
    REQUIRE(s.prefill(layer).ok());
    check_same(s.c.packed(), want, layer);
    check_plan(s, want);
    append_token(layer, 21);
    check_attention(s, layer);
  }
}

TEST_CASE("compressor: RDKV (its own weights, and SnapKV's) packs what the tools' sequence packs", "[engine]") {
  auto by_hand = [](Layer const& layer, auto const& press) {
    return ByHand(layer, press.allocator.residual, press.pack, [&](auto& cache, kvc::BitPlan<> const& plan) {
      auto const obs = kvc::observe(kvc::WindowQueries<float>{layer.rows(), {}, layer.qpos.data()});
      std::vector<float> w(static_cast<std::size_t>(kB * kH * kN)), ch(static_cast<std::size_t>(kB * kH * kD));
      kvc::ScoreSpan<> const span{w.data(), kB, kH, kN, cache.length_table()};
      std::vector<std::byte> ws(1 << 20);
      kvc::Workspace const wsv{ws.data(), ws.size()};
      REQUIRE(kvc::score(kvc::Cpu{}, press.scorer, cache.view(), obs, span, wsv).ok());
      if constexpr (!std::is_same_v<std::decay_t<decltype(press.scorer)>, kvc::RDKVTokenScorer>)
        for (Index bh = 0; bh < kB * kH; ++bh)
          kvc::scores_as_weights(w.data() + bh * kN, cache.lengths[static_cast<std::size_t>(bh)]);
      REQUIRE(kvc::score_channels(kvc::Cpu{}, press.channels, cache.view(), obs, ch.data(), wsv).ok());
      REQUIRE(kvc::allocate_bits(kvc::Cpu{}, press.allocator, span, ch.data(), plan, wsv).ok());
    });
  };
  SECTION("RDKVTokenScorer, exact solver, residual 4, groups") {
    kvc::RDKVPress<> press;
    press.scorer.window_size = press.channels.window_size = kW;
    press.allocator.budget_tokens = 4;
    press.allocator.residual = 4;
    press.pack.k_group = 8;
    press.pack.v_group = 8;
    Layer layer;
    ByHand const want = by_hand(layer, press);
    Session<kvc::RDKVPress<>> s(press, layer);
    REQUIRE(s.prefill(layer).ok());
    check_same(s.c.packed(), want, layer);
    check_plan(s, want);
    // Some tokens are evicted, some quantised: the plan is not trivial.
    kvc::PackedHead const& head = s.c.packed().head(0, 0);
    CHECK(head.tokens < 36);
    CHECK(head.v_count[0] + head.v_count[1] + head.v_count[2] > 0);
    append_token(layer, 22);
    check_attention(s, layer);
  }
  SECTION("SnapKV's scores as weights, the authors' preset") {
    kvc::RDKVPress<kvc::SnapKVScorer> press;
    press.scorer.window_size = press.channels.window_size = kW;
    press.allocator.ratio = 0.5;
    press.allocator.solver = kvc::BitSolver::lagrangian;
    press.pack = {kvc::ZeroPoint::integer, 0, 0, true};
    Layer layer;
    ByHand const want = by_hand(layer, press);
    Session<kvc::RDKVPress<kvc::SnapKVScorer>> s(press, layer);
    REQUIRE(s.prefill(layer).ok());
    check_same(s.c.packed(), want, layer);
    check_plan(s, want);
    check_attention(s, layer);
  }
}

TEST_CASE("compressor: RDKV's weights from every token scorer equal the tools' observations of it", "[engine]") {
  // The tools' weight=NAME path: tools::with_observations (window queries, ExpectedAttention's statistics, H2O's
  // accumulator) + kvc::score + kvc::scores_as_weights. Pre-RoPE queries rotated by one table on both sides.
  kvc::test::OwnedRope const rope(kvc::RopeSpec{}, kD, 1024);
  auto check = [&](auto scorer) {
    using S = decltype(scorer);
    INFO(std::string(S::name));
    kvc::RDKVPress<S> press{scorer};
    press.channels.window_size = kW;
    press.allocator.ratio = 0.6;
    Layer layer;
    layer.cache.lengths = {40, 40, 27, 27};  // TOVA reads every KV head of a sequence at once: equal lengths
    ByHand const want(layer, 0, press.pack, [&](auto& cache, kvc::BitPlan<> const& plan) {
      std::vector<float> w(static_cast<std::size_t>(kB * kH * kN)), ch(static_cast<std::size_t>(kB * kH * kD));
      kvc::ScoreSpan<> const span{w.data(), kB, kH, kN, cache.length_table()};
      std::vector<std::byte> ws(1 << 22);
      kvc::Workspace const wsv{ws.data(), ws.size()};
      kvc::tools::ObservationStorage store;
      kvc::tools::with_observations(
          scorer, cache.view(),
          kvc::tools::ObservedQueries{layer.rows(), layer.qpos.data(), rope.table, kvc::RopeSpec{}, true}, "test",
          store, [&](auto const& live, auto const& obs) {
            kvc::Status const st = kvc::score(kvc::Cpu{}, live, cache.view(), obs, span, wsv);
            INFO(st.message());
            REQUIRE(st.ok());
          });
      for (Index bh = 0; bh < kB * kH; ++bh)
        kvc::scores_as_weights(w.data() + bh * kN, cache.lengths[static_cast<std::size_t>(bh)]);
      auto const obs = kvc::observe(kvc::WindowQueries<float>{layer.rows(), rope.table, layer.qpos.data()});
      REQUIRE(kvc::score_channels(kvc::Cpu{}, press.channels, cache.view(), obs, ch.data(), wsv).ok());
      REQUIRE(kvc::allocate_bits(kvc::Cpu{}, press.allocator, span, ch.data(), plan, wsv).ok());
    });
    kvc::CompressorOptions<kvc::HostSpace> options;
    options.rope = rope.table;
    Session<kvc::RDKVPress<S>> s(press, layer, options);
    REQUIRE(s.prefill(layer).ok());
    check_same(s.c.packed(), want, layer);
  };
  kvc::SnapKVScorer snap;
  snap.window_size = kW;
  check(snap);
  check(kvc::TOVAScorer{});
  check(kvc::KeyDiffScorer{});
  check(kvc::KnormScorer{});
  check(kvc::StreamingLLMScorer{4});
  check(kvc::RandomScorer{3});
  kvc::ExpectedAttentionScorer ea;
  ea.n_future_positions = 64;
  check(ea);
  check(kvc::H2OScorer<>{});
  // ExpectedAttention needs the table that rotates its pre-RoPE queries.
  Layer layer;
  kvc::RDKVPress<kvc::ExpectedAttentionScorer> rdkv_ea{ea};
  rdkv_ea.channels.window_size = kW;
  kvc::LayerCompressor c{kvc::Cpu{}, rdkv_ea};
  CHECK(std::strstr(c.plan(layer.cache.view(), kvc::QueryShape{kHq, kW}).message(), "options.rope") != nullptr);
}

TEST_CASE("compressor: a packed layer before prefill attends over the cache alone, and reset starts a new sequence",
          "[engine]") {
  Layer layer;
  Session<kvc::KIVIPress> s(kvc::KIVIPress{4, 8, 4}, layer);
  check_attention(s, layer);  // the store is empty: the oracle is the cache itself
  REQUIRE(s.prefill(layer).ok());
  CHECK(s.c.packed().head(0, 0).tokens == 36);
  // A second prompt needs reset(): the allocation is static.
  auto const again = s.prefill(layer);
  CHECK(again.code() == kvc::Errc::invalid_argument);
  CHECK(std::strstr(again.message(), "reset()") != nullptr);
  REQUIRE(s.c.reset().ok());
  CHECK(s.c.packed().head(0, 0).tokens == 0);
  Layer fresh;
  REQUIRE(s.prefill(fresh).ok());
  CHECK(s.c.packed().head(0, 0).tokens == 36);
  CHECK(fresh.length(0, 0) == 4);
}

TEST_CASE("compressor: a packed policy's errors name what is wrong", "[engine]") {
  Layer layer;
  kvc::RDKVPress<> press;
  press.scorer.window_size = press.channels.window_size = kW;
  {
    kvc::CompressorOptions<kvc::HostSpace> options;
    options.decode = true;
    kvc::LayerCompressor c{kvc::Cpu{}, press, options};
    auto const st = c.plan(layer.cache.view(), kvc::QueryShape{kHq, kW});
    CHECK(st.code() == kvc::Errc::invalid_argument);
    CHECK(std::strstr(st.message(), "options.decode") != nullptr);
  }
  {
    kvc::LayerCompressor c{kvc::Cpu{}, press};
    auto const st = c.plan(layer.cache.view(), kvc::QueryShape{kHq, kW - 1});
    CHECK(std::strstr(st.message(), "window_size") != nullptr);
    kvc::KIVIPress bad{3};
    kvc::LayerCompressor k{kvc::Cpu{}, bad};
    CHECK(std::strstr(k.plan(layer.cache.view(), kvc::QueryShape{kHq}).message(), "bits") != nullptr);
  }
  Session<kvc::RDKVPress<>> s(press, layer);
  CHECK(s.c.prefill(layer.cache.view(), {layer.rows(), nullptr}, s.workspace()).code() == kvc::Errc::invalid_argument);
  std::vector<float> q(static_cast<std::size_t>(kB * kHq * kD)), out(q.size());
  kvc::AttendQueries<float> const no_positions{{q.data(), kvc::bhtd_layout({kB, kHq, 1, kD})}};
  auto const st = s.c.attend(no_positions, layer.cache.view(), {out.data(), nullptr}, s.workspace());
  CHECK(std::strstr(st.message(), "positions") != nullptr);
  CHECK(s.c.prefill(layer.cache.view(), {layer.rows(), layer.qpos.data()}, {s.ws.data(), s.ws.size() - 1}).code() ==
        kvc::Errc::out_of_capacity);
  // A store sized for fewer tokens than prefill packs: nothing packed, the error named.
  {
    kvc::CompressorOptions<kvc::HostSpace> small;
    small.packed_tokens = 10;
    Layer fresh;
    Session<kvc::KIVIPress> k(kvc::KIVIPress{2, 8, 4}, fresh, small);
    Session<kvc::KIVIPress> full(kvc::KIVIPress{2, 8, 4}, fresh);
    CHECK(k.c.state_bytes() < full.c.state_bytes());
    CHECK(k.prefill(fresh).code() == kvc::Errc::out_of_capacity);
    CHECK(k.c.packed().head(0, 0).tokens == 0);
    CHECK(*k.c.pack_error() == 1);
  }
  auto copy = s.c;  // a copy is unbound
  CHECK(copy.prefill(layer.cache.view(), {layer.rows(), layer.qpos.data()}, s.workspace()).code() ==
        kvc::Errc::invalid_argument);
}

TEST_CASE("compressor: the engine session of the packed policies (prefill, then append, attend, decode)", "[engine]") {
  // The session the CUDA parity test runs on both backends (tests/support/compressor_scenario.hpp).
  kvc::test::Scenario const sc;
  for (std::string const& name : kvc::test::scenario_packed_policies()) {
    INFO(name);
    kvc::test::HostMemory mem;
    kvc::test::ScenarioResult r;
    std::string const err = kvc::test::with_scenario_packed_policy<kvc::HostSpace>(
        name, sc, mem, [&](auto const& policy, auto const& options) {
          return kvc::test::run_scenario(kvc::Cpu{}, mem, policy, options, sc, r);
        });
    REQUIRE(err.empty());
    CHECK(r.pack_error == 0);
    CHECK(r.compressions == 0);
    Index const residual = name == "kivi" ? 6 : (name == "rdkv" ? 4 : 0);
    for (Index b = 0; b < sc.batch; ++b)
      for (Index h = 0; h < sc.kv_heads; ++h) {
        auto const head = static_cast<std::size_t>(b * sc.kv_heads + h);
        Index const p = sc.prompt[static_cast<std::size_t>(b)];
        CHECK(r.prefill_lengths[head] == std::min(p, residual));  // the fp16 tail: the newest `residual` tokens
        CHECK(r.lengths[head] == r.prefill_lengths[head] + sc.steps);
        CHECK(r.packed_tokens[head] > 0);
        CHECK(r.packed_tokens[head] <= p - r.prefill_lengths[head]);
        if (name == "kivi")
          CHECK(r.packed_tokens[head] == p - residual);  // KIVI evicts nothing
      }
    for (float x : r.attention)
      REQUIRE(std::isfinite(x));
  }
}
