// SPDX-License-Identifier: Apache-2.0
// kvc/store/packed.hpp: the packed mixed-precision store of RDKV and KIVI (RDKV's TriZone zones A + B, its Fig. 3):
// its byte layout and the non-owning view that attention kernels read. Host and device (no Eigen, no std::vector);
// the owning host object is kvc::PackedKV in <kvc/store/packed_kv.hpp>, the builder kvc::pack in
// <kvc/pipeline/pack.hpp>.
//
// One arena of bytes per layer and one PackedHead descriptor per (sequence, KV head). Every offset is in bytes from
// the arena start and 16-byte aligned. A head stores its kept tokens (V bits > 0) in *packed order*: V segments by
// bit width 2 | 4 | 8 | 16 (16 = zone B, raw FP16), stable by slot within a segment. K channels with bits > 0 go into
// segments 2 | 4 | 8 | 16, stable by channel; each quantised segment's count is padded to a multiple of 8 / b with
// zero columns (params scale = offset = 0, codes 0: they dequantise to exactly 0), and k_perm[i] is the original
// channel of packed channel i (-1 for a pad). Pruned channels (bits 0) are not stored, so a kernel permutes (and
// prunes) the query by k_perm once and never touches them.
//
//   K of a quantised segment s (bits b = 2, 4, 8): per channel, per group of `k_group` consecutive tokens of the
//     packed order (0: all kept tokens) -> params [k_groups][k_count[s]]; codes token-major
//     [tokens][packed_bytes(k_count[s], b)], each token's row in the split layout of quant/bitpack.hpp over the
//     segment's channels (2 bits: byte i = channels i, i + n/4, i + n/2, i + 3n/4 of the segment).
//   K at 16 bits: raw FP16 [tokens][k_count[3]] (lossless; reference=authors clamps 16 to 8, so never has it).
//   V of a quantised segment: per token, per group of `v_group` channels (0: all) -> params [v_count[s]][v_groups];
//     codes [v_count[s]][packed_bytes(padded_count(value_dim, b), b)] (pad channels code 0, not part of any output).
//   V at 16 bits: raw FP16 [v_count[3]][value_dim].
//   positions: Index [tokens], absolute positions in packed order (not ascending across segments).
//
// Memory (PackedHead::payload_bits / overhead_bits): payload = what the bit plan allocated, with the stored widths
// (Σ over kept tokens of value_dim · v_bits + Σ over kept channels of tokens · k_bits; a clamped K channel counts 8);
// overhead = params (2 FP16 = 32 bits per group, pads' params included) + pad codes + the permutation (16 bits per
// packed channel, pads included: an engine stores it as int16). Positions are not counted: an engine keeps a position
// per token for any policy (full cache included). Alignment padding of the arena is not counted either (arena_bytes
// of PackedKV is the real allocation).
//
// Two owners of that layout: kvc::PackedKV (store/packed_kv.hpp, host, an arena of exactly the bytes a plan needs,
// built by kvc::pack) and kvc::PackedStore (below: caller memory of either space, a fixed region per head bounded by
// packed_head_bytes_bound(), built by kvc::pack_into; what kvc::LayerCompressor keeps in its state).
#pragma once

#include <kvc/core/backend.hpp>
#include <kvc/core/element.hpp>
#include <kvc/core/extents.hpp>
#include <kvc/core/status.hpp>
#include <kvc/quant/bitpack.hpp>
#include <kvc/quant/minmax.hpp>

#include <cstddef>
#include <cstdint>

namespace kvc {

/// Segments of a head, in packed order, and their bit widths: 0 -> 2, 1 -> 4, 2 -> 8, 3 -> 16 (raw FP16).
inline constexpr int packed_segments = 4;
KVC_HOST_DEVICE constexpr int segment_bits(int segment) noexcept {
  return segment == 0 ? 2 : (segment == 1 ? 4 : (segment == 2 ? 8 : 16));
}
/// Segment of a bit width in {2, 4, 8, 16} (-1 otherwise, 0 bits included: not stored).
KVC_HOST_DEVICE constexpr int bits_segment(int bits) noexcept {
  return bits == 2 ? 0 : (bits == 4 ? 1 : (bits == 8 ? 2 : (bits == 16 ? 3 : -1)));
}

/// Quantiser settings shared by every head of a packed layer. Group sizes: 0 = the whole axis.
struct PackedQuant {
  ZeroPoint zero_point = ZeroPoint::float_min;
  Index v_group = 0;  ///< V channels per params group (per token)
  Index k_group = 0;  ///< packed-order tokens per params group (per channel)
};

/// Descriptor of one (sequence, KV head). Offsets are bytes from the arena start (16-byte aligned); an empty array
/// has offset 0 and must not be read.
struct PackedHead {
  Index tokens = 0;                     ///< T_eff: kept tokens (zones A + B)
  Index v_count[packed_segments] = {};  ///< tokens per V segment, bits 2, 4, 8, 16 (sum = tokens)
  Index k_count[packed_segments] = {};  ///< padded channels per K segment, bits 2, 4, 8, 16 (0 when tokens = 0)
  Index k_groups = 0;                   ///< token groups of K params: ceil(tokens / k_group), 1 for k_group = 0
                                        ///< (0 when tokens = 0)
  Index end_position = 0;               ///< 1 + the largest stored position (0 when empty): the context end
  std::uint64_t positions = 0;          ///< Index [tokens], packed order
  std::uint64_t k_perm = 0;             ///< std::int32_t [Σ k_count]: original channel, -1 for a pad
  std::uint64_t k_codes[3] = {};        ///< per segment 2/4/8: uint8 [tokens][packed_bytes(k_count[s], b)]
  std::uint64_t k_params[3] = {};       ///< per segment 2/4/8: QuantParams [k_groups][k_count[s]]
  std::uint64_t k_raw = 0;              ///< half [tokens][k_count[3]]
  std::uint64_t v_codes[3] = {};        ///< per segment 2/4/8: uint8 [v_count[s]][v_row_bytes(s)]
  std::uint64_t v_params[3] = {};       ///< per segment 2/4/8: QuantParams [v_count[s]][v_groups]
  std::uint64_t v_raw = 0;              ///< half [v_count[3]][value_dim]
  std::int64_t payload_bits = 0;        ///< codes and raw values at their stored widths, pads excluded
  std::int64_t overhead_bits = 0;       ///< params (32 bits a group), pad codes, permutation (16 bits a channel)

  /// First packed token of V segment s (the segments are consecutive in packed order).
  KVC_HOST_DEVICE constexpr Index v_begin(int s) const noexcept {
    Index t = 0;
    for (int i = 0; i < s; ++i)
      t += v_count[i];
    return t;
  }
  /// First packed channel of K segment s.
  KVC_HOST_DEVICE constexpr Index k_begin(int s) const noexcept {
    Index c = 0;
    for (int i = 0; i < s; ++i)
      c += k_count[i];
    return c;
  }
  /// Packed K channels (pads included).
  KVC_HOST_DEVICE constexpr Index k_channels() const noexcept { return k_begin(packed_segments); }
};

/// A packed layer as kernels read it: non-owning, in memory space `Space` (arena and descriptors both there).
/// `dim` is d_k (the queries' and k_perm's channel space), `value_dim` d_v; `max_tokens` bounds every head's T_eff
/// (what a descriptor may claim: the CPU kernel checks the host descriptors against it).
template <class Space = HostSpace>
struct PackedKVView {
  using memory_space = Space;

  std::byte const* arena = nullptr;
  PackedHead const* heads = nullptr;  ///< [batch, kv_heads]
  Index batch = 0;
  Index kv_heads = 0;
  Index dim = 0;
  Index value_dim = 0;
  Index max_tokens = 0;
  PackedQuant quant{};

  KVC_HOST_DEVICE constexpr PackedHead const& head(Index b, Index h) const noexcept { return heads[b * kv_heads + h]; }
  template <class T>
  KVC_HOST_DEVICE T const* at(std::uint64_t offset) const noexcept {
    return reinterpret_cast<T const*>(arena + offset);
  }
  /// V params groups per token: ceil(value_dim / v_group), 1 for v_group = 0.
  KVC_HOST_DEVICE constexpr Index v_groups() const noexcept {
    return quant.v_group > 0 ? (value_dim + quant.v_group - 1) / quant.v_group : 1;
  }
  /// Channels of a V code row at segment s's bits (value_dim padded to a multiple of 8 / b).
  KVC_HOST_DEVICE constexpr Index v_padded(int s) const noexcept { return padded_count(value_dim, segment_bits(s)); }
  /// Bytes of one V code row of segment s (s < 3).
  KVC_HOST_DEVICE constexpr Index v_row_bytes(int s) const noexcept {
    return packed_bytes(v_padded(s), segment_bits(s));
  }
  /// An upper bound of any head's packed K channels: d_k plus the pads of the 2- and 4-bit segments.
  KVC_HOST_DEVICE constexpr Index max_k_channels() const noexcept { return dim + 4; }
  /// Sequence b's context end: 1 + its largest stored position over its heads (0 when all are empty). Queries without
  /// positions sit just before it, as kvc::context_end places them for a cache.
  KVC_HOST_DEVICE constexpr Index context_end(Index b) const noexcept {
    Index end = 0;
    for (Index h = 0; h < kv_heads; ++h)
      end = head(b, h).end_position > end ? head(b, h).end_position : end;
    return end;
  }
};

namespace detail {
/// Bytes of a packed array rounded up to the arena's 16-byte alignment.
KVC_HOST_DEVICE constexpr std::uint64_t packed_round(std::uint64_t bytes) noexcept {
  return (bytes + 15) / 16 * 16;
}
/// V params groups per token and bytes of a V code row at segment s's bits (s < 3), for d_v channels.
KVC_HOST_DEVICE constexpr Index packed_v_groups(Index value_dim, PackedQuant const& q) noexcept {
  return q.v_group > 0 ? (value_dim + q.v_group - 1) / q.v_group : 1;
}
KVC_HOST_DEVICE constexpr Index packed_v_row_bytes(Index value_dim, int s) noexcept {
  return packed_bytes(padded_count(value_dim, segment_bits(s)), segment_bits(s));
}
}  // namespace detail

/// Lays head `d` out in an arena from byte `base` (16-byte aligned): from its counts (d.tokens, v_count, k_count,
/// k_groups) and `k_kept` (channels of each K segment without their pads) it sets every offset (in the order
/// positions, k_perm, per segment 2/4/8 K codes, K params, V codes, V params, then K raw, V raw; an empty array gets
/// offset 0), payload_bits and overhead_bits (the accounting of the file comment), and returns the end of the head's
/// bytes (16-byte aligned). The one layout both backends' packers write and every reader assumes. Host and device.
KVC_HOST_DEVICE inline std::uint64_t layout_packed_head(PackedHead& d, Index const (&k_kept)[packed_segments],
                                                        std::uint64_t base, Index value_dim,
                                                        PackedQuant const& quant) noexcept {
  auto const u = [](Index x) { return static_cast<std::uint64_t>(x); };
  auto take = [&base](std::uint64_t bytes) {
    std::uint64_t const at = bytes > 0 ? base : 0;
    base += detail::packed_round(bytes);
    return at;
  };
  Index const tn = d.tokens, v_groups = detail::packed_v_groups(value_dim, quant);
  d.positions = take(u(tn) * sizeof(Index));
  d.k_perm = take(u(d.k_channels()) * sizeof(std::int32_t));
  for (int s = 0; s < 3; ++s) {
    int const bits = segment_bits(s);
    d.k_codes[s] = take(u(tn) * u(packed_bytes(d.k_count[s], bits)));
    d.k_params[s] = take(u(d.k_groups) * u(d.k_count[s]) * sizeof(QuantParams));
    d.v_codes[s] = take(u(d.v_count[s]) * u(detail::packed_v_row_bytes(value_dim, s)));
    d.v_params[s] = take(u(d.v_count[s]) * u(v_groups) * sizeof(QuantParams));
  }
  d.k_raw = take(u(tn) * u(d.k_count[3]) * sizeof(half));
  d.v_raw = take(u(d.v_count[3]) * u(value_dim) * sizeof(half));
  // Memory: payload at the stored widths; params, pad codes and the permutation apart (file comment).
  std::int64_t payload = 0, overhead = 0;
  for (int s = 0; s < packed_segments; ++s) {
    std::int64_t const bits = segment_bits(s);
    payload += d.v_count[s] * value_dim * bits + k_kept[s] * tn * bits;
    overhead += 16 * d.k_count[s];
    if (s < 3) {
      overhead += 32 * (d.k_groups * d.k_count[s] + d.v_count[s] * v_groups);
      overhead += (d.k_count[s] - k_kept[s]) * tn * bits +
                  d.v_count[s] * (padded_count(value_dim, segment_bits(s)) - value_dim) * bits;
    }
  }
  d.payload_bits = payload;
  d.overhead_bits = overhead;
  return base;
}

/// An upper bound of the bytes layout_packed_head() gives any head of at most `tokens` kept tokens, whatever its bit
/// plan: the layout is linear in the per-segment counts (plus at most 3 + 1 pad channels and 15 bytes of alignment
/// per array), so its maximum over plans is at most every token at the widest V segment per token and every channel
/// at the widest K segment per channel, plus the pads' and the alignment's worst case. What a caller-memory packed
/// store reserves per head (kvc::PackedStore).
KVC_HOST_DEVICE constexpr std::uint64_t packed_head_bytes_bound(Index tokens, Index dim, Index value_dim,
                                                                PackedQuant const& quant) noexcept {
  auto const u = [](Index x) { return static_cast<std::uint64_t>(x < 0 ? 0 : x); };
  std::uint64_t const n = u(tokens), groups = quant.k_group > 0 ? (n + u(quant.k_group) - 1) / u(quant.k_group) : 1;
  std::uint64_t v_token = u(value_dim) * 2, k_channel = n * 2 + 4;  // 16 bits: raw FP16 (+ the permutation's entry)
  std::uint64_t pads = 0;
  for (int s = 0; s < 3; ++s) {
    std::uint64_t const v = u(detail::packed_v_row_bytes(value_dim, s)) +
                            u(detail::packed_v_groups(value_dim, quant)) * sizeof(QuantParams);
    std::uint64_t const k = (n * u(segment_bits(s)) + 7) / 8 + groups * sizeof(QuantParams) + 4;
    v_token = v > v_token ? v : v_token;
    k_channel = k > k_channel ? k : k_channel;
    pads += u(codes_per_byte(segment_bits(s)) - 1) * k;
  }
  return n * sizeof(Index) + n * v_token + u(dim) * k_channel + pads + 16 * 16;
}

/// A packed layer in caller memory, written by kvc::pack_into: `heads` [batch, kv_heads] descriptors and an arena
/// of batch * kv_heads regions of region_bytes() (head (b, h) in region b * kv_heads + h), sized for `tokens` kept
/// tokens per head at most (the cache's slots, or fewer: the longest prompt an engine packs). Nothing is allocated: an
/// engine reserves arena_bytes() and batch * kv_heads descriptors once (kvc::LayerCompressor puts both in its state).
/// Host and device.
template <class Space = HostSpace>
struct PackedStore {
  using memory_space = Space;

  std::byte* arena = nullptr;   ///< arena_bytes(), 16-byte aligned
  PackedHead* heads = nullptr;  ///< [batch, kv_heads]
  Index batch = 0;
  Index kv_heads = 0;
  Index dim = 0;
  Index value_dim = 0;
  Index tokens = 0;  ///< the most kept tokens of a head (the view's max_tokens)
  PackedQuant quant{};

  KVC_HOST_DEVICE constexpr std::uint64_t region_bytes() const noexcept {
    return detail::packed_round(packed_head_bytes_bound(tokens, dim, value_dim, quant));
  }
  KVC_HOST_DEVICE constexpr std::uint64_t arena_bytes() const noexcept {
    return region_bytes() * static_cast<std::uint64_t>(batch * kv_heads);
  }
  /// The view attention reads (max_tokens = tokens: sizes come from the bound, not from the descriptors).
  KVC_HOST_DEVICE constexpr PackedKVView<Space> view() const noexcept {
    return {arena, heads, batch, kv_heads, dim, value_dim, tokens, quant};
  }
};

/// Host check of a view's fields (not of the descriptors' contents, which kvc::pack writes): shapes >= 0, group
/// sizes >= 0, non-null tables for a non-empty layer.
template <class Space>
constexpr Status check_packed_view(PackedKVView<Space> const& kv, char const* what) noexcept {
  if (kv.batch < 0 || kv.kv_heads < 0 || kv.dim < 0 || kv.value_dim < 0 || kv.max_tokens < 0 || kv.quant.v_group < 0 ||
      kv.quant.k_group < 0 ||
      (kv.batch * kv.kv_heads > 0 && (kv.heads == nullptr || (kv.max_tokens > 0 && kv.arena == nullptr))))
    return {Errc::invalid_argument, what};
  return {};
}

/// Dequantises head (b, h) of a host view: keys_out [tokens, dim] in the ORIGINAL channel order (pruned channels 0),
/// values_out [tokens, value_dim], positions_out [tokens], all in packed order (any may be null). The oracle of the
/// fused kernels (they must equal kvc::attend over these) and the input of tools that compare with
/// dequantised tensors. Codes go through kvc::dequantize, raw values through the FP16 widening. Host only.
inline void dequantized(PackedKVView<HostSpace> const& kv, Index b, Index h, float* keys_out, float* values_out,
                        Index* positions_out) noexcept {
  PackedHead const& hd = kv.head(b, h);
  Index const n = hd.tokens, dk = kv.dim, dv = kv.value_dim;
  ZeroPoint const zp = kv.quant.zero_point;
  if (positions_out) {
    Index const* pos = kv.at<Index>(hd.positions);
    for (Index t = 0; t < n; ++t)
      positions_out[t] = pos[t];
  }
  if (keys_out) {
    for (Index i = 0; i < n * dk; ++i)
      keys_out[i] = 0.0f;
    std::int32_t const* perm = kv.at<std::int32_t>(hd.k_perm);
    Index const kg = kv.quant.k_group > 0 ? kv.quant.k_group : (n > 0 ? n : 1);
    for (int s = 0; s < packed_segments; ++s) {
      Index const cnt = hd.k_count[s], c0 = hd.k_begin(s);
      int const bits = segment_bits(s);
      for (Index t = 0; t < n; ++t)
        for (Index i = 0; i < cnt; ++i) {
          std::int32_t const c = perm[c0 + i];
          if (c < 0)
            continue;
          float x;
          if (s == 3) {
            x = to_float(kv.at<half>(hd.k_raw)[t * cnt + i]);
          } else {
            std::uint8_t const* row = kv.at<std::uint8_t>(hd.k_codes[s]) + t * packed_bytes(cnt, bits);
            QuantParams const p = kv.at<QuantParams>(hd.k_params[s])[(t / kg) * cnt + i];
            x = dequantize(code_at(row, cnt, bits, i), p, zp);
          }
          keys_out[t * dk + c] = x;
        }
    }
  }
  if (values_out) {
    Index const groups = kv.v_groups(), vg = kv.quant.v_group > 0 ? kv.quant.v_group : (dv > 0 ? dv : 1);
    for (int s = 0; s < packed_segments; ++s) {
      Index const t0 = hd.v_begin(s);
      for (Index j = 0; j < hd.v_count[s]; ++j) {
        float* dst = values_out + (t0 + j) * dv;
        if (s == 3) {
          half const* src = kv.at<half>(hd.v_raw) + j * dv;
          for (Index c = 0; c < dv; ++c)
            dst[c] = to_float(src[c]);
          continue;
        }
        int const bits = segment_bits(s);
        std::uint8_t const* row = kv.at<std::uint8_t>(hd.v_codes[s]) + j * kv.v_row_bytes(s);
        QuantParams const* p = kv.at<QuantParams>(hd.v_params[s]) + j * groups;
        for (Index c = 0; c < dv; ++c)
          dst[c] = dequantize(code_at(row, kv.v_padded(s), bits, c), p[c / vg], zp);
      }
    }
  }
}

}  // namespace kvc
