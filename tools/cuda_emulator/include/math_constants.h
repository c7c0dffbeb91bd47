// SPDX-License-Identifier: Apache-2.0
// tools/cuda_emulator/include/math_constants.h: the CUDA emulator's stand-in for CUDA's <math_constants.h> (the
// constants kvc's kernels use).
#pragma once

#include <limits>

#define CUDART_INF_F (std::numeric_limits<float>::infinity())
#define CUDART_NAN_F (std::numeric_limits<float>::quiet_NaN())
#define CUDART_INF (std::numeric_limits<double>::infinity())
#define CUDART_NAN (std::numeric_limits<double>::quiet_NaN())
#define CUDART_MAX_NORMAL_F (std::numeric_limits<float>::max())
