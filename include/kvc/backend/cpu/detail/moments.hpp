// SPDX-License-Identifier: Apache-2.0
// kvc/backend/cpu/detail/moments.hpp: the MomentKV kernels' shared pieces (tiles, moments widened to fp32, the
// clamped comoment), used by the scorer (scorers/moment_kv.hpp) and the corrected attention (attention/corrected.hpp).
#pragma once

#include <kvc/backend/cpu/detail/rows.hpp>
#include <kvc/backend/cpu/detail/widen.hpp>
#include <kvc/backend/cpu/detail/window_attention.hpp>  // window_pack_floats
#include <kvc/scorers/moments.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <type_traits>

namespace kvc {

namespace detail {

/// Slots per tile of the moment kernels: a [64 x d] fp32 tile of K and of V stays in L1/L2 at d = 128.
inline constexpr Index moment_tile = 64;

/// Rows of C (d_v) per Eigen product, so that the packed operand stays under Eigen's 128 KiB stack limit and the
/// kernel never allocates (window_pack_floats).
constexpr Index moment_row_chunk(Index key_dim) noexcept {
  Index const r = window_pack_floats / (key_dim > 0 ? key_dim : 1);
  return r < 1 ? 1 : r;
}

/// Widens `count` rows of `dim` elements of head (b, h) starting at slot list `slots` (or slots t0 + i when
/// `slots` is null) into dst [count, dim] row-major.
template <class View>
void load_rows(View const& view, Index b, Index h, Index const* slots, Index t0, Index count, Index dim,
               float* dst) noexcept {
  for (Index i = 0; i < count; ++i)
    widen(view.row(b, h, slots ? slots[i] : t0 + i), dst + i * dim, dim, view.scale(b, h));
}

/// One head's moments in fp32: a view of a float state, or a widened copy of a 16-bit one (`scratch`).
template <class T>
struct MomentsF32 {
  float* key_mean;
  float* value_mean;
  float* comoment;
};

template <class Space, class T>
MomentsF32<T> load_moments(MomentState<Space, T> const& st, Index b, Index h, float* scratch) noexcept {
  if constexpr (std::is_same_v<T, float>) {
    return {st.key_mean_of(b, h), st.value_mean_of(b, h), st.comoment_of(b, h)};
  } else {
    float* km = scratch;
    float* vm = km + st.key_dim;
    float* cm = vm + st.value_dim;
    widen(st.key_mean_of(b, h), km, st.key_dim);
    widen(st.value_mean_of(b, h), vm, st.value_dim);
    widen(st.comoment_of(b, h), cm, st.key_dim * st.value_dim);
    return {km, vm, cm};
  }
}

template <class Space, class T>
void store_moments(MomentState<Space, T> const& st, Index b, Index h, MomentsF32<T> const& m) noexcept {
  if constexpr (!std::is_same_v<T, float>) {
    auto narrow = [](float const* src, T* dst, Index n) {
      for (Index i = 0; i < n; ++i)
        dst[i] = from_float<T>(src[i]);
    };
    narrow(m.key_mean, st.key_mean_of(b, h), st.key_dim);
    narrow(m.value_mean, st.value_mean_of(b, h), st.value_dim);
    narrow(m.comoment, st.comoment_of(b, h), st.key_dim * st.value_dim);
  }
}

/// Floats of load_moments' scratch (0 for a float state).
template <class T>
constexpr Index moment_copy_floats(Index dk, Index dv) noexcept {
  return std::is_same_v<T, float> ? 0 : dk + dv + dk * dv;
}

/// C̃ (C with |x| < tau zeroed) into dst [dv, dk] fp32.
inline void clamped_comoment(float const* c, Index count, float tau, float* dst) noexcept {
  for (Index i = 0; i < count; ++i)
    dst[i] = clamp_small(c[i], tau);
}

}  // namespace detail

}  // namespace kvc
