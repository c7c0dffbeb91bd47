// SPDX-License-Identifier: Apache-2.0
// tools/kvc/main.cpp: the `kvc` command-line tool: score and compress .npy KV dumps with any kvc policy.
// Contract (docs/cli.md): exit 0 success, 2 usage error, 3 invalid input (the message names file, field, expectation).
#include <kvc/backend/cpu/pipeline/compact.hpp>
#include <kvc/backend/cpu/scorers/key_diff.hpp>
#include <kvc/backend/cpu/scorers/knorm.hpp>
#include <kvc/backend/cpu/scorers/streaming_llm.hpp>
#include <kvc/backend/cpu/selectors/top_k.hpp>
#include <kvc/core/validate.hpp>
#include <kvc/io/npy.hpp>
#include <kvc/pipeline/press.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace {

constexpr int exit_usage = 2;
constexpr int exit_invalid = 3;

/// An error that ends the program with a message and an exit code.
struct Failure {
  int code;
  std::string message;
};

[[noreturn]] void fail(int code, std::string message) {
  throw Failure{code, std::move(message)};
}

char const* const usage_text =
    "usage:\n"
    "  kvc score    --policy NAME [--param k=v]... --keys K.npy [--values V.npy] --out scores.npy [--time]\n"
    "  kvc compress --policy NAME (--ratio R | --budget N) [--param k=v]... --keys K.npy --values V.npy\n"
    "               --out-dir DIR [--time]\n"
    "  kvc policies\n"
    "Keys and values are [B, Hkv, N, d] float32 or float16 .npy (C order), post-RoPE as an engine caches them.\n"
    "Scores are [B, Hkv, N] float32, higher = keep. compress writes keys.npy values.npy indices.npy counts.npy.\n"
    "--ratio is the fraction removed (kept = floor(N * (1 - R))); --budget is tokens kept per head.\n"
    "Exit codes: 0 success, 2 usage error, 3 invalid input.\n";

// ---------------------------------------------------------------------------------------------------------------
// Policies: name, parameters with defaults, and how to build the scorer and the selection protections.

struct ParamInfo {
  char const* name;
  char const* default_value;
  char const* help;
};

struct PolicyInfo {
  char const* name;
  char const* summary;
  std::vector<ParamInfo> params;
  bool reads_keys;
};

std::vector<PolicyInfo> const& policies() {
  static std::vector<PolicyInfo> const list = {
      {"streaming_llm",
       "attention sinks + most recent tokens (Xiao et al., arXiv 2309.17453)",
       {{"n_sink", "4", "first tokens always kept"}},
       false},
      {"key_diff",
       "keep keys least similar to the mean unit key (Park et al., arXiv 2504.15364, Eq. 8)",
       {{"anchor", "normalized_mean", "normalized_mean (paper, kvpress) or raw_mean"},
        {"n_sink", "0", "first tokens always kept (KeyDiff + sinks)"},
        {"n_recent", "0", "last tokens always kept (KeyDiff + Recent, paper Table 11)"}},
       true},
      {"knorm",
       "keep the lowest-norm keys (Devoto et al., EMNLP 2024; kvpress KnormPress)",
       {{"n_sink", "0", "first tokens always kept"}, {"n_recent", "0", "last tokens always kept"}},
       true},
  };
  return list;
}

PolicyInfo const& find_policy(std::string const& name) {
  for (auto const& p : policies())
    if (name == p.name)
      return p;
  std::string names;
  for (auto const& p : policies())
    names += std::string(names.empty() ? "" : ", ") + p.name;
  fail(exit_usage, "unknown --policy '" + name + "' (expected one of: " + names + ")");
}

/// Parameter values after defaults and --param overrides; rejects unknown names.
std::map<std::string, std::string> resolve_params(PolicyInfo const& policy, std::vector<std::string> const& given) {
  std::map<std::string, std::string> values;
  for (auto const& p : policy.params)
    values[p.name] = p.default_value;
  for (auto const& kv : given) {
    auto const eq = kv.find('=');
    if (eq == std::string::npos || eq == 0)
      fail(exit_usage, "--param '" + kv + "': expected NAME=VALUE");
    std::string const key = kv.substr(0, eq);
    if (!values.count(key))
      fail(exit_usage, "--param '" + key + "' is not a parameter of policy " + policy.name + " (see `kvc policies`)");
    values[key] = kv.substr(eq + 1);
  }
  return values;
}

kvc::Index parse_count(std::string const& text, std::string const& what) {
  char* end = nullptr;
  errno = 0;
  long long const v = std::strtoll(text.c_str(), &end, 10);
  if (text.empty() || *end != '\0' || errno == ERANGE)
    fail(exit_invalid, what + " = '" + text + "': expected an integer");
  if (v < 0)
    fail(exit_invalid, what + " = " + text + ": expected an integer >= 0");
  return v;
}

double parse_ratio(std::string const& text) {
  char* end = nullptr;
  double const r = std::strtod(text.c_str(), &end);
  if (text.empty() || *end != '\0')
    fail(exit_invalid, "--ratio '" + text + "': expected a number in [0, 1]");
  if (!(r >= 0.0 && r <= 1.0))
    fail(exit_invalid, "--ratio " + text + ": expected a number in [0, 1] (the fraction of tokens removed)");
  return r;
}

/// Calls fn(scorer, n_sink, n_recent) with the policy's scorer and the selector's protected windows.
template <class Fn>
void with_policy(PolicyInfo const& policy, std::map<std::string, std::string> const& p, Fn&& fn) {
  std::string const name = policy.name;
  if (name == "streaming_llm") {
    fn(kvc::StreamingLLMScorer{parse_count(p.at("n_sink"), "--param n_sink")}, kvc::Index{0}, kvc::Index{0});
    return;
  }
  kvc::Index const n_sink = parse_count(p.at("n_sink"), "--param n_sink");
  kvc::Index const n_recent = parse_count(p.at("n_recent"), "--param n_recent");
  if (name == "key_diff") {
    kvc::KeyDiffScorer s;
    std::string const& anchor = p.at("anchor");
    if (anchor == "raw_mean")
      s.anchor = kvc::KeyDiffAnchor::raw_mean;
    else if (anchor != "normalized_mean")
      fail(exit_invalid, "--param anchor = '" + anchor + "': expected normalized_mean or raw_mean");
    fn(s, n_sink, n_recent);
  } else {
    fn(kvc::KnormScorer{}, n_sink, n_recent);
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Inputs.

struct Input {
  std::string path;
  kvc::NpyArray array;
};

Input load_tensor(std::string const& path, char const* role) {
  Input in{path, {}};
  std::string error;
  if (!kvc::read_npy(path, in.array, error))
    fail(exit_invalid, std::string(role) + " file " + path + ": " + error);
  auto const& s = in.array.shape;
  if (s.size() != 4)
    fail(exit_invalid, std::string(role) + " file " + path + ": field 'shape' has " + std::to_string(s.size()) +
                           " dimensions, expected 4 ([batch, kv_heads, tokens, head_dim])");
  if (in.array.dtype != kvc::NpyDtype::f32 && in.array.dtype != kvc::NpyDtype::f16)
    fail(exit_invalid, std::string(role) + " file " + path + ": field 'descr' is " +
                           std::string(kvc::npy_descr(in.array.dtype)) +
                           ", expected '<f4' (float32) or '<f2' (float16)");
  if (s[3] <= 0)
    fail(exit_invalid, std::string(role) + " file " + path + ": head_dim (shape[3]) must be > 0");
  return in;
}

kvc::KVExtents extents_of(Input const& in) {
  auto const& s = in.array.shape;
  return {s[0], s[1], s[2], s[3]};
}

/// Runs fn(cache) with a typed host view over keys (and values, or keys again when absent).
template <class Fn>
void with_cache(Input const& keys, Input const* values, Fn&& fn) {
  kvc::KVExtents const ek = extents_of(keys);
  kvc::KVExtents ev = ek;
  if (values) {
    ev = extents_of(*values);
    if (ev.batch != ek.batch || ev.heads != ek.heads || ev.tokens != ek.tokens)
      fail(exit_invalid, "values file " + values->path + ": field 'shape' [B, Hkv, N] must equal the keys' (" +
                             std::to_string(ek.batch) + ", " + std::to_string(ek.heads) + ", " +
                             std::to_string(ek.tokens) + ")");
    if (values->array.dtype != keys.array.dtype)
      fail(exit_invalid, "values file " + values->path + ": field 'descr' must equal the keys' dtype");
  }
  Input const& v = values ? *values : keys;
  auto run = [&](auto tag) {
    using T = decltype(tag);
    auto* kp = const_cast<T*>(keys.array.as<T>());  // compaction writes to a copy owned by this program
    auto* vp = const_cast<T*>(v.array.as<T>());
    auto const cache = kvc::make_cache(kvc::bhtd_rows(kp, ek), kvc::bhtd_rows(vp, ev));
    // Without --values the cache views K twice (scoring reads keys only), so only the keys are validated.
    kvc::Status const st =
        values ? kvc::validate(cache, {.check_finite = true}) : kvc::validate_rows(cache.keys, {.check_finite = true});
    if (!st.ok())
      fail(exit_invalid, "keys file " + keys.path + (values ? " / values file " + values->path : std::string()) + ": " +
                             st.message());
    fn(cache);
  };
  if (keys.array.dtype == kvc::NpyDtype::f16)
    run(kvc::half{});
  else
    run(float{});
}

// ---------------------------------------------------------------------------------------------------------------
// Commands.

struct Options {
  std::string command, policy, keys, values, queries, positions, out, out_dir, ratio, budget;
  std::vector<std::string> params;
  bool time = false;
};

Options parse_args(int argc, char** argv) {
  if (argc < 2)
    fail(exit_usage, "missing command");
  Options o;
  o.command = argv[1];
  std::map<std::string, std::string*> const valued = {
      {"--policy", &o.policy},   {"--keys", &o.keys},           {"--values", &o.values},
      {"--queries", &o.queries}, {"--positions", &o.positions}, {"--out", &o.out},
      {"--out-dir", &o.out_dir}, {"--ratio", &o.ratio},         {"--budget", &o.budget}};
  for (int i = 2; i < argc; ++i) {
    std::string const a = argv[i];
    if (a == "--time") {
      o.time = true;
    } else if (a == "--param" || valued.count(a) || a == "--rope") {
      if (i + 1 >= argc)
        fail(exit_usage, a + " needs a value");
      std::string const value = argv[++i];
      if (a == "--param")
        o.params.push_back(value);
      else if (a != "--rope")  // accepted for contract compatibility: no implemented policy rotates queries
        *valued.at(a) = value;
    } else {
      fail(exit_usage, "unknown argument '" + a + "'");
    }
  }
  return o;
}

template <class Fn>
double median_seconds(int repeats, Fn&& fn) {
  std::vector<double> s;
  for (int r = 0; r < repeats; ++r) {
    auto const t0 = std::chrono::steady_clock::now();
    fn();
    s.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(s.begin(), s.end());
  return s[s.size() / 2];
}

void print_time(char const* command, PolicyInfo const& policy, double seconds, int repeats, std::size_t bytes) {
  std::fprintf(stderr,
               "{\"command\": \"%s\", \"policy\": \"%s\", \"seconds\": %.9g, \"repeats\": %d, \"bytes_read\": %zu}\n",
               command, policy.name, seconds, repeats, bytes);
}

void write_or_fail(std::string const& path, kvc::NpyDtype dtype, std::vector<kvc::Index> const& shape,
                   void const* data) {
  std::string error;
  if (!kvc::write_npy(path, dtype, shape, data, error))
    fail(exit_invalid, "output file " + path + ": " + error);
}

void check_status(kvc::Status st, std::string const& context) {
  if (!st.ok())
    fail(exit_invalid, context + ": " + st.message());
}

constexpr int timing_repeats = 7;

int cmd_score(Options const& o) {
  if (o.policy.empty() || o.keys.empty() || o.out.empty())
    fail(exit_usage, "score needs --policy, --keys and --out");
  PolicyInfo const& policy = find_policy(o.policy);
  auto const params = resolve_params(policy, o.params);
  Input const keys = load_tensor(o.keys, "keys");
  std::optional<Input> values;
  if (!o.values.empty())
    values = load_tensor(o.values, "values");
  if (!o.queries.empty() || !o.positions.empty())
    std::fprintf(stderr, "kvc: note: policy %s does not read queries or positions; ignoring them\n", policy.name);
  kvc::KVExtents const e = extents_of(keys);
  std::vector<float> scores(static_cast<std::size_t>(e.rows()));
  with_policy(policy, params, [&](auto scorer, kvc::Index, kvc::Index) {
    with_cache(keys, values ? &*values : nullptr, [&](auto const& cache) {
      std::vector<std::byte> ws(kvc::score_workspace_bytes(kvc::Cpu{}, scorer, e));
      kvc::ScoreSpan<> out{scores.data(), e.batch, e.heads, e.tokens};
      auto once = [&] { check_status(kvc::score(kvc::Cpu{}, scorer, cache, out, {ws.data(), ws.size()}), "score"); };
      once();
      if (o.time)
        print_time("score", policy, median_seconds(timing_repeats, once), timing_repeats,
                   policy.reads_keys ? keys.array.data.size() : 0);
    });
  });
  write_or_fail(o.out, kvc::NpyDtype::f32, {e.batch, e.heads, e.tokens}, scores.data());
  return 0;
}

int cmd_compress(Options const& o) {
  if (o.policy.empty() || o.keys.empty() || o.values.empty() || o.out_dir.empty())
    fail(exit_usage, "compress needs --policy, --keys, --values and --out-dir");
  if (o.ratio.empty() == o.budget.empty())
    fail(exit_usage, "compress needs exactly one of --ratio and --budget");
  PolicyInfo const& policy = find_policy(o.policy);
  auto const params = resolve_params(policy, o.params);
  std::optional<double> const ratio = o.ratio.empty() ? std::nullopt : std::optional(parse_ratio(o.ratio));
  kvc::Index const budget = o.budget.empty() ? 0 : parse_count(o.budget, "--budget");
  Input keys = load_tensor(o.keys, "keys");
  Input values = load_tensor(o.values, "values");
  kvc::KVExtents const e = extents_of(keys);
  std::vector<kvc::Index> index(static_cast<std::size_t>(e.rows())), count(static_cast<std::size_t>(e.batch * e.heads));
  kvc::KeepPlan<> plan{index.data(), count.data(), e.batch, e.heads, e.tokens};
  kvc::Index kept_max = 0;

  with_policy(policy, params, [&](auto scorer, kvc::Index n_sink, kvc::Index n_recent) {
    with_cache(keys, &values, [&](auto const& cache) {
      auto run = [&](auto budget_value) {
        kvc::Press press{scorer, kvc::TopKSelector<decltype(budget_value)>{budget_value, n_sink, n_recent}};
        std::vector<std::byte> ws(kvc::compress_workspace_bytes(kvc::Cpu{}, press, e));
        auto once = [&] {
          check_status(kvc::compress(kvc::Cpu{}, press, cache, plan, {ws.data(), ws.size()}), "compress");
        };
        once();
        if (o.time)
          print_time("compress", policy, median_seconds(timing_repeats, once), timing_repeats,
                     policy.reads_keys ? keys.array.data.size() : 0);
      };
      if (ratio)
        run(kvc::RatioBudget{*ratio});
      else
        run(kvc::FixedBudget{budget});
      check_status(kvc::compact(kvc::Cpu{}, plan, cache), "compact");
    });
  });
  for (kvc::Index c : count)
    kept_max = std::max(kept_max, c);

  // Repack [B, H, kept_max, d]: compaction left each head's kept rows in its first slots.
  auto repack = [&](Input const& in) {
    kvc::Index const d = in.array.shape[3], item = kvc::npy_itemsize(in.array.dtype);
    std::vector<std::byte> out(static_cast<std::size_t>(e.batch * e.heads * kept_max * d * item));
    for (kvc::Index bh = 0; bh < e.batch * e.heads; ++bh)
      std::copy_n(in.array.data.data() + bh * e.tokens * d * item, count[static_cast<std::size_t>(bh)] * d * item,
                  out.data() + bh * kept_max * d * item);
    return out;
  };
  std::vector<kvc::Index> kept_index(static_cast<std::size_t>(e.batch * e.heads * kept_max), -1);
  for (kvc::Index bh = 0; bh < e.batch * e.heads; ++bh)
    std::copy_n(index.data() + bh * e.tokens, count[static_cast<std::size_t>(bh)], kept_index.data() + bh * kept_max);

  std::error_code ec;
  std::filesystem::create_directories(o.out_dir, ec);
  if (ec)
    fail(exit_invalid, "--out-dir " + o.out_dir + ": cannot create the directory (" + ec.message() + ")");
  std::string const dir = o.out_dir + "/";
  auto const k_out = repack(keys), v_out = repack(values);
  write_or_fail(dir + "keys.npy", keys.array.dtype, {e.batch, e.heads, kept_max, e.dim}, k_out.data());
  write_or_fail(dir + "values.npy", values.array.dtype, {e.batch, e.heads, kept_max, values.array.shape[3]},
                v_out.data());
  write_or_fail(dir + "indices.npy", kvc::NpyDtype::i64, {e.batch, e.heads, kept_max}, kept_index.data());
  write_or_fail(dir + "counts.npy", kvc::NpyDtype::i64, {e.batch, e.heads}, count.data());
  return 0;
}

int cmd_policies() {
  for (auto const& p : policies()) {
    std::printf("%s\n    %s\n", p.name, p.summary);
    for (auto const& param : p.params)
      std::printf("    --param %s=%s  (%s)\n", param.name, param.default_value, param.help);
  }
  std::printf(
      "budgets (compress): --ratio R (fraction removed, kept = floor(N*(1-R))) or --budget N (tokens per head)\n");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    Options const o = parse_args(argc, argv);
    if (o.command == "score")
      return cmd_score(o);
    if (o.command == "compress")
      return cmd_compress(o);
    if (o.command == "policies")
      return cmd_policies();
    if (o.command == "--help" || o.command == "-h" || o.command == "help") {
      std::fputs(usage_text, stdout);
      return 0;
    }
    fail(exit_usage, "unknown command '" + o.command + "'");
  } catch (Failure const& f) {
    std::fprintf(stderr, "kvc: error: %s\n", f.message.c_str());
    if (f.code == exit_usage)
      std::fputs(usage_text, stderr);
    return f.code;
  } catch (std::exception const& e) {
    std::fprintf(stderr, "kvc: error: %s\n", e.what());
    return exit_invalid;
  }
}
