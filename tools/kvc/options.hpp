// SPDX-License-Identifier: Apache-2.0
// tools/kvc/options.hpp: the commands of `kvc` and their options, declared once: the table CLI11 parses the command
// line from (`--name value` and `--name=value`) and each command's --help is generated from.
#pragma once

#include <map>
#include <string>
#include <string_view>
#include <vector>

namespace kvc::cli {

/// One option of a command. `value` is the placeholder --help shows (empty: a flag, which takes no value).
struct OptionDoc {
  char const* name;   ///< "--keys"
  char const* value;  ///< "K.npy"; "" for a flag
  char const* help;   ///< lines joined by '\n' (--help indents the continuation lines)
};

struct CommandInfo {
  char const* name;
  char const* synopsis;  ///< usage lines (printed with usage errors and first in --help)
  char const* intro;     ///< what the command does (--help)
  std::vector<OptionDoc> options;
  char const* footer;  ///< --help's last lines
};

/// kvc's commands: score, compress, attend, policies.
std::vector<CommandInfo> const& commands();
CommandInfo const* find_command(std::string_view name);

/// `kvc --help`: every command in one screen.
extern char const* const overview_text;

/// A command's --help, generated from its table entry.
std::string help_text(CommandInfo const& command);

/// The parsed command line: the command, each option's value (by name, e.g. "--keys"), the --param list in order.
struct Options {
  CommandInfo const* command = nullptr;
  std::map<std::string, std::string, std::less<>> values;  ///< option -> value, e.g. "--keys" -> path
  std::vector<std::string> params;                         ///< --param NAME=VALUE, in the order given
  bool time = false;
  bool help = false;  ///< --help, -h or `kvc help [COMMAND]` (command null: the overview)

  bool has(std::string_view opt) const { return values.find(opt) != values.end(); }
  std::string get(std::string_view opt) const {
    auto const it = values.find(opt);
    return it == values.end() ? std::string() : it->second;
  }
};

/// Parses `kvc COMMAND ...` (argv[0] ignored) with CLI11. Usage errors throw kvc::tools::Failure with exit code 2:
/// a missing or unknown command, an unknown argument, an option of another command, an option given twice (except
/// --param), an option without its value.
Options parse_args(int argc, char const* const* argv);

}  // namespace kvc::cli
