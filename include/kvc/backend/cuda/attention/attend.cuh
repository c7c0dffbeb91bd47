// SPDX-License-Identifier: Apache-2.0
// kvc/backend/cuda/attention/attend.cuh: the CUDA attention kernel (in detail/, since corrected attention builds on
// it).
#pragma once

#include <kvc/backend/cuda/detail/attend.cuh>
