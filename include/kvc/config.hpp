// SPDX-License-Identifier: Apache-2.0
// kvc/config.hpp: the only host header that looks at the compiler.
#pragma once

/// KVC_ENABLE_CUDA is 1 only when the kvc::cuda CMake target is linked (it defines it); never set it by hand.
#if !defined(KVC_ENABLE_CUDA)
#  define KVC_ENABLE_CUDA 0
#endif

/// Marks functions callable from host and device code (views, layouts, element conversions).
#if defined(__CUDACC__)
#  define KVC_HOST_DEVICE __host__ __device__
#else
#  define KVC_HOST_DEVICE
#endif
