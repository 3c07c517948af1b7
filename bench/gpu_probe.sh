#!/usr/bin/env bash
# The follow-up probes of the first `make gpu-check` on an H100 (2026-11-23), one device call:
#   ddp    DDP at world size 1 (nccl) cost +18..33% over the bare model in the bench: the same job
#          through ddp/train.py bare, under torchrun with nccl, and with each DDP knob that could
#          remove a copy or a broadcast, and a profile of each of the two (top-10 by self time)
#   tune   fast at batch 8192 compiled, default against TORCHINDUCTOR_MAX_AUTOTUNE=1 (MFU short of 30%)
#   mfu    the bench's compiled rows at the best batches (MFU_MODELS, default "fast:8192 resnet18:4096") in
#          each run.compile_mode of MFU_MODES (default "default max-autotune-no-cudagraphs"), written a row
#          at a time (2026-11-26: MFU 27.4-30.0% and 37.6-39.2%, the targets 35% and 45%); mfu.md and .json
#          (max-autotune-no-cudagraphs compiled 160 s for fast alone on 2026-11-26)
#   graphs the second check (2026-11-25) left DDP at world size 1 +14..18% over the bare model and
#          compiled DDP slower than eager: the same job eager, compiled, and compiled with CUDA graphs
#          (run.compile_mode=reduce-overhead), bare and under torchrun with nccl
#   fast-graphs  configs/fast.yaml on the subset compiled with CUDA graphs: does the whole loop keep
#          eager's accuracy (2026-11-26: its evaluation read an output that CUDA graphs had overwritten)
#   fast-seeds   configs/fast.yaml as gpu-check's fast step runs it (seed 0), with seeds 1 and 2
#   fast-muon    configs/fast.yaml with Muon for its filters (optim.muon_lr=0.24, airbench94_muon's), seeds 0, 1, 2:
#          its accuracy and epochs against airbench94's (2 CPU ranks: bench/results/muon-cpu.md)
#   fast-fp16    configs/fast.yaml as gpu-check's fast step runs it with run.amp=fp16: cuDNN's BatchNorm (bf16 takes
#          torch's own, 18 more launches a step) and a GradScaler; its epochs against airbench94's (eager
#          epochs 2-10: 1.18x airbench94's in bf16, 2026-11-26)
#   graphs-split bench/graphs_split.py: the bare model and DDP at world size 1 both with CUDA graphs (like for
#          like), the eager step with the optimizer fused against torch's default, and where a compiled
#          step's GPU time goes at the MFU rows' batches; pair.md, fused.md, split.md (GRAPHS_SPLIT: which of the
#          three parts, default all); the pair also with each backward compiled by compiled autograd, DDP's
#          all-reduce traced into it (python_reducer); at most 300 s
#   recipe-steps bench/recipe_steps.py: configs/fast.yaml's eager step, bf16, fp16 and fp16-weights, against airbench94's own
#          (epochs 2-10: 0.0405 against 0.0272 s, 2026-11-26; on the CPU both dispatch about as many operators):
#          kernels, their device time by kind, spans, each one's top kernels; recipe-steps.md and .json
#   overhead     the bench's DDP-overhead section alone (DDP at world size 1 against the bare model, each
#          compiled-DDP variant): a second sample of its figures; ddp-overhead.md and .json
#   steps        configs/fast.yaml as gpu-check's fast step runs it, 3 epochs, its first 12 steps profiled
#          (run.profile=1:13), step by step (bench/step_times.py): which step of the first epoch, which part
#          of it, costs that epoch twice a later one's seconds (2026-11-27); steps.md (the trace not kept); again
#          after a warm-up of 50 steps (steps-warm50.md): a GPU still ramping its clocks up, or a code path
#   capture      bench/step_capture.py: DDP at world size 1 and the bare model, each step recorded whole in one CUDA
#          graph (torch.cuda.graph, NCCL's all-reduce inside), against both eager, in turns (torch.compile's CUDA
#          graphs left DDP +3% to +55% over the bare model, 2026-11-26/27); capture.md and .json; at most 240 s
#   pairs        bench/epoch_pairs.py: airbench94 and fast.yaml's arms (PAIRS_ARMS, default fast,fast-recorded,fast-graphs) PAIRS times each
#          (default 8) in ONE process, in turns: epochs 2-10 against airbench94's without the up to 31% between
#          processes (2026-11-27); pairs.md and .jsonl, the runs' logs in pairs/; PAIRS_ARMS: which of ours
#          (bench/epoch_pairs.py --arms; fast-graphs, fast-fp16w-graphs: compiled with CUDA graphs; fast-recorded:
#          run.cuda_graph=true)
#   ddp-runs     bench/ddp_runs.sh: configs/fast.yaml end to end, python ddp/train.py against torchrun DDP at world
#          size 1, eager and run.cuda_graph=true, 3 epochs of CIFAR-10-sized synthetic data, the four runs twice
#          (2026-11-28: recorded -8.9% and +0.6%, eager +19% and +32%); ddp-runs/ddp-runs.md; at most 300 s
# Each run's epoch lines (and profile tables) go to $OUT/probe-<step>.log; the fast-* runs' metrics.jsonl
# to $OUT/<run>/.
#   alloc-conf   PYTORCH_CUDA_ALLOC_CONF values that torch's load takes and its first CUDA use may not (ALLOC_CONFS,
#          space-separated; default: a good one, then a bad value, key and range each): what a run of ours on the GPU
#          (ALLOC_CONF_DEVICE, default cuda) says and exits with; alloc-conf.md (a malformed one is refused before
#          torch's import: ddp/startup.py; what torch says of these is not yet seen, 2026-12-07)
#   fsdp   FSDP2 at one rank took 4.1x DDP's step (resnet18, batch 256, bf16, 2026-11-25): the same with
#          --amp off (bf16 shards each BatchNorm on its own: 27 FSDP2 units instead of 8)
#   bash bench/gpu_probe.sh [ddp] [tune] [mfu] [graphs] [fast-graphs] [fast-seeds] [fast-muon] [fast-fp16]
#          [graphs-split] [recipe-steps] [overhead] [steps] [pairs] [capture] [ddp-runs] [alloc-conf] [fsdp]
# Exit status: 1 if a probe (or one run of it) failed, named in the last line.
#   bash bench/gpu_probe.sh --check PROBES...   the names and MFU_MODES / MFU_MODELS checked, nothing run: one
#          line and exit 64 for a bad one (gpu_lease.sh asks first, so a typo costs no device time)
set -uo pipefail
cd "$(dirname "$0")/.."
probes=" ddp tune mfu graphs fast-graphs fast-seeds fast-muon fast-fp16 graphs-split recipe-steps overhead steps pairs capture ddp-runs alloc-conf fsdp "
modes=" default reduce-overhead max-autotune max-autotune-no-cudagraphs "  # torch.compile's (run.compile_mode)
bad() { echo "gpu_probe.sh: $*" >&2; exit 64; }
for s in ${*#--check}; do [[ $probes == *" $s "* ]] || bad "no probe '$s' (the probes: $(echo $probes))"; done
for m in ${MFU_MODES:-default}; do [[ $modes == *" $m "* ]] || bad "MFU_MODES: '$m' is no run.compile_mode (one of: $(echo $modes))"; done
for p in ${GRAPHS_SPLIT:-pair}; do [[ " pair fused split " == *" $p "* ]] || bad "GRAPHS_SPLIT: no part '$p' (the parts: pair fused split)"; done
[[ ${PAIRS:-8} =~ ^[1-9][0-9]*$ ]] || bad "PAIRS: '$PAIRS' is not a whole number >= 1 (the pairs probe's count)"
arms=${PAIRS_ARMS:-fast,fast-recorded,fast-graphs}
for a in ${arms//,/ }; do  # bench/epoch_pairs.py's ARMS
  [[ " fast fast-fp16w fast-graphs fast-fp16w-graphs fast-recorded " == *" $a "* ]] ||
    bad "PAIRS_ARMS: no arm '$a' (the arms: fast fast-fp16w fast-graphs fast-fp16w-graphs fast-recorded, comma-separated)"
done
for r in ${MFU_MODELS:-fast:1}; do
  [[ $r =~ ^[a-z0-9_]+:[1-9][0-9]*$ ]] || bad "MFU_MODELS: '$r' is not MODEL:BATCH (fast:8192, say)"
done
[ "${1:-}" = --check ] && exit 0
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
out=${OUT:-/tmp/probe}
mkdir -p "$out"
subset=(--config configs/fast.yaml data.dataset=npz data.path=.gpu/cifar10-subset.npz run.warmup_steps=3
  run.resume=never run.progress=false)  # gpu-check's fast step
common=(data.dataset=synthetic data.synthetic_test=1000 run.amp=bf16 run.channels_last=true run.cudnn_benchmark=true
  run.resume=never run.progress=false model.name=fast)
run() {  # run LABEL COMMAND...: the command's epoch lines and profile table, under LABEL
  local label=$1 dir=/tmp/probe-run
  shift
  rm -rf "$dir"
  echo "== $label"
  "$@" "run.out_dir=$dir" 2>&1 | grep -E "^epoch|^ +[a-zA-Z_].*(%|us)|Self (CPU|CUDA) time|^profile|Error|error|[Cc][Uu][Dd][Aa] ?[Gg]raph" | cut -c1-200
  [ "${PIPESTATUS[0]}" = 0 ] || failed+=" $s ($label)"
}
failed=""  # the probes (and runs of them) that failed: the exit status is 1 if any
for step in "${@:-ddp tune}"; do
  for s in $step; do
    case $s in
      ddp)
        job=("${common[@]}" data.synthetic_train=32768 train.batch_size=1024 train.epochs=3)
        tr=(python3 -m torch.distributed.run --standalone --nproc_per_node=1 ddp/train.py run.parallel=ddp)
        {
          run "bare" python3 ddp/train.py "${job[@]}"
          run "ddp nccl" "${tr[@]}" "${job[@]}"
          run "ddp nccl broadcast_buffers=false" "${tr[@]}" "${job[@]}" ddp.broadcast_buffers=false
          run "ddp nccl gradient_as_bucket_view=true" "${tr[@]}" "${job[@]}" ddp.gradient_as_bucket_view=true
          run "ddp nccl static_graph=true" "${tr[@]}" "${job[@]}" ddp.static_graph=true
          run "bare, profiled" python3 ddp/train.py "${job[@]}" run.profile=70:73
          run "ddp nccl, profiled" "${tr[@]}" "${job[@]}" run.profile=70:73
        } >"$out/probe-ddp.log"
        ;;
      tune)
        job=("${common[@]}" data.synthetic_train=65536 train.batch_size=8192 train.epochs=3 run.compile=true)
        {
          run "compiled, default" python3 ddp/train.py "${job[@]}"
          TORCHINDUCTOR_MAX_AUTOTUNE=1 run "compiled, max-autotune" timeout 300 python3 ddp/train.py "${job[@]}"
        } >"$out/probe-tune.log"
        ;;
      mfu)
        python3 -c 'import json, sys
from bench import harness, report
from bench.__main__ import SIZES
device = harness.torch.device("cuda", 0) if harness.torch.cuda.is_available() else harness.torch.device("cpu")
unknown = [p.split(":")[0] for p in sys.argv[3].split() if p.split(":")[0] not in harness.models.MODELS]
if unknown:
    sys.exit(f"gpu_probe.sh mfu: MFU_MODELS names {unknown}, not models (the models: {sorted(harness.models.MODELS)})")
rows = []
for mode in sys.argv[2].split():
    for pair in sys.argv[3].split():
        model, batch = pair.split(":")
        rows += harness.compiled_sweep(dict(SIZES["full"], compiled=[(model, int(batch))]), device, mode)
        open(sys.argv[1] + ".json", "w").write(json.dumps(rows, indent=1))  # after each row: a cut-off call keeps it
        open(sys.argv[1] + ".md", "w").write("\n".join(report.compiled(rows)) + "\n")' \
          "$out/mfu" "${MFU_MODES:-default max-autotune-no-cudagraphs}" "${MFU_MODELS:-fast:8192 resnet18:4096}" \
          >"$out/probe-mfu.log" 2>&1 || failed+=" mfu"
        cat "$out/mfu.md" >>"$out/probe-mfu.log" 2>/dev/null
        ;;
      graphs-split)
        # bounded: NCCL inside a CUDA graph (the pair's compiled-autograd DDP) may hang; what finished is written
        timeout -k 10 300 python3 bench/graphs_split.py "$out" ${GRAPHS_SPLIT:-pair fused split} \
          >"$out/probe-graphs-split.log" 2>&1 || failed+=" graphs-split"
        cat "$out/pair.md" "$out/fused.md" "$out/split.md" >>"$out/probe-graphs-split.log" 2>/dev/null
        ;;
      capture)
        # bounded: an all-reduce recorded in a CUDA graph may hang; what finished is written
        timeout -k 10 240 python3 bench/step_capture.py "$out" >"$out/probe-capture.log" 2>&1 || failed+=" capture"
        ;;
      ddp-runs)
        # bounded: four runs of fast.yaml twice, each a process of its own (2026-11-28: 3 epochs, 266 s with capture)
        timeout -k 10 300 bash bench/ddp_runs.sh "$out/ddp-runs" >"$out/probe-ddp-runs.log" 2>&1 || failed+=" ddp-runs"
        cat "$out/ddp-runs/ddp-runs.md" >>"$out/probe-ddp-runs.log" 2>/dev/null
        ;;
      recipe-steps)
        python3 bench/recipe_steps.py "$out" --airbench .gpu/airbench-0.1.8.tar.gz >"$out/probe-recipe-steps.log" 2>&1 ||
          failed+=" recipe-steps"
        ;;
      graphs)
        job=("${common[@]}" data.synthetic_train=32768 train.batch_size=1024 train.epochs=3)
        tr=(python3 -m torch.distributed.run --standalone --nproc_per_node=1 ddp/train.py run.parallel=ddp)
        {
          for launch in bare ddp; do
            cmd=(python3 ddp/train.py)
            [ $launch = ddp ] && cmd=("${tr[@]}")
            run "$launch eager" "${cmd[@]}" "${job[@]}"
            run "$launch compiled" "${cmd[@]}" "${job[@]}" run.compile=true
            run "$launch compiled, CUDA graphs" "${cmd[@]}" "${job[@]}" run.compile=true run.compile_mode=reduce-overhead
          done
        } >"$out/probe-graphs.log"
        ;;
      fast-graphs)
        rm -rf "$out/fast-graphs"
        echo "== fast.yaml on the subset, compiled, CUDA graphs" >"$out/probe-fast-graphs.log"
        python3 ddp/train.py "${subset[@]}" run.compile=true run.compile_mode=reduce-overhead \
          "run.out_dir=$out/fast-graphs" >>"$out/probe-fast-graphs.log" 2>&1 || failed+=" fast-graphs"
        ;;
      fast-seeds)
        for seed in 1 2; do
          rm -rf "$out/fast-seed$seed"
          echo "== fast.yaml on the subset, seed $seed"
          python3 ddp/train.py "${subset[@]}" run.seed=$seed "run.out_dir=$out/fast-seed$seed" 2>&1 || failed+=" fast-seeds ($seed)"
        done >"$out/probe-fast-seeds.log"
        ;;
      fast-muon)
        for seed in 0 1 2; do
          rm -rf "$out/fast-muon-seed$seed"
          echo "== fast.yaml on the subset, optim.muon_lr=0.24, seed $seed"
          python3 ddp/train.py "${subset[@]}" optim.muon_lr=0.24 run.seed=$seed "run.out_dir=$out/fast-muon-seed$seed" \
            2>&1 || failed+=" fast-muon ($seed)"
        done >"$out/probe-fast-muon.log"
        ;;
      fast-fp16)
        rm -rf "$out/fast-fp16"
        echo "== fast.yaml on the subset, run.amp=fp16" >"$out/probe-fast-fp16.log"
        python3 ddp/train.py "${subset[@]}" run.amp=fp16 "run.out_dir=$out/fast-fp16" >>"$out/probe-fast-fp16.log" 2>&1 ||
          failed+=" fast-fp16"
        ;;
      pairs)
        python3 bench/epoch_pairs.py "$out" --pairs "${PAIRS:-8}" --arms "$arms" \
          >"$out/probe-pairs.log" 2>&1 || failed+=" pairs"
        ;;
      steps)
        rm -rf "$out/steps"
        echo "== fast.yaml on the subset, 3 epochs, steps 1-12 profiled" >"$out/probe-steps.log"
        { python3 ddp/train.py "${subset[@]}" train.epochs=3 run.profile=1:13 "run.out_dir=$out/steps" &&
          python3 bench/step_times.py "$out/steps/profile/rank0.json" 1 --out "$out/steps.md"; } \
          >>"$out/probe-steps.log" 2>&1 || failed+=" steps"
        rm -rf "$out/steps/profile"  # tens of MB on a GPU: steps.md is what comes back
        # the same after 50 throwaway steps (10 epochs' worth, as airbench94's warm-up is a whole run): a first epoch
        # that pays for a GPU not yet at speed (its clocks) is a normal one here; one that pays for a code path is not
        rm -rf "$out/steps-warm50"
        echo "== the same with run.warmup_steps=50" >>"$out/probe-steps.log"
        { python3 ddp/train.py "${subset[@]}" train.epochs=3 run.profile=1:13 run.warmup_steps=50 \
          "run.out_dir=$out/steps-warm50" &&
          python3 bench/step_times.py "$out/steps-warm50/profile/rank0.json" 1 --out "$out/steps-warm50.md"; } \
          >>"$out/probe-steps.log" 2>&1 || failed+=" steps (warm-up 50)"
        rm -rf "$out/steps-warm50/profile"
        ;;
      overhead)
        python3 -c 'import json, sys
from bench import harness, report
from bench.__main__ import SIZES
rows = harness.ddp_overhead(SIZES["full"])
open(sys.argv[1] + ".json", "w").write(json.dumps(rows, indent=1))
open(sys.argv[1] + ".md", "w").write("\n".join(report.ddp(rows)) + "\n")' "$out/ddp-overhead" \
          >"$out/probe-overhead.log" 2>&1 || failed+=" overhead"
        cat "$out/ddp-overhead.md" >>"$out/probe-overhead.log" 2>/dev/null
        ;;
      alloc-conf)
        confs=${ALLOC_CONFS:-expandable_segments:True expandable_segments:yes max_split_size_mb:abc max_split_size_mb:1 \
garbage_collection_threshold:2 backend:nonesuch no_such_key:1}
        { echo "| PYTORCH_CUDA_ALLOC_CONF | exit | first error line, or the last line |"; echo "| --- | ---: | --- |"; } \
          >"$out/alloc-conf.md"
        for conf in $confs; do
          rm -rf "$out/alloc-conf-run"
          PYTORCH_CUDA_ALLOC_CONF=$conf timeout -k 5 120 python3 ddp/train.py "run.device=${ALLOC_CONF_DEVICE:-cuda}" \
            model.name=small data.dataset=synthetic data.synthetic_train=256 data.synthetic_test=64 train.epochs=1 \
            train.batch_size=64 run.resume=never run.progress=false "run.out_dir=$out/alloc-conf-run" \
            >"$out/alloc-conf-run.log" 2>&1
          code=$?
          said=$(grep -m1 -iE "error" "$out/alloc-conf-run.log" || tail -n1 "$out/alloc-conf-run.log")
          echo "| \`$conf\` | $code | ${said//|/\\|} |" | cut -c1-400 >>"$out/alloc-conf.md"
          { echo "== PYTORCH_CUDA_ALLOC_CONF=$conf: exit $code"; tail -n 30 "$out/alloc-conf-run.log"; } >>"$out/probe-alloc-conf.log"
        done
        rm -rf "$out/alloc-conf-run.log" "$out/alloc-conf-run"
        cat "$out/alloc-conf.md" >>"$out/probe-alloc-conf.log"
        ;;
      fsdp)
        for amp in auto off; do
          python3 bench/fsdp_memory.py --model resnet18 --batch 256 --steps 10 --ranks 1 --amp $amp --out "$out/fsdp-$amp.md" ||
            failed+=" fsdp ($amp)"
        done >"$out/probe-fsdp.log" 2>&1
        ;;
    esac
  done
done
cat "$out"/probe-*.log
[ -z "$failed" ] || { echo "gpu_probe.sh: failed:$failed" >&2; exit 1; }
