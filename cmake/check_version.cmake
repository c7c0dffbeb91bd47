# SPDX-License-Identifier: Apache-2.0
# cmake -DHEADER=include/kvc/version.hpp -DVERSION=x.y.z -P check_version.cmake: the header's macros equal VERSION.
file(STRINGS ${HEADER} lines REGEX "#define KVC_VERSION_(MAJOR|MINOR|PATCH) ")
set(parts "")
foreach(l IN LISTS lines)
  string(REGEX REPLACE ".* ([0-9]+)$" "\\1" n "${l}")
  list(APPEND parts ${n})
endforeach()
list(JOIN parts "." header_version)
if(NOT header_version STREQUAL VERSION)
  message(FATAL_ERROR "version.hpp says ${header_version}, CMakeLists.txt project(VERSION) says ${VERSION}")
endif()
message(STATUS "version ${VERSION} consistent")
