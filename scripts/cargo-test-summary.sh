#!/usr/bin/env bash
# Runs `cargo test` with the given arguments, then prints one closing line that totals
# every test binary ("tests: N passed, M failed"), so the last line of a run speaks for
# the whole suite rather than for whichever binary happened to run last.
set -uo pipefail
log=$(mktemp)
trap 'rm -f "$log"' EXIT
cargo test "$@" 2>&1 | tee "$log"
status=${PIPESTATUS[0]}
read -r passed failed < <(awk '/^test result:/ { for (i = 1; i <= NF; i++) { if ($(i) ~ /^passed/) p += $(i - 1); if ($(i) ~ /^failed/) f += $(i - 1) } } END { print p + 0, f + 0 }' "$log")
echo
echo "tests: ${passed} passed, ${failed} failed"
exit "$status"
