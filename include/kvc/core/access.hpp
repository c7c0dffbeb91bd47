// SPDX-License-Identifier: Apache-2.0
// kvc/core/access.hpp: how a K or V view's stored elements become fp32 values (mdspan's accessor, beside the layout).
//
// The value of element c of row (b, h, t) is load(row[c], view.scale(b, h)): to_float of the stored element times
// the view's scale for head (b, h). Kernels read every cache element this way, so a quantised cache is read by the
// same scorers, compaction and attention as a 16-bit one. Two accessors:
//  - PlainAccess (float, half, bfloat16 views): the scale is kvc::Unit, an empty type whose product is the value
//    itself, so unscaled caches pay nothing;
//  - ScaledAccess (fp8 views, vLLM's convention; docs/fp8.md): stored byte = quantize(x / scale), value =
//    decode(byte) * scale in fp32, with one fp32 scale per tensor or per KV head (vLLM's k_scale[num_kv_heads]) or
//    per (sequence, KV head). decode is exact and the product rounds once, so a kernel reading an fp8 cache computes
//    exactly what it computes on the dequantised fp32 cache.
#pragma once

#include <kvc/config.hpp>
#include <kvc/core/element.hpp>
#include <kvc/core/extents.hpp>

#include <type_traits>

namespace kvc {

/// The scale of an unscaled view: multiplying or dividing by it is the identity (no instruction).
struct Unit {};
KVC_HOST_DEVICE constexpr float operator*(float x, Unit) noexcept {
  return x;
}
KVC_HOST_DEVICE constexpr float operator/(float x, Unit) noexcept {
  return x;
}
KVC_HOST_DEVICE constexpr bool same_scale(Unit, Unit) noexcept {
  return true;
}
KVC_HOST_DEVICE constexpr bool same_scale(float a, float b) noexcept {
  return a == b;
}
KVC_HOST_DEVICE constexpr bool same_scale(Unit, float b) noexcept {
  return b == 1.0f;
}
KVC_HOST_DEVICE constexpr bool same_scale(float a, Unit) noexcept {
  return a == 1.0f;
}

/// Access of float, half and bfloat16 views: value = to_float(stored).
struct PlainAccess {
  KVC_HOST_DEVICE static constexpr Unit scale(Index, Index) noexcept { return {}; }
};

/// Access of fp8 views: value = to_float(stored) * scale(b, h). The scales are fp32 in the view's memory space.
struct ScaledAccess {
  float value = 1.0f;            ///< the per-tensor scale, used when `table` is null (1: uncalibrated, as vLLM)
  float const* table = nullptr;  ///< per-head scales: table[b * batch_stride + h]
  Index batch_stride = 0;  ///< 0: one scale per KV head ([heads]); heads: per (sequence, KV head) ([batch, heads])

  KVC_HOST_DEVICE constexpr float scale(Index b, Index h) const noexcept {
    return table ? table[b * batch_stride + h] : value;
  }
};

/// One scale for the whole tensor (vLLM's per-layer k_scale / v_scale).
constexpr ScaledAccess tensor_scale(float scale) noexcept {
  return {scale, nullptr, 0};
}
/// One scale per KV head, `scales` = [heads] (vLLM's per-head k_scale[num_kv_heads]).
constexpr ScaledAccess head_scales(float const* scales) noexcept {
  return {1.0f, scales, 0};
}
/// One scale per (sequence, KV head), `scales` = [batch, heads].
constexpr ScaledAccess sequence_head_scales(float const* scales, Index heads) noexcept {
  return {1.0f, scales, heads};
}

/// The accessor a view of element type T takes unless told otherwise: scaled for fp8, plain for the others.
template <class T>
using default_access = std::conditional_t<is_fp8<T>, ScaledAccess, PlainAccess>;

/// The fp32 value of a stored element under a scale (Unit or float): exact decode, then one rounding. On the device
/// the product is __fmul_rn, which nvcc never fuses into an FMA with a following add: the value is the dequantised
/// cache's whatever the caller does with it. (Host compilers fuse only where allowed: -ffp-contract=off keeps every
/// product rounded; GCC's default for GNU C++, fast, may fuse it into a following add, one rounding fewer.)
template <class T, class S>
KVC_HOST_DEVICE constexpr float load(T x, S scale) noexcept {
#if defined(__CUDA_ARCH__)
  if constexpr (std::is_same_v<S, float>)
    return __fmul_rn(to_float(x), scale);
  else
#endif
    return to_float(x) * scale;
}

/// The element of type T that stores fp32 value x under a scale: from_float(x / scale) (round to nearest even; fp8
/// saturates).
template <class T, class S>
KVC_HOST_DEVICE constexpr T store(float x, S scale) noexcept {
  return from_float<T>(x / scale);
}

/// Copies `dim` elements of a row from one view into another: the stored elements themselves when both have the same
/// type and scale (compaction, gather and append move bytes, never re-quantise), else each value load()-ed under the
/// source's scale and store()-d under the destination's (widening, narrowing, or an fp8 row moving between scales).
template <class Dst, class DS, class Src, class SS>
KVC_HOST_DEVICE constexpr void copy_elements(Dst* dst, DS dst_scale, Src const* src, SS src_scale, Index dim) noexcept {
  if (std::is_same_v<std::remove_const_t<Src>, Dst> && same_scale(dst_scale, src_scale)) {
    if constexpr (std::is_same_v<std::remove_const_t<Src>, Dst>)
      for (Index i = 0; i < dim; ++i)
        dst[i] = src[i];
  } else {
    for (Index i = 0; i < dim; ++i)
      dst[i] = store<Dst>(load(src[i], src_scale), dst_scale);
  }
}

}  // namespace kvc
