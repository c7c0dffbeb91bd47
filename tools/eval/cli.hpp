// SPDX-License-Identifier: Apache-2.0
// tools/eval/cli.hpp: what kvc-eval's commands share (tools/eval/main.cpp, cmd_*.cpp): their options as CLI11 parsed
// them, the loading of models, tokenizers and token files, the rows of --policies, and outputs written whole.
// Errors go through kvc::tools::fail: exit 2 (usage) or 3 (invalid input, the message naming the file).
#pragma once

#include "common/policies.hpp"
#include "eval/engine.hpp"
#include "eval/model.hpp"
#include "eval/run.hpp"
#include "eval/tokenizer.hpp"
#include "io/file.hpp"

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace CLI {
class App;
}

namespace kvc::eval::cli {

/// The options of one command (a CLI11 subcommand): each `--name VALUE` (or `--name=VALUE`) as given, in order.
/// Declared before parsing; read after parsing and check(). Option names include their leading "--".
class Options {
 public:
  /// Binds to `app` (the command's subcommand); `app` must outlive this object, and this object must not move once
  /// an option is declared (CLI11 holds pointers to its values).
  explicit Options(CLI::App& app) : app_(&app) {}
  Options(Options const&) = delete;
  Options& operator=(Options const&) = delete;

  /// The command's description (the first lines of its --help) and footer (explanations after the option list).
  void describe(std::string const& description, std::string const& footer);
  /// Declares `--name VALUE`: one value per occurrence; `value_name` shows in --help. `required`: CLI11 refuses the
  /// command without it. `repeatable`: it may be given more than once (--param); otherwise twice is a usage error.
  void option(std::string const& name, std::string const& value_name, std::string const& help, bool required = false,
              bool repeatable = false);
  /// Declares a flag `--name` (no value); given twice is a usage error.
  void flag(std::string const& name, std::string const& help);
  /// After CLI11 parsed: refuses an option given twice, an unknown option or a stray argument (exit 2, naming it).
  void check() const;

  bool has(std::string const& name) const;
  /// The value of `name`, or `fallback` when it was not given.
  std::string get(std::string const& name, std::string const& fallback = "") const;
  /// Every value of a repeatable option, in the order given (empty when absent).
  std::vector<std::string> const& all(std::string const& name) const;

 private:
  CLI::App* app_;
  std::map<std::string, std::vector<std::string>> values_;  // name -> its values (std::map: stable addresses)
  std::map<std::string, std::int64_t> flags_;               // name -> times given
  std::vector<std::string> single_;                         // options that may be given once
};

/// The integer option `name` in [min, max] (`fallback` when absent): below min or not an integer exits 3 (as
/// kvc::tools::parse_count), above max exits 3.
Index count_option(Options const& o, std::string const& name, Index fallback, Index min, Index max);

/// `s` cut at every `sep` (an empty string gives one empty piece).
std::vector<std::string> split(std::string const& s, char sep);

/// The cache element type named `type` (given as `option`, e.g. "--cache"); a usage error naming the choices.
CacheType cache_type(std::string const& type, std::string const& option);
/// --cache (default `default_type`) and --layout (dense or paged, default dense).
CacheOptions cache_options(Options const& o, std::string const& default_type);

/// The model at `path` (eval/model.hpp); exits 3 with the loader's message.
Model load_model(std::string const& path);
/// The tokenizer next to the model: tokenizer.json (Hugging Face), or tokenizer.bin / the one tok*.bin (llama2.c);
/// nullopt when there is none; exits 3 on a damaged file or two llama2.c tokenizers.
std::optional<Tokenizer> load_tokenizer(Model const& model);
/// A 1-D int32/int64 token array from a .npy file, every id in [0, vocab), at most `context` tokens (the model's
/// trained positions). Exits 3 naming the file otherwise.
std::vector<std::int32_t> load_tokens(std::string const& path, Index vocab, Index context);
/// The token ids of a text file (at most 4 MiB) or, when `path` is empty, of `builtin`; every id inside the
/// vocabulary. `option` names the file in errors ("--text FILE: ...").
std::vector<std::int32_t> encode_text(Tokenizer const& tokenizer, ModelConfig const& c, std::string const& option,
                                      std::string const& path, std::string_view builtin);

/// Creates `dir` (and its parents) for --out-dir; exits 3 when it cannot.
void make_directory(std::string const& dir);

/// Output files staged beside their destinations and committed together (all or none: io/file.hpp). A file that
/// cannot be staged exits 3 naming it; nothing is visible before commit().
class Outputs {
 public:
  void add(std::string const& path, std::string const& text);
  void add(std::string const& path, std::span<std::byte const> bytes);
  void commit();

 private:
  std::vector<StagedFile> files_;
};

/// The rows of a --policies list with their parameters: `all` stands for every policy of the table; `random` is
/// added when `add_random`. A row is SCORER[(NAME=VALUE,...)][+ALLOCATOR[+ALLOCATOR]]: its own parameters, then
/// every `--param ROW.NAME=VALUE` of `o` (the same name twice is a usage error), over the scorer's and the
/// allocators' defaults (tools/common/policies.hpp).
std::vector<PolicyRun> policy_rows(Options const& o, std::string const& list, bool add_random);
/// Splits a --policies list at the commas outside parentheses (a row's own parameters hold commas).
std::vector<std::string> split_rows(std::string const& s);

/// The prompts' seed of sample `s` for --seed `seed` (run and correction sample the same prompts).
inline std::uint64_t sample_seed(std::uint64_t seed, Index s) {
  return seed * 0x9E3779B97F4A7C15ull + static_cast<std::uint64_t>(s);
}

// The commands (cmd_*.cpp): declare_X declares X's options on `o`; command_X runs it once they parsed. Each
// returns the process's exit code or exits through kvc::tools::fail.
void declare_run(Options& o);
int command_run(Options const& o);
void declare_logits(Options& o);
int command_logits(Options const& o);
void declare_dump(Options& o);
int command_dump(Options const& o);
void declare_correction(Options& o);
int command_correction(Options const& o);
void declare_calibrate(Options& o);
int command_calibrate(Options const& o);

}  // namespace kvc::eval::cli
