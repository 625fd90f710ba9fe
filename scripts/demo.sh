#!/usr/bin/env bash
# The cryo demo: the whole story on one machine, in a few minutes.
#
#   1. start cryo's registry (embedded default, loopback);
#   2. run a Python app holding DEMO_MEM_MIB MiB of random memory in gVisor
#      (runsc --platform=systrap --network=none --ignore-cgroups, root
#      filesystem from the host, read-only);
#   3. runsc checkpoint it, cryo push the image dir;
#   4. delete the local image dir (and there is no node cache yet);
#   5. cryo restore it from the registry through the node puller;
#   6. print how long until the app ran again and until every page was
#      local, the bytes moved, and whether its memory hash is unchanged.
#
# Needs root and bin/runsc (built by `make runsc`). Cleans up after itself:
# containers, mounts, runsc's null-netns mount, processes, files.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BIN="$REPO/bin"
MEM_MIB=${DEMO_MEM_MIB:-512}
PYTHON=${DEMO_PYTHON:-/usr/bin/python3}
ID=cryo-demo

die() { echo "demo: $*" >&2; exit 1; }
[[ $(id -u) == 0 ]] || die "runsc needs root; run as root (sudo make demo)"
[[ -x "$BIN/runsc" && -x "$BIN/cryo" ]] || die "missing bin/runsc or bin/cryo (make build runsc)"
[[ -x "$PYTHON" ]] || die "no $PYTHON (set DEMO_PYTHON)"

WORK=$(mktemp -d /var/tmp/cryo-demo.XXXXXX)
STATE="$WORK/state" BUNDLE="$WORK/bundle" IMG="$WORK/img" CACHE="$WORK/cache"
RUNSC=("$BIN/runsc" --root="$STATE" --platform=systrap --network=none --ignore-cgroups)
REG_PID=""

cleanup() {
	set +e
	"${RUNSC[@]}" delete --force "$ID" >/dev/null 2>&1
	[[ -n "$REG_PID" ]] && kill "$REG_PID" 2>/dev/null && wait "$REG_PID" 2>/dev/null
	while mountpoint -q "$STATE/null-netns" 2>/dev/null; do umount "$STATE/null-netns" || break; done
	grep -F "$WORK" /proc/mounts | awk '{print $2}' | sort -r | xargs -r -n1 umount -l 2>/dev/null
	rm -rf "$WORK"
}
trap cleanup EXIT

free_port() { "$PYTHON" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
PORT=$(free_port) MPORT=$(free_port)
REG="127.0.0.1:$PORT"

echo "== 1. registry on $REG (storage under $WORK/registry)"
"$BIN/cryo" registry serve --root "$WORK/registry" --addr "$REG" --metrics-addr "127.0.0.1:$MPORT" >"$WORK/registry.log" 2>&1 &
REG_PID=$!
for _ in $(seq 100); do curl -sf "http://$REG/v2/" >/dev/null && break; sleep 0.05; done

mkdir -p "$BUNDLE" "$STATE"
cat >"$WORK/app.py" <<'PY'
import hashlib, os, signal, sys, time
buf = bytearray(os.urandom(int(sys.argv[1]) << 20))
def out(s): os.write(1, (s + "\n").encode())
want = [True]
signal.signal(signal.SIGUSR1, lambda *a: want.__setitem__(0, True))
count = 0
while True:
    if want[0]:
        want[0] = False
        out("hash " + hashlib.sha256(buf).hexdigest())
    count += 1
    out("count %d" % count)
    time.sleep(0.2)
PY
cat >"$BUNDLE/config.json" <<JSON
{
  "ociVersion": "1.0.0",
  "process": {
    "user": {"uid": 0, "gid": 0},
    "args": ["$PYTHON", "-u", "-I", "-c", $("$PYTHON" -c 'import json,sys; print(json.dumps(open(sys.argv[1]).read()))' "$WORK/app.py"), "$MEM_MIB"],
    "env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME=/"],
    "cwd": "/",
    "capabilities": {"bounding": ["CAP_KILL"], "effective": ["CAP_KILL"], "inheritable": ["CAP_KILL"], "permitted": ["CAP_KILL"]}
  },
  "root": {"path": "/", "readonly": true},
  "hostname": "cryo-demo",
  "mounts": [
    {"destination": "/proc", "type": "proc", "source": "proc"},
    {"destination": "/dev", "type": "tmpfs", "source": "tmpfs"},
    {"destination": "/sys", "type": "sysfs", "source": "sysfs", "options": ["nosuid", "noexec", "nodev", "ro"]}
  ],
  "linux": {"namespaces": [{"type": "pid"}, {"type": "network"}, {"type": "ipc"}, {"type": "uts"}, {"type": "mount"}]}
}
JSON

# wait_line FILE REGEX TIMEOUT_S: the first line of FILE (NUL bytes
# stripped: a restored app writes at its old offset) matching REGEX.
wait_line() {
	local deadline=$((SECONDS + $3)) line
	while ((SECONDS < deadline)); do
		line=$(tr -d '\000' <"$1" 2>/dev/null | grep -E -m1 "$2" || true)
		[[ -n "$line" ]] && { echo "$line"; return 0; }
		sleep 0.01
	done
	die "no line matching '$2' in $1 after $3 s"
}
now_ms() { date +%s%3N; }

echo "== 2. run a Python app with $MEM_MIB MiB of random memory in gVisor"
"${RUNSC[@]}" run --detach --bundle "$BUNDLE" "$ID" >"$WORK/out1.log" 2>"$WORK/err1.log"
HASH1=$(wait_line "$WORK/out1.log" '^hash ' 120 | cut -d' ' -f2)
wait_line "$WORK/out1.log" '^count 3$' 30 >/dev/null
echo "   memory hash $HASH1"

echo "== 3. checkpoint and push"
"${RUNSC[@]}" checkpoint --image-path="$IMG" "$ID"
LAST=$(tr -d '\000' <"$WORK/out1.log" | grep -E '^count' | tail -1 | cut -d' ' -f2)
"${RUNSC[@]}" delete --force "$ID" >/dev/null 2>&1 || true
SIZE=$(du -sb --apparent-size "$IMG" | cut -f1)
"$BIN/cryo" push --json "$IMG" "$REG/demo:v1" >"$WORK/push.json"
UPLOADED=$("$PYTHON" -c 'import json,sys; print(json.load(open(sys.argv[1]))["stats"]["uploadedBytes"])' "$WORK/push.json")
echo "   image dir $SIZE bytes, uploaded $UPLOADED bytes, last count before checkpoint: $LAST"

echo "== 4. delete the local image (the node cache is empty)"
rm -rf "$IMG"

echo "== 5. cryo restore from the registry"
blob_bytes() { curl -s "http://127.0.0.1:$MPORT/metrics" | awk '/^cryo_registry_response_bytes_total\{kind="blob"\}/ {print $2}'; }
B0=$(blob_bytes)
T0=$(now_ms)
"$BIN/cryo" restore --cache "$CACHE" --runsc "$BIN/runsc" \
	--runsc-flag=--root="$STATE" --runsc-flag=--platform=systrap --runsc-flag=--network=none --runsc-flag=--ignore-cgroups \
	"$REG/demo:v1" --bundle "$BUNDLE" "$ID" >"$WORK/out2.log" 2>"$WORK/restore.log" &
RESTORE_PID=$!
NEXT=$(wait_line "$WORK/out2.log" '^count ' 120 | cut -d' ' -f2)
T_RUN=$(( $(now_ms) - T0 ))
wait "$RESTORE_PID" || { cat "$WORK/restore.log" >&2; die "cryo restore failed"; }
T_LOADED=$(( $(now_ms) - T0 ))
B1=$(blob_bytes)
sed 's/^/   /' "$WORK/restore.log"

echo "== 6. memory check"
"${RUNSC[@]}" kill "$ID" USR1
sleep 0.5
# No hash line yet is not an error (pipefail): wait for it below.
HASH2=$(tr -d '\000' <"$WORK/out2.log" | grep -E '^hash ' | tail -1 | cut -d' ' -f2 || true)
[[ -n "$HASH2" ]] || HASH2=$(wait_line "$WORK/out2.log" '^hash ' 10 | cut -d' ' -f2)
SAME=no; [[ "$HASH2" == "$HASH1" ]] && SAME=yes

printf '\n| what | value |\n|---|---|\n'
printf '| snapshot size (image dir) | %s MiB |\n' $((SIZE >> 20))
printf '| bytes pushed | %s MiB |\n' $((UPLOADED >> 20))
printf '| bytes moved on restore (registry blob bytes served) | %s MiB |\n' "$("$PYTHON" -c 'import sys; print(int((float(sys.argv[2]) - float(sys.argv[1])) / 2**20))' "${B0:-0}" "${B1:-0}")"
printf '| time until the app ran again (next output line) | %s ms |\n' "$T_RUN"
printf '| time until fully loaded (cryo restore returned) | %s ms |\n' "$T_LOADED"
printf '| app continued | last count %s before checkpoint, next %s after restore |\n' "$LAST" "$NEXT"
printf '| memory hash unchanged | %s |\n' "$SAME"
[[ "$SAME" == yes && "$NEXT" == $((LAST + 1)) ]] || die "the restored app lost state"
