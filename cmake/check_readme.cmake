# SPDX-License-Identifier: Apache-2.0
# cmake -DREADME=README.md -DSOURCE=examples/00_readme/main.cpp -P check_readme.cmake
# Fails unless the README contains, verbatim, the source lines between "// example-begin readme" and
# "// example-end readme" (so the usage example users read is the one CI compiles and runs).
if(NOT DEFINED MARKER)
  set(MARKER readme)
endif()
file(READ ${SOURCE} source)
string(REGEX MATCH "// example-begin ${MARKER}\n(.*)// example-end ${MARKER}" _ "${source}")
set(snippet "${CMAKE_MATCH_1}")
if(snippet STREQUAL "")
  message(FATAL_ERROR "${SOURCE}: no example-begin/example-end readme markers")
endif()
file(READ ${README} readme)
string(FIND "${readme}" "${snippet}" at)
if(at EQUAL -1)
  message(FATAL_ERROR "${README} does not contain the code of ${SOURCE} between its markers; copy it over")
endif()
message(STATUS "README usage example matches ${SOURCE}")
