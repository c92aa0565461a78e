#!/usr/bin/env bash
# Runs `outbox-bench -suite wal` against a private PostgreSQL with
# wal_level = logical (the shared server runs with replica): initdb into a
# temporary directory, start on a free port, run, stop. Extra arguments go
# to outbox-bench, e.g. scripts/bench-wal.sh -rounds 2.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -1)
dir=$(mktemp -d /tmp/bench-wal-XXXXXX)
port=${BENCH_WAL_PORT:-55433}
run() { if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi; }
[ "$(id -u)" = 0 ] && chown postgres "$dir"
cleanup() { run "$bin/pg_ctl" stop -D "$dir/data" -m immediate >/dev/null 2>&1 || true; rm -rf "$dir"; }
trap cleanup EXIT
run "$bin/initdb" -D "$dir/data" -U postgres -A trust -E UTF8 --no-sync >/dev/null
run "$bin/pg_ctl" start -w -D "$dir/data" -l "$dir/server.log" -o \
	"-c port=$port -c listen_addresses=127.0.0.1 -c unix_socket_directories=$dir -c wal_level=logical -c max_replication_slots=10 -c max_wal_senders=10 -c autovacuum=${BENCH_WAL_AUTOVACUUM:-off}" >/dev/null
echo "private PostgreSQL on 127.0.0.1:$port, wal_level=logical, autovacuum=${BENCH_WAL_AUTOVACUUM:-off}"
go run ./cmd/outbox-bench -db "postgres://postgres@127.0.0.1:$port/postgres?sslmode=disable" -suite wal "$@"
