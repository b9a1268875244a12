# Sourced by bench/h200_x2_segments.sh and bench/h200_x2_timeline.sh: the
# accuracy bench's world-2 GPU commands (as bench/nccl_accuracy.py runs
# them), by name. `workload_args NAME` prints the command's words.
GPT="-m prism.workloads.gpt --hidden 1024 --layers 4 --heads 16 --seq-len 512 --batch 8 --micro-batches 2
     --vocab 4096 --device cuda --steps 8"
FSDP2="prism/workloads/frameworks/fsdp2.py --dim 512 --hidden 2048 --layers 4 --batch 4096 --steps 8"
workload_args() {
  case $1 in
    pp2) echo "$GPT --tp 1 --pp 2 --dp 1" ;;
    fsdp2) echo "$FSDP2" ;;
    gpt-tp2) echo "$GPT --tp 2 --pp 1 --dp 1" ;;
    moe) echo "$GPT --tp 1 --pp 1 --dp 2 --ep 2 --experts 4" ;;
    *) echo "unknown workload $1 (pp2, fsdp2, gpt-tp2, moe)" >&2; return 2 ;;
  esac
}
