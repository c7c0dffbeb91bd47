// SPDX-License-Identifier: Apache-2.0
// tests/install_consumer/main.cu: the CUDA umbrella compiled by nvcc against the installed kvc::cuda.
#include <kvc/cuda.cuh>

#include <cstdio>

int main() {
  int devices = 0;
  cudaError_t const e = cudaGetDeviceCount(&devices);
  std::printf("cuda consumer: built, %d device(s)%s\n", e == cudaSuccess ? devices : 0,
              e == cudaSuccess ? "" : " (no usable CUDA driver)");
  return 0;
}
