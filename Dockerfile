# The cryo image the Helm charts run (registry, gc job and node puller are
# all this one static binary). Build: docker build -t <registry>/cryo:<tag> .
FROM golang:1.26 AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
RUN CGO_ENABLED=0 go build -trimpath -o /out/cryo ./cmd/cryo
# cryo's gVisor checkpoint gofer, of the gVisor release cryo pins (its own
# module: gVisor stays out of cryo's go.mod); beside cryo, where cryo
# restore and cryo checkpoint look for it, and where puller serve
# --install-gofer copies it from.
RUN cd checkpointgofer && CGO_ENABLED=0 go build -trimpath \
      -ldflags "-X gvisor.dev/gvisor/runsc/version.version=$(go list -m -f '{{.Version}}' gvisor.dev/gvisor)" \
      -o /out/cryo-gofer/checkpointgofer .

# distroless/static: CA certificates and a passwd with the nonroot user
# (65532) the registry chart runs as; the puller chart runs it as root.
FROM gcr.io/distroless/static-debian12:nonroot
COPY --from=build /out/cryo /usr/local/bin/cryo
COPY --from=build /out/cryo-gofer/checkpointgofer /usr/local/bin/cryo-gofer/checkpointgofer
ENTRYPOINT ["/usr/local/bin/cryo"]
