// SPDX-License-Identifier: Apache-2.0
// kvc/kvc.hpp: host umbrella (convenience): core, every policy definition and every CPU kernel. Docs and examples
// include the specific headers instead; this one costs compile time.
#pragma once

#include <kvc/attention/attend.hpp>
#include <kvc/attention/corrected.hpp>
#include <kvc/attention/merge.hpp>
#include <kvc/attention/packed.hpp>
#include <kvc/backend/cpu/attention/attend.hpp>
#include <kvc/backend/cpu/attention/corrected.hpp>
#include <kvc/backend/cpu/attention/packed.hpp>
#include <kvc/backend/cpu/pipeline/compact.hpp>
#include <kvc/backend/cpu/pipeline/query_statistics.hpp>
#include <kvc/backend/cpu/pipeline/rerotate.hpp>
#include <kvc/backend/cpu/scorers/expected_attention.hpp>
#include <kvc/backend/cpu/scorers/h2o.hpp>
#include <kvc/backend/cpu/scorers/key_diff.hpp>
#include <kvc/backend/cpu/scorers/knorm.hpp>
#include <kvc/backend/cpu/scorers/moment_kv.hpp>
#include <kvc/backend/cpu/scorers/random.hpp>
#include <kvc/backend/cpu/scorers/rdkv.hpp>
#include <kvc/backend/cpu/scorers/snap_kv.hpp>
#include <kvc/backend/cpu/scorers/streaming_llm.hpp>
#include <kvc/backend/cpu/scorers/tova.hpp>
#include <kvc/backend/cpu/scorers/uncomp.hpp>
#include <kvc/backend/cpu/selectors/ada_kv.hpp>
#include <kvc/backend/cpu/selectors/rdkv.hpp>
#include <kvc/backend/cpu/selectors/top_k.hpp>
#include <kvc/backend/cpu/selectors/uncomp.hpp>
#include <kvc/backend/cpu/thread_pool.hpp>
#include <kvc/calibration/head_budgets.hpp>
#include <kvc/calibration/head_groups.hpp>
#include <kvc/calibration/matrix_entropy.hpp>
#include <kvc/core/validate.hpp>
#include <kvc/io/npy.hpp>
#include <kvc/pipeline/blockwise.hpp>
#include <kvc/pipeline/decode.hpp>
#include <kvc/pipeline/layer_stages.hpp>
#include <kvc/pipeline/moment_kv.hpp>
#include <kvc/pipeline/pack.hpp>
#include <kvc/pipeline/press.hpp>
#include <kvc/pipeline/rerotate.hpp>
#include <kvc/rate_distortion/epsilon.hpp>
#include <kvc/rate_distortion/knapsack.hpp>
#include <kvc/selectors/pyramid_kv.hpp>
#include <kvc/store/ragged.hpp>
#include <kvc/version.hpp>
