#!/usr/bin/env bash
# Builds stead's shipped binaries into one directory, where the agent finds its
# supervisor: `scripts/build-release.sh OUT_DIR [PACKAGE...]`. The packages default to
# stead-controller (the `stead` binary) and stead-supervisor; the benchmarks add
# stead-bench. STEAD_BUILD_PROFILE picks another cargo profile (default: release).
#
# The supervisor is a freestanding static executable: no C library, no `std`, no program
# interpreter (its runtime is supervisor/src/main.rs, its link arguments
# supervisor/build.rs). One supervisor runs per task, forked from the fork server, and
# with nothing but its own code mapped each one faults in few pages (docs/decisions/0037
# has the figures). That runtime is Linux on x86_64 only; it builds with its `runtime`
# feature and `-C panic=abort` (it has no unwinder) on that one crate: `cargo rustc`
# passes the flag to it alone, whatever RUSTFLAGS or a config's rustflags say, and the
# workspace's other builds stay as they are. On any other architecture the same
# supervisor code ships on the standard library's runtime instead: the binary the exec
# tests run (`stead-test-supervisor`), installed as `stead-supervisor`. STEAD_REQUIRE_STATIC is accepted and no
# longer changes anything: the supervisor is static or the build fails. The agent stays
# dynamically linked: a `listen` host name goes through glibc's NSS, which a static
# binary cannot load reliably.
set -euo pipefail

out=${1:?usage: scripts/build-release.sh OUT_DIR [PACKAGE...]}
shift
case $out in /*) ;; *) out=$PWD/$out ;; esac
packages=("$@")
[ ${#packages[@]} -gt 0 ] || packages=(stead-controller stead-supervisor)
# CARGO and RUSTC may carry arguments (`cargo +1.95`).
read -r -a cargo <<<"${CARGO:-cargo}"
read -r -a rustc <<<"${RUSTC:-rustc}"
cd "$(dirname "$0")/.."

profile=${STEAD_BUILD_PROFILE:-release}
case $profile in
  dev | test) profile_dir=debug ;;
  bench) profile_dir=release ;;
  *) profile_dir=$profile ;;
esac
host=$("${rustc[@]}" -vV | sed -n 's/^host: //p')
# Where cargo writes, whichever setting chose it (environment or config file).
target_dir=$("${cargo[@]}" metadata --format-version 1 --no-deps --offline |
  sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')
[ -n "$target_dir" ] || { echo "build-release: no target directory from cargo metadata" >&2; exit 1; }
# An explicit --target (the host) for every build: the output directory does not depend
# on a `build.target` setting, and target flags stay off build scripts and proc macros.
built=$target_dir/$host/$profile_dir

selected=()
binaries=()
supervisor=false
for package in "${packages[@]}"; do
  case $package in
    stead-controller) binaries+=("$built/stead") ;;
    stead-bench) binaries+=("$built/stead-bench") ;;
    stead-supervisor) binaries+=("$built/stead-supervisor") ;;
    *)
      echo "build-release: unknown package $package" >&2
      exit 2
      ;;
  esac
  if [[ $package == stead-supervisor ]]; then
    supervisor=true
  else
    selected+=(-p "$package")
  fi
done

if [ ${#selected[@]} -gt 0 ]; then
  "${cargo[@]}" build --locked --profile "$profile" --target "$host" "${selected[@]}"
fi
std_supervisor=false
if $supervisor && [[ $host != x86_64-*-linux-* ]]; then
  std_supervisor=true
  "${cargo[@]}" build --locked --profile "$profile" --target "$host" \
    -p stead-tests --bin stead-test-supervisor
elif $supervisor; then
  "${cargo[@]}" rustc --locked --profile "$profile" --target "$host" \
    -p stead-supervisor --bin stead-supervisor --features runtime -- -C panic=abort
  if LC_ALL=C readelf --program-headers --wide "$built/stead-supervisor" 2>/dev/null |
    grep -q 'INTERP'; then
    echo "build-release: $built/stead-supervisor came out dynamically linked" >&2
    exit 1
  fi
fi
mkdir -p "$out"
for binary in "${binaries[@]}"; do
  if $std_supervisor && [[ $binary == "$built/stead-supervisor" ]]; then
    install -m 0755 "$built/stead-test-supervisor" "$out/stead-supervisor"
  else
    install -m 0755 "$binary" "$out/"
  fi
done
