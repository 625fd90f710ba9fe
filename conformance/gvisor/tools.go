//go:build tools

// Package gvisor pins the gVisor version that cryo's tests, demo and
// benchmarks build runsc from. It is a separate module so that nothing of
// gVisor enters cryo's own go.mod.
package gvisor

import _ "gvisor.dev/gvisor/runsc"
