// SPDX-License-Identifier: Apache-2.0
// tools/cuda_emulator/include/cuda_runtime.h: the CUDA emulator's stand-in for <cuda_runtime.h> (test
// infrastructure, never installed). With it, kvc's unchanged .cuh kernels compile with the host compiler and run on
// the CPU: device memory is host memory (so AddressSanitizer sees every global access), each block's threads are
// cooperative fibers that switch at barriers and warp intrinsics, and the runtime turns divergent barriers, partial
// warps, shared-memory races and shared-memory overruns into a failed launch naming the kernel, block and thread.
// Only the subset of the runtime API and device built-ins that kvc uses is here; docs/cuda_emulator.md says what the
// emulation cannot see. The runtime lives in tools/cuda_emulator/runtime.cpp.
#pragma once

#if defined(__CUDACC__)
#  error "the CUDA emulator's cuda_runtime.h is for the host compiler; nvcc has the real one"
#endif

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <math.h>  // the device math functions kvc calls (sqrtf, expf, fmaxf, ilogb, ...) are the C library's
#include <string_view>
#include <type_traits>

#define KVC_CUDA_EMULATOR 1

// ---- Execution-space and declaration specifiers -----------------------------------------------------------------
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
// Static __shared__ variables become function statics (one copy, shared by every fiber of the running block; blocks
// run one after another) in their own section, so the runtime knows their address range: it fills it with garbage
// before each block and watches it for races and overruns.
#define __shared__ static __attribute__((section("kvc_emu_shared")))

// ---- Types ------------------------------------------------------------------------------------------------------
struct uint3 {
  unsigned x, y, z;
};
struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  constexpr dim3(unsigned vx = 1, unsigned vy = 1, unsigned vz = 1) noexcept : x(vx), y(vy), z(vz) {}
  constexpr dim3(uint3 v) noexcept : x(v.x), y(v.y), z(v.z) {}
};

struct __attribute__((aligned(16))) float4 {
  float x, y, z, w;
};
struct __attribute__((aligned(8))) float2 {
  float x, y;
};
inline float4 make_float4(float x, float y, float z, float w) {
  return {x, y, z, w};
}
inline float2 make_float2(float x, float y) {
  return {x, y};
}

struct CUstream_st;
struct CUevent_st;
struct CUgraph_st;
struct CUgraphExec_st;
using cudaStream_t = CUstream_st*;
using cudaEvent_t = CUevent_st*;
using cudaGraph_t = CUgraph_st*;
using cudaGraphExec_t = CUgraphExec_st*;

enum cudaStreamCaptureMode {
  cudaStreamCaptureModeGlobal = 0,
  cudaStreamCaptureModeThreadLocal = 1,
  cudaStreamCaptureModeRelaxed = 2,
};
enum cudaStreamCaptureStatus {
  cudaStreamCaptureStatusNone = 0,
  cudaStreamCaptureStatusActive = 1,
  cudaStreamCaptureStatusInvalidated = 2,
};

enum cudaError {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorMemoryAllocation = 2,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorInvalidDevice = 101,
  cudaErrorInvalidResourceHandle = 400,
  cudaErrorIllegalState = 401,
  cudaErrorNotReady = 600,
  cudaErrorLaunchFailure = 719,
  cudaErrorStreamCaptureUnsupported = 900,
  cudaErrorStreamCaptureInvalidated = 901,
  cudaErrorStreamCaptureImplicit = 906,
};
using cudaError_t = cudaError;

enum cudaMemcpyKind {
  cudaMemcpyHostToHost = 0,
  cudaMemcpyHostToDevice = 1,
  cudaMemcpyDeviceToHost = 2,
  cudaMemcpyDeviceToDevice = 3,
  cudaMemcpyDefault = 4,
};

enum cudaDeviceAttr {
  cudaDevAttrMaxThreadsPerBlock = 1,
  cudaDevAttrMaxGridDimX = 5,
  cudaDevAttrMaxGridDimY = 6,
  cudaDevAttrMaxGridDimZ = 7,
  cudaDevAttrMaxSharedMemoryPerBlock = 8,
  cudaDevAttrWarpSize = 10,
  cudaDevAttrMultiProcessorCount = 16,
  cudaDevAttrComputeCapabilityMajor = 75,
  cudaDevAttrComputeCapabilityMinor = 76,
  cudaDevAttrMaxSharedMemoryPerBlockOptin = 97,
};

enum cudaFuncAttribute {
  cudaFuncAttributeMaxDynamicSharedMemorySize = 8,
};

struct cudaFuncAttributes {
  std::size_t sharedSizeBytes;  ///< static __shared__ bytes (the emulator cannot tell them apart: 0)
  std::size_t constSizeBytes;
  std::size_t localSizeBytes;
  int maxThreadsPerBlock;
  int numRegs;
  int ptxVersion;
  int binaryVersion;
  int cacheModeCA;
  int maxDynamicSharedSizeBytes;
  int preferredShmemCarveout;
};

constexpr unsigned cudaStreamNonBlocking = 1;
constexpr unsigned cudaEventDefault = 0;

// ---- Runtime API (host) -----------------------------------------------------------------------------------------
cudaError_t cudaGetDeviceCount(int* count);
cudaError_t cudaGetDevice(int* device);
cudaError_t cudaSetDevice(int device);
cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device);
cudaError_t cudaDeviceSynchronize();
cudaError_t cudaGetLastError();
cudaError_t cudaPeekAtLastError();
char const* cudaGetErrorString(cudaError_t e);
char const* cudaGetErrorName(cudaError_t e);

cudaError_t cudaMalloc(void** p, std::size_t bytes);
template <class T>
cudaError_t cudaMalloc(T** p, std::size_t bytes) {
  return cudaMalloc(reinterpret_cast<void**>(p), bytes);
}
cudaError_t cudaFree(void* p);
cudaError_t cudaMemcpy(void* dst, void const* src, std::size_t bytes, cudaMemcpyKind kind);
cudaError_t cudaMemcpyAsync(void* dst, void const* src, std::size_t bytes, cudaMemcpyKind kind,
                            cudaStream_t stream = nullptr);
cudaError_t cudaMemset(void* p, int value, std::size_t bytes);
cudaError_t cudaMemsetAsync(void* p, int value, std::size_t bytes, cudaStream_t stream = nullptr);

cudaError_t cudaStreamCreate(cudaStream_t* s);
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned flags);
cudaError_t cudaStreamDestroy(cudaStream_t s);
cudaError_t cudaStreamSynchronize(cudaStream_t s);
cudaError_t cudaEventCreate(cudaEvent_t* e);
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned flags);
cudaError_t cudaEventDestroy(cudaEvent_t e);
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s = nullptr);
cudaError_t cudaEventSynchronize(cudaEvent_t e);
cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t stop);

// Stream capture and graphs: a capturing stream records its kernels, copies and sets instead of running them; a graph
// launch runs them in order. As in CUDA's global capture mode, a synchronous call (cudaMalloc, cudaFree, cudaMemcpy,
// cudaMemset, a synchronisation) or work on the legacy default stream while a stream captures fails
// (cudaErrorStreamCaptureUnsupported / cudaErrorStreamCaptureImplicit) and invalidates the capture, so that
// cudaStreamEndCapture returns cudaErrorStreamCaptureInvalidated and no graph. Events cannot be captured.
cudaError_t cudaStreamBeginCapture(cudaStream_t s, cudaStreamCaptureMode mode);
cudaError_t cudaStreamEndCapture(cudaStream_t s, cudaGraph_t* graph);
cudaError_t cudaStreamIsCapturing(cudaStream_t s, cudaStreamCaptureStatus* status);
cudaError_t cudaGraphInstantiate(cudaGraphExec_t* exec, cudaGraph_t graph, unsigned long long flags = 0);
cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t s);
cudaError_t cudaGraphDestroy(cudaGraph_t graph);
cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec);

cudaError_t cudaFuncGetAttributes(cudaFuncAttributes* attr, void const* func);
cudaError_t cudaFuncSetAttribute(void const* func, cudaFuncAttribute attr, int value);
template <class... P>
cudaError_t cudaFuncGetAttributes(cudaFuncAttributes* attr, void (*func)(P...)) {
  return cudaFuncGetAttributes(attr, reinterpret_cast<void const*>(func));
}
template <class... P>
cudaError_t cudaFuncSetAttribute(void (*func)(P...), cudaFuncAttribute attr, int value) {
  return cudaFuncSetAttribute(reinterpret_cast<void const*>(func), attr, value);
}

// ---- The emulator's own interface -------------------------------------------------------------------------------
namespace kvc::emu {

/// Where a barrier or warp intrinsic was called (its default arguments capture the caller's file and line).
struct Site {
  char const* file;
  int line;
};

/// One launch as the launch helper (kvc::backend::cuda::launch) describes it.
struct Launch {
  char const* name;  ///< the kernel's name, for diagnostics
  void const* func;  ///< the kernel (for its cudaFuncSetAttribute opt-ins)
  dim3 grid, block;
  std::size_t shared_bytes;  ///< dynamic shared memory
  cudaStream_t stream;
};

/// Runs `body()` once per thread of every block (each on its own fiber), blocks one after another. Returns
/// cudaSuccess, a configuration error (nothing ran), or cudaErrorLaunchFailure after a violation (the message is
/// printed and kept: violation()). On a capturing stream it checks the configuration and records a copy of `body`
/// (so `body` holds copies of the kernel's arguments) for the graph instead.
cudaError_t launch(Launch const& l, std::function<void()> const& body);

/// What the kernels' built-ins read: the running fiber's indices (the scheduler sets them at every switch).
extern uint3 thread_idx, block_idx;
extern dim3 block_dim, grid_dim;

/// The block's dynamic shared memory (extern __shared__ in CUDA), its size in bytes as launched.
void* dynamic_shared() noexcept;

// Barriers and warp intrinsics: each switches fibers. Operands and results travel as 64-bit patterns.
void sync_threads(Site site);
enum class WarpOp : int { sync, shfl, shfl_xor, shfl_up, shfl_down, ballot, any, all };
std::uint64_t warp_op(WarpOp op, unsigned mask, std::uint64_t value, int operand, int width, Site site);

/// Brackets an atomic read-modify-write of `bytes` at `p`: the race detector records one atomic access (atomics
/// never race with each other, but they do with plain accesses of the same bytes) and ignores the operation's own
/// loads and stores.
void atomic_begin(void const* p, std::size_t bytes) noexcept;
void atomic_end() noexcept;

/// The first violation since the last take_violation() ("" if none) and the launch that made it; take_violation()
/// also clears the sticky error, so a test of the emulator can go on.
char const* violation() noexcept;
std::string_view take_violation() noexcept;

/// The emulator cannot measure a kernel's static __shared__ bytes (cudaFuncGetAttributes reports 0): a test that
/// checks how a launch accounts for them states them here (and so resets the kernel's dynamic allowance to the
/// default, 48 KiB less them).
void set_static_shared_bytes(void const* func, std::size_t bytes) noexcept;

/// Host-side operations seen since reset_counters(): what a CUDA-graph-capturable step must not do.
struct Counters {
  long launches = 0;            ///< kernel launches, run or recorded by a capture
  long synchronizations = 0;    ///< cudaDeviceSynchronize, cudaStreamSynchronize, cudaEventSynchronize, cudaMemcpy,
                                ///< cudaMemset (the synchronous forms)
  long allocations = 0;         ///< cudaMalloc, cudaFree
  long default_stream_ops = 0;  ///< launches and async copies or sets on the legacy default stream (nullptr)
  long other_stream_ops = 0;    ///< ... on any other stream
  long graph_launches = 0;      ///< cudaGraphLaunch calls (the kernels they run are not counted as launches)
};
Counters counters() noexcept;
void reset_counters() noexcept;

}  // namespace kvc::emu

// ---- Device built-ins --------------------------------------------------------------------------------------------
#define threadIdx (static_cast<uint3 const&>(::kvc::emu::thread_idx))
#define blockIdx (static_cast<uint3 const&>(::kvc::emu::block_idx))
#define blockDim (static_cast<dim3 const&>(::kvc::emu::block_dim))
#define gridDim (static_cast<dim3 const&>(::kvc::emu::grid_dim))
constexpr int warpSize = 32;

inline void __syncthreads(char const* file = __builtin_FILE(), int line = __builtin_LINE()) {
  ::kvc::emu::sync_threads({file, line});
}
inline void __syncwarp(unsigned mask = 0xffffffffu, char const* file = __builtin_FILE(), int line = __builtin_LINE()) {
  ::kvc::emu::warp_op(::kvc::emu::WarpOp::sync, mask, 0, 0, 32, {file, line});
}

namespace kvc::emu::detail {
template <class T>
std::uint64_t to_bits(T v) noexcept {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>, "shuffles move at most 8 bytes");
  std::uint64_t u = 0;
  std::memcpy(&u, &v, sizeof v);
  return u;
}
template <class T>
T from_bits(std::uint64_t u) noexcept {
  T v;
  std::memcpy(&v, &u, sizeof v);
  return v;
}
template <class T>
T shuffle(WarpOp op, unsigned mask, T v, int operand, int width, Site site) {
  return from_bits<T>(warp_op(op, mask, to_bits(v), operand, width, site));
}
}  // namespace kvc::emu::detail

template <class T>
T __shfl_sync(unsigned mask, T v, int src_lane, int width = 32, char const* file = __builtin_FILE(),
              int line = __builtin_LINE()) {
  return ::kvc::emu::detail::shuffle(::kvc::emu::WarpOp::shfl, mask, v, src_lane, width, {file, line});
}
template <class T>
T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32, char const* file = __builtin_FILE(),
                  int line = __builtin_LINE()) {
  return ::kvc::emu::detail::shuffle(::kvc::emu::WarpOp::shfl_xor, mask, v, lane_mask, width, {file, line});
}
template <class T>
T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32, char const* file = __builtin_FILE(),
                 int line = __builtin_LINE()) {
  return ::kvc::emu::detail::shuffle(::kvc::emu::WarpOp::shfl_up, mask, v, static_cast<int>(delta), width,
                                     {file, line});
}
template <class T>
T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32, char const* file = __builtin_FILE(),
                   int line = __builtin_LINE()) {
  return ::kvc::emu::detail::shuffle(::kvc::emu::WarpOp::shfl_down, mask, v, static_cast<int>(delta), width,
                                     {file, line});
}
inline unsigned __ballot_sync(unsigned mask, int predicate, char const* file = __builtin_FILE(),
                              int line = __builtin_LINE()) {
  return static_cast<unsigned>(
      ::kvc::emu::warp_op(::kvc::emu::WarpOp::ballot, mask, predicate != 0, 0, 32, {file, line}));
}
inline int __any_sync(unsigned mask, int predicate, char const* file = __builtin_FILE(), int line = __builtin_LINE()) {
  return static_cast<int>(::kvc::emu::warp_op(::kvc::emu::WarpOp::any, mask, predicate != 0, 0, 32, {file, line}));
}
inline int __all_sync(unsigned mask, int predicate, char const* file = __builtin_FILE(), int line = __builtin_LINE()) {
  return static_cast<int>(::kvc::emu::warp_op(::kvc::emu::WarpOp::all, mask, predicate != 0, 0, 32, {file, line}));
}

// Atomics: the fibers of a launch run on one OS thread, one at a time, so a plain read-modify-write is atomic.
#define KVC_EMU_ATOMIC(name, expr)                \
  template <class T>                              \
  T name(T* address, T value) {                   \
    ::kvc::emu::atomic_begin(address, sizeof(T)); \
    T const old = *address;                       \
    *address = (expr);                            \
    ::kvc::emu::atomic_end();                     \
    return old;                                   \
  }
KVC_EMU_ATOMIC(atomicAdd, old + value)
KVC_EMU_ATOMIC(atomicSub, old - value)
KVC_EMU_ATOMIC(atomicMax, old < value ? value : old)
KVC_EMU_ATOMIC(atomicMin, value < old ? value : old)
KVC_EMU_ATOMIC(atomicExch, value)
KVC_EMU_ATOMIC(atomicOr, old | value)
KVC_EMU_ATOMIC(atomicAnd, old& value)
#undef KVC_EMU_ATOMIC
template <class T>
T atomicCAS(T* address, T compare, T value) {
  ::kvc::emu::atomic_begin(address, sizeof(T));
  T const old = *address;
  if (old == compare)
    *address = value;
  ::kvc::emu::atomic_end();
  return old;
}

// Rounding intrinsics: the point of the _rn forms on the device is that they are never fused into an FMA. Host
// compilers contract only within one expression (Clang's default) unless told otherwise; the emulated targets build
// with -ffp-contract=off, so a plain operation rounds once, as here.
inline float __fadd_rn(float a, float b) {
  return a + b;
}
inline float __fsub_rn(float a, float b) {
  return a - b;
}
inline float __fmul_rn(float a, float b) {
  return a * b;
}
inline float __fdiv_rn(float a, float b) {
  return a / b;
}
inline double __dadd_rn(double a, double b) {
  return a + b;
}
inline double __dsub_rn(double a, double b) {
  return a - b;
}
inline double __dmul_rn(double a, double b) {
  return a * b;
}
inline double __ddiv_rn(double a, double b) {
  return a / b;
}
inline float __int_as_float(int x) {
  return ::kvc::emu::detail::from_bits<float>(static_cast<std::uint32_t>(x));
}
inline int __float_as_int(float x) {
  return static_cast<int>(::kvc::emu::detail::to_bits(x));
}
inline unsigned __float_as_uint(float x) {
  return static_cast<unsigned>(::kvc::emu::detail::to_bits(x));
}
inline float __uint_as_float(unsigned x) {
  return ::kvc::emu::detail::from_bits<float>(x);
}
inline double __longlong_as_double(long long x) {
  return ::kvc::emu::detail::from_bits<double>(static_cast<std::uint64_t>(x));
}
inline long long __double_as_longlong(double x) {
  return static_cast<long long>(::kvc::emu::detail::to_bits(x));
}
inline int __popc(unsigned x) {
  return __builtin_popcount(x);
}
inline int __popcll(unsigned long long x) {
  return __builtin_popcountll(x);
}
inline int __clz(int x) {
  return x == 0 ? 32 : __builtin_clz(static_cast<unsigned>(x));
}
inline int __clzll(long long x) {
  return x == 0 ? 64 : __builtin_clzll(static_cast<unsigned long long>(x));
}
inline int __ffs(int x) {
  return __builtin_ffs(x);
}
