// SPDX-License-Identifier: Apache-2.0
// benchmarks/backend/cuda/cuda_bench.hpp: host interface to the CUDA benchmark kernels (timed with cudaEvent).
#pragma once

#include <kvc/core/extents.hpp>

#include <memory>

namespace kvc::bench::cuda {

bool device_available();

/// Device buffers for one [1, 8, tokens, dim] cache (K and V), its scores, a plan and workspaces.
struct Context;
struct ContextDeleter {
  void operator()(Context*) const;
};
using ContextPtr = std::unique_ptr<Context, ContextDeleter>;

ContextPtr make_context(Index tokens, Index dim, bool fp16);

enum class Op { key_diff, knorm, snap_kv, tova, top_k, compact, read };

/// Seconds of one `op` call on the device (cudaEvent pair around the launch), or a negative value on error.
double time_op(Context& ctx, Op op);

/// Bytes `op` must at least touch per call (one read of K for scoring; scores for top-k; moved K+V for compaction).
double bytes_of(Context const& ctx, Op op);

}  // namespace kvc::bench::cuda
