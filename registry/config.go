package registry

import (
	"bytes"
	"fmt"
	"net/url"
	"os"
	"strings"

	"github.com/distribution/distribution/v3/configuration"
	"github.com/sirupsen/logrus"
)

// DefaultAddr and DefaultRoot are the embedded default's listen address and
// filesystem storage root.
const (
	DefaultAddr = "127.0.0.1:5000"
	DefaultRoot = "./data/registry"
)

// DefaultConfig returns the embedded default: filesystem storage under root,
// deletes enabled (so snapshots can be deleted and garbage-collected),
// listening on addr. Manifests may reference layers by http(s) URL
// (non-distributable layers), which the OCI distribution spec lets clients
// push; distribution's own default refuses them with a 500.
func DefaultConfig(root, addr string) (*configuration.Configuration, error) {
	yaml := fmt.Sprintf(`version: 0.1
log:
  level: warn
  accesslog:
    disabled: true
storage:
  filesystem:
    rootdirectory: %q
  delete:
    enabled: true
  maintenance:
    uploadpurging:
      enabled: false
http:
  addr: %q
validation:
  manifests:
    urls:
      allow:
        - '^https?://'
`, root, addr)
	return parseConfig([]byte(yaml), "embedded default")
}

// LoadConfig reads a distribution YAML configuration file, as the stock
// registry does (REGISTRY_* environment variables override it), and checks
// what distribution would otherwise only find by panicking.
func LoadConfig(path string) (*configuration.Configuration, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("read registry config: %w", err)
	}
	return parseConfig(data, path)
}

func parseConfig(data []byte, name string) (*configuration.Configuration, error) {
	cfg, err := configuration.Parse(bytes.NewReader(data))
	if err != nil {
		return nil, fmt.Errorf("registry config %s: %w", name, err)
	}
	if err := validate(cfg); err != nil {
		return nil, fmt.Errorf("registry config %s: %w", name, err)
	}
	return cfg, nil
}

// SetMirrorOf turns cfg into a pull-through cache of the registry at
// remote (distribution's proxy mode). Such a registry refuses pushes.
func SetMirrorOf(cfg *configuration.Configuration, remote string) error {
	u, err := url.Parse(remote)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return fmt.Errorf("--mirror-of %q: want an http:// or https:// registry URL", remote)
	}
	cfg.Proxy.RemoteURL = strings.TrimSuffix(remote, "/")
	return nil
}

// validate checks the settings that distribution's NewApp panics on.
func validate(cfg *configuration.Configuration) error {
	if cfg.Storage.Type() == "" {
		return fmt.Errorf("no storage driver configured")
	}
	if cfg.HTTP.Addr == "" {
		return fmt.Errorf("http.addr is empty")
	}
	if cfg.Proxy.RemoteURL != "" {
		if err := SetMirrorOf(cfg, cfg.Proxy.RemoteURL); err != nil {
			return err
		}
	}
	if (cfg.HTTP.TLS.Certificate == "") != (cfg.HTTP.TLS.Key == "") {
		return fmt.Errorf("http.tls needs both certificate and key")
	}
	return nil
}

// ConfigureLogging applies cfg's log level to distribution's logger (logrus,
// which is process-wide). The stock registry does this in its own main;
// an embedding program must do it itself.
func ConfigureLogging(cfg *configuration.Configuration) error {
	level := string(cfg.Log.Level)
	if level == "" {
		level = "info"
	}
	l, err := logrus.ParseLevel(level)
	if err != nil {
		return fmt.Errorf("log.level %q: %w", level, err)
	}
	logrus.SetLevel(l)
	if cfg.Log.Formatter == "json" {
		logrus.SetFormatter(&logrus.JSONFormatter{})
	}
	return nil
}
