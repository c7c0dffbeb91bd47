// SPDX-License-Identifier: Apache-2.0
// tools/eval/cmd_calibrate.cpp: `kvc-eval calibrate`: UNComp's calibration file (eval/calibrate.hpp,
// tools/common/uncomp.hpp): head groups from the query entropies of windows of a text.
#include "common/uncomp.hpp"
#include "eval/calibrate.hpp"
#include "eval/calibration_file.hpp"
#include "eval/calibration_text.hpp"
#include "eval/cli.hpp"

#include <cstdio>
#include <string>
#include <sys/stat.h>
#include <vector>

namespace kvc::eval::cli {

using kvc::tools::exit_invalid;
using kvc::tools::exit_usage;
using kvc::tools::fail;

void declare_calibrate(Options& o) {
  o.describe("UNComp's head groups from the query entropies of windows of a text: a calibration file.",
             "The file is for `kvc-eval run --calibration` and `kvc compress --policy uncomp --calibration`.\n"
             "FILE: UTF-8 text, at most 4 MiB; default: a built-in text. --param sets the entropy's parameters: "
             "top_k=auto (d/4),\nnormalize_rows=true, renormalize_topk=false, ridge=0. The file is written whole or "
             "not at all; it never\noverwrites --text.");
  o.option("--model", "DIR", "the model", true);
  o.option("--out", "calib.json", "where to write the calibration", true);
  o.option("--text", "FILE", "the text to calibrate on (default: the built-in text)");
  o.option("--samples", "S", "windows (default 4)");
  o.option("--tokens", "N", "tokens per window, BOS included (default 256, at most the model's context)");
  o.option("--groups", "M", "head groups (default 8)");
  o.option("--rule", "mean|majority_vote", "how the windows' rankings combine (default mean)");
  o.option("--param", "NAME=VALUE", "an entropy parameter (repeatable)", false, true);
}

namespace {

/// The entropy's parameters of `kvc-eval calibrate` (--param NAME=VALUE): uncomp_entropy's top_k, normalize_rows,
/// renormalize_topk and ridge, with their defaults.
kvc::MatrixEntropyOptions calibration_entropy(Options const& o) {
  kvc::tools::PolicyInfo const& entropy = kvc::tools::find_policy("uncomp_entropy");
  kvc::tools::Params p;
  for (std::string const& kv : o.all("--param")) {
    std::size_t const eq = kv.find('=');
    if (eq == std::string::npos || eq == 0)
      fail(exit_usage, "--param '" + kv + "': expected NAME=VALUE");
    std::string const key = kv.substr(0, eq);
    if (key != "top_k" && key != "normalize_rows" && key != "renormalize_topk" && key != "ridge")
      fail(exit_usage, "--param '" + key +
                           "' is not a parameter of kvc-eval calibrate (its parameters: top_k, normalize_rows, "
                           "renormalize_topk, ridge)");
    if (!p.emplace(key, kv.substr(eq + 1)).second)
      fail(exit_usage, "--param '" + key + "' given twice");
  }
  for (char const* name : {"top_k", "normalize_rows", "renormalize_topk", "ridge"})
    p.emplace(name, kvc::tools::find_param(entropy, name)->default_value);
  return kvc::tools::entropy_config(p).options;
}

}  // namespace

/// `kvc-eval calibrate`: UNComp's calibration file (eval/calibrate.hpp, tools/common/uncomp.hpp).
int command_calibrate(Options const& o) {
  std::string const model_path = o.get("--model"), out = o.get("--out");
  CalibrationOptions opts;
  opts.samples = count_option(o, "--samples", opts.samples, 1, 1 << 16);
  opts.tokens = count_option(o, "--tokens", opts.tokens, 2, 1 << 20);
  opts.groups = count_option(o, "--groups", opts.groups, 1, kvc::tools::max_calibration_heads);
  std::string const rule = o.get("--rule", "mean");
  if (rule != "mean" && rule != "majority_vote")
    fail(exit_usage, "--rule '" + rule + "': expected mean or majority_vote");
  opts.rule = rule == "mean" ? kvc::tools::GroupRule::mean : kvc::tools::GroupRule::majority_vote;
  opts.entropy = calibration_entropy(o);
  std::string const text_path = o.get("--text");
  if (o.has("--text") && text_path.empty())
    fail(exit_usage, "--text needs a file name");
  struct stat st {};
  if (::stat(out.c_str(), &st) == 0 && !S_ISREG(st.st_mode))
    fail(exit_invalid, "--out " + out + " exists and is not a regular file");
  if (!text_path.empty() && kvc::file_id(out) && kvc::file_id(out) == kvc::file_id(text_path))
    fail(exit_invalid, "--out " + out + " is the same file as --text " + text_path + ": refusing to overwrite it");

  auto const model = load_model(model_path);
  ModelConfig const& c = model.config;
  if (opts.tokens > c.context)
    fail(exit_invalid, "--tokens " + std::to_string(opts.tokens) + ": more than the model's " +
                           std::to_string(c.context) + " positions (its queries are out of distribution past them)");
  auto const tokenizer = load_tokenizer(model);
  if (!tokenizer)
    fail(exit_invalid, model_path + ": the model has no tokenizer next to it to encode the calibration text");
  std::int32_t const bos = c.bos >= 0 ? c.bos : tokenizer->bos_id();
  std::vector<std::int32_t> const text = encode_text(*tokenizer, c, "--text", text_path, builtin_calibration_text);
  std::string const source = text_path.empty() ? std::string("the built-in calibration text") : "--text " + text_path;
  auto const windows = calibration_windows(text, opts, bos, source);
  kvc::tools::Calibration const cal =
      calibrate(model, windows, opts, model_path, text_path.empty() ? std::string(builtin_text_name) : text_path);
  kvc::eval::write_calibration(cal, out);
  std::printf(
      "kvc-eval calibrate: %s (%lld layers, %lld/%lld heads, d %lld), %lld windows x %lld tokens of %s, "
      "top_k %lld, %lld groups (%s)\n",
      model_path.c_str(), static_cast<long long>(c.layers), static_cast<long long>(c.heads),
      static_cast<long long>(c.kv_heads), static_cast<long long>(c.head_dim), static_cast<long long>(cal.samples),
      static_cast<long long>(cal.tokens), source.c_str(), static_cast<long long>(cal.top_k),
      static_cast<long long>(cal.groups), rule.c_str());
  std::printf("%5s %10s  %s\n", "layer", "score", "query-head groups (0 = highest entropy) | KV-head groups");
  for (Index l = 0; l < cal.layers; ++l) {
    std::string groups;
    for (Index h = 0; h < cal.heads; ++h) {  // appended piece by piece: GCC 12's -Wrestrict misfires on "lit" + string
      if (h > 0)
        groups += ' ';
      groups += std::to_string(cal.query_group[static_cast<std::size_t>(l * cal.heads + h)]);
    }
    groups += " |";
    for (Index g = 0; g < cal.kv_heads; ++g) {
      groups += ' ';
      groups += std::to_string(cal.kv_group[static_cast<std::size_t>(l * cal.kv_heads + g)]);
    }
    std::printf("%5lld %10.4f  %s\n", static_cast<long long>(l), cal.layer_score[static_cast<std::size_t>(l)],
                groups.c_str());
  }
  std::printf("wrote %s\n", out.c_str());
  return 0;
}

}  // namespace kvc::eval::cli
