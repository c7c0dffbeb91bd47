// SPDX-License-Identifier: Apache-2.0
// tools/kvc/main.cpp: the `kvc` program (the tool itself is kvc::cli::run, tools/kvc/cli.cpp).
#include "cli.hpp"

#include <csignal>
#include <cstdio>

int main(int argc, char** argv) {
  // A write past a file size limit (ulimit -f) then fails with EFBIG and is reported, instead of killing the tool.
  std::signal(SIGXFSZ, SIG_IGN);
  return kvc::cli::run(argc, argv, stdout, stderr);
}
