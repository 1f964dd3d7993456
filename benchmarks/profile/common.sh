# shellcheck shell=bash
# Shared by nsys_bench.sh and nsys_train.sh: find nsys, profile one command,
# print the `nsys stats` summaries. Sourced, not run.
#
# Environment (all optional):
#   NSYS          the nsys binary (default: nsys on PATH, else /usr/local/cuda/bin/nsys)
#   PYTHON        the interpreter (default: .venv/bin/python if present, else python3)
#   OUT_DIR       where reports go (default: benchmarks/results/nsys)
#   NSYS_TRACE    --trace value (default: cuda,nvtx,osrt; NCCL's own NVTX ranges come with nvtx)
#   NSYS_REPORTS  nsys stats reports (default: nvtx_sum,cuda_gpu_kern_sum,cuda_api_sum,cuda_gpu_mem_time_sum)
#   NSYS_EXTRA    more `nsys profile` flags, e.g. "--delay=20 --duration=10"
#   DRY_RUN=1     print the commands instead of running them

set -euo pipefail

PROFILE_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(cd "${PROFILE_DIR}/../.." && pwd)"

find_nsys() {
    if [[ -n "${NSYS:-}" ]]; then
        command -v "${NSYS}" || return 1
    elif command -v nsys >/dev/null 2>&1; then
        command -v nsys
    elif [[ -x /usr/local/cuda/bin/nsys ]]; then
        echo /usr/local/cuda/bin/nsys
    else
        return 1
    fi
}

require_nsys() {
    if ! NSYS_BIN="$(find_nsys)"; then
        cat >&2 <<'MSG'
error: nsys (NVIDIA Nsight Systems CLI) was not found.
  Install it from https://developer.nvidia.com/nsight-systems (or the CUDA toolkit's
  nsight-systems package), put it on PATH, or set NSYS=/path/to/nsys.
  It profiles real GPUs only: on a machine without one there is nothing to trace.
MSG
        exit 127
    fi
    export NSYS_BIN
}

find_python() {
    if [[ -n "${PYTHON:-}" ]]; then
        echo "${PYTHON}"
    elif [[ -x "${REPO_ROOT}/.venv/bin/python" ]]; then
        echo "${REPO_ROOT}/.venv/bin/python"
    else
        echo python3
    fi
}

# A file-name-safe slug of "key=value" words: ring,butterfly -> ring+butterfly.
slug() {
    local s="$*"
    s="${s//,/+}"
    s="${s// /_}"
    s="${s//[^A-Za-z0-9_+.=-]/-}"
    echo "${s}"
}

# The value of --flag or -f in the remaining arguments, else the default.
arg_value() {
    local long="$1" short="$2" default="$3"
    shift 3
    local prev=""
    for a in "$@"; do
        if [[ "${prev}" == "${long}" || ( -n "${short}" && "${prev}" == "${short}" ) ]]; then
            echo "${a}"
            return
        fi
        case "${a}" in
            "${long}"=*) echo "${a#*=}"; return ;;
        esac
        prev="${a}"
    done
    echo "${default}"
}

run() {
    if [[ "${DRY_RUN:-0}" == 1 ]]; then
        printf '%q ' "$@"
        echo
    else
        "$@"
    fi
}

# profile_and_summarize NAME CMD...: profile CMD into OUT_DIR/NAME.nsys-rep, then stats.
profile_and_summarize() {
    local name="$1"
    shift
    local out_dir="${OUT_DIR:-${REPO_ROOT}/benchmarks/results/nsys}"
    local report="${out_dir}/${name}"
    local trace="${NSYS_TRACE:-cuda,nvtx,osrt}"
    local reports="${NSYS_REPORTS:-nvtx_sum,cuda_gpu_kern_sum,cuda_api_sum,cuda_gpu_mem_time_sum}"
    local -a extra=()
    if [[ -n "${NSYS_EXTRA:-}" ]]; then
        read -r -a extra <<<"${NSYS_EXTRA}"
    fi
    mkdir -p "${out_dir}"
    # Ranges in hybridcomm's NVTX domain on (bucket and step names); NCCL keeps
    # its own NVTX ranges on (NCCL_NVTX_DISABLE unset).
    export HYBRIDCOMM_NVTX=1
    echo "== profiling: $*" >&2
    echo "== report:    ${report}.nsys-rep" >&2
    # --trace-fork-before-exec: the ranks are child processes of the launcher.
    # --cuda-graph-trace=node: kernels inside captured CUDA graphs show one by one.
    run "${NSYS_BIN}" profile \
        --trace="${trace}" \
        --sample=none --cpuctxsw=none \
        --trace-fork-before-exec=true \
        --cuda-graph-trace=node \
        --force-overwrite=true \
        --output="${report}" \
        "${extra[@]}" \
        "$@"
    echo "== nsys stats (${reports})" >&2
    run "${NSYS_BIN}" stats --force-export=true --format=column \
        --report="${reports}" "${report}.nsys-rep"
    echo "== open ${report}.nsys-rep in the Nsight Systems GUI (benchmarks/profile/README.md)" >&2
}
