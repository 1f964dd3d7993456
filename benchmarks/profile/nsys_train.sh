#!/usr/bin/env bash
# Profile the training benchmark (benchmarks/train.py) under nsys.
#
#   benchmarks/profile/nsys_train.sh                      # defaults below
#   benchmarks/profile/nsys_train.sh --configs ddp,hybrid-forward --batch-sizes 64
#   DRY_RUN=1 benchmarks/profile/nsys_train.sh            # print the commands only
#
# Any argument goes to train.py as is; the report is named after the
# configuration: train_<configs>_bs<batch sizes>_np<ranks>.nsys-rep in OUT_DIR
# (default benchmarks/results/nsys). See common.sh for the environment variables.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

require_nsys
PY="$(find_python)"

if [[ $# -eq 0 ]]; then
    # The configs worth seeing side by side in one timeline, a few steps each.
    set -- --configs stock,ddp,hybrid-backward,hybrid-forward --batch-sizes 32 \
        --iters 10 --warmup 3
fi

configs="$(arg_value --configs "" all "$@")"
batch="$(arg_value --batch-sizes "" 8,16,32,64 "$@")"
ranks="$(arg_value --nprocs "" 4 "$@")"
name="$(slug "train_${configs}_bs${batch}_np${ranks}")"

cd "${REPO_ROOT}"
profile_and_summarize "${name}" "${PY}" benchmarks/train.py "$@"
