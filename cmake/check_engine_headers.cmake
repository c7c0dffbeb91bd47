# SPDX-License-Identifier: Apache-2.0
# cmake -DDIR=<prefix>/include/kvc [-DMIN_HEADERS=n] -P check_engine_headers.cmake: the installed library is the
# engine library. It holds at least MIN_HEADERS headers (default 50: an empty or misplaced tree is an error, not a
# pass) and no file parser: no header named after a file format (npy, safetensors, json) or under an io/ folder, and
# none that opens files (fopen, <fstream>, POSIX open/mmap). The parsers live in tools/io, for the tools.
if(NOT DEFINED MIN_HEADERS)
  set(MIN_HEADERS 50)
endif()
file(GLOB_RECURSE headers LIST_DIRECTORIES false RELATIVE ${DIR} ${DIR}/*.hpp ${DIR}/*.cuh ${DIR}/*.h)
list(LENGTH headers count)
if(count LESS MIN_HEADERS)
  message(FATAL_ERROR "${DIR}: ${count} headers, expected at least ${MIN_HEADERS}: is this an installed include/kvc?")
endif()
set(offending "")
foreach(h IN LISTS headers)
  if(h MATCHES "(^|/)io/|npy|safetensors|json")
    list(APPEND offending "${h} (a file format's name)")
    continue()
  endif()
  file(STRINGS ${DIR}/${h} hits REGEX "fopen *\\(|# *include *<(fstream|fcntl.h|sys/mman.h)>|(^|[^a-z_])mmap *\\(")
  if(hits)
    list(APPEND offending "${h} (opens files)")
  endif()
endforeach()
if(offending)
  list(JOIN offending "\n  " text)
  message(FATAL_ERROR "file parser headers in the engine library (${DIR}):\n  ${text}")
endif()
message(STATUS "${count} engine headers, no file parser")
