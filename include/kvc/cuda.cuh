// SPDX-License-Identifier: Apache-2.0
// kvc/cuda.cuh: device umbrella (convenience): core, policy definitions and every CUDA kernel. Never includes Eigen.
#pragma once

#include <kvc/backend/cuda/attention/attend.cuh>
#include <kvc/backend/cuda/attention/corrected.cuh>
#include <kvc/backend/cuda/attention/merge.cuh>
#include <kvc/backend/cuda/attention/packed.cuh>
#include <kvc/backend/cuda/config.cuh>
#include <kvc/backend/cuda/pipeline/compact.cuh>
#include <kvc/backend/cuda/pipeline/pack.cuh>
#include <kvc/backend/cuda/pipeline/query_statistics.cuh>
#include <kvc/backend/cuda/pipeline/state.cuh>
#include <kvc/backend/cuda/scorers/expected_attention.cuh>
#include <kvc/backend/cuda/scorers/h2o.cuh>
#include <kvc/backend/cuda/scorers/key_diff.cuh>
#include <kvc/backend/cuda/scorers/knorm.cuh>
#include <kvc/backend/cuda/scorers/moment_kv.cuh>
#include <kvc/backend/cuda/scorers/random.cuh>
#include <kvc/backend/cuda/scorers/rdkv.cuh>
#include <kvc/backend/cuda/scorers/snap_kv.cuh>
#include <kvc/backend/cuda/scorers/streaming_llm.cuh>
#include <kvc/backend/cuda/scorers/tova.cuh>
#include <kvc/backend/cuda/scorers/uncomp.cuh>
#include <kvc/backend/cuda/selectors/ada_kv.cuh>
#include <kvc/backend/cuda/selectors/rdkv.cuh>
#include <kvc/backend/cuda/selectors/top_k.cuh>
#include <kvc/backend/cuda/selectors/uncomp.cuh>
#include <kvc/backend/cuda/store/packed.cuh>
#include <kvc/engine/layer_compressor.hpp>
#include <kvc/pipeline/press.hpp>
