#!/usr/bin/env bash
# Installs the Debian packages that building and testing stead need, when missing.
# Uses sudo when not root. Safe to run repeatedly: it does nothing when all are present.
set -euo pipefail

# gcc/libc6-dev: the linker and C runtime for rustc and crates that build C;
# g++: RocksDB's C++ sources; libclang-dev: bindgen, for RocksDB's bindings;
# pkg-config: locating system libraries from build scripts; protobuf-compiler: `protoc`,
# which etcd-client's build compiles the etcd API with; libprotobuf-dev: the well-known
# types (`google/protobuf/descriptor.proto`) that API imports, which protoc does not ship
# without its recommended packages; etcd-server: the real etcd the
# fleet tests start a three-member cluster of; procps: the `kill`
# program the tests signal processes with; prometheus: `promtool`, which the metrics
# tests lint the Prometheus text format with; python3-prometheus-client: the reference
# OpenMetrics parser, which they check the OpenMetrics format with (promtool reads only
# the Prometheus text format); chromium and chromium-driver: the headless browser and
# its WebDriver server, which the status page's tests drive.
packages=(gcc g++ libc6-dev libclang-dev pkg-config protobuf-compiler libprotobuf-dev etcd-server procps prometheus python3-prometheus-client chromium chromium-driver)

missing=()
for package in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q 'install ok installed'; then
    missing+=("$package")
  fi
done
[ ${#missing[@]} -eq 0 ] && exit 0

if ! command -v apt-get >/dev/null 2>&1; then
  echo "install-deps: missing packages ${missing[*]}, and no apt-get to install them" >&2
  exit 1
fi
sudo=()
[ "$(id -u)" -eq 0 ] || sudo=(sudo)
echo "install-deps: installing ${missing[*]}" >&2
"${sudo[@]}" apt-get update -qq
DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
