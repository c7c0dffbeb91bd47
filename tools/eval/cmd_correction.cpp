// SPDX-License-Identifier: Apache-2.0
// tools/eval/cmd_correction.cpp: `kvc-eval correction`: MomentKV's corrected and plain attention errors per layer on
// the same kept set (eval/correction.hpp), for moment_kv rows, on prompts sampled as `kvc-eval run` samples them.
#include "eval/cli.hpp"
#include "eval/correction.hpp"
#include "eval/json_out.hpp"
#include "eval/moment_kv.hpp"
#include "eval/report.hpp"

#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>
#include <vector>

namespace kvc::eval::cli {

using kvc::tools::exit_invalid;
using kvc::tools::exit_usage;
using kvc::tools::fail;

void declare_correction(Options& o) {
  o.describe("MomentKV's corrected against plain attention error per layer, on the same kept set (moment_kv rows).",
             "ROW: a moment_kv row of `kvc-eval run --policies`, e.g. 'moment_kv(order=zeroth)+ada_kv'; --param "
             "takes the row's\nwhole name. Prompts are sampled from the model as `kvc-eval run` samples them (the "
             "same --seed gives the same\nprompts); K, V and Q in fp32. --out F.json: one record per (row, ratio, "
             "layer): policy, ratio, layer, kept,\nevicted_mass, plain_error, corrected_error, corrected_wins, rows, "
             "samples, params (docs/eval.md).");
  o.option("--model", "DIR", "the model", true);
  o.option("--policies", "ROW,...", "the moment_kv rows (default moment_kv)");
  o.option("--ratios", "R,...", "fractions of the prompt's tokens evicted (default 0.5,0.75)");
  o.option("--prompt-tokens", "N", "prompt tokens per sample (default 256)");
  o.option("--continuation", "M", "query tokens after the prompt (default 64)");
  o.option("--samples", "S", "prompts (default 4)");
  o.option("--seed", "X", "the prompts' seed (default 0)");
  o.option("--param", "ROW.NAME=VALUE", "a row's parameter (repeatable)", false, true);
  o.option("--out", "F.json", "where to write the records (else printed only)");
}

int command_correction(Options const& o) {
  std::string const model_path = o.get("--model");
  Index const prompt = count_option(o, "--prompt-tokens", 256, 1, 1 << 20);
  Index const continuation = count_option(o, "--continuation", 64, 1, 1 << 20);
  Index const samples = count_option(o, "--samples", 4, 1, 1 << 16);
  std::uint64_t const seed =
      o.has("--seed") ? static_cast<std::uint64_t>(kvc::tools::parse_count(o.get("--seed"), "--seed", 0)) : 0;
  std::vector<double> ratios;
  for (std::string const& r : split(o.get("--ratios", "0.5,0.75"), ','))
    ratios.push_back(kvc::tools::parse_ratio(r));
  std::vector<PolicyRun> const rows = policy_rows(o, o.get("--policies", "moment_kv"), false);
  for (auto const& row : rows) {
    if (std::string_view(row.policy->name) != "moment_kv")
      fail(exit_usage, "--policies " + row.label() + ": kvc-eval correction measures moment_kv rows only");
    auto const cfg = eval_moment_config(row.params, row.alloc, row.label());
    if (cfg.scorer.base.window_size > prompt)
      fail(exit_usage, "--param " + row.label() + ".window_size is longer than --prompt-tokens");
  }
  auto const model = load_model(model_path);
  ModelConfig const& c = model.config;
  auto const tokenizer = load_tokenizer(model);
  std::int32_t const bos = c.bos >= 0 ? c.bos : (tokenizer ? tokenizer->bos_id() : -1);
  if (bos < 0)
    fail(exit_invalid, model_path + ": no BOS token id to sample prompts from");
  std::vector<std::vector<std::int32_t>> data;
  for (Index s = 0; s < samples; ++s)  // as `kvc-eval run` samples them (fp16 cache, the same seeds)
    data.push_back(sample_tokens(model, {}, prompt + continuation + 1, bos, sample_seed(seed, s), {bos, c.eos}));
  for (auto& d : data)
    d.pop_back();  // the run's last token is a target only
  std::printf("kvc-eval correction: %s, %lld samples x (%lld prompt + %lld query tokens), fp32 K/V/Q\n",
              model_path.c_str(), static_cast<long long>(samples), static_cast<long long>(prompt),
              static_cast<long long>(continuation));
  std::vector<OrderedJson> json;
  for (auto const& row : rows) {
    auto const records = correction_errors(model, row.params, row.alloc, ratios, data, prompt);
    std::printf("\n%s\n%5s %5s %10s %12s %10s %14s %18s\n", row.label().c_str(), "ratio", "layer", "kept/head",
                "evicted mass", "plain err", "corrected err", "corrected < plain");
    for (auto const& r : records)
      for (std::size_t l = 0; l < r.layers.size(); ++l) {
        auto const& x = r.layers[l];
        std::printf("%5.2f %5zu %10.1f %12.4f %10.4f %14.4f %17.1f%%\n", r.ratio, l, x.kept, x.evicted_mass, x.plain,
                    x.corrected, 100.0 * x.wins);
        OrderedJson j;
        j["policy"] = row.label();
        j["ratio"] = json_number(r.ratio);
        j["layer"] = l;
        j["kept"] = json_number(x.kept);
        j["evicted_mass"] = json_number(x.evicted_mass);
        j["plain_error"] = json_number(x.plain);
        j["corrected_error"] = json_number(x.corrected);
        j["corrected_wins"] = json_number(x.wins);
        j["rows"] = r.rows;
        j["samples"] = r.samples;
        j["params"] = params_text(row.params);
        json.push_back(std::move(j));
      }
  }
  if (o.has("--out")) {
    Outputs files;
    files.add(o.get("--out"), json_lines(json));
    files.commit();
    std::printf("\nwrote %s\n", o.get("--out").c_str());
  }
  return 0;
}

}  // namespace kvc::eval::cli
