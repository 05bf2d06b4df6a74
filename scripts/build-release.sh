#!/usr/bin/env bash
# Builds stead's shipped binaries into one directory, where the agent finds its
# supervisor: `scripts/build-release.sh OUT_DIR [PACKAGE...]`. The packages default to
# stead-controller (the `stead` binary) and stead-supervisor; the benchmarks add
# stead-bench. STEAD_BUILD_PROFILE picks another cargo profile (default: release).
#
# On GNU/Linux the supervisor is linked static-pie, against glibc's own libc.a: one
# supervisor runs per task, forked from the fork server, and without libc.so and the
# dynamic loader mapped in every one of them a fork copies fewer mappings and a
# supervisor faults in fewer pages (docs/BENCHMARKS.md: about 10 % off a cold start,
# 50 KiB less private memory a task). It calls nothing of glibc's that loads modules
# at run time (no user or host name lookups). The agent stays dynamically linked:
# it resolves a `listen` host name through glibc's NSS, which a static binary cannot
# load reliably. Without libc.a the supervisor is linked dynamically, with a warning.
set -euo pipefail
cd "$(dirname "$0")/.."

out=${1:?usage: scripts/build-release.sh OUT_DIR [PACKAGE...]}
shift
packages=("$@")
[ ${#packages[@]} -gt 0 ] || packages=(stead-controller stead-supervisor)

cargo=${CARGO:-cargo}
profile=${STEAD_BUILD_PROFILE:-release}
case $profile in
  dev | test) profile_dir=debug ;;
  bench) profile_dir=release ;;
  *) profile_dir=$profile ;;
esac
target_dir=${CARGO_TARGET_DIR:-target}
host=$("${RUSTC:-rustc}" -vV | sed -n 's/^host: //p')

binaries=()
others=()
static_supervisor=false
for package in "${packages[@]}"; do
  case $package in
    stead-controller) binaries+=("$target_dir/$profile_dir/stead"); others+=(-p "$package") ;;
    stead-bench) binaries+=("$target_dir/$profile_dir/stead-bench"); others+=(-p "$package") ;;
    stead-supervisor)
      libc_archive=$("${CC:-cc}" -print-file-name=libc.a 2>/dev/null || true)
      if [[ $host == *-linux-gnu* && $libc_archive == /* && -f $libc_archive ]]; then
        static_supervisor=true
        binaries+=("$target_dir/$host/$profile_dir/stead-supervisor")
      else
        echo "build-release: no glibc libc.a for $host; the supervisor is linked dynamically" >&2
        binaries+=("$target_dir/$profile_dir/stead-supervisor")
        others+=(-p "$package")
      fi
      ;;
    *)
      echo "build-release: unknown package $package" >&2
      exit 2
      ;;
  esac
done

if [ ${#others[@]} -gt 0 ]; then
  "$cargo" build --locked --profile "$profile" "${others[@]}"
fi
if $static_supervisor; then
  # An explicit --target keeps the flag off build scripts and proc macros, which must
  # stay dynamic; the static build has a directory of its own below the target dir.
  RUSTFLAGS="${RUSTFLAGS:+$RUSTFLAGS }-C target-feature=+crt-static" \
    "$cargo" build --locked --profile "$profile" --target "$host" -p stead-supervisor
fi
install -d "$out"
install -m 0755 -t "$out" "${binaries[@]}"
