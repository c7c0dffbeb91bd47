// SPDX-License-Identifier: Apache-2.0
// tools/fuzz/npy_fuzz.cpp: libFuzzer harness for the .npy parser (files are untrusted input).
//   cmake -DCMAKE_CXX_COMPILER=clang++ -DKVC_BUILD_FUZZERS=ON ... && ./tools/kvc_npy_fuzz -max_total_time=60

#include "io/npy.hpp"

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <span>
#include <string>

extern "C" int LLVMFuzzerTestOneInput(std::uint8_t const* data, std::size_t size) {
  kvc::NpyArray a;
  std::string error;
  if (kvc::parse_npy(std::span(reinterpret_cast<std::byte const*>(data), size), a, error)) {
    // An accepted file is self-consistent: the data is exactly shape-product * itemsize bytes.
    if (static_cast<kvc::Index>(a.data.size()) != a.size() * kvc::npy_itemsize(a.dtype))
      std::abort();
  } else if (error.empty()) {
    std::abort();  // every rejection says why
  }
  return 0;
}
