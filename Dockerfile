# The relay daemon as a static binary on a distroless base, running as
# nonroot (65532). Build: docker build -t outbox . ; run: docker run outbox
# (CMD relay, configured by OUTBOX_* variables; see README.md).
# scripts/docker-build-check.sh runs this file's `go build` line as is and
# checks the binary is static, without a Docker engine.

ARG GO_VERSION=1.26.8

FROM golang:${GO_VERSION} AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
RUN CGO_ENABLED=0 go build -trimpath -ldflags "-s -w" -o /out/outbox ./cmd/outbox

FROM gcr.io/distroless/static-debian12:nonroot
COPY --from=build /out/outbox /outbox
USER 65532:65532
ENTRYPOINT ["/outbox"]
CMD ["relay"]
