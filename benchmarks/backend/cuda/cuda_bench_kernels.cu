// SPDX-License-Identifier: Apache-2.0
// benchmarks/backend/cuda/cuda_bench_kernels.cu: device side of the CUDA benchmarks (see cuda_bench.hpp).
#include <kvc/backend/cuda/attention/attend.cuh>
#include <kvc/backend/cuda/attention/corrected.cuh>
#include <kvc/backend/cuda/attention/packed.cuh>
#include <kvc/backend/cuda/pipeline/compact.cuh>
#include <kvc/backend/cuda/pipeline/query_statistics.cuh>
#include <kvc/backend/cuda/scorers/expected_attention.cuh>
#include <kvc/backend/cuda/scorers/h2o.cuh>
#include <kvc/backend/cuda/scorers/key_diff.cuh>
#include <kvc/backend/cuda/scorers/knorm.cuh>
#include <kvc/backend/cuda/scorers/moment_kv.cuh>
#include <kvc/backend/cuda/scorers/snap_kv.cuh>
#include <kvc/backend/cuda/scorers/tova.cuh>
#include <kvc/backend/cuda/scorers/uncomp.cuh>
#include <kvc/backend/cuda/selectors/ada_kv.cuh>
#include <kvc/backend/cuda/selectors/top_k.cuh>
#include <kvc/backend/cuda/store/packed.cuh>
#include <kvc/pipeline/pack.hpp>
#include <kvc/store/ragged.hpp>

#include "backend/cuda/cuda_bench.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <vector>

namespace kvc::bench::cuda {

struct Context {
  KVExtents e;
  Elem elem = Elem::f32;
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
  // ExpectedAttention: statistics of 32 query heads and a RoPE table for positions [0, tokens + 512).
  float* mean = nullptr;
  float* cov = nullptr;
  float* rope = nullptr;
  Index rope_positions = 0;
  // H2O: the accumulator [1, 8, tokens] and tracked [1, 8].
  float* acc = nullptr;
  Index* tracked = nullptr;
  // ObservedAttention: one tile of 256 window queries [1, 32, 256, dim], post-RoPE.
  void* tile_queries = nullptr;
  // Query statistics: rows [1, 32, tokens, dim] and their outputs.
  void* rows = nullptr;
  float* rows_mean = nullptr;
  float* rows_cov = nullptr;
  // AdaKV: the per-head table [1, 8]. Ragged attention: offsets [9], lengths [8], the store's shape, one decode
  // query row per query head [1, 32, 1, dim] and its outputs.
  Index* table = nullptr;
  Index* offsets = nullptr;
  Index* ragged_lengths = nullptr;
  RaggedShape shape;
  void* decode_queries = nullptr;
  float* attn_out = nullptr;
  float* attn_lse = nullptr;
  // MomentKV: fp32 moments of the 8 KV heads (count 1000, filled means and co-moments) and a fixed base [1, 8, N].
  Index* moment_count = nullptr;
  float* moment_means = nullptr;  // k̄ [8, d] then v̄ [8, d]
  float* comoment = nullptr;      // [8, d, d]
  float* fixed_base = nullptr;
  // UNComp: window rows [1, 8, tokens, uncomp_window] (every slot tracked) and tracked [1, 8]; the update's queries
  // are decode_queries (one row per query head).
  float* uncomp_rows = nullptr;
  Index* uncomp_tracked = nullptr;
};

namespace {

/// SnapKV's benchmark window: 32 query heads (GQA group 4 over the 8 KV heads) x 32 queries (also H2O's update).
KVExtents window_extents(KVExtents e) {
  return {e.batch, 4 * e.heads, 32, e.dim};
}

/// ObservedAttention's query tile: 32 query heads x 256 rows.
KVExtents tile_extents(KVExtents e) {
  return {e.batch, 4 * e.heads, 256, e.dim};
}

/// The query rows of the statistics: 32 query heads x `tokens` rows (a prefill's pre-RoPE queries).
KVExtents rows_extents(KVExtents e) {
  return {e.batch, 4 * e.heads, e.tokens, e.dim};
}

constexpr Index ea_future = 512;  // ExpectedAttention's default n_future_positions

/// A NeoX RoPE table (theta 10000) for [0, positions) with `half` pairs: cos then sin, as fill_rope_table lays out.
__global__ void rope_kernel(float* table, Index positions, Index half) {
  for (Index i = static_cast<Index>(blockIdx.x) * blockDim.x + threadIdx.x; i < positions * half;
       i += static_cast<Index>(gridDim.x) * blockDim.x) {
    Index const p = i / half, k = i % half;
    double const angle = static_cast<double>(p) * pow(10000.0, -static_cast<double>(k) / static_cast<double>(half));
    table[i] = static_cast<float>(cos(angle));
    table[positions * half + i] = static_cast<float>(sin(angle));
  }
}

/// Independent fp32 FMA chains (8 per thread): the device's achievable FMA rate, the bound of d^2 work done with
/// CUDA cores in fp32 (ExpectedAttention's K Σ̄, the statistics' Gram; no tensor cores: they would not keep 1e-5).
__global__ void fma_kernel(float m, float c, int iterations, float* sink) {
  float a[8];
  for (int i = 0; i < 8; ++i)
    a[i] = static_cast<float>(threadIdx.x) * 1e-3f + static_cast<float>(i);
  for (int it = 0; it < iterations; ++it)
#pragma unroll
    for (int i = 0; i < 8; ++i)
      a[i] = fmaf(a[i], m, c);
  float s = 0.0f;
  for (int i = 0; i < 8; ++i)
    s += a[i];
  if (s == 12345.678f)  // practically never: keeps the chains alive
    *sink = s;
}

constexpr unsigned fma_blocks = 4096, fma_threads = 256;
constexpr int fma_iterations = 4096;

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

/// Fills x[0, n) on the device with fill_kernel (false if the launch failed).
template <class T>
bool fill(T* x, Index n, std::uint32_t seed) {
  return backend::cuda::launch(KVC_CUDA_KERNEL("kvc.bench.cuda", fill_kernel<T>), 1024, 256, 0, nullptr, x, n, seed)
      .ok();
}

/// A NeoX RoPE table on the device with rope_kernel (false if the launch failed).
inline bool fill_rope(float* table, Index positions, Index half) {
  return backend::cuda::launch(KVC_CUDA_KERNEL("kvc.bench.cuda", rope_kernel), 1024, 256, 0, nullptr, table, positions,
                               half)
      .ok();
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

constexpr Index uncomp_window = 8;  // UNComp's w (the paper's l)

/// UNComp's scorer over the context's state (authors' defaults: w = 8, max pooling, kernel 7).
UNCompScorer<DeviceSpace> uncomp_scorer(Context const& c) {
  return {{TokenRows<float, StridedLayout, DeviceSpace>(c.uncomp_rows, uncomp_window_layout(c.e, uncomp_window)),
           c.uncomp_tracked},
          uncomp_window,
          7,
          Pooling::max};
}

/// MomentKV's scorer over the context's moments and fixed base.
MomentKVScorer<DeviceSpace, float> moment_scorer(Context const& c) {
  MomentKVScorer<DeviceSpace, float> s;
  // Before the buffers exist (sizing the workspace) the means are null: no offset from a null pointer.
  float* const v_means = c.moment_means ? c.moment_means + c.e.heads * c.e.dim : nullptr;
  s.state = {c.moment_count, c.moment_means, v_means, c.comoment, 1, c.e.heads, c.e.dim, c.e.dim};
  s.fixed_base = {c.fixed_base, 1, c.e.heads, c.e.tokens};
  return s;
}

/// The queries' element type beside a cache of T: T, or fp16 beside an fp8 cache (queries are never fp8).
template <class T>
using query_type = std::conditional_t<is_fp8<T>, half, T>;

/// fn(T{}) with the cache element type `elem` names.
template <class Fn>
decltype(auto) with_elem(Elem elem, Fn&& fn) {
  switch (elem) {
    case Elem::f16: return fn(half{});
    case Elem::e4m3: return fn(float8_e4m3{});
    case Elem::e5m2: return fn(float8_e5m2{});
    case Elem::f32: break;
  }
  return fn(float{});
}

template <class T>
Status run(Context& c, Op op) {
  using Q = query_type<T>;
  auto const rows = bhtd_device_rows(static_cast<T*>(c.k), c.e);
  auto const cache = make_cache(rows, bhtd_device_rows(static_cast<T*>(c.v), c.e));
  ScoreSpan<DeviceSpace> const span{c.scores, c.e.batch, c.e.heads, c.e.tokens};
  KeepPlan<DeviceSpace> const plan{c.index, c.count, c.e.batch, c.e.heads, c.e.tokens};
  Workspace const ws{c.ws, c.ws_bytes};
  auto const obs = observe(WindowQueries<Q, DeviceSpace>{TokenRows<Q const, StridedLayout, DeviceSpace>(
      static_cast<Q const*>(c.queries), bhtd_layout(window_extents(c.e)))});
  Index const hq = 4 * c.e.heads, half = c.e.dim / 2;
  auto const stats = observe(QueryStatistics<DeviceSpace>{
      c.mean, c.cov, c.e.batch, hq, c.e.dim,
      RopeTable<DeviceSpace>{c.rope, c.rope + c.rope_positions * half, c.rope_positions, c.e.dim, RopeStyle::neox}});
  H2OScorer<DeviceSpace> const h2o{{{c.acc, c.e.batch, c.e.heads, c.e.tokens}, c.tracked}, 256};
  auto const tile = observe(WindowQueries<Q, DeviceSpace>{TokenRows<Q const, StridedLayout, DeviceSpace>(
      static_cast<Q const*>(c.tile_queries), bhtd_layout(tile_extents(c.e)))});
  switch (op) {
    case Op::key_diff: return score(Cuda{}, KeyDiffScorer{}, cache, span, ws);
    case Op::knorm: return score(Cuda{}, KnormScorer{}, cache, span, ws);
    case Op::snap_kv: return score(Cuda{}, SnapKVScorer{}, cache, obs, span, ws);
    case Op::tova: return score(Cuda{}, TOVAScorer{}, cache, obs, span, ws);
    case Op::top_k: return select(Cuda{}, TopKSelector{RatioBudget{0.5}}, span, plan, {});
    case Op::compact: return compact(Cuda{}, plan, cache);
    case Op::read:
      return backend::cuda::launch(KVC_CUDA_KERNEL("kvc.bench.cuda", read_kernel), 1024, 256, 0, nullptr,
                                   static_cast<float4 const*>(c.k),
                                   c.e.rows() * c.e.dim * static_cast<Index>(sizeof(T)) / 16, c.sink);
    case Op::expected_attention: return score(Cuda{}, ExpectedAttentionScorer{}, cache, stats, span, ws);
    case Op::query_statistics:
      return query_statistics(
          Cuda{},
          TokenRows<Q const, StridedLayout, DeviceSpace>(static_cast<Q const*>(c.rows), bhtd_layout(rows_extents(c.e))),
          nullptr, StatisticsRows{.n_sink = 4}, c.rows_mean, c.rows_cov, ws);
    case Op::h2o_update: return update(Cuda{}, h2o, cache, obs, ws);
    case Op::observed_attention: return score(Cuda{}, ObservedAttentionScorer{256}, cache, tile, span, ws);
    case Op::ada_kv_allocate: return allocate(Cuda{}, AdaKVSelector{FixedBudget{c.e.tokens / 2}}, span, c.table, ws);
    case Op::ada_kv_select: return select(Cuda{}, AdaKVSelector{FixedBudget{c.e.tokens / 2}}, span, plan, ws);
    case Op::ragged_attend: {
      auto const store =
          ragged_cache<DeviceSpace>(static_cast<T*>(c.k), static_cast<T*>(c.v), 1, c.e.heads, c.e.dim, c.e.dim, c.shape,
                                    c.offsets, head_lengths(c.ragged_lengths, c.e.heads));
      AttendQueries<Q, DeviceSpace> const q{TokenRows<Q const, StridedLayout, DeviceSpace>(
          static_cast<Q const*>(c.decode_queries), bhtd_layout({1, hq, 1, c.e.dim}))};
      return attend(Cuda{}, Attention{}, q, store, AttendOutput<DeviceSpace>{c.attn_out, c.attn_lse}, ws);
    }
    case Op::moment_score: return score(Cuda{}, moment_scorer(c), cache, obs, span, ws);
    case Op::moment_fold: return on_evict(Cuda{}, moment_scorer(c), cache, plan, ws);
    case Op::moment_attend: {
      AttendQueries<Q, DeviceSpace> const q{TokenRows<Q const, StridedLayout, DeviceSpace>(
          static_cast<Q const*>(c.decode_queries), bhtd_layout({1, hq, 1, c.e.dim}))};
      return attend_corrected(Cuda{}, CorrectedAttention{}, q, cache, moment_scorer(c).state,
                              AttendOutput<DeviceSpace>{c.attn_out, c.attn_lse}, ws);
    }
    case Op::uncomp_update: {
      auto const decode = observe(WindowQueries<Q, DeviceSpace>{TokenRows<Q const, StridedLayout, DeviceSpace>(
          static_cast<Q const*>(c.decode_queries), bhtd_layout({1, hq, 1, c.e.dim}))});
      return update(Cuda{}, uncomp_scorer(c), cache, decode, ws);
    }
    case Op::uncomp_score: return score(Cuda{}, uncomp_scorer(c), cache, span, ws);
    case Op::fma_peak:
      return backend::cuda::launch(KVC_CUDA_KERNEL("kvc.bench.cuda", fma_kernel), fma_blocks, fma_threads, 0, nullptr,
                                   0.999f, 1e-3f, fma_iterations, c.sink);
  }
  return {};
}

/// Allocates and fills what `op` needs besides the cache (false on failure).
template <class T>
bool prepare(Context& c, Op op) {
  using Q = query_type<T>;
  auto alloc = [](auto** p, Index n, std::size_t item) {
    return cudaMalloc(reinterpret_cast<void**>(p), static_cast<std::size_t>(n) * item) == cudaSuccess;
  };
  Index const hq = 4 * c.e.heads, d = c.e.dim;
  if (op == Op::expected_attention) {
    c.rope_positions = c.e.tokens + ea_future;
    if (!alloc(&c.mean, hq * d, sizeof(float)) || !alloc(&c.cov, hq * d * d, sizeof(float)) ||
        !alloc(&c.rope, c.rope_positions * d, sizeof(float)))
      return false;
    if (!fill(c.mean, hq * d, 4u))
      return false;
    if (!fill(c.cov, hq * d * d, 5u))
      return false;
    if (!fill_rope(c.rope, c.rope_positions, d / 2))
      return false;
  }
  if (op == Op::h2o_update) {
    if (!alloc(&c.acc, c.e.rows(), sizeof(float)) || !alloc(&c.tracked, c.e.batch * c.e.heads, sizeof(Index)) ||
        cudaMemset(c.tracked, 0, static_cast<std::size_t>(c.e.batch * c.e.heads) * sizeof(Index)) != cudaSuccess)
      return false;
  }
  if (op == Op::observed_attention) {
    if (!alloc(&c.tile_queries, tile_extents(c.e).rows() * d, sizeof(Q)))
      return false;
    if (!fill(static_cast<Q*>(c.tile_queries), tile_extents(c.e).rows() * d, 6u))
      return false;
  }
  if (op == Op::query_statistics) {
    KVExtents const re = rows_extents(c.e);
    if (!alloc(&c.rows, re.rows() * d, sizeof(Q)) || !alloc(&c.rows_mean, hq * d, sizeof(float)) ||
        !alloc(&c.rows_cov, hq * d * d, sizeof(float)))
      return false;
    if (!fill(static_cast<Q*>(c.rows), re.rows() * d, 7u))
      return false;
  }
  if (op == Op::ada_kv_allocate && !alloc(&c.table, c.e.batch * c.e.heads, sizeof(Index)))
    return false;
  if (op == Op::ragged_attend) {
    std::vector<Index> counts, offsets(static_cast<std::size_t>(c.e.heads + 1));
    for (Index h = 0; h < c.e.heads; ++h)  // uneven heads averaging tokens / 2 (8 heads: sum = 4 tokens)
      counts.push_back(c.e.tokens * (h + 1) / 9);
    if (!ragged_offsets(counts.data(), c.e.heads, 0, offsets.data(), c.shape).ok() ||
        !alloc(&c.offsets, c.e.heads + 1, sizeof(Index)) || !alloc(&c.ragged_lengths, c.e.heads, sizeof(Index)) ||
        !alloc(&c.decode_queries, hq * d, sizeof(Q)) || !alloc(&c.attn_out, hq * d, sizeof(float)) ||
        !alloc(&c.attn_lse, hq, sizeof(float)) ||
        cudaMemcpy(c.offsets, offsets.data(), offsets.size() * sizeof(Index), cudaMemcpyHostToDevice) != cudaSuccess ||
        cudaMemcpy(c.ragged_lengths, counts.data(), counts.size() * sizeof(Index), cudaMemcpyHostToDevice) !=
            cudaSuccess)
      return false;
    if (!fill(static_cast<Q*>(c.decode_queries), hq * d, 8u))
      return false;
  }
  if (op == Op::moment_score || op == Op::moment_fold || op == Op::moment_attend) {
    Index const heads = c.e.heads;
    std::vector<Index> const count(static_cast<std::size_t>(heads), 1000);
    if (!alloc(&c.moment_count, heads, sizeof(Index)) || !alloc(&c.moment_means, 2 * heads * d, sizeof(float)) ||
        !alloc(&c.comoment, heads * d * d, sizeof(float)) || !alloc(&c.fixed_base, c.e.rows(), sizeof(float)) ||
        !alloc(&c.decode_queries, hq * d, sizeof(Q)) || !alloc(&c.attn_out, hq * d, sizeof(float)) ||
        !alloc(&c.attn_lse, hq, sizeof(float)) ||
        cudaMemcpy(c.moment_count, count.data(), count.size() * sizeof(Index), cudaMemcpyHostToDevice) != cudaSuccess)
      return false;
    if (!fill(c.moment_means, 2 * heads * d, 9u))
      return false;
    if (!fill(c.comoment, heads * d * d, 10u))
      return false;
    if (!fill(c.fixed_base, c.e.rows(), 11u))
      return false;
    if (!fill(static_cast<Q*>(c.decode_queries), hq * d, 12u))
      return false;
  }
  if (op == Op::uncomp_update || op == Op::uncomp_score) {
    std::vector<Index> const tracked(static_cast<std::size_t>(c.e.heads), c.e.tokens);  // every slot holds rows
    if (!alloc(&c.uncomp_rows, c.e.rows() * uncomp_window, sizeof(float)) ||
        !alloc(&c.uncomp_tracked, c.e.heads, sizeof(Index)) || !alloc(&c.decode_queries, hq * d, sizeof(Q)) ||
        cudaMemcpy(c.uncomp_tracked, tracked.data(), tracked.size() * sizeof(Index), cudaMemcpyHostToDevice) !=
            cudaSuccess)
      return false;
    if (!fill(c.uncomp_rows, c.e.rows() * uncomp_window, 13u))
      return false;
    if (!fill(static_cast<Q*>(c.decode_queries), hq * d, 14u))
      return false;
  }
  return cudaDeviceSynchronize() == cudaSuccess;
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
  cudaFree(c->mean);
  cudaFree(c->cov);
  cudaFree(c->rope);
  cudaFree(c->acc);
  cudaFree(c->tracked);
  cudaFree(c->tile_queries);
  cudaFree(c->rows);
  cudaFree(c->rows_mean);
  cudaFree(c->rows_cov);
  cudaFree(c->table);
  cudaFree(c->offsets);
  cudaFree(c->ragged_lengths);
  cudaFree(c->decode_queries);
  cudaFree(c->attn_out);
  cudaFree(c->attn_lse);
  cudaFree(c->moment_count);
  cudaFree(c->moment_means);
  cudaFree(c->comoment);
  cudaFree(c->fixed_base);
  cudaFree(c->uncomp_rows);
  cudaFree(c->uncomp_tracked);
  cudaEventDestroy(c->start);
  cudaEventDestroy(c->stop);
  delete c;
}

ContextPtr make_context(Index tokens, Index dim, Elem elem, Op op) {
  ContextPtr c(new Context);
  c->e = {1, 8, tokens, dim};
  c->elem = elem;
  auto const elems = c->e.rows() * dim;
  auto const item = with_elem(elem, [](auto t) { return sizeof(t); });
  auto const query_item = with_elem(elem, [](auto t) { return sizeof(query_type<decltype(t)>); });
  KVExtents const qe = window_extents(c->e);
  auto const obs = observe(
      WindowQueries<float, DeviceSpace>{TokenRows<float const, StridedLayout, DeviceSpace>(nullptr, bhtd_layout(qe))});
  auto const tile = observe(WindowQueries<float, DeviceSpace>{
      TokenRows<float const, StridedLayout, DeviceSpace>(nullptr, bhtd_layout(tile_extents(c->e)))});
  auto const stats = observe(QueryStatistics<DeviceSpace>{nullptr, nullptr, 1, 4 * c->e.heads, dim});
  H2OScorer<DeviceSpace> const h2o{{}, 256};
  c->ws_bytes = std::max(
      {score_workspace_bytes(Cuda{}, KeyDiffScorer{}, c->e), score_workspace_bytes(Cuda{}, SnapKVScorer{}, c->e, obs),
       score_workspace_bytes(Cuda{}, ExpectedAttentionScorer{}, c->e, stats),
       update_workspace_bytes(Cuda{}, h2o, c->e, obs),
       score_workspace_bytes(Cuda{}, ObservedAttentionScorer{256}, c->e, tile),
       op == Op::query_statistics ? query_statistics_workspace_bytes(Cuda{}, rows_extents(c->e)) : std::size_t{0},
       select_workspace_bytes(Cuda{}, AdaKVSelector{FixedBudget{tokens / 2}}, 1, c->e.heads, tokens),
       score_workspace_bytes(Cuda{}, moment_scorer(*c), c->e, obs),
       on_evict_workspace_bytes(Cuda{}, moment_scorer(*c), c->e),
       score_workspace_bytes(Cuda{}, uncomp_scorer(*c), c->e),
       update_workspace_bytes(
           Cuda{}, uncomp_scorer(*c), c->e,
           observe(WindowQueries<float, DeviceSpace>{
               TokenRows<float const, StridedLayout, DeviceSpace>(nullptr, bhtd_layout({1, 4 * c->e.heads, 1, dim}))})),
       attend_corrected_workspace_bytes(
           Cuda{}, CorrectedAttention{},
           AttendQueries<float, DeviceSpace>{
               TokenRows<float const, StridedLayout, DeviceSpace>(nullptr, bhtd_layout({1, 4 * c->e.heads, 1, dim}))},
           make_cache(bhtd_device_rows(static_cast<float*>(nullptr), c->e),
                      bhtd_device_rows(static_cast<float*>(nullptr), c->e)),
           moment_scorer(*c).state)});
  bool ok = cudaMalloc(&c->k, static_cast<std::size_t>(elems) * item) == cudaSuccess &&
            cudaMalloc(&c->v, static_cast<std::size_t>(elems) * item) == cudaSuccess &&
            cudaMalloc(&c->scores, static_cast<std::size_t>(c->e.rows()) * sizeof(float)) == cudaSuccess &&
            cudaMalloc(&c->queries, static_cast<std::size_t>(qe.rows() * dim) * query_item) == cudaSuccess &&
            cudaMalloc(&c->index, static_cast<std::size_t>(c->e.rows()) * sizeof(Index)) == cudaSuccess &&
            cudaMalloc(&c->count, static_cast<std::size_t>(c->e.batch * c->e.heads) * sizeof(Index)) == cudaSuccess &&
            cudaMalloc(&c->ws, c->ws_bytes) == cudaSuccess && cudaMalloc(&c->sink, sizeof(float)) == cudaSuccess &&
            cudaEventCreate(&c->start) == cudaSuccess && cudaEventCreate(&c->stop) == cudaSuccess;
  if (!ok)
    return nullptr;
  bool const ready = with_elem(elem, [&](auto t) {
    using T = decltype(t);
    using Q = query_type<T>;
    // A plan for compaction and scores for top-k: score once with KeyDiff, select half.
    return fill(static_cast<T*>(c->k), elems, 1u) && fill(static_cast<T*>(c->v), elems, 2u) &&
           fill(static_cast<Q*>(c->queries), qe.rows() * dim, 3u) && run<T>(*c, Op::key_diff).ok() &&
           run<T>(*c, Op::top_k).ok() && cudaDeviceSynchronize() == cudaSuccess && prepare<T>(*c, op);
  });
  if (!ready)
    return nullptr;
  return c;
}

double time_op(Context& c, Op op) {
  cudaEventRecord(c.start);
  Status const st = with_elem(c.elem, [&](auto t) { return run<decltype(t)>(c, op); });
  cudaEventRecord(c.stop);
  if (!st.ok() || cudaEventSynchronize(c.stop) != cudaSuccess)
    return -1.0;
  float ms = 0.0f;
  cudaEventElapsedTime(&ms, c.start, c.stop);
  return static_cast<double>(ms) * 1e-3;
}

double bytes_of(Context const& c, Op op) {
  double const item = static_cast<double>(with_elem(c.elem, [](auto t) { return sizeof(t); }));
  double const kbytes = static_cast<double>(c.e.rows() * c.e.dim) * item;
  switch (op) {
    case Op::key_diff:
    case Op::knorm:
    case Op::read: return kbytes;
    case Op::snap_kv:
    case Op::tova: return kbytes;  // keys are read at least once (twice in practice: LSE pass and column pass)
    case Op::top_k: return static_cast<double>(c.e.rows()) * sizeof(float);
    case Op::compact: return 2.0 * kbytes;             // K and V, half kept: read half + write half of each
    case Op::expected_attention: return 2.0 * kbytes;  // K for the logits, V for the norms
    case Op::query_statistics: return 4.0 * kbytes;    // the rows: 32 query heads of `tokens` rows
    case Op::h2o_update:
    case Op::observed_attention: return kbytes;  // keys at least once (twice in practice: LSE and column passes)
    case Op::fma_peak: return 0.0;
    case Op::ada_kv_allocate:
    case Op::ada_kv_select: return static_cast<double>(c.e.rows()) * sizeof(float);  // the scores, once at least
    case Op::ragged_attend: return kbytes;        // half of K and half of V: the kept rows, once
    case Op::moment_score: return 2.0 * kbytes;   // K and V of every slot
    case Op::moment_fold: return kbytes;          // K and V of the evicted half (read twice in practice)
    case Op::moment_attend: return 2.0 * kbytes;  // K and V of every slot (the moments are 0.5 MiB)
    case Op::uncomp_update:  // K once (twice in practice: LSE and column passes), the w rows read and written
      return kbytes + 2.0 * static_cast<double>(c.e.rows() * uncomp_window) * sizeof(float);
    case Op::uncomp_score:  // the w rows read, the scores written (the sums' round trip is on top)
      return static_cast<double>(c.e.rows() * (uncomp_window + 1)) * sizeof(float);
  }
  return 0.0;
}

double flops_of(Context const& c, Op op) {
  double const n = static_cast<double>(c.e.rows()), d = static_cast<double>(c.e.dim), g = 4.0;
  switch (op) {
    case Op::expected_attention: return 2.0 * n * g * (d * d + 2.0 * d);  // K Σ̄ per query head, then two row dots
    case Op::query_statistics: return 2.0 * n * g * d * d;  // the full Gram (the kernel computes its upper tiles)
    case Op::h2o_update: return 4.0 * n * g * static_cast<double>(window_extents(c.e).tokens) * d;  // 2 logit passes
    case Op::observed_attention: return 4.0 * n * g * static_cast<double>(tile_extents(c.e).tokens) * d;
    case Op::moment_score: return 2.0 * n * d * d;         // C̃ k_j per slot
    case Op::uncomp_update: return 4.0 * n * g * d;        // one row per query head, 2 logit passes
    case Op::moment_fold: return 2.0 * (n / 2.0) * d * d;  // the centred co-moment of the evicted half
    case Op::fma_peak: return 2.0 * 8.0 * fma_iterations * static_cast<double>(fma_blocks) * fma_threads;
    default: return 0.0;
  }
}

// --- Packed attention (RDKV, issue 13; declared in cuda_bench.cpp, beside its only caller) -----------------------

struct PackedBench;
struct PackedBenchDeleter {
  void operator()(PackedBench*) const;
};
using PackedBenchPtr = std::unique_ptr<PackedBench, PackedBenchDeleter>;

/// A decode step's attention, 32 query heads x 1 row (GQA 4) over [1, 8, tokens, 128]: over a packed layer with
/// every token and channel at `bits` (2, 4 or 8; whole-axis groups, float-min zero point), or (bits = 16) with
/// kvc::attend over the same tokens as an fp16 cache. K and V hold the same random values in both.
struct PackedBench {
  Index tokens = 0;
  int bits = 16;
  double bytes = 0.0;  ///< what one call must read: the packed arena, or the fp16 K and V
  void* arena = nullptr;
  PackedHead* heads = nullptr;
  PackedKVView<DeviceSpace> view{};
  half* k = nullptr;
  half* v = nullptr;
  half* q = nullptr;
  float* out = nullptr;
  float* lse = nullptr;
  cudaEvent_t start{}, stop{};
};

void PackedBenchDeleter::operator()(PackedBench* p) const {
  cudaFree(p->arena);
  cudaFree(p->heads);
  cudaFree(p->k);
  cudaFree(p->v);
  cudaFree(p->q);
  cudaFree(p->out);
  cudaFree(p->lse);
  cudaEventDestroy(p->start);
  cudaEventDestroy(p->stop);
  delete p;
}

namespace {
constexpr Index packed_kv_heads = 8, packed_query_heads = 32, packed_dim = 128;
}  // namespace

PackedBenchPtr make_packed_bench(Index tokens, int bits) {
  PackedBenchPtr p(new PackedBench);
  p->tokens = tokens;
  p->bits = bits;
  KVExtents const e{1, packed_kv_heads, tokens, packed_dim};
  auto const elems = static_cast<std::size_t>(e.rows() * packed_dim);
  bool ok =
      cudaEventCreate(&p->start) == cudaSuccess && cudaEventCreate(&p->stop) == cudaSuccess &&
      cudaMalloc(&p->q, static_cast<std::size_t>(packed_query_heads * packed_dim) * sizeof(half)) == cudaSuccess &&
      cudaMalloc(&p->out, static_cast<std::size_t>(packed_query_heads * packed_dim) * sizeof(float)) == cudaSuccess &&
      cudaMalloc(&p->lse, static_cast<std::size_t>(packed_query_heads) * sizeof(float)) == cudaSuccess;
  if (!ok)
    return nullptr;
  if (!fill(p->q, packed_query_heads * packed_dim, 21u))
    return nullptr;
  if (bits == 16) {
    ok = cudaMalloc(&p->k, elems * sizeof(half)) == cudaSuccess &&
         cudaMalloc(&p->v, elems * sizeof(half)) == cudaSuccess;
    if (!ok)
      return nullptr;
    if (!fill(p->k, e.rows() * packed_dim, 22u))
      return nullptr;
    if (!fill(p->v, e.rows() * packed_dim, 23u))
      return nullptr;
    p->bytes = 2.0 * static_cast<double>(elems) * sizeof(half);
    return cudaDeviceSynchronize() == cudaSuccess ? std::move(p) : nullptr;
  }
  // The packed layer is built on the host (kvc::pack) from values drawn there, then copied.
  std::vector<half> k(elems), v(elems);
  std::uint32_t state = 12345u;
  auto next = [&] {  // a small LCG: uniform in [-1, 1)
    state = state * 1664525u + 1013904223u;
    return static_cast<float>(state >> 8) * (2.0f / 16777216.0f) - 1.0f;
  };
  for (std::size_t i = 0; i < elems; ++i) {
    k[i] = half(next());
    v[i] = half(next());
  }
  std::vector<std::int8_t> v_bits(static_cast<std::size_t>(e.rows()), static_cast<std::int8_t>(bits)),
      k_bits(static_cast<std::size_t>(packed_kv_heads * packed_dim), static_cast<std::int8_t>(bits));
  auto const cache = make_cache(bhtd_rows(k.data(), e), bhtd_rows(v.data(), e));
  PackedKV kv;
  if (!pack(cache, BitPlan<HostSpace>{v_bits.data(), k_bits.data(), 1, packed_kv_heads, tokens, packed_dim},
            PackOptions{}, kv)
           .ok())
    return nullptr;
  ok = cudaMalloc(&p->arena, kv.arena_bytes()) == cudaSuccess &&
       cudaMalloc(reinterpret_cast<void**>(&p->heads), kv.descriptor_bytes()) == cudaSuccess &&
       to_device(Cuda{}, kv, p->arena, kv.arena_bytes(), p->heads, packed_kv_heads, p->view).ok();
  p->bytes = static_cast<double>(kv.arena_bytes());
  return ok && cudaDeviceSynchronize() == cudaSuccess ? std::move(p) : nullptr;
}

double time_packed(PackedBench& p) {
  AttendQueries<half, DeviceSpace> const q{
      TokenRows<half const, StridedLayout, DeviceSpace>(p.q, bhtd_layout({1, packed_query_heads, 1, packed_dim}))};
  cudaEventRecord(p.start);
  Status st;
  if (p.bits == 16) {
    KVExtents const e{1, packed_kv_heads, p.tokens, packed_dim};
    auto const cache = make_cache(bhtd_device_rows(p.k, e), bhtd_device_rows(p.v, e));
    st = attend(Cuda{}, Attention{}, q, cache, AttendOutput<DeviceSpace>{p.out, p.lse}, Workspace{});
  } else {
    st = attend_packed(Cuda{}, Attention{}, q, p.view, AttendOutput<DeviceSpace>{p.out, p.lse}, Workspace{});
  }
  cudaEventRecord(p.stop);
  if (!st.ok() || cudaEventSynchronize(p.stop) != cudaSuccess)
    return -1.0;
  float ms = 0.0f;
  cudaEventElapsedTime(&ms, p.start, p.stop);
  return static_cast<double>(ms) * 1e-3;
}

double packed_bench_bytes(PackedBench const& p) {
  return p.bytes;
}

}  // namespace kvc::bench::cuda
