// SPDX-License-Identifier: Apache-2.0
// kvc/backend/cpu/detail/widen.hpp: widening 16-bit K/V elements to fp32 on the CPU, 8 at a time.
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

#if KVC_CPU_F16_CONVERT == 1
/// src[0, 8) widened into one register by F16C (exact), for T with f16c_widens<T>.
template <class T>
inline __m256 f16c_load8(T const* src) noexcept {
  using E = std::remove_const_t<T>;
  static_assert(f16c_widens<E>, "kvc: f16c_load8 widens fp16, E4M3 and E5M2");
  if constexpr (std::is_same_v<E, half>) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<__m128i const*>(src)));
  } else {
    // Each byte into the top half of a 16-bit lane (interleaved with zeros: one instruction, b << 8).
    __m128i const high = _mm_unpacklo_epi8(_mm_setzero_si128(), _mm_loadl_epi64(reinterpret_cast<__m128i const*>(src)));
    if constexpr (std::is_same_v<E, float8_e5m2>)
      return _mm256_cvtph_ps(high);  // E5M2 is the top half of a binary16
    // s.eeee.mmm placed as the binary16 s.0eeee.mmm0000000 (an arithmetic shift right by one, the copied sign bit
    // cleared) is the same number times 2^-8 (exponent bias 15 against 7; E4M3's subnormals m * 2^-9 become binary16
    // subnormals m * 2^-17), which F16C widens exactly; the product by 256 is exact. NaN (magnitude 0x7F, which would
    // read as 480) gets the binary16 exponent's ones first (0x3F80 | 0x7E00 is a quiet NaN; NaN x 256 is NaN).
    __m128i const nan = _mm_and_si128(
        _mm_cmpeq_epi16(_mm_and_si128(high, _mm_set1_epi16(0x7f00)), _mm_set1_epi16(0x7f00)), _mm_set1_epi16(0x7e00));
    __m128i const bits =
        _mm_or_si128(_mm_and_si128(_mm_srai_epi16(high, 1), _mm_set1_epi16(static_cast<short>(0xbf80))), nan);
    return _mm256_mul_ps(_mm256_cvtph_ps(bits), _mm256_set1_ps(256.0f));
  }
}
#endif

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
    Index i = 0;
#if KVC_CPU_F16_CONVERT == 1
    if constexpr (f16c_widens<T>)  // the product in the register: one pass over dst
      for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_mul_ps(f16c_load8(src + i), _mm256_set1_ps(scale)));
#endif
    widen(src + i, dst + i, n - i);
    for (; i < n; ++i)
      dst[i] *= scale;
  }
}

template <class T>
inline void widen(T const* src, float* dst, Index n) noexcept {
  Index i = 0;
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
/// scale, as two 8-wide vectors widened by F16C: acc[j] += (a[i + j] * scale) * b[i + j] (or (a[i + j] * scale)^2),
/// in the same order as the portable loop, with separate multiplies and adds (the portable loop may be contracted to
/// FMAs; see the top of this file). Returns the index after the last whole block.
#if KVC_CPU_F16_CONVERT == 1
template <class T, class S>
inline Index f16c_lanes(T const* a, float const* b, Index dim, float* acc, S scale) noexcept {
  __m256 lo = _mm256_loadu_ps(acc), hi = _mm256_loadu_ps(acc + 8);
  Index i = 0;
  for (; i + 16 <= dim; i += 16) {
    __m256 x = f16c_load8(a + i), y = f16c_load8(a + i + 8);
    if constexpr (!std::is_same_v<S, Unit>) {  // the dequantised values: one rounding each
      x = _mm256_mul_ps(x, _mm256_set1_ps(scale));
      y = _mm256_mul_ps(y, _mm256_set1_ps(scale));
    }
    lo = _mm256_add_ps(lo, _mm256_mul_ps(x, b ? _mm256_loadu_ps(b + i) : x));
    hi = _mm256_add_ps(hi, _mm256_mul_ps(y, b ? _mm256_loadu_ps(b + i + 8) : y));
  }
  _mm256_storeu_ps(acc, lo);
  _mm256_storeu_ps(acc + 8, hi);
  return i;
}
#else
template <class T, class S>
inline Index f16c_lanes(T const*, float const*, Index, float*, S) noexcept {
  return 0;  // never called: hardware_lanes<T> is false without F16C
}
#endif

}  // namespace kvc::detail
