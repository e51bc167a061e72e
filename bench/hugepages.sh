# Sourced by the benchmarks: fio's I/O buffers in huge pages, so that the anchors'
# speed does not depend on where the allocator's pages happen to lie.
#
# Why: a 1 MiB O_DIRECT read reaches the disk as one request only if its buffer is
# physically contiguous enough. A loop device takes at most 128 segments of up to
# 64 KiB, so 1 MiB of scattered 4 KiB pages goes out as two 512 KiB requests; a virtio
# disk without indirect descriptors (this machine's) takes one ring descriptor per
# segment. With fio's default buffer (malloc) the loop-on-raw anchor moved between
# ~1.1 and ~2.1 GB/s from round to round with the size of its disk reads (405 or 635
# KiB on average), and so did the merge's fio bandwidth (1.0 or 2.2 GB/s): a 2x swing
# in the reference that no change of ours could explain (bench/results/serve.md). From a huge page every fio request goes out whole: the anchor is its
# fast, steady case.
#
# huge_on DIR: reserves HUGE_PAGES (default 8) more 2 MiB pages, mounts hugetlbfs on
# DIR and sets FIO_MEM to fio's option for it; without root or memory FIO_MEM stays
# empty (fio's default buffers) and a note says so. huge_off undoes both.
FIO_MEM=()
HUGE_DIR=""
HUGE_WAS=""
huge_on() {
	local dir=$1 want
	HUGE_WAS=$(cat /proc/sys/vm/nr_hugepages 2>/dev/null || echo "")
	[ -n "$HUGE_WAS" ] && [ -w /proc/sys/vm/nr_hugepages ] || { echo "note: fio buffers not in huge pages (no access to nr_hugepages)" >&2; HUGE_WAS=""; return 0; }
	want=$((HUGE_WAS + ${HUGE_PAGES:-8}))
	echo "$want" >/proc/sys/vm/nr_hugepages
	mkdir -p "$dir"
	if [ "$(cat /proc/sys/vm/nr_hugepages)" -lt "$want" ] || ! mount -t hugetlbfs -o pagesize=2M none "$dir"; then
		echo "note: fio buffers not in huge pages (could not reserve or mount them)" >&2
		echo "$HUGE_WAS" >/proc/sys/vm/nr_hugepages
		HUGE_WAS=""
		return 0
	fi
	HUGE_DIR=$dir
	FIO_MEM=("--mem=mmaphuge:$dir/fio")
}
huge_off() {
	if [ -n "$HUGE_DIR" ]; then
		rm -f "$HUGE_DIR/fio"
		umount "$HUGE_DIR" 2>/dev/null || true
		HUGE_DIR=""
	fi
	if [ -n "$HUGE_WAS" ]; then
		echo "$HUGE_WAS" >/proc/sys/vm/nr_hugepages || true
		HUGE_WAS=""
	fi
	FIO_MEM=()
}
