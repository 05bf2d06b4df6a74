#!/usr/bin/env bash
# The `nvidia` device plugin on a real NVIDIA GPU, through the release agent:
# `scripts/gpu-check.sh DIST_DIR OUT_DIR`, as root on a host with the driver and one or
# more GPUs (DIST_DIR holds `stead` and `stead-supervisor`, from
# `scripts/build-release.sh DIST_DIR`). It starts the agent with the plugin on and two
# allocs that each ask for one GPU, and writes what it saw into OUT_DIR:
#   node.txt, node.json   `stead node status` and GET /v1/node: the GPUs, by UUID, with
#                         their memory, health and holder;
#   gpu-a.txt, gpu-a.log  the first alloc's status and its task's output: the
#                         CUDA_VISIBLE_DEVICES it got and the devices CUDA shows it;
#   gpu-a-stats.json      its stats while it multiplies matrices: utilisation, memory;
#   gpu-b.txt             the second alloc's status (on a one-GPU host: pending, waiting
#                         for a GPU, with the reason).
# It exits non-zero when a check fails, after writing everything it could.
set -uo pipefail

dist=${1:?usage: scripts/gpu-check.sh DIST_DIR OUT_DIR}
out=${2:?usage: scripts/gpu-check.sh DIST_DIR OUT_DIR}
case $dist in /*) ;; *) dist=$PWD/$dist ;; esac
mkdir -p "$out"
work=$(mktemp -d /tmp/stead-gpu.XXXXXX)
mkdir -p "$work/specs" "$work/data"
port=47646
python=$(command -v python3)
failed=0
fail() {
  echo "FAILED: $*" | tee -a "$out/checks.txt"
  failed=1
}
pass() { echo "ok: $*" | tee -a "$out/checks.txt"; }

# NVML by name as the loader finds it, or where the driver was mounted.
nvidia="{cleanPeriod: 1m}"
if ! ldconfig -p 2>/dev/null | grep -q 'libnvidia-ml\.so\.1 '; then
  lib=$(find /usr/local/nvidia /usr/lib /usr/lib64 /lib -name libnvidia-ml.so.1 2>/dev/null | head -1)
  [ -z "$lib" ] || nvidia="{cleanPeriod: 1m, library: $lib}"
fi
echo "nvidia plugin: $nvidia" | tee -a "$out/checks.txt"
cat >"$work/agent.yaml" <<EOF
specsDir: $work/specs
dataDir: $work/data
listen: 127.0.0.1:$port
allowRoot: true
logFormat: text
devices:
  nvidia: $nvidia
EOF

# A task that prints what it was given and what CUDA shows it, then keeps its GPU busy
# for a minute so the stats have something to show.
probe=$(
  cat <<'EOF'
import os, time
print("CUDA_VISIBLE_DEVICES=" + os.environ.get("CUDA_VISIBLE_DEVICES", ""), flush=True)
print("NVIDIA_VISIBLE_DEVICES=" + os.environ.get("NVIDIA_VISIBLE_DEVICES", ""), flush=True)
import torch
n = torch.cuda.device_count()
print("cuda device count:", n, flush=True)
for i in range(n):
    p = torch.cuda.get_device_properties(i)
    print("cuda device", i, p.name, "GPU-" + str(p.uuid), flush=True)
x = torch.rand(8192, 8192, device="cuda")
print("busy", flush=True)
end = time.time() + 60
while time.time() < end:
    y = x @ x
    torch.cuda.synchronize()
EOF
)
for name in gpu-a gpu-b; do
  cat >"$work/$name.yaml" <<EOF
apiVersion: stead/v1
kind: Alloc
metadata: {name: $name}
spec:
  restart: {attempts: 0, mode: fail}
  tasks:
    - name: main
      driver: exec
      config:
        command: $python
        args: [-c, $(printf '%s' "$probe" | python3 -c 'import json,sys; print(json.dumps(sys.stdin.read()))')]
      resources: {devices: [{name: nvidia/gpu}]}
EOF
done
# The second alloc is declared once the first holds its GPU.
mv "$work/gpu-a.yaml" "$work/specs/gpu-a.yaml"

"$dist/stead" agent --config "$work/agent.yaml" >"$out/agent.log" 2>&1 &
agent=$!
trap 'kill -TERM $agent 2>/dev/null; wait $agent 2>/dev/null' EXIT
cli() { "$dist/stead" "$1" "$2" --color never --address "127.0.0.1:$port" --token-file "$work/data/api-token" "${@:3}"; }
api() { curl -fsS -H "Authorization: Bearer $(cat "$work/data/api-token")" "http://127.0.0.1:$port$1"; }
# wait_until SECONDS COMMAND...: runs COMMAND each 0.2 s until it succeeds.
wait_until() {
  local end=$((SECONDS + $1))
  shift
  until "$@" >/dev/null 2>&1; do
    [ $SECONDS -lt $end ] || return 1
    sleep 0.2
  done
}

wait_until 20 api /v1/health || fail "the agent's API did not answer"
gpus() { api /v1/node | python3 -c 'import json,sys; d=json.load(sys.stdin); sys.exit(0 if any(g["vendor"]=="nvidia" for g in d["devices"]) else 1)'; }
wait_until 10 gpus || fail "no GPU reported within 10 s"
api /v1/node >"$out/node.json"
cli node status >"$out/node.txt" 2>&1
cat "$out/node.txt"
uuid=$(python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print([i["id"] for g in d["devices"] if g["vendor"]=="nvidia" for i in g["instances"]][0])' "$out/node.json")
case $uuid in GPU-*) pass "a GPU reported by UUID: $uuid" ;; *) fail "no GPU UUID: $uuid" ;; esac
grep -q memoryMiB "$out/node.json" && pass "its memory is an attribute" || fail "no memory attribute"

busy() { cli alloc logs gpu-a main 2>/dev/null | grep -q '^busy'; }
wait_until 90 busy || fail "the GPU task did not start computing within 90 s"
cli alloc logs gpu-a main >"$out/gpu-a.log" 2>&1
cat "$out/gpu-a.log"
grep -qx "CUDA_VISIBLE_DEVICES=$uuid" "$out/gpu-a.log" && pass "the task got CUDA_VISIBLE_DEVICES=$uuid" || fail "CUDA_VISIBLE_DEVICES is not $uuid"
grep -qx "cuda device count: 1" "$out/gpu-a.log" && pass "CUDA shows the task exactly one device" || fail "CUDA does not show exactly one device"
grep -q "cuda device 0 .* $uuid" "$out/gpu-a.log" && pass "and it is the reserved one" || fail "the device CUDA shows is not $uuid"

# The second alloc now, while the first holds the GPU.
mv "$work/gpu-b.yaml" "$work/specs/gpu-b.yaml"
pending() { cli alloc status gpu-b 2>/dev/null | grep -q "Waiting for devices"; }
if [ "$(nvidia-smi -L | wc -l)" -eq 1 ]; then
  wait_until 10 pending && pass "a second GPU task waits for a device" || fail "the second GPU task does not wait"
fi
cli alloc status gpu-b >"$out/gpu-b.txt" 2>&1

# NVML averages utilisation over a sampling window: wait until it shows the work.
busy_gpu() { api /v1/allocs/gpu-a/stats | python3 -c 'import json,sys; t=json.dumps(json.load(sys.stdin)); sys.exit(0 if "\"utilizationPercent\": 0.0" not in t and "utilizationPercent" in t else 1)'; }
wait_until 20 busy_gpu || fail "the GPU's utilisation did not show within 20 s"
api /v1/allocs/gpu-a/stats >"$out/gpu-a-stats.json"
python3 - "$out/gpu-a-stats.json" <<'EOF' && pass "stats show utilisation and memory" || fail "stats lack utilisation or memory"
import json, sys
d = json.load(open(sys.argv[1]))
text = json.dumps(d)
print(text[:2000])
sys.exit(0 if "utilizationPercent" in text and "memoryUsedBytes" in text else 1)
EOF
cli alloc status gpu-a >"$out/gpu-a.txt" 2>&1
cli node status >"$out/node-held.txt" 2>&1
cat "$out/node-held.txt"
kill -TERM $agent
wait $agent
echo "agent exited with $?" | tee -a "$out/checks.txt"
trap - EXIT
exit $failed
