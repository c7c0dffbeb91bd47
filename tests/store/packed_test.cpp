// SPDX-License-Identifier: Apache-2.0
// tests/store/packed_test.cpp mirrors include/kvc/store/packed.hpp (and packed_kv.hpp, pipeline/pack.hpp): the packed
// order and split layout of a hand case byte for byte (spec rdkv Q5), padding counts, the memory accounting by hand
// (S6), FP16 passthrough (Q3), pruned channels, dequantized() against an independent restatement of the quantiser,
// and the packer's errors.
#include <kvc/backend/cpu/pipeline/pack.hpp>
#include <kvc/pipeline/pack.hpp>
#include <kvc/store/packed.hpp>
#include <kvc/store/packed_kv.hpp>

#include "common/synthetic.hpp"
#include "support/catch.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
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

/// The hand case of Q5: one head, 3 tokens, d_k = d_v = 8. v_bits {2, 16, 4}; k_bits {2, 0, 4, 2, 8, 16, 2, 0}.
/// Values are chosen so that every group's min is 0 and its max 2^b - 1 (scale 1, offset 0): codes = values.
/// Packed order of tokens: slot 0 (2 bits), slot 2 (4 bits), slot 1 (16 bits).
/// Packed channels: 2 bits {0, 3, 6, pad}, 4 bits {2, pad}, 8 bits {4}, 16 bits {5}.
struct HandCase {
  std::vector<float> k, v;
  HandCase() : k(24, 0.0f), v(24, 0.0f) {
    auto key = [&](Index slot, Index c, float x) { k[static_cast<std::size_t>(slot * 8 + c)] = x; };
    // channel 0 over packed tokens (slots 0, 2, 1): 0, 3, 1; channel 3: 2, 0, 3; channel 6: 3, 1, 0.
    key(0, 0, 0), key(2, 0, 3), key(1, 0, 1);
    key(0, 3, 2), key(2, 3, 0), key(1, 3, 3);
    key(0, 6, 3), key(2, 6, 1), key(1, 6, 0);
    key(0, 2, 0), key(2, 2, 15), key(1, 2, 5);              // 4 bits
    key(0, 4, 0), key(2, 4, 255), key(1, 4, 7);             // 8 bits
    key(0, 5, 0.5f), key(2, 5, -1.25f), key(1, 5, 3.0f);    // 16 bits (raw)
    key(0, 1, 100), key(1, 7, -100);                        // pruned channels: never stored
    float const v0[8] = {0, 1, 2, 3, 3, 2, 1, 0};           // slot 0, 2 bits
    float const v2[8] = {0, 15, 1, 2, 3, 4, 5, 6};          // slot 2, 4 bits
    float const v1[8] = {0.5f, -2, 7, 0.125f, 0, 0, 1, 2};  // slot 1, 16 bits
    for (Index c = 0; c < 8; ++c) {
      v[static_cast<std::size_t>(c)] = v0[c];
      v[static_cast<std::size_t>(16 + c)] = v2[c];
      v[static_cast<std::size_t>(8 + c)] = v1[c];
    }
  }
  auto view() { return kvc::dense_cache(k.data(), v.data(), {1, 1, 3, 8}); }
};

template <class T>
T const* arena_at(kvc::PackedKV const& kv, std::uint64_t offset) {
  return reinterpret_cast<T const*>(kv.arena_data() + offset);
}

}  // namespace

TEST_CASE("pack: packed order, permutation and split layout of a hand case byte for byte (Q5)", "[store]") {
  HandCase hc;
  OwnedBitPlan bp(1, 1, 3, 8, {2, 16, 4}, {2, 0, 4, 2, 8, 16, 2, 0});
  kvc::PackedKV kv;
  REQUIRE(kvc::pack(hc.view(), bp.plan, {}, kv).ok());
  kvc::PackedHead const& hd = kv.head(0, 0);
  CHECK(hd.tokens == 3);
  CHECK((hd.v_count[0] == 1 && hd.v_count[1] == 1 && hd.v_count[2] == 0 && hd.v_count[3] == 1));
  // Padding: 3 two-bit channels -> 4, 1 four-bit channel -> 2, 8 and 16 bits unpadded.
  CHECK((hd.k_count[0] == 4 && hd.k_count[1] == 2 && hd.k_count[2] == 1 && hd.k_count[3] == 1));
  CHECK(hd.k_groups == 1);
  CHECK(hd.end_position == 3);
  Index const* pos = arena_at<Index>(kv, hd.positions);
  CHECK((pos[0] == 0 && pos[1] == 2 && pos[2] == 1));
  std::int32_t const* perm = arena_at<std::int32_t>(kv, hd.k_perm);
  CHECK(std::vector<std::int32_t>(perm, perm + 8) == std::vector<std::int32_t>{0, 3, 6, -1, 2, -1, 4, 5});
  // 2-bit K rows (1 byte per token): byte = c[0] | c[1] << 2 | c[2] << 4 | c[3] << 6 over channels {0, 3, 6, pad}.
  std::uint8_t const* k2 = arena_at<std::uint8_t>(kv, hd.k_codes[0]);
  CHECK(int{k2[0]} == (0 | 2 << 2 | 3 << 4));  // 56
  CHECK(int{k2[1]} == (3 | 0 << 2 | 1 << 4));  // 19
  CHECK(int{k2[2]} == (1 | 3 << 2 | 0 << 4));  // 13
  // 4-bit K rows (1 byte per token): c[0] | c[1] << 4 over {2, pad}.
  std::uint8_t const* k4 = arena_at<std::uint8_t>(kv, hd.k_codes[1]);
  CHECK((int{k4[0]} == 0 && int{k4[1]} == 15 && int{k4[2]} == 5));
  std::uint8_t const* k8 = arena_at<std::uint8_t>(kv, hd.k_codes[2]);
  CHECK((int{k8[0]} == 0 && int{k8[1]} == 255 && int{k8[2]} == 7));
  kvc::half const* kr = arena_at<kvc::half>(kv, hd.k_raw);
  CHECK((float(kr[0]) == 0.5f && float(kr[1]) == -1.25f && float(kr[2]) == 3.0f));
  // K params: scale 1, offset 0 for kept channels; pads 0, 0.
  auto const* kp = arena_at<kvc::QuantParams>(kv, hd.k_params[0]);
  for (int i = 0; i < 3; ++i)
    CHECK((float(kp[i].scale) == 1.0f && float(kp[i].offset) == 0.0f));
  CHECK((kp[3].scale.bits == 0 && kp[3].offset.bits == 0));
  // V: 2-bit token (2 bytes): byte i = c[i] | c[i+2] << 2 | c[i+4] << 4 | c[i+6] << 6.
  std::uint8_t const* v2 = arena_at<std::uint8_t>(kv, hd.v_codes[0]);
  CHECK(int{v2[0]} == (0 | 2 << 2 | 3 << 4 | 1 << 6));  // 120
  CHECK(int{v2[1]} == (1 | 3 << 2 | 2 << 4 | 0 << 6));  // 45
  // 4-bit token (4 bytes): byte i = c[i] | c[i+4] << 4.
  std::uint8_t const* v4 = arena_at<std::uint8_t>(kv, hd.v_codes[1]);
  CHECK((int{v4[0]} == (0 | 3 << 4) && int{v4[1]} == (15 | 4 << 4) && int{v4[2]} == (1 | 5 << 4) &&
         int{v4[3]} == (2 | 6 << 4)));
  kvc::half const* vr = arena_at<kvc::half>(kv, hd.v_raw);
  for (Index c = 0; c < 8; ++c)
    CHECK(vr[c].bits == kvc::half(hc.v[static_cast<std::size_t>(8 + c)]).bits);
  // Every offset is 16-byte aligned.
  for (std::uint64_t off : {hd.positions, hd.k_perm, hd.k_codes[0], hd.k_codes[1], hd.k_codes[2], hd.k_params[0],
                            hd.k_raw, hd.v_codes[0], hd.v_codes[1], hd.v_params[0], hd.v_raw})
    CHECK(off % 16 == 0);

  // dequantized(): original channel order, pruned channels 0, packed token order.
  std::vector<float> kd(24, -9.0f), vd(24, -9.0f);
  std::vector<Index> pd(3, -9);
  kvc::dequantized(kv, 0, 0, kd.data(), vd.data(), pd.data());
  CHECK(pd == std::vector<Index>{0, 2, 1});
  Index const slot_of[3] = {0, 2, 1};
  for (Index t = 0; t < 3; ++t)
    for (Index c = 0; c < 8; ++c) {
      float const expect = (c == 1 || c == 7) ? 0.0f : hc.k[static_cast<std::size_t>(slot_of[t] * 8 + c)];
      CHECK(kd[static_cast<std::size_t>(t * 8 + c)] == expect);
      CHECK(vd[static_cast<std::size_t>(t * 8 + c)] == hc.v[static_cast<std::size_t>(slot_of[t] * 8 + c)]);
    }
}

TEST_CASE("pack: payload and overhead bits by hand (S6), with and without the K 16 -> 8 clamp", "[store]") {
  HandCase hc;
  OwnedBitPlan bp(1, 1, 3, 8, {2, 16, 4}, {2, 0, 4, 2, 8, 16, 2, 0});
  kvc::PackedKV kv;
  REQUIRE(kvc::pack(hc.view(), bp.plan, {}, kv).ok());
  // Payload: V 8·2 + 8·4 + 8·16 = 176; K over 3 tokens: 3 ch·2 + 1·4 + 1·8 + 1·16 bits = 34 -> 102. 278 in all.
  CHECK(kv.payload_bits() == 278);
  // Overhead: permutation 16 · 8 packed channels = 128; K params 7 (4 + 2 + 1, pads included) · 32 = 224;
  // V params 2 tokens · 1 group · 32 = 64; pad codes 1 ch · 3 tok · 2 + 1 · 3 · 4 = 18. 434 in all.
  CHECK(kv.overhead_bits() == 434);
  CHECK(kv.arena_bytes() > 0);
  kvc::PackOptions clamp;
  clamp.clamp_k16_to_8 = true;
  REQUIRE(kvc::pack(hc.view(), bp.plan, clamp, kv).ok());
  CHECK((kv.head(0, 0).k_count[2] == 2 && kv.head(0, 0).k_count[3] == 0));
  CHECK(kv.payload_bits() == 176 + 3 * (3 * 2 + 4 + 8 + 8));  // 254: channel 5 counts 8 bits
  CHECK(kv.overhead_bits() == 128 + 8 * 32 + 64 + 18);        // 466

  // V padding and groups: d = 6, v_bits {2, 4}, every K channel at 4 bits, v_group 4 (2 groups), k_group 1.
  std::vector<float> k(12), v(12);
  for (std::size_t i = 0; i < 12; ++i) {
    k[i] = static_cast<float>(i % 5);
    v[i] = static_cast<float>(i % 7) - 3.0f;
  }
  OwnedBitPlan bp2(1, 1, 2, 6, {2, 4}, {4, 4, 4, 4, 4, 4});
  kvc::PackOptions opt;
  opt.v_group = 4;
  opt.k_group = 1;
  REQUIRE(kvc::pack(kvc::dense_cache(k.data(), v.data(), {1, 1, 2, 6}), bp2.plan, opt, kv).ok());
  CHECK(kv.head(0, 0).k_groups == 2);
  CHECK(kv.view().v_padded(0) == 8);  // 6 -> 8 at 2 bits
  CHECK(kv.view().v_padded(1) == 6);
  // Payload 6·2 + 6·4 + 6 ch · 2 tok · 4 = 84. Overhead: perm 96, K params 2 groups · 6 · 32 = 384, V params
  // 2 tokens · 2 groups · 32 = 128, V pad codes 2 · 2 bits = 4.
  CHECK(kv.payload_bits() == 84);
  CHECK(kv.overhead_bits() == 96 + 384 + 128 + 4);
}

TEST_CASE("pack: all 16 bits is a bit-exact FP16 passthrough, pruned channels read 0 even when NaN (Q3)", "[store]") {
  auto c = kvc::tools::HostCache<kvc::half>::random({2, 2, 9, 16}, 3);
  std::vector<std::int8_t> vb(2 * 2 * 9, 16), kb(2 * 2 * 16, 16);
  kb[3] = 0;  // head (0, 0) prunes channel 3: a NaN there is never read
  c.k[static_cast<std::size_t>(5 * 16 + 3)] = kvc::half(std::numeric_limits<float>::quiet_NaN());
  OwnedBitPlan bp(2, 2, 9, 16, vb, kb);
  kvc::PackedKV kv;
  REQUIRE(kvc::pack(c.view(), bp.plan, {}, kv).ok());
  std::vector<float> kd(9 * 16), vd(9 * 16);
  for (Index b = 0; b < 2; ++b)
    for (Index h = 0; h < 2; ++h) {
      kvc::dequantized(kv, b, h, kd.data(), vd.data(), nullptr);
      for (Index t = 0; t < 9; ++t)
        for (Index ch = 0; ch < 16; ++ch) {
          std::size_t const at = static_cast<std::size_t>(((b * 2 + h) * 9 + t) * 16 + ch);
          std::size_t const here = static_cast<std::size_t>(t * 16 + ch);
          if (b == 0 && h == 0 && ch == 3)
            CHECK(kd[here] == 0.0f);
          else
            CHECK(kvc::half(kd[here]).bits == c.k[at].bits);
          CHECK(kvc::half(vd[here]).bits == c.v[at].bits);
        }
    }
  CHECK(kv.overhead_bits() == 4 * 16 * 16 - 16 * 1);  // only the permutation (16 bits a stored channel)
  CHECK(kv.payload_bits() == 4 * 9 * 16 * 16 * 2 - 9 * 16);
}

TEST_CASE("pack: dequantized() equals an independent restatement of min-max quantisation", "[store]") {
  // K per channel over all kept tokens (k_group 0: order-free), V per token over 32-channel groups, float_min.
  auto c = kvc::tools::HostCache<float>::random({1, 2, 21, 64}, 11);
  kvc::tools::Rng rng(5);
  int const options[5] = {0, 2, 4, 8, 16};
  std::vector<std::int8_t> vb(2 * 21), kb(2 * 64);
  for (auto& x : vb)
    x = static_cast<std::int8_t>(options[rng.next() % 5]);
  for (auto& x : kb)
    x = static_cast<std::int8_t>(options[rng.next() % 5]);
  OwnedBitPlan bp(1, 2, 21, 64, vb, kb);
  kvc::PackOptions opt;
  opt.v_group = 32;
  kvc::PackedKV kv;
  REQUIRE(kvc::pack(c.view(), bp.plan, opt, kv).ok());
  // The restatement: s = half((max - min) / (2^b - 1)), o = half(min), q = round-half-even(clamp((x - o) / s)),
  // x̂ = q s + o (s = 0: x̂ = o); 16 bits: half(x).
  auto fake = [](std::vector<float> const& x, int bits) {
    std::vector<float> out(x.size());
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
    for (std::size_t i = 0; i < x.size(); ++i) {
      float const q = s == 0.0f ? 0.0f : std::nearbyint(std::min(std::max((x[i] - o) / s, 0.0f), qmax));
      out[i] = q * s + o;
    }
    return out;
  };
  for (Index h = 0; h < 2; ++h) {
    std::vector<Index> kept;
    for (Index t = 0; t < 21; ++t)
      if (vb[static_cast<std::size_t>(h * 21 + t)] > 0)
        kept.push_back(t);
    Index const n = kv.tokens(0, h);
    REQUIRE(n == static_cast<Index>(kept.size()));
    std::vector<float> kd(static_cast<std::size_t>(n * 64)), vd(kd.size());
    std::vector<Index> pd(static_cast<std::size_t>(n));
    kvc::dequantized(kv, 0, h, kd.data(), vd.data(), pd.data());
    // Row of packed token t (positions are slots here).
    for (Index ch = 0; ch < 64; ++ch) {
      int const bits = kb[static_cast<std::size_t>(h * 64 + ch)];
      std::vector<float> col;
      for (Index t : kept)
        col.push_back(c.k[static_cast<std::size_t>((h * 21 + t) * 64 + ch)]);
      std::vector<float> const ref = bits == 0 ? std::vector<float>(col.size(), 0.0f) : fake(col, bits);
      for (Index t = 0; t < n; ++t) {
        auto const j = static_cast<std::size_t>(std::find(kept.begin(), kept.end(), pd[static_cast<std::size_t>(t)]) -
                                                kept.begin());
        CHECK(kd[static_cast<std::size_t>(t * 64 + ch)] == ref[j]);
      }
    }
    for (Index t = 0; t < n; ++t) {
      Index const slot = pd[static_cast<std::size_t>(t)];
      int const bits = vb[static_cast<std::size_t>(h * 21 + slot)];
      for (Index g = 0; g < 2; ++g) {
        std::vector<float> grp(c.v.begin() + (h * 21 + slot) * 64 + g * 32,
                               c.v.begin() + (h * 21 + slot) * 64 + g * 32 + 32);
        std::vector<float> const ref = fake(grp, bits);
        for (Index i = 0; i < 32; ++i)
          CHECK(vd[static_cast<std::size_t>(t * 64 + g * 32 + i)] == ref[static_cast<std::size_t>(i)]);
      }
    }
    // Packed order: bits ascending, slot order within a width.
    for (Index t = 1; t < n; ++t) {
      int const b0 = vb[static_cast<std::size_t>(h * 21 + pd[static_cast<std::size_t>(t - 1)])];
      int const b1 = vb[static_cast<std::size_t>(h * 21 + pd[static_cast<std::size_t>(t)])];
      CHECK((b0 < b1 || (b0 == b1 && pd[static_cast<std::size_t>(t - 1)] < pd[static_cast<std::size_t>(t)])));
    }
  }
}

TEST_CASE("pack: lengths drop padding slots, an all-evicted head is empty", "[store]") {
  auto c = kvc::tools::HostCache<float>::random({1, 2, 8, 16}, 2);
  c.lengths = {5, 0};
  c.per_head = true;
  std::vector<std::int8_t> vb(16, 4), kb(32, 2);
  vb[7] = 99;  // past head 0's length: never read
  OwnedBitPlan bp(1, 2, 8, 16, vb, kb);
  kvc::PackedKV kv;
  REQUIRE(kvc::pack(c.view(), bp.plan, {}, kv).ok());
  CHECK(kv.tokens(0, 0) == 5);
  CHECK(kv.tokens(0, 1) == 0);
  CHECK(kv.head(0, 1).k_channels() == 0);
  CHECK(kv.head(0, 1).payload_bits == 0);
  CHECK(kv.max_tokens() == 5);
}

TEST_CASE("pack: errors name the argument (bad bits, non-finite, shapes, options)", "[store]") {
  auto c = kvc::tools::HostCache<float>::random({1, 1, 4, 8}, 1);
  kvc::PackedKV kv;
  {
    OwnedBitPlan bp(1, 1, 4, 8, {2, 3, 4, 8}, std::vector<std::int8_t>(8, 4));
    auto const st = kvc::pack(c.view(), bp.plan, {}, kv);
    CHECK(st.code() == kvc::Errc::invalid_argument);
    CHECK(std::strstr(st.message(), "v_bits") != nullptr);
  }
  {
    std::vector<std::int8_t> kb(8, 4);
    kb[2] = 1;
    OwnedBitPlan bp(1, 1, 4, 8, {2, 2, 4, 8}, kb);
    CHECK(std::strstr(kvc::pack(c.view(), bp.plan, {}, kv).message(), "k_bits") != nullptr);
  }
  {
    OwnedBitPlan bp(1, 1, 4, 7, {2, 2, 4, 8}, std::vector<std::int8_t>(7, 4));  // d_k mismatch
    CHECK(kvc::pack(c.view(), bp.plan, {}, kv).code() == kvc::Errc::invalid_argument);
  }
  {
    OwnedBitPlan bp(1, 1, 4, 8, {2, 2, 4, 8}, std::vector<std::int8_t>(8, 4));
    kvc::PackOptions bad;
    bad.k_group = -1;
    CHECK(kvc::pack(c.view(), bp.plan, bad, kv).code() == kvc::Errc::invalid_argument);
    auto nan_k = c;
    nan_k.k[9] = std::numeric_limits<float>::infinity();
    auto st = kvc::pack(nan_k.view(), bp.plan, {}, kv);
    CHECK(st.code() == kvc::Errc::non_finite);
    CHECK(std::strstr(st.message(), "key") != nullptr);
    CHECK(kv.batch() == 0);  // left empty
    auto nan_v = c;
    nan_v.v[30] = std::numeric_limits<float>::quiet_NaN();
    st = kvc::pack(nan_v.view(), bp.plan, {}, kv);
    CHECK(st.code() == kvc::Errc::non_finite);
    CHECK(std::strstr(st.message(), "value") != nullptr);
    auto big = c;
    big.v[0] = 1e6f;  // beyond FP16
    CHECK(kvc::pack(big.view(), bp.plan, {}, kv).code() == kvc::Errc::non_finite);
    // An evicted token's NaN is never read.
    OwnedBitPlan evict(1, 1, 4, 8, {2, 0, 4, 8}, std::vector<std::int8_t>(8, 4));
    auto nan_evicted = c;
    nan_evicted.v[8] = std::numeric_limits<float>::quiet_NaN();
    nan_evicted.k[8] = std::numeric_limits<float>::quiet_NaN();
    CHECK(kvc::pack(nan_evicted.view(), evict.plan, {}, kv).ok());
  }
}

namespace {
/// The bytes a head's arrays reach past `base`, read off its descriptor (the largest offset + size).
std::uint64_t head_extent(kvc::PackedHead const& d, Index value_dim, kvc::PackedQuant const& q) {
  using kvc::packed_bytes;
  using kvc::segment_bits;
  auto const u = [](Index x) { return static_cast<std::uint64_t>(x); };
  Index const groups = q.v_group > 0 ? (value_dim + q.v_group - 1) / q.v_group : 1;
  std::uint64_t end = 0;
  auto reach = [&end](std::uint64_t at, std::uint64_t bytes) {
    if (bytes > 0)
      end = std::max(end, at + bytes);
  };
  reach(d.positions, u(d.tokens) * sizeof(Index));
  reach(d.k_perm, u(d.k_channels()) * 4);
  for (int s = 0; s < 3; ++s) {
    int const b = segment_bits(s);
    reach(d.k_codes[s], u(d.tokens) * u(packed_bytes(d.k_count[s], b)));
    reach(d.k_params[s], u(d.k_groups) * u(d.k_count[s]) * 4);
    reach(d.v_codes[s], u(d.v_count[s]) * u(packed_bytes(kvc::padded_count(value_dim, b), b)));
    reach(d.v_params[s], u(d.v_count[s]) * u(groups) * 4);
  }
  reach(d.k_raw, u(d.tokens) * u(d.k_count[3]) * 2);
  reach(d.v_raw, u(d.v_count[3]) * u(value_dim) * 2);
  return end;
}
}  // namespace

TEST_CASE("pack_into: the same heads as pack, each inside its own region, and errors leave every head empty",
          "[store]") {
  std::int8_t const widths[5] = {0, 2, 4, 8, 16};
  for (Index group : {Index{0}, Index{1}, Index{3}}) {
    std::uint64_t widest = 0;  // the most bytes a head of the all-2 or all-16 plan reached
    for (int trial = 0; trial < 6; ++trial) {
      Index const heads = 3, tokens = 11, dk = 10, dv = 6;
      auto c = kvc::tools::HostCache<float>::random({2, heads, tokens, dk}, 40 + trial, dv);
      c.lengths = {11, 7, 0, 11, 3, 9};
      c.per_head = true;
      kvc::tools::Rng rng(static_cast<std::uint64_t>(trial * 17 + group));
      std::vector<std::int8_t> vb(static_cast<std::size_t>(2 * heads * tokens)),
          kb(static_cast<std::size_t>(2 * heads * dk));
      // trial 0: every width 2 (the widest per K channel with group 1); trial 1: every width 16; else random.
      for (auto& x : vb)
        x = trial == 0 ? 2 : (trial == 1 ? 16 : widths[rng.next() % 5]);
      for (auto& x : kb)
        x = trial == 0 ? 2 : (trial == 1 ? 16 : widths[rng.next() % 5]);
      OwnedBitPlan bp(2, heads, tokens, dk, vb, kb);
      kvc::PackOptions opt;
      opt.k_group = group;
      opt.v_group = group == 0 ? 0 : 4;
      opt.zero_point = trial % 2 ? kvc::ZeroPoint::integer : kvc::ZeroPoint::float_min;
      kvc::PackedKV owned;
      REQUIRE(kvc::pack(c.view(), bp.plan, opt, owned).ok());

      kvc::PackedQuant const quant{opt.zero_point, opt.v_group, opt.k_group};
      kvc::PackedStore<> store{nullptr, nullptr, 2, heads, dk, dv, tokens, quant};
      std::vector<kvc::PackedHead> descs(6);
      std::vector<std::byte> arena(store.arena_bytes() + 16, std::byte{0x5a});  // garbage: nothing may rely on zeros
      auto* base = arena.data() + (16 - reinterpret_cast<std::uintptr_t>(arena.data()) % 16) % 16;
      store.arena = base;
      store.heads = descs.data();
      std::vector<std::byte> ws(kvc::pack_workspace_bytes(kvc::Cpu{}, c.view()));
      REQUIRE(kvc::pack_into(kvc::Cpu{}, c.view(), bp.plan, opt, store, {ws.data(), ws.size()}).ok());
      kvc::PackedKVView<> const view = store.view();
      for (Index b = 0; b < 2; ++b)
        for (Index h = 0; h < heads; ++h) {
          INFO("group " << group << " trial " << trial << " head " << b << "," << h);
          kvc::PackedHead const &got = view.head(b, h), &want = owned.head(b, h);
          CHECK(got.tokens == want.tokens);
          CHECK(got.payload_bits == want.payload_bits);
          CHECK(got.overhead_bits == want.overhead_bits);
          CHECK(got.end_position == want.end_position);
          for (int s = 0; s < 4; ++s)
            CHECK((got.v_count[s] == want.v_count[s] && got.k_count[s] == want.k_count[s]));
          std::uint64_t const region = store.region_bytes(), start = static_cast<std::uint64_t>(b * heads + h) * region;
          if (got.tokens > 0) {
            CHECK(got.positions >= start);
            CHECK(head_extent(got, dv, quant) <= start + region);
          }
          auto const n = static_cast<std::size_t>(got.tokens);
          std::vector<float> k1(n * dk), v1(n * dv), k2(n * dk), v2(n * dv);
          std::vector<Index> p1(n), p2(n);
          kvc::dequantized(view, b, h, k1.data(), v1.data(), p1.data());
          kvc::dequantized(owned, b, h, k2.data(), v2.data(), p2.data());
          CHECK(k1 == k2);
          CHECK(v1 == v2);
          CHECK(p1 == p2);
        }
      // The bound is not loose: the widest of the all-2 and all-16 plans fills at least half of a region.
      if (trial < 2)
        for (Index i = 0; i < 6; ++i)
          if (descs[static_cast<std::size_t>(i)].tokens > 0)
            widest = std::max(widest, head_extent(descs[static_cast<std::size_t>(i)], dv, quant) -
                                          static_cast<std::uint64_t>(i) * store.region_bytes());
      if (trial == 1)
        CHECK(2 * widest >= store.region_bytes());
    }
  }

  // A non-finite value in the second sequence: no head is left half written, every descriptor is empty.
  auto c = kvc::tools::HostCache<float>::random({2, 1, 4, 8}, 3);
  c.v[static_cast<std::size_t>(4 * 8 + 5)] = std::numeric_limits<float>::infinity();
  OwnedBitPlan bp(2, 1, 4, 8, std::vector<std::int8_t>(8, 4), std::vector<std::int8_t>(16, 4));
  kvc::PackedStore<> store{nullptr, nullptr, 2, 1, 8, 8, 4, {}};
  std::vector<kvc::PackedHead> descs(2);
  alignas(16) static std::byte arena[4096];
  REQUIRE(store.arena_bytes() <= sizeof(arena));
  store.arena = arena;
  store.heads = descs.data();
  std::vector<std::byte> ws(kvc::pack_workspace_bytes(kvc::Cpu{}, c.view()));
  int error = 0;
  auto const st = kvc::pack_into(kvc::Cpu{}, c.view(), bp.plan, {}, store, {ws.data(), ws.size()}, &error);
  CHECK(st.code() == kvc::Errc::non_finite);
  CHECK(error == 1);
  CHECK((descs[0].tokens == 0 && descs[1].tokens == 0 && descs[0].positions == 0));
  // A store sized for fewer tokens than a head keeps: out_of_capacity, every head empty (the first head fits).
  c.v[static_cast<std::size_t>(4 * 8 + 5)] = 1.0f;
  std::vector<std::int8_t> vb(8, 4);
  vb[3] = 0;  // sequence 0 keeps 3 of its 4 tokens, sequence 1 all 4
  OwnedBitPlan const three(2, 1, 4, 8, vb, std::vector<std::int8_t>(16, 4));
  store.tokens = 3;
  descs[0].tokens = descs[1].tokens = -1;
  CHECK(kvc::pack_into(kvc::Cpu{}, c.view(), three.plan, {}, store, {ws.data(), ws.size()}).code() ==
        kvc::Errc::out_of_capacity);
  CHECK((descs[0].tokens == 0 && descs[1].tokens == 0));
  REQUIRE(store.arena_bytes() <= sizeof(arena));
  store.tokens = 4;
  REQUIRE(kvc::pack_into(kvc::Cpu{}, c.view(), three.plan, {}, store, {ws.data(), ws.size()}).ok());
  CHECK((descs[0].tokens == 3 && descs[1].tokens == 4));
  // Shape, alignment and workspace errors.
  store.tokens = -1;
  CHECK(kvc::pack_into(kvc::Cpu{}, c.view(), bp.plan, {}, store, {ws.data(), ws.size()}).code() ==
        kvc::Errc::invalid_argument);
  store.tokens = 4;
  store.arena = arena + 8;
  CHECK(std::strstr(kvc::pack_into(kvc::Cpu{}, c.view(), bp.plan, {}, store, {ws.data(), ws.size()}).message(),
                    "aligned") != nullptr);
  store.arena = arena;
  CHECK(kvc::pack_into(kvc::Cpu{}, c.view(), bp.plan, {}, store, {ws.data(), ws.size() - 1}).code() ==
        kvc::Errc::out_of_capacity);
  CHECK(kvc::pack_into(kvc::Cpu{}, c.view(), bp.plan, {}, store, {c.k.data(), ws.size()}).code() ==
        kvc::Errc::invalid_argument);
}
