// SPDX-License-Identifier: Apache-2.0
// kvc/pipeline/pack.hpp: kvc::pack, the CPU builder of the packed store (spec rdkv §2.7–2.8; layout in
// store/packed.hpp). It allocates (it fills an owning PackedKV), so it belongs after prefill, not in a decode step.
//
// Per (sequence, KV head): kept = valid slots with v_bits > 0, bucketed by bit width into the V segments 2 | 4 | 8 | 16
// (slot order within a segment: a stable sort); K channels with k_bits > 0 bucketed into 2 | 4 | 8 | 16 (channel order
// within a segment), each quantised segment padded with zero channels to a multiple of 8 / b. K params per channel
// per group of `k_group` tokens of the packed order (0: all kept tokens; a uniform plan, KIVI's, keeps the slot
// order, so these are KIVI's token groups); V params per token per group of `v_group` channels (0: all). Values at
// 16 bits are stored as FP16 (exact for an fp16 cache; rounded once for fp32, the cache's precision is not kept).
#pragma once

#include <kvc/core/checks.hpp>
#include <kvc/core/kv_view.hpp>
#include <kvc/core/status.hpp>
#include <kvc/quant/bitpack.hpp>
#include <kvc/quant/minmax.hpp>
#include <kvc/rate_distortion/bit_plan.hpp>
#include <kvc/store/packed.hpp>
#include <kvc/store/packed_kv.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace kvc {

/// Settings of kvc::pack.
struct PackOptions {
  ZeroPoint zero_point = ZeroPoint::float_min;  ///< float_min (KIVI, default) | integer (reference=authors)
  Index v_group = 0;                            ///< V channels per params group, per token (0 = all; KIVI: 32)
  Index k_group = 0;                            ///< packed-order tokens per params group, per channel (0 = all;
                                                ///< KIVI: 32)
  bool clamp_k16_to_8 = false;                  ///< store K channels at 16 bits as 8-bit codes (reference=authors)

  constexpr Status check() const noexcept {
    if (v_group < 0 || k_group < 0)
      return {Errc::invalid_argument, "kvc::PackOptions: `v_group` and `k_group` must be >= 0 (0 = whole axis)"};
    if (zero_point != ZeroPoint::float_min && zero_point != ZeroPoint::integer)
      return {Errc::invalid_argument, "kvc::PackOptions: `zero_point` must be float_min or integer"};
    return {};
  }
};

namespace detail {

inline constexpr std::uint64_t packed_alignment = 16;

constexpr std::uint64_t packed_align(std::uint64_t x) noexcept {
  return (x + packed_alignment - 1) / packed_alignment * packed_alignment;
}

/// Whether x is finite and within FP16's range (every stored value, raw or params, is FP16).
inline bool fits_half(float x) noexcept {
  return std::isfinite(x) && std::fabs(x) <= 65504.0f;
}

/// The packed order of one head, before it is written.
struct PackedHeadPlan {
  std::vector<Index> slots;        ///< kept slots in packed order
  std::vector<std::int32_t> perm;  ///< packed channel -> original channel (-1: pad)
  Index v_count[packed_segments] = {};
  Index k_count[packed_segments] = {};
  Index k_kept[packed_segments] = {};  ///< channels of each K segment without its pads
};

}  // namespace detail

/// Packs the kept tokens of a host cache (any layout and element type; keys post-RoPE as stored) with a bit plan
/// (v_bits [batch, Hkv, tokens], k_bits [batch, Hkv, d_k] with tokens = cache.tokens()) into `out` (rebuilt).
/// Slots with v_bits 0 and slots at or past a head's length are dropped (their plan entries are not read).
/// Errors (invalid_argument unless noted): options; a plan of another shape or with null tables; a bit width
/// outside {0, 2, 4, 8, 16} (valid slots and every channel); lengths out of range; a kept token's K (kept channels)
/// or V that is NaN, Inf or beyond FP16's range (non_finite, naming keys or values). On error `out` is left empty.
template <KVCacheView C>
Status pack(C const& cache, BitPlan<HostSpace> const& plan, PackOptions const& opt, PackedKV& out) {
  static_assert(std::is_same_v<typename C::memory_space, HostSpace>, "kvc::pack: the cache must be in host memory");
  out.reset(0, 0, 0, 0, {}, 0);
  KVC_RETURN_IF_ERROR(opt.check());
  KVExtents const e = cache.keys.extents();
  Index const dk = e.dim, dv = cache.values.extents().dim;
  KVC_RETURN_IF_ERROR(detail::check_cache(cache, KVC_CACHE_MESSAGES("kvc::pack", "the cache")));
  if (plan.batch != e.batch || plan.heads != e.heads || plan.tokens != cache.tokens() || plan.dim != dk)
    return {Errc::invalid_argument, "kvc::pack: the bit plan must be [batch, KV heads, tokens, d_k] of the cache"};
  if (e.batch * e.heads > 0 && ((plan.v_bits == nullptr && plan.tokens > 0) || (plan.k_bits == nullptr && dk > 0)))
    return {Errc::invalid_argument, "kvc::pack: the bit plan's `v_bits` and `k_bits` must be non-null"};
  Index const heads = e.batch * e.heads;
  std::vector<detail::PackedHeadPlan> plans(static_cast<std::size_t>(heads));
  PackedQuant const quant{opt.zero_point, opt.v_group, opt.k_group};
  PackedKVView<HostSpace> shape{nullptr, nullptr, e.batch, e.heads, dk, dv, 0, quant};
  Index const v_groups = shape.v_groups();

  // 1. Packed orders and the arena's size.
  std::uint64_t arena = 0;
  std::vector<PackedHead> descs(static_cast<std::size_t>(heads));
  Index max_tokens = 0;
  for (Index b = 0; b < e.batch; ++b)
    for (Index h = 0; h < e.heads; ++h) {
      Index const n = cache.length(b, h);
      if (n < 0 || n > cache.capacity(b, h))
        return {Errc::invalid_argument, "kvc::pack: every valid length must be in [0, capacity]"};
      auto& hp = plans[static_cast<std::size_t>(b * e.heads + h)];
      PackedHead& d = descs[static_cast<std::size_t>(b * e.heads + h)];
      std::int8_t const* vb = plan.v_row(b, h);
      std::int8_t const* kb = plan.k_row(b, h);
      for (Index t = 0; t < n; ++t)
        if (!valid_bits(vb[t]))
          return {Errc::invalid_argument, "kvc::pack: every v_bits of a valid slot must be 0, 2, 4, 8 or 16"};
      for (Index c = 0; c < dk; ++c)
        if (!valid_bits(kb[c]))
          return {Errc::invalid_argument, "kvc::pack: every k_bits must be 0, 2, 4, 8 or 16"};
      for (int s = 0; s < packed_segments; ++s)
        for (Index t = 0; t < n; ++t)
          if (bits_segment(vb[t]) == s) {
            hp.slots.push_back(t);
            ++hp.v_count[s];
          }
      Index const tn = static_cast<Index>(hp.slots.size());
      if (tn > 0)
        for (int s = 0; s < packed_segments; ++s) {
          for (Index c = 0; c < dk; ++c) {
            int bits = kb[c];
            if (bits == 16 && opt.clamp_k16_to_8)
              bits = 8;
            if (bits_segment(bits) == s) {
              hp.perm.push_back(static_cast<std::int32_t>(c));
              ++hp.k_kept[s];
            }
          }
          hp.k_count[s] = padded_count(hp.k_kept[s], segment_bits(s));
          for (Index p = hp.k_kept[s]; p < hp.k_count[s]; ++p)
            hp.perm.push_back(-1);
        }
      d.tokens = tn;
      max_tokens = tn > max_tokens ? tn : max_tokens;
      d.k_groups = tn == 0 ? 0 : (opt.k_group > 0 ? (tn + opt.k_group - 1) / opt.k_group : 1);
      for (int s = 0; s < packed_segments; ++s) {
        d.v_count[s] = hp.v_count[s];
        d.k_count[s] = hp.k_count[s];
      }
      auto take = [&arena](std::uint64_t bytes) {
        std::uint64_t const at = bytes > 0 ? arena : 0;
        arena = detail::packed_align(arena + bytes);
        return at;
      };
      auto u = [](Index x) { return static_cast<std::uint64_t>(x); };
      d.positions = take(u(tn) * sizeof(Index));
      d.k_perm = take(u(d.k_channels()) * sizeof(std::int32_t));
      for (int s = 0; s < 3; ++s) {
        int const bits = segment_bits(s);
        d.k_codes[s] = take(u(tn) * u(packed_bytes(d.k_count[s], bits)));
        d.k_params[s] = take(u(d.k_groups) * u(d.k_count[s]) * sizeof(QuantParams));
        d.v_codes[s] = take(u(d.v_count[s]) * u(shape.v_row_bytes(s)));
        d.v_params[s] = take(u(d.v_count[s]) * u(v_groups) * sizeof(QuantParams));
      }
      d.k_raw = take(u(tn) * u(d.k_count[3]) * sizeof(half));
      d.v_raw = take(u(d.v_count[3]) * u(dv) * sizeof(half));
      // Memory (store/packed.hpp): payload at the stored widths; params, pad codes and the permutation apart.
      std::int64_t payload = 0, overhead = 0;
      for (int s = 0; s < packed_segments; ++s) {
        std::int64_t const bits = segment_bits(s);
        payload += d.v_count[s] * dv * bits + hp.k_kept[s] * tn * bits;
        overhead += 16 * d.k_count[s];
        if (s < 3) {
          overhead += 32 * (d.k_groups * d.k_count[s] + d.v_count[s] * v_groups);
          overhead += (d.k_count[s] - hp.k_kept[s]) * tn * bits + d.v_count[s] * (shape.v_padded(s) - dv) * bits;
        }
      }
      d.payload_bits = payload;
      d.overhead_bits = overhead;
    }

  // 2. Fill the arena.
  out.reset(e.batch, e.heads, dk, dv, quant, static_cast<std::size_t>(arena));
  std::byte* base = out.arena_mut();
  std::vector<float> rows, row, lo, hi, scale, offset;  // scratch of the fill, reused by every head
  std::vector<std::uint8_t> codes;
  auto fail = [&out](Status st) {
    out.reset(0, 0, 0, 0, {}, 0);
    return st;
  };
  Status const bad_key{Errc::non_finite, "kvc::pack: a kept token's key (kept channel) is NaN, Inf or beyond FP16"};
  Status const bad_value{Errc::non_finite, "kvc::pack: a kept token's value is NaN, Inf or beyond FP16"};
  for (Index b = 0; b < e.batch; ++b)
    for (Index h = 0; h < e.heads; ++h) {
      auto const& hp = plans[static_cast<std::size_t>(b * e.heads + h)];
      PackedHead const& d = descs[static_cast<std::size_t>(b * e.heads + h)];
      out.head_mut(b, h) = d;
      Index const tn = d.tokens;
      if (tn == 0)
        continue;
      auto* pos = reinterpret_cast<Index*>(base + d.positions);
      Index end = 0;
      for (Index t = 0; t < tn; ++t) {
        pos[t] = cache.position(b, h, hp.slots[static_cast<std::size_t>(t)]);
        end = pos[t] + 1 > end ? pos[t] + 1 : end;
      }
      out.head_mut(b, h).end_position = end;
      if (!hp.perm.empty())
        std::memcpy(base + d.k_perm, hp.perm.data(), hp.perm.size() * sizeof(std::int32_t));

      // K: the kept rows are gathered once into `rows` [tn, d_k] fp32 (token-major: the cache is read in its
      // storage order, never a strided column per channel, which cost 128 passes over the head), then per segment
      // and token group the per-channel ranges come from one pass over the group's rows, and the codes are written
      // row by row in the segment's packed-channel order.
      rows.resize(static_cast<std::size_t>(tn * dk));
      for (Index t = 0; t < tn; ++t) {
        auto const* src = cache.keys.row(b, h, hp.slots[static_cast<std::size_t>(t)]);
        float* dst = rows.data() + t * dk;
        for (Index c = 0; c < dk; ++c)
          dst[c] = to_float(src[c]);
        for (std::int32_t const c : hp.perm)  // only what is stored must fit FP16 (pruned channels are never read)
          if (c >= 0 && !detail::fits_half(dst[c]))
            return fail(bad_key);
      }
      Index const kg = opt.k_group > 0 ? opt.k_group : tn;
      for (int s = 0; s < packed_segments; ++s) {
        Index const cnt = d.k_count[s], c0 = d.k_begin(s);
        if (cnt == 0)
          continue;
        std::int32_t const* perm = hp.perm.data() + c0;
        if (s == 3) {
          auto* raw = reinterpret_cast<half*>(base + d.k_raw);
          for (Index t = 0; t < tn; ++t)
            for (Index i = 0; i < cnt; ++i)
              raw[t * cnt + i] = perm[i] < 0 ? half(0.0f) : half(rows[static_cast<std::size_t>(t * dk + perm[i])]);
          continue;
        }
        int const bits = segment_bits(s);
        float const qmax = detail::quant_max_code(bits);
        auto* params = reinterpret_cast<QuantParams*>(base + d.k_params[s]);
        codes.assign(static_cast<std::size_t>(tn * cnt), 0);
        lo.resize(static_cast<std::size_t>(cnt));
        row.resize(static_cast<std::size_t>(cnt));
        hi.resize(static_cast<std::size_t>(cnt));
        scale.resize(static_cast<std::size_t>(cnt));
        offset.resize(static_cast<std::size_t>(cnt));
        for (Index g = 0; g < d.k_groups; ++g) {
          Index const t0 = g * kg, t1 = tn - t0 < kg ? tn : t0 + kg;
          for (Index i = 0; i < cnt; ++i) {
            float const x = perm[i] < 0 ? 0.0f : rows[static_cast<std::size_t>(t0 * dk + perm[i])];
            lo[static_cast<std::size_t>(i)] = hi[static_cast<std::size_t>(i)] = x;
          }
          for (Index t = t0 + 1; t < t1; ++t)
            for (Index i = 0; i < cnt; ++i) {
              if (perm[i] < 0)
                continue;
              float const x = rows[static_cast<std::size_t>(t * dk + perm[i])];
              auto const u = static_cast<std::size_t>(i);
              lo[u] = x < lo[u] ? x : lo[u];
              hi[u] = x > hi[u] ? x : hi[u];
            }
          for (Index i = 0; i < cnt; ++i) {
            auto const u = static_cast<std::size_t>(i);
            // pad: zero params (reset zeroed the arena), codes 0
            QuantParams const p = perm[i] < 0 ? QuantParams{} : range_params(lo[u], hi[u], bits, opt.zero_point);
            params[g * cnt + i] = p;
            scale[u] = static_cast<float>(p.scale);
            offset[u] = static_cast<float>(p.offset);
          }
          for (Index t = t0; t < t1; ++t) {  // pads: x = 0 with zero params -> code 0 in both modes
            for (Index i = 0; i < cnt; ++i)
              row[static_cast<std::size_t>(i)] = perm[i] < 0 ? 0.0f : rows[static_cast<std::size_t>(t * dk + perm[i])];
            detail::quantize_row(row.data(), scale.data(), offset.data(), cnt, qmax, opt.zero_point,
                                 codes.data() + t * cnt);
          }
        }
        Index const rb = packed_bytes(cnt, bits);
        auto* dst = reinterpret_cast<std::uint8_t*>(base + d.k_codes[s]);
        for (Index t = 0; t < tn; ++t)
          pack_codes(codes.data() + t * cnt, cnt, bits, dst + t * rb);
      }

      // V: one token at a time (params per token per channel group).
      Index const vg = opt.v_group > 0 ? opt.v_group : (dv > 0 ? dv : 1);
      for (int s = 0; s < packed_segments; ++s) {
        Index const t0 = d.v_begin(s), padded = s < 3 ? shape.v_padded(s) : dv;
        int const bits = segment_bits(s);
        row.assign(static_cast<std::size_t>(padded), 0.0f);
        codes.assign(static_cast<std::size_t>(padded), 0);
        scale.resize(static_cast<std::size_t>(dv));
        offset.resize(static_cast<std::size_t>(dv));
        for (Index j = 0; j < d.v_count[s]; ++j) {
          auto const* src = cache.values.row(b, h, hp.slots[static_cast<std::size_t>(t0 + j)]);
          for (Index c = 0; c < dv; ++c) {
            row[static_cast<std::size_t>(c)] = to_float(src[c]);
            if (!detail::fits_half(row[static_cast<std::size_t>(c)]))
              return fail(bad_value);
          }
          if (s == 3) {
            auto* raw = reinterpret_cast<half*>(base + d.v_raw) + j * dv;
            for (Index c = 0; c < dv; ++c)
              raw[c] = half(row[static_cast<std::size_t>(c)]);
            continue;
          }
          auto* params = reinterpret_cast<QuantParams*>(base + d.v_params[s]) + j * v_groups;
          for (Index g = 0; g < v_groups; ++g) {
            Index const c0 = g * vg, gn = dv - c0 < vg ? dv - c0 : vg;
            params[g] = minmax_params(row.data() + c0, gn, 1, bits, opt.zero_point);
            std::fill_n(scale.data() + c0, gn, static_cast<float>(params[g].scale));
            std::fill_n(offset.data() + c0, gn, static_cast<float>(params[g].offset));
          }
          detail::quantize_row(row.data(), scale.data(), offset.data(), dv, detail::quant_max_code(bits),
                               opt.zero_point, codes.data());
          pack_codes(codes.data(), padded, bits,
                     reinterpret_cast<std::uint8_t*>(base + d.v_codes[s]) + j * shape.v_row_bytes(s));
        }
      }
    }
  out.set_max_tokens(max_tokens);
  return {};
}

}  // namespace kvc
