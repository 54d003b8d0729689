#!/usr/bin/env bash
# Gate for a machine with one CUDA GPU (not run by CI). Under 5 minutes.
#
#   gates/gpu_qualify.sh              # on the GPU machine
#   gates/gpu_qualify.sh --cpu-dry-run  # the same steps with gloo on the host, NVML checks skipped
#
# 1. The job with the NCCL backend, one owner, CUDA tensors: 5 uninterrupted
#    updates, and 3 + a checkpoint + 2 more in fresh processes, print the same
#    state_digest as the oracle run on the same device (SGD, momentum, Adam).
# 2. The manifest records the GPU's real product and UUID, read here again
#    through NVML and compared.
# 3. A generation whose saved device product was altered (digests repaired,
#    python -m alpha_ckpt.testing.forge) is refused with device-mismatch before any
#    owner trains, and the store's bytes are unchanged.
# Prints one PASS/FAIL line per check; exits 1 if any failed.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
BACKEND=nccl DEVICE=cuda
if [[ "${1:-}" == "--cpu-dry-run" ]]; then BACKEND=gloo DEVICE=cpu; fi
if [[ $DEVICE == cuda ]] && ! $PY -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu_qualify: no CUDA device here; run it on a GPU machine (or --cpu-dry-run)" >&2
    exit 2
fi
STORE=$(mktemp -d /tmp/alpha-gpu-qualify.XXXXXX)
trap 'rm -rf "$STORE"' EXIT
CONFIG=configs/forecast.toml
FAILED=0
START=$SECONDS

verdict() {  # verdict NAME OK DETAIL
    if [[ $2 == 1 ]]; then echo "PASS $1: $3"; else echo "FAIL $1: $3"; FAILED=1; fi
}
job_argv() {  # alpha-run's and the job's flags in any order -> alpha-run's command line, NUL-separated
    $PY -c 'import sys; from alpha_ckpt.testing.launch import job_argv; sys.stdout.write("\0".join(job_argv(sys.argv[1:])))' \
        --nproc 1 --store "$STORE" --backend "$BACKEND" "$@" "$CONFIG"
}
job() {  # job ARGS... -> the final JSON line on stdout; owners' stderr to $STORE/last.err
    mapfile -d '' -t argv < <(job_argv "$@")
    $PY -m alpha_ckpt.launch.launcher "${argv[@]}" 2>"$STORE/last.err" | tail -n 1
}
field() { $PY -c 'import json, sys; print(json.loads(sys.stdin.read() or "{}").get(sys.argv[1], ""))' "$1"; }
store_hash() { (cd "$STORE" && find objects refs outputs -type f 2>/dev/null | sort | xargs -r sha256sum | sha256sum); }

for opt in sgd momentum adam; do
    sets=(--set "optimizer=$opt")
    straight=$(job --run "straight-$opt" --updates 5 "${sets[@]}" | field state_digest)
    first=$(job --run "split-$opt" --updates 3 --checkpoint-every 3 "${sets[@]}" | field last_generation)
    resumed=$(job --run "split-$opt" --updates 5 --resume-from "${first:-none}" "${sets[@]}" | field state_digest)
    oracle=$($PY -m alpha_ckpt.testing.oracle "$CONFIG" --updates 5 --device "$DEVICE" "${sets[@]}" | field state_digest)
    ok=0; [[ -n $straight && $straight == "$resumed" && $straight == "$oracle" ]] && ok=1
    verdict "resume-equivalence $opt on $DEVICE/$BACKEND" $ok \
        "straight ${straight:0:16} resumed ${resumed:0:16} oracle ${oracle:0:16} $(tail -c 300 "$STORE/last.err" | tr '\n' ' ')"
done

final=$(job --run nvml --updates 2 --checkpoint-every 2)
root=$(echo "$final" | field last_generation)
if [[ $DEVICE == cuda ]]; then
    recorded=$($PY - "$STORE" "$root" <<'EOF'
import json, sys
import pynvml
from alpha_ckpt.generation.reader import open_generation
from alpha_ckpt.store import Store
with open_generation(Store(sys.argv[1]), sys.argv[2]) as g:
    saved = g.manifest.metadata["devices"][0]
pynvml.nvmlInit()
import torch
handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
uuid, name = pynvml.nvmlDeviceGetUUID(handle), pynvml.nvmlDeviceGetName(handle)
uuid, name = (v.decode() if isinstance(v, bytes) else v for v in (uuid, name))
print(1 if saved == {"product": name, "uuid": uuid} else 0, json.dumps(saved), "nvml:", name, uuid)
EOF
)
    verdict "nvml-binding" "${recorded%% *}" "${recorded#* }"
fi

forged=$($PY -m alpha_ckpt.testing.forge --store "$STORE" "${root:-none}" --edit 'devices.0.product="Altered GPU Product"')
before=$(store_hash)
mapfile -d '' -t argv < <(job_argv --run nvml --updates 3 --resume-from "${forged:-none}")
$PY -m alpha_ckpt.launch.launcher "${argv[@]}" >/dev/null 2>"$STORE/refused.err"
code=$?
after=$(store_hash)
ok=0; [[ $code == 3 && $before == "$after" ]] && grep -q "device-mismatch" "$STORE/refused.err" && ok=1
verdict "device-mismatch" $ok "exit $code, store unchanged: $([[ $before == "$after" ]] && echo yes || echo no); \
$(grep -o 'refused \[[a-z-]*\].*' "$STORE/refused.err" | head -n 1)"

echo "gpu_qualify: $((SECONDS - START)) s"
exit $FAILED
