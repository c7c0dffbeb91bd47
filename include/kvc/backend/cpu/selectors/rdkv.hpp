// SPDX-License-Identifier: Apache-2.0
// kvc/backend/cpu/selectors/rdkv.hpp: CPU RDKV bit allocation (selectors/rdkv.hpp).
#pragma once

#include <kvc/backend/cpu/detail/for_each_head.hpp>
#include <kvc/rate_distortion/knapsack.hpp>
#include <kvc/selectors/rdkv.hpp>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>

namespace kvc {

/// One (sequence, KV head) per task for scope = head, one sequence per task for scope = layer. Each task writes only
/// its own rows of the plan and its worker's scratch, and the solvers are deterministic, so the plan is
/// bit-identical for any thread count. Inputs are validated serially before the tasks start, so the solvers inside
/// cannot fail. Scratch per worker: exact mode, the exact solver's edges for max(units, dim) units; scope = layer,
/// also the gathered weights and bits of the sequence's V units.
template <>
struct Kernel<RDKVAllocator, Cpu> {
  static std::size_t worker_bytes(RDKVAllocator const& a, Index heads, Index tokens, Index dim) {
    bool const layer = a.scope == RDKVBudgetScope::layer;
    Index const units = layer ? heads * tokens : tokens;
    std::size_t const solver =
        a.solver == BitSolver::exact ? workspace_round(exact_bits_scratch_bytes(std::max(units, dim))) : 0;
    if (!layer)
      return solver;
    return bytes_sum(workspace_round(bytes_product(units, sizeof(float))),
                     workspace_round(bytes_product(units, sizeof(std::int8_t))), solver);
  }
  static std::size_t workspace_bytes(Cpu const& cpu, RDKVAllocator const& a, Index, Index heads, Index tokens,
                                     Index dim) {
    return bytes_product(cpu.workers(), worker_bytes(a, heads, tokens, dim));
  }

  static Status run(Cpu const& cpu, RDKVAllocator const& a, ScoreSpan<HostSpace> w, float const* cw,
                    BitPlan<HostSpace> plan, Workspace ws) {
    KVC_RETURN_IF_ERROR(detail::check_lengths(w.lengths, w.batch, w.heads, w.tokens,
                                              "kvc::allocate_bits: every valid length must be in [0, tokens]"));
    KVC_RETURN_IF_ERROR(validate(a, w, cw, plan.dim));
    std::size_t const per_worker = worker_bytes(a, w.heads, w.tokens, plan.dim);
    auto* base = WorkspaceCarver(ws).take<std::byte>(static_cast<Index>(bytes_product(per_worker, cpu.workers())));
    if (base == nullptr && per_worker > 0)
      return {Errc::out_of_capacity, "kvc::allocate_bits: workspace smaller than allocate_bits_workspace_bytes()"};
    std::atomic<bool> failed{false};
    auto scratch = [&](Index worker) {
      return Workspace{per_worker > 0 ? base + static_cast<std::size_t>(worker) * per_worker : nullptr, per_worker};
    };
    if (a.scope == RDKVBudgetScope::head) {
      detail::parallel_for(cpu, w.batch * w.heads, [&](Index item, Index worker) {
        Index const b = item / w.heads, h = item % w.heads;
        if (!allocate_head(a, w, cw, plan, b, h, scratch(worker)))
          failed.store(true);
      });
    } else {
      detail::parallel_for(cpu, w.batch, [&](Index b, Index worker) {
        if (!allocate_sequence(a, w, cw, plan, b, scratch(worker)))
          failed.store(true);
      });
    }
    if (failed.load())
      return {Errc::invalid_argument, "kvc::allocate_bits: a knapsack solver rejected its input (internal error)"};
    return {};
  }

 private:
  /// Budgets saturate here (detail::rdkv_floor_bits), so sums over heads never overflow.
  static constexpr std::int64_t saturated = std::int64_t{4000000000000000000};

  static bool exact(RDKVAllocator const& a) noexcept { return a.solver == BitSolver::exact; }

  /// Knapsack tokens of a head with n valid tokens: the residual tail is outside.
  static Index units(RDKVAllocator const& a, Index n) noexcept { return n - std::min(a.residual, n); }

  /// Weights finite and >= 0 (valid slots only), and in exact mode without eviction every budget at least the
  /// floor of 2 bits per unit.
  static Status validate(RDKVAllocator const& a, ScoreSpan<HostSpace> const& w, float const* cw, Index dim) {
    for (Index b = 0; b < w.batch; ++b)
      for (Index h = 0; h < w.heads; ++h) {
        float const* row = w.row(b, h);
        for (Index t = 0; t < w.length(b, h); ++t) {
          if (std::isnan(row[t]) || std::isinf(row[t]))
            return {Errc::non_finite, "kvc::allocate_bits: `token_weights` must be finite on valid slots (NaN/Inf)"};
          if (row[t] < 0.0f)
            return {Errc::invalid_argument, "kvc::allocate_bits: `token_weights` must be >= 0 on valid slots"};
        }
        float const* crow = cw + (b * w.heads + h) * dim;
        for (Index c = 0; c < dim; ++c) {
          if (std::isnan(crow[c]) || std::isinf(crow[c]))
            return {Errc::non_finite, "kvc::allocate_bits: `channel_weights` must be finite (NaN/Inf)"};
          if (crow[c] < 0.0f)
            return {Errc::invalid_argument, "kvc::allocate_bits: `channel_weights` must be >= 0"};
        }
      }
    if (!exact(a) || a.options.evict)
      return {};
    // Without eviction no token is dropped: T_eff = m, so every budget is known before solving.
    for (Index b = 0; b < w.batch; ++b) {
      std::int64_t v_budget = 0, v_floor = 0;
      for (Index h = 0; h < w.heads; ++h) {
        Index const n = w.length(b, h), m = units(a, n), budget = detail::rdkv_budget_tokens(a, n);
        v_budget = std::min(v_budget + detail::rdkv_v_budget(a, budget), saturated);  // both <= 4e18
        v_floor += 2 * m;
        if (a.scope == RDKVBudgetScope::head && m > 0 && detail::rdkv_v_budget(a, budget) < 2 * m)
          return {Errc::invalid_argument,
                  "kvc::allocate_bits: with options.evict false the V budget must be >= 2 "
                  "bits per token (raise budget_tokens)"};
        if (m > 0 && detail::rdkv_k_budget(a, budget, dim, m) < 2 * dim)
          return {Errc::invalid_argument,
                  "kvc::allocate_bits: with options.evict false the K budget must be >= 2 "
                  "bits per channel (raise budget_tokens or k_budget_ratio)"};
      }
      if (v_budget < v_floor)
        return {Errc::invalid_argument,
                "kvc::allocate_bits: with options.evict false the V budget must be >= 2 "
                "bits per token (raise budget_tokens)"};
    }
    return {};
  }

  static void fill16(std::int8_t* bits, Index n) { std::fill(bits, bits + n, std::int8_t{16}); }

  /// Padding -> 0, residual tail -> 16 (outside the knapsack, counted against nothing).
  static void fill_tail(RDKVAllocator const& a, std::int8_t* v, Index n, Index tokens) {
    std::fill(v + n, v + tokens, std::int8_t{0});
    fill16(v + units(a, n), n - units(a, n));
  }

  static Index kept(std::int8_t const* v, Index m) {
    Index t = 0;
    for (Index i = 0; i < m; ++i)
      t += v[i] > 0;
    return t;
  }

  /// One knapsack of n units (weights w, table eps) into `out`: exact with `exact_budget` bits, or the authors'
  /// bisection at `target` average bits; a budget that covers 16 bits per unit keeps every unit lossless.
  static bool solve(RDKVAllocator const& a, float const* w, Index n, EpsilonTable const& eps, std::int64_t exact_budget,
                    double target, std::int8_t* out, Workspace s) {
    if (exact(a) ? exact_budget / 16 >= n : target >= 16.0) {
      fill16(out, n);
      return true;
    }
    if (exact(a))
      return exact_bits(w, n, eps, a.options, exact_budget, out, s.data, s.bytes).ok();
    return lagrangian_bits(w, n, eps, a.options, target, a.lagrangian, out).ok();
  }

  /// The K knapsack of head (b, h) with budget B and T_eff kept tokens (none kept: no K to store).
  static bool allocate_k(RDKVAllocator const& a, float const* cw, std::int8_t* k, Index dim, Index budget, Index t_eff,
                         Workspace s) {
    if (t_eff == 0) {
      std::fill(k, k + dim, std::int8_t{0});
      return true;
    }
    return solve(a, cw, dim, a.eps_k, exact(a) ? detail::rdkv_k_budget(a, budget, dim, t_eff) : 0,
                 exact(a) ? 0.0 : detail::rdkv_k_target(a, budget, dim, t_eff), k, s);
  }

  /// The V knapsack over m units of weights `wv` into `v` with the given budgets (exact: bits; lagrangian: the
  /// authors' total bits 2·B·dim·16 summed over the heads).
  static bool allocate_v(RDKVAllocator const& a, float const* wv, std::int8_t* v, Index m, Index dim,
                         std::int64_t exact_budget, double total_bits, Workspace s) {
    if (m == 0)
      return true;
    return solve(a, wv, m, a.eps_v, exact_budget, exact(a) ? 0.0 : detail::rdkv_v_target(a, total_bits, m, dim), v, s);
  }

  static bool allocate_head(RDKVAllocator const& a, ScoreSpan<HostSpace> const& w, float const* cw,
                            BitPlan<HostSpace> const& plan, Index b, Index h, Workspace s) {
    Index const n = w.length(b, h), m = units(a, n), budget = detail::rdkv_budget_tokens(a, n);
    std::int8_t* v = plan.v_row(b, h);
    fill_tail(a, v, n, w.tokens);
    bool ok = allocate_v(a, w.row(b, h), v, m, plan.dim, detail::rdkv_v_budget(a, budget),
                         detail::rdkv_total_bits(budget, plan.dim), s);
    ok = ok && allocate_k(a, cw + (b * w.heads + h) * plan.dim, plan.k_row(b, h), plan.dim, budget, kept(v, m), s);
    return ok;
  }

  /// scope = layer: gather the heads' knapsack tokens, one V knapsack, scatter, then each head's K.
  static bool allocate_sequence(RDKVAllocator const& a, ScoreSpan<HostSpace> const& w, float const* cw,
                                BitPlan<HostSpace> const& plan, Index b, Workspace s) {
    WorkspaceCarver carve(s);
    float* gw = carve.take<float>(w.heads * w.tokens);
    std::int8_t* gb = carve.take<std::int8_t>(w.heads * w.tokens);
    Workspace const rest = carve.rest();
    Index total_units = 0;
    std::int64_t exact_budget = 0;
    double total_bits = 0.0;
    for (Index h = 0; h < w.heads; ++h) {
      Index const n = w.length(b, h), m = units(a, n), budget = detail::rdkv_budget_tokens(a, n);
      std::copy(w.row(b, h), w.row(b, h) + m, gw + total_units);
      total_units += m;
      exact_budget = std::min(exact_budget + detail::rdkv_v_budget(a, budget), saturated);  // both <= 4e18
      total_bits += detail::rdkv_total_bits(budget, plan.dim);
    }
    if (!allocate_v(a, gw, gb, total_units, plan.dim, exact_budget, total_bits, rest))
      return false;
    Index offset = 0;
    bool ok = true;
    for (Index h = 0; h < w.heads; ++h) {
      Index const n = w.length(b, h), m = units(a, n), budget = detail::rdkv_budget_tokens(a, n);
      std::int8_t* v = plan.v_row(b, h);
      std::copy(gb + offset, gb + offset + m, v);
      offset += m;
      fill_tail(a, v, n, w.tokens);
      ok = ok && allocate_k(a, cw + (b * w.heads + h) * plan.dim, plan.k_row(b, h), plan.dim, budget, kept(v, m), rest);
    }
    return ok;
  }
};

}  // namespace kvc
