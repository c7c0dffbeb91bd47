// SPDX-License-Identifier: Apache-2.0
// tools/common/policies.hpp: the one table of kvc's policies for the tools (`kvc`, `kvc-eval`): names, summaries,
// parameters with their defaults (kvpress's where reference=kvpress), what each reads, and the one place a scorer is
// built from a name and NAME=VALUE parameters (with_policy). Errors throw kvc::tools::Failure with the exit code of
// the tools' contract: 2 usage, 3 invalid input, 70 a bug in kvc.
#pragma once

#include <kvc/backend/cpu/scorers/expected_attention.hpp>
#include <kvc/backend/cpu/scorers/h2o.hpp>
#include <kvc/backend/cpu/scorers/key_diff.hpp>
#include <kvc/backend/cpu/scorers/knorm.hpp>
#include <kvc/backend/cpu/scorers/random.hpp>
#include <kvc/backend/cpu/scorers/snap_kv.hpp>
#include <kvc/backend/cpu/scorers/streaming_llm.hpp>
#include <kvc/backend/cpu/scorers/tova.hpp>
#include <kvc/backend/cpu/selectors/ada_kv.hpp>
#include <kvc/backend/cpu/selectors/top_k.hpp>
#include <kvc/calibration/matrix_entropy.hpp>
#include <kvc/calibration/uncomp_policy.hpp>
#include <kvc/core/params.hpp>
#include <kvc/engine/moment_kv_policy.hpp>
#include <kvc/pipeline/packed_press.hpp>
#include <kvc/pipeline/rdkv_policy.hpp>
#include <kvc/selectors/pyramid_kv.hpp>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstdint>
#include <cstdlib>
#include <initializer_list>
#include <map>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace kvc::tools {

constexpr int exit_usage = 2;
constexpr int exit_invalid = 3;
constexpr int exit_internal = 70;  ///< EX_SOFTWARE: a bug in kvc (e.g. the policy table and a scorer disagree)

/// An error that ends the program with a message and an exit code.
struct Failure {
  int code;
  std::string message;
};

[[noreturn]] inline void fail(int code, std::string message) {
  throw Failure{code, std::move(message)};
}

// ---------------------------------------------------------------------------------------------------------------
// Policies: the one table of names, summaries, parameters (with defaults and help) and inputs read.

/// Where a parameter acts: the scorer, compress's top-k selection (compress only), how the queries are read, or
/// RDKV's bit allocation and packing (compress and kvc-eval only: `kvc score` writes the weights it does not change).
enum class Stage : std::uint8_t { scorer, selection, queries, allocation };

/// Parameter values by name (after resolve_params: every parameter of the policy, defaults filled in).
using Params = std::map<std::string, std::string, std::less<>>;

struct ParamInfo {
  char const* name;
  char const* default_value;
  char const* help;
  Stage stage = Stage::scorer;
  char const* kvpress_default = nullptr;  ///< the default under reference=kvpress, where it differs
  char const* authors_default = nullptr;  ///< the default under reference=authors, where it differs (rdkv)
};

struct PolicyInfo {
  char const* name;
  char const* summary;
  std::vector<ParamInfo> params;
  bool reads_keys;
  bool reads_queries;         ///< needs --queries (and accepts --positions, --rope and the `queries` parameter)
  bool reads_values = false;  ///< scores read the values too (kvc score needs --values)
  /// true: a cache policy (scores every token; kvc compress, kvc-eval rows). false: `kvc score` writes one value
  /// per (sequence, query head) instead (uncomp_entropy), and compress and kvc-eval refuse it.
  bool token_scores = true;
};

// ---------------------------------------------------------------------------------------------------------------
// Declared parameters (kvc/core/params.hpp): a policy struct's parameters() become table rows and are parsed from
// NAME=VALUE text here, once for every tool.

/// Table rows one after the other (a policy's declared parameters, then the tools' own).
inline std::vector<ParamInfo> operator+(std::vector<ParamInfo> a, std::vector<ParamInfo> const& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

/// A string that lives as long as the program (the table's rows are C strings built once).
inline char const* intern(std::string text) {
  static std::set<std::string> strings;
  return strings.insert(std::move(text)).first->c_str();
}

/// The shortest text that reads back as exactly `v` (std::to_chars: 0.01f is "0.01", not "0.00999999978"), its
/// exponent without a plus sign or leading zeros (1e-6, 1e30: as a user types it).
template <class T>
std::string number_text(T v) {
  char buf[64];
  auto const r = std::to_chars(buf, buf + sizeof buf, v);
  std::string text(buf, r.ptr);
  if (auto e = text.find('e'); e != std::string::npos) {
    std::size_t digits = e + 1 + (text[e + 1] == '-' ? 1 : 0);
    if (text[e + 1] == '+')
      text.erase(e + 1, 1);
    while (digits + 1 < text.size() && text[digits] == '0')
      text.erase(digits, 1);
  }
  return text;
}

/// A parameter's value as --param spells it.
template <class P>
std::string value_text(P const& p, typename P::value_type v) {
  if constexpr (0 < std::tuple_size_v<decltype(p.names)>) {
    for (auto const& n : p.names)
      if (n.value == v)
        return std::string(n.name);
    throw std::logic_error("kvc: parameter " + std::string(p.name) + " has a default outside its names");
  } else {
    return number_text(v);
  }
}

/// A parameter's stage other than the policy's own (declared_params).
struct StageOf {
  std::string_view name;
  Stage stage;
};

/// The table rows of policy struct S's declared parameters, at `stage` (those named in `stages` at theirs):
/// defaults from S{}, kvpress defaults from S::kvpress() and authors defaults from S::authors() where they differ
/// (not for `reference` itself).
template <kvc::DeclaresParameters S>
std::vector<ParamInfo> declared_params(Stage stage = Stage::scorer, std::initializer_list<StageOf> stages = {}) {
  std::vector<ParamInfo> rows;
  S const defaults{};
  auto row = [&](auto const& p) {
    ParamInfo info{intern(std::string(p.name)), intern(value_text(p, p.of(defaults))), intern(std::string(p.doc)),
                   stage};
    for (StageOf const& s : stages)
      if (s.name == p.name)
        info.stage = s.stage;
    if constexpr (requires { S::kvpress(); }) {
      S const kvpress = S::kvpress();
      if (p.name != "reference" && p.of(kvpress) != p.of(defaults))
        info.kvpress_default = intern(value_text(p, p.of(kvpress)));
    }
    if constexpr (requires { S::authors(); }) {
      S const authors = S::authors();
      if (p.name != "reference" && p.of(authors) != p.of(defaults))
        info.authors_default = intern(value_text(p, p.of(authors)));
    }
    rows.push_back(info);
  };
  std::apply([&](auto const&... p) { (row(p), ...); }, S::parameters());
  for (StageOf const& s : stages)  // a misspelt name would leave its parameter at the wrong stage
    if (std::none_of(rows.begin(), rows.end(), [&](ParamInfo const& r) { return s.name == r.name; }))
      throw std::logic_error("kvc: declared_params names a stage for " + std::string(s.name) + ", not a parameter");
  return rows;
}

/// `rows` in the order `names` lists them (a policy's declared rows and the tools' own, interleaved as `kvc
/// policies` shows them); every row must be named once.
inline std::vector<ParamInfo> in_order(std::vector<ParamInfo> const& rows,
                                       std::initializer_list<std::string_view> names) {
  std::vector<ParamInfo> out;
  for (std::string_view name : names)
    for (ParamInfo const& r : rows)
      if (name == r.name)
        out.push_back(r);
  if (out.size() != rows.size() || out.size() != names.size())
    throw std::logic_error("kvc: in_order names other rows than the policy has");
  return out;
}

/// `rows` with `more` appended to the help of row `name` (a tool's extension of a declared parameter).
inline std::vector<ParamInfo> with_help(std::vector<ParamInfo> rows, std::string_view name, std::string_view more) {
  for (ParamInfo& r : rows)
    if (name == r.name) {
      r.help = intern(std::string(r.help) + std::string(more));
      return rows;
    }
  throw std::logic_error("kvc: with_help names " + std::string(name) + ", not a parameter");
}

/// Sets one declared parameter of `s` from its text (bad values exit 3, naming the parameter and what it takes).
template <class O, class P>
void assign_param(O& s, P const& p, std::string const& text) {
  using T = typename P::value_type;
  constexpr std::size_t N = std::tuple_size_v<decltype(p.names)>;
  std::string const what = "--param " + std::string(p.name);
  if constexpr (N > 0) {
    std::string expected;  // "a, b or c"
    for (std::size_t i = 0; i < N; ++i) {
      if (text == p.names[i].name) {
        p.of(s) = p.names[i].value;
        return;
      }
      expected += (i == 0 ? "" : (i + 1 == N ? " or " : ", ")) + std::string(p.names[i].name);
    }
    fail(exit_invalid, what + " = '" + text + "': expected " + expected);
  } else if constexpr (std::is_integral_v<T>) {
    bool const unsigned64 = std::is_same_v<T, std::uint64_t>;
    std::string const kind = p.odd ? "an odd integer" : "an integer";
    std::string const range = unsigned64 && p.hi >= 18446744073709551615.0 ? kind + " in [0, 2^64)"
                              : p.hi >= kvc::max_param_index
                                  ? kind + " >= " + number_text(p.lo) + " (at most 2^40)"
                                  : kind + " in [" + number_text(p.lo) + ", " + number_text(p.hi) + "]";
    T v{};
    auto const r = std::from_chars(text.data(), text.data() + text.size(), v);
    if (text.empty() || r.ptr != text.data() + text.size() || r.ec == std::errc::invalid_argument)
      fail(exit_invalid, what + " = '" + text + "': expected " + (unsigned64 ? range : kind));
    if (r.ec == std::errc::result_out_of_range || static_cast<double>(v) < p.lo || static_cast<double>(v) > p.hi)
      fail(exit_invalid, what + " = " + text + ": expected " + range);
    if (p.odd && v % 2 == 0)
      fail(exit_invalid, what + " = " + text + ": expected an odd integer (an even kernel shifts what it pools)");
    p.of(s) = v;
  } else {
    char* end = nullptr;
    errno = 0;
    double const v = std::strtod(text.c_str(), &end);
    if (text.empty() || *end != '\0' || errno == ERANGE || !(v >= p.lo && v <= p.hi))
      fail(exit_invalid,
           what + " = '" + text + "': expected a number in [" + number_text(p.lo) + ", " + number_text(p.hi) + "]");
    p.of(s) = static_cast<T>(v);
  }
}

/// Policy struct S with its declared parameters set from `p` (the rest at the defaults of the preset that `p`'s
/// `reference` names, S::kvpress() or S::authors(), where S has it; else S{}'s), then S::check() (exit 3 with the
/// policy's message) unless `check` is false: a part the caller completes first (an allocator's budget), whose whole
/// is checked where it is used (kvc::LayerCompressor::plan checks the scorer and the selector).
template <kvc::DeclaresParameters S>
S from_params(Params const& p, std::string_view policy = S::name, bool check = true) {
  S s{};
  if (auto const ref = p.find("reference"); ref != p.end()) {
    if constexpr (requires { S::kvpress(); })
      if (ref->second == "kvpress")
        s = S::kvpress();
    if constexpr (requires { S::authors(); })
      if (ref->second == "authors")
        s = S::authors();
  }
  std::apply(
      [&](auto const&... param) {
        auto set = [&](auto const& one) {
          if (auto const it = p.find(one.name); it != p.end())
            assign_param(s, one, it->second);
        };
        (set(param), ...);
      },
      S::parameters());
  if constexpr (requires { s.check(); })
    if (auto const st = s.check(); check && !st.ok())
      fail(exit_invalid, "policy " + std::string(policy) + ": " + std::string(st.message()));
  return s;
}

inline ParamInfo const n_sink_param{"n_sink", "0", "first tokens always kept (compress only)", Stage::selection};
inline ParamInfo const n_recent_param{"n_recent", "0", "last tokens always kept (compress only)", Stage::selection};
inline ParamInfo const queries_param{
    "queries", "pre_rope", "pre_rope (rotated with --rope at their positions) or post_rope (as given)", Stage::queries};

inline std::vector<PolicyInfo> const& policies() {
  static std::vector<PolicyInfo> const list = {
      {"streaming_llm", "attention sinks + most recent tokens (Xiao et al., arXiv 2309.17453)",
       declared_params<StreamingLLMScorer>(), false, false},
      {"key_diff", "keep keys least similar to the mean unit key (Park et al., arXiv 2504.15364, Eq. 8)",
       declared_params<KeyDiffScorer>() +
           std::vector<ParamInfo>{
               {"n_sink", "0", "first tokens always kept (KeyDiff + sinks; compress only)", Stage::selection},
               {"n_recent", "0", "last tokens always kept (KeyDiff + Recent, paper Table 11; compress only)",
                Stage::selection}},
       true, false},
      {"knorm",
       "keep the lowest-norm keys (Devoto et al., EMNLP 2024; kvpress KnormPress)",
       {n_sink_param, n_recent_param},
       true,
       false},
      {"snap_kv", "the last window_size queries vote for the prefix keys they attend to (Li et al., arXiv 2404.14469)",
       declared_params<SnapKVScorer>() + std::vector{queries_param, n_sink_param, n_recent_param}, true, true},
      {"tova",
       "keep the tokens the newest query attends to most, mean over query heads (Oren et al., arXiv 2401.06104)",
       declared_params<TOVAScorer>() + std::vector{queries_param, n_sink_param, n_recent_param}, true, true},
      {"expected_attention",
       "the attention Gaussian future queries will pay each key, in closed form, times ||v|| (Devoto et al., arXiv "
       "2510.00636)",
       declared_params<ExpectedAttentionScorer>() +
           std::vector<ParamInfo>{
               {"queries", "pre_rope", "pre_rope only: the statistics are of pre-RoPE queries", Stage::queries},
               n_recent_param},
       true, true, true},
      {"h2o",
       "heavy hitters (attention accumulated while cached) plus a recent window (Zhang et al., arXiv 2306.14048)",
       declared_params<H2OPolicy>(Stage::scorer, {{"recent_share", Stage::selection}}) +
           std::vector{queries_param, n_sink_param},
       true, true},
      {"moment_kv",
       "evict what the moments of the evicted set already explain (score = base attention x ||v - f_E(k)||), and "
       "correct attention with those moments (Li, Li, Lan, arXiv 2606.01563)",
       in_order(declared_params<MomentKVPolicy>(Stage::scorer,
                                                {{"n_sink", Stage::selection}, {"n_recent", Stage::selection}}) +
                    std::vector{queries_param},
                {"window_size", "kernel_size", "pooling", "prefill_rounds", "clamp_tau", "order", "mi", "correction",
                 "storage", "decode_evict", "residual_refresh", "queries", "n_sink", "n_recent"}),
       true, true, true},
      {"uncomp_entropy",
       "UNComp's truncated matrix entropy of each query head's rows (Xiong et al., arXiv 2410.03090, Eq. 5-6): `kvc "
       "score` writes [B, Hq] per-head values, not token scores (the quantity UNComp's calibration averages)",
       std::vector<ParamInfo>{{"top_k", "auto",
                               "k: the leading eigenvalues kept; auto: head_dim / 4 (the paper's 32 at d = 128); "
                               "clamped to min(k, rows, head_dim)"}} +
           declared_params<MatrixEntropyOptions>() +
           std::vector<ParamInfo>{
               {"unit", "normalized",
                "normalized (H_k / ln d, the unit the authors store), truncated (H_k, nats) or erank (exp(H_k))"},
               {"dtype", "float64", "the output's dtype: float64 or float32"},
               queries_param},
       false, true, false, false},
      {"uncomp",
       "entropy-grouped per-head budgets from a calibration file (kvc-eval calibrate) and a SnapKV-style window "
       "score that keeps sliding while decoding (Xiong et al., arXiv 2410.03090); compress --calibration FILE",
       in_order(declared_params<UNCompPolicy>() +
                    std::vector<ParamInfo>{
                        {"step", "auto",
                         "step between neighbouring groups, tokens; auto: 74/384 of B (the paper's 74 at B = 384)"},
                        {"list", "",
                         "schedule=list: the groups' budgets, highest entropy first, separated by '/' (640/567/...)"},
                        {"preset", "",
                         "an authors' list (authors_384, paper_384, wide_2, narrow_2, ... wide_8): schedule=list"},
                        {"groups", "auto",
                         "M; auto: the calibration's (kvc-eval's own calibration: 8); another M regroups a rule=mean "
                         "calibration from its mean eranks"},
                        {"rule", "auto",
                         "mean or majority_vote for kvc-eval's own calibration (auto: mean); a file's must agree"},
                        {"stages", "false",
                         "kvc-eval only: true prunes hidden states at stage boundaries during prefill (spec 2.9)"},
                        {"stage_epsilon", "1",
                         "stages: a drop of the layer score (mean erank) above epsilon starts a stage"},
                        {"stage_count", "0", "stages: the number of stages (the largest drops); 0: from stage_epsilon"},
                        {"hs_min_tokens", "auto",
                         "stages: the fewest hidden states a stage keeps; auto: 3/8 of the prompt (the code's 1536 of "
                         "4096)"},
                        {"hs_step", "0",
                         "stages: hidden states dropped per stage; 0: the code's (n - hs_min_tokens) / (stages - 1)"},
                        queries_param},
                {"window_size", "kernel_size", "pooling", "schedule", "step", "largest", "list", "preset", "groups",
                 "rule", "gqa", "stages", "stage_epsilon", "stage_count", "hs_min_tokens", "hs_step", "queries"}),
       true, true},
      {"rdkv",
       "rate-distortion bit allocation: every V token and K channel gets 0 (evicted), 2, 4, 8 or 16 bits under a "
       "budget of fp16-equivalent tokens, packed and attended without unpacking (Zhang et al., arXiv 2605.08317)",
       in_order(with_help(declared_params<RDKVPolicy>(Stage::allocation, {{"window_size", Stage::scorer},
                                                                          {"kernel_size", Stage::scorer},
                                                                          {"weight", Stage::scorer}}),
                          "weight", ", or a policy's name (its scores, shifted to >= 0; its default parameters)") +
                    std::vector<ParamInfo>{
                        {"channel", "think", "channel weights: think (mean q_c^2 x mean k_c^2, ThinK)"}, queries_param},
                {"reference", "k_budget_ratio", "solver", "window_size", "kernel_size", "weight", "channel", "eps",
                 "evict", "scope", "zero_point", "v_group", "k_group", "residual", "queries"}),
       true, true},
      {"kivi",
       "uniform 2- or 4-bit quantization: K per channel in groups of tokens, V per token in groups of channels, the "
       "newest tokens in fp16 (Liu et al., arXiv 2402.02750); its memory is what its bits give (no --ratio/--budget)",
       declared_params<KIVIPress>(Stage::allocation), true, false},
      {"random", "uniform random eviction, the baseline every policy must beat (kvpress RandomPress)",
       declared_params<RandomScorer>() + std::vector{n_sink_param, n_recent_param}, false, false},
  };
  return list;
}

inline std::string policy_names(bool queries_only = false) {
  std::string names;
  for (auto const& p : policies())
    if (!queries_only || p.reads_queries)
      names += std::string(names.empty() ? "" : ", ") + p.name;
  return names;
}

inline PolicyInfo const& find_policy(std::string const& name) {
  for (auto const& p : policies())
    if (name == p.name)
      return p;
  fail(exit_usage, "unknown --policy '" + name + "' (expected one of: " + policy_names() + ")");
}

inline ParamInfo const* find_param(PolicyInfo const& policy, std::string_view name) {
  for (auto const& p : policy.params)
    if (name == p.name)
      return &p;
  return nullptr;
}

/// Parameter values after --param overrides and the defaults (kvpress's where reference=kvpress). Unknown names,
/// repeats, and selection parameters given to `score` are usage errors.
inline Params resolve_params(PolicyInfo const& policy, std::vector<std::string> const& given, bool compress) {
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
    if (!compress && info->stage == Stage::allocation)
      fail(exit_usage, "--param '" + key + "' of policy " + policy.name +
                           " sets the bit allocation or the packing; it does not change the weights (use kvc "
                           "compress)");
    if (!set.emplace(key, kv.substr(eq + 1)).second)
      fail(exit_usage, "--param '" + key + "' given twice");
  }
  auto const ref = set.find("reference");
  bool const kvpress = ref != set.end() && ref->second == "kvpress";
  bool const authors = ref != set.end() && ref->second == "authors";
  Params values;
  for (auto const& p : policy.params) {
    auto const it = set.find(p.name);
    values[p.name] = it != set.end()                ? it->second
                     : kvpress && p.kvpress_default ? p.kvpress_default
                     : authors && p.authors_default ? p.authors_default
                                                    : p.default_value;
  }
  return values;
}

inline kvc::Index parse_count(std::string const& text, std::string const& what, kvc::Index min = 0) {
  char* end = nullptr;
  errno = 0;
  long long const v = std::strtoll(text.c_str(), &end, 10);
  if (text.empty() || *end != '\0' || errno == ERANGE)
    fail(exit_invalid, what + " = '" + text + "': expected an integer");
  if (v < min)
    fail(exit_invalid, what + " = " + text + ": expected an integer >= " + std::to_string(min));
  return v;
}

inline double parse_ratio(std::string const& text) {
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

inline kvc::Reference reference_of(Params const& p) {
  return choice<kvc::Reference>(p, "reference",
                                {{"authors", kvc::Reference::authors}, {"kvpress", kvc::Reference::kvpress}});
}

/// Whether --queries are pre-RoPE (rotated to their positions) or post-RoPE (used as given).
inline bool pre_rope(Params const& p) {
  return choice<bool>(p, "queries", {{"pre_rope", true}, {"post_rope", false}});
}

/// Tokens the top-k selection protects (compress only).
struct Selection {
  kvc::Index n_sink = 0;
  kvc::Index n_recent = 0;
  double recent_share = 0.0;  ///< at least floor(share x kept) recent tokens are protected (H2O's window)

  /// The recent window for a head keeping `kept` tokens.
  kvc::Index recent(kvc::Index kept) const {
    auto const share = static_cast<kvc::Index>(recent_share * static_cast<double>(kept));
    return std::max(n_recent, share);
  }
};

/// Parameter `name` as a number in [lo, hi] (bad values exit 3, naming the parameter).
inline double parse_real(Params const& p, char const* name, double lo, double hi) {
  std::string const& text = p.at(name);
  char* end = nullptr;
  errno = 0;
  double const v = std::strtod(text.c_str(), &end);
  if (text.empty() || *end != '\0' || errno == ERANGE || !(v >= lo && v <= hi))
    fail(exit_invalid, std::string("--param ") + name + " = '" + text + "': expected a number in [" +
                           std::to_string(lo) + ", " + std::to_string(hi) + "]");
  return v;
}

inline bool parse_bool(Params const& p, char const* name) {
  return choice<bool>(p, name, {{"true", true}, {"false", false}});
}

// ---------------------------------------------------------------------------------------------------------------
// Allocators: budgets across the heads of a layer (ada_kv) and across layers (pyramid_kv), composed with any scorer:
// `kvc compress --allocator NAME[+NAME]`, `kvc-eval --policies scorer+allocator[+allocator]`.

struct AllocatorInfo {
  char const* name;
  char const* summary;
  std::vector<ParamInfo> params;
};

inline std::vector<AllocatorInfo> const& allocators() {
  static std::vector<AllocatorInfo> const list = {
      {"ada_kv",
       "head-adaptive budgets inside a layer: a global top-k over the layer's heads with a safeguard floor (Feng et "
       "al., arXiv 2407.11550)",
       declared_params<AdaKVSelector<FixedBudget>>(Stage::selection)},
      {"pyramid_kv",
       "per-layer budgets falling linearly from the first layer to the last, window included (Cai et al., arXiv "
       "2406.02069)",
       declared_params<PyramidKVBudget>(Stage::selection)},
  };
  return list;
}

/// Which allocators a `NAME[+NAME]` list names (each at most once).
struct AllocatorChoice {
  bool ada_kv = false;
  bool pyramid_kv = false;
  bool any() const { return ada_kv || pyramid_kv; }
  std::string name() const {
    return std::string(pyramid_kv ? "pyramid_kv" : "") + (ada_kv && pyramid_kv ? "+" : "") + (ada_kv ? "ada_kv" : "");
  }
};

inline AllocatorChoice parse_allocators(std::string const& list, char const* what = "--allocator") {
  AllocatorChoice c;
  std::size_t start = 0;
  while (start <= list.size()) {
    std::size_t const plus = std::min(list.find('+', start), list.size());
    std::string const name = list.substr(start, plus - start);
    bool* flag = name == "ada_kv" ? &c.ada_kv : (name == "pyramid_kv" ? &c.pyramid_kv : nullptr);
    if (flag == nullptr)
      fail(exit_usage, std::string(what) + " '" + list + "': unknown allocator '" + name +
                           "' (expected ada_kv, pyramid_kv or pyramid_kv+ada_kv)");
    if (*flag)
      fail(exit_usage, std::string(what) + " '" + list + "': allocator '" + name + "' named twice");
    *flag = true;
    start = plus + 1;
  }
  return c;
}

inline AllocatorInfo const& allocator_info(std::string_view name) {
  for (auto const& a : allocators())
    if (name == a.name)
      return a;
  throw std::logic_error("kvc: unknown allocator");
}

/// The policy's table entry with the chosen allocators' parameters added (a name both have, such as `reference` or
/// snap_kv's `window_size`, is one parameter; the allocator's defaults win, as its paper's scripts set them).
inline PolicyInfo with_allocators(PolicyInfo policy, AllocatorChoice const& choice) {
  for (char const* name : {"pyramid_kv", "ada_kv"}) {
    if ((name == std::string_view("ada_kv") && !choice.ada_kv) ||
        (name == std::string_view("pyramid_kv") && !choice.pyramid_kv))
      continue;
    for (ParamInfo const& p : allocator_info(name).params) {
      auto it = std::find_if(policy.params.begin(), policy.params.end(),
                             [&](ParamInfo const& q) { return std::string_view(q.name) == p.name; });
      if (it == policy.params.end())
        policy.params.push_back(p);
      else if (std::string_view(p.name) !=
               "reference") {  // the allocator's defaults (all three columns) under the policy's help and stage
        it->default_value = p.default_value;
        it->kvpress_default = p.kvpress_default;
        it->authors_default = p.authors_default;
      }
    }
  }
  return policy;
}

/// One runtime budget for the tools (a ratio, a token count, or PyramidKV's layer schedule), so each scorer
/// compiles two selections (top-k and AdaKV) instead of six.
struct ToolBudget {
  enum class Kind : std::uint8_t { ratio, tokens, pyramid } kind = Kind::ratio;
  kvc::RatioBudget ratio{};
  kvc::FixedBudget tokens{};
  kvc::PyramidKVBudget pyramid{};

  constexpr kvc::Index keep(kvc::Index b, kvc::Index h, kvc::Index n) const noexcept {
    return kind == Kind::ratio ? ratio.keep(b, h, n)
                               : (kind == Kind::tokens ? tokens.keep(b, h, n) : pyramid.keep(b, h, n));
  }
  constexpr kvc::Status check() const noexcept {
    return kind == Kind::ratio ? ratio.check() : (kind == Kind::tokens ? tokens.check() : pyramid.check());
  }
  /// A decode-time compression to `target` tokens (kvc::LayerCompressor): PyramidKV's schedule around it, else it.
  constexpr ToolBudget decode_budget(kvc::Index target) const noexcept {
    ToolBudget b = *this;
    if (kind == Kind::pyramid) {
      b.pyramid = pyramid.decode_budget(target);
    } else {
      b.kind = Kind::tokens;
      b.tokens = {target};
    }
    return b;
  }
};

/// The selection compress runs over `tokens`-slot heads: TopKSelector, or AdaKVSelector with the ada_kv
/// allocator, over `ratio` (when set) or `budget` tokens, through PyramidKV's schedule with the pyramid_kv
/// allocator. The authors' AdaKV and PyramidKV keep the observation window on top of the budget: a scorer with a
/// `window_size` (snap_kv) has its window protected. Calls fn(selector).
template <class Fn>
void with_selection(AllocatorChoice const& alloc, Params const& p, Selection const& sel, std::optional<double> ratio,
                    kvc::Index budget, kvc::Index tokens, Fn&& fn) {
  auto count = [&](char const* name, kvc::Index min = 0) {
    return parse_count(p.at(name), std::string("--param ") + name, min);
  };
  ToolBudget b;
  if (ratio) {
    b.kind = ToolBudget::Kind::ratio;
    b.ratio = {*ratio};
  } else {
    b.kind = ToolBudget::Kind::tokens;
    b.tokens = {budget};
  }
  bool const kvpress = p.count("reference") && reference_of(p) == kvc::Reference::kvpress;  // bad values: exit 3
  kvc::Index window = p.count("window_size") ? count("window_size") : 0;
  if (alloc.pyramid_kv) {
    kvc::PyramidKVBudget& py = b.pyramid;
    py = from_params<kvc::PyramidKVBudget>(p, "pyramid_kv");  // reference, window, beta, layer of num_layers
    if (ratio)
      py.compression_ratio = *ratio;
    else if (kvpress)
      fail(exit_usage, "pyramid_kv with reference=kvpress schedules from a ratio: use --ratio, not --budget");
    else
      py.max_capacity_prompt = budget;
    b.kind = ToolBudget::Kind::pyramid;
  }
  kvc::Index const keep = b.keep(0, 0, tokens);  // H2O's recent window is a share of it
  kvc::Index n_recent = sel.recent(keep);
  if (!kvpress && alloc.any() && p.count("window_size"))  // the authors' window sits on top of the budget
    n_recent = std::max(n_recent, window);
  if (alloc.ada_kv) {
    auto ada = from_params<kvc::AdaKVSelector<ToolBudget>>(p, "ada_kv", false);  // reference, alpha_safeguard
    ada.budget = b;
    ada.n_sink = sel.n_sink;
    ada.n_recent = n_recent;
    fn(std::as_const(ada));
  } else {
    fn(kvc::TopKSelector<ToolBudget>{b, sel.n_sink, n_recent});
  }
}

/// Whether with_policy builds the policy's scorer: every token policy but the composites, whose builders are
/// tools/common/{moment_kv,uncomp,rdkv}.hpp (and uncomp_entropy, which writes per-head values).
inline bool builds_scorer(PolicyInfo const& policy) {
  for (std::string_view composite : {"moment_kv", "uncomp", "uncomp_entropy", "rdkv", "kivi"})
    if (composite == policy.name)
      return false;
  return true;
}

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
  Selection sel{selection_count("n_sink"), selection_count("n_recent")};
  auto emit = [&](auto const& scorer) {  // the table and the scorer agree on the name and on reading queries
    using S = std::remove_cvref_t<decltype(scorer)>;
    constexpr bool queries = kvc::has_need(S::needs, kvc::Needs::window_queries) ||
                             kvc::has_need(S::needs, kvc::Needs::query_statistics) || kvc::StatefulScorer<S>;
    if (S::name != policy.name || queries != policy.reads_queries)
      throw std::logic_error(std::string("kvc: the policy table disagrees with scorer ") + std::string(S::name));
    fn(scorer, sel);
  };
  std::string_view const name = policy.name;
  if (!builds_scorer(policy)) {  // the one list of them: builds_scorer
    throw std::logic_error("kvc: " + std::string(name) +
                           " is built by its own tools/common header (moment_kv.hpp, uncomp.hpp, rdkv.hpp), not "
                           "with_policy");
  } else if (name == "streaming_llm") {
    emit(from_params<kvc::StreamingLLMScorer>(p));
  } else if (name == "key_diff") {
    emit(from_params<kvc::KeyDiffScorer>(p));
  } else if (name == "knorm") {
    emit(kvc::KnormScorer{});
  } else if (name == "snap_kv") {
    emit(from_params<kvc::SnapKVScorer>(p));
  } else if (name == "tova") {
    emit(from_params<kvc::TOVAScorer>(p));
  } else if (name == "expected_attention") {
    if (!pre_rope(p))
      fail(exit_invalid, "--param queries = post_rope: policy expected_attention needs pre-RoPE query samples");
    emit(from_params<kvc::ExpectedAttentionScorer>(p));
  } else if (name == "h2o") {
    auto const h2o = from_params<kvc::H2OPolicy>(p);
    sel.recent_share = h2o.recent_share;
    if (h2o.reference == kvc::Reference::kvpress)
      emit(kvc::ObservedAttentionScorer{});
    else
      emit(kvc::H2OScorer<>{});
  } else if (name == "random") {
    emit(from_params<kvc::RandomScorer>(p));
  } else {
    throw std::logic_error("kvc: policy " + std::string(name) + " is in the table but has no scorer");
  }
}

}  // namespace kvc::tools
