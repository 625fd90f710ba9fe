#!/bin/bash
# Pushes of format v2 (and v1) snapshots across repositories, per cryo
# binary given: a fresh `cryo registry serve` on loopback for each, then a
# first push to a, the same memory to b, a 10%-rewritten copy to c, and
# the same three in v1. Prints wall time, the registry's CPU time and what
# each push uploaded and composed (docs/benchmarks.md, "Format v2 across
# repositories").
#
#   bash bench/compose.sh bin/cryo [/path/to/other/cryo ...]
#
# CRYO_BENCH_DIR (the images are made once there and kept), _SIZE, _KIND,
# _REWRITE and _EDIT choose other images.
set -euo pipefail
cd "$(dirname "$0")/.."
work=${CRYO_BENCH_DIR:-/tmp/cryo-compose-bench}
size=${CRYO_BENCH_SIZE:-1073741824}
kind=${CRYO_BENCH_KIND:-text}         # content of the first image: text, halfzero, random
rewrite=${CRYO_BENCH_REWRITE:-0.1}    # share of its pages the second rewrites
edit=${CRYO_BENCH_EDIT:-text}         # content of the rewritten pages
mkdir -p "$work"
img=$work/img img2=$work/img2
[ -d "$img" ] || go run ./bench/mkimage -kind "$kind" -size "$size" -seed 1 "$img"
[ -d "$img2" ] || go run ./bench/mkimage -from "$img" -rewrite "$rewrite" -indels 16 -kind "$edit" -seed 2 "$img2"
cpu() { awk '{printf "%.2f", ($14+$15)/100}' "/proc/$1/stat"; }
for bin in "$@"; do
	name=$(basename "$bin")
	root=$work/root-$name
	rm -rf "$root"
	"$bin" registry serve --root "$root" --addr 127.0.0.1:5077 --metrics-addr "" >"$work/registry-$name.log" 2>&1 &
	pid=$!
	for _ in $(seq 50); do curl -fs http://127.0.0.1:5077/v2/ >/dev/null && break; sleep 0.1; done
	for step in "v2 $img a" "v2 $img b" "v2 $img2 c" "v1 $img v1a" "v1 $img v1b" "v1 $img2 v1c"; do
		set -- $step
		c0=$(cpu $pid) t0=$(date +%s.%N)
		out=$("$bin" push --format "$1" "$2" "127.0.0.1:5077/$3:v1" 2>&1)
		t1=$(date +%s.%N) c1=$(cpu $pid)
		up=$(echo "$out" | sed -n 's/^ *uploaded *//p')
		comp=$(echo "$out" | sed -n 's/^ *composed *\([^ ]* [^ ]*\).*/\1/p')
		printf '%s\t%s %s -> %s\twall %.2f s\tregistry cpu %.2f s\tuploaded %s\tcomposed %s\n' \
			"$name" "$1" "$(basename "$2")" "$3" "$(echo "$t1 - $t0" | bc)" "$(echo "$c1 - $c0" | bc)" "$up" "${comp:-0}"
	done
	kill $pid
	wait $pid 2>/dev/null || true
done
