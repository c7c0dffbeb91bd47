// SPDX-License-Identifier: Apache-2.0
#include "eval/calibration_file.hpp"

#include "eval/json_out.hpp"
#include "io/file.hpp"

#include <cstddef>
#include <span>
#include <stdexcept>
#include <string>
#include <sys/stat.h>
#include <vector>

namespace kvc::eval {

namespace {

using tools::Calibration;

/// Checks that the calibration's sizes and vectors agree (a bug in the writer, not an input error).
void check_sizes(Calibration const& c) {
  auto const lh = static_cast<std::size_t>(c.layers * c.heads), lg = static_cast<std::size_t>(c.layers * c.kv_heads);
  if (c.layers < 1 || c.heads < 1 || c.kv_heads < 1 || c.heads % c.kv_heads != 0 || c.normalized.size() != lh ||
      c.erank.size() != lh || c.truncated.size() != lh || c.query_group.size() != lh || c.kv_erank.size() != lg ||
      c.kv_group.size() != lg || c.layer_score.size() != static_cast<std::size_t>(c.layers))
    throw std::logic_error("kvc: a calibration's vectors do not match its sizes");
}

/// Elements [at, at + n) of `v` as a JSON array.
template <class T>
OrderedJson slice(std::vector<T> const& v, std::size_t at, std::size_t n) {
  return OrderedJson(
      std::vector<T>(v.begin() + static_cast<std::ptrdiff_t>(at), v.begin() + static_cast<std::ptrdiff_t>(at + n)));
}

}  // namespace

std::string calibration_json(Calibration const& c) {
  check_sizes(c);
  OrderedJson top;
  top["format"] = tools::calibration_format;
  top["version"] = tools::calibration_version;
  top["model"] = c.model;
  top["layers"] = c.layers;
  top["query_heads"] = c.heads;
  top["kv_heads"] = c.kv_heads;
  top["head_dim"] = c.head_dim;
  top["top_k"] = c.top_k;
  top["normalize_rows"] = c.normalize_rows;
  top["renormalize_topk"] = c.renormalize_topk;
  top["ridge"] = c.ridge;
  top["samples"] = c.samples;
  top["tokens"] = c.tokens;
  top["text"] = c.text;
  top["groups"] = c.groups;
  top["rule"] = tools::group_rule_name(c.rule);
  top["layer_score"] = c.layer_score;
  auto const H = static_cast<std::size_t>(c.heads), G = static_cast<std::size_t>(c.kv_heads);
  std::vector<OrderedJson> layers;
  for (std::size_t l = 0; l < static_cast<std::size_t>(c.layers); ++l) {
    OrderedJson layer;
    layer["layer"] = l;
    layer["normalized"] = slice(c.normalized, l * H, H);
    layer["erank"] = slice(c.erank, l * H, H);
    layer["truncated"] = slice(c.truncated, l * H, H);
    layer["groups"] = slice(c.query_group, l * H, H);
    layer["kv_erank"] = slice(c.kv_erank, l * G, G);
    layer["kv_groups"] = slice(c.kv_group, l * G, G);
    layers.push_back(std::move(layer));
  }
  // The layout by hand, the values by nlohmann: a top-level field a line, a layer a line (diffs and grep read them).
  std::string out = "{\n";
  for (auto const& [key, value] : top.items())
    out += "  " + json_text(OrderedJson(key)) + ": " + json_text(value) + ",\n";
  out += "  \"per_layer\": [\n";
  for (std::size_t l = 0; l < layers.size(); ++l)
    out += "    " + json_record(layers[l]) + (l + 1 < layers.size() ? ",\n" : "\n");
  return out + "  ]\n}\n";
}

void write_calibration(Calibration const& c, std::string const& path) {
  std::string const text = calibration_json(c);
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode))
    tools::fail(tools::exit_invalid, "--out " + path +
                                         " exists and is not a regular file; expected a new path or a calibration "
                                         "file to replace");
  std::string error;
  std::vector<StagedFile> files(1);
  if (!files[0].open(path, error) ||
      !files[0].write(std::span(reinterpret_cast<std::byte const*>(text.data()), text.size()), error) ||
      !files[0].finish(error))
    tools::fail(tools::exit_invalid, "calibration file " + path + ": " + error);
  std::size_t failed = 0;
  if (!commit_together(files, error, failed))
    tools::fail(tools::exit_invalid, "calibration file " + path + ": " + error);
}

}  // namespace kvc::eval
