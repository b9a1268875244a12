# Sourced by the bench/h200_*.sh device scripts: installs the wheels carried in
# .whl/ (from ../shared/tools/device-wheels: trio, pyzmq, orjson, pytest-trio,
# which the device machine lacks) into /tmp/site, puts them and this checkout
# on PYTHONPATH, and defaults $OUT for running outside the device tool.
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || return 1
OUT=${OUT:-/tmp/prism-out}
