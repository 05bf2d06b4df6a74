#!/usr/bin/env bash
# Screenshots of the status page at 1280x800, for people to look at: the node view and
# alloc `web`'s view of an agent running deploy/examples (`token: none`, on a free
# loopback port, with a data dir of its own that is removed afterwards). Headless
# Chromium takes them once every example alloc has settled and web's checks pass.
# `scripts/ui-screenshots.sh [OUT_DIR]` writes OUT_DIR/ui-node.png and OUT_DIR/ui-alloc.png
# (default docs/); `make screenshots` builds the agent first.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-docs}
stead=${STEAD:-target/debug/stead}
chromium=${CHROMIUM:-/usr/bin/chromium}

work=$(mktemp -d)
agent=
cleanup() {
  if [ -n "$agent" ]; then
    kill -TERM "$agent" 2>/dev/null || true
    wait "$agent" 2>/dev/null || true
  fi
  rm -rf "$work"
}
trap cleanup EXIT

port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
cat >"$work/agent.yaml" <<YAML
specsDir: $PWD/deploy/examples
dataDir: $work/data
listen: 127.0.0.1:$port
token: none
allowRoot: true
shutdown: drain
YAML
"$stead" agent --config "$work/agent.yaml" >"$work/agent.log" 2>&1 &
agent=$!

# Settled: every example alloc listed, and none pending.
base=http://127.0.0.1:$port
for _ in $(seq 1 300); do
  if list=$(curl -fsS "$base/v1/allocs" 2>/dev/null) &&
    python3 -c 'import json, sys; items = json.load(sys.stdin); sys.exit(0 if len(items) >= 3 and all(i["clientStatus"] != "pending" for i in items) else 1)' <<<"$list"; then
    break
  fi
  sleep 0.2
done

# Until web's checks pass (its server takes a moment), for at most 20 s.
for _ in $(seq 1 100); do
  if curl -fsS "$base/v1/allocs/web" 2>/dev/null | python3 -c 'import json, sys; sys.exit(0 if json.load(sys.stdin).get("healthy") else 1)'; then
    break
  fi
  sleep 0.2
done
# A first measurement of what allocs use, so the page shows CPU over the second since.
curl -fsS "$base/v1/allocs?usage=true" >/dev/null
sleep 1.5

mkdir -p "$out"
shoot() {
  "$chromium" --headless --no-sandbox --disable-gpu --disable-dev-shm-usage --disable-quic \
    --no-first-run --disable-background-networking --disable-component-update --disable-sync \
    --user-data-dir="$work/profile" --hide-scrollbars --window-size=1280,800 \
    --virtual-time-budget=3000 --screenshot="$1" "$2" 2>>"$work/chromium.log"
}
shoot "$PWD/$out/ui-node.png" "$base/ui"
shoot "$PWD/$out/ui-alloc.png" "$base/ui/allocs/web"
echo "wrote $out/ui-node.png and $out/ui-alloc.png"
