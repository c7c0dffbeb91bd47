// SPDX-License-Identifier: Apache-2.0
// tools/eval/report.cpp: kvc-eval's reports (report.hpp): results.json (nlohmann-json), results.csv, the terminal
// table, the plots' data, side-by-side text.
#include "eval/report.hpp"

#include "eval/json_out.hpp"
#include "eval/run.hpp"
#include "eval/svg_plot.hpp"

#include <cmath>
#include <cstdio>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace kvc::eval {

namespace {

/// A number of results.csv: %.17g (enough digits to round-trip); non-finite numbers as null, as results.json has them.
std::string csv_number(double x) {
  if (!std::isfinite(x))
    return "null";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.17g", x);
  return buf;
}

}  // namespace

std::string params_text(tools::Params const& params) {
  std::string s;
  for (auto const& [k, v] : params)
    s += (s.empty() ? "" : ",") + k + "=" + v;
  return s;
}

std::string results_json(std::vector<Record> const& records, std::vector<PolicyRun> const& runs, RunInfo const& info) {
  std::map<std::string, std::string> params;
  for (PolicyRun const& r : runs)
    params[r.label()] = params_text(r.params);
  std::vector<OrderedJson> out;
  out.reserve(records.size());
  for (Record const& r : records) {
    OrderedJson errors = OrderedJson::array(), steps = OrderedJson::array();
    for (double e : r.layer_error)
      errors.push_back(json_number(e));
    for (double b : r.kv_bytes_steps)
      steps.push_back(json_number(b));
    OrderedJson j;
    j["policy"] = r.policy;
    j["ratio"] = json_number(r.ratio);
    j["kl"] = json_number(r.kl);
    j["top1"] = json_number(r.top1);
    j["perplexity"] = json_number(r.perplexity);
    j["perplexity_full"] = json_number(r.perplexity_full);
    j["kv_bytes"] = json_number(r.kv_bytes);
    j["kv_bytes_full"] = json_number(r.kv_bytes_full);
    j["kv_held_bytes"] = json_number(r.kv_held_bytes);
    j["kv_held_bytes_full"] = json_number(r.kv_held_bytes_full);
    j["kept_min"] = json_number(r.kept_min);
    j["kept_max"] = json_number(r.kept_max);
    j["seconds"] = json_number(r.seconds);
    j["moment_bytes"] = json_number(r.moment_bytes);
    j["payload_bytes"] = json_number(r.payload_bytes);
    j["overhead_bytes"] = json_number(r.overhead_bytes);
    j["layer_error"] = std::move(errors);
    j["samples"] = r.samples;
    j["params"] = params[r.policy];
    j["model"] = info.model;
    j["cache"] = info.cache;
    j["reference_cache"] = info.reference_cache;
    j["layout"] = info.layout;
    j["prompt_tokens"] = info.prompt_tokens;
    j["continuation"] = info.continuation;
    j["seed"] = info.seed;
    j["prompt_source"] = info.prompt_source;
    j["schedule"] = info.schedule;
    j["isa"] = info.isa;
    if (!steps.empty())
      j["kv_bytes_steps"] = std::move(steps);
    out.push_back(std::move(j));
  }
  return json_lines(out);
}

std::string csv_field(std::string const& s) {
  if (s.find_first_of(",\"\r\n") == std::string::npos)
    return s;
  std::string out = "\"";
  for (char c : s) {
    if (c == '"')
      out += '"';
    out += c;
  }
  out += '"';
  return out;
}

std::string results_csv(std::vector<Record> const& records) {
  std::size_t const layers = records.empty() ? 0 : records.front().layer_error.size();
  std::string out =
      "policy,ratio,kl,top1,perplexity,perplexity_full,kv_bytes,kv_bytes_full,seconds,samples,kv_held_bytes,"
      "kv_held_bytes_full,kept_min,kept_max,moment_bytes,payload_bytes,overhead_bytes";
  for (std::size_t l = 0; l < layers; ++l)
    out += ",layer_error_" + std::to_string(l);
  out += "\n";
  for (Record const& r : records) {
    out += csv_field(r.policy);  // quoted when inline parameters hold commas: moment_kv(mi=false,correction=true)
    // (out += ','; out += ... rather than "," + ...: GCC 12 reports a false -Wrestrict on the temporary.)
    for (double x : {r.ratio, r.kl, r.top1, r.perplexity, r.perplexity_full, r.kv_bytes, r.kv_bytes_full, r.seconds}) {
      out += ',';
      out += csv_number(x);
    }
    out += ',';
    out += std::to_string(r.samples);
    for (double x : {r.kv_held_bytes, r.kv_held_bytes_full, r.kept_min, r.kept_max, r.moment_bytes, r.payload_bytes,
                     r.overhead_bytes}) {
      out += ',';
      out += csv_number(x);
    }
    for (double e : r.layer_error) {
      out += ',';
      out += csv_number(e);
    }
    out += '\n';
  }
  return out;
}

std::string results_table(std::vector<Record> const& records) {
  std::string out;
  char line[512];
  int width = 14;        // the policy column fits the longest name
  bool moments = false;  // the moments' column only when a row holds moments (MomentKV)
  for (Record const& r : records) {
    width = std::max(width, static_cast<int>(std::min<std::size_t>(r.policy.size(), 64)));
    moments = moments || r.moment_bytes > 0;
  }
  std::snprintf(line, sizeof line, "%-*s %5s %8s %8s %9s %10s %7s %10s %9s %10s %11s%s\n", width, "policy", "ratio",
                "KV kept", "held", "held KiB", "KL (nats)", "top-1", "perplexity", "max err", "ms/sample",
                "tokens/head", moments ? "  moments KiB" : "");
  out += line;
  for (Record const& r : records) {
    double max_error = 0;
    for (double e : r.layer_error)
      max_error = std::max(max_error, e);
    std::snprintf(line, sizeof line, "%-*s %5.2f %7.1f%% %7.1f%% %9.1f %10.4f %7.3f %10.3f %9.4f %10.2f %5.0f-%-5.0f\n",
                  width, r.policy.c_str(), r.ratio, r.kv_bytes_full > 0 ? 100.0 * r.kv_bytes / r.kv_bytes_full : 0.0,
                  r.kv_held_bytes_full > 0 ? 100.0 * r.kv_held_bytes / r.kv_held_bytes_full : 0.0,
                  r.kv_held_bytes / 1024.0, r.kl, r.top1, r.perplexity, max_error, 1e3 * r.seconds, r.kept_min,
                  r.kept_max);
    out += line;
    if (moments) {
      out.pop_back();  // the newline
      std::snprintf(line, sizeof line, " %12.1f\n", r.moment_bytes / 1024.0);
      out += line;
    }
  }
  return out;
}

PlotSpec quality_plot(std::vector<Record> const& records, std::string const& title, bool kl) {
  PlotSpec spec;
  spec.title = title;
  spec.x_label = "KV cache kept (fraction of the full cache's bytes)";
  spec.y_label = kl ? "KL(full || compressed), nats per token (log scale)" : "top-1 agreement with the full cache";
  spec.log_y = kl;
  for (Record const& r : records) {
    if (spec.series.empty() || spec.series.back().name != r.policy)
      spec.series.push_back({r.policy, {}, {}});
    spec.series.back().x.push_back(r.kv_bytes_full > 0 ? r.kv_bytes / r.kv_bytes_full : 0.0);
    spec.series.back().y.push_back(kl ? r.kl : r.top1);
  }
  return spec;
}

PlotSpec cache_plot(std::vector<Record> const& records, std::string const& title, double full_start, double per_token) {
  PlotSpec spec;
  spec.title = title;
  spec.x_label = "decode step";
  spec.y_label = "K + V held, KiB (all layers)";
  std::size_t steps = 0;
  for (Record const& r : records) {
    PlotSeries line{r.policy, {}, {}};
    for (std::size_t t = 0; t < r.kv_bytes_steps.size(); ++t) {
      line.x.push_back(static_cast<double>(t + 1));
      line.y.push_back(r.kv_bytes_steps[t] / 1024.0);
    }
    steps = std::max(steps, r.kv_bytes_steps.size());
    spec.series.push_back(std::move(line));
  }
  PlotSeries full{"full cache", {}, {}};
  for (std::size_t t = 0; t < steps; ++t) {
    full.x.push_back(static_cast<double>(t + 1));
    full.y.push_back((full_start + per_token * static_cast<double>(t + 1)) / 1024.0);
  }
  spec.series.push_back(std::move(full));
  return spec;
}

std::size_t code_points(std::string const& s) {
  std::size_t n = 0;
  for (unsigned char c : s)
    n += (c & 0xC0) != 0x80;
  return n;
}

std::vector<std::string> wrap(std::string const& text, std::size_t width) {
  std::vector<std::string> lines;
  std::size_t start = 0;
  while (true) {  // one paragraph (newline-separated) at a time
    std::size_t const end = text.find('\n', start);
    std::string const para = text.substr(start, end == std::string::npos ? std::string::npos : end - start);
    std::string line;
    std::size_t word_start = 0;
    while (word_start <= para.size()) {
      std::size_t word_end = para.find(' ', word_start);
      if (word_end == std::string::npos)
        word_end = para.size();
      std::string word = para.substr(word_start, word_end - word_start);
      while (code_points(word) > width) {  // cut an overlong word
        if (!line.empty())
          lines.push_back(std::exchange(line, {}));
        std::size_t cut = 0, points = 0;
        while (cut < word.size() && (points < width || (static_cast<unsigned char>(word[cut]) & 0xC0) == 0x80))
          points += (static_cast<unsigned char>(word[cut++]) & 0xC0) != 0x80;
        lines.push_back(word.substr(0, cut));
        word.erase(0, cut);
      }
      if (line.empty())
        line = word;
      else if (code_points(line) + 1 + code_points(word) <= width)
        line += " " + word;
      else
        lines.push_back(std::exchange(line, word));
      word_start = word_end + 1;
    }
    lines.push_back(line);
    if (end == std::string::npos)
      return lines;
    start = end + 1;
  }
}

std::string side_by_side(std::string const& left_title, std::string const& left, std::string const& right_title,
                         std::string const& right, std::size_t width) {
  auto const pad = [&](std::string const& s) {
    std::size_t const points = code_points(s);
    return s + std::string(width > points ? width - points : 0, ' ');
  };
  std::vector<std::string> const a = wrap(left, width), b = wrap(right, width);
  std::string out =
      pad(left_title) + " | " + right_title + "\n" + std::string(width, '-') + "-+-" + std::string(width, '-') + "\n";
  for (std::size_t i = 0; i < std::max(a.size(), b.size()); ++i)
    out += pad(i < a.size() ? a[i] : "") + " | " + (i < b.size() ? b[i] : "") + "\n";
  return out;
}

}  // namespace kvc::eval
