#!/usr/bin/env bash
# tidekv's fabric transport over a real verbs device: builds integration/rdma/fabric_smoke from
# native/ and runs it in the soft-RoCE qemu guest (softroce.sh) as two processes over
# verbs;ofi_rxm on rxe0, with the strict registration mode real NICs ask for: READ and WRITE of
# several sizes byte for byte, a READ past a region refused, the endpoint intact after, a region
# the target unregisters revoked before its key goes (then refused, nothing lands). About
# 15 s with the guest's kernel cached (the first run installs Debian packages and downloads it).
# .ci/run runs it; exit status 0: every check passed.
set -euo pipefail
cd "$(dirname "$0")/../.."
payload=$(mktemp -d)
trap 'rm -rf "$payload"' EXIT
integration/rdma/build_smoke.sh "$payload" >/dev/null
cp integration/rdma/run_smoke.sh "$payload/run.sh"
integration/rdma/softroce.sh "$payload" "${1:-300}"
