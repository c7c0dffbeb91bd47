// SPDX-License-Identifier: Apache-2.0
// kvc/selectors/rdkv.hpp: RDKV's bit allocation (Zhang et al., arXiv 2605.08317; the authors' obkv_fast.py
// `_perhead_select_and_pack_joint`, knapsack_solver.py; decisions A4–A7, A14 in docs/policies/rdkv.md#decisions):
// from token weights w_t [batch, Hkv, tokens] and channel weights w_c [batch, Hkv, dim] to a bit plan, v_bits per
// token and k_bits per channel in {0, 2, 4, 8, 16} (0 = evicted / channel pruned, 16 = FP16).
//
// Per (sequence, KV head) with n valid tokens (scope = head, the authors' path):
//  - B = ratio >= 0 ? floor(n (1 − ratio)) : budget_tokens, FP16-equivalent tokens; total bits 2 · B · dim · 16.
//  - `residual` R: the last min(R, n) valid slots get v_bits 16 and stay out of both knapsacks (KIVI's FP16 tail,
//    zone C: their K and V go to the FP16 tail with the decode tokens). Their bits count against nothing: the
//    budget B covers the m = n − min(R, n) tokens before them.
//  - V knapsack over the m tokens (unit cost dim per bit, absorbed): exact: Σ_t b_t <= floor((1 − ρ) · 2 · B · 16);
//    lagrangian: target v_avg = (1 − ρ) · 2·B·dim·16 / (m · dim), the authors' expression. v_avg >= 16 (exact:
//    budget >= 16 m) -> every token at 16, also weight-0 ones (a short context, T <= B, is lossless; the authors
//    would evict w = 0 tokens there, a case attn_linear weights never produce).
//  - T_eff = tokens of the m with b_t > 0 (the residual excluded).
//  - K knapsack over the dim channels (unit cost T_eff per bit, absorbed): exact: Σ_c b_c <= floor(ρ · 2·B·dim·16 /
//    max(1, T_eff)); lagrangian: k_avg = ρ · 2·B·dim·16 / (dim · max(1, T_eff)). k_avg >= 16 -> every channel at 16
//    (the authors' packer then clamps K16 to 8). A head with T_eff = 0 stores no K: its k_bits are 0.
//  - Padding slots (>= n) get v_bits 0.
// scope = layer: one V knapsack over the m_h tokens of every head of a sequence (budget: the sum of the heads'
// budgets; lagrangian: target Σ_h (1 − ρ) 2·B_h·dim·16 / (Σ_h m_h · dim)), then each head's K knapsack as above.
//
// Solvers (rate_distortion/knapsack.hpp): `solver` picks exact (default: Σ bits <= budget, A7) or lagrangian (the
// authors' bisection, may overshoot by tol). The authors' full preset (the tools' `reference=authors`) is solver =
// lagrangian here plus PackOptions{ZeroPoint::integer, clamp_k16_to_8 = true} in the packer (pipeline/pack.hpp).
// options.evict = false (no 0 bits, the quant-only ablation): exact mode reports invalid_argument when a head's
// (scope layer: a sequence's) V budget is below 2 bits per token or its K budget below 2 bits per channel.
// Weights must be finite and >= 0 on valid slots (padding is ignored: -inf there is fine); a scorer whose scores
// can be negative needs a transform first. Weight 0 -> 0 bits in both solvers (A14), unless the head is lossless.
#pragma once

#include <kvc/core/backend.hpp>
#include <kvc/core/kernel.hpp>
#include <kvc/core/kv_view.hpp>
#include <kvc/core/scorer.hpp>
#include <kvc/core/scores.hpp>
#include <kvc/core/status.hpp>
#include <kvc/core/workspace.hpp>
#include <kvc/rate_distortion/bit_plan.hpp>
#include <kvc/rate_distortion/epsilon.hpp>
#include <kvc/rate_distortion/knapsack.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace kvc {

/// Which units share one V knapsack (docs/policies/rdkv.md, decision A4).
enum class RDKVBudgetScope : std::uint8_t {
  head,   ///< one knapsack per (sequence, KV head): the authors' path
  layer,  ///< one λ over the V tokens of all heads of a sequence (budget: the heads' sum); K stays per head
};

/// RDKV's allocation parameters (trivially copyable).
struct RDKVAllocator {
  static constexpr std::string_view name = "rdkv";

  Index budget_tokens = 128;    ///< B: FP16-equivalent tokens per (layer, KV head); total bits = 2 * B * dim * 16
  double ratio = -1.0;          ///< >= 0 (<= 1): budget = floor(n (1 - ratio)) per head instead of budget_tokens
  double k_budget_ratio = 0.5;  ///< rho in [0, 1]: K gets rho of the bits, V 1 - rho
  BitSolver solver = BitSolver::exact;  ///< exact (default) | lagrangian (the authors' preset); dp is refused
  LagrangianOptions lagrangian{};
  EpsilonTable eps_v = EpsilonTable::llama31_v(), eps_k = EpsilonTable::llama31_k();
  BitOptions options{};  ///< evict = false: no 0 bits for tokens or channels
  RDKVBudgetScope scope = RDKVBudgetScope::head;
  Index residual = 0;  ///< last `residual` valid slots are not allocated (KIVI's FP16 tail, zone C): bits 16

  constexpr Status check() const noexcept {
    if (budget_tokens < 0)
      return {Errc::invalid_argument, "RDKVAllocator: `budget_tokens` must be >= 0"};
    if (!(ratio < 0.0) && !(ratio <= 1.0))
      return {Errc::invalid_argument, "RDKVAllocator: `ratio` must be in [0, 1] (or negative to use budget_tokens)"};
    if (!(k_budget_ratio >= 0.0 && k_budget_ratio <= 1.0))
      return {Errc::invalid_argument, "RDKVAllocator: `k_budget_ratio` must be in [0, 1]"};
    if (solver != BitSolver::exact && solver != BitSolver::lagrangian)
      return {Errc::invalid_argument, "RDKVAllocator: unknown `solver`"};
    if (!lagrangian.check().ok())
      return {Errc::invalid_argument, "RDKVAllocator: `lagrangian` needs tol > 0, max_iter >= 1, max_doublings >= 0"};
    if (!eps_v.check().ok())
      return {Errc::invalid_argument, "RDKVAllocator: `eps_v` must have eps[0] = 1, eps[4] = 0, strictly decreasing"};
    if (!eps_k.check().ok())
      return {Errc::invalid_argument, "RDKVAllocator: `eps_k` must have eps[0] = 1, eps[4] = 0, strictly decreasing"};
    if (scope != RDKVBudgetScope::head && scope != RDKVBudgetScope::layer)
      return {Errc::invalid_argument, "RDKVAllocator: unknown `scope`"};
    if (residual < 0)
      return {Errc::invalid_argument, "RDKVAllocator: `residual` must be >= 0"};
    return {};
  }
};

namespace detail {

/// B of a head with n valid tokens (FP16-equivalent tokens).
inline Index rdkv_budget_tokens(RDKVAllocator const& a, Index n) noexcept {
  if (a.ratio >= 0.0)
    return static_cast<Index>(std::floor(static_cast<double>(n) * (1.0 - a.ratio)));
  return a.budget_tokens;
}

/// floor(x) for x >= 0 as an integer bit budget (saturating far above any Σ of bits).
inline std::int64_t rdkv_floor_bits(double x) noexcept {
  return x >= 4e18 ? std::int64_t{4000000000000000000} : static_cast<std::int64_t>(std::floor(x));
}

/// Exact mode, V: Σ_t b_t <= floor((1 − ρ) · 2 · B · 16) (the cost dim per bit absorbed).
inline std::int64_t rdkv_v_budget(RDKVAllocator const& a, Index budget) noexcept {
  return rdkv_floor_bits((1.0 - a.k_budget_ratio) * (2.0 * static_cast<double>(budget) * 16.0));
}

/// Exact mode, K: Σ_c b_c <= floor(ρ · 2·B·dim·16 / max(1, T_eff)) (the cost T_eff per bit absorbed).
inline std::int64_t rdkv_k_budget(RDKVAllocator const& a, Index budget, Index dim, Index t_eff) noexcept {
  double const total = 2.0 * static_cast<double>(budget) * static_cast<double>(dim) * 16.0;
  return rdkv_floor_bits(a.k_budget_ratio * total / static_cast<double>(t_eff > 1 ? t_eff : 1));
}

/// Lagrangian mode, V: the authors' v_avg = (1 − ρ) · total / (m · dim), total = Σ of the heads' 2·B·dim·16.
inline double rdkv_v_target(RDKVAllocator const& a, double total_bits, Index units, Index dim) noexcept {
  return (1.0 - a.k_budget_ratio) * total_bits / (static_cast<double>(units) * static_cast<double>(dim));
}

/// Lagrangian mode, K: k_avg = ρ · 2·B·dim·16 / (dim · max(1, T_eff)).
inline double rdkv_k_target(RDKVAllocator const& a, Index budget, Index dim, Index t_eff) noexcept {
  double const total = 2.0 * static_cast<double>(budget) * static_cast<double>(dim) * 16.0;
  return a.k_budget_ratio * total / (static_cast<double>(dim) * static_cast<double>(t_eff > 1 ? t_eff : 1));
}

inline double rdkv_total_bits(Index budget, Index dim) noexcept {
  return 2.0 * static_cast<double>(budget) * static_cast<double>(dim) * 16.0;
}

}  // namespace detail

/// Bytes of workspace kvc::allocate_bits needs (any alignment).
template <Backend B>
std::size_t allocate_bits_workspace_bytes(B const& backend, RDKVAllocator const& alloc, Index batch, Index heads,
                                          Index tokens, Index dim) {
  static_assert(HasKernel<RDKVAllocator, B>,
                "kvc::allocate_bits: no RDKV allocation kernel for this backend; include "
                "<kvc/backend/cpu/selectors/rdkv.hpp>");
  if constexpr (HasKernel<RDKVAllocator, B>)
    return bytes_sum(Kernel<RDKVAllocator, B>::workspace_bytes(backend, alloc, batch, heads, tokens, dim),
                     workspace_slack);
  else
    return 0;
}

/// Writes the bit plan of a layer from token weights [batch, heads, tokens] (fp32; valid slots finite and >= 0,
/// padding ignored; `token_weights.lengths` are the valid lengths) and channel weights [batch, heads, dim] (fp32,
/// finite, >= 0), both in the backend's memory space. `plan` has the weights' batch, heads and tokens, dim >= 1.
/// Deterministic, bit-identical for any thread count. Errors: bad parameters (RDKVAllocator::check), extents that
/// do not match, null pointers, lengths outside [0, tokens], weights NaN/Inf (non_finite) or negative, a budget
/// below the floor without eviction (exact mode), workspace smaller than allocate_bits_workspace_bytes().
template <Backend B>
Status allocate_bits(B const& backend, RDKVAllocator const& alloc, ScoreSpan<typename B::memory_space> token_weights,
                     float const* channel_weights, BitPlan<typename B::memory_space> plan, Workspace ws) {
  static_assert(HasKernel<RDKVAllocator, B>,
                "kvc::allocate_bits: no RDKV allocation kernel for this backend; include "
                "<kvc/backend/cpu/selectors/rdkv.hpp>");
  if constexpr (HasKernel<RDKVAllocator, B>) {
    KVC_RETURN_IF_ERROR(alloc.check());
    ScoreSpan<typename B::memory_space> const& w = token_weights;
    if (w.batch < 0 || w.heads < 0 || w.tokens < 0)
      return {Errc::invalid_argument, "kvc::allocate_bits: `token_weights` extents must be >= 0"};
    if (plan.batch != w.batch || plan.heads != w.heads || plan.tokens != w.tokens)
      return {Errc::invalid_argument, "kvc::allocate_bits: `plan` must be [batch, heads, tokens] of token_weights"};
    Index const rows = w.batch * w.heads;
    if (rows > 0) {
      if (plan.dim < 1)
        return {Errc::invalid_argument, "kvc::allocate_bits: `plan.dim` must be >= 1"};
      if (w.tokens > 0 && (w.data == nullptr || plan.v_bits == nullptr))
        return {Errc::invalid_argument, "kvc::allocate_bits: `token_weights.data` and `plan.v_bits` must not be null"};
      if (plan.k_bits == nullptr)
        return {Errc::invalid_argument, "kvc::allocate_bits: `plan.k_bits` ([batch, heads, dim]) must not be null"};
      if (channel_weights == nullptr)
        return {Errc::invalid_argument, "kvc::allocate_bits: `channel_weights` ([batch, heads, dim]) must not be null"};
    }
    KVC_RETURN_IF_ERROR(check_length_table(
        w.lengths, w.heads, "kvc::allocate_bits: a per-head length table must be [batch, heads of token_weights]"));
    if (ws.bytes < Kernel<RDKVAllocator, B>::workspace_bytes(backend, alloc, w.batch, w.heads, w.tokens, plan.dim))
      return {Errc::out_of_capacity, "kvc::allocate_bits: workspace smaller than allocate_bits_workspace_bytes()"};
    return Kernel<RDKVAllocator, B>::run(backend, alloc, w, channel_weights, plan, ws);
  } else {
    return {Errc::invalid_argument, "unreachable"};
  }
}

}  // namespace kvc
