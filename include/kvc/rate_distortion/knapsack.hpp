// SPDX-License-Identifier: Apache-2.0
// kvc/rate_distortion/knapsack.hpp: RDKV's bit allocation over one knapsack (the authors' knapsack_solver.py,
// github.com/Junkai1860/RDKV @287a4a5; docs/policies/rdkv.md). Host only.
//
// A knapsack is n units of equal cost (the V tokens of a head: cost dim per bit; the K channels of a head: cost
// T_eff per bit; the common cost is absorbed into the budget), weights w[u] >= 0 (fp32, finite; NaN, Inf or a
// negative weight is an error) and a budget in bits Σ_u b_u. Unit u at bits b costs w_u · eps(b) of distortion
// (rate_distortion/epsilon.hpp); ΔD = Σ_u w_u eps(b_u).
//
// Every solver works on the lower convex hull of the table (epsilon.hpp: EpsilonTable::hull_of): a unit moves up
// the hull edge by edge, edge k of unit u having the gain rate w_u · s_k with s_k = (eps_k − eps_{k+1}) / (b_{k+1}
// − b_k), non-increasing in k. So an option off the hull is never chosen, and:
//  - a unit of weight 0 gets the lowest option (0 bits; 2 without eviction) in every solver, whatever the budget
//    (docs/policies/rdkv.md, decision A14: the authors' λ = 0 rule, kept; a w = 0 edge never lowers ΔD);
//  - ties go to fewer bits (the authors' argmin: lowest index).
// Everything is deterministic and independent of thread count; nothing allocates: exact_bits takes caller scratch.
// (The optimal multiple-choice DP, which allocates O(n · budget), is a test reference in tools/common/knapsack_dp.hpp.)
#pragma once

#include <kvc/core/extents.hpp>
#include <kvc/core/status.hpp>
#include <kvc/core/workspace.hpp>
#include <kvc/rate_distortion/epsilon.hpp>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <utility>

namespace kvc {

/// Which discrete solver an allocation runs.
enum class BitSolver : std::uint8_t {
  exact,       ///< Σ bits <= budget always, and maximal: greedy over hull edges + fill (default)
  lagrangian,  ///< the authors' bisection on λ (knapsack_solver.py): may overshoot the target by `tol`
};

/// The authors' bisection (knapsack_solver.py). Defaults are theirs.
struct LagrangianOptions {
  double tol = 0.01;       ///< stop when |avg − target| / target < tol
  int max_iter = 64;       ///< bisection iterations (>= 1)
  int max_doublings = 40;  ///< doublings of λ_hi (>= 0; λ_hi also stops growing at 1e12)

  constexpr Status check() const noexcept {
    if (!(tol > 0.0) || !(tol < 1e300))
      return {Errc::invalid_argument, "LagrangianOptions: `tol` must be finite and > 0"};
    if (max_iter < 1)
      return {Errc::invalid_argument, "LagrangianOptions: `max_iter` must be >= 1"};
    if (max_doublings < 0)
      return {Errc::invalid_argument, "LagrangianOptions: `max_doublings` must be >= 0"};
    return {};
  }
};

namespace detail {

/// The hull a solver walks: `count` options in increasing bits (the first is the floor: 0, or 2 without
/// eviction; the last is 16), the edges' costs in bits and gain rates per bit (slope, made non-increasing so that
/// rounding can never reorder a unit's own edges).
struct RDHull {
  int count = 0;
  std::int8_t bits[kBitOptions] = {};
  double eps[kBitOptions] = {};
  std::int64_t cost[kBitOptions - 1] = {};
  double slope[kBitOptions - 1] = {};

  constexpr int edges() const noexcept { return count - 1; }
  constexpr std::int64_t floor_bits() const noexcept { return bits[0]; }
};

constexpr RDHull rd_hull(EpsilonTable const& e, BitOptions opt) noexcept {
  int idx[kBitOptions] = {};
  RDHull h;
  h.count = e.hull_of(opt.evict ? 0 : 1, idx);
  for (int k = 0; k < h.count; ++k) {
    h.bits[k] = kBits[idx[k]];
    h.eps[k] = e.eps[idx[k]];
  }
  for (int k = 0; k + 1 < h.count; ++k) {
    h.cost[k] = h.bits[k + 1] - h.bits[k];
    double const s = (h.eps[k] - h.eps[k + 1]) / static_cast<double>(h.cost[k]);
    h.slope[k] = k > 0 && s > h.slope[k - 1] ? h.slope[k - 1] : s;
  }
  return h;
}

/// Hull level of a unit of weight w at multiplier λ: the number of leading edges whose gain rate w·s_k beats λ
/// strictly (a tie keeps fewer bits). Non-decreasing in w and non-increasing in λ, exactly (rounded products are
/// monotone), so the Lagrangian's bits are monotone in the weight and in the budget.
inline int rd_level(RDHull const& h, double w, double lambda) noexcept {
  int k = 0;
  while (k < h.count - 1 && w * h.slope[k] > lambda)
    ++k;
  return k;
}

/// One hull edge of one unit in the exact solver: its gain rate and id = unit * 4 + edge.
struct RDIncrement {
  double gain;
  std::uint64_t id;
};

/// The exact solver's order: higher gain rate first; ties: lower unit, then lower edge (ids are unique, so this is
/// a strict total order and the result does not depend on how the selection partitions).
constexpr bool rd_before(RDIncrement const& a, RDIncrement const& b) noexcept {
  return a.gain > b.gain || (a.gain == b.gain && a.id < b.id);
}

/// Checks a weight array: finite and >= 0.
inline Status check_weights(float const* w, Index n, char const* what) noexcept {
  for (Index u = 0; u < n; ++u)
    if (!(w[u] >= 0.0f) || !(w[u] <= std::numeric_limits<float>::max()))
      return {std::isnan(w[u]) || std::isinf(w[u]) ? Errc::non_finite : Errc::invalid_argument, what};
  return {};
}

/// The checks every discrete solver shares.
inline Status check_knapsack(float const* w, Index n, EpsilonTable const& eps, std::int8_t const* bits,
                             char const* null_msg, char const* weight_msg) noexcept {
  KVC_RETURN_IF_ERROR(eps.check());
  if (n < 0 || (n > 0 && (w == nullptr || bits == nullptr)))
    return {Errc::invalid_argument, null_msg};
  return check_weights(w, n, weight_msg);
}

/// Writes every unit's bits at λ and returns Σ bits.
inline std::int64_t rd_solve(RDHull const& h, float const* w, Index n, double lambda, std::int8_t* bits) noexcept {
  std::int64_t sum = 0;
  for (Index u = 0; u < n; ++u) {
    bits[u] = h.bits[rd_level(h, static_cast<double>(w[u]), lambda)];
    sum += bits[u];
  }
  return sum;
}

}  // namespace detail

/// b(λ) for one λ (an Everett point: optimal for the bits it spends): b_u = argmin over the hull options of
/// w_u eps(b) + λ b, ties to fewer bits. Preconditions (unchecked): eps.check() passes, w finite and >= 0, λ >= 0.
inline void bits_at_lambda(float const* w, Index n, EpsilonTable const& eps, BitOptions opt, double lambda,
                           std::int8_t* bits) {
  (void)detail::rd_solve(detail::rd_hull(eps, opt), w, n, lambda, bits);
}

/// The authors' bisection (knapsack_solver.py, knapsack_bit_allocation_batched): λ_lo = 0, λ_hi = max(0.375 · max w,
/// 1e-8), doubled while avg(λ_hi) > target (at most `max_doublings` times, not past 1e12); if λ = 0 meets the target
/// its bits are returned (w > 0 -> 16, w = 0 -> 0); else at most `max_iter` midpoints, stopping at the first with
/// |avg − target| / target < tol (else the last midpoint's bits). b_u(λ) as bits_at_lambda. `target_avg` = average
/// bits per unit (>= 0). The result may exceed the budget (by up to tol when converged, more when not: decision A7).
/// Deliberate difference: a target at or below the floor (0 bits, or 2 without eviction) gives every unit the floor
/// (λ = +inf), where the authors' bisection would return its last midpoint, which can spend bits (budget 0 must
/// evict everything). Averages are exact (Σ bits / n in double; the authors' are fp32 means). `lambda_out`: the λ
/// of the returned bits. Errors: bad table or options, n < 0, null pointers, weights NaN/Inf/negative, target NaN,
/// Inf or negative.
inline Status lagrangian_bits(float const* w, Index n, EpsilonTable const& eps, BitOptions opt, double target_avg,
                              LagrangianOptions const& lo, std::int8_t* bits, double* lambda_out = nullptr) {
  KVC_RETURN_IF_ERROR(detail::check_knapsack(w, n, eps, bits,
                                             "kvc::lagrangian_bits: `w` and `bits` ([n]) must be "
                                             "non-null and n >= 0",
                                             "kvc::lagrangian_bits: `w` must be finite and >= 0"));
  KVC_RETURN_IF_ERROR(lo.check());
  if (!(target_avg >= 0.0) || !(target_avg <= std::numeric_limits<double>::max()))
    return {Errc::invalid_argument, "kvc::lagrangian_bits: `target_avg` must be finite and >= 0"};
  detail::RDHull const h = detail::rd_hull(eps, opt);
  double lambda = 0.0;
  if (n == 0) {
  } else if (target_avg <= static_cast<double>(h.floor_bits())) {
    lambda = std::numeric_limits<double>::infinity();
    (void)detail::rd_solve(h, w, n, lambda, bits);
  } else {
    double const count = static_cast<double>(n);
    auto avg_at = [&](double lam) { return static_cast<double>(detail::rd_solve(h, w, n, lam, bits)) / count; };
    if (!(avg_at(0.0) <= target_avg)) {
      float max_w = 0.0f;
      for (Index u = 0; u < n; ++u)
        max_w = std::max(max_w, w[u]);
      double hi = std::max(static_cast<double>(max_w) * 0.375, 1e-8);
      for (int d = 0; d < lo.max_doublings && hi < 1e12 && avg_at(hi) > target_avg; ++d)
        hi *= 2.0;
      double low = 0.0;
      for (int it = 0; it < lo.max_iter; ++it) {
        lambda = (low + hi) / 2.0;
        double const avg = avg_at(lambda);
        if (std::fabs(avg - target_avg) / target_avg < lo.tol)
          break;
        (avg > target_avg ? low : hi) = lambda;
      }
    }
  }
  if (lambda_out != nullptr)
    *lambda_out = lambda;
  return {};
}

/// Bytes of scratch exact_bits needs for n units (any alignment: the slack is included).
inline std::size_t exact_bits_scratch_bytes(Index n) {
  return bytes_sum(bytes_product(n, kBitOptions - 1, sizeof(detail::RDIncrement)), workspace_slack);
}

/// Exact mode: Σ bits <= budget_bits always, and maximal. The greedy over hull edges in decreasing gain rate
/// w_u (eps_k − eps_{k+1}) / (b_{k+1} − b_k) (ties: lower unit first, then lower edge): an edge that fits the
/// remaining budget is taken; one that does not is skipped and blocks its unit's later edges; scanning on fills the
/// slack with cheaper edges of other units. Edges of zero gain (w = 0) are never taken (decision A14).
/// How: the taken prefix of that order (every edge before the first that does not fit) is found by a weighted
/// quickselect over the edges (expected O(n), std::sort past a depth limit); the fill then needs at most
/// slack / 2 < 8 passes over the units, since the slack left is below the skipped edge's cost (<= 16 bits).
/// Without eviction every unit starts at 2 bits: a budget below 2n is invalid_argument. Scratch:
/// exact_bits_scratch_bytes(n) bytes (contents ignored). Errors: bad table, n < 0, null pointers, weights
/// NaN/Inf/negative, budget < 0, scratch too small (out_of_capacity).
inline Status exact_bits(float const* w, Index n, EpsilonTable const& eps, BitOptions opt, std::int64_t budget_bits,
                         std::int8_t* bits, void* scratch, std::size_t scratch_bytes) {
  using detail::RDIncrement;
  KVC_RETURN_IF_ERROR(detail::check_knapsack(w, n, eps, bits,
                                             "kvc::exact_bits: `w` and `bits` ([n]) must be "
                                             "non-null and n >= 0",
                                             "kvc::exact_bits: `w` must be finite and >= 0"));
  if (budget_bits < 0)
    return {Errc::invalid_argument, "kvc::exact_bits: `budget_bits` must be >= 0"};
  detail::RDHull const h = detail::rd_hull(eps, opt);
  if (h.floor_bits() > 0 && budget_bits / h.floor_bits() < n)
    return {Errc::invalid_argument, "kvc::exact_bits: `budget_bits` must be >= 2 * n when options.evict is false"};
  std::int64_t slack = budget_bits - h.floor_bits() * n;
  int const edges = h.edges();
  RDIncrement* items = WorkspaceCarver({scratch, scratch_bytes}).take<RDIncrement>(n * edges);
  if (items == nullptr && n * edges > 0)
    return {Errc::out_of_capacity, "kvc::exact_bits: `scratch` smaller than exact_bits_scratch_bytes(n)"};

  // bits[] holds each unit's hull level until the end.
  Index m = 0;
  for (Index u = 0; u < n; ++u) {
    bits[u] = 0;
    for (int k = 0; k < edges; ++k) {
      double const g = static_cast<double>(w[u]) * h.slope[k];
      if (!(g > 0.0))
        break;  // gains are non-increasing along a unit's edges
      items[m++] = {g, static_cast<std::uint64_t>(u) * 4 + static_cast<std::uint64_t>(k)};
    }
  }
  auto cost = [&](RDIncrement const& x) { return h.cost[x.id & 3]; };
  auto take = [&](RDIncrement const& x) { ++bits[x.id >> 2]; };
  auto range_cost = [&](Index a, Index b) {
    std::int64_t c = 0;
    for (Index i = a; i < b; ++i)
      c += cost(items[i]);
    return c;
  };

  // Phase 1: the longest prefix of the order that fits. Invariant inside the loop: the edges of [lo, hi) cost more
  // than the slack, so the first edge that does not fit lies in [lo, hi).
  bool blocked = false;
  RDIncrement cut{};
  if (range_cost(0, m) <= slack) {
    for (Index i = 0; i < m; ++i)
      take(items[i]);
    slack -= range_cost(0, m);
  } else {
    Index lo = 0, hi = m;
    int depth = 2 * static_cast<int>(std::bit_width(static_cast<std::uint64_t>(m))) + 8;
    while (!blocked) {
      if (depth-- == 0 || hi - lo <= 16) {
        std::sort(items + lo, items + hi, detail::rd_before);
        for (Index i = lo; i < hi && !blocked; ++i) {
          if (cost(items[i]) > slack) {
            cut = items[i];
            blocked = true;
          } else {
            take(items[i]);
            slack -= cost(items[i]);
          }
        }
        break;
      }
      // Median of three as the pivot, then a Lomuto partition: [lo, p) before the pivot, p the pivot.
      Index const mid = lo + (hi - lo) / 2;
      Index a = lo, b = mid, c = hi - 1;
      if (detail::rd_before(items[b], items[a]))
        std::swap(a, b);
      if (detail::rd_before(items[c], items[b]))
        b = detail::rd_before(items[c], items[a]) ? a : c;
      std::swap(items[b], items[hi - 1]);
      RDIncrement const pivot = items[hi - 1];
      Index p = lo;
      for (Index i = lo; i < hi - 1; ++i)
        if (detail::rd_before(items[i], pivot))
          std::swap(items[i], items[p++]);
      std::swap(items[p], items[hi - 1]);
      std::int64_t const left = range_cost(lo, p);
      if (left > slack) {
        hi = p;
        continue;
      }
      for (Index i = lo; i < p; ++i)
        take(items[i]);
      slack -= left;
      if (cost(pivot) > slack) {
        cut = pivot;
        blocked = true;
      } else {
        take(pivot);
        slack -= cost(pivot);
        lo = p + 1;
      }
    }
  }

  // Phase 2: the scan past the first skipped edge `cut`. Every unit's next edge lies at or after the scan position
  // in the order (everything before it was taken); a unit whose next edge the scan passed without taking it is
  // blocked, which "strictly after the position" expresses, since the slack only shrinks. Each step takes the
  // earliest next edge that fits.
  std::int64_t min_cost = 16;
  for (int k = 0; k < edges; ++k)
    min_cost = std::min(min_cost, h.cost[k]);
  RDIncrement at = cut;
  while (blocked && slack >= min_cost) {
    bool found = false;
    RDIncrement best{};
    for (Index u = 0; u < n; ++u) {
      int const k = bits[u];
      if (k >= edges || h.cost[k] > slack)
        continue;
      RDIncrement const x{static_cast<double>(w[u]) * h.slope[k],
                          static_cast<std::uint64_t>(u) * 4 + static_cast<std::uint64_t>(k)};
      if (x.gain > 0.0 && detail::rd_before(at, x) && (!found || detail::rd_before(x, best))) {
        best = x;
        found = true;
      }
    }
    if (!found)
      break;
    take(best);
    slack -= cost(best);
    at = best;
  }
  for (Index u = 0; u < n; ++u)
    bits[u] = h.bits[bits[u]];
  return {};
}

/// Distortion Σ_u w_u eps(b_u) (double, summed in unit order). NaN when a bit width is not in {0, 2, 4, 8, 16}.
inline double distortion(float const* w, Index n, EpsilonTable const& eps, std::int8_t const* bits) {
  double d = 0.0;
  for (Index u = 0; u < n; ++u) {
    int const i = bit_option_index(bits[u]);
    if (i < 0)
      return std::numeric_limits<double>::quiet_NaN();
    d += static_cast<double>(w[u]) * eps.eps[i];
  }
  return d;
}

/// Continuous relaxation over the hull (Prop. A.3's lower bound in the RDKV paper): the fractional multiple-choice
/// knapsack, each unit's distortion the piecewise-linear hull between its options, Σ b_u <= budget_bits (real).
/// Returns the minimal ΔD: every edge of gain rate above the threshold λ* taken, and the rest of the budget spent
/// at rate λ*, with λ* found by bisection over the bit patterns of doubles (exact, ~64 passes; not a hot path).
/// <= the distortion of any allocation over {0, 2, 4, 8, 16} within the budget. +inf when the budget is below the
/// floor (2n without eviction); NaN for invalid input (bad table, n < 0, bad weights, NaN budget).
inline double hull_lower_bound(float const* w, Index n, EpsilonTable const& eps, BitOptions opt, double budget_bits) {
  if (!eps.check().ok() || n < 0 || (n > 0 && w == nullptr) || !detail::check_weights(w, n, "w").ok() ||
      std::isnan(budget_bits))
    return std::numeric_limits<double>::quiet_NaN();
  detail::RDHull const h = detail::rd_hull(eps, opt);
  double const floor = static_cast<double>(h.floor_bits());
  double const spare = budget_bits - floor * static_cast<double>(n);
  if (spare < 0.0)
    return std::numeric_limits<double>::infinity();
  auto cost_at = [&](double lam) {  // bits above the floor at λ (exact: integers)
    double c = 0.0;
    for (Index u = 0; u < n; ++u)
      c += static_cast<double>(h.bits[detail::rd_level(h, static_cast<double>(w[u]), lam)]) - floor;
    return c;
  };
  auto distortion_at = [&](double lam) {
    double d = 0.0;
    for (Index u = 0; u < n; ++u)
      d += static_cast<double>(w[u]) * h.eps[detail::rd_level(h, static_cast<double>(w[u]), lam)];
    return d;
  };
  if (cost_at(0.0) <= spare)
    return distortion_at(0.0);
  double max_gain = 0.0;
  for (Index u = 0; u < n; ++u)
    max_gain = std::max(max_gain, static_cast<double>(w[u]) * h.slope[0]);
  // Smallest λ with cost(λ) <= spare: cost(0) > spare >= cost(max_gain) = 0. Non-negative doubles order as their
  // bit patterns.
  std::uint64_t lo = 0, hi = std::bit_cast<std::uint64_t>(max_gain);
  while (hi - lo > 1) {
    std::uint64_t const mid = lo + (hi - lo) / 2;
    (cost_at(std::bit_cast<double>(mid)) <= spare ? hi : lo) = mid;
  }
  double const lambda = std::bit_cast<double>(hi);
  return distortion_at(lambda) - lambda * (spare - cost_at(lambda));
}

/// Reverse water-filling (the continuous model D_u(b) = w_u σ_u² 2^{−2b}): b_u = clip(½ log2(w_u σ_u² /
/// (c_u θ)), 0, b_max), the water level θ such that Σ_u c_u b_u = budget. Inputs: w_var [n] = w_u σ_u² (>= 0,
/// finite), cost [n] = c_u (> 0, finite), budget (finite), b_max (> 0, finite). Writes the real-valued bits [n] and
/// returns θ. θ is found by bisection on log2 θ, then solved in closed form on the units strictly inside (0, b_max).
/// Endpoints: budget <= 0 -> every b_u = 0, θ = max_u w_var_u / c_u; budget >= Σ_{w_var > 0} c_u b_max -> every
/// unit with w_var > 0 at b_max, θ = min over those of w_var_u / (c_u 4^b_max). Units with w_var = 0 get 0 bits.
/// Returns NaN (bits untouched) on invalid input. (Cover & Thomas, Elements of Information Theory, ch. 10.)
inline double water_filling(double const* w_var, double const* cost, Index n, double budget, double b_max,
                            double* bits) {
  constexpr double nan = std::numeric_limits<double>::quiet_NaN();
  if (n < 0 || (n > 0 && (w_var == nullptr || cost == nullptr || bits == nullptr)) || !std::isfinite(budget) ||
      !(b_max > 0.0) || !std::isfinite(b_max))
    return nan;
  double lx_min = std::numeric_limits<double>::infinity(), lx_max = -lx_min, full = 0.0;
  for (Index u = 0; u < n; ++u) {
    if (!(w_var[u] >= 0.0) || !std::isfinite(w_var[u]) || !(cost[u] > 0.0) || !std::isfinite(cost[u]))
      return nan;
    if (w_var[u] > 0.0) {
      double const lx = std::log2(w_var[u] / cost[u]);
      lx_min = std::min(lx_min, lx);
      lx_max = std::max(lx_max, lx);
      full += cost[u] * b_max;
    }
  }
  // In L = log2 θ: b_u(L) = clip(½ (log2 x_u − L), 0, b_max) with x_u = w_var_u / c_u.
  auto bits_of = [&](Index u, double level) {
    if (!(w_var[u] > 0.0))
      return 0.0;
    double const b = 0.5 * (std::log2(w_var[u] / cost[u]) - level);
    return b < 0.0 ? 0.0 : (b > b_max ? b_max : b);
  };
  auto total = [&](double level) {
    double t = 0.0;
    for (Index u = 0; u < n; ++u)
      t += cost[u] * bits_of(u, level);
    return t;
  };
  double level;
  if (!(lx_max > -std::numeric_limits<double>::infinity())) {  // every w_var = 0
    for (Index u = 0; u < n; ++u)
      bits[u] = 0.0;
    return 0.0;
  }
  if (budget <= 0.0) {
    level = lx_max;
  } else if (budget >= full) {
    level = lx_min - 2.0 * b_max;
  } else {
    double lo = lx_min - 2.0 * b_max, hi = lx_max;  // total(lo) = full > budget > 0 = total(hi)
    for (int it = 0; it < 200 && hi - lo > 0.0; ++it) {
      double const mid = 0.5 * (lo + hi);
      if (mid <= lo || mid >= hi)
        break;
      (total(mid) > budget ? lo : hi) = mid;
    }
    level = 0.5 * (lo + hi);
    // Closed form on the interior units: Σ_I c_u (log2 x_u − L) / 2 + Σ_sat c_u b_max = budget.
    double ci = 0.0, cl = 0.0, sat = 0.0;
    for (Index u = 0; u < n; ++u) {
      double const b = bits_of(u, level);
      if (b >= b_max)
        sat += cost[u] * b_max;
      else if (b > 0.0) {
        ci += cost[u];
        cl += cost[u] * std::log2(w_var[u] / cost[u]);
      }
    }
    if (ci > 0.0) {
      double const exact = (cl - 2.0 * (budget - sat)) / ci;
      if (std::fabs(total(exact) - budget) <= std::fabs(total(level) - budget))
        level = exact;
    }
  }
  for (Index u = 0; u < n; ++u)
    bits[u] = bits_of(u, level);
  return std::exp2(level);
}

}  // namespace kvc
