// SPDX-License-Identifier: Apache-2.0
// kvc/backend/cpu/detail/attend.hpp: CPU attention kernel and the full-vs-compressed error measurement.
// Shared: corrected and packed attention build on it; the public header is kvc/backend/cpu/attention/attend.hpp.
#pragma once

#include <kvc/attention/attend.hpp>
#include <kvc/backend/cpu/detail/for_each_head.hpp>
#include <kvc/backend/cpu/detail/rows.hpp>

#include <algorithm>
#include <bit>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>

namespace kvc {
namespace detail {

/// Slots per tile: the unit of the online softmax (one max, one rescale per row and tile) and of the row-pointer
/// lists. 64 is a multiple of reduce_lanes, so each row's max, exponentials and sum run over whole vectors of a
/// fixed count, and a tile's K and V (32 KiB at d = 128 in fp16), prefetched one tile ahead, fit the L1 and L2
/// caches next to the tile being computed.
inline constexpr Index attend_tile = 64;
/// Query rows one pass over a head's slots serves (bounds the workspace; decode has g·n rows, 4 for g = 4, n = 1;
/// a long prefill re-reads K and V once per 64 rows, where the 64 dot products per slot dominate anyway).
inline constexpr Index attend_block_rows = 64;
/// Query rows whose logits and value sums one inner loop computes together: each K or V element loaded from the
/// tile feeds this many rows' accumulators (kept in registers).
inline constexpr Index attend_group = 4;

/// e^x for x <= 0 (x = -inf gives exactly 0, x = 0 exactly 1, NaN stays NaN): Cephes' expf (Cody-Waite reduction by
/// ln 2, degree-5 polynomial, within ~1 ulp of std::exp), branch-free so that a loop of it vectorises without
/// -ffast-math (std::exp in a loop stays a scalar libm call per weight, 4 per slot at decode). Arguments below -87
/// (e^-87 ~ 1.6e-38, the end of the normal range) give 0. One definition for the vector loop and the scalar rescale
/// factor, so a weight never depends on where it is computed.
inline float exp_nonpositive(float x) noexcept {
  float const v = x >= -87.0f ? x : -87.0f;  // NaN too: the conversion to int below must stay defined
  float const n = (v * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest (1.5 * 2^23)
  float const r = (v - n * 0.693359375f) - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  float const e = p * (r * r) + r + 1.0f;
  float const two_n = std::bit_cast<float>((static_cast<std::int32_t>(n) + 127) << 23);  // 2^n, n in [-126, 0]
  return x >= -87.0f ? e * two_n : (x < -87.0f ? 0.0f : x);
}

/// x[i] = e^(x[i] - shift) for i in [0, attend_tile), where every x[i] <= shift.
inline void exp_shifted(float* x, float shift) noexcept {
  for (Index i = 0; i < attend_tile; ++i)
    x[i] = exp_nonpositive(x[i] - shift);
}

/// K and V rows whose cache lines attend_logits asks for while it computes (the next tile's): `keys[j]` and
/// `values[j]` for j < n, `key_bytes` and `value_bytes` each.
template <class KT, class VT>
struct TileAhead {
  KT const* const* keys = nullptr;
  VT const* const* values = nullptr;
  Index n = 0;
  Index key_bytes = 0;
  Index value_bytes = 0;
};

/// Prefetches slot j's rows of `ahead` (GCC/Clang; nothing elsewhere). Inlined into attend_logits on purpose: a
/// separate function holding only prefetches is "const" to GCC's IPA, which then deletes its calls.
#if defined(__GNUC__)
#  define KVC_ATTEND_PREFETCH(ahead, j)                                              \
    do {                                                                             \
      if ((j) < (ahead).n) {                                                         \
        for (Index at = 0; at < (ahead).key_bytes; at += 64)                         \
          __builtin_prefetch(reinterpret_cast<char const*>((ahead).keys[j]) + at);   \
        for (Index at = 0; at < (ahead).value_bytes; at += 64)                       \
          __builtin_prefetch(reinterpret_cast<char const*>((ahead).values[j]) + at); \
      }                                                                              \
    } while (false)
#else
#  define KVC_ATTEND_PREFETCH(ahead, j) (void)(ahead)
#endif

/// reduce_lanes fp32 lanes held in one register (or a few) across a loop: a GCC/Clang generic vector, which both
/// compilers lower to the target's own vectors (one zmm with AVX-512, two ymm with AVX2, four xmm with SSE or NEON).
/// Why not plain loops: GCC 12 does vectorise the lane loops below, but keeps the accumulators of several query rows
/// in memory (a store and a reload per slot) or vectorises across slots with gathers instead; either way the kernel
/// ran at ~0.2 of the memory bound (docs/benchmarks.md). Elsewhere, an array with the same lanes and order.
#if defined(__GNUC__)
using Lanes = float __attribute__((vector_size(reduce_lanes * sizeof(float))));
#else
struct Lanes {
  float v[reduce_lanes];
  float& operator[](Index l) noexcept { return v[l]; }
  float operator[](Index l) const noexcept { return v[l]; }
};
inline void operator+=(Lanes& a, Lanes const& b) noexcept {
  for (Index l = 0; l < reduce_lanes; ++l)
    a[l] += b[l];
}
#endif
// Lanes go by reference, never by value: GCC warns (-Wpsabi) when a 64-byte vector crosses a call without AVX-512.

#if defined(__GNUC__) && defined(__has_builtin)
#  if __has_builtin(__builtin_shufflevector)  // GCC >= 12, Clang
#    define KVC_ATTEND_SHUFFLE 1
#  endif
#endif

/// Loads reduce_lanes elements of a K, V or query row, widened to fp32 in registers (detail::widen: F16C where
/// compiled; the round trip through `wide` is folded away by the compiler).
template <class T>
inline void lanes_load(Lanes& a, T const* src) noexcept {
  if constexpr (std::is_same_v<std::remove_const_t<T>, float>) {
    std::memcpy(&a, src, sizeof(Lanes));
#if defined(KVC_ATTEND_SHUFFLE)
  } else if constexpr (std::is_same_v<std::remove_const_t<T>, bfloat16>) {
    // bits << 16 in registers: interleave the 16-bit values with zeros (one permute; __builtin_convertvector to
    // 32 bits plus a shift took five instructions with GCC 12).
    using Bits16 = std::uint16_t __attribute__((vector_size(reduce_lanes * sizeof(std::uint16_t))));
    using Bits32 = std::uint16_t __attribute__((vector_size(2 * reduce_lanes * sizeof(std::uint16_t))));
    static_assert(sizeof(bfloat16) == sizeof(std::uint16_t) && sizeof(Bits32) == sizeof(Lanes));
    Bits16 bits, zero = {};
    std::memcpy(&bits, src, sizeof bits);
    Bits32 const wide = __builtin_shufflevector(zero, bits, 0, 16, 0, 17, 0, 18, 0, 19, 0, 20, 0, 21, 0, 22, 0, 23, 0,
                                                24, 0, 25, 0, 26, 0, 27, 0, 28, 0, 29, 0, 30, 0, 31);
    std::memcpy(&a, &wide, sizeof(Lanes));
#endif
#if defined(KVC_ATTEND_SHUFFLE) && KVC_CPU_F16_CONVERT == 1
  } else if constexpr (is_fp8<T>) {
    // Two 8-wide F16C conversions joined in registers: through a 16-float array, two 32-byte stores feed one 64-byte
    // load under AVX-512, which store forwarding cannot serve (measured: fp8 attention slower than fp16).
    using Lanes8 = float __attribute__((vector_size(8 * sizeof(float))));
    Lanes8 lo, hi;
    __m256 const x = f16c_load8(src), y = f16c_load8(src + 8);
    std::memcpy(&lo, &x, sizeof lo);
    std::memcpy(&hi, &y, sizeof hi);
    a = __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#endif
  } else {
    float wide[reduce_lanes];
#if KVC_CPU_F16_CONVERT == 1 && defined(__AVX512F__)
    if constexpr (std::is_same_v<std::remove_const_t<T>, half>)
      widen(src, wide, reduce_lanes);  // one 16-wide conversion
    else
#endif
      for (Index l = 0; l < reduce_lanes; l += 8)
        widen8(src + l, wide + l);
    std::memcpy(&a, wide, sizeof(Lanes));
  }
}
/// lanes_load of a cache row's elements under its view's scale (core/access.hpp): one product per lane for scaled
/// views, the dequantised values exactly; nothing more for Unit.
template <class T, class S>
inline void lanes_load(Lanes& a, T const* src, S scale) noexcept {
  if constexpr (std::is_same_v<S, Unit>) {
    lanes_load(a, src);
#if KVC_CPU_F16_CONVERT == 1 && defined(__AVX2__)
  } else if constexpr (is_fp8<T> && std::is_same_v<S, LaneScale<std::remove_const_t<T>>>) {
    // fp8 under a LaneScale (attend's kernels prepare one per head): 16 bytes widened at once, no branch.
    constexpr bool twice = f16c_unbias<T> != 1.0f;  // E4M3: see LaneScale
    __m256i const bits = f16c_bits16(src);
#  if defined(__AVX512F__)
    __m512 x = _mm512_mul_ps(_mm512_maskz_cvtph_ps(0xffff, bits), _mm512_set1_ps(scale.first));
    if constexpr (twice)
      x = _mm512_mul_ps(x, _mm512_set1_ps(scale.second));
    std::memcpy(&a, &x, sizeof(Lanes));
#  else  // Lanes is two ymm registers here: each half written in place
    __m256 lo = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(bits)), _mm256_set1_ps(scale.first));
    __m256 hi = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(bits, 1)), _mm256_set1_ps(scale.first));
    if constexpr (twice) {
      lo = _mm256_mul_ps(lo, _mm256_set1_ps(scale.second));
      hi = _mm256_mul_ps(hi, _mm256_set1_ps(scale.second));
    }
    std::memcpy(&a, &lo, sizeof lo);
    std::memcpy(reinterpret_cast<char*>(&a) + sizeof lo, &hi, sizeof hi);
#  endif
#endif
  } else {
    lanes_load(a, src);
    a *= 1.0f * scale;  // the scale's float value (a LaneScale's or a float)
  }
}
inline void lanes_store(float* dst, Lanes const& a) noexcept {
  std::memcpy(dst, &a, sizeof(Lanes));
}
/// a += x * y, lane by lane.
inline void lanes_fma(Lanes& a, Lanes const& x, Lanes const& y) noexcept {
#if defined(__GNUC__)
  a += x * y;
#else
  for (Index l = 0; l < reduce_lanes; ++l)
    a[l] += x[l] * y[l];
#endif
}
/// a += w * y, lane by lane.
inline void lanes_fma(Lanes& a, float w, Lanes const& y) noexcept {
#if defined(__GNUC__)
  a += w * y;
#else
  for (Index l = 0; l < reduce_lanes; ++l)
    a[l] += w * y[l];
#endif
}

/// The lanes' sum by the tree of detail::dot: lane l += lane l + width for width = 8, 4, 2, 1.
inline float lanes_sum(Lanes const& a) noexcept {
#if defined(KVC_ATTEND_SHUFFLE)  // halves in registers (a memcpy of a half went through the stack)
  using Lanes8 = float __attribute__((vector_size(8 * sizeof(float))));
  using Lanes4 = float __attribute__((vector_size(4 * sizeof(float))));
  Lanes8 const h8 = __builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7) +
                    __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15);
  Lanes4 const h4 = __builtin_shufflevector(h8, h8, 0, 1, 2, 3) + __builtin_shufflevector(h8, h8, 4, 5, 6, 7);
  return (h4[0] + h4[2]) + (h4[1] + h4[3]);
#else
  float t[reduce_lanes];
  std::memcpy(t, &a, sizeof t);
  for (Index l = 0; l < 8; ++l)
    t[l] += t[l + 8];
  for (Index l = 0; l < 4; ++l)
    t[l] += t[l + 4];
  return (t[0] + t[2]) + (t[1] + t[3]);
#endif
}

/// out[r * stride] = lanes_sum(acc[r]) for RG rows. For RG = 4 (GCC >= 12 and Clang), the four trees run side by
/// side in shared vectors (10 shuffles and 5 adds instead of 16 and 16): the same additions in the same order, so
/// every row's sum is bit-identical to lanes_sum's.
template <Index RG>
inline void lanes_sums(Lanes const* acc, float* out, Index stride) noexcept {
#if defined(KVC_ATTEND_SHUFFLE)
  if constexpr (RG == 4) {
    using Lanes8 = float __attribute__((vector_size(8 * sizeof(float))));
    using Lanes4 = float __attribute__((vector_size(4 * sizeof(float))));
    // [x_l + x_{l+8}, l < 8] for x = a | b, then c | d.
    Lanes const ab =
        __builtin_shufflevector(acc[0], acc[1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
        __builtin_shufflevector(acc[0], acc[1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    Lanes const cd =
        __builtin_shufflevector(acc[2], acc[3], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
        __builtin_shufflevector(acc[2], acc[3], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    // [x_l + x_{l+4}, l < 4] for x = a | b | c | d.
    Lanes const t = __builtin_shufflevector(ab, cd, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
                    __builtin_shufflevector(ab, cd, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    // [x_0 + x_2, x_1 + x_3], then their sum.
    Lanes8 const u = __builtin_shufflevector(t, t, 0, 1, 4, 5, 8, 9, 12, 13) +
                     __builtin_shufflevector(t, t, 2, 3, 6, 7, 10, 11, 14, 15);
    Lanes4 const v = __builtin_shufflevector(u, u, 0, 2, 4, 6) + __builtin_shufflevector(u, u, 1, 3, 5, 7);
    for (Index r = 0; r < 4; ++r)
      out[r * stride] = v[r];
    return;
  }
#endif
  for (Index r = 0; r < RG; ++r)
    out[r * stride] = lanes_sum(acc[r]);
}

/// lanes_sums of two slots' accumulators a (slot j) and b (slot j + 1) into out[r * stride] and out[r * stride + 1].
/// For RG = 4 (GCC >= 12 and Clang), the eight trees share vectors (16 shuffles and 8 adds): again the additions of
/// lanes_sum, in its order.
template <Index RG>
inline void lanes_sums2(Lanes const* a, Lanes const* b, float* out, Index stride) noexcept {
#if defined(KVC_ATTEND_SHUFFLE)
  if constexpr (RG == 4) {
    using Lanes8 = float __attribute__((vector_size(8 * sizeof(float))));
    // x_r = [a_r,l + a_r,l+8 | b_r,l + b_r,l+8], l < 8.
    Lanes x[4];
    for (Index r = 0; r < 4; ++r)
      x[r] = __builtin_shufflevector(a[r], b[r], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
             __builtin_shufflevector(a[r], b[r], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    // Lane l += lane l + 4 (l < 4) of each 8: [a_0 | b_0 | a_1 | b_1] and [a_2 | b_2 | a_3 | b_3], 4 lanes each.
    Lanes const y01 = __builtin_shufflevector(x[0], x[1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
                      __builtin_shufflevector(x[0], x[1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    Lanes const y23 = __builtin_shufflevector(x[2], x[3], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
                      __builtin_shufflevector(x[2], x[3], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    // [l0 + l2, l1 + l3] of each 4, then their sums: [a_0, b_0, a_1, b_1, a_2, b_2, a_3, b_3].
    Lanes const z = __builtin_shufflevector(y01, y23, 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
                    __builtin_shufflevector(y01, y23, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    Lanes8 const w = __builtin_shufflevector(z, z, 0, 2, 4, 6, 8, 10, 12, 14) +
                     __builtin_shufflevector(z, z, 1, 3, 5, 7, 9, 11, 13, 15);
    for (Index r = 0; r < 4; ++r) {
      out[r * stride] = w[2 * r];
      out[r * stride + 1] = w[2 * r + 1];
    }
    return;
  }
#endif
  lanes_sums<RG>(a, out, stride);
  lanes_sums<RG>(b, out + 1, stride);
}

/// The largest of x[0, attend_tile): reduce_lanes running maxima, then halves (a NaN is skipped, as std::max skips
/// a NaN second argument).
inline float tile_max(float const* x) noexcept {
  float t[reduce_lanes];
#if defined(__GNUC__)
  Lanes m;
  lanes_load(m, x);
  for (Index i = reduce_lanes; i < attend_tile; i += reduce_lanes) {
    Lanes y;
    lanes_load(y, x + i);
    m = m < y ? y : m;
  }
  std::memcpy(t, &m, sizeof t);
#else
  std::memcpy(t, x, sizeof t);
  for (Index i = reduce_lanes; i < attend_tile; i += reduce_lanes)
    for (Index l = 0; l < reduce_lanes; ++l)
      t[l] = t[l] < x[i + l] ? x[i + l] : t[l];
#endif
  float peak = t[0];
  for (Index l = 1; l < reduce_lanes; ++l)
    peak = peak < t[l] ? t[l] : peak;
  return peak;
}

/// The sum of x[0, attend_tile): reduce_lanes running sums, then lanes_sum's tree (fixed order: deterministic).
inline float tile_sum(float const* x) noexcept {
  Lanes acc = {};
  for (Index i = 0; i < attend_tile; i += reduce_lanes) {
    Lanes y;
    lanes_load(y, x + i);
    acc += y;
  }
  return lanes_sum(acc);
}

/// s[r * attend_tile + j] = <q_r, k_j> for the RG query rows q (contiguous, `dim` floats apart) and the tile's `tn`
/// key rows. Two slots at a time (2·RG independent accumulators in registers, enough to cover the FMA latency); each
/// key chunk is read and widened once for the RG rows; each row's products go into reduce_lanes partial sums reduced
/// by the tree of detail::dot, the same arithmetic whatever RG is. Asks for `ahead`'s rows as it goes.
template <Index RG, class T, class VT, class S>
inline void attend_logits(float const* q, Index dim, T const* const* keys, S scale, Index tn, float* s,
                          TileAhead<T, VT> const& ahead) noexcept {
  // Bounds computed up front (not carried from one loop to the next), so that GCC does not warn about the tail
  // loops when the shapes are constants.
  Index const full = dim - dim % reduce_lanes, pairs = tn - tn % 2;
  for (Index j = 0; j < pairs; j += 2) {
    KVC_ATTEND_PREFETCH(ahead, j);
    KVC_ATTEND_PREFETCH(ahead, j + 1);
    T const* k0 = keys[j];
    T const* k1 = keys[j + 1];
    Lanes acc0[static_cast<std::size_t>(RG)] = {}, acc1[static_cast<std::size_t>(RG)] = {};
    for (Index c = 0; c < full; c += reduce_lanes) {
      Lanes x0, x1;
      lanes_load(x0, k0 + c, scale);
      lanes_load(x1, k1 + c, scale);
      for (Index r = 0; r < RG; ++r) {
        Lanes qc;
        lanes_load(qc, q + r * dim + c);
        lanes_fma(acc0[r], x0, qc);
        lanes_fma(acc1[r], x1, qc);
      }
    }
    for (Index c = full; c < dim; ++c)
      for (Index r = 0; r < RG; ++r) {
        acc0[r][c % reduce_lanes] += load(k0[c], scale) * q[r * dim + c];
        acc1[r][c % reduce_lanes] += load(k1[c], scale) * q[r * dim + c];
      }
    lanes_sums2<RG>(acc0, acc1, s + j, attend_tile);
  }
  if (pairs < tn) {  // the last slot of an odd tile
    Index const j = pairs;
    KVC_ATTEND_PREFETCH(ahead, j);
    T const* k0 = keys[j];
    Lanes acc0[static_cast<std::size_t>(RG)] = {};
    for (Index c = 0; c < full; c += reduce_lanes) {
      Lanes x0;
      lanes_load(x0, k0 + c, scale);
      for (Index r = 0; r < RG; ++r) {
        Lanes qc;
        lanes_load(qc, q + r * dim + c);
        lanes_fma(acc0[r], x0, qc);
      }
    }
    for (Index c = full; c < dim; ++c)
      for (Index r = 0; r < RG; ++r)
        acc0[r][c % reduce_lanes] += load(k0[c], scale) * q[r * dim + c];
    lanes_sums<RG>(acc0, s + j, attend_tile);
  }
}

/// o[r * dim + c, +CH·reduce_lanes) += sum_j p[r * attend_tile + j] * v_j[c, ...) for the RG rows, slots in order:
/// RG·CH accumulators stay in registers across the tile's slots (RG·CH independent FMA chains), and each value
/// chunk is read and widened once for the RG rows.
template <Index RG, Index CH, class T, class S>
inline void attend_values_chunks(float const* p, T const* const* values, S scale, Index tn, Index dim, Index c,
                                 float* o) noexcept {
  Lanes acc[static_cast<std::size_t>(RG)][static_cast<std::size_t>(CH)];
  for (Index r = 0; r < RG; ++r)
    for (Index u = 0; u < CH; ++u)
      lanes_load(acc[r][u], o + r * dim + c + u * reduce_lanes);
  for (Index j = 0; j < tn; ++j) {
    Lanes x[static_cast<std::size_t>(CH)];
    for (Index u = 0; u < CH; ++u)
      lanes_load(x[u], values[j] + c + u * reduce_lanes, scale);
    for (Index r = 0; r < RG; ++r) {
      float const w = p[r * attend_tile + j];
      for (Index u = 0; u < CH; ++u)
        lanes_fma(acc[r][u], w, x[u]);
    }
  }
  for (Index r = 0; r < RG; ++r)
    for (Index u = 0; u < CH; ++u)
      lanes_store(o + r * dim + c + u * reduce_lanes, acc[r][u]);
}

/// o[r * dim + c] += sum_j p[r * attend_tile + j] * v_j[c] for the RG rows and every column: 4 chunks of
/// reduce_lanes columns per pass over the tile, then single chunks, then single columns; each column's sum takes the
/// slots in order, so a row's arithmetic does not depend on RG.
template <Index RG, class T, class S>
inline void attend_values(float const* p, T const* const* values, S scale, Index tn, Index dim, float* o) noexcept {
  constexpr Index wide = 4 * reduce_lanes;
  Index const wide_end = dim - dim % wide, full = dim - dim % reduce_lanes;
  for (Index c = 0; c < wide_end; c += wide)
    attend_values_chunks<RG, 4>(p, values, scale, tn, dim, c, o);
  for (Index c = wide_end; c < full; c += reduce_lanes)
    attend_values_chunks<RG, 1>(p, values, scale, tn, dim, c, o);
  for (Index c = full; c < dim; ++c)
    for (Index r = 0; r < RG; ++r) {
      float a = o[r * dim + c];
      for (Index j = 0; j < tn; ++j)
        a += p[r * attend_tile + j] * load(values[j][c], scale);
      o[r * dim + c] = a;
    }
}

/// o[r * dim + c] += sum_j p[r * attend_tile + j] * v_j[c] for `rows` rows, leaving out the slots of weight 0 (so a
/// non-finite value of a skipped or masked slot does not enter): the rare path of a tile with a non-finite logit.
/// Each column sums its slots in order, as attend_values does.
template <class T, class S>
inline void attend_values_nonzero(float const* p, T const* const* values, S scale, Index tn, Index dim, float* o,
                                  Index rows) noexcept {
  for (Index r = 0; r < rows; ++r)
    for (Index j = 0; j < tn; ++j)
      if (float const w = p[r * attend_tile + j]; w != 0.0f)
        for (Index c = 0; c < dim; ++c)
          o[r * dim + c] += w * load(values[j][c], scale);
}

/// f(std::integral_constant<Index, attend_group>{}, r) for each whole group of attend_group rows from r, then
/// f(std::integral_constant<Index, 1>{}, r) for each remaining row: how every attention micro-kernel blocks a pass's
/// rows (a row's arithmetic does not depend on the group it is computed in).
template <class F>
inline void for_row_groups(Index rows, F&& f) {
  Index r = 0;
  for (; r + attend_group <= rows; r += attend_group)
    f(std::integral_constant<Index, attend_group>{}, r);
  for (; r < rows; ++r)
    f(std::integral_constant<Index, 1>{}, r);
}

/// Per-worker scratch of attend_head for a pass of `rows` query rows: the prepared queries [rows][query_floats],
/// output accumulators [rows][value_floats], one tile's logits, then weights [rows][attend_tile], the running max and
/// denominator [rows] each (fp32), and the rows' positions [rows].
struct AttendScratch {
  float* q = nullptr;
  float* o = nullptr;
  float* s = nullptr;
  float* m = nullptr;
  float* l = nullptr;
  Index* pos = nullptr;

  static std::size_t bytes(Index rows, Index query_floats, Index value_floats) {
    return bytes_sum(workspace_round(bytes_product(rows, query_floats, sizeof(float))),
                     workspace_round(bytes_product(rows, value_floats, sizeof(float))),
                     workspace_round(bytes_product(rows, attend_tile, sizeof(float))),
                     workspace_round(bytes_product(2, rows, sizeof(float))),
                     workspace_round(bytes_product(rows, sizeof(Index))));
  }
  static AttendScratch carve(WorkspaceCarver& carve, Index rows, Index query_floats, Index value_floats) noexcept {
    AttendScratch w;
    w.q = carve.take<float>(rows * query_floats);
    w.o = carve.take<float>(rows * value_floats);
    w.s = carve.take<float>(rows * attend_tile);
    w.m = carve.take<float>(2 * rows);
    w.l = w.m + rows;
    w.pos = carve.take<Index>(rows);
    return w;
  }
};

/// What attend_head reads of one (sequence, KV head): its tokens, in tiles of at most attend_tile consecutive tokens
/// (t0 a multiple of attend_tile). Two sources implement it: CacheSource (a KV view of any layout and accessor: fp32,
/// fp16, bf16, fp8 with scales) and the packed store of RDKV and KIVI (backend/cpu/attention/packed.hpp), so the
/// softmax, the causal mask, non-finite handling, GQA row blocks and the output are written once for both.
///  - prepare(dst, src, scale): one query row of d_k elements into query_floats() fp32 values, times the logit scale
///    (the source's own channel order; a packed store permutes and prunes);
///  - rows_ready(): the pass's prepared rows are in place (a source may derive per-pass data from them);
///  - positions(t0, tn, scratch): the tile's positions (in place or written to scratch [attend_tile]);
///  - logits(q, rows, t0, tn, s): s[r * attend_tile + j] = <q_r, k_{t0 + j}> for the pass's rows;
///  - values(p, rows, t0, tn, skipped, o): o[r * value_floats() + c] += sum_j p[r * attend_tile + j] v_{t0 + j}[c],
///    leaving out slots of weight 0 when `skipped` (a tile with a non-finite logit: 0 x NaN would still be NaN).
/// logits and values are called for the same tile in turn, tiles in ascending order, tiles no row sees left out.
template <class S>
concept AttendSource = requires(S& src, S const& c, float* f, float const* cf, Index i, Index* ip, bool flag) {
  { c.tokens() } -> std::same_as<Index>;
  { c.query_floats() } -> std::same_as<Index>;
  { c.value_floats() } -> std::same_as<Index>;
  { c.value_dim() } -> std::same_as<Index>;
  src.rows_ready();
  { c.positions(i, i, ip) } -> std::same_as<Index const*>;
  src.logits(cf, i, i, i, f);
  src.values(cf, i, i, i, flag, f);
};

/// The tokens of head (b, h) of a KV view (any layout, any accessor) as attend_head reads them: row pointers per tile,
/// double-buffered so that the logits of tile t ask for the cache lines of tile t + 1 while they compute.
template <KVCacheView C>
class CacheSource {
 public:
  using KT = typename C::keys_type::value_type;
  using VT = typename C::values_type::value_type;

  CacheSource(C const& cache, Index b, Index h) noexcept
      : cache_(cache),
        b_(b),
        h_(h),
        n_(cache.length(b, h)),
        // Prepared once per head for the lanes (E4M3's 2^8 folded in, the overflow check out of the loops).
        k_scale_(lane_scale<KT>(cache.keys.scale(b, h))),
        v_scale_(lane_scale<VT>(cache.values.scale(b, h))) {}

  Index tokens() const noexcept { return n_; }
  Index query_floats() const noexcept { return cache_.keys.extents().dim; }
  Index value_floats() const noexcept { return cache_.values.extents().dim; }
  Index value_dim() const noexcept { return cache_.values.extents().dim; }

  template <class T>
  void prepare(float* dst, T const* src, float scale) const noexcept {
    Index const dk = query_floats();
    for (Index c = 0; c < dk; ++c)
      dst[c] = scale * to_float(src[c]);
  }
  void rows_ready() noexcept {}

  /// Positions of a head's slots t0, t0 + 1, ... are consecutive entries for every layout but the per-head paged one
  /// (KVCache::position_slot: [batch, heads, tokens] or a ragged row number): read in place there (a vectorised
  /// min/max follows).
  Index const* positions(Index t0, Index tn, Index* scratch) const noexcept {
    using KL = typename C::keys_type::layout_type;
    constexpr bool contiguous = std::is_same_v<KL, RaggedLayout> || !requires(KL const& lay) {
      lay.slot(0, 0, 0);
    };
    if (cache_.positions && contiguous)
      return cache_.positions + cache_.position_slot(b_, h_, t0);
    for (Index j = 0; j < tn; ++j)
      scratch[j] = cache_.position(b_, h_, t0 + j);
    return scratch;
  }

  /// attend_logits, attend_group rows per read of a key chunk; the first group asks for the next tile's K and V rows,
  /// slot by slot, so that memory keeps streaming while this tile computes.
  void logits(float const* q, Index rows, Index t0, Index tn, float* s) noexcept {
    Index const cur = (t0 / attend_tile) % 2, next = 1 - cur, dk = query_floats();
    if (filled_[cur] != t0) {
      tile_rows(t0, tn, key_rows_[cur], value_rows_[cur]);
      filled_[cur] = t0;
    }
    TileAhead<KT, VT> ahead{key_rows_[next], value_rows_[next], std::min(attend_tile, n_ - t0 - attend_tile),
                            dk * Index{sizeof(KT)}, value_dim() * Index{sizeof(VT)}};
    tile_rows(t0 + attend_tile, ahead.n, key_rows_[next], value_rows_[next]);
    filled_[next] = t0 + attend_tile;
    for_row_groups(rows, [&](auto group, Index r) {
      attend_logits<decltype(group)::value>(q + r * dk, dk, key_rows_[cur], k_scale_, tn, s + r * attend_tile, ahead);
      ahead.n = 0;  // asked for once
    });
  }

  /// attend_values, attend_group rows per read of a value chunk (attend_values_nonzero for a skipped tile).
  void values(float const* p, Index rows, Index t0, Index tn, bool skipped, float* o) const noexcept {
    VT const* const* v = value_rows_[(t0 / attend_tile) % 2];
    Index const dv = value_dim();
    if (skipped) [[unlikely]] {
      attend_values_nonzero(p, v, v_scale_, tn, dv, o, rows);
      return;
    }
    for_row_groups(rows, [&](auto group, Index r) {
      attend_values<decltype(group)::value>(p + r * attend_tile, v, v_scale_, tn, dv, o + r * dv);
    });
  }

 private:
  /// Rows t0 + j (j < n) of the head's K and V. Strided and ragged rows are evenly spaced within a head, so their
  /// pointers are the first plus j rows; other layouts (paged) map every slot.
  void tile_rows(Index t0, Index n, KT const** keys, VT const** values) const noexcept {
    using KL = typename C::keys_type::layout_type;
    using VL = typename C::values_type::layout_type;
    if constexpr ((std::is_same_v<KL, StridedLayout> || std::is_same_v<KL, RaggedLayout>)&&(
                      std::is_same_v<VL, StridedLayout> || std::is_same_v<VL, RaggedLayout>)) {
      if (n <= 0)
        return;
      KT const* k0 = cache_.keys.row(b_, h_, t0);
      VT const* v0 = cache_.values.row(b_, h_, t0);
      Index const ks = cache_.keys.layout().stride_t, vs = cache_.values.layout().stride_t;
      for (Index j = 0; j < n; ++j) {
        keys[j] = k0 + j * ks;
        values[j] = v0 + j * vs;
      }
    } else {
      for (Index j = 0; j < n; ++j) {
        keys[j] = cache_.keys.row(b_, h_, t0 + j);
        values[j] = cache_.values.row(b_, h_, t0 + j);
      }
    }
  }

  C const& cache_;
  Index b_, h_, n_;
  decltype(lane_scale<KT>(std::declval<C const&>().keys.scale(0, 0))) k_scale_;
  decltype(lane_scale<VT>(std::declval<C const&>().values.scale(0, 0))) v_scale_;
  // The tile's row pointers live in the source (on the worker's stack: no aliasing with the cache's tables).
  KT const* key_rows_[2][attend_tile];
  VT const* value_rows_[2][attend_tile];
  Index filled_[2] = {-1, -1};  // the first slot of the tile each buffer holds
};

/// Attention of the query rows of KV head h's GQA group (query head h·g + r / n, row r % n) over `src`'s tokens,
/// FlashAttention-style. Why: decode reads each K and V byte once per call, so it is bound by memory, and the
/// g = Hq / Hkv query heads of a GQA group (times n queries) share the KV head. One pass over the head's tokens
/// serves up to `max_rows` rows, in tiles of attend_tile tokens:
///  1. the rows are prepared once (fp32, pre-scaled by the logit scale: Source::prepare);
///  2. per tile, the tokens' positions are read once: a tile past every row's position is skipped (nothing of it is
///     visible; its K and V are not read), a tile before every row's position needs no mask, any other is masked slot
///     by slot against each row's position (position <= the query's, the causal contract);
///  3. logits of all rows (Source::logits);
///  4. online softmax per row: the running max m, denominator l and fp32 output accumulator o are rescaled by
///     e^(m_old - m_new) when the tile raises the max, and the tile's weights are e^(s - m_new) (exp_shifted);
///  5. o += weights x V (Source::values).
/// At the end o / l is written, and lse = m + ln l (scaled-logit units); a row that saw no slot gets zeros and
/// lse = -inf. A slot whose logit is NaN or Inf (a non-finite key) is skipped as if masked: the row's softmax runs
/// over its finite slots, and the tile's values are summed without zero-weight slots. Every row's arithmetic (tile
/// boundaries at multiples of attend_tile tokens of its head, sum orders) is the same whatever rows share its pass and
/// whatever the thread count, given the source's own arithmetic per row is. `end`: the context end that queries
/// without positions are placed before (query i of n at end - n + i).
template <AttendSource Source, class Q>
void attend_head(Source& src, Attention const& op, Q const& queries, Index b, Index h, Index group, float scale,
                 Index end, Index max_rows, AttendScratch const& w, AttendOutput<HostSpace> out) noexcept {
  constexpr Index tile = attend_tile;
  constexpr float neg_inf = -std::numeric_limits<float>::infinity();
  KVExtents const q = queries.rows.extents();
  Index const n = src.tokens(), qf = src.query_floats(), of = src.value_floats(), dv = src.value_dim();
  Index const total_rows = group * q.tokens;
  for (Index r0 = 0; r0 < total_rows; r0 += max_rows) {
    Index const rows = std::min(max_rows, total_rows - r0);
    // 1. Rows r0.. of the group.
    Index q_min = std::numeric_limits<Index>::max(), q_max = std::numeric_limits<Index>::min();
    for (Index r = 0; r < rows; ++r) {
      Index const hq = h * group + (r0 + r) / q.tokens, i = (r0 + r) % q.tokens;
      src.prepare(w.q + r * qf, queries.rows.row(b, hq, i), scale);
      w.pos[r] = queries.positions ? queries.positions[b * q.tokens + i] : end - q.tokens + i;
      q_min = std::min(q_min, w.pos[r]);
      q_max = std::max(q_max, w.pos[r]);
      w.m[r] = neg_inf;
      w.l[r] = 0.0f;
    }
    src.rows_ready();
    std::fill(w.o, w.o + rows * of, 0.0f);

    Index slot_pos[tile];
    for (Index t0 = 0; t0 < n; t0 += tile) {
      Index const tn = std::min(tile, n - t0);
      // 2. Positions: skip a tile no row sees, mask one that only some rows see in part.
      bool masked = false;
      Index const* tile_pos = nullptr;
      if (op.causal) {
        tile_pos = src.positions(t0, tn, slot_pos);
        Index p_min = tile_pos[0], p_max = tile_pos[0];
        for (Index j = 1; j < tn; ++j) {
          p_min = std::min(p_min, tile_pos[j]);
          p_max = std::max(p_max, tile_pos[j]);
        }
        if (p_min > q_max)
          continue;
        masked = p_max > q_min;
      }
      // 3. Logits.
      src.logits(w.q, rows, t0, tn, w.s);
      // 4. Online softmax: skip non-finite logits, mask, pad the tile to its full width with -inf, rescale,
      // exponentiate. A NaN or Inf logit (a non-finite key) is skipped like a masked slot, so one bad token leaves
      // the softmax over the others instead of turning the whole row into NaN.
      bool skipped = false;
      for (Index r = 0; r < rows; ++r) {
        float* sr = w.s + r * tile;
        unsigned bad = 0;
        for (Index j = 0; j < tn; ++j) {  // |x| <= FLT_MAX is false for NaN and +-Inf; vectorises
          bool const finite = std::abs(sr[j]) <= std::numeric_limits<float>::max();
          bad |= finite ? 0u : 1u;
          sr[j] = finite ? sr[j] : neg_inf;
        }
        skipped = skipped || bad != 0;
        if (masked)
          for (Index j = 0; j < tn; ++j)
            sr[j] = tile_pos[j] <= w.pos[r] ? sr[j] : neg_inf;
        std::fill(sr + tn, sr + tile, neg_inf);
        float const peak = std::max(w.m[r], tile_max(sr));
        if (peak == neg_inf) {  // nothing visible to this row yet: zero weights
          std::fill(sr, sr + tile, 0.0f);
          continue;
        }
        if (w.m[r] < peak && w.m[r] > neg_inf) {  // the max grew: rescale what was accumulated
          float const alpha = exp_nonpositive(w.m[r] - peak);
          w.l[r] *= alpha;
          for (Index c = 0; c < of; ++c)
            w.o[r * of + c] *= alpha;
        }
        w.m[r] = peak;
        exp_shifted(sr, peak);
        w.l[r] += tile_sum(sr);
      }
      // 5. o += weights x V.
      src.values(w.s, rows, t0, tn, skipped, w.o);
    }

    for (Index r = 0; r < rows; ++r) {
      Index const hq = h * group + (r0 + r) / q.tokens, i = (r0 + r) % q.tokens;
      Index const at = (b * q.heads + hq) * q.tokens + i;
      float* dst = out.out + at * dv;
      for (Index c = 0; c < dv; ++c)
        dst[c] = w.l[r] > 0 ? w.o[r * of + c] / w.l[r] : 0.0f;
      if (out.lse)
        out.lse[at] = w.l[r] > 0 ? w.m[r] + std::log(w.l[r]) : neg_inf;
    }
  }
}

/// Query rows one pass over a KV head serves: g·n, capped at attend_block_rows (0 for shapes attention rejects).
inline Index attend_pass_rows(KVExtents const& q, Index kv_heads) noexcept {
  Index const group = kv_heads > 0 ? q.heads / kv_heads : 0;
  Index const rows = group > 0 && q.tokens > 0 ? group * std::min(q.tokens, attend_block_rows) : 0;
  return std::min(rows, attend_block_rows);
}

}  // namespace detail

/// One (sequence, KV head) per item: detail::attend_head over a detail::CacheSource. The layout only enters through
/// cache.keys.row(b, h, t): a tile's rows need not be contiguous with each other (paged, per-head paged, ragged and
/// strided caches alike), so two caches holding the same tokens give bit-identical outputs.
template <>
struct Kernel<Attention, Cpu> {
  template <class Q, KVCacheView C>
  static std::size_t workspace_bytes(Cpu const& cpu, Attention const&, Q const& queries, C const& cache) {
    Index const rows = detail::attend_pass_rows(queries.rows.extents(), cache.keys.extents().heads);
    return bytes_product(cpu.workers(),
                         detail::AttendScratch::bytes(rows, cache.keys.extents().dim, cache.values.extents().dim));
  }

  template <Element T, KVCacheView C>
  static Status run(Cpu const& cpu, Attention const& op, AttendQueries<T, HostSpace> const& queries, C const& cache,
                    AttendOutput<HostSpace> out, Workspace ws) {
    KVExtents const q = queries.rows.extents(), k = cache.keys.extents();
    Index const dk = k.dim, dv = cache.values.extents().dim, max_rows = detail::attend_pass_rows(q, k.heads);
    std::size_t const per_worker = detail::AttendScratch::bytes(max_rows, dk, dv);
    auto* base = WorkspaceCarver(ws).take<std::byte>(static_cast<Index>(workspace_bytes(cpu, op, queries, cache)));
    if (base == nullptr)
      return {Errc::out_of_capacity, "kvc::attend: workspace smaller than attend_workspace_bytes()"};
    KVC_RETURN_IF_ERROR(detail::check_lengths(cache.lengths, k.batch, k.heads, k.tokens,
                                              "kvc::attend: every valid length must be in [0, tokens]"));
    float const scale = op.scale > 0 ? op.scale : 1.0f / std::sqrt(static_cast<float>(dk));
    detail::parallel_for(cpu, k.batch * k.heads, [&](Index item, Index worker) {
      Index const b = item / k.heads, h = item % k.heads;
      WorkspaceCarver carve({base + static_cast<std::size_t>(worker) * per_worker, per_worker});
      detail::AttendScratch const w = detail::AttendScratch::carve(carve, max_rows, dk, dv);
      detail::CacheSource<C> src(cache, b, h);
      detail::attend_head(src, op, queries, b, h, q.heads / k.heads, scale,
                          queries.positions ? 0 : context_end(cache, b), max_rows, w, out);
    });
    return {};
  }
};

}  // namespace kvc

#undef KVC_ATTEND_PREFETCH
#undef KVC_ATTEND_SHUFFLE
