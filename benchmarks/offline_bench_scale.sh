#!/usr/bin/env bash
# `bench scale` on a machine that reaches no package index (a lent many-core machine), from a
# bundle made here with deploy/offline_bundle.py. Run from the repository root:
#
#   here:    .venv/bin/python deploy/offline_bundle.py --out .bundle --python-version 3.12 \
#                --exclude numpy --exclude tokenizers      # packages the other machine has
#   there:   OUT=results bash benchmarks/offline_bench_scale.sh
#
# Installs jetrouter from .bundle into /tmp/jetrouter-site (building its C extensions), then
# writes to $OUT: machine.txt, and the JSON of `bench scale` at 256 engines and at 8 (the same
# replicas, 1, 2 and 4, for the ratio between the fleets). SCALE_ARGS adds flags to both runs.
set -euo pipefail
out="${OUT:?set OUT to the folder for the results}"
bundle="${BUNDLE:-.bundle}"
site="${SITE:-/tmp/jetrouter-site}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
bash "$bundle/install.sh" . "$site"
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" PATH="$site/bin:$PATH"
# Away from the checkout: `python -m` (how the cluster starts its processes) puts the working
# directory first on the path, and the checkout's packages have no extensions built for this
# Python.
cd "$site"
python3 -c "import eventlog._fasthash, replicas.core._fastindex" \
    || echo "warning: the C extensions did not build; the Python code runs" >&2
{
    date -u; uname -a; python3 --version; nproc
    grep -m1 "model name" /proc/cpuinfo || true
    free -g | head -2; uptime
} > "$out/machine.txt"
# shellcheck disable=SC2086  # SCALE_ARGS is a list of flags
jetrouter bench scale --engines 256 --replicas 1,2,4 --json ${SCALE_ARGS:-} > "$out/scale256.json"
# shellcheck disable=SC2086
jetrouter bench scale --engines 8 --replicas 1,2,4 --json ${SCALE_ARGS:-} > "$out/scale8.json"
uptime >> "$out/machine.txt"
echo "wrote $out/machine.txt, $out/scale256.json, $out/scale8.json"
