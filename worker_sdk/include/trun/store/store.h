#pragma once
// <trun/store/store.h> in the source tree: the file itself is store/store.h (includes rooted
// at the repository), where the store's own headers include it from. Not installed: the install
// puts store/store.h itself at include/trun/store/store.h (worker_sdk/CMakeLists.txt).
#include "store/store.h"
