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
// Everything else is kvc::attend's: detail::PackedSource is an AttendSource of detail::attend_head (the same tiles of
// attend_tile tokens, online softmax, causal mask by position, non-finite logits skipped, GQA row passes and output
// as a cache of any layout or accessor), so packed attention is not a fork of the attention kernel: it supplies the
// query's channel order, the logits and the weighted values of a tile. fp32 throughout; summation orders fixed by the
// layout (16 lanes per dot as detail::dot, tokens in packed order), so results are bit-identical for any thread count
// and any grouping of query rows. Packed order is not position order: the tiles' positions are read from the store.
// Throughput (benchmarks/attention/packed_bench.cpp; decode, g = 4, d = 128, one core): see docs/benchmarks.md. Each
// token's codes are unpacked once for attend_group query rows and two tokens share each query load (as
// attend_logits); the value pass keeps a tile's code rows in L1 while it sweeps their column chunks.
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
  // maskz with a full mask, here and below: the same instructions, without the undefined source operand GCC 12
  // reports as maybe-uninitialized (an error under -Werror in the engines that include this header).
  b.w = _mm512_maskz_cvtepu8_epi32(0xffff, _mm_loadu_si128(reinterpret_cast<__m128i const*>(src)));
}
KVC_PACKED_INLINE void codes_to_lanes(Lanes& out, CodeBytes const& b, int shift, unsigned mask) noexcept {
  __m512 const f =
      _mm512_maskz_cvtepi32_ps(0xffff, _mm512_and_si512(_mm512_maskz_srl_epi32(0xffff, b.w, _mm_cvtsi32_si128(shift)),
                                                        _mm512_set1_epi32(static_cast<int>(mask))));
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

/// s[r * s_stride + t - t0] = bias[r] + <q'_r, codes of token t> for tokens [t0, t1) and RG rows (q' = the scaled query
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
      s[r * s_stride + t - t0] = sums[2 * r] + bias[r];
      s[r * s_stride + t - t0 + 1] = sums[2 * r + 1] + bias[r];
    }
  }
  if (t < t1) {
    Lanes acc[static_cast<std::size_t>(RG)] = {};
    packed_dots<RG, 1>(acc, qa, q_stride, seg, raw, raw_count, raw_q0, t);
    float sums[static_cast<std::size_t>(RG)];
    lanes_sums<RG>(acc, sums, 1);
    KVC_PACKED_UNROLL
    for (Index r = 0; r < RG; ++r)
      s[r * s_stride + t - t0] = sums[r] + bias[r];
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

/// One (sequence, KV head) of a packed store as detail::attend_head reads it (an AttendSource):
///  - prepare: the query row scaled by the logit scale and permuted into packed channel order (pads and pruned
///    channels 0);
///  - logits: per K token group the tile touches, q' = q a and the bias Σ q c once per pass (staged, kept while the
///    group lasts), then packed_logits, attend_group rows per read of a token's codes;
///  - values: per V segment the tile touches, the weighted codes (packed_values_fast, or a per-column path for
///    layouts it cannot take and for tiles with a skipped slot) plus the per-group bias Σ_t p_t c_{t,g}, or the FP16
///    rows of zone B.
/// Scratch (per worker, scratch_bytes): the rows' q', the K group's a and c, the bias per row, a V tile's (a, c) per
/// (token, group) and c per (group, token), the widening buffer.
class PackedSource {
 public:
  /// Floats per prepared query row (packed channels, whole lanes) and per output accumulator row (the V segments'
  /// padded channels: up to 8 / bits - 1 past value_dim).
  static Index query_floats_of(PackedKVView<HostSpace> const& kv) noexcept { return round_lanes(kv.max_k_channels()); }
  static Index value_floats_of(PackedKVView<HostSpace> const& kv) noexcept { return round_lanes(kv.value_dim + 4); }
  static std::size_t scratch_bytes(Index rows, PackedKVView<HostSpace> const& kv) {
    Index const qf = query_floats_of(kv), tile_params = attend_tile * kv.v_groups();
    return bytes_sum(
        workspace_round(bytes_product(rows, qf, sizeof(float))), workspace_round(bytes_product(2, qf, sizeof(float))),
        workspace_round(bytes_product(rows, sizeof(float))), workspace_round(bytes_product(tile_params, sizeof(float))),
        workspace_round(bytes_product(2, std::max(qf, tile_params), sizeof(float))));
  }

  PackedSource(PackedKVView<HostSpace> const& kv, Index b, Index h, Index max_rows, WorkspaceCarver& carve) noexcept
      : kv_(kv),
        hd_(kv.head(b, h)),
        qf_(query_floats_of(kv)),
        of_(value_floats_of(kv)),
        v_groups_(kv.v_groups()),
        kg_(kv.quant.k_group > 0 ? kv.quant.k_group : std::max<Index>(hd_.tokens, 1)),
        gsize_(kv.quant.v_group > 0 ? kv.quant.v_group : std::max<Index>(kv.value_dim, 1)),
        perm_(kv.at<std::int32_t>(hd_.k_perm)),
        pos_(kv.at<Index>(hd_.positions)),
        k_raw_(kv.at<half>(hd_.k_raw)) {
    for (int k = 0; k < 3; ++k)
      seg_[k] = {kv.at<std::uint8_t>(hd_.k_codes[k]), packed_bytes(hd_.k_count[k], segment_bits(k)), hd_.k_begin(k),
                 segment_bits(k)};
    qa_ = carve.take<float>(max_rows * qf_);
    ka_ = carve.take<float>(2 * qf_);
    kc_ = ka_ + qf_;
    kbias_ = carve.take<float>(max_rows);
    vct_ = carve.take<float>(attend_tile * v_groups_);
    wide_ = carve.take<float>(2 * std::max(qf_, attend_tile * v_groups_));
  }

  Index tokens() const noexcept { return hd_.tokens; }
  Index query_floats() const noexcept { return qf_; }
  Index value_floats() const noexcept { return of_; }
  Index value_dim() const noexcept { return kv_.value_dim; }

  template <class T>
  void prepare(float* dst, T const* src, float scale) const noexcept {
    Index const channels = hd_.k_channels();
    for (Index c = 0; c < channels; ++c)
      dst[c] = perm_[c] >= 0 ? scale * to_float(src[perm_[c]]) : 0.0f;
    std::fill(dst + channels, dst + qf_, 0.0f);
  }
  void rows_ready() noexcept { staged_ = -1; }
  Index const* positions(Index t0, Index, Index*) const noexcept { return pos_ + t0; }

  void logits(float const* q, Index rows, Index t0, Index tn, float* s) noexcept {
    Index const raw_q0 = hd_.k_begin(3), raw_count = hd_.k_count[3];
    for (Index t = t0; t < t0 + tn;) {
      Index const g = t / kg_, t1 = std::min(t0 + tn, (g + 1) * kg_);
      if (g != staged_)
        stage(q, rows, g);
      for_row_groups(rows, [&](auto group, Index r) {
        packed_logits<decltype(group)::value>(qa_ + r * qf_, qf_, kbias_ + r, seg_, k_raw_, raw_count, raw_q0, t, t1,
                                              s + r * attend_tile + (t - t0), attend_tile);
      });
      t = t1;
    }
  }

  void values(float const* p, Index rows, Index t0, Index tn, bool skipped, float* o) noexcept {
    for (int k = 0; k < packed_segments; ++k) {
      Index const vb = hd_.v_begin(k), a = std::max(t0, vb), e = std::min(t0 + tn, vb + hd_.v_count[k]);
      if (a < e)
        segment_values(k, p + (a - t0), rows, a - vb, e - a, skipped, o);
    }
  }

 private:
  /// q' = q a of K group g for every row, raw FP16 channels copied, and the bias Σ_i q_i c_i (16 lanes, fixed order).
  void stage(float const* q, Index rows, Index g) noexcept {
    ZeroPoint const zp = kv_.quant.zero_point;
    for (int k = 0; k < 3; ++k) {
      Index const cnt = hd_.k_count[k], c0 = hd_.k_begin(k);
      affine_params(kv_.at<QuantParams>(hd_.k_params[k]) + g * cnt, cnt, zp, wide_, ka_ + c0, kc_ + c0);
    }
    Index const quantised = hd_.k_begin(3), raw_q0 = quantised, raw_count = hd_.k_count[3];
    for (Index r = 0; r < rows; ++r) {
      float* qar = qa_ + r * qf_;
      float const* qr = q + r * qf_;
      scale_into(qar, qr, ka_, quantised);
      for (Index i = 0; i < raw_count; ++i)
        qar[raw_q0 + i] = qr[raw_q0 + i];
      kbias_[r] = dot(qr, kc_, quantised);
    }
    staged_ = g;
  }

  /// o += the weighted values of tokens [u0, u0 + un) of V segment k (weights p, attend_tile per row).
  void segment_values(int k, float const* p, Index rows, Index u0, Index un, bool skipped, float* o) noexcept {
    Index const dv = kv_.value_dim;
    if (k == 3) {  // zone B: FP16 rows
      half const* raw = kv_.at<half>(hd_.v_raw) + u0 * dv;
      if (skipped) [[unlikely]] {
        for (Index r = 0; r < rows; ++r)
          for (Index t = 0; t < un; ++t)
            if (float const w = p[r * attend_tile + t]; w != 0.0f)
              for (Index c = 0; c < dv; ++c)
                o[r * of_ + c] += w * to_float(raw[t * dv + c]);
        return;
      }
      for_row_groups(rows, [&](auto group, Index r) {
        packed_values_raw<decltype(group)::value>(p + r * attend_tile, attend_tile, raw, dv, un, o + r * of_, of_);
      });
      return;
    }
    int const bits = segment_bits(k);
    Index const row_bytes = kv_.v_row_bytes(k), per = 8 / bits, vg = kv_.quant.v_group;
    std::uint8_t const* codes = kv_.at<std::uint8_t>(hd_.v_codes[k]) + u0 * row_bytes;
    affine_pairs(kv_.at<QuantParams>(hd_.v_params[k]) + u0 * v_groups_, un * v_groups_, kv_.quant.zero_point,
                 wide_);  // (a, c) per (token, group)
    bool const fast = row_bytes % reduce_lanes == 0 && (vg == 0 || vg % reduce_lanes == 0);
    if (!fast || skipped) {
      // Any layout: dequantise each code (x̂ = code a + c, as kvc::dequantize) and weight it; zero weights left out.
      unsigned const mask = (1u << static_cast<unsigned>(bits)) - 1u;
      for (Index t = 0; t < un; ++t) {
        std::uint8_t const* row = codes + t * row_bytes;
        for (Index j = 0; j < per; ++j)
          for (Index i = 0; i < row_bytes; ++i) {
            Index const c = j * row_bytes + i;
            if (c >= dv)
              break;
            Index const g = t * v_groups_ + c / gsize_;
            float const x = static_cast<float>((row[i] >> (j * bits)) & mask) * wide_[2 * g] + wide_[2 * g + 1];
            for (Index r = 0; r < rows; ++r)
              if (float const w = p[r * attend_tile + t]; w != 0.0f)
                o[r * of_ + c] += w * x;
          }
      }
      return;
    }
    // The per-group bias Σ_t p_t c_{t,g} (16 lanes over the tokens, detail::dot's tree), added to the group's
    // columns; then the weighted codes.
    for (Index t = 0; t < un; ++t)
      for (Index g = 0; g < v_groups_; ++g)
        vct_[g * attend_tile + t] = wide_[2 * (t * v_groups_ + g) + 1];
    for (Index r = 0; r < rows; ++r) {
      float const* pr = p + r * attend_tile;
      for (Index g = 0; g < v_groups_; ++g) {
        float const bias = dot(pr, vct_ + g * attend_tile, un);
        for (Index c = g * gsize_; c < std::min(dv, (g + 1) * gsize_); ++c)
          o[r * of_ + c] += bias;
      }
    }
    for_row_groups(rows, [&](auto group, Index r) {
      constexpr Index RG = decltype(group)::value;
      float const* pr = p + r * attend_tile;
      float* orow = o + r * of_;
      if (per == 4)
        packed_values_fast<RG, 4>(pr, attend_tile, wide_, codes, row_bytes, v_groups_, vg, un, bits, orow, of_);
      else if (per == 2)
        packed_values_fast<RG, 2>(pr, attend_tile, wide_, codes, row_bytes, v_groups_, vg, un, bits, orow, of_);
      else
        packed_values_fast<RG, 1>(pr, attend_tile, wide_, codes, row_bytes, v_groups_, vg, un, bits, orow, of_);
    });
  }

  PackedKVView<HostSpace> const& kv_;
  PackedHead const& hd_;
  Index qf_, of_, v_groups_;
  Index kg_;     // K group tokens (the head's tokens for whole-axis groups)
  Index gsize_;  // V group channels
  std::int32_t const* perm_;
  Index const* pos_;
  half const* k_raw_;
  PackedKSegment seg_[3];
  float *qa_ = nullptr, *ka_ = nullptr, *kc_ = nullptr, *kbias_ = nullptr, *vct_ = nullptr, *wide_ = nullptr;
  Index staged_ = -1;  // the K group whose q' and bias are in qa_ and kbias_
};

}  // namespace detail

/// One (sequence, KV head) per item through the backend's parallel-for: detail::attend_head over a
/// detail::PackedSource; per worker scratch from the workspace; no allocation.
template <>
struct Kernel<PackedAttention, Cpu> {
  static std::size_t worker_bytes(Index rows, PackedKVView<HostSpace> const& kv) {
    using Source = detail::PackedSource;
    return bytes_sum(detail::AttendScratch::bytes(rows, Source::query_floats_of(kv), Source::value_floats_of(kv)),
                     Source::scratch_bytes(rows, kv));
  }
  template <class Q>
  static std::size_t workspace_bytes(Cpu const& cpu, PackedAttention const&, Q const& queries,
                                     PackedKVView<HostSpace> const& kv) {
    return bytes_product(cpu.workers(),
                         worker_bytes(detail::attend_pass_rows(queries.rows.extents(), kv.kv_heads), kv));
  }

  template <Element T>
  static Status run(Cpu const& cpu, PackedAttention const& op, AttendQueries<T, HostSpace> const& queries,
                    PackedKVView<HostSpace> const& kv, AttendOutput<HostSpace> out, Workspace ws) {
    using Source = detail::PackedSource;
    KVExtents const q = queries.rows.extents();
    Index const max_rows = detail::attend_pass_rows(q, kv.kv_heads);
    std::size_t const per_worker = worker_bytes(max_rows, kv);
    auto* base = WorkspaceCarver(ws).take<std::byte>(static_cast<Index>(workspace_bytes(cpu, op, queries, kv)));
    if (base == nullptr && max_rows > 0)
      return {Errc::out_of_capacity, "kvc::attend_packed: workspace smaller than attend_packed_workspace_bytes()"};
    // The descriptors are read on the host: a view not built by kvc::pack is checked before anything is read
    // through it (token and channel counts within the view's bounds, packable counts, channels in [-1, d_k)).
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
    float const scale = op.attention.scale > 0 ? op.attention.scale : 1.0f / std::sqrt(static_cast<float>(kv.dim));
    detail::parallel_for(cpu, kv.batch * kv.kv_heads, [&](Index item, Index worker) {
      Index const b = item / kv.kv_heads, h = item % kv.kv_heads;
      WorkspaceCarver carve({base + static_cast<std::size_t>(worker) * per_worker, per_worker});
      detail::AttendScratch const w =
          detail::AttendScratch::carve(carve, max_rows, Source::query_floats_of(kv), Source::value_floats_of(kv));
      Source src(kv, b, h, max_rows, carve);
      detail::attend_head(src, op.attention, queries, b, h, q.heads / kv.kv_heads, scale,
                          queries.positions ? 0 : kv.context_end(b), max_rows, w, out);
    });
    return {};
  }
};

}  // namespace kvc

#undef KVC_PACKED_CONVERT
#undef KVC_PACKED_UNROLL
#undef KVC_PACKED_INLINE
