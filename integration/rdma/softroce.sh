#!/usr/bin/env bash
# Runs a payload against a real (software) RDMA verbs device: boots a qemu guest with Debian's
# stock kernel package, whose rdma_rxe module (soft-RoCE) gives it a verbs device `rxe0`, and
# runs PAYLOAD_DIR/run.sh inside it.
#
# Why a guest: no RDMA device can exist on the host kernel of these machines. It has no module
# loading (CONFIG_MODULES unset, `nomodule`) and CONFIG_INFINIBAND is off, so there is no
# NETLINK_RDMA, no /sys/class/infiniband and `ibv_devices` fails; containers share that kernel.
# Debian's linux-image-6.1.0-*-amd64-unsigned ships rdma_rxe.ko, so a qemu guest booted with it
# (TCG, i.e. software emulation, since the host has no usable KVM; `-nic none`, nothing leaves
# it) gets a real rxe0 for libibverbs, rdma_cm and libfabric's `verbs;ofi_rxm`. See
# ../shared/reference/rdma-on-these-machines.md (beside the repository), section 1, for how this
# was worked out.
#
# Guest setup (its /init): insmod crc32_generic (rdma_rxe needs it), the ib/rdma_cm modules,
# rdma_rxe and veth; hostname `guest` (10.99.0.1 in /etc/hosts; libfabric's verbs provider needs
# a resolvable hostname); a veth pair veth0/veth1 with 10.99.0.1/24 on veth0 (rdma_cm can't route
# over rxe on lo); `rdma link add rxe0 type rxe netdev veth0`. Then it runs /payload/run.sh with
# PATH=/bin:/payload, FI_UNIVERSE_SIZE=16 (the default CQ size of verbs;ofi_rxm exceeds rxe's
# limit), SOFTROCE_DEV=rxe0 and SOFTROCE_IP=10.99.0.1, prints `SOFTROCE_EXIT <status>` and powers
# off. /bin holds busybox applets, bash, fi_info, ibv_devices, ibv_devinfo, rdma and iproute2's
# ip (call it as /bin/ip: busybox sh prefers its own applets).
#
# The guest root gets PAYLOAD_DIR at /payload, plus every shared library the ELF files in it need
# (`ldd` on the host, copied to the same path), libfabric.so.1, the libibverbs rxe provider and
# libgcc_s.so.1. The emulated data path is slow (tens of MB/s, ms per round trip): this is a
# functional test, never a benchmark.
#
# Time: 10-20 s wall on a 2-CPU host with the kernel cached (initrd build ~3 s, qemu boot to
# payload ~4 s of TCG emulation, plus the payload; a fi_pingpong of 100 x 4 KiB adds ~4 s); allow
# a minute or more under load. The first run also installs Debian packages (as root, apt-get) and
# downloads the kernel .deb (~70 MB) into ${TIDEKV_SOFTROCE_CACHE:-$HOME/.cache/tidekv-softroce},
# which later runs reuse.
#
#   integration/rdma/softroce.sh PAYLOAD_DIR [TIMEOUT_S]
#
#   PAYLOAD_DIR   host directory with an executable run.sh (shebang #!/bin/sh or #!/bin/bash) and
#                 whatever binaries it needs
#   TIMEOUT_S     wall-clock limit for the whole qemu run (default 600); the payload itself gets
#                 TIMEOUT_S-60 s (at least half of TIMEOUT_S), or $TIDEKV_SOFTROCE_PAYLOAD_TIMEOUT
#
# Prints the guest console on stdout (this script's own messages go to stderr) and exits with
# run.sh's exit status: 143 if run.sh hit the payload timeout (busybox timeout), 125 if rxe0 could
# not be created, 124 if the guest never printed the SOFTROCE_EXIT marker (e.g. TIMEOUT_S ran out).
set -euo pipefail

usage() { sed -n '/^#   integration/,/^# not be created/p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
[ $# -ge 1 ] && [ $# -le 2 ] || usage
PAYLOAD=$1
TIMEOUT_S=${2:-600}
[ -d "$PAYLOAD" ] || { echo "softroce: PAYLOAD_DIR $PAYLOAD is not a directory" >&2; exit 2; }
[ -f "$PAYLOAD/run.sh" ] && [ -x "$PAYLOAD/run.sh" ] \
  || { echo "softroce: $PAYLOAD/run.sh is missing or not executable" >&2; exit 2; }
case $TIMEOUT_S in ''|*[!0-9]*) echo "softroce: TIMEOUT_S must be a number of seconds" >&2; exit 2;; esac
PAYLOAD=$(cd "$PAYLOAD" && pwd)
PT=${TIDEKV_SOFTROCE_PAYLOAD_TIMEOUT:-$(( TIMEOUT_S - 60 > TIMEOUT_S / 2 ? TIMEOUT_S - 60 : TIMEOUT_S / 2 ))}
CACHE=${TIDEKV_SOFTROCE_CACHE:-$HOME/.cache/tidekv-softroce}
KPKG_DEFAULT=linux-image-6.1.0-47-amd64-unsigned   # the one the reference recipe was verified with
LIBDIR=/usr/lib/x86_64-linux-gnu

log() { echo "softroce: $*" >&2; }

W=$(mktemp -d "${TMPDIR:-/tmp}/softroce.XXXXXX")
trap 'rm -rf "$W"' EXIT
trap 'exit 143' TERM INT HUP

# ---- host packages ---------------------------------------------------------------------------
PKGS="qemu-system-x86 busybox-static cpio libfabric1 libfabric-bin rdma-core ibverbs-utils ibverbs-providers iproute2"
missing=""
for p in $PKGS; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing="$missing $p"
done
if [ -n "$missing" ]; then
  [ "$(id -u)" = 0 ] || { log "missing Debian packages:$missing (run as root to install them)"; exit 1; }
  log "installing:$missing"
  # shellcheck disable=SC2086
  if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $missing >"$W/apt.log" 2>&1; then
    apt-get update -qq >>"$W/apt.log" 2>&1 || true
    # shellcheck disable=SC2086
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $missing >>"$W/apt.log" 2>&1 \
      || { tail -30 "$W/apt.log" >&2; log "apt-get install failed"; exit 1; }
  fi
fi

# ---- kernel package (cached) -----------------------------------------------------------------
mkdir -p "$CACHE"
candidates=$(apt-cache search --names-only '^linux-image-6\.1\.0-[0-9]+-amd64-unsigned$' 2>/dev/null \
             | awk '{print $1}' | sort -rV || true)
[ -n "$candidates" ] || candidates=$KPKG_DEFAULT
case " $(echo $candidates) " in *" $KPKG_DEFAULT "*) ;; *) candidates="$candidates $KPKG_DEFAULT";; esac
DEB=""
for k in $candidates; do            # the highest that is in the cache or can be downloaded
  cached=$(ls -1 "$CACHE/${k}_"*.deb 2>/dev/null | sort -V | tail -1 || true)
  if [ -n "$cached" ]; then DEB=$cached; break; fi
  log "downloading $k into $CACHE"
  mkdir -p "$W/dl"
  if (cd "$W/dl" && apt-get download -q "$k") >"$W/dl.log" 2>&1; then
    f=$(ls -1 "$W/dl/${k}_"*.deb | tail -1)
    mv "$f" "$CACHE/"; DEB=$CACHE/${f##*/}; break
  fi
  tail -3 "$W/dl.log" >&2; log "could not download $k"
done
if [ -z "$DEB" ]; then               # offline: any kernel cached earlier
  DEB=$(ls -1 "$CACHE"/linux-image-6.1.0-*-amd64-unsigned_*.deb 2>/dev/null | sort -V | tail -1 || true)
  [ -n "$DEB" ] || { log "no Debian kernel package available (tried: $(echo $candidates))"; exit 1; }
fi
log "kernel package ${DEB##*/}"

MODS="crypto/crc32_generic fs/configfs/configfs drivers/infiniband/core/ib_core
      drivers/infiniband/core/ib_uverbs drivers/infiniband/core/ib_cm drivers/infiniband/core/iw_cm
      drivers/infiniband/core/rdma_cm drivers/infiniband/core/rdma_ucm net/ipv4/udp_tunnel
      net/ipv6/ip6_udp_tunnel drivers/infiniband/sw/rxe/rdma_rxe drivers/net/veth"
K=$W/k
mkdir -p "$K"
pats=("./boot/vmlinuz-*")
for m in $MODS; do pats+=("./lib/modules/*/kernel/$m.ko"); done
dpkg-deb --fsys-tarfile "$DEB" | tar -x -C "$K" --wildcards "${pats[@]}"
KV=$(ls "$K/lib/modules")
VMLINUZ=$K/boot/vmlinuz-$KV
[ -f "$VMLINUZ" ] || { log "no $VMLINUZ in ${DEB##*/}"; exit 1; }

# ---- guest root --------------------------------------------------------------------------------
R=$W/root
mkdir -p "$R"/{bin,proc,sys,dev,tmp,mods,payload,etc/libibverbs.d,$LIBDIR/libibverbs}
for m in $MODS; do cp "$K/lib/modules/$KV/kernel/$m.ko" "$R/mods/"; done

TOOLS=""
for t in fi_info ibv_devices ibv_devinfo rdma bash; do
  p=$(command -v "$t") || { log "$t not found on the host"; exit 1; }
  TOOLS="$TOOLS $p"
done
TOOLS="$TOOLS /bin/ip"
for t in $TOOLS; do cp -L "$t" "$R/bin/${t##*/}"; done
cp /bin/busybox "$R/bin/busybox"
# busybox applets for everything not copied above (never over ip/bash: cp would follow the link)
for a in $("$R/bin/busybox" --list); do
  [ -e "$R/bin/$a" ] || [ -L "$R/bin/$a" ] || ln -s busybox "$R/bin/$a"
done

cp /etc/libibverbs.d/rxe.driver "$R/etc/libibverbs.d/"
cp -L "$LIBDIR"/libibverbs/librxe-rdmav*.so "$R$LIBDIR/libibverbs/"
cp -a "$PAYLOAD/." "$R/payload/"

# ELF files whose libraries the guest needs: the tools, libfabric, the rxe provider, libgcc_s
# (rping and other C++/pthread_cancel users need it) and every ELF file in the payload.
is_elf() { [ -f "$1" ] && [ "$(LC_ALL=C head -c 4 "$1" 2>/dev/null | od -An -c | tr -d ' ')" = '177ELF' ]; }
ELFS=$(printf '%s\n' $TOOLS "$LIBDIR/libfabric.so.1" "$LIBDIR"/libibverbs/librxe-rdmav*.so)
while IFS= read -r -d '' f; do is_elf "$f" && ELFS="$ELFS"$'\n'"$f"; done < <(find "$PAYLOAD" -type f -print0)
: >"$W/libs"
echo "$LIBDIR/libgcc_s.so.1" >>"$W/libs"
while IFS= read -r f; do
  [ -n "$f" ] || continue
  out=$(ldd "$f" 2>&1) || continue                    # static or not an executable: nothing to copy
  if grep -q 'not found' <<<"$out"; then log "warning: $f: $(grep 'not found' <<<"$out" | tr -s ' \t' ' ')"; fi
  grep -oE '(^|[[:space:]])/[^ ]+' <<<"$out" | tr -d ' \t' >>"$W/libs" || true
done <<<"$ELFS"
[ -e "$LIBDIR/libgcc_s.so.1" ] && ldd "$LIBDIR/libgcc_s.so.1" 2>/dev/null | grep -oE '(^|[[:space:]])/[^ ]+' | tr -d ' \t' >>"$W/libs" || true
# (a library that ldd found inside PAYLOAD_DIR, through an rpath, also goes to its host path)
sort -u "$W/libs" | while IFS= read -r l; do
  [ -e "$l" ] || { log "warning: library $l not on the host"; continue; }
  mkdir -p "$R$(dirname "$l")"
  [ -e "$R$l" ] || cp -L "$l" "$R$l"
done

printf '127.0.0.1 localhost\n10.99.0.1 guest\n' >"$R/etc/hosts"
echo guest >"$R/etc/hostname"

cat >"$R/init" <<EOF
#!/bin/sh
PT=$PT
EOF
cat >>"$R/init" <<'EOF'
export PATH=/bin     # busybox sh prefers its own applets: call iproute2 as /bin/ip
mount -t proc p /proc; mount -t sysfs s /sys; mount -t devtmpfs d /dev; mount -t tmpfs t /tmp
mkdir -p /dev/shm /dev/pts; mount -t tmpfs m /dev/shm; mount -t devpts pts /dev/pts
echo "=== softroce guest $(uname -r), no NIC"
for m in crc32_generic configfs ib_core ib_uverbs ib_cm iw_cm rdma_cm rdma_ucm udp_tunnel ip6_udp_tunnel rdma_rxe veth; do
  insmod /mods/$m.ko || echo "insmod $m failed"
done
hostname guest; /bin/ip link set lo up
/bin/ip link add veth0 type veth peer name veth1; /bin/ip link set veth0 up; /bin/ip link set veth1 up
/bin/ip addr add 10.99.0.1/24 dev veth0
rdma link add rxe0 type rxe netdev veth0; rc=$?
echo "rdma link add rxe0 rc=$rc"
rdma link show
ibv_devices
if [ "$rc" != 0 ]; then
  echo "softroce: could not create rxe0; not running the payload"
  rc=125
else
  export FI_UNIVERSE_SIZE=16 PATH=/bin:/payload SOFTROCE_DEV=rxe0 SOFTROCE_IP=10.99.0.1 HOME=/tmp
  echo "=== /payload/run.sh (timeout ${PT}s)"
  cd /payload && timeout "$PT" /payload/run.sh; rc=$?
  cd /
fi
echo "SOFTROCE_EXIT $rc"
poweroff -f
EOF
chmod +x "$R/init"
(cd "$R" && find . | cpio -o -H newc --quiet | gzip -1) >"$W/initrd.gz"
log "initrd $(du -h "$W/initrd.gz" | cut -f1), kernel $KV, booting (TCG; limit ${TIMEOUT_S}s, payload ${PT}s)"

# ---- boot ---------------------------------------------------------------------------------------
t0=$(date +%s)
set +e
nice -n 10 timeout "$TIMEOUT_S" qemu-system-x86_64 -accel tcg -cpu max -m 1024M -smp 1 -nic none \
  -nographic -no-reboot -kernel "$VMLINUZ" -initrd "$W/initrd.gz" \
  -append "console=ttyS0 panic=-1 quiet" </dev/null 2>&1 | tee "$W/console.log"
qrc=${PIPESTATUS[0]}
set -e
secs=$(( $(date +%s) - t0 ))
st=$(tr -d '\r' <"$W/console.log" | grep -aoE 'SOFTROCE_EXIT [0-9]+' | tail -1 | awk '{print $2}' || true)
if [ -z "$st" ]; then
  if [ "$qrc" = 124 ]; then
    log "FAIL: timed out after ${TIMEOUT_S}s without the SOFTROCE_EXIT marker"
  else
    log "FAIL: qemu exited with $qrc after ${secs}s without the SOFTROCE_EXIT marker"
  fi
  exit 124
fi
log "payload exit status $st (qemu ran ${secs}s)"
exit "$st"
