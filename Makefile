# cryo: ship gVisor checkpoints as chunked, deduplicated OCI artifacts.
#
#   make demo    checkpoint a Python app in gVisor, push it, restore it through the puller (root)
#   make demo-format  pack, inspect, unpack and verify a synthetic image dir (no root)
#   make test    install what tests need (fuse3, redis, oras, helm, SeaweedFS, runsc, oci-conformance, staticcheck), lint, run every test
#   make conformance  the OCI distribution-spec conformance suite alone; reports in out/conformance/
#   make bench   benchmarks: pack and dedup, push/pull vs oras, the puller; results go in docs/benchmarks.md
#   make bench-load  32 concurrent pullers against one registry and two replicas
#   make bench-fleet  fleets of 4, 16 and 32 node pullers (network namespaces, a tbf-shaped registry link) mount one new snapshot at once, with and without peers
#   make bench-restore  real runsc restores (local, oras pull, cryo gofer and FUSE; an app with a hot set, with and without its working-set profile) and pauses (cryo checkpoint vs runsc checkpoint + cryo push)
#   make gofer   cryo's gVisor checkpoint gofer into bin/cryo-gofer/ (make build runs it)

SHELL      := /bin/bash
GO         ?= go
BIN        := $(CURDIR)/bin
CRYO       := $(BIN)/cryo
DEMO_DIR   ?= $(CURDIR)/out/demo
DEMO_SIZE  ?= 268435456
# An execution count, not a duration: a duration races Go 1.26's fuzz
# coordinator at the deadline and fails with "context deadline exceeded"
# on a busy machine without any finding (go.dev/issue/75804, fixed in 1.27).
FUZZTIME   ?= 500000x

.PHONY: all build gofer runsc deps lint test test-go test-charts conformance fuzz bench bench-restore bench-load bench-fleet demo demo-format clean

all: build

build: gofer
	$(GO) build -o $(CRYO) ./cmd/cryo

# cryo's gVisor checkpoint gofer (module checkpointgofer, same gVisor as
# runsc) into bin/cryo-gofer/, where cryo restore finds it beside bin/cryo.
gofer:
	scripts/build-gofer.sh

runsc: gofer
	scripts/build-runsc.sh

deps:
	scripts/install-test-deps.sh

lint: deps
	@unformatted=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$unformatted" ]; then echo "gofmt needed: $$unformatted"; exit 1; fi
	$(GO) vet ./...
	$(BIN)/staticcheck ./...
	cd charts/test && $(GO) vet ./... && $(BIN)/staticcheck ./...
	cd checkpointgofer && $(GO) vet ./... && $(BIN)/staticcheck ./...

# Tests that need root, FUSE or runsc skip with a printed reason on a laptop
# and fail instead of skipping when CI=true. The library (everything that
# runs in the registry and on the node, and the internal packages under
# it) runs under the race detector; the rest (commands, benchmarks, the
# conformance and scale suites, which drive processes) without it.
RACE_PKGS  := ./format/... ./transfer/... ./registry/... ./puller/... ./internal/...
test-go: build
	$(GO) test -race -count=1 $(RACE_PKGS)
	cd checkpointgofer && $(GO) test -race -count=1 ./...
	$(GO) test -count=1 $$($(GO) list ./... | grep -v -E '/cryo/(format|transfer|registry|puller|internal)(/|$$)')

conformance: build deps
	$(GO) test -count=1 -v -run '^TestOCIDistributionSpec$$' ./conformance

fuzz:
	$(GO) test ./format -run '^$$' -fuzz '^FuzzParseTable$$' -fuzztime $(FUZZTIME)
	$(GO) test ./format -run '^$$' -fuzz '^FuzzParseIndex$$' -fuzztime $(FUZZTIME)
	$(GO) test ./format -run '^$$' -fuzz '^FuzzParseTableV2$$' -fuzztime $(FUZZTIME)
	$(GO) test ./format -run '^$$' -fuzz '^FuzzCheckKeys$$' -fuzztime $(FUZZTIME)

# helm lint + helm template of both charts with every ci/*-values.yaml set,
# decoded strictly against the Kubernetes API types (own module: k8s.io/api
# stays out of cryo's go.mod).
test-charts: build deps
	cd charts/test && $(GO) test -count=1 ./...

test: deps lint test-go test-charts fuzz

# Each prints Markdown comparing cryo with the naive path in the same run.
bench: build deps
	$(GO) run ./bench/formatbench
	$(GO) run ./bench/transferbench
	$(GO) run ./bench/pullerbench

# The whole story with real gVisor: checkpoint an app, push, restore it
# through the puller, check its memory. Needs root; builds bin/runsc if missing.
demo: build
	@[ -x $(BIN)/runsc ] || scripts/build-runsc.sh
	scripts/demo.sh

# The format alone, no root needed: pack a synthetic image dir, inspect,
# unpack, verify, compare.
demo-format: build
	@rm -rf $(DEMO_DIR) && mkdir -p $(DEMO_DIR)
	$(GO) run ./bench/mkimage -kind halfzero -size $(DEMO_SIZE) $(DEMO_DIR)/image
	$(CRYO) pack $(DEMO_DIR)/image --layout $(DEMO_DIR)/layout --tag demo
	$(CRYO) inspect $(DEMO_DIR)/layout:demo
	$(CRYO) unpack $(DEMO_DIR)/layout:demo $(DEMO_DIR)/unpacked
	$(CRYO) verify $(DEMO_DIR)/layout:demo
	diff -r $(DEMO_DIR)/image $(DEMO_DIR)/unpacked && echo "demo: unpacked image dir is byte-identical to the source"
	@rm -rf $(DEMO_DIR)

clean:
	rm -rf $(BIN) out

# The end-to-end restore benchmark with real gVisor (root): local disk,
# naive oras pull, and cryo, on loopback and shaped links. Results and the
# chart go in docs/benchmarks.md.
bench-restore: build deps
	$(GO) test ./bench/restore -run '^$$' -bench Restore -benchtime 1x -timeout 120m -chart $(CURDIR)/docs/restore-loopback.png
	$(GO) test ./bench/restore -run '^$$' -bench Profile -benchtime 1x -timeout 180m -reps 5
	$(GO) test ./bench/pause -run '^$$' -bench Pause -benchtime 1x -timeout 60m -sizes 256,512,1024 -format v1,v2

# Many pullers against one registry and two replicas: 32 pullers fetching
# one 1 GiB snapshot, and 32 distinct snapshots sharing 80% of their chunks,
# cryo beside single-blob artifacts. Results and the chart go in
# docs/benchmarks.md.
bench-load: build deps
	$(GO) run ./bench/loadbench -chart $(CURDIR)/docs/load.png

# Fleets of node pullers (root: network namespaces, tbf, FUSE) mount one
# new snapshot at once: one node alone, every node on the registry, every
# node sharing chunks with its peers. Results and chart go in
# docs/benchmarks.md.
bench-fleet: build
	$(GO) run ./bench/fleetbench -chart $(CURDIR)/docs/fleet.png
