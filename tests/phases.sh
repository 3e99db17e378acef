#!/usr/bin/env bash
# The integration tests as `make test` runs them, in two phases (docs/contributors/dev-clusters.md):
#   1. the `beside` tests (SLURM, image builds and pulls, compose: they wait on daemons and disks more
#      than they compute) in a pytest of their own, beside a pytest of all the others but `alone`;
#      the beside run's output is shown after the other's, whole;
#   2. the `alone` tests (a threshold or a time budget measured on the machine), by themselves.
# Usage: tests/phases.sh PYTEST. Exit status: 0 when every phase passed, else the first failure's.
set -uo pipefail
set -m  # job control: a background job of a shell without it ignores SIGINT (the Ctrl-C tests send it)
pytest=$1
base=$(mktemp -d /tmp/gptlaunch-tests.XXXXXX)
export GPTLAUNCH_TESTS_BESIDE=1  # each run ends only its own leftovers (tests/integration/conftest.py)
started=$(date +%s)
"$pytest" -q -m "beside and not alone" --basetemp "$base/beside" --durations=20 tests/integration \
    >"$base/beside.log" 2>&1 &
beside=$!
"$pytest" -q -m "not beside and not alone" --basetemp "$base/main" --durations=30 tests/integration
main_rc=$?
wait "$beside"
beside_rc=$?
echo "=== the beside tests, run beside the above (phase 1: $(($(date +%s) - started)) s) ==="
cat "$base/beside.log"
unset GPTLAUNCH_TESTS_BESIDE
"$pytest" -q -m alone --basetemp "$base/alone" --durations=10 tests/integration
alone_rc=$?
echo "=== integration phases: $(($(date +%s) - started)) s; exit codes main $main_rc, beside $beside_rc, alone $alone_rc ==="
for rc in "$main_rc" "$beside_rc" "$alone_rc"; do
    ((rc == 0)) || exit "$rc"
done
