// SPDX-License-Identifier: Apache-2.0
// kvc/scorers/moments.hpp: the moments of an evicted set (MomentKV, arXiv 2606.01563, Eqs. 8–12, 22–25), their storage,
// their memory, and the scalar algebra every backend shares.
//
// For the evicted set E of one (sequence, KV head), kvc stores the numerically stable Welford form:
//   n  = |E|                                   (int64)
//   k̄  = (1/n) Σ_E k_i                          [d_k]
//   v̄  = (1/n) Σ_E v_i                          [d_v]
//   C  = Σ_E (v_i − v̄)(k_i − k̄)ᵀ = S − s_v s_kᵀ/n = S̃   [d_v, d_k], row-major (value index first)
// instead of the paper's raw sums (s_k = n k̄, s_v = n v̄, S = C + n v̄ k̄ᵀ): the means cannot overflow a 16-bit
// store and the co-moment does not cancel catastrophically (docs/policies/moment_kv.md, A10). Two sets merge with
// Chan's formula, which is also how one evicted block (a GEMM of its centred rows) or one evicted token (Welford) joins
// the state: the update is additive, so the order of evictions does not matter (up to rounding).
//
// Keys are post-RoPE, exactly as the cache stores them (A8). All arithmetic is fp32 (fp64 in the tests'
// instantiations of the algebra below); storage is fp32 by default or 16-bit (the paper's setting), rounded once
// per update.
#pragma once

#include <kvc/core/backend.hpp>
#include <kvc/core/element.hpp>
#include <kvc/core/extents.hpp>
#include <kvc/core/status.hpp>
#include <kvc/core/workspace.hpp>

#include <cmath>
#include <cstddef>

namespace kvc {

/// Caller-owned moments of one layer's evicted sets, one per (sequence, KV head), in memory space `Space`, stored
/// as `T` (float by default; half or bfloat16 for the paper's 16-bit setting). Zero every buffer at the start of a
/// generation (n = 0 means "nothing evicted": the correction and the residual then reduce to the plain case).
template <class Space = HostSpace, class T = float>
struct MomentState {
  using memory_space = Space;
  using value_type = T;

  Index* count = nullptr;   ///< [batch, heads] evicted tokens n
  T* key_mean = nullptr;    ///< [batch, heads, key_dim] k̄
  T* value_mean = nullptr;  ///< [batch, heads, value_dim] v̄
  T* comoment = nullptr;    ///< [batch, heads, value_dim, key_dim] C = Σ (v − v̄)(k − k̄)ᵀ, row-major
  Index batch = 0;
  Index heads = 0;
  Index key_dim = 0;
  Index value_dim = 0;

  KVC_HOST_DEVICE constexpr Index head(Index b, Index h) const noexcept { return b * heads + h; }
  KVC_HOST_DEVICE constexpr T* key_mean_of(Index b, Index h) const noexcept { return key_mean + head(b, h) * key_dim; }
  KVC_HOST_DEVICE constexpr T* value_mean_of(Index b, Index h) const noexcept {
    return value_mean + head(b, h) * value_dim;
  }
  KVC_HOST_DEVICE constexpr T* comoment_of(Index b, Index h) const noexcept {
    return comoment + head(b, h) * value_dim * key_dim;
  }

  /// Whether the buffers are set for `batch` x `heads` heads of the given dims.
  constexpr Status check(Index batch_, Index heads_, Index key_dim_, Index value_dim_) const noexcept {
    if (batch != batch_ || heads != heads_ || key_dim != key_dim_ || value_dim != value_dim_)
      return {Errc::invalid_argument,
              "MomentState: must be [batch, KV heads] of the cache with its key and value dims"};
    if (batch * heads > 0 && (count == nullptr || key_mean == nullptr || value_mean == nullptr || comoment == nullptr))
      return {Errc::invalid_argument, "MomentState: `count`, `key_mean`, `value_mean` and `comoment` must be set"};
    return {};
  }
};

/// Bytes of the moments of one KV head (paper App. A.1, Table 5): (d_v·d_k + d_k + d_v) elements of `element_bytes`
/// plus the 8-byte count. At d = 128 in 16 bits: 33,280 + 8 bytes.
constexpr std::size_t moment_head_bytes(Index key_dim, Index value_dim, std::size_t element_bytes) noexcept {
  return bytes_sum(bytes_product(bytes_sum(bytes_product(value_dim, key_dim), static_cast<std::size_t>(key_dim),
                                           static_cast<std::size_t>(value_dim)),
                                 element_bytes),
                   sizeof(Index));
}

/// Bytes of a MomentState for `batch` x `heads` heads (the four buffers, unpadded).
template <class T = float>
constexpr std::size_t moment_state_bytes(Index batch, Index heads, Index key_dim, Index value_dim) noexcept {
  return bytes_product(bytes_product(batch, heads), moment_head_bytes(key_dim, value_dim, sizeof(T)));
}

/// The moments' memory beside the cache they summarise: per head and relative to `kept` retained tokens
/// of K and V stored as `cache_element_bytes` (the paper's ratio (d + 2) / (2L) for d_k = d_v = d, 16-bit both).
struct MomentMemory {
  std::size_t head_bytes = 0;  ///< moment_head_bytes
  std::size_t kept_bytes = 0;  ///< kept · (d_k + d_v) · cache_element_bytes
  double ratio_to_kept = 0.0;  ///< head_bytes / kept_bytes (0 when nothing is kept)
};

constexpr MomentMemory moment_memory(Index key_dim, Index value_dim, std::size_t moment_element_bytes, Index kept,
                                     std::size_t cache_element_bytes) noexcept {
  MomentMemory m;
  m.head_bytes = moment_head_bytes(key_dim, value_dim, moment_element_bytes);
  m.kept_bytes = bytes_product(bytes_product(kept, key_dim + value_dim), cache_element_bytes);
  m.ratio_to_kept = m.kept_bytes > 0 ? static_cast<double>(m.head_bytes) / static_cast<double>(m.kept_bytes) : 0.0;
  return m;
}

/// Which estimate of the evicted attention output the correction uses (paper Eq. 9; Table 4's ablation).
enum class MomentOrder : unsigned char {
  first,   ///< f̂_E(q) = v̄ + (c / n) C̃ q (the paper's)
  zeroth,  ///< f̂_E = v̄ (the paper's Table 4 ablation; still weighted by Ẑ_E)
};

namespace detail {

/// The clamp of the paper's App. C.2: entries of C with |x| < tau read as zero (tau = 0 disables it).
template <class Real>
KVC_HOST_DEVICE constexpr Real clamp_small(Real x, Real tau) noexcept {
  return (x < tau && -x < tau) ? Real(0) : x;
}

/// Chan's merge of set B (n_b, k̄_b, v̄_b, C_b) into set A (n_a, k̄_a, v̄_a, C_a), in place in A's fp `Real` arrays
/// (paper Eq. 25, centred). n_b = 1 with C_b = 0 is Welford's single add. C_b may be null (zero). Exact for n_a = 0.
///   n = n_a + n_b;  Δk = k̄_b − k̄_a;  Δv = v̄_b − v̄_a;  k̄ += (n_b/n) Δk;  v̄ += (n_b/n) Δv;
///   C = C_a + C_b + (n_a n_b / n) Δv Δkᵀ
template <class Real>
KVC_HOST_DEVICE inline void merge_moments(Index n_a, Real* key_mean, Real* value_mean, Real* comoment, Index n_b,
                                          Real const* key_mean_b, Real const* value_mean_b, Real const* comoment_b,
                                          Index dk, Index dv, Real* scratch_dk) noexcept {
  if (n_b <= 0)
    return;
  Index const n = n_a + n_b;
  Real const wb = static_cast<Real>(n_b) / static_cast<Real>(n);
  Real const cross = static_cast<Real>(n_a) * wb;  // n_a n_b / n
  for (Index c = 0; c < dk; ++c) {
    Real const dkc = key_mean_b[c] - key_mean[c];
    scratch_dk[c] = dkc;
    key_mean[c] += wb * dkc;
  }
  for (Index a = 0; a < dv; ++a) {
    Real const dva = value_mean_b[a] - value_mean[a];
    value_mean[a] += wb * dva;
    Real* row = comoment + a * dk;
    Real const* row_b = comoment_b ? comoment_b + a * dk : nullptr;
    Real const s = cross * dva;
    for (Index c = 0; c < dk; ++c)
      row[c] += (row_b ? row_b[c] : Real(0)) + s * scratch_dk[c];
  }
}

/// log(exp(a) + exp(b)) without overflow; -inf when both are -inf.
template <class Real>
KVC_HOST_DEVICE inline Real log_add_exp(Real a, Real b) noexcept {
  Real const hi = a > b ? a : b, lo = a > b ? b : a;
  if (hi == -INFINITY)
    return hi;
  return hi + std::log1p(std::exp(lo - hi));
}

/// The normalisation-corrected merge of one query row (paper Eq. 12 in the log domain, Eq. 37): the retained attention
/// (out_r [d_v], lse_r = log Z_R) and the evicted set as one virtual token with log-weight lse_e = log n + c qᵀk̄
/// and value f̂_E [d_v] (in `estimate`) become out = ŵ_R out_r + ŵ_E f̂_E with ŵ_R = sigmoid(lse_r − lse_e) and
/// ŵ_E = 1 − ŵ_R, written in place into out_r. Returns lse = logaddexp(lse_r, lse_e), the merged state's
/// log-sum-exp. Both weights come from one e = exp(−|lse_r − lse_e|) (1/(1 + e) and e/(1 + e)), so they sum to 1
/// to rounding and only a difference of log-weights is exponentiated: stable for logits near ±1000. lse_r = -inf
/// (no retained slot visible) gives out = f̂_E; lse_e = -inf leaves out_r as it is.
template <class Real>
KVC_HOST_DEVICE inline Real merge_evicted(Real* out_r, Real lse_r, Real const* estimate, Real lse_e,
                                          Index dv) noexcept {
  if (lse_e == -INFINITY)
    return lse_r;
  if (lse_r == -INFINITY) {
    for (Index a = 0; a < dv; ++a)
      out_r[a] = estimate[a];
    return lse_e;
  }
  Real const diff = lse_r - lse_e;
  Real const e = std::exp(diff < 0 ? diff : -diff);
  Real const big = Real(1) / (Real(1) + e), small = e / (Real(1) + e);
  Real const w_r = diff >= 0 ? big : small, w_e = diff >= 0 ? small : big;
  for (Index a = 0; a < dv; ++a)
    out_r[a] = w_r * out_r[a] + w_e * estimate[a];
  return (diff >= 0 ? lse_r : lse_e) + std::log1p(e);
}

}  // namespace detail
}  // namespace kvc
