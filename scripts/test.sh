#!/usr/bin/env bash
# The suites of `make test`, each run even when an earlier one failed; the end
# lists each suite with its time and verdict, and the exit status is non-zero
# when any failed. Run from the repository root by `make test`.
set -uo pipefail
cd "$(dirname "$0")/.."

failed=()
summary=()

# suite NAME TAIL CMD...: runs CMD; TAIL > 0 keeps only the last TAIL lines
# of its output, without Watermill's log lines (the fault tests are verbose).
suite() {
	local name=$1 tail=$2
	shift 2
	echo "=== suite $name: $*"
	local start=$SECONDS rc
	if [ "$tail" -gt 0 ]; then
		"$@" 2>&1 | grep -v '^\[watermill\]' | tail -n "$tail"
		rc=${PIPESTATUS[0]}
	else
		"$@"
		rc=$?
	fi
	local took=$((SECONDS - start))
	if [ "$rc" -eq 0 ]; then
		summary+=("ok    $name (${took}s)")
	else
		summary+=("FAIL  $name (${took}s, exit $rc)")
		failed+=("$name")
	fi
}

kube_check() (cd deploy/kubernetes/check && go test -count=1 ./...)

suite "go test ./..." 0 go test -count=1 -timeout 30m ./...
suite "docker build check" 0 ./scripts/docker-build-check.sh
suite "kubernetes check" 0 kube_check
suite "fault: partition" 15 go test -count=1 -timeout 10m -tags fault -run TestFaultPartition -v ./tests/fault/
suite "fault: injection" 25 go test -count=1 -timeout 15m -tags fault -run TestFaultInjection -v ./tests/fault/
suite "fault: ordered kills" 10 go test -count=1 -timeout 10m -tags fault -run TestFaultOrderedKills -v ./tests/fault/
suite "fault: WAL kills" 10 go test -count=1 -timeout 10m -tags fault -run TestFaultWALKills -v ./tests/fault/

echo
echo "=== make test summary"
printf '  %s\n' "${summary[@]}"
if [ "${#failed[@]}" -gt 0 ]; then
	echo "FAILED suites: ${failed[*]}"
	exit 1
fi
echo "every suite passed"
