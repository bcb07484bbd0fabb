# Sourced by the device scripts: the wheels carried in .whl/ (the server's, xgrammar, Pillow;
# `bash benchmarks/prefix_cache.sh --fetch-wheels`) installed into /tmp/site, then this tree
# first on PYTHONPATH.
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
