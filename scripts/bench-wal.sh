#!/usr/bin/env bash
# Runs `outbox-bench -suite wal` against a private PostgreSQL with
# wal_level = logical (the shared server runs with replica): initdb into a
# temporary directory, start on a free port, run, stop. Extra arguments go
# to outbox-bench, e.g. scripts/bench-wal.sh -rounds 2.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/privatepg.sh
dir=$(mktemp -d /tmp/bench-wal-XXXXXX)
port=${BENCH_WAL_PORT:-55433}
privatepg_own "$dir"
cleanup() { privatepg_stop "$dir" immediate >/dev/null 2>&1 || true; rm -rf "$dir"; }
trap cleanup EXIT
privatepg_init "$dir"
privatepg_start "$dir" "$port" wal_level=logical max_replication_slots=10 max_wal_senders=10 "autovacuum=${BENCH_WAL_AUTOVACUUM:-off}"
echo "private PostgreSQL on 127.0.0.1:$port, wal_level=logical, autovacuum=${BENCH_WAL_AUTOVACUUM:-off}"
go run ./cmd/outbox-bench -db "postgres://postgres@127.0.0.1:$port/postgres?sslmode=disable" -suite wal "$@"
