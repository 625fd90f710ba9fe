package main

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"regexp"
	"runtime"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"
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
	if err := n.staticNeighbours(); err != nil {
		return nil, err
	}
	return n, nil
}

// staticNeighbours gives every namespace a permanent neighbour entry for
// every other: the kernel's neighbour table is shared by all namespaces
// (gc_thresh3, 1024 entries by default), and 33 namespaces that each
// resolve 32 others overflow it, which drops connection attempts for
// seconds ("neighbor table overflow!"). Permanent entries do not count.
func (n *network) staticNeighbours() error {
	type host struct{ ns, ip, mac string }
	hosts := []host{{ns: n.registryNS(), ip: registryIP}}
	for i := range n.nodes {
		hosts = append(hosts, host{ns: n.nodeNS(i), ip: nodeIP(i)})
	}
	for i := range hosts {
		out, err := exec.Command("ip", "-n", hosts[i].ns, "-j", "link", "show", "eth0").Output()
		if err != nil {
			return fmt.Errorf("ip -n %s link show eth0: %w", hosts[i].ns, err)
		}
		var links []struct {
			Address string `json:"address"`
		}
		if err := json.Unmarshal(out, &links); err != nil || len(links) != 1 {
			return fmt.Errorf("ip -n %s link show eth0: %q: %v", hosts[i].ns, out, err)
		}
		hosts[i].mac = links[0].Address
	}
	for _, h := range hosts {
		var batch strings.Builder
		for _, o := range hosts {
			if o.ns != h.ns {
				fmt.Fprintf(&batch, "neigh replace %s lladdr %s dev eth0 nud permanent\n", o.ip, o.mac)
			}
		}
		cmd := exec.Command("ip", "-n", h.ns, "-batch", "-")
		cmd.Stdin = strings.NewReader(batch.String())
		if out, err := cmd.CombinedOutput(); err != nil {
			return fmt.Errorf("ip -n %s -batch (neighbours): %v: %s", h.ns, err, out)
		}
	}
	return nil
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

// dialIn connects to addr from inside namespace ns: the socket belongs to
// the namespace it was made in, so it is made on a thread moved there and
// back (which is locked to this goroutine meanwhile).
func dialIn(ns, addr string) (net.Conn, error) {
	type result struct {
		c   net.Conn
		err error
	}
	ch := make(chan result, 1)
	go func() {
		// Unlocked only once back in the host namespace: a thread left in
		// the other one dies with this goroutine (Goexit while locked).
		runtime.LockOSThread()
		self, err := os.Open("/proc/thread-self/ns/net")
		if err != nil {
			runtime.UnlockOSThread()
			ch <- result{nil, err}
			return
		}
		defer self.Close()
		target, err := os.Open("/run/netns/" + ns)
		if err != nil {
			runtime.UnlockOSThread()
			ch <- result{nil, err}
			return
		}
		defer target.Close()
		if err := unix.Setns(int(target.Fd()), unix.CLONE_NEWNET); err != nil {
			runtime.UnlockOSThread()
			ch <- result{nil, fmt.Errorf("setns %s: %w", ns, err)}
			return
		}
		c, err := net.DialTimeout("tcp", addr, 5*time.Second)
		if serr := unix.Setns(int(self.Fd()), unix.CLONE_NEWNET); serr != nil {
			if c != nil {
				c.Close()
			}
			ch <- result{nil, fmt.Errorf("setns back from %s: %w", ns, serr)}
			runtime.Goexit() // the deferred closes run; the thread goes
		}
		runtime.UnlockOSThread()
		ch <- result{c, err}
	}()
	r := <-ch
	return r.c, r.err
}

// registryBlobBytes reads the blob bytes the registry has served so far
// from its metrics (cryo_registry_response_bytes_total{kind="blob"}).
func (n *network) registryBlobBytes() (int64, error) {
	client := &http.Client{Transport: &http.Transport{DialContext: func(context.Context, string, string) (net.Conn, error) {
		return dialIn(n.registryNS(), registryIP+":5001")
	}}, Timeout: 10 * time.Second}
	defer client.CloseIdleConnections()
	v, err := sumMetric(client, "http://"+registryIP+":5001/metrics", `cryo_registry_response_bytes_total{kind="blob"}`)
	return int64(v), err
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
