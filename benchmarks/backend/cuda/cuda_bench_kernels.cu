// SPDX-License-Identifier: Apache-2.0
// benchmarks/backend/cuda/cuda_bench_kernels.cu: device side of the CUDA benchmarks (see cuda_bench.hpp).
#include <kvc/backend/cuda/pipeline/compact.cuh>
#include <kvc/backend/cuda/scorers/key_diff.cuh>
#include <kvc/backend/cuda/scorers/knorm.cuh>
#include <kvc/backend/cuda/scorers/snap_kv.cuh>
#include <kvc/backend/cuda/selectors/top_k.cuh>

#include "backend/cuda/cuda_bench.hpp"

#include <algorithm>
#include <cstdint>

namespace kvc::bench::cuda {

struct Context {
  KVExtents e;
  bool fp16 = false;
  void* k = nullptr;
  void* v = nullptr;
  void* queries = nullptr;  // [1, 32, 32, dim] window queries, post-RoPE
  float* scores = nullptr;
  Index* index = nullptr;
  Index* count = nullptr;
  void* ws = nullptr;
  std::size_t ws_bytes = 0;
  float* sink = nullptr;
  cudaEvent_t start{}, stop{};
};

namespace {

/// SnapKV's benchmark window: 32 query heads (GQA group 4 over the 8 KV heads) x 32 queries.
KVExtents window_extents(KVExtents e) {
  return {e.batch, 4 * e.heads, 32, e.dim};
}

/// Fills n elements with a cheap hash-based pseudo-random pattern in [-1, 1) + 0.3 (the values do not matter for
/// timing; they only must not be all equal).
template <class T>
__global__ void fill_kernel(T* x, Index n, std::uint32_t seed) {
  for (Index i = static_cast<Index>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<Index>(gridDim.x) * blockDim.x) {
    std::uint32_t h = static_cast<std::uint32_t>(i) * 2654435761u ^ seed;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    x[i] = from_float<T>(static_cast<float>(h & 0xffffu) / 32768.0f - 1.0f + 0.3f);
  }
}

/// Reads n floats (vectorised float4 loads) and reduces them: the device's achievable read bandwidth.
__global__ void read_kernel(float4 const* x, Index n4, float* sink) {
  float acc = 0.0f;
  for (Index i = static_cast<Index>(blockIdx.x) * blockDim.x + threadIdx.x; i < n4;
       i += static_cast<Index>(gridDim.x) * blockDim.x) {
    float4 const v = x[i];
    acc += v.x + v.y + v.z + v.w;
  }
  if (acc == 12345.678f)  // practically never: keeps the loads alive without a reduction
    *sink = acc;
}

template <class T>
Status run(Context& c, Op op) {
  auto const rows = bhtd_device_rows(static_cast<T*>(c.k), c.e);
  auto const cache = make_cache(rows, bhtd_device_rows(static_cast<T*>(c.v), c.e));
  ScoreSpan<DeviceSpace> const span{c.scores, c.e.batch, c.e.heads, c.e.tokens};
  KeepPlan<DeviceSpace> const plan{c.index, c.count, c.e.batch, c.e.heads, c.e.tokens};
  Workspace const ws{c.ws, c.ws_bytes};
  auto const obs = observe(WindowQueries<T, DeviceSpace>{TokenRows<T const, StridedLayout, DeviceSpace>(
      static_cast<T const*>(c.queries), bhtd_layout(window_extents(c.e)))});
  switch (op) {
    case Op::key_diff: return score(Cuda{}, KeyDiffScorer{}, cache, span, ws);
    case Op::knorm: return score(Cuda{}, KnormScorer{}, cache, span, ws);
    case Op::snap_kv: return score(Cuda{}, SnapKVScorer{}, cache, obs, span, ws);
    case Op::tova: return score(Cuda{}, TOVAScorer{}, cache, obs, span, ws);
    case Op::top_k: return select(Cuda{}, TopKSelector{RatioBudget{0.5}}, span, plan, {});
    case Op::compact: return compact(Cuda{}, plan, cache);
    case Op::read:
      read_kernel<<<1024, 256>>>(static_cast<float4 const*>(c.k),
                                 c.e.rows() * c.e.dim * static_cast<Index>(sizeof(T)) / 16, c.sink);
      return backend::cuda::launch_status("read_kernel");
  }
  return {};
}

}  // namespace

bool device_available() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

void ContextDeleter::operator()(Context* c) const {
  cudaFree(c->k);
  cudaFree(c->v);
  cudaFree(c->scores);
  cudaFree(c->queries);
  cudaFree(c->index);
  cudaFree(c->count);
  cudaFree(c->ws);
  cudaFree(c->sink);
  cudaEventDestroy(c->start);
  cudaEventDestroy(c->stop);
  delete c;
}

ContextPtr make_context(Index tokens, Index dim, bool fp16) {
  ContextPtr c(new Context);
  c->e = {1, 8, tokens, dim};
  c->fp16 = fp16;
  auto const elems = c->e.rows() * dim;
  auto const item = fp16 ? sizeof(half) : sizeof(float);
  KVExtents const qe = window_extents(c->e);
  auto const obs = observe(
      WindowQueries<float, DeviceSpace>{TokenRows<float const, StridedLayout, DeviceSpace>(nullptr, bhtd_layout(qe))});
  c->ws_bytes = std::max(score_workspace_bytes(Cuda{}, KeyDiffScorer{}, c->e),
                         score_workspace_bytes(Cuda{}, SnapKVScorer{}, c->e, obs));
  bool ok = cudaMalloc(&c->k, static_cast<std::size_t>(elems) * item) == cudaSuccess &&
            cudaMalloc(&c->v, static_cast<std::size_t>(elems) * item) == cudaSuccess &&
            cudaMalloc(&c->scores, static_cast<std::size_t>(c->e.rows()) * sizeof(float)) == cudaSuccess &&
            cudaMalloc(&c->queries, static_cast<std::size_t>(qe.rows() * dim) * item) == cudaSuccess &&
            cudaMalloc(&c->index, static_cast<std::size_t>(c->e.rows()) * sizeof(Index)) == cudaSuccess &&
            cudaMalloc(&c->count, static_cast<std::size_t>(c->e.batch * c->e.heads) * sizeof(Index)) == cudaSuccess &&
            cudaMalloc(&c->ws, c->ws_bytes) == cudaSuccess && cudaMalloc(&c->sink, sizeof(float)) == cudaSuccess &&
            cudaEventCreate(&c->start) == cudaSuccess && cudaEventCreate(&c->stop) == cudaSuccess;
  if (!ok)
    return nullptr;
  if (fp16) {
    fill_kernel<<<1024, 256>>>(static_cast<half*>(c->k), elems, 1u);
    fill_kernel<<<1024, 256>>>(static_cast<half*>(c->v), elems, 2u);
    fill_kernel<<<1024, 256>>>(static_cast<half*>(c->queries), qe.rows() * dim, 3u);
  } else {
    fill_kernel<<<1024, 256>>>(static_cast<float*>(c->k), elems, 1u);
    fill_kernel<<<1024, 256>>>(static_cast<float*>(c->v), elems, 2u);
    fill_kernel<<<1024, 256>>>(static_cast<float*>(c->queries), qe.rows() * dim, 3u);
  }
  // A plan for compaction and scores for top-k: score once with KeyDiff, select half.
  if (!(c->fp16 ? run<half>(*c, Op::key_diff) : run<float>(*c, Op::key_diff)).ok() ||
      !(c->fp16 ? run<half>(*c, Op::top_k) : run<float>(*c, Op::top_k)).ok() || cudaDeviceSynchronize() != cudaSuccess)
    return nullptr;
  return c;
}

double time_op(Context& c, Op op) {
  cudaEventRecord(c.start);
  Status const st = c.fp16 ? run<half>(c, op) : run<float>(c, op);
  cudaEventRecord(c.stop);
  if (!st.ok() || cudaEventSynchronize(c.stop) != cudaSuccess)
    return -1.0;
  float ms = 0.0f;
  cudaEventElapsedTime(&ms, c.start, c.stop);
  return static_cast<double>(ms) * 1e-3;
}

double bytes_of(Context const& c, Op op) {
  double const kbytes = static_cast<double>(c.e.rows() * c.e.dim) * (c.fp16 ? 2.0 : 4.0);
  switch (op) {
    case Op::key_diff:
    case Op::knorm:
    case Op::read: return kbytes;
    case Op::snap_kv:
    case Op::tova: return kbytes;  // keys are read at least once (twice in practice: LSE pass and column pass)
    case Op::top_k: return static_cast<double>(c.e.rows()) * sizeof(float);
    case Op::compact: return 2.0 * kbytes;  // K and V, half kept: read half + write half of each
  }
  return 0.0;
}

}  // namespace kvc::bench::cuda
