// SPDX-License-Identifier: Apache-2.0
// kvc/backend/cuda/selectors/top_k.cuh: the CUDA kernel of TopKSelector (in detail/, since AdaKV's and UNComp's
// selections (selectors/allocated_top_k.hpp) run it after their allocation).
#pragma once

#include <kvc/backend/cuda/detail/top_k.cuh>
