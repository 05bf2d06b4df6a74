#!/usr/bin/env bash
# Installs the peers `stead-bench peers` measures stead against, when missing:
# supervisord from Debian's `supervisor` package (apt-get, with sudo when not root) and
# pm2 from npm, into target/bench-deps (no global install). Safe to run repeatedly.
# Prints nothing when both are present.
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
sudo=()
[ "$(id -u)" -eq 0 ] || sudo=(sudo)

if ! command -v supervisord >/dev/null 2>&1; then
  if ! command -v apt-get >/dev/null 2>&1; then
    echo "install-bench-deps: supervisord is missing, and no apt-get to install it" >&2
    exit 1
  fi
  echo "install-bench-deps: installing supervisor (Debian package)" >&2
  "${sudo[@]}" apt-get update -qq
  # The package's own service is not needed: the benchmark runs
  # supervisord with a generated config of its own.
  DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq --no-install-recommends supervisor
fi

prefix="$root/target/bench-deps"
if ! command -v pm2 >/dev/null 2>&1 && [ ! -x "$prefix/node_modules/.bin/pm2" ]; then
  if ! command -v npm >/dev/null 2>&1; then
    if ! command -v apt-get >/dev/null 2>&1; then
      echo "install-bench-deps: npm is missing, and no apt-get to install it" >&2
      exit 1
    fi
    echo "install-bench-deps: installing npm (Debian package)" >&2
    "${sudo[@]}" apt-get update -qq
    DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq --no-install-recommends npm
  fi
  echo "install-bench-deps: installing pm2 (npm) into target/bench-deps" >&2
  mkdir -p "$prefix"
  npm install --prefix "$prefix" --no-audit --no-fund --loglevel=error pm2
fi
