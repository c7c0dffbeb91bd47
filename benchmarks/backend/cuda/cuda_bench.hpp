// SPDX-License-Identifier: Apache-2.0
// benchmarks/backend/cuda/cuda_bench.hpp: host interface to the CUDA benchmark kernels (timed with cudaEvent).
#pragma once

#include <kvc/core/extents.hpp>

#include <memory>

namespace kvc::bench::cuda {

bool device_available();

/// Device buffers for one [1, 8, tokens, dim] cache (K and V), its scores, a plan and workspaces, plus what the
/// op needs besides (statistics and a RoPE table for ExpectedAttention, H2O's state, window queries, query rows).
struct Context;
struct ContextDeleter {
  void operator()(Context*) const;
};
using ContextPtr = std::unique_ptr<Context, ContextDeleter>;

enum class Op {
  key_diff,
  knorm,
  snap_kv,
  tova,
  top_k,
  compact,
  read,
  expected_attention,  ///< 32 query heads (GQA 4), statistics given, t0 = the context's end, T = 512
  query_statistics,    ///< mean and covariance of [1, 32, tokens, dim] query rows
  h2o_update,          ///< H2O's kvc::update with 32 new window queries per query head (a decode chunk)
  observed_attention,  ///< ObservedAttention over one 256-row query tile (the unit a prefill repeats N / 256 times)
  fma_peak,            ///< fp32 FMA throughput: the bound of the d^2 work
  ada_kv_allocate,     ///< kvc::allocate (AdaKV, authors) over the scores [1, 8, tokens], half kept on average
  ada_kv_select,       ///< kvc::select with AdaKVSelector (allocate + per-head top-k), half kept on average
  ragged_attend,       ///< decode attention (32 query heads x 1 row) over a ragged store of uneven heads averaging
                       ///< tokens / 2 (head h holds tokens (h + 1) / 9): bytes = the kept K + V
  moment_score,        ///< MomentKV's MI score over a fixed base (the residual pass: C̃ k_j per slot), fp32 moments
  moment_fold,         ///< MomentKV's on_evict of half the slots (block moments + Chan's merge), fp32 moments
  moment_attend,       ///< kvc::attend_corrected for 32 query heads x 1 row (attention + the moment epilogue)
  uncomp_update,       ///< UNComp's kvc::update with one new query row per query head (a decode step; w = 8):
                       ///< the window attention (per window row) + the shift of every slot's w rows
  uncomp_score,        ///< UNComp's kvc::score (w = 8, max pooling, kernel 7) over tracked window rows [1, 8, N, 8]
};

/// The cache's element type. fp8 caches (a tensor scale of 1, docs/fp8.md) take fp16 queries.
enum class Elem { f32, f16, e4m3, e5m2 };

ContextPtr make_context(Index tokens, Index dim, Elem elem, Op op);

/// Seconds of one `op` call on the device (cudaEvent pair around the launch), or a negative value on error.
double time_op(Context& ctx, Op op);

/// Bytes `op` must at least touch per call (one read of K for scoring, K and V for ExpectedAttention, the query rows
/// for statistics; scores for top-k; moved K+V for compaction): compare the rate with BM_Cuda_MemoryRead's.
double bytes_of(Context const& ctx, Op op);

/// Floating-point operations of one call (2 per multiply-add; 0 where the op is not compute-bound): compare the
/// rate with BM_Cuda_FmaPeak's.
double flops_of(Context const& ctx, Op op);

}  // namespace kvc::bench::cuda
