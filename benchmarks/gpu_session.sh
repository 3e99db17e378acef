#!/usr/bin/env bash
# One session on a GPU machine without network (issue 50; ../shared/GPU.md): install the carried
# wheels and the project, then, each under its own time cap, in the order of their value:
#   1. the trainer at GPT-2 size: baseline, profile, kernels alone, attention and micro-batch
#      variants (benchmarks/bench_gpu_mfu.py)
#   2. the GPU tests (make gpu-test's command, with this machine's python3)
#   3. more variants while the budget lasts
# Everything goes to $OUT (at most 8 files): log (this output, when run under `| tee $OUT/log`),
# probe.txt, results.json, summary.md, children.log, trace_base.json.gz, trace_best.json.gz, gpu_test.log.
#
#   set -o pipefail; bash benchmarks/gpu_session.sh 2>&1 | tee $OUT/log
#
# Carried beside the tree (git-ignored): .gpuwork/whl/*.whl (pydantic and the other packages the
# machine lacks, for Python 3.12) and .gpuwork/data/{valid,test}.txt (WikiText-2).
# GPU_SESSION_END_S (default 530): seconds after the start by which everything has ended.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:?set OUT}
END_S=${GPU_SESSION_END_S:-530}
T0=$(date +%s)
left() { echo $(( END_S - ($(date +%s) - T0) )); }
stamp() { echo "=== [$(( $(date +%s) - T0 )) s] $*"; }

stamp "setup"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .gpuwork/whl/*.whl || stamp "WHEELS FAILED"
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || { stamp "EDITABLE INSTALL FAILED: PYTHONPATH"; export PYTHONPATH=$PWD; }
# tests/conftest.py reads the text from ../shared/data/wikitext-2, beside the checkout
mkdir -p ../shared/data/wikitext-2 && cp .gpuwork/data/*.txt ../shared/data/wikitext-2/
TEXT=(.gpuwork/data/valid.txt .gpuwork/data/test.txt)

stamp "probe"
{
  date -u +%FT%TZ
  nvidia-smi
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,power.limit,temperature.gpu,persistence_mode --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version(), 'nccl', torch.cuda.nccl.version(), 'triton', triton.__version__, torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).multi_processor_count, 'SMs')"
  python3 -m pip list 2>/dev/null | grep -i -E "^(torch|triton|pydantic|numpy|tokenizers) "
  timeout 60 python3 -m launcher.cli.main probe --json
} > "$OUT/probe.txt" 2>&1
tail -n 3 "$OUT/probe.txt"

BENCH=(python3 benchmarks/bench_gpu_mfu.py all --out "$OUT" --text-files "${TEXT[@]}")

# 1. before the tests: the baseline (the trainer before issue 50: torch's attention order,
#    micro-batch 16) with its profile, the kernels alone, the trainer's new default (cuDNN attention
#    first) at micro-batch 16 and 32.
B1=$(( $(left) - 180 ))  # what the tests may need is kept back
stamp "MFU phase 1 (budget ${B1} s)"
timeout $(( B1 + 20 )) "${BENCH[@]}" --budget-s "$B1" --micro --micro-after 1 \
  --variants b16:mb=16,attn=torch cudnn16:mb=16,attn=cudnn cudnn32:mb=32,attn=cudnn

# 2. the GPU tests
T=$(( $(left) - 10 )); T=$(( T > 170 ? 170 : T ))
stamp "gpu-test (cap ${T} s)"
GPTLAUNCH_GPU_TESTS=1 timeout "$T" python3 -m pytest -q -p no:cacheprovider tests/gpu > "$OUT/gpu_test.log" 2>&1
stamp "gpu-test exit $?"
tail -n 15 "$OUT/gpu_test.log"

# 3. more variants while the budget lasts (each needs 40 s left to start; max-autotune 170 s)
B2=$(( $(left) - 5 ))
stamp "MFU phase 2 (budget ${B2} s)"
[ "$B2" -gt 40 ] && timeout $(( B2 + 5 )) "${BENCH[@]}" --budget-s "$B2" --run-timeout-s 140 \
  --variants nosync32:mb=32,attn=best,sync=log accum32x4:mb=32,attn=best,accum=4 \
  mb64:mb=64,attn=best b32:mb=32,attn=torch \
  autotune32:mb=32,attn=best,mode=max-autotune-no-cudagraphs,need=170
stamp "done"
