// SPDX-License-Identifier: Apache-2.0
// kvc/core/scorer.hpp: the Scorer concept, the per-backend ScoreKernel extension point and kvc::score().
//
// A scorer is a small, trivially copyable parameter struct (KeyDiffScorer, KnormScorer, ...). Its kernels are
// specialisations ScoreKernel<Scorer, Backend> in backend/<name>/scorers/<policy>.hpp (or .cuh). Stateful
// scorers (H2O accumulators, MomentKV moments) reference caller-owned state through pointers in the struct.
#pragma once

#include <kvc/backend/tags.hpp>
#include <kvc/core/kv_view.hpp>
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
  window_queries = 1u << 2,    ///< the last-w queries (SnapKV, TOVA)
  query_statistics = 1u << 3,  ///< mean/covariance of pre-RoPE queries (ExpectedAttention)
  attention = 1u << 4,         ///< attention rows or column sums from the engine (H2O)
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

/// The observation bundle for scorers that read only keys and values.
struct NoObservations {};

namespace detail {
template <class T>
inline constexpr bool is_score_span = false;
template <class Space>
inline constexpr bool is_score_span<ScoreSpan<Space>> = true;
}  // namespace detail

/// Observations are any bundle of views a scorer's `needs` names (window queries, statistics, attention rows);
/// the only requirement here is that they cannot be confused with the output argument.
template <class O>
concept ObservationSet = !detail::is_score_span<std::remove_cvref_t<O>>;

/// A scorer: trivially copyable parameters plus `needs` and a snake_case `name` (the CLI's policy name).
template <class S>
concept Scorer = std::is_trivially_copyable_v<S> && requires {
  { S::needs } -> std::convertible_to<Needs>;
  { S::name } -> std::convertible_to<std::string_view>;
};

/// Specialise per (scorer, backend) with
///   static std::size_t workspace_bytes(S const&, KVExtents const& keys);
///   template <KVCacheView C, class Obs> static Status run(B const&, S const&, C const&, Obs const&,
///                                                        ScoreSpan<Space>, Workspace);
/// The primary template is left undefined on purpose: a missing kernel is a compile-time error with a fix-it.
template <class S, class B>
struct ScoreKernel;

template <class S, class B>
concept HasScoreKernel = requires {
  sizeof(ScoreKernel<S, B>);
};

/// Bytes of workspace kvc::score needs for `scorer` on a cache whose keys have extents `keys` (any alignment).
template <Backend B, Scorer S>
std::size_t score_workspace_bytes(B const&, S const& scorer, KVExtents const& keys) {
  static_assert(HasScoreKernel<S, B>,
                "kvc::score: this scorer has no kernel for this backend; include "
                "<kvc/backend/cpu/scorers/NAME.hpp> (kvc::Cpu) or <kvc/backend/cuda/scorers/NAME.cuh> (kvc::Cuda)");
  if constexpr (HasScoreKernel<S, B>)
    return ScoreKernel<S, B>::workspace_bytes(scorer, keys) + workspace_slack;
  else
    return 0;
}

/// Scores every token of every (batch, KV head): out is [batch, heads, tokens] fp32, higher = keep; padding
/// (t >= cache.lengths[b]) gets -inf. `obs` carries the observations the scorer's `needs` names.
/// Errors: out's shape differs from the keys' (invalid_argument), workspace too small (out_of_capacity).
template <Backend B, Scorer S, KVCacheView C, ObservationSet Obs>
Status score(B const& backend, S const& scorer, C const& cache, Obs const& obs, ScoreSpan<typename B::memory_space> out,
             Workspace ws = {}) {
  static_assert(AccessibleFrom<C, B>, "kvc::score: the cache lives in a memory space this backend cannot read");
  static_assert(HasScoreKernel<S, B>,
                "kvc::score: this scorer has no kernel for this backend; include "
                "<kvc/backend/cpu/scorers/NAME.hpp> (kvc::Cpu) or <kvc/backend/cuda/scorers/NAME.cuh> (kvc::Cuda)");
  if constexpr (AccessibleFrom<C, B> && HasScoreKernel<S, B>) {  // one diagnostic, not a cascade
    KVExtents const e = cache.keys.extents();
    if (out.batch != e.batch || out.heads != e.heads || out.tokens != e.tokens)
      return {Errc::invalid_argument, "kvc::score: `out` must be [batch, heads, tokens] of the keys"};
    if (out.data == nullptr && out.size() > 0)
      return {Errc::invalid_argument, "kvc::score: `out.data` is null"};
    out.lengths = cache.lengths;
    return ScoreKernel<S, B>::run(backend, scorer, cache, obs, out, ws);
  } else {
    return {Errc::invalid_argument, "unreachable"};
  }
}

/// kvc::score for scorers that read only keys and values.
template <Backend B, Scorer S, KVCacheView C>
Status score(B const& backend, S const& scorer, C const& cache, ScoreSpan<typename B::memory_space> out,
             Workspace ws = {}) {
  static_assert(needs_only_kv(S::needs),
                "kvc::score: this scorer needs observations; call score(backend, scorer, cache, obs, out, ws)");
  return score(backend, scorer, cache, NoObservations{}, out, ws);
}

}  // namespace kvc
