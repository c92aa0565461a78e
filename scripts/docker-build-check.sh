#!/usr/bin/env bash
# Builds the relay binary exactly as the Dockerfile does, without a Docker
# engine: it runs the Dockerfile's own `RUN ... go build ...` line (output
# redirected to a temporary directory), then checks that the binary is
# static, stripped (-ldflags "-s -w"), built with CGO off and -trimpath, and
# runs; and that the Dockerfile's final stage is distroless/static (or
# scratch) as user 65532 with ENTRYPOINT ["/outbox"] and CMD ["relay"], on a
# Go at least as new as go.mod's.
# What it cannot check: the image build itself (base image pulls, COPY
# context, layer contents).
# Under pipefail, never pipe into a reader that stops early (grep -q, head):
# the writer gets SIGPIPE (exit 141) and the pipeline fails at random. Capture
# the output first and grep the string (grep -q ... <<<"$(cmd)").
set -euo pipefail
cd "$(dirname "$0")/.."

fail() { echo "docker-build-check: $*" >&2; exit 1; }

dockerfile=Dockerfile
[ -f "$dockerfile" ] || fail "no $dockerfile at the repository root"

# The build line, exactly as the builder stage runs it.
build_lines=$(grep -cE '^RUN .*go build' "$dockerfile" || true)
[ "$build_lines" = 1 ] || fail "want exactly one 'RUN ... go build' line in $dockerfile, found $build_lines"
build=$(grep -E '^RUN .*go build' "$dockerfile" | sed 's/^RUN //')
out=$(grep -oE -- '-o [^ ]+' <<<"$build" | awk '{print $2}')
[ -n "$out" ] || fail "the go build line has no -o output path"
grep -qE "^COPY --from=build $out /outbox$" "$dockerfile" || fail "the final stage does not copy $out to /outbox"

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
bin="$tmp/outbox"
# The builder image sets no GOFLAGS and builds for its own linux platform.
env -u GOFLAGS GOOS=linux bash -c "${build//$out/$bin}"

info=$(file -b "$bin")
grep -q 'statically linked' <<<"$info" || fail "not a static binary: $info"
grep -q ', stripped' <<<"$info" || fail "not stripped: $info"
if command -v readelf >/dev/null; then
	sections=$(readelf -S "$bin")
	! grep -qE '\.(z)?debug_' <<<"$sections" || fail "the binary has DWARF sections (-w missing)"
	headers=$(readelf -l "$bin")
	! grep -q 'INTERP' <<<"$headers" || fail "the binary asks for a dynamic loader"
fi
meta=$(go version -m "$bin")
# go version -m does not record -ldflags of a -trimpath build; "stripped"
# above is what -s -w leave.
for want in 'build	CGO_ENABLED=0' 'build	-trimpath=true'; do
	grep -qF "$want" <<<"$meta" || fail "go version -m lacks '$want':
$meta"
done
usage=$("$bin" help)
grep -q '^  relay ' <<<"$usage" || fail "the binary does not list the relay command"

# The final stage.
final=$(awk '/^FROM /{stage=""} {stage=stage $0 "\n"} END{printf "%s", stage}' "$dockerfile")
grep -qE '^FROM (gcr\.io/distroless/static[^ ]*|scratch)( |$)' <<<"$final" || fail "the final stage is not distroless/static or scratch"
grep -qE '^USER 65532(:65532)?$' <<<"$final" || fail "the final stage does not run as USER 65532"
grep -qxF 'ENTRYPOINT ["/outbox"]' <<<"$final" || fail 'the final stage lacks ENTRYPOINT ["/outbox"]'
grep -qxF 'CMD ["relay"]' <<<"$final" || fail 'the final stage lacks CMD ["relay"]'

# The builder's Go is at least go.mod's.
gomod=$(awk '$1=="go"{print $2}' go.mod)
image=$(sed -nE 's/^ARG GO_VERSION=(.*)$/\1/p' "$dockerfile")
[ -n "$image" ] || fail "no ARG GO_VERSION in $dockerfile"
[ "$(printf '%s\n%s\n' "$gomod" "$image" | sort -V | sed -n 1p)" = "$gomod" ] || fail "GO_VERSION $image is older than go.mod's go $gomod"

echo "docker-build-check: ok: $(sed -n 1p <<<"$meta" | cut -f2-) static, stripped; $info" | cut -c1-200
