// SPDX-License-Identifier: Apache-2.0
// tools/kvc/policies.cpp: `kvc policies`: the policy table and the allocators, with their parameters.

#include "internal.hpp"

namespace kvc::cli {

int cmd_policies() {
  auto param_text = [](ParamInfo const& p) {
    std::string s = std::string("--param ") + p.name + "=" + p.default_value;
    if (p.kvpress_default)
      s += std::string(" (kvpress: ") + p.kvpress_default + ")";
    if (p.authors_default)
      s += std::string(" (authors: ") + p.authors_default + ")";
    return s;
  };
  std::size_t width = 0;
  for (auto const& policy : policies())
    for (auto const& p : policy.params)
      width = std::max(width, param_text(p).size());
  for (auto const& a : allocators())
    for (auto const& p : a.params)
      width = std::max(width, param_text(p).size());
  for (auto const& policy : policies()) {
    char const* reads = !policy.token_scores   ? "--queries"
                        : policy.reads_queries ? "keys and --queries"
                                               : (policy.reads_keys ? "keys" : "no tensor data");
    std::fprintf(io.out, "%s  (reads %s)\n    %s\n", policy.name, reads, policy.summary);
    for (auto const& p : policy.params)
      std::fprintf(io.out, "    %-*s  %s\n", static_cast<int>(width), param_text(p).c_str(), p.help);
  }
  std::fprintf(
      io.out,
      "n_sink and n_recent protect tokens in compress's top-k selection; `kvc score` rejects them, and rdkv's and\n"
      "kivi's allocation and packing parameters too.\n"
      "budgets (compress): --ratio R (fraction removed, kept = floor(N*(1-R))) or --budget N (tokens per head)\n");
  std::fprintf(io.out,
               "\nallocators (compress --allocator ada_kv, pyramid_kv or pyramid_kv+ada_kv, with any policy): their "
               "parameters\nare --param too; one the policy also has (reference, snap_kv's window_size) is one "
               "parameter, with the\nallocator's default\n");
  for (auto const& a : allocators()) {
    std::fprintf(io.out, "%s  (allocator)\n    %s\n", a.name, a.summary);
    for (auto const& p : a.params)
      std::fprintf(io.out, "    %-*s  %s\n", static_cast<int>(width), param_text(p).c_str(), p.help);
  }
  return 0;
}

}  // namespace kvc::cli
