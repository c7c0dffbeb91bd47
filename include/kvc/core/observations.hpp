// SPDX-License-Identifier: Apache-2.0
// kvc/core/observations.hpp: the typed bundle of what a scorer may read besides K and V.
//
// An engine passes only what the scorer's `needs` names; a bundle lacking a needed part is a compile-time error at
// kvc::score naming the part. Every part is a non-owning view in the bundle's memory space. Shapes use Hq query
// heads; query head q reads KV head q / (Hq / Hkv) (consecutive groups, as Hugging Face repeat_kv).
#pragma once

#include <kvc/core/backend.hpp>
#include <kvc/core/element.hpp>
#include <kvc/core/kv_view.hpp>
#include <kvc/core/layout.hpp>
#include <kvc/core/rope.hpp>

#include <type_traits>

namespace kvc {

/// Marks a part of an Observations bundle that is absent.
struct Absent {};

/// The last w queries of the context: rows [batch, Hq, w, d_k] in fp32, fp16 or bf16, any strided layout.
///  - pre-RoPE (rope non-empty): query i is rotated to its absolute position before use (what kvpress does);
///  - post-RoPE (rope empty): used as given.
/// `positions` ([batch, w], optional): each query's absolute position, for RoPE and the causal mask (a query sees
/// the cache slots whose position is <= its own). Absent: the last w positions of the context, i.e. query i of
/// sequence b sits at P_b - w + i, where P_b - 1 is the largest position held by any head of sequence b.
template <Element T, class Space = HostSpace>
struct WindowQueries {
  using memory_space = Space;
  using element_type = T const;

  TokenRows<T const, StridedLayout, Space> rows;
  RopeTable<Space> rope{};
  Index const* positions = nullptr;
  Index positions_stride = 0;  ///< elements from one sequence's positions to the next; 0: the window length w

  KVC_HOST_DEVICE constexpr Index window() const noexcept { return rows.extents().tokens; }
  /// The given position of row i of sequence b (positions must be non-null).
  KVC_HOST_DEVICE constexpr Index given_position(Index b, Index i) const noexcept {
    return positions[b * (positions_stride > 0 ? positions_stride : window()) + i];
  }
};

/// Per query head statistics of pre-RoPE queries (ExpectedAttention; kvc::query_statistics builds them): mean
/// [batch, Hq, d] and population covariance [batch, Hq, d, d] (row-major, divided by the sample count; null when
/// the scorer does not use it), fp32.
///  - `rope`: the table future RoPE is averaged from (positions up to t0 + T - 1); empty means no RoPE (R̄ = I).
///  - `next_position` ([batch], optional): the absolute position of the next token, t0 of the future window.
///    Absent: one past the largest position in the cache (context_end).
///  - `observed`: query rows the statistics summarise, skipped sink rows included (kvpress's t0; 0: as
///    next_position).
template <class Space = HostSpace>
struct QueryStatistics {
  using memory_space = Space;

  float const* mean = nullptr;
  float const* covariance = nullptr;
  Index batch = 0;
  Index heads = 0;
  Index dim = 0;
  RopeTable<Space> rope{};
  Index const* next_position = nullptr;
  Index observed = 0;
};

/// Attention the engine already computed (H2O's accumulated attention): per query head, for each cache slot, the
/// sum of the softmax probabilities over `queries` query rows: [batch, Hq, tokens] fp32, slots as in the cache.
template <class Space = HostSpace>
struct AttentionColumnSums {
  using memory_space = Space;

  float const* data = nullptr;
  Index batch = 0;
  Index heads = 0;
  Index tokens = 0;
  Index queries = 0;
};

/// The bundle. Parts default to Absent; build one with kvc::observe or aggregate initialisation.
template <class Space, class WQ = Absent, class QS = Absent, class AT = Absent>
struct Observations {
  using memory_space = Space;

  [[no_unique_address]] WQ window_queries{};
  [[no_unique_address]] QS query_statistics{};
  [[no_unique_address]] AT attention{};
};

/// A bundle holding window queries only (SnapKV, TOVA).
template <Element T, class Space>
constexpr Observations<Space, WindowQueries<T, Space>> observe(WindowQueries<T, Space> const& q) noexcept {
  return {q};
}

/// A bundle holding query statistics only (ExpectedAttention).
template <class Space>
constexpr Observations<Space, Absent, QueryStatistics<Space>> observe(QueryStatistics<Space> const& s) noexcept {
  return {{}, s};
}

/// A bundle holding attention column sums only (an engine feeding H2O's accumulator from its own attention).
template <class Space>
constexpr Observations<Space, Absent, Absent, AttentionColumnSums<Space>> observe(
    AttentionColumnSums<Space> const& a) noexcept {
  return {{}, {}, a};
}

/// The empty bundle, readable by every backend (scorers that read only K and V).
struct NoObservations {};

namespace detail {
template <class Part>
inline constexpr bool present = !std::is_same_v<std::remove_cvref_t<Part>, Absent>;
}  // namespace detail

template <class O>
concept HasWindowQueries = requires(O const& o) {
  o.window_queries;
}
&&detail::present<decltype(O::window_queries)>;
template <class O>
concept HasQueryStatistics = requires(O const& o) {
  o.query_statistics;
}
&&detail::present<decltype(O::query_statistics)>;
template <class O>
concept HasAttention = requires(O const& o) {
  o.attention;
}
&&detail::present<decltype(O::attention)>;

/// Hq of a bundle's window queries, or `fallback` when it has none (scratch sizes of window scorers).
template <class O>
constexpr Index window_query_heads(O const& obs, Index fallback) noexcept {
  if constexpr (HasWindowQueries<O>)
    return obs.window_queries.rows.extents().heads;
  else
    return fallback;
}

/// Whether backend B can read bundle O (the empty bundle always).
template <class O, class B>
concept ObservationsReadableBy = !requires {
  typename O::memory_space;
}
|| ReadableBy<O, B>;

}  // namespace kvc
