#!/usr/bin/env bash
# On a CUDA machine: build kvlayout, then record the test suite, the CPU+CUDA
# conformance run (with compute-sanitizer) and the benchmark. Every step writes
# its own files under OUTDIR while it runs and its time into OUTDIR/steps.txt,
# so a step cut short leaves the earlier ones on record.
#
#   scripts/cuda_record.sh OUTDIR [STEP...]
#
# Steps (default: build tests conformance bench):
#   build        pip install --no-build-isolation --no-deps -e .   -> build.txt
#                (with the system gcc/g++ where present: a toolchain that links
#                libstdc++ statically makes an extension that crashes on its first
#                formatted error message)
#   fast         pytest -m "not slow" (every CUDA code path)        -> tests_fast.txt
#   tests        the full test suite                               -> tests.txt
#   boundary     tests/test_boundary.py -k cuda at full size (8 threads x 10,000 rounds, 100,000 soak calls),
#                in one process so that the soak's resident-memory lines reach the log; BOUNDARY_ROUNDS: the
#                thread rounds instead (a round took 15-26 ms on the H100 hosts of 74ca4df and 031f2a8, so 10,000
#                may not fit one call of a slow host)                 -> boundary.txt
#   conformance  kvlayout conformance --device cpu,cuda --sanitize  -> conformance.txt, conformance.tgz
#   bench        kvlayout bench --device cuda (full)               -> bench.txt, bench.tgz (<gpu>.{jsonl,json,md,png})
#   bench-quick  kvlayout bench --device cuda --quick              -> bench_quick.txt, bench-quick.tgz
#   ncu          kvlayout bench --device cuda --ncu (Nsight Compute
#                counters of the cases that miss their targets; NCU_ONLY: only those the bench's --only
#                selects, e.g. "to_host" or "from_host", so that the rows of a full run, about 25 s
#                each, can be split over calls)                    -> ncu.txt, ncu.tgz (<gpu>_ncu.{json,md})
#   host-profile scripts/host_profile.py on the staged rows over 50 us of host
#                time per call in this OUTDIR's bench record (else
#                bench/results/h200.jsonl; HOST_PROFILE_CALL: only rows of that call, e.g. transfer, the rows
#                replayed from their graphs)                        -> host_profile.txt
#   staged-timeline  scripts/host_profile.py --timeline on TIMELINE_KEYS (bench keys, comma-separated; default
#                the staged L32 H1 rows at T = 4096 both ways, L32 H8 and MLA to the host at T = 4096): one
#                call's kernels and copies, where its device time goes, beside one pinned copy of its bytes
#                                                                   -> staged_timeline.txt
#   host-path    scripts/host_path.py: an all-layer call's host time by part (Python,
#                the C++ checks, the launch), warm and with the device idle; HOST_PATH_KEYS: bench keys,
#                comma-separated, else the script's own   -> host_path.txt
#   binding-cost scripts/binding_cost.py: calls with tensors bound at every call (ops, LMCache and
#                SGLang entry points) beside one torch op     -> binding_cost.txt
#   lmcache-ops  scripts/build_lmcache_ops.py: LMCache's CUDA extension built from its sdist (LMCACHE_SDIST)
#                against this torch, into /tmp/lmcache-ops, in the background beside the steps after it (so
#                "lmcache-ops build ..." builds both libraries at once); side-by-side waits for it -> lmcache_ops.txt
#   side-by-side kvlayout.bench.side_by_side: kvlayout beside LMCache's multi_layer_kv_transfer on the same
#                tensors, both timings (LMCACHE: LMCache's cuda_ops extension, a folder holding it or its wheel;
#                default /tmp/lmcache-ops; SIDE_TOKENS the token counts, default 256,4096,32768)
#                                                                   -> side_by_side.txt, side-by-side.tgz (side_by_side.{jsonl,md})
#   side-by-side-ncu  the same cases' calls under Nsight Compute, about 12 s a call (SIDE_NCU_TOKENS default 256,
#                SIDE_NCU_DIRECTIONS default to_host, SIDE_NCU_SHAPES default all three, SIDE_NCU_CALLS default
#                every call, e.g. "kvlayout kernel,LMCache")      -> side_by_side_ncu.txt, side-by-side.tgz (side_by_side_ncu.{json,md})
#   side-by-side-timeline  the same cases' calls in the kernel-only timing's sequence under the profiler: each
#                call's launch gap, span and kernel time on the device (SIDE_TIMELINE_TOKENS default 256,
#                SIDE_TIMELINE_SHAPES default all three)  -> side_by_side_timeline.txt, side-by-side.tgz
#                (side_by_side_timeline.{jsonl,md})
#   ab-old       starts building the older tree AB_OLD for `ab` in the background
#                (scripts/ab_record.sh AB_OLD AB_DIR 0), beside the steps after it -> ab_old_build.txt
#   ab           scripts/ab_record.sh AB_OLD AB_DIR AB_ROUNDS AB_ONLY (this tree
#                built already; an older tree built in AB_DIR is reused) -> ab.txt, ab_compare.txt, ab_runs.tgz
#                AB_DIR (default /tmp/kvlayout-ab) holds the older tree, outside OUTDIR;
#                AB_ROUNDS default 3, AB_ONLY default "T=256,layerwise,headline";
#                AB_CROSS=1 adds this tree's library under the older tree's bench per round
#   probe        scripts/ab_case_probe.py --trace 20 on PROBE_KEYS (bench keys, comma-separated; default the
#                T = 256 L32 MLA and H1 gathers), this tree and, after ab-old or ab, the older tree in
#                AB_DIR, alternately, two processes each        -> probe.txt (one JSON line per tree, key, process)
#   walk-probe   scripts/walk_grid_probe.cu (nvcc, sm_90): the walk alone on the bench's geometries: gathers on
#                the device at small T under other grids, CTA sizes and loads in flight; host transfers under an
#                SM budget with other lanes, cache hints and a shared-memory pipeline; host transfers at T = 256
#                and 4096 without a budget under other grids, one row per CTA and the peers' staging; the device
#                rows at T = 256 both ways under either cache hint, alone and back to back; the host's
#                cost of launching parameter blocks of 8-128 segments; WALK_PROBE picks the sections (device,
#                budget, host, hints, launch, comma-separated; default all)   -> walk_probe.txt
#   graph-probe  scripts/graph_launch_probe.cu (nvcc, sm_90): the host's cost of one cudaGraphLaunch, with the
#                device idle, of graphs shaped like the staged engine's (kernels and copies, one stream or
#                pipelined over two, 4-64 chunks), by node kind and topology, as the process holds more
#                pinned buffers and graphs, on the legacy default stream; GRAPH_PROBE picks the sections (their
#                numbers, comma-separated; default all)              -> graph_probe.txt
#   staged-settings  kvlayout bench --only STAGED_ONLY (default: the L32 H1 and MLA rows at T = 256) under each
#                staged setting in turn (kept graphs or none, the default chunk count or one chunk), STAGED_ROUNDS
#                rounds (default 2); STAGED_SETTINGS replaces the settings (';' between settings, e.g.
#                "KVLAYOUT_STAGED_CHUNKS=8;KVLAYOUT_STAGED_CHUNKS=4"); the staged rows of each run
#                                                                   -> staged_settings.txt, staged-settings.tgz
# A step's report folder is packed into one STEP.tgz (unpack with tar xzf) and removed, so that a record is
# a handful of files to carry off the machine. PYTHON picks the interpreter (default python3); PYTEST_ARGS
# adds pytest arguments.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: cuda_record.sh OUTDIR [build|fast|tests|boundary|conformance|bench|bench-quick|ncu|host-profile|staged-timeline|host-path|binding-cost|lmcache-ops|side-by-side|side-by-side-ncu|side-by-side-timeline|ab-old|ab|probe|walk-probe|graph-probe|staged-settings ...]}
shift
steps=("$@")
[ ${#steps[@]} -gt 0 ] || steps=(build tests conformance bench)
mkdir -p "$out"
export JAX_PLATFORMS=cpu PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
ab_dir=${AB_DIR:-/tmp/kvlayout-ab}
repo=$(pwd)
default_probe_keys="L32_MLA_D576 T=256 ps=16 vllm_mla->lmcache_kv_mla gather_device all layers ctas=default,\
L32_H1_D128 T=256 ps=16 vllm_flash_attn_nhd->lmcache_kv_2ltd gather_device all layers ctas=default"
staged_row() { echo "$1 T=4096 ps=16 $2 $3 all layers ctas=default staged"; }
default_timeline_keys="$(staged_row L32_H1_D128 vllm_flash_attn_nhd-\>lmcache_kv_2ltd to_host),\
$(staged_row L32_H1_D128 vllm_flash_attn_nhd-\>lmcache_kv_2ltd from_host),\
$(staged_row L32_H8_D128 vllm_flash_attn_nhd-\>lmcache_kv_2ltd to_host),\
$(staged_row L32_MLA_D576 vllm_mla-\>lmcache_kv_mla to_host)"
default_staged_only="L32_H1_D128 T=256,L32_MLA_D576 T=256"
staged_settings=("KVLAYOUT_STAGED_GRAPHS=8 KVLAYOUT_STAGED_CHUNKS=8" "KVLAYOUT_STAGED_GRAPHS=0 KVLAYOUT_STAGED_CHUNKS=8"
                 "KVLAYOUT_STAGED_GRAPHS=8 KVLAYOUT_STAGED_CHUNKS=1")
[ -z "${STAGED_SETTINGS:-}" ] || IFS=';' read -r -a staged_settings <<< "$STAGED_SETTINGS"
status=0

gpu_header() {
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null
    $py -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'
    echo "source digest $($py conformance/environment.py . 2>/dev/null)"   # (the tree's, whatever .git says)
}

run_step() {   # run_step NAME LOGFILE COMMAND...: the command's output goes to the log as it comes
    local name=$1 log=$2 start=$SECONDS rc
    shift 2
    { gpu_header; echo "\$ $*"; } > "$out/$log"
    "$@" >> "$out/$log" 2>&1
    rc=$?
    echo "$name: exit $rc in $((SECONDS - start)) s" | tee -a "$out/steps.txt"
    if [ $rc -ne 0 ]; then   # why, on the terminal too: a record whose files are lost still says what failed
        status=1
        { grep -E '^(FAILED|ERROR) ' "$out/$log" | head -n 40; echo "-- $log, last lines:"; tail -n 25 "$out/$log"; } >&2
    fi
}

wait_lmcache() {   # the LMCache build started by lmcache-ops, if one is running: its end (a failure fails the record)
    if [ -n "${lmcache_pid:-}" ]; then wait "$lmcache_pid" || status=1; lmcache_pid=; fi
}

pack() {   # pack NAME FOLDER: OUTDIR/FOLDER's files into OUTDIR/NAME.tgz (added to any earlier), folder removed
    [ -d "$out/$2" ] || return 0
    local staging
    staging=$(mktemp -d)
    [ -f "$out/$1.tgz" ] && tar xzf "$out/$1.tgz" -C "$staging"
    cp -r "$out/$2/." "$staging/" && tar czf "$out/$1.tgz" -C "$staging" . && rm -rf "$out/$2"
    rm -rf "$staging"
}

for step in "${steps[@]}"; do
    case $step in
        build) if [ -x /usr/bin/g++ ] && [ -x /usr/bin/gcc ]; then export CC=/usr/bin/gcc CXX=/usr/bin/g++; fi
               run_step build build.txt $py -m pip install --no-build-isolation --no-deps -e . ;;
        fast) run_step fast tests_fast.txt $py -m pytest -q -p no:cacheprovider -m "not slow" --durations=25 \
                  ${PYTEST_ARGS:-} tests ;;
        tests) run_step tests tests.txt $py -m pytest -q -p no:cacheprovider --durations=25 ${PYTEST_ARGS:-} tests ;;
        boundary) run_step boundary boundary.txt env KVLAYOUT_THREAD_ROUNDS="${BOUNDARY_ROUNDS:-10000}" \
                      KVLAYOUT_SOAK_CALLS=100000 \
                      $py -m pytest -q -s -p no:cacheprovider -n 0 --durations=8 tests/test_boundary.py -k cuda ;;
        conformance) run_step conformance conformance.txt $py -m kvlayout conformance --device cpu,cuda --sanitize \
                         --no-progress --report "$out/conformance"
                     pack conformance conformance ;;
        bench) run_step bench bench.txt $py -m kvlayout bench --device cuda --out "$out/bench"
               pack bench bench ;;
        bench-quick) run_step bench-quick bench_quick.txt $py -m kvlayout bench --device cuda --quick \
                         --out "$out/bench-quick"
                     pack bench-quick bench-quick ;;
        ncu) run_step ncu ncu.txt $py -m kvlayout bench --device cuda --ncu --out "$out/ncu" \
                 ${NCU_ONLY:+--only "$NCU_ONLY"}
             pack ncu ncu ;;
        host-profile) recorded=$(mktemp -d)
                      [ -f "$out/bench.tgz" ] && tar xzf "$out/bench.tgz" -C "$recorded"
                      record=$(ls "$recorded"/*.jsonl 2>/dev/null | head -1)
                      record=${record:-bench/results/h200.jsonl}
                      run_step host-profile host_profile.txt $py scripts/host_profile.py \
                          --record "$record" --over 50 --rows 6 --calls 30 ${HOST_PROFILE_CALL:+--call "$HOST_PROFILE_CALL"}
                      rm -rf "$recorded" ;;
        staged-timeline) IFS=, read -r -a timeline_keys <<< "${TIMELINE_KEYS:-$default_timeline_keys}"
                         run_step staged-timeline staged_timeline.txt $py scripts/host_profile.py --timeline \
                             --calls 10 "${timeline_keys[@]}" ;;
        lmcache-ops) : "${LMCACHE_SDIST:?cuda_record.sh: lmcache-ops needs LMCACHE_SDIST, an LMCache .tar.gz}"
                     (status=0; run_step lmcache-ops lmcache_ops.txt $py scripts/build_lmcache_ops.py \
                          "$LMCACHE_SDIST" /tmp/lmcache-ops; exit $status) &
                     lmcache_pid=$! ;;
        side-by-side) wait_lmcache
                      run_step side-by-side side_by_side.txt $py -m kvlayout.bench.side_by_side \
                          --lmcache "${LMCACHE:-/tmp/lmcache-ops}" \
                          --tokens "${SIDE_TOKENS:-256,4096,32768}" --out "$out/side-by-side"
                      pack side-by-side side-by-side ;;
        side-by-side-ncu) wait_lmcache
                          run_step side-by-side-ncu side_by_side_ncu.txt $py -m kvlayout.bench.side_by_side --ncu \
                              --lmcache "${LMCACHE:-/tmp/lmcache-ops}" \
                              --tokens "${SIDE_NCU_TOKENS:-256}" --directions "${SIDE_NCU_DIRECTIONS:-to_host}" \
                              ${SIDE_NCU_SHAPES:+--shapes "$SIDE_NCU_SHAPES"} ${SIDE_NCU_CALLS:+--calls "$SIDE_NCU_CALLS"} \
                              --out "$out/side-by-side"
                          pack side-by-side side-by-side ;;
        side-by-side-timeline) wait_lmcache
                               run_step side-by-side-timeline side_by_side_timeline.txt $py \
                                   -m kvlayout.bench.side_by_side --timeline --lmcache "${LMCACHE:-/tmp/lmcache-ops}" \
                                   --tokens "${SIDE_TIMELINE_TOKENS:-256}" \
                                   ${SIDE_TIMELINE_SHAPES:+--shapes "$SIDE_TIMELINE_SHAPES"} --out "$out/side-by-side"
                               pack side-by-side side-by-side ;;
        host-path) IFS=, read -r -a host_path_keys <<< "${HOST_PATH_KEYS:-}"
                   run_step host-path host_path.txt $py scripts/host_path.py --device cuda "${host_path_keys[@]}" ;;
        binding-cost) run_step binding-cost binding_cost.txt $py scripts/binding_cost.py --device cuda ;;
        ab-old) : "${AB_OLD:?cuda_record.sh: ab-old needs AB_OLD (a git revision or a .tar.gz of a tree)}"
                scripts/ab_record.sh "$AB_OLD" "$ab_dir" 0 > "$out/ab_old_build.txt" 2>&1 &
                ab_old_pid=$!
                echo "ab-old: building $AB_OLD in the background" | tee -a "$out/steps.txt" ;;
        probe) if [ -n "${ab_old_pid:-}" ]; then wait "$ab_old_pid"; ab_old_pid=; fi
               IFS=, read -r -a probe_keys <<< "${PROBE_KEYS:-$default_probe_keys}"
               probe() {   # this tree, then the older one where it is built (its package first on PYTHONPATH)
                   for n in 1 2; do
                       $py scripts/ab_case_probe.py "${probe_keys[@]}" --reps 200 --calls 50 --trace 20
                       if [ -d "$ab_dir/old-package" ]; then
                           (cd /tmp && PYTHONPATH="$ab_dir/old-package" $py "$repo/scripts/ab_case_probe.py" \
                               "${probe_keys[@]}" --reps 200 --calls 50 --trace 20)
                       fi
                   done
               }
               run_step probe probe.txt probe ;;
        walk-probe) probe_dir=$(mktemp -d)
                    walk_probe() {   # ptxas's registers and spills of each variant, then the timings
                        nvcc -O3 -std=c++17 --expt-relaxed-constexpr -arch=sm_90 -Xptxas -v -I torch_ext/include \
                            scripts/walk_grid_probe.cu -o "$probe_dir/walk_grid_probe" > "$probe_dir/nvcc.txt" 2>&1 \
                            || { cat "$probe_dir/nvcc.txt"; return 1; }
                        grep -E 'Function properties|registers|spill' "$probe_dir/nvcc.txt"
                        "$probe_dir/walk_grid_probe" "${WALK_PROBE:-all}" 30
                    }
                    run_step walk-probe walk_probe.txt walk_probe ;;
        graph-probe) graph_dir=$(mktemp -d)
                     graph_probe() {
                         nvcc -O3 -std=c++17 -arch=sm_90 scripts/graph_launch_probe.cu -o "$graph_dir/graph_launch_probe" \
                             && "$graph_dir/graph_launch_probe" 30 ${GRAPH_PROBE:-}
                     }
                     run_step graph-probe graph_probe.txt graph_probe ;;
        ab) : "${AB_OLD:?cuda_record.sh: ab needs AB_OLD (a git revision or a .tar.gz of a tree)}"
            if [ -n "${ab_old_pid:-}" ]; then wait "$ab_old_pid"; ab_old_pid=; fi
            run_step ab ab.txt scripts/ab_record.sh "$AB_OLD" "$ab_dir" "${AB_ROUNDS:-3}" \
                "${AB_ONLY:-T=256,layerwise,headline}"
            cp "$ab_dir/compare.txt" "$out/ab_compare.txt" 2>/dev/null
            cp "$ab_dir/runs.tgz" "$out/ab_runs.tgz" 2>/dev/null ;;
        staged-settings) staged_runs() {   # every setting once per round, in turn, so that drift slows them alike
                             local n setting
                             for n in $(seq 1 "${STAGED_ROUNDS:-2}"); do
                                 for setting in "${staged_settings[@]}"; do
                                     echo "== round $n: $setting"
                                     env $setting $py -m kvlayout bench --device cuda \
                                         --only "${STAGED_ONLY:-$default_staged_only}" \
                                         --out "$out/staged-settings/${setting// /_}_$n" | grep -E '^(group|staged) '
                                 done
                             done
                         }
                         run_step staged-settings staged_settings.txt staged_runs
                         pack staged-settings staged-settings ;;
        *) echo "cuda_record.sh: unknown step $step" >&2; exit 2 ;;
    esac
done
# a build still running in the background finishes before the record ends
wait_lmcache
if [ -n "${ab_old_pid:-}" ]; then
    wait "$ab_old_pid"
    echo "ab-old: exit $? (the older tree's build)" | tee -a "$out/steps.txt"
fi
exit $status
