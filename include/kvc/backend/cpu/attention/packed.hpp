// SPDX-License-Identifier: Apache-2.0
// kvc/backend/cpu/attention/packed.hpp: the CPU kernel of kvc::attend_packed (attention over the packed RDKV/KIVI
// store, reading 2/4/8-bit codes and FP16 rows directly; nothing is unpacked to a 16-bit copy).
//
// Why this arithmetic (dequantisation folded into the query and the weights, in registers):
//  - K is quantised per channel, per token group g: k̂_{t,c} = code_{t,c} a_{g,c} + c_{g,c}, so
//      logit_t = Σ_c q_c k̂_{t,c} = Σ_c (q_c a_{g,c}) code_{t,c} + Σ_c q_c c_{g,c}.
//    Per group (and query row) the scaled query q'_c = q_c a_{g,c} and the bias Σ_c q_c c_{g,c} cost d_k operations
//    once; each token then costs one dot product of its codes with q' — the same work as an fp16 dot, on 1/8 (2 bits)
//    or 1/4 (4 bits) of the bytes. The query is permuted (and pruned) by k_perm once per pass, so the codes of a
//    segment are read in storage order.
//  - V is quantised per token (per channel group): v̂_{t,c} = code_{t,c} a_{t,g} + c_{t,g}, so
//      Σ_t p_t v̂_{t,c} = Σ_t (p_t a_{t,g}) code_{t,c} + Σ_t p_t c_{t,g}:
//    one weight per (token, group) times the codes, and a per-group bias added once at the end.
//  - The split layouts (quant/bitpack.hpp) put channels i, i + n/4, i + n/2, i + 3n/4 in byte i (2 bits), so 16
//    consecutive bytes unpack with a shift and a mask into 4 vectors of 16 consecutive channels: no shuffles.
// Softmax: two passes over the head's T_eff tokens (logits of a block of query rows into the worker's scratch, then
// max, exponentials, denominator, then the weighted values); fp32 throughout, summation orders fixed by the layout
// (16 lanes per dot as detail::dot, tokens in packed order), so results are bit-identical for any thread count and
// any grouping of query rows. Causal mask: a token is visible to a query iff its stored position <= the query's;
// packed order is not position order, so the mask is per token (skipped when every row is past the head's end).
// Throughput (benchmarks/attention/packed_bench.cpp; decode, g = 4, d = 128, one core): per token about as fast as
// the fp16 kernel at 4 bits and faster at 2 bits with whole-axis groups; 32-token/32-channel groups (KIVI) cost the
// per-group query scaling and per-tile params. Each token's codes are unpacked once for packed_group query rows and
// two tokens share each query load (as attend_logits); the value pass runs in tiles of packed_value_tile tokens.
#pragma once

#include <kvc/attention/packed.hpp>
#include <kvc/backend/cpu/detail/attend.hpp>
#include <kvc/backend/cpu/detail/for_each_head.hpp>
#include <kvc/store/packed.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#if defined(__AVX2__) || defined(__AVX512F__)
#  include <immintrin.h>
#endif

namespace kvc {
namespace detail {

/// Query rows one pass over a head serves (bounds the logits scratch: rows x T_eff floats per worker).
inline constexpr Index packed_block_rows = 16;
/// Query rows whose logits and value sums one inner loop computes together (codes unpacked once for all of them).
inline constexpr Index packed_group = 4;
/// Tokens per tile of the value pass: the tile's code rows (64 x 128 B at d = 128, 8 bits) stay in L1 while the
/// pass sweeps its column chunks, so V is read from memory once.
inline constexpr Index packed_value_tile = 64;

/// n rounded up to whole lanes.
constexpr Index round_lanes(Index n) noexcept {
  return (n + reduce_lanes - 1) / reduce_lanes * reduce_lanes;
}

#if defined(__GNUC__) && defined(__has_builtin)
#  if __has_builtin(__builtin_convertvector)
#    define KVC_PACKED_CONVERT 1
#  endif
#endif

/// Unrolls the loops over a micro-kernel's rows and sub-columns, so that their accumulators stay in registers (GCC 12
/// otherwise keeps them in a stack array: a store and a reload per FMA, measured 3-4x slower).
/// The per-token micro-kernels are forced inline into their token loops: as calls, their accumulators went through
/// memory at every token (GCC 12 did not inline them at -O2).
#if defined(__GNUC__)
#  define KVC_PACKED_UNROLL _Pragma("GCC unroll 16")
#  define KVC_PACKED_INLINE inline __attribute__((always_inline))
#else
#  define KVC_PACKED_UNROLL
#  define KVC_PACKED_INLINE inline
#endif

/// 16 code bytes zero-extended to 32-bit lanes (CodeBytes), and the float lanes of one split sub-segment of them
/// (codes_to_lanes: (x >> shift) & mask). x86 uses one vpmovzxbd (AVX-512: 16 lanes; AVX2: 2 x 8) and shifts in
/// 32-bit lanes: GCC 12 scalarises a generic u8 -> i32 __builtin_convertvector of loaded bytes (one extract per
/// lane, measured 2x slower at 8 bits), and has no byte shifts to vectorise `b >> shift` with.
#if defined(__AVX512F__)
struct CodeBytes {
  __m512i w;
};
KVC_PACKED_INLINE void code_bytes_load(CodeBytes& b, std::uint8_t const* src) noexcept {
  b.w = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<__m128i const*>(src)));
}
KVC_PACKED_INLINE void codes_to_lanes(Lanes& out, CodeBytes const& b, int shift, unsigned mask) noexcept {
  __m512 const f = _mm512_cvtepi32_ps(
      _mm512_and_si512(_mm512_srl_epi32(b.w, _mm_cvtsi32_si128(shift)), _mm512_set1_epi32(static_cast<int>(mask))));
  std::memcpy(&out, &f, sizeof out);
}
#elif defined(__AVX2__)
struct CodeBytes {
  __m256i lo, hi;
};
KVC_PACKED_INLINE void code_bytes_load(CodeBytes& b, std::uint8_t const* src) noexcept {
  b.lo = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<__m128i const*>(src)));
  b.hi = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<__m128i const*>(src + 8)));
}
KVC_PACKED_INLINE void codes_to_lanes(Lanes& out, CodeBytes const& b, int shift, unsigned mask) noexcept {
  __m128i const count = _mm_cvtsi32_si128(shift);
  __m256i const m = _mm256_set1_epi32(static_cast<int>(mask));
  __m256 const lo = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srl_epi32(b.lo, count), m));
  __m256 const hi = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srl_epi32(b.hi, count), m));
  float wide[reduce_lanes];
  _mm256_storeu_ps(wide, lo);
  _mm256_storeu_ps(wide + 8, hi);
  std::memcpy(&out, wide, sizeof out);
}
#elif defined(KVC_PACKED_CONVERT)
using CodeBytes = std::uint8_t __attribute__((vector_size(reduce_lanes)));
KVC_PACKED_INLINE void code_bytes_load(CodeBytes& b, std::uint8_t const* src) noexcept {
  std::memcpy(&b, src, sizeof b);
}
KVC_PACKED_INLINE void codes_to_lanes(Lanes& out, CodeBytes const& b, int shift, unsigned mask) noexcept {
  using Int32Lanes = std::int32_t __attribute__((vector_size(reduce_lanes * sizeof(std::int32_t))));
  CodeBytes const m = (b >> shift) & static_cast<std::uint8_t>(mask);
  out = __builtin_convertvector(__builtin_convertvector(m, Int32Lanes), Lanes);
}
#else
struct CodeBytes {
  std::uint8_t v[reduce_lanes];
};
KVC_PACKED_INLINE void code_bytes_load(CodeBytes& b, std::uint8_t const* src) noexcept {
  std::memcpy(&b, src, sizeof b);
}
KVC_PACKED_INLINE void codes_to_lanes(Lanes& out, CodeBytes const& b, int shift, unsigned mask) noexcept {
  for (Index l = 0; l < reduce_lanes; ++l)
    out[l] = static_cast<float>((b.v[l] >> shift) & mask);
}
#endif

/// One K segment of a head as the logits loop reads it.
struct PackedKSegment {
  std::uint8_t const* codes = nullptr;  ///< [tokens][bytes]
  Index bytes = 0;                      ///< bytes per token row (packed_bytes(count, bits))
  Index q0 = 0;                         ///< first packed channel (offset into the scaled query)
  int bits = 0;
};

/// acc[n·RG + r] += Σ_i q[r][i] code_{n,i} over one quantised K segment's rows of NT consecutive tokens (row n at
/// codes + n·bytes, split layout, `bytes` bytes each): 16 bytes at a time, each unpacked into 8 / bits lane vectors;
/// every query chunk is loaded once for the NT tokens. A partial chunk goes into the same lanes (lane = byte index
/// mod 16), so a token's arithmetic is fixed by the layout whatever NT and RG are.
template <Index RG, Index NT, Index Per>
KVC_PACKED_INLINE void packed_dot_segment(Lanes* acc, float const* q, Index q_stride, std::uint8_t const* codes,
                                          Index bytes) noexcept {
  constexpr int bits = static_cast<int>(8 / Per);
  constexpr unsigned mask = (1u << static_cast<unsigned>(bits)) - 1u;
  Index const full = bytes - bytes % reduce_lanes;
  for (Index i = 0; i < full; i += reduce_lanes) {
    Lanes c[static_cast<std::size_t>(NT)][static_cast<std::size_t>(Per)];
    KVC_PACKED_UNROLL
    for (Index n = 0; n < NT; ++n) {
      CodeBytes b;
      code_bytes_load(b, codes + n * bytes + i);
      KVC_PACKED_UNROLL
      for (Index j = 0; j < Per; ++j)
        codes_to_lanes(c[n][j], b, static_cast<int>(j) * bits, mask);
    }
    KVC_PACKED_UNROLL
    for (Index r = 0; r < RG; ++r) {
      KVC_PACKED_UNROLL
      for (Index j = 0; j < Per; ++j) {
        Lanes qj;
        lanes_load(qj, q + r * q_stride + j * bytes + i);
        KVC_PACKED_UNROLL
        for (Index n = 0; n < NT; ++n)
          lanes_fma(acc[n * RG + r], c[n][j], qj);
      }
    }
  }
  for (Index i = full; i < bytes; ++i)
    for (Index n = 0; n < NT; ++n) {
      unsigned const byte = codes[n * bytes + i];
      for (Index j = 0; j < Per; ++j) {
        auto const code = static_cast<float>((byte >> (j * bits)) & mask);
        for (Index r = 0; r < RG; ++r)
          acc[n * RG + r][i % reduce_lanes] += code * q[r * q_stride + j * bytes + i];
      }
    }
}

/// acc[n·RG + r] += Σ_i q[r][i] raw_{n,i} over the `count` FP16 values of NT consecutive tokens (K at 16 bits).
template <Index RG, Index NT>
KVC_PACKED_INLINE void packed_dot_raw(Lanes* acc, float const* q, Index q_stride, half const* raw,
                                      Index count) noexcept {
  Index const full = count - count % reduce_lanes;
  for (Index i = 0; i < full; i += reduce_lanes) {
    Lanes x[static_cast<std::size_t>(NT)];
    KVC_PACKED_UNROLL
    for (Index n = 0; n < NT; ++n)
      lanes_load(x[n], raw + n * count + i);
    KVC_PACKED_UNROLL
    for (Index r = 0; r < RG; ++r) {
      Lanes qr;
      lanes_load(qr, q + r * q_stride + i);
      KVC_PACKED_UNROLL
      for (Index n = 0; n < NT; ++n)
        lanes_fma(acc[n * RG + r], x[n], qr);
    }
  }
  for (Index i = full; i < count; ++i)
    for (Index n = 0; n < NT; ++n)
      for (Index r = 0; r < RG; ++r)
        acc[n * RG + r][i % reduce_lanes] += to_float(raw[n * count + i]) * q[r * q_stride + i];
}

/// acc += the dots of NT consecutive tokens from `t` over every segment of the head.
template <Index RG, Index NT>
KVC_PACKED_INLINE void packed_dots(Lanes* acc, float const* qa, Index q_stride, PackedKSegment const* seg,
                                   half const* raw, Index raw_count, Index raw_q0, Index t) noexcept {
  if (seg[0].bytes > 0)
    packed_dot_segment<RG, NT, 4>(acc, qa + seg[0].q0, q_stride, seg[0].codes + t * seg[0].bytes, seg[0].bytes);
  if (seg[1].bytes > 0)
    packed_dot_segment<RG, NT, 2>(acc, qa + seg[1].q0, q_stride, seg[1].codes + t * seg[1].bytes, seg[1].bytes);
  if (seg[2].bytes > 0)
    packed_dot_segment<RG, NT, 1>(acc, qa + seg[2].q0, q_stride, seg[2].codes + t * seg[2].bytes, seg[2].bytes);
  if (raw_count > 0)
    packed_dot_raw<RG, NT>(acc, qa + raw_q0, q_stride, raw + t * raw_count, raw_count);
}

/// s[r * s_stride + t] = bias[r] + <q'_r, codes of token t> for tokens [t0, t1) and RG rows (q' = the scaled query
/// of the tokens' K group, q_stride floats per row): two tokens at a time (their sums by lanes_sums2, bit-identical
/// to lanes_sums), then the odd one.
template <Index RG>
inline void packed_logits(float const* qa, Index q_stride, float const* bias, PackedKSegment const* seg,
                          half const* raw, Index raw_count, Index raw_q0, Index t0, Index t1, float* s,
                          Index s_stride) noexcept {
  Index t = t0;
  for (; t + 2 <= t1; t += 2) {
    Lanes acc[static_cast<std::size_t>(2 * RG)] = {};
    packed_dots<RG, 2>(acc, qa, q_stride, seg, raw, raw_count, raw_q0, t);
    float sums[static_cast<std::size_t>(2 * RG)];
    lanes_sums2<RG>(acc, acc + RG, sums, 2);
    KVC_PACKED_UNROLL
    for (Index r = 0; r < RG; ++r) {
      s[r * s_stride + t] = sums[2 * r] + bias[r];
      s[r * s_stride + t + 1] = sums[2 * r + 1] + bias[r];
    }
  }
  if (t < t1) {
    Lanes acc[static_cast<std::size_t>(RG)] = {};
    packed_dots<RG, 1>(acc, qa, q_stride, seg, raw, raw_count, raw_q0, t);
    float sums[static_cast<std::size_t>(RG)];
    lanes_sums<RG>(acc, sums, 1);
    KVC_PACKED_UNROLL
    for (Index r = 0; r < RG; ++r)
      s[r * s_stride + t] = sums[r] + bias[r];
  }
}

/// The weighted codes of one tile of a quantised V segment, fast path: o[r][j·Q + i + l] += Σ_t (p[r][t] a_{t,g})
/// code (the group bias is added by the caller), 16 bytes per chunk unpacked into Per = 8/bits vectors of 16
/// consecutive columns, RG x Per accumulators in registers across the tile's tokens (whose code rows stay in L1 for
/// the next chunk). `p` [RG][tn] (rows p_stride apart) are the softmax weights, `scales` [tn][groups] the tokens'
/// (a, c) pairs (a read); their products are formed in registers. Requires Q % 16 == 0 and group boundaries on
/// multiples of 16 columns (v_group 0 or a multiple of 16).
template <Index RG, std::size_t Per>
inline void packed_values_fast(float const* p, Index p_stride, float const* scales, std::uint8_t const* codes,
                               Index row_bytes, Index groups, Index v_group, Index tn, int bits, float* o,
                               Index o_stride) noexcept {
  unsigned const mask = (1u << static_cast<unsigned>(bits)) - 1u;
  for (Index i = 0; i < row_bytes; i += reduce_lanes) {
    Index g[Per];
    KVC_PACKED_UNROLL
    for (std::size_t j = 0; j < Per; ++j)
      g[j] = v_group > 0 ? (static_cast<Index>(j) * row_bytes + i) / v_group : 0;
    Lanes acc[static_cast<std::size_t>(RG)][Per];
    KVC_PACKED_UNROLL
    for (Index r = 0; r < RG; ++r)
      KVC_PACKED_UNROLL
    for (std::size_t j = 0; j < Per; ++j)
      lanes_load(acc[r][j], o + r * o_stride + static_cast<Index>(j) * row_bytes + i);
    for (Index t = 0; t < tn; ++t) {
      CodeBytes b;
      code_bytes_load(b, codes + t * row_bytes + i);
      Lanes c[Per];
      KVC_PACKED_UNROLL
      for (std::size_t j = 0; j < Per; ++j)
        codes_to_lanes(c[j], b, static_cast<int>(j) * bits, mask);
      float a[Per];
      KVC_PACKED_UNROLL
      for (std::size_t j = 0; j < Per; ++j)
        a[j] = scales[2 * (t * groups + g[j])];
      KVC_PACKED_UNROLL
      for (Index r = 0; r < RG; ++r) {
        float const w = p[r * p_stride + t];
        KVC_PACKED_UNROLL
        for (std::size_t j = 0; j < Per; ++j)
          lanes_fma(acc[r][j], w * a[j], c[j]);
      }
    }
    KVC_PACKED_UNROLL
    for (Index r = 0; r < RG; ++r)
      KVC_PACKED_UNROLL
    for (std::size_t j = 0; j < Per; ++j)
      lanes_store(o + r * o_stride + static_cast<Index>(j) * row_bytes + i, acc[r][j]);
  }
}

/// dst[i] = x[i] * y[i], whole lanes at a time (the arrays are distinct; plain loops were left scalar by GCC 12).
inline void scale_into(float* dst, float const* x, float const* y, Index n) noexcept {
  Index const full = n - n % reduce_lanes;
  for (Index i = 0; i < full; i += reduce_lanes) {
    Lanes a, b, z = {};
    lanes_load(a, x + i);
    lanes_load(b, y + i);
    lanes_fma(z, a, b);
    lanes_store(dst + i, z);
  }
  for (Index i = full; i < n; ++i)
    dst[i] = x[i] * y[i];
}

/// (a, c) pairs of `n` params in place of their widened FP16 (scale, offset) pairs: `ac` [2n] (a at 2i, c at 2i + 1).
inline void affine_pairs(QuantParams const* params, Index n, ZeroPoint zp, float* ac) noexcept {
  static_assert(sizeof(QuantParams) == 2 * sizeof(half));
  widen(reinterpret_cast<half const*>(params), ac, 2 * n);
  if (zp == ZeroPoint::integer)
    for (Index i = 0; i < n; ++i)
      ac[2 * i + 1] = -(ac[2 * i + 1] * ac[2 * i]);
}

/// a and c of `n` params (affine(), with the FP16 pairs widened 8 at a time through `wide` [2n floats]).
inline void affine_params(QuantParams const* params, Index n, ZeroPoint zp, float* wide, float* a, float* c) noexcept {
  static_assert(sizeof(QuantParams) == 2 * sizeof(half));
  widen(reinterpret_cast<half const*>(params), wide, 2 * n);
  if (zp == ZeroPoint::float_min) {
    for (Index i = 0; i < n; ++i) {
      a[i] = wide[2 * i];
      c[i] = wide[2 * i + 1];
    }
  } else {
    for (Index i = 0; i < n; ++i) {
      a[i] = wide[2 * i];
      c[i] = -(wide[2 * i + 1] * wide[2 * i]);
    }
  }
}

/// o[r][c] += Σ_t p[r][t] v_t[c] over FP16 rows raw [tn][dim] (V at 16 bits): chunks of 16 columns, tokens inner.
template <Index RG>
inline void packed_values_raw(float const* p, Index p_stride, half const* raw, Index dim, Index tn, float* o,
                              Index o_stride) noexcept {
  Index const full = dim - dim % reduce_lanes;
  for (Index c = 0; c < full; c += reduce_lanes) {
    Lanes acc[static_cast<std::size_t>(RG)];
    KVC_PACKED_UNROLL
    for (Index r = 0; r < RG; ++r)
      lanes_load(acc[r], o + r * o_stride + c);
    for (Index t = 0; t < tn; ++t) {
      Lanes x;
      lanes_load(x, raw + t * dim + c);
      KVC_PACKED_UNROLL
      for (Index r = 0; r < RG; ++r)
        lanes_fma(acc[r], p[r * p_stride + t], x);
    }
    KVC_PACKED_UNROLL
    for (Index r = 0; r < RG; ++r)
      lanes_store(o + r * o_stride + c, acc[r]);
  }
  for (Index c = full; c < dim; ++c)
    KVC_PACKED_UNROLL
  for (Index r = 0; r < RG; ++r) {
    float a = o[r * o_stride + c];
    for (Index t = 0; t < tn; ++t)
      a += p[r * p_stride + t] * to_float(raw[t * dim + c]);
    o[r * o_stride + c] = a;
  }
}

}  // namespace detail

/// One (sequence, KV head) per item through the backend's parallel-for; per worker scratch from the workspace; no
/// allocation. Per block of up to packed_block_rows query rows of the head's GQA group (g·n rows):
///  1. the rows, scaled by the logit scale, permuted into packed channel order (pads and pruned channels dropped);
///  2. per K token group: q' = q a and the bias Σ q c, then the logits of the group's tokens (packed_logits,
///     packed_group rows per read of a token's codes);
///  3. causal mask by stored positions, row max, e^(s - max) (detail::exp_nonpositive), denominator (16 lanes);
///  4. V: per quantised segment the weighted codes (fast path, or a per-column path for layouts the fast path cannot
///     take) and the per-group bias, then the FP16 rows of zone B; out = o / l, lse = max + ln l.
template <>
struct Kernel<PackedAttention, Cpu> {
  static Index block_rows(KVExtents const& q, Index kv_heads) noexcept {
    Index const group = kv_heads > 0 ? q.heads / kv_heads : 0;
    Index const rows = group > 0 && q.tokens > 0 ? group * std::min(q.tokens, detail::packed_block_rows) : 0;
    return std::min(rows, detail::packed_block_rows);
  }
  /// Floats per row of each scratch piece: query (permuted), scaled query, logits, value accumulator.
  static Index query_floats(PackedKVView<HostSpace> const& kv) noexcept {
    return detail::round_lanes(kv.max_k_channels());
  }
  static Index logit_floats(PackedKVView<HostSpace> const& kv) noexcept { return detail::round_lanes(kv.max_tokens); }
  static Index value_floats(PackedKVView<HostSpace> const& kv) noexcept {
    return detail::round_lanes(kv.value_dim + 4);
  }
  /// Per worker: queries (permuted, scaled), logits/weights, value accumulators and biases per query row; the K
  /// group's a and c per packed channel; a V tile's a and c per (token, group); the widening buffer.
  static std::size_t worker_bytes(Index rows, PackedKVView<HostSpace> const& kv) {
    Index const tile_params = detail::packed_value_tile * kv.v_groups();
    Index const wide = 2 * std::max(query_floats(kv), tile_params);
    return bytes_sum(
        workspace_round(bytes_product(2, rows, query_floats(kv), sizeof(float))),
        workspace_round(bytes_product(2, query_floats(kv), sizeof(float))),
        workspace_round(bytes_product(tile_params, sizeof(float))), workspace_round(bytes_product(wide, sizeof(float))),
        workspace_round(bytes_product(rows, logit_floats(kv), sizeof(float))),
        workspace_round(bytes_product(rows, value_floats(kv), sizeof(float))),
        workspace_round(bytes_product(rows, kv.v_groups(), detail::reduce_lanes + 1, sizeof(float))),
        workspace_round(bytes_product(3, rows, sizeof(float))), workspace_round(bytes_product(rows, sizeof(Index))));
  }
  template <class Q>
  static std::size_t workspace_bytes(Cpu const& cpu, PackedAttention const&, Q const& queries,
                                     PackedKVView<HostSpace> const& kv) {
    return bytes_product(cpu.workers(), worker_bytes(block_rows(queries.rows.extents(), kv.kv_heads), kv));
  }

  template <Element T>
  static Status run(Cpu const& cpu, PackedAttention const& op, AttendQueries<T, HostSpace> const& queries,
                    PackedKVView<HostSpace> const& kv, AttendOutput<HostSpace> out, Workspace ws) {
    KVExtents const q = queries.rows.extents();
    Index const dk = kv.dim, dv = kv.value_dim, max_rows = block_rows(q, kv.kv_heads);
    std::size_t const per_worker = worker_bytes(max_rows, kv);
    auto* base = WorkspaceCarver(ws).take<std::byte>(static_cast<Index>(workspace_bytes(cpu, op, queries, kv)));
    if (base == nullptr && max_rows > 0)
      return {Errc::out_of_capacity, "kvc::attend_packed: workspace smaller than attend_packed_workspace_bytes()"};
    // The descriptors are read on the host: a view not built by kvc::pack is checked before anything is read
    // through it (token and channel counts within the workspace's bounds, packable counts, channels in [-1, d_k)).
    for (Index i = 0; i < kv.batch * kv.kv_heads; ++i) {
      PackedHead const& hd = kv.heads[i];
      bool bad = hd.tokens < 0 || hd.tokens > kv.max_tokens || hd.k_channels() > kv.max_k_channels() ||
                 hd.v_begin(packed_segments) != hd.tokens;
      for (int k = 0; k < packed_segments; ++k)
        bad = bad || hd.k_count[k] < 0 || hd.v_count[k] < 0 || hd.k_count[k] % codes_per_byte(segment_bits(k)) != 0;
      std::int32_t const* perm = kv.at<std::int32_t>(hd.k_perm);
      for (Index c = 0; c < hd.k_channels() && !bad; ++c)
        bad = perm[c] < -1 || perm[c] >= kv.dim;
      if (bad)
        return {Errc::invalid_argument,
                "kvc::attend_packed: a head's descriptor does not fit the view (tokens > max_tokens, channels > "
                "d_k + 4, unpadded segments or k_perm outside [-1, d_k))"};
    }
    float const scale = op.attention.scale > 0 ? op.attention.scale : 1.0f / std::sqrt(static_cast<float>(dk));
    Index const group = q.heads / kv.kv_heads, total_rows = group * q.tokens;
    Index const qf = query_floats(kv), lf = logit_floats(kv), of = value_floats(kv), v_groups = kv.v_groups();
    ZeroPoint const zp = kv.quant.zero_point;
    constexpr Index rg = detail::packed_group, tile = detail::packed_value_tile;
    constexpr float neg_inf = -std::numeric_limits<float>::infinity();

    detail::parallel_for(cpu, kv.batch * kv.kv_heads, [&](Index item, Index worker) {
      Index const b = item / kv.kv_heads, h = item % kv.kv_heads;
      PackedHead const& hd = kv.head(b, h);
      Index const n = hd.tokens, channels = hd.k_channels();
      WorkspaceCarver carve({base + static_cast<std::size_t>(worker) * per_worker, per_worker});
      float* qp = carve.take<float>(max_rows * qf);  // permuted, scaled queries
      float* qa = carve.take<float>(max_rows * qf);  // times the K group's scales
      float* s = carve.take<float>(max_rows * lf);   // logits, then weights
      float* o = carve.take<float>(max_rows * of);
      // The V group biases: 16 lanes per (row, group) across the pass, then their sums.
      float* vbias_lanes = carve.take<float>(max_rows * v_groups * (detail::reduce_lanes + 1));
      float* vbias = vbias_lanes + max_rows * v_groups * detail::reduce_lanes;
      float* ka = carve.take<float>(2 * qf);  // the K group's a, then c, per packed channel
      float* kc = ka + qf;
      // A V tile's a and c per (token, group), and c per (group, token).
      float* vct = carve.take<float>(tile * v_groups);  // a V tile's c per (group, token)
      float* wide = carve.take<float>(2 * std::max(qf, tile * v_groups));
      float* kbias = carve.take<float>(3 * max_rows);
      float* m = kbias + max_rows;
      float* l = m + max_rows;
      Index* q_pos = carve.take<Index>(max_rows);
      Index end = 0;
      if (!queries.positions)
        for (Index hh = 0; hh < kv.kv_heads; ++hh)
          end = std::max(end, kv.head(b, hh).end_position);
      Index const* pos = kv.at<Index>(hd.positions);
      std::int32_t const* perm = kv.at<std::int32_t>(hd.k_perm);
      detail::PackedKSegment seg[3];
      for (int k = 0; k < 3; ++k)
        seg[k] = {kv.at<std::uint8_t>(hd.k_codes[k]), packed_bytes(hd.k_count[k], segment_bits(k)), hd.k_begin(k),
                  segment_bits(k)};
      half const* k_raw = kv.at<half>(hd.k_raw);
      Index const raw_q0 = hd.k_begin(3), raw_count = hd.k_count[3];
      Index const kg = kv.quant.k_group > 0 ? kv.quant.k_group : std::max<Index>(n, 1);
      Index const n_pad = detail::round_lanes(n);

      for (Index r0 = 0; r0 < total_rows; r0 += max_rows) {
        Index const rows = std::min(max_rows, total_rows - r0);
        // 1. Rows r0.. of the group: query head h·g + row / n, query row % n; fp32, scaled, in packed order.
        Index q_min = std::numeric_limits<Index>::max();
        for (Index r = 0; r < rows; ++r) {
          Index const hq = h * group + (r0 + r) / q.tokens, i = (r0 + r) % q.tokens;
          auto const* src = queries.rows.row(b, hq, i);
          for (Index c = 0; c < channels; ++c)
            qp[r * qf + c] = perm[c] >= 0 ? scale * to_float(src[perm[c]]) : 0.0f;
          q_pos[r] = queries.positions ? queries.positions[b * q.tokens + i] : end - q.tokens + i;
          q_min = std::min(q_min, q_pos[r]);
        }
        // 2. Logits, per K token group.
        for (Index t0 = 0; t0 < n; t0 += kg) {
          Index const t1 = std::min(n, t0 + kg), g = t0 / kg;
          for (int k = 0; k < 3; ++k) {
            Index const cnt = hd.k_count[k], c0 = hd.k_begin(k);
            detail::affine_params(kv.at<QuantParams>(hd.k_params[k]) + g * cnt, cnt, zp, wide, ka + c0, kc + c0);
          }
          Index const quantised = hd.k_begin(3);
          for (Index r = 0; r < rows; ++r) {
            float* qar = qa + r * qf;
            float const* qpr = qp + r * qf;
            detail::scale_into(qar, qpr, ka, quantised);
            for (Index i = 0; i < raw_count; ++i)
              qar[raw_q0 + i] = qpr[raw_q0 + i];
            float lanes[detail::reduce_lanes] = {};  // Σ_i q_i c_i in 16 lanes (vectorised, fixed order)
            Index const full = quantised - quantised % detail::reduce_lanes;
            for (Index i = 0; i < full; i += detail::reduce_lanes)
              for (Index j = 0; j < detail::reduce_lanes; ++j)
                lanes[j] += qpr[i + j] * kc[i + j];
            for (Index i = full; i < quantised; ++i)
              lanes[i % detail::reduce_lanes] += qpr[i] * kc[i];
            for (Index width = detail::reduce_lanes / 2; width > 0; width /= 2)
              for (Index j = 0; j < width; ++j)
                lanes[j] += lanes[j + width];
            kbias[r] = lanes[0];
          }
          Index r = 0;
          for (; r + rg <= rows; r += rg)
            detail::packed_logits<rg>(qa + r * qf, qf, kbias + r, seg, k_raw, raw_count, raw_q0, t0, t1, s + r * lf,
                                      lf);
          for (; r < rows; ++r)
            detail::packed_logits<1>(qa + r * qf, qf, kbias + r, seg, k_raw, raw_count, raw_q0, t0, t1, s + r * lf, lf);
        }
        // 3. Mask (packed order is not position order: per token, unless every row is past the head's end), pad
        // to whole lanes with -inf, max, weights, denominator.
        bool const masked = op.attention.causal && n > 0 && q_min < hd.end_position - 1;
        for (Index r = 0; r < rows; ++r) {
          float* sr = s + r * lf;
          if (masked)
            for (Index t = 0; t < n; ++t)
              sr[t] = pos[t] <= q_pos[r] ? sr[t] : neg_inf;
          std::fill(sr + n, sr + n_pad, neg_inf);
          float lanes[detail::reduce_lanes];
          std::fill(lanes, lanes + detail::reduce_lanes, neg_inf);
          for (Index t = 0; t < n_pad; t += detail::reduce_lanes)
            for (Index j = 0; j < detail::reduce_lanes; ++j)
              lanes[j] = lanes[j] < sr[t + j] ? sr[t + j] : lanes[j];
          float peak = neg_inf;
          for (Index j = 0; j < detail::reduce_lanes; ++j)
            peak = peak < lanes[j] ? lanes[j] : peak;
          m[r] = peak;
          if (peak == neg_inf) {  // nothing visible: zero weights, l = 0
            std::fill(sr, sr + n_pad, 0.0f);
            l[r] = 0.0f;
            continue;
          }
          for (Index t = 0; t < n_pad; ++t)
            sr[t] = detail::exp_nonpositive(sr[t] - peak);
          std::fill(lanes, lanes + detail::reduce_lanes, 0.0f);
          for (Index t = 0; t < n_pad; t += detail::reduce_lanes)
            for (Index j = 0; j < detail::reduce_lanes; ++j)
              lanes[j] += sr[t + j];
          for (Index width = detail::reduce_lanes / 2; width > 0; width /= 2)
            for (Index j = 0; j < width; ++j)
              lanes[j] += lanes[j + width];
          l[r] = lanes[0];
        }
        // 4. Values.
        std::fill(o, o + rows * of, 0.0f);
        std::fill(vbias_lanes, vbias_lanes + rows * v_groups * detail::reduce_lanes, 0.0f);
        Index const gsize = kv.quant.v_group > 0 ? kv.quant.v_group : std::max<Index>(dv, 1);
        for (int k = 0; k < 3; ++k) {
          Index const v0 = hd.v_begin(k);
          int const bits = segment_bits(k);
          Index const row_bytes = kv.v_row_bytes(k), per = 8 / bits, vg = kv.quant.v_group;
          std::uint8_t const* codes = kv.at<std::uint8_t>(hd.v_codes[k]);
          QuantParams const* params = kv.at<QuantParams>(hd.v_params[k]);
          bool const fast = row_bytes % detail::reduce_lanes == 0 && (vg == 0 || vg % detail::reduce_lanes == 0);
          unsigned const mask = (1u << static_cast<unsigned>(bits)) - 1u;
          for (Index t0 = 0; t0 < hd.v_count[k]; t0 += tile) {
            Index const tn = std::min(tile, hd.v_count[k] - t0);
            std::uint8_t const* tcodes = codes + t0 * row_bytes;
            detail::affine_pairs(params + t0 * v_groups, tn * v_groups, zp, wide);  // (a, c) per (token, group)
            if (fast) {
              // The per-group bias Σ_t p_t c_{t,g} (16 lanes over the tile's tokens), then the weighted codes.
              for (Index t = 0; t < tn; ++t)
                for (Index g = 0; g < v_groups; ++g)
                  vct[g * tile + t] = wide[2 * (t * v_groups + g) + 1];
              for (Index r = 0; r < rows; ++r) {
                float const* p = s + r * lf + v0 + t0;
                for (Index g = 0; g < v_groups; ++g) {
                  float const* cg = vct + g * tile;
                  float* acc = vbias_lanes + (r * v_groups + g) * detail::reduce_lanes;
                  float lanes[detail::reduce_lanes];  // local: the workspace copy may alias p and cg
                  std::copy(acc, acc + detail::reduce_lanes, lanes);
                  Index const full = tn - tn % detail::reduce_lanes;
                  for (Index t = 0; t < full; t += detail::reduce_lanes)
                    for (Index j = 0; j < detail::reduce_lanes; ++j)
                      lanes[j] += p[t + j] * cg[t + j];
                  for (Index t = full; t < tn; ++t)
                    lanes[t % detail::reduce_lanes] += p[t] * cg[t];
                  std::copy(lanes, lanes + detail::reduce_lanes, acc);
                }
              }
              auto run_fast = [&](auto rg_tag, Index r) {
                constexpr Index RG = decltype(rg_tag)::value;
                float const* p = s + r * lf + v0 + t0;
                float* orow = o + r * of;
                if (per == 4)
                  detail::packed_values_fast<RG, 4>(p, lf, wide, tcodes, row_bytes, v_groups, vg, tn, bits, orow, of);
                else if (per == 2)
                  detail::packed_values_fast<RG, 2>(p, lf, wide, tcodes, row_bytes, v_groups, vg, tn, bits, orow, of);
                else
                  detail::packed_values_fast<RG, 1>(p, lf, wide, tcodes, row_bytes, v_groups, vg, tn, bits, orow, of);
              };
              Index r = 0;
              for (; r + rg <= rows; r += rg)
                run_fast(std::integral_constant<Index, rg>{}, r);
              for (; r < rows; ++r)
                run_fast(std::integral_constant<Index, 1>{}, r);
            } else {
              // Any layout: dequantise each code (x̂ = code a + c, as kvc::dequantize) and weight it.
              for (Index t = 0; t < tn; ++t) {
                std::uint8_t const* row = tcodes + t * row_bytes;
                for (Index j = 0; j < per; ++j)
                  for (Index i = 0; i < row_bytes; ++i) {
                    Index const c = j * row_bytes + i;
                    if (c >= dv)
                      break;
                    Index const g = t * v_groups + c / gsize;
                    float const x = static_cast<float>((row[i] >> (j * bits)) & mask) * wide[2 * g] + wide[2 * g + 1];
                    for (Index r = 0; r < rows; ++r)
                      o[r * of + c] += s[r * lf + v0 + t0 + t] * x;
                  }
              }
            }
          }
        }
        if (hd.v_count[3] > 0) {
          Index const v0 = hd.v_begin(3);
          half const* raw = kv.at<half>(hd.v_raw);
          for (Index t0 = 0; t0 < hd.v_count[3]; t0 += tile) {
            Index const tn = std::min(tile, hd.v_count[3] - t0);
            Index r = 0;
            for (; r + rg <= rows; r += rg)
              detail::packed_values_raw<rg>(s + r * lf + v0 + t0, lf, raw + t0 * dv, dv, tn, o + r * of, of);
            for (; r < rows; ++r)
              detail::packed_values_raw<1>(s + r * lf + v0 + t0, lf, raw + t0 * dv, dv, tn, o + r * of, of);
          }
        }
        for (Index i = 0; i < rows * v_groups; ++i) {  // the biases' lanes by detail::dot's tree
          float* lanes = vbias_lanes + i * detail::reduce_lanes;
          for (Index width = detail::reduce_lanes / 2; width > 0; width /= 2)
            for (Index j = 0; j < width; ++j)
              lanes[j] += lanes[j + width];
          vbias[i] = lanes[0];
        }
        for (Index r = 0; r < rows; ++r) {
          Index const hq = h * group + (r0 + r) / q.tokens, i = (r0 + r) % q.tokens;
          Index const at = (b * q.heads + hq) * q.tokens + i;
          float* dst = out.out + at * dv;
          for (Index c = 0; c < dv; ++c)
            dst[c] = l[r] > 0 ? (o[r * of + c] + vbias[r * v_groups + c / gsize]) / l[r] : 0.0f;
          if (out.lse)
            out.lse[at] = l[r] > 0 ? m[r] + std::log(l[r]) : neg_inf;
        }
      }
    });
    return {};
  }
};

}  // namespace kvc

#undef KVC_PACKED_CONVERT
#undef KVC_PACKED_UNROLL
#undef KVC_PACKED_INLINE
