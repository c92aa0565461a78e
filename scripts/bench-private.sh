#!/usr/bin/env bash
# Runs a benchmark binary or `go run ./cmd/outbox-bench` against a private
# PostgreSQL (wal_level = logical, autovacuum off unless
# BENCH_AUTOVACUUM=on): initdb into a temporary directory, start on a free
# port, run, stop. Nothing else on the machine shares its horizon, its
# statistics or its buffers, so a session pinning the shared server's xmin
# does not move the figures. BENCH_BIN="old new" runs those outbox-bench
# binaries instead of `go run`, one after the other on the same server,
# BENCH_REPEAT times (default 1): two builds compared in one session, their
# runs interleaved. Arguments go to outbox-bench, e.g.
#   scripts/bench-private.sh -suite ordered -rounds 2
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/privatepg.sh
dir=$(mktemp -d /tmp/bench-pg-XXXXXX)
port=${BENCH_PORT:-55434}
av=${BENCH_AUTOVACUUM:-${BENCH_WAL_AUTOVACUUM:-off}}
privatepg_own "$dir"
cleanup() { privatepg_stop "$dir" immediate >/dev/null 2>&1 || true; rm -rf "$dir"; }
trap cleanup EXIT
privatepg_init "$dir"
privatepg_start "$dir" "$port" wal_level=logical max_replication_slots=10 max_wal_senders=10 "autovacuum=$av"
echo "private PostgreSQL on 127.0.0.1:$port, wal_level=logical, autovacuum=$av"
db="postgres://postgres@127.0.0.1:$port/postgres?sslmode=disable"
if [ -n "${BENCH_BIN:-}" ]; then
	for i in $(seq "${BENCH_REPEAT:-1}"); do
		for b in $BENCH_BIN; do
			echo "== $b (pass $i)"
			"$b" -db "$db" "$@"
		done
	done
else
	go run ./cmd/outbox-bench -db "$db" "$@"
fi
