// SPDX-License-Identifier: Apache-2.0
// kvc/core/scorer.hpp: the Scorer concept, kvc::score() and the state hooks kvc::update() / kvc::on_evict().
//
// A scorer is a small, trivially copyable parameter struct (KeyDiffScorer, SnapKVScorer, ...). Its kernels are
// specialisations Kernel<Scorer, Backend> (core/kernel.hpp) in backend/<name>/scorers/<policy>.hpp (or .cuh).
//
// `score` is pure: it reads the cache, the observations and the scorer's state and writes only `out` and scratch.
// Calling it twice gives the same scores. Stateful scorers (H2O's accumulated attention, MomentKV's moments,
// ExpectedAttention's decode buffers) declare `static constexpr bool stateful = true` and hold typed views of
// caller-owned state (e.g. a TokenArray<float, Space> accumulator) as members; their kernels add
//   update(B const&, S const&, C const& cache, Obs const& obs, Workspace)            // new tokens or queries seen
//   on_evict(B const&, S const&, C const& cache, KeepPlan<Space> const& plan, Workspace)  // before compaction
// and per-token state travels through compaction with the same plan (kvc::compact's extra TokenArray arguments).
#pragma once

#include <kvc/core/backend.hpp>
#include <kvc/core/checks.hpp>
#include <kvc/core/keep_plan.hpp>
#include <kvc/core/kernel.hpp>
#include <kvc/core/kv_view.hpp>
#include <kvc/core/observations.hpp>
#include <kvc/core/scores.hpp>
#include <kvc/core/status.hpp>
#include <kvc/core/workspace.hpp>

#include <concepts>
#include <cstddef>
#include <string_view>
#include <type_traits>

namespace kvc {

/// Inputs a scorer reads, as bit flags. The pipeline builds only what a scorer asks for, and an engine can
/// check at compile time whether it can feed a policy (e.g. fused attention never exposes `attention`).
enum class Needs : unsigned {
  none = 0,
  keys = 1u << 0,
  values = 1u << 1,
  window_queries = 1u << 2,    ///< the last-w queries (SnapKV, TOVA): Observations::window_queries
  query_statistics = 1u << 3,  ///< mean/covariance of pre-RoPE queries (ExpectedAttention)
  attention = 1u << 4,         ///< attention column sums from the engine (H2O)
};

constexpr Needs operator|(Needs a, Needs b) noexcept {
  return static_cast<Needs>(static_cast<unsigned>(a) | static_cast<unsigned>(b));
}
constexpr bool has_need(Needs set, Needs flag) noexcept {
  return (static_cast<unsigned>(set) & static_cast<unsigned>(flag)) != 0;
}
/// Whether every input in `set` is a key or a value (such scorers run in the block-wise driver unchanged).
constexpr bool needs_only_kv(Needs set) noexcept {
  return (static_cast<unsigned>(set) & ~static_cast<unsigned>(Needs::keys | Needs::values)) == 0;
}

namespace detail {
template <class T>
inline constexpr bool is_score_span = false;
template <class Space>
inline constexpr bool is_score_span<ScoreSpan<Space>> = true;
}  // namespace detail

/// Observations are NoObservations or an Observations bundle; this only keeps them apart from the output argument.
template <class O>
concept ObservationSet = !detail::is_score_span<std::remove_cvref_t<O>>;

/// A scorer: trivially copyable parameters plus `needs` and a snake_case `name` (the CLI's policy name).
template <class S>
concept Scorer = std::is_trivially_copyable_v<S> && requires {
  { S::needs } -> std::convertible_to<Needs>;
  { S::name } -> std::convertible_to<std::string_view>;
};

/// Whether a scorer keeps state between calls (see the file comment).
template <class S>
concept StatefulScorer = Scorer<S> && requires {
  { S::stateful } -> std::convertible_to<bool>;
} && S::stateful;

/// Compile-time check that bundle `Obs` holds every part scorer `S` needs, each with a message naming the part.
template <Scorer S, class Obs>
constexpr bool check_observations() {
  static_assert(!has_need(S::needs, Needs::window_queries) || HasWindowQueries<Obs>,
                "kvc::score: this scorer needs window queries (Needs::window_queries), but the observations have "
                "none: pass kvc::observe(kvc::WindowQueries<T, Space>{rows, rope, positions})");
  static_assert(!has_need(S::needs, Needs::query_statistics) || HasQueryStatistics<Obs>,
                "kvc::score: this scorer needs query statistics (Needs::query_statistics), but the observations "
                "have none: set Observations::query_statistics");
  static_assert(!has_need(S::needs, Needs::attention) || HasAttention<Obs>,
                "kvc::score: this scorer needs attention column sums (Needs::attention), but the observations have "
                "none: set Observations::attention");
  return (!has_need(S::needs, Needs::window_queries) || HasWindowQueries<Obs>)&&(
      !has_need(S::needs, Needs::query_statistics) ||
      HasQueryStatistics<Obs>)&&(!has_need(S::needs, Needs::attention) || HasAttention<Obs>);
}

/// Bytes of workspace kvc::score needs for `scorer` on a cache whose keys have extents `keys`, with observations
/// `obs` (their extents size window scratch). Any alignment; includes one copy per CPU worker.
template <Backend B, Scorer S, ObservationSet Obs = NoObservations>
std::size_t score_workspace_bytes(B const& backend, S const& scorer, KVExtents const& keys, Obs const& obs = {}) {
  static_assert(HasKernel<S, B>,
                "kvc::score: this scorer has no kernel for this backend; include "
                "<kvc/backend/cpu/scorers/NAME.hpp> (kvc::Cpu) or <kvc/backend/cuda/scorers/NAME.cuh> (kvc::Cuda)");
  if constexpr (HasKernel<S, B>)
    return bytes_sum(Kernel<S, B>::workspace_bytes(backend, scorer, keys, obs), workspace_slack);
  else
    return 0;
}

/// Scores every token of every (batch, KV head): out is [batch, heads, tokens] fp32, higher = keep; padding
/// (t >= cache.length(b, h)) gets -inf. `obs` carries the observations the scorer's `needs` names.
/// Errors: the cache's checks (detail::check_cache), out's shape differs from the keys' or `out` or the workspace
/// overlaps the cache's K or V, or each other (invalid_argument), workspace too small (out_of_capacity).
template <Backend B, Scorer S, KVCacheView C, ObservationSet Obs>
Status score(B const& backend, S const& scorer, C const& cache, Obs const& obs, ScoreSpan<typename B::memory_space> out,
             Workspace ws) {
  static_assert(AccessibleFrom<C, B>, "kvc::score: the cache lives in a memory space this backend cannot read");
  static_assert(ObservationsReadableBy<Obs, B>,
                "kvc::score: the observations live in a memory space this backend cannot read");
  static_assert(HasKernel<S, B>,
                "kvc::score: this scorer has no kernel for this backend; include "
                "<kvc/backend/cpu/scorers/NAME.hpp> (kvc::Cpu) or <kvc/backend/cuda/scorers/NAME.cuh> (kvc::Cuda)");
  constexpr bool complete = check_observations<S, Obs>();
  if constexpr (AccessibleFrom<C, B> && ObservationsReadableBy<Obs, B> && HasKernel<S, B> && complete) {
    KVExtents const e = cache.keys.extents();
    KVC_RETURN_IF_ERROR(detail::check_cache(cache, KVC_CACHE_MESSAGES("kvc::score", "the cache")));
    if (out.batch != e.batch || out.heads != e.heads || out.tokens != e.tokens)
      return {Errc::invalid_argument, "kvc::score: `out` must be [batch, heads, tokens] of the keys"};
    if (out.data == nullptr && out.size() > 0)
      return {Errc::invalid_argument, "kvc::score: `out.data` is null"};
    // Checked before a kernel multiplies extents to carve it (a saturated size is never satisfied; slack aside).
    if (ws.bytes < Kernel<S, B>::workspace_bytes(backend, scorer, e, obs))
      return {Errc::out_of_capacity, "kvc::score: workspace smaller than score_workspace_bytes()"};
    detail::ByteRange const written = detail::bytes_of(out.data, out.size()), scratch = detail::bytes_of(ws);
    if (detail::overlaps_cache(written, cache))
      return {Errc::invalid_argument, "kvc::score: `out` overlaps the cache's keys or values"};
    if (detail::overlaps_cache(scratch, cache) || detail::overlap(scratch, written))
      return {Errc::invalid_argument, "kvc::score: the workspace overlaps `out` or the cache's keys or values"};
    out.lengths = cache.lengths;
    return Kernel<S, B>::run(backend, scorer, cache, obs, out, ws);
  } else {
    return {Errc::invalid_argument, "unreachable"};
  }
}

/// kvc::score for scorers that read only keys and values.
template <Backend B, Scorer S, KVCacheView C>
Status score(B const& backend, S const& scorer, C const& cache, ScoreSpan<typename B::memory_space> out, Workspace ws) {
  static_assert(needs_only_kv(S::needs),
                "kvc::score: this scorer needs observations; call score(backend, scorer, cache, obs, out, ws)");
  return score(backend, scorer, cache, NoObservations{}, out, ws);
}

namespace detail {
/// The update kernel's scratch: its update_workspace_bytes when it declares one, else none.
template <class K, class B, class S, class Obs>
std::size_t update_scratch(B const& backend, S const& scorer, KVExtents const& keys, Obs const& obs) {
  if constexpr (requires { K::update_workspace_bytes(backend, scorer, keys, obs); })
    return K::update_workspace_bytes(backend, scorer, keys, obs);
  else
    return 0;
}
}  // namespace detail

/// Bytes of workspace kvc::update needs (0 for stateless scorers and kernels that declare none); any alignment.
template <Backend B, Scorer S, ObservationSet Obs>
std::size_t update_workspace_bytes(B const& backend, S const& scorer, KVExtents const& keys, Obs const& obs) {
  if constexpr (StatefulScorer<S>)
    return bytes_sum(detail::update_scratch<Kernel<S, B>>(backend, scorer, keys, obs), workspace_slack);
  else
    return 0;
}

/// State hook: a stateful scorer folds newly seen tokens or queries into its state (call it after the new tokens
/// are appended to the cache). A no-op for stateless scorers.
template <Backend B, Scorer S, KVCacheView C, ObservationSet Obs>
Status update(B const& backend, S const& scorer, C const& cache, Obs const& obs, Workspace ws) {
  if constexpr (StatefulScorer<S>) {
    static_assert(AccessibleFrom<C, B>, "kvc::update: the cache lives in a memory space this backend cannot read");
    static_assert(ObservationsReadableBy<Obs, B>,
                  "kvc::update: the observations live in a memory space this backend cannot read");
    KVC_RETURN_IF_ERROR(detail::check_cache(cache, KVC_CACHE_MESSAGES("kvc::update", "the cache")));
    if (detail::overlaps_cache(detail::bytes_of(ws), cache))
      return {Errc::invalid_argument, "kvc::update: the workspace overlaps the cache's keys or values"};
    if (ws.bytes < detail::update_scratch<Kernel<S, B>>(backend, scorer, cache.keys.extents(), obs))
      return {Errc::out_of_capacity, "kvc::update: workspace smaller than update_workspace_bytes()"};
    return Kernel<S, B>::update(backend, scorer, cache, obs, ws);
  } else {
    return {};
  }
}

namespace detail {
/// The on_evict kernel's scratch: its on_evict_workspace_bytes when it declares one, else none.
template <class K, class B, class S>
std::size_t on_evict_scratch(B const& backend, S const& scorer, KVExtents const& keys) {
  if constexpr (requires { K::on_evict_workspace_bytes(backend, scorer, keys); })
    return K::on_evict_workspace_bytes(backend, scorer, keys);
  else
    return 0;
}
}  // namespace detail

/// Bytes of workspace kvc::on_evict needs (0 for stateless scorers and kernels that declare none); any alignment.
template <Backend B, Scorer S>
std::size_t on_evict_workspace_bytes(B const& backend, S const& scorer, KVExtents const& keys) {
  if constexpr (StatefulScorer<S>)
    return bytes_sum(detail::on_evict_scratch<Kernel<S, B>>(backend, scorer, keys), workspace_slack);
  else
    return 0;
}

/// State hook: a stateful scorer sees the plan (the complement is the evicted set) before kvc::compact moves the
/// cache (MomentKV folds the evicted rows into its moments). A no-op for stateless scorers, after the checks every
/// scorer's plan gets: the cache's (detail::check_cache) and the plan's shape, [batch, heads] of the cache with
/// non-null arrays (a state sized for the cache is indexed by the plan's heads).
template <Backend B, Scorer S, KVCacheView C>
Status on_evict(B const& backend, S const& scorer, C const& cache, KeepPlan<typename B::memory_space> const& plan,
                Workspace ws) {
  KVExtents const e = cache.keys.extents();
  KVC_RETURN_IF_ERROR(detail::check_cache(cache, KVC_CACHE_MESSAGES("kvc::on_evict", "the cache")));
  if (plan.batch != e.batch || plan.heads != e.heads || plan.capacity < 0)
    return {Errc::invalid_argument, "kvc::on_evict: `plan` must have the cache's batch and heads (capacity >= 0)"};
  if ((plan.index == nullptr || plan.count == nullptr) && e.batch * e.heads > 0)
    return {Errc::invalid_argument, "kvc::on_evict: `plan.index` and `plan.count` must not be null"};
  if constexpr (StatefulScorer<S>) {
    if (detail::overlaps_cache(detail::bytes_of(ws), cache))
      return {Errc::invalid_argument, "kvc::on_evict: the workspace overlaps the cache's keys or values"};
    if (ws.bytes < detail::on_evict_scratch<Kernel<S, B>>(backend, scorer, e))
      return {Errc::out_of_capacity, "kvc::on_evict: workspace smaller than on_evict_workspace_bytes()"};
    return Kernel<S, B>::on_evict(backend, scorer, cache, plan, ws);
  } else {
    return {};
  }
}

}  // namespace kvc
