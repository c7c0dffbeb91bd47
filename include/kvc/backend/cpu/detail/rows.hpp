// SPDX-License-Identifier: Apache-2.0
// kvc/backend/cpu/detail/rows.hpp: fp32 views of K/V rows and the small vector loops CPU kernels share.
#pragma once

#include <kvc/backend/cpu/detail/widen.hpp>
#include <kvc/core/element.hpp>
#include <kvc/core/extents.hpp>
#include <kvc/core/norm_range.hpp>  // sum_squares_in_range, norm_in_range: the fp64 paths below

#include <Eigen/Core>

#include <cmath>
#include <limits>
#include <type_traits>

namespace kvc::detail {

using FloatRow = Eigen::Map<Eigen::VectorXf const>;

/// A float view of `dim` elements at `src` under a view's scale (core/access.hpp): a zero-copy map for unscaled
/// float rows; other rows are loaded into `scratch` (caller-owned, `dim` floats) by detail::widen (exact; the hardware
/// conversion where compiled; then the scale's one product).
template <class T, class S = Unit>
inline FloatRow float_row(T const* src, Index dim, float* scratch, S scale = {}) noexcept {
  if constexpr (std::is_same_v<std::remove_const_t<T>, float> && std::is_same_v<S, Unit>) {
    return FloatRow(src, dim);
  } else {
    widen(src, scratch, dim, scale);
    return FloatRow(scratch, dim);
  }
}

/// Lanes of independent fp32 accumulators: reductions vectorise without -ffast-math (no reassociation needed),
/// and 16 lanes hide the add latency at 8-wide AVX. The summation order is fixed, so results are deterministic.
inline constexpr Index reduce_lanes = 16;
static_assert(reduce_lanes == 16, "f16c_lanes() (widen.hpp) holds the 16 lanes in one zmm or two ymm registers");

/// sum_i a[i] * b[i] in fp32 with reduce_lanes partial sums; `a` may hold 16-bit or 8-bit elements under a view's
/// scale (core/access.hpp), loaded in registers (no scratch round trip).
template <class T, class S = Unit>
inline float dot(T const* a, float const* b, Index dim, S scale = {}) noexcept {
  float acc[reduce_lanes] = {};
  Index i = 0;
  if constexpr (hardware_lanes<T>) {  // fp16 and fp8 widened by F16C, same lanes and order
    float* lanes = acc;
    i = f16c_lanes<1>(&a, b, dim, &lanes, scale);
  } else {
    for (; i + reduce_lanes <= dim; i += reduce_lanes)
      for (Index j = 0; j < reduce_lanes; ++j)
        acc[j] += load(a[i + j], scale) * b[i + j];
  }
  for (; i < dim; ++i)
    acc[i % reduce_lanes] += load(a[i], scale) * b[i];
  for (Index width = reduce_lanes / 2; width > 0; width /= 2)  // a tree: log2(16) dependent adds, not 16
    for (Index j = 0; j < width; ++j)
      acc[j] += acc[j + width];
  return acc[0];
}

/// out[r] = sum_i a[r][i]^2 in fp32 for R rows (they may hold 16-bit or 8-bit elements under a view's scale, loaded
/// in registers); each row's sum is bit-identical to sum_squares' of it alone. Why several: one row's reduce_lanes
/// partial sums form a chain of dependent adds (8 at d = 128), which bounds a loop over rows by the add latency; R
/// rows in one loop give R independent chains (reduction_rows says how many pay off).
template <int R, class T, class S = Unit>
inline void sum_squares_rows(T const* const (&a)[R], Index dim, S scale, float (&out)[R]) noexcept {
  float acc[R][reduce_lanes] = {};
  Index blocks = 0;  // elements done by the hardware lanes, all rows together
  if constexpr (hardware_lanes<T>) {
    float* lanes[R];
    for (int r = 0; r < R; ++r)
      lanes[r] = acc[r];
    blocks = f16c_lanes<R>(a, nullptr, dim, lanes, scale);
  }
  for (int r = 0; r < R; ++r) {  // the portable loop row by row (interleaved rows kept GCC 12 from vectorising it)
    Index i = blocks;
    for (; i + reduce_lanes <= dim; i += reduce_lanes)
      for (Index j = 0; j < reduce_lanes; ++j)
        acc[r][j] += load(a[r][i + j], scale) * load(a[r][i + j], scale);
    for (; i < dim; ++i)
      acc[r][i % reduce_lanes] += load(a[r][i], scale) * load(a[r][i], scale);
    for (Index width = reduce_lanes / 2; width > 0; width /= 2)
      for (Index j = 0; j < width; ++j)
        acc[r][j] += acc[r][j + width];
    out[r] = acc[r][0];
  }
}

/// Rows of T a row-wise reduction (sum_squares_rows) should take per pass: 4 where one row's chain of adds bounds the
/// loop, measured on Knorm (docs/benchmarks.md, "Knorm: rows per pass"): fp16 and fp8 with AVX2 and without AVX-512
/// (two ymm chains per row; E4M3 and E5M2 1.6-1.7x faster, fp16 bound by memory either way), and E4M3 with AVX-512
/// but without VBMI (its integer widening). Elsewhere 1: with AVX-512, four rows made fp16 and E5M2 1.2-1.4x slower.
template <class T>
inline constexpr int reduction_rows = [] {
  using E = std::remove_const_t<T>;
  if constexpr (!hardware_lanes<E>) {
    return 1;
  } else {
#if defined(__AVX512F__) && !defined(__AVX512VBMI__)
    return std::is_same_v<E, float8_e4m3> ? 4 : 1;
#elif defined(__AVX2__) && !defined(__AVX512F__)
    return 4;
#else
    return 1;
#endif
  }
}();

/// sum_i a[i]^2 in fp32 (a may hold 16-bit or 8-bit elements under a view's scale, loaded in registers).
template <class T, class S = Unit>
inline float sum_squares(T const* a, Index dim, S scale = {}) noexcept {
  T const* const rows[1] = {a};
  float out[1];
  sum_squares_rows<1>(rows, dim, scale, out);
  return out[0];
}

/// sum_i a[i]^2 in fp64, in index order: the rare path for rows outside sum_squares_in_range().
template <class T, class S = Unit>
inline double sum_squares_fp64(T const* a, Index dim, S scale = {}) noexcept {
  double acc = 0.0;
  for (Index i = 0; i < dim; ++i) {
    double const x = load(a[i], scale);
    acc += x * x;
  }
  return acc;
}

/// a . b and ||a||^2 in fp64 in one pass (the rare path of a cosine whose row norm is out of range).
struct DotSquares {
  double dot, squares;
};
template <class T, class S = Unit>
inline DotSquares dot_squares_fp64(T const* a, float const* b, Index dim, S scale = {}) noexcept {
  DotSquares r{0.0, 0.0};
  for (Index i = 0; i < dim; ++i) {
    double const x = load(a[i], scale);
    r.dot += x * b[i];
    r.squares += x * x;
  }
  return r;
}

/// Whether every element of a row (under its view's scale) is finite (no NaN, no Inf): |x| <= FLT_MAX is false for
/// both.
template <class T, class S = Unit>
inline bool all_finite(T const* a, Index dim, S scale = {}) noexcept {
  bool finite = true;
  for (Index i = 0; i < dim; ++i)
    finite = finite && std::abs(load(a[i], scale)) <= std::numeric_limits<float>::max();
  return finite;
}

/// y += s * x.
inline void axpy(float* y, float const* x, float s, Index dim) noexcept {
  for (Index i = 0; i < dim; ++i)
    y[i] += s * x[i];
}

}  // namespace kvc::detail
