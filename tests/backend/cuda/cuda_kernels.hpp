// SPDX-License-Identifier: Apache-2.0
// tests/backend/cuda/cuda_kernels.hpp: host-callable wrappers around kvc's CUDA kernels for the parity tests.
// The wrappers live in cuda_kernels.cu (nvcc, no Eigen, no Catch); the tests in parity_test.cpp (host compiler).
#pragma once

#include <kvc/core/extents.hpp>
#include <kvc/selectors/top_k.hpp>

#include <string>
#include <vector>

namespace kvc::test::cuda {

/// Whether a CUDA device is present (the tests skip with "SKIPPED: no CUDA device" otherwise).
bool device_available();

/// Scores a BHTD host cache on the device; returns an error message or "" on success. T = float or kvc::half.
template <class T>
std::string key_diff_scores(KVExtents e, std::vector<T> const& keys, std::vector<Index> const& lengths,
                            std::vector<float>& scores);
template <class T>
std::string knorm_scores(KVExtents e, std::vector<T> const& keys, std::vector<Index> const& lengths,
                         std::vector<float>& scores);

/// Runs the CUDA top-k on host scores [batch, heads, tokens]; plan buffers are [batch, heads, capacity].
std::string top_k(TopKSelector<FixedBudget> sel, Index batch, Index heads, Index tokens,
                  std::vector<float> const& scores, std::vector<Index> const& lengths, Index capacity,
                  std::vector<Index>& index, std::vector<Index>& count);

/// Compacts a BHTD float cache in place on the device with a host plan; returns the compacted K and V.
std::string compact(KVExtents e, std::vector<float>& keys, std::vector<float>& values, std::vector<Index> const& index,
                    std::vector<Index> const& count, Index capacity);

}  // namespace kvc::test::cuda
