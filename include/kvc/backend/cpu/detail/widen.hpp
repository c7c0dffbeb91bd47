// SPDX-License-Identifier: Apache-2.0
// kvc/backend/cpu/detail/widen.hpp: widening 16-bit and fp8 K/V elements to fp32 on the CPU, 8 or 16 at a time.
//
// fp8 (E4M3, E5M2) goes through the same F16C conversion: each byte becomes a binary16 bit pattern first (E5M2 is the
// top byte of one; E4M3 maps to one of value / 2^8, see e4m3_binary16), 8 bytes at a time with F16C alone, 16 with
// AVX2 (one vpmovsxbw / vpmovzxbw of 16 bytes). With AVX-512 VBMI, the reductions and widen() read E4M3 64 bytes at a
// time through byte tables straight to fp32 (e4m3_widen64); without VBMI but with AVX2, the reductions and the scaled
// widen() check a row once for NaN bytes (e4m3_has_nan) and widen a row without any, nearly all, without
// e4m3_binary16's NaN carry.
//
// fp16 uses the hardware conversion where the compile target has it: F16C on x86 (vcvtph2ps, 8 halves per
// instruction, 16 with AVX-512; -mf16c, implied by -march=haswell and later or -march=native on such a CPU) or the
// fp16 conversions of AArch64 NEON (vcvt_f32_f16). Measured (docs/benchmarks.md): the 8-wide conversion through a
// store was slower than the portable loop the compiler vectorises 16-wide under AVX-512 (KeyDiff fp16, d = 64:
// 12.9 ms against 9.8 ms), hence the 16-wide path; the reductions (f16c_lanes) convert in registers. Elsewhere, or with
// KVC_PORTABLE_F16 defined, it uses the portable bit manipulation of element.hpp, which the compiler vectorises but
// which costs about ten integer operations per element. The choice is made at compile time, per translation unit. Both
// paths are exact, so every result is the same bit for bit whichever is compiled (tests/core/widen_test.cpp builds
// both). bfloat16 needs no instruction: a 16-bit shift, which compilers vectorise on every target.
#pragma once

#include <kvc/core/access.hpp>
#include <kvc/core/element.hpp>
#include <kvc/core/extents.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#if !defined(KVC_PORTABLE_F16) && defined(__F16C__)
#  define KVC_CPU_F16_CONVERT 1  // x86 F16C
#  include <immintrin.h>
#elif !defined(KVC_PORTABLE_F16) && defined(__aarch64__) && defined(__ARM_NEON)
#  define KVC_CPU_F16_CONVERT 2  // AArch64 NEON
#  include <arm_neon.h>
#else
#  define KVC_CPU_F16_CONVERT 0  // portable
#endif

namespace kvc::detail {

/// Which fp16 conversion this translation unit compiled: "f16c", "neon" or "portable" (benchmarks report it).
inline constexpr char const* f16_conversion = KVC_CPU_F16_CONVERT == 1   ? "f16c"
                                              : KVC_CPU_F16_CONVERT == 2 ? "neon"
                                                                         : "portable";

/// Whether F16C widens T here (fp16 and both fp8 formats, where F16C is compiled): f16c_load8 below.
template <class T>
inline constexpr bool f16c_widens = KVC_CPU_F16_CONVERT == 1 &&
                                    (std::is_same_v<std::remove_const_t<T>, half> || is_fp8<T>);

/// The factor a binary16 from f16c_bits8 / f16c_bits16 must be multiplied by to be the element's value: 2^8 for E4M3
/// (exponent bias 7 against binary16's 15), 1 for fp16 and E5M2. The reductions fold it into the view's scale.
template <class T>
inline constexpr float f16c_unbias = std::is_same_v<std::remove_const_t<T>, float8_e4m3> ? 256.0f : 1.0f;

/// Whether `folded` (a scale times f16c_unbias) is exact: false only when a finite scale overflowed (never in practice:
/// a scale near 2^120), where the caller reads the elements one at a time instead.
inline bool folds_exactly(float folded, float scale) noexcept {
  constexpr float top = std::numeric_limits<float>::max();
  return std::fabs(folded) <= top || !(std::fabs(scale) <= top);
}

/// A scaled view's scale prepared once per head for the F16C lanes of element type T (attention's kernels): the lanes
/// multiply each converted binary16 by `first`, and E4M3's also by `second`, with no branch in the loops: normally
/// first = scale * f16c_unbias<T> (exact) and second = 1; when that product overflows (a scale near 2^120),
/// first = f16c_unbias<T> and second = scale. Either way the result is decode(byte) * scale rounded once. `value` is
/// the scale itself for the element-wise reads (x * LaneScale is x * value, so kvc::load takes it as a float).
template <class T>
struct LaneScale {
  float value = 1.0f;
  float first = 1.0f;
  float second = 1.0f;
};
template <class T>
inline float operator*(float x, LaneScale<T> s) noexcept {
  return x * s.value;
}
/// Unit stays Unit (no multiply at all); a float scale becomes a LaneScale<T>.
template <class T>
inline Unit lane_scale(Unit) noexcept {
  return {};
}
template <class T>
inline LaneScale<T> lane_scale(float scale) noexcept {
  float const folded = scale * f16c_unbias<T>;
  if (folds_exactly(folded, scale))
    return {scale, folded, 1.0f};
  return {scale, f16c_unbias<T>, scale};
}

#if KVC_CPU_F16_CONVERT == 1

// E4M3 bytes sign-extended to 16 bits and shifted left by 7 are s.s.eeee.mmm.0000000; with bit 14 cleared, that is
// the binary16 of the same number times 2^-8 (E4M3's subnormals m * 2^-9 become binary16 subnormals m * 2^-17), which
// F16C widens exactly. NaN (magnitude 0x7F: 0x3F80 here, which would read as 1.875) is the only value that carries
// into bit 14 when 0x80 is added; or-ing that carry in gives 0x7F80 (0xFF80), a binary16 NaN. No compare, no blend.
inline __m128i e4m3_binary16(__m128i widened) noexcept {
  __m128i const b = _mm_and_si128(_mm_slli_epi16(widened, 7), _mm_set1_epi16(static_cast<short>(0xbf80)));
  return _mm_or_si128(b, _mm_and_si128(_mm_add_epi16(b, _mm_set1_epi16(0x80)), _mm_set1_epi16(0x4000)));
}

/// src[0, 8) as binary16 bits of value / f16c_unbias<T>, for T with f16c_widens<T>.
template <class T>
inline __m128i f16c_bits8(T const* src) noexcept {
  using E = std::remove_const_t<T>;
  static_assert(f16c_widens<E>, "kvc: f16c_bits8 converts fp16, E4M3 and E5M2");
  if constexpr (std::is_same_v<E, half>)
    return _mm_loadu_si128(reinterpret_cast<__m128i const*>(src));
  else if constexpr (std::is_same_v<E, float8_e5m2>)  // the top half of a binary16: b << 8, by interleaving zeros
    return _mm_unpacklo_epi8(_mm_setzero_si128(), _mm_loadl_epi64(reinterpret_cast<__m128i const*>(src)));
  else
    return e4m3_binary16(_mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<__m128i const*>(src))));
}

/// src[0, 8) widened into one register by F16C (exact), for T with f16c_widens<T>.
template <class T>
inline __m256 f16c_load8(T const* src) noexcept {
  __m256 const x = _mm256_cvtph_ps(f16c_bits8(src));
  if constexpr (f16c_unbias<T> != 1.0f)
    return _mm256_mul_ps(x, _mm256_set1_ps(f16c_unbias<T>));  // a power of two: exact
  else
    return x;
}

#  if defined(__AVX2__)
/// As the 8-wide one above; `has_nan` false (the caller checked the row: e4m3_has_nan) leaves the NaN carry out.
template <bool has_nan = true>
inline __m256i e4m3_binary16(__m256i widened) noexcept {
  __m256i const b = _mm256_and_si256(_mm256_slli_epi16(widened, 7), _mm256_set1_epi16(static_cast<short>(0xbf80)));
  if constexpr (!has_nan)
    return b;
  else
    return _mm256_or_si256(b,
                           _mm256_and_si256(_mm256_add_epi16(b, _mm256_set1_epi16(0x80)), _mm256_set1_epi16(0x4000)));
}

/// Whether the E4M3 bytes src[0, n) hold a NaN (magnitude 0x7F), checked once per row at the byte level: the
/// largest magnitude, one and and one max per 32 bytes (16 for the last block), a fraction of the NaN carry's three
/// operations per element in e4m3_binary16, which rows without NaN (nearly all) then skip.
inline bool e4m3_has_nan(float8_e4m3 const* src, Index n) noexcept {
  __m256i const magnitude = _mm256_set1_epi8(0x7f);
  __m256i most = _mm256_setzero_si256();
  Index i = 0;
  for (; i + 32 <= n; i += 32)
    most = _mm256_max_epu8(most,
                           _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<__m256i const*>(src + i)), magnitude));
  __m128i last = _mm_max_epu8(_mm256_castsi256_si128(most), _mm256_extracti128_si256(most, 1));
  if (i + 16 <= n) {
    last = _mm_max_epu8(last, _mm_and_si128(_mm_loadu_si128(reinterpret_cast<__m128i const*>(src + i)),
                                            _mm256_castsi256_si128(magnitude)));
    i += 16;
  }
  bool nan = _mm_movemask_epi8(_mm_cmpeq_epi8(last, _mm256_castsi256_si128(magnitude))) != 0;
  for (; i < n; ++i)
    nan = nan || (src[i].bits & 0x7fu) == 0x7fu;
  return nan;
}

/// Whether src[0, n) may be widened without the NaN carry: E4M3 bytes holding no NaN, where VBMI's tables are absent
/// (with them the reductions never use e4m3_binary16).
template <class T>
inline bool e4m3_without_nan(T const* src, Index n) noexcept {
#    if !defined(__AVX512VBMI__)
  if constexpr (std::is_same_v<std::remove_const_t<T>, float8_e4m3>)
    return !e4m3_has_nan(src, n);
#    endif
  (void)src, (void)n;
  return false;
}

/// src[0, 16) as binary16 bits of value / f16c_unbias<T> (AVX2: one widening of 16 bytes for fp8); `has_nan` false
/// for E4M3 bytes known to hold no NaN.
template <class T, bool has_nan = true>
inline __m256i f16c_bits16(T const* src) noexcept {
  using E = std::remove_const_t<T>;
  static_assert(f16c_widens<E>, "kvc: f16c_bits16 converts fp16, E4M3 and E5M2");
  if constexpr (std::is_same_v<E, half>) {
    return _mm256_loadu_si256(reinterpret_cast<__m256i const*>(src));
  } else {
    __m128i const bytes = _mm_loadu_si128(reinterpret_cast<__m128i const*>(src));
    if constexpr (std::is_same_v<E, float8_e5m2>)
      return _mm256_slli_epi16(_mm256_cvtepu8_epi16(bytes), 8);
    else
      return e4m3_binary16<has_nan>(_mm256_cvtepi8_epi16(bytes));
  }
}
#  endif

#  if defined(__AVX512VBMI__)
/// fp32 bits of the E4M3 magnitudes 0..127 (0x7F: NaN) split into their top two bytes (the other two are zero:
/// E4M3's 3-bit mantissa ends at bit 20): e4m3_widen64's tables.
struct alignas(64) E4m3Fp32Bytes {
  std::uint8_t byte3[128];
  std::uint8_t byte2[128];
};
inline constexpr E4m3Fp32Bytes e4m3_fp32_bytes = [] {
  E4m3Fp32Bytes t{};
  for (unsigned m = 0; m < 128; ++m) {
    unsigned const e = m >> 3, f = m & 7u;
    std::uint32_t bits = 0;  // m = 0: +0
    if (m == 0x7f)
      bits = 0x7fc00000u;  // NaN
    else if (e > 0)        // normal: 2^(e - 7) (1 + f / 8)
      bits = (e + 120u) << 23 | f << 20;
    else if (f > 0) {  // subnormal: f 2^-9 = 2^(p - 9) (f / 2^p), p = f's top bit
      unsigned const p = f >= 4 ? 2u : f >= 2 ? 1u : 0u;
      bits = (p + 118u) << 23 | (f - (1u << p)) << (23 - p);
    }
    t.byte3[m] = static_cast<std::uint8_t>(bits >> 24);
    t.byte2[m] = static_cast<std::uint8_t>(bits >> 16);
  }
  return t;
}();

/// src[0, 64) of E4M3 under a view's scale (core/access.hpp) into x[0, 4), 16 elements each, in order: the exact
/// values (NaN for NaN) times `scale`, one rounding each (no product at all for Unit). No conversion instruction: the
/// top two bytes of each fp32 from two 128-entry tables read by AVX-512 VBMI's two-register byte permute (vpermi2b
/// reads an index byte's low 7 bits: the magnitude), the sign or-ed into the top one, then two rounds of in-lane
/// unpacks lay them out as dwords over zero low halves. 14 uops per 64 elements on Intel (where a two-register byte
/// permute is 3), against about 9 per 16 through e4m3_binary16 and vcvtph2ps.
template <class S>
inline void e4m3_widen64(float8_e4m3 const* src, __m512 (&x)[4], S scale) noexcept {
  auto const* table = reinterpret_cast<__m512i const*>(&e4m3_fp32_bytes);
  // Lane k's dword j takes source dword 4j + k (a 4 x 4 transpose), so that the in-lane unpacks below leave elements
  // [16j, 16j + 16) in x[j], in order. maskz with a full mask: see widen() below (GCC 12's maybe-uninitialized).
  __m512i const bytes = _mm512_maskz_permutexvar_epi32(
      0xffff, _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), _mm512_loadu_si512(src));
  __m512i const sign = _mm512_set1_epi8(static_cast<char>(0x80));
  // top | (bytes & sign): ternary-logic truth table A | (B & C)
  __m512i const top = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(table[0], bytes, table[1]), bytes, sign, 0xf8);
  __m512i const second = _mm512_permutex2var_epi8(table[2], bytes, table[3]);
  __m512i const low = _mm512_unpacklo_epi8(second, top), high = _mm512_unpackhi_epi8(second, top);  // top 16 bits
  __m512i const zero = _mm512_setzero_si512();
  x[0] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, low));
  x[1] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, low));
  x[2] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, high));
  x[3] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, high));
  if constexpr (!std::is_same_v<S, Unit>)  // the true values: the view's scale alone, no 2^8 to fold
    for (auto& v : x)
      v = _mm512_mul_ps(v, _mm512_set1_ps(scale));
}
#  endif
#endif

/// Widens the whole blocks of 64 E4M3 elements of src[0, n) under `scale` into dst where AVX-512 VBMI is compiled
/// (e4m3_widen64); returns the index after them (0 for other types and targets).
template <class T, class S>
inline Index widen_blocks64(T const* src, float* dst, Index n, S scale) noexcept {
  Index i = 0;
#if KVC_CPU_F16_CONVERT == 1 && defined(__AVX512VBMI__)
  if constexpr (std::is_same_v<std::remove_const_t<T>, float8_e4m3>)
    for (; i + 64 <= n; i += 64) {
      __m512 x[4];
      e4m3_widen64(src + i, x, scale);
      for (int k = 0; k < 4; ++k)
        _mm512_storeu_ps(dst + i + 16 * k, x[k]);
    }
#else
  (void)src, (void)dst, (void)n, (void)scale;
#endif
  return i;
}

/// Widens src[0, 8) into dst[0, 8).
template <class T>
inline void widen8(T const* src, float* dst) noexcept {
  using E = std::remove_const_t<T>;
  if constexpr (std::is_same_v<E, float>) {
    std::memcpy(dst, src, 8 * sizeof(float));
#if KVC_CPU_F16_CONVERT == 1
  } else if constexpr (f16c_widens<E>) {
    _mm256_storeu_ps(dst, f16c_load8(src));
#elif KVC_CPU_F16_CONVERT == 2
  } else if constexpr (std::is_same_v<E, half>) {
    float16x8_t const h = vreinterpretq_f16_u16(vld1q_u16(reinterpret_cast<std::uint16_t const*>(src)));
    vst1q_f32(dst, vcvt_f32_f16(vget_low_f16(h)));
    vst1q_f32(dst + 4, vcvt_high_f32_f16(h));
#endif
  } else {
    for (int i = 0; i < 8; ++i)
      dst[i] = to_float(src[i]);
  }
}

/// Widens src[0, n) into dst[0, n) (exact).
template <class T>
inline void widen(T const* src, float* dst, Index n) noexcept;

/// Loads src[0, n) under a view's scale (core/access.hpp) into dst[0, n): widen, then one fp32 product per element
/// for scaled views (the dequantised values exactly); widen alone for Unit.
template <class T, class S>
inline void widen(T const* src, float* dst, Index n, S scale) noexcept {
  if constexpr (std::is_same_v<S, Unit>) {
    widen(src, dst, n);
  } else {
    Index i = widen_blocks64(src, dst, n, scale);
#if KVC_CPU_F16_CONVERT == 1
    if constexpr (f16c_widens<T>) {  // the product in the register (one pass over dst), E4M3's 2^8 folded into it
      float const s = scale * f16c_unbias<T>;
      if (folds_exactly(s, scale)) {
#  if defined(__AVX2__)
        // E4M3 without VBMI's tables: a row without NaN (checked once) skips the NaN carry, 16 bytes at a time.
        if (e4m3_without_nan(src + i, (n - i) - (n - i) % 16))
          for (; i + 16 <= n; i += 16) {
            __m256i const bits = f16c_bits16<T, false>(src + i);
            _mm256_storeu_ps(dst + i, _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(bits)), _mm256_set1_ps(s)));
            _mm256_storeu_ps(dst + i + 8,
                             _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(bits, 1)), _mm256_set1_ps(s)));
          }
#  endif
        for (; i + 8 <= n; i += 8)
          _mm256_storeu_ps(dst + i, _mm256_mul_ps(_mm256_cvtph_ps(f16c_bits8(src + i)), _mm256_set1_ps(s)));
      }
    }
#endif
    widen(src + i, dst + i, n - i);
    for (; i < n; ++i)
      dst[i] *= scale;
  }
}

template <class T>
inline void widen(T const* src, float* dst, Index n) noexcept {
  Index i = widen_blocks64(src, dst, n, Unit{});
#if KVC_CPU_F16_CONVERT == 1 && defined(__AVX512F__)
  if constexpr (std::is_same_v<std::remove_const_t<T>, half>)  // 16 per instruction where the target has AVX-512
    for (; i + 16 <= n; i += 16)
      // maskz with a full mask: the same instruction, without _mm512_cvtph_ps's undefined source operand, which
      // GCC 12 reports as maybe-uninitialized (an error under -Werror in the engines that include this header).
      _mm512_storeu_ps(dst + i,
                       _mm512_maskz_cvtph_ps(0xffff, _mm256_loadu_si256(reinterpret_cast<__m256i const*>(src + i))));
#endif
  for (; i + 8 <= n; i += 8)
    widen8(src + i, dst + i);
  for (; i < n; ++i)
    dst[i] = to_float(src[i]);
}

/// Whether dot() and sum_squares() over T rows use the hardware lanes below (fp16 and fp8 where F16C is compiled).
template <class T>
inline constexpr bool hardware_lanes = f16c_widens<T>;

/// The 16 accumulator lanes of rows.hpp's reductions over whole blocks of 16 fp16 or fp8 elements under a view's
/// scale, widened by F16C: acc[j] += (a[i + j] * scale) * b[i + j] (or (a[i + j] * scale)^2), in the same order as the
/// portable loop, with separate multiplies and adds (a compiler allowed to contract, e.g. GCC's default
/// -ffp-contract=fast, may fuse either loop's multiply and add into an FMA; the tests build with -ffp-contract=off).
/// E4M3's f16c_unbias joins the scale: (v / 2^8) * (scale * 2^8) is the same real number as v * scale, so it rounds to
/// the same float, with one product instead of two (scale * 2^8 is exact; when it overflows, the caller's portable
/// loop does the whole row). One 16-wide conversion and zmm arithmetic with AVX-512 (E4M3 64 at a time through
/// e4m3_widen64 where VBMI is compiled); two 8-wide conversions with AVX2 (after one 16-byte widening for fp8) or with
/// F16C alone (8 bytes or halves per load). Returns the index after the last whole block.
#if KVC_CPU_F16_CONVERT == 1
/// f16c_lanes' loop over the whole blocks of 16 of R rows a[r] (accumulators acc[r]); `has_nan` false for E4M3 rows
/// known to hold no NaN. The rows are interleaved block by block, each into its own registers: a row's arithmetic is
/// that of R = 1, and R rows give R independent add chains (one row's 8 dependent adds at d = 128 otherwise bound the
/// loop by their latency, not by the conversions).
template <bool has_nan, int R, class T, class S>
inline Index f16c_lanes_blocks(T const* const* a, float const* b, Index dim, float* const* acc,
                               [[maybe_unused]] S scale, float s) noexcept {
  constexpr bool multiply = !std::is_same_v<S, Unit> || f16c_unbias<T> != 1.0f;
  Index i = 0;
#  if defined(__AVX512F__)
  __m512 sum[R];
  for (int r = 0; r < R; ++r)
    sum[r] = _mm512_loadu_ps(acc[r]);
#    if defined(__AVX512VBMI__)
  if constexpr (std::is_same_v<std::remove_const_t<T>, float8_e4m3>)
    for (; i + 64 <= dim; i += 64)
      for (int r = 0; r < R; ++r) {
        __m512 x[4];
        e4m3_widen64(a[r] + i, x, scale);
        for (int k = 0; k < 4; ++k)
          sum[r] = _mm512_add_ps(sum[r], _mm512_mul_ps(x[k], b ? _mm512_loadu_ps(b + i + 16 * k) : x[k]));
      }
#    endif
  for (; i + 16 <= dim; i += 16)
    for (int r = 0; r < R; ++r) {
      // maskz with a full mask: see widen() below (GCC 12's maybe-uninitialized warning on _mm512_cvtph_ps).
      __m512 x = _mm512_maskz_cvtph_ps(0xffff, f16c_bits16<T, has_nan>(a[r] + i));
      if constexpr (multiply)  // the dequantised values: one rounding each
        x = _mm512_mul_ps(x, _mm512_set1_ps(s));
      sum[r] = _mm512_add_ps(sum[r], _mm512_mul_ps(x, b ? _mm512_loadu_ps(b + i) : x));
    }
  for (int r = 0; r < R; ++r)
    _mm512_storeu_ps(acc[r], sum[r]);
#  else
  __m256 lo[R], hi[R];
  for (int r = 0; r < R; ++r) {
    lo[r] = _mm256_loadu_ps(acc[r]);
    hi[r] = _mm256_loadu_ps(acc[r] + 8);
  }
  for (; i + 16 <= dim; i += 16)
    for (int r = 0; r < R; ++r) {
#    if defined(__AVX2__)
      __m256i const bits = f16c_bits16<T, has_nan>(a[r] + i);
      __m256 x = _mm256_cvtph_ps(_mm256_castsi256_si128(bits)), y = _mm256_cvtph_ps(_mm256_extracti128_si256(bits, 1));
#    else
      __m256 x = _mm256_cvtph_ps(f16c_bits8(a[r] + i)), y = _mm256_cvtph_ps(f16c_bits8(a[r] + i + 8));
#    endif
      if constexpr (multiply) {
        x = _mm256_mul_ps(x, _mm256_set1_ps(s));
        y = _mm256_mul_ps(y, _mm256_set1_ps(s));
      }
      lo[r] = _mm256_add_ps(lo[r], _mm256_mul_ps(x, b ? _mm256_loadu_ps(b + i) : x));
      hi[r] = _mm256_add_ps(hi[r], _mm256_mul_ps(y, b ? _mm256_loadu_ps(b + i + 8) : y));
    }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(acc[r], lo[r]);
    _mm256_storeu_ps(acc[r] + 8, hi[r]);
  }
#  endif
  return i;
}

/// The lanes of R rows a[r] at once (see f16c_lanes_blocks); returns the index after the last whole block (0 when
/// the scale does not fold exactly: the caller's portable loop does the rows).
template <int R, class T, class S>
inline Index f16c_lanes(T const* const* a, float const* b, Index dim, float* const* acc, S scale) noexcept {
  float s = f16c_unbias<T>;
  if constexpr (!std::is_same_v<S, Unit>) {
    s *= scale;
    if (!folds_exactly(s, scale))
      return 0;
  }
#  if defined(__AVX2__)
  // E4M3 without VBMI's tables: rows without NaN (checked once each) skip the NaN carry of every element.
  bool clean = true;
  for (int r = 0; r < R; ++r)
    clean = clean && e4m3_without_nan(a[r], dim - dim % 16);
  if (clean)
    return f16c_lanes_blocks<false, R>(a, b, dim, acc, scale, s);
#  endif
  return f16c_lanes_blocks<true, R>(a, b, dim, acc, scale, s);
}
#else
template <int R, class T, class S>
inline Index f16c_lanes(T const* const*, float const*, Index, float* const*, S) noexcept {
  return 0;  // never called: hardware_lanes<T> is false without F16C
}
#endif

}  // namespace kvc::detail
