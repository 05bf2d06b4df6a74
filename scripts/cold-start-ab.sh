#!/usr/bin/env bash
# Compares the 10-task cold start of two or more builds, alternating them start by start
# so that they share the machine's moods: `scripts/cold-start-ab.sh ROUNDS DIR...`, each
# DIR holding a release `stead` and `stead-supervisor` (scripts/build-release.sh).
#
# Each start: a new data dir, ten `sleep` specs (those of `stead-bench peers`, written
# more than RACY_MARGIN before), `stead agent` started directly and stopped with SIGTERM
# (drain) 150 ms later. The times come from the kernel's `sched:sched_process_exec`
# tracepoint (`perf record -a`, which needs root or a permissive
# `kernel.perf_event_paranoid`): from the agent's exec to its first and to its tenth
# task's exec. Prints, per build, the median and quartiles of both.
set -euo pipefail

rounds=${1:?usage: scripts/cold-start-ab.sh ROUNDS DIR...}
shift
[ $# -gt 0 ] || { echo "usage: scripts/cold-start-ab.sh ROUNDS DIR..." >&2; exit 2; }
command -v perf >/dev/null || { echo "cold-start-ab: needs perf" >&2; exit 1; }
sleep_bin=$(command -v sleep)
dirs=()
for dir in "$@"; do
  dir=$(cd "$dir" && pwd)
  [ -x "$dir/stead" ] && [ -x "$dir/stead-supervisor" ] ||
    { echo "cold-start-ab: $dir has no stead and stead-supervisor" >&2; exit 1; }
  dirs+=("$dir")
done

base=$(mktemp -d "${TMPDIR:-/tmp}/stead-cold-start-ab.XXXXXX")
trace=$base/exec.data
trap 'rm -rf "$base"' EXIT
mkdir "$base/specs"
for i in $(seq 0 9); do
  cat >"$base/specs/t$i.yaml" <<EOF
apiVersion: stead/v1
kind: Alloc
metadata: {name: t$i}
spec:
  restart: {attempts: 100000, interval: 24h, delay: 0s, mode: fail}
  tasks:
    - name: main
      driver: exec
      config: {command: "$sleep_bin", args: ["100000$i"]}
      killSignal: SIGTERM
      killTimeout: 5s
EOF
done
port=$(( 40000 + RANDOM % 20000 ))
cat >"$base/agent.yaml" <<EOF
specsDir: $base/specs
dataDir: $base/data
listen: 127.0.0.1:$port
shutdown: drain
allowRoot: true
drivers: {mock: {enabled: false}}
logFormat: json
EOF
# Older than the listing's racy margin, as a deployed spec is.
sleep 3

starts() {
  local round dir pid
  for round in $(seq "$rounds"); do
    for dir in "${dirs[@]}"; do
      rm -rf "$base/data"
      cat "$dir/stead" "$dir/stead-supervisor" "$sleep_bin" >/dev/null
      "$dir/stead" agent --config "$base/agent.yaml" 2>/dev/null &
      pid=$!
      # Not `sleep`: its exec would count as a task's.
      read -r -t 0.15 <> <(:) || true
      kill -TERM "$pid"
      wait "$pid" || true
    done
  done
}
export -f starts
export rounds base sleep_bin
export DIRS="${dirs[*]}"
perf record -q -a -e sched:sched_process_exec -o "$trace" -- \
  bash -c 'read -r -a dirs <<<"$DIRS"; starts' >/dev/null 2>&1

# Per agent exec: its build's directory and the times to its first and its tenth
# `sleep` exec.
perf script -i "$trace" -F time,trace 2>/dev/null |
  awk -v sleep_bin="$sleep_bin" '
    match($0, /filename=[^ ]+/) {
      time = $1; sub(/:$/, "", time)
      file = substr($0, RSTART + 9, RLENGTH - 9)
      if (file ~ /\/stead$/) { agent = time; dir = file; sub(/\/stead$/, "", dir); seen = 0 }
      else if (file == sleep_bin && agent != "") {
        seen++
        if (seen == 1) first = (time - agent) * 1000
        if (seen == 10) { printf "%s %.3f %.3f\n", dir, first, (time - agent) * 1000; agent = "" }
      }
    }' >"$base/times"

# The median and quartiles of the numbers on stdin.
quantiles() {
  sort -n | awk '{ v[NR] = $1 } END {
    if (NR) printf "%.2f ms (quartiles %.2f-%.2f)", v[int(NR / 2) + 1], v[int(NR / 4) + 1], v[int(NR * 3 / 4) + 1] }'
}
for dir in "${dirs[@]}"; do
  count=$(awk -v d="$dir" '$1 == d' "$base/times" | wc -l)
  tenth=$(awk -v d="$dir" '$1 == d { print $3 }' "$base/times" | quantiles)
  first=$(awk -v d="$dir" '$1 == d { print $2 }' "$base/times" | quantiles)
  echo "$dir: $count starts; tenth task $tenth; first task $first"
done
