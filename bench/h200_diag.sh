#!/usr/bin/env bash
# Issue 7, second call of 2026-11-29 on `nvidia-h200-x4`: keep the Prism
# captures' traces for study, one run each: FSDP2 (never run before) and MoE on
# 2 GPUs, GPT tp2 dp2 on 1 GPU, with the NCCL profile fitted in the first call.
# (At the time the code calibrated steps 1-2 and GPUs were not taken in turns.)
#
#   bash bench/h200_diag.sh
KEEP_RUNS="fsdp2 150 2 fsdp2;gpt1 120 1 gpt-tp2-dp2;moe2 140 2 moe-tp2-dp2-ep2" exec bash bench/h200_final.sh
