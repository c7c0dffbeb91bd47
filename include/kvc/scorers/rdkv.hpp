// SPDX-License-Identifier: Apache-2.0
// kvc/scorers/rdkv.hpp: the unit weights of RDKV (rate-distortion bit allocation, arXiv 2605.08317; the authors'
// code github.com/Junkai1860/RDKV @287a4a5, obkv_fast.py `_score_one_layer`; decisions A1, A12, A15 in
// docs/policies/rdkv.md#decisions):
// one weight per V token (RDKVTokenScorer, a kvc Scorer) and one per K channel (ThinKChannelScorer, its own entry
// point kvc::score_channels). The allocator (selectors/rdkv.hpp, RDKVAllocator) turns them into bit widths.
//
// Notation, for KV head (b, h) with n valid slots j (positions pos(j), ascending) and the g = Hq / Hkv query heads of
// its group; the window is the last W rows i of the window queries (positions qpos(i)); keys as stored (post-RoPE),
// queries rotated to qpos(i) when the WindowQueries carry a RopeTable (post-RoPE rows used as given):
//   a(q, i, j) = causal softmax_j( <query_{q,i}, key_j> / sqrt(d_k) )  over the slots with pos(j) <= qpos(i)
//   n_j        = #{ window rows i : qpos(i) >= pos(j) }  (the rows that see slot j; W for slots before the window,
//                W − i for the i-th window token in the authors' contiguous prefill — their `correct_norm`)
//
// RDKVTokenScorer, weight = attn_linear (the default; the authors' shipped `v_score_type=attn_linear`):
//   s_j = ( sum_{q in group} sum_{i in window} a(q, i, j) ) / n_j          (0 when n_j = 0: no window row sees j)
//   w_j = AvgPool1d(s, kernel k' = min(kernel_size, 2n − 1), stride 1, REFLECT padding)_j
//       = (1 / k') sum_{o = −r..r} s_{reflect(j + o)},  r = k' / 2,  reflect(x) = −x (x < 0), 2(n − 1) − x (x >= n)
//   (PyTorch's F.pad(mode="reflect") mirrors without repeating the edge: s_{−1} = s_1. n = 1: the identity;
//   n = 2: kernel 3. The authors shrink the kernel so that the reflection exists, r < n.) Linear attention mass:
//   not squared, no sigma². Window tokens are scored like every other token (no protection, A12): the
//   allocator may evict or quantise them.
// RDKVTokenScorer, weight = derived (A1's option, the first-order distortion of quantising v_j; docs/policies/rdkv.md):
//   e_j = ( sum_{q in group} sum_{i in window} a(q, i, j)² ) / n_j          (E_i[a²] summed over the group)
//   w_j = AvgPool1d(e)_j · d_v · sigma_j²,  sigma_j² = population variance of the d_v entries of value_j
//   The pooling (same kernel and reflect rule; kernel_size = 1 turns it off, the bare theory weight) smooths only
//   the attention statistic, as in attn_linear; the variance stays a property of the token itself.
// Precision: the authors score in the model dtype (FP16 softmax) unless OBKV_SCORE_FP32=1; kvc always computes the
// logits, the softmax and the sums in fp32 (16-bit keys, values and queries are widened exactly), i.e. the
// authors' OBKV_SCORE_FP32=1 path. FP16 scores only add rounding noise that the allocation then depends on.
//
// ThinKChannelScorer (the authors' `k_score_type=think`, A15):
//   w_c = mean_{q in group, i in window}( query_{q,i,c}² )  ·  mean_{j < n}( key_{j,c}² )
// over post-RoPE queries (rotated as above) and keys as stored: mean squares, not variances, not pooled; one score
// per (sequence, KV head, channel), out [batch, Hkv, d_k] fp32 (the mean over an empty head's tokens is 0).
//
// Any kvc token scorer can supply V-token weights instead of RDKVTokenScorer (A1: SnapKV, ExpectedAttention,
// KeyDiff, TOVA, H2O...): RDKVAllocator takes any ScoreSpan. The allocator needs weights >= 0 and finite on valid
// slots, so scores that can be negative (KeyDiff's negated cosine, log-domain scores) must be shifted or
// exponentiated by the caller; a common positive factor does not change the plan.
#pragma once

#include <kvc/core/backend.hpp>
#include <kvc/core/checks.hpp>
#include <kvc/core/kernel.hpp>
#include <kvc/core/kv_view.hpp>
#include <kvc/core/observations.hpp>
#include <kvc/core/scorer.hpp>
#include <kvc/core/status.hpp>
#include <kvc/core/workspace.hpp>

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace kvc {

/// Which per-token weight RDKVTokenScorer computes (see the file comment).
enum class RDKVTokenWeight : std::uint8_t {
  attn_linear,  ///< sum over the group and window of a, divided by n_j, reflect-pooled (the authors' default)
  derived,      ///< E_window[a²] summed over the group, reflect-pooled, times d_v · var(v_j) (A1's option)
};

/// Slot j of PyTorch's AvgPool1d(kernel k', stride 1) over F.pad(x, (r, r), mode="reflect") of x(0 .. n - 1), with
/// k' = min(k, 2n - 1) and r = k' / 2 (the authors' apply_score_pooling: the kernel shrinks so that the reflection
/// exists, r <= n - 1). Reflection mirrors without repeating the edge: x(-o) = x(o), x(n - 1 + o) = x(n - 1 - o).
/// Every window holds k' real values, so the mean always divides by k'. k odd, n >= 1. Host and device: both
/// backends' RDKV token weights call it.
template <class X>
KVC_HOST_DEVICE float reflect_avg_pooled_at(Index n, Index k, Index j, X const& x) noexcept {
  Index const kk = k < 2 * n - 1 ? k : 2 * n - 1, r = kk / 2;
  float sum = 0.0f;
  for (Index t = j - r; t <= j + r; ++t)  // left to right, as the pooled window lies
    sum += x(t < 0 ? -t : (t >= n ? 2 * (n - 1) - t : t));
  return sum * (1.0f / static_cast<float>(kk));
}

/// RDKV's V-token weights w_j [batch, Hkv, tokens] fp32 (kvc::score; padding slots -inf). Higher = more distortion
/// when the token is compressed. `needs` names values for `derived` (attn_linear reads only keys and queries).
struct RDKVTokenScorer {
  static constexpr Needs needs = Needs::keys | Needs::values | Needs::window_queries;
  static constexpr std::string_view name = "rdkv";

  RDKVTokenWeight weight = RDKVTokenWeight::attn_linear;
  Index window_size = 32;  ///< W: the last W rows of the window queries (the authors' obs_window 32)
  Index kernel_size = 5;  ///< reflect-avg pooling kernel, odd, >= 1 (1: no pooling); shrunk to 2n − 1 for short heads

  constexpr Status check() const noexcept {
    if (weight != RDKVTokenWeight::attn_linear && weight != RDKVTokenWeight::derived)
      return {Errc::invalid_argument, "RDKVTokenScorer: `weight` must be attn_linear or derived"};
    if (window_size < 1)
      return {Errc::invalid_argument, "RDKVTokenScorer: `window_size` must be >= 1"};
    if (kernel_size < 1 || kernel_size % 2 == 0)
      return {Errc::invalid_argument, "RDKVTokenScorer: `kernel_size` must be odd and >= 1 (an even kernel shifts)"};
    return {};
  }
};

/// ThinK's K-channel weights w_c [batch, Hkv, d_k] fp32, computed by kvc::score_channels (not kvc::score: the
/// output has one entry per channel, not per token).
struct ThinKChannelScorer {
  static constexpr Needs needs = Needs::keys | Needs::window_queries;
  static constexpr std::string_view name = "think";

  Index window_size = 32;  ///< W: the last W rows of the window queries

  constexpr Status check() const noexcept {
    if (window_size < 1)
      return {Errc::invalid_argument, "ThinKChannelScorer: `window_size` must be >= 1"};
    return {};
  }
};

/// Bytes of workspace kvc::score_channels needs on a cache whose keys have extents `keys`, with observations `obs`
/// (any alignment; includes one copy per CPU worker).
template <Backend B, ObservationSet Obs>
std::size_t channel_score_workspace_bytes(B const& backend, ThinKChannelScorer const& scorer, KVExtents const& keys,
                                          Obs const& obs) {
  static_assert(HasKernel<ThinKChannelScorer, B>,
                "kvc::score_channels: include <kvc/backend/cpu/scorers/rdkv.hpp> (kvc::Cpu) for the kernel");
  if constexpr (HasKernel<ThinKChannelScorer, B>)
    return bytes_sum(Kernel<ThinKChannelScorer, B>::workspace_bytes(backend, scorer, keys, obs), workspace_slack);
  else
    return 0;
}

/// The same query from the cache itself.
template <Backend B, KVCacheView C, ObservationSet Obs>
std::size_t channel_score_workspace_bytes(B const& backend, ThinKChannelScorer const& scorer, C const& cache,
                                          Obs const& obs) {
  return channel_score_workspace_bytes(backend, scorer, cache.keys.extents(), obs);
}

/// Writes ThinK's channel weights of every (batch, KV head) into `out` [batch, heads, d_k] fp32 (contiguous, in the
/// backend's memory space). `obs` must hold window queries [batch, Hq, >= window_size, d_k] (Hq a multiple of Hkv).
/// Errors: scorer parameters, shapes, lengths, positions or RoPE table (invalid_argument), null `out`,
/// workspace smaller than channel_score_workspace_bytes() (out_of_capacity).
template <Backend B, KVCacheView C, ObservationSet Obs>
Status score_channels(B const& backend, ThinKChannelScorer const& scorer, C const& cache, Obs const& obs, float* out,
                      Workspace ws) {
  static_assert(AccessibleFrom<C, B>,
                "kvc::score_channels: the cache lives in a memory space this backend cannot read");
  static_assert(ObservationsReadableBy<Obs, B>,
                "kvc::score_channels: the observations live in a memory space this backend cannot read");
  static_assert(HasKernel<ThinKChannelScorer, B>,
                "kvc::score_channels: include <kvc/backend/cpu/scorers/rdkv.hpp> (kvc::Cpu) for the kernel");
  static_assert(HasWindowQueries<Obs>,
                "kvc::score_channels: ThinK needs window queries: pass kvc::observe(kvc::WindowQueries<T, Space>{rows, "
                "rope, positions})");
  if constexpr (AccessibleFrom<C, B> && ObservationsReadableBy<Obs, B> && HasKernel<ThinKChannelScorer, B> &&
                HasWindowQueries<Obs>) {
    KVC_RETURN_IF_ERROR(scorer.check());
    KVExtents const e = cache.keys.extents();
    KVC_RETURN_IF_ERROR(detail::check_cache(cache, KVC_CACHE_MESSAGES("kvc::score_channels", "the cache")));
    if (out == nullptr && e.batch * e.heads * e.dim > 0)
      return {Errc::invalid_argument, "kvc::score_channels: `out` is null"};
    detail::ByteRange const written = detail::bytes_of(out, e.batch * e.heads * e.dim), scratch = detail::bytes_of(ws);
    if (detail::overlaps_cache(written, cache))
      return {Errc::invalid_argument, "kvc::score_channels: `out` overlaps the cache's keys or values"};
    if (detail::overlaps_cache(scratch, cache) || detail::overlap(scratch, written))
      return {Errc::invalid_argument,
              "kvc::score_channels: the workspace overlaps `out` or the cache's keys or values"};
    if (ws.bytes < Kernel<ThinKChannelScorer, B>::workspace_bytes(backend, scorer, e, obs))
      return {Errc::out_of_capacity, "kvc::score_channels: workspace smaller than channel_score_workspace_bytes()"};
    return Kernel<ThinKChannelScorer, B>::run(backend, scorer, cache, obs, out, ws);
  } else {
    return {Errc::invalid_argument, "unreachable"};
  }
}

}  // namespace kvc
