// SPDX-License-Identifier: Apache-2.0
// tools/eval/main.cpp: `kvc-eval`, what each policy costs and preserves on a real model (docs/eval.md).
//
//   kvc-eval run    --model DIR --out-dir D [--policies a,b] [--ratios r,...] [--prompt-tokens N] [--decode ...]
//                   [--continuation M] [--samples S] [--seed X] [--prompt-file F] [--cache TYPE]
//                   [--layout dense|paged] [--param POLICY.NAME=VALUE]... [--show POLICY@RATIO] [--generate G]
//   kvc-eval logits --model DIR --tokens T.npy --out L.npy [--cache ...] [--layout ...]
//   kvc-eval dump   --model DIR --tokens T.npy --out-dir D
//   kvc-eval correction --model DIR [--policies ROW,...] [--ratios R,...] [--prompt-tokens N] [--continuation M]
//                   [--samples S] [--seed X] [--param ROW.NAME=VALUE]... [--out F.json]
//   kvc-eval calibrate --model DIR --out calib.json [--text FILE] [--samples S] [--tokens N] [--groups M]
//                   [--rule mean|majority_vote] [--param NAME=VALUE]...
// Exit codes as kvc's: 0 success, 2 usage error, 3 invalid input (the message names the file); outputs appear whole
// or not at all (staged, then committed together).

#include "common/policies.hpp"
#include "common/rdkv.hpp"
#include "common/uncomp.hpp"
#include "eval/calibrate.hpp"
#include "eval/correction.hpp"
#include "eval/engine.hpp"
#include "eval/model.hpp"
#include "eval/moment_kv.hpp"
#include "eval/report.hpp"
#include "eval/run.hpp"
#include "eval/svg_plot.hpp"
#include "eval/tokenizer.hpp"
#include "io/file.hpp"
#include "io/npy.hpp"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <map>
#include <new>
#include <optional>
#include <string>
#include <string_view>
#include <sys/stat.h>
#include <unistd.h>
#include <utility>
#include <vector>

namespace {

namespace fs = std::filesystem;
using kvc::Index;
using kvc::tools::exit_invalid;
using kvc::tools::exit_usage;
using kvc::tools::fail;

constexpr char usage_text[] =
    "usage:\n"
    "  kvc-eval run    --model DIR --out-dir D [--policies P[+ALLOC],...] [--ratios R,...] [--prompt-tokens N]\n"
    "                  [--continuation M] [--samples S] [--seed X] [--prompt-file TEXT] [--cache TYPE]\n"
    "                  [--layout dense|paged] [--schedule prefill] [--param POLICY.NAME=VALUE]...\n"
    "                  [--show POLICY@RATIO] [--generate G] [--no-progress] [--calibration calib.json]\n"
    "                  [--reference-cache TYPE] (the full cache KL is measured against; default: --cache)\n"
    "  kvc-eval run    ... --decode interval=I,target=T[,buffer=B][,relayout=fill|compress] [--show POLICY]\n"
    "                  (no --ratios: compression while decoding the continuation, every I tokens back to T per head)\n"
    "  kvc-eval logits --model DIR --tokens T.npy --out L.npy [--cache TYPE] [--layout dense|paged]\n"
    "  kvc-eval dump   --model DIR --tokens T.npy --out-dir D\n"
    "  kvc-eval correction --model DIR [--policies ROW,...] [--ratios R,...] [--prompt-tokens N] [--continuation M]\n"
    "                  [--samples S] [--seed X] [--param ROW.NAME=VALUE]... [--out F.json]\n"
    "                  (MomentKV's corrected vs plain attention error per layer, same kept set; rows: moment_kv)\n"
    "  kvc-eval calibrate --model DIR --out calib.json [--text FILE] [--samples S] [--tokens N] [--groups M]\n"
    "                  [--rule mean|majority_vote] [--param NAME=VALUE]...\n"
    "                  (UNComp's head groups from the query entropies of S windows of N tokens of FILE, default a\n"
    "                  built-in text; --param top_k=auto (d/4), normalize_rows=true, renormalize_topk=false, ridge=0)\n"
    "P: a policy of `kvc policies`, or `all` (the default: every one); +ALLOC adds budgets across heads (ada_kv) or\n"
    "layers (pyramid_kv), or both, e.g. snap_kv+ada_kv, snap_kv+pyramid_kv+ada_kv: the compressed cache is then a\n"
    "ragged per-head store. POLICY(NAME=VALUE,...) gives a row its own parameters, so one policy can have several\n"
    "rows, e.g. moment_kv(mi=false,correction=true)+ada_kv; --param takes the row's whole name:\n"
    "--param 'moment_kv(mi=false)+ada_kv.n_sink=1'.\n"
    "rdkv rows pack the cache at the eviction rows' memory (floor(N (1 - ratio)) fp16-equivalent tokens per head),\n"
    "e.g. rdkv,'rdkv(reference=authors)'; kivi rows ('kivi(bits=2)', 'kivi(bits=4)') run once, at their own memory.\n"
    "TYPE: the KV cache's element type: fp16 (run's default), bf16, fp32 (logits' default), fp8_e4m3 or fp8_e5m2\n"
    "(per-layer K and V scales: the amax of the layer's prompt K or V over the format's largest value).\n"
    "DIR: a Hugging Face Llama directory (config.json, model.safetensors, tokenizer.json) or a llama2.c checkpoint\n"
    "(a .bin file, or a directory with one checkpoint .bin and its tok*.bin tokenizer). See docs/eval.md.\n";

/// Parsed `--name value` options of one command; a name given twice or not in `allowed` is a usage error.
struct Options {
  std::multimap<std::string, std::string> values;
  bool has(std::string const& k) const { return values.count(k) > 0; }
  std::string get(std::string const& k, std::string const& fallback = "") const {
    auto const it = values.find(k);
    return it == values.end() ? fallback : it->second;
  }
  std::string need(std::string const& k) const {
    if (!has(k))
      fail(exit_usage, "missing " + k);
    return get(k);
  }
};

Options parse_options(int argc, char** argv, std::vector<std::string> const& allowed,
                      std::vector<std::string> const& flags) {
  Options o;
  for (int i = 2; i < argc; ++i) {
    std::string a = argv[i], value;
    if (auto const eq = a.find('='); a.rfind("--", 0) == 0 && eq != std::string::npos) {
      value = a.substr(eq + 1);
      a = a.substr(0, eq);
    } else if (std::find(flags.begin(), flags.end(), a) != flags.end()) {
      value = "1";
    } else if (i + 1 < argc) {
      value = argv[++i];
    } else {
      fail(exit_usage, a + " needs a value");
    }
    bool const flag = std::find(flags.begin(), flags.end(), a) != flags.end();
    if (!flag && std::find(allowed.begin(), allowed.end(), a) == allowed.end())
      fail(exit_usage, "unknown option '" + a + "' for kvc-eval " + argv[1]);
    if (a != "--param" && o.has(a))
      fail(exit_usage, a + " given twice");
    o.values.emplace(a, value);
  }
  return o;
}

Index count_option(Options const& o, std::string const& name, Index fallback, Index min, Index max) {
  if (!o.has(name))
    return fallback;
  Index const v = kvc::tools::parse_count(o.get(name), name, min);
  if (v > max)
    fail(exit_invalid, name + " = " + o.get(name) + ": expected at most " + std::to_string(max));
  return v;
}

std::vector<std::string> split(std::string const& s, char sep) {
  std::vector<std::string> out;
  std::size_t start = 0;
  while (true) {
    std::size_t const end = s.find(sep, start);
    out.push_back(s.substr(start, end - start));
    if (end == std::string::npos)
      return out;
    start = end + 1;
  }
}

/// Splits a --policies list at the commas outside parentheses (a row's own parameters hold commas).
std::vector<std::string> split_rows(std::string const& s) {
  std::vector<std::string> out;
  std::string item;
  int depth = 0;
  for (char ch : s) {
    if (ch == ',' && depth == 0) {
      out.push_back(std::exchange(item, {}));
      continue;
    }
    depth += ch == '(' ? 1 : (ch == ')' ? -1 : 0);
    if (depth < 0 || depth > 1)
      fail(exit_usage, "--policies '" + s + "': unbalanced or nested parentheses");
    item += ch;
  }
  if (depth != 0)
    fail(exit_usage, "--policies '" + s + "': unbalanced parentheses");
  out.push_back(item);
  return out;
}

/// A row of --policies: SCORER[(NAME=VALUE,...)][+ALLOCATOR[+ALLOCATOR]].
struct RowName {
  std::string scorer, inline_params, allocators;
  bool has_allocators = false;  ///< a `+` after the scorer (and its parentheses)
};

RowName parse_row(std::string const& name) {
  RowName r;
  std::size_t const open = name.find('('), plus = name.find('+');
  if (open == std::string::npos || (plus != std::string::npos && plus < open)) {
    r.scorer = name.substr(0, plus);
    r.has_allocators = plus != std::string::npos;
    if (r.has_allocators)
      r.allocators = name.substr(plus + 1);
    return r;
  }
  std::size_t const close = name.find(')', open);
  std::string const rest = name.substr(close + 1);
  if (close == open + 1 || (!rest.empty() && rest[0] != '+'))
    fail(exit_usage, "--policies '" + name +
                         "': expected POLICY(NAME=VALUE,...)[+ALLOCATOR], e.g. "
                         "moment_kv(mi=false,correction=true)+ada_kv");
  r.scorer = name.substr(0, open);
  r.inline_params = name.substr(open + 1, close - open - 1);
  r.has_allocators = !rest.empty();
  if (r.has_allocators)
    r.allocators = rest.substr(1);
  return r;
}

/// The row name and the parameter of `--param ROW.NAME=VALUE` (the row may hold dots inside its parentheses).
std::pair<std::string, std::string> param_target(std::string const& text) {
  std::size_t from = 0;
  if (std::size_t const open = text.find('('); open != std::string::npos && open < text.find('.'))
    from = text.find(')', open);
  std::size_t const dot = from == std::string::npos ? std::string::npos : text.find('.', from);
  if (dot == std::string::npos || dot == 0)
    fail(exit_usage, "--param '" + text + "': expected POLICY.NAME=VALUE, e.g. snap_kv.window_size=16");
  return {text.substr(0, dot), text.substr(dot + 1)};
}

/// The cache element type named `type` (given as `option`); a usage error naming the choices otherwise.
kvc::eval::CacheType cache_type(std::string const& type, std::string const& option) {
  for (auto const t : {kvc::eval::CacheType::f16, kvc::eval::CacheType::bf16, kvc::eval::CacheType::f32,
                       kvc::eval::CacheType::f8_e4m3, kvc::eval::CacheType::f8_e5m2})
    if (type == kvc::eval::cache_type_name(t))
      return t;
  fail(exit_usage, option + " '" + type + "': expected fp16, bf16, fp32, fp8_e4m3 or fp8_e5m2");
}

kvc::eval::CacheOptions cache_options(Options const& o, std::string const& default_type) {
  kvc::eval::CacheOptions c;
  std::string const layout = o.get("--layout", "dense");
  c.type = cache_type(o.get("--cache", default_type), "--cache");
  if (layout == "dense")
    c.layout = kvc::eval::CacheLayout::dense;
  else if (layout == "paged")
    c.layout = kvc::eval::CacheLayout::paged;
  else
    fail(exit_usage, "--layout '" + layout + "': expected dense or paged");
  return c;
}

kvc::eval::Model load_model(std::string const& path) {
  kvc::eval::Model model;
  std::string error;
  if (!kvc::eval::Model::load(path, model, error))
    fail(exit_invalid, error);
  return model;
}

/// The tokenizer next to the model: tokenizer.json (Hugging Face), or tokenizer.bin / the one tok*.bin (llama2.c).
std::optional<kvc::eval::Tokenizer> load_tokenizer(kvc::eval::Model const& model) {
  fs::path const dir = fs::path(model.weights_path).parent_path();
  kvc::eval::Tokenizer tok;
  std::string error;
  if (model.config.format == "huggingface") {
    if (!fs::exists(dir / "tokenizer.json"))
      return std::nullopt;
    if (!kvc::eval::Tokenizer::load_json((dir / "tokenizer.json").string(), tok, error))
      fail(exit_invalid, error);
    return tok;
  }
  std::vector<fs::path> candidates;
  std::error_code ec;
  for (auto const& e : fs::directory_iterator(dir.empty() ? fs::path(".") : dir, ec))
    if (kvc::eval::is_llama2c_tokenizer(e.path()))
      candidates.push_back(e.path());
  if (candidates.empty())
    return std::nullopt;
  if (candidates.size() > 1)
    fail(exit_invalid, dir.string() + ": " + std::to_string(candidates.size()) +
                           " llama2.c tokenizers (tok*.bin) next to the checkpoint; keep the one that belongs to it");
  if (!kvc::eval::Tokenizer::load_llama2c(candidates[0].string(), static_cast<std::int32_t>(model.config.vocab), tok,
                                          error))
    fail(exit_invalid, error);
  return tok;
}

/// A 1-D int32/int64 token array from a .npy file, every id inside the vocabulary, at most `context` tokens (the
/// model's trained positions: past them its keys are out of distribution, and attention's cost grows as n^2).
std::vector<std::int32_t> load_tokens(std::string const& path, Index vocab, Index context) {
  kvc::NpyArray a;
  std::string error;
  if (!kvc::read_npy(path, a, error, 1u << 30))
    fail(exit_invalid, "tokens file " + path + ": " + error);
  if (a.shape.size() != 1 || (a.dtype != kvc::NpyDtype::i32 && a.dtype != kvc::NpyDtype::i64))
    fail(exit_invalid, "tokens file " + path + ": expected a 1-D int32 or int64 array");
  if (a.shape[0] < 1)
    fail(exit_invalid, "tokens file " + path + ": expected at least one token");
  if (a.shape[0] > context)
    fail(exit_invalid, "tokens file " + path + ": " + std::to_string(a.shape[0]) + " tokens, more than the model's " +
                           std::to_string(context) + " positions");
  std::vector<std::int32_t> tokens(static_cast<std::size_t>(a.shape[0]));
  for (Index i = 0; i < a.shape[0]; ++i) {
    std::int64_t const t = a.dtype == kvc::NpyDtype::i32 ? a.as<std::int32_t>()[i] : a.as<std::int64_t>()[i];
    if (t < 0 || t >= vocab)
      fail(exit_invalid, "tokens file " + path + ": token " + std::to_string(i) + " is " + std::to_string(t) +
                             ", outside the vocabulary [0, " + std::to_string(vocab) + ")");
    tokens[static_cast<std::size_t>(i)] = static_cast<std::int32_t>(t);
  }
  return tokens;
}

/// Output files staged beside their destinations and committed together (all or none).
class Outputs {
 public:
  void add(std::string const& path, std::string const& text) {
    add(path, std::span(reinterpret_cast<std::byte const*>(text.data()), text.size()));
  }
  void add(std::string const& path, std::span<std::byte const> bytes) {
    std::string error;
    files_.emplace_back();
    if (!files_.back().open(path, error) || !files_.back().write(bytes, error) || !files_.back().finish(error))
      fail(exit_invalid, path + ": " + error);
  }
  void commit() {
    std::string error;
    std::size_t failed = 0;
    if (!kvc::commit_together(files_, error, failed))
      fail(exit_invalid, files_[failed].path() + ": " + error);
    files_.clear();
  }

 private:
  std::vector<kvc::StagedFile> files_;
};

void make_directory(std::string const& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec || !fs::is_directory(dir))
    fail(exit_invalid, "--out-dir " + dir + ": cannot create the directory (" + ec.message() + ")");
}

/// Checks a policy's parameters before anything is loaded (with_policy builds its scorer and throws on a bad value),
/// and what this runner cannot honour: it passes pre-RoPE window queries with the model's RoPE table, so
/// `queries=post_rope` would be recorded and ignored; a window longer than the prompt has nothing to observe.
void check_policy(kvc::eval::PolicyRun const& p, kvc::eval::RunOptions const& run) {
  std::string const label = p.label();
  if (auto const q = p.params.find("queries"); q != p.params.end() && q->second != "pre_rope")
    fail(exit_usage, "--param " + label + ".queries=" + q->second +
                         ": kvc-eval passes the model's pre-RoPE queries with its RoPE table (queries=pre_rope)");
  bool const decode = run.schedule == kvc::eval::Schedule::decode;
  if (std::string_view(p.policy->name) == "uncomp") {  // its parameters, and what this runner compares
    kvc::tools::UNCompConfig const cfg = kvc::tools::uncomp_config(p.params);
    if (p.alloc.any())
      fail(exit_usage, "--policies " + label + ": uncomp allocates its own per-head budgets (no +allocator)");
    if (cfg.absolute())
      fail(exit_usage, "--param " + label + ".schedule=" + p.params.at("schedule") +
                           ": kvc-eval compares rows at equal average budgets (the ratio's); uncomp rows use "
                           "schedule=preserving");
    if (cfg.window_size > run.prompt_tokens)
      fail(exit_usage, "--param " + label + ".window_size=" + std::to_string(cfg.window_size) +
                           " is longer than --prompt-tokens " + std::to_string(run.prompt_tokens));
    return;
  }
  if (std::string_view(p.policy->name) == "moment_kv") {  // its parameters, the allocator's, and the window
    kvc::tools::MomentKVConfig const cfg = kvc::eval::eval_moment_config(p.params, p.alloc, label);
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
      if (run.schedule == kvc::eval::Schedule::decode) {  // the window comes from the queries of one interval
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
  kvc::eval::PolicyRun const* run = nullptr;
  double ratio = 0.5;
};

Shown shown_cache(std::string const& show, kvc::eval::RunOptions const& run) {
  Shown s{&run.policies.front(), run.ratios.size() > 1 ? run.ratios[run.ratios.size() / 2] : run.ratios.front()};
  if (show.empty())
    return s;
  auto const at = show.find('@');
  bool const decode = run.schedule == kvc::eval::Schedule::decode;  // the schedule fixes the memory: POLICY only
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

// ---------------------------------------------------------------------------------------------------------------

int command_logits(int argc, char** argv) {
  Options const o = parse_options(argc, argv, {"--model", "--tokens", "--out", "--cache", "--layout"}, {});
  auto const model = load_model(o.need("--model"));
  auto const tokens = load_tokens(o.need("--tokens"), model.config.vocab, model.config.context);
  std::string const out = o.need("--out");
  auto session = kvc::eval::make_session(model, cache_options(o, "fp32"), static_cast<Index>(tokens.size()));
  kvc::eval::RowMatrix logits;
  if (auto const st = session->forward(tokens, logits); !st.ok())
    fail(exit_invalid, std::string("forward: ") + st.message());
  Index const shape[2] = {logits.rows(), logits.cols()};
  Outputs files;
  files.add(out, kvc::serialize_npy(kvc::NpyDtype::f32, shape, logits.data()));
  files.commit();
  return 0;
}

int command_dump(int argc, char** argv) {
  Options const o = parse_options(argc, argv, {"--model", "--tokens", "--out-dir"}, {});
  std::string const model_path = o.need("--model");
  auto const model = load_model(model_path);
  auto const tokens = load_tokens(o.need("--tokens"), model.config.vocab, model.config.context);
  std::string const dir = o.need("--out-dir");
  kvc::eval::ModelConfig const& c = model.config;
  Index const n = static_cast<Index>(tokens.size()), d = c.head_dim;
  // An fp32 dense session: its cache holds exactly the post-RoPE keys and the values (no rounding).
  auto session = kvc::eval::make_session(model, {kvc::eval::CacheType::f32, kvc::eval::CacheLayout::dense}, n);
  kvc::eval::RowMatrix logits;
  kvc::eval::ForwardTrace trace;
  trace.projections = true;
  if (auto const st = session->forward(tokens, logits, &trace); !st.ok())
    fail(exit_invalid, std::string("forward: ") + st.message());
  make_directory(dir);
  Outputs files;
  Index const kv_shape[4] = {1, c.kv_heads, n, d}, q_shape[4] = {1, c.heads, n, d}, t_shape[1] = {n};
  std::vector<std::int64_t> ids(tokens.begin(), tokens.end());
  files.add(dir + "/tokens.npy", kvc::serialize_npy(kvc::NpyDtype::i64, t_shape, ids.data()));
  auto const& layers = trace.qkv;
  for (std::size_t l = 0; l < layers.size(); ++l) {
    std::string const ld = dir + "/layer" + std::to_string(l);
    make_directory(ld);
    files.add(ld + "/keys.npy", kvc::serialize_npy(kvc::NpyDtype::f32, kv_shape, layers[l].keys.data()));
    files.add(ld + "/values.npy", kvc::serialize_npy(kvc::NpyDtype::f32, kv_shape, layers[l].values.data()));
    files.add(ld + "/queries.npy", kvc::serialize_npy(kvc::NpyDtype::f32, q_shape, layers[l].queries.data()));
    files.add(ld + "/queries_prerope.npy",
              kvc::serialize_npy(kvc::NpyDtype::f32, q_shape, layers[l].queries_prerope.data()));
  }
  std::string meta = "{\n  \"model\": " + kvc::eval::json_string(model_path) + ",\n  \"format\": \"" + c.format +
                     "\",\n  \"tokens\": " + std::to_string(n) + ",\n  \"layers\": " + std::to_string(c.layers) +
                     ",\n  \"query_heads\": " + std::to_string(c.heads) +
                     ",\n  \"kv_heads\": " + std::to_string(c.kv_heads) + ",\n  \"head_dim\": " + std::to_string(d) +
                     ",\n  \"rope\": {\"theta\": " + kvc::eval::json_number(c.rope_theta) + ", \"style\": \"" +
                     (c.rope_style == kvc::RopeStyle::neox ? "neox" : "interleaved") +
                     "\", \"scaled\": " + (c.inv_freq.empty() ? "false" : "true") +
                     "},\n  \"files\": \"layer<L>/keys.npy, values.npy [1, kv_heads, tokens, head_dim] (keys "
                     "post-RoPE), queries.npy (post-RoPE) and queries_prerope.npy [1, query_heads, tokens, "
                     "head_dim], float32; tokens.npy int64\"\n}\n";
  files.add(dir + "/meta.json", meta);
  if (auto tok = load_tokenizer(model)) {  // the text without its BOS (llama2.c's decoder renders it as "\n<s>\n")
    std::span<std::int32_t const> text(tokens);
    if (!text.empty() && text.front() == c.bos)
      text = text.subspan(1);
    files.add(dir + "/story.txt", tok->decode(text) + "\n");
  }
  files.commit();
  std::printf("kvc-eval dump: %lld tokens, %lld layers written to %s\n", static_cast<long long>(n),
              static_cast<long long>(c.layers), dir.c_str());
  return 0;
}

std::vector<kvc::eval::PolicyRun> policy_rows(Options const& o, std::string const& list, bool add_random);

/// `kvc-eval correction`: MomentKV's corrected and plain attention errors per layer on the same kept set
/// (eval/correction.hpp), for moment_kv rows, on prompts sampled from the model as `kvc-eval run` samples them.
int command_correction(int argc, char** argv) {
  Options const o = parse_options(argc, argv,
                                  {"--model", "--policies", "--ratios", "--prompt-tokens", "--continuation",
                                   "--samples", "--seed", "--param", "--out"},
                                  {});
  std::string const model_path = o.need("--model");
  Index const prompt = count_option(o, "--prompt-tokens", 256, 1, 1 << 20);
  Index const continuation = count_option(o, "--continuation", 64, 1, 1 << 20);
  Index const samples = count_option(o, "--samples", 4, 1, 1 << 16);
  std::uint64_t const seed =
      o.has("--seed") ? static_cast<std::uint64_t>(kvc::tools::parse_count(o.get("--seed"), "--seed", 0)) : 0;
  std::vector<double> ratios;
  for (std::string const& r : split(o.get("--ratios", "0.5,0.75"), ','))
    ratios.push_back(kvc::tools::parse_ratio(r));
  std::vector<kvc::eval::PolicyRun> const rows = policy_rows(o, o.get("--policies", "moment_kv"), false);
  for (auto const& row : rows) {
    if (std::string_view(row.policy->name) != "moment_kv")
      fail(exit_usage, "--policies " + row.label() + ": kvc-eval correction measures moment_kv rows only");
    auto const cfg = kvc::eval::eval_moment_config(row.params, row.alloc, row.label());
    if (cfg.scorer.base.window_size > prompt)
      fail(exit_usage, "--param " + row.label() + ".window_size is longer than --prompt-tokens");
  }
  auto const model = load_model(model_path);
  kvc::eval::ModelConfig const& c = model.config;
  auto const tokenizer = load_tokenizer(model);
  std::int32_t const bos = c.bos >= 0 ? c.bos : (tokenizer ? tokenizer->bos_id() : -1);
  if (bos < 0)
    fail(exit_invalid, model_path + ": no BOS token id to sample prompts from");
  std::vector<std::vector<std::int32_t>> data;
  for (Index s = 0; s < samples; ++s)  // as `kvc-eval run` samples them (fp16 cache, the same seeds)
    data.push_back(kvc::eval::sample_tokens(model, {}, prompt + continuation + 1, bos,
                                            seed * 0x9E3779B97F4A7C15ull + static_cast<std::uint64_t>(s),
                                            {bos, c.eos}));
  for (auto& d : data)
    d.pop_back();  // the run's last token is a target only
  std::printf("kvc-eval correction: %s, %lld samples x (%lld prompt + %lld query tokens), fp32 K/V/Q\n",
              model_path.c_str(), static_cast<long long>(samples), static_cast<long long>(prompt),
              static_cast<long long>(continuation));
  std::string json = "[\n";
  bool first = true;
  for (auto const& row : rows) {
    auto const records = kvc::eval::correction_errors(model, row.params, row.alloc, ratios, data, prompt);
    std::printf("\n%s\n%5s %5s %10s %12s %10s %14s %18s\n", row.label().c_str(), "ratio", "layer", "kept/head",
                "evicted mass", "plain err", "corrected err", "corrected < plain");
    for (auto const& r : records)
      for (std::size_t l = 0; l < r.layers.size(); ++l) {
        auto const& x = r.layers[l];
        std::printf("%5.2f %5zu %10.1f %12.4f %10.4f %14.4f %17.1f%%\n", r.ratio, l, x.kept, x.evicted_mass, x.plain,
                    x.corrected, 100.0 * x.wins);
        json += std::string(first ? "" : ",\n") + "  {\"policy\": " + kvc::eval::json_string(row.label()) +
                ", \"ratio\": " + kvc::eval::json_number(r.ratio) + ", \"layer\": " + std::to_string(l) +
                ", \"kept\": " + kvc::eval::json_number(x.kept) +
                ", \"evicted_mass\": " + kvc::eval::json_number(x.evicted_mass) +
                ", \"plain_error\": " + kvc::eval::json_number(x.plain) +
                ", \"corrected_error\": " + kvc::eval::json_number(x.corrected) +
                ", \"corrected_wins\": " + kvc::eval::json_number(x.wins) + ", \"rows\": " + std::to_string(r.rows) +
                ", \"samples\": " + std::to_string(r.samples) +
                ", \"params\": " + kvc::eval::json_string(kvc::eval::params_text(row.params)) + "}";
        first = false;
      }
  }
  json += "\n]\n";
  if (o.has("--out")) {
    Outputs files;
    files.add(o.get("--out"), json);
    files.commit();
    std::printf("\nwrote %s\n", o.get("--out").c_str());
  }
  return 0;
}

/// The token ids of a text file (at most 4 MiB: thousands of windows; the bound also bounds the tokenizer's working
/// memory) or of the built-in calibration text, every id inside the vocabulary. `option` names the file in errors.
std::vector<std::int32_t> encode_text(kvc::eval::Tokenizer const& tokenizer, kvc::eval::ModelConfig const& c,
                                      std::string const& option, std::string const& path, std::string_view builtin) {
  std::vector<std::byte> bytes;
  std::string_view text = builtin;
  std::string const where = path.empty() ? std::string("the built-in calibration text") : option + " " + path;
  if (!path.empty()) {
    std::string error;
    if (!kvc::read_regular_file(path, bytes, error, 4u << 20))
      fail(exit_invalid, where + ": " + error);
    if (bytes.empty())
      fail(exit_invalid, where + ": the file is empty, expected text to calibrate on");
    text = {reinterpret_cast<char const*>(bytes.data()), bytes.size()};
  }
  std::vector<std::int32_t> const ids = tokenizer.encode(text);
  for (std::size_t i = 0; i < ids.size(); ++i)
    if (ids[i] < 0 || ids[i] >= c.vocab)
      fail(exit_invalid, where + ": the tokenizer gives id " + std::to_string(ids[i]) + " (token " + std::to_string(i) +
                             "), outside the model's vocabulary [0, " + std::to_string(c.vocab) + ")");
  return ids;
}

/// The entropy's parameters of `kvc-eval calibrate` (--param NAME=VALUE): uncomp_entropy's top_k, normalize_rows,
/// renormalize_topk and ridge, with their defaults.
kvc::MatrixEntropyOptions calibration_entropy(Options const& o) {
  kvc::tools::PolicyInfo const& entropy = kvc::tools::find_policy("uncomp_entropy");
  kvc::tools::Params p;
  for (auto [it, end] = o.values.equal_range("--param"); it != end; ++it) {
    std::string const& kv = it->second;
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

/// `kvc-eval calibrate`: UNComp's calibration file (eval/calibrate.hpp, tools/common/uncomp.hpp).
int command_calibrate(int argc, char** argv) {
  Options const o = parse_options(
      argc, argv, {"--model", "--text", "--out", "--samples", "--tokens", "--groups", "--rule", "--param"}, {});
  std::string const model_path = o.need("--model"), out = o.need("--out");
  kvc::eval::CalibrationOptions opts;
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
  kvc::eval::ModelConfig const& c = model.config;
  if (opts.tokens > c.context)
    fail(exit_invalid, "--tokens " + std::to_string(opts.tokens) + ": more than the model's " +
                           std::to_string(c.context) + " positions (its queries are out of distribution past them)");
  auto const tokenizer = load_tokenizer(model);
  if (!tokenizer)
    fail(exit_invalid, model_path + ": the model has no tokenizer next to it to encode the calibration text");
  std::int32_t const bos = c.bos >= 0 ? c.bos : tokenizer->bos_id();
  std::vector<std::int32_t> const text =
      encode_text(*tokenizer, c, "--text", text_path, kvc::eval::builtin_calibration_text);
  std::string const source = text_path.empty() ? std::string("the built-in calibration text") : "--text " + text_path;
  auto const windows = kvc::eval::calibration_windows(text, opts, bos, source);
  kvc::tools::Calibration const cal = kvc::eval::calibrate(
      model, windows, opts, model_path, text_path.empty() ? std::string(kvc::eval::builtin_text_name) : text_path);
  kvc::tools::write_calibration(cal, out);
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

/// The rows of a --policies list with their parameters: `all` stands for every policy of the table; `random` is
/// added when `add_random`. SCORER[(NAME=VALUE,...)][+ALLOCATOR[+ALLOCATOR]]: the row's own parameters, then
/// --param ROW.NAME=VALUE (the same name twice is a usage error), over the scorer's and the allocators' defaults
/// (pyramid_kv's layer and num_layers come from the model).
std::vector<kvc::eval::PolicyRun> policy_rows(Options const& o, std::string const& list, bool add_random) {
  std::vector<std::string> names;
  for (std::string const& name : split_rows(list)) {
    if (name != "all") {
      names.push_back(name);
      continue;
    }
    for (auto const& p : kvc::tools::policies())
      if (p.token_scores)  // uncomp_entropy writes per-head values, not a cache
        names.push_back(p.name);
  }
  if (add_random && std::find(names.begin(), names.end(), "random") == names.end())
    names.push_back("random");
  std::map<std::string, std::vector<std::string>> given;  // --param ROW.NAME=VALUE
  for (auto [it, end] = o.values.equal_range("--param"); it != end; ++it) {
    auto const [policy, kv] = param_target(it->second);
    if (std::find(names.begin(), names.end(), policy) == names.end())
      fail(exit_usage, "--param '" + it->second + "': policy " + policy + " is not in --policies");
    given[policy].push_back(kv);
  }
  std::vector<kvc::eval::PolicyRun> rows;
  for (std::string const& name : names) {
    RowName const row = parse_row(name);
    auto const& info = kvc::tools::find_policy(row.scorer);
    if (!info.token_scores)
      fail(exit_usage, "--policies " + name + ": policy " + info.name +
                           " writes per-head values (`kvc score`), it does not compress a cache (calibration: "
                           "`kvc-eval calibrate`)");
    kvc::tools::AllocatorChoice alloc;
    if (row.has_allocators)
      alloc = kvc::tools::parse_allocators(row.allocators, "--policies");
    std::vector<std::string> params;
    if (!row.inline_params.empty())
      params = split(row.inline_params, ',');
    params.insert(params.end(), given[name].begin(), given[name].end());
    for (std::string const& kv : params)
      if (kv.rfind("layer=", 0) == 0 || kv.rfind("num_layers=", 0) == 0)
        fail(exit_usage, "--param " + name + "." + kv +
                             ": kvc-eval sets pyramid_kv's layer and num_layers per layer "
                             "from the model");
    kvc::eval::PolicyRun policy_run{&info,
                                    kvc::tools::resolve_params(kvc::tools::with_allocators(info, alloc), params, true),
                                    alloc, row.inline_params};
    for (auto const& r : rows)
      if (r.label() == policy_run.label())
        fail(exit_usage, "--policies: " + policy_run.label() + " listed twice");
    rows.push_back(std::move(policy_run));
  }
  return rows;
}

/// The calibrations of the run's uncomp rows (returns what to print; empty: no uncomp row). With --calibration FILE
/// (checked against the model) every row uses it, and a row's explicit rule must be the file's. Without it, each
/// row's (groups, rule) (auto: 8, mean) gets a calibration computed with the model on the built-in calibration
/// text (eval/calibration_text.hpp; not the evaluation text: prompts are sampled from the model or read from
/// --prompt-file), 4 windows of 256 tokens (at most the model's context), the entropy's defaults; rows asking the
/// same share it.
std::string uncomp_calibration(Options const& o, kvc::eval::Model const& model,
                               std::optional<kvc::eval::Tokenizer> const& tokenizer, kvc::eval::RunOptions& run) {
  kvc::eval::ModelConfig const& c = model.config;
  std::vector<std::string> const listed = split_rows(o.get("--policies", "all"));
  if (!tokenizer && !o.has("--calibration") && std::count(listed.begin(), listed.end(), "all") > 0 &&
      std::count(listed.begin(), listed.end(), "uncomp") == 0) {  // `all` without the means to calibrate
    std::erase_if(run.policies, [](kvc::eval::PolicyRun const& r) { return r.label() == "uncomp"; });
    std::fprintf(stderr,
                 "kvc-eval: note: the uncomp row is left out of `all`: the model has no tokenizer to encode "
                 "the built-in calibration text (pass --calibration FILE)\n");
  }
  std::string report;
  std::shared_ptr<kvc::tools::Calibration const> file;
  std::string const path = o.get("--calibration");
  std::map<std::pair<Index, int>, std::shared_ptr<kvc::tools::Calibration const>> computed;
  std::vector<std::int32_t> text;
  for (kvc::eval::PolicyRun& row : run.policies) {
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
      kvc::eval::CalibrationOptions opts;
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
          text = encode_text(*tokenizer, c, "--text", "", kvc::eval::builtin_calibration_text);
        auto const windows = kvc::eval::calibration_windows(text, opts, bos, "the built-in calibration text");
        cal = std::make_shared<kvc::tools::Calibration const>(
            kvc::eval::calibrate(model, windows, opts, o.get("--model"), std::string(kvc::eval::builtin_text_name)));
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

std::string schedule_text(kvc::eval::RunOptions const& run) {
  if (run.schedule == kvc::eval::Schedule::prefill)
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

int command_run(int argc, char** argv) {
  Options const o =
      parse_options(argc, argv,
                    {"--model", "--out-dir", "--policies", "--ratios", "--prompt-tokens", "--continuation", "--samples",
                     "--seed", "--prompt-file", "--cache", "--layout", "--schedule", "--decode", "--param", "--show",
                     "--generate", "--calibration", "--reference-cache"},
                    {"--no-progress"});
  std::string const model_path = o.need("--model"), dir = o.need("--out-dir");
  if (o.get("--schedule", "prefill") != "prefill")
    fail(exit_usage, "--schedule '" + o.get("--schedule") +
                         "': expected prefill (compress once after the prompt); for compression while decoding pass "
                         "--decode interval=I,target=T");
  kvc::eval::RunOptions run;
  if (o.has("--decode")) {
    if (o.has("--schedule") || o.has("--ratios"))
      fail(exit_usage, "--decode compresses to a target size while decoding: it takes neither --schedule nor --ratios");
    run.schedule = kvc::eval::Schedule::decode;
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
  for (kvc::eval::PolicyRun& r : policy_rows(o, o.get("--policies", "all"), true)) {
    run.policies.push_back(std::move(r));
    check_policy(run.policies.back(), run);
  }
  Shown shown = shown_cache(o.get("--show"), run);

  auto const model = load_model(model_path);
  auto const tokenizer = load_tokenizer(model);
  kvc::eval::ModelConfig const& c = model.config;
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
      data.push_back(kvc::eval::sample_tokens(model, run.sampling_cache(), length, bos,
                                              seed * 0x9E3779B97F4A7C15ull + static_cast<std::uint64_t>(s),
                                              {bos, c.eos}));
  }
  make_directory(dir);

  bool const progress_bar = !o.has("--no-progress") && isatty(STDERR_FILENO);
  std::printf(
      "kvc-eval: %s (%s, %lld layers, %lld/%lld heads, d %lld), %s %s cache (against a full %s cache), %lld samples "
      "x (%lld prompt + %lld continuation tokens), prompts %s\n",
      model_path.c_str(), c.format.c_str(), static_cast<long long>(c.layers), static_cast<long long>(c.heads),
      static_cast<long long>(c.kv_heads), static_cast<long long>(c.head_dim),
      kvc::eval::cache_type_name(run.cache.type), run.cache.layout == kvc::eval::CacheLayout::paged ? "paged" : "dense",
      kvc::eval::cache_type_name(run.reference_cache().type), static_cast<long long>(samples),
      static_cast<long long>(run.prompt_tokens), static_cast<long long>(run.continuation), source.c_str());
  std::fputs(calibration_source.c_str(), stdout);
  std::fflush(stdout);
  auto const records =
      kvc::eval::evaluate(model, run, data, [&](Index done, Index total, std::string const& p, double r) {
        if (!progress_bar)
          return;
        int const width = 30, filled = total > 0 ? static_cast<int>(width * done / total) : width;
        std::fprintf(stderr, "\r[%s%s] %lld/%lld %-14s %.2f",
                     std::string(static_cast<std::size_t>(filled), '#').c_str(),
                     std::string(static_cast<std::size_t>(width - filled), ' ').c_str(), static_cast<long long>(done),
                     static_cast<long long>(total), p.c_str(), r);
        if (done == total)
          std::fprintf(stderr, "\r%*s\r", width + 40, "");
        std::fflush(stderr);
      });
  std::printf("full cache: perplexity %.3f of the continuation\n",
              records.empty() ? 0.0 : records.front().perplexity_full);
  std::string const table = kvc::eval::results_table(records);
  std::fputs(table.c_str(), stdout);

  // Greedy generation with the full cache and one compressed cache, side by side.
  std::string generation;
  if (generate > 0 && tokenizer) {
    kvc::eval::PolicyRun const* chosen = shown.run;
    std::string const show_policy = chosen->label();
    double const show_ratio = shown.ratio;
    std::vector<std::int32_t> const prompt(data[0].begin(), data[0].begin() + run.prompt_tokens);
    auto full = kvc::eval::make_session(model, run.cache, run.prompt_tokens + generate);
    full->set_calibration(chosen->calibration);
    kvc::eval::RowMatrix last;
    if (auto const st = full->forward(prompt, last); !st.ok())
      fail(exit_invalid, std::string("generation: ") + st.message());
    kvc::eval::RowMatrix last_compressed = last.bottomRows(1);  // the stage variant prefills on its own
    auto compressed = kvc::eval::row_session(model, run.cache, run.prompt_tokens + generate, *full, *chosen,
                                             run.calibration, prompt, &last_compressed);
    double seconds = 0;
    bool const decode = run.schedule == kvc::eval::Schedule::decode;
    kvc::Status const st =
        decode ? compressed->begin_decode(*chosen->policy, chosen->params, run.decode, 0, chosen->alloc,
                                          run.relayout_on_compress)
               : compressed->compress(*chosen->policy, chosen->params, show_ratio, seconds, 0, chosen->alloc);
    if (!st.ok())
      fail(exit_invalid, std::string("generation: ") + st.message());
    auto const a = kvc::eval::greedy(*full, last, generate);
    auto const b = kvc::eval::greedy(*compressed, last_compressed, generate);
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
                 kvc::eval::side_by_side("full cache", tokenizer->decode(a), title, tokenizer->decode(b));
    std::printf("\n%s", generation.c_str());
  }

  kvc::eval::RunInfo const info{model_path,
                                kvc::eval::cache_type_name(run.cache.type),
                                kvc::eval::cache_type_name(run.reference_cache().type),
                                run.cache.layout == kvc::eval::CacheLayout::paged ? "paged" : "dense",
                                run.prompt_tokens,
                                run.continuation,
                                seed,
                                source,
                                schedule_text(run)};
  std::string const name = fs::path(model_path).filename().string();
  Outputs files;
  files.add(dir + "/results.json", kvc::eval::results_json(records, run.policies, info));
  files.add(dir + "/results.csv", kvc::eval::results_csv(records));
  files.add(dir + "/kl.svg",
            kvc::eval::render_svg(kvc::eval::quality_plot(records, name + ": KL against memory", true)));
  files.add(dir + "/top1.svg",
            kvc::eval::render_svg(kvc::eval::quality_plot(records, name + ": top-1 agreement against memory", false)));
  bool const decode = run.schedule == kvc::eval::Schedule::decode;
  if (decode && !records.empty()) {  // the full cache grows by one token per step from the prompt's bytes
    double const m = static_cast<double>(run.continuation), n = static_cast<double>(run.prompt_tokens);
    double const per_token = records.front().kv_bytes_full / (n + (m + 1) / 2);
    files.add(dir + "/cache.svg",
              kvc::eval::render_svg(kvc::eval::cache_plot(
                  records, name + ": KV cache held while decoding (" + info.schedule + ")", per_token * n, per_token)));
  }
  if (!generation.empty())
    files.add(dir + "/generation.txt", generation);
  files.commit();
  std::printf("\nwrote %s/results.json, results.csv, kl.svg, top1.svg%s%s (plots: open the .svg files in a browser)\n",
              dir.c_str(), decode ? ", cache.svg" : "", generation.empty() ? "" : ", generation.txt");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    std::string const command = argc > 1 ? argv[1] : "";
    if (command == "run")
      return command_run(argc, argv);
    if (command == "logits")
      return command_logits(argc, argv);
    if (command == "dump")
      return command_dump(argc, argv);
    if (command == "correction")
      return command_correction(argc, argv);
    if (command == "calibrate")
      return command_calibrate(argc, argv);
    if (command == "--help" || command == "-h" || command == "help") {
      std::fputs(usage_text, stdout);
      return 0;
    }
    std::fprintf(stderr, "kvc-eval: %s\n%s",
                 command.empty() ? "missing command" : ("unknown command '" + command + "'").c_str(), usage_text);
    return exit_usage;
  } catch (kvc::tools::Failure const& f) {
    std::fprintf(stderr, "kvc-eval: error: %s\n", f.message.c_str());
    if (f.code == exit_usage)
      std::fputs(usage_text, stderr);
    return f.code;
  } catch (std::bad_alloc const&) {
    std::fprintf(stderr, "kvc-eval: error: out of memory\n");
    return exit_invalid;
  } catch (std::exception const& e) {
    std::fprintf(stderr, "kvc-eval: internal error: %s\n", e.what());
    return kvc::tools::exit_internal;
  }
}
