package main

import (
	"fmt"
	"io"
	"os"
	"strings"

	"github.com/cryo-oci/cryo/transfer"
	"github.com/spf13/cobra"
	"oras.land/oras-go/v2/registry/remote"
)

// credentialFlags says which credential flags a command offers.
type credentialFlags int

const (
	// withCredentials: -u, -p, --password-stdin, --password-file.
	withCredentials credentialFlags = iota
	// noPasswordStdin: as withCredentials without --password-stdin, for
	// commands whose stdin is not theirs (cryo restore: the container's).
	noPasswordStdin
	// noCredentials: none (cryo puller serve, which mounts references its
	// clients name: a password given to it would go wherever they point).
	noCredentials
)

// maxPasswordBytes bounds what --password-stdin and --password-file read.
const maxPasswordBytes = 64 << 10

// remoteOptions are the flags of every command that talks to a registry.
type remoteOptions struct {
	plainHTTP, insecure bool
	username, password  string
	passwordStdin       bool
	passwordFile        string
	caFile              string
	cmd                 *cobra.Command
	// secret is the password read from stdin or a file, once.
	secret *string
}

func (o *remoteOptions) register(cmd *cobra.Command) { o.registerWith(cmd, withCredentials) }

func (o *remoteOptions) registerWith(cmd *cobra.Command, creds credentialFlags) {
	o.cmd = cmd
	f := cmd.Flags()
	f.BoolVar(&o.plainHTTP, "plain-http", false, "talk HTTP instead of HTTPS (default for localhost and 127.0.0.1)")
	f.StringVar(&o.caFile, "ca-file", "", "PEM file of CA certificates to trust for the registry's TLS certificate, besides the system's")
	f.BoolVar(&o.insecure, "insecure", false, "do not verify the registry's TLS certificate (testing only)")
	if creds == noCredentials {
		return
	}
	f.StringVarP(&o.username, "username", "u", "", "user name for the registry the reference names (default: Docker's credential store); never sent to a mirror")
	f.StringVarP(&o.password, "password", "p", "", "password or token for the registry the reference names (insecure: other users see it in the process list; prefer --password-file or --password-stdin)")
	f.StringVar(&o.passwordFile, "password-file", "", "read the password or token from this file (trailing newline dropped)")
	if creds == withCredentials {
		f.BoolVar(&o.passwordStdin, "password-stdin", false, "read the password or token from standard input")
	}
}

// secretPassword returns the password from -p, --password-stdin or
// --password-file (at most one), reading stdin or the file once. -p
// prints a warning, as docker does.
func (o *remoteOptions) secretPassword() (string, error) {
	if o.secret != nil {
		return *o.secret, nil
	}
	n := 0
	for _, set := range []bool{o.password != "", o.passwordStdin, o.passwordFile != ""} {
		if set {
			n++
		}
	}
	if n > 1 {
		return "", fmt.Errorf("give the password one way: --password, --password-stdin or --password-file")
	}
	var pw string
	switch {
	case o.password != "":
		hint := "--password-stdin"
		if o.cmd != nil && o.cmd.Flags().Lookup("password-stdin") == nil {
			hint = "--password-file"
		}
		if o.cmd != nil {
			fmt.Fprintf(o.cmd.ErrOrStderr(), "WARNING! Using --password via the CLI is insecure. Use %s.\n", hint)
		}
		pw = o.password
	case o.passwordStdin:
		var in io.Reader = os.Stdin
		if o.cmd != nil {
			in = o.cmd.InOrStdin()
		}
		data, err := io.ReadAll(io.LimitReader(in, maxPasswordBytes))
		if err != nil {
			return "", fmt.Errorf("read password from stdin: %w", err)
		}
		pw = strings.TrimRight(string(data), "\r\n")
		if pw == "" {
			return "", fmt.Errorf("--password-stdin: standard input holds no password")
		}
	case o.passwordFile != "":
		data, err := os.ReadFile(o.passwordFile)
		if err != nil {
			return "", fmt.Errorf("--password-file: %w", err)
		}
		if len(data) > maxPasswordBytes {
			return "", fmt.Errorf("--password-file %s: over %d bytes", o.passwordFile, maxPasswordBytes)
		}
		pw = strings.TrimRight(string(data), "\r\n")
		if pw == "" {
			return "", fmt.Errorf("--password-file %s is empty", o.passwordFile)
		}
	}
	o.secret = &pw
	return pw, nil
}

// clientOptions are the options for a client whose explicit credentials
// (if any) go to the registry ref names and nowhere else.
func (o *remoteOptions) clientOptions(ref string) (transfer.ClientOptions, error) {
	opts := o.connOptions()
	pw, err := o.secretPassword()
	if err != nil {
		return opts, err
	}
	if o.username == "" && pw == "" {
		return opts, nil
	}
	parsed, err := transfer.ParseReference(ref)
	if err != nil {
		return opts, err
	}
	opts.Username, opts.Password, opts.CredentialHost = o.username, pw, parsed.Registry
	return opts, nil
}

// connOptions are the options that say how to connect, without credentials.
func (o *remoteOptions) connOptions() transfer.ClientOptions {
	opts := transfer.ClientOptions{CAFile: o.caFile, Insecure: o.insecure}
	if o.cmd != nil && o.cmd.Flags().Changed("plain-http") {
		opts.PlainHTTP = &o.plainHTTP
	}
	return opts
}

// client returns a client whose explicit credentials go to ref's registry only.
func (o *remoteOptions) client(ref string) (*transfer.Client, error) {
	opts, err := o.clientOptions(ref)
	if err != nil {
		return nil, err
	}
	return transfer.NewClient(opts)
}

func (o *remoteOptions) repository(ref string) (*remote.Repository, string, error) {
	c, err := o.client(ref)
	if err != nil {
		return nil, "", err
	}
	return c.Repository(ref)
}
