#!/usr/bin/env bash
# Checks the services the tests need and starts whichever is down, with the
# start commands of this machine kind (Debian packages, no Docker). Fails
# loudly when a service cannot be reached: tests never skip a missing service.
#
# The tests need a PostgreSQL with max_connections >= PG_MIN_CONNECTIONS
# (two `make test` runs side by side open more than the default 100). When
# the shared server falls short, `up` never reconfigures or restarts it: it
# starts a private cluster for the tests instead (scripts/privatepg.sh), kept
# between runs, and writes its URL to TEST_DATABASE_URL_FILE, which the
# Makefile reads. The test database needs no other setting: the WAL tests
# start their own wal_level=logical clusters (internal/pgtest).
#
#   up     prepare this machine (says first what it may change)
#   wait   wait until the tests' PostgreSQL and RabbitMQ accept connections
#   url    print the database URL the tests use (what make exports)
#   down   stop the private cluster and forget its URL (the shared services
#          are never stopped); its directory stays, `up` starts it again
#
# Settings (environment): PG_HOST, PG_PORT (the shared server, 127.0.0.1:5432),
# AMQP_HOST, AMQP_PORT (127.0.0.1:5672), PG_MIN_CONNECTIONS (300),
# PRIVATE_PG (auto: private only when the shared server falls short; 1:
# always private; 0: never, fail instead), PRIVATE_PG_DIR, PRIVATE_PG_PORT
# (55432, else the next free port), TEST_DATABASE_URL_FILE, PG_BIN.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/privatepg.sh

PG_HOST=${PG_HOST:-127.0.0.1}
PG_PORT=${PG_PORT:-5432}
AMQP_HOST=${AMQP_HOST:-127.0.0.1}
AMQP_PORT=${AMQP_PORT:-5672}
PG_MIN_CONNECTIONS=${PG_MIN_CONNECTIONS:-300}
PRIVATE_PG=${PRIVATE_PG:-auto}
PRIVATE_PG_PORT=${PRIVATE_PG_PORT:-55432}
CACHE=${XDG_CACHE_HOME:-$HOME/.cache}/watermill-outbox
TEST_DATABASE_URL_FILE=${TEST_DATABASE_URL_FILE:-$CACHE/test-database-url}
if [ -z "${PRIVATE_PG_DIR:-}" ]; then
	if [ "$(id -u)" = 0 ]; then # the cluster runs as postgres, which cannot enter root's home
		PRIVATE_PG_DIR=$(getent passwd postgres | cut -d: -f6)/.cache/watermill-outbox/pg
	else
		PRIVATE_PG_DIR=$CACHE/pg
	fi
fi
SHARED_URL="postgres://postgres@$PG_HOST:$PG_PORT/test?sslmode=disable"

pg_up() { pg_isready -q -h "$PG_HOST" -p "$PG_PORT"; }
amqp_up() { (exec 3<>"/dev/tcp/$AMQP_HOST/$AMQP_PORT") 2>/dev/null; }
port_taken() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

wait_for() { # name check seconds
	local name=$1 check=$2 secs=$3
	for ((i = 0; i < secs * 2; i++)); do
		if $check; then echo "$name: up"; return 0; fi
		sleep 0.5
	done
	echo "$name: NOT reachable after ${secs}s" >&2
	return 1
}

start_pg() {
	echo "PostgreSQL: down, starting"
	local v
	v=$(find /etc/postgresql -mindepth 1 -maxdepth 1 -printf '%f\n' 2>/dev/null | sort -V | tail -n1)
	[ -n "$v" ] || { echo "PostgreSQL is not installed (/etc/postgresql missing)" >&2; return 1; }
	pg_ctlcluster --skip-systemctl-redirect "$v" main start
}

start_amqp() {
	echo "RabbitMQ: down, starting"
	command -v rabbitmq-server >/dev/null || { echo "RabbitMQ is not installed" >&2; return 1; }
	rabbitmq-server -detached
}

# query HOST PORT SQL: one value from the database postgres.
query() { psql -h "$1" -p "$2" -U postgres -d postgres -tAc "$3"; }

ensure_test_db() { # host port
	# Not `psql | grep -q`: under pipefail an early-exiting grep can SIGPIPE psql.
	[ "$(query "$1" "$2" "SELECT 1 FROM pg_database WHERE datname = 'test'")" = 1 ] ||
		psql -h "$1" -p "$2" -U postgres -d postgres -c "CREATE DATABASE test"
}

# private_pg starts (or reuses) the private cluster, creates its database
# test and sets PRIVATE_URL.
private_pg() {
	local dir=$PRIVATE_PG_DIR bin want have port cur
	bin=$(privatepg_bin)
	if [ -f "$dir/data/PG_VERSION" ]; then
		have=$(cat "$dir/data/PG_VERSION")
		want=$("$bin/postgres" -V | sed -E 's/.* ([0-9]+)(\.[0-9]+)*.*/\1/')
		if [ "$have" != "$want" ]; then
			echo "private PostgreSQL: $dir/data was made by PostgreSQL $have, this machine runs $want ($bin): remove $dir (it holds only test data) and run make up again" >&2
			return 1
		fi
	else
		echo "private PostgreSQL: initdb into $dir/data (owner $(privatepg_owner))"
		privatepg_mkdir "$dir"
		privatepg_init "$dir"
	fi
	if privatepg_running "$dir"; then
		port=$(privatepg_port "$dir")
		echo "private PostgreSQL: already running on 127.0.0.1:$port ($dir), reused"
	else
		port=$PRIVATE_PG_PORT
		while port_taken "$port"; do
			port=$((port + 1))
			[ "$port" -lt $((PRIVATE_PG_PORT + 50)) ] || { echo "private PostgreSQL: no free port in $PRIVATE_PG_PORT..$port" >&2; return 1; }
		done
		echo "private PostgreSQL: starting on 127.0.0.1:$port ($dir, log $dir/server.log)"
		privatepg_start "$dir" "$port" "max_connections=$PG_MIN_CONNECTIONS" || {
			echo "private PostgreSQL: did not start; the end of $dir/server.log:" >&2
			tail -n 20 "$dir/server.log" >&2
			return 1
		}
	fi
	cur=$(query 127.0.0.1 "$port" "SHOW max_connections")
	if [ "$cur" -lt "$PG_MIN_CONNECTIONS" ]; then
		echo "private PostgreSQL: it runs with max_connections $cur < $PG_MIN_CONNECTIONS; stop it (scripts/services.sh down) and run make up again" >&2
		return 1
	fi
	echo "private PostgreSQL: max_connections $cur"
	ensure_test_db 127.0.0.1 "$port"
	PRIVATE_URL="postgres://postgres@127.0.0.1:$port/test?sslmode=disable"
}

# choose_pg prepares the database the tests use and writes its URL to
# TEST_DATABASE_URL_FILE.
choose_pg() {
	local url cur
	if [ "$PRIVATE_PG" = 1 ]; then
		echo "PostgreSQL: PRIVATE_PG=1, the tests use the private cluster"
		private_pg
		url=$PRIVATE_URL
	else
		pg_up || start_pg
		wait_for PostgreSQL pg_up 60
		# The examples' default database, whichever server the tests use.
		ensure_test_db "$PG_HOST" "$PG_PORT"
		cur=$(query "$PG_HOST" "$PG_PORT" "SHOW max_connections")
		if [ "$cur" -ge "$PG_MIN_CONNECTIONS" ]; then
			echo "PostgreSQL: max_connections $cur, the tests use $PG_HOST:$PG_PORT"
			url=$SHARED_URL
		elif [ "$PRIVATE_PG" = 0 ]; then
			echo "PostgreSQL: max_connections $cur < $PG_MIN_CONNECTIONS at $PG_HOST:$PG_PORT and PRIVATE_PG=0: raise it on that server yourself, or let make up start a private cluster (PRIVATE_PG unset)" >&2
			return 1
		else
			echo "PostgreSQL: max_connections $cur < $PG_MIN_CONNECTIONS at $PG_HOST:$PG_PORT, left as it is; the tests use a private cluster"
			private_pg
			url=$PRIVATE_URL
		fi
	fi
	printf '%s\n' "$url" >"$TEST_DATABASE_URL_FILE.tmp"
	mv "$TEST_DATABASE_URL_FILE.tmp" "$TEST_DATABASE_URL_FILE"
	echo "TEST_DATABASE_URL: $url (in $TEST_DATABASE_URL_FILE, which make reads)"
}

# test_url prints the URL the last `up` chose, else the shared server's.
test_url() { cat "$TEST_DATABASE_URL_FILE" 2>/dev/null || echo "$SHARED_URL"; }

ensure_chromium() { # the console's browser test drives Debian's Chromium
	if ! command -v chromium >/dev/null; then
		echo "Chromium: missing, installing (apt)"
		DEBIAN_FRONTEND=noninteractive apt-get install -y chromium >/dev/null ||
			{ apt-get update >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y chromium >/dev/null; }
	fi
	chromium --version >/dev/null 2>&1 || { echo "Chromium: NOT usable (apt-get install chromium)" >&2; return 1; }
	echo "Chromium: installed"
}

# announce says, before any step, what `up` may change on this machine.
announce() {
	local when="if that PostgreSQL's max_connections is below $PG_MIN_CONNECTIONS"
	[ "$PRIVATE_PG" != 1 ] || when="as PRIVATE_PG=1 asks, without looking at that server"
	cat <<EOF
make up prepares this machine for the tests and may change it; each step below runs only when needed:
  - start PostgreSQL ($PG_HOST:$PG_PORT) and RabbitMQ ($AMQP_HOST:$AMQP_PORT) if they are down;
  - install Chromium with apt-get if it is missing (the console's browser test);
EOF
	if [ "$PRIVATE_PG" = 0 ]; then
		echo "  - (PRIVATE_PG=0) fail if that PostgreSQL's max_connections is below $PG_MIN_CONNECTIONS;"
	else
		cat <<EOF
  - $when: create a private PostgreSQL cluster for the tests
    (initdb, run as $(privatepg_owner)) in $PRIVATE_PG_DIR and start it on 127.0.0.1:$PRIVATE_PG_PORT
    (or the next free port), trust authentication, max_connections $PG_MIN_CONNECTIONS; one already there
    is reused, and it keeps running after the tests (scripts/services.sh down stops it);
EOF
	fi
	cat <<EOF
  - create the database test if it does not exist, on that PostgreSQL (the examples' default) and on the
    private cluster if the tests use one;
  - write that database's URL to $TEST_DATABASE_URL_FILE (make exports it as TEST_DATABASE_URL).
It never reconfigures or restarts the shared PostgreSQL: no ALTER SYSTEM, no restart.
make demo needs none of this: only a PostgreSQL database.
EOF
}

case "${1:-up}" in
up)
	announce
	mkdir -p "$(dirname "$TEST_DATABASE_URL_FILE")"
	# Two make test runs side by side: one prepares, the other waits, then
	# reuses. flock holds the lock itself (-o): a server started below must
	# not inherit it and hold it for its lifetime.
	exec flock -o "$(dirname "$TEST_DATABASE_URL_FILE")/up.lock" scripts/services.sh up-locked
	;;
up-locked)
	ensure_chromium
	choose_pg
	amqp_up || start_amqp
	wait_for RabbitMQ amqp_up 120
	;;
wait)
	test_pg_up() { pg_isready -q -d "$(test_url)"; }
	wait_for PostgreSQL test_pg_up 60
	wait_for RabbitMQ amqp_up 120
	;;
url)
	test_url
	;;
down)
	rm -f "$TEST_DATABASE_URL_FILE"
	if privatepg_running "$PRIVATE_PG_DIR"; then
		privatepg_stop "$PRIVATE_PG_DIR"
		echo "private PostgreSQL: stopped ($PRIVATE_PG_DIR kept; rm -rf it to free the space)"
	else
		echo "private PostgreSQL: not running"
	fi
	;;
*)
	echo "usage: $0 up|wait|url|down" >&2
	exit 2
	;;
esac
