// SPDX-License-Identifier: Apache-2.0
// kvc/engine/compressor_types.hpp: what every kvc::LayerCompressor shares (engine/layer_compressor.hpp for the
// token-eviction policies, engine/packed_compressor.hpp for RDKV and KIVI): the queries it is handed, the shape it is
// planned for, its options, and the checks of plan() and of every call.
#pragma once

#include <kvc/attention/corrected.hpp>
#include <kvc/core/backend.hpp>
#include <kvc/core/checks.hpp>
#include <kvc/core/element.hpp>
#include <kvc/core/kv_view.hpp>
#include <kvc/core/rope.hpp>
#include <kvc/core/status.hpp>
#include <kvc/core/workspace.hpp>
#include <kvc/pipeline/decode.hpp>
#include <kvc/scorers/h2o.hpp>
#include <kvc/scorers/moment_kv.hpp>
#include <kvc/scorers/uncomp.hpp>

#include <cstddef>

namespace kvc {

/// Query rows handed to the compressor: rows [batch, Hq, n, d_k] (pre-RoPE, rotated with the compressor's RoPE
/// table; post-RoPE when the table is empty) and their absolute positions [batch, n] (required whenever the policy
/// reads queries).
template <Element T, class Space = HostSpace>
struct LayerQueries {
  using memory_space = Space;
  TokenRows<T const, StridedLayout, Space> rows{};
  Index const* positions = nullptr;
};

/// The queries a compressor is planned for, per sequence.
struct QueryShape {
  Index heads = 0;        ///< Hq (a multiple of the cache's KV heads)
  Index prompt_rows = 0;  ///< most rows prefill() is given: the observation window (0 for key-only policies)
  Index step_rows = 1;    ///< rows each decode() call adds (one per generated token)
  Index attend_rows = 1;  ///< most rows attend() is given
};

/// Settings of a compressor besides its policy.
template <class Space>
struct CompressorOptions {
  RopeTable<Space> rope{};         ///< rotates pre-RoPE queries (ExpectedAttention needs one); empty: post-RoPE
  bool prefill = true;             ///< compress in prefill() (false: only decode compresses; see the file comment)
  bool decode = false;             ///< compress while decoding, on `schedule`
  DecodeSchedule schedule{};       ///< interval, target_size, hidden_states_buffer_size (kvpress's DecodingPress)
  CorrectedAttention attention{};  ///< attention's scale and mask (attention.attention); MomentKV's correction
  bool corrected = true;           ///< MomentKV: attend with the correction of the evicted tokens
  Index packed_tokens = 0;         ///< RDKV, KIVI: the most valid tokens of a head at prefill (0: the cache's slots);
                                   ///< the store holds that less the fp16 tail. An engine whose cache has room for
                                   ///< generation sets its longest prompt.
};

/// The per-layer compressor (engine/layer_compressor.hpp). Policy: kvc::Press<Scorer, Selector>, kvc::RDKVPress or
/// kvc::KIVIPress; Q: the queries' element type (float, half, bfloat16). Copyable: a planned compressor copied per
/// layer shares the plan; a copy is not bound (bind and reset it before use), so no two compressors share a state by
/// accident.
template <class Policy, Backend B, Element Q = float>
class LayerCompressor;

namespace detail {
/// The scorers the compressors compose by type (their state or their own driver).
template <class S>
inline constexpr bool is_h2o = false;
template <class Space>
inline constexpr bool is_h2o<H2OScorer<Space>> = true;
template <class S>
inline constexpr bool is_uncomp = false;
template <class Space>
inline constexpr bool is_uncomp<UNCompScorer<Space>> = true;
template <class S>
inline constexpr bool is_moment_kv = false;
template <class Space, class T>
inline constexpr bool is_moment_kv<MomentKVScorer<Space, T>> = true;
/// A flag that copies do not carry: a copied compressor must bind (and reset) its own state.
struct BindingFlag {
  bool on = false;
  constexpr BindingFlag() noexcept = default;
  constexpr BindingFlag(BindingFlag const&) noexcept {}
  constexpr BindingFlag& operator=(BindingFlag const&) noexcept {
    on = false;
    return *this;
  }
};

inline Status not_ready() noexcept {
  return {Errc::invalid_argument, "kvc::LayerCompressor: call plan(), bind() and reset() first"};
}

/// plan()'s shape checks: batch, KV heads and d_k >= 1, Hq a multiple of the KV heads, row counts >= 0.
inline Status check_plan_shape(KVExtents const& e, QueryShape const& shape) noexcept {
  if (!extents_fit(e) || e.batch < 1 || e.heads < 1 || e.dim < 1 || shape.heads < 1 || shape.heads % e.heads != 0)
    return {Errc::invalid_argument,
            "kvc::LayerCompressor::plan: need batch, KV heads and d_k >= 1, and Hq a multiple of the KV heads"};
  if (shape.prompt_rows < 0 || shape.step_rows < 0 || shape.attend_rows < 0)
    return {Errc::invalid_argument, "kvc::LayerCompressor::plan: query row counts must be >= 0"};
  return {};
}

/// Every call's checks: the cache has the planned batch, KV heads and dims and at most the planned token slots
/// (`keys` and `value_dim` are the plan's), the workspace has `workspace_bytes`.
template <KVCacheView C>
Status check_compressor_call(KVExtents const& keys, Index value_dim, std::size_t workspace_bytes, C const& cache,
                             Workspace ws) noexcept {
  KVExtents const e = cache.keys.extents();
  if (e.batch != keys.batch || e.heads != keys.heads || e.dim != keys.dim || e.tokens > keys.tokens ||
      cache.values.extents().dim != value_dim)
    return {Errc::invalid_argument,
            "kvc::LayerCompressor: the cache must have the planned batch, KV heads and dims, and at most the planned "
            "token slots"};
  if (ws.bytes < workspace_bytes || (ws.data == nullptr && workspace_bytes > 0))
    return {Errc::out_of_capacity, "kvc::LayerCompressor: workspace smaller than workspace_bytes()"};
  return {};
}
}  // namespace detail

}  // namespace kvc
