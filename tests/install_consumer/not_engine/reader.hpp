// SPDX-License-Identifier: Apache-2.0
// tests/install_consumer/not_engine/reader.hpp: a header that opens files, for the check that the installed engine
// library holds none (cmake/check_engine_headers.cmake must refuse this folder: ctest kvc.install.engine_headers_*).
#pragma once

#include <fstream>
