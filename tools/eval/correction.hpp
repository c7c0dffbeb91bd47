// SPDX-License-Identifier: Apache-2.0
// tools/eval/correction.hpp: `kvc-eval correction`, MomentKV's normalisation correction measured on a real model's
// keys, values and queries (shared/specs/moment_kv.md §2.6, §8.10).
//
// Per sample (prompt + continuation tokens), an fp32 forward pass records every layer's post-RoPE keys, values and
// queries (as `kvc-eval dump` writes them). Per layer, the prompt's K and V form a cache, which MomentKV compresses
// in place exactly as kvc-eval's `moment_kv` rows do (a kvc::LayerCompressor's prefill: the window queries are the
// prompt's last rows, the compressor's moments collect the evicted tokens). Then the continuation's queries (post-RoPE,
// positions after the prompt, so the causal mask hides nothing of the prompt) attend over
//   the full prompt cache                          -> f   (and lse = log Z)
//   the compressed cache, plain (the compressor's attend without the correction: kvc::attend) -> f_R (and lse_R)
//   the compressed cache, corrected (its attend: kvc::attend_corrected with its moments)      -> f̂
// so both errors are of the same kept set and the same queries: ||f − f̂|| / ||f|| and ||f − f_R|| / ||f|| per query
// row (query head, token), averaged over the rows (and the samples). Also reported: the share of rows where the
// correction lowers the error, and the evicted softmax mass w_E = 1 − Z_R / Z (mean over rows).
// The correction is not guaranteed to lower the error (spec §8.10: it is not a theorem); this measures it.
#pragma once

#include <kvc/core/extents.hpp>

#include "common/policies.hpp"
#include "eval/model.hpp"

#include <cstdint>
#include <vector>

namespace kvc::eval {

/// One layer's figures at one ratio, means over query rows and samples.
struct CorrectionLayer {
  double corrected = 0;     ///< ||f − f̂|| / ||f||
  double plain = 0;         ///< ||f − f_R|| / ||f||
  double wins = 0;          ///< fraction of rows whose corrected error is below the plain one
  double evicted_mass = 0;  ///< w_E = 1 − Z_R / Z
  double kept = 0;          ///< tokens kept per KV head
};

struct CorrectionRecord {
  double ratio = 0;
  std::vector<CorrectionLayer> layers;
  Index rows = 0;  ///< query rows per layer, all samples together
  Index samples = 0;
};

/// Measures MomentKV's correction (see the file comment) for the row with resolved `params` and `alloc`, at each of
/// `ratios`, on `samples` of prompt_tokens + continuation tokens (continuation >= 1). Throws tools::Failure (exit 3)
/// when a kvc call refuses. Defined in correction.cpp (the kvc_eval_lib library).
std::vector<CorrectionRecord> correction_errors(Model const& model, tools::Params const& params,
                                                tools::AllocatorChoice const& alloc, std::vector<double> const& ratios,
                                                std::vector<std::vector<std::int32_t>> const& samples,
                                                Index prompt_tokens);

}  // namespace kvc::eval
