set -u; export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PRISM_PROFILE_DIR=$OUT/profiles
( CUDA_VISIBLE_DEVICES= taskset -c 16-31 timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_frameworks.py -k "pipeline or api_tour or premul" > $OUT/frameworks-torch2.11-rerun.txt 2>&1; echo "exit $?" >> $OUT/frameworks-torch2.11-rerun.txt ) &
taskset -c 0-15 timeout 170 python3 bench/nccl_diag.py --config gpt-tp2 --net bench/results/nccl-h200x2-profile.toml --out-dir $OUT 2>&1 | tail -45
taskset -c 0-15 timeout 380 python3 bench/gpu_capture.py --out-dir $OUT --only gpt8 --gangs tpxpp,1 --gpus 0 --runs-dir /tmp/gb 2>&1 | tail -14
wait; tail -5 $OUT/frameworks-torch2.11-rerun.txt
