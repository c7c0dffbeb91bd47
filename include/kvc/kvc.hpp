// SPDX-License-Identifier: Apache-2.0
// kvc/kvc.hpp: host umbrella (convenience): core, every policy definition and every CPU kernel. Docs and examples
// include the specific headers instead; this one costs compile time.
#pragma once

#include <kvc/attention/attend.hpp>
#include <kvc/backend/cpu/attention/attend.hpp>
#include <kvc/backend/cpu/pipeline/compact.hpp>
#include <kvc/backend/cpu/pipeline/rerotate.hpp>
#include <kvc/backend/cpu/scorers/key_diff.hpp>
#include <kvc/backend/cpu/scorers/knorm.hpp>
#include <kvc/backend/cpu/scorers/random.hpp>
#include <kvc/backend/cpu/scorers/snap_kv.hpp>
#include <kvc/backend/cpu/scorers/streaming_llm.hpp>
#include <kvc/backend/cpu/scorers/tova.hpp>
#include <kvc/backend/cpu/selectors/top_k.hpp>
#include <kvc/backend/cpu/thread_pool.hpp>
#include <kvc/core/validate.hpp>
#include <kvc/io/npy.hpp>
#include <kvc/pipeline/blockwise.hpp>
#include <kvc/pipeline/press.hpp>
#include <kvc/pipeline/rerotate.hpp>
#include <kvc/version.hpp>
