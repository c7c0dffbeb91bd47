// SPDX-License-Identifier: Apache-2.0
// tests/cuda_emulator/emulator_test.cpp: the CUDA emulator (tools/cuda_emulator) runs correct kernels correctly and
// turns each rule a kernel can break into a failed launch whose message names the kernel, the block and the thread:
// a divergent barrier, a partial-warp intrinsic, a shared-memory race, a shared-memory overrun, a deadlock. And
// kvc's launch helper checks a launch's configuration and shared memory before it runs.
#include <kvc/backend/cuda/config.cuh>
#include <kvc/backend/cuda/detail/block_reduce.cuh>
#include <kvc/backend/cuda/pipeline/compact.cuh>
#include <kvc/pipeline/compact.hpp>

#include "support/catch.hpp"

#include <string>
#include <vector>

namespace bc = kvc::backend::cuda;
using kvc::Index;

namespace {

// ---- Kernels (templates, as every kvc kernel) ---------------------------------------------------------------------

/// Correct: a block-wide sum through shuffles and shared memory, a block exclusive scan, and an atomic count.
template <class T>
__global__ void sum_scan_count(T const* x, T* sums, int* prefix, unsigned* count) {
  __shared__ T sum_scratch[32];
  __shared__ int scan_scratch[32];
  __shared__ unsigned local;
  if (threadIdx.x == 0)
    local = 0;
  __syncthreads();
  Index const i = static_cast<Index>(blockIdx.x) * blockDim.x + threadIdx.x;
  T const s = bc::block_sum(x[i], sum_scratch);
  int total = 0;
  prefix[i] = bc::block_exclusive_sum(static_cast<int>(threadIdx.x % 3), total, scan_scratch);
  if (x[i] > T{0})
    atomicAdd(&local, 1u);
  __syncthreads();
  if (threadIdx.x == 0) {
    sums[blockIdx.x] = s;
    atomicAdd(count, local);
  }
}

/// Odd threads wait at a barrier the even ones never reach.
template <class T>
__global__ void divergent_barrier(T* out) {
  if (threadIdx.x % 2 == 1)
    __syncthreads();
  out[threadIdx.x] = T{1};
}

/// Two groups of threads wait at two different barriers.
template <class T>
__global__ void two_barriers(T* out) {
  if (threadIdx.x < 32)
    __syncthreads();
  else
    __syncthreads();
  out[threadIdx.x] = T{1};
}

/// Thread 0 writes a shared value that thread 1 reads with (barrier = true) or without a barrier between.
template <class T>
__global__ void shared_handoff(T* out, bool barrier) {
  __shared__ T value;
  if (threadIdx.x == 0)
    value = T{42};
  if (barrier)
    __syncthreads();
  if (threadIdx.x == 1)
    out[0] = value;
}

/// Half a warp shuffles with a full mask.
template <class T>
__global__ void partial_warp_shuffle(T* out) {
  T x = static_cast<T>(threadIdx.x);
  if (threadIdx.x < 16)
    x = __shfl_xor_sync(0xffffffffu, x, 1);
  out[threadIdx.x] = x;
}

/// A full-mask shuffle in a block of 48 threads: lanes 16..31 of the second warp do not exist.
template <class T>
__global__ void shuffle_in_short_warp(T* out) {
  out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, static_cast<T>(threadIdx.x), 1);
}

/// Reads the element just past the dynamic shared memory (`n` floats were launched).
template <class T>
__global__ void dynamic_overrun(T* out, Index n) {
  T* const s = bc::dynamic_shared<T>();
  for (Index i = threadIdx.x; i < n; i += blockDim.x)
    s[i] = T{1};
  __syncthreads();
  if (threadIdx.x == 0)
    out[0] = s[n];
}

/// Lane 1 skips a full-mask shuffle and waits at the barrier, where the other lanes of its warp never come: they
/// wait in the shuffle for lane 1.
template <class T>
__global__ void shuffle_waits_for_barrier(T* out) {
  T x = T{0};
  if (threadIdx.x < 32 && threadIdx.x != 1)
    x = __shfl_xor_sync(0xffffffffu, T{1}, 1);
  __syncthreads();
  out[threadIdx.x] = x;
}

template <class T>
__global__ void fill(T* out, T value, Index n) {
  for (Index i = static_cast<Index>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<Index>(gridDim.x) * blockDim.x)
    out[i] = value;
}

// ---- Helpers -------------------------------------------------------------------------------------------------------

template <class T>
struct Device {
  T* p = nullptr;
  explicit Device(std::size_t n) { REQUIRE(cudaMalloc(&p, n * sizeof(T)) == cudaSuccess); }
  ~Device() { cudaFree(p); }
  Device(Device const&) = delete;
  Device& operator=(Device const&) = delete;
};

/// Runs `launch` (which must fail), then takes the emulator's diagnosis and checks that it names the kernel, a block
/// and a thread, and says `what`.
template <class F>
std::string expect_violation(F&& launch, char const* what) {
  kvc::Status const st = launch();
  CHECK_FALSE(st.ok());
  CHECK(st.code() == kvc::Errc::backend_error);
  std::string const v(kvc::emu::take_violation());
  INFO(v);
  CHECK(v.find(what) != std::string::npos);
  CHECK(v.find("block (") != std::string::npos);
  CHECK((v.find("thread (") != std::string::npos || v.find("deadlock") != std::string::npos));
  CHECK(cudaGetLastError() == cudaSuccess);  // taken: the next launch may run
  return v;
}

}  // namespace

TEST_CASE("emulator: a correct kernel runs every block and thread (sums, scans, atomics)", "[cuda_emulator]") {
  constexpr int blocks = 3, threads = 256;
  std::vector<float> x(blocks * threads);
  for (std::size_t i = 0; i < x.size(); ++i)
    x[i] = static_cast<float>(static_cast<int>(i % 7) - 3);  // -3..3: small integers, sums exact in any order
  Device<float> dx(x.size()), sums(blocks);
  Device<int> prefix(x.size());
  Device<unsigned> count(1);
  REQUIRE(cudaMemcpy(dx.p, x.data(), x.size() * sizeof(float), cudaMemcpyHostToDevice) == cudaSuccess);
  REQUIRE(cudaMemset(count.p, 0, sizeof(unsigned)) == cudaSuccess);
  float const* cx = dx.p;
  REQUIRE(
      bc::launch(KVC_CUDA_KERNEL("test", sum_scan_count), blocks, threads, 0, nullptr, cx, sums.p, prefix.p, count.p)
          .ok());
  std::vector<float> got_sums(blocks);
  std::vector<int> got_prefix(x.size());
  unsigned got_count = 0;
  REQUIRE(cudaMemcpy(got_sums.data(), sums.p, blocks * sizeof(float), cudaMemcpyDeviceToHost) == cudaSuccess);
  REQUIRE(cudaMemcpy(got_prefix.data(), prefix.p, x.size() * sizeof(int), cudaMemcpyDeviceToHost) == cudaSuccess);
  REQUIRE(cudaMemcpy(&got_count, count.p, sizeof(unsigned), cudaMemcpyDeviceToHost) == cudaSuccess);
  unsigned positive = 0;
  for (int b = 0; b < blocks; ++b) {
    float sum = 0;
    int before = 0;
    for (int t = 0; t < threads; ++t) {
      float const v = x[static_cast<std::size_t>(b * threads + t)];
      sum += v;
      positive += v > 0 ? 1u : 0u;
      CHECK(got_prefix[static_cast<std::size_t>(b * threads + t)] == before);
      before += t % 3;
    }
    CHECK(got_sums[static_cast<std::size_t>(b)] == sum);
  }
  CHECK(got_count == positive);
  CHECK(std::string(kvc::emu::violation()).empty());
}

TEST_CASE("emulator: a barrier that not every thread reaches fails the launch", "[cuda_emulator]") {
  Device<float> out(64);
  expect_violation([&] { return bc::launch(KVC_CUDA_KERNEL("test", divergent_barrier), 1, 64, 0, nullptr, out.p); },
                   "divergent __syncthreads");
  std::string const v =
      expect_violation([&] { return bc::launch(KVC_CUDA_KERNEL("test", two_barriers), 1, 64, 0, nullptr, out.p); },
                       "divergent __syncthreads");
  CHECK(v.find("two_barriers") != std::string::npos);  // the kernel is named
}

TEST_CASE("emulator: a full-mask warp intrinsic with an inactive lane fails the launch", "[cuda_emulator]") {
  Device<int> out(64);
  // Lanes 0-15 shuffle, 16-31 go on and return: the shuffle names lanes that will never come.
  expect_violation([&] { return bc::launch(KVC_CUDA_KERNEL("test", partial_warp_shuffle), 1, 32, 0, nullptr, out.p); },
                   "inactive lane");
  expect_violation([&] { return bc::launch(KVC_CUDA_KERNEL("test", shuffle_in_short_warp), 1, 48, 0, nullptr, out.p); },
                   "inactive lane");
  // The same shuffle with every lane present is fine.
  REQUIRE(bc::launch(KVC_CUDA_KERNEL("test", shuffle_in_short_warp), 1, 64, 0, nullptr, out.p).ok());
  std::vector<int> got(64);
  REQUIRE(cudaMemcpy(got.data(), out.p, 64 * sizeof(int), cudaMemcpyDeviceToHost) == cudaSuccess);
  for (int t = 0; t < 64; ++t)
    CHECK(got[static_cast<std::size_t>(t)] == (t ^ 1));
}

TEST_CASE("emulator: warps and barriers that wait on each other are a deadlock, not a hang", "[cuda_emulator]") {
  Device<int> out(64);
  expect_violation(
      [&] { return bc::launch(KVC_CUDA_KERNEL("test", shuffle_waits_for_barrier), 1, 64, 0, nullptr, out.p); },
      "deadlock");
}

TEST_CASE("emulator: two threads touching a shared byte between barriers, one writing, is a race", "[cuda_emulator]") {
#if !defined(__clang__)
  WARN("SKIPPED: the race detector needs Clang's -fsanitize-coverage=trace-loads,trace-stores");
  return;
#endif
  Device<float> out(1);
  std::string const v = expect_violation(
      [&] { return bc::launch(KVC_CUDA_KERNEL("test", shared_handoff), 1, 32, 0, nullptr, out.p, false); },
      "shared-memory race");
  CHECK(v.find("thread (1, 0, 0)") != std::string::npos);
  CHECK(v.find("thread (0, 0, 0)") != std::string::npos);
  // With the barrier the hand-off is correct, and the value arrives.
  REQUIRE(bc::launch(KVC_CUDA_KERNEL("test", shared_handoff), 1, 32, 0, nullptr, out.p, true).ok());
  float got = 0;
  REQUIRE(cudaMemcpy(&got, out.p, sizeof got, cudaMemcpyDeviceToHost) == cudaSuccess);
  CHECK(got == 42.0f);
}

TEST_CASE("emulator: an access past the dynamic shared memory is an overrun", "[cuda_emulator]") {
  Device<float> out(1);
  Index const n = 100;  // launched with exactly n floats; the kernel reads s[n]
#if defined(__clang__)
  expect_violation(
      [&] { return bc::launch(KVC_CUDA_KERNEL("test", dynamic_overrun), 1, 64, n * sizeof(float), nullptr, out.p, n); },
      "shared-memory overrun");
#else
  WARN("SKIPPED: the overrun check needs Clang's -fsanitize-coverage=trace-loads,trace-stores");
#endif
  // One float more and the same read is in bounds.
  REQUIRE(bc::launch(KVC_CUDA_KERNEL("test", dynamic_overrun), 1, 64, (n + 1) * sizeof(float), nullptr, out.p, n).ok());
}

TEST_CASE("launch: the configuration and shared memory are checked before launching, naming the kernel",
          "[cuda_emulator][launch]") {
  Device<float> out(4096);
  auto const f = [&](dim3 grid, dim3 block, std::size_t shared) {
    return bc::launch(KVC_CUDA_KERNEL("kvc::test", fill), grid, block, shared, nullptr, out.p, 1.0f, Index{4096});
  };
  CHECK(f(1, 1024, 0).ok());
  kvc::Status st = f(1, 1025, 0);
  CHECK(st.code() == kvc::Errc::invalid_argument);
  CHECK(std::string(st.message()) ==
        "kvc::test: fill: block above the kernel's thread limit, or grid above 65535 in y or z");
  CHECK(f(dim3(1, 65536), 32, 0).code() == kvc::Errc::invalid_argument);
  CHECK(f(dim3(1, 1, 65536), 32, 0).code() == kvc::Errc::invalid_argument);
  st = f(1, 32, (227u << 10) + 1);  // above the device's opt-in limit
  CHECK(st.code() == kvc::Errc::invalid_argument);
  CHECK(std::string(st.message()).find("fill: static + dynamic shared memory") != std::string::npos);
  // Between 48 KiB and the opt-in limit the helper opts the kernel in.
  CHECK(f(1, 32, 100u << 10).ok());
  CHECK(std::string(kvc::emu::violation()).empty());
}

TEST_CASE("launch: static shared memory counts against the limit (40 KiB static + 10 KiB dynamic needs an opt-in)",
          "[cuda_emulator][launch]") {
  Device<float> out(16);
  auto* const kernel = &fill<float>;
  kvc::emu::set_static_shared_bytes(reinterpret_cast<void const*>(kernel), 40u << 10);
  auto const f = [&](std::size_t shared) {
    return bc::launch(KVC_CUDA_KERNEL("kvc::test", kernel), 1, 32, shared, nullptr, out.p, 1.0f, Index{16});
  };
  CHECK(f(8u << 10).ok());               // 48 KiB in all: the default allowance
  CHECK(f(10u << 10).ok());              // 50 KiB: the helper opts in
  kvc::Status const st = f(190u << 10);  // 230 KiB: above the opt-in limit with the static bytes, not without
  CHECK(st.code() == kvc::Errc::invalid_argument);
  CHECK(std::string(st.message()).find("static + dynamic") != std::string::npos);
  kvc::emu::set_static_shared_bytes(reinterpret_cast<void const*>(kernel), 0);
}

TEST_CASE("emulator: counters see synchronisations, allocations and the stream of each operation", "[cuda_emulator]") {
  Device<float> out(64);
  cudaStream_t stream = nullptr;
  REQUIRE(cudaStreamCreate(&stream) == cudaSuccess);
  kvc::emu::reset_counters();
  REQUIRE(bc::launch(KVC_CUDA_KERNEL("test", fill), 1, 64, 0, stream, out.p, 2.0f, Index{64}).ok());
  REQUIRE(cudaMemsetAsync(out.p, 0, 4, stream) == cudaSuccess);
  auto c = kvc::emu::counters();
  CHECK(c.launches == 1);
  CHECK(c.other_stream_ops == 2);
  CHECK(c.default_stream_ops == 0);
  CHECK(c.synchronizations == 0);
  CHECK(c.allocations == 0);
  float host = 0;
  REQUIRE(cudaMemcpy(&host, out.p + 1, sizeof host, cudaMemcpyDeviceToHost) == cudaSuccess);
  REQUIRE(bc::launch(KVC_CUDA_KERNEL("test", fill), 1, 64, 0, nullptr, out.p, 2.0f, Index{64}).ok());
  c = kvc::emu::counters();
  CHECK(host == 2.0f);
  CHECK(c.synchronizations == 1);
  CHECK(c.default_stream_ops == 1);
  REQUIRE(cudaStreamDestroy(stream) == cudaSuccess);
}

/// Adds `step` to every element (the graph test's kernel: replaying it twice must add twice).
template <class T>
__global__ void add_step(T* out, T const* step, Index n) {
  for (Index i = static_cast<Index>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<Index>(gridDim.x) * blockDim.x)
    out[i] += *step;
}

TEST_CASE("emulator: a captured stream records kernels, copies and sets, and its graph replays them in order",
          "[cuda_emulator][graph]") {
  Device<float> out(64), step(1), copy(64);
  cudaStream_t stream = nullptr;
  REQUIRE(cudaStreamCreate(&stream) == cudaSuccess);
  float const one = 1.0f;
  REQUIRE(cudaMemcpy(step.p, &one, sizeof one, cudaMemcpyHostToDevice) == cudaSuccess);
  REQUIRE(cudaMemset(out.p, 0, 64 * sizeof(float)) == cudaSuccess);
  REQUIRE(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal) == cudaSuccess);
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  REQUIRE(cudaStreamIsCapturing(stream, &status) == cudaSuccess);
  CHECK(status == cudaStreamCaptureStatusActive);
  // The kernel reads *step when the graph runs, not when it was captured; the set and the copy follow it in order.
  REQUIRE(bc::launch(KVC_CUDA_KERNEL("test", add_step), 1, 32, 0, stream, out.p, static_cast<float const*>(step.p),
                     Index{64})
              .ok());
  REQUIRE(cudaMemsetAsync(out.p, 0, sizeof(float), stream) == cudaSuccess);  // element 0 back to 0
  REQUIRE(cudaMemcpyAsync(copy.p, out.p, 64 * sizeof(float), cudaMemcpyDeviceToDevice, stream) == cudaSuccess);
  cudaGraph_t graph = nullptr;
  REQUIRE(cudaStreamEndCapture(stream, &graph) == cudaSuccess);
  REQUIRE(graph != nullptr);
  std::vector<float> host(64, -1.0f);
  REQUIRE(cudaMemcpy(host.data(), out.p, 64 * sizeof(float), cudaMemcpyDeviceToHost) == cudaSuccess);
  CHECK(host[5] == 0.0f);  // nothing ran while capturing
  cudaGraphExec_t exec = nullptr;
  REQUIRE(cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess);
  kvc::emu::reset_counters();
  REQUIRE(cudaGraphLaunch(exec, stream) == cudaSuccess);
  float const three = 3.0f;  // a replay reads the step's current value
  REQUIRE(cudaMemcpy(step.p, &three, sizeof three, cudaMemcpyHostToDevice) == cudaSuccess);
  REQUIRE(cudaGraphLaunch(exec, stream) == cudaSuccess);
  CHECK(kvc::emu::counters().graph_launches == 2);
  CHECK(kvc::emu::counters().launches == 0);
  REQUIRE(cudaMemcpy(host.data(), copy.p, 64 * sizeof(float), cudaMemcpyDeviceToHost) == cudaSuccess);
  CHECK(host[0] == 0.0f);
  CHECK(host[5] == 4.0f);
  CHECK(host[63] == 4.0f);
  REQUIRE(cudaGraphExecDestroy(exec) == cudaSuccess);
  REQUIRE(cudaGraphDestroy(graph) == cudaSuccess);
  REQUIRE(cudaStreamDestroy(stream) == cudaSuccess);
}

TEST_CASE("emulator: a synchronous call or default-stream work during a capture invalidates it (global mode)",
          "[cuda_emulator][graph]") {
  Device<float> out(64);
  cudaStream_t stream = nullptr;
  REQUIRE(cudaStreamCreate(&stream) == cudaSuccess);
  float host = 0;
  cudaGraph_t graph = nullptr;
  for (int what = 0; what < 4; ++what) {
    INFO("case " << what);
    REQUIRE(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal) == cudaSuccess);
    REQUIRE(cudaMemsetAsync(out.p, 0, 4, stream) == cudaSuccess);
    void* p = nullptr;
    cudaError_t const e = what == 0   ? cudaMemcpy(&host, out.p, sizeof host, cudaMemcpyDeviceToHost)
                          : what == 1 ? cudaStreamSynchronize(stream)
                          : what == 2 ? cudaMalloc(&p, 16)
                                      : cudaMemsetAsync(out.p, 0, 4, nullptr);
    CHECK(e == (what == 3 ? cudaErrorStreamCaptureImplicit : cudaErrorStreamCaptureUnsupported));
    CHECK(p == nullptr);
    // Later work on the invalidated stream fails too, and the capture ends without a graph.
    CHECK_FALSE(bc::launch(KVC_CUDA_KERNEL("test", fill), 1, 64, 0, stream, out.p, 2.0f, Index{64}).ok());
    CHECK(cudaStreamEndCapture(stream, &graph) == cudaErrorStreamCaptureInvalidated);
    CHECK(graph == nullptr);
    (void)cudaGetLastError();
  }
  CHECK(cudaStreamBeginCapture(nullptr, cudaStreamCaptureModeGlobal) == cudaErrorStreamCaptureUnsupported);
  CHECK(cudaStreamEndCapture(stream, &graph) == cudaErrorIllegalState);  // not capturing
  (void)cudaGetLastError();
  REQUIRE(bc::launch(KVC_CUDA_KERNEL("test", fill), 1, 64, 0, stream, out.p, 2.0f, Index{64}).ok());  // usable again
  REQUIRE(cudaStreamDestroy(stream) == cudaSuccess);
}

TEST_CASE("cuda compaction: a plan whose count exceeds its capacity leaves each length at the rows moved",
          "[cuda_emulator][cuda][pipeline]") {
  // The row and position kernels clamp count[b, h] to the plan's capacity; the length kernel once wrote it unclamped,
  // leaving head 0 claiming 6 rows after 4 were moved.
  kvc::KVExtents const e{1, 2, 8, 4};
  std::vector<float> host(static_cast<std::size_t>(e.rows() * e.dim));
  for (std::size_t i = 0; i < host.size(); ++i)
    host[i] = static_cast<float>(i);
  Device<float> k(host.size()), v(host.size());
  Device<Index> lengths(2), index(8), count(2);
  std::vector<Index> const len{8, 8}, idx{0, 2, 4, 6, 1, 3, 5, 7}, cnt{6, 3};  // head 0: 6 > capacity 4
  REQUIRE(cudaMemcpy(k.p, host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice) == cudaSuccess);
  REQUIRE(cudaMemcpy(v.p, host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice) == cudaSuccess);
  REQUIRE(cudaMemcpy(lengths.p, len.data(), 2 * sizeof(Index), cudaMemcpyHostToDevice) == cudaSuccess);
  REQUIRE(cudaMemcpy(index.p, idx.data(), 8 * sizeof(Index), cudaMemcpyHostToDevice) == cudaSuccess);
  REQUIRE(cudaMemcpy(count.p, cnt.data(), 2 * sizeof(Index), cudaMemcpyHostToDevice) == cudaSuccess);
  auto const cache = kvc::make_cache(kvc::bhtd_device_rows(k.p, e), kvc::bhtd_device_rows(v.p, e),
                                     kvc::head_lengths(lengths.p, e.heads));
  kvc::KeepPlan<kvc::DeviceSpace> const plan{index.p, count.p, e.batch, e.heads, 4};
  REQUIRE(kvc::compact(kvc::Cuda{}, plan, cache).ok());
  std::vector<Index> got(2);
  std::vector<float> rows(host.size());
  REQUIRE(cudaMemcpy(got.data(), lengths.p, 2 * sizeof(Index), cudaMemcpyDeviceToHost) == cudaSuccess);
  REQUIRE(cudaMemcpy(rows.data(), k.p, rows.size() * sizeof(float), cudaMemcpyDeviceToHost) == cudaSuccess);
  CHECK(got[0] == 4);  // the 4 rows the plan holds were moved, not 6
  CHECK(got[1] == 3);
  for (int r = 0; r < 4; ++r)  // head 0 kept tokens 0, 2, 4, 6 in order (rows of 4 floats: token t starts at 4 t)
    CHECK(rows[static_cast<std::size_t>(4 * r)] == static_cast<float>(4 * 2 * r));
}
