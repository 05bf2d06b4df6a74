#!/usr/bin/env bash
# Builds stead's shipped binaries into one directory, where the agent finds its
# supervisor: `scripts/build-release.sh OUT_DIR [PACKAGE...]`. The packages default to
# stead-controller (the `stead` binary) and stead-supervisor; the benchmarks add
# stead-bench. STEAD_BUILD_PROFILE picks another cargo profile (default: release).
#
# On GNU/Linux the supervisor is linked static (static-pie where the target has it)
# against glibc's own libc.a: one supervisor runs per task, forked from the fork server,
# and without libc.so and the dynamic loader mapped in each of them a fork copies fewer
# mappings and a supervisor faults in fewer pages (ARCHITECTURE.md has the figures). It
# calls nothing of glibc's that loads modules at run time (no user or host name
# lookups). The agent stays dynamically linked: a `listen` host name goes through
# glibc's NSS, which a static binary cannot load reliably. Without libc.a the supervisor
# is linked dynamically, with a warning; STEAD_REQUIRE_STATIC=1 makes that an error.
set -euo pipefail

out=${1:?usage: scripts/build-release.sh OUT_DIR [PACKAGE...]}
shift
case $out in /*) ;; *) out=$PWD/$out ;; esac
packages=("$@")
[ ${#packages[@]} -gt 0 ] || packages=(stead-controller stead-supervisor)
# CARGO, RUSTC and CC may carry arguments (`cargo +1.95`, `ccache gcc`).
read -r -a cargo <<<"${CARGO:-cargo}"
read -r -a rustc <<<"${RUSTC:-rustc}"
read -r -a cc <<<"${CC:-cc}"
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

static=false
if [[ " ${packages[*]} " == *" stead-supervisor "* ]]; then
  libc_archive=$("${cc[@]}" -print-file-name=libc.a 2>/dev/null || true)
  if [[ $host == *-linux-gnu* && $libc_archive == /* && -f $libc_archive ]]; then
    static=true
  else
    case $host in
      *-linux-gnu*) reason="${cc[*]} finds no libc.a (Debian: libc6-dev)" ;;
      *) reason="static linking against glibc applies to GNU/Linux hosts, not $host" ;;
    esac
    if [ "${STEAD_REQUIRE_STATIC:-}" = 1 ]; then
      echo "build-release: STEAD_REQUIRE_STATIC=1, but $reason" >&2
      exit 1
    fi
    echo "build-release: the supervisor is linked dynamically: $reason" >&2
  fi
fi

selected=()
binaries=()
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
  if [[ $package != stead-supervisor ]] || ! $static; then
    selected+=(-p "$package")
  fi
done

if [ ${#selected[@]} -gt 0 ]; then
  "${cargo[@]}" build --locked --profile "$profile" --target "$host" "${selected[@]}"
fi
if $static; then
  # The flag on the binary's own link only: `cargo rustc` passes it to that one crate,
  # whatever RUSTFLAGS, CARGO_ENCODED_RUSTFLAGS or a config's rustflags say.
  "${cargo[@]}" rustc --locked --profile "$profile" --target "$host" \
    -p stead-supervisor --bin stead-supervisor -- -C target-feature=+crt-static
  if LC_ALL=C readelf --program-headers --wide "$built/stead-supervisor" 2>/dev/null |
    grep -q 'INTERP'; then
    echo "build-release: $built/stead-supervisor came out dynamically linked" >&2
    exit 1
  fi
fi
mkdir -p "$out"
install -m 0755 "${binaries[@]}" "$out/"
