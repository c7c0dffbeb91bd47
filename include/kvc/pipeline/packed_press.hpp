// SPDX-License-Identifier: Apache-2.0
// kvc/pipeline/packed_press.hpp: the packed policies as single policy objects, the way kvc::Press is one for the
// token-eviction policies: kvc::RDKVPress (bit allocation, docs/policies/rdkv.md) and kvc::KIVIPress (KIVI's
// uniform 2- or 4-bit plan). kvc::LayerCompressor composes them (engine/packed_compressor.hpp): after the prompt a
// bit plan per (sequence, KV head), the newest `residual` tokens left in the engine's cache as the fp16 tail (zone C,
// where decoded tokens are appended), the rest packed (kvc::pack_into); attention over the packed store and the tail,
// merged by their log-sum-exps.
#pragma once

#include <kvc/core/backend.hpp>
#include <kvc/core/keep_plan.hpp>
#include <kvc/core/kernel.hpp>
#include <kvc/core/kv_view.hpp>
#include <kvc/core/params.hpp>
#include <kvc/core/scorer.hpp>
#include <kvc/core/scores.hpp>
#include <kvc/core/status.hpp>
#include <kvc/pipeline/pack.hpp>
#include <kvc/rate_distortion/bit_plan.hpp>
#include <kvc/scorers/rdkv.hpp>
#include <kvc/selectors/rdkv.hpp>

#include <cmath>
#include <cstdint>
#include <tuple>
#include <type_traits>

namespace kvc {

/// RDKV as one policy. Token weights from `scorer`: RDKVTokenScorer (the authors' attn_linear or the derived
/// weight), or another token scorer (SnapKV, TOVA, KeyDiff, Knorm, StreamingLLM, random, ExpectedAttention, H2O over
/// the prompt's queries; decision A1), whose scores become weights by kvc::scores_as_weights. Channel weights: ThinK.
/// The allocation: `allocator` (its `residual` newest tokens stay fp16 in the engine's cache). The quantiser: `pack`.
/// The authors' preset (reference=authors) is allocator.solver = lagrangian with pack = {ZeroPoint::integer,
/// clamp_k16_to_8 = true}.
template <Scorer S = RDKVTokenScorer>
struct RDKVPress {
  using scorer_type = S;

  S scorer{};
  ThinKChannelScorer channels{};
  RDKVAllocator allocator{};
  PackOptions pack{};

  constexpr Status check() const noexcept {
    if constexpr (requires { scorer.check(); })
      KVC_RETURN_IF_ERROR(scorer.check());
    KVC_RETURN_IF_ERROR(channels.check());
    KVC_RETURN_IF_ERROR(allocator.check());
    return pack.check();
  }
  /// Window query rows the weights read: the longest window of the scorer and the channel scorer.
  constexpr Index window_rows() const noexcept {
    Index w = channels.window_size;
    if constexpr (requires { scorer.window_size; })
      w = scorer.window_size > w ? scorer.window_size : w;
    return w;
  }
  constexpr Index residual() const noexcept { return allocator.residual; }
};

/// KIVI (Liu et al., ICML 2024) as one policy: every token's K and V at `bits` (2 or 4), K per channel over groups of
/// `group` consecutive tokens, V per token over groups of `group` channels (float_min zero point), the newest
/// `residual` tokens of each head kept in fp16 (KIVI's residual window; decoded tokens join it). Reads no queries.
struct KIVIPress {
  static constexpr std::string_view name = "kivi";

  int bits = 2;          ///< 2 or 4
  Index group = 32;      ///< tokens per K group and channels per V group (>= 1)
  Index residual = 128;  ///< newest tokens of each head kept in fp16 (>= 0)

  /// The parameters the tools expose (core/params.hpp).
  static constexpr auto parameters() noexcept {
    return std::tuple{
        named_param("bits", &KIVIPress::bits, {{"2", 2}, {"4", 4}}, "2 or 4"),
        number_param("group", &KIVIPress::group, 1, 1 << 20, "tokens per K group and channels per V group"),
        number_param("residual", &KIVIPress::residual, 0, 1 << 30, "the newest tokens kept in fp16")};
  }

  constexpr Status check() const noexcept {
    if (bits != 2 && bits != 4)
      return {Errc::invalid_argument, "kvc::KIVIPress: `bits` must be 2 or 4"};
    if (group < 1)
      return {Errc::invalid_argument, "kvc::KIVIPress: `group` must be >= 1"};
    if (residual < 0)
      return {Errc::invalid_argument, "kvc::KIVIPress: `residual` must be >= 0"};
    return {};
  }
  constexpr PackOptions pack_options() const noexcept { return {ZeroPoint::float_min, group, group, false}; }
  constexpr Index window_rows() const noexcept { return 0; }
};

/// Whether P is a packed policy (a bit plan and a packed store instead of a kept set of tokens).
template <class P>
inline constexpr bool is_packed_press = false;
template <class S>
inline constexpr bool is_packed_press<RDKVPress<S>> = true;
template <>
inline constexpr bool is_packed_press<KIVIPress> = true;

/// The newest tokens of a head of `n` valid tokens that stay in the fp16 tail (zone C) outside the packed store.
KVC_HOST_DEVICE constexpr Index tail_tokens(Index n, Index residual) noexcept {
  return n < residual ? n : residual;
}

/// KIVI's bit plan of one head of `n` valid tokens in `tokens` slots: `bits` for slots [0, n - residual), 16 for the
/// newest `residual` (all when n <= residual), 0 past n; every one of the `dim` channels at `bits`. Host and device
/// (one thread per head: kvc::kivi_bit_plan's kernels).
KVC_HOST_DEVICE inline void kivi_plan(KIVIPress const& p, Index n, Index tokens, Index dim, std::int8_t* v_bits,
                                      std::int8_t* k_bits) noexcept {
  Index const quantized = n - tail_tokens(n, p.residual);
  for (Index t = 0; t < tokens; ++t)
    v_bits[t] = static_cast<std::int8_t>(t < quantized ? p.bits : (t < n ? 16 : 0));
  for (Index c = 0; c < dim; ++c)
    k_bits[c] = static_cast<std::int8_t>(p.bits);
}

/// The fp16 tail of one head of `n` valid slots: its newest tail_tokens(n, residual) slots leave the bit plan
/// (v_bits 0: not packed) and are listed in `index` (ascending) as the slots compaction keeps in the cache; returns
/// their count. Host and device.
KVC_HOST_DEVICE inline Index split_tail_head(Index n, Index residual, std::int8_t* v_bits, Index* index) noexcept {
  Index const kept = tail_tokens(n, residual);
  for (Index i = 0; i < kept; ++i) {
    v_bits[n - kept + i] = 0;
    index[i] = n - kept + i;
  }
  return kept;
}

/// A scorer's scores of one head's `n` valid tokens turned into RDKV token weights (finite, >= 0; the allocator needs
/// both): +-inf clamped to the largest / smallest finite score, NaN to the smallest, then shifted so that the
/// smallest is 0. The order is kept (ties stay ties); a head with no finite score gets weight 1 everywhere.
KVC_HOST_DEVICE inline void scores_as_weights(float* s, Index n) noexcept {
  float lo = INFINITY, hi = -INFINITY;  // the macro: numeric_limits is host-only under nvcc
  for (Index t = 0; t < n; ++t)
    if (s[t] - s[t] == 0.0f) {  // finite
      lo = s[t] < lo ? s[t] : lo;
      hi = s[t] > hi ? s[t] : hi;
    }
  if (!(lo <= hi)) {
    for (Index t = 0; t < n; ++t)
      s[t] = 1.0f;
    return;
  }
  for (Index t = 0; t < n; ++t) {
    float x = s[t] != s[t] ? lo : s[t];
    x = x < lo ? lo : (x > hi ? hi : x);
    s[t] = x - lo;
  }
}

/// Step tag of the packed policies' planning kernels (core/kernel.hpp): Kernel<PackedPlanStep, B> in
/// backend/*/pipeline/pack, with kivi(), split_tail() and weights().
struct PackedPlanStep {};

namespace detail {
template <class B>
constexpr void require_packed_plan_kernels() {
  static_assert(HasKernel<PackedPlanStep, B>,
                "kvc: include <kvc/backend/cpu/pipeline/pack.hpp> (kvc::Cpu) or <kvc/backend/cuda/pipeline/pack.cuh> "
                "(kvc::Cuda)");
}
template <class Space>
Status check_bit_plan(BitPlan<Space> const& plan, char const* what) noexcept {
  if (plan.batch < 0 || plan.heads < 0 || plan.tokens < 0 || plan.dim < 0 ||
      (plan.batch * plan.heads > 0 &&
       ((plan.v_bits == nullptr && plan.tokens > 0) || (plan.k_bits == nullptr && plan.dim > 0))))
    return {Errc::invalid_argument, what};
  return {};
}
}  // namespace detail

/// KIVI's bit plan of a layer (kivi_plan per head) from the valid lengths `lengths` ([batch] or [batch, heads], in the
/// backend's space) into `plan` [batch, heads, tokens] / [batch, heads, dim].
template <Backend B>
Status kivi_bit_plan(B const& backend, KIVIPress const& press, Lengths lengths,
                     BitPlan<typename B::memory_space> plan) {
  detail::require_packed_plan_kernels<B>();
  KVC_RETURN_IF_ERROR(press.check());
  KVC_RETURN_IF_ERROR(detail::check_bit_plan(plan, "kvc::kivi_bit_plan: the plan needs extents >= 0 and its tables"));
  if (plan.batch * plan.heads == 0)
    return {};
  return Kernel<PackedPlanStep, B>::kivi(backend, press, lengths, plan);
}

/// The fp16 tail of every head (split_tail_head): the newest `residual` valid slots leave `plan` and are listed in
/// `tail` (a KeepPlan [batch, heads, capacity >= plan.tokens], in the backend's space) for kvc::compact.
template <Backend B>
Status split_tail(B const& backend, Index residual, Lengths lengths, BitPlan<typename B::memory_space> plan,
                  KeepPlan<typename B::memory_space> tail) {
  detail::require_packed_plan_kernels<B>();
  KVC_RETURN_IF_ERROR(detail::check_bit_plan(plan, "kvc::split_tail: the plan needs extents >= 0 and its tables"));
  if (residual < 0 || tail.batch != plan.batch || tail.heads != plan.heads || tail.capacity < plan.tokens ||
      (plan.batch * plan.heads > 0 && (tail.index == nullptr || tail.count == nullptr)))
    return {Errc::invalid_argument,
            "kvc::split_tail: need residual >= 0 and a tail plan [batch, heads, >= tokens] of the bit plan"};
  if (plan.batch * plan.heads == 0)
    return {};
  return Kernel<PackedPlanStep, B>::split_tail(backend, residual, lengths, plan, tail);
}

/// Every head's valid scores turned into RDKV token weights in place (scores_as_weights).
template <Backend B>
Status scores_to_weights(B const& backend, ScoreSpan<typename B::memory_space> scores) {
  detail::require_packed_plan_kernels<B>();
  if (scores.batch < 0 || scores.heads < 0 || scores.tokens < 0 ||
      (scores.data == nullptr && scores.batch * scores.heads * scores.tokens > 0))
    return {Errc::invalid_argument, "kvc::scores_to_weights: the scores need extents >= 0 and data"};
  if (scores.batch * scores.heads == 0)
    return {};
  return Kernel<PackedPlanStep, B>::weights(backend, scores);
}

}  // namespace kvc
