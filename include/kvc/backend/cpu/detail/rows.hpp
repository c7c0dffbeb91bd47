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

/// A float view of `dim` elements at `src`: a zero-copy map for float rows; 16-bit rows are widened into
/// `scratch` (caller-owned, `dim` floats) by detail::widen (exact; the hardware conversion where compiled).
template <class T>
inline FloatRow float_row(T const* src, Index dim, float* scratch) noexcept {
  if constexpr (std::is_same_v<std::remove_const_t<T>, float>) {
    return FloatRow(src, dim);
  } else {
    widen(src, scratch, dim);
    return FloatRow(scratch, dim);
  }
}

/// Lanes of independent fp32 accumulators: reductions vectorise without -ffast-math (no reassociation needed),
/// and 16 lanes hide the add latency at 8-wide AVX. The summation order is fixed, so results are deterministic.
inline constexpr Index reduce_lanes = 16;
static_assert(reduce_lanes == 16, "f16c_lanes() (widen.hpp) holds the 16 lanes as two 8-wide vectors");

/// sum_i a[i] * b[i] in fp32 with reduce_lanes partial sums; `a` may hold 16-bit elements, widened in registers
/// (no scratch round trip).
template <class T>
inline float dot(T const* a, float const* b, Index dim) noexcept {
  float acc[reduce_lanes] = {};
  Index i = 0;
  if constexpr (hardware_lanes<T>) {  // fp16 widened by F16C, same lanes and order
    i = f16c_lanes(a, b, dim, acc);
  } else {
    for (; i + reduce_lanes <= dim; i += reduce_lanes)
      for (Index j = 0; j < reduce_lanes; ++j)
        acc[j] += to_float(a[i + j]) * b[i + j];
  }
  for (; i < dim; ++i)
    acc[i % reduce_lanes] += to_float(a[i]) * b[i];
  for (Index width = reduce_lanes / 2; width > 0; width /= 2)  // a tree: log2(16) dependent adds, not 16
    for (Index j = 0; j < width; ++j)
      acc[j] += acc[j + width];
  return acc[0];
}

/// sum_i a[i]^2 in fp32 (a may hold 16-bit elements, widened in registers).
template <class T>
inline float sum_squares(T const* a, Index dim) noexcept {
  float acc[reduce_lanes] = {};
  Index i = 0;
  if constexpr (hardware_lanes<T>) {
    i = f16c_lanes(a, nullptr, dim, acc);
  } else {
    for (; i + reduce_lanes <= dim; i += reduce_lanes)
      for (Index j = 0; j < reduce_lanes; ++j)
        acc[j] += to_float(a[i + j]) * to_float(a[i + j]);
  }
  for (; i < dim; ++i)
    acc[i % reduce_lanes] += to_float(a[i]) * to_float(a[i]);
  for (Index width = reduce_lanes / 2; width > 0; width /= 2)
    for (Index j = 0; j < width; ++j)
      acc[j] += acc[j + width];
  return acc[0];
}

/// sum_i a[i]^2 in fp64, in index order: the rare path for rows outside sum_squares_in_range().
template <class T>
inline double sum_squares_fp64(T const* a, Index dim) noexcept {
  double acc = 0.0;
  for (Index i = 0; i < dim; ++i) {
    double const x = to_float(a[i]);
    acc += x * x;
  }
  return acc;
}

/// a . b and ||a||^2 in fp64 in one pass (the rare path of a cosine whose row norm is out of range).
struct DotSquares {
  double dot, squares;
};
template <class T>
inline DotSquares dot_squares_fp64(T const* a, float const* b, Index dim) noexcept {
  DotSquares r{0.0, 0.0};
  for (Index i = 0; i < dim; ++i) {
    double const x = to_float(a[i]);
    r.dot += x * b[i];
    r.squares += x * x;
  }
  return r;
}

/// Whether every element of a row is finite (no NaN, no Inf): |x| <= FLT_MAX is false for both.
template <class T>
inline bool all_finite(T const* a, Index dim) noexcept {
  bool finite = true;
  for (Index i = 0; i < dim; ++i)
    finite = finite && std::abs(to_float(a[i])) <= std::numeric_limits<float>::max();
  return finite;
}

/// y += s * x.
inline void axpy(float* y, float const* x, float s, Index dim) noexcept {
  for (Index i = 0; i < dim; ++i)
    y[i] += s * x[i];
}

}  // namespace kvc::detail
