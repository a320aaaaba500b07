#!/usr/bin/env bash
# The host C++ (the CPU kernels, slot checks, run lists, program and binding
# caches, the Python boundary) under the compiler's sanitizers, on any Linux
# machine with gcc: the native extension is built again with -fsanitize, the
# sanitizer's runtime is preloaded into Python (which is not instrumented), and
# the tests run against it. A report stops the process that made it, so a test
# cannot pass over one; every report is also written under OUTDIR.
#
#   scripts/sanitize_cpu.sh OUTDIR [address|thread ...]     (default: address thread)
#
# Runs:
#   address  AddressSanitizer + UndefinedBehaviorSanitizer, the whole suite,
#            then every CPU conformance case (every out-of-bounds read or
#            write, use after free, overflow or misaligned access in
#            kvlayout's C++; torch's CPU tensors come from the intercepted
#            allocator, so a copy past a tensor's bytes is one)
#                                                   -> OUTDIR/address.txt, OUTDIR/address-reports/,
#                                                      OUTDIR/address-conformance/
#   thread   ThreadSanitizer, the tests that call kvlayout from several threads
#            (set_slots racing layer calls and transfers, threads on their own
#            streams, staged rings shared by threads), with the suppressions of
#            scripts/sanitizers/tsan.supp (reports inside glibc and torch)
#                                                   -> OUTDIR/thread.txt, OUTDIR/thread-reports/
# Before each run a planted bug (scripts/sanitizers/canary.cpp) must be
# reported under the same runtime and options, or the run stops.
#
# The sanitized library replaces the in-place one only while the script runs
# (objects under build/sanitize-*); the library and build stamp found at the
# start are put back at the end. PYTEST_ARGS adds pytest arguments.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: sanitize_cpu.sh OUTDIR [address|thread ...]}
shift
runs=("$@")
[ ${#runs[@]} -gt 0 ] || runs=(address thread)
mkdir -p "$out"
out=$(cd "$out" && pwd)
py=.venv/bin/python
[ -x $py ] || py=${PYTHON:-python3}
export JAX_PLATFORMS=cpu PYTHONUNBUFFERED=1

library=$($py -c 'import sysconfig; print("kvlayout/_C" + sysconfig.get_config_var("EXT_SUFFIX"))')
stamp=kvlayout/_C.build-stamp
kept=$(mktemp -d)
[ -f "$library" ] && cp -p "$library" "$kept/library"
[ -f "$stamp" ] && cp -p "$stamp" "$kept/stamp"
restore() {   # the in-place library and stamp as they were
    rm -f "$library" "$stamp"
    [ -f "$kept/library" ] && cp -p "$kept/library" "$library"
    [ -f "$kept/stamp" ] && cp -p "$kept/stamp" "$stamp"
    rm -rf "$kept"
}
trap restore EXIT
trap "exit 130" INT TERM   # (so that an interrupted run puts the library back too)

status=0
for run in "${runs[@]}"; do
    case $run in
        address) flags=address,undefined; runtime="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libubsan.so)"
                 symbol=__asan_report_load; canary=heap_overflow; expected=heap-buffer-overflow
                 tests=(tests) ;;
        thread) flags=thread; runtime=$(gcc -print-file-name=libtsan.so)
                symbol=__tsan_read; canary=data_race; expected="data race"
                tests=(tests/test_boundary.py tests/test_hardening.py tests/test_staged.py tests/test_compat_streams.py) ;;
        *) echo "sanitize_cpu.sh: unknown run $run" >&2; exit 2 ;;
    esac
    log=$out/$run.txt
    reports=$out/$run-reports
    rm -rf "$reports" && mkdir -p "$reports"
    export ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:log_path=$reports/report"
    export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:log_path=$reports/report"
    export TSAN_OPTIONS="halt_on_error=1:report_signal_unsafe=0:suppressions=$PWD/scripts/sanitizers/tsan.supp:log_path=$reports/report"
    start=$SECONDS
    {
        echo "# kvlayout's host C++ under -fsanitize=$flags, $(git rev-parse --short HEAD 2>/dev/null)$(git diff --quiet 2>/dev/null || echo ' (with uncommitted changes)'), $(date -u +%Y-%m-%dT%H:%MZ)"
        echo "# $(gcc --version | head -1); $($py -c 'import torch, sys; print("torch", torch.__version__, "python", sys.version.split()[0])'); $(nproc) cores"
        echo "\$ KVLAYOUT_SANITIZE=$flags KVLAYOUT_FORCE_CPU_ONLY=1 $py setup.py build_ext --inplace --build-temp build/sanitize-$run"
    } > "$log"
    # (CPU kernels only: the CUDA runtime and the sanitizers' shadow memory do not share a process well)
    if ! KVLAYOUT_SANITIZE=$flags KVLAYOUT_FORCE_CPU_ONLY=1 $py setup.py build_ext --inplace --build-temp "build/sanitize-$run" \
            > "$out/$run-build.txt" 2>&1; then
        echo "build failed: $out/$run-build.txt" | tee -a "$log"; status=1; continue
    fi
    # the library is instrumented, and the runtime reports a planted bug
    # (grep reads all of nm's output: with -q it would stop at the first match, and under pipefail nm's
    # broken pipe would fail the test)
    if ! nm -D "$library" | grep "$symbol" > /dev/null; then
        echo "the built library has no $symbol: not instrumented" | tee -a "$log"; status=1; continue
    fi
    g++ -shared -fPIC -g -O1 -fsanitize=$flags scripts/sanitizers/canary.cpp -o "$reports/canary.so"
    # (in a subshell: the abort it ends with is not reported by this shell)
    ( LD_PRELOAD="$runtime" $py -c "import ctypes; ctypes.CDLL('$reports/canary.so').$canary(1000)"; true ) > /dev/null 2>&1
    if grep -qs "$expected" "$reports"/report.*; then
        echo "canary: the planted $canary was reported ($expected)" >> "$log"
        rm -f "$reports"/report.* "$reports/canary.so"
    else
        echo "canary: the planted $canary was NOT reported: the sanitizer is not active" | tee -a "$log"; status=1; continue
    fi
    echo "\$ LD_PRELOAD=\"$runtime\" KVLAYOUT_TEST_SANITIZE=$flags $py -m pytest -q -p no:cacheprovider ${PYTEST_ARGS:-} ${tests[*]}" >> "$log"
    # (KVLAYOUT_TEST_SANITIZE: tests that compile C++ of their own instrument it alike, e.g. the device
    # kernel's walk run on the host, tests/test_kernel_walk.py)
    LD_PRELOAD="$runtime" KVLAYOUT_TEST_SANITIZE=$flags $py -m pytest -q -p no:cacheprovider ${PYTEST_ARGS:-} \
        "${tests[@]}" >> "$log" 2>&1
    rc=$?
    if [ "$run" = address ]; then   # and every CPU conformance case (the hostile and fuzzed-index families too)
        echo "\$ LD_PRELOAD=\"$runtime\" $py -m kvlayout conformance --device cpu --no-progress --out $out/address-conformance" >> "$log"
        LD_PRELOAD="$runtime" $py -m kvlayout conformance --device cpu --no-progress --out "$out/address-conformance" >> "$log" 2>&1 || rc=1
    fi
    found=$(cat "$reports"/report.* 2>/dev/null | grep -c "ERROR: AddressSanitizer\|runtime error:\|WARNING: ThreadSanitizer")
    echo "sanitizer reports: $found (in $reports)" >> "$log"
    echo "$run: pytest exit $rc, $found sanitizer reports, in $((SECONDS - start)) s" | tee -a "$out/steps.txt"
    { [ $rc -eq 0 ] && [ "$found" -eq 0 ]; } || status=1
done
exit $status
