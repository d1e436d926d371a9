#!/usr/bin/env bash
# The GPU session of docs/gpu/README.md, on a machine with one CUDA GPU (run from anywhere):
#
#   bash scripts/gpu_session.sh check   OUT_DIR   # machine, compiled-kernel checks, kernel tests compiled on
#                                                 # CUDA, kernel benchmark (bf16), a 2-layer end-to-end smoke
#   bash scripts/gpu_session.sh profile OUT_DIR   # plain transformers decode for scale, then the end-to-end
#                                                 # profile: Llama-3.1-8B shapes, random weights, fp16,
#                                                 # the rocketkv_fig7 preset on a smaller grid
#   bash scripts/gpu_session.sh breakdown OUT_DIR # wall vs GPU busy time of one decode step per method
#   bash scripts/gpu_session.sh compiled OUT_DIR  # the compiled decode step (scripts/gpu_compiled_decode.py, <= 8 min):
#                                                 # static-decode check with inductor, eager / compiled / stock
#                                                 # transformers ms/token vs the bandwidth floor, 32K and 128K
#   bash scripts/gpu_session.sh kernel  OUT_DIR   # the split-K decode attention (kvbench/kernels/flash_decode.py): its
#                                                 # tests compiled on CUDA, against inductor's masked attention,
#                                                 # flex_attention and SDPA; the selection methods' stable top-k
#                                                 # (kvbench/kernels/stable_topk.py) against PyTorch's; a compiled step's
#                                                 # top kernels (KERNEL_METHODS, default full,snapkv,quest,
#                                                 # exact_topk,sparq; <= 7 min)
#   bash scripts/gpu_session.sh selection OUT_DIR # issue 45 in one call (<= 9 min): the stable top-k's, group
#                                                 # scores' and split-K attention's tests compiled on CUDA,
#                                                 # bench_stable_topk (docs/gpu section 8's kernels),
#                                                 # bench_stacked_projections (section 8c), the
#                                                 # compiled phase with the selection methods first, then their
#                                                 # compiled step's top kernels (BREAKDOWN_METHODS, default
#                                                 # quest,sparq,exact_topk, in BREAKDOWN_LIMIT s, default 75)
#   bash scripts/gpu_session.sh batched OUT_DIR   # a sweep's 16 points of one 32K sample at Llama-3.1-8B shapes
#                                                 # (8 layers, bf16) one by one and batched, eager, and the first
#                                                 # 4 compiled one by one: ms per row-token vs the floor, and the
#                                                 # batch-invariance probe on this GPU (scripts/gpu_batched_decode.py,
#                                                 # <= 3 min)
#   bash scripts/gpu_session.sh big     OUT_DIR   # a model larger than one GPU in bf16 (scripts/gpu_big_model.py):
#                                                 # Llama-3.1-70B's shapes in NF4, random weights, the 70B config's
#                                                 # placement check, prefill + decode per method, memory per device
#   bash scripts/gpu_session.sh all     OUT_DIR
#
#   DEVICE=cpu bash scripts/gpu_session.sh compiled OUT_DIR   # the same phase at tiny shapes on a CPU (dynamo's
#                                                             # eager backend): tests/test_gpu_scripts.py
#
# kvbench must be importable: an editable install (`pip install -e .`), or wheels in WHEELS (default: the
# checkout's .whl/, if present: kvbench's own wheel plus transformers 5.23, hydra-core, omegaconf, antlr4 4.9.3)
# pip-installed into /tmp/site and put on PYTHONPATH. Commands run from a scratch directory, so the checkout's
# kvbench/ folder does not shadow the installed package.
# Each step has its own time limit; logs, records and a tarball of the profile results go to OUT_DIR.
# Override the profile grid with LENGTHS, METHODS, BUDGETS, REPEATS (see below); the compiled phase's flags with
# COMPILED_ARGS (appended: e.g. COMPILED_ARGS="--lengths 32768 --methods full,stock,quest"), its limits with
# COMPILED_LIMIT and COMPILED_DEADLINE.
set -uo pipefail
usage="usage: gpu_session.sh check|profile|breakdown|compiled|kernel|selection|batched|big|all OUT_DIR"
phase=${1:?$usage}
out=$(mkdir -p "${2:?$usage}" && cd "$2" && pwd)
repo=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 KVBENCH_CACHE=${KVBENCH_CACHE:-/tmp/kvbench-cache}
unset TRITON_INTERPRET
work=$(mktemp -d /tmp/kvbench-gpu.XXXX)
trap 'rm -rf "$work"' EXIT  # what a phase keeps goes to OUT_DIR (the profile's records as a tarball)
cd "$work" || exit 1

wheels=${WHEELS:-$repo/.whl}
if [ -d "$wheels" ] && ls "$wheels"/*.whl >/dev/null 2>&1; then
    $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        "$wheels"/*.whl || exit 1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
# no kvbench installed (no wheel of it in WHEELS): the checkout's own
$py -c "import kvbench" 2>/dev/null || export PYTHONPATH=$repo${PYTHONPATH:+:$PYTHONPATH}

step() {  # step NAME SECONDS COMMAND...: run with a time limit, log to OUT_DIR/NAME.log, report the status
    local name=$1 limit=$2
    shift 2
    echo "=== $name (limit ${limit}s): $*"
    local t0=$SECONDS
    timeout -k 30 "$limit" "$@" >"$out/$name.log" 2>&1
    local rc=$?
    echo "=== $name: exit $rc after $((SECONDS - t0))s"
    return $rc
}

# Llama-3.1-8B's shapes on the tiny_llama source (random weights built in code; the byte tokenizer's small
# vocabulary replaces the 128K one, so the LM head is negligible); rope scaling is left out (latency only)
llama8b=(model=tiny_llama model.name=llama3.1_8b_shapes_random model.device=${DEVICE:-cuda} model.dtype=float16
         model.config.hidden_size=4096 model.config.intermediate_size=14336
         model.config.num_attention_heads=32 model.config.num_key_value_heads=8 model.config.head_dim=128
         model.config.max_position_embeddings=131072 model.config.rope_theta=500000.0)

check() {
    {
        nvidia-smi
        nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem,power.limit --format=csv
        $py -c "import torch, triton, transformers, sys; p = torch.cuda.get_device_properties(0); \
print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, \
'transformers', transformers.__version__); print(p.name, 'sm', f'{p.major}.{p.minor}', p.multi_processor_count, 'SMs', \
round(p.total_memory / 2**30, 1), 'GiB')"
        nproc
    } 2>&1 | tee "$out/machine.log"
    # compiled kernels vs references: one process per dtype (Triton compiles on the CPU: three at a time),
    # and the unit tests compiled on CUDA alongside (pytest-xdist when installed)
    for dt in fp16 bf16 fp32; do
        step "check_$dt" 300 $py "$repo/scripts/gpu_check_kernels.py" --dtypes $dt &
    done
    xdist=()
    $py -c "import xdist" 2>/dev/null && xdist=(-n 6)
    KVBENCH_KERNEL_DEVICE=cuda TRITON_INTERPRET=0 step tests_cuda 300 $py -m pytest -q -p no:cacheprovider \
        --rootdir "$repo" -c "$repo/pyproject.toml" "${xdist[@]}" "$repo/tests/test_kernels.py" &
    wait
    for dt in fp16 bf16 fp32; do sed -n '/^kernel  /,$p' "$out/check_$dt.log"; done
    tail -n 5 "$out/tests_cuda.log"
    # timings alone on the GPU
    step bench_kernels 150 $py "$repo/scripts/bench_kernels.py" --dtype bf16
    cat "$out/bench_kernels.log"
    # end-to-end smoke: two layers of the 8B shapes, every profiled method once, 4K tokens
    step e2e_smoke 130 $py -m kvbench.profile -m experiment=rocketkv_fig7 "${llama8b[@]}" \
        model.config.num_hidden_layers=2 task.seq_len="${SMOKE_LENGTH:-4096}" task.max_new_tokens=16 budget=256 \
        method=full,rocketkv,snapkv,quest,exact_topk,adakv,sparq profiler.repeats=1 profiler.warmup_steps=2 \
        hydra/launcher=basic results_dir="$work/smoke"
    grep -E "^(Results|  *model|.*synthetic)|rror" "$out/e2e_smoke.log" | tail -n 20
}

profile() {
    # the plain transformers model's decode (no kvbench in the loop), for scale
    step decode_floor 120 $py "$repo/scripts/gpu_decode_floor.py" --lengths "${LENGTHS:-16384,32768}"
    cat "$out/decode_floor.log"
    # gpu_profile.py = python -m kvbench.profile, building the random model on the GPU (seconds, not minutes)
    step e2e_profile "${PROFILE_LIMIT:-420}" $py "$repo/scripts/gpu_profile.py" -m experiment=rocketkv_fig7 \
        "${llama8b[@]}" model.config.num_hidden_layers="${LAYERS:-32}" \
        task.seq_len="${LENGTHS:-16384,32768}" budget="${BUDGETS:-256,1024,4096}" \
        method="${METHODS:-full,quest,exact_topk,adakv,sparq,snapkv,rocketkv}" \
        profiler.repeats="${REPEATS:-2}" hydra/launcher=basic results_dir="$work/profile"
    rc=$?
    tar -C "$work" -czf "$out/profile_records.tgz" profile 2>/dev/null
    grep -E "^(Results|  *model|.*synthetic)|rror|Killed|loading model" "$out/e2e_profile.log" | tail -n 60
    return $rc
}

breakdown() {  # wall vs GPU kernel time of a decode step, per method (torch.profiler)
    step decode_breakdown 240 $py "$repo/scripts/gpu_decode_breakdown.py" --length "${BREAKDOWN_LENGTH:-16384}" \
        --budget "${BREAKDOWN_BUDGET:-1024}"
    grep -v USDT "$out/decode_breakdown.log"
    # the same without cuDNN's SDPA backend (the dense decode path's SDPA call)
    step decode_breakdown_nocudnn 240 $py "$repo/scripts/gpu_decode_breakdown.py" --no-cudnn-sdpa \
        --length "${BREAKDOWN_LENGTH:-16384}" --budget "${BREAKDOWN_BUDGET:-1024}"
    grep -v USDT "$out/decode_breakdown_nocudnn.log"
}

compiled() {  # the compiled decode step: (a) static-decode check, (b) ms/token vs floor and stock, (c) compile s
    local sizes=()
    if [ "${DEVICE:-cuda}" = cpu ]; then  # the shell and script logic at tiny shapes, dynamo's eager backend
        sizes=(--device cpu --dtype float32 --layers 1 --hidden 64 --intermediate 128 --heads 4 --kv-heads 2
               --head-dim 16 --lengths 256,320 --methods full,stock,snapkv,quest --methods-at 320=full,stock
               --budget 32 --steps 3 --warmup 2 --backend eager --check-models tiny_llama
               --check-methods full,snapkv --check-steps 4 --check-length 200 --check-shards 2)
    fi
    # shellcheck disable=SC2086 # COMPILED_ARGS: flags, split on spaces
    step compiled_decode "${COMPILED_LIMIT:-480}" $py "$repo/scripts/gpu_compiled_decode.py" "${sizes[@]}" \
        --deadline-s "${COMPILED_DEADLINE:-420}" --csv "$out/compiled_decode.csv" ${COMPILED_ARGS:-}
    local rc=$?
    grep -v -E "^USDT|Online softmax is disabled" "$out/compiled_decode.log"
    return $rc
}

batched() {  # a sweep's points decoded one by one and as one batch, and the batch-invariance probe (<= 3 min)
    local sizes=()
    if [ "${DEVICE:-cuda}" = cpu ]; then  # the shell and script logic at tiny shapes, dynamo's eager backend
        sizes=(--device cpu --dtype float32 --layers 1 --hidden 64 --intermediate 128 --heads 4 --kv-heads 2
               --head-dim 16 --length 256 --budgets 32,64 --extra "" --steps 3 --warmup 2 --compiled 2
               --backend eager)
    fi
    # shellcheck disable=SC2086 # BATCHED_ARGS: flags, split on spaces
    step batched_decode "${BATCHED_LIMIT:-180}" $py "$repo/scripts/gpu_batched_decode.py" "${sizes[@]}" \
        --csv "$out/batched_decode.csv" ${BATCHED_ARGS:-}
    local rc=$?
    grep -v -E "^USDT|Online softmax is disabled" "$out/batched_decode.log"
    return $rc
}

# the stable top-k bench and the compiled step's breakdown at tiny shapes on a CPU (the kernels interpreted):
# the `kernel` and `selection` phases' CPU smoke runs
cpu_topk=(--device cpu --lengths 300 --kv-heads 2 --group 2 --budget 32 --calls 2 --repeats 2)
cpu_stacked=(--device cpu --layers 2 --hidden 64 --intermediate 128 --heads 4 --kv-heads 2 --head-dim 16 --repeats 2)
cpu_breakdown=(--device cpu --layers 1 --hidden 64 --intermediate 128 --heads 4 --kv-heads 2 --head-dim 16
               --length 64 --budget 16 --dtype float32 --backend eager --warmup 2 --steps 2 --profiled 1)

decode_kernel() {  # the split-K decode attention and the stable top-k on this GPU, where a compiled step's time goes (<= 7 min)
    local tiny=() bench=() prof=() topk=()
    if [ "${DEVICE:-cuda}" = cpu ]; then  # the shell and script logic at tiny shapes (the kernels interpreted)
        bench=(--device cpu --lengths 200 --kv-heads 2 --head-dim 16 --layers 2 --repeats 2 --selected 24)
        topk=("${cpu_topk[@]}")
        prof=("${cpu_breakdown[@]}")
    else  # correctness first, side by side (no timing runs meanwhile): the kernel's unit tests compiled on this
        # GPU; the graph lint against Triton's own verdicts; the compile fallback on this machine's torch
        local xdist=()
        $py -c "import xdist" 2>/dev/null && xdist=(-n 4)
        KVBENCH_KERNEL_DEVICE=cuda TRITON_INTERPRET=0 step flash_decode_tests 100 $py -m pytest -q -p no:cacheprovider \
            --rootdir "$repo" -c "$repo/pyproject.toml" "${xdist[@]}" "$repo/tests/test_kernels.py" -k "flash_decode or stable_topk or group_scores or distinct_rows" &
        (cd "$repo" && step probe_triton_lint 100 $py scripts/probe_triton_lint.py) &
        (cd "$repo" && step compile_fallback_tests 100 $py -m pytest -q -p no:cacheprovider tests/test_compile_fallback.py) &
        wait
        tail -n 3 "$out/flash_decode_tests.log" "$out/compile_fallback_tests.log"
        grep -E "^(torch|CASE|  lint|  inductor|OLD-KEYS|WARNING-LINE)" "$out/probe_triton_lint.log"
        tiny=(--layers 8 --length "${KERNEL_LENGTH:-32768}" --budget 1024 --dtype bfloat16 --warmup 4 --steps 10
              --profiled 5)
        bench=(--selected 1024)  # a 1K-token selection per KV group beside the dense ways
    fi
    # flash_decode vs inductor's masked attention vs flex_attention vs SDPA over exactly the held rows; a
    # selection's slots by the indexed operator vs inductor's gathered fp32 products
    (cd "$repo/scripts" && step bench_flash_decode 100 $py bench_flash_decode.py "${bench[@]}")
    grep -v -E "^USDT|Online softmax" "$out/bench_flash_decode.log"
    # the selection methods' stable top-k: the Triton operator vs PyTorch's int64 top-k, eager and by inductor
    (cd "$repo/scripts" && step bench_stable_topk 120 $py bench_stable_topk.py "${topk[@]}")
    grep -v -E "^USDT" "$out/bench_stable_topk.log"
    # the compiled step's kernels, by GPU time: what remains outside attention, and what a selection costs
    (cd "$repo/scripts" && step kernel_breakdown 200 $py gpu_decode_breakdown.py --compile --top 14 \
        --methods "${KERNEL_METHODS:-full,snapkv,quest,exact_topk,sparq}" "${tiny[@]}" "${prof[@]}")
    grep -v -E "^USDT|Online softmax" "$out/kernel_breakdown.log"
}

selection() {  # what issue 45 still needs a GPU for, in one call of at most 9 minutes, most needed first
    local topk=() prof=() stacked=()
    if [ "${DEVICE:-cuda}" = cpu ]; then  # the shell logic at tiny shapes (the kernels interpreted)
        topk=("${cpu_topk[@]}")
        prof=("${cpu_breakdown[@]}")
        stacked=("${cpu_stacked[@]}")
    else  # the operators the selection methods' compiled step runs, their unit tests compiled on this GPU
        local xdist=()
        $py -c "import xdist" 2>/dev/null && xdist=(-n 8)
        KVBENCH_KERNEL_DEVICE=cuda TRITON_INTERPRET=0 step selection_kernel_tests 90 $py -m pytest -q \
            -p no:cacheprovider --rootdir "$repo" -c "$repo/pyproject.toml" "${xdist[@]}" "$repo/tests/test_kernels.py" \
            -k "flash_decode or stable_topk or group_scores or distinct_rows"
        tail -n 3 "$out/selection_kernel_tests.log"
        topk=(--repeats 10)
        prof=(--layers 8 --length 32768 --budget 1024 --dtype bfloat16 --warmup 4 --steps 6 --profiled 3)
    fi
    (cd "$repo/scripts" && step bench_stable_topk 80 $py bench_stable_topk.py "${topk[@]}")
    grep -v -E "^USDT" "$out/bench_stable_topk.log"
    # every method's weight products: the projections of one input separate (stock) or stacked (kvbench on CUDA)
    (cd "$repo/scripts" && step bench_stacked_projections 30 $py bench_stacked_projections.py "${stacked[@]}")
    grep -v -E "^USDT" "$out/bench_stacked_projections.log"
    if [ "${DEVICE:-cuda}" != cpu ]; then  # selection methods first: the deadline skips the rest
        COMPILED_LIMIT=${COMPILED_LIMIT:-320} COMPILED_DEADLINE=${COMPILED_DEADLINE:-280} \
        COMPILED_ARGS="--methods full,quest,rocketkv,sparq,hsa,exact_topk,snapkv,stock,adakv
                       --methods-at 131072=full,quest,snapkv,stock --rounds ${ROUNDS:-3} ${COMPILED_ARGS:-}" compiled
    fi
    (cd "$repo/scripts" && step kernel_breakdown "${BREAKDOWN_LIMIT:-75}" $py gpu_decode_breakdown.py --compile --top 12 \
        --methods "${BREAKDOWN_METHODS:-quest,sparq,exact_topk}" "${prof[@]}")
    grep -v -E "^USDT|Online softmax" "$out/kernel_breakdown.log"
}

big_model() {  # issue 47: the 70B config's check, then Llama-3.1-70B's shapes in 4-bit on this GPU (<= 4 min)
    local sizes=()
    if [ "${DEVICE:-cuda}" = cpu ]; then  # the script's logic at tiny shapes (bitsandbytes' CPU backend)
        sizes=(--device cpu --layers 4 --hidden 64 --intermediate 128 --heads 4 --kv-heads 2 --head-dim 16
               --vocab 260 --length 96 --budget 32 --filter-layers 1 --steps 3 --no-config-check)
    fi
    # shellcheck disable=SC2086 # BIG_ARGS: flags, split on spaces
    step big_model "${BIG_LIMIT:-240}" $py "$repo/scripts/gpu_big_model.py" "${sizes[@]}" ${BIG_ARGS:-}
    local rc=$?
    grep -v -E "^USDT" "$out/big_model.log"
    return $rc
}

case $phase in
    big) big_model ;;
    kernel) decode_kernel ;;
    selection) selection ;;
    batched) batched ;;
    check) check ;;
    profile) profile ;;
    breakdown) breakdown ;;
    compiled) compiled ;;
    all) check; profile; breakdown; compiled; decode_kernel; big_model ;;
    *) echo "unknown phase $phase; $usage" >&2; exit 2 ;;
esac
