#!/usr/bin/env bash
# Issue 7 on `nvidia-h200-x2` (2 x H200, NVLink), one device call (~9 min):
# ground truth at world 2 (one process per GPU, NCCL) against Prism capturing
# the same runs on 1 GPU (logical devices, the rewrite mode) and on 2 GPUs
# (each rank on its own GPU in the script's numbering: no remapping, no mode),
# predicted with the NCCL profile fitted on the 4-GPU H200 machine.
# GPT tp2, FSDP2 (never measured before), MoE dp2 ep2; traces kept.
#
#   bash bench/h200_x2_world2.sh
set -u
KEEP_RUNS=${KEEP_RUNS:-"gpt 150 1,2 gpt-tp2;fsdp2 170 1,2 fsdp2;moe 150 1,2 moe-dp2-ep2"} \
  bash bench/h200_final.sh
