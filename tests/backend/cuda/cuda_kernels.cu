// SPDX-License-Identifier: Apache-2.0
// tests/backend/cuda/cuda_kernels.cu: device-side halves of the parity tests (see cuda_kernels.hpp).
#include <kvc/backend/cuda/pipeline/compact.cuh>
#include <kvc/backend/cuda/scorers/key_diff.cuh>
#include <kvc/backend/cuda/scorers/knorm.cuh>
#include <kvc/backend/cuda/selectors/top_k.cuh>

#include "cuda_kernels.hpp"

#include <cstddef>

namespace kvc::test::cuda {

namespace {

/// A device copy of a host vector, freed on scope exit.
template <class T>
struct DeviceBuffer {
  T* ptr = nullptr;
  std::size_t n = 0;
  explicit DeviceBuffer(std::size_t count) : n(count) {
    if (cudaMalloc(&ptr, (count > 0 ? count : 1) * sizeof(T)) != cudaSuccess)
      ptr = nullptr;
  }
  explicit DeviceBuffer(std::vector<T> const& host) : DeviceBuffer(host.size()) {
    if (ptr && n)
      cudaMemcpy(ptr, host.data(), n * sizeof(T), cudaMemcpyHostToDevice);
  }
  ~DeviceBuffer() { cudaFree(ptr); }
  DeviceBuffer(DeviceBuffer const&) = delete;
  DeviceBuffer& operator=(DeviceBuffer const&) = delete;
  void to_host(std::vector<T>& host) const {
    host.resize(n);
    if (n)
      cudaMemcpy(host.data(), ptr, n * sizeof(T), cudaMemcpyDeviceToHost);
  }
};

std::string finish(Status st) {
  if (!st.ok())
    return st.message();
  cudaError_t const e = cudaDeviceSynchronize();
  return e == cudaSuccess ? std::string() : std::string(cudaGetErrorString(e));
}

template <class S, class T>
std::string scores_on_device(S scorer, KVExtents e, std::vector<T> const& keys, std::vector<Index> const& lengths,
                             std::vector<float>& scores) {
  DeviceBuffer<T> k(keys);
  DeviceBuffer<Index> len(lengths);
  DeviceBuffer<float> out(static_cast<std::size_t>(e.rows()));
  std::size_t const bytes = score_workspace_bytes(Cuda{}, scorer, e);
  DeviceBuffer<unsigned char> ws(bytes);
  auto const rows = bhtd_device_rows(static_cast<T const*>(k.ptr), e);
  auto const cache = make_cache(rows, rows, lengths.empty() ? nullptr : len.ptr);
  std::string const err = finish(score(
      Cuda{}, scorer, cache, ScoreSpan<DeviceSpace>{out.ptr, e.batch, e.heads, e.tokens}, Workspace{ws.ptr, bytes}));
  out.to_host(scores);
  return err;
}

}  // namespace

bool device_available() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

template <class T>
std::string key_diff_scores(KVExtents e, std::vector<T> const& keys, std::vector<Index> const& lengths,
                            std::vector<float>& scores) {
  return scores_on_device(KeyDiffScorer{}, e, keys, lengths, scores);
}

template <class T>
std::string knorm_scores(KVExtents e, std::vector<T> const& keys, std::vector<Index> const& lengths,
                         std::vector<float>& scores) {
  return scores_on_device(KnormScorer{}, e, keys, lengths, scores);
}

template std::string key_diff_scores<float>(KVExtents, std::vector<float> const&, std::vector<Index> const&,
                                            std::vector<float>&);
template std::string key_diff_scores<half>(KVExtents, std::vector<half> const&, std::vector<Index> const&,
                                           std::vector<float>&);
template std::string knorm_scores<float>(KVExtents, std::vector<float> const&, std::vector<Index> const&,
                                         std::vector<float>&);
template std::string knorm_scores<half>(KVExtents, std::vector<half> const&, std::vector<Index> const&,
                                        std::vector<float>&);

std::string top_k(TopKSelector<FixedBudget> sel, Index batch, Index heads, Index tokens,
                  std::vector<float> const& scores, std::vector<Index> const& lengths, Index capacity,
                  std::vector<Index>& index, std::vector<Index>& count) {
  DeviceBuffer<float> s(scores);
  DeviceBuffer<Index> len(lengths), idx(static_cast<std::size_t>(batch * heads * capacity)),
      cnt(static_cast<std::size_t>(batch * heads));
  ScoreSpan<DeviceSpace> const span{s.ptr, batch, heads, tokens, lengths.empty() ? nullptr : len.ptr};
  std::string const err =
      finish(select(Cuda{}, sel, span, KeepPlan<DeviceSpace>{idx.ptr, cnt.ptr, batch, heads, capacity}));
  idx.to_host(index);
  cnt.to_host(count);
  return err;
}

std::string compact(KVExtents e, std::vector<float>& keys, std::vector<float>& values, std::vector<Index> const& index,
                    std::vector<Index> const& count, Index capacity) {
  DeviceBuffer<float> k(keys), v(values);
  DeviceBuffer<Index> idx(index), cnt(count);
  auto const cache = make_cache(bhtd_device_rows(k.ptr, e), bhtd_device_rows(v.ptr, e));
  std::string const err =
      finish(kvc::compact(Cuda{}, KeepPlan<DeviceSpace>{idx.ptr, cnt.ptr, e.batch, e.heads, capacity}, cache));
  k.to_host(keys);
  v.to_host(values);
  return err;
}

}  // namespace kvc::test::cuda
