package main

import (
	"github.com/cryo-oci/cryo/transfer"
	"github.com/spf13/cobra"
	"oras.land/oras-go/v2/registry/remote"
)

// remoteOptions are the flags of every command that talks to a registry.
type remoteOptions struct {
	plainHTTP, insecure bool
	username, password  string
	caFile              string
	cmd                 *cobra.Command
}

func (o *remoteOptions) register(cmd *cobra.Command) {
	o.cmd = cmd
	f := cmd.Flags()
	f.BoolVar(&o.plainHTTP, "plain-http", false, "talk HTTP instead of HTTPS (default for localhost and 127.0.0.1)")
	f.StringVarP(&o.username, "username", "u", "", "registry user name (default: Docker's credential store)")
	f.StringVarP(&o.password, "password", "p", "", "registry password or token (default: Docker's credential store)")
	f.StringVar(&o.caFile, "ca-file", "", "PEM file of CA certificates to trust for the registry's TLS certificate, besides the system's")
	f.BoolVar(&o.insecure, "insecure", false, "do not verify the registry's TLS certificate (testing only)")
}

func (o *remoteOptions) clientOptions() transfer.ClientOptions {
	opts := transfer.ClientOptions{Username: o.username, Password: o.password, CAFile: o.caFile, Insecure: o.insecure}
	if o.cmd != nil && o.cmd.Flags().Changed("plain-http") {
		opts.PlainHTTP = &o.plainHTTP
	}
	return opts
}

func (o *remoteOptions) repository(ref string) (*remote.Repository, string, error) {
	return transfer.Repository(ref, o.clientOptions())
}
