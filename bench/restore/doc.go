// Package restore is the end-to-end restore benchmark (make bench-restore):
// real gVisor sandboxes restored from a local image dir, from an `oras pull`
// of the whole image, and through cryo, on loopback and on shaped links
// (testenv.Proxy).
package restore
