// SPDX-License-Identifier: Apache-2.0
// tools/eval/calibrate.hpp: UNComp's offline calibration (spec shared/specs/uncomp.md §2.5, §7.3-7.5, §7.11, §7.15) on
// kvc-eval's runner: `kvc-eval calibrate` and kvc-eval's uncomp rows without --calibration.
//
// The text (a file, or the built-in sample of eval/calibration_text.hpp) is tokenized with the model's tokenizer and
// cut into `samples` consecutive windows of `tokens` tokens each (BOS first when the model has one, then tokens - 1
// text tokens; window s starts at text token s * (tokens - 1)): deterministic, no sampling. Each window is prefilled
// through the model (fp32 cache), and every layer's post-RoPE queries of each query head [tokens, d] give one
// kvc::MatrixEntropy (kvc::MatrixEntropySolver). kvc::EntropyCalibration averages them over the windows and groups
// each layer's query heads: by the mean (default) or by the authors' greedy majority vote over the windows' labels;
// ties to the lower head index. KV heads (GQA, spec §7.15): a KV head's entropy is the mean erank_k of its query
// heads, grouped from the means (rule mean: kvc::reduce_to_kv_heads then kvc::group_heads) or by the vote over each
// window's per-KV-head means (a second EntropyCalibration). Layer scores s_l are the mean erank_k of the layer's
// query heads (spec §7.11). The result is a tools::Calibration (tools/common/uncomp.hpp).
#pragma once

#include <kvc/calibration/head_groups.hpp>
#include <kvc/calibration/matrix_entropy.hpp>

#include "common/policies.hpp"
#include "common/uncomp.hpp"
#include "eval/calibration_text.hpp"
#include "eval/engine.hpp"
#include "eval/model.hpp"

#include <cmath>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace kvc::eval {

/// What `kvc-eval calibrate` runs (its options).
struct CalibrationOptions {
  Index samples = 4;   ///< windows of text
  Index tokens = 256;  ///< tokens per window, BOS included
  Index groups = 8;    ///< M, for query heads and KV heads (M > heads leaves inner groups empty)
  tools::GroupRule rule = tools::GroupRule::mean;
  MatrixEntropyOptions entropy{};
};

/// The name the calibration file gives the built-in text.
constexpr char const* builtin_text_name = "built-in";

/// The calibration windows of `text` (token ids of the model's vocabulary): `samples` consecutive windows of
/// `tokens` tokens, each BOS (when bos >= 0) then the next tokens - 1 (or tokens) text tokens. A text too short
/// exits 3 naming `source`.
std::vector<std::vector<std::int32_t>> calibration_windows(std::span<std::int32_t const> text,
                                                           CalibrationOptions const& o, std::int32_t bos,
                                                           std::string const& source);

/// Runs the model over `windows` and computes the calibration (see the file comment). `model_name` and `text_name`
/// are recorded in the file. Errors exit 3.
tools::Calibration calibrate(Model const& model, std::vector<std::vector<std::int32_t>> const& windows,
                             CalibrationOptions const& o, std::string const& model_name, std::string const& text_name);

}  // namespace kvc::eval
