// SPDX-License-Identifier: Apache-2.0
// benchmarks/backend/cuda/cuda_bench.cpp: CUDA kernel throughput (manual time from cudaEvent pairs), with the two
// bounds in the same binary: a device-memory read case (compare each op's bytes/s with BM_Cuda_MemoryRead's) and an
// fp32 FMA case (compare the FLOP/s counter of ExpectedAttention's d^2 work, the window attention's logits, the
// statistics' Gram and MomentKV's residual and co-moment with BM_Cuda_FmaPeak's).
#include "backend/cuda/cuda_bench.hpp"

#include <benchmark/benchmark.h>

#include <cstdint>
#include <memory>
#include <vector>

namespace kb = kvc::bench::cuda;

// Packed attention (RDKV, issue 13): defined in cuda_bench_kernels.cu, declared here beside their only caller.
namespace kvc::bench::cuda {
struct PackedBench;
struct PackedBenchDeleter {
  void operator()(PackedBench*) const;
};
using PackedBenchPtr = std::unique_ptr<PackedBench, PackedBenchDeleter>;
/// A decode step (32 query heads x 1 row, GQA 4) over [1, 8, tokens, 128]: packed at `bits` (2, 4, 8) for
/// kvc::attend_packed, or bits = 16 for kvc::attend over the same tokens as an fp16 cache.
PackedBenchPtr make_packed_bench(Index tokens, int bits);
/// Seconds of one call (cudaEvent pair), negative on error.
double time_packed(PackedBench& p);
/// Bytes one call must read: the packed arena (codes, params, permutation, positions), or fp16 K and V.
double packed_bench_bytes(PackedBench const& p);
}  // namespace kvc::bench::cuda

static void run(benchmark::State& state, kb::Op op, kb::Elem elem) {
  if (!kb::device_available()) {
    state.SkipWithError("no CUDA device");
    return;
  }
  auto ctx = kb::make_context(state.range(0), state.range(1), elem, op);
  if (!ctx) {
    state.SkipWithError("CUDA allocation or setup failed");
    return;
  }
  for (auto _ : state) {
    double const s = kb::time_op(*ctx, op);
    if (s < 0) {
      state.SkipWithError("CUDA kernel failed");
      return;
    }
    state.SetIterationTime(s);
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(kb::bytes_of(*ctx, op)) * state.iterations());
  state.counters["tokens/s"] =
      benchmark::Counter(static_cast<double>(8 * state.range(0)), benchmark::Counter::kIsIterationInvariantRate);
  if (double const flops = kb::flops_of(*ctx, op); flops > 0)
    state.counters["FLOP/s"] = benchmark::Counter(flops, benchmark::Counter::kIsIterationInvariantRate);
}

/// Context lengths benchmarked. Under the CUDA emulator (kvc.bench.cuda.emulated: a smoke run of every benchmarked
/// kernel on the CPU, under its checks; its timings mean nothing) one short context: tokens:256.
#if defined(KVC_CUDA_EMULATION) && KVC_CUDA_EMULATION
static std::vector<std::int64_t> const long_contexts{256}, contexts{256};
#else
static std::vector<std::int64_t> const long_contexts{4096, 32768, 131072}, contexts{4096, 32768};
#endif

static void grid(benchmark::internal::Benchmark* b) {
  b->ArgNames({"tokens", "dim"})
      ->ArgsProduct({long_contexts, {64, 128}})
      ->UseManualTime()
      ->Unit(benchmark::kMicrosecond);
}

/// The newer policies at the shape they are specified for: Hq = 32, Hkv = 8, d = 128.
static void grid128(benchmark::internal::Benchmark* b) {
  b->ArgNames({"tokens", "dim"})->ArgsProduct({long_contexts, {128}})->UseManualTime()->Unit(benchmark::kMicrosecond);
}

/// UNComp's decode step at its specified shape (Hq = 32, Hkv = 8, d = 128, w = 8) and context lengths.
static void grid_uncomp(benchmark::internal::Benchmark* b) {
  b->ArgNames({"tokens", "dim"})->ArgsProduct({contexts, {128}})->UseManualTime()->Unit(benchmark::kMicrosecond);
}

/// Packed attention at `bits` (16: the fp16 kvc::attend baseline over the same tokens): bytes/s is the rate at
/// which the step reads what it must (compare with BM_Cuda_MemoryRead's).
static void run_packed(benchmark::State& state, int bits) {
  if (!kb::device_available()) {
    state.SkipWithError("no CUDA device");
    return;
  }
  auto p = kb::make_packed_bench(state.range(0), bits);
  if (!p) {
    state.SkipWithError("CUDA allocation or packing failed");
    return;
  }
  for (auto _ : state) {
    double const s = kb::time_packed(*p);
    if (s < 0) {
      state.SkipWithError("CUDA kernel failed");
      return;
    }
    state.SetIterationTime(s);
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(kb::packed_bench_bytes(*p)) * state.iterations());
  state.counters["tokens/s"] =
      benchmark::Counter(static_cast<double>(8 * state.range(0)), benchmark::Counter::kIsIterationInvariantRate);
}

static void grid_packed(benchmark::internal::Benchmark* b) {
  b->ArgNames({"tokens"})->ArgsProduct({contexts})->UseManualTime()->Unit(benchmark::kMicrosecond);
}

BENCHMARK_CAPTURE(run, KeyDiff_fp32, kb::Op::key_diff, kb::Elem::f32)->Apply(grid)->Name("BM_KeyDiff_Cuda/fp32");
BENCHMARK_CAPTURE(run, KeyDiff_fp16, kb::Op::key_diff, kb::Elem::f16)->Apply(grid)->Name("BM_KeyDiff_Cuda/fp16");
BENCHMARK_CAPTURE(run, Knorm_fp32, kb::Op::knorm, kb::Elem::f32)->Apply(grid)->Name("BM_Knorm_Cuda/fp32");
BENCHMARK_CAPTURE(run, Knorm_fp16, kb::Op::knorm, kb::Elem::f16)->Apply(grid)->Name("BM_Knorm_Cuda/fp16");
BENCHMARK_CAPTURE(run, SnapKV_fp16, kb::Op::snap_kv, kb::Elem::f16)->Apply(grid)->Name("BM_SnapKV_Cuda/fp16");
// fp8 caches (E4M3, E5M2): half the bytes of fp16 for the memory-bound scorers, compaction and decode attention.
BENCHMARK_CAPTURE(run, KeyDiff_e4m3, kb::Op::key_diff, kb::Elem::e4m3)->Apply(grid)->Name("BM_KeyDiff_Cuda/e4m3");
BENCHMARK_CAPTURE(run, KeyDiff_e5m2, kb::Op::key_diff, kb::Elem::e5m2)->Apply(grid)->Name("BM_KeyDiff_Cuda/e5m2");
BENCHMARK_CAPTURE(run, Knorm_e4m3, kb::Op::knorm, kb::Elem::e4m3)->Apply(grid)->Name("BM_Knorm_Cuda/e4m3");
BENCHMARK_CAPTURE(run, Knorm_e5m2, kb::Op::knorm, kb::Elem::e5m2)->Apply(grid)->Name("BM_Knorm_Cuda/e5m2");
BENCHMARK_CAPTURE(run, SnapKV_e4m3, kb::Op::snap_kv, kb::Elem::e4m3)->Apply(grid)->Name("BM_SnapKV_Cuda/e4m3");
BENCHMARK_CAPTURE(run, Compact_e4m3, kb::Op::compact, kb::Elem::e4m3)->Apply(grid)->Name("BM_Compact_Cuda/e4m3");
BENCHMARK_CAPTURE(run, RaggedAttend_e4m3, kb::Op::ragged_attend, kb::Elem::e4m3)
    ->Apply(grid128)
    ->Name("BM_RaggedAttend_Cuda/e4m3");
BENCHMARK_CAPTURE(run, RaggedAttend_e5m2, kb::Op::ragged_attend, kb::Elem::e5m2)
    ->Apply(grid128)
    ->Name("BM_RaggedAttend_Cuda/e5m2");
BENCHMARK_CAPTURE(run, TOVA_fp16, kb::Op::tova, kb::Elem::f16)->Apply(grid)->Name("BM_TOVA_Cuda/fp16");
BENCHMARK_CAPTURE(run, TopK, kb::Op::top_k, kb::Elem::f32)->Apply(grid)->Name("BM_TopK_Cuda");
BENCHMARK_CAPTURE(run, Compact_fp16, kb::Op::compact, kb::Elem::f16)->Apply(grid)->Name("BM_Compact_Cuda/fp16");
BENCHMARK_CAPTURE(run, EA_fp32, kb::Op::expected_attention, kb::Elem::f32)
    ->Apply(grid128)
    ->Name("BM_ExpectedAttention_Cuda/fp32");
BENCHMARK_CAPTURE(run, EA_fp16, kb::Op::expected_attention, kb::Elem::f16)
    ->Apply(grid128)
    ->Name("BM_ExpectedAttention_Cuda/fp16");
BENCHMARK_CAPTURE(run, Stats_fp32, kb::Op::query_statistics, kb::Elem::f32)
    ->Apply(grid128)
    ->Name("BM_QueryStatistics_Cuda/fp32");
BENCHMARK_CAPTURE(run, Stats_fp16, kb::Op::query_statistics, kb::Elem::f16)
    ->Apply(grid128)
    ->Name("BM_QueryStatistics_Cuda/fp16");
BENCHMARK_CAPTURE(run, H2O_fp32, kb::Op::h2o_update, kb::Elem::f32)->Apply(grid128)->Name("BM_H2OUpdate_Cuda/fp32");
BENCHMARK_CAPTURE(run, H2O_fp16, kb::Op::h2o_update, kb::Elem::f16)->Apply(grid128)->Name("BM_H2OUpdate_Cuda/fp16");
BENCHMARK_CAPTURE(run, Observed_fp32, kb::Op::observed_attention, kb::Elem::f32)
    ->Apply(grid128)
    ->Name("BM_ObservedAttention_Cuda/fp32");
BENCHMARK_CAPTURE(run, Observed_fp16, kb::Op::observed_attention, kb::Elem::f16)
    ->Apply(grid128)
    ->Name("BM_ObservedAttention_Cuda/fp16");
BENCHMARK_CAPTURE(run, AdaKVAllocate, kb::Op::ada_kv_allocate, kb::Elem::f32)
    ->Apply(grid128)
    ->Name("BM_AdaKVAllocate_Cuda");
BENCHMARK_CAPTURE(run, AdaKVSelect, kb::Op::ada_kv_select, kb::Elem::f32)->Apply(grid128)->Name("BM_AdaKVSelect_Cuda");
BENCHMARK_CAPTURE(run, RaggedAttend_fp16, kb::Op::ragged_attend, kb::Elem::f16)
    ->Apply(grid128)
    ->Name("BM_RaggedAttend_Cuda/fp16");
BENCHMARK_CAPTURE(run, RaggedAttend_fp32, kb::Op::ragged_attend, kb::Elem::f32)
    ->Apply(grid128)
    ->Name("BM_RaggedAttend_Cuda/fp32");
BENCHMARK_CAPTURE(run, MomentScore_fp16, kb::Op::moment_score, kb::Elem::f16)
    ->Apply(grid128)
    ->Name("BM_MomentKVScore_Cuda/fp16");
BENCHMARK_CAPTURE(run, MomentFold_fp16, kb::Op::moment_fold, kb::Elem::f16)
    ->Apply(grid128)
    ->Name("BM_MomentKVFold_Cuda/fp16");
BENCHMARK_CAPTURE(run, MomentAttend_fp16, kb::Op::moment_attend, kb::Elem::f16)
    ->Apply(grid128)
    ->Name("BM_MomentKVAttend_Cuda/fp16");
BENCHMARK_CAPTURE(run, UNCompUpdate_fp16, kb::Op::uncomp_update, kb::Elem::f16)
    ->Apply(grid_uncomp)
    ->Name("BM_UNCompUpdate_Cuda/fp16");
BENCHMARK_CAPTURE(run, UNCompUpdate_fp32, kb::Op::uncomp_update, kb::Elem::f32)
    ->Apply(grid_uncomp)
    ->Name("BM_UNCompUpdate_Cuda/fp32");
BENCHMARK_CAPTURE(run, UNCompScore, kb::Op::uncomp_score, kb::Elem::f16)
    ->Apply(grid_uncomp)
    ->Name("BM_UNCompScore_Cuda");
BENCHMARK_CAPTURE(run_packed, Packed2, 2)->Apply(grid_packed)->Name("BM_PackedAttend_Cuda/2bit");
BENCHMARK_CAPTURE(run_packed, Packed4, 4)->Apply(grid_packed)->Name("BM_PackedAttend_Cuda/4bit");
BENCHMARK_CAPTURE(run_packed, Packed8, 8)->Apply(grid_packed)->Name("BM_PackedAttend_Cuda/8bit");
BENCHMARK_CAPTURE(run_packed, Fp16, 16)->Apply(grid_packed)->Name("BM_PackedAttend_Cuda/fp16_attend");
BENCHMARK_CAPTURE(run, Read_fp32, kb::Op::read, kb::Elem::f32)->Apply(grid)->Name("BM_Cuda_MemoryRead");
BENCHMARK_CAPTURE(run, Fma, kb::Op::fma_peak, kb::Elem::f32)
    ->ArgNames({"tokens", "dim"})
    ->Args({4096, 128})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond)
    ->Name("BM_Cuda_FmaPeak");
