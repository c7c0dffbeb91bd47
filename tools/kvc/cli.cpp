// SPDX-License-Identifier: Apache-2.0
// tools/kvc/cli.cpp: the `kvc` command-line tool: score and compress .npy KV dumps with any kvc policy.
// Contract (docs/cli.md, DESIGN.md §6): exit 0 success, 2 usage error, 3 invalid input (the message names the file,
// the field and what was expected). Every policy is one row of policies() and one branch of with_policy().
// Files are untrusted (docs/cli.md "Untrusted input"): inputs must be regular files whose sizes bound every
// allocation; outputs are staged beside their destination and renamed into place only when all of them are whole.
#include "cli.hpp"

#include <kvc/backend/cpu/pipeline/compact.hpp>
#include <kvc/backend/cpu/scorers/key_diff.hpp>
#include <kvc/backend/cpu/scorers/knorm.hpp>
#include <kvc/backend/cpu/scorers/random.hpp>
#include <kvc/backend/cpu/scorers/snap_kv.hpp>
#include <kvc/backend/cpu/scorers/streaming_llm.hpp>
#include <kvc/backend/cpu/scorers/tova.hpp>
#include <kvc/backend/cpu/selectors/top_k.hpp>
#include <kvc/backend/cpu/thread_pool.hpp>
#include <kvc/core/rope.hpp>
#include <kvc/core/validate.hpp>
#include <kvc/io/file.hpp>
#include <kvc/io/npy.hpp>
#include <kvc/pipeline/press.hpp>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <initializer_list>
#include <limits>
#include <map>
#include <memory>
#include <new>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <sys/stat.h>
#include <type_traits>
#include <unistd.h>
#include <utility>
#include <vector>

namespace {

/// Where the tool prints: the standard streams for the program, others for the fuzzer.
struct Streams {
  std::FILE* out = stdout;
  std::FILE* err = stderr;
} io;

constexpr int exit_usage = 2;
constexpr int exit_invalid = 3;
constexpr int exit_internal = 70;  ///< EX_SOFTWARE: a bug in kvc (e.g. the policy table and a scorer disagree)

/// An error that ends the program with a message and an exit code.
struct Failure {
  int code;
  std::string message;
};

[[noreturn]] void fail(int code, std::string message) {
  throw Failure{code, std::move(message)};
}

// ---------------------------------------------------------------------------------------------------------------
// Policies: the one table of names, summaries, parameters (with defaults and help) and inputs read.

/// Where a parameter acts: the scorer, compress's top-k selection (compress only), or how the queries are read.
enum class Stage : std::uint8_t { scorer, selection, queries };

struct ParamInfo {
  char const* name;
  char const* default_value;
  char const* help;
  Stage stage = Stage::scorer;
  char const* kvpress_default = nullptr;  ///< the default under reference=kvpress, where it differs
};

struct PolicyInfo {
  char const* name;
  char const* summary;
  std::vector<ParamInfo> params;
  bool reads_keys;
  bool reads_queries;  ///< needs --queries (and accepts --positions, --rope and the `queries` parameter)
};

ParamInfo const n_sink_param{"n_sink", "0", "first tokens always kept (compress only)", Stage::selection};
ParamInfo const n_recent_param{"n_recent", "0", "last tokens always kept (compress only)", Stage::selection};
ParamInfo const queries_param{
    "queries", "pre_rope", "pre_rope (rotated with --rope at their positions) or post_rope (as given)", Stage::queries};

std::vector<PolicyInfo> const& policies() {
  static std::vector<PolicyInfo> const list = {
      {"streaming_llm",
       "attention sinks + most recent tokens (Xiao et al., arXiv 2309.17453)",
       {{"n_sink", "4", "first tokens always kept"}},
       false,
       false},
      {"key_diff",
       "keep keys least similar to the mean unit key (Park et al., arXiv 2504.15364, Eq. 8)",
       {{"anchor", "normalized_mean", "normalized_mean (paper, kvpress) or raw_mean"},
        {"n_sink", "0", "first tokens always kept (KeyDiff + sinks; compress only)", Stage::selection},
        {"n_recent", "0", "last tokens always kept (KeyDiff + Recent, paper Table 11; compress only)",
         Stage::selection}},
       true,
       false},
      {"knorm",
       "keep the lowest-norm keys (Devoto et al., EMNLP 2024; kvpress KnormPress)",
       {n_sink_param, n_recent_param},
       true,
       false},
      {"snap_kv",
       "the last window_size queries vote for the prefix keys they attend to (Li et al., arXiv 2404.14469)",
       {{"reference", "authors", "authors (paper code) or kvpress (SnapKVPress, with the kvpress defaults below)"},
        {"window_size", "32", "observation window w: the last w rows of --queries vote", Stage::scorer, "64"},
        {"kernel_size", "7", "pooling kernel along the tokens, odd", Stage::scorer, "5"},
        {"pooling", "max", "max or avg (avg always divides by kernel_size, as PyTorch)", Stage::scorer, "avg"},
        {"gqa", "mean", "GQA reduction: mean, max, sum or per_query_head (Hq = Hkv); kvpress: mean"},
        queries_param,
        n_sink_param,
        n_recent_param},
       true,
       true},
      {"tova",
       "keep the tokens the newest query attends to most, mean over query heads (Oren et al., arXiv 2401.06104)",
       {{"reference", "authors", "authors (the newest token competes) or kvpress (TOVAPress: it is always kept)"},
        queries_param,
        n_sink_param,
        n_recent_param},
       true,
       true},
      {"random",
       "uniform random eviction, the baseline every policy must beat (kvpress RandomPress)",
       {{"seed", "0", "64-bit; scores hash (seed, b, h, t): the same on every run and backend"},
        n_sink_param,
        n_recent_param},
       false,
       false},
  };
  return list;
}

std::string policy_names(bool queries_only = false) {
  std::string names;
  for (auto const& p : policies())
    if (!queries_only || p.reads_queries)
      names += std::string(names.empty() ? "" : ", ") + p.name;
  return names;
}

PolicyInfo const& find_policy(std::string const& name) {
  for (auto const& p : policies())
    if (name == p.name)
      return p;
  fail(exit_usage, "unknown --policy '" + name + "' (expected one of: " + policy_names() + ")");
}

ParamInfo const* find_param(PolicyInfo const& policy, std::string_view name) {
  for (auto const& p : policy.params)
    if (name == p.name)
      return &p;
  return nullptr;
}

using Params = std::map<std::string, std::string, std::less<>>;

/// Parameter values after --param overrides and the defaults (kvpress's where reference=kvpress). Unknown names,
/// repeats, and selection parameters given to `score` are usage errors.
Params resolve_params(PolicyInfo const& policy, std::vector<std::string> const& given, bool compress) {
  Params set;
  for (auto const& kv : given) {
    auto const eq = kv.find('=');
    if (eq == std::string::npos || eq == 0)
      fail(exit_usage, "--param '" + kv + "': expected NAME=VALUE");
    std::string const key = kv.substr(0, eq);
    ParamInfo const* info = find_param(policy, key);
    if (info == nullptr) {
      std::string names;
      for (auto const& p : policy.params)
        names += std::string(names.empty() ? "" : ", ") + p.name;
      fail(exit_usage, "--param '" + key + "' is not a parameter of policy " + policy.name +
                           " (its parameters: " + (names.empty() ? "none" : names) + "; see `kvc policies`)");
    }
    if (!compress && info->stage == Stage::selection)
      fail(exit_usage, "--param '" + key + "' of policy " + policy.name +
                           " protects tokens in compress's selection; it does not change scores (use kvc compress)");
    if (!set.emplace(key, kv.substr(eq + 1)).second)
      fail(exit_usage, "--param '" + key + "' given twice");
  }
  auto const ref = set.find("reference");
  bool const kvpress = ref != set.end() && ref->second == "kvpress";
  Params values;
  for (auto const& p : policy.params) {
    auto const it = set.find(p.name);
    values[p.name] =
        it != set.end() ? it->second : (kvpress && p.kvpress_default ? p.kvpress_default : p.default_value);
  }
  return values;
}

kvc::Index parse_count(std::string const& text, std::string const& what, kvc::Index min = 0) {
  char* end = nullptr;
  errno = 0;
  long long const v = std::strtoll(text.c_str(), &end, 10);
  if (text.empty() || *end != '\0' || errno == ERANGE)
    fail(exit_invalid, what + " = '" + text + "': expected an integer");
  if (v < min)
    fail(exit_invalid, what + " = " + text + ": expected an integer >= " + std::to_string(min));
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

/// Parameter `name` as one of the named choices (bad values exit 3, naming the parameter and the choices).
template <class E>
E choice(Params const& p, char const* name, std::initializer_list<std::pair<std::string_view, E>> options) {
  std::string const& value = p.at(name);
  std::string expected;  // "a, b or c"
  std::size_t i = 0;
  for (auto const& [text, e] : options) {
    if (value == text)
      return e;
    expected += (i == 0 ? "" : (i + 1 == options.size() ? " or " : ", ")) + std::string(text);
    ++i;
  }
  fail(exit_invalid, std::string("--param ") + name + " = '" + value + "': expected " + expected);
}

kvc::Reference reference_of(Params const& p) {
  return choice<kvc::Reference>(p, "reference",
                                {{"authors", kvc::Reference::authors}, {"kvpress", kvc::Reference::kvpress}});
}

/// Whether --queries are pre-RoPE (rotated to their positions) or post-RoPE (used as given).
bool pre_rope(Params const& p) {
  return choice<bool>(p, "queries", {{"pre_rope", true}, {"post_rope", false}});
}

/// Tokens the top-k selection protects (compress only).
struct Selection {
  kvc::Index n_sink = 0;
  kvc::Index n_recent = 0;
};

/// The one place scorers are built: calls fn(scorer, selection) with the policy's scorer and its protections.
template <class Fn>
void with_policy(PolicyInfo const& policy, Params const& p, Fn&& fn) {
  auto count = [&](char const* name, kvc::Index min = 0) {
    return parse_count(p.at(name), std::string("--param ") + name, min);
  };
  auto selection_count = [&](char const* name) {
    ParamInfo const* info = find_param(policy, name);
    return info && info->stage == Stage::selection ? count(name) : kvc::Index{0};
  };
  Selection const sel{selection_count("n_sink"), selection_count("n_recent")};
  auto emit = [&](auto const& scorer) {  // the table and the scorer agree on the name and on reading queries
    using S = std::remove_cvref_t<decltype(scorer)>;
    if (S::name != policy.name || kvc::has_need(S::needs, kvc::Needs::window_queries) != policy.reads_queries)
      throw std::logic_error(std::string("kvc: the policy table disagrees with scorer ") + std::string(S::name));
    fn(scorer, sel);
  };
  std::string_view const name = policy.name;
  if (name == "streaming_llm") {
    emit(kvc::StreamingLLMScorer{count("n_sink")});
  } else if (name == "key_diff") {
    kvc::KeyDiffScorer s;
    s.anchor = choice<kvc::KeyDiffAnchor>(
        p, "anchor",
        {{"normalized_mean", kvc::KeyDiffAnchor::normalized_mean}, {"raw_mean", kvc::KeyDiffAnchor::raw_mean}});
    emit(s);
  } else if (name == "knorm") {
    emit(kvc::KnormScorer{});
  } else if (name == "snap_kv") {
    kvc::SnapKVScorer s;
    s.reference = reference_of(p);
    s.window_size = count("window_size", 1);
    s.kernel_size = count("kernel_size", 1);
    if (s.kernel_size % 2 == 0)
      fail(exit_invalid, "--param kernel_size = " + p.at("kernel_size") +
                             ": expected an odd integer (an even kernel shifts the pooled scores)");
    s.pooling = choice<kvc::Pooling>(p, "pooling", {{"max", kvc::Pooling::max}, {"avg", kvc::Pooling::avg}});
    s.gqa = choice<kvc::GqaReduce>(p, "gqa",
                                   {{"mean", kvc::GqaReduce::mean},
                                    {"max", kvc::GqaReduce::max},
                                    {"sum", kvc::GqaReduce::sum},
                                    {"per_query_head", kvc::GqaReduce::per_query_head}});
    if (s.reference == kvc::Reference::kvpress && s.gqa != kvc::GqaReduce::mean)
      fail(exit_invalid, "--param gqa = " + p.at("gqa") +
                             ": reference=kvpress averages over the GQA group (use gqa=mean, or reference=authors)");
    if (auto const st = s.check(); !st.ok())
      fail(exit_invalid, "policy snap_kv: " + std::string(st.message()));
    emit(s);
  } else if (name == "tova") {
    emit(kvc::TOVAScorer{reference_of(p)});
  } else if (name == "random") {
    std::string const& seed = p.at("seed");
    char* end = nullptr;
    errno = 0;
    unsigned long long const v = std::strtoull(seed.c_str(), &end, 10);
    if (seed.empty() || seed[0] == '-' || seed[0] == '+' || *end != '\0' || errno == ERANGE)
      fail(exit_invalid, "--param seed = '" + seed + "': expected an integer in [0, 2^64)");
    emit(kvc::RandomScorer{static_cast<std::uint64_t>(v)});
  } else {
    throw std::logic_error("kvc: policy " + std::string(name) + " is in the table but has no scorer");
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Commands and options.

struct CommandInfo {
  char const* name;
  char const* synopsis;     ///< usage lines (printed with usage errors)
  char const* intro;        ///< what the command does (--help)
  char const* own_options;  ///< the options only this command has (--help)
  std::vector<std::string_view> options;
};

char const* const overview_text =
    "kvc: score and compress .npy KV-cache dumps with kvc's policies.\n"
    "usage:\n"
    "  kvc score    --policy NAME [--param NAME=VALUE]... --keys K.npy [--queries Q.npy] --out scores.npy\n"
    "  kvc compress --policy NAME (--ratio R | --budget N) [--param NAME=VALUE]... --keys K.npy --values V.npy\n"
    "               [--queries Q.npy] --out-dir DIR\n"
    "  kvc policies        every policy with its parameters and defaults\n"
    "  kvc COMMAND --help  the options of one command\n"
    "Keys and values are [B, Hkv, N, d] float32 or float16 .npy (C order), post-RoPE as an engine caches them.\n"
    "Exit codes: 0 success, 2 usage error, 3 invalid input (the message names the file, the field and what was\n"
    "expected).\n";

char const* const input_details =
    "  --policy NAME          a policy from `kvc policies`\n"
    "  --param NAME=VALUE     a parameter of the policy (repeatable); names the policy does not have are rejected\n"
    "  --keys K.npy           [B, Hkv, N, d] float32 or float16, C order, post-RoPE as an engine caches them;\n"
    "                         slot t holds position t\n"
    "  --values V.npy         [B, Hkv, N, d_v], the keys' dtype\n"
    "  --queries Q.npy        [B, Hq, w, d] float32 or float16 (Hq a multiple of Hkv; query head q reads KV head\n"
    "                         q / (Hq / Hkv)): the last w queries of the context. Required by the policies that\n"
    "                         read queries (snap_kv, tova), rejected by the others. Pre-RoPE unless\n"
    "                         --param queries=post_rope\n"
    "  --positions P.npy      int64 [B, w]: each query's absolute position, for RoPE and the causal mask\n"
    "                         (default: the context's last w positions, N - w + i)\n"
    "  --rope theta=T,style=S the RoPE that rotates pre-RoPE queries (default theta=10000,style=neox); style neox\n"
    "                         (rotate-half: Hugging Face Llama, Qwen, Mistral) or interleaved (GPT-J, llama.cpp);\n"
    "                         rejected with --param queries=post_rope\n"
    "  --time                 print one JSON line to stderr: {\"command\", \"policy\", \"seconds\" (scoring, median "
    "of\n"
    "                         7 calls, file I/O excluded), \"select_seconds\" (compress: the selection, likewise),\n"
    "                         \"repeats\", \"bytes_read\" (K and Q bytes read per scoring call),\n"
    "                         \"workspace_bytes\" (kvc's scratch for those calls), \"threads\"}\n"
    "  --threads N            worker threads over (sequence, KV head) items, over sequences for tova (default 1;\n"
    "                         results do not depend on it)\n";

std::vector<CommandInfo> const& commands() {
  static std::vector<CommandInfo> const list = {
      {"score",
       "usage: kvc score --policy NAME [--param NAME=VALUE]... --keys K.npy [--values V.npy]\n"
       "                 [--queries Q.npy [--positions P.npy] [--rope theta=T,style=neox|interleaved]]\n"
       "                 --out scores.npy [--time] [--threads N]\n",
       "Scores every cached token with a policy: writes [B, Hkv, N] float32, higher = keep.\n",
       "  --out scores.npy       the scores\n",
       {"--policy", "--param", "--keys", "--values", "--queries", "--positions", "--rope", "--out", "--time",
        "--threads"}},
      {"compress",
       "usage: kvc compress --policy NAME (--ratio R | --budget N) [--param NAME=VALUE]... --keys K.npy\n"
       "                    --values V.npy [--queries Q.npy [--positions P.npy] [--rope theta=T,style=S]]\n"
       "                    --out-dir DIR [--time] [--threads N]\n",
       "Keeps the best-scored tokens of each (sequence, KV head) and writes, in DIR: keys.npy and values.npy\n"
       "([B, Hkv, n_kept, d], input dtype), indices.npy (int64 [B, Hkv, n_kept], ascending, -1 padding where heads\n"
       "keep different counts) and counts.npy (int64 [B, Hkv]).\n",
       "  --ratio R              the fraction of tokens removed, in [0, 1]: kept = floor(N * (1 - R))\n"
       "  --budget N             tokens kept per head\n"
       "  --out-dir DIR          created if absent\n",
       {"--policy", "--param", "--keys", "--values", "--queries", "--positions", "--rope", "--ratio", "--budget",
        "--out-dir", "--time", "--threads"}},
      {"policies",
       "usage: kvc policies\n",
       "Lists every policy with every parameter (--param NAME=DEFAULT) and what it reads.\n",
       "",
       {}},
  };
  return list;
}

CommandInfo const* find_command(std::string_view name) {
  for (auto const& c : commands())
    if (name == c.name)
      return &c;
  return nullptr;
}

void print_help(CommandInfo const& c) {
  std::fputs(c.synopsis, io.out);
  std::fputs(c.intro, io.out);
  if (std::string_view(c.name) != "policies") {
    std::fputs(input_details, io.out);
    std::fputs(c.own_options, io.out);
    std::fprintf(io.out, "Policies: %s (parameters: `kvc policies`).\n", policy_names().c_str());
    std::fputs("Exit codes: 0 success, 2 usage error, 3 invalid input.\n", io.out);
  }
}

struct Options {
  CommandInfo const* command = nullptr;
  std::map<std::string, std::string, std::less<>> values;  ///< option -> value, e.g. "--keys" -> path
  std::vector<std::string> params;
  bool time = false;
  bool help = false;

  bool has(std::string_view opt) const { return values.find(opt) != values.end(); }
  std::string get(std::string_view opt) const {
    auto const it = values.find(opt);
    return it == values.end() ? std::string() : it->second;
  }
};

Options parse_args(int argc, char const* const* argv) {
  if (argc < 2)
    fail(exit_usage, "missing command");
  std::string const name = argv[1];
  Options o;
  if (name == "--help" || name == "-h" || name == "help") {
    o.help = true;
    o.command = argc > 2 ? find_command(argv[2]) : nullptr;
    return o;
  }
  o.command = find_command(name);
  if (o.command == nullptr)
    fail(exit_usage, "unknown command '" + name + "'");
  auto const& allowed = o.command->options;
  for (int i = 2; i < argc; ++i)
    if (std::string_view(argv[i]) == "--help" || std::string_view(argv[i]) == "-h")
      o.help = true;
  if (o.help)
    return o;
  std::vector<std::string_view> known;
  for (auto const& c : commands())
    known.insert(known.end(), c.options.begin(), c.options.end());
  for (int i = 2; i < argc; ++i) {
    std::string const a = argv[i];
    if (std::find(allowed.begin(), allowed.end(), a) == allowed.end()) {
      if (std::find(known.begin(), known.end(), a) != known.end())
        fail(exit_usage, a + " is not an option of `kvc " + name + "`");
      fail(exit_usage, "unknown argument '" + a + "'");
    }
    if (a == "--time") {
      o.time = true;
      continue;
    }
    if (i + 1 >= argc)
      fail(exit_usage, a + " needs a value");
    std::string const value = argv[++i];
    if (a == "--param")
      o.params.push_back(value);
    else if (!o.values.emplace(a, value).second)
      fail(exit_usage, a + " given twice");
  }
  return o;
}

/// --rope theta=T,style=neox|interleaved (either key may be left out). Malformed text is a usage error.
kvc::RopeSpec parse_rope(std::string const& text) {
  kvc::RopeSpec spec;
  auto bad = [&](std::string const& why) {
    fail(exit_usage, "--rope '" + text + "': " + why + "; the form is theta=NUMBER,style=neox|interleaved");
  };
  bool seen_theta = false, seen_style = false;
  std::size_t start = 0;
  while (true) {
    std::size_t const comma = text.find(',', start);
    std::string const item = text.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    std::size_t const eq = item.find('=');
    if (eq == std::string::npos || eq == 0)
      bad("'" + item + "' is not KEY=VALUE");
    std::string const key = item.substr(0, eq), value = item.substr(eq + 1);
    if (key == "theta") {
      if (std::exchange(seen_theta, true))
        bad("theta given twice");
      char* end = nullptr;
      spec.theta = std::strtod(value.c_str(), &end);
      if (value.empty() || *end != '\0' || !std::isfinite(spec.theta) || !(spec.theta > 1.0))
        bad("theta = '" + value + "': expected a number > 1");
    } else if (key == "style") {
      if (std::exchange(seen_style, true))
        bad("style given twice");
      if (value == "neox")
        spec.style = kvc::RopeStyle::neox;
      else if (value == "interleaved")
        spec.style = kvc::RopeStyle::interleaved;
      else
        bad("style = '" + value + "': expected neox or interleaved");
    } else {
      bad("unknown key '" + key + "'");
    }
    if (comma == std::string::npos)
      break;
    start = comma + 1;
  }
  return spec;
}

/// Usage checks of --queries, --positions and --rope against the policy (before any file is read).
void check_query_options(PolicyInfo const& policy, Options const& o, Params const& p) {
  if (!policy.reads_queries) {
    for (char const* opt : {"--queries", "--positions", "--rope"})
      if (o.has(opt))
        fail(exit_usage, std::string(opt) + " given, but policy " + policy.name +
                             " does not read queries (the policies that do: " + policy_names(true) + ")");
    return;
  }
  if (!o.has("--queries"))
    fail(exit_usage, std::string("policy ") + policy.name +
                         " reads queries: pass --queries Q.npy (the context's last w queries, [B, Hq, w, d])");
  if (o.has("--rope") && p.at("queries") == "post_rope")
    fail(exit_usage, "--rope given, but --param queries=post_rope: post-RoPE queries are used as given");
}

// ---------------------------------------------------------------------------------------------------------------
// Memory and outputs.

/// The memory this program may take, in bytes: the kernel's estimate of memory available without swapping
/// (MemAvailable), or the physical memory where that is unknown. No buffer may be larger.
std::size_t memory_bytes() {
  if (std::FILE* f = std::fopen("/proc/meminfo", "r")) {
    char line[256];
    unsigned long long kib = 0;
    bool found = false;
    while (!found && std::fgets(line, sizeof line, f))
      found = std::sscanf(line, "MemAvailable: %llu kB", &kib) == 1;
    std::fclose(f);
    if (found && kib > 0)
      return static_cast<std::size_t>(kib) * 1024;
  }
  long const pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
  return pages > 0 && page > 0 ? static_cast<std::size_t>(pages) * static_cast<std::size_t>(page) : SIZE_MAX;
}

std::string bytes_text(double bytes) {
  char text[32];
  std::snprintf(text, sizeof text, "%.3g GiB", bytes / (1024.0 * 1024.0 * 1024.0));
  return text;
}

/// `count` elements of T for `what` (named in the error): refused when larger than this machine's memory, and an
/// allocation failure is reported as out of memory, naming what needed it.
template <class T>
std::vector<T> buffer(std::size_t count, std::string const& what, T fill = T{}) {
  double const bytes = static_cast<double>(count) * sizeof(T);
  std::size_t const available = memory_bytes();
  if (count > available / sizeof(T))
    fail(exit_invalid, what + " needs " + bytes_text(bytes) + ", more than the memory available (" +
                           bytes_text(static_cast<double>(available)) + ")");
  try {
    return std::vector<T>(count, fill);
  } catch (std::bad_alloc const&) {
    fail(exit_invalid, "out of memory: " + what + " needs " + bytes_text(bytes));
  }
}

/// The options naming input files, in the order they are read.
constexpr char const* input_options[] = {"--keys", "--values", "--queries", "--positions"};

/// Checks, before any input is read, that the output paths can be replaced: each is new or a regular file (never a
/// directory or a device such as /dev/null, which renaming would replace), none is one of the inputs, and no two are
/// the same file (same device and inode, whatever the paths: symbolic and hard links included). `what` names the
/// outputs in messages ("--out", "output file").
void check_outputs(Options const& o, std::vector<std::string> const& paths, std::string const& what) {
  std::vector<std::optional<kvc::FileId>> ids;
  for (std::string const& path : paths) {
    struct stat st {};
    if (::stat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode))
      fail(exit_invalid,
           what + " " + path + " exists and is not a regular file; expected a new path or a file to replace");
    std::optional<kvc::FileId> const id = kvc::file_id(path);
    for (char const* opt : input_options)
      if (id && o.has(opt) && kvc::file_id(o.get(opt)) == id)
        fail(exit_invalid, what + " " + path + " is the same file as " + opt + " " + o.get(opt) +
                               ": refusing to overwrite an input (choose another output path)");
    for (std::size_t i = 0; i < ids.size(); ++i)
      if (id && ids[i] == id)
        fail(exit_invalid,
             what + " " + path + " is the same file as " + paths[i] + " (links): each output needs its own file");
    ids.push_back(id);
  }
}

/// An array to write as a .npy file.
struct Output {
  std::string path;
  kvc::NpyDtype dtype;
  std::vector<kvc::Index> shape;
  void const* data;
};

/// Writes every output whole or none: each is staged in a temporary file beside its destination (written, synced
/// and closed, every error checked), and they are renamed into place only once all are whole. A failure removes
/// the temporaries and names the file; the destinations keep what they held. (Links are followed: an existing
/// destination is replaced where its link points.)
void write_outputs(std::vector<Output> const& outputs) {
  std::vector<kvc::StagedFile> staged(outputs.size());
  std::vector<std::string> destinations;
  std::string error;
  for (std::size_t i = 0; i < outputs.size(); ++i) {
    Output const& out = outputs[i];
    std::error_code ec;
    std::filesystem::path const real = std::filesystem::exists(out.path, ec) && !ec
                                           ? std::filesystem::canonical(out.path, ec)
                                           : std::filesystem::path(out.path);
    destinations.push_back(ec ? out.path : real.string());
    if (!kvc::stage_npy(staged[i], destinations[i], out.dtype, out.shape, out.data, error))
      fail(exit_invalid, "output file " + out.path + ": " + error);
  }
  std::size_t failed = 0;
  if (!kvc::commit_together(staged, error, failed))
    fail(exit_invalid, "output file " + outputs[failed].path + ": " + error);
}

/// Creates `dir` and any missing parents, one component at a time, and records the folders it made (parents
/// first) so that a failure can remove exactly those.
void make_folders(std::string const& dir, std::vector<std::string>& made) {
  std::string prefix;
  std::size_t start = 0;
  while (start <= dir.size()) {
    std::size_t const slash = std::min(dir.find('/', start), dir.size());
    prefix = dir.substr(0, slash);
    start = slash + 1;
    if (prefix.empty() || prefix.back() == '/')
      continue;  // the root, or a doubled slash
    if (::mkdir(prefix.c_str(), 0777) == 0) {
      made.push_back(prefix);
    } else if (errno != EEXIST) {
      int const err = errno;
      fail(exit_invalid, "--out-dir " + dir + ": cannot create the folder " + prefix + " (" + std::strerror(err) + ")");
    }
  }
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode))
    fail(exit_invalid, "--out-dir " + dir + " is not a directory");
}

// ---------------------------------------------------------------------------------------------------------------
// Inputs.

struct Input {
  std::string path;
  kvc::NpyArray array;
};

/// Reads a rank-4 float32/float16 tensor; `role` names it in messages ("keys file K.npy: ..."). The file's size
/// bounds the array, and every dimension must be >= 1, so that no size derived from the shape (scores, plans,
/// workspaces) exceeds what the file holds.
Input load_tensor(std::string const& path, char const* role, char const* dims) {
  Input in{path, {}};
  std::string error;
  std::string const where = std::string(role) + " file " + path + ": ";
  if (!kvc::read_npy(path, in.array, error, memory_bytes()))  // the limit: a sparse file may claim more than memory
    fail(exit_invalid, where + error);
  auto const& s = in.array.shape;
  if (s.size() != 4)
    fail(exit_invalid,
         where + "field 'shape' has " + std::to_string(s.size()) + " dimensions, expected 4 (" + dims + ")");
  if (in.array.dtype != kvc::NpyDtype::f32 && in.array.dtype != kvc::NpyDtype::f16)
    fail(exit_invalid, where + "field 'descr' is " + std::string(kvc::npy_descr(in.array.dtype)) +
                           ", expected '<f4' (float32) or '<f2' (float16)");
  if (std::find(s.begin(), s.end(), 0) != s.end())
    fail(exit_invalid, where + "field 'shape' is (" + std::to_string(s[0]) + ", " + std::to_string(s[1]) + ", " +
                           std::to_string(s[2]) + ", " + std::to_string(s[3]) +
                           "): every dimension must be >= 1 (an empty array holds nothing to score)");
  return in;
}

char const* const kv_dims = "[batch, kv_heads, tokens, head_dim]";

kvc::KVExtents extents_of(Input const& in) {
  auto const& s = in.array.shape;
  return {s[0], s[1], s[2], s[3]};
}

/// `x` in %.3g.
std::string short_number(double x) {
  char text[32];
  std::snprintf(text, sizeof text, "%.3g", x);
  return text;
}

/// "beyond the exact range ..." for head dim `dim` (docs/numerics.md, "Range").
std::string range_text(kvc::Index dim) {
  return "beyond the exact range of attention logits in fp32 (head_dim * x^2 < 2^126: |x| < " +
         short_number(std::sqrt(0x1p126 / static_cast<double>(dim))) + " at head_dim " + std::to_string(dim) +
         "; see docs/numerics.md)";
}

/// What the keys must satisfy beyond finiteness for a policy's scores to be exact (docs/numerics.md, "Range").
enum class KeyRange : std::uint8_t {
  finite,  ///< KeyDiff (exact for every finite key) and the policies that read no data
  norms,   ///< Knorm: every key's norm below FLT_MAX (past it the fp32 score is -inf and such keys would tie)
  logits,  ///< window scorers: head_dim * x^2 < 2^126, so q.k logits stay finite
};

KeyRange key_range(PolicyInfo const& policy) {
  return policy.reads_queries ? KeyRange::logits
                              : (std::string_view(policy.name) == "knorm" ? KeyRange::norms : KeyRange::finite);
}

/// Fails naming the keys file when a row's norm (in double) exceeds FLT_MAX.
template <class Rows>
void check_key_norms(Rows const& rows, std::string const& path) {
  kvc::KVExtents const e = rows.extents();
  for (kvc::Index r = 0; r < e.rows(); ++r) {
    kvc::Index const b = r / (e.heads * e.tokens), h = r / e.tokens % e.heads, t = r % e.tokens;
    double const sum = kvc::detail::sum_squares_fp64(rows.row(b, h, t), e.dim);
    if (!(std::sqrt(sum) <= std::numeric_limits<float>::max()))
      fail(exit_invalid, "keys file " + path + ": field 'data': the key at [" + std::to_string(b) + ", " +
                             std::to_string(h) + ", " + std::to_string(t) + "] has norm " +
                             short_number(std::sqrt(sum)) +
                             ", past the largest float (3.4e38): its Knorm score would be -inf and tie with others "
                             "(see docs/numerics.md, Range)");
  }
}

/// Runs fn(cache) with a typed host view over keys (and values, or keys again when absent), once the data passed
/// the checks `range` asks for.
template <class Fn>
void with_cache(Input const& keys, Input const* values, KeyRange range, Fn&& fn) {
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
    if (range == KeyRange::logits && !kvc::validate_rows(cache.keys, {.check_range = true}).ok())
      fail(exit_invalid, "keys file " + keys.path + ": field 'data' holds a value " + range_text(ek.dim));
    if (range == KeyRange::norms)
      check_key_norms(cache.keys, keys.path);
    fn(cache);
  };
  if (keys.array.dtype == kvc::NpyDtype::f16)
    run(kvc::half{});
  else
    run(float{});
}

/// Window queries widened to fp32 (exact for float16), their positions and the RoPE table that rotates them.
/// Not copyable: the table points into `rope_storage`.
struct Queries {
  std::string path, positions_path;
  kvc::KVExtents ext{};  ///< [B, Hq, w, d]
  std::vector<float> rows;
  std::vector<kvc::Index> positions;  ///< [B, w]; empty: the context's last w positions
  std::vector<float> rope_storage;
  kvc::RopeTable<> rope{};  ///< empty: post-RoPE queries
  std::size_t file_bytes = 0;

  Queries() = default;
  Queries(Queries const&) = delete;
  Queries& operator=(Queries const&) = delete;

  kvc::WindowQueries<float> view() const {
    return {kvc::TokenRows<float const, kvc::StridedLayout>(rows.data(), kvc::bhtd_layout(ext)), rope,
            positions.empty() ? nullptr : positions.data()};
  }
};

/// The largest RoPE table --positions may ask for (positions x head_dim fp32 cos/sin).
constexpr std::size_t max_rope_table_bytes = std::size_t{1} << 30;

/// Loads --queries (and --positions) for keys of extents `k`, and fills the RoPE table when they are pre-RoPE.
void load_queries(Options const& o, kvc::KVExtents const& k, std::string const& keys_path, bool rotate,
                  kvc::RopeSpec const& spec, Queries& q) {
  q.path = o.get("--queries");
  Input const in = load_tensor(q.path, "queries", "[batch, query_heads, window, head_dim]");
  q.ext = extents_of(in);
  q.file_bytes = in.array.data.size();
  std::string const where = "queries file " + q.path + ": field 'shape': ";
  if (q.ext.batch != k.batch)
    fail(exit_invalid, where + "batch (shape[0]) is " + std::to_string(q.ext.batch) + ", expected the keys' " +
                           std::to_string(k.batch));
  if (k.heads <= 0 || q.ext.heads <= 0 || q.ext.heads % k.heads != 0)
    fail(exit_invalid, where + "query heads (shape[1]) is " + std::to_string(q.ext.heads) +
                           ", expected a positive multiple of the keys' KV heads (" + std::to_string(k.heads) + ")");
  if (q.ext.dim != k.dim)
    fail(exit_invalid, where + "head_dim (shape[3]) is " + std::to_string(q.ext.dim) + ", expected the keys' " +
                           std::to_string(k.dim) + " (" + keys_path + ")");
  q.rows = buffer<float>(static_cast<std::size_t>(q.ext.rows() * q.ext.dim), "the fp32 copy of queries file " + q.path);
  for (std::size_t i = 0; i < q.rows.size(); ++i) {
    q.rows[i] =
        in.array.dtype == kvc::NpyDtype::f16 ? kvc::to_float(in.array.as<kvc::half>()[i]) : in.array.as<float>()[i];
    if (!std::isfinite(q.rows[i]))
      fail(exit_invalid, "queries file " + q.path + ": field 'data' holds NaN or Inf (element " + std::to_string(i) +
                             "), expected finite values");
    if (!kvc::in_exact_range(q.rows[i], q.ext.dim))
      fail(exit_invalid, "queries file " + q.path + ": field 'data': element " + std::to_string(i) + " is " +
                             short_number(q.rows[i]) + ", " + range_text(q.ext.dim));
  }

  kvc::Index max_position = k.tokens - 1;  // the default positions end at N - 1
  if (o.has("--positions")) {
    q.positions_path = o.get("--positions");
    std::string const pw = "positions file " + q.positions_path + ": ";
    kvc::NpyArray p;
    std::string error;
    if (!kvc::read_npy(q.positions_path, p, error, memory_bytes()))
      fail(exit_invalid, pw + error);
    if (p.dtype != kvc::NpyDtype::i64)
      fail(exit_invalid, pw + "field 'descr' is " + std::string(kvc::npy_descr(p.dtype)) + ", expected '<i8' (int64)");
    if (p.shape != std::vector<kvc::Index>{q.ext.batch, q.ext.tokens})
      fail(exit_invalid, pw + "field 'shape' has " + std::to_string(p.shape.size()) +
                             " dimensions or other sizes, expected [batch, window] = [" + std::to_string(q.ext.batch) +
                             ", " + std::to_string(q.ext.tokens) + "] (the queries' shape[0] and shape[2])");
    q.positions = buffer<kvc::Index>(static_cast<std::size_t>(p.size()), "the positions of " + q.positions_path);
    std::copy_n(p.as<std::int64_t>(), p.size(), q.positions.data());
    max_position = 0;
    std::size_t const per_position = static_cast<std::size_t>(q.ext.dim) * sizeof(float);
    for (std::size_t i = 0; i < q.positions.size(); ++i) {
      kvc::Index const pos = q.positions[i];
      if (pos < 0)
        fail(exit_invalid, pw + "field 'data': position " + std::to_string(pos) + " (element " + std::to_string(i) +
                               ") is negative, expected >= 0");
      if (rotate && static_cast<std::size_t>(pos) >= max_rope_table_bytes / per_position)
        fail(exit_invalid, pw + "field 'data': position " + std::to_string(pos) +
                               " needs a RoPE table over 1 GiB; expected positions < " +
                               std::to_string(max_rope_table_bytes / per_position));
      max_position = std::max(max_position, pos);
    }
  }
  if (!rotate)
    return;
  if (auto const st = spec.check(q.ext.dim); !st.ok())
    fail(exit_invalid, where + "head_dim (shape[3]) is " + std::to_string(q.ext.dim) +
                           ": RoPE rotates pairs of channels, expected an even head_dim (or pass "
                           "--param queries=post_rope for queries already rotated)");
  kvc::Index const table_positions = std::max<kvc::Index>(1, max_position + 1);
  q.rope_storage = buffer<float>(static_cast<std::size_t>(kvc::rope_table_floats(table_positions, q.ext.dim)),
                                 "the RoPE table of queries file " + q.path);
  if (auto const st = kvc::fill_rope_table(spec, q.ext.dim, table_positions, q.rope_storage.data(), q.rope); !st.ok())
    fail(exit_invalid, "--rope: " + std::string(st.message()));
}

/// Query rows a scorer reads: the last `rows_used` rows of the window.
kvc::Index rows_used(kvc::SnapKVScorer const& s) {
  return s.window_size;
}
kvc::Index rows_used(kvc::TOVAScorer const&) {
  return 1;
}

/// Calls fn(obs) with the observations the scorer needs: the window queries, or none.
template <class S, class Fn>
void with_observations(S const& scorer, Queries const& q, kvc::KVExtents const& k, std::string const& keys_path,
                       Fn&& fn) {
  if constexpr (kvc::has_need(S::needs, kvc::Needs::window_queries)) {
    kvc::Index const used = rows_used(scorer);
    if (used > q.ext.tokens)
      fail(exit_invalid, "queries file " + q.path + ": field 'shape': window (shape[2]) is " +
                             std::to_string(q.ext.tokens) + ", but policy " + std::string(S::name) +
                             " reads the last " + std::to_string(used) +
                             " query rows (--param window_size); pass more queries or a smaller window_size");
    if (q.positions.empty() && used > k.tokens)
      fail(exit_invalid, "keys file " + keys_path + ": field 'shape': tokens (shape[2]) is " +
                             std::to_string(k.tokens) + ", but the last " + std::to_string(used) +
                             " query rows sit at positions N - " + std::to_string(used) +
                             " .. N - 1 (pass --positions P.npy)");
    fn(kvc::observe(q.view()));
  } else {
    fn(kvc::NoObservations{});
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Running.

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

constexpr int timing_repeats = 7;

/// What --time prints (one JSON line on stderr).
struct Timing {
  double seconds = 0;               ///< scoring, median
  double select_seconds = -1;       ///< compress: the selection, median (left out when negative)
  std::size_t workspace_bytes = 0;  ///< kvc's workspaces for the calls timed (score, and select for compress)
  kvc::Index threads = 1;
};

void print_time(char const* command, PolicyInfo const& policy, Timing const& t, std::size_t bytes_read) {
  char selection[64] = "";
  if (t.select_seconds >= 0)
    std::snprintf(selection, sizeof selection, ", \"select_seconds\": %.9g", t.select_seconds);
  std::fprintf(io.err,
               "{\"command\": \"%s\", \"policy\": \"%s\", \"seconds\": %.9g%s, \"repeats\": %d, \"bytes_read\": %zu, "
               "\"workspace_bytes\": %zu, \"threads\": %lld}\n",
               command, policy.name, t.seconds, selection, timing_repeats, bytes_read, t.workspace_bytes,
               static_cast<long long>(t.threads));
}

/// --threads N (default 1): the worker threads of kvc::ThreadPool the kernels spread (sequence, head) items over.
kvc::Index thread_count(Options const& o) {
  kvc::Index const n = o.has("--threads") ? parse_count(o.get("--threads"), "--threads", 1) : 1;
  if (n > 1024)
    fail(exit_invalid, "--threads " + o.get("--threads") + ": expected at most 1024");
  return n;
}

void check_status(kvc::Status st, std::string const& context) {
  if (!st.ok())
    fail(exit_invalid, context + ": " + st.message());
}

/// What score and compress share: the policy, its parameters, the keys (and values) and the queries.
struct Job {
  PolicyInfo const& policy;
  Params params;
  bool rotate = false;  ///< pre-RoPE queries, rotated with `rope`
  kvc::RopeSpec rope{};
  Input keys;
  std::optional<Input> values;
  Queries queries;

  explicit Job(PolicyInfo const& p) : policy(p) {}

  std::size_t bytes_read() const {
    return (policy.reads_keys ? keys.array.data.size() : 0) + (policy.reads_queries ? queries.file_bytes : 0);
  }
  std::string context() const {
    return "keys file " + keys.path + (policy.reads_queries ? " / queries file " + queries.path : std::string());
  }

  /// Calls fn(scorer, selection, cache, obs) with everything typed.
  template <class Fn>
  void run(Fn&& fn) const {
    kvc::KVExtents const e = extents_of(keys);
    with_policy(policy, params, [&](auto const& scorer, Selection sel) {
      with_cache(keys, values ? &*values : nullptr, key_range(policy), [&](auto const& cache) {
        with_observations(scorer, queries, e, keys.path, [&](auto const& obs) { fn(scorer, sel, cache, obs); });
      });
    });
  }
};

/// The option checks: usage errors (exit 2) first, then the `queries` parameter's value.
void check_job(Options const& o, bool compress, Job& job) {
  job.params = resolve_params(job.policy, o.params, compress);
  check_query_options(job.policy, o, job.params);
  if (o.has("--rope"))
    job.rope = parse_rope(o.get("--rope"));
  job.rotate = job.policy.reads_queries && pre_rope(job.params);
}

/// Reads the keys, the values and the queries.
void load_job(Options const& o, Job& job) {
  job.keys = load_tensor(o.get("--keys"), "keys", kv_dims);
  if (o.has("--values"))
    job.values = load_tensor(o.get("--values"), "values", kv_dims);
  if (job.policy.reads_queries)
    load_queries(o, extents_of(job.keys), job.keys.path, job.rotate, job.rope, job.queries);
}

/// A kernel's workspace: uninitialised (kernels write before they read, so untouched pages cost nothing), within
/// the memory available, and refused with a message when its size saturated (a product of two inputs' sizes).
struct Scratch {
  std::unique_ptr<std::byte[]> data;
  std::size_t size = 0;
  kvc::Workspace span() const { return {data.get(), size}; }
};

Scratch workspace(std::size_t bytes, Job const& job) {
  std::string const what = "the workspace of policy " + std::string(job.policy.name) + " over " + job.context();
  std::size_t const available = memory_bytes();
  if (bytes > available)
    fail(exit_invalid,
         what + " needs " +
             (bytes == SIZE_MAX ? std::string("more than 2^64 bytes") : bytes_text(static_cast<double>(bytes))) +
             ", more than the memory available (" + bytes_text(static_cast<double>(available)) + ")");
  Scratch s{std::unique_ptr<std::byte[]>(new (std::nothrow) std::byte[bytes == 0 ? 1 : bytes]), bytes};
  if (!s.data)
    fail(exit_invalid, "out of memory: " + what + " needs " + bytes_text(static_cast<double>(bytes)));
  return s;
}

int cmd_score(Options const& o) {
  if (!o.has("--policy") || !o.has("--keys") || !o.has("--out"))
    fail(exit_usage, "score needs --policy, --keys and --out");
  Job job(find_policy(o.get("--policy")));
  check_job(o, false, job);
  check_outputs(o, {o.get("--out")}, "--out");
  load_job(o, job);
  kvc::KVExtents const e = extents_of(job.keys);
  kvc::Index const threads = thread_count(o);
  kvc::ThreadPool pool(threads);
  kvc::Cpu const cpu = threads > 1 ? pool.cpu() : kvc::Cpu{};
  std::vector<float> scores = buffer<float>(static_cast<std::size_t>(e.rows()), "the scores of " + job.context());
  job.run([&](auto const& scorer, Selection, auto const& cache, auto const& obs) {
    Scratch const ws = workspace(kvc::score_workspace_bytes(cpu, scorer, e, obs), job);
    kvc::ScoreSpan<> out{scores.data(), e.batch, e.heads, e.tokens};
    auto once = [&] { check_status(kvc::score(cpu, scorer, cache, obs, out, ws.span()), job.context()); };
    once();
    if (o.time)
      print_time("score", job.policy, {median_seconds(timing_repeats, once), -1, ws.size, threads}, job.bytes_read());
  });
  write_outputs({{o.get("--out"), kvc::NpyDtype::f32, {e.batch, e.heads, e.tokens}, scores.data()}});
  return 0;
}

/// The files compress writes into --out-dir.
constexpr char const* compress_outputs[] = {"keys.npy", "values.npy", "indices.npy", "counts.npy"};

int cmd_compress(Options const& o) {
  if (!o.has("--policy") || !o.has("--keys") || !o.has("--values") || !o.has("--out-dir"))
    fail(exit_usage, "compress needs --policy, --keys, --values and --out-dir");
  if (o.has("--ratio") == o.has("--budget"))
    fail(exit_usage, "compress needs exactly one of --ratio and --budget");
  Job job(find_policy(o.get("--policy")));
  check_job(o, true, job);
  std::optional<double> const ratio = o.has("--ratio") ? std::optional(parse_ratio(o.get("--ratio"))) : std::nullopt;
  kvc::Index const budget = o.has("--budget") ? parse_count(o.get("--budget"), "--budget") : 0;
  std::string const out_dir = o.get("--out-dir");
  struct stat st {};
  if (::stat(out_dir.c_str(), &st) == 0 && !S_ISDIR(st.st_mode))
    fail(exit_invalid, "--out-dir " + out_dir + " exists and is not a directory");
  std::vector<std::string> outputs;
  for (char const* name : compress_outputs)
    outputs.push_back(out_dir + "/" + name);
  check_outputs(o, outputs, "output file");
  load_job(o, job);
  Input const& keys = job.keys;
  Input const& values = *job.values;
  kvc::KVExtents const e = extents_of(keys);
  auto const rows = static_cast<std::size_t>(e.rows()), heads = static_cast<std::size_t>(e.batch * e.heads);
  std::vector<kvc::Index> index = buffer<kvc::Index>(rows, "the keep plan of " + job.context());
  std::vector<kvc::Index> count = buffer<kvc::Index>(heads, "the keep plan of " + job.context());
  kvc::KeepPlan<> plan{index.data(), count.data(), e.batch, e.heads, e.tokens};
  kvc::Index const threads = thread_count(o);
  kvc::ThreadPool pool(threads);
  kvc::Cpu const cpu = threads > 1 ? pool.cpu() : kvc::Cpu{};
  std::vector<float> scores = buffer<float>(rows, "the scores of " + job.context());

  // kvc::compress is kvc::score then kvc::select; they are called one by one so that --time reports each.
  job.run([&](auto const& scorer, Selection sel, auto const& cache, auto const& obs) {
    auto run = [&](auto budget_value) {
      kvc::TopKSelector<decltype(budget_value)> const selector{budget_value, sel.n_sink, sel.n_recent};
      Scratch const score_ws = workspace(kvc::score_workspace_bytes(cpu, scorer, e, obs), job);
      Scratch const select_ws = workspace(kvc::select_workspace_bytes(cpu, selector, e.batch, e.heads, e.tokens), job);
      kvc::ScoreSpan<> span{scores.data(), e.batch, e.heads, e.tokens, cache.lengths};
      auto score_once = [&] {
        check_status(kvc::score(cpu, scorer, cache, obs, span, score_ws.span()), job.context());
      };
      auto select_once = [&] { check_status(kvc::select(cpu, selector, span, plan, select_ws.span()), job.context()); };
      score_once();
      select_once();
      if (o.time)
        print_time("compress", job.policy,
                   {median_seconds(timing_repeats, score_once), median_seconds(timing_repeats, select_once),
                    score_ws.size + select_ws.size, threads},
                   job.bytes_read());
    };
    if (ratio)
      run(kvc::RatioBudget{*ratio});
    else
      run(kvc::FixedBudget{budget});
    check_status(kvc::compact(cpu, plan, cache), "compact");
  });
  kvc::Index kept_max = 0;
  for (kvc::Index c : count)
    kept_max = std::max(kept_max, c);

  // Repack [B, H, kept_max, d]: compaction left each head's kept rows in its first slots. Every size is at most the
  // input's (kept_max <= tokens).
  auto repack = [&](Input const& in) {
    kvc::Index const d = in.array.shape[3], item = kvc::npy_itemsize(in.array.dtype);
    std::vector<std::byte> out =
        buffer<std::byte>(heads * static_cast<std::size_t>(kept_max * d * item), "the compressed copy of " + in.path);
    for (kvc::Index bh = 0; bh < e.batch * e.heads; ++bh)
      std::copy_n(in.array.data.data() + bh * e.tokens * d * item, count[static_cast<std::size_t>(bh)] * d * item,
                  out.data() + bh * kept_max * d * item);
    return out;
  };
  std::vector<kvc::Index> kept_index =
      buffer<kvc::Index>(heads * static_cast<std::size_t>(kept_max), "the kept indices of " + job.context(), -1);
  for (kvc::Index bh = 0; bh < e.batch * e.heads; ++bh)
    std::copy_n(index.data() + bh * e.tokens, count[static_cast<std::size_t>(bh)], kept_index.data() + bh * kept_max);
  auto const k_out = repack(keys), v_out = repack(values);

  std::vector<std::string> made;  // the folders this call creates, removed again if the outputs cannot be written
  std::string const dir = out_dir + "/";
  try {
    make_folders(out_dir, made);
    write_outputs({{dir + compress_outputs[0], keys.array.dtype, {e.batch, e.heads, kept_max, e.dim}, k_out.data()},
                   {dir + compress_outputs[1],
                    values.array.dtype,
                    {e.batch, e.heads, kept_max, values.array.shape[3]},
                    v_out.data()},
                   {dir + compress_outputs[2], kvc::NpyDtype::i64, {e.batch, e.heads, kept_max}, kept_index.data()},
                   {dir + compress_outputs[3], kvc::NpyDtype::i64, {e.batch, e.heads}, count.data()}});
  } catch (Failure const&) {
    for (auto folder = made.rbegin(); folder != made.rend(); ++folder)  // deepest first; each is empty
      ::rmdir(folder->c_str());
    throw;
  }
  return 0;
}

int cmd_policies() {
  auto param_text = [](ParamInfo const& p) {
    std::string s = std::string("--param ") + p.name + "=" + p.default_value;
    if (p.kvpress_default)
      s += std::string(" (kvpress: ") + p.kvpress_default + ")";
    return s;
  };
  std::size_t width = 0;
  for (auto const& policy : policies())
    for (auto const& p : policy.params)
      width = std::max(width, param_text(p).size());
  for (auto const& policy : policies()) {
    char const* reads = policy.reads_queries ? "keys and --queries" : (policy.reads_keys ? "keys" : "no tensor data");
    std::fprintf(io.out, "%s  (reads %s)\n    %s\n", policy.name, reads, policy.summary);
    for (auto const& p : policy.params)
      std::fprintf(io.out, "    %-*s  %s\n", static_cast<int>(width), param_text(p).c_str(), p.help);
  }
  std::fprintf(
      io.out,
      "n_sink and n_recent protect tokens in compress's top-k selection; `kvc score` rejects them.\n"
      "budgets (compress): --ratio R (fraction removed, kept = floor(N*(1-R))) or --budget N (tokens per head)\n");
  return 0;
}

}  // namespace

namespace kvc::cli {

int run(int argc, char const* const* argv, std::FILE* out, std::FILE* err) {
  io = {out, err};
  CommandInfo const* command = nullptr;
  try {
    Options const o = parse_args(argc, argv);
    command = o.command;
    if (o.help) {
      if (o.command)
        print_help(*o.command);
      else
        std::fputs(overview_text, io.out);
      return 0;
    }
    std::string_view const name = o.command->name;
    if (name == "score")
      return cmd_score(o);
    if (name == "compress")
      return cmd_compress(o);
    return cmd_policies();
  } catch (Failure const& f) {
    std::fprintf(io.err, "kvc: error: %s\n", f.message.c_str());
    if (f.code == exit_usage) {
      if (command == nullptr && argc > 1)
        command = find_command(argv[1]);
      if (command)
        std::fprintf(io.err, "%sRun `kvc %s --help` for the options.\n", command->synopsis, command->name);
      else
        std::fputs(overview_text, io.err);
    }
    return f.code;
  } catch (std::bad_alloc const&) {  // every large buffer is named by buffer(); this is a last resort
    std::fprintf(io.err, "kvc: error: out of memory\n");
    return exit_invalid;
  } catch (std::logic_error const& e) {  // a bug in kvc, not in the input: its own exit code (the fuzzer stops)
    std::fprintf(io.err, "kvc: internal error: %s\n", e.what());
    return exit_internal;
  } catch (std::exception const& e) {
    std::fprintf(io.err, "kvc: error: %s\n", e.what());
    return exit_invalid;
  }
}

}  // namespace kvc::cli
