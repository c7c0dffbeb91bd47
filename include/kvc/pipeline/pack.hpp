// SPDX-License-Identifier: Apache-2.0
// kvc/pipeline/pack.hpp: the CPU builders of the packed store (RDKV's obkv_accel/packing.py; layout: store/packed.hpp):
// kvc::pack fills an owning PackedKV (it allocates: the tools' way), kvc::pack_into a caller-memory PackedStore
// (nothing allocates: the engine's way, kvc::LayerCompressor's). Both write each head with the same three steps
// (detail::order_packed_head, layout_packed_head, detail::fill_packed_head); they differ only in where a head starts.
//
// Per (sequence, KV head): kept = valid slots with v_bits > 0, bucketed by bit width into the V segments 2 | 4 | 8 | 16
// (slot order within a segment: a stable sort); K channels with k_bits > 0 bucketed into 2 | 4 | 8 | 16 (channel order
// within a segment), each quantised segment padded with zero channels to a multiple of 8 / b. K params per channel
// per group of `k_group` tokens of the packed order (0: all kept tokens; a uniform plan, KIVI's, keeps the slot
// order, so these are KIVI's token groups); V params per token per group of `v_group` channels (0: all). Values at
// 16 bits are stored as FP16 (exact for an fp16 cache; rounded once for fp32, the cache's precision is not kept).
#pragma once

#include <kvc/core/backend.hpp>
#include <kvc/core/checks.hpp>
#include <kvc/core/kernel.hpp>
#include <kvc/core/kv_view.hpp>
#include <kvc/core/status.hpp>
#include <kvc/core/workspace.hpp>
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

/// Whether x is finite and within FP16's range (every stored value, raw or params, is FP16). Host and device: NaN
/// fails both comparisons, infinities the range.
KVC_HOST_DEVICE constexpr bool fits_half(float x) noexcept {
  return x >= -65504.0f && x <= 65504.0f;
}

/// Host scratch of one head's packing (kvc::pack and kvc::pack_into reuse it for every head): carved from a
/// workspace of pack_scratch_bytes(tokens, d_k, d_v) bytes, or held in vectors by the owning pack.
struct PackScratch {
  Index* slots = nullptr;        ///< [tokens]: kept slots in packed order
  std::int32_t* perm = nullptr;  ///< [d_k + 4]: packed channel -> original channel (-1: pad)
  float* rows = nullptr;         ///< [tokens, d_k]: the kept keys, widened
  float* row = nullptr;          ///< [width] each of these five: one row or channel set
  float* lo = nullptr;
  float* hi = nullptr;
  float* scale = nullptr;
  float* offset = nullptr;
  std::uint8_t* codes = nullptr;       ///< [tokens, width]
  Index k_kept[packed_segments] = {};  ///< channels of each K segment without its pads (set by order_packed_head)
};
/// The width of PackScratch's per-row arrays: the larger of d_k and d_v, plus the pads of a code row.
constexpr Index pack_scratch_width(Index dim, Index value_dim) noexcept {
  return (dim > value_dim ? dim : value_dim) + 4;
}
/// Bytes of PackScratch's arrays for heads of at most `tokens` slots (any alignment).
inline std::size_t pack_scratch_bytes(Index tokens, Index dim, Index value_dim) noexcept {
  Index const w = pack_scratch_width(dim, value_dim);
  std::size_t total = workspace_slack;
  for (std::size_t b :
       {bytes_product(tokens, sizeof(Index)), bytes_product(dim + 4, sizeof(std::int32_t)),
        bytes_product(tokens, dim, sizeof(float)), bytes_product(w, 5 * sizeof(float)), bytes_product(tokens, w)})
    total = bytes_sum(total, workspace_round(b));
  return total;
}
inline PackScratch carve_pack_scratch(Workspace ws, Index tokens, Index dim, Index value_dim) {
  WorkspaceCarver carve(ws);
  Index const w = pack_scratch_width(dim, value_dim);
  PackScratch s;
  s.slots = carve.take<Index>(tokens);
  s.perm = carve.take<std::int32_t>(dim + 4);
  s.rows = carve.take<float>(tokens * dim);
  s.row = carve.take<float>(5 * w);
  s.lo = s.row + w;
  s.hi = s.lo + w;
  s.scale = s.hi + w;
  s.offset = s.scale + w;
  s.codes = carve.take<std::uint8_t>(tokens * w);
  return s;
}

/// The checks kvc::pack and kvc::pack_into share (the plan against the cache).
template <KVCacheView C, class Space>
Status check_pack(C const& cache, BitPlan<Space> const& plan, PackOptions const& opt) {
  KVC_RETURN_IF_ERROR(opt.check());
  KVExtents const e = cache.keys.extents();
  KVC_RETURN_IF_ERROR(detail::check_cache(cache, KVC_CACHE_MESSAGES("kvc::pack", "the cache")));
  if (plan.batch != e.batch || plan.heads != e.heads || plan.tokens != cache.tokens() || plan.dim != e.dim)
    return {Errc::invalid_argument, "kvc::pack: the bit plan must be [batch, KV heads, tokens, d_k] of the cache"};
  if (e.batch * e.heads > 0 && ((plan.v_bits == nullptr && plan.tokens > 0) || (plan.k_bits == nullptr && e.dim > 0)))
    return {Errc::invalid_argument, "kvc::pack: the bit plan's `v_bits` and `k_bits` must be non-null"};
  return {};
}

/// The packed order of head (b, h): its kept slots by V segment (stable) into s.slots, its K channels by segment
/// (stable, each quantised segment padded) into s.perm and s.k_kept, and the counts of `d` (tokens, v_count,
/// k_count, k_groups; offsets not yet). Errors: a length out of range, a bit width outside {0, 2, 4, 8, 16}.
template <KVCacheView C>
Status order_packed_head(C const& cache, Index b, Index h, BitPlan<HostSpace> const& plan, PackOptions const& opt,
                         PackedHead& d, PackScratch& s) {
  d = PackedHead{};
  Index const n = cache.length(b, h), dk = cache.keys.extents().dim;
  if (n < 0 || n > cache.capacity(b, h))
    return {Errc::invalid_argument, "kvc::pack: every valid length must be in [0, capacity]"};
  std::int8_t const* vb = plan.v_row(b, h);
  std::int8_t const* kb = plan.k_row(b, h);
  for (Index t = 0; t < n; ++t)
    if (!valid_bits(vb[t]))
      return {Errc::invalid_argument, "kvc::pack: every v_bits of a valid slot must be 0, 2, 4, 8 or 16"};
  for (Index c = 0; c < dk; ++c)
    if (!valid_bits(kb[c]))
      return {Errc::invalid_argument, "kvc::pack: every k_bits must be 0, 2, 4, 8 or 16"};
  Index tn = 0;
  for (int seg = 0; seg < packed_segments; ++seg)
    for (Index t = 0; t < n; ++t)
      if (bits_segment(vb[t]) == seg) {
        s.slots[tn++] = t;
        ++d.v_count[seg];
      }
  Index channels = 0;
  for (int seg = 0; seg < packed_segments; ++seg) {
    s.k_kept[seg] = 0;
    if (tn == 0)
      continue;
    for (Index c = 0; c < dk; ++c) {
      int bits = kb[c];
      if (bits == 16 && opt.clamp_k16_to_8)
        bits = 8;
      if (bits_segment(bits) == seg) {
        s.perm[channels++] = static_cast<std::int32_t>(c);
        ++s.k_kept[seg];
      }
    }
    d.k_count[seg] = padded_count(s.k_kept[seg], segment_bits(seg));
    for (Index p = s.k_kept[seg]; p < d.k_count[seg]; ++p)
      s.perm[channels++] = -1;
  }
  d.tokens = tn;
  d.k_groups = tn == 0 ? 0 : (opt.k_group > 0 ? (tn + opt.k_group - 1) / opt.k_group : 1);
  return {};
}

/// Writes head (b, h) into `base` (the arena) at the offsets of `d` (order_packed_head, then layout_packed_head):
/// positions, permutation, K per segment and token group, V per token. Errors (non_finite): a stored K (kept channel)
/// or V value that is NaN, Inf or beyond FP16.
template <KVCacheView C>
Status fill_packed_head(C const& cache, Index b, Index h, PackOptions const& opt, PackedHead& d, std::byte* base,
                        PackScratch const& s) {
  Index const dk = cache.keys.extents().dim, dv = cache.values.extents().dim, tn = d.tokens;
  if (tn == 0)
    return {};
  PackedQuant const quant{opt.zero_point, opt.v_group, opt.k_group};
  Index const v_groups = detail::packed_v_groups(dv, quant);
  Status const bad_key{Errc::non_finite, "kvc::pack: a kept token's key (kept channel) is NaN, Inf or beyond FP16"};
  Status const bad_value{Errc::non_finite, "kvc::pack: a kept token's value is NaN, Inf or beyond FP16"};
  auto* pos = reinterpret_cast<Index*>(base + d.positions);
  Index end = 0;
  for (Index t = 0; t < tn; ++t) {
    pos[t] = cache.position(b, h, s.slots[t]);
    end = pos[t] + 1 > end ? pos[t] + 1 : end;
  }
  d.end_position = end;
  Index const channels = d.k_channels();
  std::memcpy(base + d.k_perm, s.perm, static_cast<std::size_t>(channels) * sizeof(std::int32_t));

  // K: the kept rows are gathered once into `rows` [tn, d_k] fp32 (token-major: the cache is read in its storage
  // order, never a strided column per channel, which cost 128 passes over the head), then per segment and token group
  // the per-channel ranges come from one pass over the group's rows, and the codes are written row by row in the
  // segment's packed-channel order.
  for (Index t = 0; t < tn; ++t) {
    auto const* src = cache.keys.row(b, h, s.slots[t]);
    float* dst = s.rows + t * dk;
    for (Index c = 0; c < dk; ++c)
      dst[c] = load(src[c], cache.keys.scale(b, h));
    for (Index i = 0; i < channels; ++i)  // only what is stored must fit FP16 (pruned channels are never read)
      if (s.perm[i] >= 0 && !detail::fits_half(dst[s.perm[i]]))
        return bad_key;
  }
  Index const kg = opt.k_group > 0 ? opt.k_group : tn;
  for (int seg = 0; seg < packed_segments; ++seg) {
    Index const cnt = d.k_count[seg], c0 = d.k_begin(seg);
    if (cnt == 0)
      continue;
    std::int32_t const* perm = s.perm + c0;
    if (seg == 3) {
      auto* raw = reinterpret_cast<half*>(base + d.k_raw);
      for (Index t = 0; t < tn; ++t)
        for (Index i = 0; i < cnt; ++i)
          raw[t * cnt + i] = perm[i] < 0 ? half(0.0f) : half(s.rows[t * dk + perm[i]]);
      continue;
    }
    int const bits = segment_bits(seg);
    float const qmax = detail::quant_max_code(bits);
    auto* params = reinterpret_cast<QuantParams*>(base + d.k_params[seg]);
    std::fill_n(s.codes, tn * cnt, std::uint8_t{0});
    for (Index g = 0; g < d.k_groups; ++g) {
      Index const t0 = g * kg, t1 = tn - t0 < kg ? tn : t0 + kg;
      for (Index i = 0; i < cnt; ++i)
        s.lo[i] = s.hi[i] = perm[i] < 0 ? 0.0f : s.rows[t0 * dk + perm[i]];
      for (Index t = t0 + 1; t < t1; ++t)
        for (Index i = 0; i < cnt; ++i) {
          if (perm[i] < 0)
            continue;
          float const x = s.rows[t * dk + perm[i]];
          s.lo[i] = x < s.lo[i] ? x : s.lo[i];
          s.hi[i] = x > s.hi[i] ? x : s.hi[i];
        }
      for (Index i = 0; i < cnt; ++i) {  // pad: zero params (zeroed below), codes 0
        QuantParams const p = perm[i] < 0 ? QuantParams{} : range_params(s.lo[i], s.hi[i], bits, opt.zero_point);
        params[g * cnt + i] = p;
        s.scale[i] = static_cast<float>(p.scale);
        s.offset[i] = static_cast<float>(p.offset);
      }
      for (Index t = t0; t < t1; ++t) {  // pads: x = 0 with zero params -> code 0 in both modes
        for (Index i = 0; i < cnt; ++i)
          s.row[i] = perm[i] < 0 ? 0.0f : s.rows[t * dk + perm[i]];
        detail::quantize_row(s.row, s.scale, s.offset, cnt, qmax, opt.zero_point, s.codes + t * cnt);
      }
    }
    Index const rb = packed_bytes(cnt, bits);
    auto* dst = reinterpret_cast<std::uint8_t*>(base + d.k_codes[seg]);
    for (Index t = 0; t < tn; ++t)
      pack_codes(s.codes + t * cnt, cnt, bits, dst + t * rb);
  }

  // V: one token at a time (params per token per channel group).
  Index const vg = opt.v_group > 0 ? opt.v_group : (dv > 0 ? dv : 1);
  for (int seg = 0; seg < packed_segments; ++seg) {
    Index const t0 = d.v_begin(seg), padded = seg < 3 ? padded_count(dv, segment_bits(seg)) : dv;
    int const bits = segment_bits(seg);
    std::fill_n(s.row, padded, 0.0f);
    std::fill_n(s.codes, padded, std::uint8_t{0});
    for (Index j = 0; j < d.v_count[seg]; ++j) {
      auto const* src = cache.values.row(b, h, s.slots[t0 + j]);
      for (Index c = 0; c < dv; ++c) {
        s.row[c] = load(src[c], cache.values.scale(b, h));
        if (!detail::fits_half(s.row[c]))
          return bad_value;
      }
      if (seg == 3) {
        auto* raw = reinterpret_cast<half*>(base + d.v_raw) + j * dv;
        for (Index c = 0; c < dv; ++c)
          raw[c] = half(s.row[c]);
        continue;
      }
      auto* params = reinterpret_cast<QuantParams*>(base + d.v_params[seg]) + j * v_groups;
      for (Index g = 0; g < v_groups; ++g) {
        Index const c0 = g * vg, gn = dv - c0 < vg ? dv - c0 : vg;
        params[g] = minmax_params(s.row + c0, gn, 1, bits, opt.zero_point);
        std::fill_n(s.scale + c0, gn, static_cast<float>(params[g].scale));
        std::fill_n(s.offset + c0, gn, static_cast<float>(params[g].offset));
      }
      detail::quantize_row(s.row, s.scale, s.offset, dv, detail::quant_max_code(bits), opt.zero_point, s.codes);
      pack_codes(s.codes, padded, bits,
                 reinterpret_cast<std::uint8_t*>(base + d.v_codes[seg]) + j * detail::packed_v_row_bytes(dv, seg));
    }
  }
  return {};
}

}  // namespace detail

/// Packs the kept tokens of a host cache (any layout and element type; keys post-RoPE as stored) with a bit plan
/// (v_bits [batch, Hkv, tokens], k_bits [batch, Hkv, d_k] with tokens = cache.tokens()) into `out` (rebuilt, an
/// arena of exactly the bytes the plan needs). Slots with v_bits 0 and slots at or past a head's length are dropped
/// (their plan entries are not read). Allocates: for an engine's own memory see kvc::pack_into.
/// Errors (invalid_argument unless noted): options; a plan of another shape or with null tables; a bit width
/// outside {0, 2, 4, 8, 16} (valid slots and every channel); lengths out of range; a kept token's K (kept channels)
/// or V that is NaN, Inf or beyond FP16's range (non_finite, naming keys or values). On error `out` is left empty.
template <KVCacheView C>
Status pack(C const& cache, BitPlan<HostSpace> const& plan, PackOptions const& opt, PackedKV& out) {
  static_assert(std::is_same_v<typename C::memory_space, HostSpace>, "kvc::pack: the cache must be in host memory");
  out.reset(0, 0, 0, 0, {}, 0);
  KVC_RETURN_IF_ERROR(detail::check_pack(cache, plan, opt));
  KVExtents const e = cache.keys.extents();
  Index const dk = e.dim, dv = cache.values.extents().dim;
  PackedQuant const quant{opt.zero_point, opt.v_group, opt.k_group};
  Index longest = 0;  // slots of the longest head: the scratch's token count
  for (Index b = 0; b < e.batch; ++b)
    for (Index h = 0; h < e.heads; ++h) {
      Index const n = cache.length(b, h);
      if (n < 0 || n > cache.capacity(b, h))
        return {Errc::invalid_argument, "kvc::pack: every valid length must be in [0, capacity]"};
      longest = n > longest ? n : longest;
    }
  std::vector<std::byte> scratch_bytes(detail::pack_scratch_bytes(longest, dk, dv));
  detail::PackScratch s = detail::carve_pack_scratch({scratch_bytes.data(), scratch_bytes.size()}, longest, dk, dv);

  // 1. Packed orders and the arena's size (each head at the end of the previous one).
  std::uint64_t arena = 0;
  Index max_tokens = 0;
  for (Index b = 0; b < e.batch; ++b)
    for (Index h = 0; h < e.heads; ++h) {
      PackedHead d;
      KVC_RETURN_IF_ERROR(detail::order_packed_head(cache, b, h, plan, opt, d, s));
      arena = layout_packed_head(d, s.k_kept, arena, dv, quant);
      max_tokens = d.tokens > max_tokens ? d.tokens : max_tokens;
    }

  // 2. Fill the arena (the orders again: cheaper than keeping every head's).
  out.reset(e.batch, e.heads, dk, dv, quant, static_cast<std::size_t>(arena));
  std::uint64_t at = 0;
  for (Index b = 0; b < e.batch; ++b)
    for (Index h = 0; h < e.heads; ++h) {
      PackedHead& d = out.head_mut(b, h);
      Status st = detail::order_packed_head(cache, b, h, plan, opt, d, s);
      at = layout_packed_head(d, s.k_kept, at, dv, quant);
      if (st.ok())
        st = detail::fill_packed_head(cache, b, h, opt, d, out.arena_mut(), s);
      if (!st.ok()) {
        out.reset(0, 0, 0, 0, {}, 0);
        return st;
      }
    }
  out.set_max_tokens(max_tokens);
  return {};
}

/// Step tag of kvc::pack_into's kernels (core/kernel.hpp): Kernel<PackStep, B> in backend/*/pipeline/pack.
struct PackStep {};

/// Bytes of workspace kvc::pack_into needs for caches like `cache` (in the backend's space; any alignment).
template <Backend B, KVCacheView C>
std::size_t pack_workspace_bytes(B const& backend, C const& cache) {
  static_assert(HasKernel<PackStep, B>,
                "kvc::pack_into: include <kvc/backend/cpu/pipeline/pack.hpp> (kvc::Cpu) or "
                "<kvc/backend/cuda/pipeline/pack.cuh> (kvc::Cuda)");
  if constexpr (HasKernel<PackStep, B>)
    return bytes_sum(Kernel<PackStep, B>::workspace_bytes(backend, cache), workspace_slack);
  else
    return 0;
}

/// kvc::pack into caller memory in the backend's space: the same heads as kvc::pack, each in its own region of `out`
/// (a PackedStore whose batch, KV heads, d_k and d_v are the cache's and quant the options'; its `tokens` bounds the
/// tokens a head may keep). Nothing allocates; on CUDA nothing is read on the host (enqueued on the backend's stream).
/// Bad data (a valid slot's bit width outside {0, 2, 4, 8, 16}, a length out of range, a stored K or V value that is
/// NaN, Inf or beyond FP16, a head keeping more than out.tokens tokens) leaves every descriptor of `out` empty, no
/// head half written. The CPU reports it as the Status (invalid_argument, non_finite, out_of_capacity); CUDA cannot
/// without reading device memory, so it writes 1 to `*error` (a device int, when non-null; 0 is never written) and the
/// call returns ok. Errors of the call itself: those of kvc::pack's shape checks, a store of another shape, null
/// tables, a misaligned arena, a store or workspace overlapping the cache or each other (invalid_argument), workspace
/// smaller than pack_workspace_bytes() (out_of_capacity).
template <Backend B, KVCacheView C>
Status pack_into(B const& backend, C const& cache, BitPlan<typename B::memory_space> const& plan,
                 PackOptions const& opt, PackedStore<typename B::memory_space> out, Workspace ws,
                 int* error = nullptr) {
  static_assert(AccessibleFrom<C, B>, "kvc::pack_into: the cache lives in a memory space this backend cannot read");
  static_assert(HasKernel<PackStep, B>,
                "kvc::pack_into: include <kvc/backend/cpu/pipeline/pack.hpp> (kvc::Cpu) or "
                "<kvc/backend/cuda/pipeline/pack.cuh> (kvc::Cuda)");
  if constexpr (HasKernel<PackStep, B>) {
    KVC_RETURN_IF_ERROR(detail::check_pack(cache, plan, opt));
    KVExtents const e = cache.keys.extents();
    Index const dv = cache.values.extents().dim;
    PackedQuant const quant{opt.zero_point, opt.v_group, opt.k_group};
    if (out.batch != e.batch || out.kv_heads != e.heads || out.dim != e.dim || out.value_dim != dv || out.tokens < 0 ||
        out.quant.zero_point != quant.zero_point || out.quant.v_group != quant.v_group ||
        out.quant.k_group != quant.k_group)
      return {Errc::invalid_argument,
              "kvc::pack_into: the store must have the cache's batch, KV heads and dims, tokens >= 0, and the "
              "options' quantiser"};
    if (e.batch * e.heads > 0 && (out.heads == nullptr || out.arena == nullptr))
      return {Errc::invalid_argument, "kvc::pack_into: the store's `arena` and `heads` must be non-null"};
    if (reinterpret_cast<std::uintptr_t>(out.arena) % 16 != 0)
      return {Errc::invalid_argument, "kvc::pack_into: the store's `arena` must be 16-byte aligned"};
    detail::ByteRange const arena = detail::bytes_of(out.arena, static_cast<Index>(out.arena_bytes())),
                            heads = detail::bytes_of(out.heads, e.batch * e.heads);
    if (detail::overlaps_cache(arena, cache) || detail::overlaps_cache(heads, cache) || detail::overlap(arena, heads))
      return {Errc::invalid_argument, "kvc::pack_into: the store's arena and descriptors must not overlap the cache"};
    if (ws.bytes < pack_workspace_bytes(backend, cache) || ws.data == nullptr)
      return {Errc::out_of_capacity, "kvc::pack_into: workspace smaller than pack_workspace_bytes()"};
    detail::ByteRange const scratch = detail::bytes_of(ws);
    if (detail::overlaps_cache(scratch, cache) || detail::overlap(scratch, arena) || detail::overlap(scratch, heads))
      return {Errc::invalid_argument, "kvc::pack_into: the workspace overlaps the cache or the store"};
    return Kernel<PackStep, B>::run(backend, cache, plan, opt, out, ws, error);
  } else {
    return {Errc::invalid_argument, "unreachable"};
  }
}

}  // namespace kvc
