#!/usr/bin/env bash
# Fine-tune a Hugging Face checkpoint on a JSON-lines file with FSDP2, on every GPU of this machine.
#
#   bash examples/finetune.sh [MODEL] [DATA] [OUT] [more flags for ligermodels.train...]
#   bash examples/finetune.sh Qwen/Qwen2.5-0.5B data/train.jsonl runs/qwen --steps 2000
#
# DATA holds one {"text": ...} or {"prompt": ..., "completion": ...} object per line. Flags given
# after OUT override the ones below (the last occurrence wins). Run the same command again with
# --resume to continue from the newest checkpoint in OUT. OUT/final/ ends up an HF checkpoint.
# NGPU (default: all visible GPUs, or 1 process on the CPU) and PYTHON may be set in the environment.
set -euo pipefail

MODEL=${1:-Qwen/Qwen2.5-0.5B}
DATA=${2:-data/train.jsonl}
OUT=${3:-runs/finetune}
PYTHON=${PYTHON:-python}
NGPU=${NGPU:-$("$PYTHON" -c "import torch; print(max(1, torch.cuda.device_count()))")}

exec "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$NGPU" -m ligermodels.train \
    --model "$MODEL" --data "$DATA" --out "$OUT" \
    --seq-len 2048 --batch-size 4 --grad-accum 4 --steps 1000 \
    --lr 2e-5 --lr-schedule cosine --warmup-steps 50 --weight-decay 0.0 --max-grad-norm 1.0 \
    --ac selective --save-every 200 \
    "${@:4}"
