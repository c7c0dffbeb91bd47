// SPDX-License-Identifier: Apache-2.0
// kvc/backend/cpu/detail/rows.hpp: float views of K/V rows for CPU kernels (Eigen maps, widening fp16/bf16).
#pragma once

#include <kvc/core/element.hpp>
#include <kvc/core/extents.hpp>

#include <Eigen/Core>

#include <type_traits>

namespace kvc::detail {

using FloatRow = Eigen::Map<Eigen::VectorXf const>;

/// A float view of `dim` elements at `src`: a zero-copy map for float rows; 16-bit rows are widened into
/// `scratch` (caller-owned, `dim` floats). Widening is exact.
template <class T>
inline FloatRow float_row(T const* src, Index dim, float* scratch) noexcept {
  if constexpr (std::is_same_v<std::remove_const_t<T>, float>) {
    return FloatRow(src, dim);
  } else {
    for (Index i = 0; i < dim; ++i)
      scratch[i] = to_float(src[i]);
    return FloatRow(scratch, dim);
  }
}

}  // namespace kvc::detail
