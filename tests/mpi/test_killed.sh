#!/bin/sh
# test_killed.sh MPIEXEC TEST_MPI: one rank of three is killed while the
# others wait in a collective of mha_mpi_forward; mpiexec must end the whole
# job with a non-zero status and a message naming the dead process, well
# within the timeout (no hang).
set -u
t0=$(date +%s)
out=$(timeout 60 "$1" -n 3 --allow-run-as-root --oversubscribe --bind-to none "$2" --kill 2>&1)
rc=$?
t=$(($(date +%s) - t0))
echo "$out" | tail -n 6
if [ $rc -eq 124 ]; then echo "test_killed: FAILED: the job hung (timeout 60 s)"; exit 1; fi
if [ $rc -eq 0 ]; then echo "test_killed: FAILED: mpiexec returned 0"; exit 1; fi
if ! echo "$out" | grep -qiE "signal|killed|exited"; then
    echo "test_killed: FAILED: no message about the dead rank"; exit 1
fi
echo "test_killed: the job ended in ${t} s with rc $rc: 1 passed, 0 failed"
