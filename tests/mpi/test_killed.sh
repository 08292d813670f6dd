#!/bin/sh
# test_killed.sh MPIEXEC TEST_MPI: one rank of three is killed (1) while the
# others wait in a collective of mha_mpi_forward (heads), (2) 0.3 s into a
# run of ring attention forwards and backwards, while the others compute or
# wait in the ring's exchanges; mpiexec must end the whole job with a
# non-zero status and a message naming the dead process, well within the
# timeout (no hang).
set -u
failed=0
for mode in heads ring; do
    t0=$(date +%s)
    out=$(timeout 60 "$1" -n 3 --allow-run-as-root --oversubscribe --bind-to none "$2" --kill $mode 2>&1)
    rc=$?
    t=$(($(date +%s) - t0))
    echo "$out" | tail -n 6
    if [ $rc -eq 124 ]; then
        echo "test_killed ($mode): FAILED: the job hung (timeout 60 s)"; failed=$((failed + 1))
    elif [ $rc -eq 0 ]; then
        echo "test_killed ($mode): FAILED: mpiexec returned 0"; failed=$((failed + 1))
    elif ! echo "$out" | grep -qiE "signal|killed|exited"; then
        echo "test_killed ($mode): FAILED: no message about the dead rank"; failed=$((failed + 1))
    else
        echo "test_killed ($mode): the job ended in ${t} s with rc $rc"
    fi
done
echo "test_killed: $((2 - failed)) passed, $failed failed"
[ $failed -eq 0 ]
