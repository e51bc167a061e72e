# Sourced by the benchmarks and studies in bench/: what each of them needs.
# shellcheck shell=bash

# median: the median of the numbers on stdin (one per line).
median() { sort -g | awk '{v[NR] = $1} END {if (NR % 2) print v[(NR + 1) / 2]; else print (v[NR / 2] + v[NR / 2 + 1]) / 2}'; }

# cold: nothing of any file in the page cache.
cold() { sync; echo 3 >/proc/sys/vm/drop_caches; }

# need_vabc: sets VABC, building the release binary unless VABC is set already.
need_vabc() {
	if [ -z "${VABC:-}" ]; then
		cargo build --release -q --manifest-path "$ROOT/Cargo.toml" -p vabc
		VABC=$ROOT/target/release/vabc
	fi
}

# machine: one line saying what this machine is.
machine() {
	echo "$(nproc) CPUs ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)), $(free -g | awk '/Mem:/ {print $2}') GiB, Linux $(uname -r)"
}

# check_number WHAT VALUE: exits with an error naming WHAT unless VALUE is a
# positive decimal number, so that an empty or failed measurement stops the
# benchmark instead of becoming a 0 (or a bc syntax error) in its table.
check_number() {
	if ! [[ $2 =~ ^[0-9]*\.?[0-9]+$ ]] || [ "$(echo "$2 > 0" | bc -l)" != 1 ]; then
		echo "bench: $1 is '$2', not a measurement; stopping" >&2
		exit 1
	fi
}

# record_results NAME FILE [AREA]: appends FILE to bench/results/AREA.md (default:
# NAME's area, read-path for the studies) unless RECORD=0; the verdict table in
# bench/RESULTS.md is edited by hand from it.
record_results() {
	if [ "${RECORD:-1}" != 0 ]; then
		local area=${3:-read-path}
		printf '\n' >>"$ROOT/bench/results/$area.md"
		cat "$2" >>"$ROOT/bench/results/$area.md"
		echo "$1: appended to bench/results/$area.md" >&2
	fi
}
