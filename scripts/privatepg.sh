# shellcheck shell=bash
# Sourced, not run: a private PostgreSQL cluster with this machine's server
# binaries (PG_BIN, else the newest Debian /usr/lib/postgresql/<v>/bin, else
# initdb on the PATH), run as the user postgres when root (initdb and pg_ctl
# refuse root), as the caller otherwise. A cluster lives in one directory
# DIR: DIR/data is its data directory, DIR holds its unix socket and
# DIR/server.log its log; it listens on 127.0.0.1 only and trusts every
# local connection. Used by services.sh (the tests' cluster, kept between
# runs, when the shared server falls short) and by bench-wal.sh and
# bench-private.sh (a throwaway cluster per run). internal/pgtest does the
# same for the Go tests that need a cluster of their own.

# privatepg_bin prints the directory of the server binaries.
privatepg_bin() {
	if [ -n "${PG_BIN:-}" ]; then
		echo "$PG_BIN"
		return 0
	fi
	local d
	d=$(find /usr/lib/postgresql -mindepth 2 -maxdepth 2 -name bin -type d 2>/dev/null | sort -V | tail -n1)
	if [ -z "$d" ] && d=$(command -v initdb); then
		d=$(dirname "$d")
	fi
	[ -n "$d" ] || { echo "no PostgreSQL server binaries (initdb): install the postgresql package or set PG_BIN" >&2; return 1; }
	echo "$d"
}

# privatepg_as CMD...: runs CMD as the clusters' owner.
privatepg_as() {
	if [ "$(id -u)" = 0 ]; then
		runuser -u postgres -- "$@"
	else
		"$@"
	fi
}

# privatepg_owner prints the clusters' owner.
privatepg_owner() { if [ "$(id -u)" = 0 ]; then echo postgres; else id -un; fi; }

# privatepg_own DIR: hands an existing directory (mktemp -d) to the owner.
privatepg_own() { if [ "$(id -u)" = 0 ]; then chown postgres "$1"; fi; }

# privatepg_mkdir DIR: creates DIR and its missing parents as the owner.
privatepg_mkdir() { privatepg_as mkdir -p -m 700 "$1"; }

# privatepg_init DIR: initdb into DIR/data: user postgres, trust
# authentication, UTF8.
privatepg_init() {
	local bin
	bin=$(privatepg_bin) || return 1
	privatepg_as "$bin/initdb" -D "$1/data" -U postgres -A trust -E UTF8 --no-sync >/dev/null
}

# privatepg_start DIR PORT [NAME=VALUE...]: starts the cluster of DIR on
# 127.0.0.1:PORT with the settings given (for this start: they are not
# written into the cluster's configuration) and waits until it accepts
# connections; non-zero when it does not start (DIR/server.log says why).
privatepg_start() {
	local dir=$1 port=$2 bin opts s
	shift 2
	bin=$(privatepg_bin) || return 1
	opts="-c port=$port -c listen_addresses=127.0.0.1 -c unix_socket_directories='$dir'"
	for s in "$@"; do
		opts+=" -c $s"
	done
	privatepg_as "$bin/pg_ctl" start -w -t 60 -D "$dir/data" -l "$dir/server.log" -o "$opts" >/dev/null
}

# privatepg_stop DIR [MODE]: stops the cluster of DIR (MODE fast unless
# given); quiet, and zero, when it does not run.
privatepg_stop() {
	local bin
	bin=$(privatepg_bin) || return 1
	privatepg_running "$1" || return 0
	privatepg_as "$bin/pg_ctl" stop -w -D "$1/data" -m "${2:-fast}" >/dev/null
}

# privatepg_running DIR: zero when the cluster of DIR runs.
privatepg_running() {
	local bin
	bin=$(privatepg_bin) || return 1
	[ -f "$1/data/PG_VERSION" ] && privatepg_as "$bin/pg_ctl" status -D "$1/data" >/dev/null 2>&1
}

# privatepg_port DIR prints the port of the running cluster of DIR.
privatepg_port() { sed -n 4p "$1/data/postmaster.pid"; }
