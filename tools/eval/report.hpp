// SPDX-License-Identifier: Apache-2.0
// tools/eval/report.hpp: kvc-eval's outputs as text: results.json, results.csv, the terminal table, the plots' data,
// and two texts side by side. Numbers round-trip: shortest form in JSON (eval/json_out.hpp), %.17g in CSV.
#pragma once

#include "eval/run.hpp"
#include "eval/svg_plot.hpp"

#include <cmath>
#include <cstdio>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace kvc::eval {

/// Facts about the run every record carries.
struct RunInfo {
  std::string model;
  std::string cache;            ///< fp16, bf16, fp32, fp8_e4m3, fp8_e5m2
  std::string reference_cache;  ///< the full cache's type: KL, top-1 and the full perplexity are against it
  std::string layout;           ///< dense, paged
  Index prompt_tokens = 0;
  Index continuation = 0;
  std::uint64_t seed = 0;
  std::string prompt_source;         ///< "sampled" or the text file
  std::string schedule = "prefill";  ///< "prefill", or "decode interval=I,target=T,buffer=B"
  std::string isa{};                 ///< the instruction sets the kernels were compiled for (tools::compiled_isa())
};

/// A row's parameters as "NAME=VALUE,..." in the parameters' order (results.json's "params").
std::string params_text(tools::Params const& params);

/// results.json: an array of records, one a line, each with the run's facts (`info`); fields documented in
/// docs/eval.md; written through eval/json_out.hpp (NaN and +-Inf as null).
std::string results_json(std::vector<Record> const& records, std::vector<PolicyRun> const& runs, RunInfo const& info);

/// A CSV field: quoted (quotes doubled) when it holds a comma, a quote or a line break (RFC 4180).
std::string csv_field(std::string const& s);

/// results.csv: one header line, one line per record; layer errors as layer_error_0, layer_error_1, ... (last).
std::string results_csv(std::vector<Record> const& records);

/// The terminal table.
std::string results_table(std::vector<Record> const& records);

/// One plot: y (KL or top-1) against the fraction of KV memory kept, a line per policy.
PlotSpec quality_plot(std::vector<Record> const& records, std::string const& title, bool kl);

/// Decode-time runs: K + V KiB held after each decode step, a line per policy, and the full cache's line.
PlotSpec cache_plot(std::vector<Record> const& records, std::string const& title, double full_start, double per_token);

/// Code points in UTF-8 text (continuation bytes 10xxxxxx are not counted).
std::size_t code_points(std::string const& s);

/// Splits UTF-8 text into lines of at most `width` code points: words (separated by spaces) fill a line greedily,
/// newlines are kept, and a word longer than a line is cut at a code point boundary.
std::vector<std::string> wrap(std::string const& text, std::size_t width);

/// Two texts in two columns of `width` code points, with headings.
std::string side_by_side(std::string const& left_title, std::string const& left, std::string const& right_title,
                         std::string const& right, std::size_t width = 48);

}  // namespace kvc::eval
