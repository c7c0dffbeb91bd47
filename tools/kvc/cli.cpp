// SPDX-License-Identifier: Apache-2.0
// tools/kvc/cli.cpp: the `kvc` command-line tool: score and compress .npy or .safetensors KV dumps with any kvc
// policy.
// Contract (docs/cli.md, DESIGN.md §6): exit 0 success, 2 usage error, 3 invalid input (the message names the file,
// the field and what was expected). Every policy is one row of policies() and one branch of with_policy().
// Files are untrusted (docs/cli.md "Untrusted input"): inputs must be regular files whose sizes bound every
// allocation; outputs are staged beside their destination and renamed into place only when all of them are whole.
// The commands are in score.cpp, compress.cpp (compress_job.cpp, compress_packed.cpp), attend.cpp and
// policies.cpp; what they share in internal.hpp.
#include "cli.hpp"

#include "internal.hpp"

#include <cstdio>
#include <exception>
#include <new>
#include <stdexcept>
#include <string_view>

namespace kvc::cli {

Streams io;

int run(int argc, char const* const* argv, std::FILE* out, std::FILE* err) {
  io = {out, err};
  CommandInfo const* command = nullptr;
  try {
    Options const o = parse_args(argc, argv);
    command = o.command;
    if (o.help) {
      std::fputs(o.command ? help_text(*o.command).c_str() : overview_text, io.out);
      return 0;
    }
    std::string_view const name = o.command->name;
    if (name == "score")
      return cmd_score(o);
    if (name == "compress")
      return cmd_compress(o);
    if (name == "attend")
      return cmd_attend(o);
    return cmd_policies();
  } catch (Failure const& f) {
    std::fprintf(io.err, "kvc: error: %s\n", f.message.c_str());
    if (f.code == exit_usage) {
      if (command == nullptr && argc > 1)
        command = find_command(argv[1]);
      if (command)
        std::fprintf(io.err, "%sRun `kvc %s --help` for the options.\n", command->synopsis, command->name);
      else
        std::fputs(overview_text, io.err);
    }
    return f.code;
  } catch (std::bad_alloc const&) {  // every large buffer is named by buffer(); this is a last resort
    std::fprintf(io.err, "kvc: error: out of memory\n");
    return exit_invalid;
  } catch (std::logic_error const& e) {  // a bug in kvc, not in the input: its own exit code (the fuzzer stops)
    std::fprintf(io.err, "kvc: internal error: %s\n", e.what());
    return exit_internal;
  } catch (std::exception const& e) {
    std::fprintf(io.err, "kvc: error: %s\n", e.what());
    return exit_invalid;
  }
}

}  // namespace kvc::cli
