// SPDX-License-Identifier: Apache-2.0
// tools/kvc/cli.hpp: the `kvc` command-line tool as a function, so that the program and the whole-path fuzzer
// (tools/fuzz/cli_fuzz.cpp) run the same code.
#pragma once

#include <cstdio>

namespace kvc::cli {

/// Runs `kvc argv[1] ...` (argv[0] is ignored), printing to `out` and `err`. Returns the exit code: 0 success,
/// 2 usage error, 3 invalid input. Never throws.
int run(int argc, char const* const* argv, std::FILE* out, std::FILE* err);

}  // namespace kvc::cli
