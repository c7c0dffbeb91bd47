// SPDX-License-Identifier: Apache-2.0
// tools/common/uncomp.hpp: UNComp in the tools (kvc CLI and kvc-eval; spec shared/specs/uncomp.md §2.5, §7):
//  - the truncated matrix entropy's parameters (`uncomp_entropy` in policies.hpp, and `kvc-eval calibrate`'s
//    --param), declared by kvc::MatrixEntropyOptions, parsed once with the unit and the output dtype;
//  - the calibration file: per-(layer, query head) entropies averaged over calibration samples, the head groups of
//    each layer (query heads, and KV heads whose entropy is the mean erank of their query heads), and the layer
//    scores s_l (mean erank of the layer's heads). `kvc-eval calibrate` writes it (kvc::eval::write_calibration in
//    tools/eval/calibration_file.hpp: deterministic JSON, whole or nothing); `kvc compress --policy uncomp` and
//    kvc-eval's uncomp rows read it (read_calibration: an untrusted file, every field checked, exit 3 naming the
//    field).
#pragma once

#include <kvc/calibration/head_budgets.hpp>
#include <kvc/calibration/head_groups.hpp>
#include <kvc/calibration/matrix_entropy.hpp>
#include <kvc/calibration/uncomp_policy.hpp>

#include "io/file.hpp"
#include "io/json.hpp"
#include "policies.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace kvc::tools {

// ---------------------------------------------------------------------------------------------------------------
// The entropy's parameters.

/// The unit `kvc score --policy uncomp_entropy` writes: Ĥ_k = H_k / ln d (the authors' stored unit), H_k, or
/// erank_k = exp(H_k). They are monotone transforms of one another: head rankings and groups do not depend on it.
enum class EntropyUnit : std::uint8_t { normalized, truncated, erank };

struct EntropyConfig {
  MatrixEntropyOptions options{};
  EntropyUnit unit = EntropyUnit::normalized;
  bool float64 = true;  ///< the output's dtype: float64 or float32

  double value(MatrixEntropy const& e) const noexcept {
    return unit == EntropyUnit::normalized ? e.normalized : (unit == EntropyUnit::truncated ? e.truncated : e.erank);
  }
};

/// The largest top_k accepted (k is clamped to min(k, n, d) anyway).
constexpr Index max_entropy_top_k = Index{1} << 20;

/// The entropy's options from resolved parameters: normalize_rows, renormalize_topk and ridge as
/// MatrixEntropyOptions declares them, top_k (`auto`: 0, head_dim / 4), and `unit` and `dtype` where the policy has
/// them (uncomp_entropy: the output's format). Bad values exit 3 naming the parameter.
inline EntropyConfig entropy_config(Params const& p) {
  EntropyConfig c;
  c.options = from_params<MatrixEntropyOptions>(p, "uncomp_entropy", false);  // checked whole, with top_k, below
  c.options.top_k = p.at("top_k") == "auto" ? 0 : parse_count(p.at("top_k"), "--param top_k", 1);  // 0: d / 4
  if (c.options.top_k > max_entropy_top_k)
    fail(exit_invalid, "--param top_k = " + p.at("top_k") + ": expected auto or an integer in [1, 2^20]");
  if (auto const st = c.options.check(); !st.ok())
    fail(exit_invalid, "policy uncomp_entropy: " + std::string(st.message()));
  if (p.count("unit"))
    c.unit = choice<EntropyUnit>(p, "unit",
                                 {{"normalized", EntropyUnit::normalized},
                                  {"truncated", EntropyUnit::truncated},
                                  {"erank", EntropyUnit::erank}});
  if (p.count("dtype"))
    c.float64 = choice<bool>(p, "dtype", {{"float64", true}, {"float32", false}});
  return c;
}

// ---------------------------------------------------------------------------------------------------------------
// The calibration file.

/// How a layer's heads are grouped from the calibration samples (spec §2.5, §7.5).
enum class GroupRule : std::uint8_t { mean, majority_vote };

inline char const* group_rule_name(GroupRule r) noexcept {
  return r == GroupRule::mean ? "mean" : "majority_vote";
}

/// The file's "format" and "version" fields.
constexpr std::string_view calibration_format = "kvc.uncomp.calibration";
constexpr std::int64_t calibration_version = 1;

/// Bounds read_calibration enforces before it allocates.
constexpr Index max_calibration_layers = Index{1} << 12;
constexpr Index max_calibration_heads = Index{1} << 12;
constexpr std::uint64_t max_calibration_file_bytes = std::uint64_t{64} << 20;

/// One model's UNComp calibration. Per layer l and query head h, index l * heads + h; per KV head g,
/// l * kv_heads + g. Group labels: 0 = the HIGHEST entropy group (the paper's g = 1), balanced group sizes.
struct Calibration {
  std::string model;  ///< the model as given to the tool (a path)
  Index layers = 0;
  Index heads = 0;     ///< query heads Hq
  Index kv_heads = 0;  ///< KV heads Hkv (divides Hq)
  Index head_dim = 0;  ///< d
  // The entropy's options (MatrixEntropyOptions).
  Index top_k = 32;
  bool normalize_rows = true;
  bool renormalize_topk = false;
  double ridge = 0.0;
  // The calibration data.
  Index samples = 0;  ///< windows of text run through the model
  Index tokens = 0;   ///< tokens per window (BOS included when the model has one)
  std::string text;   ///< the text: a file path, or "built-in"
  // The grouping.
  Index groups = 8;  ///< M: query heads and KV heads alike (M > heads leaves inner groups empty, head_groups.hpp)
  GroupRule rule = GroupRule::mean;
  std::vector<double> normalized;   ///< [layers, heads] mean Ĥ_k over samples
  std::vector<double> erank;        ///< [layers, heads] mean erank_k (Eq. 7)
  std::vector<double> truncated;    ///< [layers, heads] mean H_k
  std::vector<Index> query_group;   ///< [layers, heads] group labels in [0, groups)
  std::vector<double> kv_erank;     ///< [layers, kv_heads] mean erank_k of each KV head's query heads
  std::vector<Index> kv_group;      ///< [layers, kv_heads] group labels in [0, groups)
  std::vector<double> layer_score;  ///< [layers] s_l = mean erank_k of the layer's query heads (spec §7.11)

  bool operator==(Calibration const&) const = default;
};

namespace detail {

/// Reads one calibration file's JSON tree; every error names the file and the field.
class CalibrationReader {
 public:
  explicit CalibrationReader(std::string path) : where_("calibration file " + std::move(path) + ": ") {}

  [[noreturn]] void bad(std::string const& field, std::string const& what) const {
    fail(exit_invalid, where_ + "field '" + field + "' " + what);
  }

  json::Value const& member(json::Value const& object, std::string const& prefix, char const* name) const {
    json::Value const* v = object.find(name);
    if (v == nullptr)
      bad(prefix + name, "is missing");
    return *v;
  }

  /// Rejects members not in `known` (a misspelt field would otherwise be ignored).
  void only(json::Value const& object, std::string const& prefix, std::span<char const* const> known) const {
    for (auto const& member : object.members())  // (not a structured binding: clang 14 cannot capture one)
      if (std::none_of(known.begin(), known.end(), [&](char const* k) { return member.first == k; }))
        fail(exit_invalid, where_ + "unknown field '" + prefix + json::printable(member.first) + "'");
  }

  Index integer(json::Value const& object, std::string const& prefix, char const* name, Index lo, Index hi) const {
    json::Value const& v = member(object, prefix, name);
    std::int64_t x = 0;
    if (!json::to_int64(v, x) || x < lo || x > hi)
      bad(prefix + name, "is not an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
    return x;
  }

  bool boolean(json::Value const& object, char const* name) const {
    json::Value const& v = member(object, "", name);
    if (!v.is_bool())
      bad(name, "is not true or false");
    return v.as_bool();
  }

  double real(json::Value const& v, std::string const& field, double lo, double hi) const {
    if (!v.is_number() || !std::isfinite(v.as_double()) || !(v.as_double() >= lo && v.as_double() <= hi))
      bad(field, "is not a finite number in [" + number_text(lo) + ", " + number_text(hi) + "]");
    return v.as_double();
  }

  std::string const& text(json::Value const& object, char const* name) const {
    json::Value const& v = member(object, "", name);
    if (!v.is_string())
      bad(name, "is not a string");
    return v.as_string();
  }

  /// An array of exactly `n` elements (checked before anything is allocated for it).
  std::vector<json::Value> const& array(json::Value const& object, std::string const& prefix, char const* name,
                                        Index n) const {
    json::Value const& v = member(object, prefix, name);
    if (!v.is_array())
      bad(prefix + name, "is not an array");
    if (static_cast<Index>(v.items().size()) != n)
      bad(prefix + name, "has " + std::to_string(v.items().size()) + " elements, expected " + std::to_string(n));
    return v.items();
  }

  void reals(json::Value const& object, std::string const& prefix, char const* name, Index n, double lo, double hi,
             std::vector<double>& out) const {
    auto const& items = array(object, prefix, name, n);
    for (std::size_t i = 0; i < items.size(); ++i)
      out.push_back(real(items[i], prefix + name + "[" + std::to_string(i) + "]", lo, hi));
  }

  /// Group labels of `n` heads in [0, groups), each group holding the balanced split's count of heads
  /// (kvc::balanced_group_sizes: what group_heads and majority_vote_groups give).
  void labels(json::Value const& object, std::string const& prefix, char const* name, Index n, Index groups,
              std::vector<Index>& out) const {
    auto const& items = array(object, prefix, name, n);
    std::vector<Index> size(static_cast<std::size_t>(groups), 0), want(static_cast<std::size_t>(groups), 0);
    if (!balanced_group_sizes(n, groups, want.data()).ok())
      bad(prefix + name, "cannot split " + std::to_string(n) + " heads into " + std::to_string(groups) + " groups");
    for (std::size_t i = 0; i < items.size(); ++i) {
      std::int64_t x = 0;
      if (!json::to_int64(items[i], x) || x < 0 || x >= groups)
        bad(prefix + name + "[" + std::to_string(i) + "]",
            "is not a group label in [0, " + std::to_string(groups) + ")");
      ++size[static_cast<std::size_t>(x)];
      out.push_back(x);
    }
    for (std::size_t g = 0; g < size.size(); ++g)
      if (size[g] != want[g])
        bad(prefix + name, "puts " + std::to_string(size[g]) + " heads in group " + std::to_string(g) +
                               ", expected the balanced split of " + std::to_string(n) + " heads into " +
                               std::to_string(groups) + " groups (" + std::to_string(want[g]) + ")");
  }

 private:
  std::string where_;
};

}  // namespace detail

/// Reads a calibration file written by kvc::eval::write_calibration (or by hand): an untrusted file. It must be a
/// regular file of at most 64 MiB holding one JSON object with exactly the fields calibration_json writes; sizes are
/// checked against their bounds and against each other before any array is read; entropies must be finite and in
/// their ranges (Ĥ_k and H_k >= 0, erank_k >= 1, s_l >= 1), labels balanced groups. Errors exit 3 naming the file
/// and the field.
inline Calibration read_calibration(std::string const& path) {
  detail::CalibrationReader const r(path);
  std::string const where = "calibration file " + path + ": ";
  std::vector<std::byte> bytes;
  std::string error;
  if (!read_regular_file(path, bytes, error, max_calibration_file_bytes))
    fail(exit_invalid, where + error + " (expected a JSON file as `kvc-eval calibrate` writes it)");
  json::Value doc;
  if (!json::parse(std::string_view(reinterpret_cast<char const*>(bytes.data()), bytes.size()), doc, error))
    fail(exit_invalid, where + "not JSON: " + error);
  if (!doc.is_object())
    fail(exit_invalid, where + "expected a JSON object");
  static constexpr char const* top[] = {"format",   "version",     "model",    "layers",         "query_heads",
                                        "kv_heads", "head_dim",    "top_k",    "normalize_rows", "renormalize_topk",
                                        "ridge",    "samples",     "tokens",   "text",           "groups",
                                        "rule",     "layer_score", "per_layer"};
  r.only(doc, "", top);
  if (r.text(doc, "format") != calibration_format)
    r.bad("format", "is not \"" + std::string(calibration_format) + "\"");
  r.integer(doc, "", "version", calibration_version, calibration_version);
  Calibration c;
  c.model = r.text(doc, "model");
  c.layers = r.integer(doc, "", "layers", 1, max_calibration_layers);
  c.heads = r.integer(doc, "", "query_heads", 1, max_calibration_heads);
  c.kv_heads = r.integer(doc, "", "kv_heads", 1, c.heads);
  if (c.heads % c.kv_heads != 0)
    r.bad("kv_heads",
          "(" + std::to_string(c.kv_heads) + ") does not divide query_heads (" + std::to_string(c.heads) + ")");
  c.head_dim = r.integer(doc, "", "head_dim", 1, Index{1} << 16);
  c.top_k = r.integer(doc, "", "top_k", 1, max_entropy_top_k);
  c.normalize_rows = r.boolean(doc, "normalize_rows");
  c.renormalize_topk = r.boolean(doc, "renormalize_topk");
  c.ridge = r.real(r.member(doc, "", "ridge"), "ridge", 0.0, 0.5);
  c.samples = r.integer(doc, "", "samples", 1, Index{1} << 30);
  c.tokens = r.integer(doc, "", "tokens", 1, Index{1} << 30);
  c.text = r.text(doc, "text");
  c.groups = r.integer(doc, "", "groups", 1, max_calibration_heads);
  std::string const& rule = r.text(doc, "rule");
  if (rule != "mean" && rule != "majority_vote")
    r.bad("rule", "is not \"mean\" or \"majority_vote\"");
  c.rule = rule == "mean" ? GroupRule::mean : GroupRule::majority_vote;
  double const max_erank = static_cast<double>(c.head_dim) * (1.0 + 1e-9);
  double const max_log = std::log(static_cast<double>(c.head_dim)) * (1.0 + 1e-9) + 1.0;  // ridge adds < 1
  r.reals(doc, "", "layer_score", c.layers, 1.0 - 1e-9, max_erank, c.layer_score);
  auto const& layers = r.array(doc, "", "per_layer", c.layers);
  auto const lh = static_cast<std::size_t>(c.layers * c.heads), lg = static_cast<std::size_t>(c.layers * c.kv_heads);
  c.normalized.reserve(lh);
  c.erank.reserve(lh);
  c.truncated.reserve(lh);
  c.query_group.reserve(lh);
  c.kv_erank.reserve(lg);
  c.kv_group.reserve(lg);
  static constexpr char const* per_layer[] = {"layer",  "normalized", "erank",    "truncated",
                                              "groups", "kv_erank",   "kv_groups"};
  for (std::size_t l = 0; l < layers.size(); ++l) {
    std::string const prefix = "per_layer[" + std::to_string(l) + "].";
    json::Value const& v = layers[l];
    if (!v.is_object())
      fail(exit_invalid, where + "field 'per_layer[" + std::to_string(l) + "]' is not an object");
    r.only(v, prefix, per_layer);
    r.integer(v, prefix, "layer", static_cast<Index>(l), static_cast<Index>(l));
    r.reals(v, prefix, "normalized", c.heads, 0.0, max_log, c.normalized);
    r.reals(v, prefix, "erank", c.heads, 1.0 - 1e-9, max_erank, c.erank);
    r.reals(v, prefix, "truncated", c.heads, 0.0, max_log, c.truncated);
    r.labels(v, prefix, "groups", c.heads, c.groups, c.query_group);
    r.reals(v, prefix, "kv_erank", c.kv_heads, 1.0 - 1e-9, max_erank, c.kv_erank);
    r.labels(v, prefix, "kv_groups", c.kv_heads, c.groups, c.kv_group);
  }
  return c;
}

/// Checks that a calibration fits a model or a dump (its layers, heads and head dim); `what` names the other side.
inline void check_calibration_fits(Calibration const& c, std::string const& path, Index layers, Index heads,
                                   Index kv_heads, Index head_dim, std::string const& what) {
  auto mismatch = [&](char const* field, Index have, Index want) {
    if (have != want)
      fail(exit_invalid, "calibration file " + path + ": field '" + field + "' is " + std::to_string(have) + ", but " +
                             what + " has " + std::to_string(want) + " (a calibration of another model?)");
  };
  if (layers > 0)
    mismatch("layers", c.layers, layers);
  if (heads > 0)
    mismatch("query_heads", c.heads, heads);
  if (kv_heads > 0)
    mismatch("kv_heads", c.kv_heads, kv_heads);
  if (head_dim > 0)
    mismatch("head_dim", c.head_dim, head_dim);
}

// ---------------------------------------------------------------------------------------------------------------
// The `uncomp` policy: its parameters and each layer's per-head budgets.

/// How UNComp meets GQA (spec §7.15; kvc::UNCompGqa).
using UNCompGqa = kvc::UNCompGqa;

/// UNComp as the tools run it: the library's policy object (its parameters declared there), and what the tools add:
/// the step's `auto`, a list of budgets or a preset, the calibration's groups and rule, and kvc-eval's hidden-state
/// stages.
struct UNCompConfig : UNCompPolicy {
  std::optional<double> step;     ///< tokens; empty: auto (74/384 of B̄)
  std::vector<Index> list;        ///< schedule list: the groups' budgets (from `list` or `preset`)
  std::string preset;             ///< the preset's name (empty: none)
  Index groups = 0;               ///< 0: the calibration's M
  std::optional<GroupRule> rule;  ///< empty: auto
  bool stages = false;
  double stage_epsilon = 1.0;
  Index stage_count = 0;               ///< 0: from stage_epsilon
  std::optional<Index> hs_min_tokens;  ///< empty: auto (3/8 of the prompt)
  Index hs_step = 0;

  /// The budgets are absolute (paper, list): no --budget or --ratio sets them.
  bool absolute() const noexcept { return budgets.schedule != BudgetSchedule::preserving; }
};

/// Parses the `uncomp` parameters (bad values exit 3 naming the parameter).
inline UNCompConfig uncomp_config(Params const& p) {
  auto count = [&](char const* name, Index min = 0) {
    return parse_count(p.at(name), std::string("--param ") + name, min);
  };
  UNCompConfig c;
  static_cast<UNCompPolicy&>(c) = from_params<UNCompPolicy>(p);
  if (p.at("step") != "auto")
    c.step = parse_real(p, "step", 0.0, 1e9);
  c.preset = p.at("preset");
  std::string const& list = p.at("list");
  if (!c.preset.empty() && !list.empty())
    fail(exit_invalid, "--param preset = " + c.preset + " and --param list = " + list + ": give one of them");
  if (!c.preset.empty()) {
    Index m = 0;
    Index const* preset = head_budget_preset(c.preset, m);
    if (preset == nullptr)
      fail(exit_invalid, "--param preset = '" + c.preset +
                             "': expected authors_384, paper_384, wide_2, narrow_2, wide_3, narrow_3, wide_4, "
                             "narrow_4, wide_5, narrow_5 or wide_8");
    c.list.assign(preset, preset + m);
    c.budgets.schedule = BudgetSchedule::list;
  } else if (!list.empty()) {
    std::size_t start = 0;
    while (start <= list.size()) {
      std::size_t const slash = std::min(list.find('/', start), list.size());
      Index const v =
          parse_count(list.substr(start, slash - start), "--param list (entry " + std::to_string(c.list.size()) + ")");
      if (v > (Index{1} << 40) || c.list.size() >= 4096)
        fail(exit_invalid, "--param list = '" + list + "': expected at most 4096 budgets of at most 2^40 tokens");
      c.list.push_back(v);
      start = slash + 1;
    }
    if (c.budgets.schedule != BudgetSchedule::list)
      fail(exit_invalid, "--param list is the budgets of schedule=list; --param schedule is " + p.at("schedule"));
  }
  if (c.budgets.schedule == BudgetSchedule::list && c.list.empty())
    fail(exit_invalid, "--param schedule = list: give the budgets with --param list=N1/N2/... or --param preset=NAME");
  if (p.at("groups") != "auto") {
    c.groups = count("groups", 1);
    if (c.groups > max_calibration_heads)
      fail(exit_invalid, "--param groups = " + p.at("groups") + ": expected at most 4096");
  }
  if (p.at("rule") != "auto")
    c.rule = choice<GroupRule>(p, "rule", {{"mean", GroupRule::mean}, {"majority_vote", GroupRule::majority_vote}});
  c.stages = parse_bool(p, "stages");
  c.stage_epsilon = parse_real(p, "stage_epsilon", 0.0, 1e300);
  c.stage_count = count("stage_count");
  if (p.at("hs_min_tokens") != "auto")
    c.hs_min_tokens = count("hs_min_tokens");
  c.hs_step = count("hs_step");
  pre_rope(p);  // its value checked (kvc-eval refuses post_rope)
  return c;
}

/// The calibration's labels of layer `layer` for the heads budgets are per (KV heads, or query heads with
/// gqa=expand), as the config asks: the file's, or regrouped into cfg.groups groups from its mean eranks (rule mean
/// only). Fills `labels` [heads] and returns M.
inline Index uncomp_labels(UNCompConfig const& cfg, Calibration const& cal, std::string const& path, Index layer,
                           std::vector<Index>& labels) {
  bool const expand = cfg.gqa == UNCompGqa::expand;
  Index const heads = expand ? cal.heads : cal.kv_heads;
  auto const first = static_cast<std::size_t>(layer * heads);
  std::vector<Index> const& file = expand ? cal.query_group : cal.kv_group;
  labels.assign(file.begin() + static_cast<std::ptrdiff_t>(first),
                file.begin() + static_cast<std::ptrdiff_t>(first) + heads);
  if (cfg.groups == 0 || cfg.groups == cal.groups)
    return cal.groups;
  if (cal.rule != GroupRule::mean)
    fail(exit_invalid, "--param groups = " + std::to_string(cfg.groups) + ": calibration file " + path + " has " +
                           std::to_string(cal.groups) +
                           " groups by majority vote, which cannot be regrouped (calibrate again with --groups " +
                           std::to_string(cfg.groups) + ")");
  std::vector<double> const& erank = expand ? cal.erank : cal.kv_erank;
  if (!group_heads(erank.data() + first, heads, cfg.groups, labels.data()).ok())
    fail(exit_invalid,
         "--param groups = " + std::to_string(cfg.groups) + ": cannot group " + std::to_string(heads) + " heads");
  return cfg.groups;
}

/// The integer per-head budgets [heads] of layer `layer` (head_budgets: largest remainder, at least the window)
/// for an average of `average` tokens per head (schedule preserving). `heads` is Hkv, or Hq with gqa=expand.
inline std::vector<Index> uncomp_budgets(UNCompConfig const& cfg, Calibration const& cal, std::string const& path,
                                         Index layer, double average) {
  std::vector<Index> labels;
  Index const groups = uncomp_labels(cfg, cal, path, layer, labels);
  HeadBudgetSpec spec = cfg.budgets;  // schedule and largest
  spec.groups = groups;
  spec.average = average;
  spec.step = cfg.step ? *cfg.step : average * 74.0 / 384.0;
  if (spec.schedule == BudgetSchedule::list) {
    if (static_cast<Index>(cfg.list.size()) != groups)
      fail(exit_invalid, "--param " + std::string(cfg.preset.empty() ? "list" : "preset") + ": " +
                             std::to_string(cfg.list.size()) + " budgets, but the calibration (" + path + ") has " +
                             std::to_string(groups) + " groups (or pass --param groups=" +
                             std::to_string(cfg.list.size()) + " to regroup a rule=mean calibration)");
    spec.list = cfg.list.data();
  }
  std::vector<Index> budget(labels.size());
  Status const st =
      head_budgets(spec, labels.data(), static_cast<Index>(labels.size()), cfg.scorer.window_size, budget.data());
  if (!st.ok())
    fail(exit_invalid, "policy uncomp, layer " + std::to_string(layer) + " (average " + number_text(average) +
                           " tokens per head, step " + number_text(spec.step) + "): " + st.message());
  return budget;
}

}  // namespace kvc::tools
