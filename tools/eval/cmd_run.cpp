// SPDX-License-Identifier: Apache-2.0
// tools/eval/cmd_run.cpp: `kvc-eval run`: every policy's quality (KL, top-1, perplexity) against KV cache memory on
// a model: results.json, results.csv, the plots and a side-by-side generation (docs/eval.md).
#include "common/isa.hpp"
#include "common/rdkv.hpp"
#include "common/uncomp.hpp"
#include "eval/calibrate.hpp"
#include "eval/calibration_text.hpp"
#include "eval/cli.hpp"
#include "eval/moment_kv.hpp"
#include "eval/report.hpp"
#include "eval/svg_plot.hpp"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unistd.h>
#include <utility>
#include <vector>

namespace kvc::eval::cli {

namespace fs = std::filesystem;
using kvc::tools::exit_invalid;
using kvc::tools::exit_usage;
using kvc::tools::fail;

void declare_run(Options& o) {
  o.describe(
      "Measures every policy's quality (KL, top-1, perplexity) against KV cache memory on a model.",
      "KL and top-1 agreement of the next-token distribution are against the full cache; perplexity is of the "
      "continuation.\nPrefill (the default): each row compresses the prompt once, at each of --ratios. With "
      "--decode: compression\nwhile decoding the continuation, every I tokens back to T tokens per head (no "
      "--ratios).\n"
      "POLICY: a policy of `kvc policies`, or `all` (the default: every one); random is always added as the "
      "baseline.\n"
      "+ALLOC adds budgets across heads (ada_kv) or layers (pyramid_kv), or both, e.g. snap_kv+ada_kv,\n"
      "snap_kv+pyramid_kv+ada_kv: the compressed cache is then a ragged per-head store. POLICY(NAME=VALUE,...) gives "
      "a\nrow its own parameters, so one policy can have several rows, e.g. moment_kv(mi=false,correction=true)+ada_kv;"
      "\n--param takes the row's whole name: --param 'moment_kv(mi=false)+ada_kv.n_sink=1'.\n"
      "rdkv rows pack the cache at the eviction rows' memory (floor(N (1 - ratio)) fp16-equivalent tokens per head),\n"
      "e.g. rdkv,'rdkv(reference=authors)'; kivi rows ('kivi(bits=2)', 'kivi(bits=4)') run once, at their own "
      "memory.\n"
      "TYPE: the KV cache's element type: fp16 (the default), bf16, fp32, fp8_e4m3 or fp8_e5m2 (per-layer K and V\n"
      "scales: the amax of the layer's prompt K or V over the format's largest value).\n"
      "DIR: a Hugging Face Llama directory (config.json, model.safetensors, tokenizer.json) or a llama2.c checkpoint\n"
      "(a .bin file, or a directory with one checkpoint .bin and its tok*.bin tokenizer).\n"
      "Outputs (D/results.json, results.csv, kl.svg, top1.svg, cache.svg with --decode, generation.txt) appear whole "
      "or\nnot at all. Exit codes: 0 success, 2 usage error, 3 invalid input (the message names the file).");
  o.option("--model", "DIR", "the model", true);
  o.option("--out-dir", "D", "the folder for the outputs (created if absent)", true);
  o.option("--policies", "POLICY[+ALLOC],...", "the rows (default all)");
  o.option("--ratios", "R,...", "fractions of the prompt's tokens evicted (default 0.25,0.5,0.75,0.9)");
  o.option("--prompt-tokens", "N", "prompt tokens per sample (default 256)");
  o.option("--continuation", "M", "tokens scored after the prompt (default 64)");
  o.option("--samples", "S", "samples (default 4)");
  o.option("--seed", "X", "the sampled prompts' seed (default 0)");
  o.option("--prompt-file", "TEXT", "cut the samples from this UTF-8 text (default: sampled from the full model)");
  o.option("--cache", "TYPE", "the KV cache's element type (default fp16)");
  o.option("--reference-cache", "TYPE", "the full cache KL is measured against (default: --cache)");
  o.option("--layout", "dense|paged", "the KV cache's layout (default dense)");
  o.option("--schedule", "prefill", "compress once after the prompt (the default; see --decode)");
  o.option("--decode", "interval=I,target=T[,buffer=B][,relayout=fill|compress]",
           "compress while decoding: every I tokens back to T tokens per head");
  o.option("--param", "POLICY.NAME=VALUE", "a row's parameter (repeatable)", false, true);
  o.option("--show", "POLICY@RATIO", "the compressed cache of the side-by-side generation (with --decode: POLICY)");
  o.option("--generate", "G", "greedy tokens generated side by side (default 48; 0: none)");
  o.option("--calibration", "calib.json", "uncomp rows: the head groups of `kvc-eval calibrate`");
  o.flag("--no-progress", "no progress bar on stderr");
}

namespace {

/// Checks a policy's parameters before anything is loaded (with_policy builds its scorer and throws on a bad value),
/// and what this runner cannot honour: it passes pre-RoPE window queries with the model's RoPE table, so
/// `queries=post_rope` would be recorded and ignored; a window longer than the prompt has nothing to observe.
void check_policy(PolicyRun const& p, RunOptions const& run) {
  std::string const label = p.label();
  if (auto const q = p.params.find("queries"); q != p.params.end() && q->second != "pre_rope")
    fail(exit_usage, "--param " + label + ".queries=" + q->second +
                         ": kvc-eval passes the model's pre-RoPE queries with its RoPE table (queries=pre_rope)");
  bool const decode = run.schedule == Schedule::decode;
  if (std::string_view(p.policy->name) == "uncomp") {  // its parameters, and what this runner compares
    kvc::tools::UNCompConfig const cfg = kvc::tools::uncomp_config(p.params);
    if (p.alloc.any())
      fail(exit_usage, "--policies " + label + ": uncomp allocates its own per-head budgets (no +allocator)");
    if (cfg.absolute())
      fail(exit_usage, "--param " + label + ".schedule=" + p.params.at("schedule") +
                           ": kvc-eval compares rows at equal average budgets (the ratio's); uncomp rows use "
                           "schedule=preserving");
    if (cfg.scorer.window_size > run.prompt_tokens)
      fail(exit_usage, "--param " + label + ".window_size=" + std::to_string(cfg.scorer.window_size) +
                           " is longer than --prompt-tokens " + std::to_string(run.prompt_tokens));
    return;
  }
  if (std::string_view(p.policy->name) == "moment_kv") {  // its parameters, the allocator's, and the window
    kvc::tools::MomentKVConfig const cfg = eval_moment_config(p.params, p.alloc, label);
    if (p.alloc.any())
      kvc::tools::with_selection(p.alloc, p.params, {cfg.n_sink, cfg.n_recent},
                                 decode ? std::nullopt : std::optional<double>(0.5), run.decode.target_size,
                                 run.prompt_tokens, [](auto const&) {});
    if (cfg.scorer.base.window_size > run.prompt_tokens)
      fail(exit_usage, "--param " + label + ".window_size=" + std::to_string(cfg.scorer.base.window_size) +
                           " is longer than --prompt-tokens " + std::to_string(run.prompt_tokens) +
                           " (MomentKV's base score observes the prompt's last queries)");
    return;
  }
  if (kvc::tools::is_packed_policy(p.policy->name)) {  // rdkv, kivi: their parameters and the window
    if (p.alloc.any())
      fail(exit_usage, "--policies " + label + ": rdkv and kivi allocate their own bits per token and channel (no " +
                           "+allocator)");
    kvc::tools::RDKVConfig const cfg = kvc::tools::rdkv_config(*p.policy, p.params);
    kvc::tools::check_rdkv_budget(cfg, decode ? std::nullopt : std::optional<double>(0.5), run.decode.target_size);
    if (cfg.window_size() > run.prompt_tokens)
      fail(exit_usage, "--param " + label + ".window_size=" + std::to_string(cfg.window_size()) +
                           " is longer than --prompt-tokens " + std::to_string(run.prompt_tokens) +
                           " (RDKV's weights observe the prompt's last queries)");
    return;
  }
  if (p.alloc.pyramid_kv && decode && p.params.at("reference") == "kvpress")
    fail(exit_usage, "--policies " + label +
                         ": pyramid_kv with reference=kvpress schedules from a ratio; --decode compresses to a target "
                         "size (use reference=authors)");
  kvc::tools::with_policy(*p.policy, p.params, [&](auto const& scorer, kvc::tools::Selection sel) {
    if (p.alloc.any())  // the allocators' parameters (errors exit 3, naming the parameter)
      kvc::tools::with_selection(p.alloc, p.params, sel, decode ? std::nullopt : std::optional<double>(0.5),
                                 run.decode.target_size, run.prompt_tokens, [](auto const&) {});
    if constexpr (requires { scorer.window_size; }) {
      if (run.schedule == Schedule::decode) {  // the window comes from the queries of one interval
        Index const rows = std::min(run.decode.compression_interval, run.decode.hidden_states_buffer_size);
        if (scorer.window_size > rows)
          fail(exit_usage, "--param " + label + ".window_size=" + std::to_string(scorer.window_size) +
                               " is longer than the " + std::to_string(rows) +
                               " queries a decode-time compression sees (min of --decode interval and buffer)");
        return;
      }
      if (scorer.window_size > run.prompt_tokens)
        fail(exit_usage, "--param " + label + ".window_size=" + std::to_string(scorer.window_size) +
                             " is longer than --prompt-tokens " + std::to_string(run.prompt_tokens));
      if (p.alloc.any())  // the allocators keep the window on top of the budget (tools::with_selection)
        return;
      for (double r : run.ratios)
        if (static_cast<Index>(static_cast<double>(run.prompt_tokens) * (1.0 - r)) < scorer.window_size)
          std::fprintf(stderr,
                       "kvc-eval: note: %s at ratio %.2f keeps fewer tokens than its window (%lld): the kept set is "
                       "the window's oldest tokens, with nothing of the prefix and not the newest tokens\n",
                       label.c_str(), r, static_cast<long long>(scorer.window_size));
    }
  });
}

/// The cache `--show POLICY@RATIO` picks for the side-by-side generation (default: the first policy at the middle
/// ratio).
struct Shown {
  PolicyRun const* run = nullptr;
  double ratio = 0.5;
};

Shown shown_cache(std::string const& show, RunOptions const& run) {
  Shown s{&run.policies.front(), run.ratios.size() > 1 ? run.ratios[run.ratios.size() / 2] : run.ratios.front()};
  if (show.empty())
    return s;
  auto const at = show.find('@');
  bool const decode = run.schedule == Schedule::decode;  // the schedule fixes the memory: POLICY only
  if (at == std::string::npos && !decode)
    fail(exit_usage, "--show '" + show + "': expected POLICY@RATIO");
  if (at != std::string::npos && decode)
    fail(exit_usage, "--show '" + show + "': with --decode, expected POLICY (the schedule sets the cache size)");
  s.run = nullptr;
  for (auto const& r : run.policies)
    if (r.label() == show.substr(0, at))
      s.run = &r;
  if (s.run == nullptr)
    fail(exit_usage, "--show: policy " + show.substr(0, at) + " is not in --policies");
  if (!decode)
    s.ratio = kvc::tools::parse_ratio(show.substr(at + 1));
  return s;
}

/// --decode interval=I,target=T[,buffer=B][,relayout=fill|compress]: the decode driver's schedule (kvpress's
/// DecodingPress fields), and when a ragged store (rows with an allocator) is re-laid out.
kvc::DecodeSchedule parse_decode(std::string const& text, bool& relayout_on_compress) {
  kvc::DecodeSchedule s;
  s.hidden_states_buffer_size = 256;
  bool interval = false, target = false;
  for (std::string const& item : split(text, ',')) {
    auto const eq = item.find('=');
    std::string const key = item.substr(0, eq), value = eq == std::string::npos ? "" : item.substr(eq + 1);
    if (key == "interval") {
      s.compression_interval = kvc::tools::parse_count(value, "--decode interval", 1);
      interval = true;
    } else if (key == "target") {
      s.target_size = kvc::tools::parse_count(value, "--decode target", 1);
      target = true;
    } else if (key == "buffer") {
      s.hidden_states_buffer_size = kvc::tools::parse_count(value, "--decode buffer", 1);
    } else if (key == "relayout" && (value == "fill" || value == "compress")) {
      relayout_on_compress = value == "compress";
    } else {
      fail(exit_usage, "--decode '" + text +
                           "': expected interval=I,target=T[,buffer=B][,relayout=fill|compress], not '" + item + "'");
    }
  }
  if (!interval || !target)
    fail(exit_usage, "--decode '" + text + "': expected interval=I,target=T[,buffer=B] (both interval and target)");
  if (s.compression_interval > (1 << 20) || s.target_size > (1 << 24))
    fail(exit_invalid, "--decode '" + text + "': interval at most 2^20 and target at most 2^24");
  return s;
}

/// The calibrations of the run's uncomp rows (returns what to print; empty: no uncomp row). With --calibration FILE
/// (checked against the model) every row uses it, and a row's explicit rule must be the file's. Without it, each
/// row's (groups, rule) (auto: 8, mean) gets a calibration computed with the model on the built-in calibration
/// text (eval/calibration_text.hpp; not the evaluation text: prompts are sampled from the model or read from
/// --prompt-file), 4 windows of 256 tokens (at most the model's context), the entropy's defaults; rows asking the
/// same share it.
std::string uncomp_calibration(Options const& o, Model const& model, std::optional<Tokenizer> const& tokenizer,
                               RunOptions& run) {
  ModelConfig const& c = model.config;
  std::vector<std::string> const listed = split_rows(o.get("--policies", "all"));
  if (!tokenizer && !o.has("--calibration") && std::count(listed.begin(), listed.end(), "all") > 0 &&
      std::count(listed.begin(), listed.end(), "uncomp") == 0) {  // `all` without the means to calibrate
    std::erase_if(run.policies, [](PolicyRun const& r) { return r.label() == "uncomp"; });
    std::fprintf(stderr,
                 "kvc-eval: note: the uncomp row is left out of `all`: the model has no tokenizer to encode "
                 "the built-in calibration text (pass --calibration FILE)\n");
  }
  std::string report;
  std::shared_ptr<kvc::tools::Calibration const> file;
  std::string const path = o.get("--calibration");
  std::map<std::pair<Index, int>, std::shared_ptr<kvc::tools::Calibration const>> computed;
  std::vector<std::int32_t> text;
  for (PolicyRun& row : run.policies) {
    if (std::string_view(row.policy->name) != "uncomp")
      continue;
    kvc::tools::UNCompConfig const cfg = kvc::tools::uncomp_config(row.params);
    if (o.has("--calibration")) {
      if (!file) {
        kvc::tools::Calibration cal = kvc::tools::read_calibration(path);
        kvc::tools::check_calibration_fits(cal, path, c.layers, c.heads, c.kv_heads, c.head_dim, "the model");
        file = std::make_shared<kvc::tools::Calibration const>(std::move(cal));
        report += "uncomp: head groups from " + path + "\n";
      }
      if (cfg.rule && *cfg.rule != file->rule)
        fail(exit_usage, "--param " + row.label() + ".rule=" + kvc::tools::group_rule_name(*cfg.rule) +
                             ": the calibration (" + path + ") groups by " + kvc::tools::group_rule_name(file->rule));
      row.calibration = file;
    } else {
      CalibrationOptions opts;
      opts.tokens = std::min<Index>(opts.tokens, c.context);
      opts.groups = cfg.groups > 0 ? cfg.groups : 8;
      opts.rule = cfg.rule.value_or(kvc::tools::GroupRule::mean);
      auto& cal = computed[{opts.groups, static_cast<int>(opts.rule)}];
      if (!cal) {
        if (!tokenizer)
          fail(exit_invalid,
               "uncomp rows: the model has no tokenizer to encode the built-in calibration text; pass "
               "--calibration FILE");
        std::int32_t const bos = c.bos >= 0 ? c.bos : tokenizer->bos_id();
        if (text.empty())
          text = encode_text(*tokenizer, c, "--text", "", builtin_calibration_text);
        auto const windows = calibration_windows(text, opts, bos, "the built-in calibration text");
        cal = std::make_shared<kvc::tools::Calibration const>(
            calibrate(model, windows, opts, o.get("--model"), std::string(builtin_text_name)));
        report += "uncomp: head groups from the built-in calibration text (" + std::to_string(opts.samples) +
                  " windows x " + std::to_string(opts.tokens) + " tokens, " + std::to_string(opts.groups) +
                  " groups, " + kvc::tools::group_rule_name(opts.rule) + ")\n";
      }
      row.calibration = cal;
    }
    kvc::tools::uncomp_budgets(cfg, *row.calibration, o.has("--calibration") ? path : "the built-in calibration", 0,
                               static_cast<double>(run.prompt_tokens) / 2);  // the budgets' parameters
  }
  if (report.empty() && o.has("--calibration"))
    fail(exit_usage, "--calibration given, but --policies has no uncomp row");
  return report;
}

std::string schedule_text(RunOptions const& run) {
  if (run.schedule == Schedule::prefill)
    return "prefill";
  std::string text = "decode interval=";  // += rather than "lit" + std::string (GCC 12's false -Wrestrict)
  text += std::to_string(run.decode.compression_interval);
  text += ",target=";
  text += std::to_string(run.decode.target_size);
  text += ",buffer=";
  text += std::to_string(run.decode.hidden_states_buffer_size);
  if (run.relayout_on_compress)
    text += ",relayout=compress";
  return text;
}

}  // namespace

int command_run(Options const& o) {
  std::string const model_path = o.get("--model"), dir = o.get("--out-dir");
  if (o.get("--schedule", "prefill") != "prefill")
    fail(exit_usage, "--schedule '" + o.get("--schedule") +
                         "': expected prefill (compress once after the prompt); for compression while decoding pass "
                         "--decode interval=I,target=T");
  RunOptions run;
  if (o.has("--decode")) {
    if (o.has("--schedule") || o.has("--ratios"))
      fail(exit_usage, "--decode compresses to a target size while decoding: it takes neither --schedule nor --ratios");
    run.schedule = Schedule::decode;
    run.decode = parse_decode(o.get("--decode"), run.relayout_on_compress);
  }
  run.cache = cache_options(o, "fp16");
  if (o.has("--reference-cache"))
    run.reference_type = cache_type(o.get("--reference-cache"), "--reference-cache");
  run.prompt_tokens = count_option(o, "--prompt-tokens", 256, 1, 1 << 20);
  run.continuation = count_option(o, "--continuation", 64, 1, 1 << 20);
  Index const samples = count_option(o, "--samples", 4, 1, 1 << 16);
  Index const generate = count_option(o, "--generate", 48, 0, 1 << 16);
  std::uint64_t seed = 0;
  if (o.has("--seed"))
    seed = static_cast<std::uint64_t>(kvc::tools::parse_count(o.get("--seed"), "--seed", 0));
  run.seed = seed;
  for (std::string const& r : split(o.get("--ratios", "0.25,0.5,0.75,0.9"), ','))
    run.ratios.push_back(kvc::tools::parse_ratio(r));

  // Policies: the listed ones (default: every policy of the table), random always included as the baseline.
  for (PolicyRun& r : policy_rows(o, o.get("--policies", "all"), true)) {
    run.policies.push_back(std::move(r));
    check_policy(run.policies.back(), run);
  }
  Shown shown = shown_cache(o.get("--show"), run);

  auto const model = load_model(model_path);
  auto const tokenizer = load_tokenizer(model);
  ModelConfig const& c = model.config;
  std::size_t const rows = run.policies.size();
  std::string const calibration_source = uncomp_calibration(o, model, tokenizer, run);
  if (run.policies.size() != rows)  // a row was left out: the shown row again
    shown = shown_cache(o.get("--show"), run);
  Index const length = run.prompt_tokens + run.continuation + 1;
  if (length > c.context)
    std::fprintf(stderr,
                 "kvc-eval: warning: %lld tokens per sample exceed the model's context (%lld): its keys are out of "
                 "distribution past it\n",
                 static_cast<long long>(length), static_cast<long long>(c.context));

  // Samples: cut from a text, or sampled from the full model from BOS (temperature 1, BOS/EOS never sampled).
  std::vector<std::vector<std::int32_t>> data;
  std::string source = "sampled from the full model";
  std::int32_t const bos = c.bos >= 0 ? c.bos : (tokenizer ? tokenizer->bos_id() : -1);
  if (o.has("--prompt-file")) {
    std::string const path = o.get("--prompt-file");
    if (!tokenizer)
      fail(exit_invalid, "--prompt-file " + path + ": the model has no tokenizer next to it to encode the text");
    std::vector<std::byte> bytes;
    std::string error;
    // 4 MiB of text is thousands of samples; the bound also bounds the tokenizer's working memory (a text without
    // pre-tokenizer is one BPE word, about 40 bytes per character).
    if (!kvc::read_regular_file(path, bytes, error, 4u << 20))
      fail(exit_invalid, "--prompt-file " + path + ": " + error);
    std::vector<std::int32_t> const text =
        tokenizer->encode({reinterpret_cast<char const*>(bytes.data()), bytes.size()});
    for (std::size_t i = 0; i < text.size(); ++i)
      if (text[i] < 0 || text[i] >= c.vocab)
        fail(exit_invalid, "--prompt-file " + path + ": the tokenizer gives id " + std::to_string(text[i]) +
                               " (token " + std::to_string(i) + "), outside the model's vocabulary [0, " +
                               std::to_string(c.vocab) + ")");
    Index const per = length - (bos >= 0 ? 1 : 0);
    if (static_cast<Index>(text.size()) < samples * per)
      fail(exit_invalid, "--prompt-file " + path + ": " + std::to_string(text.size()) + " tokens, but " +
                             std::to_string(samples) + " samples of " + std::to_string(per) + " need " +
                             std::to_string(samples * per));
    for (Index s = 0; s < samples; ++s) {
      std::vector<std::int32_t> sample;
      if (bos >= 0)
        sample.push_back(bos);
      sample.insert(sample.end(), text.begin() + s * per, text.begin() + (s + 1) * per);
      data.push_back(std::move(sample));
    }
    source = path;
  } else {
    if (bos < 0)
      fail(exit_invalid, model_path +
                             ": no BOS token id (config.json bos_token_id) to sample prompts from; give "
                             "--prompt-file");
    for (Index s = 0; s < samples; ++s)
      data.push_back(sample_tokens(model, run.sampling_cache(), length, bos, sample_seed(seed, s), {bos, c.eos}));
  }
  make_directory(dir);

  bool const progress_bar = !o.has("--no-progress") && isatty(STDERR_FILENO);
  std::printf(
      "kvc-eval: %s (%s, %lld layers, %lld/%lld heads, d %lld), %s %s cache (against a full %s cache), %lld samples "
      "x (%lld prompt + %lld continuation tokens), prompts %s\n",
      model_path.c_str(), c.format.c_str(), static_cast<long long>(c.layers), static_cast<long long>(c.heads),
      static_cast<long long>(c.kv_heads), static_cast<long long>(c.head_dim), cache_type_name(run.cache.type),
      run.cache.layout == CacheLayout::paged ? "paged" : "dense", cache_type_name(run.reference_cache().type),
      static_cast<long long>(samples), static_cast<long long>(run.prompt_tokens),
      static_cast<long long>(run.continuation), source.c_str());
  std::fputs(calibration_source.c_str(), stdout);
  std::fflush(stdout);
  auto const records = evaluate(model, run, data, [&](Index done, Index total, std::string const& p, double r) {
    if (!progress_bar)
      return;
    int const width = 30, filled = total > 0 ? static_cast<int>(width * done / total) : width;
    std::fprintf(stderr, "\r[%s%s] %lld/%lld %-14s %.2f", std::string(static_cast<std::size_t>(filled), '#').c_str(),
                 std::string(static_cast<std::size_t>(width - filled), ' ').c_str(), static_cast<long long>(done),
                 static_cast<long long>(total), p.c_str(), r);
    if (done == total)
      std::fprintf(stderr, "\r%*s\r", width + 40, "");
    std::fflush(stderr);
  });
  std::printf("full cache: perplexity %.3f of the continuation\n",
              records.empty() ? 0.0 : records.front().perplexity_full);
  std::string const table = results_table(records);
  std::fputs(table.c_str(), stdout);

  // Greedy generation with the full cache and one compressed cache, side by side.
  std::string generation;
  if (generate > 0 && tokenizer) {
    PolicyRun const* chosen = shown.run;
    std::string const show_policy = chosen->label();
    double const show_ratio = shown.ratio;
    std::vector<std::int32_t> const prompt(data[0].begin(), data[0].begin() + run.prompt_tokens);
    auto full = make_session(model, run.cache, run.prompt_tokens + generate);
    full->set_calibration(chosen->calibration);
    RowMatrix last;
    if (auto const st = full->forward(prompt, last); !st.ok())
      fail(exit_invalid, std::string("generation: ") + st.message());
    RowMatrix last_compressed = last.bottomRows(1);  // the stage variant prefills on its own
    auto compressed = row_session(model, run.cache, run.prompt_tokens + generate, *full, *chosen, run.calibration,
                                  prompt, &last_compressed);
    double seconds = 0;
    bool const decode = run.schedule == Schedule::decode;
    kvc::Status const st =
        decode ? compressed->begin_decode(*chosen->policy, chosen->params, run.decode, 0, chosen->alloc,
                                          run.relayout_on_compress)
               : compressed->compress(*chosen->policy, chosen->params, show_ratio, seconds, 0, chosen->alloc);
    if (!st.ok())
      fail(exit_invalid, std::string("generation: ") + st.message());
    auto const a = greedy(*full, last, generate);
    auto const b = greedy(*compressed, last_compressed, generate);
    char title[160];
    if (decode && std::string_view(chosen->policy->name) == "moment_kv")  // Algorithm 1: every token
      std::snprintf(title, sizeof title, "%s, target %lld", show_policy.c_str(),
                    static_cast<long long>(run.decode.target_size));
    else if (decode)
      std::snprintf(title, sizeof title, "%s, target %lld every %lld", show_policy.c_str(),
                    static_cast<long long>(run.decode.target_size),
                    static_cast<long long>(run.decode.compression_interval));
    else
      std::snprintf(title, sizeof title, "%s at ratio %.2f", show_policy.c_str(), show_ratio);
    std::vector<std::int32_t> const tail(prompt.end() - std::min<Index>(32, run.prompt_tokens), prompt.end());
    generation = "prompt (last tokens): ..." + tokenizer->decode(tail) + "\n\ngreedy continuation of " +
                 std::to_string(generate) + " tokens:\n" +
                 side_by_side("full cache", tokenizer->decode(a), title, tokenizer->decode(b));
    std::printf("\n%s", generation.c_str());
  }

  RunInfo const info{model_path,
                     cache_type_name(run.cache.type),
                     cache_type_name(run.reference_cache().type),
                     run.cache.layout == CacheLayout::paged ? "paged" : "dense",
                     run.prompt_tokens,
                     run.continuation,
                     seed,
                     source,
                     schedule_text(run),
                     kvc::tools::compiled_isa()};
  std::string const name = fs::path(model_path).filename().string();
  Outputs files;
  files.add(dir + "/results.json", results_json(records, run.policies, info));
  files.add(dir + "/results.csv", results_csv(records));
  files.add(dir + "/kl.svg", render_svg(quality_plot(records, name + ": KL against memory", true)));
  files.add(dir + "/top1.svg", render_svg(quality_plot(records, name + ": top-1 agreement against memory", false)));
  bool const decode = run.schedule == Schedule::decode;
  if (decode && !records.empty()) {  // the full cache grows by one token per step from the prompt's bytes
    double const m = static_cast<double>(run.continuation), n = static_cast<double>(run.prompt_tokens);
    double const per_token = records.front().kv_bytes_full / (n + (m + 1) / 2);
    files.add(dir + "/cache.svg",
              render_svg(cache_plot(records, name + ": KV cache held while decoding (" + info.schedule + ")",
                                    per_token * n, per_token)));
  }
  if (!generation.empty())
    files.add(dir + "/generation.txt", generation);
  files.commit();
  std::printf("\nwrote %s/results.json, results.csv, kl.svg, top1.svg%s%s (plots: open the .svg files in a browser)\n",
              dir.c_str(), decode ? ", cache.svg" : "", generation.empty() ? "" : ", generation.txt");
  return 0;
}

}  // namespace kvc::eval::cli
