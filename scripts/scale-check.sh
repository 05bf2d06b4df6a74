#!/usr/bin/env bash
# Issue 36's exec figures on a large node, in one short run:
# `scripts/scale-check.sh DIST_DIR OUT_DIR [TASKS] [ROUNDS]`, as root (DIST_DIR holds
# `stead-bench` and `stead-supervisor`, from
# `scripts/build-release.sh DIST_DIR stead-supervisor stead-bench`; TASKS defaults to
# 10,000; ROUNDS, the rounds each start is measured over, to 1). It raises the
# open-files limit and `pid_max` to fit TASKS, then writes into OUT_DIR:
#   machine.txt   cores, memory, kernel, the cgroup mount and the file system of the
#                 data dir, the limits it ran under;
#   exec.txt      `stead-bench exec TASKS 5 ROUNDS`: the bare loop, the loop with a
#                 cgroup per process, stead's start, reattach after a restart, and
#                 drain, with the CPU each start and stop costs.
# The data dirs go on the disk under /var/tmp (not a tmpfs), as an agent's do.
set -uo pipefail

usage='usage: scripts/scale-check.sh DIST_DIR OUT_DIR [TASKS] [ROUNDS]'
dist=${1:?$usage}
out=${2:?$usage}
tasks=${3:-10000}
rounds=${4:-1}
case $dist in /*) ;; *) dist=$PWD/$dist ;; esac
mkdir -p "$out"
work=$(mktemp -d /var/tmp/stead-scale.XXXXXX)
trap 'rm -rf "$work"' EXIT

# Each task holds a descriptor in the agent, and runs as two processes (its supervisor
# and itself); the bench keeps the bare loop's children too.
ulimit -n "$(ulimit -Hn)" 2>/dev/null || true
pid_max=$(cat /proc/sys/kernel/pid_max)
if [ "$pid_max" -lt $((tasks * 4)) ]; then
  echo $((tasks * 4 > 4194304 ? 4194304 : tasks * 4)) >/proc/sys/kernel/pid_max 2>/dev/null || true
fi

{
  echo "cores: $(nproc)"
  grep -E '^(MemTotal|MemAvailable)' /proc/meminfo
  echo "kernel: $(uname -r)"
  echo "cgroup mounts:"
  grep cgroup /proc/self/mounts
  echo "own cgroup: $(cat /proc/self/cgroup | tr '\n' ' ')"
  echo "data dir file system: $(stat -f -c %T "$work")"
  echo "open files: $(ulimit -n) (hard $(ulimit -Hn))"
  echo "pid_max: $(cat /proc/sys/kernel/pid_max)"
  echo "load: $(cat /proc/loadavg)"
} >"$out/machine.txt" 2>&1

TMPDIR=$work STEAD_SUPERVISOR=$dist/stead-supervisor \
  "$dist/stead-bench" exec "$tasks" 5 "$rounds" >"$out/exec.txt" 2>&1
status=$?
cat "$out/machine.txt" "$out/exec.txt"
exit $status
