// SPDX-License-Identifier: Apache-2.0
// tools/eval/rows.cpp: the rows of --policies and their parameters (cli.hpp's policy_rows): row names
// SCORER[(NAME=VALUE,...)][+ALLOCATOR[+ALLOCATOR]] and --param ROW.NAME=VALUE, resolved through
// tools/common/policies.hpp.
#include "eval/cli.hpp"

#include <algorithm>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace kvc::eval::cli {

using kvc::tools::exit_usage;
using kvc::tools::fail;

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

namespace {

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

}  // namespace

std::vector<PolicyRun> policy_rows(Options const& o, std::string const& list, bool add_random) {
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
  for (std::string const& text : o.all("--param")) {
    auto const [policy, kv] = param_target(text);
    if (std::find(names.begin(), names.end(), policy) == names.end())
      fail(exit_usage, "--param '" + text + "': policy " + policy + " is not in --policies");
    given[policy].push_back(kv);
  }
  std::vector<PolicyRun> rows;
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
    PolicyRun policy_run{&info, kvc::tools::resolve_params(kvc::tools::with_allocators(info, alloc), params, true),
                         alloc, row.inline_params};
    for (auto const& r : rows)
      if (r.label() == policy_run.label())
        fail(exit_usage, "--policies: " + policy_run.label() + " listed twice");
    rows.push_back(std::move(policy_run));
  }
  return rows;
}

}  // namespace kvc::eval::cli
