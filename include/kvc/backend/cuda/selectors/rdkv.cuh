// SPDX-License-Identifier: Apache-2.0
// kvc/backend/cuda/selectors/rdkv.cuh: RDKV's bit allocation on CUDA (Kernel<RDKVAllocator, Cuda>): one block per
// (sequence, KV head), the V knapsack over the head's tokens, then the K knapsack over its channels, each solved by
// the whole block. Bit for bit the CPU kernel's plan given the same weights, because every quantity that
// decides a bit is computed with the CPU's exact operations (kvc/rate_distortion/knapsack.hpp):
//  - the hull (detail::rd_hull) is built on the host by the CPU's own function and passed by value;
//  - a unit's level at λ compares w_u · s_k > λ: one rounded product (__dmul_rn: never fused) against a double;
//  - the Lagrangian's control values (λ_hi, midpoints, averages Σ bits / n, the stopping test) are the CPU's
//    double expressions, evaluated identically in every thread from block-wide integer counts (exact in any
//    order); no multiply is followed by an add there, so FMA contraction has nothing to contract, and the one
//    product (0.375 · max w) is written __dmul_rn anyway;
//  - exact mode takes the same edges as the CPU's greedy (order: gain w_u · s_k descending, then id = 4u + k
//    ascending), found without sorting: the gain G* of the first edge that does not fit is the largest gain whose
//    edges of gain >= G* cost more than the slack, found by bisection over the bit patterns of positive doubles
//    (which order as the doubles do); every edge above G* is taken; the edges at exactly G* are taken in id order
//    (a block-wide prefix sum over units) up to the first that does not fit, the cut; then the CPU's fill: at most
//    slack / 2 < 8 steps, each a block-wide argmin (in the same order) of the units' next edges that fit and come
//    strictly after the last position. This is the CPU's algorithm, not an approximation of it: its phase 1 is
//    "take the longest prefix of the order that fits", whatever partitioning finds it.
// Budgets are the CPU's double expressions too (see rdkv_head_budgets). Scratch: none (each unit's hull level lives
// in the output plan until the end, as on the CPU).
#pragma once

#include <kvc/backend/cuda/config.cuh>
#include <kvc/rate_distortion/epsilon.hpp>
#include <kvc/rate_distortion/knapsack.hpp>
#include <kvc/selectors/rdkv.hpp>

#include <cstddef>
#include <cstdint>
#include <math_constants.h>

namespace kvc::backend::cuda {

inline constexpr int rdkv_threads = 512;

/// Block-wide sum of one 64-bit integer per thread (exact, so any order gives the same result). `scratch` holds
/// rdkv_threads / warp_size values. Every thread gets the result; call it block-uniformly.
__device__ inline long long rd_block_sum(long long x, long long* scratch) {
  int const warp = static_cast<int>(threadIdx.x) / warp_size, lane = static_cast<int>(threadIdx.x) % warp_size;
  for (int offset = warp_size / 2; offset > 0; offset /= 2)
    x += __shfl_xor_sync(full_mask, x, offset);
  if (lane == 0)
    scratch[warp] = x;
  __syncthreads();
  long long total = 0;
  for (int i = 0; i < (static_cast<int>(blockDim.x) + warp_size - 1) / warp_size; ++i)
    total += scratch[i];
  __syncthreads();
  return total;
}

/// Block-wide max of one float per thread (weights: finite, >= 0, so fmaxf equals the CPU's std::max).
__device__ inline float rd_block_max(float x, float* scratch) {
  int const warp = static_cast<int>(threadIdx.x) / warp_size, lane = static_cast<int>(threadIdx.x) % warp_size;
  x = warp_max(x);
  if (lane == 0)
    scratch[warp] = x;
  __syncthreads();
  float m = scratch[0];
  for (int i = 1; i < (static_cast<int>(blockDim.x) + warp_size - 1) / warp_size; ++i)
    m = fmaxf(m, scratch[i]);
  __syncthreads();
  return m;
}

/// An edge in the exact solver's order (detail::RDIncrement on the device). Invalid: gain -1 (valid gains are > 0).
struct RDEdge {
  double gain;
  unsigned long long id;
};

__device__ inline bool rd_edge_before(RDEdge const& a, RDEdge const& b) {
  return a.gain > b.gain || (a.gain == b.gain && a.id < b.id);
}

/// The first edge in the order over the block (invalid ones never win). Every thread gets the result.
__device__ inline RDEdge rd_block_first(RDEdge x, RDEdge* scratch) {
  int const warp = static_cast<int>(threadIdx.x) / warp_size, lane = static_cast<int>(threadIdx.x) % warp_size;
  for (int offset = warp_size / 2; offset > 0; offset /= 2) {
    RDEdge const y{__shfl_xor_sync(full_mask, x.gain, offset), __shfl_xor_sync(full_mask, x.id, offset)};
    if (rd_edge_before(y, x))
      x = y;
  }
  if (lane == 0)
    scratch[warp] = x;
  __syncthreads();
  RDEdge best = scratch[0];
  for (int i = 1; i < (static_cast<int>(blockDim.x) + warp_size - 1) / warp_size; ++i)
    if (rd_edge_before(scratch[i], best))
      best = scratch[i];
  __syncthreads();
  return best;
}

/// Shared state of one block's solver.
struct RDShared {
  long long sums[rdkv_threads / warp_size];
  float maxima[rdkv_threads / warp_size];
  RDEdge edges[rdkv_threads / warp_size];
  long long prefix[rdkv_threads];
  Index cut_unit;
  long long cut_before;
};

/// Gain rate of edge k of a unit of weight w (the CPU's static_cast<double>(w[u]) * h.slope[k], never fused).
__device__ inline double rd_gain(float w, detail::RDHull const& h, int k) {
  return __dmul_rn(static_cast<double>(w), h.slope[k]);
}

/// detail::rd_level on the device.
__device__ inline int rd_level_device(detail::RDHull const& h, float w, double lambda) {
  int k = 0;
  while (k < h.count - 1 && rd_gain(w, h, k) > lambda)
    ++k;
  return k;
}

/// Σ bits of the units at λ (block-wide, exact).
__device__ inline long long rd_bits_at(detail::RDHull const& h, float const* w, Index n, double lambda, RDShared& sh) {
  long long part = 0;
  for (Index u = threadIdx.x; u < n; u += blockDim.x)
    part += h.bits[rd_level_device(h, w[u], lambda)];
  return rd_block_sum(part, sh.sums);
}

/// kvc::lagrangian_bits on one block: the λ whose bits the CPU returns (every thread computes the same values).
__device__ inline double rd_lagrangian_lambda(detail::RDHull const& h, float const* w, Index n, double target_avg,
                                              LagrangianOptions const& lo, RDShared& sh) {
  if (n == 0)
    return 0.0;
  if (target_avg <= static_cast<double>(h.bits[0]))
    return CUDART_INF;
  double const count = static_cast<double>(n);
  auto avg_at = [&](double lam) { return static_cast<double>(rd_bits_at(h, w, n, lam, sh)) / count; };
  if (avg_at(0.0) <= target_avg)
    return 0.0;
  float max_w = 0.0f;
  for (Index u = threadIdx.x; u < n; u += blockDim.x)
    max_w = fmaxf(max_w, w[u]);
  max_w = rd_block_max(max_w, sh.maxima);
  double const scaled = __dmul_rn(static_cast<double>(max_w), 0.375);
  double hi = scaled < 1e-8 ? 1e-8 : scaled;  // std::max(scaled, 1e-8)
  for (int d = 0; d < lo.max_doublings && hi < 1e12 && avg_at(hi) > target_avg; ++d)
    hi *= 2.0;
  double low = 0.0, lambda = 0.0;
  for (int it = 0; it < lo.max_iter; ++it) {
    lambda = __ddiv_rn(__dadd_rn(low, hi), 2.0);
    double const avg = avg_at(lambda);
    if (__ddiv_rn(fabs(__dsub_rn(avg, target_avg)), target_avg) < lo.tol)
      break;
    if (avg > target_avg)
      low = lambda;
    else
      hi = lambda;
  }
  return lambda;
}

/// Writes the units' bits at λ into `bits` and returns their sum.
__device__ inline long long rd_write_at(detail::RDHull const& h, float const* w, Index n, double lambda,
                                        std::int8_t* bits, RDShared& sh) {
  long long part = 0;
  for (Index u = threadIdx.x; u < n; u += blockDim.x) {
    bits[u] = h.bits[rd_level_device(h, w[u], lambda)];
    part += bits[u];
  }
  return rd_block_sum(part, sh.sums);
}

/// Σ costs of the edges with gain > 0 and gain >= x (x = a non-negative double's bit pattern).
__device__ inline long long rd_cost_from(detail::RDHull const& h, float const* w, Index n, unsigned long long x,
                                         RDShared& sh) {
  double const g_min = __longlong_as_double(static_cast<long long>(x));
  long long part = 0;
  for (Index u = threadIdx.x; u < n; u += blockDim.x)
    for (int k = 0; k < h.count - 1; ++k) {
      double const g = rd_gain(w[u], h, k);
      if (!(g > 0.0) || g < g_min)
        break;  // gains are non-increasing along a unit's edges
      part += h.cost[k];
    }
  return rd_block_sum(part, sh.sums);
}

/// kvc::exact_bits on one block (the budget >= floor * n check is the caller's): writes `bits`, returns Σ bits.
__device__ inline long long rd_exact(detail::RDHull const& h, float const* w, Index n, long long budget_bits,
                                     std::int8_t* bits, RDShared& sh) {
  int const edges = h.count - 1;
  long long const floor_bits = h.bits[0];
  if (floor_bits > 0 && budget_bits / floor_bits < n) {  // the CPU rejects this (see the Kernel's comment)
    for (Index u = threadIdx.x; u < n; u += blockDim.x)
      bits[u] = h.bits[0];
    return rd_block_sum(0, sh.sums) + floor_bits * n;
  }
  long long slack = budget_bits - floor_bits * n;
  // bits[] holds each unit's hull level until the end. Everything with a positive gain, and its cost.
  long long part = 0;
  float max_w = 0.0f;
  for (Index u = threadIdx.x; u < n; u += blockDim.x) {
    int k = 0;
    while (k < edges && rd_gain(w[u], h, k) > 0.0)
      part += h.cost[k++];
    bits[u] = static_cast<std::int8_t>(k);
    max_w = fmaxf(max_w, w[u]);
  }
  long long const total = rd_block_sum(part, sh.sums);
  bool blocked = false;
  RDEdge at{-1.0, 0};
  if (total > slack) {
    blocked = true;
    // 1. G*: the largest gain with cost(gain >= G*) > slack. Patterns: lo passes (cost from +0 = total), hi fails.
    max_w = rd_block_max(max_w, sh.maxima);
    unsigned long long lo = 0, hi = static_cast<unsigned long long>(__double_as_longlong(rd_gain(max_w, h, 0))) + 1ull;
    while (hi - lo > 1ull) {
      unsigned long long const mid = lo + (hi - lo) / 2ull;
      if (rd_cost_from(h, w, n, mid, sh) > slack)
        lo = mid;
      else
        hi = mid;
    }
    double const g_star = __longlong_as_double(static_cast<long long>(lo));
    long long const above = rd_cost_from(h, w, n, lo + 1ull, sh);  // edges of gain > G*: all taken
    long long const slack1 = slack - above;
    // 2. Edges at exactly G*, in unit order: each thread a contiguous range of units, their tie costs, a prefix sum.
    Index const per = (n + blockDim.x - 1) / blockDim.x, u0 = threadIdx.x * per, u1 = u0 + per < n ? u0 + per : n;
    auto tie_cost = [&](Index u) {
      long long c = 0;
      for (int k = 0; k < edges; ++k) {
        double const g = rd_gain(w[u], h, k);
        if (g < g_star)
          break;
        if (g == g_star)
          c += h.cost[k];
      }
      return c;
    };
    long long local = 0;
    for (Index u = u0; u < u1; ++u)
      local += tie_cost(u);
    sh.prefix[threadIdx.x] = local;
    __syncthreads();
    if (threadIdx.x == 0) {
      long long run = 0;
      for (unsigned i = 0; i < blockDim.x; ++i) {
        long long const x = sh.prefix[i];
        sh.prefix[i] = run;
        run += x;
      }
      sh.cut_unit = n;  // unreachable: the tie edges cost more than slack1 by the choice of G*
      sh.cut_before = 0;
    }
    __syncthreads();
    long long run = sh.prefix[threadIdx.x];
    for (Index u = u0; u < u1; ++u) {
      long long const c = tie_cost(u);
      if (run > slack1)
        break;  // past the crossing (a later thread's range): not ours
      if (run + c > slack1) {
        sh.cut_unit = u;  // the crossing excl <= slack1 < incl: one unit, so one thread, finds it
        sh.cut_before = run;
        break;
      }
      run += c;
    }
    __syncthreads();
    Index const cut_unit = sh.cut_unit;
    long long left = slack1 - sh.cut_before;  // what the cut unit's tie edges may spend
    // 3. Levels: edges above G*, plus the tie edges of units before the cut unit, plus the cut unit's that fit.
    int cut_edge = edges;
    for (Index u = threadIdx.x; u < n; u += blockDim.x) {
      int k = 0;
      while (k < edges && rd_gain(w[u], h, k) > g_star)
        ++k;
      if (u < cut_unit) {
        while (k < edges && rd_gain(w[u], h, k) == g_star)
          ++k;
      }
      bits[u] = static_cast<std::int8_t>(k);
    }
    __syncthreads();     // the cut unit's owner has written its level: thread 0 overwrites it below
    if (cut_unit < n) {  // every thread walks the cut unit's tie edges (same values everywhere)
      int k = 0;
      while (k < edges && rd_gain(w[cut_unit], h, k) > g_star)
        ++k;
      while (k < edges && rd_gain(w[cut_unit], h, k) == g_star && h.cost[k] <= left)
        left -= h.cost[k++];
      cut_edge = k;
      if (threadIdx.x == 0)
        bits[cut_unit] = static_cast<std::int8_t>(k);
    }
    slack = left;
    at = RDEdge{g_star, static_cast<unsigned long long>(cut_unit) * 4ull + static_cast<unsigned long long>(cut_edge)};
    __syncthreads();
  } else {
    slack -= total;
  }
  // 4. The fill past the cut: the earliest next edge that fits and comes strictly after the position.
  long long min_cost = 16;
  for (int k = 0; k < edges; ++k)
    min_cost = h.cost[k] < min_cost ? h.cost[k] : min_cost;
  while (blocked && slack >= min_cost) {
    RDEdge best{-1.0, ~0ull};
    for (Index u = threadIdx.x; u < n; u += blockDim.x) {
      int const k = bits[u];
      if (k >= edges || h.cost[k] > slack)
        continue;
      RDEdge const x{rd_gain(w[u], h, k),
                     static_cast<unsigned long long>(u) * 4ull + static_cast<unsigned long long>(k)};
      if (x.gain > 0.0 && rd_edge_before(at, x) && rd_edge_before(x, best))
        best = x;
    }
    best = rd_block_first(best, sh.edges);
    if (!(best.gain > 0.0))
      break;
    if (threadIdx.x == 0)
      bits[best.id >> 2] = static_cast<std::int8_t>(bits[best.id >> 2] + 1);
    slack -= h.cost[best.id & 3ull];
    at = best;
    __syncthreads();
  }
  // Levels to bits.
  long long sum = 0;
  for (Index u = threadIdx.x; u < n; u += blockDim.x) {
    bits[u] = h.bits[bits[u]];
    sum += bits[u];
  }
  return rd_block_sum(sum, sh.sums);
}

/// The budget expressions of selectors/rdkv.hpp (detail::rdkv_*), operation for operation in the CPU's order, each
/// rounded on its own (no FMA).
__device__ inline Index rd_budget_tokens(RDKVAllocator const& a, Index n) {
  if (a.ratio >= 0.0)
    return static_cast<Index>(floor(__dmul_rn(static_cast<double>(n), __dsub_rn(1.0, a.ratio))));
  return a.budget_tokens;
}
__device__ inline long long rd_floor_bits(double x) {
  return x >= 4e18 ? 4000000000000000000ll : static_cast<long long>(floor(x));
}
__device__ inline double rd_total_bits(Index budget, Index dim) {
  return __dmul_rn(__dmul_rn(__dmul_rn(2.0, static_cast<double>(budget)), static_cast<double>(dim)), 16.0);
}
__device__ inline long long rd_v_budget(RDKVAllocator const& a, Index budget) {
  return rd_floor_bits(
      __dmul_rn(__dsub_rn(1.0, a.k_budget_ratio), __dmul_rn(__dmul_rn(2.0, static_cast<double>(budget)), 16.0)));
}
__device__ inline long long rd_k_budget(RDKVAllocator const& a, Index budget, Index dim, Index t_eff) {
  double const total = rd_total_bits(budget, dim);
  return rd_floor_bits(__ddiv_rn(__dmul_rn(a.k_budget_ratio, total), static_cast<double>(t_eff > 1 ? t_eff : 1)));
}
__device__ inline double rd_v_target(RDKVAllocator const& a, double total_bits, Index units, Index dim) {
  return __ddiv_rn(__dmul_rn(__dsub_rn(1.0, a.k_budget_ratio), total_bits),
                   __dmul_rn(static_cast<double>(units), static_cast<double>(dim)));
}
__device__ inline double rd_k_target(RDKVAllocator const& a, Index budget, Index dim, Index t_eff) {
  double const total = rd_total_bits(budget, dim);
  return __ddiv_rn(__dmul_rn(a.k_budget_ratio, total),
                   __dmul_rn(static_cast<double>(dim), static_cast<double>(t_eff > 1 ? t_eff : 1)));
}

__device__ inline void rd_fill(std::int8_t* bits, Index begin, Index end, std::int8_t value) {
  for (Index i = begin + threadIdx.x; i < end; i += blockDim.x)
    bits[i] = value;
}

/// The CPU's allocate_v: the V knapsack over m units (exact budget in bits, or the lagrangian total bits).
__device__ inline void rd_allocate_v(RDKVAllocator const& a, detail::RDHull const& hv, float const* wv, std::int8_t* v,
                                     Index m, Index dim, long long exact_budget, double total_bits, RDShared& sh) {
  if (m == 0)
    return;
  if (a.solver == BitSolver::exact) {
    if (exact_budget / 16 >= m)
      rd_fill(v, 0, m, 16);
    else
      (void)rd_exact(hv, wv, m, exact_budget, v, sh);
    return;
  }
  double const target = rd_v_target(a, total_bits, m, dim);
  if (target >= 16.0)
    rd_fill(v, 0, m, 16);
  else
    (void)rd_write_at(hv, wv, m, rd_lagrangian_lambda(hv, wv, m, target, a.lagrangian, sh), v, sh);
}

/// The CPU's allocate_k: the K knapsack of one head with budget B and T_eff kept tokens.
__device__ inline void rd_allocate_k(RDKVAllocator const& a, detail::RDHull const& hk, float const* cw, std::int8_t* k,
                                     Index dim, Index budget, Index t_eff, RDShared& sh) {
  if (t_eff == 0) {
    rd_fill(k, 0, dim, 0);
    return;
  }
  if (a.solver == BitSolver::exact) {
    long long const bits = rd_k_budget(a, budget, dim, t_eff);
    if (bits >= 16 * dim)
      rd_fill(k, 0, dim, 16);
    else
      (void)rd_exact(hk, cw, dim, bits, k, sh);
    return;
  }
  double const target = rd_k_target(a, budget, dim, t_eff);
  if (target >= 16.0)
    rd_fill(k, 0, dim, 16);
  else
    (void)rd_write_at(hk, cw, dim, rd_lagrangian_lambda(hk, cw, dim, target, a.lagrangian, sh), k, sh);
}

/// Kept tokens among v[0, m) (block-wide).
__device__ inline Index rd_kept(std::int8_t const* v, Index m, RDShared& sh) {
  long long part = 0;
  for (Index i = threadIdx.x; i < m; i += blockDim.x)
    part += v[i] > 0 ? 1 : 0;
  return static_cast<Index>(rd_block_sum(part, sh.sums));
}

/// Padding -> 0, residual tail [m, n) -> 16.
__device__ inline void rd_fill_tail(std::int8_t* v, Index m, Index n, Index tokens) {
  rd_fill(v, n, tokens, 0);
  rd_fill(v, m, n, 16);
}

/// scope = head: grid (heads, batch), one block per (sequence, KV head). scope = layer: grid (1, batch), one block
/// per sequence: the heads' knapsack tokens gathered into `gw` / `gb` ([batch, heads * tokens] workspace), one V
/// knapsack, scattered back, then each head's K knapsack in turn.
template <class Weights>
__global__ void __launch_bounds__(rdkv_threads)
    rdkv_allocate_kernel(RDKVAllocator a, detail::RDHull hv, detail::RDHull hk, Weights w, float const* cw,
                         BitPlan<DeviceSpace> plan, float* gw, std::int8_t* gb) {
  __shared__ RDShared sh;
  Index const b = blockIdx.y, dim = plan.dim;
  auto units = [&](Index n) { return n - (a.residual < n ? a.residual : n); };
  if (a.scope == RDKVBudgetScope::head) {
    Index const h = blockIdx.x, n = clamp_length(w.length(b, h), w.tokens), m = units(n);
    Index const budget = rd_budget_tokens(a, n);
    std::int8_t* v = plan.v_row(b, h);
    rd_fill_tail(v, m, n, w.tokens);
    rd_allocate_v(a, hv, w.row(b, h), v, m, dim, rd_v_budget(a, budget), rd_total_bits(budget, dim), sh);
    __syncthreads();
    Index const t_eff = rd_kept(v, m, sh);
    rd_allocate_k(a, hk, cw + (b * w.heads + h) * dim, plan.k_row(b, h), dim, budget, t_eff, sh);
    return;
  }
  float* sw = gw + b * w.heads * w.tokens;
  std::int8_t* sb = gb + b * w.heads * w.tokens;
  Index total_units = 0;
  long long exact_budget = 0;
  double total_bits = 0.0;
  for (Index h = 0; h < w.heads; ++h) {  // the CPU's order: the sums below are the same in every thread
    Index const n = clamp_length(w.length(b, h), w.tokens), m = units(n), budget = rd_budget_tokens(a, n);
    float const* src = w.row(b, h);
    for (Index t = threadIdx.x; t < m; t += blockDim.x)
      sw[total_units + t] = src[t];
    total_units += m;
    exact_budget += rd_v_budget(a, budget);
    total_bits = __dadd_rn(total_bits, rd_total_bits(budget, dim));
  }
  __syncthreads();
  rd_allocate_v(a, hv, sw, sb, total_units, dim, exact_budget, total_bits, sh);
  __syncthreads();
  Index offset = 0;
  for (Index h = 0; h < w.heads; ++h) {
    Index const n = clamp_length(w.length(b, h), w.tokens), m = units(n), budget = rd_budget_tokens(a, n);
    std::int8_t* v = plan.v_row(b, h);
    for (Index t = threadIdx.x; t < m; t += blockDim.x)
      v[t] = sb[offset + t];
    offset += m;
    rd_fill_tail(v, m, n, w.tokens);
    __syncthreads();
    Index const t_eff = rd_kept(v, m, sh);
    rd_allocate_k(a, hk, cw + (b * w.heads + h) * dim, plan.k_row(b, h), dim, budget, t_eff, sh);
    __syncthreads();
  }
}

}  // namespace kvc::backend::cuda

namespace kvc {

/// RDKV allocation on CUDA: the CPU kernel's plan, bit for bit (see the file comment). Workspace (device): none for
/// scope = head; for scope = layer, the gathered weights and bits of every sequence ([batch, heads * tokens] fp32 and
/// int8). Differences from the CPU, all about errors a device cannot report without synchronising:
///  - weights are not validated (the CPU reports NaN/Inf as non_finite and negative weights as invalid_argument);
///    such weights give unspecified (but in-range) bits;
///  - options.evict = false with a budget below 2 bits per unit: reported as on the CPU when the lengths are host
///    computable (no length table: every head holds `tokens`); otherwise (a device length table) the offending
///    knapsack gets 2 bits per unit, where the CPU reports invalid_argument;
///  - valid lengths outside [0, tokens] are clamped, as in every CUDA kernel.
/// Limits: batch and heads <= 65535.
template <>
struct Kernel<RDKVAllocator, Cuda> {
  static std::size_t workspace_bytes(Cuda const&, RDKVAllocator const& a, Index batch, Index heads, Index tokens,
                                     Index) {
    if (a.scope != RDKVBudgetScope::layer)
      return 0;
    return bytes_sum(workspace_round(bytes_product(batch, heads, tokens, sizeof(float))),
                     workspace_round(bytes_product(batch, heads, tokens, sizeof(std::int8_t))));
  }

  static Status run(Cuda const& cuda, RDKVAllocator const& a, ScoreSpan<DeviceSpace> w, float const* cw,
                    BitPlan<DeviceSpace> plan, Workspace ws) {
    namespace bc = backend::cuda;
    if (w.batch * w.heads == 0)
      return {};
    KVC_RETURN_IF_ERROR(
        bc::head_grid_status(w.batch, w.heads, "kvc::allocate_bits(Cuda): batch and heads must be <= 65535"));
    bool const layer = a.scope == RDKVBudgetScope::layer;
    float* gw = nullptr;
    std::int8_t* gb = nullptr;
    if (layer) {
      WorkspaceCarver carve(ws);
      gw = carve.take<float>(w.batch * w.heads * w.tokens);
      gb = carve.take<std::int8_t>(w.batch * w.heads * w.tokens);
      if ((gw == nullptr || gb == nullptr) && w.tokens > 0)
        return {Errc::out_of_capacity,
                "kvc::allocate_bits(Cuda): workspace smaller than allocate_bits_workspace_bytes()"};
    }
    if (a.solver == BitSolver::exact && !a.options.evict && w.lengths.data == nullptr)
      KVC_RETURN_IF_ERROR(check_floor(a, w, plan.dim));
    KVC_RETURN_IF_ERROR(bc::pending_status());
    // The hulls, by the CPU's own function (constexpr host code: nvcc does not run it on the device).
    detail::RDHull const hv = detail::rd_hull(a.eps_v, a.options), hk = detail::rd_hull(a.eps_k, a.options);
    dim3 const grid(layer ? 1u : static_cast<unsigned>(w.heads), static_cast<unsigned>(w.batch));
    KVC_RETURN_IF_ERROR(bc::launch(KVC_CUDA_KERNEL("kvc::allocate_bits(rdkv, Cuda)", bc::rdkv_allocate_kernel), grid,
                                   bc::rdkv_threads, 0, cuda.stream, a, hv, hk, w, cw, plan, gw, gb));
    return {};
  }

 private:
  /// The CPU's floor check (options.evict = false, exact mode) when every head holds `tokens`: T_eff = m then.
  static Status check_floor(RDKVAllocator const& a, ScoreSpan<DeviceSpace> const& w, Index dim) {
    Index const n = w.tokens, m = n - (a.residual < n ? a.residual : n), budget = detail::rdkv_budget_tokens(a, n);
    std::int64_t const v_budget = detail::rdkv_v_budget(a, budget);
    if (m > 0 && a.scope == RDKVBudgetScope::head && v_budget < 2 * m)
      return {Errc::invalid_argument,
              "kvc::allocate_bits: with options.evict false the V budget must be >= 2 "
              "bits per token (raise budget_tokens)"};
    if (m > 0 && detail::rdkv_k_budget(a, budget, dim, m) < 2 * dim)
      return {Errc::invalid_argument,
              "kvc::allocate_bits: with options.evict false the K budget must be >= 2 "
              "bits per channel (raise budget_tokens or k_budget_ratio)"};
    if (m > 0 && v_budget < 2 * m)  // scope = layer: the heads' sums, all equal here
      return {Errc::invalid_argument,
              "kvc::allocate_bits: with options.evict false the V budget must be >= 2 "
              "bits per token (raise budget_tokens)"};
    return {};
  }
};

}  // namespace kvc
