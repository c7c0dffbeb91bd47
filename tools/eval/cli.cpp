// SPDX-License-Identifier: Apache-2.0
// tools/eval/cli.cpp: kvc-eval's options through CLI11, and the loading and writing its commands share (cli.hpp).
#include "eval/cli.hpp"

#include "io/npy.hpp"

#include <CLI/CLI.hpp>
#include <filesystem>
#include <string>
#include <system_error>
#include <vector>

namespace kvc::eval::cli {

namespace fs = std::filesystem;
using kvc::tools::exit_invalid;
using kvc::tools::exit_usage;
using kvc::tools::fail;

void Options::describe(std::string const& description, std::string const& footer) {
  app_->description(description);
  app_->footer(footer);
}

void Options::option(std::string const& name, std::string const& value_name, std::string const& help, bool required,
                     bool repeatable) {
  CLI::Option* opt = app_->add_option(name, values_[name], help);
  // One value per occurrence (`--name VALUE` or `--name=VALUE`); every occurrence kept, so that check() can refuse
  // a repeated one by name.
  opt->type_name(value_name)
      ->expected(1)
      ->allow_extra_args(false)
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  if (required)
    opt->required();
  if (!repeatable)
    single_.push_back(name);
}

void Options::flag(std::string const& name, std::string const& help) {
  app_->add_flag(name, flags_[name], help);
}

void Options::check() const {
  for (std::string const& name : single_)
    if (values_.at(name).size() > 1)
      fail(exit_usage, name + " given twice");
  for (auto const& [name, count] : flags_)
    if (count > 1)
      fail(exit_usage, name + " given twice");
  for (std::string const& extra : app_->remaining()) {
    if (extra.rfind("-", 0) == 0)
      fail(exit_usage, "unknown option '" + extra.substr(0, extra.find('=')) + "' for kvc-eval " + app_->get_name());
    fail(exit_usage, "unexpected argument '" + extra + "' (each option takes one value; quote a value with spaces)");
  }
}

bool Options::has(std::string const& name) const {
  if (auto const f = flags_.find(name); f != flags_.end())
    return f->second > 0;
  auto const v = values_.find(name);
  return v != values_.end() && !v->second.empty();
}

std::string Options::get(std::string const& name, std::string const& fallback) const {
  auto const v = values_.find(name);
  return v == values_.end() || v->second.empty() ? fallback : v->second.front();
}

std::vector<std::string> const& Options::all(std::string const& name) const {
  static std::vector<std::string> const none;
  auto const v = values_.find(name);
  return v == values_.end() ? none : v->second;
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

CacheType cache_type(std::string const& type, std::string const& option) {
  for (auto const t : {CacheType::f16, CacheType::bf16, CacheType::f32, CacheType::f8_e4m3, CacheType::f8_e5m2})
    if (type == cache_type_name(t))
      return t;
  fail(exit_usage, option + " '" + type + "': expected fp16, bf16, fp32, fp8_e4m3 or fp8_e5m2");
}

CacheOptions cache_options(Options const& o, std::string const& default_type) {
  CacheOptions c;
  std::string const layout = o.get("--layout", "dense");
  c.type = cache_type(o.get("--cache", default_type), "--cache");
  if (layout == "dense")
    c.layout = CacheLayout::dense;
  else if (layout == "paged")
    c.layout = CacheLayout::paged;
  else
    fail(exit_usage, "--layout '" + layout + "': expected dense or paged");
  return c;
}

Model load_model(std::string const& path) {
  Model model;
  std::string error;
  if (!Model::load(path, model, error))
    fail(exit_invalid, error);
  return model;
}

std::optional<Tokenizer> load_tokenizer(Model const& model) {
  fs::path const dir = fs::path(model.weights_path).parent_path();
  Tokenizer tok;
  std::string error;
  if (model.config.format == "huggingface") {
    if (!fs::exists(dir / "tokenizer.json"))
      return std::nullopt;
    if (!Tokenizer::load_json((dir / "tokenizer.json").string(), tok, error))
      fail(exit_invalid, error);
    return tok;
  }
  std::vector<fs::path> candidates;
  std::error_code ec;
  for (auto const& e : fs::directory_iterator(dir.empty() ? fs::path(".") : dir, ec))
    if (is_llama2c_tokenizer(e.path()))
      candidates.push_back(e.path());
  if (candidates.empty())
    return std::nullopt;
  if (candidates.size() > 1)
    fail(exit_invalid, dir.string() + ": " + std::to_string(candidates.size()) +
                           " llama2.c tokenizers (tok*.bin) next to the checkpoint; keep the one that belongs to it");
  if (!Tokenizer::load_llama2c(candidates[0].string(), static_cast<std::int32_t>(model.config.vocab), tok, error))
    fail(exit_invalid, error);
  return tok;
}

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

std::vector<std::int32_t> encode_text(Tokenizer const& tokenizer, ModelConfig const& c, std::string const& option,
                                      std::string const& path, std::string_view builtin) {
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

void make_directory(std::string const& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec || !fs::is_directory(dir))
    fail(exit_invalid, "--out-dir " + dir + ": cannot create the directory (" + ec.message() + ")");
}

void Outputs::add(std::string const& path, std::string const& text) {
  add(path, std::span(reinterpret_cast<std::byte const*>(text.data()), text.size()));
}

void Outputs::add(std::string const& path, std::span<std::byte const> bytes) {
  std::string error;
  files_.emplace_back();
  if (!files_.back().open(path, error) || !files_.back().write(bytes, error) || !files_.back().finish(error))
    fail(exit_invalid, path + ": " + error);
}

void Outputs::commit() {
  std::string error;
  std::size_t failed = 0;
  if (!kvc::commit_together(files_, error, failed))
    fail(exit_invalid, files_[failed].path() + ": " + error);
  files_.clear();
}

}  // namespace kvc::eval::cli
