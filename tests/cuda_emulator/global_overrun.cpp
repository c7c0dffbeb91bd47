// SPDX-License-Identifier: Apache-2.0
// tests/cuda_emulator/global_overrun.cpp: under AddressSanitizer, a kernel that reads one element past a device
// buffer dies with ASan's heap-buffer-overflow report, followed by the emulator's line naming the kernel, the block
// and the thread (ctest kvc.cuda_emulator.global_overrun expects that line; built only with -fsanitize=address).
#include <kvc/backend/cuda/config.cuh>

#include <cstdio>

namespace {

/// Thread i copies x[i + 1] (the last thread reads one element past the n-element buffer).
template <class T>
__global__ void read_past_end(T const* x, T* y, kvc::Index n) {
  kvc::Index const i = static_cast<kvc::Index>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n)
    y[i] = x[i + 1];
}

}  // namespace

int main() {
  constexpr kvc::Index n = 64;
  float *x = nullptr, *y = nullptr;
  if (cudaMalloc(&x, n * sizeof(float)) != cudaSuccess || cudaMalloc(&y, n * sizeof(float)) != cudaSuccess)
    return 2;
  float const* cx = x;
  kvc::Status const st =
      kvc::backend::cuda::launch(KVC_CUDA_KERNEL("kvc::test", read_past_end), 2, 32, 0, nullptr, cx, y, n);
  std::printf("global_overrun: the launch returned (%s): AddressSanitizer saw nothing\n", st.message());
  return 1;
}
