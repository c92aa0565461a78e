# watermill-outbox: make help lists the targets.
SHELL := /bin/bash
GOLANGCI_LINT_VERSION ?= v2.15.0
GOBIN ?= $(shell go env GOPATH)/bin
SHARED_TEST_DATABASE_URL := postgres://postgres@127.0.0.1:5432/test?sslmode=disable
# make up writes the URL of the database it prepared for the tests (the shared
# server's, or a private cluster's when the shared one falls short) to this
# file; a TEST_DATABASE_URL of the environment or the command line wins. Read
# when a recipe runs, so make test sees what its prerequisite up wrote.
TEST_DATABASE_URL_FILE ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/watermill-outbox/test-database-url
TEST_DATABASE_URL ?= $(or $(shell cat '$(TEST_DATABASE_URL_FILE)' 2>/dev/null),$(SHARED_TEST_DATABASE_URL))
FUZZTIME ?= 30s
export TEST_DATABASE_URL TEST_DATABASE_URL_FILE

.PHONY: help up wait test fuzz fault partition ordered_history wal_history switch_history test_short test_race test_stress lint fmt vet bench bench-wal demo

help: ## List the targets.
	@grep -E '^[a-z_]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-12s %s\n", $$1, $$2}'

up: ## Prepare this machine for the tests (not needed by make demo); it says first what it may change: start PostgreSQL and RabbitMQ if down, install Chromium with apt-get if missing, create the database test. When the shared PostgreSQL's max_connections is below 300 it leaves that server as it is and starts a private cluster for the tests instead (initdb in a cache directory, kept and reused; scripts/services.sh down stops it); the tests then use it.
	@./scripts/services.sh up

wait: ## Wait until the tests' PostgreSQL (the one make up chose) and RabbitMQ accept connections.
	@./scripts/services.sh wait

test: up ## Run every suite against the real services (the command CI runs): go test ./..., the Docker build and Kubernetes checks, the partition test (root) and the fault-injection tests (default, ordered and WAL relays SIGKILLed while producers commit). A failing suite does not stop the others; the end lists each suite's verdict and time.
	./scripts/test.sh

fuzz: ## Fuzz every FuzzXxx target of the module for FUZZTIME each (default 30s; make fuzz FUZZTIME=5m), one at a time (go test -fuzz takes one target per run); needs PostgreSQL. Prints each target's executions; a failing input lands in the package's testdata/fuzz.
	@set -o pipefail; logs=$$(mktemp -d); trap 'rm -rf "$$logs"' EXIT; for file in $$(git grep -l '^func Fuzz' -- '*_test.go'); do \
		for target in $$(sed -n 's/^func \(Fuzz[A-Za-z0-9_]*\)(.*/\1/p' $$file); do \
			printf '%-24s %-18s ' $$target ./$$(dirname $$file); \
			go test -run '^$$' -fuzz "^$$target$$" -fuzztime $(FUZZTIME) ./$$(dirname $$file) > $$logs/$$target.log 2>&1 \
				|| { echo FAIL; grep -v '^fuzz: ' $$logs/$$target.log; exit 1; }; \
			{ grep -o 'execs: [0-9]*' $$logs/$$target.log || echo 'execs: 0 (FUZZTIME ended in the baseline)'; } | tail -1; \
		done; \
	done

fault: ## The fault-injection test at full size (100,000 events, 12 relay kills); restarts its own private PostgreSQL and RabbitMQ, not the shared ones.
	FAULT_EVENTS=100000 FAULT_KILLS=12 FAULT_SUMMARY_FILE=$(CURDIR)/docs/fault-summary.txt \
		go test -count=1 -timeout 60m -tags fault -run TestFaultInjection -v ./tests/fault/ 2>&1 | grep -v '^\[watermill\]' | tail -25; exit $${PIPESTATUS[0]}

partition: ## The partition test alone (root): a relay leader cut off in its own network namespace, a standby takes over.
	go test -count=1 -timeout 10m -tags fault -run TestFaultPartition -v ./tests/fault/ 2>&1 | grep -v '^\[watermill\]' | tail -15; exit $${PIPESTATUS[0]}

ordered_history: up ## The ordered-mode history checker at full size (30,000 events, relays joining, closing and killed, operator skips and replays); prints its counts and seed.
	ORDERED_HISTORY_EVENTS=30000 go test -count=1 -timeout 30m -run 'TestOrderedHistory$$' -v ./subscriber/ 2>&1 | grep -v '^\[watermill\]' | grep -v '^=== ' | tail -150; exit $${PIPESTATUS[0]}

wal_history: up ## The WAL relay's history checker at a larger size (10,000 events; failures, replays, skips, relays replaced and sessions terminated); prints its counts.
	WAL_HISTORY_EVENTS=10000 go test -count=1 -timeout 30m -run 'TestWALHistory$$' -v ./walrelay/ 2>&1 | grep -v '^=== ' | grep -E 'history_test|^(---|ok|FAIL)' | tail -60; exit $${PIPESTATUS[0]}

switch_history: up ## The cross-mode history checker at full size (20,000 events, 32 switches between every pair of modes, relays of the three modes started, closed and killed, operator skips, replays and cleaner passes); prints its seed and counts (SWITCH_HISTORY_SEED=<seed> replays a run).
	SWITCH_HISTORY_EVENTS=20000 SWITCH_HISTORY_SWITCHES=32 go test -count=1 -timeout 60m -run 'TestSwitchHistory$$' -v ./tests/switchhistory/ 2>&1 | grep -v '^\[watermill\]' | grep -v '^=== ' | tail -150; exit $${PIPESTATUS[0]}

test_short: ## Quick run (~1 min): every package with -short (Watermill's universal suites run with few messages); no Docker or fault test.
	go test -count=1 -short -timeout 10m ./...

test_race: ## Run every test with the race detector.
	go test -count=1 -race -timeout 40m ./...

test_stress: ## Run Watermill's stress suite (build tag stress).
	go test -count=1 -tags stress -run TestPubSubStress -timeout 60m ./subscriber/

fmt: ## Format the code.
	gofmt -w $$(git ls-files '*.go')

vet: ## go vet.
	go vet ./...

lint: ## gofmt check, go vet and golangci-lint (installed from the module proxy if missing).
	@test -z "$$(gofmt -l $$(git ls-files '*.go'))" || (echo "gofmt needed:"; gofmt -l $$(git ls-files '*.go'); exit 1)
	go vet ./...
	@test -x $(GOBIN)/golangci-lint && grep -qF $(GOLANGCI_LINT_VERSION:v%=%) <<<"$$($(GOBIN)/golangci-lint version 2>/dev/null)" || \
		GOBIN=$(GOBIN) go install github.com/golangci/golangci-lint/v2/cmd/golangci-lint@$(GOLANGCI_LINT_VERSION)
	$(GOBIN)/golangci-lint run --build-tags fault,stress ./...

DEMO_DATABASE_URL ?= postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable

demo: ## Run the relay end to end, from PostgreSQL to an in-process Kafka cluster, printing what it forwarded. Needs only a PostgreSQL database (OUTBOX_DATABASE_URL, else DEMO_DATABASE_URL: the local server's postgres database) and changes nothing on the machine: its table lives in a schema of its own, dropped at the end.
	OUTBOX_DATABASE_URL="$${OUTBOX_DATABASE_URL:-$(DEMO_DATABASE_URL)}" go run ./examples/demo

bench-wal: ## The WAL relay's benchmarks on a private wal_level=logical PostgreSQL (docs/BENCHMARKS.md section 9).
	./scripts/bench-wal.sh -rounds 3

# make bench measures the server docs/BENCHMARKS.md describes, not a private
# test cluster make up may have started: TEST_DATABASE_URL when you set it,
# else the shared server.
BENCH_DATABASE_URL ?= $(if $(filter environment command,$(origin TEST_DATABASE_URL)),$(TEST_DATABASE_URL),$(SHARED_TEST_DATABASE_URL))

bench: ## Print the benchmark tables (outbox vs baselines measured in the same run).
	go run ./cmd/outbox-bench -db '$(BENCH_DATABASE_URL)' -suite all -rounds 2 -chart docs/latency.png
