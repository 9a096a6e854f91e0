#pragma once
// <trun/store/dialect.h> in the source tree: the file itself is store/dialect.h (includes rooted
// at the repository), where the store's own headers include it from. Not installed: the install
// puts store/dialect.h itself at include/trun/store/dialect.h (worker_sdk/CMakeLists.txt).
#include "store/dialect.h"
