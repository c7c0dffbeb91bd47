// SPDX-License-Identifier: Apache-2.0
// tests/quant/bitpack_test.cpp mirrors include/kvc/quant/bitpack.hpp: the 8-bit, 4-bit half-split and 2-bit
// quarter-split byte layouts of spec rdkv §2.7 (obkv_accel/bitpack.py), padding (§8 Q5) and lossless round trips.
// Byte values are worked out by hand in the comments; the random cases use an independent bit-level restatement.
#include <kvc/quant/bitpack.hpp>
#include <kvc/quant/minmax.hpp>

#include "support/catch.hpp"

#include <cstdint>
#include <random>
#include <vector>

namespace {

using kvc::Index;
using Bytes = std::vector<std::uint8_t>;

Bytes pack(Bytes const& codes, int bits) {
  Bytes out(static_cast<std::size_t>(kvc::packed_bytes(static_cast<Index>(codes.size()), bits)));
  kvc::pack_codes(codes.data(), static_cast<Index>(codes.size()), bits, out.data());
  return out;
}

Bytes unpack(Bytes const& bytes, Index n, int bits) {
  Bytes codes(static_cast<std::size_t>(n));
  kvc::unpack_codes(bytes.data(), n, bits, codes.data());
  return codes;
}

/// Restatement of the split layout: with k = 8 / bits segments of length n / k, code i goes to byte i mod (n / k),
/// bit position bits * (i div (n / k)).
Bytes restated_pack(Bytes const& codes, int bits) {
  std::size_t const n = codes.size();
  std::size_t const k = static_cast<std::size_t>(8 / bits);
  std::size_t const seg = n / k;
  Bytes out(seg, 0);
  for (std::size_t i = 0; i < n; ++i)
    for (int bit = 0; bit < bits; ++bit)
      if ((codes[i] >> bit) & 1)
        out[i % seg] = static_cast<std::uint8_t>(
            out[i % seg] | 1u << (static_cast<std::size_t>(bits) * (i / seg) + static_cast<std::size_t>(bit)));
  return out;
}

}  // namespace

TEST_CASE("packed_bytes and padded_count") {
  CHECK(kvc::packed_bytes(128, 8) == 128);
  CHECK(kvc::packed_bytes(128, 4) == 64);
  CHECK(kvc::packed_bytes(128, 2) == 32);
  CHECK(kvc::packed_bytes(0, 2) == 0);
  CHECK(kvc::packed_bytes(6, 2) == 2);  // an unpadded count gets the bytes of its padded count (8 codes)
  CHECK(kvc::packed_bytes(5, 4) == 3);
  CHECK(kvc::packed_bytes(3, 16) == 6);  // raw FP16
  CHECK(kvc::padded_count(0, 2) == 0);
  CHECK(kvc::padded_count(1, 2) == 4);
  CHECK(kvc::padded_count(4, 2) == 4);
  CHECK(kvc::padded_count(5, 2) == 8);
  CHECK(kvc::padded_count(127, 2) == 128);
  CHECK(kvc::padded_count(5, 4) == 6);
  CHECK(kvc::padded_count(6, 4) == 6);
  CHECK(kvc::padded_count(5, 8) == 5);
  CHECK(kvc::padded_count(5, 16) == 5);
  static_assert(kvc::packed_bytes(kvc::padded_count(13, 2), 2) == 4);
  CHECK(kvc::packable(8, 2));
  CHECK(kvc::packable(0, 4));
  CHECK(kvc::packable(7, 8));
  CHECK_FALSE(kvc::packable(6, 2));
  CHECK_FALSE(kvc::packable(3, 4));
  CHECK_FALSE(kvc::packable(8, 16));
  CHECK_FALSE(kvc::packable(8, 3));
  CHECK_FALSE(kvc::packable(-4, 2));
  CHECK(kvc::check_packable(8, 4).ok());
  CHECK(kvc::check_packable(6, 2).code() == kvc::Errc::invalid_argument);
  CHECK(kvc::check_packable(8, 0).code() == kvc::Errc::invalid_argument);
}

TEST_CASE("pack layouts on hand examples") {
  // 8 bits: bytes are the codes.
  CHECK(pack({0, 200, 255, 7}, 8) == Bytes{0, 200, 255, 7});
  // 4 bits, codes 0..7 (n = 8, half = 4): byte i = c[i] | c[i + 4] << 4 = 0x40, 0x51, 0x62, 0x73.
  CHECK(pack({0, 1, 2, 3, 4, 5, 6, 7}, 4) == Bytes{0x40, 0x51, 0x62, 0x73});
  // 4 bits, n = 4: {15, 0, 9, 10}: byte 0 = 15 | 9 << 4 = 0x9f, byte 1 = 0 | 10 << 4 = 0xa0.
  CHECK(pack({15, 0, 9, 10}, 4) == Bytes{0x9f, 0xa0});
  // 2 bits, {0, 1, 2, 3, 3, 2, 1, 0} (n = 8, quarter = 2): byte 0 = c0 | c2 << 2 | c4 << 4 | c6 << 6
  // = 0 | 8 | 48 | 64 = 0x78; byte 1 = c1 | c3 << 2 | c5 << 4 | c7 << 6 = 1 | 12 | 32 | 0 = 0x2d.
  CHECK(pack({0, 1, 2, 3, 3, 2, 1, 0}, 2) == Bytes{0x78, 0x2d});
  // 2 bits, n = 4: one byte {3, 0, 1, 2} -> 3 | 0 | 1 << 4 | 2 << 6 = 0x93.
  CHECK(pack({3, 0, 1, 2}, 2) == Bytes{0x93});
  // Bits above the width are masked off: 0x1f at 4 bits packs as 0xf.
  CHECK(pack({0x1f, 0x10}, 4) == Bytes{0x0f});
  // Unpacking the hand bytes gives the codes back.
  CHECK(unpack({0x78, 0x2d}, 8, 2) == Bytes{0, 1, 2, 3, 3, 2, 1, 0});
  CHECK(unpack({0x40, 0x51, 0x62, 0x73}, 8, 4) == Bytes{0, 1, 2, 3, 4, 5, 6, 7});
  CHECK(kvc::code_at(Bytes{0x78, 0x2d}.data(), 8, 2, 4) == 3);
  CHECK(kvc::code_at(Bytes{0x40, 0x51, 0x62, 0x73}.data(), 8, 4, 6) == 6);
}

TEST_CASE("Q5 pack and unpack round trips for 2, 4 and 8 bits") {
  std::mt19937 rng(17);
  for (int bits : {2, 4, 8}) {
    Index const k = 8 / bits;
    for (Index n = 0; n <= 160; n += k) {
      Bytes codes(static_cast<std::size_t>(n));
      for (auto& c : codes)
        c = static_cast<std::uint8_t>(rng() & ((1u << bits) - 1u));
      // Output exactly packed_bytes long: a sentinel after it stays untouched.
      Bytes out(static_cast<std::size_t>(kvc::packed_bytes(n, bits)) + 1, 0xa5);
      kvc::pack_codes(codes.data(), n, bits, out.data());
      CHECK(out.back() == 0xa5);
      out.pop_back();
      CHECK(out == restated_pack(codes, bits));
      CHECK(unpack(out, n, bits) == codes);
      for (Index i = 0; i < n; ++i)
        REQUIRE(kvc::code_at(out.data(), n, bits, i) == codes[static_cast<std::size_t>(i)]);
    }
  }
}

TEST_CASE("Q5 padding a row with zero codes and reading it back") {
  // 13 channels at 2 bits pad to 16 (4 bytes), at 4 bits to 14 (7 bytes); pads read back as code 0.
  for (int bits : {2, 4}) {
    Index const n = 13;
    Index const padded = kvc::padded_count(n, bits);
    CHECK(padded == (bits == 2 ? 16 : 14));
    Bytes codes(static_cast<std::size_t>(padded), 0);
    for (Index i = 0; i < n; ++i)
      codes[static_cast<std::size_t>(i)] = static_cast<std::uint8_t>((i * 5 + 1) % (1 << bits));
    Bytes const bytes = pack(codes, bits);
    CHECK(static_cast<Index>(bytes.size()) == (bits == 2 ? 4 : 7));
    Bytes const back = unpack(bytes, padded, bits);
    CHECK(back == codes);
    for (Index i = n; i < padded; ++i)
      CHECK(kvc::code_at(bytes.data(), padded, bits, i) == 0);
  }
}

TEST_CASE("quantise, pack and dequantise one V row in place of codes") {
  // A V row of 128 channels at 2/4/8 bits: reading code_at from the packed bytes and dequantising gives the same
  // values as dequantising the unpacked codes.
  std::mt19937 rng(1);
  std::normal_distribution<float> gauss(0.0f, 1.0f);
  std::vector<float> row(128);
  for (float& v : row)
    v = gauss(rng);
  for (int bits : {2, 4, 8})
    for (kvc::ZeroPoint zp : {kvc::ZeroPoint::float_min, kvc::ZeroPoint::integer}) {
      kvc::QuantParams const p = kvc::minmax_params(row.data(), 128, 1, bits, zp);
      Bytes codes(128);
      for (std::size_t i = 0; i < 128; ++i)
        codes[i] = kvc::quantize(row[i], p, bits, zp);
      Bytes const bytes = pack(codes, bits);
      kvc::Affine const a = kvc::affine(p, zp);
      for (Index i = 0; i < 128; ++i) {
        std::uint8_t const c = kvc::code_at(bytes.data(), 128, bits, i);
        CHECK(static_cast<float>(c) * a.a + a.c == kvc::dequantize(codes[static_cast<std::size_t>(i)], p, zp));
      }
    }
}
