#!/bin/sh
# The soft-RoCE guest's payload (integration/rdma/softroce.sh): fabric_smoke's target and
# initiator as two processes over verbs;ofi_rxm on rxe0 (10.99.0.1). Exit status: the initiator's.
cd /payload
export TIDEKV_FABRIC_PROVIDER=${TIDEKV_FABRIC_PROVIDER:-verbs}
./fabric_smoke target 10.99.0.1 > /tmp/target.out 2>&1 &
target=$!
i=0
while ! grep -q READY /tmp/target.out 2>/dev/null; do
  i=$((i + 1))
  if [ $i -gt 120 ] || ! kill -0 $target 2>/dev/null; then cat /tmp/target.out; echo "target did not start"; exit 1; fi
  sleep 1
done
cat /tmp/target.out
set -- $(grep READY /tmp/target.out)
./fabric_smoke initiator 10.99.0.1 "$2" "$3" "$4" "$5" "$6"
status=$?
kill $target 2>/dev/null
exit $status
