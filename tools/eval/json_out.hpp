// SPDX-License-Identifier: Apache-2.0
// tools/eval/json_out.hpp: how kvc-eval writes JSON (results.json, correction's --out, dump's meta.json), with
// nlohmann-json: objects keep their keys in insertion order (ordered_json) so that files read and diff in a fixed
// order. Numbers: integers as integers, doubles in their shortest round-trip form; NaN and +-Inf (JSON has none) are
// written as null, on purpose (json_number). Strings are UTF-8; invalid UTF-8 bytes (a file name, say) become
// U+FFFD instead of failing the write. Files kvc-eval reads (configs, tokenizers, calibrations) go through the
// strict reader io/json.hpp instead. Included by .cpp files only (nlohmann's header is large).
#pragma once

#include <cmath>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace kvc::eval {

using OrderedJson = nlohmann::ordered_json;

/// `x` as a JSON value: itself when finite, null for NaN and +-Inf.
inline OrderedJson json_number(double x) {
  return std::isfinite(x) ? OrderedJson(x) : OrderedJson(nullptr);
}

/// `v` as text: `indent` < 0 on one line, else pretty-printed with that many spaces; UTF-8 out, invalid bytes as
/// U+FFFD.
inline std::string json_text(OrderedJson const& v, int indent = -1) {
  return v.dump(indent, ' ', false, OrderedJson::error_handler_t::replace);
}

/// One record (an object) on one line as kvc-eval has always written them: `{"key": value, "key": value}` (a space
/// after each top-level ':' and ','; nested values compact, e.g. `[0.5,null]`).
inline std::string json_record(OrderedJson const& record) {
  if (!record.is_object())
    return json_text(record);
  std::string out = "{";
  for (auto const& [key, value] : record.items()) {
    if (out.size() > 1)
      out += ", ";
    out += json_text(OrderedJson(key));
    out += ": ";
    out += json_text(value);
  }
  return out + "}";
}

/// An array of records, one record per line ("[\n  {...},\n  {...}\n]\n"): diffs and grep see one record a line.
inline std::string json_lines(std::vector<OrderedJson> const& records) {
  std::string out = "[\n";
  for (std::size_t i = 0; i < records.size(); ++i) {
    out += "  ";
    out += json_record(records[i]);
    out += i + 1 < records.size() ? ",\n" : "\n";
  }
  return out + "]\n";
}

}  // namespace kvc::eval
