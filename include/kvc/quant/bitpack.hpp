// SPDX-License-Identifier: Apache-2.0
// kvc/quant/bitpack.hpp: packing of 2-, 4- and 8-bit codes into bytes in the RDKV split layouts (the authors'
// obkv_accel/bitpack.py, github.com/Junkai1860/RDKV @287a4a5). Host and device, no allocation.
//
// A run of n codes (n padded to a multiple of 8 / bits) is split into 8 / bits equal segments and byte i holds code
// i of every segment, the first segment in the low bits:
//   8-bit: byte[i] = c[i]                                                         (n bytes)
//   4-bit: byte[i] = c[i] | c[i + n/2] << 4                                       (n/2 bytes, "half split")
//   2-bit: byte[i] = c[i] | c[i + n/4] << 2 | c[i + n/2] << 4 | c[i + 3n/4] << 6   (n/4 bytes, "quarter split")
// so a kernel reading byte i gets codes i, i + n/k, ... whose positions differ by a constant stride: contiguous
// lanes read contiguous bytes.
//
// Precondition of pack_codes/unpack_codes/code_at: packable(n, bits) (bits in {2, 4, 8}, n >= 0 a multiple of
// 8 / bits; pad with padded_count and zero codes). It is asserted (host and device, when NDEBUG is not defined);
// host code that takes n or bits from input checks check_packable() first.
#pragma once

#include <kvc/config.hpp>
#include <kvc/core/extents.hpp>
#include <kvc/core/status.hpp>

#include <cassert>
#include <cstdint>

namespace kvc {

/// Codes per byte at `bits` bits: 8 / bits for bits in {2, 4, 8}, 1 otherwise (16-bit raw values, 0 = nothing).
KVC_HOST_DEVICE constexpr Index codes_per_byte(int bits) noexcept {
  return bits == 2 ? 4 : (bits == 4 ? 2 : 1);
}

/// n rounded up to a multiple of 8 / bits (4 at 2 bits, 2 at 4 bits; n itself at 8 or 16 bits). n >= 0.
KVC_HOST_DEVICE constexpr Index padded_count(Index n, int bits) noexcept {
  Index const k = codes_per_byte(bits);
  return (n + k - 1) / k * k;
}

/// Bytes of n codes at b bits: b = 8: n; 4: n/2; 2: n/4 (n padded: a multiple of 8/b). Rounds up for an unpadded
/// n (the bytes its padded count needs). b = 16 gives 2n (raw FP16), b = 0 gives 0.
KVC_HOST_DEVICE constexpr Index packed_bytes(Index n, int bits) noexcept {
  return (n * bits + 7) / 8;
}

/// True when n codes at `bits` bits can be packed: bits in {2, 4, 8} and n >= 0 a multiple of 8 / bits.
KVC_HOST_DEVICE constexpr bool packable(Index n, int bits) noexcept {
  return (bits == 2 || bits == 4 || bits == 8) && n >= 0 && n % codes_per_byte(bits) == 0;
}

/// Host check of the packing precondition, naming the argument.
constexpr Status check_packable(Index n, int bits) noexcept {
  if (bits != 2 && bits != 4 && bits != 8)
    return {Errc::invalid_argument, "kvc::pack_codes: bits must be 2, 4 or 8"};
  if (n < 0 || n % codes_per_byte(bits) != 0)
    return {Errc::invalid_argument, "kvc::pack_codes: n must be a non-negative multiple of 8 / bits (padded_count)"};
  return {};
}

/// Packs codes[0, n) (each < 2^bits; higher bits are masked off) into packed_bytes(n, bits) bytes of `out`.
KVC_HOST_DEVICE inline void pack_codes(std::uint8_t const* codes, Index n, int bits, std::uint8_t* out) noexcept {
  assert(packable(n, bits));
  if (bits == 8) {
    for (Index i = 0; i < n; ++i)
      out[i] = codes[i];
  } else if (bits == 4) {
    Index const h = n / 2;
    for (Index i = 0; i < h; ++i)
      out[i] = static_cast<std::uint8_t>((codes[i] & 0xfu) | (codes[i + h] & 0xfu) << 4);
  } else if (bits == 2) {
    Index const q = n / 4;
    for (Index i = 0; i < q; ++i)
      out[i] = static_cast<std::uint8_t>((codes[i] & 3u) | (codes[i + q] & 3u) << 2 | (codes[i + 2 * q] & 3u) << 4 |
                                         (codes[i + 3 * q] & 3u) << 6);
  }
}

/// Inverse of pack_codes: writes codes[0, n) from packed_bytes(n, bits) bytes of `in`.
KVC_HOST_DEVICE inline void unpack_codes(std::uint8_t const* in, Index n, int bits, std::uint8_t* codes) noexcept {
  assert(packable(n, bits));
  if (bits == 8) {
    for (Index i = 0; i < n; ++i)
      codes[i] = in[i];
  } else if (bits == 4) {
    Index const h = n / 2;
    for (Index i = 0; i < h; ++i) {
      codes[i] = static_cast<std::uint8_t>(in[i] & 0xfu);
      codes[i + h] = static_cast<std::uint8_t>(in[i] >> 4);
    }
  } else if (bits == 2) {
    Index const q = n / 4;
    for (Index i = 0; i < q; ++i) {
      codes[i] = static_cast<std::uint8_t>(in[i] & 3u);
      codes[i + q] = static_cast<std::uint8_t>((in[i] >> 2) & 3u);
      codes[i + 2 * q] = static_cast<std::uint8_t>((in[i] >> 4) & 3u);
      codes[i + 3 * q] = static_cast<std::uint8_t>(in[i] >> 6);
    }
  }
}

/// Code i (0 <= i < n) of n packed codes, without unpacking the rest. Segment found by comparisons (no division:
/// this sits in fused kernels' inner loops).
KVC_HOST_DEVICE inline std::uint8_t code_at(std::uint8_t const* in, Index n, int bits, Index i) noexcept {
  assert(packable(n, bits) && i >= 0 && i < n);
  if (bits == 4) {
    Index const h = n / 2;
    return i < h ? static_cast<std::uint8_t>(in[i] & 0xfu) : static_cast<std::uint8_t>(in[i - h] >> 4);
  }
  if (bits == 2) {
    Index const q = n / 4;
    Index const seg = (i >= q ? 1 : 0) + (i >= 2 * q ? 1 : 0) + (i >= 3 * q ? 1 : 0);
    return static_cast<std::uint8_t>((in[i - seg * q] >> (2 * seg)) & 3u);
  }
  return in[i];
}

}  // namespace kvc
