#!/usr/bin/env bash
# One device call of GPU work whose results come back even when the call runs out of time:
#   bash bench/gpu_lease.sh [--dry-run] [SECONDS]
# runs `bash bench/gpu_check.sh $CHECK_STEPS` (default: none; `fast airbench` until 2026-11-27, whose figures are
# in), then `bash bench/gpu_probe.sh $PROBES` (default: mfu fast-muon ddp-runs alloc-conf, what issue 33 still
# needs: MFU at the best batches on whichever GPU is lent (an H200's memory is faster than the H100's whose kernels
# capped it), fast.yaml with Muon for its filters (seeds 0-2: its recording, epochs and accuracy on a GPU), then
# fast.yaml end to end in one process and under torchrun DDP at world size 1; last, in what time is left, what a
# run says of allocator settings torch checks at its first CUDA use; until 2026-11-28: capture pairs;
# until 2026-11-27-b: pairs graphs-split steps recipe-steps); graphs-split runs its pair alone unless GRAPHS_SPLIT
# names its parts; an mfu probe runs at MFU_MODES=default MFU_MODELS="fast:8192 resnet18:4096" unless set (on an
# H100 max-autotune-no-cudagraphs added 1.7-2.8% to resnet18's images/s for 252 s of compile); none with
# --dry-run: the probes need CUDA), all of it within SECONDS (default 540: a device call's 600 s less
# the start of python and the packing). The device tool brings back at most 8 files from $OUT, so the
# work goes to $GPU_LEASE_DIR (default /tmp/gpu-lease) and is packed, checkpoints left out, into
# $OUT/gpu-lease.tgz every $GPU_LEASE_PACK_S seconds (default 20) and at the end: a call killed at its
# limit still brings back every log up to its last 20 s. The check's summary.md is also copied beside
# the archive; later-epochs.md (in it, and printed last) sets the epochs after the first of the check's fast
# run and of each probe's fast-* run beside airbench94's of the same call.
#   run(command="bash bench/gpu_lease.sh", carry=[".gpu"], timeout_s=600)   after `make gpu-carry` here
# Exit status: 124 when SECONDS ran out, else the check's (its failed steps) plus 1 if a probe failed.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
dry=()
[ "${1:-}" = --dry-run ] && dry=(--dry-run) && shift
budget=${1:-540}
[[ $budget =~ ^[1-9][0-9]*$ ]] || { echo "gpu_lease.sh: SECONDS must be a whole number >= 1, not '$budget'" >&2; exit 64; }
every=${GPU_LEASE_PACK_S:-20}
[[ $every =~ ^[1-9][0-9]*$ ]] || { echo "gpu_lease.sh: GPU_LEASE_PACK_S must be a whole number >= 1, not '$every'" >&2; exit 64; }
check=${CHECK_STEPS-}
probes=${PROBES-mfu fast-muon ddp-runs alloc-conf}
export MFU_MODES="${MFU_MODES-default}" MFU_MODELS="${MFU_MODELS-fast:8192 resnet18:4096}"
export GRAPHS_SPLIT="${GRAPHS_SPLIT-pair}"  # the fused A/B and the MFU split were measured; the pair's profile not yet
[ -z "$probes" ] || bash bench/gpu_probe.sh --check $probes || exit 64  # a typo found now, not after the check
[ ${#dry[@]} = 1 ] && probes=${PROBES-}
work=${GPU_LEASE_DIR:-/tmp/gpu-lease}
dest=${OUT:-$root/bench/results/gpu-check}
# emptied first, so only a folder this script made (its .gpu-lease mark) or an empty or new one
if [ "$(realpath -m "$work")" = "$(realpath -m "$dest")" ] ||
  { [ -n "$(ls -A "$work" 2>/dev/null)" ] && [ ! -f "$work/.gpu-lease" ]; }; then
  echo "gpu_lease.sh: GPU_LEASE_DIR=$work holds files this script did not write: name a new or empty folder" >&2
  exit 64
fi
rm -rf "$work"
mkdir -p "$work/check" "$work/probe" "$dest" && touch "$work/.gpu-lease" || exit 64

pack() {  # the work folder into $dest/gpu-lease.tgz, whole or not at all (a kill mid-way leaves the last one)
  tar czf "$dest/gpu-lease.tgz.part" --exclude='*.pt' -C "$(dirname "$work")" "$(basename "$work")" 2>/dev/null &&
    mv -f "$dest/gpu-lease.tgz.part" "$dest/gpu-lease.tgz"
  [ -f "$work/check/summary.md" ] && cp "$work/check/summary.md" "$dest/summary.md"
  return 0
}
(while sleep "$every"; do pack; done) >/dev/null 2>&1 &  # (no hold on our output: a pipe reader sees our end)
packer=$!
run_all() {  # the check, then the probes: the exit status counts what failed
  local code=0
  if [ -n "$CHECK_STEPS" ]; then bash bench/gpu_check.sh $LEASE_DRY $CHECK_STEPS; code=$?; fi
  if [ -n "$PROBES" ]; then OUT=$LEASE_DIR/probe bash bench/gpu_probe.sh $PROBES || code=$((code + 1)); fi
  return $code
}
export -f run_all
export CHECK_STEPS="$check" PROBES="$probes" GPU_CHECK_OUT="$work/check" LEASE_DIR="$work" LEASE_DRY="${dry[*]}"
timeout "$budget" bash -c run_all &  # timeout makes a process group of its own (its pid) ...
worker=$!
wait "$worker"
code=$?
kill -KILL -- -"$worker" 2>/dev/null  # ... ended whole: a rank that stops gracefully on SIGTERM writes no more
kill "$packer" 2>/dev/null
wait "$packer" 2>/dev/null
[ $code = 124 ] && echo "gpu_lease.sh: out of time after $budget s; what was written until then is packed" >&2
runs=()  # epochs 2 on of the check's fast run and the probes' fast-* runs, against airbench94's (seconds)
for d in "$work"/probe/fast-*/; do [ -d "$d" ] && runs+=("${d%/}"); done
if [ ${#runs[@]} -gt 0 ] || [ -e "$work/check/fast" ] || [ -e "$work/check/airbench.json" ]; then
  PYTHONPATH="$root" timeout -k 5 60 "${PYTHON:-python3}" bench/gpu_summary.py --later-epochs "$work/check" \
    "${runs[@]}" >"$work/later-epochs.md" 2>&1
  cat "$work/later-epochs.md"
fi
[ -f "$work/probe/pairs.md" ] && cat "$work/probe/pairs.md"  # the epochs against airbench94's, in one process
pack
echo "gpu_lease.sh: $(tar tzf "$dest/gpu-lease.tgz" | grep -vc '/$') files in $dest/gpu-lease.tgz (exit $code)"
exit $code
