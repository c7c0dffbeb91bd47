// SPDX-License-Identifier: Apache-2.0
// tools/eval/main.cpp: `kvc-eval`, what each policy costs and preserves on a real model (docs/eval.md). Its commands
// are CLI11 subcommands (cli.hpp; each in cmd_<command>.cpp): run, logits, dump, correction, calibrate; `kvc-eval
// COMMAND --help` lists a command's options. Options take `--name VALUE` or `--name=VALUE`.
// Exit codes as kvc's: 0 success, 2 usage error, 3 invalid input (the message names the file), 70 internal error;
// outputs appear whole or not at all (staged, then committed together).
#include "eval/cli.hpp"

#include <CLI/CLI.hpp>
#include <cstdio>
#include <exception>
#include <memory>
#include <new>
#include <string>
#include <vector>

namespace {

using kvc::tools::exit_usage;
namespace cli = kvc::eval::cli;

/// One command: its CLI11 subcommand, its options and what runs it.
struct Command {
  CLI::App* app = nullptr;
  std::unique_ptr<cli::Options> options;
  int (*run)(cli::Options const&) = nullptr;
};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app("kvc-eval: what each KV cache compression policy costs and preserves on a real model (docs/eval.md).",
               "kvc-eval");
  app.footer(
      "Run `kvc-eval COMMAND --help` for a command's options. Exit codes: 0 success, 2 usage error, 3 invalid "
      "input\n(the message names the file), 70 internal error.");
  app.require_subcommand(1);
  struct Entry {
    char const* name;
    void (*declare)(cli::Options&);
    int (*run)(cli::Options const&);
  };
  Entry const entries[] = {{"run", cli::declare_run, cli::command_run},
                           {"logits", cli::declare_logits, cli::command_logits},
                           {"dump", cli::declare_dump, cli::command_dump},
                           {"correction", cli::declare_correction, cli::command_correction},
                           {"calibrate", cli::declare_calibrate, cli::command_calibrate}};
  std::vector<Command> commands;
  std::string names;
  for (Entry const& e : entries) {
    Command c;
    c.app = app.add_subcommand(e.name);
    c.app->allow_extras();  // unknown options are refused by Options::check, naming them
    c.options = std::make_unique<cli::Options>(*c.app);
    e.declare(*c.options);
    c.run = e.run;
    commands.push_back(std::move(c));
    names += names.empty() ? "" : ", ";
    names += e.name;
  }

  std::string const first = argc > 1 ? argv[1] : "";
  std::string prefix = "kvc-eval";  // "kvc-eval COMMAND" once the command is known
  Command const* chosen = nullptr;
  for (Command const& c : commands)
    if (c.app->get_name() == first) {
      chosen = &c;
      prefix += " " + first;
    }
  if (first == "help")  // `kvc-eval help` as `kvc-eval --help`
    return std::fputs(app.help().c_str(), stdout) < 0 ? 1 : 0;
  if (chosen == nullptr && !first.empty() && first[0] != '-') {
    std::fprintf(stderr, "kvc-eval: error: unknown command '%s' (expected %s; see kvc-eval --help)\n", first.c_str(),
                 names.c_str());
    return exit_usage;
  }
  try {
    try {
      app.parse(argc, argv);
    } catch (CLI::CallForHelp const&) {
      std::fputs(app.help().c_str(), stdout);  // the chosen command's help, named "kvc-eval COMMAND"
      return 0;
    } catch (CLI::ParseError const& e) {
      if (chosen == nullptr && first.empty()) {
        std::fprintf(stderr, "kvc-eval: error: missing command (expected %s)\n%s", names.c_str(), app.help().c_str());
        return exit_usage;
      }
      kvc::tools::fail(exit_usage, e.what());
    }
    if (chosen == nullptr)
      kvc::tools::fail(exit_usage, "missing command (expected " + names + ")");
    chosen->options->check();
    return chosen->run(*chosen->options);
  } catch (kvc::tools::Failure const& f) {
    std::fprintf(stderr, "%s: error: %s\n", prefix.c_str(), f.message.c_str());
    if (f.code == exit_usage)
      std::fprintf(stderr, "(run `%s --help` for the options)\n", prefix.c_str());
    return f.code;
  } catch (std::bad_alloc const&) {
    std::fprintf(stderr, "%s: error: out of memory\n", prefix.c_str());
    return kvc::tools::exit_invalid;
  } catch (std::exception const& e) {
    std::fprintf(stderr, "%s: internal error: %s\n", prefix.c_str(), e.what());
    return kvc::tools::exit_internal;
  }
}
