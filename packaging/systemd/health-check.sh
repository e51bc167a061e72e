#!/bin/sh
# vabc-health-check.service's runner: every executable file in DIR, in name order;
# exits non-zero at the first that fails (naming it), 0 when all pass or DIR is empty.
#   health-check.sh DIR
set -u
dir=${1:?usage: health-check.sh DIR}
n=0
for check in "$dir"/*; do
	[ -f "$check" ] && [ -x "$check" ] || continue
	n=$((n + 1))
	if "$check"; then
		echo "health check $check: passed"
	else
		rc=$?
		echo "health check $check: FAILED (exit $rc)" >&2
		exit 1
	fi
done
echo "health checks: $n passed"
