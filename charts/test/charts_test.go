// Package chartstest checks cryo's Helm charts: helm lint, helm template
// with the default values and every ci/*-values.yaml set, then a strict
// decode of every rendered object against the Kubernetes API types (an
// unknown or misspelt field fails), and the rules the API server or cryo
// itself would apply only at install time: Bidirectional mount propagation
// only in privileged containers, every flag given to cryo exists, the
// registry configuration parses, secrets and volumes that are referenced
// exist.
//
// It is its own Go module so that k8s.io/api stays out of cryo's go.mod.
package chartstest

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/cryo-oci/cryo/internal/testenv"
	"github.com/cryo-oci/cryo/registry"
	appsv1 "k8s.io/api/apps/v1"
	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"sigs.k8s.io/yaml"
)

// monitor is the part of the Prometheus operator's ServiceMonitor and
// PodMonitor the charts set (the operator's Go types would pull in the
// whole operator; these are checked strictly too).
type monitor struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata"`
	Spec              struct {
		Selector            metav1.LabelSelector `json:"selector"`
		Endpoints           []monitorEndpoint    `json:"endpoints,omitempty"`
		PodMetricsEndpoints []monitorEndpoint    `json:"podMetricsEndpoints,omitempty"`
	} `json:"spec"`
}

type monitorEndpoint struct {
	Port     string `json:"port"`
	Path     string `json:"path"`
	Interval string `json:"interval"`
}

// rendered is one chart rendered with one values set, decoded.
type rendered struct {
	name        string
	configMaps  []*corev1.ConfigMap
	secrets     []*corev1.Secret
	services    []*corev1.Service
	pvcs        []*corev1.PersistentVolumeClaim
	accounts    []*corev1.ServiceAccount
	deployments []*appsv1.Deployment
	daemonSets  []*appsv1.DaemonSet
	cronJobs    []*batchv1.CronJob
	pdbs        []*policyv1.PodDisruptionBudget
	monitors    []*monitor
}

func TestCharts(t *testing.T) {
	root, err := testenv.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	helm := testenv.Tool(t, "helm")
	cryo := testenv.Tool(t, "cryo")
	for _, chart := range []string{"cryo-registry", "cryo-puller"} {
		dir := filepath.Join(root, "charts", chart)
		sets, err := filepath.Glob(filepath.Join(dir, "ci", "*-values.yaml"))
		if err != nil {
			t.Fatal(err)
		}
		if len(sets) == 0 {
			t.Fatalf("%s: no ci/*-values.yaml", chart)
		}
		for _, values := range append([]string{""}, sets...) {
			name := chart + "/default"
			if values != "" {
				name = chart + "/" + strings.TrimSuffix(filepath.Base(values), "-values.yaml")
			}
			t.Run(name, func(t *testing.T) {
				args := []string{"lint", "--strict", dir}
				if values != "" {
					args = append(args, "-f", values)
				}
				if out, err := exec.Command(helm, args...).CombinedOutput(); err != nil {
					t.Fatalf("helm %s: %v\n%s", strings.Join(args, " "), err, out)
				}
				r := render(t, helm, dir, values)
				r.name = name
				checkCommon(t, r)
				checkCryoArgs(t, cryo, r)
				if chart == "cryo-registry" {
					checkRegistry(t, r)
				} else {
					checkPuller(t, r)
				}
			})
		}
	}
}

// TestChartsRefuseBadValues checks that values that cannot work fail at
// helm template time with a message naming the value.
func TestChartsRefuseBadValues(t *testing.T) {
	root, err := testenv.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	helm := testenv.Tool(t, "helm")
	for _, tc := range []struct {
		chart string
		set   []string
		want  string
	}{
		{"cryo-registry", []string{"replicaCount=2"}, "ReadWriteMany"},
		{"cryo-registry", []string{"replicaCount=2", "storage.filesystem.persistence.enabled=false"}, "shared storage"},
		{"cryo-registry", []string{"storage.type=s3"}, "storage.s3.bucket"},
		{"cryo-registry", []string{"storage.type=gcs"}, "storage.type"},
		{"cryo-registry", []string{"mirror.enabled=true"}, "mirror.remoteURL"},
		{"cryo-registry", []string{"tls.enabled=true"}, "tls.secretName"},
		{"cryo-registry", []string{"redis.enabled=true"}, "redis.addr"},
		{"cryo-registry", []string{"redis.chunkIndexAnchors=true"}, "redis.enabled"},
		{"cryo-registry", []string{"auth.htpasswd.enabled=true"}, "auth.htpasswd.existingSecret"},
		{"cryo-puller", []string{"hostPaths.cache=var/lib/cryo"}, "hostPaths.cache"},
		{"cryo-puller", []string{"cache.sizeBytes=200Gi"}, "cache.sizeBytes"},
		{"cryo-puller", []string{"api.socketGroup=docker"}, "api.socketGroup"},
		{"cryo-puller", []string{"api.maxMounts=lots"}, "api.maxMounts"},
		{"cryo-puller", []string{"peers.enabled=true"}, "peers.tokenSecret"},
	} {
		args := []string{"template", "r", filepath.Join(root, "charts", tc.chart)}
		for _, s := range tc.set {
			args = append(args, "--set", s)
		}
		out, err := exec.Command(helm, args...).CombinedOutput()
		if err == nil {
			t.Errorf("%s with %v rendered; want an error mentioning %q", tc.chart, tc.set, tc.want)
			continue
		}
		if !strings.Contains(string(out), tc.want) {
			t.Errorf("%s with %v: error does not mention %q:\n%s", tc.chart, tc.set, tc.want, out)
		}
	}
}

// render runs helm template and decodes every object strictly.
func render(t *testing.T, helm, dir, values string) *rendered {
	t.Helper()
	args := []string{"template", "rel", dir, "--namespace", "cryo"}
	if values != "" {
		args = append(args, "-f", values)
	}
	var stderr bytes.Buffer
	cmd := exec.Command(helm, args...)
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("helm %s: %v\n%s", strings.Join(args, " "), err, stderr.String())
	}
	r := &rendered{}
	for _, doc := range regexp.MustCompile(`(?m)^---\s*$`).Split(string(out), -1) {
		if strings.TrimSpace(stripComments(doc)) == "" {
			continue
		}
		var tm metav1.TypeMeta
		if err := yaml.Unmarshal([]byte(doc), &tm); err != nil {
			t.Fatalf("rendered YAML does not parse: %v\n%s", err, doc)
		}
		var obj any
		switch tm.APIVersion + "/" + tm.Kind {
		case "v1/ConfigMap":
			obj = appendNew(&r.configMaps)
		case "v1/Secret":
			obj = appendNew(&r.secrets)
		case "v1/Service":
			obj = appendNew(&r.services)
		case "v1/PersistentVolumeClaim":
			obj = appendNew(&r.pvcs)
		case "v1/ServiceAccount":
			obj = appendNew(&r.accounts)
		case "apps/v1/Deployment":
			obj = appendNew(&r.deployments)
		case "apps/v1/DaemonSet":
			obj = appendNew(&r.daemonSets)
		case "batch/v1/CronJob":
			obj = appendNew(&r.cronJobs)
		case "policy/v1/PodDisruptionBudget":
			obj = appendNew(&r.pdbs)
		case "monitoring.coreos.com/v1/ServiceMonitor", "monitoring.coreos.com/v1/PodMonitor":
			obj = appendNew(&r.monitors)
		default:
			t.Fatalf("rendered an object the test does not know: %s %s", tm.APIVersion, tm.Kind)
		}
		if err := yaml.UnmarshalStrict([]byte(doc), obj); err != nil {
			t.Fatalf("%s %s does not decode strictly: %v\n%s", tm.APIVersion, tm.Kind, err, doc)
		}
	}
	return r
}

func labelsMatch(selector, labels map[string]string) bool {
	for k, v := range selector {
		if labels[k] != v {
			return false
		}
	}
	return len(selector) > 0
}

func appendNew[T any](list *[]*T) *T {
	v := new(T)
	*list = append(*list, v)
	return v
}

func stripComments(doc string) string {
	var b strings.Builder
	for _, line := range strings.Split(doc, "\n") {
		if !strings.HasPrefix(strings.TrimSpace(line), "#") {
			b.WriteString(line + "\n")
		}
	}
	return b.String()
}

// podSpecs returns every pod template the release renders, by owner name.
func (r *rendered) podSpecs() map[string]*corev1.PodSpec {
	specs := map[string]*corev1.PodSpec{}
	for _, d := range r.deployments {
		specs["Deployment "+d.Name] = &d.Spec.Template.Spec
	}
	for _, d := range r.daemonSets {
		specs["DaemonSet "+d.Name] = &d.Spec.Template.Spec
	}
	for _, c := range r.cronJobs {
		specs["CronJob "+c.Name] = &c.Spec.JobTemplate.Spec.Template.Spec
	}
	return specs
}

// checkCommon applies rules the API server and kubelet enforce at install.
func checkCommon(t *testing.T, r *rendered) {
	t.Helper()
	secrets := map[string]map[string]bool{}
	for _, s := range r.secrets {
		keys := map[string]bool{}
		for k := range s.Data {
			keys[k] = true
		}
		secrets[s.Name] = keys
	}
	configMaps := map[string]bool{}
	for _, c := range r.configMaps {
		configMaps[c.Name] = true
	}
	for owner, spec := range r.podSpecs() {
		volumes := map[string]corev1.Volume{}
		for _, v := range spec.Volumes {
			if _, dup := volumes[v.Name]; dup {
				t.Errorf("%s: volume %s defined twice", owner, v.Name)
			}
			volumes[v.Name] = v
			if v.ConfigMap != nil && !configMaps[v.ConfigMap.Name] {
				t.Errorf("%s: volume %s refers to ConfigMap %s, which the chart does not render", owner, v.Name, v.ConfigMap.Name)
			}
		}
		for _, c := range spec.Containers {
			if c.Image == "" || strings.HasSuffix(c.Image, ":") {
				t.Errorf("%s/%s: image %q has no tag", owner, c.Name, c.Image)
			}
			for _, m := range c.VolumeMounts {
				if _, ok := volumes[m.Name]; !ok {
					t.Errorf("%s/%s: mounts volume %s, which the pod does not define", owner, c.Name, m.Name)
				}
				if m.MountPropagation != nil && *m.MountPropagation == corev1.MountPropagationBidirectional &&
					(c.SecurityContext == nil || c.SecurityContext.Privileged == nil || !*c.SecurityContext.Privileged) {
					t.Errorf("%s/%s: Bidirectional mount propagation of %s in an unprivileged container (the API server refuses it)", owner, c.Name, m.Name)
				}
			}
			for _, e := range c.Env {
				if ref := e.ValueFrom; ref != nil && ref.SecretKeyRef != nil {
					keys, rendered := secrets[ref.SecretKeyRef.Name]
					if rendered && !keys[ref.SecretKeyRef.Key] {
						t.Errorf("%s/%s: env %s wants key %s of Secret %s, which has no such key", owner, c.Name, e.Name, ref.SecretKeyRef.Key, ref.SecretKeyRef.Name)
					}
				}
			}
			for _, p := range []*corev1.Probe{c.LivenessProbe, c.ReadinessProbe} {
				if p == nil || p.HTTPGet == nil {
					continue
				}
				if !slices.ContainsFunc(c.Ports, func(cp corev1.ContainerPort) bool { return cp.Name == p.HTTPGet.Port.String() }) {
					t.Errorf("%s/%s: probe on port %s, which the container does not name", owner, c.Name, p.HTTPGet.Port.String())
				}
			}
		}
	}
	// A Service's named target ports must be ports of the pods it selects.
	for _, s := range r.services {
		var selected []*corev1.PodSpec
		for _, d := range r.deployments {
			if labelsMatch(s.Spec.Selector, d.Spec.Template.Labels) {
				selected = append(selected, &d.Spec.Template.Spec)
			}
		}
		for _, d := range r.daemonSets {
			if labelsMatch(s.Spec.Selector, d.Spec.Template.Labels) {
				selected = append(selected, &d.Spec.Template.Spec)
			}
		}
		if len(selected) == 0 {
			t.Errorf("Service %s selects no pod the chart renders", s.Name)
		}
		for _, p := range s.Spec.Ports {
			for _, spec := range selected {
				if p.TargetPort.Type == intstr.String && !slices.ContainsFunc(spec.Containers, func(c corev1.Container) bool {
					return slices.ContainsFunc(c.Ports, func(cp corev1.ContainerPort) bool { return cp.Name == p.TargetPort.StrVal })
				}) {
					t.Errorf("Service %s port %s targets %q, which no selected container names", s.Name, p.Name, p.TargetPort.StrVal)
				}
			}
		}
	}
	// Pods run as the ServiceAccount the chart creates, if it creates one.
	for _, a := range r.accounts {
		for owner, spec := range r.podSpecs() {
			if spec.ServiceAccountName != a.Name {
				t.Errorf("%s runs as %q, not the chart's ServiceAccount %s", owner, spec.ServiceAccountName, a.Name)
			}
		}
	}
}

var flagName = regexp.MustCompile(`^(--[a-z0-9-]+)`)

// checkCryoArgs checks that every flag a container passes to cryo is one
// `cryo <command> --help` lists.
func checkCryoArgs(t *testing.T, cryo string, r *rendered) {
	t.Helper()
	for owner, spec := range r.podSpecs() {
		for _, c := range spec.Containers {
			var command []string
			for _, a := range c.Args {
				if strings.HasPrefix(a, "-") {
					break
				}
				command = append(command, a)
			}
			if len(command) == 0 {
				t.Errorf("%s/%s: args %v name no cryo command", owner, c.Name, c.Args)
				continue
			}
			help, err := exec.Command(cryo, append(command, "--help")...).CombinedOutput()
			if err != nil {
				t.Errorf("%s/%s: cryo %s --help: %v\n%s", owner, c.Name, strings.Join(command, " "), err, help)
				continue
			}
			for _, a := range c.Args[len(command):] {
				m := flagName.FindString(a)
				if m == "" {
					t.Errorf("%s/%s: argument %q is not a --flag", owner, c.Name, a)
					continue
				}
				// The flag, then a space (its type or its help): not a
				// longer flag it is a prefix of.
				if !regexp.MustCompile(`(?m)^\s+(-\w, )?` + regexp.QuoteMeta(m) + `( |$)`).Match(help) {
					t.Errorf("%s/%s: cryo %s has no flag %s", owner, c.Name, strings.Join(command, " "), m)
				}
			}
		}
	}
}

func checkRegistry(t *testing.T, r *rendered) {
	t.Helper()
	if len(r.deployments) != 1 || len(r.services) != 1 || len(r.configMaps) != 1 {
		t.Fatalf("want one Deployment, Service and ConfigMap; got %d, %d, %d", len(r.deployments), len(r.services), len(r.configMaps))
	}
	d := r.deployments[0]
	cm := r.configMaps[0]
	// The configuration parses as cryo's registry would parse it.
	path := filepath.Join(t.TempDir(), "config.yml")
	if err := os.WriteFile(path, []byte(cm.Data["config.yml"]), 0o644); err != nil {
		t.Fatal(err)
	}
	cfg, err := registry.LoadConfig(path)
	if err != nil {
		t.Fatalf("rendered registry config: %v\n%s", err, cm.Data["config.yml"])
	}
	replicas := int32(1)
	if d.Spec.Replicas != nil {
		replicas = *d.Spec.Replicas
	}
	if replicas > 1 {
		if cfg.Storage.Type() == "filesystem" && (len(r.pvcs) != 1 || !slices.Contains(r.pvcs[0].Spec.AccessModes, corev1.ReadWriteMany)) {
			t.Errorf("%d replicas on filesystem storage without a ReadWriteMany volume", replicas)
		}
		if d.Spec.Strategy.Type == appsv1.RecreateDeploymentStrategyType {
			t.Error("several replicas with the Recreate strategy: every rollout is an outage")
		}
		if len(r.pdbs) != 1 {
			t.Errorf("%d replicas and %d PodDisruptionBudgets", replicas, len(r.pdbs))
		}
		if cfg.Storage["cache"]["blobdescriptor"] != "redis" {
			t.Logf("note: %d replicas without the redis blob descriptor cache", replicas)
		}
	}
	c := d.Spec.Template.Spec.Containers[0]
	if c.ReadinessProbe == nil || c.ReadinessProbe.HTTPGet == nil || c.ReadinessProbe.HTTPGet.Path != "/readyz" {
		t.Error("the registry's readiness probe is not /readyz (which fails while storage is unreachable)")
	}
	env := map[string]bool{}
	for _, e := range c.Env {
		env[e.Name] = true
	}
	if !env["REGISTRY_HTTP_SECRET"] {
		t.Error("no REGISTRY_HTTP_SECRET: replicas would sign upload state with different secrets")
	}
	if cfg.Storage.Type() == "s3" && cfg.Storage.Parameters()["accesskey"] != nil {
		t.Error("S3 access key written into the ConfigMap")
	}
	mirror := cfg.Proxy.RemoteURL != ""
	if mirror == (len(r.cronJobs) == 1) {
		t.Errorf("mirror %v with %d gc CronJobs: want gc on primaries only", mirror, len(r.cronJobs))
	}
	anchors := func(args []string) string {
		for _, a := range args {
			if v, ok := strings.CutPrefix(a, "--chunk-index-anchors="); ok {
				return v
			}
		}
		return "storage"
	}
	if anchors(c.Args) == "redis" && len(cfg.Redis.Options.Addrs) == 0 {
		t.Error("chunk index anchors in redis, but the configuration names no redis")
	}
	for _, cj := range r.cronJobs {
		gc := cj.Spec.JobTemplate.Spec.Template.Spec.Containers[0]
		if !slices.ContainsFunc(gc.Args, func(a string) bool { return strings.HasPrefix(a, "--read-only-wait=") }) {
			t.Error("gc CronJob does not put the registry in read-only mode")
		}
		if a, b := anchors(c.Args), anchors(gc.Args); a != b {
			t.Errorf("the replicas keep chunk index anchors in %s, gc prunes them in %s", a, b)
		}
		if cj.Spec.ConcurrencyPolicy != batchv1.ForbidConcurrent {
			t.Error("two gc jobs may run at once")
		}
	}
	if cfg.HTTP.TLS.Certificate != "" && c.ReadinessProbe.HTTPGet.Scheme != corev1.URISchemeHTTPS {
		t.Error("TLS registry probed over HTTP")
	}
	for _, m := range r.monitors {
		if m.Kind != "ServiceMonitor" || len(m.Spec.Endpoints) != 1 || m.Spec.Endpoints[0].Port != "metrics" {
			t.Errorf("ServiceMonitor: %+v", m)
		}
	}
	fmt.Fprintf(os.Stderr, "%s: %d replica(s), storage %s, mirror %v, %d CronJob(s)\n", r.name, replicas, cfg.Storage.Type(), mirror, len(r.cronJobs))
}

func checkPuller(t *testing.T, r *rendered) {
	t.Helper()
	if len(r.daemonSets) != 1 {
		t.Fatalf("want one DaemonSet, got %d", len(r.daemonSets))
	}
	if us := r.daemonSets[0].Spec.UpdateStrategy; us.Type == appsv1.OnDeleteDaemonSetStrategyType && us.RollingUpdate != nil {
		t.Error("updateStrategy OnDelete with rollingUpdate set (the API server refuses it)")
	}
	spec := r.daemonSets[0].Spec.Template.Spec
	c := spec.Containers[0]
	hostPaths := map[string]string{}
	for _, v := range spec.Volumes {
		if v.HostPath != nil {
			hostPaths[v.Name] = v.HostPath.Path
		}
	}
	fuse := !slices.Contains(c.Args, "--no-fuse")
	var sawFuse, sawRunBidirectional bool
	for _, m := range c.VolumeMounts {
		hp, ok := hostPaths[m.Name]
		if !ok {
			continue
		}
		// runsc on the host gets the paths the puller hands out as they are.
		if hp != m.MountPath {
			t.Errorf("host path %s mounted at %s: paths handed to runsc would not exist on the host", hp, m.MountPath)
		}
		if m.MountPath == "/dev/fuse" {
			sawFuse = true
		}
		if m.MountPropagation != nil && *m.MountPropagation == corev1.MountPropagationBidirectional {
			sawRunBidirectional = true
		}
	}
	mounts := argValue(c.Args, "--mounts")
	if !slices.ContainsFunc(c.VolumeMounts, func(m corev1.VolumeMount) bool {
		return m.MountPropagation != nil && *m.MountPropagation == corev1.MountPropagationBidirectional && strings.HasPrefix(mounts, m.MountPath+"/")
	}) && fuse {
		t.Errorf("--mounts=%s is not under a Bidirectional host path mount: runsc on the host would not see the FUSE mounts", mounts)
	}
	if fuse != sawFuse || fuse != sawRunBidirectional {
		t.Errorf("fuse %v but /dev/fuse mounted %v and Bidirectional mount %v", fuse, sawFuse, sawRunBidirectional)
	}
	sc := c.SecurityContext
	privileged := sc != nil && sc.Privileged != nil && *sc.Privileged
	if !fuse && privileged {
		t.Error("privileged without FUSE")
	}
	if fuse && (sc.Capabilities == nil || !slices.Contains(sc.Capabilities.Add, "SYS_ADMIN")) {
		t.Error("FUSE without CAP_SYS_ADMIN")
	}
	socket := argValue(c.Args, "--socket")
	if !slices.ContainsFunc(c.VolumeMounts, func(m corev1.VolumeMount) bool { return strings.HasPrefix(socket, m.MountPath+"/") }) {
		t.Errorf("--socket=%s is not on a host path: nothing on the node could reach the API", socket)
	}
	cache := argValue(c.Args, "--cache")
	if !slices.ContainsFunc(c.VolumeMounts, func(m corev1.VolumeMount) bool { return cache == m.MountPath }) {
		t.Errorf("--cache=%s is not a host path: the node cache would die with the pod", cache)
	}
	// The API socket is root's unless a group is named, by number: a name
	// would resolve in the image's /etc/group, not the node's.
	if g := argValue(c.Args, "--socket-group"); g != "" {
		if _, err := strconv.Atoi(g); err != nil {
			t.Errorf("--socket-group=%s is not a numeric GID", g)
		}
	}
	if n, err := strconv.Atoi(argValue(c.Args, "--max-mounts")); err != nil || n <= 0 {
		t.Errorf("--max-mounts=%q: want a positive number", argValue(c.Args, "--max-mounts"))
	}
	peers := checkPeers(t, r, spec, c)
	fmt.Fprintf(os.Stderr, "%s: fuse %v, privileged %v, mirrors %d, socket group %q, peers %v\n", r.name, fuse, privileged, strings.Count(strings.Join(c.Args, " "), "--mirror="), argValue(c.Args, "--socket-group"), peers)
}

// checkPeers checks a puller pool: the peer port is the container's, a
// headless Service of the DaemonSet's pods publishes it under the name
// --peers resolves, the token comes from a Secret's "token" key readable
// by root only, and TLS flags come with their files. It returns whether
// peers are on.
func checkPeers(t *testing.T, r *rendered, spec corev1.PodSpec, c corev1.Container) bool {
	t.Helper()
	listen := argValue(c.Args, "--peer-listen")
	if listen == "" {
		for _, s := range r.services {
			t.Errorf("Service %s rendered without peers", s.Name)
		}
		return false
	}
	_, port, _ := strings.Cut(listen, ":")
	if !slices.ContainsFunc(c.Ports, func(p corev1.ContainerPort) bool {
		return p.Name == "peer" && strconv.Itoa(int(p.ContainerPort)) == port
	}) {
		t.Errorf("--peer-listen=%s but no container port named peer on %s", listen, port)
	}
	peers := argValue(c.Args, "--peers")
	var svc *corev1.Service
	for _, s := range r.services {
		if labelsMatch(s.Spec.Selector, r.daemonSets[0].Spec.Template.Labels) {
			svc = s
		}
	}
	switch {
	case svc == nil:
		t.Fatal("peers without a Service selecting the pullers")
	case svc.Spec.ClusterIP != corev1.ClusterIPNone:
		t.Errorf("peer Service %s is not headless: its name would resolve to one virtual IP, not to every puller", svc.Name)
	case peers != fmt.Sprintf("dns:%s.%s.svc:%s", svc.Name, "cryo", port):
		t.Errorf("--peers=%s does not name the peer Service %s on port %s", peers, svc.Name, port)
	case len(svc.Spec.Ports) != 1 || strconv.Itoa(int(svc.Spec.Ports[0].Port)) != port || svc.Spec.Ports[0].TargetPort.StrVal != "peer":
		t.Errorf("peer Service ports %+v, want %s targeting the peer port", svc.Spec.Ports, port)
	}
	mountOf := func(file string) *corev1.Volume {
		for _, m := range c.VolumeMounts {
			if strings.HasPrefix(file, m.MountPath+"/") {
				for i, v := range spec.Volumes {
					if v.Name == m.Name {
						return &spec.Volumes[i]
					}
				}
			}
		}
		return nil
	}
	token := argValue(c.Args, "--peer-token-file")
	v := mountOf(token)
	if v == nil || v.Secret == nil {
		t.Fatalf("--peer-token-file=%s is not in a Secret volume", token)
	}
	if v.Secret.DefaultMode == nil || *v.Secret.DefaultMode&0o077 != 0 {
		t.Errorf("the pool token's volume is readable by other users than root: mode %v", v.Secret.DefaultMode)
	}
	if !slices.ContainsFunc(v.Secret.Items, func(k corev1.KeyToPath) bool { return k.Key == "token" && strings.HasSuffix(token, "/"+k.Path) }) {
		t.Errorf("--peer-token-file=%s is not the Secret's token key: %+v", token, v.Secret.Items)
	}
	tlsFlags := 0
	for _, f := range []string{"--peer-tls-cert", "--peer-tls-key", "--peer-ca"} {
		if file := argValue(c.Args, f); file != "" {
			tlsFlags++
			if v := mountOf(file); v == nil || v.Secret == nil {
				t.Errorf("%s=%s is not in a Secret volume", f, file)
			}
		}
	}
	if tlsFlags != 0 && tlsFlags != 3 {
		t.Errorf("%d of the 3 peer TLS flags set: peers could not reach each other", tlsFlags)
	}
	return true
}

func argValue(args []string, flag string) string {
	for _, a := range args {
		if v, ok := strings.CutPrefix(a, flag+"="); ok {
			return v
		}
	}
	return ""
}
