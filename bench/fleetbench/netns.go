package main

import (
	"fmt"
	"os"
	"os/exec"
	"regexp"
	"strconv"
	"strings"
)

// network is the benchmark's own network: a switch namespace holding a
// bridge, the registry's namespace behind a link shaped with tbf (its
// egress: what it serves), and a namespace per node, each joined to the
// bridge by a veth pair. Nothing is added to the caller's namespace, so
// no traffic leaves the namespaces made here.
type network struct {
	prefix string
	nodes  int
	// made are the namespaces created, removed by close.
	made []string
}

// Addresses on the benchmark's network.
const (
	registryIP = "10.77.0.1"
	netmask    = "/16"
)

// nodeIP is the address of node i.
func nodeIP(i int) string { return fmt.Sprintf("10.77.%d.%d", 1+i/250, 1+i%250) }

func (n *network) ns(name string) string { return n.prefix + name }

// registryNS and nodeNS name the namespaces.
func (n *network) registryNS() string  { return n.ns("reg") }
func (n *network) nodeNS(i int) string { return n.ns(fmt.Sprintf("n%d", i)) }

// run runs a command (ip, tc) and returns its output in the error.
func run(name string, args ...string) error {
	out, err := exec.Command(name, args...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("%s %s: %v: %s", name, strings.Join(args, " "), err, strings.TrimSpace(string(out)))
	}
	return nil
}

// newNetwork makes the namespaces of a registry and nodes nodes, the
// registry's egress shaped to rate (a tbf rate, e.g. "200mbit").
func newNetwork(prefix string, nodes int, rate string) (_ *network, err error) {
	n := &network{prefix: prefix, nodes: nodes}
	defer func() {
		if err != nil {
			n.close()
		}
	}()
	sw := n.ns("sw")
	if err := n.add(sw); err != nil {
		return nil, err
	}
	if err := run("ip", "-n", sw, "link", "add", "br0", "type", "bridge"); err != nil {
		return nil, err
	}
	if err := run("ip", "-n", sw, "link", "set", "br0", "up"); err != nil {
		return nil, err
	}
	join := func(ns, port, addr string) error {
		if err := n.add(ns); err != nil {
			return err
		}
		steps := [][]string{
			{"ip", "link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", port, "netns", sw},
			{"ip", "-n", sw, "link", "set", port, "master", "br0", "up"},
			{"ip", "-n", ns, "addr", "add", addr + netmask, "dev", "eth0"},
			{"ip", "-n", ns, "link", "set", "eth0", "up"},
			{"ip", "-n", ns, "link", "set", "lo", "up"},
		}
		for _, s := range steps {
			if err := run(s[0], s[1:]...); err != nil {
				return err
			}
		}
		return nil
	}
	if err := join(n.registryNS(), "vreg", registryIP); err != nil {
		return nil, err
	}
	// The registry's link: tbf on its egress, with about 50 ms of queue.
	if err := run("tc", "-n", n.registryNS(), "qdisc", "add", "dev", "eth0", "root", "tbf", "rate", rate, "burst", "256kb", "latency", "50ms"); err != nil {
		return nil, fmt.Errorf("shape the registry's link (needs the kernel's tbf): %w", err)
	}
	for i := range nodes {
		if err := join(n.nodeNS(i), fmt.Sprintf("v%d", i), nodeIP(i)); err != nil {
			return nil, err
		}
	}
	return n, nil
}

func (n *network) add(ns string) error {
	if err := run("ip", "netns", "add", ns); err != nil {
		return err
	}
	n.made = append(n.made, ns)
	return nil
}

// close removes every namespace made (and so their links).
func (n *network) close() {
	for i := len(n.made) - 1; i >= 0; i-- {
		if err := run("ip", "netns", "del", n.made[i]); err != nil {
			fmt.Fprintln(os.Stderr, "fleetbench:", err)
		}
	}
	n.made = nil
}

// removeStale removes the namespaces an earlier run with prefix left.
func removeStale(prefix string) {
	out, err := exec.Command("ip", "netns", "list").Output()
	if err != nil {
		return
	}
	for _, line := range strings.Split(string(out), "\n") {
		if f := strings.Fields(line); len(f) > 0 && strings.HasPrefix(f[0], prefix) {
			run("ip", "netns", "del", f[0])
		}
	}
}

var sentRE = regexp.MustCompile(`Sent (\d+) bytes`)

// registrySent returns the bytes the registry's link has sent so far.
func (n *network) registrySent() (int64, error) {
	out, err := exec.Command("tc", "-n", n.registryNS(), "-s", "qdisc", "show", "dev", "eth0").Output()
	if err != nil {
		return 0, fmt.Errorf("tc -s qdisc show: %w", err)
	}
	m := sentRE.FindSubmatch(out)
	if m == nil {
		return 0, fmt.Errorf("no byte count in %q", out)
	}
	return strconv.ParseInt(string(m[1]), 10, 64)
}
