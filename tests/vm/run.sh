#!/usr/bin/env bash
# Run one command in a fresh guest on a stock Debian kernel and return its output
# (the guest's console, on stdout) and its exit status.
#
#   tests/vm/run.sh [options] [--] COMMAND [ARG...]
#     --share PATH[:rw]  share a host folder into the guest at the same path
#                        (read-only unless :rw); the project root and the current
#                        folder are always shared read-only
#     --disk FILE[,OPTS] attach FILE as a virtio disk (/dev/vda, /dev/vdb, ...);
#                        OPTS are QEMU -drive options (default cache=writeback)
#     --smp N            vCPUs (default 2)        --mem MIB   memory (default 2048)
#     --timeout S        kill the guest after S seconds (default 900)
#
# The guest sees this machine's /usr and /etc read-only, so the command runs the
# host's binaries (the vabc build, bash, coreutils, veritysetup...) unchanged. It runs
# as root in /, with the current folder's path as $VM_CWD, the kernel's modules under
# $VM_KMOD (use `modprobe -d "$VM_KMOD" MOD`), and every VABC_* variable passed on.
# Exit status: the command's; 124 when the guest was killed at the timeout; 125 when
# it ended without reporting one (a kernel panic, say).
#
# Acceleration: KVM when /dev/kvm works for a stock kernel, else TCG (software
# emulation, 10-30x slower). VABC_VM_ACCEL=kvm|tcg forces one.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
SMP=2 MEM=2048 TIMEOUT=900
SHARES=("$ROOT:ro") DISKS=()
while (($#)); do
	case $1 in
	--share) SHARES+=("$2"); shift 2 ;;
	--disk) DISKS+=("$2"); shift 2 ;;
	--smp) SMP=$2; shift 2 ;;
	--mem) MEM=$2; shift 2 ;;
	--timeout) TIMEOUT=$2; shift 2 ;;
	--) shift; break ;;
	-*) sed -n '2,24p' "$0" >&2; exit 2 ;;
	*) break ;;
	esac
done
(($#)) || { sed -n '2,24p' "$0" >&2; exit 2; }
case $PWD in / | "$ROOT") ;; *) SHARES+=("$PWD:ro") ;; esac

CACHE=$("$HERE/prepare.sh")
PKG=$(cat "$CACHE/kernel.pkg")
KROOT=$CACHE/$PKG
KVER=$(ls "$KROOT/lib/modules")
INITRD=$CACHE/initramfs-$KVER.cpio.gz

accel=${VABC_VM_ACCEL:-}
if [ -z "$accel" ]; then
	# KVM-PVM (a paravirtualised KVM for guests of a cloud VM) runs only PVM-built
	# guest kernels; a stock kernel dies in its decompressor there.
	if [ -w /dev/kvm ] && [ ! -d /sys/module/kvm_pvm ]; then accel=kvm; else accel=tcg; fi
fi
case $accel in
kvm) ACCEL=(-accel kvm -cpu host) ;;
tcg) ACCEL=(-accel tcg,thread=multi -cpu max) ;;
*) echo "vm: VABC_VM_ACCEL=$accel is not kvm or tcg" >&2; exit 2 ;;
esac

OUT=$(mktemp -d "${TMPDIR:-/tmp}/vabc-vm.XXXXXX")
trap 'rm -rf "$OUT"' EXIT
{
	echo 'set -o pipefail'
	for v in $(compgen -e); do
		case $v in VABC_*) printf 'export %s=%q\n' "$v" "${!v}" ;; esac
	done
	printf 'export VM_CWD=%q\n' "$PWD"
	printf 'cd %q\n' "$PWD"
	printf '%q ' "$@"
	echo
} >"$OUT/job.sh"

QEMU=(qemu-system-x86_64 -machine q35 "${ACCEL[@]}" -smp "$SMP" -m "$MEM"
	-display none -monitor none -serial stdio -no-reboot -nodefaults
	-kernel "$KROOT/vmlinux" -initrd "$INITRD"
	-append "console=ttyS0 quiet loglevel=3 panic=-1 rdinit=/init"
	-fsdev "local,id=out,path=$OUT,security_model=none"
	-device virtio-9p-pci,fsdev=out,mount_tag=out)
fs() { # TAG PATH ro|rw
	local ro=
	[ "$3" = ro ] && ro=,readonly=on
	QEMU+=(-fsdev "local,id=$1,path=$2,security_model=none,multidevs=remap$ro"
		-device "virtio-9p-pci,fsdev=$1,mount_tag=$1")
}
fs usr /usr ro
fs etc /etc ro
fs kmod "$KROOT" ro
i=0
: >"$OUT/mounts"
for s in "${SHARES[@]}"; do
	mode=ro path=$s
	case $s in *:rw) mode=rw path=${s%:rw} ;; *:ro) path=${s%:ro} ;; esac
	path=$(realpath "$path")
	fs "s$i" "$path" "$mode"
	echo "s$i $path $mode" >>"$OUT/mounts"
	i=$((i + 1))
done
for d in "${DISKS[@]}"; do
	file=${d%%,*} opts=
	[ "$file" = "$d" ] || opts=,${d#*,}
	case $opts in *cache=*) ;; *) opts=$opts,cache=writeback ;; esac
	QEMU+=(-drive "file=$file,if=virtio,format=raw$opts")
done

echo "vm: $PKG, $SMP vCPUs, $MEM MiB, $accel; running: $*" >&2
start=$(date +%s)
set +e
timeout -k 10 "$TIMEOUT" "${QEMU[@]}" </dev/null | sed -u 's/\r$//'
qrc=${PIPESTATUS[0]}
set -e
secs=$(($(date +%s) - start))
if [ "$qrc" = 124 ]; then
	echo "vm: killed after ${TIMEOUT}s" >&2
	exit 124
fi
if [ "$qrc" = 137 ] || [ "$qrc" = 143 ]; then
	echo "vm: the emulator was killed after ${secs}s" >&2
	exit 124
fi
if [ ! -e "$OUT/rc" ]; then
	echo "vm: the guest ended without an exit status (qemu exit $qrc, ${secs}s)" >&2
	exit 125
fi
rc=$(cat "$OUT/rc")
echo "vm: exit $rc after ${secs}s" >&2
exit "$rc"
