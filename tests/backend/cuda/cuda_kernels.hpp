// SPDX-License-Identifier: Apache-2.0
// tests/backend/cuda/cuda_kernels.hpp: host-callable wrappers around kvc's CUDA kernels for the parity tests.
// The wrappers live in cuda_kernels.cu (nvcc, no Eigen, no Catch); the tests in parity_test.cpp (host compiler).
// Every wrapper mirrors a host description of a case onto the device, runs one entry point, copies the results
// back and returns "" or an error message.
#pragma once

#include <kvc/core/extents.hpp>
#include <kvc/selectors/top_k.hpp>

#include <string>
#include <vector>

namespace kvc::test::cuda {

enum class Dtype { f32, f16, bf16 };
enum class Layout { bhtd, bthd, paged };

/// A cache (and window queries) described on the host in fp32; the device side narrows K, V and queries to `dtype`
/// with the library's round-to-nearest-even, exactly as a host HostCache<T> built from the same floats.
struct Case {
  KVExtents e;
  Index dim_v = 0;
  std::vector<float> k, v;     ///< BHTD [B, H, N, d] and [B, H, N, dim_v]
  std::vector<Index> lengths;  ///< empty, [B] or [B * H] (per_head)
  bool per_head = false;
  std::vector<Index> positions;  ///< empty or [B, H, N]
  Layout layout = Layout::bhtd;
  Dtype dtype = Dtype::f32;
  std::vector<float> queries;  ///< [B, Hq, w, d] window (or attention) queries
  KVExtents q_ext{};
  bool pre_rope = false;  ///< rotate queries with a NeoX table (theta 10000) covering 4096 positions
};

/// Whether a CUDA device is present (the tests skip with "SKIPPED: no CUDA device" otherwise).
bool device_available();

/// Scores with the named policy: key_diff, key_diff_raw (the raw-mean anchor), knorm, streaming_llm, random,
/// snap_kv, snap_kv_kvpress, tova, tova_kvpress (window policies read Case::queries with window_size = q_ext.tokens).
std::string scores(std::string const& policy, Case const& c, std::vector<float>& out);

/// Attention of Case::queries over the cache (causal by the cache's positions, queries at the context's last).
std::string attend(Case const& c, std::vector<float>& out, std::vector<float>& lse);

/// Runs the CUDA top-k (ratio budget when `ratio` >= 0, else `fixed`) on host scores [batch, heads, tokens].
std::string top_k(double ratio, Index fixed, Index n_sink, Index n_recent, Index batch, Index heads, Index tokens,
                  std::vector<float> const& scores, std::vector<Index> const& lengths, bool per_head, Index capacity,
                  std::vector<Index>& index, std::vector<Index>& count);

/// Top-k with a per-(sequence, head) budget table that lives on the device.
std::string top_k_per_head(std::vector<Index> const& budget, Index batch, Index heads, Index tokens,
                           std::vector<float> const& scores, std::vector<Index>& index, std::vector<Index>& count);

/// Compacts the cache in place with a host plan; returns K, V (as fp32), positions and lengths after compaction.
std::string compact(Case& c, std::vector<Index> const& index, std::vector<Index> const& count, Index capacity);

/// Gathers the kept rows into a new dense cache of `capacity` slots with a per-head length table and positions.
std::string gather(Case const& c, std::vector<Index> const& index, std::vector<Index> const& count, Index capacity,
                   Case& out);

/// Appends tokens [begin, begin + count) of `src` after `dst`'s lengths; dst is returned updated.
std::string append(Case& dst, Case const& src, Index begin, Index count);

/// KeyDiff's block-wise protocol on the device (kvc::blockwise_compress with FixedBudget{budget}); returns the
/// working cache's per-head lengths and positions [B, H, capacity].
std::string blockwise_key_diff(Case const& src, Index budget, Index block, std::vector<Index>& lengths,
                               std::vector<Index>& positions);

}  // namespace kvc::test::cuda
