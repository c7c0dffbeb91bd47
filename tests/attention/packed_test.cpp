// SPDX-License-Identifier: Apache-2.0
// tests/attention/packed_test.cpp mirrors include/kvc/attention/packed.hpp (CPU kernel) and attention/merge.hpp:
// attention over the packed store equals kvc::attend over the dequantised kept tokens (spec rdkv S4; the dense
// reference is built from dequantized() and, for float_min with whole-axis K groups, from an independent restatement
// of the quantiser), the lossless path (S3), true token removal and exactly-zero pruned channels (Q3), the FP16 tail
// merged by log-sum-exp (S5), thread-count independence, and the entry point's errors.
#include <kvc/attention/merge.hpp>
#include <kvc/backend/cpu/attention/attend.hpp>
#include <kvc/backend/cpu/attention/packed.hpp>
#include <kvc/backend/cpu/thread_pool.hpp>
#include <kvc/pipeline/pack.hpp>
#include <kvc/store/packed_kv.hpp>

#include "common/synthetic.hpp"
#include "support/catch.hpp"
#include "support/helpers.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <vector>

using kvc::Index;

namespace {

struct OwnedBitPlan {
  std::vector<std::int8_t> v, k;
  kvc::BitPlan<> plan;
  OwnedBitPlan(Index batch, Index heads, Index tokens, Index dim, std::vector<std::int8_t> vb,
               std::vector<std::int8_t> kb)
      : v(std::move(vb)), k(std::move(kb)), plan{v.data(), k.data(), batch, heads, tokens, dim} {}
};

/// A random plan: each V slot and K channel draws from `options`.
OwnedBitPlan random_plan(kvc::KVExtents e, std::uint64_t seed, std::vector<int> const& v_options,
                         std::vector<int> const& k_options) {
  kvc::tools::Rng rng(seed);
  std::vector<std::int8_t> vb(static_cast<std::size_t>(e.rows())),
      kb(static_cast<std::size_t>(e.batch * e.heads * e.dim));
  for (auto& x : vb)
    x = static_cast<std::int8_t>(v_options[rng.next() % v_options.size()]);
  for (auto& x : kb)
    x = static_cast<std::int8_t>(k_options[rng.next() % k_options.size()]);
  return OwnedBitPlan(e.batch, e.heads, e.tokens, e.dim, vb, kb);
}

/// A dense fp32 cache [B, H, max T_eff, d] of the dequantised kept tokens of every head, sorted by position (a
/// per-head length table and positions), optionally followed by the `tail` tokens of each head.
struct DenseOf {
  kvc::tools::HostCache<float> cache;
};

DenseOf dense_of(kvc::PackedKV const& kv, kvc::tools::HostCache<float> const* tail = nullptr) {
  Index const B = kv.batch(), H = kv.kv_heads(), dk = kv.dim(), dv = kv.value_dim();
  Index cap = 0;
  for (Index b = 0; b < B; ++b)
    for (Index h = 0; h < H; ++h)
      cap = std::max(cap, kv.tokens(b, h) + (tail ? tail->length_table().at(b, h, tail->ext.tokens) : 0));
  DenseOf d{kvc::tools::HostCache<float>({B, H, std::max<Index>(cap, 1), dk}, dv)};
  d.cache.track(0);
  for (Index b = 0; b < B; ++b)
    for (Index h = 0; h < H; ++h) {
      Index const n = kv.tokens(b, h);
      std::vector<float> k(static_cast<std::size_t>(n * dk)), v(static_cast<std::size_t>(n * dv));
      std::vector<Index> pos(static_cast<std::size_t>(n));
      kvc::dequantized(kv, b, h, k.data(), v.data(), pos.data());
      std::vector<Index> order(static_cast<std::size_t>(n));
      std::iota(order.begin(), order.end(), Index{0});
      std::sort(order.begin(), order.end(),
                [&](Index x, Index y) { return pos[static_cast<std::size_t>(x)] < pos[static_cast<std::size_t>(y)]; });
      Index len = 0;
      auto put = [&](float const* krow, float const* vrow, Index p) {
        Index const slot = (b * H + h) * d.cache.ext.tokens + len;
        std::copy(krow, krow + dk, d.cache.k.begin() + slot * dk);
        std::copy(vrow, vrow + dv, d.cache.v.begin() + slot * dv);
        d.cache.positions[static_cast<std::size_t>(slot)] = p;
        ++len;
      };
      for (Index t : order)
        put(k.data() + t * dk, v.data() + t * dv, pos[static_cast<std::size_t>(t)]);
      if (tail) {
        Index const tn = tail->length_table().at(b, h, tail->ext.tokens);
        for (Index t = 0; t < tn; ++t) {
          Index const at = (b * H + h) * tail->ext.tokens + t;
          put(tail->k.data() + at * dk, tail->v.data() + at * dv, tail->positions[static_cast<std::size_t>(at)]);
        }
      }
      d.cache.lengths[static_cast<std::size_t>(b * H + h)] = len;
    }
  return d;
}

template <class T>
kvc::AttendQueries<T> queries_of(std::vector<T> const& q, kvc::KVExtents e, Index const* positions = nullptr) {
  return {kvc::TokenRows<T const, kvc::StridedLayout>(q.data(), kvc::bhtd_layout(e)), positions};
}

struct Result {
  std::vector<float> out, lse;
};

template <class T>
Result run_packed(kvc::PackedKV const& kv, kvc::AttendQueries<T> const& q, kvc::Cpu cpu = {}, kvc::Attention op = {}) {
  kvc::KVExtents const e = q.rows.extents();
  Result r{std::vector<float>(static_cast<std::size_t>(e.rows() * kv.value_dim()), -7.0f),
           std::vector<float>(static_cast<std::size_t>(e.rows()), -7.0f)};
  kvc::test::OwnedWorkspace ws(kvc::attend_packed_workspace_bytes(cpu, op, q, kv.view()));
  REQUIRE(kvc::attend_packed(cpu, op, q, kv.view(), {r.out.data(), r.lse.data()}, ws.get()).ok());
  return r;
}

template <class T, kvc::KVCacheView C>
Result run_dense(C const& cache, kvc::AttendQueries<T> const& q, Index dv, kvc::Attention op = {}) {
  kvc::KVExtents const e = q.rows.extents();
  Result r{std::vector<float>(static_cast<std::size_t>(e.rows() * dv)),
           std::vector<float>(static_cast<std::size_t>(e.rows()))};
  kvc::test::OwnedWorkspace ws(kvc::attend_workspace_bytes(kvc::Cpu{}, op, q, cache));
  REQUIRE(kvc::attend(kvc::Cpu{}, op, q, cache, {r.out.data(), r.lse.data()}, ws.get()).ok());
  return r;
}

/// Max |a - b| over outputs relative to max |b| (and the same for finite lse; -inf must match exactly).
void check_close(Result const& a, Result const& b, double tol) {
  double diff = 0, scale = 0;
  for (std::size_t i = 0; i < a.out.size(); ++i) {
    diff = std::max(diff, std::fabs(double{a.out[i]} - b.out[i]));
    scale = std::max(scale, std::fabs(double{b.out[i]}));
  }
  CHECK(diff <= tol * std::max(scale, 1e-30));
  for (std::size_t i = 0; i < a.lse.size(); ++i) {
    if (std::isinf(b.lse[i])) {
      CHECK(a.lse[i] == b.lse[i]);
    } else {
      CHECK(std::fabs(double{a.lse[i]} - b.lse[i]) <= tol * std::max(1.0, std::fabs(double{b.lse[i]})));
    }
  }
}

template <class T>
std::vector<T> random_queries(kvc::KVExtents e, std::uint64_t seed) {
  return kvc::tools::random_values<T>(e.rows() * e.dim, seed, 0.7f);
}

}  // namespace

TEST_CASE("attend_packed: all 16 bits with K passthrough equals kvc::attend on the full cache (S3)", "[attention]") {
  auto c = kvc::tools::HostCache<kvc::half>::random({2, 2, 70, 64}, 7);
  OwnedBitPlan bp = random_plan(c.ext, 1, {16}, {16});
  kvc::PackedKV kv;
  REQUIRE(kvc::pack(c.view(), bp.plan, {}, kv).ok());
  for (Index g : {1, 4}) {
    kvc::KVExtents const qe{2, 2 * g, 3, 64};
    auto const q = random_queries<float>(qe, 9);
    auto const queries = queries_of(q, qe);  // the last 3 positions: causal within the cache
    check_close(run_packed(kv, queries), run_dense(c.view(), queries, 64), 1e-5);
  }
}

TEST_CASE("attend_packed: a non-finite FP16 key is skipped as kvc::attend skips it", "[attention]") {
  auto c = kvc::tools::HostCache<kvc::half>::random({1, 2, 150, 64}, 11);
  OwnedBitPlan bp = random_plan(c.ext, 1, {16}, {16});
  kvc::PackedKV kv;
  REQUIRE(kvc::pack(c.view(), bp.plan, {}, kv).ok());
  // kvc::pack refuses non-finite values, a store written otherwise may hold them: token 70 of head 0 (the second
  // tile; all 16 bits, so packed order = slot order and k_perm = identity) gets an infinite key element and a NaN
  // value element, in the store and in the cache.
  kvc::PackedHead const& hd = kv.head_mut(0, 0);
  REQUIRE(hd.k_count[3] == 64);
  auto* k_raw = reinterpret_cast<kvc::half*>(kv.arena_mut() + hd.k_raw);
  auto* v_raw = reinterpret_cast<kvc::half*>(kv.arena_mut() + hd.v_raw);
  kvc::half const inf(std::numeric_limits<float>::infinity()), nan(std::numeric_limits<float>::quiet_NaN());
  k_raw[70 * 64 + 3] = c.k[static_cast<std::size_t>(70 * 64 + 3)] = inf;
  v_raw[70 * 64 + 9] = c.v[static_cast<std::size_t>(70 * 64 + 9)] = nan;
  kvc::KVExtents const qe{1, 8, 2, 64};
  auto const q = random_queries<float>(qe, 12);
  std::vector<Index> decode = {160, 161};
  auto const queries = queries_of(q, qe, decode.data());
  Result const packed = run_packed(kv, queries);
  for (float x : packed.out)
    REQUIRE(std::isfinite(x));
  check_close(packed, run_dense(c.view(), queries, 64), 1e-5);
}

TEST_CASE("attend_packed: evicted tokens leave the softmax, pruned channels add exactly 0 (Q3)", "[attention]") {
  auto c = kvc::tools::HostCache<kvc::half>::random({1, 2, 40, 32}, 4);
  std::vector<std::int8_t> vb(80, 16), kb(64, 16);
  for (Index t = 0; t < 40; t += 3)
    vb[static_cast<std::size_t>(t)] = 0, vb[static_cast<std::size_t>(40 + (t + 1) % 40)] = 0;
  kb[5] = 0, kb[32 + 17] = 0;
  // The pruned channels hold NaN: never read.
  for (Index t = 0; t < 40; ++t) {
    c.k[static_cast<std::size_t>(t * 32 + 5)] = kvc::half(std::numeric_limits<float>::quiet_NaN());
    c.k[static_cast<std::size_t>((40 + t) * 32 + 17)] = kvc::half(std::numeric_limits<float>::quiet_NaN());
  }
  OwnedBitPlan bp(1, 2, 40, 32, vb, kb);
  kvc::PackedKV kv;
  REQUIRE(kvc::pack(c.view(), bp.plan, {}, kv).ok());
  // The pruned cache, built by hand: kept slots only (their positions), pruned channels zeroed.
  kvc::tools::HostCache<kvc::half> pruned({1, 2, 40, 32});
  pruned.track(0);
  for (Index h = 0; h < 2; ++h) {
    Index len = 0;
    for (Index t = 0; t < 40; ++t) {
      if (vb[static_cast<std::size_t>(h * 40 + t)] == 0)
        continue;
      for (Index ch = 0; ch < 32; ++ch) {
        std::size_t const src = static_cast<std::size_t>((h * 40 + t) * 32 + ch);
        std::size_t const dst = static_cast<std::size_t>((h * 40 + len) * 32 + ch);
        pruned.k[dst] = kb[static_cast<std::size_t>(h * 32 + ch)] == 0 ? kvc::half(0.0f) : c.k[src];
        pruned.v[dst] = c.v[src];
      }
      pruned.positions[static_cast<std::size_t>(h * 40 + len)] = t;
      ++len;
    }
    pruned.lengths[static_cast<std::size_t>(h)] = len;
  }
  kvc::KVExtents const qe{1, 8, 2, 32};
  auto const q = random_queries<kvc::half>(qe, 3);
  std::vector<Index> pos = {20, 45};  // one query in the middle (causal mask over packed order), one past the end
  auto const queries = queries_of(q, qe, pos.data());
  Result const packed = run_packed(kv, queries);
  check_close(packed, run_dense(pruned.view(), queries, 32), 1e-5);
  for (float x : packed.out)
    CHECK(std::isfinite(x));
}

TEST_CASE("attend_packed: random mixed plans equal kvc::attend over the dequantised kept tokens (S4)", "[attention]") {
  struct Case {
    Index dim, k_group, v_group;
    kvc::ZeroPoint zp;
  };
  // d = 64 takes the fast V path (whole 16-byte chunks); d = 40 and v_group 8 the per-column path.
  std::vector<Case> const cases = {{64, 0, 0, kvc::ZeroPoint::float_min},   {64, 32, 32, kvc::ZeroPoint::float_min},
                                   {64, 0, 0, kvc::ZeroPoint::integer},     {64, 32, 32, kvc::ZeroPoint::integer},
                                   {40, 32, 32, kvc::ZeroPoint::float_min}, {40, 0, 0, kvc::ZeroPoint::integer},
                                   {64, 5, 8, kvc::ZeroPoint::float_min}};
  std::uint64_t seed = 100;
  for (Case const& cs : cases)
    for (int half_cache = 0; half_cache < 2; ++half_cache)
      for (Index g : {1, 4}) {
        kvc::KVExtents const e{2, 2, 150, cs.dim};  // ~120 kept tokens: tiles of kvc::attend's 64 cross segments
        kvc::PackOptions opt;
        opt.k_group = cs.k_group;
        opt.v_group = cs.v_group;
        opt.zero_point = cs.zp;
        OwnedBitPlan bp = random_plan(e, ++seed, {0, 2, 4, 8, 16}, {0, 2, 4, 8, 16});
        kvc::PackedKV kv;
        if (half_cache) {
          auto c = kvc::tools::HostCache<kvc::half>::random(e, seed);
          c.lengths = {150, 100, 17, 150};  // ragged heads
          c.per_head = true;
          REQUIRE(kvc::pack(c.view(), bp.plan, opt, kv).ok());
        } else {
          auto c = kvc::tools::HostCache<float>::random(e, seed);
          for (float& x : c.k)
            x += 0.5f;  // groups that exclude 0 now and then (the integer mode's clipping is part of k̂)
          REQUIRE(kvc::pack(c.view(), bp.plan, opt, kv).ok());
        }
        DenseOf const ref = dense_of(kv);
        kvc::KVExtents const qe{2, 2 * g, 3, cs.dim};
        auto const q = random_queries<float>(qe, seed + 7);
        INFO("dim " << cs.dim << " k_group " << cs.k_group << " v_group " << cs.v_group << " integer "
                    << (cs.zp == kvc::ZeroPoint::integer) << " fp16 " << half_cache << " g " << g);
        auto const queries = queries_of(q, qe);
        check_close(run_packed(kv, queries), run_dense(ref.cache.view(), queries, cs.dim), 1e-5);
        std::vector<Index> decode = {160, 161, 162, 155, 156, 157};  // past every stored position
        auto const later = queries_of(q, qe, decode.data());
        check_close(run_packed(kv, later), run_dense(ref.cache.view(), later, cs.dim), 1e-5);
      }
}

TEST_CASE("attend_packed: equals attention over an independent restatement of the quantiser (S4)", "[attention]") {
  // float_min, K per channel over all kept tokens (k_group 0, so the packed order does not matter), V per token.
  kvc::KVExtents const e{1, 2, 45, 64};
  auto c = kvc::tools::HostCache<float>::random(e, 77);
  OwnedBitPlan bp = random_plan(e, 78, {0, 2, 4, 8, 16}, {0, 2, 4, 8, 16});
  kvc::PackedKV kv;
  REQUIRE(kvc::pack(c.view(), bp.plan, {}, kv).ok());
  auto fake = [](std::vector<float> const& x, int bits) {
    std::vector<float> out(x.size());
    if (bits == 0)
      return std::vector<float>(x.size(), 0.0f);
    if (bits == 16) {
      for (std::size_t i = 0; i < x.size(); ++i)
        out[i] = float(kvc::half(x[i]));
      return out;
    }
    float mn = x[0], mx = x[0];
    for (float y : x)
      mn = std::min(mn, y), mx = std::max(mx, y);
    float const qmax = static_cast<float>((1 << bits) - 1);
    float const s = float(kvc::half((mx - mn) / qmax)), o = float(kvc::half(mn));
    for (std::size_t i = 0; i < x.size(); ++i)
      out[i] = (s == 0.0f ? 0.0f : std::nearbyint(std::min(std::max((x[i] - o) / s, 0.0f), qmax))) * s + o;
    return out;
  };
  kvc::tools::HostCache<float> ref({1, 2, 45, 64});
  ref.track(0);
  for (Index h = 0; h < 2; ++h) {
    std::vector<Index> kept;
    for (Index t = 0; t < 45; ++t)
      if (bp.v[static_cast<std::size_t>(h * 45 + t)] > 0)
        kept.push_back(t);
    for (Index ch = 0; ch < 64; ++ch) {
      std::vector<float> col;
      for (Index t : kept)
        col.push_back(c.k[static_cast<std::size_t>((h * 45 + t) * 64 + ch)]);
      auto const kh = fake(col, bp.k[static_cast<std::size_t>(h * 64 + ch)]);
      for (std::size_t j = 0; j < kept.size(); ++j)
        ref.k[static_cast<std::size_t>((h * 45 + static_cast<Index>(j)) * 64 + ch)] = kh[j];
    }
    for (std::size_t j = 0; j < kept.size(); ++j) {
      auto const first = c.v.begin() + (h * 45 + kept[j]) * 64;
      auto const vh = fake(std::vector<float>(first, first + 64), bp.v[static_cast<std::size_t>(h * 45 + kept[j])]);
      std::copy(vh.begin(), vh.end(), ref.v.begin() + (h * 45 + static_cast<Index>(j)) * 64);
      ref.positions[static_cast<std::size_t>(h * 45) + j] = kept[j];
    }
    ref.lengths[static_cast<std::size_t>(h)] = static_cast<Index>(kept.size());
  }
  kvc::KVExtents const qe{1, 8, 2, 64};
  auto const q = random_queries<float>(qe, 79);
  std::vector<Index> pos = {30, 44};
  auto const queries = queries_of(q, qe, pos.data());
  check_close(run_packed(kv, queries), run_dense(ref.view(), queries, 64), 1e-5);
}

TEST_CASE("merge_attention: packed zones plus an FP16 tail equal attention over the concatenation (S5)",
          "[attention]") {
  kvc::KVExtents const e{1, 2, 50, 64};
  auto c = kvc::tools::HostCache<float>::random(e, 21);
  OwnedBitPlan bp = random_plan(e, 22, {0, 2, 4, 16}, {2, 4, 8});
  kvc::PackOptions opt;
  opt.k_group = 32;
  opt.v_group = 32;
  kvc::PackedKV kv;
  REQUIRE(kvc::pack(c.view(), bp.plan, opt, kv).ok());
  // The tail: 6 decode tokens at positions T, T + 1, ... (every head), FP16 values widened.
  auto tail = kvc::tools::HostCache<float>::random({1, 2, 6, 64}, 23);
  for (float& x : tail.k)
    x = float(kvc::half(x));
  for (float& x : tail.v)
    x = float(kvc::half(x));
  tail.track(6);
  for (Index i = 0; i < 12; ++i)
    tail.positions[static_cast<std::size_t>(i)] = 50 + i % 6;
  DenseOf const all = dense_of(kv, &tail);
  kvc::KVExtents const qe{1, 8, 2, 64};
  auto const q = random_queries<float>(qe, 24);
  std::vector<Index> pos = {54, 55};  // the second-to-last decode token sees the tail's first 5, the last all 6
  auto const queries = queries_of(q, qe, pos.data());
  Result merged = run_packed(kv, queries);
  Result const tail_part = run_dense(tail.view(), queries, 64);
  REQUIRE(kvc::merge_attention(merged.out.data(), merged.lse.data(), tail_part.out.data(), tail_part.lse.data(),
                               qe.rows(), 64)
              .ok());
  check_close(merged, run_dense(all.cache.view(), queries, 64), 1e-5);
  // An empty side leaves the other as it is.
  Result a = tail_part;
  std::vector<float> zero(a.out.size(), 0.0f), none(a.lse.size(), -std::numeric_limits<float>::infinity());
  REQUIRE(kvc::merge_attention(a.out.data(), a.lse.data(), zero.data(), none.data(), qe.rows(), 64).ok());
  CHECK(a.out == tail_part.out);
  CHECK(a.lse == tail_part.lse);
  CHECK(kvc::merge_attention(nullptr, a.lse.data(), zero.data(), none.data(), 1, 64).code() ==
        kvc::Errc::invalid_argument);
}

TEST_CASE("attend_packed: bit-identical for any thread count, empty heads give 0 and -inf", "[attention]") {
  kvc::KVExtents const e{2, 4, 77, 64};
  auto c = kvc::tools::HostCache<kvc::half>::random(e, 31);
  OwnedBitPlan bp = random_plan(e, 32, {0, 2, 4, 8, 16}, {0, 2, 4, 8, 16});
  std::fill(bp.v.begin() + 77, bp.v.begin() + 2 * 77, std::int8_t{0});  // head (0, 1) evicts everything
  kvc::PackedKV kv;
  REQUIRE(kvc::pack(c.view(), bp.plan, {}, kv).ok());
  REQUIRE(kv.tokens(0, 1) == 0);
  constexpr Index n = 17;
  kvc::KVExtents const qe{2, 16, n, 64};  // 68 rows per KV head: two passes of kvc::attend's 64 rows
  auto const q = random_queries<kvc::bfloat16>(qe, 33);
  auto const queries = queries_of(q, qe);
  Result const serial = run_packed(kv, queries);
  // The second pass (rows 64-67 of each KV head) stages its own K groups' scaled queries: equal to the reference.
  check_close(serial, run_dense(dense_of(kv).cache.view(), queries, 64), 1e-5);
  for (Index threads : {2, 3, 8}) {
    kvc::ThreadPool pool(threads);
    Result const par = run_packed(kv, queries, pool.cpu());
    CHECK(par.out == serial.out);
    CHECK(par.lse == serial.lse);
  }
  for (Index hq = 4; hq < 8; ++hq)  // query heads of KV head 1 in sequence 0
    for (Index i = 0; i < n; ++i) {
      Index const row = hq * n + i;
      CHECK(serial.lse[static_cast<std::size_t>(row)] == -std::numeric_limits<float>::infinity());
      for (Index ch = 0; ch < 64; ++ch)
        CHECK(serial.out[static_cast<std::size_t>(row * 64 + ch)] == 0.0f);
    }
}

TEST_CASE("attend_packed: errors name the argument", "[attention]") {
  auto c = kvc::tools::HostCache<float>::random({1, 2, 8, 16}, 1);
  OwnedBitPlan bp = random_plan(c.ext, 2, {2, 4}, {4});
  kvc::PackedKV kv;
  REQUIRE(kvc::pack(c.view(), bp.plan, {}, kv).ok());
  std::vector<float> q(static_cast<std::size_t>(3 * 16)), out(48), lse(3);
  kvc::test::OwnedWorkspace ws(1 << 20);
  kvc::Attention const op{};
  auto const bad_heads = queries_of(q, {1, 3, 1, 16});
  CHECK(kvc::attend_packed(kvc::Cpu{}, op, bad_heads, kv.view(), {out.data(), lse.data()}, ws.get()).code() ==
        kvc::Errc::invalid_argument);
  auto const bad_dim = queries_of(q, {1, 2, 1, 12});
  CHECK(kvc::attend_packed(kvc::Cpu{}, op, bad_dim, kv.view(), {out.data(), lse.data()}, ws.get()).code() ==
        kvc::Errc::invalid_argument);
  auto const good = queries_of(q, {1, 2, 1, 16});
  CHECK(kvc::attend_packed(kvc::Cpu{}, op, good, kv.view(), {nullptr, lse.data()}, ws.get()).code() ==
        kvc::Errc::invalid_argument);
  CHECK(kvc::attend_packed(kvc::Cpu{}, op, good, kv.view(), {out.data(), lse.data()}, {ws.get().data, 8}).code() ==
        kvc::Errc::out_of_capacity);
  auto view = kv.view();
  view.max_tokens = 3;  // smaller than a head's T_eff
  CHECK(kvc::attend_packed(kvc::Cpu{}, op, good, view, {out.data(), lse.data()}, ws.get()).code() ==
        kvc::Errc::invalid_argument);
  CHECK(kvc::attend_packed(kvc::Cpu{}, op, good, kv.view(), {out.data(), nullptr}, ws.get()).ok());
}
