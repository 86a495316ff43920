#!/usr/bin/env bash
# The GPU checks of issues 16, 17 and 19 as named steps, for one call on a lent GPU machine (device
# tool): `bash profiling/gpu_checks.sh STEP ...` with `carry: [".whl", "data"]` (data/: reproduce's).
# Each step has its own time limit and runs only while the call's budget lasts (BUDGET seconds,
# default 560: a call may run 600); the results so far are packed into $OUT/results.tgz after each
# step (the tool brings back at most 8 files). Copy them to profiling/results/gpu_<device>/ with the
# commit that ran them.
#
# Measured durations say so (2026-11-26: a machine started in 30-50 s, so a session's 15 minutes
# held about 13 of runs); the others are estimates.
# Issue 16, clients sharing the GPU through the host-staged gloo transport (about, on an H200):
#   exact    distributed == simulator, 4 clients, fp32 (shared_device_exact.py)    1 min measured
#   table9   Table 9, 4 clients, Qwen2-1.5B: one method per call, merged into one table
#            (H100: 75 s a method measured)                                        5 x 1-2 min
#            (D-Adam's 4 clients need an H200's memory; on an H100 it stops at its first step)
#   memory   Llama-3.1-8B, 2 clients, ring: peak per client against the estimator         2 min
#   offload  Llama-3.1-8B, 4 clients with --offload frozen (an H200's memory)              4 min
# Issue 17, one client (profiling/README.md, "GPU measurements that remain"):
#   setup    setup + training peaks, resident and offloaded, Llama-3.1-8B (target 1)       6 min
#            (H200, 743e68b: setup and aggshare together 325 s measured)
#   terms    the estimator's setup terms against torch.cuda, drawn and from a checkpoint   20 s measured
#   ckpt     as setup, the 8B model loaded from a bf16 safetensors checkpoint of it       7 min
#   matmul   matmul efficiency, uncapped and capped at 32 / 96 GB (target 4)   H200: 16 s a run measured
#   update   the fused update on the device (target 3)                                     50 s measured
#   aggshare DECA's Agg & Up share with the eager and the fused update (target 3) at 1 x 512, each
#            run twice in alternating order (--repeats 2: the later of two runs was the slower)  5 min
#   aggpreset the fused update at the rtxpro6000 preset's 4 x 512, 2 layers per block, with the
#            decoder layers compiled and not, alternated (--repeats 2): should the presets compile  7 min
#   compile  the fused run at 1 x 512 with the decoder layers compiled (--compile-layers) and not,
#            alternated (--repeats 2; c65074b: 40.5 against 118.2 ms, one run each)       4-5 min
#   trace    the fused update's 1 x 512 runs, the layers compiled and not, with steps 9-11 traced by
#            torch.profiler (--trace-steps): where the compiled step's time goes (da61034 traced the
#            eager one: the device worked 49 of 104-127 ms)                                    4 min
#   events   the fused update's share at 1 x 512 with the phases timed by CUDA events and by waiting
#            (--phase-timing), and the rtx5090_qwen2.5-3b preset with events       2 x 2 + 2 min
#   fused4   the same with neighbours: DECA eager and fused, table9's 4 clients (target 3) 3-5 min
#            (H200: fused4, update and terms together 247 s measured)
#            (the fused run compiles its kernels in its warm-up steps, 4 ranks at once)
#   fits     each preset trained under its card's memory (--card; target 4); an H100 refuses
#            the RTX PRO 6000 ones at once (their cap is above its memory): an H200's     4 x 2 min
#            (H200: about 55 s a preset measured)
#   fitsn    the two RTX 5090 presets with real neighbours: 3 clients on a ring share the GPU, each
#            capped at the card (an H200's: an H100 refuses 3 x 32 GB at once)          2 x 3-5 min
# Issue 19, the scaled accuracy grid (reproduce/gpu_ag_news.yaml; data/ag_news carried):
#   reproduce  pretrain the 88M Llama (once per machine, 135-157 s), then the grid's cells within the
#            budget, seed 0 of every method first (four at a time: 400 s each for DECA and its ablations,
#            measured), and the tables of the finished cells; the cells finished earlier are committed in
#            reproduce/results/gpu_ag_news/cells and start the grid's runs directory (a fresh machine
#            pretrains again, to the same weights on the same GPU type, which the cells' base hash checks)
#            GRID_ARGS picks the cells: e.g. "--only seed=1 method=deca,dadam --jobs 2"; GRID_SET sets an
#            option of every cell (deca-reproduce --set), whose cells then run in GRID_RUNS (default
#            runs/gpu_ag_news), e.g. GRID_SET=compile_layers=true GRID_RUNS=runs/gpu_ag_news_compiled
#   decaf    DeCAF's re-factorization, pair by pair against one SVD per core shape on the host, for
#            the grid's DeCAF cells (profiling/decaf_refactor.py)                              1 min
# Across two calls on one warm machine (a session's 15 minutes then hold about 13 of steps, and the
# accuracy grid about 580 s of cells after pretraining, measured, against 400 s in one call):
#   bg STEP ...  (the call's last step) runs the steps named after it in a process session of its own,
#            which outlives the call, with BG_BUDGET seconds (default 1100), waits out this call's
#            BUDGET and brings back what they finished so far (their log, results.tgz, the grid's cells)
#   bg-finish  the next call, at once (the machine stays warm 30 s): waits for them while its BUDGET
#            lasts, then stops the step running (SIGTERM; the grid keeps its finished cells and writes
#            its tables) and skips the rest, and brings back their log and results.tgz
# Wheels the machine lacks travel in .whl/, and the grid's data in data/: `bash profiling/gpu_carry.sh` makes both.
# DRY_RUN=1 prints each command instead of running it, and sets nothing up (no GPU needed): the
# tests parse every printed command's options, so a typo cannot waste a lent GPU's minutes.
set -u -o pipefail
OUT=${OUT:-/tmp/out}
RES=/tmp/res
BG=/tmp/bg  # a background run's (bg): its pid, log, stop flag and results
DEADLINE=$((SECONDS + ${BUDGET:-560}))
pack() { tar czf "$OUT/results.tgz" -C "$RES" .; }
# run CMD...: CMD, or with DRY_RUN its words, shell-quoted, on one line
run() {
  if [[ -n ${DRY_RUN:-} ]]; then printf '%q ' "$@"; echo; else "$@"; fi
}
# collect LINES: a background run's log and results so far into $OUT, and its last LINES lines on stdout
collect() {
  cp "$BG/log" "$OUT/"
  [[ -f $BG/out/results.tgz ]] && cp "$BG/out/results.tgz" "$OUT/"
  tail -n "$1" "$BG/log"
}
# step LIMIT NAME CMD...: CMD with at most LIMIT seconds, fewer if the call's budget is shorter; returns its status
step() {
  local limit=$1 name=$2 left=$((DEADLINE - SECONDS - 10)) rc
  shift 2
  ((limit < left)) && left=$limit
  if ((left < 30)); then echo "$name skipped: the call's budget is spent"; return 124; fi
  if [[ -n ${BG_RUN:-} && -f $BG/stop ]]; then echo "$name skipped: stopped by bg-finish"; return 124; fi
  if [[ -n ${DRY_RUN:-} ]]; then run "$@"; return; fi
  # -k: a command that outlives its SIGTERM by 30 s is killed, so the steps after it still run
  timeout -k 30 "$left" "$@"
  rc=$?
  echo "$name rc=$rc"
  pack
  return $rc
}
[[ -n ${DRY_RUN:-} ]] || mkdir -p "$RES" "$OUT"
if [[ -z ${DRY_RUN:-} && -z ${SET_UP:-} ]]; then  # SET_UP: a background run's, set up by its caller
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl ||
    exit 1
  export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$RES/device.txt"
  PYTHONPATH=/tmp/site python3 -m pip check | grep -v "^$" | head -20  # what the carried wheels still lack
  python3 -c "import torch, deepspeed, transformers, peft, datasets, huggingface_hub.hf_api, deca_ds.runtime.trainer
print(torch.__version__, deepspeed.__version__, transformers.__version__, peft.__version__)" | tee -a "$RES/device.txt" ||
    exit 1
  export SET_UP=1
fi

QWEN=(--from-config --model profiling/configs/qwen2-1.5b.json --transport gloo --layers-per-block 4)
LLAMA=(--from-config --model profiling/configs/llama-3.1-8b-instruct.json)
BF16=(--ds-config ds_configs/profile_bf16.json --out "$RES")
TABLE9=("${BF16[@]}" --ranks 4 --steps-per-block 3 --warmup 3 --name profile_resources_4clients_qwen2-1.5b --merge)

(($#)) || { echo "name the steps to run: exact table9 memory offload setup terms ckpt trains matmul update aggshare compile aggpreset trace events fused4 fits fitsn decaf reproduce bg bg-finish"; exit 2; }
while (($#)); do
  what=$1
  shift
  case $what in
    exact) step 120 exact python3 profiling/shared_device_exact.py --ranks 4 --out "$RES/shared_device_exact.json" \
             --train-args --from-config --model profiling/configs/cpu/llama-8x256 ;;
    table9) for method in deca dec_lora dec_adapter decaf dadam; do
              step 150 "table9 $method" python3 profiling/profile_resources.py "${TABLE9[@]}" --methods $method \
                --train-args "${QWEN[@]}"
            done ;;
    memory) step 150 memory python3 profiling/profile_memory.py "${BF16[@]}" --ranks 2 --layers-per-block 1 \
              --offload none --steps-per-block 2 --warmup 2 --name profile_memory_2clients_llama-3.1-8b \
              --train-args "${LLAMA[@]}" --transport gloo ;;
    offload) step 240 offload python3 profiling/profile_memory.py "${BF16[@]}" --ranks 4 --layers-per-block 1 \
               --offload frozen --steps-per-block 2 --warmup 2 --name profile_memory_4clients_offload_llama-3.1-8b \
               --train-args "${LLAMA[@]}" --transport gloo ;;
    setup) step 420 setup python3 profiling/profile_memory.py "${BF16[@]}" --ranks 1 --layers-per-block 1 \
             --offload none frozen --offload-keep 0 --steps-per-block 3 --train-args "${LLAMA[@]}" ;;
    terms) step 150 terms python3 profiling/setup_peaks.py --device cuda --hidden 4096 --layers 8 --vocab 128256 \
             --eval-batch 32 --out "$RES/setup_peaks.json" ;;
    ckpt) # the random initialisation of `setup`'s runs saved as a checkpoint (profiling/save_init.py), then loaded
          [[ -f /tmp/llama-3.1-8b-init/model.safetensors ]] ||
            step 180 "ckpt save" python3 profiling/save_init.py --out /tmp/llama-3.1-8b-init \
              --train-args --ds_config ds_configs/profile_bf16.json "${LLAMA[@]}"
          step 420 ckpt python3 profiling/profile_memory.py "${BF16[@]}" --ranks 1 --layers-per-block 1 \
            --offload none frozen --offload-keep 0 --steps-per-block 3 --name profile_memory_checkpoint_llama-3.1-8b \
            --train-args --model /tmp/llama-3.1-8b-init ;;
    trains) # the embeddings' and the LM head's blocks (--train-embeddings --train-lm-head): the round's peak is
            # the embeddings' block's (525M parameters against a layer's 218M), measured against the estimate
            step 420 trains python3 profiling/profile_memory.py "${BF16[@]}" --ranks 1 --layers-per-block 1 \
              --offload none frozen --steps-per-block 2 --name profile_memory_trains_llama-3.1-8b \
              --train-args "${LLAMA[@]}" --train-embeddings --train-lm-head ;;
    matmul) step 200 matmul python3 profiling/matmul_efficiency.py --layers 4 --out "$RES/matmul_efficiency.json"
            for gb in 32 96; do
              step 200 "matmul ${gb}gb" python3 profiling/matmul_efficiency.py --layers 4 --card-gb $gb \
                --out "$RES/matmul_efficiency_${gb}gb.json"
            done ;;
    update) step 150 update python3 profiling/update_cost.py --config profiling/configs/llama-3.1-8b-instruct.json \
              --out "$RES" ;;
    decaf) step 120 decaf python3 profiling/decaf_refactor.py --out "$RES" ;;
    aggshare) step 360 aggshare python3 profiling/profile_resources.py "${BF16[@]}" --ranks 1 --methods deca \
                --steps-per-block 3 --warmup 3 --updates eager fused --repeats 2 --name profile_resources_llama-3.1-8b \
                --train-args "${LLAMA[@]}" --layers-per-block 1 ;;
    compile) step 360 compile python3 profiling/profile_resources.py "${BF16[@]}" --ranks 1 --methods deca \
               --steps-per-block 3 --warmup 3 --updates fused compiled --repeats 2 \
               --name profile_resources_llama-3.1-8b_compiled --train-args "${LLAMA[@]}" --layers-per-block 1 ;;
    aggpreset) # the same at the preset's micro-batch (4 x 512) and granularity (2 layers per block)
               step 480 aggpreset python3 profiling/profile_resources.py \
                 --ds-config ds_configs/rtxpro6000_llama-3.1-8b.json --out "$RES" --ranks 1 --methods deca \
                 --steps-per-block 3 --warmup 3 --updates fused compiled --repeats 2 \
                 --name profile_resources_llama-3.1-8b_preset \
                 --train-args "${LLAMA[@]}" --dataset synthetic --synthetic-words 600 ;;
    trace) # a block's three steps (the last activates the next block), after the kernels compiled: where the
           # compiled step's time goes, beside the fused update's eager layers
           step 300 trace python3 profiling/profile_resources.py "${BF16[@]}" --ranks 1 --methods deca \
             --steps-per-block 3 --warmup 3 --updates fused compiled \
             --name profile_resources_llama-3.1-8b_compiled_trace \
             --train-args "${LLAMA[@]}" --layers-per-block 1 --trace-steps 3 --trace-start 9 ;;
    events) # target 3 with the phases timed by CUDA events (--phase-timing events: the host runs ahead of the
            # device) beside the default, which waits for the device at each phase: the fused update, 1 x 512
            for timing in sync events; do
              step 180 "events $timing" python3 profiling/profile_resources.py "${BF16[@]}" --ranks 1 --methods deca \
                --steps-per-block 3 --warmup 3 --updates fused --name "profile_resources_llama-3.1-8b_$timing" \
                --train-args "${LLAMA[@]}" --layers-per-block 1 --phase-timing $timing
            done
            # the rtx5090_qwen2.5-3b preset, whose step may be the host's launches
            step 150 "events qwen2.5-3b" python3 profiling/profile_resources.py \
              --ds-config ds_configs/rtx5090_qwen2.5-3b.json --out "$RES" --ranks 1 --methods deca \
              --steps-per-block 2 --warmup 2 --updates eager --name profile_resources_qwen2.5-3b_events \
              --train-args --from-config --model profiling/configs/qwen2.5-3b-instruct.json --dataset synthetic \
              --synthetic-words 600 --layers-per-block 2 --phase-timing events ;;
    fused4) step 300 fused4 python3 profiling/profile_resources.py "${BF16[@]}" --ranks 4 --methods deca \
              --updates eager fused --steps-per-block 3 --warmup 3 --name profile_resources_4clients_qwen2-1.5b_fused \
              --train-args "${QWEN[@]}" ;;
    fits) for preset in rtx5090_qwen2-1.5b:qwen2-1.5b rtx5090_qwen2.5-3b:qwen2.5-3b-instruct \
                        rtxpro6000_llama-2-7b:llama-2-7b-hf rtxpro6000_llama-3.1-8b:llama-3.1-8b-instruct; do
            name=${preset%%:*} card="RTX 5090"
            [[ $name == rtxpro6000* ]] && card="RTX PRO 6000"
            # the presets' own micro-batch, sequence length and granularity; sequences filled to 512 tokens
            step 180 "fits $name" python3 profiling/profile_memory.py --ds-config "ds_configs/$name.json" --card "$card" \
              --ranks 1 --layers-per-block 2 --steps-per-block 2 --warmup 1 --out "$RES" --name "fits_$name" \
              --train-args --from-config --model "profiling/configs/${preset#*:}.json" --dataset synthetic \
              --synthetic-words 600
          done ;;
    fitsn) # each client's peak with two neighbours (their mixing buffers), under the card's cap: over gloo, which
           # ranks sharing a GPU need (NCCL's own device buffers are not in it)
           for preset in rtx5090_qwen2-1.5b:qwen2-1.5b rtx5090_qwen2.5-3b:qwen2.5-3b-instruct; do
             name=${preset%%:*}
             step 300 "fitsn $name" python3 profiling/profile_memory.py --ds-config "ds_configs/$name.json" \
               --card "RTX 5090" --ranks 3 --layers-per-block 2 --steps-per-block 2 --warmup 1 --out "$RES" \
               --name "fits_3clients_$name" --train-args --from-config --model "profiling/configs/${preset#*:}.json" \
               --dataset synthetic --synthetic-words 600 --topology ring --transport gloo
           done ;;
    reproduce) [[ -f data/ag_news/train.jsonl || -n ${DRY_RUN:-} ]] || { echo "reproduce: no data/ag_news (carry it)"; exit 2; }
               # the cells earlier calls finished (committed in reproduce/results/gpu_ag_news/cells), unless this
               # machine holds its own; the grid pretrains its model first (once per machine) and runs
               # those cells again only if the weights differ (their settings hold the weights' sha256)
               # GRID_SET: options of every cell in place of the grid file's (deca-reproduce --set), run in
               # GRID_RUNS, e.g. GRID_SET=compile_layers=true GRID_RUNS=runs/gpu_ag_news_compiled
               runs=${GRID_RUNS:-runs/gpu_ag_news}
               # shellcheck disable=SC2206  # GRID_SET: words
               set_options=(${GRID_SET:+--set $GRID_SET})
               [[ -n ${DRY_RUN:-} || -d $runs || $runs != runs/gpu_ag_news ]] ||
                 { mkdir -p runs && cp -r reproduce/results/gpu_ag_news/cells runs/gpu_ag_news; }
               [[ -n ${DRY_RUN:-} ]] || { nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv -l 10 \
                                            > "$RES/gpu_ag_news_utilization.csv" & util=$!; }
               # stopped by its time limit, the grid stops its cells (SIGTERM) and finished cells stay finished;
               # 60 s are left for that, the tables and the packing
               # shellcheck disable=SC2206  # GRID_ARGS: words, e.g. --only seed=1 --jobs 2
               grid=(python3 launch/reproduce.py reproduce/gpu_ag_news.yaml --runs-dir "$runs" --results-dir "$RES/${runs##*/}"
                     "${set_options[@]}" ${GRID_ARGS:-})
               step $((DEADLINE - SECONDS - 70)) grid "${grid[@]}"
               if (($? == 2)) && [[ -z ${DRY_RUN:-} && ! -d $runs.other_base ]]; then
                 # refused before any cell ran: e.g. the committed cells were fine-tuned from other weights
                 # than this machine's pretraining made (the grid mixes no two bases); they are set aside
                 # (and stay committed) and the grid starts afresh on this machine's base
                 mv "$runs" "$runs.other_base"
                 step $((DEADLINE - SECONDS - 70)) grid "${grid[@]}"
               fi
               run python3 launch/reproduce.py reproduce/gpu_ag_news.yaml --runs-dir "$runs" --report-only \
                 --results-dir "$RES/${runs##*/}" "${set_options[@]}"
               # the cell directories (settings, metrics, scores: kilobytes) come back too, for
               # reproduce/results/gpu_ag_news/cells; not a simulated cell's checkpoint (gigabytes)
               [[ -n ${DRY_RUN:-} ]] || { kill "$util"; mkdir -p "$RES/${runs##*/}_runs"
                                          cp -r "$runs/." "$RES/${runs##*/}_runs/"
                                          find "$RES/${runs##*/}_runs" -name 'checkpoint.*' -delete; pack; } ;;
    bg) if [[ -n ${DRY_RUN:-} ]]; then bash "$0" "$@"; break; fi
        if [[ -f $BG/pid ]] && kill -0 "$(cat "$BG/pid")" 2> /dev/null; then
          echo "bg: a background run is still going (pid $(cat "$BG/pid")): bg-finish it first"; exit 2
        fi
        rm -rf "$BG" && mkdir -p "$BG/out"
        (OUT=$BG/out BUDGET=${BG_BUDGET:-1100} BG_RUN=1 setsid bash "$0" "$@" > "$BG/log" 2>&1 < /dev/null &
         echo $! > "$BG/pid")
        while ((DEADLINE - SECONDS > 15)); do sleep 5; done
        [[ -d runs/gpu_ag_news ]] && tar czf "$OUT/cells_so_far.tgz" runs/gpu_ag_news
        collect 20
        break ;;
    bg-finish) [[ -n ${DRY_RUN:-} ]] && continue
               [[ -f $BG/pid ]] || { echo "bg-finish: no background run on this machine (\`bg STEP ...\` starts one; a" \
                                          "machine given back between the calls starts bare)"; exit 2; }
               sid=$(cat "$BG/pid")  # setsid made it a session leader: its pid is its session's id
               while kill -0 "$sid" 2> /dev/null && ((DEADLINE - SECONDS > 45)); do sleep 5; done
               # the step running now ends at its timeout's SIGTERM, passed on to it (the grid stops its
               # cells and writes its tables); the steps after it see the stop flag
               touch "$BG/stop"
               pkill -TERM -s "$sid" -x timeout
               for _ in {1..40}; do kill -0 "$sid" 2> /dev/null || break; sleep 1; done
               collect 30 ;;
    *) echo "unknown step $what"; exit 2 ;;
  esac
done
