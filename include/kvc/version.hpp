// SPDX-License-Identifier: Apache-2.0
// kvc/version.hpp: library version; a ctest case checks it equals project(VERSION) in CMakeLists.txt.
#pragma once

#define KVC_VERSION_MAJOR 0
#define KVC_VERSION_MINOR 1
#define KVC_VERSION_PATCH 0
