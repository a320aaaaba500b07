#!/usr/bin/env bash
# Benchmarks an older tree and this one on the same machine, alternately, and
# lists the rows the newer one is slower on. Two records from different days
# differ by more than a few per cent on small rows (the machine's own copy
# limits move by up to 40 %), so a regression is judged only from such runs.
#
#   scripts/ab_record.sh OLD OUTDIR [ROUNDS] [ONLY]
#
# OLD     a git revision (archived with `git archive`) or a .tar.gz of a tree
# OUTDIR  gets old-tree/ (the older tree, built in place), old_N/ and new_N/
#         (`kvlayout bench --out` of round N), compare.txt and runs.tgz (every
#         old_N/new_N in one file)
# ROUNDS  rounds of (old, new), default 2; 0 only builds the older tree and
#         makes OUTDIR/old-package (it needs nothing of this tree, so it may
#         run beside this tree's build)
# ONLY    the bench's --only selection, default "T=256"
#
# With AB_CROSS=1 each round also runs the older tree's bench against this
# tree's library (cross_N/): the two benches differ too (cases, baselines,
# what runs before a row), and a row that is slower in new_N but not in
# cross_N is slower by the bench's doing, not the library's. compare.txt
# then also compares each old_N with every cross run, and ends with each
# row's median over the old runs against its median over the new (and
# cross) runs.
#
# This tree must be built already (scripts/cuda_record.sh OUT build) for
# ROUNDS > 0. The older tree runs from a package folder that maps its
# directories as pyproject.toml's package-dir does, put first on PYTHONPATH.
set -uo pipefail
cd "$(dirname "$0")/.."
old=${1:?usage: ab_record.sh OLD OUTDIR [ROUNDS] [ONLY]}
out=${2:?usage: ab_record.sh OLD OUTDIR [ROUNDS] [ONLY]}
rounds=${3:-2}
only=${4:-T=256}
py=${PYTHON:-python3}
export JAX_PLATFORMS=cpu PYTHONUNBUFFERED=1
mkdir -p "$out/old-tree"
out=$(cd "$out" && pwd)
tree="$out/old-tree"

# An older tree of the same OLD already built in OUTDIR (an earlier run, or
# ROUNDS=0 run beside this tree's build) is used as it is.
if [ "$(cat "$tree/.ab_built" 2>/dev/null)" = "$old" ] && ls "$tree"/kvlayout/_C*.so >/dev/null 2>&1; then
    echo "ab_record.sh: the older tree in $tree is $old, built"
else
    if [ -f "$old" ]; then
        tar xzf "$old" -C "$tree"
    else
        git archive "$old" | tar x -C "$tree" || { echo "ab_record.sh: cannot archive $old" >&2; exit 2; }
    fi
    if [ -x /usr/bin/g++ ] && [ -x /usr/bin/gcc ]; then export CC=/usr/bin/gcc CXX=/usr/bin/g++; fi
    (cd "$tree" && $py setup.py build_ext --inplace -j "$(nproc)") > "$out/old_build.txt" 2>&1 \
        || { echo "ab_record.sh: the older tree does not build (see $out/old_build.txt)" >&2; exit 1; }
    echo "$old" > "$tree/.ab_built"
fi
# package DIR TREE BENCH_TREE: DIR/kvlayout, TREE's directories linked in as
# pyproject.toml's package-dir maps them, and BENCH_TREE's bench/.
package() {
    local pkg="$1/kvlayout" pair f
    mkdir -p "$pkg"
    for f in "$2"/kvlayout/*; do ln -sfn "$f" "$pkg/"; done
    for pair in reference:reference ops:ops conformance:conformance compat:compat dist:distributed; do
        [ -d "$2/${pair#*:}" ] && ln -sfn "$2/${pair#*:}" "$pkg/${pair%%:*}"
    done
    ln -sfn "$3/bench" "$pkg/bench"
}
# The older tree's package, and with AB_CROSS=1 this tree's library with the older tree's bench.
package "$out/old-package" "$tree" "$tree"
cross=${AB_CROSS:-0}
[ "$cross" = 1 ] && package "$out/cross-package" "$(pwd)" "$tree"
# (ROUNDS = 0: the older tree built and its package made, for the rounds or a probe to come)
[ "$rounds" -gt 0 ] || exit 0

for n in $(seq 1 "$rounds"); do
    (cd /tmp && PYTHONPATH="$out/old-package" $py -m kvlayout bench --device cuda --only "$only" \
        --out "$out/old_$n") > "$out/old_$n.txt" 2>&1
    if [ "$cross" = 1 ]; then
        (cd /tmp && PYTHONPATH="$out/cross-package" $py -m kvlayout bench --device cuda --only "$only" \
            --out "$out/cross_$n") > "$out/cross_$n.txt" 2>&1
    fi
    $py -m kvlayout bench --device cuda --only "$only" --out "$out/new_$n" > "$out/new_$n.txt" 2>&1
    echo "round $n done"
done
stem=$(basename "$(ls "$out"/new_1/*.jsonl | head -1)" .jsonl)
kinds=(new)
[ "$cross" = 1 ] && kinds+=(cross)   # (cross: this library under the older bench)
{
    for kind in "${kinds[@]}"; do
        for n in $(seq 1 "$rounds"); do
            echo "# old_$n against every $kind run"
            $py -m kvlayout.bench.compare --same-machine "$out/old_$n/$stem.jsonl" "$out/${kind}"_*/"$stem.jsonl"
        done
        # a row whose rounds split between two speeds: judged by where most of them fall
        echo "# the median of the old runs against the median of the $kind runs"
        $py -m kvlayout.bench.compare --same-machine --medians "$rounds" "$out"/old_*/"$stem.jsonl" \
            "$out/${kind}"_*/"$stem.jsonl"
    done
} | tee "$out/compare.txt"
# every run's record in one file, beside compare.txt
(cd "$out" && tar czf runs.tgz old_[0-9]* new_[0-9]* $(ls -d cross_[0-9]* 2>/dev/null))
