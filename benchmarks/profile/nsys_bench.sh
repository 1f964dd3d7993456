#!/usr/bin/env bash
# Profile the all-reduce microbenchmark (python -m hybridcomm.tools.bench) under nsys.
#
#   benchmarks/profile/nsys_bench.sh                      # defaults below, one rank per GPU
#   benchmarks/profile/nsys_bench.sh --algo ring,native -b 1M -e 256M
#   DRY_RUN=1 benchmarks/profile/nsys_bench.sh            # print the commands only
#
# Any argument goes to hybridcomm-bench as is; the report is named after the
# configuration: bench_<algos>_<minbytes>-<maxbytes>_<dtype>_np<ranks>.nsys-rep
# in OUT_DIR (default benchmarks/results/nsys). See common.sh for the
# environment variables.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

require_nsys
PY="$(find_python)"

if [[ $# -eq 0 ]]; then
    # Few iterations: a profile needs a handful of steps per size, not statistics.
    set -- --algo ring,butterfly,halving_doubling,native -b 4K -e 64M -f 4 -n 5 -w 2
fi

algos="$(arg_value --algo "" ring,butterfly,halving_doubling,auto,native "$@")"
minb="$(arg_value --minbytes -b 4K "$@")"
maxb="$(arg_value --maxbytes -e 64M "$@")"
dtype="$(arg_value --dtype -d float32 "$@")"
ranks="${WORLD_SIZE:-$(arg_value --nprocs "" gpus "$@")}"
name="$(slug "bench_${algos}_${minb}-${maxb}_${dtype}_np${ranks}")"

cd "${REPO_ROOT}"
profile_and_summarize "${name}" "${PY}" -m hybridcomm.tools.bench "$@"
