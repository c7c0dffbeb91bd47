// SPDX-License-Identifier: Apache-2.0
// kvc/backend/cuda/scorers/tova.cuh: CUDA kernel of TOVAScorer (defined with SnapKV's, which shares the window
// attention).
#pragma once

#include <kvc/backend/cuda/scorers/snap_kv.cuh>
