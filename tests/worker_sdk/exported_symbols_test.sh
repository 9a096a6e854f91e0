#!/usr/bin/env bash
# libtrun_worker's dynamic symbol table holds the trun:: API and nothing else (trun/export.h,
# worker_sdk/libtrun_worker.map): no Asio, spdlog, fmt, Gloo, JSON or standard-library code that
# could interpose on another copy in the same process, no store implementation, no private
# implementation types. Lists every offending symbol.
# Usage: exported_symbols_test.sh <path of libtrun_worker.so>
set -euo pipefail
lib=$1

# "T trun::worker::init(...)": the type letter, then the demangled name.
symbols=$(nm -D --defined-only --demangle "$lib" | sed -E 's/^[0-9a-f]* *//')
count=$(grep -c . <<<"$symbols" || true)
echo "$lib: $count exported symbols"
fail=0

# The API must be there (an empty table would pass every check below).
for want in 'trun::worker::init(trun::worker::InitOptions const&)' \
  'trun::worker::ProcessGroup::allreduce(' 'typeinfo for trun::worker::CollectiveError' \
  'trun::worker::heartbeat()' 'trun::worker::Section::Section(char const*)'; do
  if ! grep -qF -- "$want" <<<"$symbols"; then
    echo "FAIL: not exported: $want"
    fail=1
  fi
done

# Anything outside trun:: (its functions, data, vtables and typeinfo).
outside=$(grep -vE '^[A-Za-z] ((typeinfo name for|typeinfo for|vtable for|VTT for) )?trun::' \
  <<<"$symbols" || true)
if [[ -n $outside ]]; then
  echo "FAIL: $(grep -c . <<<"$outside") exported symbols outside trun::"
  echo "$outside" | head -100
  fail=1
fi

# Inside trun::, nothing of the store's implementation (the public store headers are header-only)
# and none of the private nested types (TRUN_HIDDEN) or of worker_sdk/src's detail namespace,
# except the one function the inline trun::worker::record calls.
private=$(grep -E 'trun::store::|::(Impl|State|Block|Groups)::|trun::worker::detail::' \
  <<<"$symbols" | grep -vF 'trun::worker::detail::record_current_exception()' || true)
if [[ -n $private ]]; then
  echo "FAIL: $(grep -c . <<<"$private") private trun:: symbols exported"
  echo "$private" | head -100
  fail=1
fi

if [[ $fail == 0 ]]; then
  echo "PASS: only the trun:: API is exported"
fi
exit $fail
