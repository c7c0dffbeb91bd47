// SPDX-License-Identifier: Apache-2.0
// kvc/backend/cuda/detail/logits.cuh: attention logits of one query row against a head's slots, and their
// warp-wide log-sum-exp (the window-attention kernels; the attention kernel shares key_dot).
#pragma once

#include <kvc/backend/cuda/config.cuh>
#include <kvc/core/norm_range.hpp>  // finite_logit: the CPU's rule for a non-finite logit

#include <math_constants.h>

namespace kvc::backend::cuda {

/// <q, key(b, h, j)> in fp32, channels in order (q: `dim` floats, already widened; the key under its view's scale).
template <class C>
__device__ inline float key_dot(C const& cache, Index b, Index h, Index j, float const* q) {
  auto const* k = cache.keys.row(b, h, j);
  auto const ks = cache.keys.scale(b, h);  // kvc::Unit (no instruction) unless the cache is fp8
  float dot = 0.0f;
  for (Index c = 0; c < cache.keys.extents().dim; ++c)
    dot += q[c] * load(k[c], ks);
  return dot;
}

/// scale * <q, key(b, h, j)> in fp32 (q: `dim` floats, already widened), or -inf when `causal` and the slot's
/// position is past `q_pos`, or when the logit is not finite (a NaN or Inf key): such a slot is skipped like a masked
/// one, as on the CPU (docs/api_checks.md), so one bad token neither erases its head nor spreads NaN.
template <class C>
__device__ inline float slot_logit(C const& cache, Index b, Index h, Index j, float const* q, Index q_pos, float scale,
                                   bool causal) {
  if (causal && cache.position(b, h, j) > q_pos)
    return -CUDART_INF_F;
  return detail::finite_logit(scale * key_dot(cache, b, h, j, q));
}

/// Warp-wide (every lane gets it): log of the sum over slots [0, n) of exp(slot_logit), max-shifted; -inf when no
/// slot is visible. Lanes take slots in turn, two passes (max, then the sum of exponentials).
template <class C>
__device__ inline float warp_lse(C const& cache, Index b, Index h, Index n, float const* q, Index q_pos, float scale,
                                 bool causal) {
  int const lane = static_cast<int>(threadIdx.x) % warp_size;
  float peak = -CUDART_INF_F;
  for (Index j = lane; j < n; j += warp_size)
    peak = fmaxf(peak, slot_logit(cache, b, h, j, q, q_pos, scale, causal));
  peak = warp_max(peak);
  if (peak == -CUDART_INF_F)
    return -CUDART_INF_F;
  float total = 0.0f;
  for (Index j = lane; j < n; j += warp_size)
    total += expf(slot_logit(cache, b, h, j, q, q_pos, scale, causal) - peak);
  return peak + logf(warp_sum(total));
}

}  // namespace kvc::backend::cuda
