#!/usr/bin/env bash
# Checks the services the tests need and starts whichever is down, with the
# start commands of this machine kind (Debian packages, no Docker). Fails
# loudly when a service cannot be reached: tests never skip a missing service.
set -euo pipefail

PG_HOST=${PG_HOST:-127.0.0.1}
PG_PORT=${PG_PORT:-5432}
AMQP_HOST=${AMQP_HOST:-127.0.0.1}
AMQP_PORT=${AMQP_PORT:-5672}

pg_up() { pg_isready -q -h "$PG_HOST" -p "$PG_PORT"; }
amqp_up() { (exec 3<>"/dev/tcp/$AMQP_HOST/$AMQP_PORT") 2>/dev/null; }

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
	v=$(ls /etc/postgresql 2>/dev/null | sort -V | tail -n1)
	[ -n "$v" ] || { echo "PostgreSQL is not installed (/etc/postgresql missing)" >&2; return 1; }
	pg_ctlcluster --skip-systemctl-redirect "$v" main start
}

start_amqp() {
	echo "RabbitMQ: down, starting"
	command -v rabbitmq-server >/dev/null || { echo "RabbitMQ is not installed" >&2; return 1; }
	rabbitmq-server -detached
}

# Two `make test` runs side by side (and the fault tests' relays) open more
# connections than PostgreSQL's default max_connections (100).
PG_MIN_CONNECTIONS=${PG_MIN_CONNECTIONS:-300}

ensure_pg_connections() {
	local cur v
	cur=$(psql -h "$PG_HOST" -p "$PG_PORT" -U postgres -d postgres -tAc "SHOW max_connections")
	if [ "$cur" -ge "$PG_MIN_CONNECTIONS" ]; then
		echo "PostgreSQL: max_connections $cur"
		return 0
	fi
	v=$(ls /etc/postgresql 2>/dev/null | sort -V | tail -n1)
	[ -n "$v" ] || { echo "PostgreSQL: max_connections $cur < $PG_MIN_CONNECTIONS and the server is not a local cluster this script can restart; raise it by hand" >&2; return 1; }
	echo "PostgreSQL: max_connections $cur < $PG_MIN_CONNECTIONS: raising it (ALTER SYSTEM) and restarting the server"
	psql -h "$PG_HOST" -p "$PG_PORT" -U postgres -d postgres -qc "ALTER SYSTEM SET max_connections = $PG_MIN_CONNECTIONS"
	pg_ctlcluster --skip-systemctl-redirect "$v" main restart
	wait_for PostgreSQL pg_up 60
}

ensure_test_db() {
	# Not `psql | grep -q`: under pipefail an early-exiting grep can SIGPIPE psql.
	[ "$(psql -h "$PG_HOST" -p "$PG_PORT" -U postgres -d postgres -tAc "SELECT 1 FROM pg_database WHERE datname = 'test'")" = 1 ] ||
		psql -h "$PG_HOST" -p "$PG_PORT" -U postgres -d postgres -c "CREATE DATABASE test"
}

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
	cat <<EOF
make up prepares this machine for the tests and may change it; each step below runs only when needed:
  - start PostgreSQL ($PG_HOST:$PG_PORT) and RabbitMQ ($AMQP_HOST:$AMQP_PORT) if they are down;
  - install Chromium with apt-get if it is missing (the console's browser test);
  - raise PostgreSQL's max_connections to $PG_MIN_CONNECTIONS with ALTER SYSTEM and restart the server if it is lower;
  - create the database test if it does not exist.
make demo needs none of this: only a PostgreSQL database.
EOF
}

case "${1:-up}" in
up)
	announce
	ensure_chromium
	pg_up || start_pg
	wait_for PostgreSQL pg_up 60
	ensure_pg_connections
	ensure_test_db
	amqp_up || start_amqp
	wait_for RabbitMQ amqp_up 120
	;;
wait)
	wait_for PostgreSQL pg_up 60
	wait_for RabbitMQ amqp_up 120
	;;
*)
	echo "usage: $0 up|wait" >&2
	exit 2
	;;
esac
