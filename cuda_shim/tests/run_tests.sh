#!/bin/sh
# Run every C test with the shim preloaded (all must pass), then the negative
# control without it (all must fail: each test detects a missing shim).
# Usage: sh tests/run_tests.sh <build dir>
B=${1:-build}
T=$B/tests/shim_tests
TIMEOUT=${DILU_SHIM_TEST_TIMEOUT:-120}
fail=0
for t in $(LD_LIBRARY_PATH="$B/fake" $T --list); do
    if env LD_LIBRARY_PATH="$B/fake" LD_PRELOAD="$B/libdilu_shim.so" timeout "$TIMEOUT" "$T" "$t"; then
        :
    else
        echo "FAILED with the shim: $t"
        fail=1
    fi
done
for t in $(LD_LIBRARY_PATH="$B/fake" $T --list); do
    if env LD_LIBRARY_PATH="$B/fake" timeout "$TIMEOUT" "$T" "$t" >/dev/null 2>&1; then
        echo "negative control: $t passed without the shim"
        fail=1
    fi
done
if [ $fail -eq 0 ]; then echo "all C tests passed; all failed without the shim"; fi
exit $fail
