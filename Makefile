# stead: `make run` builds and starts the agent on deploy/examples; `make test` builds and
# passes the whole suite. Both install the system packages they need first.

# Recipes run in bash with pipefail: a failing command piped into `tee` fails the recipe.
SHELL := bash
.SHELLFLAGS := -eu -o pipefail -c

CARGO ?= cargo
SPECS ?= deploy/examples

.PHONY: run test deps fmt-check clippy unit release bench soak fuzz screenshots gpu-check scale-check

# The same build as `make test` (every target of the workspace), so the two share one
# compile of RocksDB's C++; a narrower selection unifies features differently and
# would compile it again. The supervisor, which builds only through the release script,
# goes next to target/debug/stead, where the agent looks for it.
run: deps
	$(CARGO) build --locked --workspace --all-targets
	STEAD_BUILD_PROFILE=dev CARGO="$(CARGO)" scripts/build-release.sh target/debug stead-supervisor
	target/debug/stead validate $(SPECS)
	target/debug/stead agent --config deploy/dev-agent.yaml --specs $(SPECS)

test: deps fmt-check clippy unit

deps:
	@scripts/install-deps.sh

fmt-check:
	$(CARGO) fmt --all -- --check

# Clippy only type-checks: nothing links, so RocksDB's C++ (minutes of compiling) is not
# built for it; ROCKSDB_LIB_DIR tells librocksdb-sys's build script to skip it. The
# supervisor binary, which workspace builds skip, is checked the way the release script
# builds it: with its runtime, and without unwinding (`-C panic=abort` reaches only the
# supervisor's own crates).
clippy:
	ROCKSDB_LIB_DIR=$(CURDIR)/target $(CARGO) clippy --locked --workspace --all-targets -- -D warnings
	$(CARGO) clippy --locked -p stead-supervisor --bin stead-supervisor --features runtime -- -D warnings -C panic=abort

unit:
	scripts/cargo-test-summary.sh --locked --workspace

# The status page at 1280x800 (docs/ui-node.png, docs/ui-alloc.png), taken by headless
# Chromium from an agent running deploy/examples; for people to look at, not a test.
screenshots: deps
	$(CARGO) build --locked --workspace --all-targets
	STEAD_BUILD_PROFILE=dev CARGO="$(CARGO)" scripts/build-release.sh target/debug stead-supervisor
	scripts/ui-screenshots.sh docs

# The shipped binaries, `stead` and its supervisor (a static executable without a C
# library), in one directory: target/dist.
release: deps
	CARGO="$(CARGO)" scripts/build-release.sh target/dist

# Benchmarks (the release binaries, in target/dist; figures, not pass/fail). ALLOCS and
# IDLE_SECONDS scale the core one; PEER_ROUNDS, PEER_IDLE_SECONDS and PEER_RESTARTS the
# one against supervisord and pm2, which scripts/install-bench-deps.sh installs when
# missing. The peer report lands in target/bench-peers.md.
ALLOCS ?= 10000
IDLE_SECONDS ?= 10
PEER_ROUNDS ?= 3
PEER_IDLE_SECONDS ?= 60
PEER_RESTARTS ?= 10
bench: deps
	@scripts/install-bench-deps.sh
	CARGO="$(CARGO)" scripts/build-release.sh target/dist stead-controller stead-supervisor stead-bench
	target/dist/stead-bench core $(ALLOCS) $(IDLE_SECONDS)
	target/dist/stead-bench exec 500
	target/dist/stead-bench checks 1000 30
	target/dist/stead-bench store 1000 10 3
	target/dist/stead-bench devices 1000 64 201
	target/dist/stead-bench parse 20
	target/dist/stead-bench logfollow 1000 30
	PATH="$(CURDIR)/target/bench-deps/node_modules/.bin:$$PATH" \
	  target/dist/stead-bench peers $(PEER_ROUNDS) $(PEER_IDLE_SECONDS) $(PEER_RESTARTS) | tee target/bench-peers.md

# The `nvidia` device plugin on a host with an NVIDIA GPU and its driver, as root: the
# release agent with two allocs asking for a GPU; what it saw goes to GPU_CHECK_OUT
# (scripts/gpu-check.sh says what each file shows). Not part of `make test`, which runs
# where there is no GPU.
GPU_CHECK_OUT ?= target/gpu-check
gpu-check: deps
	CARGO="$(CARGO)" scripts/build-release.sh target/dist stead-controller stead-supervisor
	scripts/gpu-check.sh target/dist $(GPU_CHECK_OUT)

# Issue 36's exec figures on a large node, as root: SCALE_CHECK_TASKS (10,000) tasks
# started, reattached after an agent restart and drained, against the bare loop and the
# loop with a cgroup per process; the data dirs on disk under /var/tmp. The machine and
# the figures go to SCALE_CHECK_OUT (scripts/scale-check.sh says what each file shows).
SCALE_CHECK_TASKS ?= 10000
SCALE_CHECK_ROUNDS ?= 1
SCALE_CHECK_OUT ?= target/scale-check
scale-check: deps
	CARGO="$(CARGO)" scripts/build-release.sh target/dist stead-supervisor stead-bench
	scripts/scale-check.sh target/dist $(SCALE_CHECK_OUT) $(SCALE_CHECK_TASKS) $(SCALE_CHECK_ROUNDS)

# The crash test at length: the agent SIGKILLed at random moments CRASH_ITERATIONS times
# (`make test` runs 50). CRASH_SEED picks another sequence of churn and crash moments.
# Then 2,000 half-open connections held HALF_OPEN_SECONDS (`make test` only waits out
# the header timeout), reopened as the agent drops them. Then SCALE_TASKS exec tasks
# reattached across an agent's SIGKILL (`make test` runs 200).
CRASH_ITERATIONS ?= 500
CRASH_SEED ?= $(shell date +%s)
HALF_OPEN_SECONDS ?= 60
SCALE_TASKS ?= 2000
# Before them, SIM_SEEDS histories of the deterministic simulator (`make test` runs
# 500); a failure prints the one line that replays its seed.
SIM_SEEDS ?= 10000
# Then FLEET_SCALE (nodes,allocs) release agents of one etcd fleet converging on one
# apply (`make test` runs 5,20 debug agents).
FLEET_SCALE ?= 50,20
soak: deps
	STEAD_SIM_SEEDS=$(SIM_SEEDS) \
	  $(CARGO) test --locked -p stead-tests --test scenarios sim:: -- --nocapture
	STEAD_CRASH_ITERATIONS=$(CRASH_ITERATIONS) STEAD_CRASH_SEED=$(CRASH_SEED) \
	  $(CARGO) test --locked -p stead-tests --test scenarios state_crash -- --nocapture
	STEAD_HALF_OPEN_SECONDS=$(HALF_OPEN_SECONDS) \
	  $(CARGO) test --locked -p stead-tests --test scenarios agent_bounds::two_thousand -- --nocapture
	STEAD_SCALE_TASKS=$(SCALE_TASKS) \
	  $(CARGO) test --locked -p stead-tests --test scenarios scale_agent -- --nocapture
	CARGO="$(CARGO)" scripts/build-release.sh target/dist stead-controller stead-supervisor
	STEAD_FLEET_SCALE=$(FLEET_SCALE) STEAD_FLEET_AGENT=$(CURDIR)/target/dist/stead \
	  $(CARGO) test --locked -p stead-tests --test scenarios fleet_agent::fleet_nodes_converge -- --nocapture

# Fuzz the spec parser (needs a nightly toolchain and cargo-fuzz; not part of `make test`).
FUZZ_SECONDS ?= 60
fuzz:
	cd fuzz && mkdir -p corpus/parse_spec && \
	  $(CARGO) +nightly fuzz run parse_spec corpus/parse_spec seeds/parse_spec -- -max_total_time=$(FUZZ_SECONDS)
