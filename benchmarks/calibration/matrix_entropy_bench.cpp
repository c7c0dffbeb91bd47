// SPDX-License-Identifier: Apache-2.0
// benchmarks/calibration/matrix_entropy_bench.cpp mirrors include/kvc/calibration/matrix_entropy.hpp: UNComp's
// truncated matrix entropy of one head's rows [N, 128] (N = 4096 and 32768), next to what bounds it, from one run:
//  - BM_MatrixEntropy/<fp32|fp16>/tokens:N: MatrixEntropySolver::compute (default options: centre, row-normalise,
//    fp64 SYRK over 256-row tiles, then the 128 x 128 eigensolve), serial, one head per iteration.
//  - BM_MatrixEntropy_EigenSyrk/tokens:N: the second moment alone, Eigen fp64 A += ZᵀZ as a rank update of the lower
//    triangle (SYRK, what the library calls) on a ready [N, 128] fp64 matrix; BM_MatrixEntropy_EigenGemm: the full
//    product A = ZᵀZ (GEMM) of the same shape.
//  - BM_MatrixEntropy_Eigensolver: Eigen's SelfAdjointEigenSolver, eigenvalues only, on a 128 x 128 SPD matrix: the
//    fixed per-head cost (compare with compute()'s time for the eigensolver's share).
// FLOP/s counts 2·N·D² per head for every N-dependent benchmark (the GEMM count; a SYRK does about half of it, so
// the library's and EigenSyrk's true rates are ~half the figure shown). rows/s: token rows per second.
#include <kvc/calibration/matrix_entropy.hpp>
#include <kvc/core/element.hpp>

#include "common/synthetic.hpp"

#include <Eigen/Core>
#include <Eigen/Eigenvalues>
#include <benchmark/benchmark.h>

#include <cstddef>
#include <vector>

namespace {

using kvc::Index;
constexpr Index dim = 128;

void token_counts(benchmark::internal::Benchmark* b) {
  b->ArgName("tokens")->Arg(4096)->Arg(32768)->Unit(benchmark::kMillisecond);
}

void counters(benchmark::State& state, Index n) {
  state.counters["FLOP/s"] =
      benchmark::Counter(2.0 * static_cast<double>(n * dim * dim), benchmark::Counter::kIsIterationInvariantRate);
  state.counters["rows/s"] = benchmark::Counter(static_cast<double>(n), benchmark::Counter::kIsIterationInvariantRate);
}

/// Rows [n, 128] of T: N(0, 1) with column c scaled by 1 + c / 32 (an anisotropic cloud, like real queries).
template <class T>
std::vector<T> rows(Index n) {
  kvc::tools::Rng rng(42);
  std::vector<T> x(static_cast<std::size_t>(n * dim));
  for (Index r = 0; r < n; ++r)
    for (Index c = 0; c < dim; ++c)
      x[static_cast<std::size_t>(r * dim + c)] =
          kvc::from_float<T>((1.0f + static_cast<float>(c) / 32.0f) * rng.normal());
  return x;
}

template <class T>
void BM_MatrixEntropy(benchmark::State& state) {
  Index const n = state.range(0);
  std::vector<T> const x = rows<T>(n);
  kvc::MatrixEntropySolver solver(dim);
  kvc::MatrixEntropy e;
  for (auto _ : state) {
    kvc::Status const st = solver.compute(x.data(), n, dim, e);
    benchmark::DoNotOptimize(st);
    benchmark::DoNotOptimize(e.truncated);
  }
  if (!solver.compute(x.data(), n, dim, e).ok())
    state.SkipWithError("compute failed");
  state.SetBytesProcessed(static_cast<std::int64_t>(x.size() * sizeof(T)) * state.iterations());
  counters(state, n);
}

using RowMatrix = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

void BM_MatrixEntropy_EigenSyrk(benchmark::State& state) {
  Index const n = state.range(0);
  RowMatrix const z = RowMatrix::Random(n, dim);
  Eigen::MatrixXd a(dim, dim);
  for (auto _ : state) {
    a.setZero();
    a.selfadjointView<Eigen::Lower>().rankUpdate(z.transpose());
    benchmark::DoNotOptimize(a.data());
  }
  counters(state, n);
}

void BM_MatrixEntropy_EigenGemm(benchmark::State& state) {
  Index const n = state.range(0);
  RowMatrix const z = RowMatrix::Random(n, dim);
  Eigen::MatrixXd a(dim, dim);
  for (auto _ : state) {
    a.noalias() = z.transpose() * z;
    benchmark::DoNotOptimize(a.data());
  }
  counters(state, n);
}

void BM_MatrixEntropy_Eigensolver(benchmark::State& state) {
  RowMatrix const z = RowMatrix::Random(4 * dim, dim);
  Eigen::MatrixXd const a = z.transpose() * z;  // SPD
  Eigen::SelfAdjointEigenSolver<Eigen::MatrixXd> solver(dim);
  for (auto _ : state) {
    solver.compute(a, Eigen::EigenvaluesOnly);
    benchmark::DoNotOptimize(solver.eigenvalues().data());
  }
  state.counters["solves/s"] = benchmark::Counter(1.0, benchmark::Counter::kIsIterationInvariantRate);
}

int const registered = [] {
  benchmark::RegisterBenchmark("BM_MatrixEntropy/fp32", BM_MatrixEntropy<float>)->Apply(token_counts);
  benchmark::RegisterBenchmark("BM_MatrixEntropy/fp16", BM_MatrixEntropy<kvc::half>)->Apply(token_counts);
  benchmark::RegisterBenchmark("BM_MatrixEntropy_EigenSyrk", BM_MatrixEntropy_EigenSyrk)->Apply(token_counts);
  benchmark::RegisterBenchmark("BM_MatrixEntropy_EigenGemm", BM_MatrixEntropy_EigenGemm)->Apply(token_counts);
  benchmark::RegisterBenchmark("BM_MatrixEntropy_Eigensolver", BM_MatrixEntropy_Eigensolver)
      ->Unit(benchmark::kMicrosecond);
  return 0;
}();

}  // namespace
